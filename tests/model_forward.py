"""One parallel (prefill) forward of a model, as the tests take their ground truth from: the strategy-free
reference every decoding path is compared with (imported by tests in every folder: tests/ is on sys.path
through tests/conftest.py)."""
from __future__ import annotations

import torch

from ssmspec.engine.context import RunContext
from ssmspec.models.kv_cache import KVCache
from ssmspec.strategies import SpecConfig, StepInputs, make_strategy


def parallel_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids (B, L) on the model's device -> logits (B, L, V) of one prefill forward from empty caches."""
    cfg, dev = model.cfg, ids.device
    strat = make_strategy("autoregressive")
    strat.allocate(cfg, ids.shape[0], SpecConfig(), dev, model.dtype)
    kv = [KVCache(ids.shape[0], cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_seq_len, rows=ids.shape[0],
                  max_new=ids.shape[1], device=dev, dtype=model.dtype) for _ in cfg.attention_layers]
    step = StepInputs(input_ids=ids, positions=torch.arange(ids.shape[1], device=dev)[None].expand_as(ids), prefill=True)
    with torch.no_grad():
        return model(ids, RunContext(strategy=strat, kv=kv, step=step))


def next_logits(model, tokens: list[int]) -> torch.Tensor:
    """(V,) logits after ``tokens``, from one fresh prefill (independent of any stepping under test)."""
    return parallel_logits(model, torch.tensor([tokens], device=model.device))[0, -1]
