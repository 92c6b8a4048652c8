"""Attention of a model call's new tokens over a preallocated KV cache plus their own keys.

``decode_attention`` dispatches the split-K Triton kernel on CUDA (calls of L <= 64 new tokens: decode,
draft chains, token trees; no gather, no dense mask, time proportional to the committed slots each row
reads) and the SDPA twin elsewhere. Prompts keep the SDPA path (``sdpa_attention``).
"""
from __future__ import annotations

from torch import Tensor

from ssmspec.ops.attention.naive import decode_attention_ref, sdpa_attention
from ssmspec.ops.dispatch import use_triton

MAX_DECODE_TOKENS = 64  # L above this is a prompt: SDPA is the better kernel


def decode_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, start: Tensor, length: Tensor,
                     *, ctx_len: int, scale: float, seq_index: Tensor | None = None, kv_hide: Tensor | None = None,
                     tree_mask: Tensor | None = None, valid: Tensor | None = None, splits: int | None = None,
                     store_k: Tensor | None = None, store_v: Tensor | None = None, backend: str = "auto") -> Tensor:
    """Attention of L new tokens per model row over committed KV slots and the call's own keys.

    q (B', L, Hq, D), k, v (B', L, Hkv, D) (Hq a multiple of Hkv); k_cache, v_cache (B, Hkv, max_len, D);
    start, length (B,) int. Row r belongs to sequence ``seq_index[r]`` ((B',); r itself when None) and sees
    its committed slots start <= slot < min(length - kv_hide[r], ctx_len) (``kv_hide`` (B',) or None;
    ``ctx_len`` a host int bound, the cache capacity when unknown), plus its new keys under ``tree_mask``
    (B', L, L) bool ([i, j]: token i sees token j; causal when None), columns restricted to ``valid``
    (B', L) bool. A query that sees nothing attends to its own key (finite output for pad tokens).
    ``splits``: chunks of the committed range per row (default: enough to fill the GPU). ``store_k/v``
    (>= B', Hkv, >= L, D) or None: also write k, v there (the cache's pending scratch). Returns
    (B', L, Hq, D) in q's dtype; fp32 accumulation."""
    if use_triton(q, k, v, k_cache, v_cache, backend=backend):
        from ssmspec.ops.attention.triton import decode_attention_triton
        return decode_attention_triton(q, k, v, k_cache, v_cache, start, length, ctx_len=ctx_len, scale=scale,
                                       seq_index=seq_index, kv_hide=kv_hide, tree_mask=tree_mask, valid=valid,
                                       splits=splits, store_k=store_k, store_v=store_v)
    return decode_attention_ref(q, k, v, k_cache, v_cache, start, length, ctx_len=ctx_len, scale=scale,
                                seq_index=seq_index, kv_hide=kv_hide, tree_mask=tree_mask, valid=valid,
                                store_k=store_k, store_v=store_v)


__all__ = ["MAX_DECODE_TOKENS", "decode_attention", "decode_attention_ref", "sdpa_attention"]
