"""The backoff bench's decisions from measured quantities (bench/saguaro_backoff.py), without running anything:
``pick`` defers to ``saguaro_topology.backoff_choice`` where the backups trade speed for acceptance and says so
where one dominates; ``summary_row`` finds the flip and the measured crossing and whether they agree."""
from __future__ import annotations

import pytest

from ssmspec.bench.saguaro_backoff import pick, summary_row
from ssmspec.drafting import saguaro_topology as topo

BASE = {"hit_rate": 0.9, "verify_s": 0.010, "slow_s": 0.004, "fast_s": 0.0004, "draft_alpha": 0.7,
        "fast_alpha": 0.1, "S": 4}


@pytest.mark.parametrize("batch", [1, 4, 16, 64, 256])
def test_pick_is_backoff_choice_where_the_backups_trade(batch):
    got = pick(BASE, batch)
    want = topo.backoff_choice(batch=batch, **BASE)
    assert got["choice"] == want.backup and got["threshold_batch"] == want.threshold_batch
    assert got["predicted_s_per_token_slow"] == pytest.approx(want.seconds_per_token["slow"])
    assert got["predicted_s_per_token_fast"] == pytest.approx(want.seconds_per_token["fast"])
    assert got["backoff_note"] is None


def test_pick_flips_once_with_the_batch():
    choices = [pick(BASE, b)["choice"] for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert choices[0] == "slow" and choices[-1] == "fast"
    assert choices == sorted(choices, key=lambda c: c == "fast")


@pytest.mark.parametrize("change,choice", [
    ({"fast_alpha": 0.9}, "fast"),  # the n-gram is cheaper and more accurate: nothing to trade
    ({"fast_s": 0.005, "fast_alpha": 0.5}, "slow"),  # dearer and less accurate
    ({"fast_s": 0.005, "fast_alpha": 0.9}, None),  # dearer and more accurate: the roles do not apply
], ids=["fast-dominates", "slow-dominates", "roles-reversed"])
def test_pick_names_a_dominating_backup(change, choice):
    got = pick({**BASE, **change}, 8)
    assert got["choice"] == choice and got["backoff_note"]


def _line(label, batch, tps):
    return {"line": label, "batch": batch, "tokens_per_s": tps, "status": "ok"}


def test_summary_finds_flip_and_crossing():
    lines = [_line("async backup=draft", b, t) for b, t in ((1, 100), (4, 300), (16, 500))]
    lines += [_line("async backup=ngram", b, t) for b, t in ((1, 60), (4, 250), (16, 700))]
    choices = [{"batch": b, "status": "ok", "choice": c, "threshold_batch": th}
               for b, c, th in ((1, "slow", 9), (4, "slow", 9), (16, "fast", 9))]
    s = summary_row(choices, lines, {})
    assert (s["flip_batch"], s["crossing_batch"], s["agree"], s["monotone"]) == (16, 16, True, True)
    assert s["threshold_at_flip"] == 9
    choices[1]["choice"] = "fast"
    s = summary_row(choices, lines, {})
    assert (s["flip_batch"], s["agree"]) == (4, False)
    choices[2]["choice"] = "slow"
    assert summary_row(choices, lines, {})["monotone"] is False
