"""generate(): the one decoding loop. It names no concrete strategy, drafter or verifier.

Per step (``engine/step.py``): drafter proposes a tree under each sequence's pending token -> strategy lays
out the call -> model forward (Mamba-2 mixers call the strategy, attention blocks their KV cache) ->
verifier returns accepted counts, path and bonus token -> strategy and KV caches commit -> the emitted
tokens are appended to the device token buffer, EOS and length flags set -- all on the device, captured
once as CUDA graphs and replayed (``engine/engine.py``). The host reads each step's small report one step
late, so it never stalls the device. Standard decoding is the same loop with no drafter (draft_len 0).
"""
from __future__ import annotations

import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from ssmspec.engine.engine import Engine
from ssmspec.models.model import HybridLM
from ssmspec.strategies import SpecConfig, StrategyBase
from ssmspec.verify.distributions import SamplingConfig


@dataclass
class StepRecord:
    """One decode step, for timing hooks and metrics."""

    index: int  # 0 = prefill
    seconds: float  # time of the step (CUDA events around it on the GPU, perf_counter on the CPU)
    accepted: list[int]  # accepted draft tokens per sequence (prefill: 0)
    emitted: list[int]  # tokens appended per still-running sequence
    tokens_in_call: int  # rows x length of the model call

    def running_accepted(self) -> list[int]:
        """Accepted counts of the sequences still running in this step (a finished row keeps being verified
        until its whole batch is done; what its drafts earn there is not acceptance)."""
        return [a for a, e in zip(self.accepted, self.emitted) if e > 0]


@dataclass
class GenerationOutput:
    sequences: list[list[int]]  # generated tokens per prompt (prompt excluded, EOS included if hit)
    steps: list[StepRecord] = field(default_factory=list)
    cache_bytes: int = 0  # strategy state + KV caches allocated for this run
    cuda_graph: bool = False  # decode steps replayed from CUDA graphs
    drafter_on_device: bool = True  # drafting ran on the device (False: a host drafter synced every step)

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
            for a in s.running_accepted():
                hist[a] = hist.get(a, 0) + 1
        return dict(sorted(hist.items()))

    def mean_accepted(self) -> float:
        vals = [a for s in self.steps[1:] for a in s.running_accepted()]
        return sum(vals) / len(vals) if vals else 0.0


def _pad_left(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        if len(p):
            ids[b, T - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            valid[b, T - len(p):] = True
    return ids.to(device), valid.to(device)


_TOKENIZE = ("generate takes token ids, not text: tokenize first, e.g. tok = ssmspec.load_tokenizer(model) (the "
             "checkpoint's tokenizer; bytes for random weights), then generate(model, [tok.encode(text) for text in "
             "texts], ...)")


def prompt_lists(prompts, attention_mask=None) -> list[list[int]]:
    """The prompts ``generate`` accepts, as one list of token ids per prompt.

    ``prompts``: a list of id lists (lengths may differ), a (T,) integer tensor (one prompt) or a (B, T) one
    (a batch, as transformers takes it). ``attention_mask`` (only with a tensor, same shape): 0/1 per token;
    the 1s of a row are its prompt, one run padded on the left or the right. Anything else raises a
    TypeError (wrong kind: text, floats, a tokenizer's whole output) or ValueError (wrong shape or mask)
    naming the fix.
    """
    if isinstance(prompts, Tensor):
        return _tensor_prompts(prompts, attention_mask)
    if attention_mask is not None:
        raise TypeError("attention_mask goes with a (B, T) tensor of token ids; a list of id lists needs none "
                        "(each list is one prompt, lengths may differ)")
    if isinstance(prompts, (str, bytes)):
        raise TypeError(_TOKENIZE)
    if isinstance(prompts, Mapping):  # a tokenizer's BatchEncoding
        raise TypeError("prompts is a mapping (a tokenizer's output?); pass its ids and mask: generate(model, "
                        "enc['input_ids'], attention_mask=enc['attention_mask'], ...)")
    try:
        rows = list(prompts)
    except TypeError:
        raise TypeError(f"prompts must be a list of token-id lists or a (B, T) tensor of ids, got "
                        f"{type(prompts).__name__}") from None
    out = []
    for b, row in enumerate(rows):
        if isinstance(row, (str, bytes)):
            raise TypeError(_TOKENIZE)
        if isinstance(row, Tensor) and (row.dim() != 1 or row.dtype.is_floating_point or row.dtype.is_complex):
            raise TypeError(f"prompt {b} is a tensor of shape {tuple(row.shape)} and dtype {row.dtype}; a prompt in a "
                            f"list is a 1-D integer tensor or a list of ids (or pass one (B, T) tensor)")
        if not hasattr(row, "__iter__"):
            raise TypeError(f"prompt {b} is {row!r}, not a list of token ids: prompts holds one list per prompt "
                            f"([[5, 6, 7]] for one prompt)")
        ids = []
        for t in row:
            try:
                ids.append(operator.index(t))  # int, numpy integer, 0-d integer tensor; never a float
            except TypeError:
                raise TypeError(f"prompt {b} holds {t!r}, not a token id (an integer)") from None
        out.append(ids)
    return out


def _tensor_prompts(ids: Tensor, mask) -> list[list[int]]:
    """(T,) or (B, T) token ids plus an optional 0/1 mask of the same shape -> one id list per row."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"the prompt tensor has dtype {ids.dtype}; token ids are integers: pass a (B, T) LongTensor "
                        f"of ids (embeddings or logits are no prompt)")
    if ids.dim() not in (1, 2):
        raise ValueError(f"the prompt tensor has shape {tuple(ids.shape)}; generate takes token ids of shape (T,) "
                         f"(one prompt) or (B, T) (a batch)")
    rows = ids.reshape(1, -1) if ids.dim() == 1 else ids  # (B, T)
    if rows.numel() == 0:
        raise ValueError(f"every prompt needs at least one token; the prompt tensor has shape {tuple(ids.shape)}")
    rows = rows.cpu()
    if mask is None:
        return rows.tolist()
    mask = torch.as_tensor(mask)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but the prompt tensor {tuple(ids.shape)}; "
                         f"they must match, one 0 / 1 per token")
    m = mask.reshape(rows.shape).cpu()
    odd = m[(m != 0) & (m != 1)]
    if odd.numel():
        raise ValueError(f"attention_mask holds {odd.unique()[:5].tolist()}; it must be 0 (padding) or 1 (a prompt "
                         f"token)")
    m = m.bool()  # (B, T)
    count = m.sum(1)  # (B,) prompt length per row
    T = m.shape[1]
    first = m.int().argmax(1)  # (B,) first 1 per row
    last = T - 1 - m.flip(1).int().argmax(1)  # (B,) last 1 per row
    for b in range(m.shape[0]):
        if count[b] == 0:
            raise ValueError(f"attention_mask row {b} is all 0; every prompt needs at least one token")
        if last[b] - first[b] + 1 != count[b]:
            raise ValueError(f"attention_mask row {b} has 0s between its 1s ({m[b].int().tolist()}); the 1s of a row "
                             f"mark its prompt as one run, padded on the left or the right only")
    return [rows[b, first[b]:last[b] + 1].tolist() for b in range(m.shape[0])]


@torch.no_grad()
def generate(model: HybridLM, prompts: Sequence[Sequence[int]] | Tensor, *, max_new_tokens: int,
             attention_mask: Tensor | None = None, strategy: str | StrategyBase = "autoregressive", drafter=None, verifier=None,
             sampling: SamplingConfig = SamplingConfig(), spec: SpecConfig | None = None,
             eos_token_id: int | None = None, hooks: Sequence[Callable[[StepRecord], None]] = (),
             timing: bool = True, progress=None, cuda_graph: bool | None = None) -> GenerationOutput:
    """Decode ``max_new_tokens`` tokens after each prompt: a list of token-id lists (lengths may differ),
    or a (T,) / (B, T) integer tensor with an optional 0/1 ``attention_mask`` of its shape whose 1s mark each
    row's prompt (left or right padding; ``prompt_lists``). Text must be tokenized first
    (``ssmspec.load_tokenizer(model).encode``).

    ``strategy`` keeps the SSM state (a registered name or an instance), ``drafter`` proposes drafts
    (None: standard decoding), ``verifier`` judges them (default: greedy when temperature is 0, else
    speculative sampling). ``cuda_graph``: replay captured steps (default: on CUDA). Every finished step
    calls each hook with a ``StepRecord`` (one step late: the host reads reports without stalling the
    device); ``progress`` is an optional callable(n) told how many steps ran. ``timing`` is kept for
    compatibility: step times always come from events that cost no synchronisation.
    """
    cfg = model.cfg
    prompts = prompt_lists(prompts, attention_mask)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    bad = [(b, int(t)) for b, p in enumerate(prompts) for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:  # the embedding would fail with a bare IndexError
        raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size}) for {cfg.name}; got (prompt, id) "
                         f"{bad[:5]}; encode the prompts with this model's tokenizer (ssmspec.data.load_tokenizer)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = model.device
    ids, valid = _pad_left(prompts, cfg.pad_token_id, device)
    bsz, Tp = ids.shape
    eng = Engine(model, batch=bsz, prefill_len=Tp, max_new_tokens=max_new_tokens, strategy=strategy,
                 drafter=drafter, verifier=verifier, sampling=sampling, spec=spec, eos_token_id=eos_token_id,
                 cuda_graph=cuda_graph)
    out = GenerationOutput(sequences=[[] for _ in range(bsz)], cache_bytes=eng.cache_bytes(),
                           cuda_graph=eng.graphed, drafter_on_device=eng.drafter_on_device)

    def record(rep, seconds: float, tokens_in_call: int) -> bool:
        for b, toks in enumerate(rep.tokens):
            out.sequences[b].extend(toks)
        rec = StepRecord(len(out.steps), seconds, rep.accepted if out.steps else [0] * bsz,
                         [len(t) for t in rep.tokens], tokens_in_call)
        out.steps.append(rec)
        for h in hooks:
            h(rec)
        if progress is not None and rec.index:
            progress(1)
        return all(rep.done)

    t0 = time.perf_counter()
    first = eng.prefill(ids, valid, prompts)
    finished = record(first, time.perf_counter() - t0, bsz * Tp)
    rows, length = eng.strategy.max_rows(bsz, eng.spec), eng.strategy.max_call_len(eng.spec)
    lag = 1 if eng.cuda else 0  # on CUDA the host reads step t-1 while step t runs; CPU steps are synchronous
    while not finished:
        eng.launch()
        for rep, seconds in eng.collect(keep=lag):
            finished = record(rep, seconds, rows * length) or finished
        if finished:
            break
        if len(out.steps) > max_new_tokens + 1:  # every step emits >= 1 token per running sequence
            raise RuntimeError("generation did not finish within max_new_tokens steps (engine bug)")
    eng.collect(keep=0)  # on CUDA one step ran past the end: every sequence was finished (masked)
    return out
