"""Snakes and Ladders (seed 001) Tables 2-4 as step-time experiments: every number is the time of the
engine's own decode step (``ssmspec.engine.Engine``, the captured step generate() replays), through
``bench/steps.py``: an engine started at ``bench.context`` tokens with random drafts of the spec's shape.

- ``snl_tab2_ablation`` (Table 2): joint_attainment at D drafts x S, each ``scan`` (fused multi-step
  kernel | chunk scan, the paper's baseline | loop of single-token launches) x ``jit_copy`` (copy inside
  the captured step | the paper's eager copy, host-launched per layer after the step).
- ``snl_tab3_verify`` (Table 3): ms per step vs drafts x S for activation_replay and joint_attainment.
- ``snl_tab4_scaling`` (Table 4): step time and memory vs model size at one D x S.

Every speculative row carries ``ar_ms_p50`` (the autoregressive step of the same model, measured first in
the same run) and ``overhead`` = ms_p50 / ar_ms_p50: the cost of one speculative step relative to one
ordinary token (the paper's "1.47x the cost of one" and "1.98x -> 1.22x"). A step's time does not depend on
the draft tokens (every shape is fixed), so random drafts time it faithfully; rows record the accepted
counts they saw (``acceptance: random-drafts``). Memory: ``cache_bytes`` (strategy state + KV caches),
``weights_bytes`` and, on CUDA, ``peak_allocated_bytes``: the allocator's peak from building the engine to
the last timed step, weights included (the paper's "memory footprint"); None on CPU.

Every preset is checked against the free memory (weights + the largest engine of the grid) before the
first model is built (``engine/memory.py``).
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.inputs import track
from ssmspec.bench.steps import step_engine, step_row
from ssmspec.engine.memory import check_fits, plan_bytes
from ssmspec.models.config import load_preset
from ssmspec.strategies import SpecConfig, make_strategy

log = logging.getLogger("ssmspec.bench.steps_snl")

SPEC_STRATEGIES = ("activation_replay", "joint_attainment")
SCANS = ("fused", "chunk", "loop")
# seed 001 Table 2's four rows as (scan, jit_copy); the loop rows are this project's extra baseline
PAPER_TAB2 = {("chunk", False): "Joint attainment", ("fused", False): "+ Fused-SSU",
              ("chunk", True): "+ JIT-state-copy", ("fused", True): "+ both"}


def _ints(b: DictConfig, key: str, *, minimum: int) -> list[int]:
    vals = b.get(key)
    if vals is None or isinstance(vals, (str, bool)) or not hasattr(vals, "__iter__"):
        raise ValueError(f"bench.{key} must be a list of integers, got {vals!r}")
    out = [int(v) for v in vals]
    if not out or min(out) < minimum:
        raise ValueError(f"bench.{key} needs integers >= {minimum}, got {out}")
    return out


def _settings(cfg: DictConfig) -> dict:
    """The shared knobs of the three tables, checked."""
    b = cfg.bench
    presets = [None] if cfg.get("checkpoint") else list(b.get("presets") or [])
    if not presets:
        raise ValueError("bench.presets is empty; name at least one model preset (e.g. bench.presets=[mamba2-2.7b])")
    batch, context = int(b.get("batch", 1)), int(b.get("context", 128))
    if batch < 1 or context < 1:
        raise ValueError(f"bench.batch and bench.context must be >= 1, got {batch} and {context}")
    return {"presets": presets, "batch": batch, "context": context, "warmup": int(b.warmup), "iters": int(b.iters),
            "graph": C.use_cuda_graph(b.get("cuda_graph", "auto"), str(cfg.device))}


def _strategies(b: DictConfig) -> list[str]:
    names = list(b.get("strategies") or [])
    bad = sorted(set(names) - set(SPEC_STRATEGIES))
    if not names or bad:
        raise ValueError(f"bench.strategies takes {', '.join(SPEC_STRATEGIES)}, got {names}")
    return names


def _spec(drafts: int, S: int) -> SpecConfig:
    return SpecConfig(draft_len=S, num_drafts=drafts) if S else SpecConfig()


def check_grid_fits(cfg: DictConfig, presets: list, *, batch: int, context: int, steps: int,
                    specs: list[SpecConfig]) -> None:
    """Refuse, before any model exists, a preset whose weights + largest engine of the grid cannot fit."""
    dtype = C.resolve_dtype(str(cfg.dtype), str(cfg.device))
    elt = torch.empty((), dtype=dtype).element_size()
    for preset in presets:
        mcfg = C.model_config(cfg) if preset is None else load_preset(preset)
        weights = mcfg.num_parameters() * elt
        for name in SPEC_STRATEGIES:
            for spec in specs:
                strat = make_strategy(name)
                parts = {"weights": weights, **plan_bytes(mcfg, strat, batch=batch, spec=spec, dtype=dtype,
                                                          kv_capacity=context + steps * (spec.draft_len + 1)
                                                          + spec.nodes + 1, prefill_len=context, prefill=False)}
                check_fits(parts, cfg.device, what=f"{mcfg.name} with {name} at batch {batch}, {spec.num_drafts} "
                           f"drafts x S={spec.draft_len}", fix="drop the preset from bench.presets or lower bench.batch")


class _Models:
    """One model at a time: the previous one is freed before the next is built (13b bf16 is 26 GB). Callers
    pass ``get(preset)`` straight on and keep no reference of their own, so the old model can go."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg, self.model, self.preset = cfg, None, object()

    def get(self, preset):
        if preset != self.preset:
            self.model = None
            gc.collect()
            if str(self.cfg.device).startswith("cuda"):
                torch.cuda.empty_cache()
            self.model = C.make_model(self.cfg, preset=preset)
            self.preset = preset
        return self.model


def time_step(model, strategy, *, drafts: int, S: int, s: dict, **fields) -> dict:
    """One engine (``strategy`` at D x S), timed: its tidy row plus model, memory and the options."""
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(model.device)
    spec = _spec(drafts, S)
    eng = step_engine(model, strategy=strategy, batch=s["batch"], context=s["context"], spec=spec, graph=s["graph"],
                      steps=s["warmup"] + s["iters"] + 2)
    row = step_row(eng, warmup=s["warmup"], iters=s["iters"], model=model.cfg.name,
                   params=model.cfg.num_parameters(), context=s["context"], dtype=C.dtype_name(model.dtype),
                   **getattr(eng.strategy, "options", {}), **fields)
    row["weights_bytes"] = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(model.device) if cuda else None
    row["status"] = "ok"
    del eng
    if cuda:  # give the engine (and its graphs' pool) back to the driver before the next one's check and peak
        gc.collect()
        torch.cuda.empty_cache()
    return row


def _with_ar(row: dict, ar: dict) -> dict:
    row["ar_ms_p50"] = ar["ms_p50"]
    row["overhead"] = row["ms_p50"] / ar["ms_p50"]
    if row.get("peak_allocated_bytes") and ar.get("peak_allocated_bytes"):
        row["memory_ratio"] = row["peak_allocated_bytes"] / ar["peak_allocated_bytes"]
    return row


def _ar_row(model, s: dict) -> dict:
    row = time_step(model, "autoregressive", drafts=0, S=0, s=s)
    row.update(ar_ms_p50=row["ms_p50"], overhead=1.0, memory_ratio=1.0 if row["peak_allocated_bytes"] else None)
    return row


def run_snl_tab2(cfg: DictConfig) -> Iterator[dict]:
    """Table 2: joint_attainment's step at D x S for every (scan, jit_copy) of the grid, and autoregressive."""
    b, s = cfg.bench, _settings(cfg)
    scans = [str(x) for x in b.scans]
    bad = sorted(set(scans) - set(SCANS))
    if not scans or bad:
        raise ValueError(f"bench.scans takes {', '.join(SCANS)}, got {scans}")
    copies = [bool(x) for x in b.jit_copy]
    drafts, S = int(b.drafts), int(b.S)
    if drafts < 1 or S < 1:
        raise ValueError(f"bench.drafts and bench.S must be >= 1, got {drafts} and {S}")
    check_grid_fits(cfg, s["presets"], batch=s["batch"], context=s["context"], steps=s["warmup"] + s["iters"] + 2,
                    specs=[_spec(drafts, S)])
    models = _Models(cfg)
    points = [(p, sc, jc) for p in s["presets"] for sc in [None, *scans] for jc in ([None] if sc is None else copies)]
    ar = None
    for preset, scan, jit in track(points, desc="snl_tab2", total=len(points)):
        if scan is None:
            ar = _ar_row(models.get(preset), s)
            yield {**ar, "variant": "autoregressive", "paper_row": "Mamba-2 (no speculation)"}
            continue
        strat = make_strategy("joint_attainment", scan=scan, jit_copy=jit)
        row = time_step(models.get(preset), strat, drafts=drafts, S=S, s=s,
                        variant=f"{scan} scan, {'JIT' if jit else 'eager'} copy", paper_row=PAPER_TAB2.get((scan, jit)))
        yield _with_ar(row, ar)


def run_snl_tab3(cfg: DictConfig) -> Iterator[dict]:
    """Table 3: ms per step vs drafts x S for each strategy, and autoregressive (S = 0), per preset."""
    b, s = cfg.bench, _settings(cfg)
    names = _strategies(b)
    D, S = _ints(b, "drafts", minimum=1), _ints(b, "S", minimum=1)
    check_grid_fits(cfg, s["presets"], batch=s["batch"], context=s["context"], steps=s["warmup"] + s["iters"] + 2,
                    specs=[_spec(max(D), max(S))])
    models = _Models(cfg)
    points = [pt for p in s["presets"] for pt in [(p, None, 0, 0)] + [(p, n, d, k) for d in D for k in S for n in names]]
    ar = None
    for preset, name, d, k in track(points, desc="snl_tab3", total=len(points)):
        if name is None:
            ar = _ar_row(models.get(preset), s)
            yield ar
        else:
            yield _with_ar(time_step(models.get(preset), name, drafts=d, S=k, s=s), ar)


def run_snl_tab4(cfg: DictConfig) -> Iterator[dict]:
    """Table 4: step time and memory vs model size at D x S, each strategy against autoregressive."""
    b, s = cfg.bench, _settings(cfg)
    names = _strategies(b)
    drafts, S = int(b.drafts), int(b.S)
    if drafts < 1 or S < 1:
        raise ValueError(f"bench.drafts and bench.S must be >= 1, got {drafts} and {S}")
    check_grid_fits(cfg, s["presets"], batch=s["batch"], context=s["context"], steps=s["warmup"] + s["iters"] + 2,
                    specs=[_spec(drafts, S)])
    models = _Models(cfg)
    points = [(p, n) for p in s["presets"] for n in [None, *names]]
    ar = None
    for preset, name in track(points, desc="snl_tab4", total=len(points)):
        if name is None:
            ar = _ar_row(models.get(preset), s)
            yield ar
        else:
            yield _with_ar(time_step(models.get(preset), name, drafts=drafts, S=S, s=s), ar)
