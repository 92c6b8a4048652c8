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


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A checkpoint of an architecture load_model does not read (GPT-2: n_embd / n_layer, no hidden_size)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("ckpt") / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=16)).save_pretrained(path)
    return path


def _supported_listed(msg):
    from ssmspec.models.loading import HF_FAMILIES
    from ssmspec.models.loading_qwen import QWEN_ARCHITECTURES

    for mt, cls in {**{k: v[0] for k, v in HF_FAMILIES.items()}, **QWEN_ARCHITECTURES}.items():
        assert f"{cls} (model_type {mt})" in msg, msg
    assert "mamba_ssm MambaLMHeadModel" in msg and "MambaInLlama (a llama config.json plus mamba_config.json)" in msg


def test_unsupported_architecture_is_named_with_the_supported_ones(gpt2):
    with pytest.raises(ValueError) as info:
        load_model(gpt2)
    msg = str(info.value)
    assert msg.startswith(f"{gpt2}/config.json: model_type 'gpt2' (GPT2LMHeadModel) is not an architecture "
                          f"load_model reads. load_model reads: ")
    assert msg.endswith("Point it at a checkpoint of one of these") and "hidden_size" not in msg
    _supported_listed(msg)


def test_llama_without_mamba_config_and_config_without_model_type(ckpt):
    _edit_config(ckpt, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]))
    _expect(ckpt, r"model_type 'llama' \(LlamaForCausalLM\) is not an architecture load_model reads \(a MambaInLlama "
                  r"checkpoint also holds mamba_config.json; this one has none\)")
    _edit_config(ckpt, lambda c: c.pop("model_type"))
    _expect(ckpt, r"config.json: has no model_type \(LlamaForCausalLM\) and is no mamba_ssm config \(d_model, n_layer\)",
            "load_model reads: Mamba2ForCausalLM")


def test_unsupported_architecture_through_the_command_line(cli, gpt2, tmp_path):
    out = tmp_path / "out"
    status, stdout, err = cli("run", *TINY, f"checkpoint={gpt2}", f"results_dir={out}")
    assert status == 2 and "Traceback" not in err + stdout
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert line.startswith(f"error: {gpt2}/config.json: model_type 'gpt2' (GPT2LMHeadModel) is not an architecture")
    _supported_listed(line)
    assert not out.exists()
