"""The multi-token-prediction (MTP) head that Qwen3.5, Qwen3-Next and Nemotron-3 checkpoints ship, in the
Qwen3-Next / Qwen3.5 form (vLLM's ``Qwen3NextMultiTokenPredictor``; Nemotron-H's ``NemotronHMTP`` is the same
computation under other names):

    u_t = fc([RMSNorm_e(embed(x_{t+1})) ; RMSNorm_h(h_t)])     fc: Linear(2d -> d), no bias
    g_t = norm(blocks(u_t))                                    one decoder layer: attention + MLP (or MoE)
    logits_t = lm_head(g_t)  ->  token t + 2

``h_t`` is the target's final hidden state at position t *after* its final norm (what the target's forward hands
its LM head, and what vLLM feeds its MTP drafts), ``x_{t+1}`` the token after it; the head shares the target's
embedding and LM head. Chaining (the ``mtp`` drafter, ``drafting/mtp.py``): draft k + 1 comes from the head's own
``g`` of draft k and the embedding of draft k. The blocks are the model's own (``Block``: pre-norm residual,
attention with its KV cache and RoPE at position t, MLP / MoE of the target's kind), from ``cfg.mtp_pattern``.

Checkpoint names (``mtp_from_hf`` / ``mtp_to_hf``; the ``mtp.`` prefix stripped):

    Qwen form (qwen3_5, qwen3_next, and our mamba2 exports)      Nemotron form (nemotron_h)
    fc.weight                                                    layers.0.eh_proj.weight
    pre_fc_norm_embedding.weight / pre_fc_norm_hidden.weight     layers.0.enorm.weight / layers.0.hnorm.weight
    norm.weight                                                  layers.{last}.final_layernorm.weight
    layers.0.input_layernorm / self_attn.*                       layers.{j}.norm / layers.{j}.mixer.* (block j)
    layers.0.post_attention_layernorm / mlp.*

Qwen's norms are zero-centred (y = x̂ (1 + w), stored as w; kept here as 1 + w like the rest of the Qwen model).
Routed experts stored one per expert are stacked as the loaders stack the model's own.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.layers import RMSNorm
from ssmspec.models.model import Block

log = logging.getLogger(__name__)

MTP_PREFIXES = ("mtp.", "model.mtp.", "backbone.mtp.", "model.language_model.mtp.")  # where checkpoints keep it
_ZERO_CENTRED = ("qwen3_5", "qwen3_next")
_TOP = {"fc.weight": "fc.weight", "pre_fc_norm_embedding.weight": "pre_fc_norm_embedding.weight",
        "pre_fc_norm_hidden.weight": "pre_fc_norm_hidden.weight", "norm.weight": "norm.weight"}
_NEMOTRON_START = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
                   "hnorm.weight": "pre_fc_norm_hidden.weight"}
_QWEN_PART = {"input_layernorm": (0, "norm"), "self_attn": (0, "mixer"), "post_attention_layernorm": (1, "norm"),
              "mlp": (1, "mixer")}


class MTPHead(nn.Module):
    """The head of ``cfg`` (``cfg.mtp_layers`` x ``cfg.mtp_pattern`` blocks; module doc). Attention blocks are
    numbered among the head's own (index into the ``RunContext.kv`` its caller passes)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.pre_fc_norm_embedding = RMSNorm(d, cfg.norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(d, cfg.norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        kinds = cfg.mtp_pattern * cfg.mtp_layers
        self.blocks = nn.ModuleList(Block(cfg, k, kinds[:j].count("*")) for j, k in enumerate(kinds))
        self.norm = RMSNorm(d, cfg.norm_eps)

    @property
    def attention_blocks(self) -> int:
        return sum(b.kind == "*" for b in self.blocks)

    def forward(self, emb: Tensor, hidden: Tensor, ctx) -> Tensor:
        """emb (B', L, d) embeddings of tokens t + 1, hidden (B', L, d) the final hidden states at t (module doc)
        -> (B', L, d) the head's output after its final norm, in the model dtype; ``ctx`` carries the head's KV
        caches (or training attention) and the call's positions."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, ctx)
        return self.norm.add(x, residual, residual_in_fp32=self.cfg.residual_in_fp32)[0]


def mtp_hidden(model, ids: Tensor, hidden: Tensor, ctx) -> Tensor:
    """The head of ``model`` on tokens ids (B', L) (each the token after its hidden state) and hidden (B', L, d)
    -> (B', L, d); ``model.logits`` of it predicts the token after each of ``ids``."""
    return model.mtp(model.embeddings(ids), hidden.to(model.dtype), ctx)


# config.json ----------------------------------------------------------------------------------------------
def mtp_config_fields(hf: dict, family: str) -> dict:
    """``ModelConfig`` fields of the head a config.json declares ({} for none): Qwen ``mtp_num_hidden_layers``
    (its layer is attention + the MLP, or MoE where layer 0 of the model has one), Nemotron-H
    ``num_nextn_predict_layers`` with ``mtp_layers_block_type`` / ``mtp_hybrid_override_pattern`` (transformers'
    default ``*E``); our mamba2 exports add ``mtp_config`` with the attention and MLP sizes of the head."""
    if family == "nemotron_h":
        n = int(hf.get("num_nextn_predict_layers") or 0)
        if not n:
            return {}
        types = hf.get("mtp_layers_block_type")
        names = {"full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
        if types:
            bad = sorted({t for t in types if t not in names})
            if bad:
                raise ValueError(f"mtp_layers_block_type has unknown entries {bad}; expected {sorted(names)}")
            pattern = "".join(names[t] for t in types)
        else:
            pattern = hf.get("mtp_hybrid_override_pattern") or "*E"
        return {"mtp_layers": n, "mtp_pattern": pattern}
    n = int(hf.get("mtp_num_hidden_layers") or 0)
    if not n:
        return {}
    if family == "mamba2":
        sizes = hf.get("mtp_config") or {}
        return {"mtp_layers": n, "mtp_pattern": hf.get("mtp_hybrid_override_pattern") or "*-",
                "n_heads": int(sizes.get("num_attention_heads", 4)),
                "n_kv_heads": int(sizes.get("num_key_value_heads", 2)),
                "attn_head_dim": int(sizes.get("head_dim", 16)), "d_ff": int(sizes.get("intermediate_size", 128)),
                "mlp_kind": sizes.get("mlp_hidden_act", "relu2")}
    step, only = int(hf.get("decoder_sparse_step", 1) or 1), set(hf.get("mlp_only_layers") or [])
    moe = family == "qwen3_next" and int(hf.get("num_experts", 0) or 0) > 0 and 1 % step == 0 and 0 not in only
    return {"mtp_layers": n, "mtp_pattern": "*E" if moe else "*-"}


def mtp_hf_fields(cfg: ModelConfig) -> dict:
    """The config.json fields that declare ``cfg``'s head for its family's exporter (inverse of
    ``mtp_config_fields``; {} without a head)."""
    if not cfg.mtp_layers:
        return {}
    if cfg.family == "nemotron_h":
        return {"num_nextn_predict_layers": cfg.mtp_layers, "mtp_hybrid_override_pattern": cfg.mtp_pattern}
    out = {"mtp_num_hidden_layers": cfg.mtp_layers}
    if cfg.family == "mamba2":
        out.update(mtp_hybrid_override_pattern=cfg.mtp_pattern,
                   mtp_config={"num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
                               "head_dim": cfg.attn_head_dim, "intermediate_size": cfg.d_ff,
                               "mlp_hidden_act": cfg.mlp_kind})
    return out


# weights --------------------------------------------------------------------------------------------------
def split_mtp(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A checkpoint's tensors -> (the model's, the head's with its prefix stripped)."""
    rest, head = {}, {}
    for k, t in sd.items():
        pre = next((p for p in MTP_PREFIXES if k.startswith(p)), None)
        if pre is None:
            rest[k] = t
        else:
            head[k[len(pre):]] = t
    return rest, head


def keep_declared_head(cfg: ModelConfig, head: dict[str, Tensor], where: str) -> ModelConfig:
    """A config that declares a head whose checkpoint holds no ``mtp.*`` tensor at all (transformers' save_pretrained
    drops them) loads without one; a partial head is left to the key check, which names what is missing."""
    if cfg.mtp_layers and not head:
        log.info("%s declares %d MTP layer(s) but holds no mtp.* weights: loaded without the head", where,
                 cfg.mtp_layers)
        return cfg.replace(mtp_layers=0)
    return cfg


def _qwen_form(cfg: ModelConfig) -> None:
    if cfg.mtp_layers and (len(cfg.mtp_pattern) != 2 or cfg.mtp_pattern[0] != "*"):
        raise ValueError(f"model {cfg.name!r}: a {cfg.family} MTP layer is attention then an MLP or MoE (mtp_pattern "
                         f"*- or *E), got {cfg.mtp_pattern!r}")


def mtp_from_hf(head: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The head's checkpoint tensors (prefix stripped; module doc) -> ``HybridLM`` keys ``mtp.*``. Names the loader
    does not know are kept under ``mtp.`` so the key check reports them as unexpected."""
    nemotron, zc = cfg.family == "nemotron_h", cfg.family in _ZERO_CENTRED
    if not nemotron:
        _qwen_form(cfg)
    last = len(cfg.mtp_pattern) * cfg.mtp_layers - 1
    out: dict[str, Tensor] = {}
    experts: dict[tuple[str, str], dict[int, Tensor]] = {}
    for k, t in head.items():
        parts = k.split(".")
        name, shift = None, False
        if not nemotron and k in _TOP:
            name, shift = _TOP[k], zc and k != "fc.weight"
        elif len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit():
            i, part, sub = int(parts[1]), parts[2], ".".join(parts[3:])
            if nemotron and part in ("norm", "mixer"):
                name = f"blocks.{i}.{part}.{sub}"
            elif nemotron and i == 0 and f"{part}.{sub}" in _NEMOTRON_START:
                name = _NEMOTRON_START[f"{part}.{sub}"]
            elif nemotron and i == last and part == "final_layernorm" and sub == "weight":
                name = "norm.weight"
            elif not nemotron and part in _QWEN_PART:
                second, kind = _QWEN_PART[part]
                name = f"blocks.{2 * i + second}.{kind}.{sub}"
                shift = zc and (kind == "norm" or sub in ("q_norm.weight", "k_norm.weight"))
        if name is not None:  # routed experts one per expert: blocks.J.mixer.experts.E.PROJ.weight
            p = name.split(".")
            if len(p) == 7 and p[3] == "experts" and p[4].isdigit() and p[6] == "weight":
                experts.setdefault((".".join(p[:4]), p[5]), {})[int(p[4])] = t
                continue
        out["mtp." + (name or k)] = t.float() + 1.0 if shift else t
    for (base, proj), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"checkpoint has MTP experts {sorted(per)} under {base}.*.{proj}: expert indices must be "
                             f"0..E-1; the checkpoint is incomplete (re-download all shards)")
        out[f"mtp.{base}.{proj}"] = torch.stack([per[e] for e in range(len(per))])  # (E, out, in)
    if cfg.moe_kind == "qwen":  # Qwen experts: gate_proj and up_proj stacked as one gate_up_proj
        for base in sorted({k[:-len(".gate_proj")] for k in out if k.endswith("experts.gate_proj")}):
            if f"{base}.up_proj" in out:
                out[f"{base}.gate_up_proj"] = torch.cat([out.pop(f"{base}.gate_proj"), out.pop(f"{base}.up_proj")], 1)
    return out


def mtp_to_hf(model) -> dict[str, Tensor]:
    """``model``'s head as checkpoint tensors under their family's names with the ``mtp.`` prefix (inverse of
    ``mtp_from_hf``; fp32 on the CPU). Routed experts are not exported (the trainer trains none)."""
    cfg = model.cfg
    if model.mtp is None:
        return {}
    nemotron, zc = cfg.family == "nemotron_h", cfg.family in _ZERO_CENTRED
    if not nemotron:
        _qwen_form(cfg)
    last = len(model.mtp.blocks) - 1
    inverse = {v: k for k, v in _NEMOTRON_START.items()}
    out = {}
    for k, t in model.mtp.state_dict().items():
        t, parts = t.detach().float().cpu(), k.split(".")
        if "experts" in parts:
            raise ValueError(f"model {cfg.name!r}: MoE blocks in the MTP head (mtp_pattern {cfg.mtp_pattern!r}) are not "
                             f"exported; use an MLP (*-)")
        if parts[0] != "blocks":
            name = (f"layers.0.{inverse[k]}" if k in inverse else f"layers.{last}.final_layernorm.weight") if nemotron else k
            shift = zc and k != "fc.weight"
        else:
            j, part, sub = int(parts[1]), parts[2], ".".join(parts[3:])
            if nemotron:
                name = k.replace("blocks.", "layers.", 1)
            else:
                layer = {(0, "norm"): "input_layernorm", (0, "mixer"): "self_attn",
                         (1, "norm"): "post_attention_layernorm", (1, "mixer"): "mlp"}[(j % 2, part)]
                name = f"layers.{j // 2}.{layer}.{sub}"
            shift = zc and (part == "norm" or sub in ("q_norm.weight", "k_norm.weight"))
        out["mtp." + name] = t - 1.0 if shift else t
    return out
