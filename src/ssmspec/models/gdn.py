"""The Gated DeltaNet mixer of Qwen3-Next / Qwen3.5 (block character ``G``) and its prefill / tree maths.

Mixer (transformers' ``Qwen3_5GatedDeltaNet``; Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` are split
into this layout by the loader): ``in_proj_qkv`` -> q | k | v (pre-conv), ``in_proj_z`` -> z, ``in_proj_b`` -> b,
``in_proj_a`` -> a; the strategy runs the depthwise causal conv (SiLU, no bias) over q | k | v, l2-normalises q
and k, and runs the gated delta rule with beta = sigmoid(b) and g = -exp(A_log) * softplus(a + dt_bias) (the
state (H, N, P) per sequence, k-major, as ``ops/gdn``); the mixer then applies the gated norm of Qwen
(RMSNorm over each value head *first*, times weight, times silu(z): the reverse order of Mamba-2's) and
``out_proj``.

Multi-token maths (seed 000's WY form): from a state S, the tokens of a call whose ancestors are given by a
mask M (M[s, t]: t is s itself or an ancestor; causal for a chain) have, per value head,
    Γ_s = Σ_{t: M[s,t]} g_t,  R_s = β_s (v_s − e^{Γ_s} Sᵀk_s),  A[s, t] = β_s e^{Γ_s − Γ_t} k_t·k_s (t ≠ s, M[s,t])
    U = (I + A)⁻¹ R,   y_s = scale (e^{Γ_s} Sᵀq_s + Σ_{t: M[s,t]} e^{Γ_s − Γ_t} (k_t·q_s) U_t)
and, for a chain, the state after the last token is e^{Γ_L} S + Σ_t e^{Γ_L − Γ_t} k_t U_tᵀ. With a causal
mask this is the chunk of the chunked prefill (``gdn_chunk_scan``); with a tree mask every node's U_t depends
on its ancestors only (A is supported on ancestors, so forward substitution in node order never reads a
sibling), so one solve verifies a whole token tree (``gdn_tree_scan``, used by ``stree``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ssmspec.models.config import ModelConfig

if TYPE_CHECKING:
    from ssmspec.strategies.base import GDNParams


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x² + eps) over the last dim (fla's and transformers' l2norm), in x's dtype."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _cd(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def gdn_tree_scan(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                  mask: Tensor | None = None, scale: float | None = None,
                  final_state: bool = False, corrections: bool = False):
    """The WY form of L tokens from ``state`` (module doc), output only unless ``final_state`` (chains).

    state (B, H, N, P) fp32 (not modified); q, k (B, L, G, N) l2-normed; v (B, L, H, P); g, beta (B, L, H)
    (g = beta = 0 on pad tokens: the state passes through them); mask (B, L, L) bool ancestor-or-self (None:
    causal). Returns y (B, L, H, P) in v's dtype and, with ``final_state``, the state after the last token
    (B, H, N, P) in the compute dtype (fp64 for fp64 inputs; only meaningful for a chain), else None; with
    ``corrections`` also U (B, L, H, P), each node's correction u_t = β_t(v_t − e^{g_t} S_{t-1}ᵀk_t) along its
    own path (what ReplaySSM for GDN caches)."""
    bsz, L, H, P = v.shape
    G, N = q.shape[2], q.shape[3]
    cd = torch.promote_types(_cd(v), state.dtype)
    sc = N ** -0.5 if scale is None else scale
    dev = v.device
    qh = q.to(cd).repeat_interleave(H // G, dim=2)  # (B, L, H, N)
    kh = k.to(cd).repeat_interleave(H // G, dim=2)
    if mask is None:
        mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None].expand(bsz, L, L)
    gf, bf = g.to(cd), beta.to(cd)
    gam = torch.einsum("bst,bth->bsh", mask.to(cd), gf)  # (B, L, H) Γ_s along each node's ancestors
    S = state.to(cd)
    hk = torch.einsum("bhnp,blhn->blhp", S, kh)  # Sᵀk_s
    hq = torch.einsum("bhnp,blhn->blhp", S, qh)  # Sᵀq_s
    eg = torch.exp(gam)[..., None]  # (B, L, H, 1)
    Rv = bf[..., None] * (v.to(cd) - eg * hk)
    diff = gam[:, :, None] - gam[:, None]  # (B, Ls, Lt, H) Γ_s − Γ_t
    dec = torch.where(mask[..., None], torch.exp(torch.where(mask[..., None], diff, 0.0)), 0.0)
    kk = torch.einsum("bshn,bthn->bsth", kh, kh)
    kq = torch.einsum("bshn,bthn->bsth", qh, kh)
    off = ~torch.eye(L, dtype=torch.bool, device=dev)
    A = bf[:, :, None] * dec * kk * off[None, :, :, None]  # (B, Ls, Lt, H) strictly "lower" on the tree
    M = torch.eye(L, dtype=cd, device=dev) + A.permute(0, 3, 1, 2)  # (B, H, L, L) unit lower triangular
    U = torch.linalg.solve_triangular(M, Rv.permute(0, 2, 1, 3), upper=False, unitriangular=True)
    U = U.permute(0, 2, 1, 3)  # (B, L, H, P)
    y = sc * (eg * hq + torch.einsum("bsth,bthp->bshp", dec * kq, U))
    new = None
    if final_state:
        last = gam[:, -1]  # (B, H) Γ_L
        w = torch.exp(last[:, None] - gam)  # (B, L, H)
        new = torch.exp(last)[..., None, None] * S + torch.einsum("blh,blhn,blhp->bhnp", w, kh, U)
    if corrections:
        return y.to(v.dtype), new, U
    return y.to(v.dtype), new


def gdn_chunk_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, chunk_size: int = 64,
                   initial_state: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule over a whole sequence (the prefill): the WY form per chunk of ``chunk_size``
    tokens, the state carried between chunks. Shapes as ``gdn_tree_scan``; returns y (B, L, H, P) and the
    final state (B, H, N, P) fp32."""
    bsz, L, H, P = v.shape
    N = q.shape[3]
    S = (torch.zeros(bsz, H, N, P, device=v.device, dtype=torch.float32) if initial_state is None
         else initial_state.float())
    ys = []
    for c0 in range(0, L, chunk_size):
        sl = slice(c0, min(L, c0 + chunk_size))
        y, S = gdn_tree_scan(S, q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=scale, final_state=True)
        ys.append(y)
    y = torch.cat(ys, dim=1) if ys else v.new_zeros(bsz, 0, H, P)
    return y, S.float()


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
        from ssmspec.models.layers import _weight_key
        from ssmspec.strategies.base import GDNParams

        key = tuple(_weight_key(t) for t in (self.conv1d.weight, self.dt_bias, self.A_log))
        if self._params is None or key != self._key:
            c = self.cfg
            with torch.no_grad():
                A = -torch.exp(self.A_log.float())
            self._params = GDNParams(index=self.index, conv_weight=self.conv1d.weight[:, 0, :], dt_bias=self.dt_bias,
                                     A=A, k_heads=c.gdn_k_heads, v_heads=c.gdn_v_heads, k_dim=c.gdn_k_dim,
                                     v_dim=c.gdn_v_dim, chunk_size=c.gdn_chunk_size)
            self._key = key
        return self._params

    def prepare(self) -> "GDNParams":
        self._params = None
        return self.params()

    def forward(self, h: Tensor, ctx) -> Tensor:
        from ssmspec.strategies.base import GDNInputs

        c = self.cfg
        b, L, _ = h.shape
        inp = GDNInputs(qkv=self.in_proj_qkv(h), b=self.in_proj_b(h), a=self.in_proj_a(h))
        y = ctx.strategy.run_mixer(self.params(), inp, ctx.step)  # (B', L, H, P)
        z = self.in_proj_z(h).view(b, L, c.gdn_v_heads, c.gdn_v_dim)
        return self.out_proj(self.norm(y.to(h.dtype), z).reshape(b, L, -1))
