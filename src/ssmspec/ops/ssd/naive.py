"""Mamba-2 SSM over a sequence: per-token recurrence (ground truth) and the chunked SSD scan.

Per head (DESIGN.md section 1):  S_t = exp(A·dt_t)·S_{t-1} + dt_t·x_t B_tᵀ,   y_t = S_t C_t + D·x_t
Shapes: x (B, L, H, P), dt (B, L, H) already softplus'ed and clamped, A (H,) negative,
B and C (B, L, G, N), D (H,) or None, state (B, H, P, N) fp32.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.multistep.naive import check_multistep_shapes


def _expand_groups(t: Tensor, heads: int) -> Tensor:
    """(B, L, G, N) -> (B, L, H, N): head h reads group h // (H / G)."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def check_ssd_shapes(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
                     initial_state: Tensor | None) -> tuple[int, int, int, int, int, int]:
    """Validate the scan's shapes (module docstring). Returns (B, L, H, P, G, N)."""
    bsz, L, H, P, G, N = check_multistep_shapes(x, dt, A, B, C, D, None, None)
    if initial_state is not None and tuple(initial_state.shape) != (bsz, H, P, N):
        raise ValueError(f"initial_state must be (B, H, P, N) = {(bsz, H, P, N)}, got {tuple(initial_state.shape)}")
    if initial_state is not None and not initial_state.is_floating_point():
        raise ValueError(f"initial_state must be a float tensor (fp32 state), got {initial_state.dtype}")
    return bsz, L, H, P, G, N


def ssm_recurrence_ref(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                       initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token recurrence in fp32. Returns y (B, L, H, P) in fp32 and the final state (B, H, P, N)."""
    bsz, L, H, P = x.shape
    N = B.shape[-1]
    x, dt, B, C = x.float(), dt.float(), _expand_groups(B.float(), H), _expand_groups(C.float(), H)
    state = (torch.zeros(bsz, H, P, N, device=x.device, dtype=torch.float32) if initial_state is None
             else initial_state.float().clone())
    ys = []
    for t in range(L):
        decay = torch.exp(A.float()[None, :] * dt[:, t])  # (B, H)
        state = state * decay[..., None, None] + (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(bsz, 0, H, P)
    if D is not None:
        y = y + D.float()[None, None, :, None] * x
    return y, state


def _segsum(a: Tensor) -> Tensor:
    """a (..., T) -> (..., T, T) with out[i, j] = sum_{j < k <= i} a_k for j <= i, -inf above the diagonal."""
    T = a.shape[-1]
    cs = torch.cumsum(a, dim=-1)
    out = cs[..., :, None] - cs[..., None, :]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device))
    return out.masked_fill(~mask, float("-inf"))


def ssd_chunk_scan_ref(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                       chunk_size: int = 64, initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Chunked SSD scan (the Mamba-2 prefill algorithm) in fp32, mathematically equal to the recurrence.

    Within a chunk the output is a masked quadratic form (seed 003 eq. for the accumulated transition);
    across chunks a state is carried. Returns y (B, L, H, P) fp32 and the final state (B, H, P, N).
    """
    bsz, L, H, P = x.shape
    N = B.shape[-1]
    x, dt, Bh, Ch = x.float(), dt.float(), _expand_groups(B.float(), H), _expand_groups(C.float(), H)
    state = (torch.zeros(bsz, H, P, N, device=x.device, dtype=torch.float32) if initial_state is None
             else initial_state.float())
    ys = []
    for s in range(0, L, chunk_size):
        e = min(s + chunk_size, L)
        xc, dtc, Bc, Cc = x[:, s:e], dt[:, s:e], Bh[:, s:e], Ch[:, s:e]  # (B, T, H, ...)
        a = (A.float()[None, None, :] * dtc).permute(0, 2, 1)  # (B, H, T) log-decay per step
        acum = torch.cumsum(a, dim=-1)  # (B, H, T)
        decay = torch.exp(_segsum(a))  # (B, H, T, T): exp(a_i - a_j), j <= i
        scores = torch.einsum("bihn,bjhn->bhij", Cc, Bc) * decay  # (B, H, T, T)
        xdt = xc * dtc[..., None]  # (B, T, H, P)
        y_intra = torch.einsum("bhij,bjhp->bihp", scores, xdt)
        y_state = torch.einsum("bihn,bhpn->bihp", Cc, state) * torch.exp(acum).permute(0, 2, 1)[..., None]
        ys.append(y_intra + y_state)
        # carry: S_e = exp(acum_T) S_s + sum_j exp(acum_T - acum_j) dt_j x_j B_jᵀ
        tail = torch.exp(acum[..., -1:] - acum)  # (B, H, T)
        state = state * torch.exp(acum[..., -1])[..., None, None] + torch.einsum(
            "bht,bthp,bthn->bhpn", tail, xdt, Bc)
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(bsz, 0, H, P)
    if D is not None:
        y = y + D.float()[None, None, :, None] * x
    return y, state
