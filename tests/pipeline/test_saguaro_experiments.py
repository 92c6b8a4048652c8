"""``saguaro_fig4_fanout`` and ``saguaro_fig5_residual`` on CPU through the CLI, on the tiny pair the suite trains
(conf/train/tiny.yaml, once per session into a temporary cache): rows say measured and name the pair, the optimum
is the best topology on the prompts it was fitted on, figures are drawn, bad input is one error line."""
from __future__ import annotations

import pytest
from pipeline_helpers import run_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIG4 = ["experiment=saguaro_fig4_fanout", "profile=cpu", "bench.num_prompts=4", "bench.new_tokens=24",
        "bench.temperature=[0.0,1.0]", "bench.budget=[5,10]"]
FIG5 = ["experiment=saguaro_fig5_residual", "profile=cpu", "bench.num_prompts=4", "bench.new_tokens=24",
        "bench.lam=[1.0,0.3]"]


def test_fanout_rows_are_measured_and_the_optimum_wins_where_fitted(cli, tmp_path, train_cache):
    rows = run_rows(cli, tmp_path, FIG4, f"bench.cache_dir={train_cache}")
    assert len(rows) == 2 * 2 * 3
    assert all(r["acceptance"] == "measured" and r["pair"] == "trained" and r["train_key"] for r in rows)
    for T in (0.0, 1.0):
        for N in (5, 10):
            got = {r["topology"]: r for r in rows if r["temperature"] == T and r["budget"] == N}
            assert set(got) == {"uniform", "geometric", "optimal"}
            assert all(sum(r["fanout"]) <= N and len(r["fanout"]) == 5 for r in got.values())
            best = got["optimal"]["hit_rate_fit"]
            assert all(best >= r["hit_rate_fit"] - 1e-9 for r in got.values())
            assert all(0.0 <= r["hit_rate"] <= 1.0 and r["rounds_held"] > 0 for r in got.values())


def test_residual_rows_trade_acceptance_for_hits(cli, tmp_path, train_cache):
    rows = run_rows(cli, tmp_path, FIG5, f"bench.cache_dir={train_cache}")
    assert [r["lam"] for r in rows] == [1.0, 0.3]
    assert all(r["acceptance"] == "measured" and r["pair"] == "trained" and r["temperature"] == 1.0 for r in rows)
    assert all(r["rounds"] > 0 and 0.0 <= r["hit_rate"] <= 1.0 for r in rows)


@pytest.mark.parametrize("argv,extra,message", [
    (FIG4, "bench.budget=[0]", "cannot hold one cache branch"),
    (FIG4, "bench.topologies=[fancy]", "bench.topologies takes"),
    (FIG5, "bench.lam=[1.5]", r"lambda must lie in (0, 1]"),
    (FIG5, "bench.temperature=[0.0]", "every bench.temperature must be > 0"),
], ids=["budget", "topology", "lambda", "greedy-lambda"])
def test_bad_input_is_one_error_line(cli, tmp_path, argv, extra, message):
    status, _, err = cli("run", *argv, extra, f"results_dir={tmp_path / 'run'}")
    assert status == 2 and message in err, err
    assert not (tmp_path / "run").exists()
