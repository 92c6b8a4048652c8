"""DraftRunner: a draft HybridLM with its own decoding state, for the model-based drafters.

The runner keeps a *committed* state per sequence (conv + SSM state of every Mamba-2 mixer, a KV cache
per attention block) and a device counter ``consumed`` (B,) of the engine's buffer tokens it has absorbed.
Every tensor is allocated at ``reset`` with fixed shapes and updated in place, so a step can be captured
in a CUDA graph (``Drafter.propose_device``). Each step:

1. ``absorb_device(buf)``: one right-padded call of fixed width A = 1 + max_depth feeds the buffer's tokens
   in columns ``consumed .. buf.length - 1`` (the last step's accepted drafts and bonus: at most A; finished
   sequences none). Pads are masked (the SSM state keeps its value, the conv state takes the last W-1
   *valid* inputs, the KV cache commits the valid tokens only, by device counts). The logits at each
   sequence's last valid token are its draft distribution at the tree root. Nothing to roll back:
   rejected drafts never touched the committed state.
2. ``begin(width)``: scratch rows, ``width`` per sequence (row b*width + w), set to the committed SSM/conv
   state. ``step(tokens, depth)`` feeds one token per scratch row (draft depth ``depth``); ``reorder(rows)``
   lets beam search move rows to their parents. Attention in scratch calls reads the committed KV cache
   (rows mapped to their sequence) plus the scratch rows' own draft keys (``_ScratchKV``), so the
   committed cache is never copied. The depth loop is a static Python loop: the schedule is the same
   every step.

The KV cache holds ``capacity`` slots per sequence, fixed at reset from the prompt and a ``max_new_tokens``
budget (not ``cfg.max_seq_len``, which can be huge); every attention call reads all of them
(``StepInputs.kv_bound`` is that host constant), masked by the device lengths.

The sequence of state updates equals the draft model's own autoregressive decoding (prefill, then one
token at a time through ``selective_state_update``), so greedy drafts equal what the draft model's
greedy ``generate()`` continues with (tests/test_draft_models.py checks it after partial acceptance).
Host callers use ``absorb(history)`` (lists), which builds a ``TokenBuffer`` and runs the same device call
as many times as the catch-up needs. A draft model with MoE layers routes tokens with data-dependent
shapes (``layers.MoE``) and so cannot be captured.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssmspec.drafting.base import TokenBuffer
from ssmspec.engine.context import RunContext
from ssmspec.models.kv_cache import KVCache
from ssmspec.models.model import HybridLM
from ssmspec.ops.causal_conv1d import causal_conv1d
from ssmspec.ops.selective_state_update import selective_state_update
from ssmspec.strategies.base import MambaParams, MixerInputs, SpecConfig, StepInputs, StrategyBase

DEFAULT_MAX_NEW_TOKENS = 1024  # KV budget of new tokens when reset() is not told (clipped to max_seq_len)


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
    this call's keys (causal). Duck-types ``KVCache.attend``; keeps the draft keys itself, in buffers of
    fixed size (``capacity`` draft keys per row)."""

    def __init__(self, base: KVCache, seq: Tensor, capacity: int) -> None:
        self.base, self.seq, self.bound = base, seq, base.max_len  # seq (R,) sequence of each scratch row
        R = seq.shape[0]
        Hkv, Dh = base.k.shape[1], base.k.shape[3]
        self.k = torch.zeros(R, Hkv, capacity, Dh, device=base.k.device, dtype=base.k.dtype)
        self.v = torch.zeros_like(self.k)
        self.n = 0  # draft keys held per row (the same for every row; a host count, static per step)

    def reorder(self, rows: Tensor) -> None:
        self.k.copy_(self.k[rows])
        self.v.copy_(self.v[rows])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, step, *, scale: float) -> Tensor:
        """q (R, L, Hq, D), k, v (R, L, Hkv, D) -> (R, L, Hq, D)."""
        R, L, Hq, _ = q.shape
        n, seq, base = self.n, self.seq, self.base
        slot = torch.arange(self.bound, device=q.device)
        old_ok = (slot[None] >= base.start[seq, None]) & (slot[None] < base.length[seq, None])  # (R, bound)
        keys = torch.cat([base.k[seq], self.k[:, :, :n], k.transpose(1, 2)], dim=2)  # (R, Hkv, bound+n+L, D)
        vals = torch.cat([base.v[seq], self.v[:, :, :n], v.transpose(1, 2)], dim=2)
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


def token_buffer(history: list[list[int]], prompt_len: list[int], device) -> TokenBuffer:
    """Host lists (every token so far, pending last) -> a ``TokenBuffer`` as the engine keeps it
    (capacity: the longest history)."""
    cap = max(len(h) for h in history)
    tokens = torch.zeros(len(history), cap, dtype=torch.long)
    for b, h in enumerate(history):
        tokens[b, :len(h)] = torch.tensor(h, dtype=torch.long)
    return TokenBuffer(tokens.to(device), torch.tensor([len(h) for h in history], device=device),
                       torch.tensor(prompt_len, device=device))


class DraftRunner:
    """Drives one draft model: committed state per sequence, scratch rows for drafting (module doc).

    ``max_depth``: deepest draft token (A = 1 + max_depth tokens absorbed per call; sizes the scratch
    keys); ``width``: scratch rows per sequence the drafter uses (allocated at reset); ``slack``: KV slots
    beyond prompt + ``max_new_tokens`` (tokens in flight in the engine's last step).
    """

    def __init__(self, model: HybridLM, *, max_depth: int, width: int = 1, slack: int = 0) -> None:
        if model.cfg.gdn_layers:
            raise ValueError(f"draft model {model.cfg.name!r} has Gated DeltaNet mixers, which the draft runner does "
                             f"not keep state for yet; draft with a Mamba-2 or Mamba-2 hybrid preset (e.g. "
                             f"mamba2-130m) or checkpoint, or with the png / oracle drafters")
        self.model = model
        self.max_depth = max_depth
        self.absorb_width = 1 + max_depth  # A: a step emits at most the accepted drafts + the bonus
        self.default_width = width
        self.slack = slack
        self.states = _MaskedSteps()

    # committed state ------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, prompts: list[list[int]], *, max_new_tokens: int | None = None) -> None:
        """Prefill every prompt (left-padded) into the committed state; size the KV cache for the prompt
        plus ``max_new_tokens`` new tokens (default ``DEFAULT_MAX_NEW_TOKENS``, clipped to max_seq_len)."""
        model, cfg = self.model, self.model.cfg
        dev = model.device
        bsz = len(prompts)
        plen = [len(p) for p in prompts]
        if not bsz or min(plen) == 0:
            raise ValueError("every prompt needs at least one token")
        Tp = max(plen)
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        budget = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        capacity = Tp + budget + self.slack
        if cfg.attention_layers and capacity > cfg.max_seq_len:
            if max_new_tokens is not None or Tp + self.slack >= cfg.max_seq_len:
                raise ValueError(f"draft model {cfg.name} needs {capacity} KV slots (prompt {Tp} + max_new_tokens "
                                 f"{budget} + {self.slack} in flight) but allows max_seq_len={cfg.max_seq_len}; "
                                 f"raise the draft's max_seq_len, shorten the prompt or lower max_new_tokens")
            capacity = cfg.max_seq_len
        self.capacity = capacity  # KV slots per sequence (host constant: every call's kv_bound)
        ids = torch.full((bsz, Tp), cfg.pad_token_id, dtype=torch.long)
        valid = torch.zeros(bsz, Tp, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, Tp - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[b, Tp - len(p):] = True
        ids, valid = ids.to(dev), valid.to(dev)
        self.states.allocate(cfg, bsz, SpecConfig(), dev, model.dtype)
        self.committed = (self.states.conv_state, self.states.ssm_state)
        self.kv = [KVCache(bsz, cfg.n_kv_heads, cfg.attn_head_dim, capacity, rows=bsz,
                           max_new=max(Tp, self.absorb_width), device=dev, dtype=model.dtype)
                   for _ in cfg.attention_layers]
        pads = (~valid).sum(1)
        positions = (torch.arange(Tp, device=dev)[None] - pads[:, None]).clamp(min=0)
        logits = model(ids, RunContext(self.states, self.kv, StepInputs(ids, positions, valid=valid, prefill=True)))
        n = torch.tensor(plen, device=dev)
        slots = (torch.arange(capacity, device=dev)[None] + pads[:, None]).clamp(max=capacity - 1)  # (B, capacity)
        for c in self.kv:
            c.commit(torch.arange(bsz, device=dev), torch.arange(Tp, device=dev)[None].expand(bsz, Tp),
                     torch.full((bsz,), Tp, device=dev, dtype=torch.long))
            # drop the left padding: row b's tokens move to slots 0 .. plen-1, so it holds exactly the
            # tokens it absorbed (at most the engine buffer's capacity)
            idx = slots[:, None, :, None].expand_as(c.k)
            c.k.copy_(c.k.gather(2, idx))
            c.v.copy_(c.v.gather(2, idx))
            c.start.zero_()
            c.length.copy_(n)
        self.batch, self.prompt_len, self.prompt_max = bsz, plen, Tp
        self.consumed = n.clone()  # (B,) buffer tokens absorbed per sequence
        self.last = logits[:, -1].clone()  # (B, V) draft logits after each sequence's last absorbed token
        self._cols = torch.arange(self.absorb_width, device=dev)[None]  # (1, A)
        self._alloc_scratch(self.default_width)

    def check_buffer(self, buf: TokenBuffer) -> None:
        """Shape checks only (no device read): the batch, and a capacity the KV cache can hold."""
        if buf.tokens.shape[0] != self.batch:
            raise ValueError(f"token buffer has {buf.tokens.shape[0]} sequences but the drafter was reset for "
                             f"{self.batch}")
        if self.kv and buf.capacity > self.capacity:
            raise ValueError(f"the token buffer holds up to {buf.capacity} tokens per sequence but draft model "
                             f"{self.model.cfg.name} keeps {self.capacity} KV slots (sized at reset for prompt "
                             f"{self.prompt_max} + max_new_tokens + {self.slack}); pass the drafter's reset(..., "
                             f"max_new_tokens={buf.capacity - self.prompt_max - self.slack}) or more")

    @torch.no_grad()
    def absorb_device(self, buf: TokenBuffer) -> Tensor:
        """Feed up to A buffer tokens not seen yet, in one call of width A; returns (B, V) draft logits
        after each sequence's last absorbed token (the pending one). Sequences with nothing new keep their
        last logits. Device ops only."""
        self.check_buffer(buf)
        model, col, cap = self.model, self._cols, buf.capacity
        n = (buf.length - self.consumed).clamp(min=0, max=self.absorb_width)  # (B,) new tokens this call
        valid = col < n[:, None]  # (B, A) valid tokens first
        ids = buf.tokens.gather(1, (self.consumed[:, None] + col).clamp(max=cap - 1))  # (B, A)
        ids = torch.where(valid, ids, model.cfg.pad_token_id)
        step = StepInputs(ids, self.consumed[:, None] + col, valid=valid, kv_bound=self.capacity)
        self.states.conv_state, self.states.ssm_state = self.committed
        logits = model(ids, RunContext(self.states, self.kv, step))  # (B, A, V)
        for c in self.kv:
            c.commit(torch.arange(self.batch, device=ids.device), col.expand(self.batch, -1), n)
        last = logits.gather(1, (n - 1).clamp(min=0)[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        self.last.copy_(torch.where((n > 0)[:, None], last, self.last))
        self.consumed += n
        return self.last

    @torch.no_grad()
    def absorb(self, history: list[list[int]]) -> Tensor:
        """Host lists (every token so far, pending last) -> (B, V) root logits, through ``absorb_device``
        called as often as the longest catch-up needs (reads the device counters: host use only)."""
        if len(history) != self.batch:
            raise ValueError(f"history has {len(history)} sequences but the drafter was reset for {self.batch}")
        buf = token_buffer(history, self.prompt_len, self.model.device)
        behind = (buf.length - self.consumed).tolist()
        if min(behind) < 0:
            raise ValueError("history is shorter than what the draft model absorbed: call reset() first")
        for _ in range(-(-max(behind) // self.absorb_width)):
            self.absorb_device(buf)
        return self.last

    # scratch rows ----------------------------------------------------------------------------
    def _alloc_scratch(self, width: int) -> None:
        conv, ssm = self.committed
        rows = self.batch * width
        self.width = width
        self.scratch = (conv.new_zeros(conv.shape[0], rows, *conv.shape[2:]),  # (n_mamba, B*W, C, W-1)
                        ssm.new_zeros(ssm.shape[0], rows, *ssm.shape[2:]))  # (n_mamba, B*W, H, P, N)
        self.seq = torch.arange(self.batch, device=conv.device).repeat_interleave(width)  # (B*W,)
        self.scratch_kv = [_ScratchKV(c, self.seq, self.max_depth) for c in self.kv]

    def begin(self, width: int) -> None:
        """``width`` scratch rows per sequence (row b*width + w), each at the committed state. A width other
        than reset's reallocates (eager use only)."""
        if width != self.width:
            self._alloc_scratch(width)
        for src, dst in zip(self.committed, self.scratch):
            dst.view(dst.shape[0], self.batch, width, *dst.shape[2:]).copy_(src[:, :, None])
        self.pos0 = (self.consumed - 1)[self.seq]  # (B*W,) position of the root (the pending token)
        for kv in self.scratch_kv:
            kv.n = 0

    @torch.no_grad()
    def step(self, tokens: Tensor, depth: int) -> Tensor:
        """tokens (B*W,) at draft depth ``depth`` (1 = child of the root) -> (B*W, V) draft logits after them."""
        ids = tokens.to(self.model.device)[:, None]
        step = StepInputs(ids, (self.pos0 + depth)[:, None])
        self.states.conv_state, self.states.ssm_state = self.scratch
        return self.model(ids, RunContext(self.states, self.scratch_kv, step))[:, -1]

    def reorder(self, rows: Tensor) -> None:
        """Scratch row r takes the state of row ``rows[r]`` (B*W,) (beam search: rows follow parents)."""
        for t in self.scratch:
            t.copy_(t[:, rows])
        for kv in self.scratch_kv:
            kv.reorder(rows)


class ModelDrafterBase:
    """Mixin for drafters built on a draft model: ``draft`` is a ``HybridLM`` or a preset name (random
    weights from ``seed``, built at ``reset`` on the target's device in ``dtype``: default float32 on CPU,
    bfloat16 on CUDA). Subclasses implement ``_draft(root_logits)``; ``propose`` (host lists) and
    ``propose_device`` (the engine's buffer, capturable) differ only in how the runner absorbs."""

    on_device = True

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

    def _reset_runner(self, prompts, device, *, max_depth: int, width: int,
                      max_new_tokens: int | None) -> DraftRunner:
        """Build the draft (first time), a runner with ``width`` scratch rows per sequence, and prefill."""
        self.device = torch.device(device)
        if self._draft_model is None:
            from ssmspec.models.config import load_preset
            from ssmspec.models.model import build_model

            dtype = self._draft_dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
            self._draft_model = build_model(load_preset(self._draft_name), seed=self._draft_seed, device=self.device,
                                            dtype=getattr(torch, dtype))
        # slack: the engine's last step may append a whole window past the budget, and its buffer keeps a spare
        self.runner = DraftRunner(self._draft_model, max_depth=max_depth, width=width, slack=self.spec.nodes + 2)
        self.runner.reset([list(p) for p in prompts], max_new_tokens=max_new_tokens)
        return self.runner

    def _draft(self, root: Tensor):
        raise NotImplementedError

    def generators(self) -> list[torch.Generator]:
        """Device generators ``propose_device`` draws from (a graph capturing it registers them)."""
        return []

    @torch.no_grad()
    def propose(self, history: list[list[int]], pending: Tensor):
        """Host lists -> ``DraftTree`` (the same device path as ``propose_device``)."""
        return self._draft(self.runner.absorb(history))

    @torch.no_grad()
    def propose_device(self, buf: TokenBuffer):
        """The engine's buffer -> ``DraftTree``: one absorb call and a static drafting schedule, no host sync."""
        return self._draft(self.runner.absorb_device(buf))
