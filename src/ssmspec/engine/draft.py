"""The draft engine: a draft model decoding through the same machinery as the target (a strategy instance
that keeps its state, KV caches, fixed shapes, device ops only), so any model the target side runs can draft.

Each sequence keeps a *committed* state: the draft model after every token of the target's buffer it has
absorbed (``consumed``), pending token included. One draft step, ``propose_device(buf)`` of a model drafter:

    absorb(buf)       one call of B rows and fixed width A feeds each sequence's new buffer tokens (what the
                      target accepted since the last step, then its bonus) from the committed state, right-padded;
                      the state after the last valid token becomes the committed one, the valid keys join the KV
                      cache. Returns the draft's logits at the root (the pending token).
    step(tokens, k)   calls 1 .. S-1: B*W rows of one token at depth k (W rows per sequence: chains, tree layers
                      or beams), each row continuing from any row of depth k - 1 (``parents``) or from the
                      committed state (depth 1)

Rejected drafts never touch the committed state, so nothing rolls back: the next absorb feeds what the target
kept. The strategy keeps the states in slots (``StrategyBase.slot_states``; ``snapshot``): slot b is sequence
b's committed state, then the drafting slots.

Chains whose drafter reports the verdicts (``resumes``: ``draft_model``) keep the state after every depth in a slot of its own,
W (S - 1) per sequence, and the keys each depth fed (``DraftKV``). The drafter tells the engine what the target
accepted (``resume(row, depth)``, from the verdict: the accepted drafts are the draft's own tokens of that row),
so the next absorb starts from the state after the deepest accepted draft it fed and appends that row's keys of
the accepted depths to the cache: it feeds at most two tokens (the bonus; after a whole chain, also the last
draft, which no depth call fed), A = 2, whatever S is -- the accepted drafts are not run through the draft
twice. Without a ``resume`` (host catch-up, a drafter that does not call it) the absorb starts from the
committed state and feeds up to A tokens a call.

Trees and beams (rows move to other parents) keep 2W drafting slots per sequence, alternating by depth so no row
overwrites a state another row still reads, and absorb all of an accepted path: A = 1 + S.

The state updates are the draft model's own autoregressive decoding (pads leave a state as it was), so greedy
drafts equal what its greedy ``generate()`` continues with.

The draft's calls choose their decode kernels by ``SSMSPEC_DRAFT_DECODE_FUSION`` where it is set
(``ops.dispatch.draft_decode_fusion``; unset: the target's ``SSMSPEC_DECODE_FUSION``), read when the engine is
built: a small draft at batch 1 may take the norm-fused GEMVs that do not pay at the target's sizes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import TokenBuffer
from ssmspec.engine.context import RunContext
from ssmspec.models.kv_cache import DraftKV
from ssmspec.models.model import HybridLM
from ssmspec.ops.dispatch import decode_fusion_scope, draft_decode_fusion
from ssmspec.ops.step_glue import absorb_plan
from ssmspec.strategies import StepInputs, StrategyBase, make_strategy

DEFAULT_MAX_NEW_TOKENS = 1024  # KV budget of new tokens when reset() is not told (clipped to max_seq_len)


def draft_strategy(name: str | StrategyBase) -> StrategyBase:
    """The strategy instance that keeps a draft model's state; refuses one without state slots."""
    strat = make_strategy(name) if isinstance(name, str) else name
    if not strat.slot_states:
        raise ValueError(f"strategy {strat.name!r} keeps one state per sequence and verify window, so it cannot keep "
                         f"a draft model's committed state apart from the rows it drafts in; draft with "
                         f"draft_strategy=snapshot")
    return strat


class DraftEngine:
    """One draft model's decoding state: ``width`` (W) drafting rows per sequence, ``depth`` (S) draft tokens,
    ``reorders``: rows may continue from other rows (beams, tree layers); ``resumes``: a chain drafter that
    calls ``resume`` after every verdict (module doc)."""

    def __init__(self, model: HybridLM, *, width: int, depth: int, reorders: bool, resumes: bool = False,
                 strategy: str | StrategyBase = "snapshot") -> None:
        self.model, self.W, self.S, self.reorders = model, width, depth, reorders
        self.strategy = draft_strategy(strategy)
        self.fusion = draft_decode_fusion()  # the draft's decode kernels (SSMSPEC_DRAFT_DECODE_FUSION), or None
        # ``resumes``: the drafter calls ``resume`` after every verdict (chains): a slot per depth, absorbs resume
        # at the accepted depth
        self.chains = resumes and not reorders and depth > 1
        # absorb width: the bonus and, after a whole chain, its last draft (chains); else the accepted path + bonus
        self.A = 2 if self.chains else 1 + depth

    # reset --------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, prompts: list[list[int]], *, max_new_tokens: int | None = None, slack: int = 0) -> None:
        """Allocate every buffer and prefill each prompt into the committed state; size the KV cache for the
        prompt, ``max_new_tokens`` (default ``DEFAULT_MAX_NEW_TOKENS``, clipped to the draft's max_seq_len) and
        ``slack`` tokens in flight."""
        model, cfg = self.model, self.model.cfg
        dev, dtype = model.device, model.dtype
        B, W, S = len(prompts), self.W, self.S
        plen = [len(p) for p in prompts]
        if not B or min(plen) == 0:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        Tp = max(plen)
        budget = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        capacity = Tp + budget + slack
        if cfg.attention_layers and capacity > cfg.max_seq_len:
            if max_new_tokens is not None or Tp + slack >= cfg.max_seq_len:
                raise ValueError(f"draft model {cfg.name} needs {capacity} KV slots (prompt {Tp} + max_new_tokens "
                                 f"{budget} + {slack} in flight) but allows max_seq_len={cfg.max_seq_len}; raise the "
                                 f"draft's max_seq_len, shorten the prompt or lower max_new_tokens")
            capacity = cfg.max_seq_len
        self.capacity, self.batch, self.prompt_len, self.prompt_max, self.slack = capacity, B, plen, Tp, slack
        # drafting slots per row: one per depth 1 .. S-1 (chains), or two alternating by depth (rows move)
        self.P = max(S - 1, 1) if self.chains else (2 if self.reorders else 1)
        self.strategy.allocate_slots(cfg, B * (1 + self.P * W), dev, dtype)
        self.kv = [DraftKV(B, W, S, cfg.n_kv_heads, cfg.attn_head_dim, capacity, max_new=max(Tp, self.A), device=dev,
                           dtype=dtype) for _ in cfg.attention_layers]
        self.ctx = RunContext(self.strategy, self.kv, None)
        rows = torch.arange(B * W, device=dev)
        self.seq, self.row_w = rows // W, rows % W  # (R,) sequence and row within it
        self.home = torch.arange(B, device=dev)  # (B,) slot of each committed state
        self.anc = torch.zeros(B * W, max(S, 1), dtype=torch.long, device=dev)  # (R, S) row of each depth's ancestor
        self._cols = torch.arange(self.A, device=dev)[None]  # (1, A)
        # static per depth 1 .. S-1 when rows keep their parents: (source slots (R,), destination slots (R, 1))
        self._slots = [(self.home[self.seq] if d == 1 else self._work(d - 1, self.row_w), self._work(d, self.row_w)[:, None])
                       for d in range(1, S)]
        self._pos = torch.zeros(B * W, max(S - 1, 1), dtype=torch.long, device=dev)  # (R, S-1) set by absorb
        self.skip = torch.zeros(B, dtype=torch.long, device=dev)  # (B,) accepted depth the next absorb resumes at
        self.skip_row = torch.zeros(B, dtype=torch.long, device=dev)  # (B,) drafting row (0 .. W-1) it resumes in
        # the absorb's plan (ops/step_glue.absorb_plan, one launch): call tokens, positions, valid, source slots, counts
        long = dict(dtype=torch.long, device=dev)
        self._ids, self._apos = torch.zeros(B, self.A, **long), torch.zeros(B, self.A, **long)
        self._valid = torch.zeros(B, self.A, dtype=torch.bool, device=dev)
        self._src, self._n, self._skip_eff, self._last_idx = (torch.zeros(B, **long) for _ in range(4))
        # a slot strategy's per-call plan (Snapshot._per_call: tokens fed, state slot per column), written by the
        # absorb's plan, so the strategy does not make it again in six launches
        self._slot_dst = torch.zeros(B, self.A, **long)
        self._prefill(prompts)

    def _work(self, depth: int | Tensor, w: Tensor, seq: Tensor | None = None) -> Tensor:
        """(R,) drafting slot of sequence ``seq`` (default: each row's) row ``w`` at ``depth``: its own slot per
        depth (chains), else the slot of the depth's parity."""
        seq = self.seq if seq is None else seq
        if self.chains:
            return self.batch + (seq * self.W + w) * self.P + depth - 1
        parity = depth % self.P
        return self.batch + (seq * self.P + parity) * self.W + w

    def _prefill(self, prompts: list[list[int]]) -> None:
        """Every prompt, left-padded, into the committed slots and the KV caches; the logits at each last token
        (what the root of a sequence that emits nothing keeps)."""
        model, dev = self.model, self.model.device
        B, T = self.batch, self.prompt_max
        ids = torch.full((B, T), model.cfg.pad_token_id, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[b, T - len(p):] = True
        ids, valid = ids.to(dev), valid.to(dev)
        pads = (~valid).sum(1)
        positions = (torch.arange(T, device=dev)[None] - pads[:, None]).clamp(min=0)
        for kv in self.kv:
            kv.set_call("commit")
        self.ctx.step = StepInputs(ids, positions, valid=valid, prefill=True, dst_slot=self.home[:, None])
        with decode_fusion_scope(self.fusion):  # a short prompt at batch 1 has decode-sized calls too
            h = model.hidden(ids, self.ctx)[:, -1:]
            self.last = model.logits(h)[:, 0].clone()  # (B, V) draft logits after each sequence's last token
        n = valid.sum(1)
        slots = (torch.arange(self.capacity, device=dev)[None] + pads[:, None]).clamp(max=self.capacity - 1)
        for kv in self.kv:  # commit, then drop the left padding: row b's tokens sit at slots 0 .. n-1
            c = kv.cache
            c.commit(torch.arange(B, device=dev), torch.arange(T, device=dev)[None].expand(B, T),
                     torch.full((B,), T, device=dev, dtype=torch.long))
            idx = slots[:, None, :, None].expand_as(c.k)
            c.k.copy_(c.k.gather(2, idx))
            c.v.copy_(c.v.gather(2, idx))
            c.start.zero_()
            c.length.copy_(n)
        self.consumed = n.clone()  # (B,) buffer tokens absorbed per sequence

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

    # one draft step -------------------------------------------------------------------------------
    def resume(self, row: Tensor | None, accepted: Tensor) -> None:
        """Chains: the target accepted ``accepted`` (B,) drafts of drafting row ``row`` (B,) (0 .. W-1; None: row 0,
        which one drafting row per sequence always is) of the last step, the draft's own tokens; the next absorb
        resumes from that row's state after the deepest of them it fed (module doc). Device ops only; engines of
        moving rows ignore it."""
        if self.chains:
            if row is None and self.W != 1:  # refused before anything changes
                raise ValueError(f"resume(None, ...) names row 0, but this engine drafts {self.W} rows per sequence")
            torch.clamp(accepted, max=self.S - 1, out=self.skip)  # one launch (clamp, then copy_: two)
            if row is not None:
                self.skip_row.copy_(row)

    @torch.no_grad()
    def absorb(self, buf: TokenBuffer) -> Tensor:
        """Feed up to A buffer tokens not absorbed yet in one call of width A, after the accepted drafts a
        ``resume`` vouches for (module doc); returns (B, V) draft logits (fp32) after each sequence's last
        absorbed token (the root). Sequences with nothing new keep their last logits. Device ops only."""
        self.check_buffer(buf)
        B = self.batch
        absorb_plan(buf.tokens, buf.length, self.consumed, self.skip, self.skip_row, ids=self._ids, pos=self._apos,
                    valid=self._valid, src=self._src, n=self._n, skip_eff=self._skip_eff, last_idx=self._last_idx,
                    row_pos=self._pos, pad=self.model.cfg.pad_token_id, resumes=self.chains, width=self.W,
                    per_row=self.P, slots_base=self.batch, slot_dst=self._slot_dst)
        if self.chains and self.kv:
            rows = self.home * self.W + self.skip_row  # (B,) the resumed drafting row
            for kv in self.kv:  # keys the accepted depths fed join the cache first: (B, S-1, Hkv, D)
                kv.cache.append(kv.k[rows].transpose(1, 2), kv.v[rows].transpose(1, 2), self._skip_eff)
        for kv in self.kv:
            kv.set_call("commit")
        self.ctx.step = StepInputs(self._ids, self._apos, valid=self._valid, kv_bound=self.capacity,
                                   src_slot=self._src, dst_slot=self.home[:, None],
                                   extras={"slot_keep": self._n, "slot_dst": self._slot_dst})
        with decode_fusion_scope(self.fusion):
            h = self.model.hidden(self._ids, self.ctx)  # (B, A, d)
        last = h.gather(1, self._last_idx[:, None, None].expand(-1, 1, h.shape[-1]))  # (B, 1, d)
        for kv in self.kv:
            kv.cache.commit(self.home, self._cols.expand(B, -1), self._n)
        # a sequence with nothing new (valid[:, 0] False: n = 0) keeps its last logits; a bf16 / fp16 head's output
        # is upcast (exactly) by the where that writes the fp32 logits (a float64 model's cannot narrow there)
        with decode_fusion_scope(self.fusion):
            head = self.model.logits(last, fp32=self.model.dtype == torch.float64)[:, 0]
        torch.where(self._valid[:, :1], head, self.last, out=self.last)
        return self.last

    @torch.no_grad()
    def step(self, tokens: Tensor, depth: int, parents: Tensor | None = None, *, fp32: bool = True) -> Tensor:
        """tokens (B*W,) fed at ``depth`` (1 .. S-1), row r continuing from row ``parents[r]`` (B*W,) of depth
        ``depth`` - 1 (None: itself; at depth 1 every row continues from the committed state) -> (B*W, V)
        draft logits, fp32 or (``fp32=False``, for a caller that only ranks them) in the model dtype."""
        if not 1 <= depth < self.S:
            raise ValueError(f"draft depth {depth} outside 1 .. {self.S - 1}")
        if parents is not None and not self.reorders:
            raise ValueError("this draft engine was built with reorders=False: its rows cannot change parents")
        if parents is None:  # slots and positions were set at reset / by the absorb: no index arithmetic per call
            src, dst = self._slots[depth - 1]
        else:
            src = self.home[self.seq] if depth == 1 else self._work(depth - 1, parents % self.W)
            dst = self._slots[depth - 1][1]
        if self.kv and parents is not None:  # ancestors by depth: only attention reads them
            self.anc.copy_(self.anc[parents])
        ids = tokens.to(self.model.device)[:, None]
        for kv in self.kv:
            kv.set_call("depth", depth, self.anc)
        self.ctx.step = StepInputs(ids, self._pos[:, depth - 1:depth], seq_index=self.seq, kv_bound=self.capacity,
                                   src_slot=src, dst_slot=dst)
        with decode_fusion_scope(self.fusion):
            logits = self.model(ids, self.ctx, fp32=fp32)[:, -1]
        if self.kv:
            self.anc[:, depth] = torch.arange(self.anc.shape[0], device=ids.device)
        return logits

    def cache_bytes(self) -> int:
        """State slots + KV caches of the draft."""
        return self.strategy.cache_bytes() + sum(kv.nbytes() for kv in self.kv)
