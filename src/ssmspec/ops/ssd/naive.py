"""Mamba-2 SSM over a sequence: per-token recurrence (ground truth) and the chunked SSD scan.

Per head (DESIGN.md section 1):  S_t = exp(A·dt_t)·S_{t-1} + dt_t·x_t B_tᵀ,   y_t = (S_t C_t + D·x_t)·silu(z_t)
Shapes: x (B, L, H, P), dt (B, L, H) already softplus'ed and clamped (or raw, with ``dt_bias`` / ``dt_softplus``
/ ``dt_limit``), A (H,) negative, B and C (B, L, G, N), D (H,) or (H, P) or None, z (B, L, H, P) or None,
state (B, H, P, N) fp32. Several sequences in one row (``seq_idx`` / ``cu_seqlens``): the state restarts where a
sequence starts, as if each ran alone (``ssd_chunk_scan_ref``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.multistep.naive import check_multistep_shapes, discretize_dt


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


def check_scan_options(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
                       initial_state: Tensor | None, *, z: Tensor | None = None, dt_bias: Tensor | None = None,
                       dt_limit: tuple[float, float] = (0.0, float("inf")), seq_idx: Tensor | None = None,
                       cu_seqlens: Tensor | None = None) -> int:
    """Validate the scan's inputs with every option of ``ssd_chunk_scan`` (module docstring). D may be (H,) or
    (H, P); with ``cu_seqlens`` the batch is one packed row and the initial / final states are one per sequence.
    Returns the number of final states: B, or the sequences of ``cu_seqlens``. Reads ``cu_seqlens`` (one
    device-to-host copy when it lives on the GPU)."""
    bsz, L, H, P, G, N = check_ssd_shapes(x, dt, A, B, C, None, None)
    check_multistep_shapes(x, dt, A, B, C, None, z, dt_bias)
    if D is not None and tuple(D.shape) not in ((H,), (H, P)):
        raise ValueError(f"D must be (H,) = ({H},) or (H, P) = {(H, P)}, got {tuple(D.shape)}")
    lo, hi = dt_limit
    if not 0.0 <= lo <= hi:
        raise ValueError(f"dt_limit must be (lo, hi) with 0 <= lo <= hi (no limit: (0.0, inf)), got {dt_limit}")
    n_states = bsz
    if seq_idx is not None and (tuple(seq_idx.shape) != (bsz, L) or seq_idx.is_floating_point()
                                or seq_idx.dtype == torch.bool):
        raise ValueError(f"seq_idx must be an integer (B, L) = {(bsz, L)} tensor (the sequence of every token), got "
                         f"{tuple(seq_idx.shape)} {seq_idx.dtype}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor (num_seqs + 1,) of sequence starts ending at "
                             f"L, e.g. [0, 5, 12]; got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
        if bsz != 1:
            raise ValueError(f"cu_seqlens packs the sequences into one row: x must be (1, L, H, P), got batch {bsz}; "
                             f"concatenate the sequences along L (or pass seq_idx alone for several rows)")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != L or any(e <= s for s, e in zip(cu, cu[1:])):
            shown = cu if len(cu) <= 9 else [*cu[:4], "...", *cu[-4:]]
            raise ValueError(f"cu_seqlens must start at 0, increase strictly (no empty sequence) and end at L = {L}; "
                             f"got {shown}")
        n_states = len(cu) - 1
        if seq_idx is not None and not torch.equal(seq_idx[0].cpu().long(), seq_ids(cu_seqlens, L).cpu()):
            raise ValueError("seq_idx disagrees with cu_seqlens: token t of sequence i must have seq_idx i; pass "
                             "cu_seqlens alone (the sequence ids follow from it)")
    if initial_state is not None:
        want, name = (n_states, H, P, N), ("(num_seqs, H, P, N)" if cu_seqlens is not None else "(B, H, P, N)")
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be {name} = {want}, got {tuple(initial_state.shape)}")
    return n_states


def seq_ids(cu_seqlens: Tensor, L: int) -> Tensor:
    """(L,) int64 on cu_seqlens' device: the sequence of every token of the packed row (no host sync)."""
    tok = torch.arange(L, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), tok, right=True)


def _run_cuts(row: Tensor) -> list[int]:
    """seq_idx of one row (L,) -> [0, starts of the later sequences..., L]: a sequence starts where the id changes."""
    starts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
    return [0, *starts, row.numel()]


def _chunk_scan(x: Tensor, dt: Tensor, A: Tensor, Bh: Tensor, Ch: Tensor, chunk_size: int,
                state: Tensor) -> tuple[Tensor, Tensor]:
    """The chunked SSD scan of one sequence per row, without D and z: fp32 x (B, L, H, P), dt (B, L, H) discretized,
    Bh, Ch (B, L, H, N) per head, state (B, H, P, N). Within a chunk the output is a masked quadratic form (seed
    003 eq. for the accumulated transition); across chunks a state is carried. Returns y (B, L, H, P), state."""
    ys = []
    for s in range(0, x.shape[1], chunk_size):
        e = min(s + chunk_size, x.shape[1])
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
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(*x.shape)
    return y, state


def ssd_chunk_scan_ref(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                       chunk_size: int = 64, initial_state: Tensor | None = None, z: Tensor | None = None,
                       dt_bias: Tensor | None = None, dt_softplus: bool = False,
                       dt_limit: tuple[float, float] = (0.0, float("inf")), seq_idx: Tensor | None = None,
                       cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Chunked SSD scan (the Mamba-2 prefill algorithm) in fp32, mathematically equal to the recurrence, with
    every option of ``ssd_chunk_scan`` (shapes there). dt is discretized first (``dt_bias``, softplus,
    ``dt_limit``); y = (scan + D·x)·silu(z). Several sequences in a row run one after the other, each from its
    own start state (the row's initial state for its first sequence of ``seq_idx``, zeros for the later ones;
    ``initial_state[i]`` for sequence i of ``cu_seqlens``), each cut into its own chunks. Returns y (B, L, H, P)
    fp32 and the final states: (B, H, P, N), or (num_seqs, H, P, N) with ``cu_seqlens``.
    """
    bsz, L, H, P = x.shape
    N = B.shape[-1]
    x32, Bh, Ch = x.float(), _expand_groups(B.float(), H), _expand_groups(C.float(), H)
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, torch.float32)
    init = (torch.zeros(bsz if cu_seqlens is None else cu_seqlens.numel() - 1, H, P, N, device=x.device,
                        dtype=torch.float32) if initial_state is None else initial_state.float())
    if seq_idx is None and cu_seqlens is None:
        y, state = _chunk_scan(x32, dt, A, Bh, Ch, chunk_size, init)
    else:
        rows = [cu_seqlens.tolist()] if cu_seqlens is not None else [_run_cuts(seq_idx[b]) for b in range(bsz)]
        ys, finals = [], []
        for b, cuts in enumerate(rows):
            pieces = []
            for k, (s, e) in enumerate(zip(cuts, cuts[1:])):  # one sequence: tokens s..e-1 of row b
                start = init[k] if cu_seqlens is not None else (init[b] if k == 0 else torch.zeros_like(init[b]))
                y_k, st = _chunk_scan(x32[b:b + 1, s:e], dt[b:b + 1, s:e], A, Bh[b:b + 1, s:e], Ch[b:b + 1, s:e],
                                      chunk_size, start[None])
                pieces.append(y_k)
                if cu_seqlens is not None:
                    finals.append(st)
            ys.append(torch.cat(pieces, dim=1))
            if cu_seqlens is None:
                finals.append(st)
        y, state = torch.cat(ys, dim=0), torch.cat(finals, dim=0)
    if D is not None:
        y = y + (D.float()[:, None] if D.dim() == 1 else D.float()) * x32  # (H, 1) or (H, P) against (B, L, H, P)
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    return y, state
