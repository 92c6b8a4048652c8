"""Verifiers: judge a step's draft tree against the target logits and return a ``Verdict``."""
from __future__ import annotations

from ssmspec.verify.base import Verdict, Verifier
from ssmspec.verify.distributions import SamplingConfig
from ssmspec.verify.greedy import GreedyVerifier
from ssmspec.verify.speculative import SpeculativeVerifier

# name -> factory(sampling=...). `speculative` handles chains (Leviathan) and trees (multi-step sampling);
# generate() asks for it when temperature > 0.
_VERIFIERS = {"greedy": lambda sampling=None: GreedyVerifier(),
              "speculative": lambda sampling=None: SpeculativeVerifier(sampling)}


def register_verifier(name: str, factory) -> None:
    _VERIFIERS[name] = factory


def verifier_names() -> list[str]:
    return sorted(_VERIFIERS)


def make_verifier(name: str, *, sampling: SamplingConfig | None = None):
    if name not in _VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(verifier_names())}")
    return _VERIFIERS[name](sampling=sampling)


__all__ = [
    "GreedyVerifier",
    "SamplingConfig",
    "SpeculativeVerifier",
    "Verdict",
    "Verifier",
    "make_verifier",
    "register_verifier",
    "verifier_names",
]
