"""The SSD scan's backward (ops/ssd_grad): gradients of the Triton forward + tile-parallel backward against autograd
through the fp32 reference (the naive twin), for x, dt, A, B, C, D and the initial state. CPU: Triton interpreter
on small shapes; GPU (``gpu`` marker): the paper's sizes in bf16, against the twin and against mamba_ssm's
``mamba_chunk_scan_combined`` backward."""
from __future__ import annotations

import pytest
import torch

from kernel_checks import TOL, assert_close, rel_err, ssd_scan_inputs
from ssmspec.ops.ssd_grad import ssd_chunk_scan_grad_ref, ssd_chunk_scan_trainable

NAMES = ("x", "dt", "A", "B", "C", "D", "s0")
# gradient tolerance, relative to the largest reference gradient of each input: fp32 is the kernel's tf32x3 /
# interpreter fp32 maths against the reference's fp32 maths; bf16 / fp16 round every dot operand (weights, the
# states, dy) to the input dtype, as the forward does, and the reference does not
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def scan_inputs(bsz, L, H, P, G, N, dtype, device, seed=0):
    """``kernel_checks.ssd_scan_inputs`` and, from the same generator, the upstream gradients dy (B, L, H, P) and
    d final state (B, H, P, N)."""
    g = torch.Generator().manual_seed(seed)
    inp = ssd_scan_inputs(bsz, L, H, P, G, N, dtype, device, g)
    up = dict(dy=torch.randn(bsz, L, H, P, generator=g).to(device, dtype),
              dfinal=torch.randn(bsz, H, P, N, generator=g).to(device))
    return inp, up


def grads(fn, inp, up, *, D=True, init=True, y_loss=True, state_loss=True, **kw):
    """y, final state and the gradient of <y, dy> + <final, dfinal> for every input that is used."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inp.items()
              if not (k == "D" and not D) and not (k == "s0" and not init)}
    y, s = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], leaves.get("D"),
              initial_state=leaves.get("s0"), **kw)
    loss = 0.0
    if y_loss:
        loss = loss + (y.float() * up["dy"].float()).sum()
    if state_loss:
        loss = loss + (s * up["dfinal"]).sum()
    loss.backward()
    return y, s, {k: v.grad for k, v in leaves.items()}


def triton_grads(inp, up, **kw):
    from ssmspec.ops.ssd_grad.triton import ssd_chunk_scan_grad_triton
    return grads(ssd_chunk_scan_grad_triton, inp, up, **kw)


def twin_grads(inp, up, *, D=True, init=True, y_loss=True, state_loss=True):
    return grads(ssd_chunk_scan_grad_ref, inp, up, D=D, init=init, y_loss=y_loss, state_loss=state_loss,
                 chunk_size=7)


def assert_grads_close(got: dict, ref: dict, dtype) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        if ref[k] is None:  # an input the used outputs do not depend on (D for a final-state loss)
            assert got[k] is None or not got[k].any(), k
            continue
        assert got[k] is not None and got[k].dtype == ref[k].dtype, k
        scale = ref[k].abs().max().item()
        assert_close(got[k], ref[k], (GRAD_TOL[dtype] * scale, GRAD_TOL[dtype]), f"d{k}")


# (batch, L, H, P, G, N, launch): L not a multiple of any tile; checkpoints spanning several backward tiles (the
# carry replayed forward from a state, backward from a dS); forward and backward tiles that differ; G = 3 (2 heads
# a group share dB, dC); P = 80 (two P blocks of the dS pass, one padded block of the chunk kernel); one checkpoint
# a tile; one token; a group's heads split over programs (dB, dC as summed slots, or added with atomics); dS
# checkpoints apart from the states', in tiles of the dS pass other than the chunk kernel's, the last dS chunk cut
# short by L inside a tile of the pass (its dS is stored at the sequence's end)
SHAPES = [
    pytest.param(2, 37, 6, 32, 3, 16, dict(fwd_block_t=16, block_t=16, checkpoint=32, heads_per_program=1, bc_atomic=1),
                 id="L37-G3-heads-split-atomic"),
    pytest.param(1, 45, 4, 16, 1, 16, dict(fwd_block_t=16, block_t=32, checkpoint=32, dcheckpoint=64, pass_block_t=16,
                                           heads_per_program=2), id="L45-heads-split-summed-dck2tiles-partial"),
    pytest.param(2, 40, 2, 16, 1, 16, dict(fwd_block_t=32, block_t=16, checkpoint=64, dcheckpoint=16, pass_block_t=16),
                 id="L40-ck4tiles-dck1tile"),
    pytest.param(2, 37, 6, 32, 3, 16, dict(fwd_block_t=16, block_t=16, checkpoint=32), id="L37-G3-ck2tiles"),
    pytest.param(1, 50, 2, 16, 1, 8, dict(fwd_block_t=16, block_t=16, checkpoint=16), id="L50-G1-N8-ck1tile"),
    pytest.param(2, 45, 4, 80, 2, 16, dict(fwd_block_t=32, block_t=16, checkpoint=32, block_p=64),
                 id="L45-P80-2pblocks-fwd32-bwd16"),
    pytest.param(1, 70, 2, 16, 2, 32, dict(fwd_block_t=16, block_t=16, checkpoint=64), id="L70-H=G-ck4tiles"),
    pytest.param(2, 1, 3, 16, 1, 16, {}, id="L1-defaults"),
]


@pytest.mark.parametrize("bsz, L, H, P, G, N, launch", SHAPES)
def test_grads_match_the_twin(device, bsz, L, H, P, G, N, launch):
    inp, up = scan_inputs(bsz, L, H, P, G, N, torch.float32, device)
    y, s, got = triton_grads(inp, up, **launch)
    y_ref, s_ref, ref = twin_grads(inp, up)
    assert_close(y, y_ref, TOL[torch.float32], "y")
    assert_close(s, s_ref, (2e-5, 2e-5), "final state")
    assert_grads_close(got, ref, torch.float32)


@pytest.mark.parametrize("D", [pytest.param(False, id="D-None"), pytest.param(True, id="D-set")])
@pytest.mark.parametrize("init", [pytest.param(False, id="zero-state"), pytest.param(True, id="initial-state")])
def test_optional_arguments(device, init, D):
    inp, up = scan_inputs(2, 21, 4, 16, 2, 16, torch.float32, device, seed=1)
    launch = dict(fwd_block_t=16, block_t=16, checkpoint=32)
    _, _, got = triton_grads(inp, up, D=D, init=init, **launch)
    _, _, ref = twin_grads(inp, up, D=D, init=init)
    assert ("D" in got) is D and ("s0" in got) is init
    assert_grads_close(got, ref, torch.float32)


@pytest.mark.parametrize("y_loss, state_loss", [pytest.param(True, False, id="y-only"),
                                                pytest.param(False, True, id="final-state-only")])
def test_one_output_used(device, y_loss, state_loss):
    """An unused output sends no gradient (None): a zero dy or d final state is read in its place."""
    inp, up = scan_inputs(1, 33, 2, 16, 1, 16, torch.float32, device, seed=2)
    _, _, got = triton_grads(inp, up, y_loss=y_loss, state_loss=state_loss, fwd_block_t=16, block_t=16, checkpoint=16)
    _, _, ref = twin_grads(inp, up, y_loss=y_loss, state_loss=state_loss)
    assert_grads_close(got, ref, torch.float32)


@pytest.mark.parametrize("dtype, state_bf16", [pytest.param(torch.bfloat16, None, id="bf16-bf16-states"),
                                               pytest.param(torch.bfloat16, 0, id="bf16-fp32-states"),
                                               pytest.param(torch.float16, None, id="fp16")])
def test_half_inputs_accumulate_in_fp32(device, dtype, state_bf16):
    """bf16 / fp16 inputs: fp32 accumulation; bf16 inputs save the states and dS checkpoints in bf16 by default
    (the rounding every state operand gets before its products anyway), fp32 on request."""
    inp, up = scan_inputs(2, 37, 4, 32, 2, 16, dtype, device, seed=3)
    y, s, got = triton_grads(inp, up, fwd_block_t=16, block_t=16, checkpoint=32, state_bf16=state_bf16)
    _, _, ref = twin_grads(inp, up)
    assert y.dtype == dtype and s.dtype == torch.float32
    assert got["x"].dtype == got["B"].dtype == dtype and got["dt"].dtype == got["s0"].dtype == torch.float32
    assert_grads_close(got, ref, dtype)


def test_strided_views_with_poisoned_gaps(device):
    """x, B, C as views into one packed row (as the mixer splits xBC) with NaN in the unused columns, dt strided
    over NaN tokens: the forward and the backward read only their own elements, every gradient is finite."""
    bsz, L, H, P, G, N = 2, 23, 4, 16, 2, 16
    inp, up = scan_inputs(bsz, L, H, P, G, N, torch.float32, device, seed=4)
    packed = torch.full((bsz, L, H * P + 2 * G * N + 8), float("nan"), device=device)
    packed[..., :H * P] = inp["x"].reshape(bsz, L, -1)
    packed[..., H * P:H * P + G * N] = inp["B"].reshape(bsz, L, -1)
    packed[..., H * P + G * N:H * P + 2 * G * N] = inp["C"].reshape(bsz, L, -1)
    dt2 = torch.full((bsz, 2 * L, H), float("nan"), device=device)
    dt2[:, ::2] = inp["dt"]
    leaf = packed.clone().requires_grad_()
    dt_leaf = dt2.clone().requires_grad_()
    from ssmspec.ops.ssd_grad.triton import ssd_chunk_scan_grad_triton
    y, s = ssd_chunk_scan_grad_triton(leaf[..., :H * P].view(bsz, L, H, P), dt_leaf[:, ::2], inp["A"],
                                      leaf[..., H * P:H * P + G * N].view(bsz, L, G, N),
                                      leaf[..., H * P + G * N:H * P + 2 * G * N].view(bsz, L, G, N), inp["D"],
                                      initial_state=inp["s0"], fwd_block_t=16, block_t=16, checkpoint=16)
    ((y * up["dy"]).sum() + (s * up["dfinal"]).sum()).backward()
    _, _, ref = twin_grads(inp, up)
    g = leaf.grad
    assert_grads_close({"x": g[..., :H * P].reshape(bsz, L, H, P), "B": g[..., H * P:H * P + G * N].reshape(bsz, L, G, N),
                        "C": g[..., H * P + G * N:H * P + 2 * G * N].reshape(bsz, L, G, N), "dt": dt_leaf.grad[:, ::2]},
                       {k: ref[k] for k in ("x", "B", "C", "dt")}, torch.float32)
    assert (g[..., H * P + 2 * G * N:] == 0).all() and (dt_leaf.grad[:, 1::2] == 0).all()


def test_empty_sequence(device):
    """No tokens: the final state is the initial state, so its gradient passes straight through."""
    inp, up = scan_inputs(2, 0, 2, 16, 1, 16, torch.float32, device)
    _, s, got = triton_grads(inp, up)
    torch.testing.assert_close(s, inp["s0"])
    torch.testing.assert_close(got["s0"], up["dfinal"])
    assert got["x"].shape == (2, 0, 2, 16) and (got["A"] == 0).all() and (got["D"] == 0).all()


def test_naive_gradcheck():
    """The twin's autograd against central differences on a tiny shape. Inputs are float64, but the reference
    computes in fp32 (it casts its inputs), so the step is 1e-3 (fp32 rounding / step ~ 1e-4, truncation
    ~ step^2) and the tolerance 1e-3: a missing or wrong term is off by O(1)."""
    inp, _ = scan_inputs(1, 5, 2, 3, 1, 2, torch.float64, "cpu", seed=5)
    args = tuple(inp[k].double().requires_grad_() for k in NAMES)

    def fn(x, dt, A, B, C, D, s0):
        return ssd_chunk_scan_grad_ref(x, dt, A, B, C, D, initial_state=s0, chunk_size=2)

    assert torch.autograd.gradcheck(fn, args, eps=1e-3, atol=1e-3, rtol=1e-3)


def test_public_dispatch(device, monkeypatch):
    """``auto`` runs the kernels on CUDA and the reference with autograd on CPU; ``triton`` the kernels."""
    inp, up = scan_inputs(1, 19, 2, 16, 1, 16, torch.float32, device, seed=6)
    y, _, got = grads(ssd_chunk_scan_trainable, inp, up, chunk_size=4)
    _, _, ref = twin_grads(inp, up)
    assert_grads_close(got, ref, torch.float32)
    calls = []
    import ssmspec.ops.ssd_grad.triton as kernel_mod
    orig = kernel_mod.ssd_chunk_scan_grad_triton
    monkeypatch.setattr(kernel_mod, "ssd_chunk_scan_grad_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    _, _, got_k = grads(ssd_chunk_scan_trainable, inp, up, backend="triton")
    grads(ssd_chunk_scan_trainable, inp, up)
    assert len(calls) == (2 if device == "cuda" else 1)
    assert_grads_close(got_k, ref, torch.float32)


@pytest.mark.parametrize("change, match", [
    pytest.param(dict(dt=torch.rand(2, 9, 3)), "dt must be", id="dt-shape"),
    pytest.param(dict(B=torch.randn(2, 9, 3, 16)), "divisible by G", id="groups-not-dividing"),
    pytest.param(dict(initial_state=torch.zeros(2, 2, 16, 8)), "initial_state must be", id="state-shape"),
    pytest.param(dict(chunk_size=0), "chunk_size must be", id="chunk-size"),
])
def test_bad_input_is_refused(change, match):
    inp, _ = scan_inputs(2, 9, 2, 16, 1, 16, torch.float32, "cpu")
    args = {k: inp[k] for k in ("x", "dt", "A", "B", "C", "D")} | change
    x, dt, A, B, C, D = (args.pop(k) for k in ("x", "dt", "A", "B", "C", "D"))
    with pytest.raises(ValueError, match=match):
        ssd_chunk_scan_trainable(x, dt, A, B, C, D, **args)


@pytest.mark.parametrize("launch, match", [
    pytest.param(dict(block_t=24), "block_t must be a power of two", id="tile"),
    pytest.param(dict(fwd_block_t=32, block_t=16, checkpoint=48), "checkpoint must be a positive multiple",
                 id="checkpoint"),
    pytest.param(dict(block_q=16), "unknown launch options", id="unknown"),
    pytest.param(dict(block_t=16, checkpoint=32, dcheckpoint=24), "dcheckpoint must be a positive multiple",
                 id="dcheckpoint"),
    pytest.param(dict(heads_per_program=3), "heads_per_program must divide", id="heads-per-program"),
])
def test_bad_launch_options_are_refused(device, launch, match):
    inp, up = scan_inputs(1, 9, 2, 16, 1, 16, torch.float32, device)
    with pytest.raises(ValueError, match=match):
        triton_grads(inp, up, **launch)


def test_default_launch():
    """Checkpoints no bigger in bytes than x (bf16 states for bf16 inputs), a whole number of the tiles; the dS
    pass's P halved where chains leave SMs idle; a group's heads split over programs only where tiles x groups x
    batch leave SMs idle; options derived from those given."""
    from ssmspec.ops.ssd_grad.triton import default_launch
    seed004 = default_launch(32768, 64, 64, itemsize=2, chains=16 * 8, sms=132, heads=8, groups=1)
    assert (seed004["block_p"], seed004["checkpoint"], seed004["dcheckpoint"], seed004["fwd_block_t"],
            seed004["block_t"], seed004["heads_per_program"], seed004["pass_block_t"]) == (16, 128, 128, 64, 64, 8, 128)
    seed004_16 = default_launch(32768, 64, 64, itemsize=2, chains=16 * 8, sms=132, heads=8, groups=1, bf16=True)
    assert (seed004_16["checkpoint"], seed004_16["fwd_block_p"], seed004_16["bc_block_t"],
            seed004_16["bc_num_warps"], seed004_16["pass_block_t"]) == (64, 32, 64, 4, 64)
    assert default_launch(2048, 64, 64, itemsize=2, chains=16 * 8, sms=132, heads=8, groups=1)["heads_per_program"] == 2
    nemo = default_launch(32768, 64, 128, itemsize=2, chains=16 * 112, sms=132, heads=112, groups=8)
    assert (nemo["block_p"], nemo["checkpoint"], nemo["num_warps"], nemo["heads_per_program"]) == (32, 256, 4, 14)
    nemo16 = default_launch(32768, 64, 128, itemsize=2, chains=16 * 112, sms=132, heads=112, groups=8, bf16=True)
    assert (nemo16["state_bf16"], nemo16["checkpoint"], nemo16["bc_block_t"], nemo16["pass_block_t"],
            nemo16["pass_num_warps"]) == (1, 128, 128, 128, 8)
    assert nemo["state_bf16"] == 0  # fp16 or fp32 inputs: fp32 states
    short = default_launch(20, 16, 8, itemsize=4)
    assert (short["fwd_block_t"], short["block_t"], short["checkpoint"], short["pass_block_t"]) == (32, 32, 32, 32)
    given = default_launch(4096, 64, 64, itemsize=2, block_t=32, checkpoint=64)
    assert (given["dcheckpoint"], given["pass_block_t"], given["heads_per_program"]) == (64, 64, 1)


def test_launch_sweep_smoke(device, tmp_path):
    """``python -m ssmspec.bench.ssd_grad_sweep --tiny``: every variant runs and agrees with the defaults' gradients,
    and the best configuration is one the kernels take."""
    import json

    from ssmspec.bench.ssd_grad_sweep import main
    from ssmspec.ops.ssd_grad.triton import LAUNCH_KEYS
    rows = main(["--tiny", "--json", str(tmp_path / "rows.json")])
    assert rows == json.loads((tmp_path / "rows.json").read_text())
    timed = [r for r in rows if r["stage"] != "best"]
    assert len(timed) >= 4 and {"default", "dx tile x warps", "heads a program"} <= {r["stage"] for r in timed}
    assert all(r["ms"] > 0 and r["rel_err"] < 2e-2 and "failed" not in r for r in timed)
    best = next(r for r in rows if r["stage"] == "best")
    inp, up = scan_inputs(1, 40, 2, 16, 1, 16, torch.bfloat16, device)
    _, _, got = triton_grads(inp, up, **{k: best[k] for k in LAUNCH_KEYS})
    assert_grads_close(got, twin_grads(inp, up)[2], torch.bfloat16)


class _Ev:  # the fields of a profiler event that kernel_table reads
    def __init__(self, name, us, cuda=True, parent=None):
        self.name, self.cpu_parent = name, parent
        self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        self.device_time_total = us if cuda else 0.0
        self.cpu_time_total = 0.0 if cuda else us


def test_profile_table_counts_launches_and_time_per_call():
    """``bench/ssd_grad_profile.kernel_table``: launches and microseconds per call, shares of the whole, longest
    first; host events are not kernels on a GPU, nested host operators are not counted twice on CPU."""
    from ssmspec.bench.ssd_grad_profile import kernel_table
    ev = [_Ev("_fwd_save_kernel", 30.0), _Ev("_bwd_dx_kernel", 50.0), _Ev("_fwd_save_kernel", 30.0),
          _Ev("_bwd_dx_kernel", 50.0), _Ev("Memset (Device)", 4.0), _Ev("aten::empty", 99.0, cuda=False)]
    us, table = kernel_table(ev, 2, cuda=True)
    assert us == pytest.approx(82.0)
    assert [r["kernel"] for r in table] == ["_bwd_dx_kernel", "_fwd_save_kernel", "Memset (Device)"]
    assert [r["per_call"] for r in table] == [1.0, 1.0, 0.5]
    assert table[0]["us_per_call"] == pytest.approx(50.0) and sum(r["share"] for r in table) == pytest.approx(1.0)
    host = [_Ev("SSDScanFunction", 10.0, cuda=False), _Ev("aten::mm", 7.0, cuda=False, parent=object())]
    us, table = kernel_table(host, 1, cuda=False)
    assert us == pytest.approx(10.0) and [r["kernel"] for r in table] == ["SSDScanFunction"]
    with pytest.raises(ValueError, match="calls >= 1"):
        kernel_table(ev, 0, cuda=True)


def test_profile_smoke(tmp_path):
    """``python -m ssmspec.bench.ssd_grad_profile --tiny``: our forward and backward are in the table, mamba_ssm's
    row says why it is skipped, the JSON holds the rows printed; a malformed shape is one error."""
    import json

    from ssmspec.bench.ssd_grad_profile import main
    rows = main(["--tiny", "--json", str(tmp_path / "prof.json")])
    assert rows == json.loads((tmp_path / "prof.json").read_text())
    ours = next(r for r in rows if r["impl"] == "ours")
    names = [k["kernel"] for k in ours["kernels"]]
    assert any("SSDScanFunctionBackward" in n for n in names) and "SSDScanFunction" in names
    assert ours["us_per_call"] > 0 and sum(k["share"] for k in ours["kernels"]) <= 1.0 + 1e-9
    assert next(r for r in rows if r["impl"] == "mamba_ssm")["status"] == "skipped"
    with pytest.raises(SystemExit, match="mixer:batch:seqlen"):
        main(["--tiny", "--shapes", "seed004:16"])
    with pytest.raises(SystemExit, match=r"--iters must be >= 1 and --warmup >= 0 \(got 1, -1\)"):
        main(["--tiny", "--warmup", "-1"])
    with pytest.raises(SystemExit, match=r"\(got 0, 1\)"):  # 0 profiled calls is refused, not taken as the default
        main(["--tiny", "--iters", "0"])


# GPU: the paper's sizes -------------------------------------------------------------------------------------
GPU_SHAPES = [  # (batch, L, H, P, G, N)
    pytest.param(2, 4099, 32, 64, 4, 128, id="H32-G4-N128-L4099"),
    pytest.param(4, 8192, 8, 64, 1, 64, id="seed004-B4-L8192"),
    pytest.param(1, 2048, 16, 64, 1, 128, id="H16-N128-L2048"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("bsz, L, H, P, G, N", GPU_SHAPES)
def test_gpu_real_sizes_match_the_twin(bsz, L, H, P, G, N):
    inp, up = scan_inputs(bsz, L, H, P, G, N, torch.bfloat16, "cuda", seed=7)
    y, s, got = triton_grads(inp, up)
    y_ref, s_ref, ref = grads(ssd_chunk_scan_grad_ref, inp, up, chunk_size=256)
    assert rel_err(y, y_ref) < 1e-2 and rel_err(s, s_ref) < 1e-2
    bad = {k: rel_err(got[k], ref[k]) for k in ref if not rel_err(got[k], ref[k]) < 2e-2}  # norm-relative, bf16 operands
    assert not bad, bad


@pytest.mark.gpu
def test_gpu_matches_mamba_ssm_backward():
    """The same gradients as mamba_ssm's ``mamba_chunk_scan_combined`` (dt already discretized, no softplus),
    for y and final-state losses, with D and an initial state."""
    pytest.importorskip("mamba_ssm")
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    def mamba(x, dt, A, B, C, D, *, initial_state):
        return mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=256, D=D, initial_states=initial_state,
                                         dt_softplus=False, return_final_states=True)

    inp, up = scan_inputs(2, 4096, 32, 64, 4, 128, torch.bfloat16, "cuda", seed=8)
    _, _, got = triton_grads(inp, up)
    _, _, ref = grads(mamba, inp, up)
    bad = {k: rel_err(got[k], ref[k]) for k in ref if not rel_err(got[k], ref[k]) < 2e-2}
    assert not bad, bad


@pytest.mark.gpu
def test_gpu_profile_sees_our_four_kernels():
    """On a GPU the profile's table holds the forward's kernel and the backward's three, and their time."""
    from ssmspec.bench.ssd_grad_profile import main
    rows = main(["--shapes", "seed004:2:4096", "--iters", "2", "--warmup", "1"])
    ours = next(r for r in rows if r["impl"] == "ours")
    names = " ".join(k["kernel"] for k in ours["kernels"])
    for k in ("_fwd_save_kernel", "_bwd_dx_kernel", "_bwd_dbc_kernel", "_bwd_dstate_kernel"):
        assert k in names
    assert sum(k["share"] for k in ours["kernels"]) <= 1.0 + 1e-9 and ours["us_per_call"] > 0
