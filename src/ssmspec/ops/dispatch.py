"""Choosing between a Triton kernel and its pure-PyTorch twin."""
from __future__ import annotations

import os

import torch


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests)."""
    if os.environ.get("SSMSPEC_FORCE_REFERENCE", "0") == "1":
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return interpret_mode()
