"""Step-time benchmarks time the engine (``ssmspec.engine.Engine``): the captured decode step that
generate() replays, never a copy written for the benchmark. Shared pieces of every step-time experiment.

    eng = step_engine(model, strategy="replay", batch=256, context=1024, spec=SpecConfig(buffer_size=16),
                      graph=True, steps=warmup + iters)
    row = step_row(eng, warmup=3, iters=20, model=model.cfg.name, strategy="replay")

``step_engine`` starts the engine as if ``context`` tokens had been prefilled (random KV contents, zero SSM
state: a step's time does not depend on the values) and, for speculative specs, gives it a ``draft_source``
drafter: chains (or a tree shape) of tokens drawn at random from the vocabulary, on the device. With random
weights no drafter has a meaningful acceptance; random drafts are almost always rejected, and every row
records the accepted counts the step actually saw (``mean_accepted``, ``accepted_hist``) and
``acceptance: random-drafts``. Experiments that need a stated acceptance use the oracle drafter instead.
"""
from __future__ import annotations

from collections import Counter

import torch

from ssmspec.bench.timing import summarize, wall_check
from ssmspec.drafting.oracle import Oracle
from ssmspec.engine import Engine
from ssmspec.strategies import SpecConfig


def random_drafter(spec: SpecConfig, vocab_size: int, batch: int, *, tree: list[int] | None = None,
                   seed: int = 0) -> Oracle:
    """Drafts of the spec's shape whose tokens are random (an oracle whose "truth" is a random sequence)."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randint(0, vocab_size, (batch, 64), generator=g).tolist()
    if tree is not None:
        return Oracle(p=0.0, tree=tree, reference=ref, vocab_size=vocab_size, seed=seed)
    return Oracle(p=0.0, draft_len=spec.draft_len, num_drafts=spec.num_drafts, reference=ref,
                  vocab_size=vocab_size, seed=seed)


def step_engine(model, *, strategy, batch: int, context: int, spec: SpecConfig = SpecConfig(), drafter=None,
                graph: bool, steps: int, seed: int = 0) -> Engine:
    """An engine at batch ``batch`` whose caches hold ``context`` tokens, with room for ``steps`` steps."""
    if spec.draft_len and drafter is None:
        drafter = random_drafter(spec, model.cfg.vocab_size, batch, seed=seed)
    eng = Engine(model, batch=batch, prefill_len=context, max_new_tokens=steps * (spec.draft_len + 1),
                 strategy=strategy, drafter=drafter, spec=spec, cuda_graph=graph, prefill=False)
    g = torch.Generator(device=model.device).manual_seed(seed)
    pending = torch.randint(3, model.cfg.vocab_size, (batch,), generator=g, device=model.device)
    eng.start_synthetic(context, pending)
    return eng


def step_row(eng: Engine, *, warmup: int, iters: int, **fields) -> dict:
    """Time ``iters`` engine steps after ``warmup``; one tidy row with raw samples, the loop's wall clock beside
    their sum (``timing.wall_check``: ``wall_flag`` marks a row whose steps left the device idle) and
    acceptance."""
    samples = eng.time_steps(warmup=warmup, iters=iters)
    acc = [a for step in eng.accepted for a in step]
    hist = dict(sorted(Counter(acc).items()))
    drafter = eng.drafter
    return {**fields, **summarize(samples), "samples_ms": samples, **wall_check(samples, eng.loop_wall_ms),
            "timing": "cuda_graph" if eng.graphed else "eager",
            "strategy": eng.strategy.name, "batch": eng.step.batch, "draft_len": eng.spec.draft_len,
            "num_drafts": eng.spec.num_drafts, "tree_size": eng.spec.tree_size, "buffer_size": eng.spec.buffer_size,
            "tokens_per_call": eng.strategy.max_rows(eng.step.batch, eng.spec) * eng.strategy.max_call_len(eng.spec),
            "cache_bytes": eng.cache_bytes(), "acceptance": "random-drafts" if drafter is not None else "none",
            "drafter_on_device": eng.drafter_on_device,
            "mean_accepted": sum(acc) / len(acc) if acc else 0.0, "accepted_hist": {str(k): v for k, v in hist.items()},
            **draft_fields(eng)}


def draft_fields(eng: Engine) -> dict:
    """Rows whose drafter runs a draft model (``engine/draft.py``): its name, the drafting time of every timed
    step (the drafter graph's share of the step, ``Engine.draft_ms``; median and p90), its calls per step
    (the root call of two tokens per sequence, then one per further draft depth) and the median per call."""
    draft = getattr(eng.drafter, "engine", None)
    if draft is None:
        return {}
    ms = eng.draft_ms()
    q = summarize(ms)
    return {"draft": draft.model.cfg.name, "draft_samples_ms": ms, "draft_ms": q["ms_p50"], "draft_ms_p90": q["ms_p90"],
            "draft_calls": draft.S, "draft_call_ms": q["ms_p50"] / draft.S, "draft_cache_bytes": draft.cache_bytes()}
