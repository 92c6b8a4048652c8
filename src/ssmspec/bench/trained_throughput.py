"""Tokens/s of the trained pair through the captured engine: the speed side of ``trained_acceptance``.

``bench/trained.py`` measures acceptance through eager ``generate()``; this module times the same pair the way
the end-to-end experiments time random weights (``bench/e2e.py``: ``Engine`` with CUDA graphs, ``throughput_row``
over ``warmup`` + ``iters`` steps from a prefilled batch), so that speculative decoding's speedup over
autoregressive decoding is measured with the acceptance the trained draft earns on real prompts, not designed.

Per prompt set of ``bench.throughput.sets`` and batch B of ``bench.throughput.batch``: the set's prompts in groups
of B (group g holds prompts g*B .. g*B+B-1, cycling through the set; each cut to its last ``prompt_len`` tokens,
left-padded), decoded greedily by the autoregressive line and by every ``(drafter, strategy, S)`` of
``bench.throughput.lines`` x ``draft_len`` (replay's ring holds ``bench.throughput.R`` entries). A line decodes
G = ceil(``bench.throughput.sequences`` / B) groups (null: G = 1, the first), each prefilled into a fresh engine
and timed over ``warmup`` + ``iters`` steps, and its one row pools them (``pool_groups``; ``groups``: G): one
group's few steps are too few to say a line's acceptance, and at batch 1 they are one sequence's. Models are
loaded in ``bench.throughput.dtype`` (auto: bf16 on CUDA, as the random-weight experiments run). Each row carries
``tokens_per_s`` (emitted tokens: accepted + 1 per sequence and step, over the steps' summed time, all groups'),
``speedup_vs_ar`` (over the autoregressive line of the same set and batch), ``mean_accepted`` and ``ref_match``
(the share of sequences whose tokens equal the autoregressive engine's greedy output at that dtype, each group
against its own). Captured rows also carry ``kernels_per_step``: the GPU kernels one step launches (drafting
included), from ``PROFILED_STEPS`` profiled steps after the last group's timed ones (``bench/kernel_profile.py``;
the engine's budget keeps room for them) -- a model this small is its launches, so this count is what its speedup
turns on. At the batches of ``bench.throughput.profile_batches`` they also carry ``kernel_table``: per kernel name,
launches and device microseconds per step and the share of the step's kernel time. With programmatic dependent
launch a kernel starts while the one before it runs and its time includes that wait, so the times overlap and do
not split the step's wall time; ``SSMSPEC_PDL=off`` gives times that do.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from ssmspec import config as C
from ssmspec.bench.designed import designed_fields
from ssmspec.bench.e2e import _is_oom, throughput_row
from ssmspec.bench.kernel_profile import profile_steps
from ssmspec.bench.prompt_groups import pad_group
from ssmspec.bench.steps_replay import release
from ssmspec.bench.real_drafters import measured_drafter
from ssmspec.bench.timing import summarize, wall_check
from ssmspec.strategies import SpecConfig

log = logging.getLogger("ssmspec.bench.trained")

LINE_KEYS = {"drafter", "strategy"}
PROFILED_STEPS = 2  # within the two steps of slack that _horizon leaves after the timed ones
TABLE_TOP = 25  # kernels in a row's kernel_table (the longest first)
DRAFTERS = ("draft_model", "png", "mtp")


def check_throughput(t: DictConfig) -> None:
    """One ValueError naming the fix for a ``bench.throughput`` block that cannot run."""
    for line in t.lines:
        unknown = set(line) - LINE_KEYS
        if unknown or line.get("drafter") not in DRAFTERS or not line.get("strategy"):
            raise ValueError(f"bench.throughput.lines: {OmegaConf.to_container(line)} must be {{drafter: "
                             f"{' | '.join(DRAFTERS)}, strategy: <a speculative strategy>}}")
    if not t.batch or min(int(x) for x in t.batch) < 1 or not t.draft_len or min(int(s) for s in t.draft_len) < 1:
        raise ValueError("bench.throughput.batch and bench.throughput.draft_len must be non-empty lists of ints >= 1")
    if int(t.iters) < 1 or int(t.warmup) < 0:
        raise ValueError("bench.throughput.iters must be >= 1 and warmup >= 0")
    n = t.get("sequences")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"bench.throughput.sequences must be null (one group of prompts per batch) or an int >= 1 "
                         f"(the sequences each line decodes per batch, in ceil(sequences / batch) groups), got {n!r}")


def groups(t: DictConfig, bsz: int) -> int:
    """Groups of ``bsz`` prompts a line decodes: ceil(``sequences`` / ``bsz``), one when ``sequences`` is null."""
    n = t.get("sequences")
    return 1 if n is None else math.ceil(int(n) / bsz)


def pool_groups(parts: list[tuple[dict, list[int]]]) -> dict:
    """One row of the groups one engine decoded. ``parts``: per group, its ``throughput_row`` and the accepted
    drafts of its every timed (sequence, step). Counts, step samples and loop wall clocks are summed over the
    groups, and every mean, rate and summary is made again from the sums (one group: its row, plus ``groups``)."""
    rows = [r for r, _ in parts]
    accepted = [a for _, acc in parts for a in acc]
    samples = [ms for r in rows for ms in r["samples_ms"]]
    emitted, seconds = sum(r["tokens_emitted"] for r in rows), sum(samples) * 1e-3
    row = {**rows[0], **summarize(samples), "samples_ms": samples,
           **wall_check(samples, sum(r["loop_wall_ms"] for r in rows)), "groups": len(rows),
           "mean_accepted": sum(accepted) / len(accepted) if accepted else 0.0,
           "accepted_hist": {str(k): v for k, v in sorted(Counter(accepted).items())}}
    row.update(tokens_emitted=emitted, tokens_per_s=emitted / seconds,
               tokens_per_s_wall=emitted / (row["loop_wall_ms"] * 1e-3), tokens_per_step=emitted / len(accepted),
               ref_match=sum(r["ref_match"] for r in rows) / len(rows))  # every group holds as many sequences
    row.update(designed_fields(expected=row["expected_accepted"], accepted=accepted, seconds=seconds,
                               tokens_per_s=row["tokens_per_s"]))
    if "draft_samples_ms" in row:  # bench/steps.py: draft_fields
        ms = [x for r in rows for x in r["draft_samples_ms"]]
        q = summarize(ms)
        row.update(draft_samples_ms=ms, draft_ms=q["ms_p50"], draft_ms_p90=q["ms_p90"],
                   draft_call_ms=q["ms_p50"] / row["draft_calls"])
    return row


def _horizon(t: DictConfig) -> int:
    """New tokens every engine may emit: all timed steps at the longest chain, plus two steps (the profiled ones)."""
    return (int(t.warmup) + int(t.iters) + 2) * (max(int(s) for s in t.draft_len) + 1)


def throughput_rows(entry, manifest: dict, names: tuple[str, str], sets: dict, b: DictConfig, cfg: DictConfig,
                    base: dict) -> Iterator[dict]:
    """Rows of ``kind: throughput`` (module doc). ``entry``: the train cache entry; ``names``: (target, draft)
    of the manifest; ``sets``: set name -> its prompts (``PromptSet.prompts``, ``prompt_len`` tokens each)."""
    from ssmspec.engine import Engine
    from ssmspec.engine.generate import generate
    from ssmspec.models.loading import load_model

    t = b.throughput
    check_throughput(t)
    device = str(cfg.device)
    dtype = C.resolve_dtype(str(t.get("dtype", "auto")), device)
    graph = C.use_cuda_graph(t.get("cuda_graph", "auto"), device)
    Tp, H, warmup, iters = int(t.prompt_len), _horizon(t), int(t.warmup), int(t.iters)
    profiled = {int(x) for x in t.get("profile_batches") or []}
    models = manifest["models"]
    target = load_model(entry / models[names[0]]["path"], device=device, dtype=dtype)
    draft = load_model(entry / models[names[1]]["path"], device=device, dtype=dtype)
    ngram = OmegaConf.to_container(b.png)
    head = {**base, "kind": "throughput", "dtype": C.dtype_name(dtype), "prompt_len": Tp,
            "timing": "cuda_graph" if graph else "eager"}
    for set_name in t.sets:
        texts = sets.get(str(set_name))
        if not texts:
            yield {**head, "set": str(set_name), "status": "skipped",
                   "reason": f"prompt set {set_name!r} is not loaded (bench.sets lists the sets; HumanEval needs "
                             f"`make data`)"}
            continue
        for bsz in [int(x) for x in t.batch]:
            G = groups(t, bsz)
            samples = [[texts[(g * bsz + i) % len(texts)][-Tp:] for i in range(bsz)] for g in range(G)]
            padded = [pad_group(sample, Tp, target.cfg.pad_token_id, device) for sample in samples]
            references = [generate(target, sample, max_new_tokens=H, strategy="autoregressive",
                                   cuda_graph=graph).sequences for sample in samples]
            release(device)
            ar_tps = None
            todo = [("none", "autoregressive", 0)] + [(str(ln.drafter), str(ln.strategy), int(S))
                                                       for S in t.draft_len for ln in t.lines]
            for dname, strategy, S in todo:
                row_head = {**head, "set": str(set_name), "batch": bsz, "line": f"{strategy} + {dname}" if S else
                            "autoregressive", "drafter": dname, "S": S, "groups": G}
                eng = None
                try:
                    parts, spec = [], SpecConfig(draft_len=S, buffer_size=int(t.get("R", 32)))
                    for (ids, valid), sample, reference in zip(padded, samples, references):
                        # a fresh engine a group: a captured engine's graphs read its drafter's buffers, which a
                        # second prefill allocates anew (replaying them read freed memory on the GPU); the last
                        # group's engine is dropped before the next one allocates
                        eng = None
                        drafter = measured_drafter(dname, target=target, draft=draft, draft_len=S,
                                                   **(ngram if dname == "png" else {})) if S else None
                        eng = Engine(target, batch=bsz, prefill_len=Tp, max_new_tokens=H, strategy=strategy,
                                     drafter=drafter, spec=spec, cuda_graph=graph)
                        eng.prefill(ids, valid, sample)
                        part = throughput_row(eng, warmup=warmup, iters=iters, reference=reference,
                                              oracle_alpha=None, **row_head)
                        parts.append((part, [a for step in eng.accepted for a in step]))
                    row = pool_groups(parts)
                    if eng.graphed:  # what a captured step launches (profiled after the timed steps)
                        row["kernels_per_step"], table = profile_steps(eng, steps=PROFILED_STEPS, top=TABLE_TOP)
                        if bsz in profiled:
                            row["kernel_table"] = table
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not _is_oom(e):
                        raise
                    row = {**row_head, "status": "oom", "reason": str(e).splitlines()[0]}
                del eng
                release(device)
                if row["status"] == "ok":
                    if not S:
                        ar_tps = row["tokens_per_s"]
                    row["speedup_vs_ar"] = row["tokens_per_s"] / ar_tps if ar_tps else None
                    log.info("throughput %s B=%d x%d %-28s %8.0f tokens/s (%.2f accepted, %.2fx AR, ref_match "
                             "%.2f)", set_name, bsz, G, row["line"] + (f" S={S}" if S else ""), row["tokens_per_s"],
                             row["mean_accepted"], row["speedup_vs_ar"] or 1.0, row["ref_match"])
                yield row
