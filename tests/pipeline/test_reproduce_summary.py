"""The summary `reproduce` ends with, and its exit status, from synthetic results directories.

Rows are written the way the benches write them (status ok / skipped / oom / n/a, a reason where there is
one, ``"mamba_ssm not importable: ..."`` from bench.kernels.mamba_ssm_ops). No experiment really runs: the
reproduce tests replace the experiments' runs with a function that writes those rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ssmspec import summary
from ssmspec.registry import Experiment

NO_MAMBA = "mamba_ssm not importable: ModuleNotFoundError: No module named 'mamba_ssm'"
PRESETS = {"nemotron-h-4b": dict(H=112, P=64), "mamba2-2.7b": dict(H=80, P=64)}


def kernel_rows(profile: str, *, baseline: bool) -> list[dict]:
    """kernel_parity-like rows: per preset x batch, ours measured and mamba_ssm measured or skipped."""
    rows = []
    for model, sizes in PRESETS.items():
        for batch in (1, 16):
            base = dict(experiment="kernel_parity", run_id="r1", profile=profile, device="cuda:0", model=model,
                        batch=batch, **sizes, N=128, rot=4 if batch == 1 else 1)
            rows.append(dict(base, impl="ours", status="ok", ms_p50=0.01, samples_ms=[0.01, 0.011]))
            rows.append(dict(base, impl="mamba_ssm", status="ok", ms_p50=0.012, samples_ms=[0.012]) if baseline
                        else dict(base, impl="mamba_ssm", status="skipped", reason=NO_MAMBA))
    return rows


def throughput_rows(profile: str) -> list[dict]:
    rows = [dict(experiment="throughput_ar", profile=profile, model="mamba2-2.7b", params=2_700_000_000, phase=phase,
                 batch=batch, context=1024, tokens=batch * (1024 if phase == "prefill" else 1), status="ok")
            for phase in ("prefill", "decode") for batch in (1, 64)]
    rows[1].update(status="skipped")  # prefill B=64 over bench.max_prefill_tokens: no reason field
    rows[3].update(status="oom")
    return rows


def write_run(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


# summary of rows ----------------------------------------------------------------------------------------
def test_skipped_rows_are_grouped_by_reason_and_named_by_the_fields_that_vary():
    s = summary.summarize_rows("kernel_parity", kernel_rows("gpu", baseline=False))
    assert (s.rows, s.statuses) == (8, (("ok", 4), ("skipped", 4)))
    (g,) = s.groups
    # H and P follow from the model and rot from (model, batch): left out; N and run_id are constant
    assert g.where == "model=nemotron-h-4b,mamba2-2.7b; batch=1,16; impl=mamba_ssm"
    assert (g.status, g.rows, g.reason, g.baseline, g.profile) == ("skipped", 4, NO_MAMBA, "mamba_ssm", "gpu")


def test_rows_without_a_reason_and_other_statuses_are_listed_too():
    s = summary.summarize_rows("throughput_ar", throughput_rows("gpu"))
    assert s.statuses == (("ok", 2), ("oom", 1), ("skipped", 1))
    by_status = {g.status: g for g in s.groups}
    assert by_status["skipped"].reason == "(no reason recorded)" and by_status["skipped"].baseline is None
    assert by_status["skipped"].where == "phase=prefill; batch=64"
    assert by_status["oom"].where == "phase=decode; batch=64"


def test_render_lists_every_experiment_its_rows_and_every_skip():
    text = summary.render([summary.summarize_rows("kernel_parity", kernel_rows("gpu", baseline=False)),
                           summary.summarize_rows("throughput_ar", throughput_rows("gpu")),
                           summary.ExperimentSummary("lossless", "failed"),
                           summary.ExperimentSummary("snl_tab1_kernels", "no results")])
    lines = text.splitlines()
    assert lines[0] == "=== summary"
    row = {line.split()[0]: line.split() for line in lines[2:] if not line.startswith(" ")}
    assert row["kernel_parity"][1:4] == ["ok", "8", "ok"] and row["throughput_ar"][2] == "4"
    assert row["lossless"][1:3] == ["FAILED", "-"] and "older results" in " ".join(row["lossless"])
    assert row["snl_tab1_kernels"][1:3] == ["no", "rows"]
    assert f"skipped 4: model=nemotron-h-4b,mamba2-2.7b; batch=1,16; impl=mamba_ssm -- {NO_MAMBA}" in text
    assert "skipped 1: phase=prefill; batch=64 -- (no reason recorded)" in text
    assert "oom 1: phase=decode; batch=64" in text


def test_wall_clock_flags_and_off_design_acceptance_are_counted_and_rendered():
    rows = [dict(experiment="e2e", batch=b, status="ok", wall_flag=b == 4, accepted_within=b != 8)
            for b in (1, 4, 8)] + [dict(experiment="e2e", batch=16, status="ok")]
    s = summary.summarize_rows("e2e", rows)
    assert (s.timed, s.wall_flagged, s.designed, s.off_design) == (3, 1, 3, 1)
    text = summary.render([s])
    assert "wall clock: 1 of 3 timed loops" in text and "0 longer" in text and "acceptance: 1 of 3 oracle rows" in text
    quiet = summary.render([summary.summarize_rows("e2e", [dict(status="ok", wall_flag=False)])])
    assert "wall clock" not in quiet and "acceptance" not in quiet


def test_long_value_lists_are_cut():
    rows = [dict(batch=b, status="skipped", reason="r") for b in range(12)] + [dict(batch=99, status="ok")]
    (g,) = summary.summarize_rows("x", rows).groups
    assert g.where == "batch=0,1,2,3,4,5,6,7,+4 more"


# the missing-baseline rule ----------------------------------------------------------------------------
@pytest.mark.parametrize("profile, baseline, allow, fails", [
    pytest.param("gpu", False, False, True, id="gpu-missing"),
    pytest.param("gpu", False, True, False, id="gpu-missing-allowed"),
    pytest.param("gpu", True, False, False, id="gpu-present"),
    pytest.param("cpu", False, False, False, id="cpu-missing-by-design"),
])
def test_a_gpu_row_skipped_for_a_missing_baseline_fails_unless_allowed(profile, baseline, allow, fails):
    s = [summary.summarize_rows("kernel_parity", kernel_rows(profile, baseline=baseline)),
         summary.summarize_rows("throughput_ar", throughput_rows(profile))]
    err = summary.baseline_error(s, allow_missing=allow)
    assert (err is not None) == fails
    if fails:
        assert "mamba_ssm: kernel_parity (4 rows)" in err
        assert "python -m ssmspec.baselines install" in err and "--allow-missing-baselines" in err


@pytest.mark.parametrize("profile, argv, status", [
    pytest.param("gpu", [], 1, id="gpu-profile"),
    pytest.param("gpu", ["--allow-missing-baselines"], 0, id="gpu-profile-allowed"),
    pytest.param("cpu", [], 0, id="cpu-profile"),
])
def test_summary_command_exit_status(tmp_path, capsys, profile, argv, status):
    k = write_run(tmp_path / "k", kernel_rows(profile, baseline=False))
    t = write_run(tmp_path / "t", throughput_rows(profile))
    assert summary.main([str(k), str(t), *argv]) == status
    out, err = capsys.readouterr()
    assert "kernel_parity" in out and "throughput_ar" in out
    assert ("error: rows were skipped on the GPU for missing baselines" in err) == (status == 1)


def test_summary_command_names_a_directory_without_results(tmp_path, capsys):
    assert summary.main([str(tmp_path)]) == 2
    assert "no results.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allowed"])
def test_preflight_stops_a_gpu_run_before_anything_runs(monkeypatch, allow):
    from ssmspec import baselines

    monkeypatch.setattr(baselines, "check", lambda: {"mamba_ssm": NO_MAMBA, "fla": None})
    err = summary.preflight("gpu", allow_missing=allow)
    assert (err is None) == allow
    if not allow:
        assert NO_MAMBA in err and "nothing was run" in err and "--allow-missing-baselines" in err
    assert summary.preflight("cpu") is None  # the CPU profile never needs them


# reproduce end to end (experiments replaced) ---------------------------------------------------------
@pytest.fixture
def fake_reproduce(monkeypatch, tmp_path):
    """A GPU machine with two experiments, whose runs write the given rows (or fail) where the reproduction
    puts them (runs/reproduce/<time>/results, or tmp results with --save-reference)."""
    from ssmspec import baselines, cli, config, paths, registry, reproduce

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(paths, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(config, "cuda_available", lambda: True)
    monkeypatch.setattr(reproduce, "cmd_figures", lambda *a, **k: 0)
    exps = [Experiment(id=i, title=i, bench="m:f", plot="m:g", profiles=("cpu", "gpu"))
            for i in ("kernel_parity", "throughput_ar")]
    monkeypatch.setattr(registry, "experiments", lambda: exps)
    outcome: dict[str, list[dict] | None] = {}

    def run(exps, plan, slots):  # the experiments' runs: write each one's rows, None = it failed
        for e in exps:
            if outcome[e.id] is not None:
                write_run(plan.run_dir(e.id), outcome[e.id])
        return [e.id for e in exps if outcome[e.id] is None]

    monkeypatch.setattr(reproduce, "run_experiments", run)

    def reproduce(kernel, throughput, *argv, importable=True):
        outcome.update(kernel_parity=kernel, throughput_ar=throughput)
        monkeypatch.setattr(baselines, "check", lambda: {"mamba_ssm": None if importable else NO_MAMBA, "fla": None})
        return cli.main(["reproduce", "--profile", "gpu", *argv])

    return reproduce


def test_reproduce_ends_with_the_summary_and_succeeds_with_every_baseline(fake_reproduce, capsys, tmp_path):
    assert fake_reproduce(kernel_rows("gpu", baseline=True), throughput_rows("gpu")) == 0
    out = capsys.readouterr().out
    summary_text = out[out.index("=== summary (profile gpu)"):]
    assert "kernel_parity" in summary_text and "throughput_ar" in summary_text
    assert "skipped 1: phase=prefill; batch=64 -- (no reason recorded)" in summary_text
    assert summary_text.rstrip().splitlines()[-1].startswith("baselines: mamba_ssm ")
    # by default into a fresh runs/reproduce/<time>/, the committed results/ untouched; the summary says where
    (run,) = (tmp_path / "runs" / "reproduce").iterdir()
    assert (run / "results" / "kernel_parity" / "gpu" / "results.jsonl").is_file()
    assert not (tmp_path / "results").exists()
    where = f"results: runs/reproduce/{run.name}/results/<id>/gpu/, figures: runs/reproduce/{run.name}/figures/"
    assert where in summary_text and "results/ are unchanged" in summary_text


def test_reproduce_save_reference_writes_the_committed_results(fake_reproduce, capsys, tmp_path):
    assert fake_reproduce(kernel_rows("gpu", baseline=True), throughput_rows("gpu"), "--save-reference") == 0
    out = capsys.readouterr().out
    assert (tmp_path / "results" / "throughput_ar" / "gpu" / "results.jsonl").is_file()
    assert "results: results/<id>/gpu/, figures: results/figures/" in out and "unchanged" not in out
    assert not (tmp_path / "runs").exists()  # one slot, no logs: nothing under runs/


def test_reproduce_exits_non_zero_when_gpu_rows_lack_a_baseline(fake_reproduce, capsys):
    # the baseline imported at the start, yet rows were skipped for it (a broken submodule, say)
    assert fake_reproduce(kernel_rows("gpu", baseline=False), throughput_rows("gpu")) == 2
    out, err = capsys.readouterr()
    assert f"impl=mamba_ssm -- {NO_MAMBA}" in out
    assert "error: rows were skipped on the GPU for missing baselines (mamba_ssm: kernel_parity (4 rows))" in err
    assert fake_reproduce(kernel_rows("gpu", baseline=False), throughput_rows("gpu"),
                          "--allow-missing-baselines") == 0


def test_reproduce_refuses_to_start_without_a_baseline(fake_reproduce, capsys, tmp_path):
    assert fake_reproduce(kernel_rows("gpu", baseline=True), throughput_rows("gpu"), importable=False) == 2
    out, err = capsys.readouterr()
    assert "nothing was run" in err and "=== summary" not in out
    assert not (tmp_path / "results").exists() and not (tmp_path / "runs").exists()
    status = fake_reproduce(kernel_rows("gpu", baseline=False), throughput_rows("gpu"), "--allow-missing-baselines",
                            importable=False)
    assert status == 0 and "=== summary" in capsys.readouterr().out


def test_reproduce_summary_marks_a_failed_experiment(fake_reproduce, capsys):
    assert fake_reproduce(None, throughput_rows("gpu")) == 2
    out, err = capsys.readouterr()
    line = next(x for x in out.splitlines() if x.startswith("kernel_parity"))
    assert "FAILED" in line and "1 experiment(s) failed: kernel_parity (nothing of them was written)" in err


def test_reproduce_that_wrote_nothing_leaves_no_empty_folder(fake_reproduce, capsys, tmp_path):
    (tmp_path / "runs" / "reproduce").mkdir(parents=True)  # an older reproduction's folder was here
    assert fake_reproduce(None, None) == 2
    assert "2 experiment(s) failed" in capsys.readouterr().err
    assert list((tmp_path / "runs" / "reproduce").iterdir()) == []  # its runs/reproduce/<time>/ went again
