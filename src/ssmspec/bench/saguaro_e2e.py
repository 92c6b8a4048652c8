"""Asynchronous speculation end to end on the trained pair (seed 002, issue 25 item 5): ``saguaro_e2e``, and the
pieces ``saguaro_fig6_backoff`` (``bench/saguaro_backoff.py``) shares with it.

Lines, each timed through the engine (``Engine`` + ``bench.e2e.throughput_row``: the captured decode steps on
CUDA, eager steps on CPU, ``warmup`` untimed steps then ``iters`` timed ones from a prefilled batch):

    autoregressive        the target alone (``drafter: none``)
    sync draft_model      synchronous speculation: the draft model drafts a chain of S on the critical path
    async backup=draft    ``async_draft``: the speculation cache filled while the target verifies; a miss drafts
                          synchronously with the draft model (the same draft, the same S)
    async backup=ngram    ``async_draft`` whose misses take a prompt n-gram lookup instead
    async ..., draft on D the two async lines with the draft on device D of its own (``bench.draft_devices``: the
                          target's GPU is ``same``; e.g. ``cuda:1``, seed 002's setting): the speculation runs on
                          the second GPU while the first verifies (``engine/speculate.py``); rows ``skipped`` where
                          the machine has no such GPU

Acceptance is MEASURED: a trained pair (``bench.family``: ``mamba2`` by default; a hybrid pair's attention draft
works too, ``drafting/async_kv.py``) of the train run ``bench.train`` (``tiny`` on CPU, ``gpu`` on the GPU profile; trained on
first use, ``bench/trained.py``) decodes real prompts: HumanEval's and held-out validation files' (``bench.sets``),
each cut to its last ``prompt_len`` tokens. The prompts of a set split in two halves. On the first the
speculation cache's fan-out is fitted (``bench.fanout: optimal``): synchronous speculation decodes it eagerly
through ``generate()`` recording every round's verdict and the draft's logits (``saguaro_cache.record_rounds``),
and ``saguaro_topology.optimal_fanout`` picks the fan-out of ``bench.budget`` branches that maximises the hit
rate of those rounds (``saguaro_cache.fit_topologies``), once per set and temperature; a list instead is a
stated fan-out used as given. Rows say which (``fanout_from``). The timed batches hold the second half's
prompts, cycled up to the batch size, so the fan-out is never scored on the prompts it was fitted on.

``bench.S`` is the draft length of every speculative line, or a list of them: each draft length is a group of
rows with every line (autoregressive too, timed again), its own fitted fan-out, and ``sweep_S`` naming it; the
speedups compare lines of one group only.

Per set, draft length, temperature (0: greedy; > 0: speculative sampling, seeded) and batch, each row carries
``tokens_per_s`` (emitted tokens, accepted + 1 per sequence and step, over the summed step times), ``ms_p50`` /
``ms_p90`` (step time), ``mean_accepted`` and ``accepted_hist``, ``draft_ms`` (the drafting part of each step:
``Engine.draft_ms``, the draft graph on the critical path -- for the async lines the cache lookup and, in a
round where some row missed, the backup (``engine/speculate.py``); ``draft_ms_p90`` beside it), ``hit_rate``
(async lines: hits over the rounds that had a cache, from the drafter's device counters ``hit_counts()``: every
round of the run after the first, warm-up rounds included, per sequence), ``backup_share`` (the share of the
run's steps whose backup ran because some row missed: the engine's count), ``speedup_vs_ar`` and, for the
async lines, ``speedup_vs_sync`` (ratios of tokens/s measured in
the same run, same set, temperature and batch). Greedy rows carry ``ref_match`` (the share of sequences equal to
the target's autoregressive greedy output of the same prompts, computed once per set and batch) and ``exact``
(``ref_match == 1``): greedy verification is lossless, so in float32 (CPU) every line must be exact
(tests/pipeline/test_saguaro_e2e.py asserts it); in bf16 a near-tie argmax may flip, and the row says so.

On CPU the steps run eagerly and the draft's speculation runs before the target's verification in the same
thread: no overlap exists there, so the async lines pay speculation on top of the step; CPU rows say how the
loop behaves, not where overlap pays (that is the GPU profile's question).

No oracle rows. The oracle drafter (``drafting/oracle.py``) designs acceptance on random weights by corrupting the
target's own continuation; the speculation cache's hit rate is a different quantity, whether the target's bonus
token is among the draft's top candidates at the verdict's depth, a property of the draft's predictions that
random weights do not have (their draft's candidates never rank the target's token) and the oracle has no logits
to rank. A row with a designed hit rate would have to design that rank law too: a cost model, not a measurement
of this cache, so none is made.
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from ssmspec import config as C
from ssmspec.bench.e2e import _is_oom, throughput_row
from ssmspec.bench.inputs import track
from ssmspec.bench.prompt_groups import pad_group
from ssmspec.bench.real_drafters import measured_drafter
from ssmspec.bench.saguaro_cache import fit_topologies, record_rounds
from ssmspec.bench.steps_replay import release
from ssmspec.bench.timing import summarize
from ssmspec.bench.trained import Pair, families, humaneval_set, load_pair, train_run, validation_set
from ssmspec.drafting import saguaro
from ssmspec.drafting import saguaro_topology as topo
from ssmspec.strategies import SpecConfig
from ssmspec.verify.distributions import SamplingConfig

log = logging.getLogger("ssmspec.bench.saguaro_e2e")

SETS = {"validation": validation_set, "humaneval": humaneval_set}
NGRAM = 3  # the ngram backup's match length (drafting/async_draft.py) and that of the sync png line (fig6)


@dataclass(frozen=True)
class Line:
    label: str  # the row's ``line``
    drafter: str  # none | draft_model | png | async_draft
    backup: str | None = None  # async_draft only: draft | ngram
    draft_device: str | None = None  # async_draft only: a device of its own for the draft (None: the target's)

    def on(self, device: str) -> "Line":
        """This async line with the draft on ``device``."""
        return Line(f"{self.label}, draft on {device}", self.drafter, self.backup, device)


AR = Line("autoregressive", "none")
SYNC = Line("sync draft_model", "draft_model")
SYNC_PNG = Line("sync png", "png")
ASYNC_DRAFT = Line("async backup=draft", "async_draft", "draft")
ASYNC_NGRAM = Line("async backup=ngram", "async_draft", "ngram")
E2E_LINES = (AR, SYNC, ASYNC_DRAFT, ASYNC_NGRAM)


# checks -------------------------------------------------------------------------------------------------------
def check_common(b: DictConfig, what: str) -> tuple[list[int], list[str]]:
    """One ValueError naming the fix for settings that cannot run, before anything trains; returns the batches
    and the prompt sets."""
    sizes = [int(x) for x in b.batch] if b.batch is not None else []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{what}: bench.batch needs a non-empty list of batch sizes >= 1, got {sizes}; e.g. "
                         f"bench.batch=[1,2]")
    draft_lengths(b, what)
    if int(b.num_prompts) < 2 or int(b.prompt_len) < 1:
        raise ValueError(f"{what}: need bench.num_prompts >= 2 (the first half fits the fan-out, the second is timed) "
                         f"and bench.prompt_len >= 1; got {b.num_prompts}, {b.prompt_len}")
    if int(b.iters) < 1 or int(b.warmup) < 0 or int(b.fit_batch) < 1 or int(b.fit_new_tokens) < 2:
        raise ValueError(f"{what}: need bench.iters >= 1, bench.warmup >= 0, bench.fit_batch >= 1 and "
                         f"bench.fit_new_tokens >= 2")
    for T in b.temperature:
        SamplingConfig(temperature=float(T))  # a negative temperature fails here
    if not list(b.temperature):
        raise ValueError(f"{what}: bench.temperature needs at least one temperature, e.g. [0.0]")
    for S in draft_lengths(b, what):
        fanout_spec(with_S(b, S))
    draft_devices(b)
    sets = [str(s) for s in b.sets]
    if not sets or set(sets) - set(SETS):
        raise ValueError(f"{what}: bench.sets lists prompt sets of {list(SETS)}, got {sets}")
    return sizes, sets


def draft_lengths(b: DictConfig, what: str = "saguaro_e2e") -> list[int]:
    """``bench.S``: one draft length, or a list of them (each a group of rows with every line, ``sweep_S``)."""
    raw = OmegaConf.to_container(b.S) if OmegaConf.is_list(b.S) else [b.S]
    try:
        Ss = [int(s) for s in raw]
    except (TypeError, ValueError):
        Ss = []
    if not Ss or min(Ss) < 1 or len(set(Ss)) != len(Ss):
        eg = "bench.S=[4] or bench.S=[4,8]" if OmegaConf.is_list(b.S) else "bench.S=4"  # the type the file declares
        raise ValueError(f"{what}: bench.S (drafts per round) is a draft length >= 1 or a list of distinct ones, "
                         f"got {raw}; e.g. {eg}")
    return Ss


def with_S(b: DictConfig, S: int) -> DictConfig:
    """``b`` with ``bench.S`` set to the one draft length ``S`` (the settings one group of rows runs with)."""
    c = OmegaConf.to_container(b, resolve=True)
    c["S"] = int(S)
    return OmegaConf.create(c)


def draft_devices(b: DictConfig) -> list[str]:
    """``bench.draft_devices``: where the async lines' draft runs, ``same`` (the target's GPU, its own stream) and
    devices of its own such as ``cuda:1``; a malformed name fails here (a missing GPU skips its rows instead)."""
    devs = [str(d) for d in b.get("draft_devices", ["same"])]
    if not devs:
        raise ValueError("bench.draft_devices needs at least one entry, e.g. [same] or [same, cuda:1]")
    for d in devs:
        if d != "same" and (not d.startswith("cuda:") or not d[5:].isdigit()):
            raise ValueError(f"bench.draft_devices: {d!r} is neither 'same' nor a GPU such as cuda:1")
    return devs


def fanout_spec(b: DictConfig) -> tuple[int, ...] | None:
    """``bench.fanout``: ``optimal`` (fitted, returns None; ``bench.budget`` checked) or a stated list of S + 1
    counts (checked: ``saguaro.check_fanout``)."""
    fan = b.fanout
    if isinstance(fan, str):
        if fan != "optimal":
            raise ValueError(f"bench.fanout is 'optimal' (fitted on the first half of the prompts) or a list of S + 1 "
                             f"branch counts, got {fan!r}")
        topo.check_budget(int(b.budget))
        return None
    return saguaro.check_fanout(list(OmegaConf.to_container(fan)), int(b.S))


# the pair, its prompts and the fitted fan-out -------------------------------------------------------------------
def pairs(cfg: DictConfig) -> Iterator[Pair]:
    b = cfg.bench
    result = train_run(b)
    for family in families(b):
        yield load_pair(b, str(cfg.device), family, result)


def prompt_halves(pair: Pair, b: DictConfig, name: str) -> tuple[list, list, str | None]:
    """(fit half, timed half, why not) of prompt set ``name`` (``bench/trained.py``)."""
    if name not in SETS:
        raise ValueError(f"bench.sets: unknown prompt set {name!r}; choose among {list(SETS)}")
    pset = SETS[name](pair, b)
    if pset.reason is not None:
        return [], [], pset.reason
    half = len(pset.prompts) // 2
    if half < 1:
        return [], [], f"prompt set {name} has {len(pset.prompts)} prompts; the fit and the timed batch need two"
    return pset.prompts[:half], pset.prompts[half:], None


def fit_fanout(pair: Pair, fit_prompts: list, b: DictConfig, temperature: float) -> tuple[tuple[int, ...], dict]:
    """The fan-out of the async lines and the columns that say where it came from (module doc)."""
    stated = fanout_spec(b)
    if stated is not None:
        return stated, {"fanout_from": "stated (bench.fanout)", "budget": sum(stated)}
    N = int(b.budget)
    sub = OmegaConf.create({"S": int(b.S), "batch": int(b.fit_batch), "seed": int(b.seed),
                            "new_tokens": int(b.fit_new_tokens), "strategy": str(b.strategy)})
    rounds = record_rounds(pair, fit_prompts, sub, temperature=temperature, keep=N)
    fan, _ = fit_topologies(rounds, N, N)["optimal"]
    fit_hit = float(rounds.hits(fan).float().mean()) if len(rounds.accepted) else None
    log.info("T=%.2f: optimal fan-out %s (budget %d) fitted on %d rounds, hit rate there %s", temperature, list(fan),
             N, len(rounds.accepted), fit_hit)
    return fan, {"fanout_from": "optimal_fanout fitted on the first half of the prompts", "budget": N,
                 "fit_rounds": len(rounds.accepted), "fit_prompts": len(fit_prompts), "fit_hit_rate": fit_hit}


# timing one line ----------------------------------------------------------------------------------------------
@dataclass
class Point:
    """One (set, temperature, batch) point: the models to time, the batch's prompts, its reference."""

    target: object
    draft: object
    sample: list  # bsz prompts (token lists)
    ids: torch.Tensor  # (B, Tp) left-padded
    valid: torch.Tensor  # (B, Tp)
    temperature: float
    fanout: tuple[int, ...]
    reference: list | None  # greedy: the target's autoregressive output of ``sample``
    drafts_on: dict | None = None  # draft device -> the draft model loaded there (the lines' ``draft_device``)


def timing_models(pair: Pair, b: DictConfig, device: str) -> tuple[object, object, torch.dtype]:
    """The pair in ``bench.dtype`` (auto: bf16 on CUDA, float32 on CPU): reloaded when that is not float32."""
    from ssmspec.models.loading import load_model

    dtype = C.resolve_dtype(str(b.dtype), device)
    if dtype == torch.float32:
        return pair.target, pair.draft, dtype
    models = pair.manifest["models"]
    return tuple(load_model(pair.entry / models[n]["path"], device=device, dtype=dtype) for n in pair.names) + (dtype,)


def horizon(b: DictConfig) -> int:
    """New tokens every engine may emit: every launched step at S + 1 tokens, plus slack."""
    return (max(int(b.warmup), 1) + int(b.iters) + 2) * (int(b.S) + 1)


def make_point(target, draft, prompts: list, bsz: int, b: DictConfig, *, temperature: float,
               fanout: tuple[int, ...], graph: bool) -> Point:
    from ssmspec.engine.generate import generate

    Tp = int(b.prompt_len)
    sample = [prompts[i % len(prompts)][-Tp:] for i in range(bsz)]
    ids, valid = pad_group(sample, Tp, target.cfg.pad_token_id, target.device)
    ref = None
    if temperature == 0.0:
        ref = generate(target, sample, max_new_tokens=horizon(b), strategy="autoregressive",
                       cuda_graph=graph).sequences
        release(str(target.device))
    return Point(target, draft, sample, ids, valid, temperature, fanout, ref)


def time_line(p: Point, line: Line, b: DictConfig, *, graph: bool, head: dict) -> dict:
    """One row: ``line`` at point ``p`` through the engine (module doc); ``status: oom`` where it does not fit."""
    from ssmspec.engine import Engine

    S, T, bsz, seed = int(b.S), p.temperature, len(p.sample), int(b.seed)
    spec_line = line.drafter != "none"
    row_head = {**head, "line": line.label, "drafter": line.drafter, "backup": line.backup, "S": S if spec_line else 0,
                "batch": bsz, "temperature": T,
                "fanout": list(p.fanout) if line.drafter == "async_draft" else None}
    opts: dict = {"draft_len": S}
    if line.drafter in ("draft_model", "async_draft"):
        opts.update(temperature=T, sample_seed=seed + 1)
    if line.drafter == "async_draft":
        opts.update(fanout=list(p.fanout), backup=line.backup, draft_device=line.draft_device)
        row_head.update(draft_device=line.draft_device or "same")
    if line.drafter == "png":
        opts.update(ngram=NGRAM)
    eng = None
    try:
        draft = p.drafts_on[line.draft_device] if line.draft_device else p.draft
        drafter = measured_drafter(line.drafter, target=p.target, draft=draft, **opts) if spec_line else None
        eng = Engine(p.target, batch=bsz, prefill_len=int(b.prompt_len), max_new_tokens=horizon(b),
                     strategy=str(b.strategy) if spec_line else "autoregressive", drafter=drafter,
                     spec=SpecConfig(draft_len=S, buffer_size=int(b.R)) if spec_line else None,
                     sampling=SamplingConfig(temperature=T, seed=seed), cuda_graph=graph)
        eng.prefill(p.ids, p.valid, p.sample)
        row = throughput_row(eng, warmup=int(b.warmup), iters=int(b.iters), reference=p.reference,
                             oracle_alpha=None, **row_head)
        if spec_line and "draft_ms" not in row:  # a drafter without a draft model (png): its drafting time too
            ms = eng.draft_ms()
            row.update(draft_samples_ms=ms, draft_ms=statistics.median(ms), draft_ms_p90=summarize(ms)["ms_p90"])
        if line.drafter == "async_draft":
            rounds, hits = drafter.hit_counts()
            backups = getattr(eng.speculation, "backups", None)  # rounds whose backup ran (a row missed)
            row.update(cache_rounds=rounds * bsz, cache_hits=sum(hits),
                       hit_rate=sum(hits) / (rounds * bsz) if rounds else None, backup_rounds=backups,
                       backup_share=backups / eng.launches if backups is not None and eng.launches else None)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
        row = {**row_head, "status": "oom", "reason": str(e).splitlines()[0]}
    del eng
    release(str(p.target.device))
    if line.draft_device:
        release(line.draft_device)
    if row["status"] == "ok":
        row["exact"] = row["ref_match"] == 1.0 if p.reference is not None and spec_line else None
        if not spec_line:
            row.update(draft_ms=0.0, acceptance="none")
        log.info("T=%.2f B=%d %-20s %9.1f tokens/s  %.2f accepted  draft %.3f ms  hit %s", T, bsz, line.label,
                 row["tokens_per_s"], row["mean_accepted"], row.get("draft_ms") or 0.0, row.get("hit_rate"))
    return row


def add_speedups(rows: list[dict]) -> None:
    """``speedup_vs_ar`` on every ok row and ``speedup_vs_sync`` on the async ones: ratios within ``rows`` (one
    set, temperature and batch of one run)."""
    tps = {r["line"]: r["tokens_per_s"] for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        ar, sync = tps.get(AR.label), tps.get(SYNC.label)
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar if ar else None
        if r["drafter"] == "async_draft":
            r["speedup_vs_sync"] = r["tokens_per_s"] / sync if sync else None


@dataclass
class SetRun:
    """One pair's prompt set, ready to time: the models (in ``bench.dtype``), the fit and timed halves."""

    pair: Pair
    target: object
    draft: object
    graph: bool
    fit: list
    timed: list


def set_points(cfg: DictConfig, sets: list[str]) -> Iterator[tuple[dict, SetRun | None]]:
    """Per pair and prompt set: (columns every row carries, the set ready to time); None with a skipped row's
    columns where the set is not on disk."""
    b = cfg.bench
    device = str(cfg.device)
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    for pair in pairs(cfg):
        target, draft, dtype = timing_models(pair, b, device)
        for name in sets:
            fit, timed, reason = prompt_halves(pair, b, name)
            base = {**pair.info, "acceptance": "measured", "set": name, "dtype": C.dtype_name(dtype),
                    "timing": "cuda_graph" if graph else "eager", "strategy": str(b.strategy),
                    "overlap": "speculate on a side CUDA stream" if graph else "none: eager, speculate then verify",
                    "prompt_len": int(b.prompt_len), "prompts_timed": len(timed), "R": int(b.R)}
            if reason is not None:
                yield {**base, "status": "skipped", "reason": reason}, None
                continue
            yield base, SetRun(pair, target, draft, graph, fit, timed)


def run_e2e(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``saguaro_e2e`` (module doc): one row per set, draft length, temperature, batch and
    line."""
    b = cfg.bench
    sizes, sets = check_common(b, "saguaro_e2e")
    Ss = draft_lengths(b)
    for base, run in set_points(cfg, sets):
        base["kind"] = "e2e"
        if run is None:
            yield base
            continue
        drafts_on, missing = remote_drafts(run, b, str(cfg.device))
        for S in Ss:
            bS = with_S(b, S)
            for T in [float(t) for t in b.temperature]:
                fan, fan_cols = fit_fanout(run.pair, run.fit, bS, T)
                head = {**base, **fan_cols, "sweep_S": S}
                for bsz in track(sizes, desc=f"saguaro_e2e {base['set']} S={S} T={T:g}"):
                    p = make_point(run.target, run.draft, run.timed, bsz, bS, temperature=T, fanout=fan,
                                   graph=run.graph)
                    p.drafts_on = drafts_on
                    rows = [time_line(p, line, bS, graph=run.graph, head=head) for line in E2E_LINES]
                    for dev in drafts_on:
                        rows += [time_line(p, line.on(dev), bS, graph=run.graph,
                                           head={**head, "overlap": f"speculate on {dev} (the draft's own GPU) while "
                                                 f"{cfg.device} verifies"}) for line in (ASYNC_DRAFT, ASYNC_NGRAM)]
                    add_speedups(rows)
                    yield from rows
        yield from ({**base, "line": line.on(dev).label, "drafter": "async_draft", "backup": line.backup,
                     "draft_device": dev, "status": "skipped", "reason": why}
                    for dev, why in missing.items() for line in (ASYNC_DRAFT, ASYNC_NGRAM))


def remote_drafts(run: "SetRun", b: DictConfig, device: str) -> tuple[dict, dict]:
    """({draft device: the draft model loaded there}, {draft device: why its rows are skipped}) for the
    devices of ``bench.draft_devices`` other than ``same``."""
    from ssmspec.drafting.draft_device import resolve_draft_device
    from ssmspec.models.loading import load_model

    have, missing = {}, {}
    for dev in draft_devices(b):
        if dev == "same":
            continue
        try:
            resolve_draft_device(dev, torch.device(device))
        except ValueError as e:
            missing[dev] = str(e)
            continue
        entry = run.pair.manifest["models"][run.pair.names[1]]
        have[dev] = load_model(run.pair.entry / entry["path"], device=dev, dtype=run.draft.dtype)
    return have, missing
