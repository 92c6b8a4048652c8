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


def _setup(inp, opts, device):
    """(keyword arguments, start states, the live state rows) for ``opts``. With ``rows`` the state has one row
    more than the batch and row 1 is nobody's (NaN: must stay unread); update_count is 0, about L / 2 (< L from
    L = 2 on) and L, in that order."""
    bsz, L, H, P = inp["x"].shape
    N = inp["B"].shape[-1]
    kw = dict(dt_bias=inp["dt_bias"] if opts.get("dt_bias") else None, D=inp["D"] if opts.get("D") else None,
              z=inp["z"] if opts.get("z") else None, dt_limit=(0.01, 0.2) if opts.get("limit") else (0.0, float("inf")))
    s0 = _state(bsz + 1, H, P, N, device)
    s0[1] = float("nan")
    live = [0, *range(2, bsz + 1)]
    if opts.get("rows"):
        kw["state_batch_indices"] = torch.tensor([bsz, 0, *range(2, bsz)], device=device)
    else:
        s0 = s0[:bsz].clone()
        s0[1] = _state(1, H, P, N, device, seed=3)[0]
        live = list(range(bsz))
    if opts.get("count"):
        kw["update_count"] = torch.tensor([0, (L + 1) // 2, L][:bsz], device=device)
    if "output" in opts:
        kw["output"] = opts["output"]
    return kw, s0, live


@pytest.mark.parametrize("dtype,opts", CASES)
def test_multistep_kernel_matches_naive(dtype, opts, device):
    inp = mamba_inputs(**SMALL, dtype=dtype, device=device)
    kw, s0, live = _setup(inp, opts, device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    st_k, st_r = s0.clone(), s0.clone()
    y_k = ssm_multistep(st_k, *args, backend="triton", **kw)
    y_r = ssm_multistep(st_r, *args, backend="reference", **kw)
    if kw.get("output", True):
        assert_close(y_k, y_r, TOL[dtype], "y")
    else:
        assert y_k is None
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


# launch options (P3): when the loads are issued changes, not what is computed ------------------------------
PREFETCH, STAGES2 = dict(prefetch=True), dict(num_stages=2)
# prefetch over every window length; num_stages at two only: the interpreter runs tl.range(..., num_stages) as a
# plain loop, so on CPU it checks the plumbing (the GPU runs it compiled in test_multistep_large)
LAUNCH_L = [pytest.param(PREFETCH, L, id=f"prefetch-L{L}") for L in (1, 2, 5, 10, 17)] + \
    [pytest.param(STAGES2, L, id=f"stages2-L{L}") for L in (1, 5)]
LAUNCH_CASES = [
    pytest.param(torch.float32, dict(), id="fp32-plain"),
    pytest.param(torch.bfloat16, dict(D=True, z=True, dt_bias=True, limit=True, rows=True, count=True),
                 id="bf16-D-z-bias-limit-state_indices-update_count"),
    pytest.param(torch.float32, dict(dt_bias=True, rows=True, count=True, output=False), id="fp32-replay-form"),
]


def _launch_shape(L: int) -> dict:
    """Odd sizes (P=24: a partial row block, two heads a group) and 3 sequences (update_count 0, < L, L); the
    long windows on 2 sequences of one head, as the interpreter runs the programs one after another."""
    return dict(bsz=3, H=2, P=24, G=1, N=16) if L <= 5 else dict(bsz=2, H=1, P=24, G=1, N=16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor (torch.equal on it is bitwise, NaN rows included)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


@pytest.mark.parametrize("launch,L", LAUNCH_L)
@pytest.mark.parametrize("dtype,opts", LAUNCH_CASES)
def test_launch_option_is_bitwise_the_default(dtype, opts, launch, L, device):
    """prefetch and num_stages move loads, not arithmetic: y and every state row equal the plain launch's
    (prefetch off, one stage: the default prefetches at these small grids) bit for bit (update_count 0 and < L,
    the replay form included), and the twin's within tolerance."""
    from ssmspec.ops.multistep.triton import ssm_multistep_triton

    inp = mamba_inputs(**_launch_shape(L), L=L, dtype=dtype, device=device)
    kw, s0, live = _setup(inp, opts, device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    st_d, st_o, st_r = s0.clone(), s0.clone(), s0.clone()
    y_d = ssm_multistep_triton(st_d, *args, **kw, prefetch=False, num_stages=1)
    y_o = ssm_multistep_triton(st_o, *args, **kw, **launch)
    y_r = ssm_multistep(st_r, *args, backend="reference", **kw)
    assert torch.equal(_bits(st_o), _bits(st_d))
    if kw.get("output", True):
        assert torch.equal(_bits(y_o), _bits(y_d))
        assert_close(y_o, y_r, TOL[dtype], "y")
    else:
        assert y_o is None
    assert_close(st_o[live], st_r[live], STATE_TOL, "state")
    if "update_count" in kw:  # sequence 0's count is 0: its row is not even rewritten
        row = int(kw["state_batch_indices"][0]) if "state_batch_indices" in kw else 0
        assert torch.equal(st_o[row], s0[row])


@pytest.mark.parametrize("launch,L", LAUNCH_L)
def test_snapshot_launch_option_is_bitwise_the_default(launch, L, device):
    from ssmspec.ops.multistep.triton import ssm_multistep_snapshot_triton

    z = _launch_shape(L)
    inp = mamba_inputs(2, L, z["H"], z["P"], z["G"], z["N"], torch.bfloat16, device)
    pool = _state(2 * L + 3, z["H"], z["P"], z["N"], device)
    pool[-1] = float("nan")  # never read, never written
    src = torch.tensor([1, 0], device=device)
    dst = torch.stack([2 + 2 * torch.arange(L), 3 + 2 * torch.arange(L)]).to(device)
    dst[0, -1], dst[1, 0] = -1, 0  # -1: no store; sequence 1's first snapshot overwrites its own start slot
    kw = dict(dt_bias=inp["dt_bias"], z=inp["z"], src_slot=src, dst_slots=dst)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    p_d, p_o, p_r = pool.clone(), pool.clone(), pool.clone()
    y_d = ssm_multistep_snapshot_triton(p_d, *args, **kw, prefetch=False, num_stages=1)  # the plain launch
    y_o = ssm_multistep_snapshot_triton(p_o, *args, **kw, **launch)
    y_r = ssm_multistep_snapshot(p_r, *args, backend="reference", **kw)
    assert torch.equal(_bits(y_o), _bits(y_d)) and torch.equal(_bits(p_o), _bits(p_d))
    assert_close(y_o, y_r, TOL[torch.bfloat16], "y")
    assert_close(p_o[:-1], p_r[:-1], STATE_TOL, "snapshots")
    assert torch.isnan(p_o[-1]).all()


@pytest.fixture
def memory_trace(device, monkeypatch):
    """Every load and store the CPU interpreter runs, in order: ("load" | "store", byte addresses of the lanes
    that are on)."""
    import numpy as np
    from triton.runtime import interpreter

    if device != "cpu":
        pytest.skip("traces the CPU interpreter's memory accesses")
    builder, trace = interpreter.interpreter_builder, []
    load, store = builder.create_masked_load, builder.create_masked_store

    def on(ptrs, mask):
        return ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape).astype(bool)].astype(np.int64)

    def traced_load(ptrs, mask, *rest):
        trace.append(("load", on(ptrs, mask)))
        return load(ptrs, mask, *rest)

    def traced_store(ptrs, value, mask, *rest):
        trace.append(("store", on(ptrs, mask)))
        return store(ptrs, value, mask, *rest)

    monkeypatch.setattr(builder, "create_masked_load", traced_load)
    monkeypatch.setattr(builder, "create_masked_store", traced_store)
    return trace


def _addresses(t: torch.Tensor, upto=None) -> set[int]:
    """Byte addresses of a contiguous tensor's elements; with ``upto``, of t[b, :upto[b]] for every b only."""
    offs = torch.arange(t.numel()).view(t.shape)
    if upto is not None:
        offs = torch.cat([offs[b, :int(n)].flatten() for b, n in enumerate(upto)])
    return set((t.data_ptr() + t.element_size() * offs.flatten()).tolist())


@pytest.mark.parametrize("launch", [pytest.param(dict(prefetch=False), id="plain"),
                                    pytest.param(dict(prefetch=True), id="prefetch")])
@pytest.mark.parametrize("form", ["update_count", "replay-form", "snapshot"])
def test_loads_stay_inside_the_computed_tokens(form, launch, memory_trace, device):
    """Every element loaded belongs to a token the sequence computes -- tokens < update_count[b] in the replay
    form, < L otherwise -- or to the state, A, D, dt_bias and the index tensors: the load of token t + 1 is masked
    off after the last token (unmasked it would read past x's end for the last sequence, and token count[b] of
    the others), and absent optional tensors are never read."""
    from ssmspec.ops.multistep.triton import ssm_multistep_snapshot_triton, ssm_multistep_triton

    L = 4
    inp = mamba_inputs(3, L, 2, 24, 1, 16, torch.bfloat16, device)
    tokens = ("x", "dt", "B", "C")
    if form == "snapshot":
        pool = _state(7, 2, 24, 16, device)
        src, dst = torch.tensor([0, 1, 2]), torch.tensor([[3, 4, -1, 5]] * 3)
        kw = dict(dt_bias=inp["dt_bias"], z=inp["z"], src_slot=src, dst_slots=dst)
        ssm_multistep_snapshot_triton(pool, *(inp[k] for k in ("x", "dt", "A", "B", "C", "D")), **kw, **launch)
        steps, fixed = [L] * 3, [pool, inp["A"], inp["D"], inp["dt_bias"], src, dst]
        tokens += ("z",)
    else:
        opts = dict(D=True, z=True, dt_bias=True, count=True, rows=True)
        if form == "replay-form":
            opts = dict(dt_bias=True, count=True, output=False)
            tokens = ("x", "dt", "B")
        kw, s0, _ = _setup(inp, opts, device)
        ssm_multistep_triton(s0, *(inp[k] for k in ("x", "dt", "A", "B", "C")), **kw, **launch)
        count = kw["update_count"].tolist()
        steps = count if form == "replay-form" else [L] * 3
        fixed = [s0, inp["A"], kw["update_count"]] + [kw[k] for k in ("D", "dt_bias", "state_batch_indices")
                                                        if kw.get(k) is not None]
        tokens += ("z",) if kw["z"] is not None else ()
    allowed = set().union(*(_addresses(t) for t in fixed), *(_addresses(inp[k], steps) for k in tokens))
    loaded = set().union(*(set(a.tolist()) for kind, a in memory_trace if kind == "load"))
    assert loaded and loaded <= allowed, f"{len(loaded - allowed)} elements loaded that no computed token needs"


def test_prefetch_loads_the_next_token_before_computing_this_one(memory_trace, device):
    """The order of one program's accesses: without prefetch, x of token t is loaded, then y of token t stored;
    prefetch loads token t + 1's x before it stores y of token t (and token 0's before the loop)."""
    from ssmspec.ops.multistep.triton import ssm_multistep_triton

    L = 4
    inp = mamba_inputs(1, L, 1, 24, 1, 16, torch.float32, device)
    orders = {}
    for prefetch in (False, True):
        memory_trace.clear()
        y = ssm_multistep_triton(_state(1, 1, 24, 16, device), *(inp[k] for k in ("x", "dt", "A", "B", "C")),
                                 prefetch=prefetch)
        xs = [_addresses(inp["x"][0, t, 0]) for t in range(L)]  # sequence 0, head 0: the first program's
        ys = [_addresses(y[0, t, 0]) for t in range(L)]
        order = []
        for kind, a in memory_trace:
            hits = set(a.tolist())
            order += [("x", t) for t in range(L) if kind == "load" and hits and hits <= xs[t]]
            order += [("y", t) for t in range(L) if kind == "store" and hits and hits <= ys[t]]
        orders[prefetch] = order
    assert orders[False] == [e for t in range(L) for e in (("x", t), ("y", t))]
    assert orders[True] == [("x", 0)] + [e for t in range(L - 1) for e in (("x", t + 1), ("y", t))] + [("y", L - 1)]


@pytest.mark.parametrize("form", ["multistep", "snapshot"])
def test_launch_options_reach_the_kernel(form, device, monkeypatch):
    """Both launchers hand prefetch / num_stages to the kernel as PREFETCH / NUM_STAGES (left out: the rule's
    prefetch, on at this small grid of L = 3 tokens, and 1 stage; a given prefetch=False stays off), and refuse
    a stage count below 1. The interpreter runs tl.range(..., num_stages) as a plain loop, so only this sees
    NUM_STAGES arrive."""
    from ssmspec.ops.multistep import triton as mt

    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **consts: seen.append((consts["PREFETCH"], consts["NUM_STAGES"]))

    monkeypatch.setattr(mt, "_ssm_update_kernel", Spy())
    inp = mamba_inputs(2, 3, 2, 8, 1, 8, torch.float32, device)
    args = [inp[k] for k in ("x", "dt", "A", "B", "C")]

    def call(**launch):
        if form == "multistep":
            return mt.ssm_multistep_triton(_state(2, 2, 8, 8, device), *args, **launch)
        return mt.ssm_multistep_snapshot_triton(_state(4, 2, 8, 8, device), *args, src_slot=torch.tensor([0, 1]),
                                                dst_slots=torch.tensor([[2, 3, -1]] * 2), **launch)

    for launch in ({}, dict(prefetch=True), dict(num_stages=2), dict(prefetch=False, num_stages=1)):
        call(**launch)
    assert mt.default_launch(2, 3, 2, 8, 8, mt.sm_count(torch.device(device)))["prefetch"]
    assert seen == [(True, 1), (True, 1), (True, 2), (False, 1)]
    with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
        call(num_stages=0)


@pytest.mark.parametrize("preset", ["mamba2-2.7b", "nemotron-h-4b"])
def test_default_prefetch_follows_the_grid(preset):
    """The default prefetches where the GPU sweep (two H200s, L = 10) timed it faster -- the batch-16 grid of both
    paper mixers -- and not at their batch-256 grid, where it was slower; never with one token; a given prefetch
    is kept either way. The mixers' sizes are the presets', the SM count the measured GPUs'."""
    from ssmspec.bench.kernels import mixer_sizes
    from ssmspec.ops.multistep.triton import REFERENCE_SMS, default_launch

    z = mixer_sizes(preset)

    def plan(bsz, L=10, **given):
        return default_launch(bsz, L, z["H"], z["P"], z["N"], REFERENCE_SMS, **given)

    for bsz, on in ((16, True), (256, False)):
        got = plan(bsz)
        bp = got["block_p"]
        assert got["grid"] == (-(-z["P"] // bp), bsz, z["H"]), got
        assert got["prefetch"] is on, (bsz, got)
        assert plan(bsz, prefetch=not on)["prefetch"] is (not on)  # an explicit choice is kept
    assert not plan(16, L=1)["prefetch"]


@pytest.mark.parametrize("form", ["multistep", "replay-form", "snapshot"])
def test_default_prefetch_is_bitwise_the_plain_launch(form, device, monkeypatch):
    """Where the rule says prefetch (a small grid, L > 1), the launch without options runs the kernel with
    PREFETCH on and gives y and the state bit for bit as an explicit prefetch=False launch: prefetch only moves
    loads."""
    from ssmspec.ops.multistep import triton as mt

    bsz, L, H, P, G, N = 3, 5, 2, 24, 1, 16
    assert mt.default_launch(bsz, L, H, P, N, mt.sm_count(torch.device(device)))["prefetch"]
    kernel, seen = mt._ssm_update_kernel, []

    class Spy:  # records PREFETCH, then runs the kernel
        def __getitem__(self, grid):
            def run(*args, **consts):
                seen.append(consts["PREFETCH"])
                return kernel[grid](*args, **consts)
            return run

    monkeypatch.setattr(mt, "_ssm_update_kernel", Spy())
    inp = mamba_inputs(bsz, L, H, P, G, N, torch.bfloat16, device)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    if form == "snapshot":
        pool = _state(bsz + bsz * L, H, P, N, device)  # slots 0..bsz-1: the starts; then one a token
        src = torch.tensor([1, 0, 2], device=device)
        dst = (bsz + torch.arange(bsz * L, device=device)).view(bsz, L)
        dst[0, -1] = -1  # no store
        kw = dict(dt_bias=inp["dt_bias"], z=inp["z"], src_slot=src, dst_slots=dst)
        p_d, p_o = pool.clone(), pool.clone()
        y_d = mt.ssm_multistep_snapshot_triton(p_d, *args, inp["D"], **kw)
        y_o = mt.ssm_multistep_snapshot_triton(p_o, *args, inp["D"], **kw, prefetch=False)
        same_state = torch.equal(_bits(p_d), _bits(p_o))
    else:
        opts = dict(D=True, z=True, dt_bias=True, rows=True, count=True) if form == "multistep" else \
            dict(dt_bias=True, count=True, output=False)
        kw, s0, _ = _setup(inp, opts, device)
        st_d, st_o = s0.clone(), s0.clone()
        y_d = mt.ssm_multistep_triton(st_d, *args, **kw)
        y_o = mt.ssm_multistep_triton(st_o, *args, **kw, prefetch=False)
        same_state = torch.equal(_bits(st_d), _bits(st_o))
    assert seen == [True, False]
    assert same_state
    if y_d is None:
        assert y_o is None
    else:
        assert torch.equal(_bits(y_d), _bits(y_o))


def test_multistep_sweep_smoke(device, tmp_path):
    """``python -m ssmspec.bench.multistep_sweep --tiny``: every launch of the reduced grid runs and matches the
    default launch (prefetch and stages bit for bit), the chunk scan says why it is missing, and the JSON lines
    written are the rows returned."""
    import json

    from ssmspec.bench.multistep_sweep import TINY_GRID, launches, main
    if device != "cpu":
        pytest.skip("the --tiny smoke runs under the interpreter")
    rows = main(["--tiny", "--out", str(tmp_path / "rows.jsonl")])
    assert rows == [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    fused = [r for r in rows if r["impl"] == "fused"]
    assert [{k: r[k] for k in TINY_GRID} for r in fused] == launches(TINY_GRID)
    assert all(r["status"] == "ok" and r["same_bits"] and r["rel"] < 1e-5 and r["ms_p50"] > 0 for r in fused)
    assert sum(r["default"] for r in fused) == 1
    assert rows[-1]["impl"] == "chunk_scan_mamba_ssm" and rows[-1]["status"] in ("ok", "skipped")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", [pytest.param((112, 64, 8, 128), id="nemotron-h-4b"),
                                    pytest.param((80, 64, 1, 128), id="mamba2-2.7b")])
@pytest.mark.parametrize("L", [1, 6, 10])
@pytest.mark.parametrize("launch", [pytest.param({}, id="default"), pytest.param(PREFETCH, id="prefetch"),
                                    pytest.param(STAGES2, id="stages2")])
def test_multistep_large(preset, L, launch, device):
    """The paper's mixers; a launch option gives the plain launch's (no prefetch, one stage) y and states bit for
    bit."""
    from ssmspec.ops.multistep.triton import ssm_multistep_triton

    H, P, G, N = preset
    inp = mamba_inputs(64, L, H, P, G, N, torch.bfloat16, device)
    s0 = _state(64, H, P, N, device)
    st_k, st_r = s0.clone(), s0.clone()
    kw = dict(dt_bias=inp["dt_bias"], z=inp["z"], update_count=torch.randint(0, L + 1, (64,), device=device))
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"])
    y_k = ssm_multistep_triton(st_k, *args, **kw, **launch)
    y_r = ssm_multistep(st_r, *args, backend="reference", **kw)
    assert_close(y_k, y_r, TOL[torch.bfloat16], "y")
    assert_close(st_k, st_r, (1e-3, 1e-3), "state")
    if launch:
        st_d = s0.clone()
        y_d = ssm_multistep_triton(st_d, *args, **kw, prefetch=False, num_stages=1)  # the plain launch
        assert torch.equal(_bits(y_k), _bits(y_d)) and torch.equal(_bits(st_k), _bits(st_d))
