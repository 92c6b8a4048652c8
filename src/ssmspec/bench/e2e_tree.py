"""STree end to end (seed 003): ``stree_tab3_e2e`` (Table 3), ``stree_fig4_temperature`` (Fig. 4b/c),
``stree_tab4_tree_shapes`` (Table 4), and this project's ``tree_replay`` (replay verifying token trees); its
``Runner`` also runs ``stree_tab8_beam`` (``bench/stree_beam.py``) and ``stree_tab2_unrolled``.

Every line decodes through the engine (``ssmspec.engine.Engine``: the captured step generate() replays) and is
timed like ``replay_fig8_throughput`` (``bench/e2e.py``): tokens/s = emitted tokens (accepted + 1 per sequence and
step) over the summed step times (drafting + verify + commit; CUDA events, perf_counter on CPU). Rows carry
``mean_accepted`` (accepted drafts per step), ``tau`` = mean_accepted + 1 (the seed's "average number of tokens
accepted", 1 for autoregressive), the accepted-count histogram, and ``speedup`` over the autoregressive line
of the same model, batch and temperature in the same run. Oracle rows carry the designed numbers beside the
measured ones (``bench/designed.py``): ``tokens_per_s_designed`` = sequence-steps x (1 + E[a]) over the summed
step times, ``tau_designed`` = E[a] + 1, ``speedup_designed``, ``accepted_gap`` = measured / designed - 1 of the
mean accepted length and ``accepted_within`` (|gap| <= 2%).

Prompts (``bench/tree_prompts.py``): seeded random tokens with ``data=synthetic``; with ``data=<set>`` the set's
prompts of >= ``bench.prompt_len`` tokens, their last ``prompt_len``, in ``bench.groups`` groups of ``batch``.

Trained pairs (``bench.trained``, ``bench/trained_rows.py``): the runner calls these benches again with
``checkpoint=`` the trained target (one model, rows' ``model`` its name, the presets unused),
``bench.draft_checkpoint=`` its distilled draft, ``data=`` a prompt set and ``trained.bench`` merged into ``bench``
(``drafter: draft``, a fixed ``iters`` and ``groups``: ``iters: auto`` is the oracle's law and refused for measured
drafters). Measured rows at temperature 0 compare every line's emitted tokens with the target's greedy
autoregressive continuation of the same prompts (``ref_match``, ``exact``: greedy verification is lossless, so they
must agree token for token at float32). An experiment measured on trained pairs alone points its ``bench:`` at a
``run_*`` here and sets ``trained.only: true`` (``stree_tab8_beam`` does so through ``bench/stree_beam.py``).

How many steps (``bench.iters``). The oracle's draws are Weyl sequences (``bench.draws: weyl``,
``drafting/weyl.py``): the measured mean accepted length converges to E[a] like 1/n. ``bench.iters: auto``
times, at every batch and temperature, the largest count the point's oracle lines need for a 2% band
(``weyl.steps_needed``: at most 1 offset draw in 1000 misses it; fixed before the run from the law and the draws'
rates, never from the run's outcome); every line of the point times that count, so their contexts grow alike;
rows record ``steps_needed`` per line. The token budget (and the oracle's reference) holds the steps at the law's
worst case over offsets (``weyl.max_accepted``), not at every draft accepted, which would be 3-6x longer.

Acceptance, stated (``bench.drafter``; ``auto``: ``oracle`` on random weights, ``draft`` with ``checkpoint=``):

- ``oracle`` (``drafting/oracle.py``): each draft node holds the token the target emits at its position with
  probability alpha, per branch -- the r-th child of a tree node with alpha * beta^r (``rank_decay`` beta:
  later guesses are right less often) -- else a different token; the accepted length is the depth of the
  deepest fully kept path and its mean is known exactly (``expected_accepted``, in every row). ``bench.oracle``:
  ``coupled`` (default): verification is a real test and the law is the target's -- at temperature 0 greedy
  verification compares tokens with the target's greedy continuation, at temperature > 0 the target samples
  each position by race noise keyed by (sequence, position, token), so its sampled continuation is known in
  advance and is the truth (``bench/tree_sampling.py``: ``CoupledOracle``, ``CoupledSampler``). Emitted tokens
  equal the truth (``ref_match``; a near-tie flipped by other numerics lowers it, after which the measured
  acceptance falls below the designed one). ``forced``: greedy verification takes the oracle's word for its kept
  nodes (bf16 flips cannot lower the acceptance, as ``replay_fig8_throughput``); at temperature > 0 the real
  speculative / MSS test runs for its cost and its verdict is replaced (``ForcedSampler``): rows say ``law:
  designed``, the emitted tokens are not a sample of the target. The defaults are calibrated on seed 003's
  Table 3 (MT-Bench, measured acceptance of its draft model): at temperature 0 alpha = 0.55, beta = 0.35 give a
  chain of 4 1.11 and tree A 1.44 accepted drafts by design (paper, measured: 1.04 and 1.47); at temperature 1
  alpha = 0.37, beta = 0.7 give 0.58 and 1.03 (paper 0.55 and 1.03).
- ``self``: measured acceptance of a draft whose q is a stated perturbation of p: the target model itself
  (shared weights, its own states) drafts with N(0, sigma^2) noise on every logit, q = softmax((z + sigma
  eps) / T) (``bench.sigma``). Chains and MSS trees sample their children from q and record it; naive trees
  take the top-k of the perturbed logits. Verification is exact (``law: target``). Drafting costs a target
  call per tree layer, so tokens/s compare lines with the same drafter only (the seed's drafter is a 2-layer
  model).
- ``draft``: a draft model (``bench.draft`` preset, ``bench.draft_checkpoint`` for its weights) drafting the
  same way with sigma = 0: with ``checkpoint=`` (and on the trained pairs) the real drafters, measured.

Lines: ``autoregressive`` (S = 0); ``chain`` (``bench.chain_strategy``, default activation_replay as the
seed's vanilla SD, S = ``bench.chain_S``); ``tree`` (``stree``, static shape ``bench.shape``: seed 003's
shapes A-E, ``drafting/static_tree.py: SHAPES``). Fig. 4 adds ``tree naive`` (top-k tree, naive sampling:
sample the target at each node and follow the child that holds the sample; ``NaiveTreeSampler``, lossless).
``tree_replay`` compares, per shape, ``replay`` verifying the tree, ``stree`` on the same tree and ``replay``
on a chain of as many drafts (equal tokens per call), plus ``replay`` standard decoding. A ``Line`` with
``beams`` drafts the draft model's beam-search tree (``drafting/beam_tree.py``; ``stree_tab8_beam``).

A point whose engine cannot fit beside the weights is a ``status: skipped`` row naming both byte counts; an
out-of-memory error is a ``status: oom`` row.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.designed import ACCEPTED_TOLERANCE
from ssmspec.bench.e2e import _is_oom, oracle_draws, plan_point, throughput_row
from ssmspec.bench.inputs import track
from ssmspec.bench.steps_replay import model_for, release
from ssmspec.bench.tree_lines import (ORACLE_MODES, Line, acceptance_table, chain, check_common, drafter_kind,
                                     named_shape, verify_label)
from ssmspec.bench.tree_prompts import check_groups, eligible_prompts, group_fields, merge_rows, prompt_groups
from ssmspec.bench.tree_sampling import (CoupledOracle, CoupledSampler, ForcedSampler, NaiveTreeSampler, PerturbedTree,
                                         coupled_reference)
from ssmspec.drafting import weyl
from ssmspec.drafting.beam_tree import BeamTree
from ssmspec.drafting.oracle import Oracle, expected_accepted, sibling_ranks
from ssmspec.drafting.static_tree import SHAPES, check_parents
from ssmspec.engine import Engine
from ssmspec.engine.generate import generate
from ssmspec.strategies import SpecConfig
from ssmspec.verify.distributions import SamplingConfig

log = logging.getLogger("ssmspec.bench.e2e_tree")

class Runner:
    """Runs lines for one experiment: models, prompts, references, engines (module doc)."""

    def __init__(self, cfg: DictConfig, what: str) -> None:
        self.cfg, self.b, self.what = cfg, cfg.bench, what
        check_common(self.b, what)
        self.kind = drafter_kind(cfg)
        self.device = str(cfg.device)
        self.graph = C.use_cuda_graph(self.b.get("cuda_graph", "auto"), self.device)
        self._draft_model = None
        if self.kind == "draft" and cfg.get("checkpoint") and not self.b.get("draft_checkpoint"):
            raise ValueError(f"{what}: checkpoint= drafts with a draft model, and a random-weight one is never "
                             f"accepted; give its weights with bench.draft_checkpoint=<dir> (and bench.draft=<its "
                             f"preset>), or measure a perturbed self-draft with bench.drafter=self")
        self.oracle_mode = str(self.b.get("oracle", "coupled"))
        if self.oracle_mode not in ORACLE_MODES:
            raise ValueError(f"{what}: bench.oracle must be coupled or forced, got {self.oracle_mode!r}")
        self.draws = oracle_draws(self.b)
        self.groups = check_groups(cfg, self.kind, what)

    def presets(self) -> list[str]:
        """The presets to run, or the checkpoint alone (``run`` loads it whatever the preset)."""
        return [str(self.cfg.checkpoint)] if self.cfg.get("checkpoint") else [str(p) for p in self.b.presets]

    def law(self, line: Line, alpha: float, decay: float) -> tuple[list[int], list[float]] | None:
        """(parents, keep probability per node) of an oracle line's drafts, None for other lines."""
        if self.kind != "oracle" or not line.parents:
            return None
        ranks = sibling_ranks(line.parents) if not line.is_chain else [0] * len(line.parents)
        return list(line.parents), [alpha * decay ** r for r in ranks]

    def steps_needed(self, line: Line, batch: int, alpha: float, decay: float) -> int | None:
        """Steps per sequence the line's law asks for a 2% band on its mean accepted length: the Weyl rule
        (``drafting/weyl.py: steps_needed``), or the independent draws' count (``iid_steps`` / batch)."""
        law = self.law(line, alpha, decay)
        if law is None:
            return None
        if self.draws == "weyl":
            return weyl.steps_needed(*law, batch=batch, tol=ACCEPTED_TOLERANCE)
        return math.ceil(weyl.iid_steps(*law, tol=ACCEPTED_TOLERANCE) / batch)

    def plan(self, lines: list[Line], batch: int, alpha: float, decay: float) -> tuple[int, int, dict]:
        """(timed steps, token budget, steps needed per line label) of one batch and temperature. ``bench.iters:
        auto`` times the largest count the point's oracle lines need; the budget holds every step's tokens: at
        most the law's worst case over offsets for Weyl draws, every draft accepted otherwise."""
        needs = {line.label: self.steps_needed(line, batch, alpha, decay) for line in lines}
        if str(self.b.iters) == "auto":
            if self.kind != "oracle" or self.draws != "weyl":
                raise ValueError(f"{self.what}: bench.iters=auto sizes the run by the oracle's Weyl draws; give "
                                 f"bench.iters=<steps> with bench.drafter={self.kind} / bench.draws={self.draws}")
            iters = max(v for v in needs.values() if v is not None)
        else:
            iters = int(self.b.iters)
        steps = max(int(self.b.warmup), 1) + iters + 1
        budget = 1
        for line in lines:
            law = self.law(line, alpha, decay)
            if not line.parents:
                need = 1 + steps
            elif law is not None and self.draws == "weyl":
                need = 1 + steps + weyl.max_accepted(*law, batch=batch, steps=steps) + line.depth
            else:
                need = 1 + steps * (line.depth + 1) + line.depth
            budget = max(budget, need)
        return iters, budget, needs

    def draft_source(self, model):
        """The model that drafts for ``self`` (the target) and ``draft`` (a draft preset or checkpoint)."""
        if self.kind == "self":
            return model
        if self._draft_model is None:
            path = self.b.get("draft_checkpoint")
            if path:
                from ssmspec.models.loading import load_model

                self._draft_model = load_model(str(path), device=self.device, dtype=model.dtype)
            else:
                self._draft_model = str(self.b.get("draft", "mamba2-130m"))
        return self._draft_model

    def drafter(self, model, line: Line, *, temperature: float, alpha: float, decay: float, reference):
        """The drafter of ``line`` at ``temperature`` and its expected accepted length (None: measured)."""
        if not line.parents:
            return None, 0.0
        if line.beams:  # the draft model's beam search (greedy, deterministic: q None, one-hot to MSS)
            if self.kind == "oracle":
                raise ValueError(f"{self.what}: the oracle cannot draft a beam-search tree; use bench.drafter=draft")
            return BeamTree(draft=self.draft_source(model), beams=line.beams, depth=line.depth,
                            seed=int(self.cfg.seed)), None
        if self.kind == "oracle":
            V, forced = model.cfg.vocab_size, self.oracle_mode == "forced"
            cls = CoupledOracle if temperature > 0 and not forced else Oracle
            kw = dict(draft_len=len(line.parents)) if line.is_chain else dict(tree=line.parents, rank_decay=decay)
            d = cls(p=alpha, reference=reference, vocab_size=V, seed=int(self.cfg.seed), forced=forced,
                    draws=self.draws, **kw)
            return d, d.expected_accepted()
        sigma = float(self.b.get("sigma", 0.0)) if self.kind == "self" else 0.0
        sample = temperature > 0 and line.verify == "exact"  # MSS / Leviathan need drafts drawn from q
        d = PerturbedTree(draft=self.draft_source(model), shape=line.parents, sigma=sigma, temperature=temperature,
                          sample=sample, noise_seed=int(self.cfg.seed), seed=int(self.cfg.seed))
        return d, None

    def verifier(self, line: Line, sampling: SamplingConfig):
        if not line.parents:
            return None  # the engine's plain picking
        if line.verify == "naive":
            return NaiveTreeSampler(sampling)
        if self.kind == "oracle" and not sampling.greedy:
            return ForcedSampler(sampling) if self.oracle_mode == "forced" else CoupledSampler(sampling, self.cfg.seed)
        return None  # greedy (reads the forced oracle's match) or speculative / MSS

    def reference(self, model, ids, *, H: int, temperature: float, cache: dict):
        """The oracle's truth for these prompts: the target's greedy continuation (temperature 0, or a forced
        oracle) or its sampled one under the coupled noise; computed once per kind and prompts and kept in
        ``cache``. Measured drafters: the greedy continuation at temperature 0 (``ref_match``), else None."""
        if self.kind != "oracle" and temperature > 0:
            return None
        coupled = self.kind == "oracle" and temperature > 0 and self.oracle_mode == "coupled"
        key = (id(ids), temperature if coupled else "greedy")
        if key not in cache:
            prompts = ids.tolist()
            if coupled:
                cache[key] = coupled_reference(model, prompts, max_new_tokens=H, seed=int(self.cfg.seed),
                                               sampling=SamplingConfig(temperature=temperature,
                                                                       seed=int(self.cfg.seed)),
                                               cuda_graph=self.graph)
            else:
                cache[key] = generate(model, prompts, max_new_tokens=H, strategy="autoregressive",
                                      cuda_graph=self.graph).sequences
            release(self.device)
        return cache[key]

    def run(self, preset: str, lines: list[Line], temps: list[tuple[float, float, float]],
            extra: dict | None = None) -> Iterator[dict]:
        """Every line at every batch and temperature for one preset; speedups against autoregressive."""
        b = self.b
        Tp, R = int(b.prompt_len), int(b.get("R", 16))
        batches = [int(x) for x in b.batch]
        if self.kind == "oracle" and any(a is None or d is None for _, a, d in temps):
            raise ValueError(f"{self.what}: the oracle drafts at bench.alpha and bench.rank_decay; set both (one value, "
                             f"or one per temperature)")
        plans = {(bsz, t): self.plan(lines, bsz, alpha, decay) for bsz in batches for t, alpha, decay in temps}
        room = Tp + max(p[1] for p in plans.values()) + 64
        if self.cfg.get("checkpoint"):  # the checkpoint replaces the presets (one model; rows say its name)
            model = C.make_model(self.cfg, max_seq_len=room)
            preset = model.cfg.name
        else:
            model = model_for(self.cfg, preset, room)
        eligible = eligible_prompts(self.cfg, model, Tp, self.what)
        for bsz in track(batches, desc=f"{preset} batches"):
            groups = prompt_groups(self.cfg, eligible, batch=bsz, groups=self.groups, prompt_len=Tp,
                                   vocab_size=model.cfg.vocab_size, device=self.device, what=self.what)
            refs: dict = {}
            H_ref = max(plans[bsz, t][1] for t, _, _ in temps)  # one greedy reference serves every temperature
            for temperature, alpha, decay in temps:
                iters, H, needs = plans[bsz, temperature]
                todo = [(ids, self.reference(model, ids, H=H_ref, temperature=temperature, cache=refs))
                        for ids in groups]
                fields = {**(extra or {}), **group_fields(self.cfg, groups)}
                rows = [self.point(model, line, batch=bsz, groups=todo, H=H, R=R, iters=iters,
                                   temperature=temperature, alpha=alpha, decay=decay, preset=preset,
                                   extra={**fields, "steps_needed": needs[line.label]}) for line in lines]
                base = next((r for r in rows if r["line"] == "autoregressive" and r["status"] == "ok"), None)
                for r in rows:
                    if base is not None and r["status"] == "ok":
                        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
                        d = r.get("tokens_per_s_designed")
                        r["speedup_designed"] = d / base["tokens_per_s"] if d is not None else None
                    yield r
        del model
        release(self.device)

    def point(self, model, line: Line, *, batch: int, groups: list, H: int, R: int, iters: int, temperature: float,
              alpha: float, decay: float, preset: str, extra: dict) -> dict:
        """One line at one batch and temperature over every (prompts, reference) of ``groups``, an engine each: a
        tidy row (status ok / skipped / oom)."""
        spec_d = len(line.parents) if line.parents else 0
        oracle = self.kind == "oracle" and bool(line.parents)
        sampled = temperature > 0
        forced = oracle and self.oracle_mode == "forced"
        base = dict(model=preset, line=line.label, strategy=line.strategy, shape=line.shape,
                    draft_nodes=spec_d, depth=line.depth, batch=batch, prompt_len=int(self.b.prompt_len),
                    temperature=temperature, dtype=C.dtype_name(model.dtype),
                    R=R if line.strategy == "replay" else None, drafter=self.kind if line.parents else None,
                    acceptance=("oracle" if oracle else "measured") if line.parents else "none",
                    alpha=alpha if oracle else None, rank_decay=decay if oracle and not line.is_chain else None,
                    sigma=float(self.b.get("sigma", 0.0)) if self.kind == "self" and line.parents else None,
                    oracle=self.oracle_mode if oracle else None, draws=self.draws if oracle else None,
                    verify=verify_label(line, oracle=oracle, forced=forced, sampled=sampled),
                    law="designed" if forced and sampled else "target", **extra)
        sampling = SamplingConfig(temperature=temperature, seed=int(self.cfg.seed))
        rows = []
        for ids, reference in groups:
            # emitted tokens vs the truth: an oracle line's (not where forced verdicts emit it under sampling), every
            # line's greedy reference with a measured drafter (temperature 0; None otherwise)
            check = (None if forced and sampled else reference) if oracle else (
                None if self.kind == "oracle" else reference)
            row = self._decode(model, line, ids=ids, reference=reference, H=H, R=R, iters=iters, sampling=sampling,
                               alpha=alpha, decay=decay, base=base, check=check)
            if row["status"] != "ok":
                return row
            rows.append(row)
        row = merge_rows(rows)
        expect = row["expected_accepted"]  # 0.0 without drafts, the oracle's E[a], None where measured
        row.update(tau=row["mean_accepted"] + 1.0, tau_designed=expect + 1.0 if expect is not None else None,
                   exact=row["ref_match"] == 1.0 if row["ref_match"] is not None else None)
        if forced and row["ref_match"] is not None and row["ref_match"] < 1.0:
            row["law"] = "designed"  # a kept draft off the target's own path was emitted
        log.info("%s %s T=%.2f B=%d: %.1f tokens/s, tau %.2f", preset, line.label, temperature, batch,
                 row["tokens_per_s"], row["tau"])
        return row

    def _decode(self, model, line: Line, *, ids, reference, H: int, R: int, iters: int, sampling: SamplingConfig,
                alpha, decay, base: dict, check) -> dict:
        """One group of prompts ``ids`` (B, prompt_len) prefilled into an engine of its own, ``iters`` steps timed;
        ``check``: the reference its emitted tokens are compared with (``ref_match``), or None."""
        oracle = base["acceptance"] == "oracle"
        eng = None
        try:
            drafter, expect = self.drafter(model, line, temperature=sampling.temperature, alpha=alpha, decay=decay,
                                           reference=reference)
            spec = drafter.spec if drafter is not None else SpecConfig()
            spec = dataclasses.replace(spec, buffer_size=R)
            fit, need, free = plan_point(model, line.strategy, batch=ids.shape[0], prompt_len=ids.shape[1],
                                         new_tokens=H, spec=spec)
            if not fit:
                return {**base, "status": "skipped", "planned_bytes": need,
                        "reason": f"needs {need} bytes beside the weights but {free} are free"}
            eng = Engine(model, batch=ids.shape[0], prefill_len=ids.shape[1], max_new_tokens=H,
                         strategy=line.strategy, drafter=drafter, verifier=self.verifier(line, sampling),
                         sampling=sampling, spec=spec, cuda_graph=self.graph)
            eng.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
            row = throughput_row(eng, warmup=int(self.b.warmup), iters=iters, reference=check,
                                 oracle_alpha=alpha if oracle else None, expected=expect, **base, planned_bytes=need)
            row.update(acceptance=base["acceptance"], alpha=base["alpha"])
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not _is_oom(e):
                raise
            row = {**base, "status": "oom", "reason": str(e).splitlines()[0]}
        del eng
        release(self.device)
        return row


# experiments ------------------------------------------------------------------------------------------
def run_tab3(cfg: DictConfig) -> Iterator[dict]:
    """Table 3: autoregressive, chain (vanilla SD) and tree (STree) at every temperature."""
    b = cfg.bench
    run = Runner(cfg, "stree_tab3_e2e")
    parents, name = named_shape(b.shape)
    S = int(b.chain_S)
    if S < 1:
        raise ValueError(f"stree_tab3_e2e: bench.chain_S is the chain's draft length, >= 1; got {S}")
    lines = [Line("autoregressive", "autoregressive"),
             Line(f"chain S={S}", str(b.chain_strategy), chain(S), shape=f"chain{S}"),
             Line(f"tree {name}", "stree", parents, shape=name)]
    for preset in run.presets():
        yield from run.run(preset, lines, acceptance_table(b))


def run_fig4(cfg: DictConfig) -> Iterator[dict]:
    """Fig. 4: speed and acceptance vs temperature; MSS (sampled tree) vs naive (top-k tree) sampling."""
    b = cfg.bench
    run = Runner(cfg, "stree_fig4_temperature")
    if run.kind == "oracle":
        raise ValueError("stree_fig4_temperature compares how two verification rules accept real drafts; the "
                         "oracle's acceptance is designed, not measured. Use bench.drafter=self (the target with "
                         "logit noise bench.sigma) or draft (a draft model)")
    parents, name = named_shape(b.shape)
    S = int(b.chain_S)
    lines = [Line("autoregressive", "autoregressive"),
             Line(f"chain S={S}", str(b.chain_strategy), chain(S), shape=f"chain{S}"),
             Line(f"tree {name} MSS", "stree", parents, shape=name),
             Line(f"tree {name} naive", "stree", parents, verify="naive", shape=name)]
    for preset in run.presets():
        yield from run.run(preset, lines, acceptance_table(b))


def run_tab4(cfg: DictConfig) -> Iterator[dict]:
    """Table 4: STree with static shapes A-E (and autoregressive for the speedup)."""
    b = cfg.bench
    run = Runner(cfg, "stree_tab4_tree_shapes")
    lines = [Line("autoregressive", "autoregressive")]
    for s in b.shapes:
        parents, name = named_shape(s)
        lines.append(Line(f"tree {name}", "stree", parents, shape=name))
    for preset in run.presets():
        for r in run.run(preset, lines, acceptance_table(b)):
            if r.get("shape") in SHAPES:
                depth = check_parents(SHAPES[r["shape"]])
                r["tree_width"] = max(depth.count(d) for d in set(depth))
                r["tree_tokens"] = len(depth)
            yield r


def run_tree_replay(cfg: DictConfig) -> Iterator[dict]:
    """replay on token trees vs stree vs replay on a chain of as many drafts (equal tokens per call)."""
    b = cfg.bench
    run = Runner(cfg, "tree_replay")
    R = int(b.R)
    lines = [Line("autoregressive", "autoregressive"), Line("replay", "replay")]
    for s in b.shapes:
        parents, name = named_shape(s)
        T = len(parents)
        if R < 1 + T:
            raise ValueError(f"tree_replay: replay's buffer R={R} cannot hold one call of shape {name} ({1 + T} "
                             f"tokens); raise bench.R to at least {1 + T}")
        lines += [Line(f"replay tree {name}", "replay", parents, shape=name),
                  Line(f"stree tree {name}", "stree", parents, shape=name),
                  Line(f"replay chain S={T}", "replay", chain(T), shape=f"chain{T} (={name})")]
    for preset in run.presets():
        yield from run.run(preset, lines, acceptance_table(b))


__all__ = ["expected_accepted", "run_fig4", "run_tab3", "run_tab4", "run_tree_replay"]
