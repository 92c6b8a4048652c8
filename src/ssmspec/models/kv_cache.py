"""KV cache for attention blocks, with per-sequence length pointers that move back (rollback is free:
rejected keys simply lie beyond ``length``) and an explicit commit of the accepted path.

Slots 0 .. length[b]-1 of sequence b hold committed tokens; slots below ``start[b]`` are left padding
of the prompt and never attended. A model call attends to the committed slots plus its own new
keys/values under a causal or tree mask; the new keys/values wait in ``pending_k/v`` until ``commit``
copies the accepted ones (a chain prefix or a tree path, from the row that verified them) into the
cache. Everything is device-side with fixed shapes (no host sync), so steps can be graph-captured.
"""
from __future__ import annotations

import torch
from torch import Tensor


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
        """q (B', L, Hq, D), k, v (B', L, Hkv, D) of this call -> (B', L, Hq, D)."""
        Bp, L, Hq, Dh = q.shape
        Hkv = k.shape[2]
        if L > self.pending_k.shape[2] or Bp > self.pending_k.shape[0]:
            raise ValueError(f"model call of {Bp} rows x {L} tokens exceeds the KV scratch "
                             f"({self.pending_k.shape[0]} x {self.pending_k.shape[2]}) allocated for this run")
        self.pending_k[:Bp, :, :L] = k.transpose(1, 2)
        self.pending_v[:Bp, :, :L] = v.transpose(1, 2)
        seq = torch.arange(Bp, device=q.device) if step.seq_index is None else step.seq_index
        # committed context: (B', Hkv, T, D), attended where start <= slot < length
        ctx_len = 0 if step.prefill else min(step.kv_bound or self.max_len, self.max_len)
        keys = torch.cat([self.k[seq, :, :ctx_len], k.transpose(1, 2)], dim=2)
        vals = torch.cat([self.v[seq, :, :ctx_len], v.transpose(1, 2)], dim=2)
        slot = torch.arange(ctx_len, device=q.device)
        end = self.length[seq] if step.kv_hide is None else self.length[seq] - step.kv_hide  # (B',)
        old_ok = (slot[None] >= self.start[seq, None]) & (slot[None] < end[:, None])  # (B', T)
        if step.tree_mask is not None:
            new_ok = step.tree_mask
        else:
            new_ok = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()[None].expand(Bp, L, L)
        if step.valid is not None:
            new_ok = new_ok & step.valid[:, None, :]
        mask = torch.cat([old_ok[:, None, :].expand(Bp, L, ctx_len), new_ok], dim=2)  # (B', L, T+L)
        # a fully masked query row (a pad token) would give NaN; let it see itself, its output is unused
        eye = torch.eye(L, dtype=torch.bool, device=q.device)[None].expand(Bp, L, L)
        mask = mask | torch.cat([torch.zeros(Bp, L, ctx_len, dtype=torch.bool, device=q.device), eye], 2) & ~mask.any(-1, keepdim=True)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys, vals, attn_mask=mask[:, None], scale=scale, enable_gqa=Hq != Hkv)
        return out.transpose(1, 2)  # (B', L, Hq, D)

    def commit(self, src_row: Tensor, cols: Tensor, count: Tensor) -> None:
        """Append, for every sequence b, ``count[b]`` pending tokens of row ``src_row[b]`` taken at
        columns ``cols[b, :count[b]]`` (B,), (B, C), (B,). Columns past ``count`` are copied too but
        land beyond the new length, where nothing reads them."""
        bsz, C = cols.shape
        dst = (self.length[:, None] + torch.arange(C, device=cols.device)[None]).clamp(max=self.max_len - 1)
        k_new = self.pending_k[src_row[:, None], :, cols]  # (B, C, Hkv, D)
        v_new = self.pending_v[src_row[:, None], :, cols]
        b_idx = torch.arange(bsz, device=cols.device)[:, None].expand(bsz, C)
        keep = torch.arange(C, device=cols.device)[None] < count[:, None]
        k_old = self.k[b_idx, :, dst]
        v_old = self.v[b_idx, :, dst]
        self.k[b_idx, :, dst] = torch.where(keep[..., None, None], k_new, k_old)
        self.v[b_idx, :, dst] = torch.where(keep[..., None, None], v_new, v_old)
        self.length += count
