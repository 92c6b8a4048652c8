"""Qwen3.5 / Qwen3-Next checkpoints written by transformers (random init, save_pretrained) load into HybridLM
with logits equal to transformers' forward and greedy generate() equal token for token (CPU, float64 logits
and float32 generate), and broken checkpoints fail naming the field or tensor."""
import json

import pytest
import torch

from ssmspec.engine.generate import generate
from ssmspec.models.loading import load_model
from model_forward import parallel_logits

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=8, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _perturb_norms(model, seed):
    """Qwen inits its zero-centred norms to 0 and the gated norm to 1: random values so that a missing (1 + w)
    or a swapped norm shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def _qwen35(tmp_path, **over):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**{**SIZES, "num_hidden_layers": 4, **over})
    model = _perturb_norms(Qwen3_5ForCausalLM(cfg).eval(), 1)
    model.save_pretrained(tmp_path)
    return model


def _qwen3next(tmp_path, **over):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**{**SIZES, "num_hidden_layers": 5, "num_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                             "mlp_only_layers": [1], **over})
    model = _perturb_norms(Qwen3NextForCausalLM(cfg).eval(), 2)
    model.save_pretrained(tmp_path)
    model.config._experts_implementation = "eager"  # the grouped-GEMM default refuses float64
    return model


BUILDERS = {"qwen3_5": _qwen35, "qwen3_next": _qwen3next}



@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_logits_equal_transformers_forward(tmp_path, family):
    """70 tokens (two 64-token chunks of transformers' chunked GDN kernel), float64 on both sides."""
    hf = BUILDERS[family](tmp_path).double()
    ours = load_model(tmp_path, dtype=torch.float64)
    assert ours.cfg.family == family and "G" in ours.cfg.pattern and "*" in ours.cfg.pattern
    if family == "qwen3_next":
        assert ours.cfg.pattern == "GEG-GE*EGE"  # mlp_only_layers [1]: a dense MLP there and ours.cfg.n_experts == 4
    ids = torch.randint(3, 300, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    got = parallel_logits(ours, ids)
    assert ref.abs().max() > 1e-2
    # transformers runs its GDN kernels and Qwen norms in fp32 even for float64 models, and our logits are fp32
    torch.testing.assert_close(got.double(), ref.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_greedy_generate_equals_transformers(tmp_path, family):
    hf = BUILDERS[family](tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    prompts = [[5, 17, 33, 8, 99], [9, 10, 11, 12, 13]]
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompts), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                          pad_token_id=0).tolist()
    out = generate(ours, prompts, max_new_tokens=12, strategy="autoregressive", timing=False).sequences
    assert [r[5:] for r in ref] == out
    assert len(set(out[0])) > 2  # not a degenerate repeat


def test_tied_embeddings_and_interval(tmp_path):
    """tie_word_embeddings and full_attention_interval (no layer_types) are honoured."""
    _qwen35(tmp_path, tie_word_embeddings=True, num_hidden_layers=4)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("layer_types")
    raw["full_attention_interval"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="does not match"):  # the weights are laid out for interval 4
        load_model(tmp_path)
    raw["full_attention_interval"] = 4
    (tmp_path / "config.json").write_text(json.dumps(raw))
    m = load_model(tmp_path)
    assert m.cfg.tie_embeddings and m.lm_head.weight is m.embeddings.weight and m.cfg.pattern == "G-G-G-*-"


def test_missing_field_and_tensor_are_named(tmp_path):
    _qwen3next(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    bad = dict(raw)
    bad.pop("linear_num_value_heads")
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    from safetensors.torch import load_file, save_file
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd.pop("model.layers.3.self_attn.q_norm.weight")
    sd.pop("model.layers.0.linear_attn.in_proj_ba.weight")
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="in_proj_ba"):
        load_model(tmp_path)


def test_conditional_generation_layout(tmp_path):
    """A Qwen3_5ForConditionalGeneration directory (model_type qwen3_5, the text model in text_config, keys under
    model.language_model., vision and MTP weights beside them) loads its language model."""
    from safetensors.torch import load_file, save_file
    hf = _qwen35(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    text = {k: v for k, v in raw.items() if k not in ("architectures", "tie_word_embeddings")}
    text["model_type"] = "qwen3_5_text"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                      "model_type": "qwen3_5", "text_config": text,
                                                      "vision_config": {"depth": 2}, "tie_word_embeddings": False}))
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in sd.items()}
    sd["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(tmp_path, dtype=torch.float64)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.double()(ids).logits
    torch.testing.assert_close(parallel_logits(ours, ids).double(), ref, rtol=0, atol=1e-5)
