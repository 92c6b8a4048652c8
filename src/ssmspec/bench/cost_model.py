"""The ``cost_model`` experiment: fit the step-cost model of ``ssmspec/policy.py`` from measured engine steps,
let the policy pick strategy, S and D per batch size, and score its picks against every fixed setting.

Every setting of the grid (``autoregressive``, and ``bench.strategies`` x ``bench.S`` x ``bench.D`` chains) runs
through the engine at every batch of ``bench.batch``, timed like ``replay_fig8_throughput`` (``bench/e2e.py``:
captured steps, emitted tokens over summed step times), with the forced oracle at ``bench.alpha`` (acceptance
stated: random weights accept no real drafter). Each point times at least ``bench.iters`` steps and at least
``bench.min_sequence_steps`` sequence-steps (batch x steps), so small batches are not judged on a handful of
Bernoulli draws. Two runs of the grid on different prompts and oracle draws (``bench.fit_seed`` and
``bench.eval_seed``):

- ``phase: fit`` rows: their median step times are the points of the fit (``kind: fit`` rows hold each
  strategy's coefficients, knee and relative RMS residual; ``python -m ssmspec policy --fit results.jsonl``
  refits them from these rows);
- ``phase: eval`` rows: the same settings measured again, at ``bench.batch`` plus ``bench.eval_batch`` -- batch
  sizes the fit never saw, where the policy has only the model's interpolation. The policy's pick at a batch
  (``kind: policy``, made from the fit alone) is scored by the evaluation measurement of the setting it picked,
  against the best fixed setting at that batch (``ratio_to_best``); ``model_only_*`` columns give the pick of
  the fitted surface without the per-setting calibration. ``kind: range`` rows give every fixed setting's and
  the policy's geometric mean of that ratio over the batch range. Measure rows also carry
  ``tokens_per_s_at_alpha`` (the measured step time at the expected acceptance), free of the acceptance draws'
  noise.

Goal (issue 9): the policy never more than 3% below the best fixed setting at any batch, and above the best
single fixed setting over the whole range.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.e2e import _is_oom, plan_point, throughput_row
from ssmspec.bench.inputs import synthetic_prompts, track
from ssmspec.bench.steps_replay import model_for, release
from ssmspec.drafting.oracle import Oracle, expected_accepted
from ssmspec.engine import Engine
from ssmspec.engine.generate import generate
from ssmspec.policy import Setting, candidates, fit, pick
from ssmspec.strategies import SpecConfig, strategy_names

log = logging.getLogger("ssmspec.bench.cost_model")
GOAL_AT_BATCH = 0.97  # the policy's tokens/s at least this share of the best fixed setting at every batch


def _grid(b: DictConfig) -> list[Setting]:
    known = set(strategy_names()) - {"autoregressive"}
    strategies = [str(s) for s in b.strategies]
    bad = sorted(set(strategies) - known)
    if bad or not strategies:
        raise ValueError(f"cost_model: bench.strategies holds speculative strategies ({', '.join(sorted(known))}), "
                         f"got {strategies}")
    S, D = [int(s) for s in b.S], [int(d) for d in b.D]
    if not S or not D or min(S) < 1 or min(D) < 1:
        raise ValueError(f"cost_model: bench.S and bench.D need values >= 1, got {S}, {D}")
    if not 0.0 <= float(b.alpha) <= 1.0:
        raise ValueError(f"cost_model: bench.alpha is the oracle's per-token acceptance, in [0, 1]; got {b.alpha}")
    sizes = [int(x) for x in b.batch]
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"cost_model: bench.batch needs at least 2 sizes >= 1 (the fit has a batch term), got {sizes}")
    extra = [int(x) for x in b.get("eval_batch", []) or []]
    if extra and min(extra) < 1:
        raise ValueError(f"cost_model: bench.eval_batch holds batch sizes >= 1 the fit does not see, got {extra}")
    return candidates(["autoregressive", *strategies], S, D)


def _iters(b: DictConfig, batch: int) -> int:
    """Timed steps of a point: bench.iters, and at least bench.min_sequence_steps / batch."""
    return max(int(b.iters), math.ceil(int(b.get("min_sequence_steps", 0)) / batch))


def _horizon(b: DictConfig, batch: int, smax: int) -> int:
    """Tokens per sequence a point can emit: warm-up, timed and one spare step of smax + 1 tokens."""
    return 1 + (max(int(b.warmup), 1) + _iters(b, batch) + 1) * (smax + 1) + smax


def _measure(model, setting: Setting, *, batch: int, ids, reference, H: int, b: DictConfig, seed: int, graph: bool,
             base: dict) -> dict:
    spec = SpecConfig(draft_len=setting.S, num_drafts=setting.D, buffer_size=int(b.R))
    fit_ok, need, free = plan_point(model, setting.strategy, batch=batch, prompt_len=ids.shape[1], new_tokens=H,
                                    spec=spec)
    if not fit_ok:
        return {**base, "status": "skipped", "planned_bytes": need,
                "reason": f"needs {need} bytes beside the weights but {free} are free"}
    eng = None
    try:
        drafter = None
        if setting.S:
            drafter = Oracle(p=float(b.alpha), draft_len=setting.S, num_drafts=setting.D, reference=reference,
                             vocab_size=model.cfg.vocab_size, seed=seed, forced=True)
        eng = Engine(model, batch=batch, prefill_len=ids.shape[1], max_new_tokens=H, strategy=setting.strategy,
                     drafter=drafter, spec=spec, cuda_graph=graph)
        eng.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
        row = throughput_row(eng, warmup=int(b.warmup), iters=_iters(b, batch),
                             reference=reference if setting.S else None, oracle_alpha=float(b.alpha), **base,
                             planned_bytes=need)
        expect = expected_accepted(float(b.alpha), draft_len=setting.S, num_drafts=setting.D) if setting.S else 0.0
        row.update(expected_accepted=expect, tokens_per_s_at_alpha=1000.0 * batch * (1 + expect) / row["ms_p50"])
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        row = {**base, "status": "oom", "reason": str(e).splitlines()[0]}
    del eng
    release(str(model.device))
    return row


def run_cost_model(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``cost_model`` (module doc)."""
    b = cfg.bench
    grid = _grid(b)
    device = str(cfg.device)
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    Tp, smax = int(b.prompt_len), max(s.S for s in grid)
    alpha, sizes = float(b.alpha), [int(x) for x in b.batch]
    eval_sizes = sorted(set(sizes) | {int(x) for x in b.get("eval_batch", []) or []})
    min_tok = int(cfg.data.get("min_token_id", 3))
    for preset in b.presets:
        model = model_for(cfg, preset, Tp + max(_horizon(b, x, smax) for x in eval_sizes) + 16)
        measured: dict[tuple[str, int, str], dict] = {}
        for phase, seed, batches in (("fit", int(b.fit_seed), sizes), ("eval", int(b.eval_seed), eval_sizes)):
            for bsz in track(batches, desc=f"{preset} {phase}"):
                H = _horizon(b, bsz, smax)
                ids = synthetic_prompts(bsz, Tp, model.cfg.vocab_size, seed=seed, min_token_id=min_tok, device=device)
                reference = generate(model, ids.tolist(), max_new_tokens=H, strategy="autoregressive",
                                     cuda_graph=graph).sequences
                release(device)
                for s in grid:
                    base = dict(model=preset, kind="measure", phase=phase, setting=s.label, strategy=s.strategy,
                                S=s.S, D=s.D, tokens=s.tokens, batch=bsz, prompt_len=Tp, dtype=C.dtype_name(model.dtype),
                                acceptance="oracle" if s.S else "none", alpha=alpha if s.S else None,
                                oracle="forced" if s.S else None, seed=seed)
                    row = _measure(model, s, batch=bsz, ids=ids, reference=reference, H=H, b=b, seed=seed,
                                   graph=graph, base=base)
                    measured[(phase, bsz, s.label)] = row
                    yield row
        del model
        release(device)
        yield from _score(preset, grid, sizes, eval_sizes, alpha, measured)


def _score(preset: str, grid: list[Setting], sizes: list[int], eval_sizes: list[int], alpha: float,
           measured: dict) -> Iterator[dict]:
    """Fit rows, the policy's pick per batch scored on the evaluation run, and whole-range scores."""
    pts = [dict(strategy=r["strategy"], batch=r["batch"], S=r["S"], D=r["D"], ms=r["ms_p50"])
           for (phase, _, _), r in measured.items() if phase == "fit" and r["status"] == "ok"]
    model = fit(pts)
    for st, coef in model.coef.items():
        yield dict(model=preset, kind="fit", strategy=st, **coef, residual=model.residual[st], status="ok")
    fitted = {label for (phase, _, label), r in measured.items() if phase == "fit" and r["status"] == "ok"}
    ratios: dict[str, list[float]] = {s.label: [] for s in grid}
    ratios["policy"] = []
    for bsz in eval_sizes:
        ok = {s.label: measured[("eval", bsz, s.label)] for s in grid
              if measured[("eval", bsz, s.label)]["status"] == "ok"}
        if not ok:
            continue
        best_label = max(ok, key=lambda k: ok[k]["tokens_per_s"])
        best = ok[best_label]["tokens_per_s"]
        cands = [s for s in grid if s.strategy in model.coef]
        fits = lambda s, B: s.label in fitted and s.label in ok  # noqa: E731 -- the memory plan's verdict
        choice, predicted = pick(model, bsz, alpha, cands, fits=fits)
        bare, _ = pick(model, bsz, alpha, cands, fits=fits, calibrated=False)
        got = ok[choice.label]["tokens_per_s"]
        for label, r in ok.items():
            ratios[label].append(r["tokens_per_s"] / best)
        ratios["policy"].append(got / best)
        at_alpha = {k: r["tokens_per_s_at_alpha"] for k, r in ok.items()}
        yield dict(model=preset, kind="policy", batch=bsz, fitted_batch=bsz in sizes, setting=choice.label,
                   strategy=choice.strategy, S=choice.S, D=choice.D, predicted_tokens_per_s=predicted,
                   tokens_per_s=got, best_setting=best_label, best_tokens_per_s=best, ratio_to_best=got / best,
                   meets_goal=got / best >= GOAL_AT_BATCH,
                   ratio_to_best_at_alpha=at_alpha[choice.label] / max(at_alpha.values()),
                   model_only_setting=bare.label, model_only_ratio_to_best=ok[bare.label]["tokens_per_s"] / best,
                   alpha=alpha, acceptance="oracle", status="ok")
        log.info("%s B=%d%s: policy %s %.0f tokens/s, best fixed %s %.0f (%.3f)", preset, bsz,
                 "" if bsz in sizes else " (not fitted)", choice.label, got, best_label, best, got / best)
    n = len(ratios["policy"])
    scores = {k: math.exp(sum(math.log(x) for x in v) / len(v)) for k, v in ratios.items() if len(v) == n and n}
    best_fixed = max((k for k in scores if k != "policy"), key=scores.get, default=None)
    for label, score in scores.items():
        yield dict(model=preset, kind="range", setting=label, geomean_ratio_to_best=score, batches=n,
                   is_policy=label == "policy", best_single_fixed=label == best_fixed,
                   beats_best_single=scores["policy"] > scores[best_fixed] if label == "policy" and best_fixed else None,
                   status="ok")
