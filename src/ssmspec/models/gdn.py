"""The Gated DeltaNet mixer of Qwen3-Next / Qwen3.5 (block character ``G``) and its prefill / tree maths.

Mixer (transformers' ``Qwen3_5GatedDeltaNet``; Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are split
into this layout by the loader): ``in_proj_qkv`` -> q | k | v (pre-conv), ``in_proj_z`` -> z, ``in_proj_b`` -> b,
``in_proj_a`` -> a; the strategy runs the depthwise causal conv (SiLU, no bias) over q | k | v, l2-normalises q
and k, and runs the gated delta rule with beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) (the
state (H, N, P) per sequence, k-major, as ``ops/gdn``); the mixer then applies the gated norm of Qwen
(RMSNorm over each value head *first*, times weight, times silu(z): the reverse order of Mamba-2's) and
``out_proj``.

Types the mixer hands to a strategy (here, where the model defines them; ``strategies.base`` re-exports them):
``GDNParams`` (weights and sizes, the post-conv split and the gates) and ``GDNInputs`` (the projections before
the conv). The multi-token maths (the chunked WY prefill ``gdn_chunk_scan``, the tree-masked ``gdn_tree_scan``)
and ``l2norm`` are ops: ``ops/gdn/chunk.py``, ``ops/gdn/l2norm.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.layers import _weight_key, linear
from ssmspec.ops.gdn import l2norm


@dataclass
class GDNParams:
    """One Gated DeltaNet mixer's weights and sizes, as strategies need them (q, k, v as seed 000 writes them)."""

    index: int  # position among the model's GDN mixers
    conv_weight: Tensor  # (conv_dim, W) over q | k | v, no bias
    dt_bias: Tensor  # (H,)
    A: Tensor  # (H,) fp32, = -exp(A_log)
    k_heads: int  # G
    v_heads: int  # H
    k_dim: int  # N
    v_dim: int  # P
    chunk_size: int = 64
    A_log: Tensor | None = None  # (H,) the raw parameter, for the ops' raw gate form (``ops/gdn/forms.py``)
    conv_bias = None
    activation = "silu"
    kind = "gdn"

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def split(self, qkv: Tensor, normed: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Post-conv (B, L, conv_dim) -> q, k (B, L, G, N) l2-normalised (raw with ``normed=False``, for an op
        called with ``use_qk_l2norm``), v (B, L, H, P)."""
        b, L, _ = qkv.shape
        kd = self.k_heads * self.k_dim
        q, k, v = qkv.split([kd, kd, self.v_heads * self.v_dim], dim=-1)
        q, k = q.reshape(b, L, self.k_heads, self.k_dim), k.reshape(b, L, self.k_heads, self.k_dim)
        if normed:
            q, k = l2norm(q), l2norm(k)
        return q, k, v.reshape(b, L, self.v_heads, self.v_dim)

    def gates(self, a: Tensor, b: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """g = -exp(A_log)·softplus(a + dt_bias) and beta = sigmoid(b), (B, L, H) in at least fp32; both 0 on
        invalid (pad / no-op) tokens, which leaves the state untouched (decay e^0 = 1, correction β·(...) = 0)."""
        cd = torch.promote_types(a.dtype, torch.float32)
        g = self.A.to(cd) * F.softplus(a.to(cd) + self.dt_bias.to(cd))
        beta = torch.sigmoid(b.to(cd))
        if valid is not None:
            ok = valid[..., None].to(cd)
            g, beta = g * ok, beta * ok
        return g, beta


@dataclass
class GDNInputs:
    """What a GDN mixer hands to the strategy: its projections before the conv."""

    qkv: Tensor  # (B', L, conv_dim) pre-conv q | k | v
    b: Tensor  # (B', L, H) pre-sigmoid beta
    a: Tensor  # (B', L, H) pre-softplus gate



class GatedRMSNormQwen(nn.Module):
    """Qwen's RMSNormGated over each value head: RMSNorm(y) * weight, then * silu(z) (norm before gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        """y, z (..., dim) -> (..., dim) in y's dtype."""
        dt = y.dtype
        yf = y.float() if y.dtype != torch.float64 else y
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * yf.to(dt)
        return (out * F.silu(z.to(yf.dtype))).to(dt)


class GDNMixer(nn.Module):
    """Gated DeltaNet token mixer (module doc); the strategy keeps its conv and delta-rule state."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index  # index among the model's GDN mixers
        d, H, cd, vd = cfg.d_model, cfg.gdn_v_heads, cfg.gdn_conv_dim, cfg.gdn_value_dim
        self.in_proj_qkv = nn.Linear(d, cd, bias=False)
        self.in_proj_z = nn.Linear(d, vd, bias=False)
        self.in_proj_b = nn.Linear(d, H, bias=False)
        self.in_proj_a = nn.Linear(d, H, bias=False)
        self.conv1d = nn.Conv1d(cd, cd, cfg.conv_kernel, groups=cd, padding=cfg.conv_kernel - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
        self.norm = GatedRMSNormQwen(cfg.gdn_v_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(vd, d, bias=False)
        self._params: GDNParams | None = None
        self._key: tuple | None = None

    def params(self) -> "GDNParams":
        """The strategy-side constants (A = -exp(A_log) fp32, conv weight (conv_dim, W)); rebuilt when a weight
        changed (same identity rule as ``Mamba2Mixer.params``)."""
        key = tuple(_weight_key(t) for t in (self.conv1d.weight, self.dt_bias, self.A_log))
        if self._params is None or key != self._key:
            c = self.cfg
            with torch.no_grad():
                A = -torch.exp(self.A_log.float())
            self._params = GDNParams(index=self.index, conv_weight=self.conv1d.weight[:, 0, :], dt_bias=self.dt_bias,
                                     A=A, k_heads=c.gdn_k_heads, v_heads=c.gdn_v_heads, k_dim=c.gdn_k_dim,
                                     v_dim=c.gdn_v_dim, chunk_size=c.gdn_chunk_size, A_log=self.A_log)
            self._key = key
        return self._params

    def prepare(self) -> "GDNParams":
        self._params = None
        return self.params()

    def forward(self, h: Tensor, ctx) -> Tensor:
        c = self.cfg
        b, L, _ = h.shape
        inp = GDNInputs(qkv=linear(h, self.in_proj_qkv), b=linear(h, self.in_proj_b), a=linear(h, self.in_proj_a))
        y = ctx.strategy.run_mixer(self.params(), inp, ctx.step)  # (B', L, H, P)
        z = linear(h, self.in_proj_z).view(b, L, c.gdn_v_heads, c.gdn_v_dim)
        return linear(self.norm(y.to(h.dtype), z).reshape(b, L, -1), self.out_proj)
