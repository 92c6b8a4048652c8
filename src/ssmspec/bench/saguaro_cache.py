"""Saguaro's speculation cache, measured with synchronous speculative decoding (seed 002, Figs. 4 and 5):
``saguaro_fig4_fanout`` (cache hit rate of uniform, geometric and optimal fan-out vs temperature and cache budget)
and ``saguaro_fig5_residual`` (bonus-token hit rate and acceptance vs the residual scaling lambda).

How a hit is measured. The trained pair (``bench/trained.py``: ``bench.train``, trained on first use) decodes held-out
validation prompts through ``generate()`` -- the engine's own loop -- with a draft-model drafter that also records,
every round, the draft's logits at depths 0 .. S (row k drew d_{k+1}; row S follows d_S: one extra draft step the
synchronous loop does not need, the step the asynchronous drafter takes anyway) and the drafts
(``RecordingDraft``). The round's verdict (k, b) comes from the engine's report: k accepted drafts and the bonus b,
the last token the step emitted. A topology ``fanout`` hits a round when (k, b) is among the keys
``saguaro.bonus_candidates(logits, drafts, fanout)``, decided by ``saguaro.cache_lookup`` -- exactly the lookup
the asynchronous engine makes when its verdict arrives, so its measured hit rate must agree with these numbers at
the same pair, temperature and topology. (Only the draft's top ``max(budget) + 1`` logits per depth are kept;
the keys of any fan-out within the budget are the same.) Rounds count when the sequence ran and its step was not
cut at the token budget (emitted = k + 1). The decode runs eager (the recording reads each round on the host);
nothing here is timed.

Fitting and scoring (fig4). The prompts split in two halves: on the first, the depth law a_k (histogram of k) and
the rank law p_k(j) (how often the bonus was the draft's j-th candidate at depth k) are measured; the optimum
(``saguaro_topology.optimal_fanout``) and the geometric closed form (its alpha and power-law r fitted to that half)
are chosen there, and every topology is scored on the held-out half (``hit_rate``; ``hit_rate_fit`` is the
first half's). Uniform needs no fit.

Residual scaling (fig5). Drafts are drawn from the draft distribution with its top fanout[k] + 1 tokens at depth k
scaled by lambda and renormalised (``saguaro.rescale_top``, the authors' F + 1), and that same q goes to the
speculative-sampling verifier, so the output law stays the target's (tests/test_saguaro_cache.py); lambda < 1
lowers acceptance and moves the residual's mass onto the cached candidates. Rows report the uniform topology's
hit rate overall, after a rejection (``hit_rate_reject``: where lambda acts) and after full acceptance.

Every row says ``acceptance: measured`` and carries the pair's columns (``pair: trained``, train key, models).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import Tensor

from ssmspec.bench.inputs import track
from ssmspec.bench.trained import Pair, families, load_pair, train_run, validation_set
from ssmspec.drafting import saguaro
from ssmspec.drafting import saguaro_topology as topo
from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.draft_model import DraftModel, draw
from ssmspec.verify.distributions import SamplingConfig, target_probs

log = logging.getLogger("ssmspec.bench.saguaro_cache")

TOPOLOGIES = ("uniform", "geometric", "optimal")


class RecordingDraft(DraftModel):
    """One chain of S drafts from the draft model that records each round's logits at depths 0 .. S (top ``keep``
    + 1 per depth) and drafts (module doc); with ``lam`` < 1 (sampling only) drafts come from the lambda-scaled
    distribution, the top ``counts[k]`` tokens at depth k scaled, and that q is what the verifier gets."""

    def __init__(self, *, draft, draft_len: int, temperature: float, keep: int, lam: float = 1.0,
                 counts: tuple[int, ...] | None = None, sample_seed: int = 0) -> None:
        super().__init__(draft=draft, draft_len=draft_len, temperature=temperature, sample_seed=sample_seed)
        saguaro.rescale_top(torch.ones(1, 2), lam, 1)  # lambda outside (0, 1]: its one clear error, now
        if lam != 1.0 and self.sampling.greedy:
            raise ValueError(f"residual scaling lambda={lam} acts on sampled drafts; use temperature > 0 (or lam=1)")
        self.keep, self.lam = keep, lam
        self.counts = counts if counts is not None else (0,) * draft_len
        self.rounds: list[tuple[Tensor, Tensor, Tensor]] = []  # (values, indices) (B, S+1, keep+1), drafts (B, S)

    def _shape(self):
        return self.D, self.S + 1, False  # one more depth: the logits after d_S (the cache's keys at k = S)

    def _draft(self, root: Tensor) -> DraftTree:
        eng, S = self.engine, self.S
        logits, rows, toks, qs = root, [root], [], []
        for k in range(S):
            if self.sampling.greedy:
                t = logits.argmax(-1)  # (B,)
            else:
                probs = saguaro.rescale_top(target_probs(logits, self.sampling), self.lam, self.counts[k] + 1)
                t = draw(probs, self.gen)
                qs.append(probs)
            toks.append(t)
            logits = eng.step(t, depth=k + 1)  # (B, V); depth S: the row after d_S
            rows.append(logits)
        top = torch.stack(rows, 1).float().topk(min(self.keep + 1, root.shape[-1]), dim=-1)  # (B, S+1, keep+1)
        tokens = torch.stack(toks, 1)  # (B, S)
        self.rounds.append((top.values.cpu(), top.indices.cpu(), tokens.cpu()))
        q = torch.stack(qs, 1)[:, None].to(self.device) if qs else None
        return DraftTree.from_chains(tokens[:, None].to(self.device), q)


@dataclass
class Rounds:
    """Every counted round of a decode: prompt index, verdict and the draft's recorded logits."""

    prompt: Tensor  # (n,) index of the prompt in the set
    accepted: Tensor  # (n,) k
    bonus: Tensor  # (n,) b
    values: Tensor  # (n, S+1, keep+1) the draft's top logits per depth
    indices: Tensor  # (n, S+1, keep+1) their tokens
    drafts: Tensor  # (n, S)
    vocab: int

    def subset(self, mask: Tensor) -> Rounds:
        return Rounds(self.prompt[mask], self.accepted[mask], self.bonus[mask], self.values[mask],
                      self.indices[mask], self.drafts[mask], self.vocab)

    def hits(self, fanout: tuple[int, ...], chunk: int = 512) -> Tensor:
        """(n,) bool: the round's (k, b) is a key of ``fanout`` (``saguaro.bonus_candidates`` + ``cache_lookup``)."""
        fan = saguaro.check_fanout(fanout, self.drafts.shape[1])
        depths = saguaro.branch_depths(fan)
        out = []
        for s in range(0, len(self.accepted), chunk):
            vals, idx = self.values[s:s + chunk], self.indices[s:s + chunk]
            logits = torch.full((*vals.shape[:2], self.vocab), float("-inf")).scatter_(2, idx, vals)
            keys = saguaro.bonus_candidates(logits, self.drafts[s:s + chunk], fan)  # (c, N)
            out.append(saguaro.cache_lookup(keys, depths, self.accepted[s:s + chunk], self.bonus[s:s + chunk])[0])
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)

    def laws(self, width: int) -> tuple[list[float], list[list[float]]]:
        """(depth law a_k, rank law p_k(j) for j = 1 .. width) of these rounds (module doc)."""
        S = self.drafts.shape[1]
        depth = topo.depth_law_from_hist(torch.bincount(self.accepted, minlength=S + 1).tolist(), S)
        keys = _wide_keys(self, width)  # (n, S+1, width) candidates per depth, best first
        rank = keys.gather(1, self.accepted[:, None, None].expand(-1, 1, width))[:, 0] == self.bonus[:, None]
        ranks = []
        for k in range(S + 1):
            at = self.accepted == k
            n = int(at.sum())
            ranks.append((rank[at].sum(0).double() / n).tolist() if n else [0.0] * width)
        return depth, ranks


def _wide_keys(r: Rounds, width: int) -> Tensor:
    S = r.drafts.shape[1]
    chunks = []
    for s in range(0, len(r.accepted), 512):
        vals, idx = r.values[s:s + 512], r.indices[s:s + 512]
        logits = torch.full((*vals.shape[:2], r.vocab), float("-inf")).scatter_(2, idx, vals)
        chunks.append(saguaro.bonus_candidates(logits, r.drafts[s:s + 512], (width,) * (S + 1)).reshape(-1, S + 1, width))
    return torch.cat(chunks)


def record_rounds(pair: Pair, prompts: list[list[int]], b: DictConfig, *, temperature: float, keep: int,
                  lam: float = 1.0, counts: tuple[int, ...] | None = None) -> Rounds:
    """Decode ``prompts`` in groups of ``bench.batch`` through ``generate()`` with a ``RecordingDraft`` and pair
    each recorded round with its verdict; checks that the accepted tokens are the recorded drafts."""
    from ssmspec.engine.generate import generate

    S, bsz = int(b.S), int(b.batch)
    cols: dict[str, list] = {k: [] for k in ("prompt", "accepted", "bonus", "values", "indices", "drafts")}
    for g in range(0, len(prompts), bsz):
        group = prompts[g:g + bsz]
        drafter = RecordingDraft(draft=pair.draft, draft_len=S, temperature=temperature, keep=keep, lam=lam,
                                 counts=counts, sample_seed=int(b.seed) + g)
        sampling = SamplingConfig(temperature=temperature, seed=int(b.seed) + 7919 + g)
        # eager (no CUDA graphs): the recording copies each round's logits to the host, which no capture allows
        out = generate(pair.target, group, max_new_tokens=int(b.new_tokens), strategy=str(b.strategy),
                       drafter=drafter, sampling=sampling, cuda_graph=False)
        steps = out.steps[1:]
        if len(drafter.rounds) < len(steps):
            raise RuntimeError(f"the drafter recorded {len(drafter.rounds)} rounds for {len(steps)} decode steps")
        cum = list(out.steps[0].emitted)  # tokens of each sequence before the first decode step
        for (vals, idx, drafts), step in zip(drafter.rounds, steps):
            for j, (k, e) in enumerate(zip(step.accepted, step.emitted)):
                start, cum[j] = cum[j], cum[j] + e
                if e == 0 or e != k + 1:
                    continue  # finished, or cut at the token budget: no whole verdict
                seq = out.sequences[j]
                if seq[start:start + k] != drafts[j, :k].tolist():
                    raise RuntimeError("recorded drafts and the engine's accepted tokens disagree (rounds misaligned)")
                for name, v in (("prompt", g + j), ("accepted", k), ("bonus", seq[start + k])):
                    cols[name].append(v)
                cols["values"].append(vals[j])
                cols["indices"].append(idx[j])
                cols["drafts"].append(drafts[j])
    t = {k: torch.tensor(cols[k], dtype=torch.long) for k in ("prompt", "accepted", "bonus")}
    return Rounds(t["prompt"], t["accepted"], t["bonus"], torch.stack(cols["values"]), torch.stack(cols["indices"]),
                  torch.stack(cols["drafts"]), pair.target.cfg.vocab_size)


def fit_topologies(fit: Rounds, budget: int, width: int) -> dict[str, tuple[tuple[int, ...], dict]]:
    """topology -> (fanout, fitted parameters) chosen on ``fit`` rounds for ``budget`` (module doc)."""
    S = fit.drafts.shape[1]
    depth, ranks = fit.laws(width)
    alpha = topo.fit_rate(depth)
    miss = [1.0 - sum(a * sum(row[:F]) for a, row in zip(depth, ranks)) for F in range(width + 1)]
    r = topo.fit_power(miss)
    return {"uniform": (topo.uniform_fanout(budget, S), {}),
            "geometric": (topo.geometric_fanout(budget, S, alpha=alpha, r=r), {"alpha_fit": alpha, "r_fit": r}),
            "optimal": (topo.optimal_fanout(budget, depth, ranks), {"concave_fit": topo.is_concave(ranks)})}


def _check(b: DictConfig, what: str) -> None:
    if int(b.S) < 1 or int(b.batch) < 1 or int(b.new_tokens) < 2 or int(b.num_prompts) < 2:
        raise ValueError(f"{what}: need bench.S >= 1, bench.batch >= 1, bench.new_tokens >= 2 and bench.num_prompts "
                         f">= 2 (half fit, half held out); got S={b.S}, batch={b.batch}, new_tokens={b.new_tokens}, "
                         f"num_prompts={b.num_prompts}")
    for t in b.temperature:
        SamplingConfig(temperature=float(t))  # a negative temperature fails here, before anything runs


def _pairs(cfg: DictConfig) -> Iterator[tuple[Pair, list[list[int]], dict]]:
    b = cfg.bench
    result = train_run(b)
    for family in families(b):
        pair = load_pair(b, str(cfg.device), family, result)
        pset = validation_set(pair, b)
        if pset.reason is not None:
            raise ValueError(pset.reason)
        base = {"acceptance": "measured", **pair.info, "drafter": "draft_model", "S": int(b.S),
                "strategy": str(b.strategy), "batch": int(b.batch), "new_tokens": int(b.new_tokens),
                "prompt_len": int(b.prompt_len), "prompts": len(pset.prompts), "status": "ok"}
        yield pair, pset.prompts, base


def run_fanout(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``saguaro_fig4_fanout`` (module doc): one row per pair, temperature, budget, topology."""
    b = cfg.bench
    _check(b, "saguaro_fig4_fanout")
    budgets = [topo.check_budget(int(n)) for n in b.budget]
    bad = [t for t in b.topologies if t not in TOPOLOGIES]
    if bad or not b.topologies:
        raise ValueError(f"saguaro_fig4_fanout: bench.topologies takes {', '.join(TOPOLOGIES)}, got {list(b.topologies)}")
    width = max(budgets)
    for pair, prompts, base in _pairs(cfg):
        half = len(prompts) // 2
        for T in track([float(t) for t in b.temperature], desc="saguaro_fig4_fanout"):
            rounds = record_rounds(pair, prompts, b, temperature=T, keep=width)
            fit, held = rounds.subset(rounds.prompt < half), rounds.subset(rounds.prompt >= half)
            for N in budgets:
                chosen = fit_topologies(fit, N, width)
                for name in b.topologies:
                    fan, params = chosen[name]
                    hit, hit_fit = held.hits(fan), fit.hits(fan)
                    row = {**base, "kind": "fanout", "temperature": T, "budget": N, "topology": name,
                           "fanout": list(fan), "hit_rate": float(hit.float().mean()),
                           "hit_rate_fit": float(hit_fit.float().mean()), "rounds_held": len(held.accepted),
                           "rounds_fit": len(fit.accepted), "mean_accepted": float(rounds.accepted.float().mean()),
                           "accepted_hist": {str(k): int(v) for k, v in
                                             enumerate(torch.bincount(rounds.accepted, minlength=int(b.S) + 1))},
                           **params}
                    log.info("T=%.2f N=%d %-9s %s hit %.3f (fit %.3f)", T, N, name, list(fan), row["hit_rate"],
                             row["hit_rate_fit"])
                    yield row


def run_residual(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``saguaro_fig5_residual`` (module doc): one row per pair, temperature and lambda."""
    b = cfg.bench
    _check(b, "saguaro_fig5_residual")
    S = int(b.S)
    fan = topo.uniform_fanout(topo.check_budget(int(b.budget)), S)
    lams = [float(x) for x in b.lam]
    for lam in lams:
        saguaro.rescale_top(torch.ones(1, 2), lam, 1)  # each lambda checked before anything runs
    if any(float(t) == 0.0 for t in b.temperature) and any(lam != 1.0 for lam in lams):
        raise ValueError("saguaro_fig5_residual: lambda scales sampled drafts; every bench.temperature must be > 0")
    for pair, prompts, base in _pairs(cfg):
        for T in [float(t) for t in b.temperature]:
            for lam in track(lams, desc=f"saguaro_fig5_residual T={T}"):
                rounds = record_rounds(pair, prompts, b, temperature=T, keep=max(fan), lam=lam, counts=fan)
                hit = rounds.hits(fan)
                rej = rounds.accepted < S
                row = {**base, "kind": "residual", "temperature": T, "lam": lam, "budget": int(b.budget),
                       "topology": "uniform", "fanout": list(fan), "rounds": len(hit),
                       "hit_rate": float(hit.float().mean()),
                       "hit_rate_reject": float(hit[rej].float().mean()) if rej.any() else None,
                       "hit_rate_full": float(hit[~rej].float().mean()) if (~rej).any() else None,
                       "mean_accepted": float(rounds.accepted.float().mean()),
                       "accepted_hist": {str(k): int(v) for k, v in
                                         enumerate(torch.bincount(rounds.accepted, minlength=S + 1))}}
                log.info("T=%.2f lambda=%.2f hit %.3f (after a rejection %s) mean accepted %.3f", T, lam,
                         row["hit_rate"], row["hit_rate_reject"], row["mean_accepted"])
                yield row
