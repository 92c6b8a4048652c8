"""Benchmark inputs: synthetic prompts (conf/data/synthetic.yaml) and progress reporting."""
from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def synthetic_prompts(batch: int, length: int, vocab_size: int, *, seed: int = 0, min_token_id: int = 3,
                      device="cpu") -> Tensor:
    """(batch, length) int64 token ids drawn uniformly from [min_token_id, vocab_size) with a seeded CPU
    generator (the same prompts on every device), then moved to ``device``."""
    if batch < 1 or length < 1:
        raise ValueError(f"synthetic prompts need batch >= 1 and length >= 1, got {batch} x {length}")
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"data.min_token_id={min_token_id} must lie in [0, vocab_size={vocab_size})")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min_token_id, vocab_size, (batch, length), generator=gen).to(device)


def track(items: Iterable[T], *, desc: str, total: int | None = None) -> Iterable[T]:
    """A progress bar over ``items`` on an interactive terminal (tqdm, on stderr); plain iteration
    otherwise (logs and CI stay clean; the runner logs one line per result row instead)."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, total=total, disable=not sys.stderr.isatty(), leave=False, dynamic_ncols=True)
