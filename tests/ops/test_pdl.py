"""Programmatic dependent launch of the decode kernels (``ops/triton_common.py``): the ``SSMSPEC_PDL`` knob, and on a
Hopper GPU the same outputs, bit for bit, with and without it -- each kernel alone and a captured decode."""
from __future__ import annotations

import pytest
import torch

from ssmspec.ops.triton_common import PDL_ENV, pdl_args, pdl_enabled, pdl_mode

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("raw,mode", [(None, "auto"), ("auto", "auto"), ("1", "on"), ("ON", "on"), ("0", "off"),
                                      ("off", "off")])
def test_mode_spellings(raw, mode, monkeypatch):
    if raw is None:
        monkeypatch.delenv(PDL_ENV, raising=False)
    else:
        monkeypatch.setenv(PDL_ENV, raw)
    assert pdl_mode() == mode


def test_bad_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv(PDL_ENV, "yes")
    with pytest.raises(ValueError, match=r"SSMSPEC_PDL='yes': use auto \(PDL on Hopper and newer GPUs\), 1 \(on\) or 0"):
        pdl_args(torch.zeros(1))


@pytest.mark.parametrize("raw", ["auto", "1", "0"])
def test_off_on_the_cpu(raw, monkeypatch):
    """The CPU (and the interpreter, whose tensors are CPU tensors) never launches with PDL, whatever the knob."""
    monkeypatch.setenv(PDL_ENV, raw)
    assert not pdl_enabled(torch.zeros(1)) and pdl_args(torch.zeros(1)) == {"USE_GDC": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_follows_the_compute_capability(monkeypatch):
    monkeypatch.setenv(PDL_ENV, "auto")
    x = torch.zeros(1, device="cuda")
    assert pdl_args(x) == ({"USE_GDC": True, "launch_pdl": True} if HOPPER else {"USE_GDC": False})
    if not HOPPER:
        monkeypatch.setenv(PDL_ENV, "1")
        with pytest.raises(ValueError, match="needs a GPU of compute capability 9.0"):
            pdl_args(x)


MAMBA2_2_7B = dict(d=2560, di=5120, H=80, P=64, N=128, n_in=10576)  # decode sizes of mamba2-2.7b
SMALL = dict(d=48, di=64, H=4, P=16, N=16, n_in=40)


def _ops_outputs(device: str, d: int, di: int, H: int, P: int, N: int, n_in: int, backend: str = "triton") -> dict:
    """Every PDL-aware kernel once at one decode token (bf16 on CUDA, fp32 on the CPU): outputs and states."""
    from ssmspec.ops.causal_conv1d import causal_conv1d_update
    from ssmspec.ops.gemv import add_rms_norm_linear, gated_norm_linear, linear_small
    from ssmspec.ops.norm import add_rms_norm, gated_rms_norm
    from ssmspec.ops.selective_state_update import selective_state_update

    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    r = lambda *s, dtype=dt: torch.randn(*s, generator=g, device=device, dtype=dtype)  # noqa: E731
    tr = dict(backend=backend)
    x, res = r(1, d), r(1, d)
    out = {}
    out["norm"], out["res"] = add_rms_norm(x, res, r(d), eps=1e-5, **tr)
    out["gemv"] = linear_small(x, r(n_in, d), **tr)
    out["norm_gemv"], out["norm_gemv_res"] = add_rms_norm_linear(x, res, r(d), r(n_in, d), eps=1e-5, **tr)
    y, z = r(1, di), r(1, di)
    out["gated"] = gated_rms_norm(y, z, r(di), group_size=di, eps=1e-5, **tr)
    out["gated_gemv"] = gated_norm_linear(y, z, r(di), r(d, di), group_size=di, eps=1e-5, **tr)
    conv_state = r(1, di + 2 * N, 3)
    out["conv"] = causal_conv1d_update(r(1, 1, di + 2 * N), conv_state, r(di + 2 * N, 4), r(di + 2 * N),
                                       activation="silu", **tr)
    out["conv_state"] = conv_state
    state = r(1, H, P, N, dtype=torch.float32)
    A = -torch.rand(H, generator=g, device=device)
    out["ssm"] = selective_state_update(state, r(1, H, P), r(1, H), A, r(1, 1, N), r(1, 1, N),
                                        r(H, dtype=torch.float32), r(1, H, P), r(H, dtype=torch.float32), True, **tr)
    out["ssm_state"] = state
    if device == "cuda":
        torch.cuda.synchronize()
    return out


def test_every_pdl_aware_kernel_runs_its_plain_form(device):
    """Under the interpreter (USE_GDC compiled out) every PDL-aware kernel runs and gives what its reference
    gives: the helper the GPU test below uses, checked where it can run here."""
    got, ref = _ops_outputs(device, **SMALL), _ops_outputs(device, **SMALL, backend="reference")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-4, rtol=1e-4, msg=k)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (or newer) GPU")
def test_each_kernel_gives_the_same_bits_with_pdl(monkeypatch):
    runs = {}
    for raw in ("0", "1"):
        monkeypatch.setenv(PDL_ENV, raw)
        runs[raw] = _ops_outputs("cuda", **MAMBA2_2_7B)
    for k in runs["0"]:
        assert torch.equal(runs["0"][k], runs["1"][k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (or newer) GPU")
@pytest.mark.parametrize("preset", ["mamba2-130m", "tiny-hybrid"])
def test_captured_decode_is_the_same_with_pdl(preset, monkeypatch):
    """Greedy decoding through captured graphs (the kernels back to back, PDL edges in the graph) emits the same
    tokens with and without PDL, for a pure Mamba-2 model and a hybrid with attention."""
    from ssmspec.engine.generate import generate
    from ssmspec.models.config import load_preset
    from ssmspec.models.model import build_model

    model = build_model(load_preset(preset), seed=0, device="cuda", dtype=torch.bfloat16)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    seqs = {}
    for raw in ("0", "1"):
        monkeypatch.setenv(PDL_ENV, raw)
        seqs[raw] = generate(model, prompts, max_new_tokens=48, strategy="autoregressive", cuda_graph=True).sequences
    assert seqs["0"] == seqs["1"]


COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from ssmspec.ops.causal_conv1d.triton import _conv_update_kernel
from ssmspec.ops.gemv.triton import _norm_gemv_kernel
from ssmspec.ops.multistep.triton import _ssm_update_kernel
from ssmspec.ops.norm.triton import _add_rms_norm_kernel, _gated_rms_norm_kernel

IDX = {n: "*i64" for n in ("row_ptr", "count_ptr", "dst_ptr", "src_ptr", "keep_ptr")}
FP32 = {n: "*fp32" for n in ("state_ptr", "A_ptr", "D_ptr", "dt_bias_ptr", "part_ptr")}
CASES = {
    "add_rms_norm": (_add_rms_norm_kernel, dict(HAS_RESIDUAL=True, STORE_RESIDUAL=True, BLOCK=4096), {}),
    "gated_rms_norm": (_gated_rms_norm_kernel, dict(BLOCK=4096), {}),
    "conv_update": (_conv_update_kernel, dict(W=4, HAS_BIAS=True, SILU=True, UPDATE=True, HAS_SLOTS=False,
                                              HAS_KEEP=False, SAVE=False, BLOCK_C=256), IDX),
    "ssm_update": (_ssm_update_kernel, dict(HAS_ROW=False, HAS_COUNT=False, SNAPSHOT=False, STORE_FINAL=True,
                                            OUTPUT=True, HAS_D=True, HAS_Z=True, HAS_DT_BIAS=True, DT_SOFTPLUS=True,
                                            HAS_LIMIT=False, BLOCK_P=8, BLOCK_N=128), {**IDX, **FP32}),
    "gemv": (_norm_gemv_kernel, dict(NORM=0, HAS_RESIDUAL=False, STORE_RESIDUAL=False, HAS_BIAS=False, IEEE=False,
                                     SPLIT=2, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, PREFETCH_LINES=8, LINE=64),
             {**FP32, "cnt_ptr": "*i32"}),
}
# the multistep kernel as it launches by default at small grids: the next token's operands loaded a token ahead
CASES["ssm_update_prefetch"] = (_ssm_update_kernel, dict(CASES["ssm_update"][1], BLOCK_P=16, PREFETCH=True),
                                CASES["ssm_update"][2])


def ptx(fn, constexprs, ptr_types):
    sig, const = {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            const[(i,)] = constexprs[p.name] if p.name in constexprs else p.default
        elif p.name.endswith("_ptr"):
            sig[p.name] = ptr_types.get(p.name, "*bf16")
        else:
            sig[p.name] = "fp32" if p.name in ("eps", "lo", "hi") else "i32"
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]


out = {}
for name, (fn, consts, ptrs) in CASES.items():
    on, off = ptx(fn, {**consts, "USE_GDC": True}, ptrs), ptx(fn, {**consts, "USE_GDC": False}, ptrs)
    out[name] = {k: [v.find(s) for s in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                          "prefetch.global.L2", "ld.global")] for k, v in (("on", on), ("off", off))}
json.dump(out, sys.stdout)
"""


def _hopper_toolchain() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - any missing piece of the toolchain: the test cannot compile here
        return False


@pytest.mark.skipif(not _hopper_toolchain(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_pdl_kernels_compile_for_hopper():
    """Every PDL-aware kernel, with USE_GDC on, compiles ahead of time to a Hopper cubin (Triton's bundled ptxas: no
    GPU needed, and an instruction sm_90 lacks or a malformed inline asm fails here) that waits
    (griddepcontrol.wait) before it lets the next kernel launch; the GEMV prefetches its weight lines into L2
    before that wait, and every kernel's first load from global memory comes after it (the multistep kernel with
    PREFETCH too, its default at small grids). With USE_GDC off none of it is compiled in. A subprocess: the tests
    here run the interpreter."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert set(found) == {"add_rms_norm", "gated_rms_norm", "conv_update", "ssm_update", "ssm_update_prefetch",
                          "gemv"}
    for name, got in found.items():
        wait, launch, prefetch, load = got["on"]
        assert 0 <= wait < launch and wait < load, (name, got)
        if name == "gemv":
            assert 0 <= prefetch < wait, got  # the weights' lines before the wait
        else:
            assert prefetch == -1, (name, got)
        assert got["off"][:3] == [-1, -1, -1] and got["off"][3] >= 0, (name, got)


def test_prefetch_knob(monkeypatch):
    from ssmspec.ops.gemv.triton import PREFETCH_DEFAULT, PREFETCH_ENV, prefetch_lines

    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    assert prefetch_lines() == PREFETCH_DEFAULT
    for raw, n in (("0", 0), ("16", 16)):
        monkeypatch.setenv(PREFETCH_ENV, raw)
        assert prefetch_lines() == n
    for raw in ("3", "128", "-2", "many"):
        monkeypatch.setenv(PREFETCH_ENV, raw)
        with pytest.raises(ValueError, match="give a power of two up to 64"):
            prefetch_lines()
