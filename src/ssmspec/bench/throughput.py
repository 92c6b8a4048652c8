"""Experiment ``throughput_ar``: prefill and decode throughput of model presets with the autoregressive loop.

For every preset, batch B and context length T (the ``bench`` grid of conf/experiment/throughput_ar.yaml):

- prefill: the engine's prefill (``DecodeStep.prefill``, what generate() runs first): one model call over
  B synthetic prompts of T tokens that sets every SSM / conv state and KV cache, and picks the first
  token from the last position's logits (the LM head at the last position only). Timed eager with CUDA
  events (one call is long; a graph adds nothing). tokens_per_s = B * T / time.
- decode: one step of the engine (``ssmspec.engine.Engine``, the loop generate() runs) without drafts:
  strategy layout -> model call on the B pending tokens (full LM head) -> greedy pick -> strategy commit
  and KV-cache append -> token buffer append and flags. The caches start as if T tokens had been
  prefilled: KV lengths are T (contents random: a step's time does not depend on the values), SSM / conv
  states zero. On CUDA the engine captures its step once as a CUDA graph and replays it; each replay is a
  real step (caches grow by one token). tokens_per_s = B / time.

Every grid point is checked against the free memory before any model is built (``engine/memory.py``).

Rows: model, params, strategy, phase, batch, context, tokens (per timed call), dtype, timing
(cuda_graph | eager), samples_ms and its summary (ms_p50 ...), tokens_per_s (from the median), status
(ok | oom | skipped), impl (ssmspec | transformers); decode rows on CUDA add bytes_min (weights + SSM/conv
state read and written + the KV cache read once), hbm_fraction = bytes_min / time / measured copy
bandwidth, and x_weight_floor = time / the time it takes to read the weights once (weight_floor_ms).
CUDA decode rows at the grid's smallest context also carry ``kernels_per_step`` (GPU kernels one step launches,
the same at every context, from 3 profiled steps after the timed ones: ``bench/kernel_profile.py``) and, at the batches of ``bench.profile_batches``, ``kernel_table``: per
kernel its launches, device microseconds and share of one step (where the step's time goes).
``bench.transformers_batch`` adds decode rows of transformers' generate() on the same architecture and
random weights (``bench/hf_baseline.py``), the user's alternative.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.inputs import synthetic_prompts, track
from ssmspec.bench.kernel_profile import profile_steps
from ssmspec.bench.timing import hbm_fraction, measure_hbm_bandwidth, summarize, time_eager, wall_check
from ssmspec.engine import Engine
from ssmspec.engine.memory import check_fits, plan_bytes
from ssmspec.models.config import load_preset
from ssmspec.strategies import SpecConfig

log = logging.getLogger("ssmspec.bench.throughput")


def prefill_engine(model, strategy, ids: torch.Tensor) -> Engine:
    """The engine whose ``step.prefill`` is timed: one model call over the B prompts of T tokens that sets
    every SSM / conv state and KV cache and picks the first token (LM head at the last position only)."""
    bsz, T = ids.shape
    return Engine(model, batch=bsz, prefill_len=T, max_new_tokens=1, strategy=strategy, cuda_graph=False)


def decode_engine(model, strategy, pending: torch.Tensor, context: int, steps: int, *, graph: bool):
    """The engine of standard decoding at batch len(pending), started as if ``context`` tokens had been
    prefilled, with room for ``steps`` more; and the fewest bytes one step must move (weights, SSM / conv
    state read and written, the KV cache read once)."""
    mcfg = model.cfg
    bsz = pending.shape[0]
    eng = Engine(model, batch=bsz, prefill_len=context, max_new_tokens=steps, strategy=strategy, cuda_graph=graph,
                 prefill=False)
    eng.start_synthetic(context, pending)
    st = eng.strategy
    bytes_min = (sum(p.numel() * p.element_size() for p in model.parameters())
                 + 2 * sum(t.numel() * t.element_size() for t in (st.ssm_state, st.conv_state))
                 + sum(2 * bsz * mcfg.n_kv_heads * context * mcfg.attn_head_dim * c.k.element_size()
                       for c in eng.step.kv))
    return eng, bytes_min


def check_grid_fits(cfg: DictConfig, presets: list, grid: list, device: str, max_prefill_tokens: int = 0) -> None:
    """Refuse, before any model is built, a grid point whose weights + caches + activations cannot fit (prefill
    points above ``max_prefill_tokens`` are skipped, not run, so they are not checked)."""
    dtype = C.resolve_dtype(str(cfg.dtype), device)
    elt = torch.empty((), dtype=dtype).element_size()
    strategy = C.build_strategy(cfg)
    for preset in presets:
        mcfg = C.model_config(cfg) if preset is None else load_preset(preset)
        weights = mcfg.num_parameters() * elt
        for phase, bsz, T in grid:
            if phase == "prefill" and max_prefill_tokens and bsz * T > max_prefill_tokens:
                continue
            steps = 64
            parts = {"weights": weights, **plan_bytes(mcfg, strategy, batch=bsz, spec=SpecConfig(),
                                                      kv_capacity=T + steps + 1, prefill_len=T, dtype=dtype,
                                                      prefill=phase == "prefill")}
            check_fits(parts, device, what=f"{mcfg.name} {phase} at batch {bsz}, context {T}",
                       fix="lower bench.batch or bench.context")


def _grid(b: DictConfig) -> list[tuple[str, int, int]]:
    phases = list(b.get("phases", ["prefill", "decode"]))
    bad = sorted(set(phases) - {"prefill", "decode"})
    if bad:
        raise ValueError(f"bench.phases may hold prefill and decode, got {bad}")
    batches, contexts = [int(x) for x in b.batch], [int(x) for x in b.context]
    if not batches or not contexts or min(batches + contexts) < 1:
        raise ValueError(f"bench.batch and bench.context need positive sizes, got {batches} and {contexts}")
    return [(ph, bs, T) for ph in phases for bs in batches for T in contexts]


def run_throughput(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``throughput_ar`` (experiment contract): yields one row per grid point."""
    b = cfg.bench
    device = str(cfg.device)
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    warmup, iters = int(b.warmup), int(b.iters)
    pre_warmup, pre_iters = int(b.get("prefill_warmup") or warmup), int(b.get("prefill_iters") or iters)
    max_tokens = int(b.get("max_prefill_tokens") or 0)
    grid = _grid(b)
    presets = [None] if cfg.get("checkpoint") else list(b.get("presets") or [cfg.model.name])
    peak = measure_hbm_bandwidth() if device.startswith("cuda") else None
    strategy = C.build_strategy(cfg)
    if strategy.speculative:
        raise ValueError(f"throughput_ar times standard decoding; strategy {strategy.name!r} speculates. Use "
                         f"strategy=autoregressive (or a strategy with speculative=False)")
    check_grid_fits(cfg, presets, grid, device, max_tokens)
    points = [(p, *g) for p in presets for g in grid]
    model, current = None, object()
    for preset, phase, bsz, T in track(points, desc="throughput", total=len(points)):
        if preset != current:
            model = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            # KV room for the longest context plus the timed steps (a preset's max_seq_len may equal a grid context)
            need = max(T for _, _, T in grid) + warmup + iters + 16
            base = C.model_config(cfg) if preset is None else load_preset(preset)
            model = C.make_model(cfg, preset=preset, max_seq_len=max(base.max_seq_len, need))
            current = preset
        mcfg = model.cfg
        row = {"model": mcfg.name, "params": mcfg.num_parameters(), "strategy": strategy.name, "phase": phase,
               "impl": "ssmspec",
               "batch": bsz, "context": T, "dtype": C.dtype_name(model.dtype),
               "tokens": bsz * T if phase == "prefill" else bsz}
        if phase == "prefill" and max_tokens and bsz * T > max_tokens:
            log.info("skip prefill %s B=%d T=%d: %d tokens > bench.max_prefill_tokens=%d", mcfg.name, bsz, T,
                     bsz * T, max_tokens)
            yield {**row, "status": "skipped"}
            continue
        try:
            if phase == "prefill":
                ids = synthetic_prompts(bsz, T, mcfg.vocab_size, seed=int(cfg.data.get("seed", 0)),
                                        min_token_id=int(cfg.data.get("min_token_id", 3)), device=device)
                eng = prefill_engine(model, strategy, ids)
                valid = torch.ones_like(ids, dtype=torch.bool)
                samples = time_eager(lambda: eng.step.prefill(ids, valid), warmup=pre_warmup, iters=pre_iters,
                                     device=device)
                del eng
                timing, extra = "eager", {}
            else:
                pending = synthetic_prompts(bsz, 1, mcfg.vocab_size, seed=int(cfg.data.get("seed", 0)),
                                            device=device)[:, 0]
                eng, bytes_min = decode_engine(model, strategy, pending, T, steps=warmup + iters + 8, graph=graph)
                samples = eng.time_steps(warmup=warmup, iters=iters)
                timing = "cuda_graph" if eng.graphed else "eager"
                extra = {"cache_fill": "random", "bytes_min": bytes_min, **wall_check(samples, eng.loop_wall_ms)}
                if device.startswith("cuda") and T == min(g[2] for g in grid):  # what one step launches (the
                    # same at every context: profiled at the smallest) and, at bench.profile_batches, a table
                    extra["kernels_per_step"], table = profile_steps(eng, steps=3)
                    if bsz in [int(x) for x in b.get("profile_batches") or []]:
                        extra["kernel_table"] = table
                del eng  # the step's caches and graphs
            # the engine's states live in the strategy: free them before the next point
            strategy = C.build_strategy(cfg)
        except torch.OutOfMemoryError as e:
            log.warning("out of memory: %s %s B=%d T=%d (%s)", mcfg.name, phase, bsz, T, str(e)[:400])
            strategy = C.build_strategy(cfg)  # drop the state tensors of this point
            torch.cuda.empty_cache()
            yield {**row, "status": "oom"}
            continue
        stats = summarize(samples)
        row.update(status="ok", timing=timing, **extra, **stats, samples_ms=samples,
                   tokens_per_s=row["tokens"] / (stats["ms_p50"] * 1e-3))
        if peak and phase == "decode":
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            floor_ms = weights / (peak * 1e9) * 1e3  # reading every weight once at the measured bandwidth
            row.update(hbm_gbps_peak=peak, hbm_fraction=hbm_fraction(row["bytes_min"], stats["ms_p50"], peak),
                       weights_bytes=weights, weight_floor_ms=floor_ms, x_weight_floor=stats["ms_p50"] / floor_ms)
        log.info("%-14s %-7s B=%-3d T=%-5d %9.3f ms  %12.0f tok/s  (%s)", mcfg.name, phase, bsz, T,
                 stats["ms_p50"], row["tokens_per_s"], timing)
        yield row
    del model
    yield from _transformers_rows(cfg, presets, device, peak)


def _transformers_rows(cfg: DictConfig, presets: list, device: str, peak: float | None) -> Iterator[dict]:
    """Decode rows of transformers' generate() on the same architectures (``bench.transformers_batch``)."""
    from ssmspec.bench.hf_baseline import hf_decode_ms, hf_kernels, hf_model

    b = cfg.bench
    batches = [int(x) for x in (b.get("transformers_batch") or [])]
    contexts = [int(x) for x in (b.get("transformers_context") or [])]
    n_new, iters = int(b.get("transformers_tokens") or 16), max(int(b.iters) // 3, 2)
    dtype = C.resolve_dtype(str(cfg.dtype), device)
    for preset in presets if batches else []:
        mcfg = C.model_config(cfg) if preset is None else load_preset(preset)
        base = {"model": mcfg.name, "params": mcfg.num_parameters(), "strategy": "transformers", "phase": "decode",
                "impl": "transformers", "dtype": C.dtype_name(dtype), "kernels": hf_kernels()}
        try:
            model = hf_model(mcfg, device=device, dtype=dtype, seed=int(cfg.seed))
        except ValueError as e:  # an architecture transformers has no class for (MoE, RoPE hybrids)
            yield {**base, "status": "skipped", "reason": str(e)}
            continue
        for bsz in batches:
            for T in contexts:
                row = {**base, "batch": bsz, "context": T, "tokens": bsz}
                samples = hf_decode_ms(model, batch=bsz, context=T, new_tokens=n_new, iters=iters,
                                       vocab=mcfg.vocab_size, seed=int(cfg.data.get("seed", 0)))
                stats = summarize(samples)
                row.update(status="ok", timing="eager", **stats, samples_ms=samples,
                           tokens_per_s=bsz / (stats["ms_p50"] * 1e-3))
                log.info("%-14s transformers decode B=%-3d T=%-5d %9.3f ms", mcfg.name, bsz, T, stats["ms_p50"])
                yield row
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
