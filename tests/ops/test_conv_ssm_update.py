"""Fused conv + single-token SSM update (ops/conv_ssm_update) vs its twin (the unfused pair on the reference ops)
and vs the unfused pair on our own kernels, over several decode steps: outputs, conv state and SSM state.

The kernel's conv sums its taps in the unfused conv kernel's order, so against our unfused kernels the conv state
is exact and y and the SSM state agree to the last bit under the interpreter (to FMA contraction on a GPU).
Against the twin (F.conv1d) the bf16 conv outputs may differ by one bf16 ulp, which the SSM carries on: hence
the wider bf16 tolerances there.
"""
from __future__ import annotations

import pytest
import torch
from kernel_checks import STATE_TOL, TOL, assert_close

from ssmspec.models.config import load_preset
from ssmspec.ops.causal_conv1d import causal_conv1d_update
from ssmspec.ops.conv_ssm_update import conv_ssm_update
from ssmspec.ops.selective_state_update import selective_state_update

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TWIN_TOL = {torch.float32: (TOL[torch.float32], STATE_TOL), torch.bfloat16: ((5e-2, 3e-2), (1e-2, 1e-2))}  # y, state
SIZES = dict(H=4, P=8, N=16, W=4)


def _mixer(bsz, H, P, G, N, W, dtype, device, *, bias=True, seed=0):
    """Random weights and one step's worth of state. xbc and dt are views into an in_proj-like row with NaN in the
    z part, as the model hands them over: the kernel must read only its columns."""
    g = torch.Generator().manual_seed(seed)
    cd = H * P + 2 * G * N

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return dict(conv_state=r(bsz, cd, W - 1).to(device, dtype), conv_weight=r(cd, W, scale=0.4).to(device, dtype),
                conv_bias=r(cd, scale=0.2).to(device, dtype) if bias else None, ssm_state=r(bsz, H, P, N, scale=0.3).to(device),
                A=-(0.5 + 7.5 * torch.rand(H, generator=g)).to(device), D=r(H).to(device),
                dt_bias=r(H, scale=0.5).to(device), sizes=dict(heads=H, head_dim=P, groups=G, state_size=N))


def _token(bsz, mix, dtype, device, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    s = mix["sizes"]
    cd, H = mix["conv_weight"].shape[0], s["heads"]
    row = torch.full((bsz, s["heads"] * s["head_dim"] + cd + H), float("nan"))
    row[:, -cd - H:-H] = torch.randn(bsz, cd, generator=g)
    row[:, -H:] = torch.randn(bsz, H, generator=g) - 3.0
    row = row.to(device, dtype)
    return row[:, -cd - H:-H], row[:, -H:]  # xbc (B, conv_dim), dt (B, H): strided views


def _unfused(xbc, dt, mix, conv_state, ssm_state, dt_limit, backend):
    """Today's autoregressive step: the conv update, then one selective_state_update."""
    s = mix["sizes"]
    H, P, G, N = s["heads"], s["head_dim"], s["groups"], s["state_size"]
    bsz = xbc.shape[0]
    post = causal_conv1d_update(xbc[:, None], conv_state, mix["conv_weight"], mix["conv_bias"], backend=backend)[:, 0]
    x, B, C = post.split([H * P, G * N, G * N], dim=-1)
    y = selective_state_update(ssm_state, x.reshape(bsz, H, P), dt, mix["A"], B.reshape(bsz, G, N),
                               C.reshape(bsz, G, N), mix["D"], dt_bias=mix["dt_bias"], dt_softplus=True,
                               dt_limit=dt_limit, backend=backend)
    return y.reshape(bsz, -1)


def _run_steps(bsz, G, dtype, device, *, bias=True, dt_limit=(0.0, float("inf")), steps=3, sizes=SIZES, exact=None,
               **blocks):
    """``steps`` tokens through the fused kernel, its twin and the unfused kernels, compared after every step."""
    from ssmspec.ops.conv_ssm_update.triton import conv_ssm_update_triton

    mix = _mixer(bsz, sizes["H"], sizes["P"], G, sizes["N"], sizes["W"], dtype, device, bias=bias)
    ws = torch.zeros(bsz * G, dtype=torch.int32, device=device)
    st = {k: (mix["conv_state"].clone(), mix["ssm_state"].clone()) for k in ("fused", "twin", "unfused")}
    y_tol, s_tol = TWIN_TOL[dtype]
    exact = device == "cpu" if exact is None else exact  # interpreter: the same numpy ops in the same order
    for t in range(steps):
        xbc, dt = _token(bsz, mix, dtype, device, t)
        y_k = conv_ssm_update_triton(xbc, st["fused"][0], mix["conv_weight"], mix["conv_bias"], st["fused"][1], dt,
                                     mix["A"], mix["D"], mix["dt_bias"], **mix["sizes"], dt_limit=dt_limit,
                                     workspace=ws, **blocks)
        y_r = conv_ssm_update(xbc, st["twin"][0], mix["conv_weight"], mix["conv_bias"], st["twin"][1], dt, mix["A"],
                              mix["D"], mix["dt_bias"], **mix["sizes"], dt_limit=dt_limit, backend="reference")
        y_u = _unfused(xbc, dt, mix, *st["unfused"], dt_limit, "triton")
        assert_close(y_k, y_r, y_tol, f"y vs twin, step {t}")
        assert_close(st["fused"][1], st["twin"][1], s_tol, f"ssm state vs twin, step {t}")
        assert torch.equal(st["fused"][0], st["twin"][0]), f"conv state vs twin, step {t}"  # copies of inputs
        assert torch.equal(st["fused"][0], st["unfused"][0]), f"conv state vs unfused, step {t}"
        if exact:
            assert torch.equal(y_k, y_u) and torch.equal(st["fused"][1], st["unfused"][1]), f"vs unfused, step {t}"
        else:
            assert_close(y_k, y_u, TOL[dtype], f"y vs unfused, step {t}")
            assert_close(st["fused"][1], st["unfused"][1], STATE_TOL, f"ssm state vs unfused, step {t}")
        assert not ws.any(), "the kernel must leave its counters zero"


@pytest.mark.parametrize("dtype,bsz,G,bias,limit", [
    pytest.param(torch.float32, 1, 1, True, False, id="fp32-B1-G1-bias"),
    pytest.param(torch.float32, 3, 2, False, True, id="fp32-B3-G2-nobias-limit"),
    pytest.param(torch.bfloat16, 3, 1, False, False, id="bf16-B3-G1-nobias"),
    pytest.param(torch.bfloat16, 1, 2, True, True, id="bf16-B1-G2-bias-limit"),
])
def test_fused_equals_unfused(bsz, dtype, G, bias, limit, device):
    _run_steps(bsz, G, dtype, device, bias=bias, dt_limit=(0.01, 0.08) if limit else (0.0, float("inf")))


def test_odd_sizes_and_several_p_blocks(device):
    """P=12, N=12, G=3, W=3 (no powers of two, masked tiles) and BLOCK_P=4: three P blocks x two heads of a group
    read each group's B/C window, and exactly one of them may shift it."""
    _run_steps(1, 3, torch.float32, device, steps=2, sizes=dict(H=6, P=12, N=12, W=3), block_p=4)


def test_bad_inputs():
    mix = _mixer(2, 4, 8, 2, 16, 4, torch.float32, "cpu")
    xbc, dt = _token(2, mix, torch.float32, "cpu", 0)
    args = dict(conv_weight=mix["conv_weight"], conv_bias=None, A=mix["A"], D=mix["D"], dt_bias=mix["dt_bias"])

    def call(xbc=xbc, conv_state=mix["conv_state"], ssm_state=mix["ssm_state"], dt=dt, backend="triton", **kw):
        a = {**args, **mix["sizes"], **kw}
        return conv_ssm_update(xbc, conv_state, a.pop("conv_weight"), a.pop("conv_bias"), ssm_state, dt, a.pop("A"),
                               a.pop("D"), a.pop("dt_bias"), backend=backend, **a)

    with pytest.raises(ValueError, match="one token per sequence"):
        call(xbc=xbc[:, None])
    with pytest.raises(ValueError, match="conv_state must be"):
        call(conv_state=mix["conv_state"][..., :2], backend="reference")
    with pytest.raises(ValueError, match="ssm_state must be"):
        call(ssm_state=mix["ssm_state"][:, :3])
    with pytest.raises(ValueError, match="float32"):
        call(ssm_state=mix["ssm_state"].half())
    with pytest.raises(ValueError, match="heads % groups"):
        call(groups=3)
    with pytest.raises(ValueError, match="dt must be"):
        call(dt=dt[:, :2])
    with pytest.raises(ValueError, match="workspace"):
        call(workspace=torch.zeros(2 * 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="xbc's dtype"):
        call(conv_state=mix["conv_state"].double())


def _mamba_ssm_pair():
    """(causal_conv1d_update, selective_state_update) of the causal-conv1d and mamba_ssm packages, or a reason."""
    try:
        from causal_conv1d import causal_conv1d_update as conv
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as ssu
    except Exception as e:  # noqa: BLE001 -- any import failure: no baseline here
        return None, f"{type(e).__name__}: {e}"
    return (conv, ssu), ""


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 8, 64])
@pytest.mark.parametrize("preset", ["mamba2-2.7b", "nemotron-h-4b"])
def test_published_sizes(preset, bsz, device):
    """The real mixers in bf16 (mamba2-2.7b: H=80, P=64, N=128, G=1; nemotron-h-4b: H=112, P=64, N=128, G=8),
    20 steps so that a conv-state race (a program reading a B/C window already shifted) would show."""
    c = load_preset(preset)
    sizes = dict(H=c.ssm_heads, P=c.head_dim, N=c.state_size, W=c.conv_kernel)
    _run_steps(bsz, c.n_groups, torch.bfloat16, device, bias=c.conv_bias, dt_limit=(c.dt_min_limit, c.dt_max_limit),
               steps=20, sizes=sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 8, 64])
@pytest.mark.parametrize("preset", ["mamba2-2.7b", "nemotron-h-4b"])
def test_published_sizes_vs_mamba_ssm(preset, bsz, device):
    pair, why = _mamba_ssm_pair()
    if pair is None:
        pytest.skip(f"causal-conv1d / mamba_ssm not importable: {why}")
    conv, ssu = pair
    c = load_preset(preset)
    H, P, N, G, W = c.ssm_heads, c.head_dim, c.state_size, c.n_groups, c.conv_kernel
    mix = _mixer(bsz, H, P, G, N, W, torch.bfloat16, device, bias=c.conv_bias)
    cs_k, ss_k = mix["conv_state"].clone(), mix["ssm_state"].clone()
    cs_m, ss_m = mix["conv_state"].clone(), mix["ssm_state"].clone()
    for t in range(5):
        xbc, dt = _token(bsz, mix, torch.bfloat16, device, t)
        y_k = conv_ssm_update(xbc, cs_k, mix["conv_weight"], mix["conv_bias"], ss_k, dt, mix["A"], mix["D"],
                              mix["dt_bias"], **mix["sizes"], backend="triton")
        post = conv(xbc.contiguous(), cs_m, mix["conv_weight"], mix["conv_bias"], "silu")  # (B, conv_dim)
        x, B, C = post.split([H * P, G * N, G * N], dim=-1)
        y_m = ssu(ss_m, x.reshape(bsz, H, P), dt[..., None].expand(-1, -1, P), mix["A"][:, None, None].expand(H, P, N),
                  B.reshape(bsz, G, N), C.reshape(bsz, G, N), D=mix["D"][:, None].expand(H, P),
                  dt_bias=mix["dt_bias"][:, None].expand(H, P), dt_softplus=True)
        assert_close(y_k, y_m.reshape(bsz, -1), TWIN_TOL[torch.bfloat16][0], f"y vs mamba_ssm, step {t}")
        assert_close(ss_k, ss_m, TWIN_TOL[torch.bfloat16][1], f"ssm state vs mamba_ssm, step {t}")
        assert torch.equal(cs_k, cs_m), f"conv state vs causal-conv1d, step {t}"
