"""The input forms the GDN ops take besides today's (l2-normed q, k; log-decay g; beta in (0, 1)), as fla-core's
kernels and transformers' Qwen3-Next / Qwen3.5 mixers hand them over:
    use_qk_l2norm   q, k raw; l2-normalised in the op (fla's ``use_qk_l2norm_in_kernel``)
    raw gate        g = None and a (B, L, H) raw with A_log, dt_bias (H,):  g = −exp(A_log)·softplus(a + dt_bias)
    beta_logits     beta given as the logits b:  beta = sigmoid(b)
``check_forms`` validates a call's choice (one ValueError naming the fix), ``resolve_forms`` turns the new forms
into today's in PyTorch (the reference paths and the chunked prefill; the Triton decode kernel computes them
in-kernel). The law every test checks: an op given the new forms equals the same op given their resolution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssmspec.ops.gdn.l2norm import l2norm


def check_forms(g: Tensor | None, beta: Tensor, *, a: Tensor | None, A_log: Tensor | None,
                dt_bias: Tensor | None, H: int) -> None:
    """One gate form, and the pieces it needs: g alone, or a with A_log and dt_bias (H,)."""
    if g is not None and (a is not None or A_log is not None or dt_bias is not None):
        raise ValueError("give the gate either as g (the log-decay) or as a with A_log and dt_bias (the raw form "
                         "g = -exp(A_log)*softplus(a + dt_bias)), not both: pass g=None with the raw form")
    if g is None:
        if a is None or A_log is None or dt_bias is None:
            raise ValueError("g=None takes the raw gate form: pass a (B, L, H), A_log (H,) and dt_bias (H,) "
                             f"(got a={_shape(a)}, A_log={_shape(A_log)}, dt_bias={_shape(dt_bias)}), or pass g")
        if A_log.shape != (H,) or dt_bias.shape != (H,):
            raise ValueError(f"A_log and dt_bias must be (H,) = ({H},), one per value head; got {tuple(A_log.shape)} "
                             f"and {tuple(dt_bias.shape)}")
        if a.shape != beta.shape:
            raise ValueError(f"a must have beta's shape {tuple(beta.shape)} (B, L, H), got {tuple(a.shape)}")


def _shape(t: Tensor | None):
    return None if t is None else tuple(t.shape)


def raw_gate(a: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tensor:
    """g = −exp(A_log)·softplus(a + dt_bias) in at least fp32, A_log and dt_bias (H,) broadcast over a (..., H):
    the order of ``models.gdn.GDNParams.gates`` (A = −exp(A_log) in fp32 first), so the two agree bit for bit."""
    cd = torch.promote_types(a.dtype, torch.float32)
    A = -torch.exp(A_log.float())
    return A.to(cd) * F.softplus(a.to(cd) + dt_bias.to(cd))


def resolve_forms(q: Tensor, k: Tensor, g: Tensor | None, beta: Tensor, *, use_qk_l2norm: bool = False,
                  a: Tensor | None = None, A_log: Tensor | None = None, dt_bias: Tensor | None = None,
                  beta_logits: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, k, g, beta) in today's form: q, k l2-normed (``l2norm``, in their dtype, as the mixer does), g the
    log-decay and beta = sigmoid(logits) in at least fp32. Validates the choice first (``check_forms``)."""
    check_forms(g, beta, a=a, A_log=A_log, dt_bias=dt_bias, H=beta.shape[-1])
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if g is None:
        g = raw_gate(a, A_log, dt_bias)
    if beta_logits:
        beta = torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32)))
    return q, k, g, beta
