"""DraftRunner: a draft HybridLM with its own decoding state, for the model-based drafters.

The runner keeps a *committed* state per sequence (conv + SSM state of every Mamba-2 mixer, a KV cache
per attention block) that has absorbed exactly the history's tokens up to the pending one. Each step:

1. ``absorb(history)``: feed every history token the draft has not seen yet (the accepted drafts and the
   bonus of the last step, or just the pending token) in one right-padded call; pads are masked (the
   SSM state keeps its value, the conv state takes the last W-1 *valid* inputs, the KV cache commits
   only valid tokens). The logits at each sequence's last valid token are its draft distribution at the
   tree root. Nothing to roll back: rejected drafts never touched the committed state.
2. ``begin(width)``: scratch rows, ``width`` per sequence (row b*width + w), copied from the committed
   SSM/conv state. ``step(tokens, depth)`` feeds one token per scratch row (draft depth ``depth``);
   ``reorder(rows)`` lets beam search move rows to their parents. Attention in scratch calls reads the
   committed KV cache (rows mapped to their sequence) plus the scratch rows' own draft keys
   (``_ScratchKV``), so the committed cache is never copied.

The sequence of state updates equals the draft model's own autoregressive decoding (prefill, then one
token at a time through ``selective_state_update``), so greedy drafts equal what the draft model's
greedy ``generate()`` continues with (tests/test_drafters.py checks it after partial acceptance).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssmspec.engine.context import RunContext
from ssmspec.models.kv_cache import KVCache
from ssmspec.models.model import HybridLM
from ssmspec.ops.causal_conv1d import causal_conv1d
from ssmspec.ops.selective_state_update import selective_state_update
from ssmspec.strategies.base import MambaParams, MixerInputs, SpecConfig, StepInputs, StrategyBase

_ABSORB_CHUNK = 64  # most tokens per absorb call (KV scratch size); longer catch-ups take several calls


class _MaskedSteps(StrategyBase):
    """Autoregressive state updates that skip invalid (right-padding) tokens. ``conv_state`` and
    ``ssm_state`` point at the committed or the scratch tensors, whichever the runner is feeding."""

    name = "draft-runner"
    speculative = False

    def mix(self, p: MambaParams, inp: MixerInputs, step: StepInputs) -> Tensor:
        conv_state, ssm_state = self.conv_state[p.index], self.ssm_state[p.index]  # (R, C, W-1), (R, H, P, N)
        xbc, new_conv = causal_conv1d(inp.xbc, p.conv_weight, p.conv_bias, state=conv_state, activation=p.activation)
        valid = step.valid  # (R, L) valid tokens first (right padding) or None
        if valid is None:
            conv_state.copy_(new_conv)
        else:
            full = torch.cat([conv_state.to(inp.xbc.dtype), inp.xbc.transpose(1, 2)], dim=-1)  # (R, C, W-1+L)
            keep = conv_state.shape[-1]
            idx = valid.sum(1)[:, None] + torch.arange(keep, device=full.device)[None]  # (R, W-1) last valid inputs
            conv_state.copy_(full.gather(2, idx[:, None, :].expand(-1, full.shape[1], -1)))
        x, B, C = p.split_xbc(xbc)  # (R, L, H, P), (R, L, G, N) x2
        ys = []
        for t in range(x.shape[1]):
            old = None if valid is None else ssm_state.clone()
            ys.append(selective_state_update(ssm_state, x[:, t], inp.dt[:, t], p.A, B[:, t], C[:, t], p.D,
                                             dt_bias=p.dt_bias, dt_softplus=True, dt_limit=p.dt_limit))
            if old is not None:
                ssm_state.copy_(torch.where(valid[:, t, None, None, None], ssm_state, old))
        y = torch.stack(ys, dim=1)  # (R, L, H, P)
        return y.reshape(*y.shape[:2], -1)


class _ScratchKV:
    """Attention for scratch rows: committed keys of the row's sequence + the row's earlier draft keys +
    this call's keys (causal). Duck-types ``KVCache.attend``; keeps the draft keys itself."""

    def __init__(self, base: KVCache, seq: Tensor, capacity: int, bound: int) -> None:
        self.base, self.seq, self.bound = base, seq, bound  # seq (R,) sequence of each scratch row
        R = seq.shape[0]
        Hkv, Dh = base.k.shape[1], base.k.shape[3]
        self.k = torch.zeros(R, Hkv, capacity, Dh, device=base.k.device, dtype=base.k.dtype)
        self.v = torch.zeros_like(self.k)
        self.n = 0  # draft keys held per row (the same for every row)

    def reorder(self, rows: Tensor) -> None:
        self.k, self.v = self.k[rows], self.v[rows]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step, *, scale: float) -> Tensor:
        """q (R, L, Hq, D), k, v (R, L, Hkv, D) -> (R, L, Hq, D)."""
        R, L, Hq, _ = q.shape
        n, seq, base = self.n, self.seq, self.base
        slot = torch.arange(self.bound, device=q.device)
        old_ok = (slot[None] >= base.start[seq, None]) & (slot[None] < base.length[seq, None])  # (R, bound)
        keys = torch.cat([base.k[seq, :, :self.bound], self.k[:, :, :n], k.transpose(1, 2)], dim=2)
        vals = torch.cat([base.v[seq, :, :self.bound], self.v[:, :, :n], v.transpose(1, 2)], dim=2)
        new_ok = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        mask = torch.cat([old_ok[:, None, :].expand(R, L, self.bound),
                          torch.ones(R, L, n, dtype=torch.bool, device=q.device),
                          new_ok[None].expand(R, L, L)], dim=2)  # (R, L, bound+n+L)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=mask[:, None], scale=scale,
                                             enable_gqa=Hq != k.shape[2])
        self.k[:, :, n:n + L] = k.transpose(1, 2)
        self.v[:, :, n:n + L] = v.transpose(1, 2)
        self.n = n + L
        return out.transpose(1, 2)


class DraftRunner:
    """Drives one draft model: committed state per sequence, scratch rows for drafting (module doc)."""

    def __init__(self, model: HybridLM, *, max_depth: int) -> None:
        self.model = model
        self.max_depth = max_depth  # deepest draft token a scratch row is fed (sizes the scratch keys)
        self.states = _MaskedSteps()

    # committed state ------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, prompts: list[list[int]]) -> None:
        """Prefill every prompt (left-padded) into the committed state."""
        model, cfg = self.model, self.model.cfg
        dev = model.device
        bsz = len(prompts)
        Tp = max(len(p) for p in prompts)
        ids = torch.full((bsz, Tp), cfg.pad_token_id, dtype=torch.long)
        valid = torch.zeros(bsz, Tp, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, Tp - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[b, Tp - len(p):] = True
        ids, valid = ids.to(dev), valid.to(dev)
        self.states.allocate(cfg, bsz, SpecConfig(), dev, model.dtype)
        self.committed = (self.states.conv_state, self.states.ssm_state)
        self.kv = [KVCache(bsz, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_seq_len, rows=bsz,
                           max_new=max(Tp, _ABSORB_CHUNK), device=dev, dtype=model.dtype)
                   for _ in cfg.attention_layers]
        pads = (~valid).sum(1)
        positions = (torch.arange(Tp, device=dev)[None] - pads[:, None]).clamp(min=0)
        logits = model(ids, RunContext(self.states, self.kv, StepInputs(ids, positions, valid=valid, prefill=True)))
        for c in self.kv:
            c.start.copy_(pads)
            c.commit(torch.arange(bsz, device=dev), torch.arange(Tp, device=dev)[None].expand(bsz, Tp),
                     torch.full((bsz,), Tp, device=dev, dtype=torch.long))
        self.consumed = [len(p) for p in prompts]  # history tokens absorbed per sequence
        self.kv_len = [Tp] * bsz  # committed KV slots per sequence (host copy: no sync for bounds)
        self.last = logits[:, -1]  # (B, V) draft logits after each sequence's last absorbed token
        self.batch = bsz

    @torch.no_grad()
    def absorb(self, history: list[list[int]]) -> Tensor:
        """Feed the history tokens not seen yet; returns (B, V) draft logits after each sequence's last
        token (the pending one). Sequences with nothing new (finished ones) keep their last logits."""
        if len(history) != self.batch:
            raise ValueError(f"history has {len(history)} sequences but the drafter was reset for {self.batch}")
        new = []
        for b, h in enumerate(history):
            if len(h) < self.consumed[b]:
                raise ValueError("history is shorter than what the draft model absorbed: call reset() first")
            new.append(h[self.consumed[b]:])
        while any(new):
            piece = [t[:_ABSORB_CHUNK] for t in new]
            new = [t[_ABSORB_CHUNK:] for t in new]
            self._absorb_piece(piece)
        return self.last

    def _absorb_piece(self, piece: list[list[int]]) -> None:
        model, dev = self.model, self.model.device
        bsz, L = self.batch, max(len(t) for t in piece)
        counts = [len(t) for t in piece]
        need = max(n + c for n, c in zip(self.kv_len, counts)) + self.max_depth
        if self.kv and need > model.cfg.max_seq_len:
            raise ValueError(f"draft model {model.cfg.name} needs {need} KV slots but allocates max_seq_len="
                             f"{model.cfg.max_seq_len}; raise the draft's max_seq_len or generate fewer tokens")
        ids = torch.tensor([t + [model.cfg.pad_token_id] * (L - len(t)) for t in piece], dtype=torch.long, device=dev)
        n = torch.tensor(counts, dtype=torch.long, device=dev)
        col = torch.arange(L, device=dev)[None]
        valid = col < n[:, None]  # (B, L) valid tokens first
        start = torch.tensor([self.consumed[b] for b in range(bsz)], device=dev)  # real tokens before (RoPE)
        step = StepInputs(ids, start[:, None] + col, valid=valid, kv_bound=max(self.kv_len))
        self.states.conv_state, self.states.ssm_state = self.committed
        logits = model(ids, RunContext(self.states, self.kv, step))  # (B, L, V)
        for c in self.kv:
            c.commit(torch.arange(bsz, device=dev), col.expand(bsz, L), n)
        last = logits.gather(1, (n - 1).clamp(min=0)[:, None, None].expand(bsz, 1, logits.shape[-1]))[:, 0]
        self.last = torch.where((n > 0)[:, None], last, self.last)
        for b in range(bsz):
            self.consumed[b] += counts[b]
            self.kv_len[b] += counts[b]

    # scratch rows ----------------------------------------------------------------------------
    def begin(self, width: int) -> None:
        """``width`` scratch rows per sequence (row b*width + w), each at the committed state."""
        conv, ssm = self.committed
        self.width = width
        self.scratch = (conv.repeat_interleave(width, dim=1), ssm.repeat_interleave(width, dim=1))
        seq = torch.arange(self.batch, device=conv.device).repeat_interleave(width)  # (B*W,)
        self.seq = seq
        self.pos0 = torch.tensor(self.consumed, device=conv.device)[seq] - 1  # (B*W,) position of the root
        self.scratch_kv = [_ScratchKV(c, seq, self.max_depth, max(self.kv_len)) for c in self.kv]

    @torch.no_grad()
    def step(self, tokens: Tensor, depth: int) -> Tensor:
        """tokens (B*W,) at draft depth ``depth`` (1 = child of the root) -> (B*W, V) draft logits after them."""
        ids = tokens.to(self.model.device)[:, None]
        step = StepInputs(ids, (self.pos0 + depth)[:, None])
        self.states.conv_state, self.states.ssm_state = self.scratch
        return self.model(ids, RunContext(self.states, self.scratch_kv, step))[:, -1]

    def reorder(self, rows: Tensor) -> None:
        """Scratch row r takes the state of row ``rows[r]`` (B*W,) (beam search: rows follow parents)."""
        conv, ssm = self.scratch
        self.scratch = (conv[:, rows], ssm[:, rows])
        for kv in self.scratch_kv:
            kv.reorder(rows)


class ModelDrafterBase:
    """Mixin for drafters built on a draft model: ``draft`` is a ``HybridLM`` or a preset name (random
    weights from ``seed``, built at ``reset`` on the target's device in ``dtype``: default float32 on CPU,
    bfloat16 on CUDA)."""

    def _init_draft(self, draft, *, seed: int, dtype: str | None) -> dict:
        if isinstance(draft, HybridLM):
            self._draft_model, label = draft, draft.cfg.name
        elif isinstance(draft, str):
            from ssmspec.models.config import load_preset

            load_preset(draft)  # unknown presets fail here, with the list of names
            self._draft_model, label = None, draft
        else:
            raise TypeError(f"draft must be a HybridLM or a model preset name, got {type(draft).__name__}")
        if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (float32, bfloat16, float64), got {dtype!r}")
        self._draft_name, self._draft_seed, self._draft_dtype = label, seed, dtype
        return {"draft": label, "seed": seed, "dtype": dtype}

    def _runner(self, device, max_depth: int) -> DraftRunner:
        if self._draft_model is None:
            from ssmspec.models.config import load_preset
            from ssmspec.models.model import build_model

            dev = torch.device(device)
            dtype = self._draft_dtype or ("bfloat16" if dev.type == "cuda" else "float32")
            self._draft_model = build_model(load_preset(self._draft_name), seed=self._draft_seed, device=dev,
                                            dtype=getattr(torch, dtype))
        return DraftRunner(self._draft_model, max_depth=max_depth)
