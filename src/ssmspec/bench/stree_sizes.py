"""STree Table 1 (seed 003, section 4): latency of one model call at batch 1 for autoregressive decode, a
token tree through STree's packed tree scan, and vanilla (chain) speculation, over Mamba-2 models of
growing size -- ``stree_tab1_sizes``.

Each preset of ``bench.presets`` is built with random weights (seed 003 does the same from 7B up) and, per
line, its engine (``bench/steps.py``) is started as if ``bench.context`` tokens had been prefilled; the model
call (``DecodeStep.forward``: layout + model, a CUDA graph on CUDA) is timed alone, as the seed's "forward
pass". Lines:

- ``autoregressive``: one token per call;
- ``stree``: a complete binary tree of ``bench.tree_tokens`` - 1 draft nodes under the pending token;
- ``vanilla_sd``: a chain of ``bench.chain_tokens`` - 1 drafts through ``bench.chain_strategy`` (the fused
  multi-step scan of activation replay, the seed's "vanilla SD").

Rows carry ``overhead`` = ms / the autoregressive ms of the same model (seed 003: STree 2.04x at 2.3B falling
to 1.26x at 23B; vanilla SD 1.37x -> 1.06x). A model whose weights and caches do not fit the free memory is
one ``status: skipped`` row per line naming both numbers, so the table stops there instead of the run.
Timing only: the drafts are random and their acceptance is not measured (``acceptance: not measured``).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.e2e import _is_oom
from ssmspec.bench.steps import random_drafter, step_engine
from ssmspec.bench.steps_fit import binary_tree
from ssmspec.bench.steps_replay import forward_samples, model_for, point_fits, release
from ssmspec.bench.timing import summarize
from ssmspec.engine.memory import fmt_bytes
from ssmspec.models.config import load_preset
from ssmspec.strategies import SpecConfig

log = logging.getLogger("ssmspec.bench.stree_sizes")
CHAIN_STRATEGIES = ("activation_replay", "joint_attainment", "snapshot", "replay")


def _lines(b: DictConfig) -> list[tuple[str, str, int]]:
    """(line, strategy, tokens per call) in table order; settings that cannot work refused."""
    tree, chain = int(b.tree_tokens), int(b.chain_tokens)
    if not 2 <= tree <= 64 or not 2 <= chain <= 64:
        raise ValueError(f"stree_tab1_sizes: bench.tree_tokens and bench.chain_tokens count the pending token plus "
                         f"drafts, 2..64; got {tree}, {chain}")
    if str(b.chain_strategy) not in CHAIN_STRATEGIES:
        raise ValueError(f"stree_tab1_sizes: bench.chain_strategy is one of {', '.join(CHAIN_STRATEGIES)}, got "
                         f"{b.chain_strategy!r}")
    if not list(b.presets):
        raise ValueError("stree_tab1_sizes: bench.presets is empty; name the model sizes to compare")
    return [("autoregressive", "autoregressive", 1), ("stree", "stree", tree),
            ("vanilla_sd", str(b.chain_strategy), chain)]


def _spec(strategy: str, tokens: int) -> SpecConfig:
    """The speculation shape of a line's calls (its memory plan; the drafter sets the same)."""
    if tokens == 1:
        return SpecConfig()
    if strategy == "stree":
        parents = binary_tree(tokens - 1)
        depth = [0]
        for par in parents:
            depth.append(depth[par] + 1)
        return SpecConfig(draft_len=max(depth), tree_size=len(parents), buffer_size=max(16, 2 * tokens))
    return SpecConfig(draft_len=tokens - 1, buffer_size=max(16, 2 * tokens))


def _engine(model, strategy: str, tokens: int, *, context: int, graph: bool, steps: int):
    vocab = model.cfg.vocab_size
    if tokens == 1:
        return step_engine(model, strategy=strategy, batch=1, context=context, graph=graph, steps=steps)
    if strategy == "stree":
        drafter = random_drafter(SpecConfig(), vocab, 1, tree=binary_tree(tokens - 1))
    else:
        drafter = random_drafter(SpecConfig(draft_len=tokens - 1), vocab, 1)
    spec = SpecConfig(draft_len=drafter.spec.draft_len, tree_size=drafter.spec.tree_size,
                      buffer_size=max(16, 2 * tokens))
    return step_engine(model, strategy=strategy, batch=1, context=context, spec=spec, drafter=drafter, graph=graph,
                       steps=steps)


def run_stree_sizes(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``stree_tab1_sizes`` (module doc)."""
    b = cfg.bench
    lines = _lines(b)
    device, dtype = str(cfg.device), C.resolve_dtype(str(cfg.dtype), str(cfg.device))
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    warmup, iters, T = int(b.warmup), int(b.iters), int(b.context)
    steps = warmup + iters + 2
    widest = max(n for _, _, n in lines)
    for preset in b.presets:
        mcfg = load_preset(preset)
        base = dict(model=preset, params=mcfg.num_parameters(), batch=1, context=T, dtype=C.dtype_name(dtype),
                    acceptance="not measured")
        fits = [point_fits(mcfg, strategy, batch=1, context=T, spec=_spec(strategy, n), steps=steps, dtype=dtype,
                           device=device) for _, strategy, n in lines]
        need, free = max(f[1] for f in fits), min(f[2] for f in fits)
        if not all(f[0] for f in fits):
            for line, strategy, n in lines:
                yield {**base, "line": line, "strategy": strategy, "tokens": n, "status": "skipped",
                       "reason": f"weights and caches need {fmt_bytes(need)} but {fmt_bytes(free)} are free"}
            continue
        try:
            model = model_for(cfg, preset, T + steps * widest)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not _is_oom(e):
                raise
            release(device)
            for line, strategy, n in lines:
                yield {**base, "line": line, "strategy": strategy, "tokens": n, "status": "oom",
                       "reason": f"building the weights ran out of memory: {str(e).splitlines()[0]}"}
            continue
        ar_ms = None
        for line, strategy, n in lines:
            eng = _engine(model, strategy, n, context=T, graph=graph, steps=steps)
            eng.time_steps(warmup=1, iters=1)  # sets the drafts the timed forward reads
            samples = forward_samples(eng, warmup=warmup, iters=iters)
            row = {**base, "line": line, "strategy": strategy, "tokens": n, "status": "ok", **summarize(samples),
                   "samples_ms": samples, "timing": "cuda_graph" if eng.graphed else "eager"}
            ar_ms = row["ms_p50"] if line == "autoregressive" else ar_ms
            row["overhead"] = row["ms_p50"] / ar_ms
            log.info("%s %s (%d tokens): %.3f ms, %.2fx autoregressive", preset, line, n, row["ms_p50"],
                     row["overhead"])
            yield row
            del eng
            release(device)
        del model
        release(device)
