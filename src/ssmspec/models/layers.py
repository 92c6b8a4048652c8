"""Layers of a hybrid model. Parameter names follow transformers' Mamba2 / NemotronH modules so that
checkpoints load by renaming prefixes only (``loading.py``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.kv_cache import KVCache
from ssmspec.models.rope import apply_rope, rope_cos_sin
from ssmspec.ops.activation import relu_square
from ssmspec.ops.dispatch import decode_fusion, use_triton
from ssmspec.ops.gemv import add_rms_norm_linear, gated_norm_linear, linear_small
from ssmspec.ops.norm import add_rms_norm, gated_rms_norm

DECODE_ROWS = 8  # most rows (B' x L) a call may have for the fused decode GEMVs (ops/gemv)


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused in (``add``): one launch per block boundary on CUDA."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d) -> (..., d) in the weight dtype."""
        return add_rms_norm(x, None, self.weight, eps=self.eps)[0]

    def add(self, x: Tensor, residual: Tensor | None, *, residual_in_fp32: bool) -> tuple[Tensor, Tensor]:
        """Pre-norm step: x (..., d) a block's output (the embeddings first), residual (..., d) or None ->
        (RMSNorm(residual + x) in the weight dtype, residual + x in fp32 when residual_in_fp32)."""
        return add_rms_norm(x, residual, self.weight, eps=self.eps, residual_in_fp32=residual_in_fp32)


def _decode_kernel(part: str, x: Tensor, *weights: Tensor) -> bool:
    """Whether ``x`` (..., K) takes the decode kernel ``part`` of ``ops.dispatch.decode_fusion``: the part asked
    for (``gemv`` by default, the fused forms opt-in), at most ``DECODE_ROWS`` rows, the Triton backend in use
    for these tensors (never on the CPU reference path, which stays today's path bit for bit), one dtype for all
    the weights, and no gradient wanted (the kernels have no backward)."""
    if part not in decode_fusion():
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > DECODE_ROWS or len({w.dtype for w in weights}) != 1:
        return False
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return False
    return use_triton(x, *weights)


def fused_decode(x: Tensor, *weights: Tensor) -> bool:
    """Whether ``x`` goes through the norm-fused decode GEMVs of ``ops/gemv`` (the norm in the projection's
    prologue, one launch) instead of the norm then the projection: ``SSMSPEC_DECODE_FUSION`` names ``norm_gemv``
    (``_decode_kernel``)."""
    return _decode_kernel("norm_gemv", x, *weights)


def linear(x: Tensor, layer: nn.Linear) -> Tensor:
    """``layer(x)``; at decode (a few rows on the Triton backend, ``SSMSPEC_DECODE_FUSION`` naming ``gemv``, as by
    default: ``_decode_kernel``) the GEMV of ``ops/gemv`` (one launch, no split-K reduce launch) instead of cuBLAS."""
    if x.dtype == layer.weight.dtype and _decode_kernel("gemv", x, layer.weight):
        return linear_small(x, layer.weight, layer.bias)
    return layer(x)


class PreNorm:
    """A block's input at decode, before its norm: the previous block's output x (B', L, d) and the residual
    stream. The mixer's first projections apply the norm in their prologue (``project``); ``residual`` is the
    new stream (residual + x), which the first of them writes. Stands in for the normed h (shape, dtype)."""

    def __init__(self, x: Tensor, residual: Tensor | None, norm: RMSNorm, *, residual_in_fp32: bool) -> None:
        self.x, self.norm, self.residual_in_fp32 = x, norm, residual_in_fp32
        self._residual_in, self._residual_out = residual, None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def residual(self) -> Tensor:
        if self._residual_out is None:
            raise RuntimeError("PreNorm.residual read before any projection of the block's input")
        return self._residual_out

    def linear(self, layer: nn.Linear) -> Tensor:
        """layer(RMSNorm(residual + x)) (..., N) in one launch. Later projections norm the new residual stream
        itself (no residual to add: the same normed input, and no second write of the stream)."""
        n = self.norm
        if self._residual_out is None:
            out, self._residual_out = add_rms_norm_linear(self.x, self._residual_in, n.weight, layer.weight, layer.bias,
                                                          eps=n.eps, residual_in_fp32=self.residual_in_fp32)
            return out
        return add_rms_norm_linear(self._residual_out, None, n.weight, layer.weight, layer.bias, eps=n.eps)[0]


def project(h: Tensor | PreNorm, layer: nn.Linear) -> Tensor:
    """layer(h) for a mixer's first projections: h the normed input, or a ``PreNorm`` at decode."""
    return h.linear(layer) if isinstance(h, PreNorm) else linear(h, layer)


class GatedRMSNorm(nn.Module):
    """y * silu(z), then RMSNorm over groups of ``group_size`` channels (norm_before_gate=False, the
    Mamba-2 / Nemotron-H form; transformers >= 5 and mamba_ssm normalise per group)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        """y, z (..., d) -> (..., d) in the model dtype (one launch on CUDA)."""
        return gated_rms_norm(y, z, self.weight, group_size=self.group_size, eps=self.eps)

    def linear(self, y: Tensor, z: Tensor, layer: nn.Linear) -> Tensor:
        """layer(self(y, z)) (..., N); one launch at decode (``fused_decode``)."""
        if fused_decode(y, self.weight, layer.weight):
            return gated_norm_linear(y, z, self.weight, layer.weight, layer.bias, group_size=self.group_size, eps=self.eps)
        return linear(self(y, z), layer)


def _weight_key(t: Tensor | None) -> tuple | None:
    """Identity of a weight's current values without a device sync: storage, dtype and the in-place
    version counter (``.to()`` and ``load_state_dict(assign=True)`` change the storage, ``copy_`` the version)."""
    if t is None:
        return None
    return t.data_ptr(), t.dtype, t.device, -1 if torch.is_inference(t) else t._version


@dataclass
class MambaParams:
    """One Mamba-2 mixer's weights and sizes, as strategies and kernels need them."""

    index: int  # position of this mixer among the model's Mamba-2 mixers (0 .. n_mamba-1)
    conv_weight: Tensor  # (conv_dim, W)
    conv_bias: Tensor | None  # (conv_dim,)
    dt_bias: Tensor  # (H,)
    A: Tensor  # (H,) fp32, = -exp(A_log)
    D: Tensor  # (H,)
    dt_limit: tuple[float, float]
    heads: int  # H
    head_dim: int  # P
    groups: int  # G
    state_size: int  # N
    activation: str

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    def split_xbc(self, xbc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Post-conv (B, L, conv_dim) -> x (B, L, H, P), B (B, L, G, N), C (B, L, G, N)."""
        b, L, _ = xbc.shape
        gn = self.groups * self.state_size
        x, B, C = xbc.split([self.d_inner, gn, gn], dim=-1)
        return (x.reshape(b, L, self.heads, self.head_dim), B.reshape(b, L, self.groups, self.state_size),
                C.reshape(b, L, self.groups, self.state_size))

    def discretize(self, dt_raw: Tensor, valid: Tensor | None = None) -> Tensor:
        """dt = clamp(softplus(dt_raw + dt_bias)) in fp32, (B, L, H); 0 on invalid (pad / no-op) tokens,
        which leaves the state untouched: exp(A·0) = 1 and the input term is scaled by dt = 0."""
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        lo, hi = self.dt_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(min=lo, max=hi)
        if valid is not None:
            dt = dt * valid[..., None].to(dt.dtype)
        return dt


@dataclass
class MixerInputs:
    """What a Mamba-2 mixer hands to the strategy: its projections before the conv."""

    xbc: Tensor  # (B', L, conv_dim) pre-conv x | B | C
    dt: Tensor  # (B', L, H) raw dt, before bias / softplus


class Mamba2Mixer(nn.Module):
    """in_proj -> z | xBC | dt; the strategy runs conv + SSM on (xBC, dt); gated norm with z; out_proj."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index  # index among the model's Mamba-2 mixers
        I, H = cfg.d_inner, cfg.ssm_heads
        self.in_proj = nn.Linear(cfg.d_model, cfg.in_proj_dim, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim,
                                padding=cfg.conv_kernel - 1, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(H))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = GatedRMSNorm(I, I // cfg.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(I, cfg.d_model, bias=cfg.proj_bias)
        self._params: MambaParams | None = None  # built by prepare() on first use
        self._params_key: tuple | None = None

    def _weights(self) -> tuple[Tensor | None, ...]:
        return self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D

    def prepare(self) -> MambaParams:
        """Build the constants a step needs (A = -exp(A_log) in fp32, the conv weight as (conv_dim, W))
        once; ``params`` rebuilds them when a weight changed (loading, ``.to()``, an in-place copy).
        An inference cache: A carries no autograd graph."""
        c = self.cfg
        with torch.no_grad():
            A = -torch.exp(self.A_log.float())  # (H,)
        self._params = MambaParams(index=self.index, conv_weight=self.conv1d.weight[:, 0, :], conv_bias=self.conv1d.bias,
                                   dt_bias=self.dt_bias, A=A, D=self.D, dt_limit=(c.dt_min_limit, c.dt_max_limit),
                                   heads=c.ssm_heads, head_dim=c.head_dim, groups=c.n_groups,
                                   state_size=c.state_size, activation=c.mamba_activation)
        self._params_key = tuple(_weight_key(t) for t in self._weights())
        return self._params

    def params(self) -> MambaParams:
        """The prepared ``MambaParams``: host-side checks only (no launch) unless a weight changed."""
        if self._params is None or self._params_key != tuple(_weight_key(t) for t in self._weights()):
            return self.prepare()
        return self._params

    def prenorm_layers(self) -> list[nn.Linear]:
        """The projections of the block's normed input (``Block`` fuses its norm into them at decode)."""
        return [self.in_proj]

    def forward(self, h: Tensor | PreNorm, ctx) -> Tensor:
        c = self.cfg
        z, xbc, dt = project(h, self.in_proj).split([c.d_inner, c.conv_dim, c.ssm_heads], dim=-1)
        inp = MixerInputs(xbc=xbc, dt=dt)
        p = self.params()
        y = ctx.strategy.prefill(p, inp, ctx.step) if ctx.step.prefill else ctx.strategy.mix(p, inp, ctx.step)
        return self.norm.linear(y.to(h.dtype), z, self.out_proj)


class Attention(nn.Module):
    """GQA self-attention over a ``KVCache`` (committed tokens) plus this call's tokens under a causal or
    tree mask; optional RoPE (on the first ``cfg.rope_dim`` channels of a head), and Qwen3-Next / Qwen3.5's
    gated attention: ``attn_qk_norm`` RMSNorms every q and k head, ``attn_output_gate`` makes q_proj emit
    [query | gate] per head and scales the output by sigmoid(gate) before o_proj."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index  # index among the model's attention layers
        d, hd = cfg.d_model, cfg.attn_head_dim
        self.q_proj = nn.Linear(d, cfg.n_heads * hd * (2 if cfg.attn_output_gate else 1), bias=cfg.attn_bias)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=cfg.attn_bias)
        if cfg.attn_qk_norm:  # Qwen's zero-centred (1 + w) norms, stored with the 1 added by the loader
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)

    def prenorm_layers(self) -> list[nn.Linear]:
        """The projections of the block's normed input (``Block`` fuses its norm into them at decode)."""
        return [self.q_proj, self.k_proj, self.v_proj]

    def forward(self, h: Tensor | PreNorm, ctx) -> Tensor:
        c = self.cfg
        b, L, _ = h.shape
        gate = None
        if c.attn_output_gate:  # per head [query | gate] (transformers' Qwen3NextAttention layout)
            q, gate = project(h, self.q_proj).view(b, L, c.n_heads, 2 * c.attn_head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, L, -1)
        else:
            q = project(h, self.q_proj).view(b, L, c.n_heads, c.attn_head_dim)
        k = project(h, self.k_proj).view(b, L, c.n_kv_heads, c.attn_head_dim)
        v = project(h, self.v_proj).view(b, L, c.n_kv_heads, c.attn_head_dim)
        if c.attn_qk_norm:
            q, k = self.q_norm(q).to(h.dtype), self.k_norm(k).to(h.dtype)
        if c.rope:
            r = c.rope_dim
            cos, sin = rope_cos_sin(ctx.step.positions, r, c.rope_theta, q.dtype, c)
            if r == c.attn_head_dim:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            else:  # partial rotary: the first r channels rotate, the rest pass
                q = torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)
                k = torch.cat([apply_rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        kv: KVCache = ctx.kv[self.index]
        out = kv.attend(q.contiguous(), k, v, ctx.step, scale=1.0 / math.sqrt(c.attn_head_dim))  # (B', L, heads, D)
        out = out.reshape(b, L, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, self.o_proj)


def _act(kind: str):
    return {"relu2": relu_square, "silu": F.silu, "gelu": F.gelu}[kind]


class MLP(nn.Module):
    """relu²: down(relu(up(x))²) (Nemotron-H); swiglu: down(silu(gate(x)) * up(x)) (Llama)."""

    def __init__(self, cfg: ModelConfig, d_ff: int | None = None) -> None:
        super().__init__()
        d_ff = d_ff or cfg.d_ff
        self.kind = cfg.mlp_kind
        self.up_proj = nn.Linear(cfg.d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, cfg.d_model, bias=False)
        if self.kind == "swiglu":
            self.gate_proj = nn.Linear(cfg.d_model, d_ff, bias=False)
        elif self.kind != "relu2":
            raise ValueError(f"unknown mlp_kind {self.kind!r}; use relu2 or swiglu")

    def prenorm_layers(self) -> list[nn.Linear]:
        """The projections of the block's normed input (``Block`` fuses its norm into them at decode)."""
        return [self.gate_proj, self.up_proj] if self.kind == "swiglu" else [self.up_proj]

    def forward(self, x: Tensor | PreNorm, ctx=None) -> Tensor:
        if self.kind == "swiglu":
            return linear(F.silu(project(x, self.gate_proj)) * project(x, self.up_proj), self.down_proj)
        return linear(relu_square(project(x, self.up_proj)), self.down_proj)


class TopKRouter(nn.Module):
    """Sigmoid scores + correction bias for the choice, group-limited top-k (Nemotron-H / DeepSeek-V3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_experts, cfg.d_model))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        c = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # (T, E)
        choice = scores + self.e_score_correction_bias
        if c.n_expert_groups > 1:
            per = c.n_experts // c.n_expert_groups
            gscore = choice.view(-1, c.n_expert_groups, per).topk(min(2, per), dim=-1)[0].sum(-1)
            keep = torch.zeros_like(gscore).scatter_(1, gscore.topk(c.topk_groups, dim=-1)[1], 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(per, dim=1), float("-inf"))
        idx = choice.topk(c.top_k, dim=-1)[1]  # (T, k)
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * c.routed_scaling


class MoE(nn.Module):
    """Routed experts (non-gated relu² MLPs stored as 3-D weights) plus an optional shared expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = TopKRouter(cfg)
        self.experts = nn.Module()
        self.experts.up_proj = nn.Parameter(torch.randn(cfg.n_experts, cfg.moe_d_ff, cfg.d_model) * 0.02)
        self.experts.down_proj = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_model, cfg.moe_d_ff) * 0.02)
        self.shared_experts = MLP(cfg.replace(mlp_kind="relu2"), cfg.shared_d_ff) if cfg.shared_d_ff else None

    def forward(self, x: Tensor, ctx=None) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, d)
        idx, w = self.gate(flat)  # (T, k)
        # every expert runs on every token, weighted 0 where it was not routed: fixed shapes (a decode step
        # stays CUDA-graph capturable, no host sync on the routing); experts are summed in index order as
        # routed-only computation would. The presets' MoE layers are small; large MoE wants a grouped GEMM.
        gate = torch.zeros(flat.shape[0], self.cfg.n_experts, dtype=w.dtype, device=x.device).scatter(1, idx, w)
        y = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        for e in range(self.cfg.n_experts):
            hid = relu_square(F.linear(flat, self.experts.up_proj[e]))  # (T, moe_d_ff)
            y += F.linear(hid, self.experts.down_proj[e]).float() * gate[:, e, None]
        y = y.to(x.dtype).view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class QwenMoE(nn.Module):
    """Qwen3-Next's sparse MoE block (transformers' ``Qwen3NextSparseMoeBlock``): softmax router over
    ``gate.weight``, top-k (renormalised when ``norm_topk_prob``), SwiGLU experts stored as 3-D
    ``experts.gate_up_proj`` (E, 2 I, d) and ``experts.down_proj`` (E, d, I), plus a SwiGLU shared expert
    scaled by sigmoid(``shared_expert_gate``(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(cfg.n_experts, 2 * cfg.moe_d_ff, cfg.d_model) * 0.02)
        self.experts.down_proj = nn.Parameter(torch.randn(cfg.n_experts, cfg.d_model, cfg.moe_d_ff) * 0.02)
        self.shared_expert = MLP(cfg.replace(mlp_kind="swiglu"), cfg.shared_d_ff) if cfg.shared_d_ff else None
        self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_d_ff else None

    def forward(self, x: Tensor, ctx=None) -> Tensor:
        c = self.cfg
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (T, d)
        probs = torch.softmax(self.gate(flat).float(), dim=-1)  # (T, E)
        w, idx = probs.topk(c.top_k, dim=-1)
        if c.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = w * c.routed_scaling
        # every expert on every token, weighted 0 where not routed (fixed shapes, no host sync; see MoE)
        gate = torch.zeros_like(probs).scatter(1, idx, w).to(x.dtype)
        y = torch.zeros_like(flat)
        for e in range(c.n_experts):
            g, u = F.linear(flat, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = y + F.linear(F.silu(g) * u, self.experts.down_proj[e]) * gate[:, e, None]
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return y.view(shape)
