"""Gated DeltaNet ops in pure PyTorch: the per-token recurrence (ground truth, also of the chunked WY scan in
``chunk.py``), the l2norm reference, and ReplaySSM for GDN.

Per value head h (DESIGN.md section 1; seed 000, Alg. 5), with the state stored k-major as fla-core and
transformers store it, S (N, P) = (dk, dv) fp32:
    S ← exp(g_t)·S;   u_t = β_t·(v_t − Sᵀk_t);   S ← S + k_t u_tᵀ;   y_t = scale·Sᵀq_t
which is S_t = exp(g_t)·S_{t-1}(I − β_t k_t k_tᵀ) + β_t k_t v_tᵀ in fla's orientation. q, k (B, L, G, N) are
already l2-normalized and shared by the H/G value heads of a group (GVA: head h reads group h // (H/G));
v (B, L, H, P); g (B, L, H) log-decay (g = −exp(A_log)·softplus(a + dt_bias) in Qwen3-Next / Qwen3.5);
beta (B, L, H) = sigmoid(b); scale defaults to N^-1/2 (fla, transformers).

ReplaySSM for GDN (seed 000, Alg. 6 and 8): a checkpoint S0 (B, H, N, P) fp32 and a ring of R entries per
sequence holding (k_j, u_j, g_j) -- the correction u_j = β_j(v_j − exp(g_j)·S_{j-1}ᵀk_j) replaces v_j, so the
update is S_j = exp(g_j)·S_{j-1} + k_j u_jᵀ and the state unrolls like Mamba-2's:
    S_h = exp(cum_{h-1})·S0 + Σ_{j<h} exp(cum_{h-1} − cum_j)·k_j u_jᵀ,   cum_j = Σ_{i≤j} g_i.
``head[b]`` is the slot of the oldest entry, ``count[b]`` = h the committed entries; window entry j lives at
slot (head + j) % R. A call of L tokens (the pending token and S drafts) at window positions h + s, with
Γ_s = cum_{h-1} + Σ_{i≤s} g_i (decay from the checkpoint through token s):
    R_s = β_s·(v_s − exp(Γ_s)·S0ᵀk_s − Σ_{j<h} exp(Γ_s − cum_j)(k_j·k_s)·u_j)
    A[s, t] = β_s·exp(Γ_s − Γ_t)·(k_t·k_s) for t < s   (strictly lower triangular)
    U = (I + A)⁻¹ R                                      (the triangular solve of the WY form, Alg. 8)
    y_s = scale·(exp(Γ_s)·S0ᵀq_s + Σ_{j<h} exp(Γ_s − cum_j)(k_j·q_s)·u_j + Σ_{t≤s} exp(Γ_s − Γ_t)(k_t·q_s)·U_t)
Only S0ᵀk_s and S0ᵀq_s touch the state: output-only, one checkpoint load, no state store. The flush (one
state store) folds the committed entries into S0 at the start of a call, where count + 2L > R (or where
``flush`` says so); the call's own tokens are never folded (they may be rejected).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.replay.naive import _window, replay_commit, replay_flush_flags

gdn_replay_commit = replay_commit  # count += accepted + 1: the ring pointers of GDN and Mamba-2 are the same
gdn_replay_flush_flags = replay_flush_flags  # count + 2L > R (seed 000's early flush)


def _cd(t: Tensor) -> torch.dtype:
    """At least fp32; float64 inputs stay float64 so exact-agreement tests are not limited by fp32."""
    return torch.promote_types(t.dtype, torch.float32)


def check_gdn_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate q, k (B, L, G, N), v (B, L, H, P), g and beta (B, L, H), H % G == 0. Returns (B, L, H, P, G, N)."""
    if v.dim() != 4:
        raise ValueError(f"v must be (B, L, H, P), got {tuple(v.shape)}")
    bsz, L, H, P = v.shape
    if q.dim() != 4 or q.shape != k.shape or q.shape[:2] != (bsz, L) or H % q.shape[2]:
        raise ValueError(f"q and k must both be (B, L, G, N) with B={bsz}, L={L} and H={H} divisible by G; got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if g.shape != (bsz, L, H) or beta.shape != (bsz, L, H):
        raise ValueError(f"g and beta must be (B, L, H) = {(bsz, L, H)}, got {tuple(g.shape)} and {tuple(beta.shape)}")
    return bsz, L, H, P, q.shape[2], q.shape[3]


def default_scale(scale: float | None, N: int) -> float:
    return N ** -0.5 if scale is None else float(scale)


def _heads(t: Tensor, H: int, dim: int = 2) -> Tensor:
    """(..., G, N) at ``dim`` -> (..., H, N): value head h reads key group h // (H / G)."""
    return t.repeat_interleave(H // t.shape[dim], dim=dim)


def gdn_recurrence_ref(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                       scale: float | None = None, snap: list | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule from ``state`` (B, H, N, P), out of place, in at least fp32.
    Returns y (B, L, H, P) and the final state; ``snap`` (a list) collects the state after every token."""
    bsz, L, H, P, _, _ = check_gdn_shapes(q, k, v, g, beta)
    cd = _cd(v)
    sc = default_scale(scale, q.shape[3])
    s = state.to(cd)
    qh, kh = _heads(q.to(cd), H), _heads(k.to(cd), H)  # (B, L, H, N)
    vf, gf, bf = v.to(cd), g.to(cd), beta.to(cd)
    ys = []
    for t in range(L):
        s = s * torch.exp(gf[:, t])[..., None, None]  # gated decay
        u = bf[:, t, :, None] * (vf[:, t] - torch.einsum("bhnp,bhn->bhp", s, kh[:, t]))  # correction (B, H, P)
        s = s + kh[:, t, :, :, None] * u[:, :, None, :]  # rank-1 write at k
        ys.append(sc * torch.einsum("bhnp,bhn->bhp", s, qh[:, t]))
        if snap is not None:
            snap.append(s)
    y = torch.stack(ys, dim=1) if ys else vf.new_zeros(bsz, 0, H, P)
    return y, s


def l2norm_ref(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x² + eps) over the last dim, computed in at least fp32 and returned in x's dtype: the
    ground truth of ``ops.gdn.l2norm`` (which multiplies by rsqrt in x's own dtype). x (..., N) -> (..., N)."""
    xf = x.to(_cd(x))
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gdn_multistep_ref(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                      scale: float | None = None, state_batch_indices: Tensor | None = None,
                      update_count: Tensor | None = None, store_state: bool = True,
                      output: bool = True) -> Tensor | None:
    """L tokens from a stored state, in place: every output, the state stored once.

    state (Bs, H, N, P) fp32, row ``state_batch_indices[b]`` (default b) is sequence b's, a negative row is a
    pad sequence (y = 0, nothing stored); update_count (B,) int: the state stored is the one after
    update_count[b] tokens (None: all L; 0: unchanged) while y follows all L tokens. Returns y (B, L, H, P)
    in v's dtype, or None when ``output`` is False.
    """
    bsz, L, H, P, _, N = check_gdn_shapes(q, k, v, g, beta)
    _check_state(state, H, N, P)
    rows = torch.arange(bsz, device=v.device) if state_batch_indices is None else state_batch_indices.long()
    ok = rows >= 0
    cd = _cd(v)
    snaps: list[Tensor] = []
    y, _ = gdn_recurrence_ref(state[rows.clamp(min=0)], q, k, v, g, beta, scale=scale, snap=snaps)
    y = torch.where(ok[:, None, None, None], y, torch.zeros_like(y))
    if store_state and L:
        keep = torch.full((bsz,), L, device=v.device) if update_count is None else update_count.long()
        hist = torch.stack([state[rows.clamp(min=0)].to(cd), *snaps], dim=1)  # (B, L + 1, H, N, P)
        new = hist[torch.arange(bsz, device=v.device), keep.clamp(0, L)]
        write = ok & (keep > 0)
        state[rows[write]] = new[write].to(state.dtype)
    return y.to(v.dtype) if output else None


def gdn_multistep_snapshot_ref(state_pool: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                               scale: float | None = None, src_slot: Tensor, dst_slots: Tensor) -> Tensor:
    """The `snapshot` baseline for GDN (seed 000, Alg. 7): start from slot src_slot[b] of state_pool
    (Nslots, H, N, P) fp32, store the state after token t into slot dst_slots[b, t] (negative: no store).
    The start states are read before any store. Returns y (B, L, H, P) in v's dtype."""
    bsz, L, H, P, _, N = check_gdn_shapes(q, k, v, g, beta)
    _check_state(state_pool, H, N, P)
    if src_slot.shape != (bsz,) or dst_slots.shape != (bsz, L):
        raise ValueError(f"src_slot must be (B,) and dst_slots (B, L) = ({bsz}, {L}); got {tuple(src_slot.shape)} "
                         f"and {tuple(dst_slots.shape)}")
    snaps: list[Tensor] = []
    y, _ = gdn_recurrence_ref(state_pool[src_slot.long()], q, k, v, g, beta, scale=scale, snap=snaps)
    for t, s in enumerate(snaps):
        dst = dst_slots[:, t].long()
        keep = dst >= 0
        state_pool[dst[keep]] = s[keep].to(state_pool.dtype)
    return y.to(v.dtype)


def _check_state(state: Tensor, H: int, N: int, P: int) -> None:
    if state.dim() != 4 or state.shape[1:] != (H, N, P) or state.dtype != torch.float32:
        raise ValueError(f"the GDN state must be fp32 (rows, H, N, P) = (rows, {H}, {N}, {P}), k-major like "
                         f"fla-core's [N, HV, K, V]; got {tuple(state.shape)} {state.dtype}")


def check_replay_args(S0: Tensor, ring_k: Tensor, ring_u: Tensor, ring_g: Tensor, head: Tensor, count: Tensor,
                      q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                      flush: Tensor | None) -> tuple[int, int, int, int, int, int, int]:
    """Shapes of one GDN replay call. Returns (B, L, H, P, G, N, R)."""
    bsz, L, H, P, G, N = check_gdn_shapes(q, k, v, g, beta)
    R = ring_k.shape[1] if ring_k.dim() == 4 else -1
    if ring_k.shape != (bsz, R, G, N) or ring_u.shape != (bsz, R, H, P) or ring_g.shape != (bsz, R, H):
        raise ValueError(f"ring buffers must be k (B, R, G, N), u (B, R, H, P), g (B, R, H) with B={bsz}, G={G}, "
                         f"N={N}, H={H}, P={P}; got {tuple(ring_k.shape)}, {tuple(ring_u.shape)}, "
                         f"{tuple(ring_g.shape)}")
    if L > R:
        raise ValueError(f"a call of L={L} tokens does not fit a ring of R={R}; raise the buffer size R or lower S")
    if S0.shape != (bsz, H, N, P) or S0.dtype != torch.float32 or ring_g.dtype != torch.float32:
        raise ValueError(f"S0 must be fp32 (B, H, N, P) = {(bsz, H, N, P)} and ring_g fp32; got {tuple(S0.shape)} "
                         f"{S0.dtype}, ring_g {ring_g.dtype}")
    if head.shape != (bsz,) or count.shape != (bsz,) or (flush is not None and flush.shape != (bsz,)):
        raise ValueError(f"head, count and flush must be (B,) = ({bsz},)")
    return bsz, L, H, P, G, N, R


def gdn_replay_state_ref(S0: Tensor, ring_k: Tensor, ring_u: Tensor, ring_g: Tensor, head: Tensor,
                         count: Tensor) -> Tensor:
    """The state after the count[b] committed entries, S_h = exp(cum_{h-1})·S0 + Σ_j exp(cum_{h-1} − cum_j)·k_j
    u_jᵀ (out of place, (B, H, N, P) in at least fp32). Dead slots (window position >= count) are never read."""
    bsz, R, H = ring_g.shape
    cd = torch.promote_types(_cd(S0), ring_u.dtype)
    live = (torch.arange(R, device=S0.device)[None] < count[:, None])[..., None]  # (B, R, 1)
    wk = torch.where(live[..., None], _window(ring_k, head).to(cd), 0.0)  # (B, R, G, N)
    wu = torch.where(live[..., None], _window(ring_u, head).to(cd), 0.0)  # (B, R, H, P)
    wg = torch.where(live, _window(ring_g, head).to(cd), 0.0)  # (B, R, H)
    cum = torch.cumsum(wg, dim=1)
    tot = cum[:, -1]  # (B, H)
    w = torch.where(live, torch.exp(tot[:, None] - cum), 0.0)  # (B, R, H)
    return torch.exp(tot)[..., None, None] * S0.to(cd) + torch.einsum("brh,brhn,brhp->bhnp", w, _heads(wk, H), wu)


def gdn_replay_verify_ref(S0: Tensor, ring_k: Tensor, ring_u: Tensor, ring_g: Tensor, head: Tensor, count: Tensor,
                          q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                          flush: Tensor | None = None) -> Tensor:
    """One ReplaySSM call of L tokens for GDN (module docstring): flush where due, output-only readout of
    every token through the triangular solve, append (k, U, g) at slots (head + count + s) % R.

    S0 (B, H, N, P) fp32, updated in place where ``flush``; ring_k (B, R, G, N), ring_u (B, R, H, P), ring_g
    (B, R, H) fp32, written in place; head, count (B,) int64, updated where ``flush`` (head += count mod R,
    count = 0) -- count is NOT advanced (``gdn_replay_commit`` does that); q, k (B, L, G, N) l2-normed;
    v (B, L, H, P); g, beta (B, L, H); flush (B,) bool or None (count + 2L > R). Needs count + L <= R after
    the flush. Returns y (B, L, H, P) in v's dtype.
    """
    bsz, L, H, P, G, N, R = check_replay_args(S0, ring_k, ring_u, ring_g, head, count, q, k, v, g, beta, flush)
    dev, cd = v.device, _cd(v)
    sc = default_scale(scale, N)
    if flush is None:
        flush = gdn_replay_flush_flags(count, L, R)
    # 1) flush: fold the committed entries of flushing rows into S0 (the only state store)
    S_new = gdn_replay_state_ref(S0, ring_k, ring_u, ring_g, head, count * flush)
    S0.copy_(torch.where(flush[:, None, None, None], S_new.to(S0.dtype), S0))
    head.copy_(torch.where(flush, (head + count) % R, head))
    count.copy_(torch.where(flush, torch.zeros_like(count), count))
    # 2) the committed window, dead slots masked (never read)
    live = torch.arange(R, device=dev)[None] < count[:, None]  # (B, R)
    rk = _heads(torch.where(live[..., None, None], _window(ring_k, head).to(cd), 0.0), H)  # (B, R, H, N)
    ru = torch.where(live[..., None, None], _window(ring_u, head).to(cd), 0.0)  # (B, R, H, P)
    rg = torch.where(live[..., None], _window(ring_g, head).to(cd), 0.0)  # (B, R, H)
    cumr = torch.cumsum(rg, dim=1)  # (B, R, H)
    gam = cumr[:, -1:] + torch.cumsum(g.to(cd), dim=1)  # (B, L, H) Γ_s
    qh, kh = _heads(q.to(cd), H), _heads(k.to(cd), H)  # (B, L, H, N)
    S0c = S0.to(cd)
    hk = torch.einsum("bhnp,blhn->blhp", S0c, kh)  # S0ᵀk_s
    hq = torch.einsum("bhnp,blhn->blhp", S0c, qh)  # S0ᵀq_s
    wr = torch.where(live[:, None, :, None], torch.exp(gam[:, :, None] - cumr[:, None]), 0.0)  # (B, L, R, H)
    kk_r = torch.einsum("brhn,blhn->blrh", rk, kh)
    kq_r = torch.einsum("brhn,blhn->blrh", rk, qh)
    ring_kpart = torch.einsum("blrh,brhp->blhp", wr * kk_r, ru)
    ring_qpart = torch.einsum("blrh,brhp->blhp", wr * kq_r, ru)
    eg = torch.exp(gam)[..., None]  # (B, L, H, 1)
    Rv = beta.to(cd)[..., None] * (v.to(cd) - eg * hk - ring_kpart)  # (B, L, H, P)
    # 3) the triangular solve over the call's tokens (seed 000, Alg. 8): U = (I + A)^-1 R per (b, h)
    tri = torch.ones(L, L, dtype=torch.bool, device=dev).tril()  # t <= s
    dec = torch.where(tri[None, :, :, None], torch.exp(gam[:, :, None] - gam[:, None]), 0.0)  # (B, L_s, L_t, H)
    kk_n = torch.einsum("bshn,bthn->bsth", kh, kh)
    kq_n = torch.einsum("bshn,bthn->bsth", qh, kh)
    A = beta.to(cd)[:, :, None] * dec * kk_n * (~torch.eye(L, dtype=torch.bool, device=dev))[None, :, :, None]
    M = torch.eye(L, dtype=cd, device=dev) + A.permute(0, 3, 1, 2)  # (B, H, L, L) unit lower triangular
    U = torch.linalg.solve_triangular(M, Rv.permute(0, 2, 1, 3), upper=False, unitriangular=True)  # (B, H, L, P)
    U = U.permute(0, 2, 1, 3)  # (B, L, H, P)
    y = sc * (eg * hq + ring_qpart + torch.einsum("bsth,bthp->bshp", dec * kq_n, U))
    # 4) append (k, U, g) at slots (head + count + s) % R
    slots = (head[:, None] + count[:, None] + torch.arange(L, device=dev)[None]) % R  # (B, L)
    rows = torch.arange(bsz, device=dev)[:, None]
    ring_k[rows, slots] = k.to(ring_k.dtype)
    ring_u[rows, slots] = U.to(ring_u.dtype)
    ring_g[rows, slots] = g.to(ring_g.dtype)
    return y.to(v.dtype)
