"""``saguaro_fig6_backoff`` (seed 002, Fig. 6): throughput vs batch of asynchronous speculation with a slow backup
(the draft model drafts the missed round) and a fast one (prompt n-gram lookup), and Saguaro's batch-size-aware
backoff between them, acceptance MEASURED on the trained Mamba-2 pair (``bench/saguaro_e2e.py`` for the pair, the
prompts, the fitted fan-out and how a line is timed).

Per prompt set, temperature and batch, four lines run through the engine in the same run:

    async backup=draft    the slow backup
    async backup=ngram    the fast backup
    sync draft_model      input only: the draft model drafting S tokens on the critical path, and its acceptance
    sync png              input only: the n-gram predictor (match length 3, as the ngram backup) on the critical
                          path, and its acceptance

and a ``backoff`` row: the backup ``saguaro_topology.backoff_choice`` picks at that batch from these measured
quantities of the same batch, and the tokens/s of the line it picks (no third engine run: the backoff decides
which of the two measured lines runs at each batch):

    hit_rate      the async backup=draft line's cache hit rate (the drafter's counters: hits over rounds with a
                  cache, per sequence)
    verify_s      the median over timed steps of (step time - drafting time) of the async backup=ngram line: the
                  part of a round after the lookup and backup (the target's verification, the speculation beside
                  it; on CPU, where nothing overlaps, after it). The lookup, common to both backups, is left out
    slow_s        the median drafting time of the sync draft_model line (``Engine.draft_ms``): the draft model
                  drafting S tokens, what a missed round waits for with the slow backup
    fast_s        the median drafting time of the sync png line: the n-gram lookup. The sync lines run their
                  drafter every step, so their medians are the backups' costs; the async lines' drafting time
                  holds a backup only in rounds where a row missed (``engine/speculate.py``)
    draft_alpha   per-token acceptance of the draft's chains: ``saguaro_topology.fit_rate`` of the sync
                  draft_model line's accepted-length histogram (what a hit or a slow backup earns)
    fast_alpha    the same of the sync png line's histogram (what a fast backup earns)

The choice minimises backoff_choice's expected time per emitted token, (T_v + (1 - h^B) T_backup) / (B (h E_hit
+ (1 - h) E_backup)); the row carries both predictions, the measured seconds per token of both lines and
``threshold_batch`` (``backoff_threshold`` from that batch's quantities). Where the measured n-gram predictor is
both cheaper and at least as accurate as the draft, no trade-off exists: the row picks it and says so
(``backoff_note``); where it is dearer and no more accurate, the draft.

A ``backoff_summary`` row per set and temperature: ``flip_batch``, the first batch of the sweep where the choice
is the fast backup; ``crossing_batch``, the first where the measured async backup=ngram line beats async
backup=draft; ``agree`` (the same batch, or neither exists), and ``monotone`` (the choice flips at most once).
The model assumes what the engine does (``engine/speculate.py``: the backup runs only in a round where some row
missed) and more: hits independent across sequences (miss share 1 - h^B; the slow line's ``backup_share`` is the
engine's measured share beside it) and latencies that add. The summary tests the model against the engine.
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Iterator

from omegaconf import DictConfig

from ssmspec.bench.inputs import track
from ssmspec.bench.saguaro_e2e import (ASYNC_DRAFT, ASYNC_NGRAM, SYNC, SYNC_PNG, check_common, draft_lengths,
                                       fit_fanout, make_point, set_points, time_line)
from ssmspec.drafting import saguaro_topology as topo

log = logging.getLogger("ssmspec.bench.saguaro_backoff")

BACKOFF_LINES = (SYNC, SYNC_PNG, ASYNC_DRAFT, ASYNC_NGRAM)
INPUT_ONLY = {SYNC.label, SYNC_PNG.label}


def measured_inputs(rows: dict[str, dict], S: int) -> dict:
    """backoff_choice's inputs from one batch's rows (module doc), by line label."""
    ngram = rows[ASYNC_NGRAM.label]
    rest = [s - d for s, d in zip(ngram["samples_ms"], ngram["draft_samples_ms"])]
    return {"hit_rate": rows[ASYNC_DRAFT.label]["hit_rate"], "verify_s": statistics.median(rest) * 1e-3,
            "slow_s": rows[SYNC.label]["draft_ms"] * 1e-3, "fast_s": rows[SYNC_PNG.label]["draft_ms"] * 1e-3,
            "draft_alpha": topo.fit_rate(topo.depth_law_from_hist(rows[SYNC.label]["accepted_hist"], S)),
            "fast_alpha": topo.fit_rate(topo.depth_law_from_hist(rows[SYNC_PNG.label]["accepted_hist"], S)), "S": S}


def predicted(inputs: dict, batch: int) -> dict:
    """backoff_choice's expected seconds per emitted token with each backup (``seconds_per_token``)."""
    x = inputs
    e_cache = topo.expected_tokens(x["draft_alpha"], x["S"])
    kw = dict(hit_rate=x["hit_rate"], batch=batch, verify_s=x["verify_s"], cache_tokens=e_cache)
    return {"predicted_s_per_token_slow": topo.seconds_per_token(**kw, backup_s=x["slow_s"], backup_tokens=e_cache),
            "predicted_s_per_token_fast": topo.seconds_per_token(
                **kw, backup_s=x["fast_s"], backup_tokens=topo.expected_tokens(x["fast_alpha"], x["S"]))}


def pick(inputs: dict, batch: int) -> dict:
    """The backup at ``batch`` (module doc): ``backoff_choice`` where the two trade speed for acceptance."""
    x = inputs
    pred = predicted(x, batch)
    if x["fast_s"] <= x["slow_s"] and x["fast_alpha"] >= x["draft_alpha"]:
        return {**pred, "choice": "fast", "threshold_batch": 1, "backoff_note": "the n-gram backup measured both "
                "cheaper and at least as accurate as the draft: it wins at every batch"}
    if x["fast_s"] >= x["slow_s"] and x["fast_alpha"] <= x["draft_alpha"]:
        return {**pred, "choice": "slow", "threshold_batch": None, "backoff_note": "the n-gram backup measured no "
                "cheaper and no more accurate than the draft: the draft wins at every batch"}
    if x["fast_s"] > x["slow_s"]:
        return {**pred, "choice": None, "threshold_batch": None, "backoff_note": "the n-gram backup measured dearer "
                "and more accurate than the draft: backoff_choice's roles do not apply"}
    c = topo.backoff_choice(batch=batch, **{k: x[k] for k in ("hit_rate", "verify_s", "slow_s", "fast_s",
                                                               "draft_alpha", "fast_alpha", "S")})
    return {**pred, "choice": c.backup, "threshold_batch": c.threshold_batch, "backoff_note": None}


def backoff_row(rows: dict[str, dict], head: dict, S: int, batch: int) -> dict:
    bad = [label for label, r in rows.items() if r["status"] != "ok" or (r["drafter"] == "async_draft"
                                                                          and r["hit_rate"] is None)]
    row = {**head, "kind": "backoff", "line": "backoff", "batch": batch}
    if bad:
        return {**row, "status": "skipped", "reason": f"no measurement of {bad} at this batch (out of memory, or no "
                                                      f"round with a cache: raise bench.iters)"}
    inputs = measured_inputs(rows, S)
    choice = pick(inputs, batch)
    picked = {"slow": ASYNC_DRAFT.label, "fast": ASYNC_NGRAM.label}.get(choice["choice"])
    if picked is None:
        return {**row, "status": "skipped", "reason": choice["backoff_note"], **inputs}
    slow, fast = rows[ASYNC_DRAFT.label], rows[ASYNC_NGRAM.label]
    return {**row, "status": "ok", **inputs, **choice, "picked": picked, "tokens_per_s": rows[picked]["tokens_per_s"],
            "measured_s_per_token_slow": 1 / slow["tokens_per_s"], "measured_s_per_token_fast": 1 / fast["tokens_per_s"],
            "S": S, "fanout": slow["fanout"], "fanout_from": slow["fanout_from"]}


def summary_row(choices: list[dict], lines: list[dict], head: dict) -> dict:
    """Where the choice flips against where the measured lines cross (module doc)."""
    ok = sorted((r for r in choices if r["status"] == "ok"), key=lambda r: r["batch"])
    flips = [r["batch"] for r in ok if r["choice"] == "fast"]
    seq = [r["choice"] for r in ok]
    tps = {(r["line"], r["batch"]): r["tokens_per_s"] for r in lines if r["status"] == "ok"}
    batches = sorted({b for _, b in tps})
    cross = [b for b in batches if (ASYNC_DRAFT.label, b) in tps and (ASYNC_NGRAM.label, b) in tps
             and tps[ASYNC_NGRAM.label, b] > tps[ASYNC_DRAFT.label, b]]
    flip, crossing = (flips[0] if flips else None), (cross[0] if cross else None)
    at_flip = next((r["threshold_batch"] for r in ok if r["batch"] == flip), None)
    return {**head, "kind": "backoff_summary", "status": "ok" if ok else "skipped", "flip_batch": flip,
            "crossing_batch": crossing, "agree": flip == crossing, "threshold_at_flip": at_flip,
            "monotone": seq == sorted(seq, key=lambda c: c == "fast"), "choices": seq,
            "batches": [r["batch"] for r in ok]}


def run_backoff(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``saguaro_fig6_backoff`` (module doc)."""
    b = cfg.bench
    sizes, sets = check_common(b, "saguaro_fig6_backoff")
    Ss = draft_lengths(b, "saguaro_fig6_backoff")
    if len(Ss) != 1:
        raise ValueError(f"saguaro_fig6_backoff: bench.S takes one draft length here, got {Ss}; e.g. bench.S={Ss[0]} "
                         f"(saguaro_e2e sweeps a list)")
    S = Ss[0]
    for base, run in set_points(cfg, sets):
        if run is None:
            yield {**base, "kind": "line"}
            continue
        for T in [float(t) for t in b.temperature]:
            fan, fan_cols = fit_fanout(run.pair, run.fit, b, T)
            head = {**base, **fan_cols, "temperature": T}
            lines, choices = [], []
            for bsz in track(sizes, desc=f"saguaro_fig6_backoff {base['set']} T={T:g}"):
                p = make_point(run.target, run.draft, run.timed, bsz, b, temperature=T, fanout=fan, graph=run.graph)
                rows = {ln.label: time_line(p, ln, b, graph=run.graph, head={**head, "kind": "line"})
                        for ln in BACKOFF_LINES}
                for r in rows.values():
                    r["role"] = "input" if r["line"] in INPUT_ONLY else "line"
                choice = backoff_row(rows, head, S, bsz)
                if choice["status"] == "ok":
                    log.info("T=%.2f B=%d backoff picks %s (threshold %s): %.1f tokens/s", T, bsz, choice["picked"],
                             choice["threshold_batch"], choice["tokens_per_s"])
                lines += rows.values()
                choices.append(choice)
                yield from rows.values()
                yield choice
            yield summary_row(choices, lines, head)
