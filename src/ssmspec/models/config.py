"""Model configuration: one frozen dataclass for pure Mamba-2 and its attention hybrids.

A model is a stack of pre-norm residual blocks, one mixer per block, named by one character each as
Nemotron-H writes its ``hybrid_override_pattern``:

    M  Mamba-2 mixer        *  attention (GQA, optional RoPE)
    -  MLP (relu² or SwiGLU) E  mixture of experts (top-k routing, optional shared expert)
    G  Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 ``linear_attention``; ``models/gdn.py``)

Pure Mamba-2 is ``"M" * n_layer``; a Llama-style hybrid (MambaInLlama) is ``"M-*-M-*-..."`` with a
SwiGLU MLP. A Qwen3.5 / Qwen3-Next decoder layer (token mixer, then MLP or MoE, each pre-normed) is two
blocks: ``"G-G-G-*-"`` (Qwen3.5, dense SwiGLU) or ``"GEGEGE*E"`` (Qwen3-Next, MoE in every layer) with
``attn_output_gate``, ``attn_qk_norm`` and a partial rotary ``rope_partial``; their zero-centred norms
(1 + w) are stored as plain weights (the loader adds the 1), so the block norm is the same RMSNorm. The published sizes live in ``conf/model/<preset>.yaml`` (numbers in shared/MODELS.md);
``load_preset`` reads them so that the Hydra config group and the Python API share one source.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import yaml

from ssmspec.paths import CONF_DIR

MIXER_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "G": "gdn"}
FAMILIES = ("mamba2", "nemotron_h", "mamba_in_llama", "qwen3_5", "qwen3_next")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"  # preset name, recorded in every result row
    family: str = "mamba2"  # checkpoint family: mamba2 | nemotron_h | mamba_in_llama | qwen3_5 | qwen3_next (loader)
    d_model: int = 64  # residual stream width
    pattern: str = "MM"  # one character per block, see module docstring
    vocab_size: int = 512  # rows of the embedding (padded size for mamba_ssm checkpoints)
    # Mamba-2 mixer (seed 000 writes v, k, q for x, B, C)
    ssm_heads: int = 4  # H
    head_dim: int = 32  # P; d_inner I = H * P
    state_size: int = 16  # N
    n_groups: int = 1  # G; B and C are shared by H / G heads; gated RMSNorm is group-wise too
    conv_kernel: int = 4  # width of the causal depthwise conv over xBC
    chunk_size: int = 256  # chunk length of the SSD prefill scan
    dt_min_limit: float = 0.0  # dt is clamped to [dt_min_limit, dt_max_limit] after softplus
    dt_max_limit: float = math.inf
    conv_bias: bool = True  # conv1d has a bias
    proj_bias: bool = False  # in_proj / out_proj have biases
    mamba_activation: str = "silu"  # activation after the conv
    d_xb: int = 0  # MambaInLlama: width of x and of B before their GQA-style repeat to H heads / G groups (0: none)
    # attention
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (GQA)
    attn_head_dim: int = 16  # per-head width of q, k, v
    rope: bool = False  # rotary embeddings (Nemotron-H has none; Llama-style hybrids do)
    rope_theta: float = 10000.0
    # Llama 3.1 "llama3" RoPE scaling (transformers' rope_scaling): low frequencies divided by the factor
    rope_scaling_factor: float = 1.0  # 1: plain RoPE
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192  # original_max_position_embeddings
    attn_bias: bool = False
    rope_partial: float = 1.0  # fraction of attn_head_dim that is rotated (Qwen3-Next / Qwen3.5: 0.25)
    attn_output_gate: bool = False  # q_proj also emits a per-head gate: out * sigmoid(gate) before o_proj (Qwen)
    attn_qk_norm: bool = False  # RMSNorm of every q and k head over attn_head_dim before RoPE (Qwen)
    # Gated DeltaNet mixer (G blocks; conv_kernel is shared with Mamba-2). Seed 000 writes q, k, v as here
    gdn_k_heads: int = 2  # G: key heads (linear_num_key_heads)
    gdn_v_heads: int = 4  # H: value heads (linear_num_value_heads), a multiple of G
    gdn_k_dim: int = 16  # N: key head dim (linear_key_head_dim)
    gdn_v_dim: int = 16  # P: value head dim (linear_value_head_dim)
    gdn_chunk_size: int = 64  # chunk length of the GDN prefill (WY form)
    # MLP / MoE
    mlp_kind: str = "relu2"  # relu2 (Nemotron-H: up -> relu^2 -> down) | swiglu (Llama: silu(gate)*up)
    d_ff: int = 128  # MLP hidden width
    n_experts: int = 0  # routed experts of an E block
    top_k: int = 1  # experts per token
    moe_d_ff: int = 64  # hidden width of one routed expert
    shared_d_ff: int = 0  # hidden width of the shared expert (0: none)
    routed_scaling: float = 1.0  # multiplier on the routed experts' sum
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    n_expert_groups: int = 1  # routing groups (DeepSeek-V3 style group-limited routing, Nemotron-H n_group)
    topk_groups: int = 1  # groups a token may route into
    moe_kind: str = "nemotron"  # nemotron (sigmoid router, relu² experts) | qwen (softmax router, SwiGLU
    #                             experts, SwiGLU shared expert behind a sigmoid gate: Qwen3-Next)
    # multi-token-prediction head (models/mtp.py): from the final hidden state at t and the embedding of token t + 1
    # it predicts token t + 2, with the blocks below sized as the model's own; it shares the embedding and LM head
    mtp_layers: int = 0  # MTP layers (0: no head; Qwen3.5 / Qwen3-Next mtp_num_hidden_layers, Nemotron-H
    #                      num_nextn_predict_layers; the published heads have 1)
    mtp_pattern: str = "*-"  # blocks of one MTP layer (Nemotron-H mtp_hybrid_override_pattern; Qwen: *- or *E)
    # whole model
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # lm_head shares the embedding matrix
    residual_in_fp32: bool = True  # keep the residual stream in fp32 (mamba_ssm / HF Mamba2 default)
    max_seq_len: int = 4096  # KV-cache length allocated for attention blocks
    pad_token_id: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 0
    source: str = ""  # where the numbers come from ([F]/[3P]/[D] tags of shared/MODELS.md)

    def __post_init__(self) -> None:
        bad = sorted(set(self.pattern) - set(MIXER_CHARS))
        if bad:
            raise ValueError(
                f"model {self.name!r}: unknown block characters {bad} in pattern {self.pattern!r}; "
                f"use M (Mamba-2), * (attention), - (MLP), E (MoE) or G (Gated DeltaNet)"
            )
        if self.moe_kind not in ("nemotron", "qwen"):
            raise ValueError(f"model {self.name!r}: moe_kind must be nemotron or qwen, got {self.moe_kind!r}")
        if "G" in self.pattern and self.gdn_v_heads % self.gdn_k_heads:
            raise ValueError(f"model {self.name!r}: gdn_v_heads={self.gdn_v_heads} must be a multiple of "
                             f"gdn_k_heads={self.gdn_k_heads}")
        if not 0.0 < self.rope_partial <= 1.0 or int(self.attn_head_dim * self.rope_partial) % 2:
            raise ValueError(f"model {self.name!r}: rope_partial={self.rope_partial} must be in (0, 1] and rotate an "
                             f"even number of the attn_head_dim={self.attn_head_dim} channels")
        if "M" in self.pattern and self.ssm_heads % self.n_groups:
            raise ValueError(f"model {self.name!r}: ssm_heads={self.ssm_heads} must be a multiple of n_groups={self.n_groups}")
        if "M" in self.pattern and self.d_xb:
            xh, bg = self.d_xb // self.head_dim, self.d_xb // self.state_size  # heads of x, groups of B
            if self.d_xb % self.head_dim or self.d_xb % self.state_size or self.ssm_heads % xh or self.n_groups % bg:
                raise ValueError(f"model {self.name!r}: d_xb={self.d_xb} must be a multiple of head_dim={self.head_dim} "
                                 f"and state_size={self.state_size} whose quotients divide ssm_heads={self.ssm_heads} "
                                 f"and n_groups={self.n_groups} (MambaInLlama repeats x and B head-wise)")
        if "*" in self.pattern + self.mtp_pattern * self.mtp_layers and self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name!r}: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.mtp_layers not in (0, 1) or not self.mtp_pattern or set(self.mtp_pattern) - set("*-E"):
            raise ValueError(f"model {self.name!r}: mtp_layers={self.mtp_layers} must be 0 (no head) or 1 (the published "
                             f"Qwen3.5 / Qwen3-Next / Nemotron-3 heads), and mtp_pattern={self.mtp_pattern!r} one or "
                             f"more of * (attention), - (MLP), E (MoE)")
        if "E" in self.pattern + self.mtp_pattern * self.mtp_layers and not (0 < self.top_k <= self.n_experts):
            raise ValueError(f"model {self.name!r}: need 0 < top_k <= n_experts for E blocks")

    # derived sizes -------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return len(self.pattern)

    @property
    def d_inner(self) -> int:  # I
        return self.ssm_heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # channels of the depthwise conv: x | B | C (x and B d_xb wide when d_xb is set)
        gn = self.n_groups * self.state_size
        return (self.d_xb or self.d_inner) + (self.d_xb or gn) + gn

    @property
    def in_proj_dim(self) -> int:  # z | xBC | dt
        return self.d_inner + self.conv_dim + self.ssm_heads

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, c in enumerate(self.pattern) if c == "M"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, c in enumerate(self.pattern) if c == "*"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, c in enumerate(self.pattern) if c == "G"]

    @property
    def gdn_conv_dim(self) -> int:  # channels of a GDN mixer's conv: q | k | v
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim

    @property
    def gdn_value_dim(self) -> int:  # H * P: width of z and of the mixer output
        return self.gdn_v_heads * self.gdn_v_dim

    @property
    def rope_dim(self) -> int:  # rotated channels of an attention head
        return int(self.attn_head_dim * self.rope_partial)

    @property
    def is_hybrid(self) -> bool:
        return "*" in self.pattern

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        data = dict(data)
        data.pop("_target_", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config fields {unknown}; known fields: {sorted(known)}")
        for key in ("dt_min_limit", "dt_max_limit"):
            if isinstance(data.get(key), str):
                data[key] = float(data[key])
        return cls(**data)

    def num_parameters(self) -> int:
        """Parameter count of the model this config builds (embedding counted once when tied)."""
        d, n = self.d_model, 0
        if self.mtp_layers:  # the MTP head's two input norms, fc (2d -> d) and final norm
            n += 3 * d + 2 * d * d
        for c in self.pattern + self.mtp_pattern * self.mtp_layers:
            n += d  # block norm
            if c == "M":
                n += d * self.in_proj_dim + self.conv_dim * (self.conv_kernel + int(self.conv_bias))
                n += 3 * self.ssm_heads + self.d_inner + self.d_inner * d
            elif c == "*":
                q, kv = self.n_heads * self.attn_head_dim, self.n_kv_heads * self.attn_head_dim
                n += d * (q * (2 if self.attn_output_gate else 1) + 2 * kv) + q * d
                n += 2 * self.attn_head_dim if self.attn_qk_norm else 0
            elif c == "G":
                cd, vd, H = self.gdn_conv_dim, self.gdn_value_dim, self.gdn_v_heads
                n += d * (cd + vd + 2 * H) + cd * self.conv_kernel + 2 * H + self.gdn_v_dim + vd * d
            elif c == "E" and self.moe_kind == "qwen":
                n += d * self.n_experts + self.n_experts * 3 * d * self.moe_d_ff + 3 * d * self.shared_d_ff + d
            elif c == "-":
                n += (3 if self.mlp_kind == "swiglu" else 2) * d * self.d_ff
            elif c == "E":
                per = (3 if self.mlp_kind == "swiglu" else 2) * d
                n += d * self.n_experts + self.n_experts * per * self.moe_d_ff + per * self.shared_d_ff
        n += d + self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return n


def preset_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def load_preset(name: str, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of ``conf/model/<name>.yaml``, with field overrides."""
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(preset_names())}")
    data = yaml.safe_load(path.read_text()) or {}
    data.update(overrides)
    return ModelConfig.from_dict(data)
