"""Trained ``HybridLM`` -> Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer files) in
the format ``models.loading.load_model`` reads for its family and transformers loads as its own class:

    mamba2      Mamba2ForCausalLM      (transformers' Mamba2Config)
    nemotron_h  NemotronHForCausalLM   (M, * and - blocks; MoE blocks are not trained here)
    qwen3_5     Qwen3_5ForCausalLM     (Qwen3.5 text model: G or * decoder layers, each followed by a SwiGLU MLP)

The weights go through the transformers model (``load_state_dict(strict=True)``, then ``save_pretrained``), so the
directory is exactly what transformers writes for that class. A multi-token-prediction head (``cfg.mtp_layers``;
``models/mtp.py``), which none of these classes holds, is declared in config.json the way its family's checkpoints
declare it and appended to the weights under its family's ``mtp.*`` names; transformers skips those keys. ``canonical_config`` is the config the loader reads
back from that config.json: the trainer builds its model from it, so the checkpoint reloads with the trained
numbers (e.g. Nemotron-H's residual stream in the model dtype, its dt clamp at time_step_min).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ssmspec.models.config import ModelConfig
from ssmspec.models.loading import config_from_hf
from ssmspec.models.model import HybridLM
from ssmspec.models.mtp import mtp_hf_fields, mtp_to_hf

TRAINABLE = ("mamba2", "nemotron_h", "qwen3_5")
_ZERO_CENTRED = ("norm_f.weight", ".norm.weight", "q_norm.weight", "k_norm.weight")  # Qwen stores w with y = x̂ (1 + w)


def _check(cfg: ModelConfig) -> None:
    if cfg.family not in TRAINABLE:
        raise ValueError(f"model family {cfg.family!r} cannot be trained and exported yet; use one of {TRAINABLE}")
    if "E" in cfg.pattern:
        raise ValueError(f"model {cfg.name!r}: MoE blocks (E in pattern {cfg.pattern!r}) are not trained here; use M, "
                         f"*, - (nemotron_h) or G, *, - (qwen3_5) blocks")
    if cfg.mtp_layers and "E" in cfg.mtp_pattern:
        raise ValueError(f"model {cfg.name!r}: MoE blocks in the MTP head (mtp_pattern {cfg.mtp_pattern!r}) are not "
                         f"trained here; use *- (attention, then an MLP)")
    if cfg.family == "mamba2" and (set(cfg.pattern) != {"M"} or cfg.d_inner % cfg.d_model):
        raise ValueError(f"model {cfg.name!r}: a mamba2 model is M blocks only with ssm_heads*head_dim a multiple of "
                         f"d_model (transformers' expand); got pattern {cfg.pattern!r}, {cfg.d_inner} / {cfg.d_model}")
    if cfg.family == "qwen3_5":
        mixers, mlps = cfg.pattern[0::2], cfg.pattern[1::2]
        if len(cfg.pattern) % 2 or set(mixers) - {"G", "*"} or set(mlps) != {"-"} or cfg.mlp_kind != "swiglu":
            raise ValueError(f"model {cfg.name!r}: a qwen3_5 model alternates a G or * block with a - block (SwiGLU), "
                             f"e.g. 'G-G-G-*-'; got pattern {cfg.pattern!r}, mlp_kind {cfg.mlp_kind!r}")


def hf_config(cfg: ModelConfig):
    """The transformers config object of ``cfg``'s family (module doc)."""
    _check(cfg)
    ids = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, tie_word_embeddings=cfg.tie_embeddings,
               pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
               **mtp_hf_fields(cfg))
    if cfg.family == "mamba2":
        from transformers import Mamba2Config

        return Mamba2Config(**ids, num_heads=cfg.ssm_heads, head_dim=cfg.head_dim, expand=cfg.d_inner // cfg.d_model,
                            state_size=cfg.state_size, n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel,
                            chunk_size=cfg.chunk_size, num_hidden_layers=cfg.n_layer, layer_norm_epsilon=cfg.norm_eps,
                            use_bias=cfg.proj_bias, use_conv_bias=cfg.conv_bias, hidden_act=cfg.mamba_activation,
                            residual_in_fp32=cfg.residual_in_fp32,
                            time_step_limit=(cfg.dt_min_limit, cfg.dt_max_limit))
    if cfg.family == "nemotron_h":
        from transformers import NemotronHConfig

        return NemotronHConfig(**ids, hybrid_override_pattern=cfg.pattern, num_attention_heads=cfg.n_heads,
                               num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.attn_head_dim,
                               intermediate_size=cfg.d_ff, mamba_num_heads=cfg.ssm_heads, mamba_head_dim=cfg.head_dim,
                               n_groups=cfg.n_groups, ssm_state_size=cfg.state_size, chunk_size=cfg.chunk_size,
                               conv_kernel=cfg.conv_kernel, time_step_min=cfg.dt_min_limit or 1e-3,
                               layer_norm_epsilon=cfg.norm_eps, use_bias=cfg.proj_bias, use_conv_bias=cfg.conv_bias,
                               attention_bias=cfg.attn_bias, mamba_hidden_act=cfg.mamba_activation,
                               max_position_embeddings=cfg.max_seq_len)
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    types = ["linear_attention" if c == "G" else "full_attention" for c in cfg.pattern[0::2]]
    return Qwen3_5TextConfig(**ids, intermediate_size=cfg.d_ff, num_hidden_layers=len(types), layer_types=types,
                             num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                             head_dim=cfg.attn_head_dim, linear_conv_kernel_dim=cfg.conv_kernel,
                             linear_key_head_dim=cfg.gdn_k_dim, linear_value_head_dim=cfg.gdn_v_dim,
                             linear_num_key_heads=cfg.gdn_k_heads, linear_num_value_heads=cfg.gdn_v_heads,
                             rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_seq_len,
                             rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                              "partial_rotary_factor": cfg.rope_partial})


def canonical_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` as the loader reads it back from the exported config.json (module doc); name kept."""
    raw = hf_config(cfg).to_dict()
    out = config_from_hf(raw, name=cfg.name, max_seq_len=cfg.max_seq_len)
    if cfg.family == "qwen3_5":
        out = out.replace(gdn_chunk_size=cfg.gdn_chunk_size)  # a kernel setting, not in config.json
    return out.replace(source=cfg.source)


def _hf_model(cfg: ModelConfig):
    hc = hf_config(cfg)
    if cfg.family == "mamba2":
        from transformers import Mamba2ForCausalLM as cls
    elif cfg.family == "nemotron_h":
        from transformers import NemotronHForCausalLM as cls
    else:
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM as cls
    with torch.device("meta"):
        return cls(hc)


def _qwen_key(k: str) -> str:
    """A HybridLM key -> the Qwen3_5ForCausalLM key (inverse of ``loading_qwen.convert_qwen_state_dict``)."""
    if k in ("lm_head.weight",):
        return k
    if k == "embeddings.weight":
        return "model.embed_tokens.weight"
    if k == "norm_f.weight":
        return "model.norm.weight"
    _, n, part, rest = k.split(".", 3)  # layers.{n}.{norm|mixer}.{rest}
    i, second = divmod(int(n), 2)
    if part == "norm":
        return f"model.layers.{i}.{'post_attention_layernorm' if second else 'input_layernorm'}.{rest}"
    if second:
        return f"model.layers.{i}.mlp.{rest}"
    return f"model.layers.{i}.{'linear_attn' if 'in_proj_qkv' in rest or _is_gdn(rest) else 'self_attn'}.{rest}"


def _is_gdn(rest: str) -> bool:
    return rest.split(".")[0] in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias", "A_log",
                                  "norm", "out_proj")


def hf_state_dict(model: HybridLM, hf_keys: set[str]) -> dict[str, torch.Tensor]:
    """The model's tensors under the transformers model's names (zero-centred Qwen norms stored as w - 1)."""
    cfg, out = model.cfg, {}
    for k, t in model.state_dict().items():
        if k.startswith("mtp."):  # not in the transformers model: export_checkpoint appends it (mtp_to_hf)
            continue
        t = t.detach().float().cpu()
        if cfg.family == "qwen3_5":
            name = _qwen_key(k)
            if k.endswith(_ZERO_CENTRED) and ".mixer.norm." not in k:
                t = t - 1.0
        else:
            name = next((p + k for p in ("", "backbone.", "model.") if p + k in hf_keys), k)
        out[name] = t
    missing, unexpected = sorted(hf_keys - set(out)), sorted(set(out) - hf_keys)
    if missing or unexpected:
        raise ValueError(f"export of {cfg.name!r} ({cfg.family}): transformers' model has keys {missing[:6]} we do not "
                         f"fill and we have keys {unexpected[:6]} it does not take; the family mapping of "
                         f"ssmspec/train/export.py needs updating for this transformers version")
    return out


def export_checkpoint(model: HybridLM, out: str | Path, *, tokenizer_dir: str | Path | None = None) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory ``out`` (module doc), with the tokenizer files of
    ``tokenizer_dir`` copied beside it."""
    out = Path(out)
    hf = _hf_model(model.cfg)
    sd = hf_state_dict(model, set(hf.state_dict()))
    hf.load_state_dict(sd, strict=True, assign=True)
    if model.cfg.tie_embeddings:
        hf.tie_weights()
    hf.save_pretrained(str(out))
    _append_weights(out, mtp_to_hf(model))
    if tokenizer_dir is not None:
        for f in sorted(Path(tokenizer_dir).iterdir()):
            if f.is_file():
                shutil.copy2(f, out / f.name)
    return out


def _append_weights(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensors`` to the checkpoint save_pretrained wrote in ``out``: into model.safetensors, or as one more
    shard listed in model.safetensors.index.json."""
    if not tensors:
        return
    import json

    from safetensors.torch import load_file, save_file

    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / "model-mtp.safetensors"),
                  metadata={"format": "pt"})
        data["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    file = out / "model.safetensors"
    merged = {**load_file(str(file)), **tensors}
    save_file({k: t.contiguous() for k, t in merged.items()}, str(file), metadata={"format": "pt"})
