"""Reference single-token state update, same signature as mamba_ssm's ``selective_state_update``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def selective_state_update_ref(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                               D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                               dt_softplus: bool = False, *, dt_limit: tuple[float, float] = (0.0, float("inf")),
                               state_batch_indices: Tensor | None = None) -> Tensor:
    """One token, in place on ``state``.

    state (Bs, H, P, N) fp32; x (B, H, P); dt (B, H) (raw when dt_softplus, else already discretized);
    A (H,); B, C (B, G, N); D (H,); z (B, H, P) gates the output with silu(z); dt_bias (H,);
    state_batch_indices (B,) row of ``state`` used by each sequence. Returns y (B, H, P) in x's dtype.
    """
    bsz, H, P = x.shape
    rows = torch.arange(bsz, device=x.device) if state_batch_indices is None else state_batch_indices.long()
    s = state[rows].float()  # (B, H, P, N)
    dtf = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        dtf = F.softplus(dtf)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dtf = dtf.clamp(min=lo, max=hi)
    Bh = B.float().repeat_interleave(H // B.shape[1], dim=1)  # (B, H, N)
    Ch = C.float().repeat_interleave(H // C.shape[1], dim=1)
    decay = torch.exp(dtf * A.float()[None])  # (B, H)
    s = s * decay[..., None, None] + (dtf[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", s, Ch)
    if D is not None:
        y = y + D.float()[None, :, None] * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    state[rows] = s.to(state.dtype)
    return y.to(x.dtype)
