"""The l2 normalisation a GDN mixer applies to q and k after the conv (fla's and transformers' ``l2norm``);
its ground truth is ``naive.l2norm_ref`` (tests/ops/test_gdn_chunk.py)."""
from __future__ import annotations

import torch
from torch import Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x² + eps) over the last dim (fla's and transformers' l2norm), in x's dtype: x (..., N) ->
    (..., N)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
