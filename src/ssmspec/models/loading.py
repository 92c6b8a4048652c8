"""Checkpoint loading: Hugging Face ``Mamba2ForCausalLM`` / ``NemotronHForCausalLM`` and mamba_ssm
``MambaLMHeadModel`` directories (or hub ids) -> ``HybridLM``. Qwen3.5 / Qwen3-Next (Gated DeltaNet hybrids)
are read by ``loading_qwen.py`` and MambaInLlama by ``loading_mil.py``; ``load_model`` picks the family.

Formats (numbers and field names in shared/MODELS.md, sections 1, 3 and 4):

- HF (``config.json`` with ``model_type`` ``mamba2`` or ``nemotron_h``; weights in ``model.safetensors``,
  sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``). Keys start with ``backbone.``
  (what ``save_pretrained`` writes; transformers 5 renames it to ``model.`` in memory, also accepted).
  NemotronH routed experts are stored one per expert (``experts.{e}.up_proj.weight``) and stacked here
  into the 3-D ``experts.up_proj`` of ``layers.MoE``.
- mamba_ssm (``config.json`` with ``d_model``/``n_layer``/``ssm_cfg``; ``pytorch_model.bin`` or
  safetensors). Same keys as HF Mamba2 except ``backbone.embedding.weight``; every SSM size not in
  ``ssm_cfg`` is mamba_ssm's ``Mamba2`` default; the vocabulary is padded to ``pad_vocab_size_multiple``.

A checkpoint whose keys or shapes disagree with the config read next to it fails with one ``ValueError``
naming the keys (missing, unexpected, mismatched shapes) and the fix.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch
from torch import Tensor

from ssmspec.models.checkpoint import (_RESAVE, DEFAULT_MAX_SEQ_LEN, _first_id, check_state_dict,
                                      read_config_json, read_state_dict)
from ssmspec.models.config import ModelConfig
from ssmspec.models.loading_mil import MIL_CONFIG, load_mil
from ssmspec.models.loading_qwen import QWEN_ARCHITECTURES, config_from_qwen, is_qwen, load_qwen
from ssmspec.models.model import HybridLM
from ssmspec.models.mtp import keep_declared_head, mtp_config_fields, mtp_from_hf, split_mtp

log = logging.getLogger(__name__)

# transformers 5 layer-type names (and their legacy spellings) -> our block characters
_BLOCK_TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                "moe": "E"}
# mamba_ssm.modules.mamba2.Mamba2 constructor defaults ([F], shared/MODELS.md section 3a)
MAMBA_SSM_DEFAULTS = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "chunk_size": 256,
                      "bias": False, "conv_bias": True, "dt_limit": (0.0, math.inf), "rmsnorm": True,
                      "norm_before_gate": False, "D_has_hdim": False, "d_ssm": None, "activation": "swish"}
# mamba_ssm.models.config_mamba.MambaConfig defaults
MAMBA_SSM_MODEL_DEFAULTS = {"d_intermediate": 0, "vocab_size": 50277, "attn_layer_idx": [], "rms_norm": True,
                            "residual_in_fp32": True, "pad_vocab_size_multiple": 8, "tie_embeddings": True}
# KV-cache length allocated when the checkpoint advertises more (262144 for Nemotron-3-Nano); override
# with load_model(..., max_seq_len=...)
_IGNORED_PREFIXES = ("mtp.",)  # an MTP head the config does not declare (load_model reads a declared one: models/mtp.py)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# config ----------------------------------------------------------------------------------------
# config.json fields that size the model (top level, and mamba_ssm's ssm_cfg): a value must be an integer >= 1
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_heads", "head_dim", "state_size", "n_groups", "num_hidden_layers",
                "conv_kernel", "chunk_size", "num_attention_heads", "num_key_value_heads", "attention_head_dim",
                "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "mamba_n_groups",
                "mamba_d_conv", "mamba_chunk_size", "moe_intermediate_size", "n_group", "topk_group",
                "num_experts_per_tok", "max_position_embeddings", "d_model", "n_layer", "pad_vocab_size_multiple",
                "d_state", "d_conv", "expand", "headdim", "ngroups")


def _check_sizes(raw: dict, file: Path) -> None:
    for where, node in (("", raw), ("ssm_cfg.", raw.get("ssm_cfg") or {})):
        for key in _SIZE_FIELDS:
            value = node.get(key) if isinstance(node, dict) else None
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{file}: field {where}{key} must be an integer >= 1, got {value!r}; fix config.json "
                                 f"or {_RESAVE}")


def _pick(hf: dict, *names, default=None):
    """First present, non-None field among ``names`` (current name first, then legacy aliases)."""
    for n in names:
        if hf.get(n) is not None:
            return hf[n]
    return default


def config_from_hf(hf: dict, *, name: str = "checkpoint", max_seq_len: int | None = None) -> ModelConfig:
    """Map a transformers ``config.json`` (a ``model_type`` of ``HF_FAMILIES`` or a Qwen one) to our
    ``ModelConfig``."""
    if is_qwen(hf):
        return config_from_qwen(hf, name=name, max_seq_len=max_seq_len)
    family = HF_FAMILIES.get(hf.get("model_type"))
    if family is None:
        raise ValueError(unsupported_message(hf, name))
    common = {"name": name, "vocab_size": int(hf["vocab_size"]), "d_model": int(hf["hidden_size"]),
              "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
              "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
              "pad_token_id": _first_id(hf.get("pad_token_id"), 0),
              "bos_token_id": _first_id(hf.get("bos_token_id"), 0),
              "eos_token_id": _first_id(hf.get("eos_token_id"), 0)}
    return family[1](hf, common, name=name, max_seq_len=max_seq_len)


def _mamba2_config(hf: dict, common: dict, *, name: str, max_seq_len: int | None) -> ModelConfig:
    heads, hd, hidden = int(hf["num_heads"]), int(hf["head_dim"]), int(hf["hidden_size"])
    if hidden * hf.get("expand", 2) != heads * hd:  # transformers' validate_architecture
        raise ValueError(f"{name}: hidden_size*expand ({hidden}*{hf.get('expand', 2)}) != num_heads*head_dim "
                         f"({heads}*{hd}) in config.json; fix the config so the two agree")
    lo, hi = hf.get("time_step_limit", (0.0, math.inf))
    return ModelConfig(**common, family="mamba2", pattern="M" * int(hf["num_hidden_layers"]),
                       ssm_heads=heads, head_dim=hd, state_size=int(hf["state_size"]),
                       n_groups=int(hf.get("n_groups", 8)), conv_kernel=int(hf.get("conv_kernel", 4)),
                       chunk_size=int(hf.get("chunk_size", 256)), dt_min_limit=float(lo), dt_max_limit=float(hi),
                       conv_bias=bool(hf.get("use_conv_bias", True)), proj_bias=bool(hf.get("use_bias", False)),
                       mamba_activation=hf.get("hidden_act", "silu"),
                       residual_in_fp32=bool(hf.get("residual_in_fp32", True)),
                       max_seq_len=max_seq_len or 4096, **mtp_config_fields(hf, "mamba2"))


def _nemotron_h_pattern(hf: dict, name: str) -> str:
    types = _pick(hf, "layers_block_type", "layer_types")
    if types is not None:
        bad = sorted({t for t in types if t not in _BLOCK_TYPES})
        if bad:
            raise ValueError(f"{name}: unknown layers_block_type entries {bad}; expected {sorted(_BLOCK_TYPES)}")
        return "".join(_BLOCK_TYPES[t] for t in types)
    pattern = hf.get("hybrid_override_pattern")
    if not pattern:
        raise ValueError(f"{name}: config.json has neither layers_block_type nor hybrid_override_pattern; "
                         f"add one (e.g. hybrid_override_pattern: \"M-M*-\")")
    return pattern


def _nemotron_h_config(hf: dict, common: dict, *, name: str, max_seq_len: int | None) -> ModelConfig:
    if hf.get("moe_latent_size") is not None:
        raise ValueError(f"{name}: moe_latent_size (latent MoE projections) is not supported by HybridLM")
    if hf.get("mlp_bias"):
        raise ValueError(f"{name}: mlp_bias=true is not supported by HybridLM (MLPs have no bias)")
    act = hf.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"{name}: mlp_hidden_act {act!r} is not supported; NemotronH MLPs/experts are relu2")
    heads = int(hf.get("num_attention_heads", 32))
    # transformers 5 reads head_dim (default 128); hub configs spell it attention_head_dim
    attn_hd = int(_pick(hf, "head_dim", "attention_head_dim", default=128))
    max_pos = int(hf.get("max_position_embeddings", 4096))
    return ModelConfig(
        **common, family="nemotron_h", pattern=_nemotron_h_pattern(hf, name),
        ssm_heads=int(hf.get("mamba_num_heads", 128)), head_dim=int(hf.get("mamba_head_dim", 64)),
        state_size=int(hf.get("ssm_state_size", 128)), n_groups=int(_pick(hf, "n_groups", "mamba_n_groups", default=8)),
        conv_kernel=int(_pick(hf, "conv_kernel", "mamba_d_conv", default=4)),
        chunk_size=int(_pick(hf, "chunk_size", "mamba_chunk_size", default=128)),
        # transformers clamps dt to (time_step_min, inf) in the chunk scan (and not in its 1-token decode
        # path, shared/MODELS.md 1b); we clamp in every path
        dt_min_limit=float(_pick(hf, "time_step_min", "mamba_dt_min", default=1e-3)), dt_max_limit=math.inf,
        conv_bias=bool(_pick(hf, "use_conv_bias", "mamba_conv_bias", default=True)),
        proj_bias=bool(hf.get("use_bias", False)),  # transformers builds in_proj/out_proj with use_bias
        mamba_activation=hf.get("mamba_hidden_act", "silu"),
        n_heads=heads, n_kv_heads=int(_pick(hf, "num_key_value_heads", default=heads)), attn_head_dim=attn_hd,
        rope=False, attn_bias=bool(hf.get("attention_bias", False)),
        mlp_kind="relu2", d_ff=int(hf.get("intermediate_size", 21504)),
        n_experts=int(hf.get("n_routed_experts", 8)), top_k=int(hf.get("num_experts_per_tok", 2)),
        moe_d_ff=int(hf.get("moe_intermediate_size", 7688)),
        shared_d_ff=int(hf.get("moe_shared_expert_intermediate_size", 7688)),
        routed_scaling=float(hf.get("routed_scaling_factor", 1.0)), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        n_expert_groups=int(hf.get("n_group", 1)), topk_groups=int(hf.get("topk_group", 1)),
        # NemotronHBlock adds the residual in the activation dtype whatever residual_in_fp32 says
        residual_in_fp32=False,
        max_seq_len=max_seq_len or min(max_pos, DEFAULT_MAX_SEQ_LEN), **mtp_config_fields(hf, "nemotron_h"))


# model_type -> (the transformers class that saves it, the mapper of its config.json). config_from_hf
# dispatches on this table and supported_architectures() lists it, so the two cannot disagree.
HF_FAMILIES = {"mamba2": ("Mamba2ForCausalLM", _mamba2_config),
               "nemotron_h": ("NemotronHForCausalLM", _nemotron_h_config)}
MAMBA_SSM_KEYS = ("d_model", "n_layer")  # a config.json without model_type but with these is mamba_ssm's


def supported_architectures() -> list[str]:
    """What ``load_model`` reads, one entry per checkpoint kind, taken from the loaders' dispatch tables."""

    hf = {**{mt: cls for mt, (cls, _) in HF_FAMILIES.items()}, **QWEN_ARCHITECTURES}
    return [f"{cls} (model_type {mt})" for mt, cls in hf.items()] + [
        f"mamba_ssm MambaLMHeadModel (config.json with {' and '.join(MAMBA_SSM_KEYS)}, no model_type)",
        f"MambaInLlama (a llama config.json plus {MIL_CONFIG})"]


def unsupported_message(raw: dict, where: str) -> str:
    """``where`` holds an architecture load_model does not read: name it, every supported one and the fix."""

    mt, archs = raw.get("model_type"), raw.get("architectures")
    names = f" ({', '.join(map(str, archs))})" if isinstance(archs, list) and archs else ""
    if mt is None:
        found = f"has no model_type{names} and is no mamba_ssm config ({', '.join(MAMBA_SSM_KEYS)})"
    else:
        found = f"model_type {mt!r}{names} is not an architecture load_model reads"
    hint = f" (a MambaInLlama checkpoint also holds {MIL_CONFIG}; this one has none)" if mt == "llama" else ""
    return (f"{where}: {found}{hint}. load_model reads: {'; '.join(supported_architectures())}. Point it at "
            f"a checkpoint of one of these")


def config_from_mamba_ssm(raw: dict, *, name: str = "checkpoint", max_seq_len: int | None = None) -> ModelConfig:
    """Map a mamba_ssm ``MambaConfig`` (config.json of ``MambaLMHeadModel``) to our ``ModelConfig``."""
    m = {**MAMBA_SSM_MODEL_DEFAULTS, **raw}
    ssm = {**MAMBA_SSM_DEFAULTS, **(m.get("ssm_cfg") or {})}
    layer = ssm.pop("layer", "Mamba1")  # mamba_ssm's MambaLMHeadModel defaults to Mamba-1
    unsupported = []
    if layer != "Mamba2":
        unsupported.append(f"ssm_cfg.layer={layer!r} (only Mamba2 mixers)")
    if m["attn_layer_idx"]:
        unsupported.append("attn_layer_idx (mamba_ssm MHA blocks)")
    if m["d_intermediate"]:
        unsupported.append("d_intermediate > 0 (mamba_ssm GatedMLP blocks)")
    if not m["rms_norm"]:
        unsupported.append("rms_norm=false (LayerNorm)")
    if not ssm["rmsnorm"] or ssm["norm_before_gate"] or ssm["D_has_hdim"]:
        unsupported.append("ssm_cfg rmsnorm=false / norm_before_gate=true / D_has_hdim=true")
    d_model, expand, headdim = int(m["d_model"]), int(ssm["expand"]), int(ssm["headdim"])
    d_inner = expand * d_model
    if ssm["d_ssm"] not in (None, d_inner):
        unsupported.append("ssm_cfg.d_ssm != expand*d_model (in_proj MLP part)")
    if unsupported:
        raise ValueError(f"{name}: mamba_ssm checkpoint uses {'; '.join(unsupported)}, which HybridLM does not "
                         f"implement; convert it to a supported layout or use a pure-Mamba2 checkpoint")
    vocab, mult = int(m["vocab_size"]), int(m["pad_vocab_size_multiple"])
    if mult > 1 and vocab % mult:
        vocab += mult - vocab % mult  # MambaLMHeadModel pads the embedding rows
    lo, hi = ssm["dt_limit"]
    act = "silu" if ssm["activation"] in ("swish", "silu") else ssm["activation"]
    return ModelConfig(name=name, family="mamba2", d_model=d_model, pattern="M" * int(m["n_layer"]),
                       vocab_size=vocab, ssm_heads=d_inner // headdim, head_dim=headdim,
                       state_size=int(ssm["d_state"]), n_groups=int(ssm["ngroups"]), conv_kernel=int(ssm["d_conv"]),
                       chunk_size=int(ssm["chunk_size"]), dt_min_limit=float(lo), dt_max_limit=float(hi),
                       conv_bias=bool(ssm["conv_bias"]), proj_bias=bool(ssm["bias"]), mamba_activation=act,
                       norm_eps=float(m.get("norm_epsilon", 1e-5)), tie_embeddings=bool(m["tie_embeddings"]),
                       residual_in_fp32=bool(m["residual_in_fp32"]), max_seq_len=max_seq_len or 4096,
                       pad_token_id=0, bos_token_id=0, eos_token_id=0)


def checkpoint_format(raw: dict, where: str = "config.json") -> str:
    """``hf`` or ``mamba_ssm`` from a decoded config.json; any other architecture raises, naming it."""
    if "model_type" in raw:
        if raw["model_type"] not in HF_FAMILIES and not is_qwen(raw):
            raise ValueError(unsupported_message(raw, where))
        return "hf"
    if all(k in raw for k in MAMBA_SSM_KEYS):
        return "mamba_ssm"
    raise ValueError(unsupported_message(raw, where))


def config_from_checkpoint(path: str | os.PathLike, *, max_seq_len: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint directory (either format)."""
    raw = read_config_json(path)
    name, file = Path(path).name, Path(path) / "config.json"
    fmt = checkpoint_format(raw, str(file))  # an unsupported architecture, before its fields are read
    _check_sizes(raw, file)
    try:
        if fmt == "hf":
            cfg = config_from_hf(raw, name=name, max_seq_len=max_seq_len)
        else:
            cfg = config_from_mamba_ssm(raw, name=name, max_seq_len=max_seq_len)
    except KeyError as e:  # a field the format requires (e.g. vocab_size)
        kind = raw.get("model_type", "mamba_ssm")
        raise ValueError(f"{file}: field {e.args[0]!r} is missing (a {kind} config.json needs it); add the value the "
                         f"checkpoint was saved with, or {_RESAVE}") from None
    except (TypeError, ZeroDivisionError) as e:  # a field of the wrong type that the size check does not cover
        raise ValueError(f"{file}: a field has a value of the wrong type ({e}); fix config.json or {_RESAVE}") from None
    return cfg.replace(source=f"checkpoint {path}")


def convert_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Checkpoint keys -> ``HybridLM`` keys: strip ``backbone.``/``model.``, rename mamba_ssm's
    ``embedding``, stack per-expert NemotronH weights into (E, ...) tensors, drop a tied ``lm_head``
    and keys transformers ignores too (``mtp.*``, rotary buffers)."""
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    for key, t in sd.items():
        k = key
        for prefix in ("backbone.", "model."):
            if k.startswith(prefix):
                k = k[len(prefix):]
                break
        if k.startswith(_IGNORED_PREFIXES) or k.endswith(_IGNORED_SUFFIXES):
            continue
        if k == "embedding.weight":
            k = "embeddings.weight"
        parts = k.split(".")
        # layers.N.mixer.experts.E.{up,down}_proj.weight -> layers.N.mixer.experts.{up,down}_proj[E]
        if len(parts) == 7 and parts[3] == "experts" and parts[4].isdigit() and parts[6] == "weight":
            experts.setdefault((".".join(parts[:4]), parts[5]), {})[int(parts[4])] = t
            continue
        out[k] = t
    for (base, proj), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"checkpoint has experts {sorted(per)} under {base}.*.{proj}: expert indices must be "
                             f"0..E-1; the checkpoint is incomplete (re-download all shards)")
        out[f"{base}.{proj}"] = torch.stack([per[e] for e in range(len(per))])  # (E, out, in)
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)  # same matrix as the embedding (mamba_ssm saves both)
    return out


# entry point ------------------------------------------------------------------------------------
def resolve_checkpoint(path_or_hub_id: str | os.PathLike) -> Path:
    """A local checkpoint directory: the path itself, or a hub snapshot fetched via huggingface_hub."""
    p = Path(path_or_hub_id).expanduser()
    if p.is_dir():
        return p
    ref = str(path_or_hub_id)
    if p.exists() or ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        raise ValueError(f"checkpoint {ref!r} is not a directory nor a hub id (owner/name); pass the directory "
                         f"that holds config.json and the weights")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        return Path(snapshot_download(ref, local_files_only=offline,
                                      allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"]))
    except Exception as err:  # noqa: BLE001  (offline, unreachable hub, gated or unknown repo)
        raise ValueError(
            f"{ref!r} is no local directory, and fetching it from the Hugging Face hub failed "
            f"({type(err).__name__}: {str(err)[:300]}). Without hub access, "
            f"download it on a machine with network (`huggingface-cli download {ref} --local-dir DIR`), copy DIR "
            f"here and pass its local path: load_model('DIR')") from None


def load_model(path_or_hub_id: str | os.PathLike, *, device="cpu", dtype: torch.dtype = torch.float32,
               max_seq_len: int | None = None) -> HybridLM:
    """A ``HybridLM`` with the weights of a Mamba2 / NemotronH / Qwen3.5 / Qwen3-Next (HF) or mamba_ssm checkpoint.

    ``path_or_hub_id``: a directory with config.json + weights, or a hub id (needs network or the local
    hub cache). ``dtype``: parameter dtype (the router's correction bias stays fp32, as in
    transformers). ``max_seq_len``: KV-cache slots for attention blocks (default: the checkpoint's
    max_position_embeddings, at most 8192). ``model.cfg.source`` records the directory, which
    ``ssmspec.data.load_tokenizer`` uses to find the checkpoint's tokenizer.
    """
    path = resolve_checkpoint(path_or_hub_id)
    if (path / "mamba_config.json").is_file():  # MambaInLlama: Llama config.json + mamba_config.json
        return load_mil(path, device=device, dtype=dtype, max_seq_len=max_seq_len)
    raw = read_config_json(path)
    if is_qwen(raw):  # Qwen3.5 / Qwen3-Next: Gated DeltaNet hybrids
        _check_sizes(raw, path / "config.json")
        return load_qwen(path, raw, device=device, dtype=dtype, max_seq_len=max_seq_len)
    cfg = config_from_checkpoint(path, max_seq_len=max_seq_len)
    sd, head = split_mtp(read_state_dict(path))
    cfg = keep_declared_head(cfg, head, f"checkpoint {path}")
    sd = convert_state_dict(sd, cfg)
    if cfg.mtp_layers:  # the multi-token-prediction head the config declares (models/mtp.py)
        sd.update(mtp_from_hf(head, cfg))
    check_state_dict(sd, cfg, where=f"checkpoint {path}")
    with torch.device("meta"):
        model = HybridLM(cfg)
    model.load_state_dict(sd, strict=False, assign=True)  # keys were checked above; tied lm_head is absent
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embeddings.weight
    model = model.to(device=device, dtype=dtype)
    for block in model.blocks():
        if block.kind == "E":
            block.mixer.gate.e_score_correction_bias.data = block.mixer.gate.e_score_correction_bias.float()
    log.info("loaded %s (%s, %d params) from %s", cfg.name, cfg.family, cfg.num_parameters(), path)
    return model.eval()


def checkpoint_dir(model_or_cfg) -> Path | None:
    """The directory a model was loaded from (``load_model`` records it in ``cfg.source``); None for a
    model with random weights."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    prefix = "checkpoint "
    if isinstance(cfg.source, str) and cfg.source.startswith(prefix):
        return Path(cfg.source[len(prefix):])
    return None
