"""The user's alternative: transformers' own ``generate()`` on the same architecture with random weights.

``hf_model(cfg)`` builds ``Mamba2ForCausalLM`` / ``NemotronHForCausalLM`` from one of our presets (the
inverse of ``models/loading.py``'s config mapping), with seeded random weights, on the device in the run's
dtype. ``hf_decode_ms`` times greedy ``generate()`` with a KV / SSM cache from a prompt of ``context``
tokens: the time of ``1 + n`` new tokens minus the time of 1 new token (the prefill), over n -- decode time
per token, as a user of transformers would see it (whatever kernels transformers picks on that machine:
mamba_ssm's where it is importable, its torch code otherwise; rows record which).
"""
from __future__ import annotations

import importlib.util
import math
import time

import torch

from ssmspec.models.config import ModelConfig

_KIND = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def hf_config(cfg: ModelConfig):
    """transformers config of the same architecture as ``cfg`` (mamba2 and nemotron_h families)."""
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, layer_norm_epsilon=cfg.norm_eps,
                  tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
                  eos_token_id=None, use_cache=True)
    if set(cfg.pattern) == {"M"} and cfg.family == "mamba2":
        from transformers import Mamba2Config

        return Mamba2Config(**common, num_heads=cfg.ssm_heads, head_dim=cfg.head_dim, expand=cfg.d_inner // cfg.d_model,
                            state_size=cfg.state_size, n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel,
                            chunk_size=cfg.chunk_size, num_hidden_layers=cfg.n_layer, use_conv_bias=cfg.conv_bias,
                            use_bias=cfg.proj_bias, residual_in_fp32=cfg.residual_in_fp32,
                            time_step_limit=(cfg.dt_min_limit, cfg.dt_max_limit))
    if cfg.family in ("mamba2", "nemotron_h") and not cfg.rope:
        from transformers import NemotronHConfig

        if "E" in cfg.pattern:
            raise ValueError(f"{cfg.name}: the transformers baseline covers Mamba-2 / attention / MLP blocks, not MoE")
        return NemotronHConfig(**common, hybrid_override_pattern=cfg.pattern, num_hidden_layers=len(cfg.pattern),
                               num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                               head_dim=cfg.attn_head_dim, intermediate_size=cfg.d_ff, mamba_num_heads=cfg.ssm_heads,
                               mamba_head_dim=cfg.head_dim, n_groups=cfg.n_groups, ssm_state_size=cfg.state_size,
                               conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size, use_conv_bias=cfg.conv_bias,
                               use_bias=cfg.proj_bias, residual_in_fp32=cfg.residual_in_fp32,
                               max_position_embeddings=cfg.max_seq_len)
    raise ValueError(f"{cfg.name}: no transformers baseline for family {cfg.family!r} (mamba2 and nemotron_h only)")


@torch.no_grad()
def hf_model(cfg: ModelConfig, *, device, dtype, seed: int = 0):
    """A transformers model of ``cfg``'s architecture with seeded random weights (normal(0.02) projections,
    Mamba-2's A and dt ranges), built directly on ``device``."""
    from transformers import AutoModelForCausalLM

    hcfg = hf_config(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hcfg, torch_dtype=dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=gen, device=device) * 15 + 1))
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=gen, device=device) * (math.log(0.1) - math.log(1e-3))
                           + math.log(1e-3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif "norm" in name or name.endswith(".D"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
    for name, b in model.named_buffers():
        if b.is_floating_point():
            b.zero_()
    if cfg.tie_embeddings:
        model.tie_weights()
    return model.eval()


def hf_kernels() -> str:
    """Which Mamba-2 kernels transformers can use here (it picks at import time)."""
    return "mamba_ssm" if importlib.util.find_spec("mamba_ssm") is not None else "torch"


@torch.no_grad()
def hf_decode_ms(model, *, batch: int, context: int, new_tokens: int, iters: int, vocab: int,
                 seed: int = 0) -> list[float]:
    """ms per decoded token of greedy ``generate()``: (time of 1 + n new tokens - time of 1) / n, ``iters``
    samples (one warm-up pair first)."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, context), generator=g, device=dev)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    run(1), run(1 + new_tokens)  # warm-up: kernels compiled, caches allocated
    samples = []
    for _ in range(iters):
        samples.append((run(1 + new_tokens) - run(1)) / new_tokens * 1e3)
    return samples
