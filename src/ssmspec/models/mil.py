"""MambaInLlama's Mamba-2 mixer (Wang et al. 2024, ``jxiw/MambaInLlama`` ``mamba2/hybrid_mamba_layer.py``);
Llama 3.1's RoPE scaling, which its attention layers keep, is ``rope.llama3_inv_freq``.

The mixer was distilled from an attention layer, and its projections keep the attention's shapes (the
checkpoint initialised x, B, C from v, k, q):

    in_proj -> z (d_inner) | x (d_xb) | B (d_xb) | C (d_inner) | dt (H)          [z, x, B, C, dt]
    conv over x | B | C (d_xb + d_xb + d_inner channels), silu
    x (d_xb / P heads) and B (d_xb / N groups) repeated head-wise (``repeat_kv``, repeat_interleave) to the
    H heads and G groups of C; H = G and P = N in the published models (every head has its own B and C).

Only the split after the conv differs from ``Mamba2Mixer``: every strategy keeps conv states of the
narrower ``cfg.conv_dim`` and calls ``MambaParams.split_xbc``, which ``MILParams`` overrides with the
repeat. Gated norm (group size d_inner / G), D, dt and A are those of Mamba-2.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.layers import Mamba2Mixer, MambaParams


@dataclass
class MILParams(MambaParams):
    """``MambaParams`` whose post-conv split repeats x and B head-wise (d_xb-wide x and B)."""

    d_xb: int = 0  # width of x and of B in the conv output

    def split_xbc(self, xbc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Post-conv (B, L, 2·d_xb + G·N) -> x (B, L, H, P), B (B, L, G, N), C (B, L, G, N); x head h is x head
        h // (H / (d_xb/P)) of the call, B group g is B group g // (G / (d_xb/N)) (MambaInLlama's repeat_kv)."""
        b, L, _ = xbc.shape
        H, P, G, N = self.heads, self.head_dim, self.groups, self.state_size
        xh, bg = self.d_xb // P, self.d_xb // N
        x, B, C = xbc.split([self.d_xb, self.d_xb, G * N], dim=-1)
        x = x.reshape(b, L, xh, 1, P).expand(b, L, xh, H // xh, P).reshape(b, L, H, P)
        B = B.reshape(b, L, bg, 1, N).expand(b, L, bg, G // bg, N).reshape(b, L, G, N)
        return x, B, C.reshape(b, L, G, N)


class MILMixer(Mamba2Mixer):
    """``Mamba2Mixer`` with MambaInLlama's d_xb-wide x and B (same parameter names and forward)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        if not cfg.d_xb:
            raise ValueError(f"model {cfg.name!r}: MILMixer needs d_xb > 0 (MambaInLlama's x / B width)")
        super().__init__(cfg, index)

    def prepare(self) -> MambaParams:
        p = super().prepare()
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(MambaParams)}
        self._params = MILParams(**fields, d_xb=self.cfg.d_xb)
        return self._params
