"""``python -m ssmspec train`` end to end on CPU at a tiny size: training lowers the validation loss,
distillation lowers the KL, the target's MTP head trained on the frozen target agrees with the target's next-next
token far above chance and drafts losslessly through the mtp drafter, the exported checkpoints load in our loader
and in transformers (greedy generate() equal token for token), the cache hits on a rerun, is written whole or not
at all and refuses a corrupt entry."""
import json
import shutil

import pytest
import torch

from ssmspec.cli import main
from ssmspec.engine.generate import generate
from ssmspec.models.config import load_preset
from ssmspec.models.loading import load_model
from ssmspec.models.model import build_model
from ssmspec.train import run as train_run
from ssmspec.train.cache import read_entry
from ssmspec.train.command import compose_train
from ssmspec.train.export import canonical_config, export_checkpoint
from ssmspec.train.forward import train_logits
from ssmspec.train.trainer import LoopConfig, check_memory, fit, lm_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["corpus.max_bytes=150000", "tokenizer.vocab_size=384", "train.seq_len=32", "train.steps=30",
         "train.eval_every=15", "distill.seq_len=32", "distill.steps=20", "distill.eval_every=10", "mtp.seq_len=32",
         "mtp.steps=30", "mtp.eval_every=15"]


def _cfg(cache, *extra):
    return compose_train("tiny", [*SMALL, f"cache_dir={cache}", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, train_run.train_pairs(_cfg(cache))


def test_training_and_distillation_improve(trained):
    _, res = trained
    assert not res.hit
    t, d = res.manifest["models"]["mamba2-target"], res.manifest["models"]["mamba2-draft"]
    assert t["val_loss"] < t["initial_val_loss"] - 0.5 and t["tokens_seen"] == 30 * 16 * 32 and t["train_time_s"] > 0
    assert d["val_kl"] < d["initial_val_kl"] and d["target"] == "mamba2-target"
    rows = [json.loads(line) for line in (res.entry / "train_log.jsonl").read_text().splitlines()]
    assert {r["model"] for r in rows} == {"mamba2-target", "mamba2-draft", "mamba2-target-mtp"}
    assert (res.entry / "curves.png").stat().st_size > 0


def test_the_mtp_head_trains_on_the_frozen_target_and_drafts(trained):
    """The head's validation loss falls, its top-1 agreement with the target's next-next token beats always guessing
    the most frequent one (this 30-step target mostly predicts one token: the tiny config's, in
    tests/pipeline/test_trained_acceptance.py, is held to more), and the exported target drafts with it
    losslessly."""
    from ssmspec.drafting import make_drafter

    _, res = trained
    t = res.manifest["models"]["mamba2-target"]
    h = t["mtp"]
    assert h["layers"] == 1 and h["steps"] == 30 and h["tokens_seen"] == 30 * 16 * 32 and h["train_time_s"] > 0
    assert h["val_loss"] < h["initial_val_loss"] - 0.5
    assert h["agreement"] > max(0.3, h["majority_agreement"]) and h["agreement_tokens"] > 500
    model = load_model(res.entry / "mamba2-target")
    assert model.cfg.mtp_layers == 1 and model.mtp is not None
    assert t["params"] + h["params"] == model.cfg.num_parameters()  # the target's own, then the head's
    draft = load_model(res.entry / "mamba2-draft")
    assert draft.mtp is None  # drafts carry no head
    tok_prompts = [[5 + i for i in range(20)], [40 + 3 * i for i in range(12)]]
    want = generate(model, tok_prompts, max_new_tokens=24).sequences
    out = generate(model, tok_prompts, max_new_tokens=24, strategy="replay",
                   drafter=make_drafter("mtp", target=model, draft_len=3))
    assert out.sequences == want and out.mean_accepted() > 0.3


def test_export_reloads_with_the_same_logits(tmp_path):
    cfg = canonical_config(load_preset("tiny-mamba2", vocab_size=300, chunk_size=8))
    model = build_model(cfg, seed=0)
    windows = torch.randint(3, 300, (4000,), generator=torch.Generator().manual_seed(0))
    c = LoopConfig(seq_len=16, batch=4, steps=3, warmup=1, eval_every=3, eval_batches=1)
    fit(model, lm_loss, windows, windows[:17][None], c, seed=0, label="t", log_file=tmp_path / "log.jsonl")
    export_checkpoint(model, tmp_path / "ckpt")
    ids = torch.randint(3, 300, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(train_logits(load_model(tmp_path / "ckpt"), ids), train_logits(model, ids),
                                   atol=0, rtol=0)


def test_transformers_loads_the_trained_target_and_generates_like_us(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, res = trained
    path = res.entry / "mamba2-target"
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ours = load_model(path)
    prompt = tok.encode("import os\n\n\ndef main(argv):\n    ")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(train_logits(ours, ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    new = 16
    ref = hf.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    got = generate(ours, [prompt], max_new_tokens=new).sequences[0]
    if 2 in ref:  # both stop at <eos>
        ref = ref[:ref.index(2) + 1]
    assert got == ref and len(got) > 3


def test_rerun_hits_the_cache_and_a_corrupt_entry_is_refused(trained, tmp_path, capsys):
    cache, res = trained
    again = train_run.train_pairs(_cfg(cache))
    assert again.hit and again.entry == res.entry and again.manifest == res.manifest
    broken = tmp_path / "cache"
    shutil.copytree(cache, broken)
    (broken / res.entry.name / "mamba2-draft" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="corrupt.*rm -rf.*--retrain"):
        read_entry(broken / res.entry.name)
    assert main(["train", *SMALL, f"cache_dir={broken}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cache entry") and "--retrain" in err[0]


def test_an_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_run, "export_checkpoint", stop)
    with pytest.raises(KeyboardInterrupt):
        train_run.train_pairs(_cfg(tmp_path, "train.steps=2", "train.eval_every=2"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("override", "match"), [
    ("tokenizer.vocab_size=200", "tokenizer.vocab_size >= 259"),
    ("corpus.max_bytes=3000", "corpus too small"),
    ("train.steps=0", "train.steps=0 must be >= 1"),
    ("models.mamba2.target.pattern=M*", "a mamba2 model is M blocks only"),
    ("train.bogus=1", "Could not override"),
    ("mtp.layers=2", "mtp.layers=2 must be 0 (no head) or 1"),
])
def test_bad_input_is_one_error_line(tmp_path, capsys, override, match):
    assert main(["train", *SMALL, f"cache_dir={tmp_path}", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0]
    assert not any(tmp_path.iterdir())


def test_a_model_larger_than_memory_is_refused():
    huge = load_preset("mamba2-2.7b").replace(d_model=65536, pattern="M" * 64)
    with pytest.raises(ValueError, match="shrink the model"):
        check_memory(huge, LoopConfig(), torch.device("cpu"))
