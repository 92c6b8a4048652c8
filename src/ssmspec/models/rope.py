"""Rotary position embeddings (Llama's half-rotation layout) and Llama 3.1's RoPE scaling, which the attention
layers of MambaInLlama (``mil.py``) keep."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ssmspec.models.config import ModelConfig


def rope_cos_sin(positions: Tensor, dim: int, theta: float, dtype, cfg: ModelConfig | None = None) -> tuple[Tensor, Tensor]:
    """positions (B, L) -> cos, sin (B, L, dim) (half-rotation layout of Llama); ``cfg`` with a
    rope_scaling_factor != 1 applies Llama 3.1's scaling (``llama3_inv_freq``)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    if cfg is not None and cfg.rope_scaling_factor != 1.0:
        inv = llama3_inv_freq(inv, cfg)
    ang = positions.float()[..., None] * inv  # (B, L, dim/2)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, L, heads, D)."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


def llama3_inv_freq(inv_freq: Tensor, cfg: ModelConfig) -> Tensor:
    """Llama 3.1's "llama3" RoPE scaling of the inverse frequencies (dim/2,): wavelengths shorter than
    original_max_pos / high_freq_factor are kept, longer than original_max_pos / low_freq_factor divided by
    the factor, and the band between interpolated smoothly (transformers' ``_compute_llama3_parameters``)."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_pos
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = scaled.where(wavelen >= old / high, inv_freq)  # short waves: unchanged
    return out.where(wavelen <= old / low, inv_freq / factor)  # long waves: divided by the factor
