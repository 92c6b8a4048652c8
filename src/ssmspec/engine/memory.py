"""Memory a run needs, checked before anything is allocated.

``plan_bytes`` adds up what a ``DecodeStep`` allocates for a batch (the strategy's state, measured by
allocating the strategy on the meta device; the KV caches; the token buffer) and an estimate of the
largest activations of one call (the logits as the run's verifier reads them -- fp32 logits and
probabilities, or for a verifier that reads only the argmax one bounded chunk of model-dtype logits,
``HybridLM.argmax`` -- and a few hidden-size temporaries of the widest layer, prefill included).
``check_fits`` compares it with the free memory of the device (CUDA: the driver's free bytes; CPU:
MemAvailable) and refuses, with both numbers, a run that cannot fit -- before a single tensor exists, so a
user's typo (``bench.batch=[1000000]``) ends in one error line instead of an allocator traceback or the
kernel's OOM killer.
"""
from __future__ import annotations

import copy

import torch

from ssmspec.models.config import ModelConfig
from ssmspec.models import model as _model
from ssmspec.units import fmt_bytes  # noqa: F401  (re-exported: bench and engine messages)
from ssmspec.strategies import SpecConfig, StrategyBase
from ssmspec.verify.base import reads_argmax
from ssmspec.verify.distributions import SamplingConfig

HEADROOM = 0.9  # use at most this share of the free memory (allocator fragmentation, the CUDA context, ...)


def strategy_bytes(strategy: StrategyBase, cfg: ModelConfig, batch: int, spec: SpecConfig, dtype) -> int:
    """Bytes ``strategy`` allocates for ``batch`` sequences (allocated on the meta device: no memory used)."""
    probe = copy.copy(strategy)  # allocate() sets the state tensors as attributes: keep the original untouched
    probe.allocate(cfg, batch, spec, "meta", dtype)
    return probe.cache_bytes()


def plan_bytes(cfg: ModelConfig, strategy: StrategyBase, *, batch: int, spec: SpecConfig, kv_capacity: int,
               prefill_len: int, dtype, prefill: bool = True, verifier=None,
               sampling: SamplingConfig = SamplingConfig()) -> dict[str, int]:
    """Bytes of every part of a run, before allocation, as an ``Engine`` given the same arguments allocates them.
    ``prefill``: whether the run prefills its prompts (the prompt pass's activations; the engine computes the LM
    head at the last position only). ``verifier``: the run's, or None for the one an engine picks by itself
    (``engine.step.default_verifier`` of ``spec`` and ``sampling``: greedy at temperature 0); one with
    ``argmax_only`` holds one chunk of logits at a time, any other fp32 logits and probabilities at every
    position of the call."""
    if verifier is None:
        from ssmspec.engine.step import default_verifier
        verifier = default_verifier(spec, sampling)
    elt = torch.empty((), dtype=dtype).element_size()
    rows = strategy.max_rows(batch, spec)
    call_len = max(prefill_len, strategy.max_call_len(spec))
    n_attn = len(cfg.attention_layers)
    kv = n_attn * 2 * cfg.n_kv_heads * cfg.attn_head_dim * elt * (batch * kv_capacity + rows * call_len)
    state = strategy_bytes(strategy, cfg, batch, spec, dtype)
    tokens = 8 * batch * (prefill_len + 2 * (spec.draft_len + 2)) + 8 * batch * 8
    gdn_width = cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * cfg.gdn_v_heads if cfg.gdn_layers else 0  # qkv|z|b|a
    width = max(cfg.in_proj_dim if cfg.mamba_layers else 0, gdn_width, cfg.d_ff or 0, 3 * cfg.d_model,
                cfg.n_heads * cfg.attn_head_dim if n_attn else 0)
    decode_tok = rows * strategy.max_call_len(spec)
    prefill_tok = batch * prefill_len if prefill else 0
    logits_tok = max(decode_tok, batch)
    if reads_argmax(verifier):  # one chunk of model-dtype logits + the int64 argmax
        row = elt * cfg.vocab_size
        logits = min(row * logits_tok, max(_model.ARGMAX_CHUNK_BYTES, row)) + 8 * logits_tok
    else:  # fp32 logits and the verifier's probabilities
        logits = 2 * 4 * cfg.vocab_size * logits_tok
    # the logits and ~2 live fp32 temporaries of the widest layer
    act = logits + 2 * 4 * width * max(decode_tok, prefill_tok)
    if cfg.mamba_layers and prefill:  # the prefill chunk scan's per-chunk states (fp32)
        chunks = -(-prefill_len // max(cfg.chunk_size, 1))
        act += 2 * 4 * batch * chunks * cfg.ssm_heads * cfg.head_dim * cfg.state_size
    if cfg.gdn_layers and prefill:  # the GDN prefill's WY chunk: (B, H, C, C) solve and (B, H, C, N|P) tiles, fp32
        C = min(max(cfg.gdn_chunk_size, 1), max(prefill_len, 1))
        act += 4 * 4 * batch * cfg.gdn_v_heads * C * (C + cfg.gdn_k_dim + cfg.gdn_v_dim)
    return {"state": state, "kv_cache": kv, "tokens": tokens, "activations": act}


def free_bytes(device) -> int:
    """Free memory where a run would allocate: the CUDA driver's free bytes plus what PyTorch's caching allocator
    holds unused (a freed tensor's memory stays reserved, and the next allocation reuses it), or MemAvailable on
    CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(torch.cuda.mem_get_info(dev)[0]) + max(int(cached), 0)
    if dev.type == "meta":
        return 1 << 62
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_fits(parts: dict[str, int], device, *, what: str, fix: str) -> int:
    """Raise ValueError naming the bytes needed and free when ``parts`` does not fit; returns the total."""
    need = sum(parts.values())
    free = free_bytes(device)
    if need > HEADROOM * free:
        detail = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items())
        raise ValueError(f"{what} needs {fmt_bytes(need)} ({detail}) but only {fmt_bytes(free)} are free on "
                         f"{torch.device(device)} (at most {HEADROOM:.0%} of it is used); {fix}")
    return need
