"""A broken checkpoint ends in one message naming the file, the field or tensor and the fix, never in a
traceback: the tests write each broken checkpoint from a valid one."""
from __future__ import annotations

import json
import re
import shutil

import pytest
from pipeline_helpers import TINY
from safetensors.torch import load_file, save_file

from ssmspec.models.loading import load_model


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    path = tmp_path_factory.mktemp("ckpt") / "mamba2"
    cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, chunk_size=8,
                       num_hidden_layers=2, vocab_size=64, tie_word_embeddings=True)
    Mamba2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture
def ckpt(good, tmp_path):
    """A fresh copy of the valid checkpoint to break."""
    path = tmp_path / "broken"
    shutil.copytree(good, path)
    return path


def _edit_config(path, change):
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _expect(path, *fragments):
    with pytest.raises(ValueError) as info:
        load_model(path)
    msg = str(info.value)
    for fragment in fragments:
        assert re.search(fragment, msg), msg


def test_valid_checkpoint_loads(good):
    assert load_model(good).cfg.vocab_size == 64


def test_config_without_a_required_field(ckpt):
    _edit_config(ckpt, lambda c: c.pop("vocab_size"))
    _expect(ckpt, r"broken/config.json: field 'vocab_size' is missing \(a mamba2 config.json needs it\)",
            "save_pretrained")


def test_truncated_config(ckpt):
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text[:40])
    _expect(ckpt, r"broken/config.json is not valid JSON \(.* at line \d+ column \d+; a truncated download\?\)")


def test_config_field_that_would_divide_by_zero(ckpt):
    _edit_config(ckpt, lambda c: c.update(n_groups=0))
    _expect(ckpt, r"config.json: field n_groups must be an integer >= 1, got 0")
    _edit_config(ckpt, lambda c: c.update(n_groups=2, hidden_size="32"))
    _expect(ckpt, r"field hidden_size must be an integer >= 1, got '32'")


def test_corrupt_and_truncated_safetensors(ckpt):
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _expect(ckpt, r"broken/model.safetensors: cannot read the weights \(SafetensorError", "truncated or corrupt",
            "re-download")
    weights.write_bytes(b"\x00garbage" * 16)
    _expect(ckpt, r"model.safetensors: cannot read the weights")


def test_missing_tensor_and_missing_shard(ckpt):
    weights = ckpt / "model.safetensors"
    sd = load_file(str(weights))
    name = next(k for k in sd if k.endswith("mixer.A_log"))
    save_file({k: v for k, v in sd.items() if k != name}, str(weights), metadata={"format": "pt"})
    _expect(ckpt, "missing keys", name.replace("backbone.", ""), "Fix:")
    weights.unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    _expect(ckpt, r"lists shard\(s\) model-00001-of-00002.safetensors that are not in", "re-download every shard")


def test_broken_checkpoint_through_the_command_line(cli, ckpt, tmp_path):
    _edit_config(ckpt, lambda c: c.pop("vocab_size"))
    out = tmp_path / "out"
    status, stdout, err = cli("run", *TINY, f"checkpoint={ckpt}", f"results_dir={out}")
    assert status == 2 and "Traceback" not in err + stdout
    assert err.strip().splitlines()[-1].startswith("error: ") and "field 'vocab_size' is missing" in err
    assert not out.exists()
