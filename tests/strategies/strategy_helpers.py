"""Shared helpers of the strategy tests."""
from __future__ import annotations

from ssmspec.verify.greedy import GreedyVerifier


class Recorder(GreedyVerifier):
    """Greedy verifier that keeps every call's node logits and verdict."""

    fp32_logits = True  # the fp32 logits, as the speculative verifier reads them

    def __init__(self):
        self.calls = []

    def verify(self, node_logits, drafts, generator=None):
        v = super().verify(node_logits, drafts, generator)
        self.calls.append((node_logits.clone(), v))
        return v
