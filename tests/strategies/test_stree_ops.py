"""ops.tree_scan: the STree tree-masked scan and tree conv equal the plain recurrence / causal conv run along
every root-to-node path of the tree (what unrolling the tree into sequences would compute, seed 003 Fig. 1)."""
import pytest
import torch

from ssmspec.drafting.base import DraftTree
from ssmspec.ops.causal_conv1d import causal_conv1d
from ssmspec.ops.ssd.naive import ssm_recurrence_ref
from ssmspec.ops.tree_scan import tree_conv1d, tree_scan

F64 = torch.float64
TREES = {
    "chain": [0, 1, 2, 3],
    "binary": [0, 0, 1, 1, 2, 2],
    "ragged": [0, 0, 1, 1, 2, 3, 5, 0, 8],  # depths 1..4 next to depth-1 leaves
    "root_only": [],
}


def _mask(parents: list[int], bsz: int) -> torch.Tensor:
    if not parents:  # the pending token alone (standard decoding)
        return torch.ones(bsz, 1, 1, dtype=torch.bool)
    par = torch.tensor(parents, dtype=torch.long).reshape(1, -1).expand(bsz, -1)
    return DraftTree(torch.zeros_like(par), par).ancestor_mask()  # (B, L, L)


def _paths(mask: torch.Tensor, t: int) -> list[int]:
    return [j for j in range(mask.shape[-1]) if mask[0, t, j]]


@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
@pytest.mark.parametrize("H,P,N,G,use_D", [(4, 3, 5, 2, True), (3, 8, 4, 3, False), (2, 5, 6, 1, True)],
                         ids=["G2-D", "G3-noD", "G1-D"])
def test_tree_scan_equals_recurrence_along_every_path(tree, H, P, N, G, use_D):
    gen = torch.Generator().manual_seed(0)
    bsz = 2
    mask = _mask(TREES[tree], bsz)
    L = mask.shape[-1]
    x = torch.randn(bsz, L, H, P, generator=gen, dtype=F64)
    dt = torch.rand(bsz, L, H, generator=gen, dtype=F64)
    A = -torch.rand(H, generator=gen, dtype=F64) * 3 - 0.1
    B, C = (torch.randn(bsz, L, G, N, generator=gen, dtype=F64) for _ in range(2))
    D = torch.randn(H, generator=gen, dtype=F64) if use_D else None
    S0 = torch.randn(bsz, H, P, N, generator=gen, dtype=torch.float32)
    y = tree_scan(S0, x, dt, A, B, C, D, tree_mask=mask)
    assert y.shape == (bsz, L, H, P) and y.dtype == F64
    for t in range(L):
        path = _paths(mask, t)
        yr, _ = ssm_recurrence_ref(x[:, path], dt[:, path], A, B[:, path], C[:, path], D, initial_state=S0)
        torch.testing.assert_close(y[:, t], yr[:, -1].to(F64), rtol=1e-5, atol=1e-5)


def test_tree_scan_causal_default_and_raw_dt():
    """tree_mask=None is the chain; raw dt with bias + softplus + clamp equals pre-discretized dt."""
    gen = torch.Generator().manual_seed(1)
    bsz, L, H, P, N, G = 2, 5, 4, 3, 4, 2
    x = torch.randn(bsz, L, H, P, generator=gen)
    raw = torch.randn(bsz, L, H, generator=gen)
    bias = torch.randn(H, generator=gen)
    A = -torch.rand(H, generator=gen) - 0.5
    B, C = (torch.randn(bsz, L, G, N, generator=gen) for _ in range(2))
    S0 = torch.randn(bsz, H, P, N, generator=gen)
    dt = torch.nn.functional.softplus(raw + bias).clamp(0.01, 0.5)
    y1 = tree_scan(S0, x, raw, A, B, C, tree_mask=None, dt_bias=bias, dt_softplus=True, dt_limit=(0.01, 0.5))
    y2 = tree_scan(S0, x, dt, A, B, C, tree_mask=_mask([0, 1, 2, 3], bsz))
    yr, _ = ssm_recurrence_ref(x, dt, A, B, C, None, initial_state=S0)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y1, yr, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
@pytest.mark.parametrize("W", [4, 2], ids=["W4", "W2"])
def test_tree_conv_equals_causal_conv_along_every_path(tree, W):
    gen = torch.Generator().manual_seed(2)
    bsz, Cdim = 2, 7
    mask = _mask(TREES[tree], bsz)
    L = mask.shape[-1]
    x = torch.randn(bsz, L, Cdim, generator=gen, dtype=F64)
    state = torch.randn(bsz, Cdim, W - 1, generator=gen, dtype=F64)
    w, b = torch.randn(Cdim, W, generator=gen, dtype=F64), torch.randn(Cdim, generator=gen, dtype=F64)
    before = state.clone()
    y = tree_conv1d(x, state, w, b, tree_mask=mask, activation="silu")
    assert torch.equal(state, before), "the tree conv must not touch the committed conv state"
    for t in range(L):
        path = _paths(mask, t)
        yr, _ = causal_conv1d(x[:, path], w, b, state=state, activation="silu")
        torch.testing.assert_close(y[:, t], yr[:, -1], rtol=1e-6, atol=1e-6)  # the reference conv is fp32


def test_tree_ops_reject_bad_shapes():
    x = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_scan(torch.zeros(1, 2, 4, 5), x, torch.rand(1, 3, 2), -torch.ones(2), torch.randn(1, 3, 1, 5),
                  torch.randn(1, 3, 1, 5), tree_mask=torch.ones(1, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="state"):
        tree_scan(torch.zeros(1, 2, 4, 6), x, torch.rand(1, 3, 2), -torch.ones(2), torch.randn(1, 3, 1, 5),
                  torch.randn(1, 3, 1, 5))
    with pytest.raises(ValueError, match="conv_state"):
        tree_conv1d(torch.randn(1, 3, 5), torch.zeros(1, 5, 2), torch.randn(5, 4))
