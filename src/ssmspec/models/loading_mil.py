"""MambaInLlama checkpoints (``jxiw/MambaInLlama``, e.g. JunxiongWang/Llama3.1-Mamba2-8B-distill) -> ``HybridLM``.

A MambaInLlama directory holds the base Llama's ``config.json`` (model_type ``llama``), a
``mamba_config.json`` (the ``MambaConfig`` dataclass of ``mamba2/hybrid_mamba_config.py``: d_model,
ssm_cfg {expand, ngroups, d_state, ...}, rms_norm_eps, d_inner, d_xb, intermediate_size, hidden_act,
n_layer, attn_layers) and the weights of the whole ``LlamaForCausalLM`` whose non-attention layers were
replaced by ``MambaDecoderLayer`` (safetensors, sharded or not, or pytorch_model.bin):

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.N.{input_layernorm, post_attention_layernorm}.weight, model.layers.N.mlp.{gate,up,down}_proj.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.weight                      (N in attn_layers)
    model.layers.N.mamba.{in_proj, out_proj, norm}.weight, .mamba.conv1d.{weight, bias}, .mamba.{dt_bias, A_log, D}

One Llama layer N is two of our blocks: 2N (the mixer, M or *, normed by input_layernorm) and 2N+1 (the
SwiGLU MLP, normed by post_attention_layernorm). The Mamba-2 mixer has d_xb-wide x and B (``models/mil.py``).
``loading.load_model`` sends a directory with a ``mamba_config.json`` here.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.checkpoint import DEFAULT_MAX_SEQ_LEN, _first_id, check_state_dict, read_config_json, read_state_dict
from ssmspec.models.model import HybridLM

log = logging.getLogger(__name__)
MIL_CONFIG = "mamba_config.json"
# mamba2/hybrid_mamba_layer.py Mamba2 constructor defaults that the checkpoints rely on
MIL_SSM_DEFAULTS = {"expand": 2, "d_conv": 4, "chunk_size": 256, "conv_bias": True, "bias": False,
                    "dt_limit": (0.0, math.inf), "rmsnorm": True, "norm_before_gate": False, "D_has_hdim": False,
                    "repeat_kv_before_conv": False, "d_ssm": None}
# hybrid_mamba_layer.py builds its gated RMSNorm with eps=1e-5 whatever the config says
MIL_GATED_NORM_EPS = 1e-5
_LAYER_PARTS = {"input_layernorm": (0, "norm"), "self_attn": (0, "mixer"), "mamba": (0, "mixer"),
                "post_attention_layernorm": (1, "norm"), "mlp": (1, "mixer")}


def is_mil_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MIL_CONFIG).is_file()


def read_mil_config(path: str | Path) -> dict:
    return json.loads((Path(path) / MIL_CONFIG).read_text())


def _rope_fields(hf: dict, name: str) -> dict:
    """Llama's RoPE settings (transformers 4: rope_theta + rope_scaling; 5: rope_parameters) as our fields."""
    rp = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or rp
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    theta = float(hf.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "llama3":
        raise ValueError(f"{name}: rope type {kind!r} is not supported; MambaInLlama checkpoints use Llama 3.1's "
                         f"'llama3' scaling or none")
    return {"rope_theta": theta, "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
            "rope_high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
            "rope_original_max_pos": int(scaling.get("original_max_position_embeddings", 8192))}


def config_from_mil(llama: dict, mil: dict, *, name: str = "checkpoint", max_seq_len: int | None = None) -> ModelConfig:
    """Map a Llama ``config.json`` plus MambaInLlama's ``mamba_config.json`` to our ``ModelConfig``."""
    if llama.get("model_type") != "llama":
        raise ValueError(f"{name}: a MambaInLlama checkpoint's config.json must be the base Llama config "
                         f"(model_type 'llama'), got model_type {llama.get('model_type')!r}")
    ssm = {**MIL_SSM_DEFAULTS, **(mil.get("ssm_cfg") or {})}
    d_model, n_layer = int(mil["d_model"]), int(mil["n_layer"])
    d_inner = int(mil.get("d_inner") or ssm["expand"] * d_model)
    groups, d_state, d_xb = int(ssm.get("ngroups", 1)), int(ssm.get("d_state", 128)), int(mil["d_xb"])
    eps = float(llama.get("rms_norm_eps", 1e-5))
    bad = []
    if d_model != int(llama["hidden_size"]) or n_layer != int(llama["num_hidden_layers"]):
        bad.append(f"d_model/n_layer {d_model}/{n_layer} vs the Llama's {llama['hidden_size']}/"
                   f"{llama['num_hidden_layers']}")
    if d_inner != groups * d_state:
        bad.append(f"d_inner {d_inner} != ngroups*d_state {groups}*{d_state} (MambaInLlama asserts it)")
    if ssm["repeat_kv_before_conv"] or not ssm["rmsnorm"] or ssm["norm_before_gate"] or ssm["D_has_hdim"]:
        bad.append("ssm_cfg repeat_kv_before_conv / rmsnorm=false / norm_before_gate / D_has_hdim")
    if ssm["d_ssm"] not in (None, d_inner):
        bad.append("ssm_cfg d_ssm != d_inner (in_proj MLP part)")
    if llama.get("mlp_bias") or llama.get("hidden_act", "silu") != "silu" or mil.get("hidden_act", "silu") != "silu":
        bad.append("an MLP with bias or an activation other than silu")
    if not math.isclose(eps, MIL_GATED_NORM_EPS) or not math.isclose(float(mil.get("rms_norm_eps", eps)), eps):
        bad.append(f"rms_norm_eps {eps} (the Mamba layers' gated norm is built with 1e-5; one eps serves both here)")
    attn = sorted(int(i) for i in mil.get("attn_layers", []))
    if any(not 0 <= i < n_layer for i in attn):
        bad.append(f"attn_layers {attn} outside 0..{n_layer - 1}")
    if bad:
        raise ValueError(f"{name}: MambaInLlama checkpoint with {'; '.join(bad)}, which HybridLM does not "
                         f"implement; fix mamba_config.json / config.json or convert the checkpoint")
    heads = int(llama["num_attention_heads"])
    lo, hi = ssm["dt_limit"]
    return ModelConfig(
        name=name, family="mamba_in_llama", d_model=d_model,
        pattern="".join(("*" if i in attn else "M") + "-" for i in range(n_layer)),
        vocab_size=int(llama["vocab_size"]), ssm_heads=groups, head_dim=d_state, state_size=d_state,
        n_groups=groups, d_xb=d_xb, conv_kernel=int(ssm["d_conv"]), chunk_size=int(ssm["chunk_size"]),
        dt_min_limit=float(lo), dt_max_limit=float(hi), conv_bias=bool(ssm["conv_bias"]), proj_bias=bool(ssm["bias"]),
        n_heads=heads, n_kv_heads=int(llama.get("num_key_value_heads") or heads),
        attn_head_dim=int(llama.get("head_dim") or d_model // heads), rope=True, **_rope_fields(llama, name),
        attn_bias=bool(llama.get("attention_bias", False)), mlp_kind="swiglu",
        d_ff=int(mil.get("intermediate_size") or llama["intermediate_size"]), norm_eps=eps,
        tie_embeddings=bool(llama.get("tie_word_embeddings", False)), residual_in_fp32=False,
        max_seq_len=max_seq_len or min(int(llama.get("max_position_embeddings", 4096)), DEFAULT_MAX_SEQ_LEN),
        pad_token_id=_first_id(llama.get("pad_token_id"), 0), bos_token_id=_first_id(llama.get("bos_token_id"), 0),
        eos_token_id=_first_id(llama.get("eos_token_id"), 0))


def convert_mil_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """MambaInLlama keys -> ``HybridLM`` keys (Llama layer N -> blocks 2N and 2N+1). Keys it does not know pass
    through unchanged, so ``check_state_dict`` names them as unexpected."""
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        k = key.removeprefix("model.")
        if k.endswith("rotary_emb.inv_freq"):
            continue
        parts = k.split(".")
        if k == "embed_tokens.weight":
            k = "embeddings.weight"
        elif k == "norm.weight":
            k = "norm_f.weight"
        elif len(parts) >= 4 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER_PARTS:
            offset, slot = _LAYER_PARTS[parts[2]]
            k = ".".join(["layers", str(2 * int(parts[1]) + offset), slot, *parts[3:]])
        out[k] = t
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_mil(path: Path, *, device="cpu", dtype: torch.dtype = torch.float32, max_seq_len: int | None = None) -> HybridLM:
    """A ``HybridLM`` with a MambaInLlama checkpoint's weights (see ``loading.load_model``)."""
    cfg = config_from_mil(read_config_json(path), read_mil_config(path), name=Path(path).name,
                          max_seq_len=max_seq_len).replace(source=f"checkpoint {path}")
    sd = convert_mil_state_dict(read_state_dict(path), cfg)
    check_state_dict(sd, cfg, where=f"MambaInLlama checkpoint {path}")
    with torch.device("meta"):
        model = HybridLM(cfg)
    model.load_state_dict(sd, strict=False, assign=True)  # keys were checked above; a tied lm_head is absent
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embeddings.weight
    model = model.to(device=device, dtype=dtype)
    log.info("loaded %s (MambaInLlama, %d params) from %s", cfg.name, cfg.num_parameters(), path)
    return model.eval()
