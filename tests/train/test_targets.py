"""Targets cached by their own key (train/targets.py) and the attention share of a models entry (train/run.py
attention_pattern): runs that differ only in their drafts train the target once and distill the same draft as a
run that trained it; a share resolves to the pattern written out (one target key) and a share the layers cannot
hold is one error line."""
import json

import pytest

from ssmspec.cli import main
from ssmspec.train import run as train_run
from ssmspec.train.command import compose_train
from ssmspec.train.run import attention_pattern

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["corpus.max_bytes=150000", "tokenizer.vocab_size=384", "train.seq_len=32", "train.batch=8", "train.steps=12",
         "train.eval_every=6", "distill.seq_len=32", "distill.batch=8", "distill.eval_every=5", "mtp.layers=0"]


def _train(cache, *extra):
    return train_run.train_pairs(compose_train("tiny", [*SMALL, f"cache_dir={cache}", *extra]))


@pytest.mark.parametrize(("pattern", "share", "want"), [
    ("M-M-M-M-M-M-M-M-", 0.0, "M-M-M-M-M-M-M-M-"),
    ("M-M-M-M-M-M-M-M-", 0.125, "M-M-M-M-M-M-M-*-"),
    ("M-*-M-*-M-*-M-*-", 0.25, "M-M-M-*-M-M-M-*-"),  # the written attention moves: the share decides
    ("MMMMMMMM", 0.5, "M*M*M*M*"),  # MambaInLlama's 50%: layers 1, 3, 5, 7
    ("G-G-G-G-", 0.25, "G-G-G-*-"),
    ("M-ME*", 1.0, "*-*E*"),  # MLP and MoE blocks stay
], ids=["none", "one-in-8", "quarter", "half", "gdn", "all"])
def test_attention_pattern(pattern, share, want):
    assert attention_pattern(pattern, share) == want


@pytest.mark.parametrize(("pattern", "share", "match"), [
    ("M-M-M-", 0.25, r"attention_share=0.25 of the 3 mixer layers .* is 0.75 layers; use a multiple of 1/3"),
    ("MMMM", 1.5, r"use a multiple of 1/4 in \[0, 1\]"),
    ("*-*-", 0.5, "one kind of SSM mixer"),
    ("MGMG", 0.5, "one kind of SSM mixer"),
])
def test_attention_pattern_refuses(pattern, share, match):
    with pytest.raises(ValueError, match=match):
        attention_pattern(pattern, share)


def test_a_bad_share_is_one_error_line_and_trains_nothing(tmp_path, capsys):
    assert main(["train", "hybrid_tiny", f"cache_dir={tmp_path}", "models.nemotron_h.target.attention_share=0.3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: models entry 'nemotron_h-target': attention_share=0.3")
    assert not any(tmp_path.iterdir())


def test_a_share_resolves_to_its_pattern():
    """The share written as a share or as the pattern it makes is one model (one target key)."""
    from ssmspec.train.run import model_config

    cfg = compose_train("hybrid_tiny", ["models.nemotron_h.target.attention_share=0.25"])["models"]["nemotron_h"]
    spec = {k: v for k, v in cfg["target"].items() if k != "attention_share"}
    a = model_config(cfg["target"], name="t", vocab_size=384, seed=0)
    b = model_config({**spec, "pattern": "MMM*MMM*"}, name="t", vocab_size=384, seed=0)
    assert a == b and a.pattern == "MMM*MMM*"


def test_runs_that_differ_in_their_drafts_train_the_target_once(tmp_path):
    """Distillation steps 6 then 3 in one cache: the second run reads the first one's target (same key, same
    weights, its log lines) and distils exactly the draft a run that trains its own target does."""
    shared, fresh = tmp_path / "shared", tmp_path / "fresh"
    first = _train(shared, "distill.steps=6")
    second = _train(shared, "distill.steps=3")
    alone = _train(fresh, "distill.steps=3")
    t1, t2 = first.manifest["models"]["mamba2-target"], second.manifest["models"]["mamba2-target"]
    assert second.entry != first.entry and second.entry.name == alone.entry.name  # the entry key: the whole config
    assert not t1["target_cache_hit"] and t2["target_cache_hit"] and not alone.manifest["models"]["mamba2-target"][
        "target_cache_hit"]
    assert t1["target_key"] == t2["target_key"] and t1["val_loss"] == t2["val_loss"]
    assert [p.name for p in (shared / "targets").iterdir()] == [t1["target_key"]]
    weights = "mamba2-target/model.safetensors"
    assert (first.entry / weights).read_bytes() == (second.entry / weights).read_bytes()
    drafts = "mamba2-draft/model.safetensors"
    assert (second.entry / drafts).read_bytes() == (alone.entry / drafts).read_bytes()
    assert (first.entry / drafts).read_bytes() != (second.entry / drafts).read_bytes()
    log = [json.loads(line)["model"] for line in (second.entry / "train_log.jsonl").read_text().splitlines()]
    assert log.count("mamba2-target") == 3 and log.count("mamba2-draft") == 2  # evaluations at 0, 6, 12 / 0, 3


def test_a_family_distils_for_its_own_steps(tmp_path):
    """``models.<family>.distill`` overrides the run's distillation loop for that family's draft alone: the same
    draft as the run with the global ``distill.steps`` at that count, from the same cached target; a bad field is
    refused by name before anything trains."""
    own = _train(tmp_path, "distill.steps=6", "+models.mamba2.distill.steps=3")
    glob = _train(tmp_path, "distill.steps=3")
    d_own, d_glob = own.manifest["models"]["mamba2-draft"], glob.manifest["models"]["mamba2-draft"]
    assert own.entry != glob.entry and own.manifest["models"]["mamba2-target"]["target_key"] == \
        glob.manifest["models"]["mamba2-target"]["target_key"]
    assert d_own["tokens_seen"] == d_glob["tokens_seen"] == 3 * 8 * 32
    drafts = "mamba2-draft/model.safetensors"
    assert (own.entry / drafts).read_bytes() == (glob.entry / drafts).read_bytes()
    with pytest.raises(ValueError, match=r"models.mamba2.distill: unknown keys \['stpes'\]"):
        _train(tmp_path / "bad", "+models.mamba2.distill.stpes=3")
    with pytest.raises(ValueError, match=r"models.mamba2.distill must be a mapping of loop fields \(e.g. "
                                         r"models.mamba2.distill.steps=900\), got 3"):
        _train(tmp_path / "bad", "+models.mamba2.distill=3")
    assert not (tmp_path / "bad").exists()


def test_a_run_level_distill_override_that_a_family_loop_shadows_is_named():
    """On the gpu run (its Mamba-2 and Nemotron-H drafts have loops of their own) ``distill.steps=600`` reaches the
    GDN draft only: ``train`` names the two it does not reach and how to reach them; a family-level override, a
    field no family sets, and the tiny run (no family loops) give no note."""
    from ssmspec.train.command import compose_train, shadowed_distill

    gpu = ["distill.steps=600"]
    notes = shadowed_distill(compose_train("gpu", gpu), gpu)
    assert notes == [f"distill.steps=600 does not reach the {f} draft: models.{f}.distill.steps=900 is its own "
                     f"loop's; set models.{f}.distill.steps to change it" for f in ("mamba2", "nemotron_h")]
    for overrides in (["models.mamba2.distill.steps=600"], ["distill.lr=0.001"]):
        assert shadowed_distill(compose_train("gpu", overrides), overrides) == []
    assert shadowed_distill(compose_train("tiny", gpu), gpu) == []
