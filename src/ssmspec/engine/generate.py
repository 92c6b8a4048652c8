"""generate(): the one decoding loop. It names no concrete strategy, drafter or verifier.

Per step: drafter proposes a tree under each sequence's pending token -> strategy lays out the call ->
model forward (Mamba-2 mixers call the strategy, attention blocks their KV cache) -> verifier returns
accepted counts, path and bonus token -> strategy and KV caches commit on the device -> tokens are
appended. Standard decoding is the same loop with no drafter (draft_len 0).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from ssmspec.engine.context import RunContext
from ssmspec.models.kv_cache import KVCache
from ssmspec.models.model import HybridLM
from ssmspec.strategies import SpecConfig, StepInputs, StrategyBase, make_strategy
from ssmspec.verify.base import Verdict
from ssmspec.verify.distributions import SamplingConfig, sample, target_probs


@dataclass
class StepRecord:
    """One decode step, for timing hooks and metrics."""

    index: int  # 0 = prefill
    seconds: float  # wall time of the step (device synchronised when timing=True)
    accepted: list[int]  # accepted draft tokens per sequence (prefill: 0)
    emitted: list[int]  # tokens appended per still-running sequence
    tokens_in_call: int  # rows x length of the model call


@dataclass
class GenerationOutput:
    sequences: list[list[int]]  # generated tokens per prompt (prompt excluded, EOS included if hit)
    steps: list[StepRecord] = field(default_factory=list)
    cache_bytes: int = 0  # strategy state + KV caches allocated for this run

    @property
    def prefill_seconds(self) -> float:
        return self.steps[0].seconds if self.steps else 0.0

    @property
    def decode_seconds(self) -> float:
        return sum(s.seconds for s in self.steps[1:])

    @property
    def model_calls(self) -> int:
        return max(len(self.steps) - 1, 0)

    def accepted_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for s in self.steps[1:]:
            for a in s.accepted:
                hist[a] = hist.get(a, 0) + 1
        return dict(sorted(hist.items()))

    def mean_accepted(self) -> float:
        vals = [a for s in self.steps[1:] for a in s.accepted]
        return sum(vals) / len(vals) if vals else 0.0


class _SampleVerifier:
    """No drafts: emit one token from the target distribution (greedy or sampled)."""

    name = "sample"

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling

    def verify(self, node_logits: Tensor, drafts, generator=None) -> Verdict:
        bsz = node_logits.shape[0]
        last = node_logits[:, 0]
        tok = last.argmax(-1) if self.sampling.greedy else sample(target_probs(last, self.sampling), generator)
        zeros = torch.zeros(bsz, dtype=torch.long, device=last.device)
        return Verdict(accepted=zeros, path=zeros[:, None], bonus=tok)


def _pad_left(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        if len(p):
            ids[b, T - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            valid[b, T - len(p):] = True
    return ids.to(device), valid.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: HybridLM, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             strategy: str | StrategyBase = "autoregressive", drafter=None, verifier=None,
             sampling: SamplingConfig = SamplingConfig(), spec: SpecConfig | None = None,
             eos_token_id: int | None = None, hooks: Sequence[Callable[[StepRecord], None]] = (),
             timing: bool = True, progress=None) -> GenerationOutput:
    """Decode ``max_new_tokens`` tokens after each prompt (lists of token ids; lengths may differ).

    ``strategy`` keeps the SSM state (a registered name or an instance), ``drafter`` proposes drafts
    (None: standard decoding), ``verifier`` judges them (default: greedy when temperature is 0). Every
    finished step calls each hook with a ``StepRecord``; ``progress`` is an optional callable(n) told how
    many steps ran.
    """
    cfg = model.cfg
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    bad = [(b, int(t)) for b, p in enumerate(prompts) for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:  # the embedding would fail with a bare IndexError
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size}) for {cfg.name}; got (prompt, id) "
                         f"{bad[:5]}; encode the prompts with this model's tokenizer (ssmspec.data.load_tokenizer)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    strat = make_strategy(strategy) if isinstance(strategy, str) else strategy
    if spec is None:
        spec = drafter.spec if drafter is not None else SpecConfig()
    if drafter is None and spec.draft_len:
        raise ValueError("draft_len > 0 needs a drafter")
    device, dtype = model.device, model.dtype
    bsz = len(prompts)
    ids, valid = _pad_left(prompts, cfg.pad_token_id, device)
    Tp = ids.shape[1]
    call_len = max(Tp, strat.max_call_len(spec))
    need = Tp + max_new_tokens + spec.nodes + 1
    if cfg.attention_layers and need > cfg.max_seq_len:
        raise ValueError(f"prompt of {Tp} tokens + {max_new_tokens} new tokens (+{spec.nodes + 1} per step in "
                         f"flight) needs {need} KV slots but {cfg.name} allocates max_seq_len={cfg.max_seq_len}; "
                         f"shorten the prompt, lower max_new_tokens, or raise model.max_seq_len")
    strat.allocate(cfg, bsz, spec, device, dtype)
    kv = [KVCache(bsz, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_seq_len, rows=strat.max_rows(bsz, spec),
                  max_new=call_len, device=device, dtype=dtype) for _ in cfg.attention_layers]
    if verifier is None:
        if spec.draft_len == 0:
            verifier = _SampleVerifier(sampling)
        else:
            from ssmspec.verify import make_verifier
            verifier = make_verifier("greedy" if sampling.greedy else "speculative", sampling=sampling)
    gen = torch.Generator(device=device).manual_seed(sampling.seed)
    if drafter is not None:
        drafter.reset([list(p) for p in prompts], batch=bsz, device=device)

    out = GenerationOutput(sequences=[[] for _ in range(bsz)])
    out.cache_bytes = strat.cache_bytes() + sum(c.nbytes() for c in kv)
    done = [False] * bsz
    history = [list(p) for p in prompts]

    def emit(toks_per_seq: list[list[int]]) -> list[int]:
        counts = []
        for b, toks in enumerate(toks_per_seq):
            n = 0
            for t in toks:
                if done[b]:
                    break
                out.sequences[b].append(t)
                history[b].append(t)
                n += 1
                if (eos_token_id is not None and t == eos_token_id) or len(out.sequences[b]) >= max_new_tokens:
                    done[b] = True
            counts.append(n)
        return counts

    # prefill ------------------------------------------------------------------------------
    t0 = time.perf_counter()
    pads = (~valid).sum(1)
    positions = (torch.arange(Tp, device=device)[None] - pads[:, None]).clamp(min=0)
    step = StepInputs(input_ids=ids, positions=positions, valid=valid, prefill=True)
    ctx = RunContext(strategy=strat, kv=kv, step=step)
    logits = model(ids, ctx)
    for c in kv:
        c.start.copy_(pads)
        c.commit(torch.arange(bsz, device=device), torch.arange(Tp, device=device)[None].expand(bsz, Tp),
                 torch.full((bsz,), Tp, device=device, dtype=torch.long))
    first = verifier_first(verifier, logits[:, -1:], gen)
    seq_len = valid.sum(1)  # tokens folded into the state per sequence (pads excluded)
    kv_bound = Tp
    if timing:
        _sync(device)
    rec = StepRecord(0, time.perf_counter() - t0, [0] * bsz, emit([[t] for t in first.tolist()]), bsz * Tp)
    out.steps.append(rec)
    for h in hooks:
        h(rec)
    pending = first

    # decode -------------------------------------------------------------------------------
    while not all(done):
        t0 = time.perf_counter()
        drafts = drafter.propose(history, pending) if drafter is not None else None
        step = strat.layout(pending, drafts, seq_len)
        kv_bound = min(kv_bound + spec.nodes + 1, cfg.max_seq_len)
        step.kv_bound = kv_bound
        ctx.step = step
        logits = model(step.input_ids, ctx)
        verdict = verifier.verify(step.gather_nodes(logits), drafts, gen)
        strat.commit(verdict, step)
        if kv:
            rows, cols = _kv_source(step, verdict, bsz)
            for c in kv:
                c.commit(rows, cols, verdict.accepted + 1)
        if drafter is not None:
            drafter.observe(verdict)
        seq_len = seq_len + verdict.accepted + 1
        pending = verdict.bonus
        toks = verdict.emitted(drafts)
        if timing:
            _sync(device)
        rec = StepRecord(len(out.steps), time.perf_counter() - t0, verdict.accepted.tolist(), emit(toks),
                         step.rows * step.length)
        out.steps.append(rec)
        for h in hooks:
            h(rec)
        if progress is not None:
            progress(1)
    return out


def verifier_first(verifier, last_logits: Tensor, gen) -> Tensor:
    """The first token after the prompt: no drafts, so any verifier reduces to sampling node 0."""
    return verifier.verify(last_logits, None, gen).bonus


def _kv_source(step: StepInputs, verdict: Verdict, bsz: int) -> tuple[Tensor, Tensor]:
    """Row and columns that hold each sequence's accepted tokens (pending token + accepted path)."""
    path = verdict.path  # (B, 1+Smax) node numbers
    cols = path if step.node_col is None else step.node_col.gather(1, path)
    if step.node_row is None:
        rows = torch.arange(bsz, device=path.device)
    else:
        rows = step.node_row.gather(1, verdict.last_node[:, None])[:, 0]
    return rows, cols
