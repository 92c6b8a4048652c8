"""Decode-update kernel (single token, fused multi-step, replay form, snapshot) vs the naive twins, and
the twins vs the per-token recurrence in float64."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import STATE_TOL, TOL, assert_close, mamba_inputs

from ssmspec.ops.multistep import ssm_multistep, ssm_multistep_snapshot
from ssmspec.ops.selective_state_update import selective_state_update
from ssmspec.ops.ssd.naive import ssm_recurrence_ref

SMALL = dict(bsz=2, L=5, H=6, P=80, G=3, N=64)  # odd sizes (STYLE.md): P=80 is no power of two


def _state(Bs, H, P, N, device, seed=1):
    return torch.randn(Bs, H, P, N, generator=torch.Generator().manual_seed(seed)).to(device)


def test_naive_equals_recurrence_float64():
    inp = mamba_inputs(2, 5, 6, 8, 3, 4, torch.float64, "cpu")
    dt = torch.nn.functional.softplus(inp["dt"] + inp["dt_bias"])
    s0 = _state(2, 6, 8, 4, "cpu")
    st = s0.clone()
    cnt = torch.tensor([2, 5])
    y = ssm_multistep(st, inp["x"], dt, inp["A"], inp["B"], inp["C"], inp["D"], dt_softplus=False, update_count=cnt)
    y_ref, _ = ssm_recurrence_ref(inp["x"], dt, inp["A"], inp["B"], inp["C"], inp["D"], initial_state=s0.double())
    torch.testing.assert_close(y.float(), y_ref, atol=1e-4, rtol=1e-4)  # the recurrence runs in fp32
    for b, c in enumerate(cnt.tolist()):
        _, s_ref = ssm_recurrence_ref(inp["x"][b:b + 1, :c], dt[b:b + 1, :c], inp["A"], inp["B"][b:b + 1, :c],
                                      inp["C"][b:b + 1, :c], initial_state=s0[b:b + 1].double())
        torch.testing.assert_close(st[b], s_ref[0], atol=1e-5, rtol=1e-5)


CASES = [
    pytest.param(torch.float32, dict(), id="fp32-plain"),
    pytest.param(torch.bfloat16, dict(D=True, z=True, dt_bias=True, limit=True), id="bf16-D-z-bias-limit"),
    pytest.param(torch.float16, dict(D=True, dt_bias=True, rows=True), id="fp16-D-bias-state_indices"),
    pytest.param(torch.float32, dict(D=True, dt_bias=True, count=True), id="fp32-update_count"),
    pytest.param(torch.bfloat16, dict(dt_bias=True, count=True, output=False), id="bf16-replay-form"),
]


def _kwargs(inp, opts, device):
    kw = dict(dt_bias=inp["dt_bias"] if opts.get("dt_bias") else None, D=inp["D"] if opts.get("D") else None,
              z=inp["z"] if opts.get("z") else None, dt_limit=(0.01, 0.2) if opts.get("limit") else (0.0, float("inf")))
    if opts.get("rows"):
        kw["state_batch_indices"] = torch.tensor([2, 0], device=device)
    if opts.get("count"):
        kw["update_count"] = torch.tensor([0, 3], device=device)
    if "output" in opts:
        kw["output"] = opts["output"]
    return kw


@pytest.mark.parametrize("dtype,opts", CASES)
def test_multistep_kernel_matches_naive(dtype, opts, device):
    inp = mamba_inputs(**SMALL, dtype=dtype, device=device)
    kw = _kwargs(inp, opts, device)
    s0 = _state(3, SMALL["H"], SMALL["P"], SMALL["N"], device)
    s0[1] = float("nan")  # row 1 is nobody's state when state_batch_indices = [2, 0]: must stay unread
    if "state_batch_indices" not in kw:
        s0 = s0[:2].clone()
        s0[1] = _state(1, SMALL["H"], SMALL["P"], SMALL["N"], device, seed=3)[0]
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    st_k, st_r = s0.clone(), s0.clone()
    y_k = ssm_multistep(st_k, *args, backend="triton", **kw)
    y_r = ssm_multistep(st_r, *args, backend="reference", **kw)
    if kw.get("output", True):
        assert_close(y_k, y_r, TOL[dtype], "y")
    else:
        assert y_k is None
    live = [0, 2] if "state_batch_indices" in kw else [0, 1]
    assert_close(st_k[live], st_r[live], STATE_TOL, "state")
    if "update_count" in kw:  # count 0: the state is not even rewritten
        assert torch.equal(st_k[0], s0[0])


def test_store_state_false_leaves_state(device):
    inp = mamba_inputs(2, 3, 6, 16, 3, 64, torch.bfloat16, device)
    s0 = _state(2, 6, 16, 64, device)
    st = s0.clone()
    y = ssm_multistep(st, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], dt_bias=inp["dt_bias"],
                      store_state=False, backend="triton")
    y_r = ssm_multistep(s0.clone(), inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                        dt_bias=inp["dt_bias"], backend="reference")
    assert torch.equal(st, s0)
    assert_close(y, y_r, TOL[torch.bfloat16], "y")


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_selective_state_update_kernel(dtype, device):
    inp = mamba_inputs(3, 1, 6, 80, 3, 64, dtype, device)
    s0 = _state(4, 6, 80, 64, device)
    s0[3] = float("nan")
    idx = torch.tensor([2, 0, -1], device=device)  # -1: a pad sequence, y = 0 and no state touched
    one = {k: (v[:, 0] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    st_k, st_r = s0.clone(), s0.clone()
    y_k = selective_state_update(st_k, one["x"], one["dt"], one["A"], one["B"], one["C"], one["D"], one["z"],
                                 one["dt_bias"], True, state_batch_indices=idx, backend="triton")
    y_r = selective_state_update(st_r[:3], one["x"][:2], one["dt"][:2], one["A"], one["B"][:2], one["C"][:2], one["D"],
                                 one["z"][:2], one["dt_bias"], True, state_batch_indices=idx[:2], backend="reference")
    assert_close(y_k[:2], y_r, TOL[dtype], "y")
    assert torch.all(y_k[2] == 0)
    assert_close(st_k[[0, 2]], st_r[[0, 2]], STATE_TOL, "state")
    assert torch.isnan(st_k[3]).all() and torch.equal(st_k[1], s0[1])


def test_snapshot_kernel(device):
    inp = mamba_inputs(2, 5, 6, 80, 3, 64, torch.bfloat16, device)
    pool = _state(16, 6, 80, 64, device)
    pool[[9, 15]] = float("nan")  # never read, never written
    src = torch.tensor([3, 7], device=device)
    dst = torch.tensor([[3, 4, 5, 6, -1], [10, 11, 12, 13, 14]], device=device)  # dst may equal src; -1: no store
    kw = dict(dt_bias=inp["dt_bias"], src_slot=src, dst_slots=dst)
    p_k, p_r = pool.clone(), pool.clone()
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    y_k = ssm_multistep_snapshot(p_k, *args, backend="triton", **kw)
    y_r = ssm_multistep_snapshot(p_r, *args, backend="reference", **kw)
    assert_close(y_k, y_r, TOL[torch.bfloat16], "y")
    ok = [i for i in range(16) if i not in (9, 15)]
    assert_close(p_k[ok], p_r[ok], STATE_TOL, "snapshots")
    assert torch.isnan(p_k[[9, 15]]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", [pytest.param((112, 64, 8, 128), id="nemotron-h-4b"),
                                    pytest.param((80, 64, 1, 128), id="mamba2-2.7b")])
@pytest.mark.parametrize("L", [1, 6, 10])
def test_multistep_large(preset, L, device):
    H, P, G, N = preset
    inp = mamba_inputs(64, L, H, P, G, N, torch.bfloat16, device)
    s0 = _state(64, H, P, N, device)
    st_k, st_r = s0.clone(), s0.clone()
    kw = dict(dt_bias=inp["dt_bias"], z=inp["z"], update_count=torch.randint(0, L + 1, (64,), device=device))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    y_k = ssm_multistep(st_k, *args, backend="triton", **kw)
    y_r = ssm_multistep(st_r, *args, backend="reference", **kw)
    assert_close(y_k, y_r, TOL[torch.bfloat16], "y")
    assert_close(st_k, st_r, (1e-3, 1e-3), "state")
