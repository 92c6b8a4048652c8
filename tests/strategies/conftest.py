"""Shared lossless harness for every strategy (tests/strategies/test_lossless.py and the strategy files'
own tests): tiny float64 models, their autoregressive greedy reference, and the draft settings a strategy
is checked with.

The drafters are the real ones (``ssmspec.drafting``): ``oracle`` (the reference continuation, each token
kept with probability p, else a different token) for controlled acceptance, ``png`` (prompt n-gram
lookup) for drafts a user would get. Float64 models so that no argmax tie can flip and agreement can be
exact (the SSM states themselves stay fp32, as every strategy keeps them).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from ssmspec.drafting.oracle import Oracle
from ssmspec.drafting.png import PromptNgram
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.model import build_model
from ssmspec.strategies import make_strategy, strategy_names

PRESETS = ["tiny-mamba2", "tiny-hybrid"]  # pure Mamba-2 and a Nemotron-H-style hybrid (attention, MoE)
PROMPTS = [[5, 17, 33, 8], [9, 10, 11, 12, 13, 14, 15], [42, 7]]  # batch 3, different lengths: left padding
NEW = 14  # new tokens per sequence
TREE = [0, 0, 1, 1, 2, 3, 5, 0]  # 8 nodes, depth 3, ragged: leaves at depth 1, 2 and 3


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models: one intra-op thread per test process. With xdist on a shared 2-core machine, torch's
    default (one thread per core in every worker) oversubscribes the cores and spin-waits, which made these
    tests 20-100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def reference_run(preset: str) -> tuple[torch.nn.Module, list[list[int]]]:
    """(float64 model with seeded random weights, its autoregressive greedy continuation of PROMPTS)."""
    model = build_model(load_preset(preset), seed=0, dtype=torch.float64)
    ref = generate(model, PROMPTS, max_new_tokens=NEW, strategy="autoregressive", timing=False).sequences
    return model, ref


@dataclass(frozen=True)
class DraftCase:
    """One draft setting of the lossless grid."""

    id: str
    drafter: str  # oracle | png
    S: int = 0  # chain length (trees: depth)
    D: int = 1  # chains per sequence
    p: float = 0.5  # oracle: probability a draft token is the true one
    tree: bool = False  # oracle over the static TREE instead of chains

    def make(self, ref: list[list[int]], vocab: int, seed: int = 3):
        if self.drafter == "png":
            return PromptNgram(ngram=2, num_drafts=self.D, draft_len=self.S)
        if self.tree:
            return Oracle(p=self.p, tree=TREE, reference=ref, vocab_size=vocab, seed=seed)
        return Oracle(p=self.p, draft_len=self.S, num_drafts=self.D, reference=ref, vocab_size=vocab, seed=seed)


# S in {1, 3, 5}, p in {0, 0.5, 1}, several drafts, a tree (tree strategies only) and PNG
DRAFT_CASES = [
    DraftCase("S1-p0.5", "oracle", S=1),
    DraftCase("S3-p0", "oracle", S=3, p=0.0),
    DraftCase("S3-p0.5", "oracle", S=3),
    DraftCase("S3-p1", "oracle", S=3, p=1.0),
    DraftCase("S5-p0.5", "oracle", S=5),
    DraftCase("S5-p1", "oracle", S=5, p=1.0),
    DraftCase("2xS3-p0.5", "oracle", S=3, D=2),
    DraftCase("3xS2-p1", "oracle", S=2, D=3, p=1.0),
    DraftCase("tree-p0.5", "oracle", S=3, tree=True),
    DraftCase("png-2xS3", "png", S=3, D=2),
]


def speculative_strategies() -> list[str]:
    """Every registered strategy that takes drafts (new strategies are covered automatically)."""
    return [n for n in strategy_names() if make_strategy(n).speculative]


def supports_trees(name: str) -> bool:
    return make_strategy(name).supports_trees


@pytest.fixture(scope="session", params=PRESETS)
def preset(request) -> str:
    return request.param
