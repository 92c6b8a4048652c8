"""Model configuration: one frozen dataclass for pure Mamba-2 and its attention hybrids.

A model is a stack of pre-norm residual blocks, one mixer per block, named by one character each as
Nemotron-H writes its ``hybrid_override_pattern``:

    M  Mamba-2 mixer        *  attention (GQA, optional RoPE)
    -  MLP (relu² or SwiGLU) E  mixture of experts (top-k routing, optional shared expert)

Pure Mamba-2 is ``"M" * n_layer``; a Llama-style hybrid (MambaInLlama) is ``"M-*-M-*-..."`` with a
SwiGLU MLP. The published sizes live in ``conf/model/<preset>.yaml`` (numbers in shared/MODELS.md);
``load_preset`` reads them so that the Hydra config group and the Python API share one source.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import yaml

from ssmspec.paths import CONF_DIR

MIXER_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"  # preset name, recorded in every result row
    family: str = "mamba2"  # checkpoint family: mamba2 | nemotron_h | mamba_in_llama (picks loader key maps)
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
                f"use M (Mamba-2), * (attention), - (MLP) or E (MoE)"
            )
        if "M" in self.pattern and self.ssm_heads % self.n_groups:
            raise ValueError(f"model {self.name!r}: ssm_heads={self.ssm_heads} must be a multiple of n_groups={self.n_groups}")
        if "M" in self.pattern and self.d_xb:
            xh, bg = self.d_xb // self.head_dim, self.d_xb // self.state_size  # heads of x, groups of B
            if self.d_xb % self.head_dim or self.d_xb % self.state_size or self.ssm_heads % xh or self.n_groups % bg:
                raise ValueError(f"model {self.name!r}: d_xb={self.d_xb} must be a multiple of head_dim={self.head_dim} "
                                 f"and state_size={self.state_size} whose quotients divide ssm_heads={self.ssm_heads} "
                                 f"and n_groups={self.n_groups} (MambaInLlama repeats x and B head-wise)")
        if "*" in self.pattern and self.n_heads % self.n_kv_heads:
            raise ValueError(f"model {self.name!r}: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if "E" in self.pattern and not (0 < self.top_k <= self.n_experts):
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
        for c in self.pattern:
            n += d  # block norm
            if c == "M":
                n += d * self.in_proj_dim + self.conv_dim * (self.conv_kernel + int(self.conv_bias))
                n += 3 * self.ssm_heads + self.d_inner + self.d_inner * d
            elif c == "*":
                q, kv = self.n_heads * self.attn_head_dim, self.n_kv_heads * self.attn_head_dim
                n += d * (q + 2 * kv) + q * d
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
