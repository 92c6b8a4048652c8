"""STree's packed token tree (seed 003): the tree-masked scan from the committed state and the conv over
ancestors. Both dispatch Triton on CUDA (``ops.dispatch``); the pure-PyTorch twins in ``naive.py`` are the
ground truth and serve CPU and float64.
"""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.dispatch import use_triton
from ssmspec.ops.tree_scan.naive import tree_conv1d_ref, tree_scan_ref

_INF = float("inf")


def tree_scan(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
              tree_mask: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
              dt_limit: tuple[float, float] = (0.0, _INF), backend: str = "auto") -> Tensor:
    """Output-only tree-masked scan of a packed tree from a committed state (read, never written).

    state (B, H, P, N) fp32; x (B, L, H, P); dt (B, L, H), raw when ``dt_softplus`` (then dt_bias is added,
    softplus and the clamp to dt_limit applied), else already discretized (0 on pad / no-op nodes); A (H,);
    B, C (B, L, G, N); D (H,) or None; tree_mask (B, L, L) bool, [t, j] = j is t or an ancestor of t, nodes
    in topological order; None = one causal chain. Returns y (B, L, H, P) in x's dtype.
    """
    if use_triton(state, x, dt, A, B, C, backend=backend):
        from ssmspec.ops.tree_scan.triton import tree_scan_triton
        return tree_scan_triton(state, x, dt, A, B, C, D, tree_mask=tree_mask, dt_bias=dt_bias,
                                dt_softplus=dt_softplus, dt_limit=dt_limit)
    return tree_scan_ref(state, x, dt, A, B, C, D, tree_mask=tree_mask, dt_bias=dt_bias, dt_softplus=dt_softplus,
                         dt_limit=dt_limit)


def tree_conv1d(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                tree_mask: Tensor | None = None, activation: str | None = "silu", backend: str = "auto") -> Tensor:
    """Depthwise causal conv whose window runs over each node's ancestors, then into the conv state.

    x (B, L, C) pre-conv inputs; conv_state (B, C, W-1) the last W-1 committed inputs, oldest first (read
    only); weight (C, W); bias (C,) or None; tree_mask as for ``tree_scan``. Returns y (B, L, C) in x's
    dtype after ``activation`` ('silu' or None).
    """
    if use_triton(x, conv_state, weight, backend=backend):
        from ssmspec.ops.tree_scan.triton import tree_conv1d_triton
        return tree_conv1d_triton(x, conv_state, weight, bias, tree_mask=tree_mask, activation=activation)
    return tree_conv1d_ref(x, conv_state, weight, bias, tree_mask=tree_mask, activation=activation)


__all__ = ["tree_conv1d", "tree_conv1d_ref", "tree_scan", "tree_scan_ref"]
