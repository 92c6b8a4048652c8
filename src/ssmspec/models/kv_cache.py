"""KV cache for attention blocks, with per-sequence length pointers that move back (rollback is free:
rejected keys simply lie beyond ``length``) and an explicit commit of the accepted path.

Slots 0 .. length[b]-1 of sequence b hold committed tokens; slots below ``start[b]`` are left padding
of the prompt and never attended. A model call attends to the committed slots plus its own new
keys/values under a causal or tree mask; the new keys/values wait in ``pending_k/v`` until ``commit``
copies the accepted ones (a chain prefix or a tree path, from the row that verified them) into the
cache. Everything is device-side with fixed shapes (no host sync), so steps can be graph-captured.

Decode calls (L <= 64 new tokens a row) run ``ops.attention.decode_attention``: on CUDA a split-K kernel
that reads each row's committed slots straight from the cache, so its time follows the committed length,
not the capacity; prompts use SDPA over their own keys.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.ops.attention import MAX_DECODE_TOKENS, decode_attention, sdpa_attention


class KVCache:
    def __init__(self, batch: int, kv_heads: int, head_dim: int, max_len: int, *, rows: int, max_new: int,
                 device, dtype) -> None:
        self.max_len = max_len
        self.k = torch.zeros(batch, kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)  # committed slots
        self.start = torch.zeros(batch, dtype=torch.long, device=device)  # first real (unpadded) slot
        # this call's keys/values, per model row, until commit
        self.pending_k = torch.zeros(rows, kv_heads, max_new, head_dim, device=device, dtype=dtype)
        self.pending_v = torch.zeros_like(self.pending_k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pending_k, self.pending_v))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step, *, scale: float) -> Tensor:
        """q (B', L, Hq, D), k, v (B', L, Hkv, D) of this call -> (B', L, Hq, D). The call's keys wait in
        ``pending_k/v`` for ``commit``; masks and row-to-sequence map come from ``step`` (StepInputs)."""
        Bp, L = q.shape[:2]
        if L > self.pending_k.shape[2] or Bp > self.pending_k.shape[0]:
            raise ValueError(f"model call of {Bp} rows x {L} tokens exceeds the KV scratch "
                             f"({self.pending_k.shape[0]} x {self.pending_k.shape[2]}) allocated for this run")
        ctx_len = 0 if step.prefill else min(step.kv_bound or self.max_len, self.max_len)  # host int: no sync
        args = dict(ctx_len=ctx_len, scale=scale, seq_index=step.seq_index, kv_hide=step.kv_hide,
                    tree_mask=step.tree_mask, valid=step.valid)
        if step.prefill or L > MAX_DECODE_TOKENS:  # prompts: SDPA over the call's own keys, in the input dtype
            self.pending_k[:Bp, :, :L] = k.transpose(1, 2)
            self.pending_v[:Bp, :, :L] = v.transpose(1, 2)
            return sdpa_attention(q, k, v, self.k, self.v, self.start, self.length, **args)
        # decode, chains, trees: on CUDA one split-K kernel reads only each row's committed slots and also
        # writes the call's keys/values into pending_k/v
        return decode_attention(q, k, v, self.k, self.v, self.start, self.length, store_k=self.pending_k,
                                store_v=self.pending_v, **args)

    def commit(self, src_row: Tensor, cols: Tensor, count: Tensor) -> None:
        """Append, for every sequence b, ``count[b]`` pending tokens of row ``src_row[b]`` taken at
        columns ``cols[b, :count[b]]`` (B,), (B, C), (B,). Columns past ``count`` are copied too but
        land beyond the new length, where nothing reads them."""
        self.append(self.pending_k[src_row[:, None], :, cols], self.pending_v[src_row[:, None], :, cols], count)

    def append(self, k_new: Tensor, v_new: Tensor, count: Tensor) -> None:
        """Append the first ``count[b]`` of k_new[b], v_new[b] (B, C, Hkv, D) to sequence b (device-side)."""
        bsz, C = k_new.shape[:2]
        dev = k_new.device
        dst = (self.length[:, None] + torch.arange(C, device=dev)[None]).clamp(max=self.max_len - 1)
        b_idx = torch.arange(bsz, device=dev)[:, None].expand(bsz, C)
        keep = torch.arange(C, device=dev)[None] < count[:, None]
        k_old = self.k[b_idx, :, dst]
        v_old = self.v[b_idx, :, dst]
        self.k[b_idx, :, dst] = torch.where(keep[..., None, None], k_new, k_old)
        self.v[b_idx, :, dst] = torch.where(keep[..., None, None], v_new, v_old)
        self.length.add_(count).clamp_(max=self.max_len)  # finished sequences may keep stepping


class DraftKV:
    """Attention of a draft model's calls (``engine/draft.py``): each sequence's committed keys (``cache``)
    plus the keys its drafting rows fed this step, kept per (row, depth) and never moved (column j - 1 holds
    the token a row fed at depth j). A row at depth k attends its sequence's committed slots, its ancestors'
    keys (column j - 1 of row ``anc[r, j]``, j < k) and its own key; the ancestors ride along as extra new keys
    of the decode kernel behind queries that are zero and discarded, so the committed range is read once per
    row with no copy of the cache (a sequence's rows share it through ``seq_index``).

    The engine sets each call's kind before running the model (``set_call``): ``commit`` (a prompt or an
    absorb call of B rows: ``cache`` attends and keeps the keys until the engine commits the valid ones) or
    ``depth`` (B*W rows, one token at depth k).
    """

    def __init__(self, batch: int, width: int, depth: int, kv_heads: int, head_dim: int, capacity: int, *,
                 max_new: int, device, dtype) -> None:
        self.cache = KVCache(batch, kv_heads, head_dim, capacity, rows=batch, max_new=max_new, device=device,
                             dtype=dtype)
        rows = batch * width
        self.k = torch.zeros(rows, kv_heads, max(depth - 1, 1), head_dim, device=device, dtype=dtype)  # (R, Hkv, S-1, D)
        self.v = torch.zeros_like(self.k)
        self.seq = torch.arange(rows, device=device) // width  # (R,) sequence of each row
        self.kind, self.depth, self.anc = "commit", 0, None

    def nbytes(self) -> int:
        return self.cache.nbytes() + sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def set_call(self, kind: str, depth: int = 0, anc: Tensor | None = None) -> None:
        """The next call's kind (class doc); ``anc`` (R, S) rows of each row's ancestors by depth."""
        self.kind, self.depth, self.anc = kind, depth, anc

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step, *, scale: float) -> Tensor:
        """q (B', L, Hq, D), k, v (B', L, Hkv, D) -> (B', L, Hq, D) (class doc)."""
        c = self.cache
        if self.kind == "commit":
            return c.attend(q, k, v, step, scale=scale)
        d = self.depth  # one token per row at depth d >= 1
        ks, vs = [], []
        for j in range(1, d):  # ancestor at depth j: column j - 1 of the row that fed it
            ks.append(self.k[self.anc[:, j], :, j - 1:j])
            vs.append(self.v[self.anc[:, j], :, j - 1:j])
        keys = torch.cat([*ks, k.transpose(1, 2)], dim=2).transpose(1, 2)  # (R, d, Hkv, D)
        vals = torch.cat([*vs, v.transpose(1, 2)], dim=2).transpose(1, 2)
        qs = torch.cat([q.new_zeros(q.shape[0], d - 1, *q.shape[2:]), q], dim=1) if d > 1 else q  # (R, d, Hq, D)
        ctx_len = min(step.kv_bound or c.max_len, c.max_len)
        out = decode_attention(qs, keys, vals, c.k, c.v, c.start, c.length, ctx_len=ctx_len, scale=scale,
                               seq_index=self.seq)[:, -1:]
        self.k[:, :, d - 1] = k[:, 0]  # for the rows below this one
        self.v[:, :, d - 1] = v[:, 0]
        return out
