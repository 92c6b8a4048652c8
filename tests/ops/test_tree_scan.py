"""The packed token-tree kernels (ops/tree_scan/triton.py) vs their naive twins over tree shapes, mixer sizes
and every optional argument; the twins are checked against the per-path recurrence in
tests/strategies/test_stree_ops.py."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, assert_close, mamba_inputs

from ssmspec.drafting.base import DraftTree
from ssmspec.ops.tree_scan import tree_conv1d, tree_scan


def _random_parents(T: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T + 1)]


def _full_binary(depth: int) -> list[int]:
    """Full binary tree of ``depth`` levels (root included, seed 003 Fig. 3): node i's parent is (i-1)//2."""
    return [(i - 1) // 2 for i in range(1, 2 ** depth - 1)]


# parents of nodes 1..T (node 0 is the pending token); None = the causal default (tree_mask=None)
TREES = {
    "causal-T5": None,
    "chain-T5": [0, 1, 2, 3, 4],
    "chains-5-4-4": [0, 1, 2, 3, 4, 0, 6, 7, 8, 0, 10, 11, 12],  # three chains from the root, T=13
    "bushy-T13": [0] * 13,
    "static-3x4": [0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 8, 10],  # a width-3 static tree, T=13 (seed 003 Fig. 4a)
    "binary-d5": _full_binary(5),  # T=30
    "random-T40": _random_parents(40, 1),
    "random-T70": _random_parents(70, 2),  # 71 nodes: two node blocks, cross-block ancestors
}


def _mask(parents: list[int] | None, bsz: int, device) -> tuple[torch.Tensor | None, int]:
    if parents is None:
        return None, 6
    par = torch.tensor(parents).reshape(1, -1).expand(bsz, -1)
    mask = DraftTree(torch.zeros_like(par), par).ancestor_mask().to(device)
    return mask, mask.shape[-1]


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    """A copy of t (B, L, ...) inside a buffer whose extra node rows are NaN: a read past L shows up."""
    buf = torch.full((t.shape[0], t.shape[1] + 3, *t.shape[2:]), float("nan"), dtype=t.dtype, device=t.device)
    buf[:, :t.shape[1]] = t
    return buf[:, :t.shape[1]]


SIZES = [pytest.param(6, 80, 3, 64, id="H6-P80-G3-N64"), pytest.param(2, 8, 2, 5, id="H2-P8-G2-N5")]
OPTIONS = [  # dtype, D, raw dt (dt_bias + softplus + clamp) or pre-discretized
    pytest.param(torch.float32, True, True, id="fp32-D-rawdt"),
    pytest.param(torch.bfloat16, False, False, id="bf16-noD-discretized"),
    pytest.param(torch.float16, True, False, id="fp16-D-discretized"),
]


@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
@pytest.mark.parametrize("H,P,G,N", SIZES)
@pytest.mark.parametrize("dtype,use_D,raw_dt", OPTIONS)
def test_tree_scan_kernel_matches_naive(tree, H, P, G, N, dtype, use_D, raw_dt, device):
    bsz = 2
    mask, L = _mask(TREES[tree], bsz, device)
    inp = mamba_inputs(bsz, L, H, P, G, N, dtype, device, seed=L)
    state = torch.randn(bsz, H, P, N, device=device) * 0.5
    if raw_dt:
        kw = dict(dt=inp["dt"], dt_bias=inp["dt_bias"], dt_softplus=True, dt_limit=(0.001, 0.3))
    else:  # what stree passes: fp32 discretized dt, 0 on a no-op node
        dt = torch.nn.functional.softplus(inp["dt"].float() + inp["dt_bias"])
        dt[:, L // 2] = 0.0
        kw = dict(dt=dt)
    x, B, C = (_poisoned(inp[k]) for k in ("x", "B", "C"))
    D = inp["D"] if use_D else None
    before = state.clone()
    y_k = tree_scan(state, x, A=inp["A"], B=B, C=C, D=D, tree_mask=mask, backend="triton", **kw)
    y_r = tree_scan(state, x, A=inp["A"], B=B, C=C, D=D, tree_mask=mask, backend="reference", **kw)
    assert y_k.shape == (bsz, L, H, P) and y_k.dtype == dtype
    assert_close(y_k, y_r, TOL[dtype], "y")
    assert torch.equal(state, before), "the tree scan must not write the committed state"


@pytest.mark.parametrize("launch", [
    pytest.param(dict(readout_block=16), id="readout-in-4-steps"),
    pytest.param(dict(block_p=16, num_warps=8), id="bp16-8warps"),
    pytest.param(dict(block_p=32, readout_block=32, readout="tf32x3"), id="bp32-r32-tf32x3"),
    pytest.param(dict(readout="tf32"), id="tf32"),
])
@pytest.mark.parametrize("tree", ["static-3x4", "random-T70"])
def test_tree_scan_launch_options_match_naive(tree, launch, device):
    """Every launch option of the sweep (``scan_launch``: P columns a program, warps, the readout in steps
    over the state width, its precision) gives the naive twin's y: P = 80 leaves a partial P block at 16 and
    32, N = 64 takes 4 readout steps of 16, random-T70 has a block of nodes before the diagonal one."""
    from ssmspec.ops.tree_scan.triton import tree_scan_triton

    bsz, H, P, G, N = 2, 4, 80, 2, 64
    mask, L = _mask(TREES[tree], bsz, device)
    inp = mamba_inputs(bsz, L, H, P, G, N, torch.bfloat16, device, seed=3)
    state = torch.randn(bsz, H, P, N, device=device) * 0.5
    x, B, C = (_poisoned(inp[k]) for k in ("x", "B", "C"))
    kw = dict(tree_mask=mask, dt_bias=inp["dt_bias"], dt_softplus=True)
    y_k = tree_scan_triton(state, x, inp["dt"], inp["A"], B, C, inp["D"], **kw, **launch)
    y_r = tree_scan(state, x, inp["dt"], inp["A"], B, C, inp["D"], **kw, backend="reference")
    assert_close(y_k, y_r, TOL[torch.bfloat16], "y")  # bf16 outputs: a tf32 readout rounds below that


def test_tree_scan_rejects_bad_launch_options(device):
    from ssmspec.ops.tree_scan.triton import scan_launch

    for bad, match in ((dict(block_p=24), "block_p must be a power of two"),
                       (dict(readout_block=256), r"readout_block must be a power of two in \[16, 64\]"),
                       (dict(num_warps=3), "num_warps"), (dict(readout="bf16"), "readout must be one of")):
        with pytest.raises(ValueError, match=match):
            scan_launch(40, 64, 64, **bad)
    # the defaults: one node block, a whole head's P, 8 warps; a tf32 readout for 16-bit inputs, exact for fp32
    assert scan_launch(63, 64, 128) == dict(BLOCK_T=64, BLOCK_N=128, BLOCK_P=64, BLOCK_R=128, num_warps=8, READOUT=2)
    assert scan_launch(63, 64, 128, half=False)["READOUT"] == 0
    assert scan_launch(63, 64, 128, half=False, readout="tf32x3")["READOUT"] == 1


@pytest.mark.parametrize("block_p", [16, 32])
def test_tree_scan_refuses_the_launch_triton_miscompiles(block_p):
    """64 nodes a program, fewer than 64 P columns, 4 warps and a one-step readout over 128 state columns read
    past their shared memory on an H200 (Triton 3.6; compute-sanitizer: an invalid __shared__ read in the store
    of y, at every readout precision). ``scan_launch`` refuses exactly that launch and names the fixes, which
    it accepts."""
    from ssmspec.ops.tree_scan.triton import scan_launch

    with pytest.raises(ValueError, match="use num_warps=8 or readout_block=64"):
        scan_launch(63, 64, 128, block_p=block_p, num_warps=4)
    assert scan_launch(63, 64, 128, block_p=block_p, num_warps=8)["BLOCK_P"] == block_p
    assert scan_launch(63, 64, 128, block_p=block_p, num_warps=4, readout_block=64)["BLOCK_R"] == 64
    assert scan_launch(31, 64, 128, block_p=block_p, num_warps=4)["BLOCK_T"] == 32  # 32 nodes: no fault seen


def test_tree_scan_sweep_smoke(device, tmp_path):
    """``python -m ssmspec.bench.tree_scan_sweep --tiny``: the baseline and every option group run, every
    variant's y agrees with the defaults', and the rows written are the rows returned."""
    import json

    from ssmspec.bench.tree_scan_sweep import main
    if device != "cpu":
        pytest.skip("the --tiny smoke runs under the interpreter")
    rows = main(["--tiny", "--json", str(tmp_path / "rows.json")])
    assert rows == json.loads((tmp_path / "rows.json").read_text())
    assert [r["impl"] for r in rows][:2] == ["unrolled_shared", "packed"] and rows[-1]["impl"] == "packed-best"
    packed = [r for r in rows if r["impl"] == "packed"]
    seen = {k for r in packed for k in r["launch"]}
    assert {"readout", "readout_block", "block_p", "num_warps"} <= seen
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["rel"] < 1e-5 for r in packed)


def test_tree_scan_sweep_isolates_a_launch_that_crashes(device):
    """``--isolate`` (the default on CUDA): each measurement runs in a child process, so a child that dies (on the
    GPU an illegal memory access, which poisons the CUDA context; here a preset that does not exist) is a
    ``crashed`` row with the child's error line; a launch ``scan_launch`` refuses is a ``refused`` row with its
    reason, and a good launch's row comes back whole."""
    from types import SimpleNamespace

    from ssmspec.bench.tree_scan_sweep import isolated
    if device != "cpu":
        pytest.skip("the children run the --tiny sizes under the interpreter")
    a = SimpleNamespace(iters=1, warmup=0, tiny=True)
    dead = isolated("no-such-model", 1, 3, "packed", {}, a)
    assert dead["status"] == "crashed" and dead["ms"] is None
    assert dead["reason"].startswith("exit 1: ValueError: unknown model preset 'no-such-model'"), dead["reason"]
    bad = isolated("tiny-mamba2", 1, 3, "packed", {"block_p": 24}, a)
    assert bad["status"] == "refused" and bad["ms"] is None and bad["launch"] == {"block_p": 24}
    assert bad["reason"].startswith("tree scan: block_p must be a power of two"), bad["reason"]
    good = isolated("tiny-mamba2", 1, 3, "packed", {"readout": "tf32x3"}, a)
    assert good["status"] == "ok" and good["ms"] > 0 and good["rel"] < 1e-5 and good["launch"] == {"readout": "tf32x3"}


def test_tree_scan_kernel_rows_differ_per_sequence(device):
    """Each sequence reads its own mask: a chain in row 0 and a bushy tree in row 1."""
    H, P, G, N, T = 2, 16, 1, 16, 6
    par = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0]])
    mask = DraftTree(torch.zeros_like(par), par).ancestor_mask().to(device)
    inp = mamba_inputs(2, T + 1, H, P, G, N, torch.float32, device)
    state = torch.randn(2, H, P, N, device=device)
    args = (state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    kw = dict(tree_mask=mask, dt_bias=inp["dt_bias"], dt_softplus=True)
    assert_close(tree_scan(*args, **kw, backend="triton"), tree_scan(*args, **kw, backend="reference"),
                 TOL[torch.float32], "y")


@pytest.mark.parametrize("tree", ["causal-T5", "chains-5-4-4", "bushy-T13", "random-T70"])
@pytest.mark.parametrize("W", [pytest.param(4, id="W4"), pytest.param(2, id="W2"), pytest.param(1, id="W1")])
@pytest.mark.parametrize("dtype,act,use_bias", [
    pytest.param(torch.bfloat16, "silu", True, id="bf16-silu-bias"),
    pytest.param(torch.float32, None, False, id="fp32-identity-nobias"),
])
def test_tree_conv_kernel_matches_naive(tree, W, dtype, act, use_bias, device):
    bsz, Cdim = 2, 300  # 300 channels: a partial channel block
    mask, L = _mask(TREES[tree], bsz, device)
    g = torch.Generator().manual_seed(W)
    x = _poisoned(torch.randn(bsz, L, Cdim, generator=g).to(device, dtype))
    state = torch.randn(bsz, Cdim, W - 1, generator=g).to(device, dtype)
    w, b = torch.randn(Cdim, W, generator=g).to(device, dtype), torch.randn(Cdim, generator=g).to(device, dtype)
    before = state.clone()
    kw = dict(tree_mask=mask, activation=act)
    y_k = tree_conv1d(x, state, w, b if use_bias else None, backend="triton", **kw)
    y_r = tree_conv1d(x, state, w, b if use_bias else None, backend="reference", **kw)
    assert_close(y_k, y_r, TOL[dtype], "y")
    assert torch.equal(state, before)


def test_tree_kernels_reject_bad_input(device):
    x = torch.randn(1, 3, 2, 4, device=device)
    dt, A = torch.rand(1, 3, 2, device=device), -torch.ones(2, device=device)
    B = torch.randn(1, 3, 1, 5, device=device)
    with pytest.raises(ValueError, match="tree_mask must be a bool"):
        tree_scan(torch.zeros(1, 2, 4, 5, device=device), x, dt, A, B, B, backend="triton",
                  tree_mask=torch.ones(1, 3, 3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="state must be fp32"):
        tree_scan(torch.zeros(1, 2, 4, 5, dtype=torch.bfloat16, device=device), x, dt, A, B, B, backend="triton")
    with pytest.raises(ValueError, match="backend='reference'"):
        tree_scan(torch.zeros(1, 2, 4, 5, device=device), x.double(), dt, A, B.double(), B.double(), backend="triton")
    with pytest.raises(ValueError, match="conv_state"):
        tree_conv1d(torch.randn(1, 3, 5, device=device), torch.zeros(1, 5, 2, device=device),
                    torch.randn(5, 4, device=device), backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [4, 6])
def test_tree_kernels_mamba2_2p7b_sizes(depth, device):
    """The mamba2-2.7b mixer (H=80, P=64, N=128, G=1) on full binary trees, batch 4, bf16."""
    bsz, H, P, G, N = 4, 80, 64, 1, 128
    mask, L = _mask(_full_binary(depth), bsz, device)
    inp = mamba_inputs(bsz, L, H, P, G, N, torch.bfloat16, device)
    state = torch.randn(bsz, H, P, N, device=device) * 0.5
    args = (state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    kw = dict(tree_mask=mask, dt_bias=inp["dt_bias"], dt_softplus=True)
    assert_close(tree_scan(*args, **kw, backend="triton"), tree_scan(*args, **kw, backend="reference"),
                 TOL[torch.bfloat16], "y")
    conv_dim = H * P + 2 * G * N
    xc = torch.randn(bsz, L, conv_dim, device=device, dtype=torch.bfloat16)
    st = torch.randn(bsz, conv_dim, 3, device=device, dtype=torch.bfloat16)
    w, b = torch.randn(conv_dim, 4, device=device, dtype=torch.bfloat16), torch.randn(conv_dim, device=device)
    assert_close(tree_conv1d(xc, st, w, b.bfloat16(), tree_mask=mask, backend="triton"),
                 tree_conv1d(xc, st, w, b.bfloat16(), tree_mask=mask, backend="reference"), TOL[torch.bfloat16], "conv")
