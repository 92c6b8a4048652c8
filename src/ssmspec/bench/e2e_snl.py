"""Snakes and Ladders end to end (seed 001): ``snl_tab5_e2e`` (Table 5) and ``snl_fig4_multiseq`` (Fig. 4).

Both decode real prompt sets (``data=``: conf/data/{mtbench,gsm8k,humaneval,synthetic,benchmarks}.yaml; local
copies only, ``python -m ssmspec.data.fetch`` puts them there) through the engine (``ssmspec.engine.Engine``,
the captured step generate() replays). Prompts are tokenised with the model's tokenizer (byte-level on random
weights), left-padded to the longest prompt of the set and decoded in groups of ``batch`` for exactly
``new_tokens`` tokens each (no EOS: every line emits the same number of tokens). One engine per line is
built once, warmed up on the first group (``bench.warmup`` groups, untimed: on CUDA the first step captures the
graphs), and re-prefilled for every group, so the timed steps are graph replays.

Throughput is decode tokens per second: the tokens the decode steps emit (the first token comes from the
prefill) over the summed step times (CUDA events around each step; perf_counter on CPU), from the first decode
step to the one that finishes the group's last sequence. Prefill is timed apart (``prefill_ms_p50``): it is the
same for every line and seed 001's numbers are decode rates (70 tokens/s = its 14.1 ms step). Per line the
rows carry the group times (``samples_ms``, one per group: the end-to-end latency of ``new_tokens`` tokens),
the step times summary, ``speedup`` = tokens/s over the autoregressive line of the same set and run.

Acceptance, stated (issue 9). Drafts are D chains of S tokens from one of two drafters (``bench.drafter``;
``auto``: ``png`` with ``checkpoint=``, ``oracle`` on random weights), and lines are named by the drafter that
drafted: ``joint_attainment + PNG(6,2)`` or ``joint_attainment + oracle(6,2)``:

- ``png`` (``drafting/png.py``): the prompt n-gram lookup on the device; rows say ``acceptance: measured``.
- ``oracle`` (``drafting/oracle.py``): every draft token is the target's own next greedy token with
  probability alpha, independently per token and per chain; the truth is the autoregressive line's output for
  the same group (greedy verification is lossless, so the speculative run emits that same continuation), which
  runs S tokens past the budget for it (the last step's drafts look that far; only its first new_tokens - 1
  steps are counted). A chain
  then accepts P(a >= k) = alpha^k, and the best of D chains E[a] = sum_k 1 - (1 - alpha^k)^D
  (``expected_accepted_chains``). Rows say ``acceptance: oracle`` and alpha. By default the oracle is *forced*
  (``bench.oracle: forced``, as in replay_fig8_throughput): greedy verification accepts exactly its kept tokens,
  so a near-tie argmax that random bf16 weights flip between the autoregressive and a speculative call cannot
  drag the acceptance below alpha's; ``bench.oracle: compare`` verifies by token comparison (the same on fp32).

Designed beside measured (``bench/designed.py``): oracle rows carry ``tokens_per_s_designed`` = sequence-steps x
(1 + E[a]) over the summed step times and ``speedup_designed``, the measured ``mean_accepted`` beside E[a]
(``expected_accepted``), ``accepted_gap`` and ``accepted_within`` (2%). The oracle's draws are Weyl sequences
(``bench.draws: weyl``, ``drafting/weyl.py``) that go on across the groups an engine decodes, and ``bench.groups:
auto`` decodes enough groups that every oracle line runs the steps its law needs (``weyl.steps_needed`` x
(1 + E[a]) tokens a sequence, 10% margin; a fixed token budget, so the step count is set before the run and
varies only with the draws). Measured tokens/s counts emitted tokens: the last step of each sequence is cut at
the budget, so it sits about E[a] / 2 / new_tokens below the designed one even where the acceptance matches.

Wall clock (``timing.wall_check``, as step rows): ``loop_wall_ms`` is the host's clock over every group's decode
loop, from the first launch to the report of its last counted step, beside ``steps_sum_ms``, the sum of the
step events; ``wall_flag`` marks a row where they differ by more than 2% (the device sat idle between steps).

Every speculative row records ``mean_accepted`` and ``accepted_hist`` as the engine's reports saw them (running
sequences only) and ``ref_match``: the share of sequences whose output equals the autoregressive line's (1.0
unless a near-tie argmax flipped under other numerics). A set that is not on disk is a ``status: skipped`` row
naming the fetch command; an engine that cannot fit is a ``status: skipped`` row naming both byte counts.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from ssmspec import config as C
from ssmspec.bench.designed import ACCEPTED_TOLERANCE, designed_fields
from ssmspec.bench.e2e import _is_oom, oracle_draws, oracle_forced, plan_point
from ssmspec.bench.inputs import track
from ssmspec.bench.prompt_groups import Decoded, GroupOracle, PromptSet, decode, load_sets, pad_group
from ssmspec.bench.steps_replay import model_for, release
from ssmspec.bench.timing import summarize, wall_check
from ssmspec.data.prompts import set_configs
from ssmspec.data.tokenizers import load_tokenizer
from ssmspec.drafting import weyl
from ssmspec.drafting.oracle import chain_parents, expected_accepted
from ssmspec.drafting.png import PromptNgram
from ssmspec.engine import Engine
from ssmspec.engine.memory import HEADROOM, fmt_bytes
from ssmspec.strategies import SpecConfig

log = logging.getLogger("ssmspec.bench.e2e_snl")

SPEC_STRATEGIES = ("joint_attainment", "activation_replay")
DRAFTERS = ("auto", "oracle", "png")
# Seed 001 Table 5 (Mamba-2, A10G, tokens/s): PNG(6, 2) with joint attainment / activation replay (ARP)
PAPER_TAB5 = {"autoregressive": {"mtbench": 70.36, "gsm8k": 70.37, "humaneval": 70.26},
              "joint_attainment": {"mtbench": 112.67, "gsm8k": 137.49, "humaneval": 133.64},
              "activation_replay": {"mtbench": 103.80, "gsm8k": 122.73, "humaneval": 120.66}}
PAPER_MEAN_SPEEDUP = {"joint_attainment": 1.82, "activation_replay": 1.64}


def expected_accepted_chains(alpha: float, S: int, D: int) -> float:
    """Mean accepted drafts of the best of D independent oracle chains of S tokens (greedy verification):
    P(max a >= k) = 1 - (1 - alpha^k)^D, summed over k = 1..S (``drafting.oracle.expected_accepted``). D = 1: the
    truncated geometric sum_k alpha^k; D = 0: no drafts."""
    return expected_accepted(alpha, draft_len=S, num_drafts=D) if D else 0.0


@dataclass
class Line:
    """One curve or table row: a strategy at D drafts x S (D = 0: autoregressive standard decode), named by the
    drafter that drafted: ``PNG(S,D)`` (the prompt n-gram drafter) or ``oracle(S,D)`` (D oracle chains of S)."""

    strategy: str
    drafts: int
    S: int
    drafter: str = "png"

    @property
    def label(self) -> str:
        name = "PNG" if self.drafter == "png" else self.drafter
        return "autoregressive" if not self.drafts else f"{self.strategy} + {name}({self.S},{self.drafts})"

    @property
    def spec(self) -> SpecConfig:
        return SpecConfig(draft_len=self.S, num_drafts=self.drafts) if self.drafts else SpecConfig()


def check_common(b: DictConfig, what: str) -> dict:
    """The knobs both experiments share, checked (ValueError naming the fix)."""
    strategies = [str(s) for s in b.strategies]
    bad = sorted(set(strategies) - set(SPEC_STRATEGIES))
    if not strategies or bad:
        raise ValueError(f"{what}: bench.strategies takes {', '.join(SPEC_STRATEGIES)}, got {strategies}")
    if str(b.drafter) not in DRAFTERS:
        raise ValueError(f"{what}: bench.drafter is one of {', '.join(DRAFTERS)}, got {b.drafter!r}")
    if not 0.0 <= float(b.alpha) <= 1.0:
        raise ValueError(f"{what}: bench.alpha is the oracle's per-token acceptance of each chain, in [0, 1]; "
                         f"got {b.alpha}")
    if int(b.S) < 1 or int(b.new_tokens) < 2 or int(b.ngram) < 1:
        raise ValueError(f"{what}: need bench.S >= 1, bench.ngram >= 1 and bench.new_tokens >= 2 (one from the "
                         f"prefill, the rest from decode steps); got S={b.S}, ngram={b.ngram}, "
                         f"new_tokens={b.new_tokens}")
    if not b.presets:
        raise ValueError(f"{what}: bench.presets is empty; name a model preset (e.g. bench.presets=[mamba2-2.7b])")
    return dict(strategies=strategies, S=int(b.S), new_tokens=int(b.new_tokens), warmup=int(b.warmup),
                alpha=float(b.alpha), ngram=int(b.ngram), forced=oracle_forced(b), draws=oracle_draws(b))


GROUP_MARGIN = 1.1  # auto groups: 10% more sequence-steps than the law asks for (the step count of a fixed token
#                     budget varies a little with the draws)


def steps_needed(s: dict, line: Line, batch: int) -> int | None:
    """Steps per sequence an oracle line's law asks for a 2% band on its mean accepted length (``drafting/weyl.py``:
    the Weyl rule, or the independent draws' count / batch); None for lines without oracle drafts."""
    if not line.drafts or line.drafter != "oracle":
        return None
    parents = chain_parents(line.S, line.drafts)
    keep = [s["alpha"]] * len(parents)
    if s["draws"] == "weyl":
        return weyl.steps_needed(parents, keep, batch=batch, tol=ACCEPTED_TOLERANCE)
    return math.ceil(weyl.iid_steps(parents, keep, tol=ACCEPTED_TOLERANCE) / batch)


def groups_for(b: DictConfig, s: dict, lines: list[Line], batch: int, what: str) -> int | None:
    """``bench.groups``: a number, null (every prompt of the set) or auto: enough groups of ``batch`` that every
    oracle line decodes the steps its law asks for (``steps_needed`` x (1 + E[a]) tokens a sequence, 10% margin);
    with a measured drafter auto decodes every prompt."""
    g = b.get("groups")
    if g is None:
        return None
    if str(g) != "auto":
        if int(g) < 1:
            raise ValueError(f"{what}: bench.groups is the number of batches per set (null: all; auto: the oracle's "
                             f"law decides), got {g}")
        return int(g)
    need = [(steps_needed(s, line, batch), expected_accepted_chains(s["alpha"], line.S, line.drafts))
            for line in lines if line.drafts and line.drafter == "oracle"]
    if not need:
        return None
    if s["draws"] != "weyl":
        raise ValueError(f"{what}: bench.groups=auto sizes the run by the oracle's Weyl draws; give "
                         f"bench.groups=<n> with bench.draws={s['draws']}")
    return max(math.ceil(GROUP_MARGIN * n * (1 + e) / (s["new_tokens"] - 1)) for n, e in need)


def drafter_kind(cfg: DictConfig) -> str:
    kind = str(cfg.bench.drafter)
    return ("png" if cfg.get("checkpoint") else "oracle") if kind == "auto" else kind


class Runner:
    """Decodes groups of one prompt set with one model, line by line (module doc)."""

    def __init__(self, cfg: DictConfig, model, preset: str, pset: PromptSet, *, batch: int, groups: int | None,
                 s: dict) -> None:
        self.cfg, self.model, self.preset, self.pset, self.s = cfg, model, preset, pset, s
        self.batch, self.kind = batch, drafter_kind(cfg)
        n = len(pset.prompts) // batch * batch  # the paper drops a last batch that is not full
        self.groups_asked = groups
        if groups is not None:
            n = min(n, groups * batch)
        self.groups = [pset.prompts[i:i + batch] for i in range(0, n, batch)]
        self.width = max((len(p) for g in self.groups for p in g), default=0)
        self.graph = C.use_cuda_graph(cfg.bench.get("cuda_graph", "auto"), str(cfg.device))
        self.reference: list[list[list[int]]] | None = None  # autoregressive output per group

    def base(self, line: Line) -> dict:
        spec = bool(line.drafts)
        oracle = spec and self.kind == "oracle"
        return dict(model=self.preset, set=self.pset.name, line=line.label, strategy=line.strategy,
                    drafts=line.drafts, S=line.S if spec else 0, batch=self.batch, groups=len(self.groups),
                    prompts=len(self.groups) * self.batch, prompt_len_max=self.width,
                    new_tokens=self.s["new_tokens"], dtype=C.dtype_name(self.model.dtype),
                    drafter=self.kind if spec else "none",
                    acceptance=("oracle" if oracle else "measured") if spec else "none",
                    alpha=self.s["alpha"] if oracle else None,
                    oracle=("forced" if self.s["forced"] else "compare") if oracle else None,
                    draws=self.s["draws"] if oracle else None, groups_asked=self.groups_asked,
                    expected_accepted=expected_accepted_chains(self.s["alpha"], line.S, line.drafts) if oracle else None,
                    steps_needed=steps_needed(self.s, line, self.batch),
                    ngram=self.s["ngram"] if spec and self.kind == "png" else None)

    def _drafter(self, line: Line):
        if not line.drafts:
            return None
        if self.kind == "png":
            return PromptNgram(ngram=self.s["ngram"], num_drafts=line.drafts, draft_len=line.S)
        return GroupOracle(p=self.s["alpha"], draft_len=line.S, num_drafts=line.drafts,
                           reference=self._padded_refs(0, line.S), vocab_size=self.model.cfg.vocab_size,
                           seed=int(self.cfg.seed), forced=self.s["forced"], draws=self.s["draws"])

    def _padded_refs(self, g: int, S: int) -> list[list[int]]:
        width = self.s["new_tokens"] + S + 1
        return [r + [r[-1]] * (width - len(r)) for r in self.reference[g]]

    def run(self, line: Line) -> dict:
        """Decode every group with one engine for ``line``; one row (status ok / skipped / oom)."""
        base = self.base(line)
        if not self.groups:
            return {**base, "status": "skipped", "reason": f"{self.pset.name} has {len(self.pset.prompts)} prompts, "
                    f"fewer than one batch of {self.batch}"}
        if line.drafts and self.kind == "oracle" and self.reference is None:
            raise RuntimeError("the autoregressive line runs first: it is the oracle's truth (bug)")
        fit, need, free = plan_point(self.model, line.strategy, batch=self.batch, prompt_len=self.width,
                                     new_tokens=self.s["new_tokens"], spec=line.spec)
        if not fit:
            return {**base, "status": "skipped", "planned_bytes": need,
                    "reason": f"needs {fmt_bytes(need)} beside the weights but {fmt_bytes(free)} are free "
                              f"(at most {HEADROOM:.0%} used)"}
        dev = self.model.device
        eng = None
        try:
            drafter = self._drafter(line)
            # the autoregressive line is the oracle's truth: it decodes S tokens past the budget (the drafts of the
            # last step look that far), and only its first new_tokens - 1 steps are counted
            budget = self.s["new_tokens"] + (self.s["S"] if not line.drafts and self.kind == "oracle" else 0)
            eng = Engine(self.model, batch=self.batch, prefill_len=self.width, max_new_tokens=budget,
                         strategy=line.strategy, drafter=drafter, spec=line.spec, cuda_graph=self.graph)
            # untimed warm-up decodes of the first group (on CUDA at least one: its first step captures the graphs)
            warm = max(self.s["warmup"], 1 if eng.graphed else 0)
            runs = []
            for i, g in enumerate([0] * warm + list(range(len(self.groups)))):
                if isinstance(drafter, GroupOracle):
                    drafter.reference = self._padded_refs(g, line.S)
                ids, valid = pad_group(self.groups[g], self.width, self.model.cfg.pad_token_id, dev)
                out = decode(eng, ids, valid, self.groups[g])
                if i >= warm:
                    runs.append(out if line.drafts else self._cut(out))
            row = self._row(base, eng, runs, need)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not _is_oom(e):
                raise
            row = {**base, "status": "oom", "planned_bytes": need, "reason": str(e).splitlines()[0]}
        del eng
        release(str(dev))
        return row

    def _cut(self, out: Decoded) -> Decoded:
        """An autoregressive decode counted up to the budget: new_tokens - 1 steps of one token per sequence
        (the whole output stays in ``full`` as the oracle's truth)."""
        n = self.s["new_tokens"]
        out.full = out.sequences
        out.sequences = [s[:n] for s in out.sequences]
        out.step_ms, out.accepted, out.emitted = out.step_ms[:n - 1], out.accepted[:(n - 1) * self.batch], \
            (n - 1) * self.batch
        out.step_wall_ms = out.step_wall_ms[:n - 1]
        return out

    def _row(self, base: dict, eng: Engine, runs: list[Decoded], need: int) -> dict:
        seqs = [s for r in runs for s in r.sequences]
        if not base["drafts"]:
            self.reference = [r.full for r in runs]
        n = self.s["new_tokens"]
        ref = [s[:n] for g in self.reference for s in g] if self.reference else seqs
        acc = [a for r in runs for a in r.accepted]
        steps = [t for r in runs for t in r.step_ms]
        emitted, seconds = sum(r.emitted for r in runs), sum(steps) * 1e-3
        group_ms = [sum(r.step_ms) for r in runs]
        hist = dict(sorted(Counter(acc).items())) if base["drafts"] else {}
        wall = sum(r.step_wall_ms[-1] for r in runs if r.step_wall_ms)  # each group's loop, to its last counted step
        expected = base["expected_accepted"] if base["drafts"] else 0.0
        return {**base, **summarize(group_ms), "samples_ms": group_ms, "status": "ok",
                "timing": "cuda_graph" if eng.graphed else "eager", "drafter_on_device": eng.drafter_on_device,
                "tokens_emitted": emitted, "decode_s": seconds, "tokens_per_s": emitted / seconds,
                **designed_fields(expected=expected, accepted=acc, seconds=seconds, tokens_per_s=emitted / seconds),
                **wall_check(steps, wall),
                "steps": len(steps), "step_ms_p50": summarize(steps)["ms_p50"],
                "tokens_per_step": emitted / sum(len(r.accepted) for r in runs),
                "prefill_ms_p50": summarize([r.prefill_ms for r in runs])["ms_p50"],
                "mean_accepted": sum(acc) / len(acc) if base["drafts"] else 0.0,
                "accepted_hist": {str(k): v for k, v in hist.items()},
                "ref_match": sum(a == b for a, b in zip(seqs, ref)) / len(seqs), "planned_bytes": need}


def _with_ar(row: dict, ar: dict | None) -> dict:
    """Add the autoregressive line's tokens/s and the speedups over it, measured and designed (the autoregressive
    row is its own)."""
    ar = row if not row["drafts"] else ar
    ok = row["status"] == "ok" and ar is not None and ar["status"] == "ok"
    row["ar_tokens_per_s"] = ar["tokens_per_s"] if ok else None
    row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"] if ok else None
    d = row.get("tokens_per_s_designed") if ok else None
    row["speedup_designed"] = d / ar["tokens_per_s"] if d is not None else None
    return row


def _log(row: dict) -> None:
    if row["status"] == "ok":
        log.info("%s %s B=%d %s: %.0f tokens/s (%.2f accepted, ref_match %.2f)", row["model"], row["set"],
                 row["batch"], row["line"], row["tokens_per_s"], row["mean_accepted"], row["ref_match"])
        if row["ref_match"] < 1.0 and row["drafts"]:
            log.warning("%s %s: %.0f%% of sequences left the autoregressive output (a near-tie argmax flipped)%s",
                        row["set"], row["line"], 100 * (1 - row["ref_match"]),
                        "; the compared oracle's drafts after that point are rejected" if row["oracle"] == "compare"
                        else "")


def _models(cfg: DictConfig, b: DictConfig, extra: int) -> Iterator[tuple[str, object]]:
    """(label, model) per preset (one at a time; a checkpoint replaces the presets), KV room for ``extra``."""
    for preset in ([str(cfg.checkpoint)] if cfg.get("checkpoint") else [str(p) for p in b.presets]):
        model = model_for(cfg, preset, extra) if not cfg.get("checkpoint") else C.make_model(cfg, max_seq_len=extra)
        yield (model.cfg.name if cfg.get("checkpoint") else preset), model
        del model
        release(str(cfg.device))


def _room(cfg: DictConfig, s: dict, drafts: int) -> int:
    """KV slots one sequence may need: the longest kept prompt (bounded by max_prompt_len when set) + budget."""
    longest = max([int(d["prompt_len"]) if d["name"] == "synthetic" else int(d.get("max_prompt_len") or 4096)
                   for d in set_configs(OmegaConf.to_container(cfg.data, resolve=True))])
    return longest + s["new_tokens"] + (s["S"] + 1) * max(drafts, 1) + 2


def run_snl_tab5(cfg: DictConfig) -> Iterator[dict]:
    """Table 5: tokens/s of autoregressive and every strategy with PNG(S, D) per prompt set (module doc)."""
    b = cfg.bench
    s = check_common(b, "snl_tab5_e2e")
    D, batch = int(b.drafts), int(b.batch)
    if D < 1 or batch < 1:
        raise ValueError(f"snl_tab5_e2e: need bench.drafts >= 1 and bench.batch >= 1, got {D} and {batch}")
    kind = drafter_kind(cfg)
    lines = [Line("autoregressive", 0, 0)] + [Line(n, D, s["S"], kind) for n in s["strategies"]]
    groups = groups_for(b, s, lines, batch, "snl_tab5_e2e")
    for preset, model in _models(cfg, b, _room(cfg, s, D)):
        tok = load_tokenizer(model)
        for pset in load_sets(cfg, tok, model.cfg.vocab_size):
            if pset.reason is not None:
                for line in lines:
                    yield {**Runner(cfg, model, preset, pset, batch=batch, groups=groups, s=s).base(line),
                           "status": "skipped", "reason": pset.reason,
                           "paper_tokens_per_s": PAPER_TAB5.get(line.strategy, {}).get(pset.name)}
                continue
            run = Runner(cfg, model, preset, pset, batch=batch, groups=groups, s=s)
            ar = None
            for line in track(lines, desc=f"{preset} {pset.name}"):
                row = _with_ar(run.run(line), ar)
                ar = row if not line.drafts else ar
                paper = PAPER_TAB5.get(line.strategy, {}).get(pset.name)
                row["paper_tokens_per_s"] = paper
                row["paper_speedup"] = paper / PAPER_TAB5["autoregressive"][pset.name] if paper else None
                _log(row)
                yield row
                if not line.drafts and row["status"] != "ok":
                    break  # no truth for the oracle, no baseline for the speedups


def run_snl_fig4(cfg: DictConfig) -> Iterator[dict]:
    """Fig. 4: tokens/s vs drafts per sequence (0 = autoregressive) for every batch size, per strategy."""
    b = cfg.bench
    s = check_common(b, "snl_fig4_multiseq")
    drafts = sorted({int(d) for d in b.drafts})
    batches = [int(x) for x in b.batch]
    if not drafts or min(drafts) < 0 or not batches or min(batches) < 1:
        raise ValueError(f"snl_fig4_multiseq: bench.drafts holds draft counts >= 0 and bench.batch sizes >= 1, got "
                         f"{list(b.drafts)} and {batches}")
    if b.get("groups") is None:
        raise ValueError("snl_fig4_multiseq: bench.groups is the batches decoded per point (a number, or auto: the "
                         "oracle's law decides); null is not allowed here")
    kind = drafter_kind(cfg)
    lines = [Line("autoregressive", 0, 0)] + [Line(n, d, s["S"], kind) for d in drafts if d for n in s["strategies"]]
    for preset, model in _models(cfg, b, _room(cfg, s, max(drafts))):
        sets = load_sets(cfg, load_tokenizer(model), model.cfg.vocab_size)
        if len(sets) != 1:
            raise ValueError(f"snl_fig4_multiseq groups one prompt set into batches; choose one with data=<set> "
                             f"(got {len(sets)}: {', '.join(p.name for p in sets)})")
        pset = sets[0]
        if pset.reason is not None:
            raise ValueError(f"snl_fig4_multiseq: {pset.reason}; or choose another set with data=<set>")
        for batch in track(batches, desc=f"{preset} batches"):
            groups = groups_for(b, s, lines, batch, "snl_fig4_multiseq") or 1  # auto with a measured drafter: 1
            run = Runner(cfg, model, preset, pset, batch=batch, groups=groups, s=s)
            ar = None
            for line in lines:
                row = _with_ar(run.run(line), ar)
                ar = row if not line.drafts else ar
                row["gain"] = row["speedup"] - 1.0 if row["speedup"] is not None else None
                _log(row)
                yield row
                if not line.drafts and row["status"] != "ok":
                    break
