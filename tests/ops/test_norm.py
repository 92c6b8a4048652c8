"""Fused residual-add + RMSNorm and the gated group RMSNorm vs their naive twins, and the twins vs the
unfused PyTorch form of transformers' Mamba2 / NemotronH blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import TOL, assert_close

from ssmspec.ops.norm import add_rms_norm, gated_rms_norm


def _randn(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def test_twin_equals_unfused_block_form():
    """The twin is what a pre-norm block did unfused: residual = h.float(); h = residual + out; norm(h.to(w))."""
    x = _randn(2, 3, 40, dtype=torch.bfloat16, device="cpu", seed=0)
    out = _randn(2, 3, 40, dtype=torch.bfloat16, device="cpu", seed=1)
    w = _randn(40, dtype=torch.bfloat16, device="cpu", seed=2, scale=0.2) + 1
    res = x.float() + out  # (2, 3, 40) fp32
    h = res.to(w.dtype).float()
    want = (w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))).to(w.dtype)
    y, r = add_rms_norm(out, x.float(), w, eps=1e-5, residual_in_fp32=True, backend="reference")
    assert torch.equal(r, res) and torch.equal(y, want)


@pytest.mark.parametrize("shape", [pytest.param((1, 1, 64), id="decode-d64"), pytest.param((3, 7, 300), id="B3-L7-d300"),
                                   pytest.param((2, 5, 1000), id="B2-L5-d1000")])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("has_residual,res_fp32", [
    pytest.param(False, False, id="first-block"), pytest.param(False, True, id="first-block-fp32res"),
    pytest.param(True, False, id="residual"), pytest.param(True, True, id="residual-fp32res"),
])
def test_add_rms_norm_kernel(shape, dtype, has_residual, res_fp32, device):
    x = _randn(*shape, dtype=dtype, device=device, seed=0)
    rdt = torch.float32 if res_fp32 else dtype
    residual = _randn(*shape, dtype=rdt, device=device, seed=1, scale=3.0) if has_residual else None
    w = _randn(shape[-1], dtype=dtype, device=device, seed=2, scale=0.2) + 1
    y_k, r_k = add_rms_norm(x, residual, w, eps=1e-5, residual_in_fp32=res_fp32, backend="triton")
    y_r, r_r = add_rms_norm(x, residual, w, eps=1e-5, residual_in_fp32=res_fp32, backend="reference")
    assert y_k.dtype == dtype and r_k.dtype == r_r.dtype == (torch.float32 if res_fp32 else dtype)
    assert_close(y_k, y_r, TOL[dtype], "y")
    # one rounded fp32 add: exact, except that the CPU interpreter rounds fp32 -> bf16 by truncation
    exact = r_k.dtype != torch.bfloat16 or torch.cuda.is_available()
    torch.testing.assert_close(r_k, r_r, atol=0, rtol=0 if exact else 2 ** -7)
    if not has_residual and not res_fp32:
        assert r_k is x  # nothing to add or cast: no copy


def test_add_rms_norm_strided_x(device):
    """x a column slice of a wider tensor (rows not contiguous with each other): read through its strides."""
    wide = _randn(4, 6, 130, dtype=torch.float32, device=device, seed=0)
    x = wide[..., 10:110]  # (4, 6, 100), row stride 130
    res = _randn(4, 6, 100, dtype=torch.float32, device=device, seed=1)
    w = torch.ones(100, device=device)
    y_k, r_k = add_rms_norm(x, res, w, eps=1e-6, backend="triton")
    y_r, r_r = add_rms_norm(x, res, w, eps=1e-6, backend="reference")
    assert_close(y_k, y_r, TOL[torch.float32], "y")
    assert torch.equal(r_k, r_r)


def test_gated_twin_equals_unfused_form():
    y = _randn(2, 3, 48, dtype=torch.float64, device="cpu", seed=0)
    z = _randn(2, 3, 48, dtype=torch.float64, device="cpu", seed=1)
    w = _randn(48, dtype=torch.float64, device="cpu", seed=2)
    h = (y * F.silu(z)).view(2, 3, 4, 12)  # 4 groups of 12
    want = w * (h / h.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()).view(2, 3, 48)
    torch.testing.assert_close(gated_rms_norm(y, z, w, group_size=12, eps=1e-5), want)


@pytest.mark.parametrize("shape,group_size", [
    pytest.param((1, 1, 80), 80, id="decode-1group"), pytest.param((3, 7, 240), 80, id="B3-L7-3groups-odd"),
    pytest.param((2, 5, 512), 64, id="B2-L5-8groups"), pytest.param((2, 3, 96), 96, id="d96-1group"),
])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("strided_z", [pytest.param(False, id="z-contig"), pytest.param(True, id="z-slice")])
def test_gated_rms_norm_kernel(shape, group_size, dtype, strided_z, device):
    y = _randn(*shape, dtype=dtype, device=device, seed=0)
    d = shape[-1]
    if strided_z:  # z as the model has it: the first d channels of the in_proj output
        z = _randn(*shape[:-1], 2 * d + 7, dtype=dtype, device=device, seed=1)[..., :d]
    else:
        z = _randn(*shape, dtype=dtype, device=device, seed=1)
    w = _randn(d, dtype=dtype, device=device, seed=2, scale=0.2) + 1
    out_k = gated_rms_norm(y, z, w, group_size=group_size, eps=1e-5, backend="triton")
    out_r = gated_rms_norm(y, z, w, group_size=group_size, eps=1e-5, backend="reference")
    assert out_k.dtype == out_r.dtype == dtype
    assert_close(out_k, out_r, TOL[dtype], "out")


@pytest.mark.parametrize("call,match", [
    pytest.param(lambda d: gated_rms_norm(torch.ones(2, 6, device=d), torch.ones(2, 6, device=d), torch.ones(6, device=d),
                                          group_size=4, eps=1e-5, backend="triton"), "group_size", id="group-not-dividing"),
    pytest.param(lambda d: add_rms_norm(torch.ones(2, 6, device=d), torch.ones(2, 5, device=d), torch.ones(6, device=d),
                                        eps=1e-5, backend="triton"), "residual", id="residual-shape"),
    pytest.param(lambda d: add_rms_norm(torch.ones(2, 6, device=d, dtype=torch.float64), None,
                                        torch.ones(6, device=d, dtype=torch.float64), eps=1e-5, backend="triton"),
                 "backend='reference'", id="float64"),
])
def test_bad_input(call, match, device):
    with pytest.raises(ValueError, match=match):
        call(device)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [pytest.param(1, id="B1"), pytest.param(256, id="B256")])
def test_norms_nemotron_h_4b_sizes(rows, device):
    """d_model 3072 (residual in bf16), d_inner 7168 in 8 groups of 896 (Nemotron-H-4B); mamba2-2.7b's 2560/5120."""
    for d, d_inner, groups, res_fp32 in ((3072, 7168, 8, False), (2560, 5120, 1, True)):
        x = _randn(rows, 1, d, dtype=torch.bfloat16, device=device, seed=0)
        res = _randn(rows, 1, d, dtype=torch.float32 if res_fp32 else torch.bfloat16, device=device, seed=1)
        w = _randn(d, dtype=torch.bfloat16, device=device, seed=2, scale=0.2) + 1
        (y_k, r_k), (y_r, r_r) = (add_rms_norm(x, res, w, eps=1e-5, residual_in_fp32=res_fp32, backend=b)
                                  for b in ("triton", "reference"))
        assert_close(y_k, y_r, TOL[torch.bfloat16], "y")
        assert torch.equal(r_k, r_r)
        y = _randn(rows, 1, d_inner, dtype=torch.bfloat16, device=device, seed=3)
        z = _randn(rows, 1, d_inner, dtype=torch.bfloat16, device=device, seed=4)
        wg = _randn(d_inner, dtype=torch.bfloat16, device=device, seed=5, scale=0.2) + 1
        assert_close(gated_rms_norm(y, z, wg, group_size=d_inner // groups, eps=1e-5, backend="triton"),
                     gated_rms_norm(y, z, wg, group_size=d_inner // groups, eps=1e-5, backend="reference"),
                     TOL[torch.bfloat16], "gated")


def test_mamba_constants_prepared_once_and_rebuilt_when_weights_change():
    """Mamba2Mixer.params() hands out the same prepared MambaParams (no -exp(A_log) per call) until a
    weight changes: an in-place copy, a load_state_dict, or a dtype cast of the model."""
    from ssmspec.models.config import load_preset
    from ssmspec.models.model import build_model

    model = build_model(load_preset("tiny-mamba2"), seed=0)
    mixer = next(b.mixer for b in model.layers if b.kind == "M")
    p = mixer.params()
    assert mixer.params() is p
    with torch.no_grad():
        mixer.A_log.copy_(torch.zeros_like(mixer.A_log))  # A = -1
    p2 = mixer.params()
    assert p2 is not p and torch.equal(p2.A, -torch.ones_like(p2.A))
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert mixer.params() is not p2
    model.to(torch.float64)
    p3 = mixer.params()
    assert p3.conv_weight.dtype == torch.float64 and p3.A.dtype == torch.float32
    assert model.prepare() is model and mixer.params() is not p3  # prepare() rebuilds eagerly
