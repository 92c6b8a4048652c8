"""ReplaySSM ops (seed 000, Alg. 2 / 4) in pure PyTorch: the fp32 ground truth for the Triton kernels.

Per sequence b: a checkpoint state S0[b] (H, P, N) fp32 and a ring buffer of capacity R holding the
inputs of recent tokens, x (R, H, P), dt (R, H) fp32 already discretized, B (R, G, N); ``head[b]`` is the
ring slot of the oldest cached entry and ``count[b]`` = h the number of committed entries. Entry j of the
window (j = 0, 1, ...) lives at slot (head + j) % R.

Output-only form from the checkpoint (seed 000, section "Output-only"; DESIGN.md section 1): with
cum_j = Σ_{i ≤ j} A·dt_i over the window, token s of a call sits at window position p_s = h + s and
    y_s = exp(cum_{p_s})·(S0 C_s) + Σ_{j ≤ p_s} exp(cum_{p_s} − cum_j)·dt_j·(B_jᵀ C_s)·x_j + D·x_s
Flush (the state-and-output route, one state store): S0 ← exp(cum_{h-1})·S0 + Σ_{j<h} exp(cum_{h-1} − cum_j)
dt_j x_j B_jᵀ over the committed entries only (seed 000: "only committed cached inputs are summarized").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def replay_flush_flags(count: Tensor, L: int, R: int) -> Tensor:
    """(B,) bool: count + 2L > R -- flush one window early so every call finds L free slots (seed 000)."""
    return count + 2 * L > R


def replay_commit(count: Tensor, accepted: Tensor) -> None:
    """count += accepted + 1 in place (the pending token and the accepted drafts stay in the ring).

    count (..., B) int64, accepted (B,) int64 broadcast over leading dims (e.g. one count row per layer).
    Device-side, no host sync."""
    count += accepted + 1


def replay_commit_path(ring_x: Tensor, ring_dt: Tensor, ring_B: Tensor, head: Tensor, count: Tensor,
                       path: Tensor) -> None:
    """Tree verify (beyond seed 000): gather the accepted path into consecutive ring slots, before
    ``replay_commit``. Node s of the call sits at slot (head + count + s) % R; the entry of node path[k] moves
    to slot (head + count + k) % R for every k (path[k] >= k in topological order, and all moves read
    before they write). Entries past the accepted count move too but land beyond the pointer. Device-side.

    ring_x (B, R, H, P), ring_dt (B, R, H), ring_B (B, R, G, N) in place; head, count (B,); path (B, K)
    node numbers root first (``Verdict.path``)."""
    bsz, R = ring_x.shape[:2]
    K = path.shape[1]
    base = head[:, None] + count[:, None]  # (B, 1)
    src = (base + path) % R  # (B, K)
    dst = (base + torch.arange(K, device=path.device)[None]) % R
    rows = torch.arange(bsz, device=path.device)[:, None]
    for ring in (ring_x, ring_dt, ring_B):
        ring[rows, dst] = ring[rows, src]  # advanced indexing copies the source first


def _window(ring: Tensor, head: Tensor) -> Tensor:
    """ring (B, R, ...) -> (B, R, ...) in window order: entry j = ring[(head + j) % R]."""
    bsz, R = ring.shape[:2]
    idx = (head[:, None] + torch.arange(R, device=ring.device)[None]) % R  # (B, R)
    return ring[torch.arange(bsz, device=ring.device)[:, None], idx]


def replay_verify_ref(S0: Tensor, ring_x: Tensor, ring_dt: Tensor, ring_B: Tensor, head: Tensor, count: Tensor,
                      x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                      dt_bias: Tensor | None, dt_limit: tuple[float, float] = (0.0, float("inf")),
                      flush: Tensor | None = None, tree_mask: Tensor | None = None) -> Tensor:
    """One ReplaySSM call of L tokens: flush where due, append, output-only readout.

    S0 (B, H, P, N) fp32 checkpoint, updated in place where ``flush``; ring_x (B, R, H, P), ring_dt (B, R, H)
    fp32, ring_B (B, R, G, N), written in place at slots (head + count + s) % R; head, count (B,) int64,
    updated in place where ``flush`` (head += count mod R, count = 0) -- ``count`` is NOT advanced by the
    call (``replay_commit`` does that once the verdict is known); x (B, L, H, P); dt (B, L, H) raw,
    discretized here as softplus(dt + dt_bias) clamped to dt_limit; A (H,); B, C (B, L, G, N); D (H,) or
    None; flush (B,) bool (None: seed 000's rule count + 2L > R, ``replay_flush_flags``); tree_mask (B, L, L) bool ancestor-or-self mask when the call's tokens are a packed
    token tree (beyond seed 000; None = the causal chain of the contract). Needs count + L <= R after the
    flush. Returns y (B, L, H, P) in x's dtype.
    """
    bsz, L, H, P = x.shape
    R = ring_x.shape[1]
    G, N = B.shape[2], B.shape[3]
    if ring_x.shape != (bsz, R, H, P) or ring_dt.shape != (bsz, R, H) or ring_B.shape != (bsz, R, G, N):
        raise ValueError(f"ring buffers must be x (B, R, H, P), dt (B, R, H), B (B, R, G, N) with B={bsz}, H={H}, "
                         f"P={P}, G={G}, N={N}; got {tuple(ring_x.shape)}, {tuple(ring_dt.shape)}, {tuple(ring_B.shape)}")
    if tree_mask is not None and (tree_mask.shape != (bsz, L, L) or tree_mask.dtype != torch.bool):
        raise ValueError(f"tree_mask must be a bool (B, L, L) = {(bsz, L, L)} tensor, got {tuple(tree_mask.shape)}")
    if L > R:
        raise ValueError(f"a call of L={L} tokens does not fit a ring of R={R}; raise the buffer size R or lower S")
    if S0.shape != (bsz, H, P, N) or S0.dtype != torch.float32:
        raise ValueError(f"S0 must be fp32 (B, H, P, N) = {(bsz, H, P, N)}, got {tuple(S0.shape)} {S0.dtype}")
    dev = x.device
    rep = H // G
    Af = A.float()
    ar = torch.arange(R, device=dev)
    if flush is None:
        flush = replay_flush_flags(count, L, R)
    # 1) flush: fold the committed entries into S0 where flush (state-and-output route)
    win_x, win_dt, win_B = _window(ring_x, head).float(), _window(ring_dt, head).float(), _window(ring_B, head).float()
    fold = (ar[None] < (count * flush)[:, None]).float()  # (B, R) committed entries of flushing rows
    a = win_dt * fold[..., None] * Af  # (B, R, H) log-decays of the folded entries
    cum = torch.cumsum(a, dim=1)  # (B, R, H)
    tot = cum[:, -1]  # (B, H)
    w = torch.exp(tot[:, None] - cum) * win_dt * fold[..., None]  # (B, R, H)
    Bh = win_B.repeat_interleave(rep, dim=2)  # (B, R, H, N)
    S_new = torch.exp(tot)[..., None, None] * S0 + torch.einsum("brh,brhp,brhn->bhpn", w, win_x, Bh)
    S0.copy_(torch.where(flush[:, None, None, None], S_new, S0))
    head.copy_(torch.where(flush, (head + count) % R, head))
    count.copy_(torch.where(flush, torch.zeros_like(count), count))
    # 2) append the call's tokens at slots (head + count + s) % R
    dtd = F.softplus(dt.float() + (dt_bias.float() if dt_bias is not None else 0.0))  # (B, L, H)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dtd = dtd.clamp(min=lo, max=hi)
    slots = (head[:, None] + count[:, None] + torch.arange(L, device=dev)[None]) % R  # (B, L)
    rows = torch.arange(bsz, device=dev)[:, None]
    ring_x[rows, slots] = x.to(ring_x.dtype)
    ring_dt[rows, slots] = dtd
    ring_B[rows, slots] = B.to(ring_B.dtype)
    # 3) output-only readout: token s sits at window position count + s and sees every committed entry plus
    #    the call's tokens up to itself (chain) or its ancestors-or-self (tree_mask)
    win_x, win_dt, win_B = _window(ring_x, head).float(), _window(ring_dt, head).float(), _window(ring_B, head).float()
    a = win_dt * Af  # (B, R, H) log-decay of every window entry
    rel = ar[None] - count[:, None]  # (B, R) index of a window entry among the call's tokens (< 0: committed)
    committed = rel < 0
    if tree_mask is None:
        see = ar[None, None, :] <= (count[:, None] + torch.arange(L, device=dev)[None])[..., None]  # (B, L, R)
    else:
        tm = tree_mask.gather(2, rel.clamp(0, L - 1)[:, None, :].expand(-1, L, -1))  # (B, L, R) mask[s, rel_j]
        see = committed[:, None, :] | (tm & ((rel >= 0) & (rel < L))[:, None, :])
    # accumulated log-decay along what each token sees (a prefix sum for a chain, seed 003's A_tree for a tree)
    cum_s = torch.einsum("blr,brh->blh", see.float(), a)  # (B, L, H)
    prefix = torch.cumsum(a * committed[..., None], dim=1)  # (B, R, H) for committed entries
    cum = torch.where(committed[..., None], prefix, cum_s.gather(1, rel.clamp(0, L - 1)[..., None].expand(-1, -1, H)))
    seg = (cum_s[:, :, None, :] - cum[:, None, :, :]).masked_fill(~see[..., None], float("-inf"))  # (B, L, R, H)
    Ch = C.float().repeat_interleave(rep, dim=2)  # (B, L, H, N)
    Bh = win_B.repeat_interleave(rep, dim=2)  # (B, R, H, N)
    kq = torch.einsum("brhn,blhn->blrh", Bh, Ch)  # (B, L, R, H) key-query products (seed 000: one GEMM)
    y = torch.einsum("blrh,brhp->blhp", kq * torch.exp(seg) * win_dt[:, None], win_x)  # second GEMM
    y = y + torch.exp(cum_s)[..., None] * torch.einsum("bhpn,blhn->blhp", S0, Ch)  # checkpoint readout
    if D is not None:
        y = y + D.float()[None, None, :, None] * x.float()
    return y.to(x.dtype)
