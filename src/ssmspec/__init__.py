"""ssmspec: speculative decoding on state-space models and their attention hybrids.

The Python API (README "Python API"), importable from the package itself::

    from ssmspec import load_preset, build_model, generate, make_drafter

    model = build_model(load_preset("tiny-hybrid"), seed=0)
    out = generate(model, [[5, 6, 7, 8]], max_new_tokens=16, strategy="replay",
                   drafter=make_drafter("png", ngram=2, draft_len=3))

Names are resolved on first use, so ``import ssmspec`` (the command line, ``ssmspec.paths``) does not
load torch.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_API = {
    # models: presets with the published sizes, random weights, checkpoints
    "ModelConfig": "ssmspec.models", "HybridLM": "ssmspec.models", "build_model": "ssmspec.models",
    "load_model": "ssmspec.models", "load_preset": "ssmspec.models", "preset_names": "ssmspec.models",
    # the generation loop
    "generate": "ssmspec.engine", "GenerationOutput": "ssmspec.engine", "StepRecord": "ssmspec.engine",
    # strategies (how the SSM state is kept), drafters, verifiers
    "make_strategy": "ssmspec.strategies", "strategy_names": "ssmspec.strategies", "SpecConfig": "ssmspec.strategies",
    "make_drafter": "ssmspec.drafting", "drafter_names": "ssmspec.drafting",
    "make_verifier": "ssmspec.verify", "verifier_names": "ssmspec.verify", "SamplingConfig": "ssmspec.verify",
    # prompts and tokenizers
    "load_prompts": "ssmspec.data", "load_tokenizer": "ssmspec.data",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'ssmspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
