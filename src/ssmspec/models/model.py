"""HybridLM: embeddings, pre-norm residual blocks with one mixer each, final norm, LM head.

The model itself keeps no decoding state: SSM and conv states belong to the strategy, keys and values
to the ``KVCache`` of each attention block; both travel in a ``RunContext`` (``engine/context.py``).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from ssmspec.models.config import ModelConfig
from ssmspec.models.gdn import GDNMixer
from ssmspec.models.layers import MLP, Attention, Mamba2Mixer, MoE, PreNorm, QwenMoE, RMSNorm, fused_decode, linear
from ssmspec.models.mil import MILMixer

ARGMAX_CHUNK_BYTES = 64 << 20  # most bytes of logits ``HybridLM.argmax`` holds at once


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if kind == "M" and cfg.d_xb:  # MambaInLlama's mixer
            self.mixer = MILMixer(cfg, index)
        elif kind == "M":
            self.mixer = Mamba2Mixer(cfg, index)
        elif kind == "*":
            self.mixer = Attention(cfg, index)
        elif kind == "G":
            self.mixer = GDNMixer(cfg, index)
        elif kind == "-":
            self.mixer = MLP(cfg)
        elif cfg.moe_kind == "qwen":
            self.mixer = QwenMoE(cfg)
        else:
            self.mixer = MoE(cfg)

    def forward(self, x: Tensor, residual: Tensor | None, ctx) -> tuple[Tensor, Tensor]:
        """x (B', L, d) the previous block's output (the embeddings for the first block), residual
        (B', L, d) the stream before it (None for the first) -> (this block's output, residual + x).
        The add is fused into the norm (mamba_ssm's prenorm form), one launch per block boundary; at decode
        (``fused_decode``: a few rows on the Triton backend) the norm goes further, into the mixer's first
        projections (``PreNorm``), which then also write the new residual."""
        if self._fuse_norm(x):
            pre = PreNorm(x, residual, self.norm, residual_in_fp32=self.residual_in_fp32)
            return self.mixer(pre, ctx), pre.residual
        h, residual = self.norm.add(x, residual, residual_in_fp32=self.residual_in_fp32)
        return self.mixer(h, ctx), residual

    def _fuse_norm(self, x: Tensor) -> bool:
        """Mixers that name the projections of their normed input (``prenorm_layers``) take it as a PreNorm."""
        layers = getattr(self.mixer, "prenorm_layers", None)
        return layers is not None and fused_decode(x, self.norm.weight, *(lin.weight for lin in layers()))


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        counters = {"M": 0, "*": 0, "G": 0}
        blocks = []
        for kind in cfg.pattern:
            idx = counters.get(kind, 0)
            blocks.append(Block(cfg, kind, idx))
            if kind in counters:
                counters[kind] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embeddings.weight
        self.mtp = None  # multi-token-prediction head (models/mtp.py), built only when the config declares one
        if cfg.mtp_layers:
            from ssmspec.models.mtp import MTPHead  # mtp.py builds its blocks from Block above

            self.mtp = MTPHead(cfg)

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    def blocks(self) -> list[Block]:
        """Every block: the model's, then the MTP head's."""
        return [*self.layers, *(self.mtp.blocks if self.mtp is not None else ())]

    def prepare(self) -> "HybridLM":
        """Build every mixer's per-step constants now (e.g. before a CUDA-graph capture); they are rebuilt
        on their own when weights change, so calling this is never required for correctness."""
        for block in self.layers:
            if hasattr(block.mixer, "prepare"):
                block.mixer.prepare()
        return self

    def hidden(self, input_ids: Tensor, ctx) -> Tensor:
        """input_ids (B', L) -> final-normed hidden states (B', L, d) in the model dtype."""
        x, residual = self.embeddings(input_ids), None
        for block in self.layers:
            x, residual = block(x, residual, ctx)
        return self.norm_f.add(x, residual, residual_in_fp32=self.cfg.residual_in_fp32)[0]

    def forward(self, input_ids: Tensor, ctx, *, fp32: bool = True) -> Tensor:
        """input_ids (B', L) -> logits (B', L, V) in fp32; ``ctx`` carries strategy, KV caches and step.
        ``fp32=False`` returns the LM head's output in the model dtype (its fp32 upcast is exact): for callers
        that only rank the logits, it saves writing and re-reading an fp32 copy of (B', L, V) -- at batch 256,
        4 tokens and a 131K vocabulary that copy is 0.5 GB a step."""
        return self.logits(self.hidden(input_ids, ctx), fp32=fp32)

    def logits(self, h: Tensor, *, fp32: bool = True) -> Tensor:
        """The LM head on hidden states h (..., d): logits (..., V) in fp32, or in the model dtype (``forward``)."""
        logits = linear(h.to(self.lm_head.weight.dtype), self.lm_head)
        return logits.float() if fp32 else logits

    def argmax(self, h: Tensor, *, chunk_bytes: int | None = None) -> Tensor:
        """The LM head's argmax at hidden states h (..., d) -> (...,) int64: ``logits(h, fp32=False).argmax(-1)``
        (the model dtype's logits rank as their exact fp32 upcast does, ties to the first index), made over chunks
        of positions whose logits take at most ``chunk_bytes``, so a wide verify call never holds all of its
        (..., V) logits: at batch 256, 5 positions and a 131K vocabulary they are 0.34 GB in bf16, one chunk
        64 MiB (``ARGMAX_CHUNK_BYTES``, read at the call). A call that fits one chunk (every small batch) is the
        unchunked path itself."""
        lead, d = h.shape[:-1], h.shape[-1]
        flat = h.reshape(-1, d)
        cap = ARGMAX_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        per = max(1, cap // (self.cfg.vocab_size * self.lm_head.weight.element_size()))
        if flat.shape[0] <= per:
            return self.logits(flat, fp32=False).argmax(-1).reshape(lead)
        out = torch.empty(flat.shape[0], dtype=torch.long, device=h.device)
        for s in range(0, flat.shape[0], per):
            out[s:s + per] = self.logits(flat[s:s + per], fp32=False).argmax(-1)
        return out.reshape(lead)

    @torch.no_grad()
    def init_random(self, seed: int = 0) -> "HybridLM":
        """Seeded random weights at the configured sizes (timing runs with no checkpoint): normal(0.02)
        projections, residual outputs scaled by 1/sqrt(2 n_layer), Mamba-2's A and dt initialisation."""
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed)  # draws on the weights' device (fast at 13B)
        n = max(self.cfg.n_layer, 1)

        def normal_(t: Tensor, std: float) -> None:
            t.copy_(torch.randn(t.shape, generator=gen, device=dev, dtype=torch.float32).mul_(std))

        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D", "norm_embedding.weight", "norm_hidden.weight")):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                a = torch.rand(p.shape, generator=gen, device=dev) * 15 + 1  # A in [1, 16]
                p.copy_(torch.log(a).to(p.dtype))
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.rand(p.shape, generator=gen, device=dev) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_((dt + torch.log(-torch.expm1(-dt))).to(p.dtype))  # inverse softplus
            elif name.endswith("bias"):
                p.zero_()
            elif "conv1d.weight" in name:
                normal_(p, 1.0 / math.sqrt(self.cfg.conv_kernel))
            elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")):
                normal_(p, 0.02 / math.sqrt(2 * n))
            else:
                normal_(p, 0.02)
        return self


def build_model(cfg: ModelConfig, *, seed: int = 0, device="cpu", dtype=torch.float32) -> HybridLM:
    """A HybridLM with seeded random weights, built directly on ``device`` in ``dtype``. The weights are
    allocated in ``dtype`` (a 23B model in bf16 needs 45 GB, not fp32's 89 GB) and drawn in fp32 then rounded,
    so they equal an fp32 build cast to ``dtype``."""
    with torch.device("meta"):
        model = HybridLM(cfg).to(dtype=dtype)
    model = model.to_empty(device=device)
    for block in model.blocks():  # buffers are not touched by init_random
        if block.kind == "E" and cfg.moe_kind != "qwen":
            block.mixer.gate.e_score_correction_bias.zero_()
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embeddings.weight
    model.init_random(seed)
    return model.to(dtype=dtype).eval()
