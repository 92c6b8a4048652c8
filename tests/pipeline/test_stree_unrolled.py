"""stree_tab2_unrolled (bench/stree_unrolled.py) on CPU: beam trees packed (stree) vs unrolled into one chain per
leaf path (activation_replay), the same verdicts on both, the path count and sizes, refusals before running."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ssmspec.bench.stree_unrolled import UnrolledTree, beam_tree, leaf_paths
from ssmspec.drafting.oracle import Oracle
from ssmspec.drafting.static_tree import check_parents

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["experiment=stree_tab2_unrolled", "profile=cpu", "bench.warmup=0", "bench.iters=6", "bench.prompt_len=6"]


@pytest.mark.parametrize("M,N", [(1, 3), (2, 4), (3, 2), (5, 3)])
def test_beam_tree_layers_and_leaves(M, N):
    parents = beam_tree(M, N)
    depth = check_parents(parents)[1:]
    assert [depth.count(d) for d in range(1, N + 1)] == [M] * N  # N layers of M tokens
    paths, n = leaf_paths(parents)
    assert n == N and len(paths) == M + (N - 1) * (M - math.ceil(M / 2))
    for p in paths:  # each a root-to-leaf chain of parent links
        assert parents[p[0] - 1] == 0 and all(parents[b - 1] == a for a, b in zip(p, p[1:]))


def test_unrolled_chains_carry_the_tree_tokens_and_verdicts():
    parents = beam_tree(3, 3)
    ref = torch.randint(0, 40, (2, 32), generator=torch.Generator().manual_seed(0)).tolist()
    tree = Oracle(p=0.6, tree=parents, reference=ref, vocab_size=40, seed=2, forced=True)
    un = UnrolledTree(Oracle(p=0.6, tree=parents, reference=ref, vocab_size=40, seed=2, forced=True), parents)
    for d in (tree, un):
        d.reset([[1, 2]] * 2, batch=2, device="cpu")
    t, u = tree.propose([[1, 2]] * 2, None), un.propose([[1, 2]] * 2, None)
    paths, N = leaf_paths(parents)
    chains, match = u.chains(), u.match.reshape(2, len(paths), N)
    for c, p in enumerate(paths):
        assert torch.equal(chains[:, c, :len(p)], t.tokens[:, [v - 1 for v in p]])
        assert torch.equal(match[:, c, :len(p)], t.match[:, [v - 1 for v in p]])
        assert not match[:, c, len(p):].any()  # padding is never accepted
    with pytest.raises(ValueError, match="forced oracle"):
        UnrolledTree(Oracle(p=0.6, tree=parents, reference=ref, vocab_size=40), parents)


def test_packed_and_unrolled_accept_the_same_and_the_unrolled_call_is_wider(cli, tmp_path):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, "bench.beams=[2,3]", "bench.steps=[3]", f"results_dir={out}")
    assert status == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["status"] == "ok" for r in rows)
    for M in (2, 3):
        p, u = (next(r for r in rows if r.get("shape") == f"M={M} N=3" and r["form"] == f) for f in ("packed", "unrolled"))
        assert p["strategy"] == "stree" and u["strategy"] == "activation_replay"
        assert p["accepted_hist"] == u["accepted_hist"] and p["mean_accepted"] == u["mean_accepted"]
        assert p["tree_tokens"] == 1 + 3 * M and u["paths"] == len(leaf_paths(beam_tree(M, 3))[0])
        assert u["tokens_per_call"] > p["tokens_per_call"] and u["planned_bytes"] > p["planned_bytes"]
        assert p["acceptance"] == "oracle" and p["oracle"] == "forced" and p["alpha"] == 0.55
    png = tmp_path / "fig.png"
    status, _, err = cli("plot", "stree_tab2_unrolled", "--from", str(out), "--out", str(png))
    assert status == 0, err
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("override, message", [("bench.oracle=coupled", "runs the forced oracle only"),
                                               ("bench.beams=[0]", "need values >= 1")])
def test_bad_settings_are_refused_before_running(cli, tmp_path, override, message):
    out = tmp_path / "run"
    status, _, err = cli("run", *SMALL, override, f"results_dir={out}")
    assert status == 2 and message in err, err
    assert not out.exists()
