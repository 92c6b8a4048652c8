"""``ssd_chunk_scan`` as a drop-in for mamba_ssm's ``mamba_chunk_scan_combined``: z gating, D per (head, p), raw dt
with dt_bias / softplus / dt_limit, and several sequences in one launch (``seq_idx`` rows, ``cu_seqlens`` packed).
CPU: the kernel under the Triton interpreter against the fp32 twin on small shapes, and the law of the varlen
scan -- the same outputs and final states as each sequence scanned alone by the fixed-length kernel. GPU
(``gpu`` marker): mamba2-2.7b mixer sizes against the twin and against mamba_ssm on its own grid."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_checks import TOL, assert_close, rel_err
from ssmspec.ops.ssd import ssd_chunk_scan, ssd_chunk_scan_ref

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
STATE_TOL = {torch.float32: (5e-5, 5e-5), torch.bfloat16: (5e-3, 1e-2)}


def inputs(bsz, L, H, P, G, N, dtype, device, *, seed=0, n_states=None):
    """Raw mixer inputs (dt before dt_bias and softplus), z, D (H,) and (H, P), and fp32 initial states."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return dict(x=r(bsz, L, H, P).to(device, dtype), dt_raw=(r(bsz, L, H) - 3.0).to(device),
                A=-(0.5 + 7.5 * torch.rand(H, generator=g)).to(device),
                B=r(bsz, L, G, N, scale=0.3).to(device, dtype), C=r(bsz, L, G, N, scale=0.3).to(device, dtype),
                D=r(H).to(device), D_hp=r(H, P).to(device), z=r(bsz, L, H, P).to(device, dtype),
                dt_bias=r(H, scale=0.5).to(device), s0=r(n_states or bsz, H, P, N, scale=0.3).to(device))


def call(fn, inp, *, z=False, D="h", raw=False, init=False, **kw):
    """One scan by ``fn`` (the kernel or the twin) with the chosen options; ``raw``: dt_bias + softplus + limit,
    else dt discretized here (softplus only)."""
    opts = dict(z=inp["z"] if z else None, initial_state=inp["s0"] if init else None)
    if raw:
        opts.update(dt_bias=inp["dt_bias"], dt_softplus=True, dt_limit=(0.01, 0.2))
        dt = inp["dt_raw"]
    else:
        dt = F.softplus(inp["dt_raw"])
    Dv = {"h": inp["D"], "hp": inp["D_hp"], None: None}[D]
    return fn(inp["x"], dt, inp["A"], inp["B"], inp["C"], Dv, **opts, **kw)


def kernel(*args, **kw):
    from ssmspec.ops.ssd.triton import ssd_chunk_scan_triton
    return ssd_chunk_scan_triton(*args, **kw)


def twin(*args, **kw):
    return ssd_chunk_scan_ref(*args, chunk_size=5, **kw)


def check(out, ref, dtype, what=""):
    assert out[0].dtype == dtype and out[1].dtype == torch.float32
    assert_close(out[0], ref[0], TOL[dtype], f"y {what}")
    assert_close(out[1], ref[1], STATE_TOL[dtype], f"final states {what}")


OPTIONS = [  # the options of one fixed-length row, alone and together
    pytest.param(dict(z=True), id="z"),
    pytest.param(dict(D="hp"), id="D-HP"),
    pytest.param(dict(D=None, raw=True), id="raw-dt-no-D"),
    pytest.param(dict(z=True, D="hp", raw=True, init=True), id="all"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", OPTIONS)
def test_fixed_length_options_match_twin(device, opts, dtype):
    inp = inputs(2, 21, 2, 24, 2, 16, dtype, device, seed=1)
    check(call(kernel, inp, block_t=16, **opts), call(twin, inp, **opts), dtype)


def test_dt_limit_clamps_after_softplus(device):
    """A limit that binds on every token gives the scan of the clamped dt (here: constant dt = hi)."""
    inp = inputs(1, 17, 2, 16, 1, 16, torch.float32, device, seed=2)
    y, s = kernel(inp["x"], inp["dt_raw"], inp["A"], inp["B"], inp["C"], dt_bias=inp["dt_bias"], dt_softplus=True,
                  dt_limit=(0.5, 0.5), block_t=16)
    y_ref, s_ref = twin(inp["x"], torch.full_like(inp["dt_raw"], 0.5), inp["A"], inp["B"], inp["C"])
    check((y, s), (y_ref, s_ref), torch.float32)


# seq_idx rows at block_t 16: (lengths of row 0, lengths of row 1, initial state, segment_len, dtype). Starts at
# a tile's (and a segment's) first token (16, 32), one-token sequences, three starts inside one tile, a row of one
# sequence; each with and without the row's initial state, in one segment and cut into segments of one tile
TILE_STARTS, ONE_TOKEN_ENDS = ([16, 1, 1, 3, 16], [37]), ([5, 27, 5], [1, 35, 1])
ROWS = [
    pytest.param(*TILE_STARTS, True, 16, torch.float32, id="tile-starts-init-seg16-fp32"),
    pytest.param(*TILE_STARTS, False, None, torch.float32, id="tile-starts-zero-fp32"),
    pytest.param(*TILE_STARTS, True, None, torch.bfloat16, id="tile-starts-init-bf16"),
    pytest.param(*ONE_TOKEN_ENDS, False, 16, torch.float32, id="one-token-ends-zero-seg16-fp32"),
    pytest.param(*ONE_TOKEN_ENDS, True, None, torch.float32, id="one-token-ends-init-fp32"),
    pytest.param(*ONE_TOKEN_ENDS, False, 16, torch.bfloat16, id="one-token-ends-zero-seg16-bf16"),
]


def seq_idx_of(rows, device):
    """(B, L) int32 ids (mamba_ssm's dtype; the packed tests cover int64) from each row's sequence lengths."""
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
    return ids.to(device, torch.int32)


@pytest.mark.parametrize("row0, row1, init, segment_len, dtype", ROWS)
def test_seq_idx_rows_match_twin_and_each_sequence_alone(device, row0, row1, init, segment_len, dtype):
    """Rows of several sequences: the row's initial state feeds its first sequence, later ones start from zero,
    the final state is the row's; a sequence starting at a tile (or segment) boundary included."""
    inp = inputs(2, 37, 2, 16, 2, 16, dtype, device, seed=3)
    seq_idx = seq_idx_of([row0, row1], device) + 7  # ids need not start at 0
    opts = dict(z=True, D="hp", raw=True, init=init, seq_idx=seq_idx)
    out = call(kernel, inp, block_t=16, segment_len=segment_len, **opts)
    check(out, call(twin, inp, **opts), dtype)
    if dtype == torch.bfloat16:
        return
    for b, lengths in enumerate([row0, row1]):  # the law, per sequence with the fixed-length kernel
        s = 0
        for k, n in enumerate(lengths):
            one = {key: (v[b:b + 1, s:s + n] if key in ("x", "dt_raw", "B", "C", "z") else v) for key, v in inp.items()}
            one["s0"] = inp["s0"][b:b + 1] if k == 0 and init else torch.zeros_like(inp["s0"][b:b + 1])
            y1, s1 = call(kernel, one, z=True, D="hp", raw=True, init=True, block_t=16)
            assert_close(out[0][b:b + 1, s:s + n], y1, TOL[dtype], f"y of row {b} sequence {k}")
            s += n
        assert_close(out[1][b:b + 1], s1, STATE_TOL[dtype], f"final state of row {b}")


PACKED = [  # (lengths of the packed sequences, initial states, segment_len, dtype) at block_t 16
    pytest.param([5, 1, 20, 11], True, None, torch.float32, id="5-1-20-11-init-fp32"),
    pytest.param([5, 1, 20, 11], False, 16, torch.float32, id="5-1-20-11-zero-seg16-fp32"),
    pytest.param([5, 1, 20, 11], True, 16, torch.bfloat16, id="5-1-20-11-init-seg16-bf16"),
    pytest.param([16, 16, 3], True, 16, torch.float32, id="tile-aligned-init-seg16-fp32"),
    pytest.param([16, 16, 3], False, None, torch.bfloat16, id="tile-aligned-zero-bf16"),
    pytest.param([37], True, 16, torch.float32, id="one-sequence-init-seg16-fp32"),
]


@pytest.mark.parametrize("lengths, init, segment_len, dtype", PACKED)
def test_packed_sequences_equal_each_sequence_alone(device, lengths, init, segment_len, dtype):
    """The law of cu_seqlens: y and every sequence's final state as if each ran alone from its own initial
    state, with every option on; and the twin agrees."""
    L = sum(lengths)
    inp = inputs(1, L, 2, 24, 1, 16, dtype, device, seed=4, n_states=len(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    opts = dict(z=True, D="hp", raw=True, init=init, cu_seqlens=cu)
    y, s = call(kernel, inp, block_t=16, block_p=16, segment_len=segment_len, **opts)  # P = 24: two P blocks
    assert s.shape == (len(lengths), 2, 24, 16)
    check((y, s), call(twin, inp, **opts), dtype)
    for k, (a, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        one = {key: (v[:, a:e] if key in ("x", "dt_raw", "B", "C", "z") else v) for key, v in inp.items()}
        one["s0"] = inp["s0"][k:k + 1]
        y1, s1 = call(kernel, one, z=True, D="hp", raw=True, init=init, block_t=16)
        assert_close(y[:, a:e], y1, TOL[dtype], f"y of sequence {k}")
        assert_close(s[k:k + 1], s1, STATE_TOL[dtype], f"final state of sequence {k}")


def test_public_op_takes_every_option(device):
    """``ssd_chunk_scan`` passes the options to the backend it picks; both backends agree."""
    inp = inputs(1, 12, 2, 16, 1, 16, torch.float32, device, seed=5, n_states=3)
    cu = torch.tensor([0, 4, 5, 12], device=device)
    opts = dict(z=True, D="hp", raw=True, init=True, cu_seqlens=cu, seq_idx=torch.tensor([[0] * 4 + [1] + [2] * 7],
                                                                                          device=device))
    ref = call(ssd_chunk_scan, inp, backend="reference", **opts)
    assert ref[1].shape == (3, 2, 16, 16)
    check(call(ssd_chunk_scan, inp, backend="triton", **opts), ref, torch.float32)


@pytest.mark.parametrize("change, match", [
    pytest.param(dict(D=torch.randn(3, 8)), "D must be", id="D-shape"),
    pytest.param(dict(z=torch.randn(1, 12, 2, 4)), "z must be", id="z-shape"),
    pytest.param(dict(dt_bias=torch.randn(3)), "dt_bias must be", id="dt-bias-shape"),
    pytest.param(dict(dt_limit=(0.3, 0.1)), "dt_limit must be", id="dt-limit-order"),
    pytest.param(dict(seq_idx=torch.zeros(1, 11, dtype=torch.int32)), "seq_idx must be", id="seq-idx-shape"),
    pytest.param(dict(seq_idx=torch.zeros(1, 12)), "seq_idx must be an integer", id="seq-idx-float"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 5, 5, 12])), "increase strictly", id="cu-empty-sequence"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 7, 5, 12])), "increase strictly", id="cu-decreasing"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 5, 11])), "end at L = 12", id="cu-not-ending-at-L"),
    pytest.param(dict(cu_seqlens=torch.tensor([1, 5, 12])), "start at 0", id="cu-not-starting-at-0"),
    pytest.param(dict(cu_seqlens=torch.tensor([0.0, 12.0])), "1-D integer", id="cu-float"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 5, 12]), initial_state=torch.zeros(1, 2, 8, 16)),
                 r"\(num_seqs, H, P, N\)", id="cu-init-per-row"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 5, 12]), seq_idx=torch.zeros(1, 12, dtype=torch.int32)),
                 "seq_idx disagrees with cu_seqlens", id="cu-and-seq-idx-disagree"),
])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_input_is_refused(change, match, backend):
    inp = inputs(1, 12, 2, 8, 1, 16, torch.float32, "cpu")
    args = dict(x=inp["x"], dt=inp["dt_raw"], A=inp["A"], B=inp["B"], C=inp["C"], D=None)
    args.update(change)
    pos = [args.pop(k) for k in ("x", "dt", "A", "B", "C", "D")]
    with pytest.raises(ValueError, match=match):
        ssd_chunk_scan(*pos, backend=backend, **args)


def test_cu_seqlens_needs_one_row():
    inp = inputs(2, 12, 2, 8, 1, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="packs the sequences into one row"):
        ssd_chunk_scan(inp["x"], inp["dt_raw"], inp["A"], inp["B"], inp["C"], cu_seqlens=torch.tensor([0, 5, 12]),
                       seq_idx=torch.zeros(2, 12, dtype=torch.int32))


# GPU: mamba2-2.7b mixer sizes -----------------------------------------------------------------------------
LENGTHS = [1000, 37, 2048, 513]


def gpu_inputs(dtype, seed=6):
    L = sum(LENGTHS)
    inp = inputs(1, L, 80, 64, 1, 128, dtype, "cuda", seed=seed, n_states=len(LENGTHS))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS), device="cuda", dtype=torch.int32),
                                      torch.tensor(LENGTHS, device="cuda"))[None]
    return inp, cu, seq_idx


@pytest.mark.gpu
@pytest.mark.parametrize("init", [pytest.param(False, id="zero"), pytest.param(True, id="init")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_packed_mamba2_matches_twin_and_each_sequence(dtype, init):
    inp, cu, _ = gpu_inputs(dtype)
    opts = dict(z=True, D="hp", raw=True, init=init, cu_seqlens=cu)
    y, s = call(kernel, inp, **opts)
    y_ref, s_ref = call(ssd_chunk_scan_ref, inp, chunk_size=256, **opts)
    limit = 1e-4 if dtype == torch.float32 else 1e-2  # norm-relative over millions of outputs
    assert rel_err(y, y_ref) < limit and rel_err(s, s_ref) < limit
    for k, (a, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        one = {key: (v[:, a:e] if key in ("x", "dt_raw", "B", "C", "z") else v) for key, v in inp.items()}
        one["s0"] = inp["s0"][k:k + 1]
        y1, s1 = call(kernel, one, z=True, D="hp", raw=True, init=init)
        assert rel_err(y[:, a:e], y1) < limit and rel_err(s[k:k + 1], s1) < limit, f"sequence {k}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_packed_mamba2_matches_mamba_ssm(dtype):
    """mamba_ssm's ``mamba_chunk_scan_combined`` on its own grid (chunk 256, seq_idx + cu_seqlens,
    return_varlen_states), with z, D (H, P), dt_bias + softplus + dt_limit: the same y and per-sequence states."""
    combined = pytest.importorskip("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
    inp, cu, seq_idx = gpu_inputs(dtype, seed=7)
    y, s = call(kernel, inp, z=True, D="hp", raw=True, cu_seqlens=cu)
    y_m, _, s_m = combined(inp["x"], inp["dt_raw"], inp["A"], inp["B"], inp["C"], 256, D=inp["D_hp"], z=inp["z"],
                           dt_bias=inp["dt_bias"], seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True,
                           dt_limit=(0.01, 0.2), return_final_states=True, return_varlen_states=True)
    assert rel_err(y, y_m) < 1e-2 and rel_err(s, s_m) < 1e-2


@pytest.mark.gpu
def test_gpu_seq_idx_rows_mamba2_match_twin():
    """Two rows of mamba2-2.7b sizes, each several sequences (seq_idx alone), bf16, from the rows' initial states."""
    rows = [LENGTHS, [2048, 1000, 513, 37]]
    inp = inputs(2, sum(LENGTHS), 80, 64, 1, 128, torch.bfloat16, "cuda", seed=8)
    opts = dict(z=True, D="hp", raw=True, init=True, seq_idx=seq_idx_of(rows, "cuda"))
    y, s = call(kernel, inp, **opts)
    y_ref, s_ref = call(ssd_chunk_scan_ref, inp, chunk_size=256, **opts)
    assert rel_err(y, y_ref) < 1e-2 and rel_err(s, s_ref) < 1e-2
