"""Every ``@triton.jit`` kernel of src/ssmspec compiles ahead of time for sm_90 (Triton's bundled toolchain, no
GPU) at every specialization the recorded CPU tests launch. The interpreter runs code Triton's compiler refuses (a
loop-carried name that changes type, as a conv tile's loop in the one-launch replay verify did on an H200), so
such a kernel otherwise fails first on a GPU. The tests of tests/ops, less the slow ones ``TRIM`` skips or trims, and
``EXTRA`` run once under the interpreter with their launches recorded (aot_specs.py): about 440 distinct
specializations of the about 630 the CPU suite launches, in under 3 minutes on 2 cores. Each is compiled in a
subprocess without the interpreter. ``SSMSPEC_AOT_FULL=1`` records every CPU test that runs a kernel instead
(about 6 minutes)."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from aot_specs import RECORD_ENV, TRIM_ENV, Recorder
from test_pdl import _hopper_toolchain

from ssmspec.ops.dispatch import interpret_mode

ROOT = Path(__file__).resolve().parents[2]
FULL_ENV = "SSMSPEC_AOT_FULL"

# slow tests of tests/ops: None skips one, a regex keeps the parametrizations whose id it matches. Chosen from
# one recorded run of the whole suite: the skipped ones run whole models (their kernels' flags are the op
# tests') or launch nothing; the trimmed ones keep a few shapes of every dtype and form
TRIM = {
    "tests/ops/test_gemv.py::test_a_draft_takes_its_own_decode_kernels": None,
    "tests/ops/test_gemv.py::test_model_fused_decode_equals_unfused": None,
    "tests/ops/test_launch_count.py::test_a_step_of_the_tiny_pair_launches_six_kernels_a_mamba2_layer_and_the_draft"
    "_its_own": None,
    "tests/ops/test_launch_count.py::test_cli_prints_a_line_a_step_and_refuses_an_unknown_family": None,
    "tests/ops/test_decode_attention.py::test_model_decodes_on_the_fused_kernels": None,
    "tests/ops/test_ssd.py::test_model_prefill_runs_the_kernel": None,
    "tests/ops/test_tree_scan.py::test_tree_scan_sweep_isolates_a_launch_that_crashes": None,
    "tests/ops/test_gdn_chunk.py::test_chunk_scan_equals_recurrence": None,
    "tests/ops/test_gdn_forms.py::test_reference_forms_equal_resolved": None,
    "tests/ops/test_ssd_grad.py::test_naive_gradcheck": None,
    "tests/ops/test_pdl.py::test_pdl_kernels_compile_for_hopper": None,
    "tests/ops/test_multistep.py::test_multistep_kernel_matches_naive": None,
    "tests/ops/test_multistep.py::test_snapshot_kernel": None,
    "tests/ops/test_multistep.py::test_selective_state_update_kernel": None,
    "tests/ops/test_gdn_kernels.py::test_replay_verify_kernel": "verify-S1-R8|decode-L1",
    "tests/ops/test_gdn_kernels.py::test_decode_kernel_forms": "R4-full-ring-flush",
    "tests/ops/test_replay_kernels.py::test_replay_verify_kernel": "verify-S4|tree-L6",
    "tests/ops/test_decode_attention.py::test_kernel_vs_twin": "decode-L1|chain-L3",
    "tests/ops/test_tree_scan.py::test_tree_scan_kernel_matches_naive": "H2-P8",
    "tests/ops/test_tree_scan.py::test_tree_scan_launch_options_match_naive": "static-3x4",
    "tests/ops/test_tree_scan.py::test_tree_conv_kernel_matches_naive": "bushy|causal|chains",
    "tests/ops/test_ssd.py::test_segmented_chains_match_recurrence": "L65|L37",
    "tests/ops/test_ssd.py::test_kernel_matches_recurrence": "L1-|L19|L70",
    "tests/ops/test_ssd_grad.py::test_grads_match_the_twin": "L1-|L45-heads|L70|L50",
}
# outside tests/ops: a model's training backward and a GDN model's tree decode (model-sized launches)
EXTRA = ["tests/train/test_forward.py::test_training_scan_runs_the_triton_backward[tiny-hybrid]",
         "tests/strategies/test_kernels_wired.py::test_strategy_on_triton_kernels_is_lossless_on_gdn[stree]"]
# with SSMSPEC_AOT_FULL: every module outside tests/ops that runs kernels under the interpreter
FULL_EXTRA = ["tests/strategies/test_kernels_wired.py", "tests/strategies/test_conv_ssm_decode.py",
              "tests/train/test_forward.py", "tests/pipeline/test_ssd_experiments.py",
              "tests/pipeline/test_decode_kernels_experiment.py"]
# @triton.jit functions that no recorded test launches or calls, each with why (keep it short)
NOT_LAUNCHED: dict[str, str] = {}


@triton.jit
def _loop_type_change_kernel(x_ptr, y_ptr, n, REUSE_NAME: tl.constexpr, BLOCK: tl.constexpr):
    """The check's positive control: with REUSE_NAME, a static_range loop inside a runtime loop takes the name of a
    tensor (``part``), the pattern an H200 refused in the replay verify's conv tile. The interpreter runs it; Triton's
    compiler refuses it. Without REUSE_NAME the loop variable has its own name and it compiles."""
    offs = tl.arange(0, BLOCK)
    part = tl.load(x_ptr + offs)
    for i in range(n):
        if REUSE_NAME:
            for part in tl.static_range(2):
                tl.store(y_ptr + part * BLOCK + offs, tl.load(x_ptr + offs) + i)
        else:
            for bc in tl.static_range(2):
                tl.store(y_ptr + bc * BLOCK + offs, tl.load(x_ptr + offs) + i)
    tl.store(y_ptr + 2 * BLOCK + offs, part)


def _control_specs() -> list[dict]:
    """The control kernel's two specializations, typed by the recorder from a launch on CPU tensors (under the
    interpreter the launch runs too: it accepts both)."""
    rec = Recorder()
    x, y = torch.arange(16, dtype=torch.float32), torch.zeros(48)
    for reuse in (True, False):
        kw = dict(REUSE_NAME=reuse, BLOCK=16, num_warps=1)
        rec.add(_loop_type_change_kernel.fn, (x, y, 3), kw)
        if interpret_mode():
            _loop_type_change_kernel[(1,)](x, y, 3, **kw)
            assert torch.equal(y[32:], torch.ones(16) if reuse else x), "the interpreter ran the control"
    return list(rec.specs.values())


def _env(**extra: str) -> dict:
    drop = ("TRITON_INTERPRET", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_XDIST")}
    paths = [str(ROOT / "tests" / "ops"), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def _record(tmp: Path, full: bool) -> list[dict]:
    """Runs the chosen tests under the interpreter (on the CPU, two workers) and returns what they launched."""
    (tmp / "trim.json").write_text(json.dumps({} if full else TRIM))
    out = tmp / "specs.json"
    args = ["tests/ops", "--ignore", "tests/ops/test_aot_compile.py", *(FULL_EXTRA if full else EXTRA)]
    if importlib.util.find_spec("xdist") is not None:
        args += ["-n", "2"]
    env = _env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",  # the CPU, also where a GPU is
               **{RECORD_ENV: str(out), TRIM_ENV: str(tmp / "trim.json")})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "aot_specs", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    specs = []
    for path in sorted(glob.glob(f"{out}*")):  # one file a worker
        specs += json.loads(Path(path).read_text())
    return specs


def _distinct(specs: list[dict]) -> list[dict]:
    """One specialization per (kernel, argument types, constexprs, options): launches that differ only in the
    16-divisibility hints of their pointers and ints compile the same code paths; the one with the most hints is
    kept (a GPU's large aligned buffers)."""
    best: dict[str, dict] = {}
    for s in specs:
        key = json.dumps([s["kernel"], [p if p[1] == "constexpr" else p[:2] for p in s["params"]], s["options"]],
                         sort_keys=True)
        hints = sum(p[2] == "D" for p in s["params"])
        if key not in best or hints > sum(p[2] == "D" for p in best[key]["params"]):
            best[key] = s
    return list(best.values())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    if not _hopper_toolchain():
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    tmp = tmp_path_factory.mktemp("aot")
    specs = _distinct(_record(tmp, full=os.environ.get(FULL_ENV) == "1")) + _control_specs()
    (tmp / "distinct.json").write_text(json.dumps(specs))
    env = _env(TRITON_CACHE_DIR=str(tmp / "cache"))  # a cold cache: every specialization is compiled here
    proc = subprocess.run([sys.executable, "-m", "aot_specs", "compile", str(tmp / "distinct.json"),
                           str(tmp / "compiled.json"), "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp / "compiled.json").read_text())
    return specs, got["results"], got["jit"]


def _control(spec: dict) -> bool:
    return spec["kernel"].endswith(":_loop_type_change_kernel")


def _describe(spec: dict, result: dict) -> str:
    ones = spec["as_constexpr"]
    consts = {p[0]: p[2] for p in spec["params"] if p[1] == "constexpr" and p[0] not in ones}
    return (f"{spec['kernel']} constexprs={consts} options={spec['options']}, arguments the launcher makes "
            f"constexprs (1 or None): {ones or 'none'}; launched by {spec['test']}\n    {result['error'][-1500:]}")


def test_every_launched_specialization_compiles_for_hopper(compiled):
    """Each distinct specialization the recorded tests launched compiles for sm_90, as Triton's launcher would
    compile it on an H100 or H200 (the same argument typing, constexprs and launch options)."""
    specs, results, _ = compiled
    bad = [_describe(s, r) for s, r in zip(specs, results) if not _control(s) and not r["ok"]]
    assert not bad, f"{len(bad)} of {len(specs) - 2} specializations fail to compile for sm_90:\n" + "\n".join(bad)


def test_every_jit_function_is_compiled(compiled):
    """Every @triton.jit function in src/ssmspec is a kernel some recorded test launches, a function such a kernel
    calls, or named in NOT_LAUNCHED: a new kernel no test launches would escape the check."""
    specs, _, jit = compiled
    reached = {s["kernel"] for s in specs if not _control(s)}
    todo = list(reached)
    while todo:
        for callee in jit.get(todo.pop(), []):
            if callee not in reached:
                reached.add(callee)
                todo.append(callee)
    assert not reached - set(jit), f"launched but not found in src/ssmspec: {sorted(reached - set(jit))}"
    assert set(NOT_LAUNCHED) <= set(jit), f"NOT_LAUNCHED names what is gone: {sorted(set(NOT_LAUNCHED) - set(jit))}"
    missing = sorted(set(jit) - reached - set(NOT_LAUNCHED))
    assert not missing, f"no recorded test launches or calls {missing}: add a test, or name it in NOT_LAUNCHED"
    stale = sorted(set(NOT_LAUNCHED) & reached)
    assert not stale, f"NOT_LAUNCHED names what the recorded tests now compile: {stale}"


def test_the_check_refuses_a_loop_carried_type_change(compiled):
    """The positive control: the harness reports the pattern the H200 refused (the interpreter ran it), and compiles
    the same kernel with the loop variable renamed, so a failure above is the kernel's, not the harness's."""
    specs, results, _ = compiled
    by_flag = {next(p[2] for p in s["params"] if p[0] == "REUSE_NAME"): r for s, r in zip(specs, results)
               if _control(s)}
    assert by_flag[False]["ok"], by_flag[False]
    assert not by_flag[True]["ok"] and "Loop carried variable part changed type" in by_flag[True]["error"], \
        by_flag[True]
