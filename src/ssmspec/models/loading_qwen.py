"""Loading Qwen3.5 (``Qwen3_5ForCausalLM``, and the text part of ``Qwen3_5ForConditionalGeneration``) and
Qwen3-Next (``Qwen3NextForCausalLM``) checkpoints into ``HybridLM`` (Gated DeltaNet blocks ``G``).

Config (transformers 5.23 field names; shared/MODELS.md 1c, 3c, 3d): ``layer_types`` (or
``full_attention_interval``: layer i is full attention iff (i + 1) % interval == 0) picks the token mixer of each
decoder layer, ``G`` (linear_attention) or ``*`` (full_attention); every decoder layer is two blocks here, the
mixer and then its MLP (``-``) or, in Qwen3-Next, its sparse MoE (``E``: where num_experts > 0, (i + 1) %
decoder_sparse_step == 0 and i not in mlp_only_layers). ``model_type`` ``qwen3_5`` keeps the text model in
``text_config``.

Weights: decoder layer i's ``input_layernorm`` / mixer become block 2i, its ``post_attention_layernorm`` /
``mlp`` block 2i + 1. Qwen's zero-centred norms (y = x̂ (1 + w): the block norms, the final norm, q_norm, k_norm)
are stored as 1 + w (the GDN's gated norm is a plain weight and is copied). Qwen3-Next's ``in_proj_qkvz`` and
``in_proj_ba`` are grouped per key head ([q | k | v r heads | z r heads], [b r | a r]) and are split into the
Qwen3.5 layout ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``; per-expert ``gate_proj`` /
``up_proj`` / ``down_proj`` are stacked into ``experts.gate_up_proj`` (E, 2 I, d) and ``experts.down_proj``.
``model.visual.*`` is skipped, as transformers skips it; ``mtp.*``, the multi-token-prediction head, is read when
config.json declares it (``mtp_num_hidden_layers``; ``models/mtp.py``) and skipped otherwise, as transformers does.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from ssmspec.models.checkpoint import DEFAULT_MAX_SEQ_LEN, _first_id, check_state_dict, read_state_dict
from ssmspec.models.config import ModelConfig
from ssmspec.models.model import HybridLM
from ssmspec.models.mtp import keep_declared_head, mtp_config_fields, mtp_from_hf, split_mtp

log = logging.getLogger(__name__)

# model_type -> the transformers class that saves it (loading.supported_architectures lists them)
QWEN_ARCHITECTURES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_text": "Qwen3_5ForCausalLM",
                      "qwen3_next": "Qwen3NextForCausalLM"}
_MIXER = {"linear_attention": "G", "full_attention": "*"}
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
_SKIP = ("mtp.", "model.visual.", "visual.", "model.mtp.")


def is_qwen(raw: dict) -> bool:
    return raw.get("model_type") in QWEN_ARCHITECTURES


def _text(raw: dict) -> dict:
    if raw.get("model_type") == "qwen3_5":
        tc = raw.get("text_config")
        if not isinstance(tc, dict):
            raise ValueError("config.json has model_type qwen3_5 but no text_config object; a Qwen3_5ForConditional"
                             "Generation config keeps the language model's fields there")
        return {**tc, "tie_word_embeddings": raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))}
    return raw


def _req(hf: dict, key: str, name: str):
    if hf.get(key) is None:
        raise ValueError(f"{name}: config.json field {key!r} is missing (a {hf.get('model_type')} config needs it); "
                         f"add the value the checkpoint was saved with, or re-save it with save_pretrained")
    return hf[key]


def qwen_layer_types(hf: dict, name: str) -> list[str]:
    n = int(_req(hf, "num_hidden_layers", name))
    types = hf.get("layer_types")
    if types is None:
        every = int(hf.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    bad = sorted({t for t in types if t not in _MIXER})
    if bad or len(types) != n:
        raise ValueError(f"{name}: layer_types must be {n} entries of linear_attention / full_attention "
                         f"(num_hidden_layers={n}); got {len(types)} entries, unknown {bad}")
    return list(types)


def _moe_layers(hf: dict, n: int) -> list[bool]:
    experts = int(hf.get("num_experts", 0) or 0)
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    only = set(hf.get("mlp_only_layers") or [])
    return [experts > 0 and (i + 1) % step == 0 and i not in only for i in range(n)]


def config_from_qwen(raw: dict, *, name: str = "checkpoint", max_seq_len: int | None = None) -> ModelConfig:
    """Map a Qwen3.5 / Qwen3-Next ``config.json`` to our ``ModelConfig`` (fields named in every error)."""

    hf = _text(raw)
    mt = raw.get("model_type")
    family = "qwen3_next" if mt == "qwen3_next" else "qwen3_5"
    for key in ("hidden_act",):
        if hf.get(key, "silu") != "silu":
            raise ValueError(f"{name}: {key}={hf[key]!r} is not supported; Qwen GDN, MLP and experts use silu")
    types = qwen_layer_types(hf, name)
    moe = _moe_layers(hf, len(types)) if family == "qwen3_next" else [False] * len(types)
    pattern = "".join(_MIXER[t] + ("E" if m else "-") for t, m in zip(types, moe))
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{name}: rope_parameters.rope_type={rope['rope_type']!r} is not supported (default RoPE only)")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    heads = int(_req(hf, "num_attention_heads", name))
    d = int(_req(hf, "hidden_size", name))
    head_dim = int(hf.get("head_dim") or d // heads)
    max_pos = int(hf.get("max_position_embeddings", 4096))
    n_exp = int(hf.get("num_experts", 0) or 0) if family == "qwen3_next" else 0
    if any(moe) and not hf.get("shared_expert_intermediate_size"):
        raise ValueError(f"{name}: shared_expert_intermediate_size is missing or 0; Qwen3-Next MoE blocks have a shared "
                         f"expert")
    return ModelConfig(
        name=name, family=family, d_model=d, pattern=pattern, vocab_size=int(_req(hf, "vocab_size", name)),
        conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
        gdn_k_heads=int(_req(hf, "linear_num_key_heads", name)), gdn_v_heads=int(_req(hf, "linear_num_value_heads", name)),
        gdn_k_dim=int(_req(hf, "linear_key_head_dim", name)), gdn_v_dim=int(_req(hf, "linear_value_head_dim", name)),
        n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads), attn_head_dim=head_dim,
        rope=True, rope_theta=theta, rope_partial=partial, attn_output_gate=bool(hf.get("attn_output_gate", True)),
        attn_qk_norm=True, attn_bias=bool(hf.get("attention_bias", False)),
        mlp_kind="swiglu", d_ff=int(_req(hf, "intermediate_size", name)),
        moe_kind="qwen", n_experts=n_exp, top_k=int(hf.get("num_experts_per_tok", 1)) if n_exp else 1,
        moe_d_ff=int(hf.get("moe_intermediate_size", 64)) if n_exp else 64,
        shared_d_ff=int(hf.get("shared_expert_intermediate_size", 0) or 0) if n_exp else 0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        residual_in_fp32=False, max_seq_len=max_seq_len or min(max_pos, DEFAULT_MAX_SEQ_LEN),
        pad_token_id=_first_id(hf.get("pad_token_id"), 0), bos_token_id=_first_id(hf.get("bos_token_id"), 0),
        eos_token_id=_first_id(hf.get("eos_token_id"), 0), **mtp_config_fields(hf, family))


def _split_qkvz(w_qkvz: Tensor, w_ba: Tensor, cfg: ModelConfig) -> dict[str, Tensor]:
    """Qwen3-Next's per-key-head [q | k | v | z] and [b | a] rows -> the Qwen3.5 split projections."""
    G, H, N, P, d = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim, cfg.d_model
    r = H // G
    if w_qkvz.shape != (G * (2 * N + 2 * r * P), d) or w_ba.shape != (2 * H, d):
        raise ValueError(f"in_proj_qkvz {tuple(w_qkvz.shape)} / in_proj_ba {tuple(w_ba.shape)} do not match the config "
                         f"(expected {(G * (2 * N + 2 * r * P), d)} and {(2 * H, d)}: linear_num_key_heads={G}, "
                         f"linear_num_value_heads={H}, head dims {N}/{P}, hidden {d})")
    q, k, v, z = w_qkvz.view(G, 2 * N + 2 * r * P, d).split([N, N, r * P, r * P], dim=1)
    b, a = w_ba.view(G, 2 * r, d).split([r, r], dim=1)
    return {"in_proj_qkv.weight": torch.cat([q.reshape(G * N, d), k.reshape(G * N, d), v.reshape(H * P, d)]),
            "in_proj_z.weight": z.reshape(H * P, d), "in_proj_b.weight": b.reshape(H, d),
            "in_proj_a.weight": a.reshape(H, d)}


def convert_qwen_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Checkpoint keys -> ``HybridLM`` keys (module doc)."""
    out: dict[str, Tensor] = {}
    fused: dict[int, dict[str, Tensor]] = {}
    experts: dict[tuple[int, str], dict[int, Tensor]] = {}
    for key, t in sd.items():
        k = key
        if k.startswith(_SKIP) or k.endswith("rotary_emb.inv_freq"):
            continue
        for prefix in ("model.language_model.", "language_model.model.", "model."):
            if k.startswith(prefix):
                k = k[len(prefix):]
                break
        if k == "embed_tokens.weight":
            out["embeddings.weight"] = t
            continue
        if k == "norm.weight":
            out["norm_f.weight"] = t.float() + 1.0
            continue
        if k == "lm_head.weight" or not k.startswith("layers."):
            out[k] = t
            continue
        parts = k.split(".")
        if not parts[1].isdigit():
            out[k] = t
            continue
        i, rest = int(parts[1]), parts[2:]
        sub = ".".join(rest[1:])
        if rest[0] == "input_layernorm":
            out[f"layers.{2 * i}.norm.{sub}"] = t.float() + 1.0
        elif rest[0] == "post_attention_layernorm":
            out[f"layers.{2 * i + 1}.norm.{sub}"] = t.float() + 1.0
        elif rest[0] in ("linear_attn", "self_attn"):
            if sub in ("in_proj_qkvz.weight", "in_proj_ba.weight"):
                fused.setdefault(i, {})[sub] = t
            else:
                out[f"layers.{2 * i}.mixer.{sub}"] = t.float() + 1.0 if sub in ("q_norm.weight", "k_norm.weight") else t
        elif rest[0] == "mlp":
            # per-expert weights: mlp.experts.E.{gate,up,down}_proj.weight
            if len(rest) == 5 and rest[1] == "experts" and rest[2].isdigit() and rest[4] == "weight":
                experts.setdefault((i, rest[3]), {})[int(rest[2])] = t
            else:
                out[f"layers.{2 * i + 1}.mixer.{sub}"] = t
        else:
            out[k] = t  # reported as unexpected by check_state_dict
    for i, f in fused.items():
        if set(f) != {"in_proj_qkvz.weight", "in_proj_ba.weight"}:
            raise ValueError(f"layer {i}: linear_attn has {sorted(f)} but Qwen3-Next needs both in_proj_qkvz.weight and "
                             f"in_proj_ba.weight; the checkpoint is incomplete (re-download all shards)")
        for name, w in _split_qkvz(f["in_proj_qkvz.weight"], f["in_proj_ba.weight"], cfg).items():
            out[f"layers.{2 * i}.mixer.{name}"] = w
    layers = sorted({i for i, _ in experts})
    for i in layers:
        per = {p: experts.get((i, p), {}) for p in ("gate_proj", "up_proj", "down_proj")}
        n = len(per["down_proj"])
        for p, got in per.items():
            if sorted(got) != list(range(n)):
                raise ValueError(f"layer {i}: mlp.experts.*.{p}.weight has experts {sorted(got)}, expected 0..{n - 1} "
                                 f"like down_proj; the checkpoint is incomplete (re-download all shards)")
        out[f"layers.{2 * i + 1}.mixer.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per["gate_proj"][e], per["up_proj"][e]]) for e in range(n)])
        out[f"layers.{2 * i + 1}.mixer.experts.down_proj"] = torch.stack([per["down_proj"][e] for e in range(n)])
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_qwen(path: str | os.PathLike, raw: dict, *, device="cpu", dtype: torch.dtype = torch.float32,
              max_seq_len: int | None = None) -> HybridLM:
    """A ``HybridLM`` with the weights of a Qwen3.5 / Qwen3-Next checkpoint directory (``raw``: its config.json)."""

    path = Path(path)
    try:
        cfg = config_from_qwen(raw, name=path.name, max_seq_len=max_seq_len)
    except (TypeError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(path.name):
            raise
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    cfg = cfg.replace(source=f"checkpoint {path}")
    sd, head = split_mtp(read_state_dict(path))
    cfg = keep_declared_head(cfg, head, f"checkpoint {path}")
    sd = convert_qwen_state_dict(sd, cfg)
    if cfg.mtp_layers:  # the multi-token-prediction head the config declares (models/mtp.py)
        sd.update(mtp_from_hf(head, cfg))
    check_state_dict(sd, cfg, where=f"checkpoint {path}")
    with torch.device("meta"):
        model = HybridLM(cfg)
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embeddings.weight
    log.info("loaded %s (%s, %d params) from %s", cfg.name, cfg.family, cfg.num_parameters(), path)
    return model.to(device=device, dtype=dtype).eval()
