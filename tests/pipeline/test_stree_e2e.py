"""STree end to end (bench/e2e_tree.py, bench/tree_sampling.py) on CPU: the four experiments run through the
engine and draw their figures; oracle rows state their acceptance and match its exact expectation's support;
greedy lines stay lossless; replay on a token tree accepts exactly what stree accepts on the same drafts; the
naive tree sampler, the forced sampler and the coupled (position-keyed) sampler do what their docs say; a
draft equal to the target is always accepted by multi-step speculative sampling."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pipeline_helpers import PNG_MAGIC, rows_of

from ssmspec.bench.tree_sampling import (CoupledOracle, CoupledSampler, ForcedSampler, NaiveTreeSampler,
                                         coupled_reference, race_noise)
from ssmspec.drafting import weyl
from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.oracle import expected_accepted
from ssmspec.engine.generate import generate
from ssmspec.models import build_model, load_preset
from ssmspec.verify import SamplingConfig

FAST = ["profile=cpu", "bench.warmup=0", "bench.iters=3", "bench.trained=null"]  # trained rows: test_tree_trained.py


def _run(cli, tmp_path: Path, exp: str, *extra: str, plot: bool = True) -> list[dict]:
    out = tmp_path / "run"
    status, _, err = cli("run", f"experiment={exp}", *FAST, *extra, f"results_dir={out}")
    assert status == 0, err
    if plot:
        png = tmp_path / "fig.png"
        status, _, err = cli("plot", exp, "--from", str(out), "--out", str(png))
        assert status == 0, err
        assert png.read_bytes()[:8] == PNG_MAGIC
    return rows_of(out)


def _by(rows, **kw) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def test_tab3_states_its_acceptance_and_greedy_stays_lossless(cli, tmp_path):
    rows = _run(cli, tmp_path, "stree_tab3_e2e")
    assert {r["line"] for r in rows} == {"autoregressive", "chain S=4", "tree A"}
    assert {r["temperature"] for r in rows} == {0.0, 1.0}
    for r in rows:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["tau"] == pytest.approx(r["mean_accepted"] + 1)
        assert sum(r["accepted_hist"].values()) == 3 == r["sequence_steps"]  # one count per timed step (batch 1)
        seconds = sum(r["samples_ms"]) * 1e-3
        if r["line"] == "autoregressive":
            assert r["acceptance"] == "none" and r["speedup"] == pytest.approx(1.0)
            assert r["tokens_per_s_designed"] == r["tokens_per_s"] and r["accepted_gap"] is None
            continue
        # designed beside measured: designed tokens = sequence-steps x (1 + E[a]) over the same step times
        assert r["tokens_per_s_designed"] == pytest.approx(3 * (1 + r["expected_accepted"]) / seconds)
        assert r["tau_designed"] == pytest.approx(r["expected_accepted"] + 1)
        assert r["accepted_gap"] == pytest.approx(r["mean_accepted"] / r["expected_accepted"] - 1)
        assert r["accepted_within"] == (abs(r["accepted_gap"]) <= 0.02) and r["draws"] == "weyl"
        assert r["steps_needed"] >= 25  # the law asks for far more than the 3 steps this test times
        assert r["acceptance"] == "oracle" and r["alpha"] in (0.55, 0.37)
        tree = r["line"] == "tree A"
        assert r["expected_accepted"] == pytest.approx(
            expected_accepted(r["alpha"], tree="A", rank_decay=r["rank_decay"]) if tree else
            expected_accepted(r["alpha"], draft_len=4))
        assert max(int(k) for k in r["accepted_hist"]) <= 4
        # coupled oracle: a real test, the target's law; the emitted tokens are the truth (greedy or sampled)
        assert r["ref_match"] == 1.0 and r["law"] == "target" and r["oracle"] == "coupled"
        assert r["verify"] == ("greedy" if r["temperature"] == 0.0 else "coupled")


def test_tab3_forced_oracle_says_its_law_is_designed_under_sampling(cli, tmp_path):
    rows = _run(cli, tmp_path, "stree_tab3_e2e", "bench.oracle=forced", plot=False)
    for r in rows:
        if r["draft_nodes"] and r["temperature"] == 1.0:
            assert r["law"] == "designed" and r["ref_match"] is None
            assert r["verify"] == ("forced-mss" if r["line"] == "tree A" else "forced-speculative")
        elif r["draft_nodes"]:
            assert r["law"] == "target" and r["ref_match"] == 1.0 and r["verify"] == "greedy"


def test_fig4_measures_mss_and_naive_and_refuses_the_oracle(cli, tmp_path):
    rows = _run(cli, tmp_path, "stree_fig4_temperature", "bench.temperature=[0.0,1.0]")
    spec = [r for r in rows if r["line"] != "autoregressive"]
    assert spec and all(r["acceptance"] == "measured" and r["law"] == "target" and r["alpha"] is None
                        for r in spec)
    mss = _by(rows, line="tree A MSS", temperature=0.0)[0]
    naive = _by(rows, line="tree A naive", temperature=0.0)[0]
    # greedy: the same top-k drafts (same noise seed), and naive sampling at T = 0 is greedy verification
    assert mss["accepted_hist"] == naive["accepted_hist"]
    assert _by(rows, line="tree A MSS", temperature=1.0)[0]["verify"] == "mss"
    assert _by(rows, line="tree A naive", temperature=1.0)[0]["verify"] == "naive"
    status, _, err = cli("run", "experiment=stree_fig4_temperature", *FAST, "bench.drafter=oracle",
                         f"results_dir={tmp_path / 'bad'}")
    assert status != 0 and "bench.drafter=self" in err and not (tmp_path / "bad").exists()


@pytest.mark.parametrize("drafter,temperature", [("self", 1.0), ("draft", 0.0), ("draft", 1.0)])
def test_a_draft_equal_to_the_target_is_always_accepted(cli, tmp_path, drafter, temperature):
    """q = p: the target drafts for itself with no noise (self, sigma 0), or a draft model built from the target's
    preset and seed (the same random weights). Multi-step speculative sampling, Leviathan's test and greedy
    verification then accept every draft, so tau = depth + 1 exactly -- the drafts, their recorded q and the
    tree's logits line up; and a perturbed self-draft is accepted less."""
    args = ["bench.temperature=[%s]" % temperature, "bench.alpha=[1.0]", "bench.rank_decay=[1.0]"]
    rows = _run(cli, tmp_path, "stree_tab3_e2e", f"bench.drafter={drafter}", "bench.sigma=0.0",
                "bench.draft=tiny-mamba-in-llama", *args, plot=False)
    assert _by(rows, line="tree A")[0]["tau"] == pytest.approx(5.0)
    assert _by(rows, line="chain S=4")[0]["tau"] == pytest.approx(5.0)
    assert all(r["acceptance"] == "measured" for r in rows if r["draft_nodes"])
    if drafter == "self":
        rows = _run(cli, tmp_path / "noisy", "stree_tab3_e2e", "bench.drafter=self", "bench.sigma=3.0", *args,
                    "bench.iters=8", plot=False)
        assert _by(rows, line="chain S=4")[0]["tau"] < 4.5


def test_tab3_iters_auto_times_the_steps_the_law_needs(cli, tmp_path):
    """bench.iters=auto: every line of a temperature times the largest count its oracle lines need (weyl rule,
    fixed before the run), and the measured mean accepted length is then within 2% of the designed one."""
    out = tmp_path / "run"
    status, _, err = cli("run", "experiment=stree_tab3_e2e", "profile=cpu", "bench.trained=null", "bench.warmup=0", "bench.iters=auto",
                         "bench.temperature=[0.0]", "bench.alpha=[0.9]", "bench.rank_decay=[0.35]", "bench.chain_S=2",
                         "bench.shape=[0,0]", f"results_dir={out}")
    assert status == 0, err
    rows = rows_of(out)
    need = max(r["steps_needed"] for r in rows if r["steps_needed"])
    assert need == max(weyl.steps_needed([0, 1], [0.9] * 2, batch=1), weyl.steps_needed([0, 0], [0.9, 0.315], batch=1))
    for r in rows:
        assert r["n"] == need and r["sequence_steps"] == need
        if r["draft_nodes"]:
            assert r["accepted_within"] and abs(r["mean_accepted"] / r["expected_accepted"] - 1) <= 0.02
    status, _, err = cli("run", "experiment=stree_tab3_e2e", "profile=cpu", "bench.iters=auto", "bench.draws=random",
                         f"results_dir={tmp_path / 'bad'}")
    assert status != 0 and "bench.iters=auto sizes the run by the oracle's Weyl draws" in err


def test_tab4_shapes_follow_table4(cli, tmp_path):
    rows = _run(cli, tmp_path, "stree_tab4_tree_shapes", "bench.shapes=[A,B,E]")
    got = {r["shape"]: (r["tree_width"], r["depth"], r["tree_tokens"]) for r in rows if r["shape"]}
    assert got == {"A": (3, 4, 13), "B": (16, 3, 29), "E": (3, 5, 16)}
    assert all(r["law"] == "target" and r["rank_decay"] == 0.7 and r["ref_match"] == 1.0 for r in rows if r["shape"])


def test_tree_replay_accepts_what_stree_accepts(cli, tmp_path):
    rows = _run(cli, tmp_path, "tree_replay", "bench.shapes=[A]", "bench.batch=[2]")
    assert {r["line"] for r in rows} == {"autoregressive", "replay", "replay tree A", "stree tree A",
                                         "replay chain S=12"}
    rt, st = _by(rows, line="replay tree A")[0], _by(rows, line="stree tree A")[0]
    assert rt["accepted_hist"] == st["accepted_hist"]  # same oracle draws, both lossless
    for r in rows:
        if r["draft_nodes"]:
            assert r["ref_match"] == 1.0 and r["tokens_per_call"] == 13 * 2 and r["alpha"] == 0.55
    status, _, err = cli("run", "experiment=tree_replay", *FAST, "bench.R=8", f"results_dir={tmp_path / 'bad'}")
    assert status != 0 and "raise bench.R to at least 13" in err


# the verifiers ---------------------------------------------------------------------------------------
def _tree(bsz: int, tokens: list[int], parents: list[int], match=None) -> DraftTree:
    t = torch.tensor(tokens).expand(bsz, -1).contiguous()
    d = DraftTree(t, torch.tensor(parents).expand(bsz, -1).contiguous())  # depth found from the parents
    d.match = None if match is None else torch.tensor(match).expand(bsz, -1).contiguous()
    return d


def test_naive_sampler_emits_the_target_law_and_accepts_the_drafted_mass():
    """Root children {1, 3}, node 1 has child 2. The first emitted token ~ p(root); a child is entered with
    probability p(root)[{1, 3}]; entering node 1 then accepts node 2 with p(node 1)[2]."""
    V, n = 5, 40_000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3 + 1, V, generator=g), -1)  # nodes 0..3
    logits = p.log()[None].expand(n, -1, -1)
    drafts = _tree(n, [1, 3, 2], [0, 0, 1])
    v = NaiveTreeSampler(SamplingConfig(temperature=1.0)).verify(logits, drafts, torch.Generator().manual_seed(1))
    first = torch.where(v.accepted > 0, drafts.tokens.gather(1, (v.path[:, 1:2] - 1).clamp(min=0))[:, 0], v.bonus)
    freq = torch.bincount(first, minlength=V).double() / n
    assert (freq - p[0].double()).abs().max() < 4 * (0.25 / n) ** 0.5
    entered = (v.accepted > 0).double().mean()
    assert abs(entered - (p[0, 1] + p[0, 3])) < 4 * (0.25 / n) ** 0.5
    deep = (v.accepted == 2).double().mean()
    assert abs(deep - p[0, 1] * p[1, 2]) < 4 * (0.25 / n) ** 0.5
    # greedy: the argmax walk
    top = torch.zeros(1, 4, V)
    top[0, 0, 1] = top[0, 1, 2] = top[0, 3, 4] = 1.0
    vg = NaiveTreeSampler(SamplingConfig()).verify(top, _tree(1, [1, 3, 2], [0, 0, 1]))
    assert vg.accepted.tolist() == [2] and vg.path.tolist() == [[0, 1, 3]] and vg.bonus.tolist() == [4]


def test_forced_sampler_takes_the_kept_path_and_samples_the_bonus_there():
    V, n = 4, 20_000
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(2 * torch.randn(4, V, generator=g), -1)
    drafts = _tree(n, [1, 3, 2], [0, 0, 1], match=[False, True, True])  # node 3 (under node 1) unreachable
    v = ForcedSampler(SamplingConfig(temperature=1.0)).verify(p.log()[None].expand(n, -1, -1), drafts,
                                                               torch.Generator().manual_seed(3))
    assert (v.accepted == 1).all() and (v.path[:, :2] == torch.tensor([0, 2])).all()
    freq = torch.bincount(v.bonus, minlength=V).double() / n
    assert (freq - p[2].double()).abs().max() < 4 * (0.25 / n) ** 0.5  # drawn from p at node 2


def test_race_noise_draws_the_target_law_and_is_keyed_by_position():
    """argmax(p / E) with the hashed noise: frequencies over many sequences follow p; the noise of a (sequence,
    position) is the same whatever the call it is drawn in, and differs between positions and seeds."""
    V, n = 6, 30_000
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(4)), -1)
    rows = torch.arange(n)
    pos = torch.full((n, 1), 7)
    y = (p / race_noise(0, rows, pos, V)).argmax(-1)[:, 0]
    freq = torch.bincount(y, minlength=V).double() / n
    assert (freq - p.double()).abs().max() < 4 * (0.25 / n) ** 0.5
    wide = race_noise(0, rows[:3], torch.tensor([[5, 7, 9]] * 3), V)
    assert torch.equal(wide[:, 1], race_noise(0, rows[:3], pos[:3], V)[:, 0])
    assert not torch.equal(wide[:, 0], wide[:, 1]) and not torch.equal(race_noise(1, rows[:3], pos[:3], V),
                                                                      race_noise(0, rows[:3], pos[:3], V))


def test_coupled_sampler_enters_a_prefix_drafted_twice_once():
    """Root children 1 and 2 hold the same token (the oracle keeps both: the truth of depth 1); only node 2 has a
    kept child. One prefix, so the walk enters it and reaches node 3: the deepest fully kept path, not the first
    copy's dead end."""
    V = 5
    logits = torch.zeros(1, 4, V)
    logits[0, :, 1] = 30.0  # the target samples token 1 everywhere (a near one-hot p)
    drafts = _tree(1, [1, 1, 1], [0, 0, 2])
    drafts.position = torch.zeros(1, dtype=torch.long)
    v = CoupledSampler(SamplingConfig(temperature=1.0), 0).verify(logits, drafts)
    assert v.accepted.tolist() == [2] and v.path.tolist() == [[0, 2, 3]] and v.bonus.tolist() == [1]


@pytest.mark.parametrize("tree", ["A", None])
def test_coupled_oracle_emits_the_sampled_truth_at_its_designed_acceptance(tree):
    m = build_model(load_preset("tiny-mamba-in-llama"), seed=0, device="cpu", dtype=torch.float32)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    s = SamplingConfig(temperature=1.0)
    ref = coupled_reference(m, prompts, max_new_tokens=110, sampling=s, seed=3)
    kw = dict(tree=tree, rank_decay=0.5) if tree else dict(draft_len=4)
    d = CoupledOracle(p=0.6, reference=ref, vocab_size=m.cfg.vocab_size, seed=1, **kw)
    out = generate(m, prompts, max_new_tokens=100, strategy="stree", drafter=d, verifier=CoupledSampler(s, 3),
                   sampling=s)
    assert [r[:100] for r in ref] == out.sequences  # lossless: the target's own sample
    acc = torch.tensor([a for st in out.steps[1:] for a in st.accepted], dtype=torch.float64)
    assert abs(acc.mean() - d.expected_accepted()) < 4 * acc.std() / len(acc) ** 0.5
    # a sampler keyed by another seed sees other samples: the kept drafts are then mostly rejected
    out = generate(m, prompts, max_new_tokens=40, strategy="stree", drafter=CoupledOracle(
        p=0.6, reference=ref, vocab_size=m.cfg.vocab_size, seed=1, **kw), verifier=CoupledSampler(s, 4), sampling=s)
    assert sum(a for st in out.steps[1:] for a in st.accepted) < 0.5 * d.expected_accepted() * (len(out.steps) - 1)


def test_a_checkpoint_needs_a_trained_draft(cli, tmp_path):
    status, _, err = cli("run", "experiment=stree_tab3_e2e", *FAST, "checkpoint=/nonexistent/ckpt",
                         f"results_dir={tmp_path / 'bad'}")
    assert status != 0 and not (tmp_path / "bad").exists()
    assert "give its weights with bench.draft_checkpoint" in err and "bench.drafter=self" in err
