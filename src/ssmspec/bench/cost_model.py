"""The ``cost_model`` experiment: fit the step-cost model of ``ssmspec/policy.py`` from measured engine steps, then
score the policy's pick of strategy, S and D -- beside two baselines that need no model -- only at batch sizes the
fit never saw.

Every setting of the grid (``autoregressive``, and ``bench.strategies`` x ``bench.S`` x ``bench.D`` chains; the
strategies of ``bench.single_draft`` at D = 1 only) runs through the engine, timed like
``replay_fig8_throughput`` (``bench/e2e.py``: captured steps, emitted tokens over summed step times), with the
forced oracle at ``bench.alpha`` (acceptance stated: random weights accept no real drafter). Each point times at
least ``bench.iters`` steps and at least ``bench.min_sequence_steps`` sequence-steps (batch x steps), so small
batches are not judged on a handful of Bernoulli draws.

- ``phase: fit`` rows: the grid at ``bench.fit_batch`` on the prompts and oracle draws of ``bench.fit_seed``.
  Their median step times are the points of the fit (``kind: fit`` rows hold each strategy's coefficients, knee
  and relative RMS residual; ``python -m ssmspec policy --fit results.jsonl`` refits them from these rows), and
  their tokens/s are all the baselines see.
- ``phase: eval`` rows: the grid at ``bench.heldout_batch`` -- disjoint from the fit's batches, refused
  otherwise -- once per seed of ``bench.eval_seeds`` (each its own prompts and oracle draws).

The policy (fit alone), the best single fixed setting of the fit and the fastest setting at the nearest fitted
batch each pick a setting at every held-out batch; each pick is scored in every evaluation measurement against
the fastest setting of that measurement (``bench/cost_model_scoring.py``: the score, the spread over seeds, what
counts as a miss, and the ``kind: split`` / ``policy`` / ``baseline`` / ``batch_summary`` / ``range`` rows).
Measure rows also carry ``tokens_per_s_at_alpha`` (the measured step time at the expected acceptance, free of
the acceptance draws' noise) and ``point_wall_s`` (the point's wall clock, engine build and graph capture
included); the ``kind: split`` row carries ``measure_wall_s``, the preset's whole measurement.

Measured acceptance (``bench.drafter``: png, draft_model or mtp, with ``checkpoint=``; ``bench.trained`` runs it on the
pair the suite trains, ``bench/trained_rows.py``). The prompt set of ``data=`` (each prompt's last ``prompt_len``
tokens) is split in two: its first half are the fit prompts, its second half the held-out prompts. Every setting
drafts with the real drafter. The fit phase decodes fit prompts only (a seeded choice of them per batch); the
acceptance the policy uses is then estimated from the fit phase's single chains (``policy.fit_alpha``: the
maximum-likelihood per-token alpha of their accepted counts; a ``kind: acceptance`` row holds it, with every
setting's measured mean accepted length beside the one that alpha predicts), before any held-out row runs. The
evaluation phases decode held-out prompts only (a seeded choice per seed) at held-out batches, and every chooser is
scored on their measured tokens/s: the step-cost fit, the acceptance and both baselines saw neither those batches
nor those prompts (rows list the prompts they decoded: ``prompt_ids``).

Goal (issue 9, on held-out batches only): no miss at any held-out batch, and a geometric mean above the best
single fixed setting's. The policy is also compared with the nearest-fitted-batch lookup
(``beats_nearest_fitted``): a model that does not beat a lookup table is not worth its fit.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.cost_model_scoring import heldout_rows
from ssmspec.bench.e2e import _is_oom, _models, plan_point, prompt_set, throughput_row
from ssmspec.bench.inputs import synthetic_prompts, track
from ssmspec.bench.prompt_groups import pad_group
from ssmspec.bench.steps_replay import release
from ssmspec.drafting.oracle import Oracle, expected_accepted
from ssmspec.engine import Engine
from ssmspec.engine.generate import generate
from ssmspec.policy import Setting, fit, fit_alpha, pick
from ssmspec.strategies import SpecConfig, strategy_names

log = logging.getLogger("ssmspec.bench.cost_model")

DRAFTERS = ("oracle", "png", "draft_model", "mtp")  # bench.drafter: the forced oracle, or a real drafter


def _sizes(b: DictConfig, key: str, *, least: int) -> list[int]:
    sizes = [int(x) for x in b.get(key) or []]
    if len(set(sizes)) < least or len(set(sizes)) != len(sizes) or min(sizes) < 1:
        raise ValueError(f"cost_model: bench.{key} needs at least {least} distinct batch sizes >= 1, got {sizes}")
    return sorted(sizes)


def _grid(b: DictConfig) -> tuple[list[Setting], list[int], list[int], list[int]]:
    """(settings, fitted batches, held-out batches, evaluation seeds) of ``bench``, every user error refused
    before anything runs."""
    known = set(strategy_names()) - {"autoregressive"}
    strategies = [str(s) for s in b.strategies]
    bad = sorted(set(strategies) - known)
    if bad or not strategies:
        raise ValueError(f"cost_model: bench.strategies holds speculative strategies ({', '.join(sorted(known))}), "
                         f"got {strategies}")
    single = [str(s) for s in b.get("single_draft") or []]
    if set(single) - set(strategies):
        raise ValueError(f"cost_model: bench.single_draft names strategies of bench.strategies ({strategies}) that "
                         f"run at D = 1 only, got {single}")
    S, D = [int(s) for s in b.S], [int(d) for d in b.D]
    if not S or not D or min(S) < 1 or min(D) < 1:
        raise ValueError(f"cost_model: bench.S and bench.D need values >= 1, got {S}, {D}")
    grid = [Setting("autoregressive")]
    grid += [Setting(st, s, d) for st in strategies for s in S for d in ([1] if st in single else D)]
    if not 0.0 <= float(b.alpha) <= 1.0:
        raise ValueError(f"cost_model: bench.alpha is the oracle's per-token acceptance, in [0, 1]; got {b.alpha}")
    fitted = _sizes(b, "fit_batch", least=2)  # the fit has a batch term
    heldout = _sizes(b, "heldout_batch", least=1)
    both = sorted(set(fitted) & set(heldout))
    if both:
        raise ValueError(f"cost_model: bench.heldout_batch {heldout} holds fitted batches {both} (bench.fit_batch "
                         f"{fitted}); the choosers are scored only where the fit never ran: drop {both} from one "
                         f"of the two lists")
    seeds = [int(s) for s in b.get("eval_seeds") or []]
    if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds) or int(b.fit_seed) in seeds:
        raise ValueError(f"cost_model: bench.eval_seeds needs at least 2 distinct seeds other than bench.fit_seed "
                         f"({b.fit_seed}), so that each held-out score has a spread; got {seeds}")
    return grid, fitted, heldout, seeds


def _drafter_kind(cfg: DictConfig, grid: list[Setting]) -> str:
    """``bench.drafter`` checked against the grid and the run (ValueError naming the fix)."""
    b = cfg.bench
    trained = ((b.get("trained") or {}).get("bench") or {}).get("drafter")
    for kind in [str(b.get("drafter", "oracle"))] + ([str(trained)] if trained else []):
        if kind not in DRAFTERS:
            raise ValueError(f"cost_model: bench.drafter is one of {', '.join(DRAFTERS)}, got {kind!r}")
    kind = str(b.get("drafter", "oracle"))
    if kind == "oracle":
        return kind
    if not cfg.get("checkpoint"):
        raise ValueError(f"cost_model: bench.drafter={kind} measures a real drafter of a checkpoint; give "
                         f"checkpoint=<dir> (bench.trained gives the trained pair's) or bench.drafter=oracle")
    if kind != "png" and any(s.D > 1 for s in grid if s.S):
        raise ValueError(f"cost_model: the {kind} drafter drafts one greedy chain a sequence; set bench.D=[1] (png "
                         f"drafts several)")
    if not any(s.S and s.D == 1 for s in grid):
        raise ValueError("cost_model: the measured acceptance is estimated from single chains (D = 1); add 1 to "
                         "bench.D or a strategy to bench.single_draft")
    if kind == "draft_model" and not b.get("draft_checkpoint"):
        raise ValueError("cost_model: the draft_model drafter needs bench.draft_checkpoint=<dir of the draft model> "
                         "(bench.trained sets the distilled draft)")
    return kind


def _pools(cfg: DictConfig, model, Tp: int) -> tuple[str, dict[str, list[tuple[int, list[int]]]]]:
    """(set name, {phase: [(prompt index, its last Tp tokens), ...]}) of a measured run: the first half of the set
    of ``data=`` are the fit prompts, the second half the held-out prompts of every evaluation (module doc)."""
    name, texts = prompt_set(cfg, model)
    if texts is None:
        raise ValueError(f"cost_model: {name}")
    if len(texts) < 2:
        raise ValueError(f"cost_model: {name} has {len(texts)} prompt; the measured acceptance needs at least 2 (half "
                         f"to fit, half held out): raise data.num_prompts")
    cut = list(enumerate(t[-Tp:] for t in texts))
    return name, {"fit": cut[:len(cut) // 2], "eval": cut[len(cut) // 2:]}


def _choose(pool: list, batch: int, seed: int) -> list[tuple[int, list[int]]]:
    """``batch`` prompts of ``pool`` in a seeded order (cycling through it when the batch is larger)."""
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    return [pool[order[i % len(pool)]] for i in range(batch)]


def _iters(b: DictConfig, batch: int) -> int:
    """Timed steps of a point: bench.iters, and at least bench.min_sequence_steps / batch."""
    return max(int(b.iters), math.ceil(int(b.get("min_sequence_steps", 0)) / batch))


def _horizon(b: DictConfig, batch: int, smax: int) -> int:
    """Tokens per sequence a point can emit: warm-up, timed and one spare step of smax + 1 tokens."""
    return 1 + (max(int(b.warmup), 1) + _iters(b, batch) + 1) * (smax + 1) + smax


def _measure(model, setting: Setting, *, inputs: tuple, reference, H: int, b: DictConfig, drafter, graph: bool,
             base: dict) -> dict:
    """One setting's throughput row on ``inputs`` (ids, valid, prompts) with ``drafter`` (None at S = 0)."""
    ids, valid, prompts = inputs
    batch = ids.shape[0]
    spec = SpecConfig(draft_len=setting.S, num_drafts=setting.D, buffer_size=int(b.R))
    fit_ok, need, free = plan_point(model, setting.strategy, batch=batch, prompt_len=ids.shape[1], new_tokens=H,
                                    spec=spec)
    if not fit_ok:
        return {**base, "status": "skipped", "planned_bytes": need,
                "reason": f"needs {need} bytes beside the weights but {free} are free"}
    eng = None
    oracle = base["acceptance"] != "measured"
    try:
        eng = Engine(model, batch=batch, prefill_len=ids.shape[1], max_new_tokens=H, strategy=setting.strategy,
                     drafter=drafter, spec=spec, cuda_graph=graph)
        eng.prefill(ids, valid, prompts)
        # the best of D chains: its designed columns (bench/designed.py) take this law, not one chain's
        expect = expected_accepted(float(b.alpha), draft_len=setting.S, num_drafts=setting.D) if setting.S else 0.0
        row = throughput_row(eng, warmup=int(b.warmup), iters=_iters(b, batch),
                             reference=reference if setting.S else None, oracle_alpha=float(b.alpha) if oracle else None,
                             expected=expect if setting.S and oracle else None, **base, planned_bytes=need)
        if oracle:
            row.update(tokens_per_s_at_alpha=1000.0 * batch * (1 + expect) / row["ms_p50"])
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
    grid, fitted, heldout, seeds = _grid(b)
    kind = _drafter_kind(cfg, grid)
    oracle = kind == "oracle"
    device = str(cfg.device)
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    Tp, smax = int(b.prompt_len), max(s.S for s in grid)
    min_tok = int(cfg.data.get("min_token_id", 3))
    passes = [("fit", int(b.fit_seed), fitted), *(("eval", seed, heldout) for seed in seeds)]
    room = Tp + max(_horizon(b, x, smax) for x in fitted + heldout) + 16
    for preset, model in _models(cfg, b, room):
        start = time.perf_counter()
        pset, pools = _pools(cfg, model, Tp) if not oracle else (None, None)
        make = _real_drafters(cfg, kind, model, room) if not oracle else None
        alpha = float(b.alpha) if oracle else None  # measured: estimated from the fit phase (module doc)
        measured: dict[tuple[str, int, int, str], dict] = {}  # (phase, seed, batch, setting) -> measure row
        for phase, seed, batches in passes:
            if alpha is None and phase == "eval":  # the fit prompts' acceptance, before any held-out row
                alpha, row = _acceptance(preset, kind, pset, measured, pools)
                yield row
            for bsz in track(batches, desc=f"{preset} {phase} seed {seed}"):
                H = _horizon(b, bsz, smax)
                used = None
                if oracle:
                    ids = synthetic_prompts(bsz, Tp, model.cfg.vocab_size, seed=seed, min_token_id=min_tok,
                                            device=device)
                    valid, prompts = torch.ones_like(ids, dtype=torch.bool), ids.tolist()
                else:  # prompts of this phase's half of the set only
                    used, prompts = zip(*_choose(pools[phase], bsz, seed))
                    prompts = list(prompts)
                    ids, valid = pad_group(prompts, Tp, model.cfg.pad_token_id, device)
                reference = generate(model, prompts, max_new_tokens=H, strategy="autoregressive",
                                     cuda_graph=graph).sequences
                release(device)
                for s in grid:
                    base = dict(model=preset, kind="measure", phase=phase, setting=s.label, strategy=s.strategy,
                                S=s.S, D=s.D, tokens=s.tokens, batch=bsz, prompt_len=Tp,
                                dtype=C.dtype_name(model.dtype),
                                acceptance=("oracle" if oracle else "measured") if s.S else "none",
                                alpha=alpha if s.S and oracle else None, oracle="forced" if s.S and oracle else None,
                                drafter=kind if s.S else "none", seed=seed)
                    if not oracle:
                        base.update(set=pset, prompt_ids=list(used))
                    t0 = time.perf_counter()
                    drafter = None
                    if s.S:
                        drafter = make(s) if make else Oracle(p=alpha, draft_len=s.S, num_drafts=s.D,
                                                              reference=reference, vocab_size=model.cfg.vocab_size,
                                                              seed=seed, forced=True)
                    row = _measure(model, s, inputs=(ids, valid, prompts), reference=reference, H=H, b=b,
                                   drafter=drafter, graph=graph, base=base)
                    row["point_wall_s"] = time.perf_counter() - t0
                    measured[(phase, seed, bsz, s.label)] = row
                    yield row
        wall = time.perf_counter() - start
        del model
        make = None
        release(device)
        extra = {} if oracle else dict(drafter=kind, set=pset, fit_prompts=[i for i, _ in pools["fit"]],
                                       eval_prompts=[i for i, _ in pools["eval"]],
                                       alpha_source="measured: single chains of the fit phase (policy.fit_alpha)")
        yield from _score(preset, grid, alpha, measured, fit_seed=int(b.fit_seed), measure_wall_s=wall,
                          acceptance="oracle" if oracle else "measured", extra=extra)


def _real_drafters(cfg: DictConfig, kind: str, model, room: int):
    """setting -> a new drafter of ``kind`` for ``model`` (png: D chains of S; mtp: its head; draft_model: the
    model of ``bench.draft_checkpoint``, loaded once in the target's dtype)."""
    from ssmspec.bench.real_drafters import measured_drafter
    from ssmspec.drafting.mtp import check_head
    from ssmspec.models.loading import load_model

    if kind == "mtp":
        check_head(model.cfg)
    draft = None
    if kind == "draft_model":
        draft = load_model(str(cfg.bench.draft_checkpoint), device=str(cfg.device), dtype=model.dtype, max_seq_len=room)
    ngram = int(cfg.bench.get("ngram", 3))
    return lambda s: measured_drafter(kind, target=model, draft=draft, draft_len=s.S,
                                      **(dict(ngram=ngram, num_drafts=s.D) if kind == "png" else {}))


def _acceptance(preset: str, kind: str, pset: str, measured: dict, pools: dict) -> tuple[float, dict]:
    """(alpha, the ``kind: acceptance`` row) from the fit phase's measured single chains (``policy.fit_alpha``), with
    every setting's measured mean accepted length on the fit prompts beside the one alpha predicts."""
    ok = [r for (phase, *_), r in measured.items() if phase == "fit" and r["status"] == "ok" and r["S"]]
    try:
        alpha, steps = fit_alpha([(r["S"], r["accepted_hist"]) for r in ok if r["D"] == 1])
    except ValueError as e:
        raise ValueError(f"cost_model: {e}: no single-chain setting ran at a fitted batch; lower bench.fit_batch") from e
    per: dict[str, list[int]] = {}
    for r in ok:
        acc = per.setdefault(r["setting"], [0, 0, r["S"], r["D"]])
        acc[0] += sum(int(a) * n for a, n in r["accepted_hist"].items())
        acc[1] += sum(r["accepted_hist"].values())
    settings = {label: dict(measured=a / max(n, 1), predicted=expected_accepted(alpha, draft_len=S, num_drafts=D))
                for label, (a, n, S, D) in per.items()}
    log.info("%s: measured acceptance alpha %.3f over %d single-chain steps of the fit prompts (%s)", preset, alpha,
             steps, kind)
    return alpha, dict(model=preset, kind="acceptance", phase="fit", drafter=kind, set=pset, acceptance="measured",
                       alpha=alpha, steps=steps, per_setting=settings, fit_prompts=[i for i, _ in pools["fit"]],
                       status="ok")


def _tables(measured: dict, phase: str, column: str) -> dict[tuple[int, int], dict[str, float]]:
    """{(batch, seed): {setting: column}} of the settings that ran in ``phase``."""
    out: dict[tuple[int, int], dict[str, float]] = {}
    for (ph, seed, bsz, label), r in measured.items():
        if ph == phase and r["status"] == "ok":
            out.setdefault((bsz, seed), {})[label] = r[column]
    return out


def _score(preset: str, grid: list[Setting], alpha: float, measured: dict, *, fit_seed: int,
           measure_wall_s: float, acceptance: str = "oracle", extra: dict | None = None) -> Iterator[dict]:
    """Fit rows, then the three choosers scored at the held-out batches (``cost_model_scoring.heldout_rows``)."""
    pts = [dict(strategy=r["strategy"], batch=r["batch"], S=r["S"], D=r["D"], ms=r["ms_p50"])
           for (phase, *_), r in measured.items() if phase == "fit" and r["status"] == "ok"]
    model = fit(pts)
    for st, coef in model.coef.items():
        yield dict(model=preset, kind="fit", strategy=st, **coef, residual=model.residual[st], status="ok")
    fit_tables = {bsz: t for (bsz, _), t in _tables(measured, "fit", "tokens_per_s").items()}
    evals = _tables(measured, "eval", "tokens_per_s")
    missing = sorted({(bsz, seed) for (ph, seed, bsz, _) in measured if ph == "eval"} - set(evals))
    if missing:  # nothing ran there, not even standard decoding: no setting to compare
        raise RuntimeError(f"cost_model: no setting ran at held-out (batch, seed) {missing}; lower bench.heldout_batch")
    cands = [s for s in grid if s.label in model.calibration]  # settings the fit measured

    def policy(B: int, runs: set[str]) -> tuple[str, dict]:
        """The cost model's pick among the measured settings that run at ``B`` (the memory plan's verdict)."""
        fits = lambda s, _: s.label in runs  # noqa: E731
        choice, predicted = pick(model, B, alpha, cands, fits=fits)
        bare, _ = pick(model, B, alpha, cands, fits=fits, calibrated=False)
        return choice.label, dict(predicted_tokens_per_s=predicted, model_only_setting=bare.label)

    at_alpha = _tables(measured, "eval", "tokens_per_s_at_alpha") if acceptance == "oracle" else None
    rows = heldout_rows(fit=fit_tables, evals=evals, policy=policy, at_alpha=at_alpha,
                        common=dict(model=preset, alpha=alpha, acceptance=acceptance),
                        split_extra=dict(fit_seed=fit_seed, settings=[s.label for s in grid],
                                         measure_wall_s=measure_wall_s, **(extra or {})))
    for r in rows:
        if r["kind"] == "range":
            extra = "".join(f", {k} {r[k]}" for k in ("vs_best_fixed", "vs_nearest_fitted") if k in r)
            log.info("%s %s: geomean score %.3f over held-out batches %s, worst %.3f at %d%s", preset, r["chooser"],
                     r["geomean_score"], r["heldout_batches"], r["worst_score"], r["worst_batch"], extra)
    yield from rows
