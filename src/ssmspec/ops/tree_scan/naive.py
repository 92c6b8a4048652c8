"""STree's tree-masked Mamba-2 scan and the tree conv over ancestors (seed 003, section 3), fp32 ground truth.

A packed token tree of L nodes per row is described by ``tree_mask`` (B, L, L) bool, [t, j] = node j is t
or one of t's ancestors (seed 003 eq. 2), topological order (ancestors come first). Every node sees the
committed state S0 (and, for the conv, the committed conv state) plus its own ancestors only, so one call
verifies every branch of the tree without unrolling it.

Scan (seed 003 eq. 5-6, DESIGN.md section 1), per head, with a_j = A·dt_j:
    acc_t = Σ_{j anc-or-self t} a_j                                   ("A_tree", accumulated transition)
    y_t   = exp(acc_t)·(S0 C_t) + Σ_{j anc-or-self t} exp(acc_t − acc_j)·dt_j·(B_jᵀ C_t)·x_j + D·x_t
For a causal mask (a chain) this is the Mamba-2 recurrence unrolled from S0. Nothing is stored: the state
after the accepted path is rebuilt later by activation replay (seed 003, Alg. 1, line 7).

Conv: node t's window of W inputs is [its W-1 nearest ancestors, itself]; where the tree above t is
shallower than W-1, the window continues into the conv state (the last W-1 committed inputs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(t: Tensor) -> torch.dtype:
    """At least fp32 (float64 inputs stay float64 so exact-agreement tests are not limited by fp32)."""
    return torch.promote_types(t.dtype, torch.float32)


def _check_mask(tree_mask: Tensor | None, bsz: int, L: int, device) -> Tensor:
    if tree_mask is None:
        return torch.ones(L, L, dtype=torch.bool, device=device).tril()[None].expand(bsz, L, L)
    if tree_mask.shape != (bsz, L, L) or tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be a bool tensor of shape (B, L, L) = {(bsz, L, L)}, "
                         f"got {tuple(tree_mask.shape)} {tree_mask.dtype}")
    return tree_mask


def tree_scan_ref(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                  *, tree_mask: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
                  dt_limit: tuple[float, float] = (0.0, float("inf"))) -> Tensor:
    """Output-only tree-masked scan from a committed state (the state is read, never written).

    state (B, H, P, N) fp32 committed state S0; x (B, L, H, P); dt (B, L, H) raw when ``dt_softplus``
    (then ``dt_bias`` is added and softplus / clamp to ``dt_limit`` applied), else already discretized
    (0 on pad / no-op nodes, which then neither decay nor write); A (H,) negative; B, C (B, L, G, N);
    D (H,) or None; tree_mask (B, L, L) bool ancestor-or-self mask, None = causal chain.
    Returns y (B, L, H, P) in x's dtype.
    """
    bsz, L, H, P = x.shape
    if state.shape[:3] != (bsz, H, P) or state.shape[-1] != B.shape[-1]:
        raise ValueError(f"state must be (B, H, P, N) = ({bsz}, {H}, {P}, {B.shape[-1]}), got {tuple(state.shape)}")
    if dt.shape != (bsz, L, H):
        raise ValueError(f"dt must be (B, L, H) = {(bsz, L, H)}, got {tuple(dt.shape)}")
    if B.shape != C.shape or B.shape[:2] != (bsz, L) or H % B.shape[2]:
        raise ValueError(f"B and C must both be (B, L, G, N) with H % G == 0, got {tuple(B.shape)}, {tuple(C.shape)}")
    mask = _check_mask(tree_mask, bsz, L, x.device)
    cd = _compute_dtype(x)
    dtf = dt.to(cd)
    if dt_bias is not None:
        dtf = dtf + dt_bias.to(cd)
    if dt_softplus:
        dtf = F.softplus(dtf)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dtf = dtf.clamp(min=lo, max=hi)
    rep = H // B.shape[2]
    Bh = B.to(cd).repeat_interleave(rep, dim=2)  # (B, L, H, N)
    Ch = C.to(cd).repeat_interleave(rep, dim=2)
    xf = x.to(cd)
    a = dtf * A.to(cd)[None, None, :]  # (B, L, H) log-decay of each node
    acc = torch.einsum("btj,bjh->bth", mask.to(cd), a)  # (B, L, H) A_tree: summed over ancestors-or-self
    # exp(acc_t − acc_j) on ancestor pairs only; -inf elsewhere so non-ancestors give exactly 0
    seg = (acc[:, :, None, :] - acc[:, None, :, :]).masked_fill(~mask[..., None], float("-inf"))  # (B, t, j, H)
    w = torch.exp(seg) * dtf[:, None, :, :]  # (B, t, j, H)
    cb = torch.einsum("bthn,bjhn->btjh", Ch, Bh)  # (B, t, j, H) C_tᵀ B_j
    y = torch.einsum("btjh,bjhp->bthp", cb * w, xf)  # (B, L, H, P) tree part
    s0c = torch.einsum("bhpn,bthn->bthp", state.to(cd), Ch)  # (B, L, H, P) checkpoint readout
    y = y + torch.exp(acc)[..., None] * s0c
    if D is not None:
        y = y + D.to(cd)[None, None, :, None] * xf
    return y.to(x.dtype)


def tree_conv1d_ref(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                    tree_mask: Tensor | None = None, activation: str | None = "silu") -> Tensor:
    """Depthwise causal conv where each node's window runs over its ancestors (then the conv state).

    x (B, L, C) pre-conv inputs of the packed tree; conv_state (B, C, W-1) the last W-1 committed inputs,
    oldest first (read only); weight (C, W); bias (C,) or None; tree_mask (B, L, L) bool ancestor-or-self,
    None = causal chain (then equal to ``causal_conv1d_update(..., update_state=False)``).
    Returns y (B, L, C) in x's dtype, after ``activation`` ('silu' or None).
    """
    bsz, L, Cdim = x.shape
    W = weight.shape[-1]
    if conv_state.shape != (bsz, Cdim, W - 1):
        raise ValueError(f"conv_state must be (B, C, W-1) = {(bsz, Cdim, W - 1)}, got {tuple(conv_state.shape)}")
    mask = _check_mask(tree_mask, bsz, L, x.device)
    cd = _compute_dtype(x)
    depth = mask.sum(-1) - 1  # (B, L) ancestors of each node inside this call
    xf, sf, wf = x.to(cd), conv_state.to(cd), weight.to(cd)
    y = torch.zeros(bsz, L, Cdim, dtype=cd, device=x.device) if bias is None else bias.to(cd).expand(bsz, L, Cdim).clone()
    for k in range(W):  # tap k reads the input k steps up the tree; weight[:, W-1-k] multiplies it
        # the ancestor j of t with depth(j) = depth(t) - k (one-hot over j, or none when the tree is too shallow)
        sel = mask & (depth[:, None, :] == (depth[:, :, None] - k))  # (B, t, j)
        from_tree = torch.einsum("btj,bjc->btc", sel.to(cd), xf)  # (B, L, C)
        col = (W - 1 - (k - depth)).clamp(0, W - 2) if W > 1 else depth * 0  # (B, L) conv-state column
        from_state = sf.gather(2, col[:, None, :].expand(bsz, Cdim, L)).transpose(1, 2) if W > 1 else from_tree
        tap = torch.where((k <= depth)[..., None], from_tree, from_state)  # (B, L, C)
        y = y + tap * wf[:, W - 1 - k]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation not in (None, "identity"):
        raise ValueError(f"unsupported conv activation {activation!r}; use 'silu' or None")
    return y.to(x.dtype)
