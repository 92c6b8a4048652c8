"""Attention of a model call's L new tokens over the committed slots of a ``KVCache`` plus their own keys,
by gathering the cache rows, concatenating the new keys and calling SDPA with a dense boolean mask. This is
the ground truth of the decode kernel and the prefill path of ``KVCache.attend``; the gather and the mask
cost memory and time that grow with the cache capacity, which is why decode has a kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, start: Tensor, length: Tensor, *,
                   ctx_len: int, scale: float, seq_index: Tensor | None = None, kv_hide: Tensor | None = None,
                   tree_mask: Tensor | None = None, valid: Tensor | None = None) -> Tensor:
    """Math in the inputs' dtype (see ``decode_attention_ref`` for the shapes)."""
    Bp, L, Hq, _ = q.shape
    Hkv = k.shape[2]
    dev = q.device
    seq = torch.arange(Bp, device=dev) if seq_index is None else seq_index  # (B',)
    keys = torch.cat([k_cache[seq, :, :ctx_len], k.transpose(1, 2)], dim=2)  # (B', Hkv, T+L, D)
    vals = torch.cat([v_cache[seq, :, :ctx_len], v.transpose(1, 2)], dim=2)
    slot = torch.arange(ctx_len, device=dev)
    end = length[seq] if kv_hide is None else length[seq] - kv_hide  # (B',)
    old_ok = (slot[None] >= start[seq, None]) & (slot[None] < end[:, None])  # (B', T)
    if tree_mask is not None:
        new_ok = tree_mask.bool()
    else:
        new_ok = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None].expand(Bp, L, L)
    if valid is not None:
        new_ok = new_ok & valid.bool()[:, None, :]
    mask = torch.cat([old_ok[:, None, :].expand(Bp, L, ctx_len), new_ok], dim=2)  # (B', L, T+L)
    # a fully masked query row (a pad token) would give NaN; let it see itself, its output is unused
    eye = torch.eye(L, dtype=torch.bool, device=dev)[None].expand(Bp, L, L)
    itself = torch.cat([torch.zeros(Bp, L, ctx_len, dtype=torch.bool, device=dev), eye], 2)
    mask = mask | itself & ~mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=Hq != Hkv)
    return out.transpose(1, 2)  # (B', L, Hq, D)


def decode_attention_ref(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, start: Tensor,
                         length: Tensor, *, ctx_len: int, scale: float, seq_index: Tensor | None = None,
                         kv_hide: Tensor | None = None, tree_mask: Tensor | None = None,
                         valid: Tensor | None = None, store_k: Tensor | None = None,
                         store_v: Tensor | None = None) -> Tensor:
    """q (B', L, Hq, D), k, v (B', L, Hkv, D) the call's new tokens; k_cache, v_cache (B, Hkv, max_len, D);
    start, length (B,) int: row r (sequence ``seq_index[r]``, r itself when None) sees committed slots
    start <= slot < min(length - kv_hide[r], ctx_len), plus its new keys under ``tree_mask`` (B', L, L)
    ([i, j]: token i sees token j; causal when None), columns restricted to ``valid`` (B', L). A query
    that sees nothing attends to its own key. ``store_k/v`` (>= B', Hkv, >= L, D) or None receive the
    call's k, v (the cache's pending scratch). Returns (B', L, Hq, D) in q's dtype, computed in fp32."""
    if store_k is not None:
        store_k[:k.shape[0], :, :k.shape[1]] = k.transpose(1, 2)
        store_v[:v.shape[0], :, :v.shape[1]] = v.transpose(1, 2)
    f = [t.float() for t in (q, k, v, k_cache, v_cache)]
    return sdpa_attention(*f, start, length, ctx_len=ctx_len, scale=scale, seq_index=seq_index, kv_hide=kv_hide,
                          tree_mask=tree_mask, valid=valid).to(q.dtype)
