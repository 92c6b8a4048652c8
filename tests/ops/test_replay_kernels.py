"""ReplaySSM kernels vs the naive twin, in both forms: the four launches (scores precompute, flush + output-only
main kernel, append + pointers) and the one launch per (sequence, head) of ``ops/replay/fused.py``. Standard
decode (L = 1), verify of S drafts, flush per sequence, ring wrap-around, a ring smaller than two windows (the
append overwrites entries the fold reads), tree masks, NaN-poisoned dead slots."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import STATE_TOL, TOL, assert_close, mamba_inputs

from ssmspec.ops.replay import replay_verify


def _ring(bsz, R, H, P, G, N, head, count, dtype, device, seed=5, dead=float("nan")):
    """Ring buffers with live entries at window positions < count and ``dead`` everywhere else."""
    g = torch.Generator().manual_seed(seed)
    rx = torch.randn(bsz, R, H, P, generator=g).to(device, dtype)
    rdt = (0.02 + 0.1 * torch.rand(bsz, R, H, generator=g)).to(device)
    rB = (0.3 * torch.randn(bsz, R, G, N, generator=g)).to(device, dtype)
    for b in range(bsz):
        for j in range(count[b], R):  # dead slots: must never be read
            slot = (head[b] + j) % R
            rx[b, slot], rdt[b, slot], rB[b, slot] = dead, dead, dead
    return rx, rdt, rB


def _tree(L, bsz, device):
    parents = [-1, 0, 0, 1, 1, 2, 3, 0][:L]
    m = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        j = i
        while j >= 0:
            m[i, j], j = True, parents[j]
    return m[None].expand(bsz, L, L).contiguous().to(device)


CASES = [  # (P, L, R, head, count, flush, tree); batch 2, H = 6, G = 3, N = 64
    pytest.param(80, 1, 8, [5, 7], [3, 7], [False, True], False, id="decode-L1-R8-P80"),
    pytest.param(32, 5, 12, [10, 3], [5, 2], [True, False], False, id="verify-S4-R12-wrap"),
    pytest.param(32, 5, 5, [4, 2], [5, 3], [True, True], False, id="ring-smaller-than-two-windows"),
    pytest.param(32, 6, 12, [9, 4], [4, 6], [False, True], True, id="tree-L6"),
    pytest.param(32, 3, 8, [6, 1], [3, 2], None, False, id="flush-rule-in-kernel"),  # None: count + 2L > R
]


FORMS = [  # (fused, gemm): the four launches with either state kernel, the one launch with either state part
    pytest.param(False, True, id="split-gemm"), pytest.param(False, False, id="split-rows"),
    pytest.param(True, None, id="fused"), pytest.param(True, False, id="fused-rows"),
]


@pytest.mark.parametrize("P,L,R,head,count,flush,tree", CASES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("fused,gemm", FORMS)
def test_replay_verify_kernel(P, L, R, head, count, flush, tree, dtype, fused, gemm, device):
    """Both forms of the call and of the state part (tensor-core GEMMs / row reductions) against the reference;
    the one-launch form leaves its workspace zero."""
    from ssmspec.ops.replay.triton import replay_verify_triton
    bsz, H, G, N = 2, 6, 3, 64
    ws = torch.zeros(bsz, dtype=torch.int32, device=device)
    inp = mamba_inputs(bsz, L, H, P, G, N, dtype, device)
    S0 = torch.randn(bsz, H, P, N, generator=torch.Generator().manual_seed(2)).to(device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    kw = dict(dt_bias=inp["dt_bias"], dt_limit=(0.0, 0.5),
              flush=None if flush is None else torch.tensor(flush, device=device),
              tree_mask=_tree(L, bsz, device) if tree else None)
    if flush is None:  # the kernel decides by seed 000's rule; the case mixes a flushing and a waiting row
        flush = [c + 2 * L > R for c in count]
        assert any(flush) and not all(flush)
    outs = []
    for backend, dead in (("triton", float("nan")), ("reference", 0.0)):  # the kernel must not read dead slots
        ring = _ring(bsz, R, H, P, G, N, head, count, dtype, device, dead=dead)
        st = [S0.clone(), *ring, torch.tensor(head, device=device), torch.tensor(count, device=device)]
        y = (replay_verify_triton(*st, *args, gemm=gemm, fused=fused, workspace=ws, **kw) if backend == "triton"
             else replay_verify(*st, *args, backend=backend, **kw))
        outs.append((y, st))
    assert not ws.any(), "the workspace is left zero for the next launch"
    (y_k, st_k), (y_r, st_r) = outs
    assert_close(y_k, y_r, TOL[dtype], "y")
    assert_close(st_k[0], st_r[0], STATE_TOL, "S0")
    for name, a, b in zip(("ring_x", "ring_dt", "ring_B"), st_k[1:4], st_r[1:4]):  # dead slots stay NaN / 0
        torch.testing.assert_close(a.float().nan_to_num(0.0), b.float(), atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")
    assert torch.equal(st_k[4], st_r[4]) and torch.equal(st_k[5], st_r[5]), "head / count"
    for b, f in enumerate(flush):
        if not f:
            assert torch.equal(st_k[0][b], S0[b]), "S0 is stored on flush steps only"


@pytest.mark.gpu
@pytest.mark.parametrize("L,R", [(1, 8), (7, 16)])
@pytest.mark.parametrize("fused,gemm", FORMS)
@pytest.mark.parametrize("bsz,H,P,G,N", [pytest.param(64, 112, 64, 8, 128, id="nemotron-h-4b-B64"),
                                         pytest.param(64, 12, 64, 1, 64, id="trained-mamba2-B64"),
                                         pytest.param(1, 12, 64, 1, 64, id="trained-mamba2-B1")])
def test_replay_verify_large(L, R, fused, gemm, bsz, H, P, G, N, device):
    """Real sizes on the GPU, where the one-launch form's programs really race for the shared ring entries and
    pointers (the interpreter runs them one after another)."""
    from ssmspec.ops.replay.triton import replay_verify_triton
    inp = mamba_inputs(bsz, L, H, P, G, N, torch.bfloat16, device)
    head = torch.randint(0, R, (bsz,)).tolist()
    count = torch.randint(0, R - L + 1, (bsz,)).tolist()
    flush = [c + 2 * L > R for c in count]
    S0 = torch.randn(bsz, H, P, N, device=device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    outs = []
    for backend, dead in (("triton", float("nan")), ("reference", 0.0)):
        ring = _ring(bsz, R, H, P, G, N, head, count, torch.bfloat16, device, dead=dead)
        st = [S0.clone(), *ring, torch.tensor(head, device=device), torch.tensor(count, device=device)]
        kw = dict(dt_bias=inp["dt_bias"], flush=torch.tensor(flush, device=device))
        y = replay_verify_triton(*st, *args, gemm=gemm, fused=fused, **kw) if backend == "triton" else replay_verify(
            *st, *args, backend=backend, **kw)
        outs.append((y, st))
    (y_k, st_k), (y_r, st_r) = outs
    assert_close(y_k, y_r, TOL[torch.bfloat16], "y")
    assert_close(st_k[0], st_r[0], (1e-3, 1e-3), "S0")
    for name, a, b in zip(("ring_x", "ring_dt", "ring_B"), st_k[1:4], st_r[1:4]):
        torch.testing.assert_close(a.float().nan_to_num(0.0), b.float(), atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")
    assert torch.equal(st_k[4], st_r[4]) and torch.equal(st_k[5], st_r[5]), "head / count"


def test_default_form(device):
    """One launch where the call's state is small and a head's tile fits one program, four launches otherwise."""
    from ssmspec.ops.replay.triton import FUSED_MAX_STATE, use_fused
    assert use_fused(1, 12, 64, 64) and use_fused(16, 12, 64, 64) and use_fused(1, 80, 64, 128)
    assert use_fused(4, 80, 64, 128), "mamba2-2.7b's mixer at batch 4: the measured bound"
    assert not use_fused(4, 112, 64, 128) and not use_fused(16, 80, 64, 128) and not use_fused(64, 12, 64, 64)
    assert not use_fused(FUSED_MAX_STATE // (8 * 64 * 64) + 1, 8, 64, 64)
    assert not use_fused(1, 8, 128, 128), "a 128 x 128 fp32 tile does not fit one program"


def test_fused_refusals(device):
    """A workspace the one-launch form cannot count in, and a tile too large for one program: one clear error."""
    from ssmspec.ops.replay.triton import replay_verify_triton
    bsz, L, R, H, P, G, N = 2, 3, 8, 4, 16, 2, 16

    def call(P_=P, N_=N, **kw):
        i = mamba_inputs(bsz, L, H, P_, G, N_, torch.bfloat16, device)
        a = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"])
        st = [torch.zeros(bsz, H, P_, N_, device=device), *_ring(bsz, R, H, P_, G, N_, [0, 0], [0, 0], torch.bfloat16,
                                                                  device, dead=0.0),
              torch.zeros(bsz, dtype=torch.int64, device=device), torch.zeros(bsz, dtype=torch.int64, device=device)]
        return replay_verify_triton(*st, *a, dt_bias=i["dt_bias"], fused=True, **kw)

    with pytest.raises(ValueError, match="workspace must be a contiguous int32"):
        call(workspace=torch.zeros(bsz, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="workspace must be a contiguous int32"):
        call(workspace=torch.zeros(bsz - 1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="use fused=False"):
        call(P_=128, N_=128)
    with pytest.raises(ValueError, match="launch options of the four-launch form"):
        call(block_p=16)


def test_split_launch_options_pick_the_split_form(device, monkeypatch):
    """A sweep of the four-launch form's options (block_p, window_warps) times that form even where the default
    would be the one launch: never the fused kernel with the options silently dropped."""
    import ssmspec.ops.replay.fused as fu
    from ssmspec.ops.replay.triton import replay_verify_triton, use_fused
    bsz, L, R, H, P, G, N = 2, 3, 8, 4, 16, 2, 16
    assert use_fused(bsz, H, P, N)
    called = []
    monkeypatch.setattr(fu, "replay_verify_fused_triton", lambda *a, **k: called.append(1))
    inp = mamba_inputs(bsz, L, H, P, G, N, torch.bfloat16, device)
    for opts in ({"block_p": 16}, {"window_warps": 1}):
        st = [torch.zeros(bsz, H, P, N, device=device), *_ring(bsz, R, H, P, G, N, [0, 0], [0, 0], torch.bfloat16,
                                                                device, dead=0.0),
              torch.zeros(bsz, dtype=torch.int64, device=device), torch.zeros(bsz, dtype=torch.int64, device=device)]
        y = replay_verify_triton(*st, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                                 dt_bias=inp["dt_bias"], **opts)
        assert y is not None and y.shape == inp["x"].shape
    replay_verify_triton(*st, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], dt_bias=inp["dt_bias"])
    assert called == [1], "without split options the default at this size is the one launch"
