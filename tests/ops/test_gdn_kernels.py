"""Gated DeltaNet kernels (recurrent update, multi-token / snapshot update, ReplaySSM verify with flush and
append) vs their naive twins, and the naive twins vs the per-token recurrence in float64: the WY form of
replay equals the delta rule through flushes, rejections and ring wrap-around. Odd sizes throughout
(H = 3 value heads over G = 1 key head, dk = 48, dv = 80, R = 12, S = 5); dead ring slots and unused state
rows are NaN-poisoned for both backends."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import STATE_TOL, TOL, assert_close

from ssmspec.ops.gdn import (gdn_multistep, gdn_multistep_snapshot, gdn_recurrence_ref, gdn_recurrent_update,
                             gdn_replay_commit, gdn_replay_state_ref, gdn_replay_verify)

ODD = dict(H=3, G=1, N=48, P=80)
QWEN35 = dict(H=32, G=16, N=128, P=128)  # Qwen3.5-4B / Qwen3-Next-80B GDN mixer (published configs)


def gdn_inputs(bsz, L, H, G, N, P, dtype, device, seed=0) -> dict:
    """Decode inputs as a Qwen3.5 GDN mixer hands them over: l2-normed q, k; g = −exp(A_log)·softplus(a + bias)
    (log-decays around −0.05..−2); beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(bsz, L, G, N, generator=gen), dim=-1)
    k = F.normalize(torch.randn(bsz, L, G, N, generator=gen), dim=-1)
    a_log = torch.rand(H, generator=gen) * 2 - 1.5
    g = -a_log.exp() * F.softplus(torch.randn(bsz, L, H, generator=gen) - 1.0)
    beta = torch.sigmoid(torch.randn(bsz, L, H, generator=gen))
    v = torch.randn(bsz, L, H, P, generator=gen)
    return dict(q=q.to(device, dtype), k=k.to(device, dtype), v=v.to(device, dtype), g=g.to(device),
                beta=beta.to(device, dtype))


def _args(inp):
    return inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"]


def _state(rows, H, N, P, device, seed=1, dtype=torch.float32):
    return (0.3 * torch.randn(rows, H, N, P, generator=torch.Generator().manual_seed(seed))).to(device, dtype)


# the naive twins against the delta rule ---------------------------------------------------------------
def test_recurrence_is_the_gated_delta_rule_float64():
    """k-major S_t = exp(g)(I − β k kᵀ) S_{t-1} + β k vᵀ, y = scale·Sᵀq (fla's orientation of DESIGN.md section 1)."""
    H, G, N, P = 4, 2, 6, 5
    inp = gdn_inputs(2, 4, H, G, N, P, torch.float64, "cpu")
    s0 = _state(2, H, N, P, "cpu", dtype=torch.float64)
    y, s = gdn_recurrence_ref(s0, *_args(inp), scale=0.7)
    S = s0.clone()
    kh, qh = inp["k"].repeat_interleave(2, dim=2), inp["q"].repeat_interleave(2, dim=2)
    eye = torch.eye(N, dtype=torch.float64)
    for t in range(4):
        kt, bt, gt = kh[:, t], inp["beta"][:, t], inp["g"][:, t]
        house = eye - bt[..., None, None] * kt[..., :, None] * kt[..., None, :]  # (B, H, N, N)
        S = gt.exp()[..., None, None] * house @ S + bt[..., None, None] * kt[..., :, None] * inp["v"][:, t, :, None, :]
        torch.testing.assert_close(y[:, t], 0.7 * torch.einsum("bhnp,bhn->bhp", S, qh[:, t]))
    torch.testing.assert_close(s, S)


@pytest.mark.parametrize("S,R,accepted", [pytest.param(0, 4, [0] * 9, id="decode-R4"),
                                          pytest.param(5, 12, [5, 0, 3, 5, 1, 2, 5, 4], id="S5-R12"),
                                          pytest.param(2, 5, [2, 0, 1, 2, 2, 0, 1], id="S2-R5-overlap")])
def test_replay_naive_equals_recurrence_float64(S, R, accepted):
    """A decode of several calls (pending token + S drafts, commit of the accepted ones, flushes by the rule):
    every output equals the delta rule from the committed prefix, and checkpoint + ring rebuild its state."""
    bsz, L = 2, S + 1
    H, G, N, P = 6, 3, 8, 5
    s0 = _state(bsz, H, N, P, "cpu", dtype=torch.float64).float()
    S0 = s0.clone()
    ring_k = torch.full((bsz, R, G, N), float("nan"), dtype=torch.float64)
    ring_u = torch.full((bsz, R, H, P), float("nan"), dtype=torch.float64)
    ring_g = torch.full((bsz, R, H), float("nan"))
    head, count = torch.tensor([3, R - 1]), torch.zeros(bsz, dtype=torch.long)
    committed = s0.double()  # the delta rule's state after the committed tokens
    flushes = 0
    for step, a in enumerate(accepted):
        inp = gdn_inputs(bsz, L, H, G, N, P, torch.float64, "cpu", seed=10 + step)
        flushes += int((count + 2 * L > R).sum())
        y = gdn_replay_verify(S0, ring_k, ring_u, ring_g, head, count, *_args(inp), scale=0.5)
        y_ref, _ = gdn_recurrence_ref(committed, *_args(inp), scale=0.5)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)  # S0 and ring_g are fp32
        acc = torch.tensor([a, max(a - 1, 0)])
        for b in range(bsz):  # advance the delta rule by the accepted prefix of each sequence
            n = int(acc[b]) + 1
            one = {key: t[b:b + 1, :n] for key, t in inp.items()}
            committed[b] = gdn_recurrence_ref(committed[b:b + 1], *_args(one))[1][0]
        gdn_replay_commit(count, acc)
        torch.testing.assert_close(gdn_replay_state_ref(S0, ring_k, ring_u, ring_g, head, count), committed,
                                   atol=1e-5, rtol=1e-5)
    assert flushes >= 2


# kernels vs naive twins ---------------------------------------------------------------------------------
MULTI = [  # (dtype, L, options)
    pytest.param(torch.float32, 1, dict(), id="fp32-L1-plain"),
    pytest.param(torch.bfloat16, 5, dict(rows=True, scale=0.3), id="bf16-L5-state_indices-scale"),
    pytest.param(torch.float16, 5, dict(count=True), id="fp16-L5-update_count"),
    pytest.param(torch.bfloat16, 5, dict(count=True, output=False), id="bf16-L5-replay-form"),
    pytest.param(torch.float32, 3, dict(store_state=False), id="fp32-L3-no-store"),
]


@pytest.mark.parametrize("dtype,L,opts", MULTI)
def test_multistep_kernel_matches_naive(dtype, L, opts, device):
    H, G, N, P = ODD.values()
    inp = gdn_inputs(2, L, H, G, N, P, dtype, device)
    kw = dict(scale=opts.get("scale"), output=opts.get("output", True), store_state=opts.get("store_state", True))
    s0 = _state(3, H, N, P, device)
    if opts.get("rows"):
        kw["state_batch_indices"] = torch.tensor([2, 0], device=device)
        s0[1] = float("nan")  # nobody's state: never read, never written
    else:
        s0 = s0[:2].clone()
    if opts.get("count"):
        kw["update_count"] = torch.tensor([0, 3], device=device)
    st_k, st_r = s0.clone(), s0.clone()
    y_k = gdn_multistep(st_k, *_args(inp), backend="triton", **kw)
    y_r = gdn_multistep(st_r, *_args(inp), backend="reference", **kw)
    if kw["output"]:
        assert_close(y_k, y_r, TOL[dtype], "y")
    else:
        assert y_k is None and y_r is None
    live = [0, 2] if opts.get("rows") else [0, 1]
    assert_close(st_k[live], st_r[live], STATE_TOL, "state")
    if opts.get("rows"):
        assert torch.isnan(st_k[1]).all()
    if opts.get("count") or not kw["store_state"]:  # count 0 / no store: the state is not even rewritten
        assert torch.equal(st_k[live[0]], s0[live[0]])


@pytest.mark.parametrize("rows", [pytest.param(None, id="rows-None"), pytest.param([3, 0, -1], id="rows-pad")])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_recurrent_update_kernel(rows, dtype, device):
    H, G, N, P = ODD.values()
    one = {key: t[:, 0] for key, t in gdn_inputs(3, 1, H, G, N, P, dtype, device).items()}
    s0 = _state(4 if rows else 3, H, N, P, device)
    idx = None if rows is None else torch.tensor(rows, device=device)
    if rows:
        s0[[1, 2]] = float("nan")  # unused rows (the pad sequence has none)
    st_k, st_r = s0.clone(), s0.clone()
    y_k = gdn_recurrent_update(st_k, *_args(one), state_batch_indices=idx, backend="triton")
    y_r = gdn_recurrent_update(st_r, *_args(one), state_batch_indices=idx, backend="reference")
    assert_close(y_k[:2], y_r[:2], TOL[dtype], "y")
    live = [0, 1, 2] if rows is None else [0, 3]
    assert_close(st_k[live], st_r[live], STATE_TOL, "state")
    if rows:
        assert torch.all(y_k[2] == 0) and torch.all(y_r[2] == 0), "a pad sequence outputs zeros"
        assert torch.isnan(st_k[[1, 2]]).all()


def test_snapshot_kernel(device):
    H, G, N, P = ODD.values()
    inp = gdn_inputs(2, 5, H, G, N, P, torch.bfloat16, device)
    pool = _state(16, H, N, P, device)
    pool[[9, 15]] = float("nan")  # never read, never written
    kw = dict(src_slot=torch.tensor([3, 7], device=device),
              dst_slots=torch.tensor([[3, 4, 5, 6, -1], [10, 11, 12, 13, 14]], device=device))  # dst = src; -1
    p_k, p_r = pool.clone(), pool.clone()
    y_k = gdn_multistep_snapshot(p_k, *_args(inp), backend="triton", **kw)
    y_r = gdn_multistep_snapshot(p_r, *_args(inp), backend="reference", **kw)
    assert_close(y_k, y_r, TOL[torch.bfloat16], "y")
    ok = [i for i in range(16) if i not in (9, 15)]
    assert_close(p_k[ok], p_r[ok], STATE_TOL, "snapshots")
    assert torch.isnan(p_k[[9, 15]]).all()


def _ring(bsz, R, H, G, N, P, head, count, dtype, device, seed=5):
    """Ring buffers with live entries at window positions < count and NaN everywhere else (never read)."""
    gen = torch.Generator().manual_seed(seed)
    rk = F.normalize(torch.randn(bsz, R, G, N, generator=gen), dim=-1)
    ru = 0.5 * torch.randn(bsz, R, H, P, generator=gen)
    rg = -(0.02 + 0.5 * torch.rand(bsz, R, H, generator=gen))
    for b in range(bsz):
        for j in range(count[b], R):
            slot = (head[b] + j) % R
            rk[b, slot], ru[b, slot], rg[b, slot] = float("nan"), float("nan"), float("nan")
    return rk.to(device, dtype), ru.to(device, dtype), rg.to(device)


REPLAY = [  # (L, R, head, count, flush, scale); batch 2, ODD sizes
    pytest.param(1, 12, [5, 11], [3, 11], [False, True], None, id="decode-L1-R12"),
    pytest.param(6, 12, [10, 3], [5, 2], [True, False], 0.4, id="verify-S5-R12-wrap-scale"),
    pytest.param(5, 5, [4, 2], [5, 3], [True, True], None, id="ring-smaller-than-two-windows"),
    pytest.param(3, 12, [9, 4], [7, 2], None, None, id="flush-rule-in-kernel"),  # None: count + 2L > R
    pytest.param(6, 12, [0, 7], [0, 0], [True, False], None, id="empty-ring-flush"),
    # the inverse (I + A)^-1 by doubling: L = 2 takes no squaring, L = 9 three
    pytest.param(2, 8, [7, 1], [4, 0], [False, True], None, id="verify-S1-R8"),
    pytest.param(9, 20, [15, 2], [2, 11], None, None, id="verify-S8-R20-flush-rule"),
]


FORMS = [pytest.param(torch.bfloat16, dict(gemm=False), id="bf16-rows"),
         pytest.param(torch.float32, dict(gemm=False), id="fp32-rows"),
         pytest.param(torch.bfloat16, dict(gemm=True), id="bf16-gemm"),  # the GEMM form (tf32 for 16-bit inputs)
         pytest.param(torch.float32, dict(gemm=True), id="fp32-gemm"),  # ... tf32x3 for fp32 inputs
         # the state streamed in several chunks of N (48 = 3 x 16), over 3 column blocks of P = 80
         pytest.param(torch.bfloat16, dict(gemm=True, block_k=16, block_p=32), id="bf16-gemm-chunks")]


@pytest.mark.parametrize("L,R,head,count,flush,scale", REPLAY)
@pytest.mark.parametrize("dtype,form", FORMS)
def test_replay_verify_kernel(L, R, head, count, flush, scale, dtype, form, device):
    _check_replay(L, R, head, count, flush, scale, dtype, device, **form)


DECODE = [  # (R, head, count, flush); batch 3: a waiting row, a flush of a full ring, a flush of an empty one
    pytest.param(12, [5, 11, 0], [3, 11, 0], [False, True, True], id="R12"),
    pytest.param(4, [1, 3, 2], [2, 3, 0], None, id="R4-flush-rule-in-kernel"),  # count + 2 > R
    # a flush of a full ring: the new entry's slot is the oldest folded one (the split form stashes it)
    pytest.param(4, [1, 3, 2], [4, 2, 4], [True, False, True], id="R4-full-ring-flush"),
]


@pytest.mark.parametrize("R,head,count,flush", DECODE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("form", [pytest.param(dict(split=True), id="split"), pytest.param(dict(split=False), id="fused"),
                                  pytest.param(dict(split=True, block_p=16, num_warps=1, window_warps=2),
                                               id="split-16-columns")])  # several column blocks per head
def test_decode_kernel_forms(R, head, count, flush, dtype, form, device):
    """One-token calls: the split decode (a window launch that also appends k and g, then a state kernel that
    streams its tile, folds on flush steps and appends u), over one or several column blocks per head, and
    the fused three-launch form all equal the reference, pointers and ring included."""
    _check_replay(1, R, head, count, flush, 0.3, dtype, device, **form)


def _check_replay(L, R, head, count, flush, scale, dtype, device, **kw):
    from ssmspec.ops.gdn.replay import gdn_replay_verify_triton
    H, G, N, P = ODD.values()
    bsz = len(head)
    inp = gdn_inputs(bsz, L, H, G, N, P, dtype, device)
    S0 = _state(bsz, H, N, P, device, seed=2)
    fl = None if flush is None else torch.tensor(flush, device=device)
    if flush is None:  # the kernel decides by seed 000's rule; the case mixes a flushing and a waiting row
        flush = [c + 2 * L > R for c in count]
        assert any(flush) and not all(flush)
    outs = []
    for backend in ("triton", "reference"):
        st = [S0.clone(), *_ring(bsz, R, H, G, N, P, head, count, dtype, device),
              torch.tensor(head, device=device), torch.tensor(count, device=device)]
        y = (gdn_replay_verify_triton(*st, *_args(inp), scale=scale, flush=fl, **kw) if backend == "triton"
             else gdn_replay_verify(*st, *_args(inp), scale=scale, flush=fl, backend=backend))
        outs.append((y, st))
    (y_k, st_k), (y_r, st_r) = outs
    assert_close(y_k, y_r, TOL[dtype], "y")
    assert_close(st_k[0], st_r[0], STATE_TOL, "S0")
    assert torch.equal(st_k[4], st_r[4]) and torch.equal(st_k[5], st_r[5]), "head / count"
    for name, a, b in zip(("ring_k", "ring_u", "ring_g"), st_k[1:4], st_r[1:4]):  # dead slots stay NaN in both
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: written slots differ"
        tol = TOL[dtype] if name == "ring_u" else (1e-6, 1e-6)
        torch.testing.assert_close(a.float().nan_to_num(0.0), b.float().nan_to_num(0.0), atol=tol[0], rtol=tol[1],
                                   msg=lambda m: f"{name}: {m}")
    for b, f in enumerate(flush):
        if not f or count[b] == 0:
            assert torch.equal(st_k[0][b], S0[b]), "S0 is stored on flush steps of a non-empty ring only"


def test_bad_inputs_name_the_fix(device):
    H, G, N, P = ODD.values()
    inp = gdn_inputs(2, 3, H, G, N, P, torch.float32, device)
    with pytest.raises(ValueError, match="k-major"):
        gdn_multistep(_state(2, H, P, N, device), *_args(inp), backend="reference")  # (P, N): Mamba-2's layout
    with pytest.raises(ValueError, match="raise the buffer size R"):
        gdn_replay_verify(_state(2, H, N, P, device), *_ring(2, 2, H, G, N, P, [0, 0], [0, 0], torch.float32, device),
                          torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), *_args(inp))
    with pytest.raises(ValueError, match="one token"):
        gdn_recurrent_update(_state(2, H, N, P, device), *_args(inp))
    from ssmspec.ops.gdn.replay import gdn_replay_verify_triton
    ring = _ring(2, 8, H, G, N, P, [0, 0], [0, 0], torch.float32, device)
    with pytest.raises(ValueError, match="leave split=None"):  # the split form is the one-token decode's
        gdn_replay_verify_triton(_state(2, H, N, P, device), *ring, torch.zeros(2, dtype=torch.long),
                                 torch.zeros(2, dtype=torch.long), *_args(inp), split=True)


@pytest.mark.gpu
@pytest.mark.parametrize("L,R", [(1, 16), (7, 16), (7, 32)])
@pytest.mark.parametrize("gemm", [pytest.param(False, id="rows"), pytest.param(True, id="gemm")])
def test_replay_verify_large(L, R, gemm, device):
    """Qwen3.5-4B mixer sizes, batch 64: random pointers, the in-kernel flush rule, both forms."""
    from ssmspec.ops.gdn.replay import gdn_replay_verify_triton
    H, G, N, P = QWEN35.values()
    bsz = 64
    inp = gdn_inputs(bsz, L, H, G, N, P, torch.bfloat16, device)
    head = torch.randint(0, R, (bsz,)).tolist()
    count = torch.randint(0, R - L + 1, (bsz,)).tolist()
    S0 = _state(bsz, H, N, P, device)
    outs = []
    for backend in ("triton", "reference"):
        st = [S0.clone(), *_ring(bsz, R, H, G, N, P, head, count, torch.bfloat16, device),
              torch.tensor(head, device=device), torch.tensor(count, device=device)]
        y = (gdn_replay_verify_triton(*st, *_args(inp), gemm=gemm) if backend == "triton" else
             gdn_replay_verify(*st, *_args(inp), backend=backend))
        outs.append((y, st))
    (y_k, st_k), (y_r, st_r) = outs
    assert_close(y_k, y_r, TOL[torch.bfloat16], "y")
    assert_close(st_k[0], st_r[0], (1e-3, 1e-3), "S0")


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 7])
def test_multistep_large(L, device):
    H, G, N, P = QWEN35.values()
    inp = gdn_inputs(64, L, H, G, N, P, torch.bfloat16, device)
    s0 = _state(64, H, N, P, device)
    st_k, st_r = s0.clone(), s0.clone()
    kw = dict(update_count=torch.randint(0, L + 1, (64,), device=device))
    assert_close(gdn_multistep(st_k, *_args(inp), backend="triton", **kw),
                 gdn_multistep(st_r, *_args(inp), backend="reference", **kw), TOL[torch.bfloat16], "y")
    assert_close(st_k, st_r, (1e-3, 1e-3), "state")


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 4])
def test_recurrence_matches_fla(L, device):
    """Our k-major state, GVA head mapping and default scale are fla-core's: its fused recurrent kernel from the
    same state gives the same outputs and final state as ours (skipped where fla-core is not importable)."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    H, G, N, P = QWEN35.values()
    inp = gdn_inputs(8, L, H, G, N, P, torch.bfloat16, device)
    s0 = _state(8, H, N, P, device)
    st = s0.clone()
    y = gdn_multistep(st, *_args(inp), backend="triton")
    y_fla, s_fla = fla.fused_recurrent_gated_delta_rule(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"],
                                                        beta=inp["beta"], initial_state=s0, output_final_state=True)
    assert_close(y, y_fla, TOL[torch.bfloat16], "y vs fla")
    assert_close(st, s_fla, (1e-3, 1e-3), "state vs fla")
