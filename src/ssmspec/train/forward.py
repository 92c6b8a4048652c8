"""A differentiable parallel forward of ``HybridLM`` for training, through the model's own strategy hook.

The model hands every mixer's projected inputs to a strategy (``strategies/base.py``); ``TrainStrategy`` runs
the prefill maths of the inference path (conv, then the chunked SSD or WY scan from a zero state) and keeps no
state. Three things differ from inference:

* the per-step constants are rebuilt from the module's parameters on every call: ``Mamba2Mixer.params()``
  caches A = -exp(A_log) under ``no_grad`` (an inference cache), which would cut A_log out of the graph;
* the Mamba-2 scan is ``ops.ssd_grad.ssd_chunk_scan_trainable``: on CUDA the one-kernel Triton forward and its
  tile-parallel backward (seed 004), elsewhere autograd through the same fp32 reference inference runs on CPU.
  ``mamba_prefill`` is ``run_prefill``'s conv and scan with that one call swapped;
* attention is ``CausalAttention``: causal SDPA over the call's own keys, no KV cache to write.

Every other op runs its PyTorch reference (``reference_ops``: those Triton kernels have no backward), so the
same code trains on CPU and CUDA. The model and strategy code is left as it is: the files that decide
benchmark results stay untouched (issue 24). fla-core's GDN chunk kernels are not used for training: fla 0.6
refuses their backward on Hopper GPUs with Triton < 3.7.1 (wrong gradients there, fla issue #640), which is what
the GPU machines run, so GDN mixers train through the PyTorch WY form.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from ssmspec.engine.context import RunContext
from ssmspec.models.model import HybridLM
from ssmspec.ops.causal_conv1d import causal_conv1d
from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.ssd_grad import ssd_chunk_scan_trainable
from ssmspec.strategies.base import (GDNInputs, GDNParams, MambaParams, MixerInputs, StepInputs, StrategyBase,
                                     run_prefill_gdn)


@contextmanager
def reference_ops() -> Iterator[None]:
    """Every op of ``ssmspec.ops`` on its PyTorch reference inside the block (``SSMSPEC_OPS_BACKEND``, read at
    each call by ``ops.dispatch.use_triton``); the previous setting comes back afterwards."""
    key = "SSMSPEC_OPS_BACKEND"
    old = os.environ.get(key)
    os.environ[key] = "reference"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def mamba_prefill(p: MambaParams, inp: MixerInputs, step: StepInputs, *, chunk_size: int, backend: str) -> Tensor:
    """``strategies/base.py:run_prefill`` from a zero state (conv, then the chunked scan; left padding masked)
    with the scan of ``ssd_chunk_scan_trainable`` on ``backend``. Returns y (B, L, I); no state is kept."""
    xbc = inp.xbc
    if step.valid is not None:
        xbc = xbc * step.valid[..., None].to(xbc.dtype)  # pads feed zeros, as the empty history does
    xbc_conv, _ = causal_conv1d(xbc, p.conv_weight, p.conv_bias, activation=p.activation)
    x, B, C = p.split_xbc(xbc_conv)
    dt = p.discretize(inp.dt, step.valid)
    y, _ = ssd_chunk_scan_trainable(x, dt, p.A, B, C, p.D, chunk_size=chunk_size, backend=backend)
    return y.reshape(*y.shape[:2], -1).to(inp.xbc.dtype)


class TrainStrategy(StrategyBase):
    """Prefill-only, stateless strategy whose outputs carry gradients to every mixer parameter. ``scan_backend``
    is the Mamba-2 scan's backend, resolved from the model's device and dtype when the strategy is made (outside
    ``reference_ops``, so ``SSMSPEC_OPS_BACKEND`` as the user set it decides): the Triton kernels on CUDA."""

    name = "train"
    speculative = False

    def __init__(self, model: HybridLM) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.mamba = [b.mixer for b in model.layers if b.kind == "M"]  # index = MambaParams.index
        self.gdn = [b.mixer for b in model.layers if b.kind == "G"]  # index = GDNParams.index
        if model.cfg.d_xb:
            raise ValueError("training MambaInLlama models (d_xb > 0) is not supported; train a mamba2, nemotron_h "
                             "or qwen3_5 family model")
        self.scan_backend = "triton" if use_triton(next(model.parameters())) else "reference"

    def prefill(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        m = self.mamba[p.index]
        p = dataclasses.replace(p, conv_weight=m.conv1d.weight[:, 0, :], conv_bias=m.conv1d.bias, dt_bias=m.dt_bias,
                                A=-torch.exp(m.A_log.float()), D=m.D)
        return mamba_prefill(p, inp, step, chunk_size=self.cfg.chunk_size, backend=self.scan_backend)  # (B, L, I)

    def prefill_gdn(self, p: GDNParams, inp: GDNInputs, step: StepInputs) -> Tensor:
        m = self.gdn[p.index]
        p = dataclasses.replace(p, conv_weight=m.conv1d.weight[:, 0, :], dt_bias=m.dt_bias,
                                A=-torch.exp(m.A_log.float()))
        return run_prefill_gdn(p, inp, step)[0]  # (B, L, H, P)

    def mix(self, p, inp, step):
        raise ValueError("TrainStrategy runs whole sequences only (StepInputs.prefill=True)")


class CausalAttention:
    """Stands in for a ``KVCache``: causal SDPA of a call over its own keys (GQA), nothing kept."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step: StepInputs, *, scale: float) -> Tensor:
        """q (B, L, Hq, D), k, v (B, L, Hkv, D) -> (B, L, Hq, D)."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=scale, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)


def train_context(model: HybridLM, ids: Tensor, *, attention: int | None = None, strategy: bool = True) -> RunContext:
    """The context of a training call on ids (B, L): positions 0 .. L - 1, ``attention`` causal-attention stand-ins
    (default: one per attention block of the model), the ``TrainStrategy`` (``strategy=False``: none, for the MTP
    head, which has no SSM block)."""
    B, L = ids.shape
    step = StepInputs(input_ids=ids, positions=torch.arange(L, device=ids.device)[None].expand(B, L), prefill=True)
    n = len(model.cfg.attention_layers) if attention is None else attention
    return RunContext(strategy=TrainStrategy(model) if strategy else None, kv=[CausalAttention() for _ in range(n)],
                      step=step)


def train_logits(model: HybridLM, ids: Tensor) -> Tensor:
    """ids (B, L) -> logits (B, L, V) fp32, differentiable in every parameter (module doc)."""
    ctx = train_context(model, ids)  # outside reference_ops: the strategy picks the scan's backend when made
    with reference_ops():
        return model(ids, ctx)


def train_hidden(model: HybridLM, ids: Tensor) -> Tensor:
    """ids (B, L) -> the final hidden states (B, L, d) after the final norm (what the LM head and an MTP head read)."""
    ctx = train_context(model, ids)  # outside reference_ops (train_logits)
    with reference_ops():
        return model.hidden(ids, ctx)
