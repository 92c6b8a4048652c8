"""Multi-token Mamba-2 state update from a stored state, fp32 per-token ground truth (seed 001, App. A;
seed 000, Alg. 3).

Per head (DESIGN.md section 1):  S_t = exp(A·dt_t)·S_{t-1} + dt_t·x_t B_tᵀ,   y_t = (S_t C_t + D·x_t)·silu(z_t)
dt_t = clamp(softplus(dt_raw + dt_bias), dt_limit) when ``dt_softplus``; otherwise dt is taken as given
(already discretized; 0 on pad / no-op tokens, which then leave the state untouched).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(t: Tensor) -> torch.dtype:
    """At least fp32; float64 inputs stay float64 so exact-agreement tests are not limited by fp32."""
    return torch.promote_types(t.dtype, torch.float32)


def discretize_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float],
                  dtype: torch.dtype) -> Tensor:
    """dt (..., H) -> dt + dt_bias, softplus if ``dt_softplus``, clamped to ``dt_limit`` when it is not (0, inf)."""
    d = dt.to(dtype)
    if dt_bias is not None:
        d = d + dt_bias.to(dtype)
    if dt_softplus:
        d = F.softplus(d)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        d = d.clamp(min=lo, max=hi)
    return d


def check_multistep_shapes(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
                           z: Tensor | None, dt_bias: Tensor | None) -> tuple[int, int, int, int, int, int]:
    """Validate (B, L, H, P) / (B, L, H) / (H,) / (B, L, G, N) shapes. Returns (B, L, H, P, G, N)."""
    if x.dim() != 4:
        raise ValueError(f"x must be (B, L, H, P), got {tuple(x.shape)}")
    bsz, L, H, P = x.shape
    if dt.shape != (bsz, L, H):
        raise ValueError(f"dt must be (B, L, H) = {(bsz, L, H)}, got {tuple(dt.shape)}")
    if A.shape != (H,):
        raise ValueError(f"A must be (H,) = ({H},) (one scalar per head), got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape != C.shape or B.shape[:2] != (bsz, L) or H % B.shape[2]:
        raise ValueError(f"B and C must both be (B, L, G, N) with B={bsz}, L={L} and H={H} divisible by G; "
                         f"got {tuple(B.shape)} and {tuple(C.shape)}")
    for name, t, shape in (("D", D, (H,)), ("dt_bias", dt_bias, (H,)), ("z", z, (bsz, L, H, P))):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
    return bsz, L, H, P, B.shape[2], B.shape[3]


def _scan(s: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, z: Tensor | None,
          keep: Tensor | None, snap: list | None) -> tuple[Tensor, Tensor]:
    """Recurrence over L tokens from s (B, H, P, N). keep (B,) int: the returned state is the one after
    keep[b] tokens (None: after all L). ``snap`` (list) collects the state after every token when given."""
    bsz, L, H, P = x.shape
    cd = s.dtype
    rep = H // B.shape[2]
    Bh, Ch = B.to(cd).repeat_interleave(rep, dim=2), C.to(cd).repeat_interleave(rep, dim=2)  # (B, L, H, N)
    xf = x.to(cd)
    kept = s.clone() if keep is not None else None
    ys = []
    for t in range(L):
        decay = torch.exp(dt[:, t] * A.to(cd)[None])  # (B, H)
        s = s * decay[..., None, None] + (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", s, Ch[:, t]))
        if keep is not None:
            kept = torch.where((t < keep)[:, None, None, None], s, kept)
        if snap is not None:
            snap.append(s)
    y = torch.stack(ys, dim=1) if ys else xf.new_zeros(bsz, 0, H, P)  # (B, L, H, P)
    if D is not None:
        y = y + D.to(cd)[None, None, :, None] * xf
    if z is not None:
        y = y * F.silu(z.to(cd))
    return y, (s if keep is None else kept)


def ssm_multistep_ref(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                      *, dt_bias: Tensor | None = None, dt_softplus: bool = True,
                      dt_limit: tuple[float, float] = (0.0, float("inf")), z: Tensor | None = None,
                      state_batch_indices: Tensor | None = None, update_count: Tensor | None = None,
                      store_state: bool = True, output: bool = True) -> Tensor | None:
    """L tokens from a stored state; every output returned, the state stored once (seed 001, App. A).

    state (Bs, H, P, N) fp32, row ``state_batch_indices[b]`` (default b) is sequence b's; x (B, L, H, P);
    dt (B, L, H) raw when ``dt_softplus`` else discretized; A (H,); B, C (B, L, G, N); D (H,); z (B, L, H, P)
    gate; update_count (B,) int: if ``store_state``, the state written back is the one after update_count[b]
    tokens (None: all L; 0: unchanged) while y still follows all L tokens -- with ``output=False`` (y not
    needed) this is the replay form of activation_replay / stree. Returns y (B, L, H, P) in x's dtype
    (None when ``output`` is False).
    """
    check_multistep_shapes(x, dt, A, B, C, D, z, dt_bias)
    bsz = x.shape[0]
    rows = torch.arange(bsz, device=x.device) if state_batch_indices is None else state_batch_indices.long()
    cd = _compute_dtype(x)
    dtd = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, cd)
    keep = None if update_count is None else update_count.to(x.device).long()
    y, s = _scan(state[rows].to(cd), x, dtd, A, B, C, D, z, keep, None)
    if store_state:
        state[rows] = s.to(state.dtype)
    return y.to(x.dtype) if output else None


def ssm_multistep_snapshot_ref(state_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                               D: Tensor | None = None, *, dt_bias: Tensor | None = None, dt_softplus: bool = True,
                               dt_limit: tuple[float, float] = (0.0, float("inf")), src_slot: Tensor,
                               dst_slots: Tensor, z: Tensor | None = None) -> Tensor:
    """The `snapshot` baseline fused (seed 000, Alg. 3): one state load, one state store per token.

    state_pool (Nslots, H, P, N) fp32; sequence b starts from slot src_slot[b] (chosen by the previous
    accepted count) and the state after its token t is stored into slot dst_slots[b, t] (B, L) int;
    a negative dst slot stores nothing (pad tokens). Other shapes as ``ssm_multistep_ref``. The start states
    are read before any store, so a dst slot may equal a src slot. Returns y (B, L, H, P) in x's dtype.
    """
    bsz, L = check_multistep_shapes(x, dt, A, B, C, D, z, dt_bias)[:2]
    if src_slot.shape != (bsz,) or dst_slots.shape != (bsz, L):
        raise ValueError(f"src_slot must be (B,) and dst_slots (B, L) = ({bsz}, {L}); got "
                         f"{tuple(src_slot.shape)} and {tuple(dst_slots.shape)}")
    cd = _compute_dtype(x)
    dtd = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, cd)
    snaps: list[Tensor] = []
    y, _ = _scan(state_pool[src_slot.long()].to(cd), x, dtd, A, B, C, D, z, None, snaps)
    for t, s in enumerate(snaps):
        dst = dst_slots[:, t].long()
        ok = dst >= 0
        state_pool[dst[ok]] = s[ok].to(state_pool.dtype)
    return y.to(x.dtype)
