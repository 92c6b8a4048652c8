"""Target distributions from logits: temperature, top-k and top-p (nucleus), and seeded sampling."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens (0: all)
    seed: int = 0  # seeds the torch.Generator that all sampling draws from

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no top-k filter), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """(..., V) logits -> (..., V) fp32 probabilities after temperature / top-k / top-p.
    Greedy configs give the one-hot of the argmax."""
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(..., V) -> (...) int64 draws."""
    # argmax(p / E) with E ~ Exp(1) draws index i with probability p_i -- what torch.multinomial does for one
    # sample, without multinomial's host-side check of the probabilities (a device sync that a CUDA graph
    # cannot capture)
    flat = probs.reshape(-1, probs.shape[-1])
    e = torch.empty_like(flat, dtype=torch.float32).exponential_(generator=generator).clamp_(min=1e-30)
    return (flat.float() / e).argmax(-1).reshape(probs.shape[:-1])
