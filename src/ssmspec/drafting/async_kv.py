"""Attention of ``async_draft``'s calls: the keys its cache branches see, for draft models with attention layers.

``async_draft`` forks the draft's SSM / GDN states per branch through state slots; an attention layer needs the
matching keys. Per attention layer and sequence, ``AsyncKV`` keeps

    cache        the committed keys (the prompt's, then every chain prefix the target accepted): a ``KVCache``,
                 slots 0 .. length - 1 at positions 0 .. length - 1
    chain_k/v    the keys of the last chain call [b, d_1 .. d_S] (column j: depth j), (B, Hkv, S + 1, D)
    branch_k/v   each branch's keys of its calls 1 .. S - 1, (B*N, Hkv, S - 1, D)
    backup_k/v   the ``draft`` backup's keys of its calls 1 .. S - 1, (B, Hkv, S - 1, D)

and attends each call the way a state slot continues it (the drafter sets the call's kind first, ``set_call``):

    chain      B rows of S + 1 tokens from the state after d_k of the previous chain: the committed keys (the
               drafter first appends that chain's accepted prefix [b, d_1 .. d_k], ``commit_chain``) and its own,
               causal; its keys become chain_k/v
    branch c   B*N rows, one token each, call c (0-based) of a branch continuing the chain after depth k_n: the
               committed keys, chain columns 0 .. k_n, the branch's own earlier keys and its own key
    backup c   B rows, one token, call c of the backup (it runs before the round's chain call): the committed
               keys, the previous chain's accepted prefix (columns < ``visible`` of chain_k/v, not committed yet)
               and its own earlier keys
    prefill    the prompt pass (``KVCache.attend``)

The extra keys ride along as new keys of the decode kernel behind queries that are zero and discarded, hidden
per row by ``valid`` (``DraftKV``'s way: the committed range is read once per row, never copied). Device ops and
fixed shapes only, so the drafter's calls stay capturable.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.models.kv_cache import KVCache
from ssmspec.ops.attention import decode_attention


class AsyncKV:
    """One attention layer's keys for ``async_draft`` (module doc). ``cache``: the prefilled committed cache;
    ``branch_depth`` (N,): the chain depth each branch continues from."""

    def __init__(self, cache: KVCache, *, batch: int, depth: int, branch_depth: Tensor) -> None:
        B, S, N = batch, depth, branch_depth.numel()
        _, Hkv, _, D = cache.k.shape
        dev, dtype = cache.k.device, cache.k.dtype
        self.cache, self.B, self.S, self.N = cache, B, S, N
        zeros = dict(device=dev, dtype=dtype)
        self.chain_k = torch.zeros(B, Hkv, S + 1, D, **zeros)
        self.chain_v = torch.zeros_like(self.chain_k)
        self.branch_k = torch.zeros(B * N, Hkv, max(S - 1, 1), D, **zeros)
        self.branch_v = torch.zeros_like(self.branch_k)
        self.backup_k = torch.zeros(B, Hkv, max(S - 1, 1), D, **zeros)
        self.backup_v = torch.zeros_like(self.backup_k)
        cols = torch.arange(S + 1, device=dev)
        self.branch_seq = torch.arange(B * N, device=dev) // N  # (B*N,) sequence of each branch row
        # (B*N, S + 1): branch n sees chain columns 0 .. k_n (the tokens its start state has absorbed)
        self.branch_vis = (cols[None] <= branch_depth.to(dev)[:, None]).repeat(B, 1)
        self.backup_vis = torch.zeros(B, S + 1, dtype=torch.bool, device=dev)  # set per round (``set_visible``)
        self._cols = cols
        self.kind, self.call = "prefill", 0

    def nbytes(self) -> int:
        own = (self.chain_k, self.chain_v, self.branch_k, self.branch_v, self.backup_k, self.backup_v)
        return self.cache.nbytes() + sum(t.numel() * t.element_size() for t in own)

    # the drafter's side -------------------------------------------------------------------------------
    def set_call(self, kind: str, call: int = 0) -> None:
        """The next model call's kind (module doc) and, for ``branch`` / ``backup``, its index 0 .. S - 1."""
        self.kind, self.call = kind, call

    def commit_chain(self, count: Tensor) -> None:
        """Append the first ``count[b]`` (B,) keys of sequence b's last chain to its committed keys (the prefix the
        target accepted: the bonus and the accepted drafts)."""
        self.cache.append(self.chain_k.transpose(1, 2), self.chain_v.transpose(1, 2), count)

    def set_visible(self, count: Tensor) -> None:
        """The backup's rows see the first ``count[b]`` (B,) columns of the last chain (not committed yet)."""
        torch.lt(self._cols[None], count[:, None], out=self.backup_vis)

    # the model's side ---------------------------------------------------------------------------------
    def attend(self, q: Tensor, k: Tensor, v: Tensor, step, *, scale: float) -> Tensor:
        """q (B', L, Hq, D), k, v (B', L, Hkv, D) -> (B', L, Hq, D) (module doc)."""
        c = self.cache
        if self.kind == "prefill":
            return c.attend(q, k, v, step, scale=scale)
        ctx_len = min(step.kv_bound or c.max_len, c.max_len)
        if self.kind == "chain":
            return decode_attention(q, k, v, c.k, c.v, c.start, c.length, ctx_len=ctx_len, scale=scale,
                                    store_k=self.chain_k, store_v=self.chain_v)
        if self.kind == "branch":
            seq, vis, own_k, own_v = self.branch_seq, self.branch_vis, self.branch_k, self.branch_v
            chain_k, chain_v = self.chain_k[seq], self.chain_v[seq]
        elif self.kind == "backup":
            seq, vis, own_k, own_v = None, self.backup_vis, self.backup_k, self.backup_v
            chain_k, chain_v = self.chain_k, self.chain_v
        else:
            raise ValueError(f"unknown async_draft call kind {self.kind!r}")
        j = self.call  # this row's earlier calls: own columns 0 .. j - 1
        keys = torch.cat([chain_k, own_k[:, :, :j], k.transpose(1, 2)], dim=2).transpose(1, 2)  # (R, S+2+j, Hkv, D)
        vals = torch.cat([chain_v, own_v[:, :, :j], v.transpose(1, 2)], dim=2).transpose(1, 2)
        extra = keys.shape[1] - 1
        qs = torch.cat([q.new_zeros(q.shape[0], extra, *q.shape[2:]), q], dim=1)  # (R, S+2+j, Hq, D)
        valid = torch.cat([vis, vis.new_ones(vis.shape[0], j + 1)], dim=1)
        out = decode_attention(qs, keys, vals, c.k, c.v, c.start, c.length, ctx_len=ctx_len, scale=scale,
                               seq_index=seq, valid=valid)[:, -1:]
        if j < self.S - 1:  # for this row's later calls
            own_k[:, :, j] = k[:, 0]
            own_v[:, :, j] = v[:, 0]
        return out
