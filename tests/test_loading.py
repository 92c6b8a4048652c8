"""Checkpoint loading: config mapping (HF Mamba2 / NemotronH, mamba_ssm) against the published presets,
sharded weights, dtype, and one clear error for every kind of bad checkpoint or unreachable hub id."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Mamba2Config, Mamba2ForCausalLM, NemotronHConfig, NemotronHForCausalLM

from ssmspec.models import load_model, load_preset
from ssmspec.models.loading import checkpoint_dir, config_from_hf, config_from_mamba_ssm, read_config_json


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# fields that describe the architecture (name, source, max_seq_len are bookkeeping)
ARCH = ("family", "d_model", "pattern", "vocab_size", "ssm_heads", "head_dim", "state_size", "n_groups",
        "conv_kernel", "chunk_size", "conv_bias", "proj_bias", "n_heads", "n_kv_heads", "attn_head_dim", "rope",
        "mlp_kind", "d_ff", "norm_eps", "tie_embeddings", "residual_in_fp32", "pad_token_id", "bos_token_id",
        "eos_token_id")

# Nemotron-H-8B-Base-8K config.json as the hub writes it (shared/MODELS.md 3b: Megatron-Bridge fixture)
NEMOTRON_H_8B_HUB = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", "num_hidden_layers": 52,
    "vocab_size": 131072, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
    "conv_kernel": 4, "chunk_size": 128, "num_attention_heads": 32, "num_key_value_heads": 8,
    "attention_head_dim": 128, "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
    "layer_norm_epsilon": 1e-5, "residual_in_fp32": False, "use_bias": False, "use_conv_bias": True,
    "tie_word_embeddings": False, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "time_step_min": 0.001, "time_step_max": 0.1, "transformers_version": "4.48.0.dev0"}
# state-spaces/mamba2-130m config.json (mamba_ssm MambaConfig, shared/MODELS.md 3a)
MAMBA2_130M_SSM = {"d_model": 768, "d_intermediate": 0, "n_layer": 24, "vocab_size": 50277,
                   "ssm_cfg": {"layer": "Mamba2"}, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
                   "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 16,
                   "tie_embeddings": True}
# the same model converted to transformers (convert_ssm_config_to_hf_config; AntonV/mamba2-130m-hf)
MAMBA2_130M_HF = {"model_type": "mamba2", "hidden_size": 768, "num_hidden_layers": 24, "num_heads": 24,
                  "head_dim": 64, "state_size": 128, "expand": 2, "n_groups": 1, "conv_kernel": 4, "chunk_size": 256,
                  "vocab_size": 50288, "tie_word_embeddings": True, "residual_in_fp32": True,
                  "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True, "pad_token_id": 0,
                  "bos_token_id": 0, "eos_token_id": 0}


def _arch(cfg):
    return {k: getattr(cfg, k) for k in ARCH}


@pytest.mark.parametrize("raw,preset,mapper", [
    pytest.param(NEMOTRON_H_8B_HUB, "nemotron-h-8b", config_from_hf, id="nemotron-h-8b-hub"),
    pytest.param(MAMBA2_130M_SSM, "mamba2-130m", config_from_mamba_ssm, id="mamba2-130m-mamba_ssm"),
    pytest.param(MAMBA2_130M_HF, "mamba2-130m", config_from_hf, id="mamba2-130m-hf"),
])
def test_published_configs_map_to_the_presets(raw, preset, mapper):
    cfg = mapper(raw)
    assert _arch(cfg) == _arch(load_preset(preset))
    assert cfg.num_parameters() == load_preset(preset).num_parameters()


def test_nemotron_fields_aliases_and_moe():
    raw = {**NEMOTRON_H_8B_HUB, "hybrid_override_pattern": "ME*-", "mamba_n_groups": 4, "time_step_min": 0.02,
           "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 40,
           "moe_shared_expert_intermediate_size": 56, "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1,
           "norm_topk_prob": False, "max_position_embeddings": 262144}
    del raw["n_groups"]
    cfg = config_from_hf(raw)
    assert cfg.pattern == "ME*-" and cfg.n_groups == 4 and cfg.dt_min_limit == 0.02
    assert (cfg.n_experts, cfg.top_k, cfg.moe_d_ff, cfg.shared_d_ff) == (8, 3, 40, 56)
    assert (cfg.routed_scaling, cfg.n_expert_groups, cfg.topk_groups, cfg.norm_topk_prob) == (2.5, 2, 1, False)
    assert cfg.max_seq_len == 8192  # capped: 262144 slots would be allocated per attention block
    # transformers 5's own serialisation (layers_block_type) and legacy layer-type names
    saved = NemotronHConfig(hybrid_override_pattern="M-*E", vocab_size=64).to_dict()
    assert config_from_hf(saved).pattern == "M-*E"
    legacy = {**NEMOTRON_H_8B_HUB, "layers_block_type": ["mamba", "attention", "mlp", "moe"]}
    assert config_from_hf(legacy).pattern == "M*-E"


def test_mamba2_time_step_limit_survives_save_pretrained(tmp_path):
    Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, num_hidden_layers=1,
                 vocab_size=64, time_step_limit=(0.001, 0.5)).save_pretrained(tmp_path)
    cfg = config_from_hf(read_config_json(tmp_path))
    assert (cfg.dt_min_limit, cfg.dt_max_limit) == (0.001, 0.5)
    Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, n_groups=2, num_hidden_layers=1).save_pretrained(tmp_path)
    assert config_from_hf(read_config_json(tmp_path)).dt_max_limit == float("inf")  # written {"__float__": ...}


@pytest.fixture
def mamba2_dir(tmp_path):
    cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, chunk_size=8,
                       num_hidden_layers=2, vocab_size=64, tie_word_embeddings=True)
    Mamba2ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _edit_weights(path, fn):
    sd = load_file(str(path / "model.safetensors"))
    fn(sd)
    save_file(sd, str(path / "model.safetensors"))


def test_missing_unexpected_and_mismatched_keys_in_one_error(mamba2_dir):
    def corrupt(sd):
        del sd["backbone.layers.1.mixer.D"]
        sd["backbone.layers.0.mixer.extra.weight"] = torch.zeros(3)
        sd["backbone.layers.0.mixer.A_log"] = torch.zeros(5)

    _edit_weights(mamba2_dir, corrupt)
    with pytest.raises(ValueError) as err:
        load_model(mamba2_dir)
    msg = str(err.value)
    assert "missing keys (1): layers.1.mixer.D" in msg
    assert "unexpected keys (1): layers.0.mixer.extra.weight" in msg
    assert "layers.0.mixer.A_log (5,) vs (4,)" in msg
    assert "Fix:" in msg and "config.json" in msg


def test_config_that_disagrees_with_the_weights(mamba2_dir):
    raw = json.loads((mamba2_dir / "config.json").read_text())
    (mamba2_dir / "config.json").write_text(json.dumps({**raw, "state_size": 16}))
    with pytest.raises(ValueError, match=r"shape mismatches.*layers.0.mixer.conv1d.weight \(96, 1, 4\) vs \(128, 1, 4\)"):
        load_model(mamba2_dir)


def test_untied_checkpoint_without_lm_head(tmp_path):
    cfg = NemotronHConfig(hidden_size=32, hybrid_override_pattern="M-", vocab_size=64, mamba_num_heads=4,
                          mamba_head_dim=16, n_groups=2, ssm_state_size=8, intermediate_size=48)
    NemotronHForCausalLM(cfg).save_pretrained(tmp_path)
    ok = load_model(tmp_path)
    assert ok.lm_head.weight is not ok.embeddings.weight  # NemotronH does not tie
    _edit_weights(tmp_path, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing keys \(1\): lm_head.weight"):
        load_model(tmp_path)


def test_sharded_safetensors_and_dtype(mamba2_dir, tmp_path):
    hf = Mamba2ForCausalLM.from_pretrained(mamba2_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, b = load_model(mamba2_dir), load_model(tmp_path / "sharded")
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert torch.equal(a.embeddings.weight, hf.backbone.embeddings.weight)
    half = load_model(mamba2_dir, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.lm_head.weight is half.embeddings.weight
    assert checkpoint_dir(half) == mamba2_dir


def test_model_prefix_and_mamba_ssm_embedding_name(mamba2_dir):
    """transformers 5 names NemotronH's backbone ``model.`` in memory; mamba_ssm says ``embedding``."""
    ref = load_model(mamba2_dir)
    _edit_weights(mamba2_dir, lambda sd: sd.update({k.replace("backbone.", "model.").replace("embeddings", "embedding"):
                                                     sd.pop(k) for k in list(sd)}))
    assert "model.embedding.weight" in load_file(str(mamba2_dir / "model.safetensors"))
    got = load_model(mamba2_dir)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), got.state_dict().values()))


def test_moe_router_bias_stays_fp32(tmp_path):
    cfg = NemotronHConfig(hidden_size=32, hybrid_override_pattern="E", vocab_size=64, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24)
    NemotronHForCausalLM(cfg).save_pretrained(tmp_path)
    m = load_model(tmp_path, dtype=torch.bfloat16)
    assert m.layers[0].mixer.experts.up_proj.shape == (4, 16, 32)  # per-expert keys stacked
    assert m.layers[0].mixer.gate.e_score_correction_bias.dtype == torch.float32


def test_hub_id_offline_says_how_to_pass_a_local_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"'no-such-owner/mamba2-tiny' is no local directory.*pass its local path"):
        load_model("no-such-owner/mamba2-tiny")


@pytest.mark.parametrize("what,match", [
    ("not/a/dir/or/id", "not a directory nor a hub id"),
    ("no-config", "no config.json"),
    ("no-weights", "no weights found"),
    ("mamba1", r"ssm_cfg.layer='Mamba1'"),
    ("mamba-hf", r"model_type 'mamba' is not an architecture load_model reads\. load_model reads: Mamba2ForCausalLM"),
])
def test_unusable_checkpoints(tmp_path, what, match):
    path = tmp_path / what
    if what != "not/a/dir/or/id":
        path.mkdir()
    if what == "no-weights":
        (path / "config.json").write_text(json.dumps(MAMBA2_130M_HF))
    elif what == "mamba1":
        (path / "config.json").write_text(json.dumps({**MAMBA2_130M_SSM, "ssm_cfg": {}}))
    elif what == "mamba-hf":
        (path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8, "vocab_size": 8}))
    with pytest.raises(ValueError, match=match):
        load_model(path)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown model preset 'mamba3-1b'; choose one of: .*tiny-mamba2"):
        load_preset("mamba3-1b")
