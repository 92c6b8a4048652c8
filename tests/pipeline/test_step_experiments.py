"""The step-time experiments of bench/steps_replay.py and bench/steps_fit.py run end to end on CPU through the
engine's own step (tiny presets, eager) and draw their figures; the breakdown's parts add up, points that cannot
fit are skipped rows, the fits and the needed acceptance follow seed 003's Eqs. 7-8, and the kernel timing
cycles state copies past 4x the L2."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from ssmspec.bench import steps_replay
from ssmspec.bench.kernels import Ctx
from ssmspec.bench.steps_fit import binary_tree, fit
from ssmspec.bench.steps_replay import classify, kernel_names

from pipeline_helpers import FAST, run_and_plot


def test_breakdown_parts_add_up_and_unfit_contexts_are_skipped(cli, tmp_path):
    rows = run_and_plot(cli, tmp_path, "replay_fig2_breakdown", "bench.context=[16,1000000000]",
                         "bench.profile_steps=1")
    ok = [r for r in rows if r["status"] == "ok"]
    assert {(r["strategy"], r["context"]) for r in ok} == {("autoregressive", 16), ("replay", 16)}
    for r in ok:
        assert r["breakdown"] == "op-timers" and r["timing"] == "eager" and len(r["samples_ms"]) == 2
        assert r["ssm_share"] > 0 and r["attention_share"] > 0  # tiny-hybrid: Mamba-2 mixers and attention
        assert r["ssm_ms"] + r["attention_ms"] + r["rest_ms"] == pytest.approx(r["ms_p50"])
        assert r["ssm_share"] + r["attention_share"] + r["rest_share"] == pytest.approx(1.0)
        assert r["mean_accepted"] == 0.0 and r["draft_len"] == 0  # standard decode
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert {r["strategy"] for r in skipped} == {"autoregressive", "replay"}
    assert all(r["context"] == 1000000000 and "needs" in r["reason"] and "free" in r["reason"] for r in skipped)


def test_breakdown_refuses_speculative_strategies(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=replay_fig2_breakdown", *FAST, "bench.strategies=[snapshot]",
                         f"results_dir={out}")
    assert status == 2 and "bench.strategies may hold autoregressive and replay" in err
    assert not out.exists()


def test_fig6_step_rows_beside_the_kernel_rows(cli, tmp_path):
    rows = run_and_plot(cli, tmp_path, "replay_fig6_speedup", "bench.presets=[tiny-mamba2]", "bench.batch=[2]",
                         "bench.R=[4]")
    assert {r["impl"] for r in rows} >= {"ssu_ours", "replay", "step_autoregressive", "step_replay"}
    steps = {r["impl"]: r for r in rows if r.get("stage") == "step"}
    assert steps["step_replay"]["strategy"] == "replay" and steps["step_replay"]["buffer_size"] == 16
    assert steps["step_autoregressive"]["strategy"] == "autoregressive"
    for r in steps.values():
        assert r["model"] == "tiny-hybrid" and r["batch"] == 2 and r["draft_len"] == 0 and len(r["samples_ms"]) == 2


def test_propagation_has_every_stage_of_both_strategies(cli, tmp_path):
    rows = run_and_plot(cli, tmp_path, "replay_fig10_propagation")
    by = {r["impl"]: r for r in rows}
    assert set(by) == {f"{st}_{s}" for st in ("kernel", "forward", "step") for s in ("snapshot", "replay")}
    for r in rows:
        assert r["status"] == "ok" and r["S"] == 4 and r["L"] == 5 and r["ms_p50"] > 0
    for s in ("snapshot", "replay"):  # forward and step of one engine: separate samples, same settings
        fwd, step = by[f"forward_{s}"], by[f"step_{s}"]
        assert fwd["strategy"] == step["strategy"] == s and fwd["draft_len"] == 4
        assert fwd["samples_ms"] != step["samples_ms"]
    assert by["kernel_replay"]["R"] == 16 and by["kernel_replay"]["accepted"] == 0


def test_propagation_refuses_a_buffer_smaller_than_a_call(cli, tmp_path):
    status, _, err = cli("run", "experiment=replay_fig10_propagation", *FAST, "bench.R=4",
                         f"results_dir={tmp_path / 'run'}")
    assert status == 2 and "R >= S + 1" in err


def test_runtime_fit_rows_follow_seed_003(cli, tmp_path):
    rows = run_and_plot(cli, tmp_path, "stree_fig2_runtime_fit", "bench.tokens=[1,2,3,5]")
    calls = [r for r in rows if r["kind"] == "measure" and r["stage"] == "call"]
    assert {(r["strategy"], r["tokens"]) for r in calls} == {(s, n) for s in ("activation_replay", "stree")
                                                               for n in (1, 2, 3, 5)}
    for r in calls:
        assert r["tokens_per_call"] == r["tokens"]  # N tokens per sequence go through each call
    fits = {(r["strategy"], r["degree"]): r for r in rows if r["kind"] == "fit"}
    for s in ("activation_replay", "stree"):  # least squares on the call medians, recomputed here
        pts = sorted((r["tokens"], r["ms_p50"]) for r in calls if r["strategy"] == s)
        k, c = np.polyfit(*zip(*pts), 1)
        assert fits[(s, 1)]["k"] == pytest.approx(k) and fits[(s, 1)]["C"] == pytest.approx(c)
        assert fits[(s, 2)]["a"] == pytest.approx(np.polyfit(*zip(*pts), 2)[0])
    tree, chain = fits[("stree", 1)], fits[("activation_replay", 1)]
    tq, cq = fits[("stree", 2)], fits[("activation_replay", 2)]
    needed = [r for r in rows if r["kind"] == "needed"]
    assert [r["tokens"] for r in needed] == [1, 2, 3, 5] and all(r["n1"] == 5 for r in needed)
    for r in needed:  # Eqs. 7 and 8 with N1 = 5
        n = r["tokens"]
        assert r["needed_linear"] == pytest.approx((tree["k"] * n + tree["C"]) / (chain["k"] * 5 + chain["C"]))
        assert r["needed_quadratic"] == pytest.approx((tq["a"] * n * n + tq["b"] * n + tq["c"])
                                                      / (cq["a"] * 25 + cq["b"] * 5 + cq["c"]))


def test_runtime_fit_needs_three_sizes(cli, tmp_path):
    status, _, err = cli("run", "experiment=stree_fig2_runtime_fit", *FAST, "bench.tokens=[1,4]",
                         f"results_dir={tmp_path / 'run'}")
    assert status == 2 and "at least 3 sizes" in err


def test_fit_recovers_a_polynomial_and_the_tree_is_binary():
    n = [1, 2, 4, 8, 16]
    coef, r2 = fit(n, [0.5 * x * x + 2 * x + 3 for x in n], 2)
    assert coef == pytest.approx([0.5, 2.0, 3.0]) and r2 == pytest.approx(1.0)
    assert binary_tree(6) == [0, 0, 1, 1, 2, 2]


def test_kernels_are_classified_from_the_op_modules():
    names = kernel_names()
    assert names["_ssm_update_kernel"] == names["_main_kernel"] == names["_tree_scan_kernel"] == "ssm"
    assert names["_split_kernel"] == names["_combine_kernel"] == "attention"
    assert not any("conv" in k for k in names)  # the conv is part of the rest
    assert classify("_window_kernel", names) == "ssm"
    assert classify("pytorch_flash::flash_fwd_splitkv_kernel<...>", names) == "attention"
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32", names) == "rest"
    assert classify("_add_rms_norm_kernel", names) == "rest"


def test_op_timers_are_removed_afterwards():
    import ssmspec.models.kv_cache as kv
    import ssmspec.strategies.replay as rep

    before = (rep.replay_verify, kv.decode_attention)
    parts = {"ssm": 0.0, "attention": 0.0}
    with steps_replay._op_timers(parts):
        assert rep.replay_verify is not before[0] and kv.decode_attention is not before[1]
    assert (rep.replay_verify, kv.decode_attention) == before


@pytest.mark.parametrize("state_mb", [2.0, 2.6, 3.7])  # Qwen3.5 GDN, mamba2-2.7b, nemotron-h-4b at batch 1
def test_rotation_exceeds_four_l2_at_batch_1(state_mb):
    ctx = Ctx.__new__(Ctx)  # the timing context without a device: only the rotation rule
    ctx.cuda, ctx.l2 = True, 50 * 2**20  # H100: 50 MiB L2
    sb = int(state_mb * 1e6)
    assert ctx.rotation(sb) * sb >= 4 * ctx.l2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_breakdown_reads_the_kernels_of_graph_replays_and_forward_is_captured():
    """On CUDA the profiler sees the kernels of the captured step (not an eager fallback), finds the SSM state
    and decode-attention kernels, and the kernels add up to about the step time; the verify forward alone is
    captured and faster than the whole step."""
    from ssmspec.bench.steps import step_engine, step_row
    from ssmspec.bench.steps_replay import breakdown_fields, forward_samples
    from ssmspec.models import build_model, load_preset
    from ssmspec.strategies import SpecConfig

    model = build_model(load_preset("tiny-hybrid"), seed=0, device="cuda", dtype=torch.bfloat16)
    for strategy in ("autoregressive", "replay"):
        eng = step_engine(model, strategy=strategy, batch=4, context=64, graph=True, steps=12)
        row = step_row(eng, warmup=2, iters=5)
        got = breakdown_fields(eng, 2, row["ms_p50"])
        assert got["profiled"] == "cuda_graph" and got["kernels_per_step"] > 10
        assert got["ssm_ms"] > 0 and got["attention_ms"] > 0
        assert got["kernel_ms"] <= 1.5 * row["ms_p50"]
    eng = step_engine(model, strategy="replay", batch=4, context=64, spec=SpecConfig(draft_len=4, buffer_size=16),
                      graph=True, steps=12)
    step = step_row(eng, warmup=2, iters=5)
    fwd = forward_samples(eng, warmup=1, iters=5)
    assert 0 < sorted(fwd)[2] < step["ms_p50"]
