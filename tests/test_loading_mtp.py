"""Multi-token-prediction heads in checkpoints (issue 24): a head that config.json declares loads from the names its
family's checkpoints use -- Qwen3.5 / Qwen3-Next ``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.layers.0.*`` with
zero-centred norms, Nemotron-H ``mtp.layers.0.eh_proj / enorm / hnorm``, ``final_layernorm`` and routed experts one
per expert -- and the exporter writes it back so that the checkpoint reloads with the same weights; a declared head
whose weights are absent loads without it, a partial one is named, an undeclared one is skipped as before."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ssmspec.models import load_model, load_preset
from ssmspec.models.model import build_model
from ssmspec.train.export import canonical_config, export_checkpoint
from model_forward import mtp_prefill, parallel_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers = pytest.importorskip("transformers")

TRAINABLE = {"tiny-mamba2": {}, "tiny-hybrid": {"pattern": "M-M*-"}, "tiny-qwen3.5": {}}
# the names each family's checkpoints give the head (mtp. prefix included)
HF_NAMES = {"mamba2": {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                       "mtp.norm.weight", "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.self_attn.q_proj.weight",
                       "mtp.layers.0.post_attention_layernorm.weight", "mtp.layers.0.mlp.up_proj.weight"},
            "nemotron_h": {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
                           "mtp.layers.0.norm.weight", "mtp.layers.0.mixer.q_proj.weight", "mtp.layers.1.norm.weight",
                           "mtp.layers.1.mixer.up_proj.weight", "mtp.layers.1.final_layernorm.weight"},
            "qwen3_5": {"mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_norm.weight",
                        "mtp.layers.0.mlp.gate_proj.weight", "mtp.norm.weight"}}


def _perturb(model, seed=3):
    """Random norm weights (init 1): a missing or doubled (1 + w) shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("preset", sorted(TRAINABLE))
def test_export_writes_the_head_and_reloads_it(tmp_path, preset):
    cfg = canonical_config(load_preset(preset, **TRAINABLE[preset]).replace(mtp_layers=1))
    assert cfg.mtp_layers == 1 and cfg.mtp_pattern == "*-"  # the config.json fields read back
    model = _perturb(build_model(cfg, seed=0))
    export_checkpoint(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    declared = raw.get("num_nextn_predict_layers") if cfg.family == "nemotron_h" else raw.get("mtp_num_hidden_layers")
    assert declared == 1
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert HF_NAMES[cfg.family] <= keys
    back = load_model(tmp_path)
    assert back.cfg.mtp_layers == 1 and back.mtp is not None
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0, msg=k)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    h = torch.randn(2, 9, cfg.d_model, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(mtp_prefill(back, ids, h), mtp_prefill(model, ids, h), atol=0, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # transformers skips the head's keys
    assert not any("mtp" in k for k in hf.state_dict())


def _qwen_dir(tmp_path, family):
    """A transformers checkpoint (save_pretrained) of a tiny Qwen3.5 or Qwen3-Next model: no head yet."""
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=8, rms_norm_eps=1e-6, num_hidden_layers=4)
    torch.manual_seed(0)
    if family == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**sizes))
    else:
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **sizes, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48))
    model.save_pretrained(tmp_path)
    return tmp_path


def _add(path, tensors: dict, **config):
    sd = load_file(str(path / "model.safetensors"))
    save_file({**sd, **tensors}, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **config}))


def _randn(*shape, seed=[0]):
    seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed[0]))


def _qwen_head(d=64, heads=4, kv=2, hd=16, ff=96, experts=0, moe_ff=32, shared=48):
    t = {"mtp.fc.weight": _randn(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": _randn(d),
         "mtp.pre_fc_norm_hidden.weight": _randn(d), "mtp.norm.weight": _randn(d),
         "mtp.layers.0.input_layernorm.weight": _randn(d), "mtp.layers.0.post_attention_layernorm.weight": _randn(d),
         "mtp.layers.0.self_attn.q_proj.weight": _randn(2 * heads * hd, d),  # [query | gate] per head
         "mtp.layers.0.self_attn.k_proj.weight": _randn(kv * hd, d), "mtp.layers.0.self_attn.v_proj.weight": _randn(kv * hd, d),
         "mtp.layers.0.self_attn.o_proj.weight": _randn(d, heads * hd),
         "mtp.layers.0.self_attn.q_norm.weight": _randn(hd), "mtp.layers.0.self_attn.k_norm.weight": _randn(hd)}
    mlp = "mtp.layers.0.mlp."
    if not experts:
        t.update({mlp + "gate_proj.weight": _randn(ff, d), mlp + "up_proj.weight": _randn(ff, d),
                  mlp + "down_proj.weight": _randn(d, ff)})
        return t
    for e in range(experts):  # one tensor per expert, as the hub stores them
        t.update({f"{mlp}experts.{e}.gate_proj.weight": _randn(moe_ff, d), f"{mlp}experts.{e}.up_proj.weight":
                  _randn(moe_ff, d), f"{mlp}experts.{e}.down_proj.weight": _randn(d, moe_ff)})
    t.update({mlp + "gate.weight": _randn(experts, d), mlp + "shared_expert.gate_proj.weight": _randn(shared, d),
              mlp + "shared_expert.up_proj.weight": _randn(shared, d), mlp + "shared_expert.down_proj.weight":
              _randn(d, shared), mlp + "shared_expert_gate.weight": _randn(1, d)})
    return t


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_qwen_head_loads_from_the_hub_names(tmp_path, family):
    path = _qwen_dir(tmp_path, family)
    plain = load_model(path, dtype=torch.float64)
    head = _qwen_head(experts=4 if family == "qwen3_next" else 0)
    _add(path, head, mtp_num_hidden_layers=1)
    m = load_model(path, dtype=torch.float64)
    assert m.cfg.mtp_layers == 1 and m.cfg.mtp_pattern == ("*E" if family == "qwen3_next" else "*-")
    sd = {k: v.float() for k, v in m.state_dict().items()}
    same = {"mtp.fc.weight": head["mtp.fc.weight"],  # zero-centred norms: 1 + w
            "mtp.pre_fc_norm_hidden.weight": 1 + head["mtp.pre_fc_norm_hidden.weight"],
            "mtp.norm.weight": 1 + head["mtp.norm.weight"],
            "mtp.blocks.0.norm.weight": 1 + head["mtp.layers.0.input_layernorm.weight"],
            "mtp.blocks.1.norm.weight": 1 + head["mtp.layers.0.post_attention_layernorm.weight"],
            "mtp.blocks.0.mixer.q_norm.weight": 1 + head["mtp.layers.0.self_attn.q_norm.weight"],
            "mtp.blocks.0.mixer.o_proj.weight": head["mtp.layers.0.self_attn.o_proj.weight"]}
    if family == "qwen3_next":  # experts stacked, gate and up side by side
        e2 = "mtp.layers.0.mlp.experts.2."
        same["mtp.blocks.1.mixer.experts.gate_up_proj"] = torch.cat([head[e2 + "gate_proj.weight"],
                                                                     head[e2 + "up_proj.weight"]])[None]
        sd["mtp.blocks.1.mixer.experts.gate_up_proj"] = sd["mtp.blocks.1.mixer.experts.gate_up_proj"][2:3]
        same["mtp.blocks.1.mixer.shared_expert_gate.weight"] = head["mtp.layers.0.mlp.shared_expert_gate.weight"]
    else:
        same["mtp.blocks.1.mixer.gate_proj.weight"] = head["mtp.layers.0.mlp.gate_proj.weight"]
    for k, v in same.items():
        torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=0, msg=k)
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(parallel_logits(m, ids), parallel_logits(plain, ids), atol=0, rtol=0)


def test_a_nemotron_head_with_experts_loads_from_the_hub_names(tmp_path):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    d, heads, kv, hd, moe_ff, shared = 32, 4, 2, 8, 16, 24
    cfg = NemotronHConfig(hidden_size=d, hybrid_override_pattern="M*-", vocab_size=64, mamba_num_heads=4,
                          mamba_head_dim=16, n_groups=2, ssm_state_size=8, intermediate_size=48,
                          num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=moe_ff, moe_shared_expert_intermediate_size=shared)
    NemotronHForCausalLM(cfg).save_pretrained(tmp_path)
    L0, L1 = "mtp.layers.0.", "mtp.layers.1."
    head = {L0 + "enorm.weight": _randn(d), L0 + "hnorm.weight": _randn(d), L0 + "eh_proj.weight": _randn(d, 2 * d),
            L0 + "norm.weight": _randn(d), L0 + "mixer.q_proj.weight": _randn(heads * hd, d),
            L0 + "mixer.k_proj.weight": _randn(kv * hd, d), L0 + "mixer.v_proj.weight": _randn(kv * hd, d),
            L0 + "mixer.o_proj.weight": _randn(d, heads * hd), L1 + "norm.weight": _randn(d),
            L1 + "mixer.gate.weight": _randn(4, d), L1 + "mixer.gate.e_score_correction_bias": _randn(4),
            L1 + "mixer.shared_experts.up_proj.weight": _randn(shared, d),
            L1 + "mixer.shared_experts.down_proj.weight": _randn(d, shared), L1 + "final_layernorm.weight": _randn(d)}
    for e in range(4):
        head.update({f"{L1}mixer.experts.{e}.up_proj.weight": _randn(moe_ff, d),
                     f"{L1}mixer.experts.{e}.down_proj.weight": _randn(d, moe_ff)})
    _add(tmp_path, head, num_nextn_predict_layers=1, mtp_layers_block_type=["attention", "moe"])
    m = load_model(tmp_path, dtype=torch.bfloat16)
    assert (m.cfg.mtp_layers, m.cfg.mtp_pattern) == (1, "*E")
    sd = m.state_dict()
    for ours, theirs in [("fc.weight", L0 + "eh_proj.weight"), ("pre_fc_norm_embedding.weight", L0 + "enorm.weight"),
                         ("pre_fc_norm_hidden.weight", L0 + "hnorm.weight"), ("norm.weight", L1 + "final_layernorm.weight"),
                         ("blocks.0.mixer.k_proj.weight", L0 + "mixer.k_proj.weight")]:
        assert torch.equal(sd["mtp." + ours], head[theirs].to(torch.bfloat16)), ours
    assert torch.equal(sd["mtp.blocks.1.mixer.experts.down_proj"][3], head[f"{L1}mixer.experts.3.down_proj.weight"]
                       .to(torch.bfloat16))
    assert m.mtp.blocks[1].mixer.gate.e_score_correction_bias.dtype == torch.float32  # as the model's own routers


def test_declared_absent_partial_and_undeclared_heads(tmp_path):
    """transformers' save_pretrained keeps mtp_num_hidden_layers but drops the head: the model loads without one;
    a head with a tensor missing is named; mtp.* weights the config does not declare are skipped."""
    path = _qwen_dir(tmp_path, "qwen3_5")
    _add(path, {}, mtp_num_hidden_layers=1)
    m = load_model(path)
    assert m.cfg.mtp_layers == 0 and m.mtp is None
    head = _qwen_head()
    del head["mtp.fc.weight"]
    _add(path, head)
    with pytest.raises(ValueError, match=r"missing keys \(1\): mtp.fc.weight"):
        load_model(path)
    _add(path, {}, mtp_num_hidden_layers=0)
    assert load_model(path).mtp is None


def test_more_than_one_mtp_layer_is_refused():
    with pytest.raises(ValueError, match="mtp_layers=2 must be 0 .* or 1"):
        load_preset("tiny-qwen3.5", mtp_layers=2)
