"""STree Fig. 2 (seed 003, section 4): model-call time vs tokens per call, its linear and quadratic fits, and
the acceptance ratio a token tree needs to beat chain speculation -- ``stree_fig2_runtime_fit``.

For every strategy of ``bench.strategies`` and N in ``bench.tokens`` the engine (``bench/steps.py``) runs
calls of N tokens per sequence: ``activation_replay`` (the fused multi-step scan, STree's "FSS" baseline) a
chain of N - 1 random drafts, ``stree`` a complete binary tree of N - 1 draft nodes under the pending token
(node i's parent is (i - 1) // 2); N = 1 is standard decode. Timed: the model call alone (``stage: call``,
``DecodeStep.forward``: layout + model, a CUDA graph on CUDA) and the whole engine step (``stage: step``).

Fits (``kind: fit``), least squares on the call medians: t = k N + C (seed 003, the SSM model) and
t = a N^2 + b N + c (its hybrid model, attention being quadratic in N), with R^2. Seed 003, Eqs. 7-8: with
wall time proportional to t / tau (tau: tokens a step emits), tree speculation with N2 tokens beats chain
speculation with N1 tokens (``bench.n1``; seed 003: 5) only where

    tau2 / tau1 >= (k2 N2 + C2) / (k1 N1 + C1)        (linear)
    tau2 / tau1 >= (a2 N2^2 + b2 N2 + c2) / (a1 N1^2 + b1 N1 + c1)   (quadratic)

with fit 2 of ``bench.tree_strategy`` and fit 1 of ``bench.chain_strategy``; ``kind: needed`` rows hold both
ratios per N2 (seed 003, Fig. 2 right: about 1.5x at N2 = 15 for Mamba2-2.7B on an RTX 3090).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.steps import random_drafter, step_engine, step_row
from ssmspec.bench.steps_replay import forward_samples, model_for, point_fits, release
from ssmspec.bench.timing import summarize
from ssmspec.engine.memory import fmt_bytes
from ssmspec.models.config import load_preset
from ssmspec.strategies import SpecConfig

log = logging.getLogger("ssmspec.bench.steps_fit")
STRATEGIES = ("activation_replay", "stree")


def binary_tree(nodes: int) -> list[int]:
    """Parents list of a complete binary tree of ``nodes`` draft nodes under the root (node i -> (i-1)//2)."""
    return [(i - 1) // 2 for i in range(1, nodes + 1)]


def call_engine(model, strategy: str, tokens: int, *, batch: int, context: int, graph: bool, steps: int):
    """The engine whose calls carry ``tokens`` tokens per sequence (module doc)."""
    if tokens == 1:
        return step_engine(model, strategy=strategy, batch=batch, context=context, graph=graph, steps=steps)
    vocab = model.cfg.vocab_size
    if strategy == "stree":
        drafter = random_drafter(SpecConfig(), vocab, batch, tree=binary_tree(tokens - 1))
    else:
        drafter = random_drafter(SpecConfig(draft_len=tokens - 1), vocab, batch)
    spec = SpecConfig(draft_len=drafter.spec.draft_len, tree_size=drafter.spec.tree_size, buffer_size=max(16, tokens))
    return step_engine(model, strategy=strategy, batch=batch, context=context, spec=spec, drafter=drafter,
                       graph=graph, steps=steps)


def fit(tokens: list[int], ms: list[float], degree: int) -> tuple[list[float], float]:
    """Least-squares polynomial of ``degree`` through (tokens, ms): coefficients, highest power first, and R^2."""
    x, y = np.asarray(tokens, dtype=float), np.asarray(ms, dtype=float)
    coef = np.polyfit(x, y, degree)
    resid = y - np.polyval(coef, x)
    ss = float(((y - y.mean()) ** 2).sum())
    return [float(c) for c in coef], (1.0 - float((resid ** 2).sum()) / ss) if ss > 0 else 1.0


def _check(b: DictConfig) -> tuple[list[str], list[int]]:
    strategies = [str(s) for s in b.strategies]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise ValueError(f"stree_fig2_runtime_fit: bench.strategies may hold {', '.join(STRATEGIES)}, got {bad}")
    tokens = sorted({int(t) for t in b.tokens})
    if len(tokens) < 3 or tokens[0] < 1 or tokens[-1] > 64:
        raise ValueError(f"bench.tokens needs at least 3 sizes in 1..64 (a quadratic fit; decode calls carry at "
                         f"most 64 tokens), got {list(b.tokens)}")
    for key in ("tree_strategy", "chain_strategy"):
        if str(b[key]) not in strategies:
            raise ValueError(f"bench.{key}={b[key]} must be one of bench.strategies {strategies}")
    if int(b.n1) < 1:
        raise ValueError(f"bench.n1 (tokens of the chain call) must be >= 1, got {b.n1}")
    return strategies, tokens


def run_runtime_fit(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``stree_fig2_runtime_fit`` (module doc)."""
    b = cfg.bench
    strategies, tokens = _check(b)
    device, dtype = str(cfg.device), C.resolve_dtype(str(cfg.dtype), str(cfg.device))
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    warmup, iters = int(b.warmup), int(b.iters)
    bsz, T, steps = int(b.batch), int(b.context), warmup + iters + 2
    for preset in b.presets:
        mcfg = load_preset(preset)
        for strategy in strategies:
            spec = SpecConfig(draft_len=tokens[-1] - 1, buffer_size=max(16, tokens[-1]))
            ok, need, free = point_fits(mcfg, strategy, batch=bsz, context=T, spec=spec, steps=steps, dtype=dtype,
                                        device=device)
            if not ok:
                raise ValueError(f"stree_fig2_runtime_fit: {preset} at batch {bsz}, context {T} needs "
                                 f"{fmt_bytes(need)} but {fmt_bytes(free)} are free; lower bench.batch or bench.context")
        model = model_for(cfg, preset, T + steps * tokens[-1])
        medians: dict[str, list[float]] = {}
        for strategy in strategies:
            for n in tokens:
                eng = call_engine(model, strategy, n, batch=bsz, context=T, graph=graph, steps=steps)
                row = step_row(eng, warmup=warmup, iters=iters, model=preset, tokens=n, context=T, kind="measure",
                               stage="step", status="ok", dtype=C.dtype_name(dtype))
                call = forward_samples(eng, warmup=warmup, iters=iters)
                keep = {k: v for k, v in row.items() if not k.startswith("ms_") and k not in ("samples_ms", "n")}
                call_row = {**keep, **summarize(call), "samples_ms": call, "stage": "call"}
                medians.setdefault(strategy, []).append(call_row["ms_p50"])
                log.info("%s %s N=%d: call %.3f ms, step %.3f ms", preset, strategy, n, call_row["ms_p50"],
                         row["ms_p50"])
                yield call_row
                yield row
                del eng
                release(device)
        del model
        release(device)
        yield from _fit_rows(preset, tokens, medians, tree=str(b.tree_strategy), chain=str(b.chain_strategy),
                             n1=int(b.n1))


def _fit_rows(preset: str, tokens: list[int], medians: dict[str, list[float]], *, tree: str, chain: str,
              n1: int) -> Iterator[dict]:
    """Fit rows per strategy and degree, then the acceptance ratio needed per N2 (seed 003, Eqs. 7-8)."""
    fits = {}
    for strategy, ms in medians.items():
        for degree in (1, 2):
            coef, r2 = fit(tokens, ms, degree)
            fits[(strategy, degree)] = coef
            names = ("k", "C") if degree == 1 else ("a", "b", "c")
            yield dict(model=preset, strategy=strategy, kind="fit", degree=degree, r2=r2, status="ok",
                       **dict(zip(names, coef)))
    for n2 in tokens:
        row = dict(model=preset, kind="needed", strategy=tree, chain_strategy=chain, n1=n1, tokens=n2, status="ok")
        for degree, key in ((1, "needed_linear"), (2, "needed_quadratic")):
            row[key] = float(np.polyval(fits[(tree, degree)], n2) / np.polyval(fits[(chain, degree)], n1))
        yield row
