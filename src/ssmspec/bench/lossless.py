"""Experiment ``lossless``: every strategy decodes exactly what the target model would.

Two kinds of rows (``kind``):

- ``greedy``: for every model preset x strategy x drafter of the ``bench`` grid, ``generate()`` greedy on a
  batch of synthetic prompts of different lengths (left padding) against the autoregressive greedy
  reference of the same model and dtype. ``agree`` is the fraction of positions whose token equals the
  reference's, ``prefix`` the fraction inside each sequence's common prefix, ``exact`` whether every
  sequence is identical; ``first_mismatch`` the earliest differing position (-1: none) and
  ``margin_at_mismatch`` the reference's top-1 minus top-2 logit there (a near-tie explains a flip in low
  precision; float64 on CPU leaves none). Also the decoding metrics of the run: ``mean_accepted`` draft
  tokens per step, ``accepted_hist``, ``tokens_per_call`` (emitted tokens per model call and sequence),
  ``model_calls`` and ``cache_bytes`` (strategy state + KV caches allocated). A tree drafter with a
  chain-only strategy gives a row with status ``n/a``.
- ``sampling``: the emitted-token distribution of sampling verification. With top-k sampling the first
  ``tokens`` emitted tokens have a small support, so their exact joint distribution under the target is
  enumerated (one forward per prefix) and ``samples`` sequences decoded from one prompt (batches of at most
  ``max_batch``, each seeded on its own; every strategy gets the same seeds) are compared with it: Pearson chi-square over the outcomes (cells with expected count < 5 pooled), its
  p-value, the total-variation distance ``tv`` and ``tv_noise``, the mean TV of as many exact draws (the
  distance sampling noise alone gives). ``pass`` is p_value >= ``alpha``. Rows for every strategy,
  autoregressive (no drafter) included as the baseline.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from ssmspec import config as C
from ssmspec.bench.inputs import synthetic_prompts, track
from ssmspec.engine.context import RunContext
from ssmspec.engine.generate import generate
from ssmspec.models.kv_cache import KVCache
from ssmspec.models.model import build_model
from ssmspec.strategies import SpecConfig, StepInputs, make_strategy, strategy_names
from ssmspec.verify import make_verifier
from ssmspec.verify.distributions import SamplingConfig, target_probs

log = logging.getLogger("ssmspec.bench.lossless")


class _MarginRecorder:
    """Wraps a verifier; keeps, per sequence, the top-1 minus top-2 logit behind every emitted token."""

    def __init__(self, inner, batch: int) -> None:
        self.inner, self.name = inner, getattr(inner, "name", "verifier")
        self.margins: list[list[float]] = [[] for _ in range(batch)]

    def verify(self, node_logits, drafts, generator=None):
        v = self.inner.verify(node_logits, drafts, generator)
        top = node_logits.float().topk(2, dim=-1).values  # (B, 1+T, 2)
        gap = (top[..., 0] - top[..., 1]).gather(1, v.path)  # (B, 1+Smax): logits behind emitted tokens
        for b, (row, a) in enumerate(zip(gap.tolist(), v.accepted.tolist())):
            self.margins[b].extend(row[:a + 1])
        return v


def drafter_label(d: dict) -> str:
    """Short column label of a drafter setting, e.g. 'oracle p=0.5 S=3', 'png 2x3', 'oracle tree A'."""
    name = d.get("name", "none")
    if name == "none":
        return "none"
    if name == "beam_tree":  # beams x depth
        return f"beam_tree {d.get('beams', 3)}x{d.get('depth', 4)}"
    if name == "static_tree":
        return f"static_tree {d.get('shape', 'A')}"
    if d.get("tree") is not None:
        shape = d["tree"] if isinstance(d["tree"], str) else f"{len(d['tree'])} nodes"
        return f"{name} tree {shape}" + (f" p={d['p']}" if "p" in d else "")
    chains = f"{d.get('num_drafts', 1)}x{d.get('draft_len', 4)}"
    return f"{name} p={d['p']} {chains}" if "p" in d else f"{name} {chains}"


def _make_drafter(d: dict, *, reference: list[list[int]], model, seed: int):
    """The drafter of one column; ``draft: family`` is a draft model of the target's own preset and family with
    weights seeded apart (``seed`` + 1), so every family drafts for itself through the draft engine."""
    opts = {k: v for k, v in d.items() if k != "name"}
    if d.get("name", "none") == "none":
        return None
    from ssmspec.drafting import make_drafter

    if d["name"] == "oracle":
        opts.update(reference=reference, vocab_size=model.cfg.vocab_size)
    if opts.get("draft") == "family":
        opts["draft"] = build_model(model.cfg, seed=seed + 1, device=model.device, dtype=model.dtype)
    return make_drafter(d["name"], **opts)


def _prompts(b: DictConfig, cfg: DictConfig, vocab: int) -> list[list[int]]:
    """``batch`` synthetic prompts, lengths prompt_len, prompt_len - 1, ... (left padding is exercised)."""
    bsz, T = int(b.batch), int(b.prompt_len)
    ids = synthetic_prompts(bsz, T, vocab, seed=int(cfg.data.get("seed", 0)),
                            min_token_id=int(cfg.data.get("min_token_id", 3)))
    return [row[:max(1, T - i)] for i, row in enumerate(ids.tolist())]


def _model(cfg: DictConfig, preset, dtype: torch.dtype, max_seq_len: int):
    model = C.make_model(cfg, preset=preset, max_seq_len=max_seq_len)
    return model.to(dtype)


def _dtype(b: DictConfig, cfg: DictConfig) -> torch.dtype:
    return C.resolve_dtype(str(b.get("dtype") or cfg.dtype), str(cfg.device))


def _strategies(b: DictConfig) -> list[str]:
    names = b.get("strategies", "all")
    if names in (None, "all"):
        return strategy_names()
    names = list(names)
    for n in names:
        make_strategy(n)  # unknown names: a clear error before anything runs
    return names


def _compare(got: list[list[int]], ref: list[list[int]], ref_margins: list[list[float]]) -> dict:
    total = same = prefix = 0
    first, margin = -1, None
    for g, r, m in zip(got, ref, ref_margins):
        n = len(r)
        total += n
        same += sum(int(a == c) for a, c in zip(g, r))
        k = next((i for i, (a, c) in enumerate(zip(g, r)) if a != c), min(len(g), n))
        prefix += k
        if k < n and (first < 0 or k < first):
            first, margin = k, (m[k] if k < len(m) else None)
    return {"tokens": total, "agree": same / total, "prefix": prefix / total, "exact": got == ref,
            "first_mismatch": first, "margin_at_mismatch": margin}


def greedy_rows(cfg: DictConfig) -> Iterator[dict]:
    """One row per (preset, strategy, drafter) of the greedy agreement table."""
    b = cfg.bench
    dtype = _dtype(b, cfg)
    presets = [None] if cfg.get("checkpoint") else list(b.presets)
    drafters = [OmegaConf.to_container(d) for d in b.drafters]
    names = _strategies(b)
    new = int(b.new_tokens)
    for preset in presets:
        model = _model(cfg, preset, dtype, max_seq_len=int(b.prompt_len) + new + 64)
        mcfg = model.cfg
        prompts = _prompts(b, cfg, mcfg.vocab_size)
        ar = _MarginRecorder(make_verifier("greedy"), len(prompts))
        # eager (cuda_graph=False): the margin recorder reads every verdict on the host, which a captured step
        # cannot; that captured steps equal eager ones is tests/test_engine.py's check
        ref = generate(model, prompts, max_new_tokens=new, strategy="autoregressive", verifier=ar,
                       timing=False, cuda_graph=False).sequences
        base = {"kind": "greedy", "model": mcfg.name, "family": mcfg.family, "params": mcfg.num_parameters(),
                "dtype": C.dtype_name(dtype), "batch": len(prompts), "new_tokens": new}
        for d in track(drafters, desc=f"lossless {mcfg.name}"):
            for name in names:
                strat = make_strategy(name)
                drafter = _make_drafter(d, reference=ref, model=model, seed=int(cfg.seed))
                row = {**base, "strategy": name, "drafter": drafter_label(d),
                       "drafter_config": drafter.describe() if drafter is not None else {"name": "none"}}
                if drafter is not None and not strat.speculative:
                    yield {**row, "status": "n/a", "reason": "does not speculate"}
                    continue
                if drafter is not None and drafter.spec.tree_size and not strat.supports_trees:
                    yield {**row, "status": "n/a", "reason": "chains only"}
                    continue
                rec = _MarginRecorder(make_verifier("greedy"), len(prompts))
                out = generate(model, prompts, max_new_tokens=new, strategy=strat, drafter=drafter, verifier=rec,
                               timing=False, cuda_graph=False)
                emitted = sum(sum(s.emitted) for s in out.steps[1:])
                calls = max(out.model_calls, 1)
                row.update(status="ok", **_compare(out.sequences, ref, ar.margins),
                           mean_accepted=out.mean_accepted(),
                           accepted_hist={str(k): v for k, v in out.accepted_histogram().items()},
                           tokens_per_call=emitted / calls / len(prompts), model_calls=out.model_calls,
                           cache_bytes=out.cache_bytes)
                log.info("%-14s %-18s %-20s agree %.4f exact %s", mcfg.name, name, row["drafter"], row["agree"],
                         row["exact"])
                yield row
        del model


# sampling ---------------------------------------------------------------------------------------
@torch.no_grad()
def next_token_probs(model, seqs: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """(n, T) token ids -> (n, V) target distribution of the next token (one prompt-pass forward)."""
    mcfg, (n, T) = model.cfg, seqs.shape
    strat = make_strategy("autoregressive")
    strat.allocate(mcfg, n, SpecConfig(), seqs.device, model.dtype)
    kv = [KVCache(n, mcfg.n_kv_heads, mcfg.attn_head_dim, T, rows=n, max_new=T, device=seqs.device,
                  dtype=model.dtype) for _ in mcfg.attention_layers]
    step = StepInputs(input_ids=seqs, positions=torch.arange(T, device=seqs.device)[None].expand(n, T), prefill=True)
    logits = model(seqs, RunContext(strategy=strat, kv=kv, step=step))[:, -1]  # (n, V)
    return target_probs(logits, sampling)


def exact_joint(model, prompt: list[int], tokens: int, sampling: SamplingConfig, *,
                max_outcomes: int = 4096) -> dict[tuple[int, ...], float]:
    """{(t1, ..., t_tokens): probability} of the first ``tokens`` sampled tokens after ``prompt``, by
    enumerating every prefix in the support (needs a small support: top_k sampling)."""
    dev = model.device
    joint = {(): 1.0}
    for _ in range(tokens):
        prefixes = list(joint)
        seqs = torch.tensor([prompt + list(p) for p in prefixes], device=dev)
        probs = next_token_probs(model, seqs, sampling).double().cpu()  # (n, V)
        nxt = {}
        for p, row in zip(prefixes, probs):
            for t in row.nonzero()[:, 0].tolist():
                nxt[p + (t,)] = joint[p] * float(row[t])
        if len(nxt) > max_outcomes:
            raise ValueError(f"the first {tokens} tokens have more than {max_outcomes} outcomes; lower "
                             f"bench.sampling.tokens or bench.sampling.top_k")
        joint = nxt
    return joint


def chi_square(counts: torch.Tensor, expected: torch.Tensor, *, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson chi-square of counts vs expected (same total), cells with expected < min_expected pooled.
    Returns (chi2, dof, p_value)."""
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    if (obs[~keep] > 0).any():  # outcomes the target cannot produce
        return float("inf"), int(keep.sum()) - 1, 0.0
    obs, exp = obs[keep], exp[keep]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = max(int(obs.numel()) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                      torch.tensor(chi2 / 2.0, dtype=torch.float64)))
    return chi2, dof, p


def sampling_rows(cfg: DictConfig) -> Iterator[dict]:
    """One row per (preset, strategy): emitted-token distribution vs the exact target distribution."""
    s = cfg.bench.sampling
    if not s.get("enabled", True):
        return
    dtype = _dtype(cfg.bench, cfg)
    n, K = int(s.samples), int(s.tokens)
    chunk = int(s.get("max_batch") or n)  # sequences per generate() call
    scfg = SamplingConfig(temperature=float(s.temperature), top_k=int(s.top_k), seed=int(s.get("seed", 0)))
    if scfg.greedy or not scfg.top_k:
        raise ValueError("bench.sampling needs temperature > 0 and top_k > 0 (the exact distribution is enumerated)")
    d = OmegaConf.to_container(s.drafter)
    names = _strategies(cfg.bench)
    presets = [None] if cfg.get("checkpoint") else list(s.presets)
    for preset in presets:
        model = _model(cfg, preset, dtype, max_seq_len=int(s.prompt_len) + K + 32)
        mcfg = model.cfg
        prompt = synthetic_prompts(1, int(s.prompt_len), mcfg.vocab_size, seed=int(cfg.data.get("seed", 0)))[0].tolist()
        joint = exact_joint(model, prompt, K, scfg)
        outcomes = list(joint)
        index = {o: i for i, o in enumerate(outcomes)}
        probs = torch.tensor([joint[o] for o in outcomes], dtype=torch.float64)
        gen = torch.Generator().manual_seed(12345)
        noise = [0.5 * float((torch.bincount(torch.multinomial(probs, n, replacement=True, generator=gen),
                                             minlength=len(outcomes)).double() / n - probs).abs().sum())
                 for _ in range(5)]
        ref = generate(model, [prompt], max_new_tokens=K + 8, strategy="autoregressive", timing=False).sequences
        for name in track(names, desc=f"sampling {mcfg.name}"):
            strat = make_strategy(name)
            counts = torch.zeros(len(outcomes) + 1, dtype=torch.float64)  # last cell: outside the support
            accepted = []
            for i, start in enumerate(range(0, n, chunk)):  # chunks bound the state memory (paper-size models)
                m = min(chunk, n - start)
                drafter = _make_drafter(d, reference=ref * m, model=model, seed=int(cfg.seed)) if strat.speculative else None
                out = generate(model, [prompt] * m, max_new_tokens=K, strategy=strat, drafter=drafter,
                               sampling=dataclasses.replace(scfg, seed=scfg.seed + i), timing=False)
                for seq in out.sequences:
                    counts[index.get(tuple(seq[:K]), len(outcomes))] += 1
                accepted.append(out.mean_accepted())
            expected = torch.cat([probs * n, torch.zeros(1, dtype=torch.float64)])
            chi2, dof, p = chi_square(counts, expected)
            tv = 0.5 * float((counts / n - torch.cat([probs, torch.zeros(1, dtype=torch.float64)])).abs().sum())
            row = {"kind": "sampling", "model": mcfg.name, "family": mcfg.family, "dtype": C.dtype_name(dtype),
                   "strategy": name, "drafter": drafter_label(d) if strat.speculative else "none",
                   "temperature": scfg.temperature, "top_k": scfg.top_k, "samples": n, "tokens": K,
                   "outcomes": len(outcomes), "chi2": chi2, "dof": dof, "p_value": p, "tv": tv,
                   "tv_noise": sum(noise) / len(noise), "alpha": float(s.alpha), "pass": p >= float(s.alpha),
                   "mean_accepted": sum(accepted) / len(accepted), "status": "ok"}
            log.info("%-14s %-18s chi2 %.1f dof %d p %.3g tv %.4f (noise %.4f)", mcfg.name, name, chi2, dof, p, tv,
                     row["tv_noise"])
            yield row
        del model


def check_sampling_presets(cfg: DictConfig) -> None:
    """The sampling rows run on a subset of the chosen presets (``bench.sampling.presets`` among
    ``bench.presets``); refused, with the fix, before any row runs."""
    s = cfg.bench.sampling
    if cfg.get("checkpoint") or not s.get("enabled", True):
        return
    chosen, sampled = [str(p) for p in cfg.bench.presets], [str(p) for p in s.presets]
    extra = [p for p in sampled if p not in chosen]
    if extra:
        raise ValueError(f"lossless: bench.sampling.presets {extra} are not among bench.presets {chosen} (the sampling "
                         f"rows run on some of the chosen presets); add bench.sampling.presets=[{chosen[0]}], or "
                         f"bench.sampling.enabled=false")


def run_lossless(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``lossless`` (experiment contract): greedy agreement rows, then sampling rows."""
    check_sampling_presets(cfg)
    yield from greedy_rows(cfg)
    yield from sampling_rows(cfg)
