"""Choosing between a Triton kernel and its pure-PyTorch twin.

Every public op takes ``backend="auto" | "triton" | "reference"``:
- ``auto``: Triton when every tensor lives on CUDA and none is float64, the reference otherwise (CPU
  model and strategy tests stay fast and never touch the interpreter). ``SSMSPEC_OPS_BACKEND=triton|reference`` overrides ``auto``
  process-wide (e.g. reference kernels on a GPU for an A/B run, or the interpreter for a strategy test);
  the older ``SSMSPEC_FORCE_REFERENCE=1`` still forces the reference.
- ``triton``: the kernel; on CPU tensors this needs ``TRITON_INTERPRET=1`` set before the Triton modules
  are imported (``triton.jit`` decides interpreter mode when the kernel is decorated; tests/ops/conftest.py
  sets it first). The Triton modules are imported lazily, inside the public functions, for that reason.
- ``reference``: the naive twin.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "triton", "reference")


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor | None, backend: str = "auto") -> bool:
    """True when the op should run its Triton kernel on these tensors (None entries are ignored)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if os.environ.get("SSMSPEC_FORCE_REFERENCE", "0") == "1":
            return False
        backend = os.environ.get("SSMSPEC_OPS_BACKEND", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"SSMSPEC_OPS_BACKEND must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if backend == "auto":  # float64 (exact-agreement tests) runs on the reference only
        return on_cuda and not any(t.dtype == torch.float64 for t in tensors if t is not None)
    if not on_cuda and not interpret_mode():
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before the first "
                         "import of ssmspec's Triton modules (CPU interpreter); use backend='reference' on CPU")
    return True


DECODE_FUSIONS = ("conv_ssm", "gemv", "norm_gemv")  # the parts ``SSMSPEC_DECODE_FUSION`` may name


DEFAULT_DECODE_FUSION = "gemv"
_SCOPE: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("ssmspec_decode_fusion", default=None)


def decode_fusion() -> frozenset[str]:
    """Which decode kernels the Triton backend uses (``SSMSPEC_DECODE_FUSION``): ``gemv`` (the default), ``none``
    (norm, cuBLAS projection, conv and SSM update each their own launch), ``all``, or a comma-separated list of
    - ``gemv``: the decode projections and the LM head (at most ``models.layers.DECODE_ROWS`` rows) through
      ``ops/gemv``'s GEMV instead of cuBLAS: no split-K reduce launch, and a row's result does not depend on how
      many rows share the call;
    - ``conv_ssm``: a Mamba-2 layer's conv and single-token SSM update in one launch (``ops/conv_ssm_update``);
    - ``norm_gemv``: the block's norms fused into those GEMVs' prologue.
    Measured with ``throughput_ar`` (one H100, commit a7357e1, context 512, ms a decode step at batch 1 / 4 / 16):
    mamba2-2.7b none 3.317 / 3.803 / 5.332, gemv 3.262 / 3.693 / 5.329, gemv,conv_ssm 3.322 / 3.993 / 6.614, all
    4.701 / 6.722 / 6.626; nemotron-h-4b none 4.043 / 4.323 / 5.222, gemv 3.848 / 4.103 / 5.219, gemv,conv_ssm
    3.866 / 4.271 / 5.829, all 4.672 / 5.859 / 5.828. So ``gemv`` is on and the other two stay opt-in until they
    beat the separate launches. Inside ``decode_fusion_scope`` (a draft model's calls, ``engine/draft.py``) the
    scope's parts stand instead."""
    scoped = _SCOPE.get()
    if scoped is not None:
        return scoped
    return parse_decode_fusion(os.environ.get("SSMSPEC_DECODE_FUSION", DEFAULT_DECODE_FUSION), "SSMSPEC_DECODE_FUSION")


def parse_decode_fusion(raw: str, name: str) -> frozenset[str]:
    """The parts a ``none`` / ``all`` / comma-separated value names; ``name`` (the variable) is in the error."""
    raw = raw.strip()
    if raw == "none":
        return frozenset()
    if raw == "all":
        return frozenset(DECODE_FUSIONS)
    parts = frozenset(p.strip() for p in raw.split(","))
    bad = sorted(parts - set(DECODE_FUSIONS))
    if bad or not parts:
        raise ValueError(f"{name} must be none, all or a comma-separated list of "
                         f"{', '.join(DECODE_FUSIONS)}; got {raw!r}")
    return parts


def draft_decode_fusion() -> frozenset[str] | None:
    """The decode kernels of a draft model's calls (``SSMSPEC_DRAFT_DECODE_FUSION``, the values of
    ``SSMSPEC_DECODE_FUSION``), or None where it is unset: the draft then takes the target's. A draft is a
    small model at batch 1 bound by its launches, where a norm fused into the GEMV's prologue (a pass over a
    few hundred channels) may pay though it does not at the sizes measured above; this sets the draft's kernels
    without moving the target's or the autoregressive baseline's."""
    raw = os.environ.get("SSMSPEC_DRAFT_DECODE_FUSION")
    return None if raw is None else parse_decode_fusion(raw, "SSMSPEC_DRAFT_DECODE_FUSION")


@contextlib.contextmanager
def decode_fusion_scope(parts: frozenset[str] | None) -> Iterator[None]:
    """``decode_fusion()`` returns ``parts`` inside (None: no scope, the process setting). A captured graph keeps
    the kernels chosen while it was captured, so a graph captured inside keeps the scope's."""
    if parts is None:
        yield
        return
    token = _SCOPE.set(frozenset(parts))
    try:
        yield
    finally:
        _SCOPE.reset(token)
