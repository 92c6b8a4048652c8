"""Decode-time conv kernels (a few tokens over [state, x]; the rollback offset) vs their naive twins, and the
twins vs one conv over the whole sequence."""
from __future__ import annotations

import pytest
import torch
from kernel_checks import TOL, assert_close

from ssmspec.ops.causal_conv1d import (causal_conv1d_ref, causal_conv1d_update, causal_conv1d_update_slots,
                                       conv_state_advance, conv_state_commit)


def _inputs(bsz, L, Cdim, W, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bsz, L, Cdim, generator=g).to(device, dtype), torch.randn(bsz, Cdim, W - 1, generator=g).to(device, dtype),
            torch.randn(Cdim, W, generator=g).to(device, dtype), torch.randn(Cdim, generator=g).to(device, dtype))


def test_naive_update_then_advance_equals_full_conv():
    x, st, w, b = _inputs(2, 7, 5, 4, torch.float64, "cpu")
    full, _ = causal_conv1d_ref(torch.cat([st.transpose(1, 2), x], 1), w, b, state=None)
    s = st.clone()
    y1 = causal_conv1d_update(x[:, :3], s, w, b)  # tokens 0..2, state advanced by all 3
    s2 = s.clone()
    conv_state_advance(s2, x[:, 3:6], torch.tensor([2, 2]))  # keep tokens 3, 4 of a call of 3
    y2 = causal_conv1d_update(x[:, 5:], s2, w, b, update_state=False)
    torch.testing.assert_close(y1, full[:, 3:6])
    torch.testing.assert_close(y2, full[:, 8:])


@pytest.mark.parametrize("W", [pytest.param(4, id="W4"), pytest.param(2, id="W2")])
@pytest.mark.parametrize("dtype,act,bias,update", [
    pytest.param(torch.bfloat16, "silu", True, True, id="bf16-silu-bias-update"),
    pytest.param(torch.float32, None, False, False, id="fp32-identity-readonly"),
])
def test_conv_update_kernel(W, dtype, act, bias, update, device):
    x, st, w, b = _inputs(3, 5, 300, W, dtype, device)  # 300 channels: a partial channel block
    s_k, s_r = st.clone(), st.clone()
    y_k = causal_conv1d_update(x, s_k, w, b if bias else None, activation=act, update_state=update, backend="triton")
    y_r = causal_conv1d_update(x, s_r, w, b if bias else None, activation=act, update_state=update, backend="reference")
    assert_close(y_k, y_r, TOL[dtype], "y")
    assert torch.equal(s_k, s_r)  # the state is a copy of inputs: exact


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_conv_update_keeps_its_inputs_in_the_same_call(backend, device):
    """``save_input``: the call's pre-conv inputs land in the first L positions of a (B, >= L, C) view of a strategy's
    buffer (one layer's slice of a (layers, B, Lmax, C) tensor) in the conv's own launch; the output and the
    state are those of the call without it; the rest of the buffer is untouched."""
    x, st, w, b = _inputs(3, 4, 300, 4, torch.bfloat16, device)
    buf = torch.full((2, 3, 6, 300), 7.0, dtype=torch.bfloat16, device=device)
    s_a, s_b = st.clone(), st.clone()
    y = causal_conv1d_update(x, s_a, w, b, update_state=False, save_input=buf[1], backend=backend)
    y0 = causal_conv1d_update(x, s_b, w, b, update_state=False, backend=backend)
    assert torch.equal(y, y0) and torch.equal(s_a, st)
    assert torch.equal(buf[1, :, :4], x) and (buf[1, :, 4:] == 7).all() and (buf[0] == 7).all()
    with pytest.raises(ValueError, match="save_input must be"):
        causal_conv1d_update(x, s_a, w, b, save_input=buf[1, :, :3], backend=backend)


def test_conv_state_advance_kernel(device):
    x, st, _, _ = _inputs(4, 5, 300, 4, torch.bfloat16, device)
    keep = torch.tensor([0, 1, 3, 5], device=device)  # 0: unchanged; 1: mixes state and x; 5: all of x
    x[0] = float("nan")  # keep 0 reads nothing of its row
    x[1, 1:] = float("nan")
    s_k, s_r = st.clone(), st.clone()
    conv_state_advance(s_k, x, keep, backend="triton")
    conv_state_advance(s_r, x, keep, backend="reference")
    assert torch.equal(s_k, s_r) and torch.equal(s_k[0], st[0])


@pytest.mark.parametrize("W", [4, 2])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_conv_state_commit_is_replay_commit_and_advance_of_every_layer(W, backend, device):
    """n = 3 layers x B = 4 sequences, rows layer-major: every layer's count moves by accepted + 1 of its
    sequence, and every row's conv state advances as ``conv_state_advance`` does with keep = accepted + 1 --
    exactly, in one call; inputs past a row's keep are never read (NaN there changes nothing)."""
    n, B, L = 3, 4, 5
    x, st, _, _ = _inputs(n * B, L, 300, W, torch.bfloat16, device)
    accepted = torch.tensor([0, 4, 2, 1], device=device)  # keep 1 .. 5 = L
    for r in range(n * B):
        x[r, int(accepted[r % B]) + 1:] = float("nan")
    count = torch.arange(n * B, device=device).view(n, B) * 10
    s_got, c_got = st.clone(), count.clone()
    conv_state_commit(s_got, x, accepted, c_got, backend=backend)
    s_want = st.clone()
    conv_state_advance(s_want, x, (accepted + 1).repeat(n), backend="reference")
    assert torch.equal(c_got, count + accepted + 1)
    assert torch.equal(s_got, s_want) and not s_got.isnan().any()


def test_conv_state_commit_refuses_shapes_that_do_not_pair_layers_and_sequences(device):
    x, st, _, _ = _inputs(6, 3, 8, 4, torch.float32, device)
    count, accepted = torch.zeros(2, 3, dtype=torch.long, device=device), torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"needs count \(n, B\), accepted \(B,\) and conv_state \(n B, C, W-1\)"):
        conv_state_commit(st, x, accepted[:2], count)
    with pytest.raises(ValueError, match="needs count and accepted int64"):
        conv_state_commit(st, x, accepted.int(), count)


@pytest.mark.parametrize("W", [pytest.param(4, id="W4"), pytest.param(3, id="W3")])
@pytest.mark.parametrize("dtype,keep,bias", [
    pytest.param(torch.bfloat16, None, True, id="bf16-all-bias"),
    pytest.param(torch.float32, [0, 1, 3, 5], False, id="fp32-keep"),
])
def test_conv_update_slots_kernel(W, dtype, keep, bias, device):
    """Windows read from pool slots (two rows share one) and stored into others (one row in place): the kernel
    equals its twin, output and every slot; slots nobody names stay as they were."""
    x, _, w, b = _inputs(4, 5, 300, W, dtype, device)
    pool = torch.randn(9, 300, W - 1, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    src = torch.tensor([2, 5, 5, 0], device=device)
    dst = torch.tensor([2, 7, 8, 6], device=device)  # row 0 in place; rows 1, 2 read slot 5 and store apart
    kp = None if keep is None else torch.tensor(keep, device=device)
    if keep is not None:
        x[0] = float("nan")  # keep 0 stores its window unchanged (its outputs are not compared)
    p_k, p_r = pool.clone(), pool.clone()
    y_k = causal_conv1d_update_slots(x, p_k, w, b if bias else None, src_slot=src, dst_slot=dst, keep=kp,
                                     backend="triton")
    y_r = causal_conv1d_update_slots(x, p_r, w, b if bias else None, src_slot=src, dst_slot=dst, keep=kp,
                                     backend="reference")
    rows = slice(1, None) if keep is not None else slice(None)
    assert_close(y_k[rows], y_r[rows], TOL[dtype], "y")
    assert torch.equal(p_k, p_r)
    untouched = [s for s in range(9) if s not in dst.tolist()]
    assert torch.equal(p_k[untouched], pool[untouched])
    want = causal_conv1d_update(x[1:2], pool[5:6].clone(), w, b if bias else None, backend="reference")
    assert_close(y_k[1:2], want, TOL[dtype], "y vs update")


@pytest.mark.gpu
def test_conv_large(device):
    x, st, w, b = _inputs(256, 7, 7168 + 2 * 8 * 128, 4, torch.bfloat16, device)
    s_k, s_r = st.clone(), st.clone()
    assert_close(causal_conv1d_update(x, s_k, w, b, backend="triton"), causal_conv1d_update(x, s_r, w, b, backend="reference"),
                 TOL[torch.bfloat16], "y")
    assert torch.equal(s_k, s_r)


@pytest.mark.gpu
def test_conv_state_commit_large(device):
    """nemotron-h-4b's conv width at batch 256 over 4 layers (rows layer-major), every keep 1 .. 7."""
    n, B = 4, 256
    x, st, _, _ = _inputs(n * B, 7, 7168 + 2 * 8 * 128, 4, torch.bfloat16, device)
    accepted = torch.arange(B, device=device) % 7
    count = torch.randint(0, 50, (n, B), device=device)
    s_k, c_k, s_r, c_r = st.clone(), count.clone(), st.clone(), count.clone()
    conv_state_commit(s_k, x, accepted, c_k, backend="triton")
    conv_state_commit(s_r, x, accepted, c_r, backend="reference")
    assert torch.equal(s_k, s_r) and torch.equal(c_k, c_r)


@pytest.mark.parametrize("args, match", [
    ({"pool_shape": (9, 299, 3)}, r"need x \(B, L, C\) and a pool \(slots, C, W-1\) with W = 2..4"),
    ({"pool_shape": (9, 300, 4)}, r"need x \(B, L, C\) and a pool \(slots, C, W-1\) with W = 2..4"),
    ({"w_shape": (300, 3)}, r"weight must be \(C, W\) = \(300, 4\)"),
    ({"src": [0, 1]}, r"src_slot must be \(B,\) = \(4,\)"),
    ({"keep": [1, 2, 3]}, r"keep must be \(B,\) = \(4,\)"),
    ({"activation": "gelu"}, "unsupported conv activation 'gelu'"),
], ids=["channels", "width", "weight", "src", "keep", "activation"])
def test_conv_update_slots_kernel_refuses_bad_shapes(args, match, device):
    x, _, w, _ = _inputs(4, 5, 300, 4, torch.float32, device)
    pool = torch.zeros(*args.get("pool_shape", (9, 300, 3)), device=device)
    w = torch.zeros(*args["w_shape"], device=device) if "w_shape" in args else w
    src = torch.tensor(args.get("src", [0, 1, 2, 3]), device=device)
    keep = torch.tensor(args["keep"], device=device) if "keep" in args else None
    with pytest.raises(ValueError, match=match):
        causal_conv1d_update_slots(x, pool, w, src_slot=src, dst_slot=torch.tensor([4, 5, 6, 7], device=device),
                                   keep=keep, activation=args.get("activation", "silu"), backend="triton")
