"""One parallel (prefill) forward of a model, as the tests take their ground truth from: the strategy-free
reference every decoding path is compared with (imported by tests in every folder: tests/ is on sys.path
through tests/conftest.py)."""
from __future__ import annotations

import torch

from ssmspec.engine.context import RunContext
from ssmspec.models.kv_cache import KVCache
from ssmspec.strategies import SpecConfig, StepInputs, make_strategy


def _prefill_context(model, ids: torch.Tensor, n_attention: int, strategy: bool = True) -> RunContext:
    cfg, dev = model.cfg, ids.device
    strat = None
    if strategy:
        strat = make_strategy("autoregressive")
        strat.allocate(cfg, ids.shape[0], SpecConfig(), dev, model.dtype)
    kv = [KVCache(ids.shape[0], cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_seq_len, rows=ids.shape[0],
                  max_new=ids.shape[1], device=dev, dtype=model.dtype) for _ in range(n_attention)]
    step = StepInputs(input_ids=ids, positions=torch.arange(ids.shape[1], device=dev)[None].expand_as(ids), prefill=True)
    return RunContext(strategy=strat, kv=kv, step=step)


def parallel_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids (B, L) on the model's device -> logits (B, L, V) of one prefill forward from empty caches."""
    with torch.no_grad():
        return model(ids, _prefill_context(model, ids, len(model.cfg.attention_layers)))


def parallel_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """ids (B, L) -> the final hidden states (B, L, d) (after the final norm) of one prefill forward."""
    with torch.no_grad():
        return model.hidden(ids, _prefill_context(model, ids, len(model.cfg.attention_layers)))


def mtp_prefill(model, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The model's MTP head over every entry in one prefill from an empty cache: ids (B, L) the token after each
    entry, hidden (B, L, d) the hidden state at each entry -> the head's outputs (B, L, d)."""
    from ssmspec.models.mtp import mtp_hidden

    with torch.no_grad():
        return mtp_hidden(model, ids, hidden, _prefill_context(model, ids, model.mtp.attention_blocks, strategy=False))


def mtp_drafts(model, tokens: list[int], S: int) -> list[int]:
    """The S tokens the mtp drafter chains after ``tokens`` (pending last), from scratch: the target's hidden
    states of every token but the pending one (one prefill), then per draft one fresh prefill of the head over
    every entry, the chained entries reading the head's own output at the entry before."""
    dev = model.device
    hidden = parallel_hidden(model, torch.tensor([tokens[:-1]], device=dev))  # (1, L - 1, d)
    nxt, out = list(tokens[1:]), []
    for _ in range(S):
        g = mtp_prefill(model, torch.tensor([nxt], device=dev), hidden)[:, -1:]  # (1, 1, d) at the last entry
        tok = int(model.logits(g)[0, 0].argmax())
        out.append(tok)
        nxt.append(tok)
        hidden = torch.cat([hidden, g], dim=1)
    return out


def next_logits(model, tokens: list[int]) -> torch.Tensor:
    """(V,) logits after ``tokens``, from one fresh prefill (independent of any stepping under test)."""
    return parallel_logits(model, torch.tensor([tokens], device=model.device))[0, -1]
