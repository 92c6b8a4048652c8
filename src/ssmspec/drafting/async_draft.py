"""`async_draft`: asynchronous speculation with a speculation cache (seed 002, "speculative speculative decoding").

While the target verifies round i's chain d_1 .. d_S, the draft model prepares round i + 1 for several possible
verdicts (k accepted drafts, bonus b) at once; when the verdict arrives one device-side lookup either finds the
next drafts ready (a hit) or falls back to a backup predictor (a miss). One round, in the engine's order:

    lookup(buf)           (main stream, on the critical path) ``saguaro.cache_lookup``'s match of the last verdict
                          against the cache keys, in one launch (``ops/cache_lookup``); hit rows take their branch's S
                          tokens (and q); it also writes the flag ``miss_any`` that ``missed()`` reads
    backup_drafts(buf)    (main stream, only when a row missed: the engine asks ``missed()`` on the host) miss rows
                          take the backup's drafts: ``draft`` (the draft model drafts synchronously from its state
                          after d_k: feed b, then S - 1 more, exactly what the ``draft_model`` drafter proposes),
                          ``ngram`` (prompt n-gram lookup over the token buffer) or ``random`` (uniform tokens); q
                          one-hot for the last two
    speculate()           (side stream, concurrent with the target's verification) one call of B rows x (S + 1)
                          tokens [b, d_1 .. d_S] from the draft state after d_k of the previous chain stores the
                          state after every token (the new chain at depths 0 .. S) and gives the logits at every
                          depth; ``saguaro.bonus_candidates`` turns them into N = sum(fanout) keys per sequence;
                          then S calls of B*N rows draft every branch (call 1 feeds the branch's bonus candidate
                          from the chain state at its depth k, calls 2 .. S the branch's previous draft).
    observe(verdict)      (inside the target's step) keeps (k, b) on the device for the next lookup.

Why re-feed the chain in speculate instead of keeping every branch's states: the chain's states at depths 0 .. S
are recomputed off the critical path in one wide call (the count of draft calls per round is the same as feeding
d_S alone: 1 + S), so the states of a hit branch are never needed after the round and the slot bookkeeping is
three fixed regions per sequence with no index tables: the chain (S + 1 slots, rewritten in place: the fused ops
read a row's start state before they store), one scratch slot for the backup draft, and one slot per branch
(updated in place by its S calls). The first round has no cache: it is a miss from the prefilled state.

Greedy: hits and ``backup: draft`` misses propose exactly the draft model's greedy continuation of the accepted
prefix, the ``draft_model`` drafter's drafts (tests/test_async_draft.py checks it round by round). Sampled: drafts
are drawn from the draft distribution with its top max(fanout) + 1 tokens scaled by ``residual_scale`` (lambda,
``saguaro.rescale_top``) and that same q is what speculative sampling verifies with, so the target's law holds;
a branch's draws use their own generator and never see the target's random numbers, so a hit's drafts are a
fresh draw from q given the prefix.

Fixed shapes, device ops only: the lookup, the backup (it runs for every row; hit rows keep their branch) and the
branch calls are capturable; ``engine/speculate.py`` replays the backup only in rounds where a row missed, so a
round where every row hit has nothing but the lookup on the critical path. With ``backup: draft`` a miss costs a
whole synchronous draft (S calls of B rows); the fast backups (``ngram``, ``random``: Saguaro's backoff) cost
acceptance instead, and at large batches some row misses almost every round. Counters on the device for benches:
``rounds`` (rounds with a cache) and ``hits`` (B,).
Memory beyond the draft model: (S + 2 + N) state slots per sequence and, when sampling, the branches' q
(B, N, S, V) fp32.

Drafts with attention layers (Nemotron-H, Qwen3.5 hybrids, MambaInLlama): each attention layer keeps, besides the
committed keys, the last chain's S + 1 keys and every branch's and the backup's own keys (``drafting/async_kv.py``);
a branch that continues the chain after depth k attends the committed keys, the chain's columns 0 .. k and its own,
exactly the keys its start state has absorbed. The chain's accepted prefix (the bonus and the accepted drafts: what
the state after d_k has absorbed) joins the committed keys at the start of the next ``speculate``; the backup,
which runs before it, sees that prefix as extra keys. Positions (RoPE) follow from the committed length.

The draft on its own device (``draft_device``, e.g. ``cuda:1``; ``drafting/draft_device.py``): the draft model, its
slots and the draft side of the round (``speculate``, the ``draft`` backup) live there, while the lookup, the round's
drafts and a copy of the cache stay on the target's device. Three transfers a round, all small and in stream order
(``engine/speculate.py`` places them): ``send`` (target -> draft: the bonus, the start slot and the drafts, packed
into one (B, 2 + S) tensor), ``fetch_cache`` (draft -> target: keys and branch tokens as one (B, N, 1 + S) tensor,
and q when sampling) and, in a round where a row missed and the backup is ``draft``, ``fetch_backup``. Without a
draft device the same tensors are shared and nothing is copied.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from ssmspec.drafting.async_kv import AsyncKV
from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.drafting.draft_device import parse_draft_device, resolve_draft_device
from ssmspec.drafting.draft_model import draw
from ssmspec.drafting.model_drafter import ModelDrafterBase
from ssmspec.drafting.png import ngram_drafts_device
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.drafting.saguaro import bonus_candidates, branch_depths, check_fanout, rescale_top
from ssmspec.ops.cache_lookup import cache_lookup_step
from ssmspec.ops.dispatch import decode_fusion_scope
from ssmspec.strategies import StepInputs
from ssmspec.strategies.base import SpecConfig
from ssmspec.verify.distributions import SamplingConfig, target_probs

BACKUPS = ("draft", "ngram", "random")
NGRAM = 3  # longest suffix the ngram backup matches (png's default match length)


@register_drafter("async_draft")
class AsyncDraft(ModelDrafterBase, DrafterBase):
    """One chain of ``draft_len`` tokens per sequence, the next round speculated while the target verifies
    (module doc). ``fanout``: S + 1 cache branch counts per accepted length (``saguaro``)."""

    def __init__(self, *, draft="mamba2-130m", draft_len: int = 4, fanout: list[int] | None = None,
                 backup: str = "draft", residual_scale: float = 1.0, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, sample_seed: int = 0, seed: int = 0, dtype: str | None = None,
                 draft_strategy: str = "snapshot", draft_device: str | None = None) -> None:
        super().__init__()
        if draft_len < 1:
            raise ValueError(f"async_draft needs draft_len >= 1, got {draft_len} (no speculation: use drafter=none)")
        fanout = [1] * (draft_len + 1) if fanout is None else fanout
        self.fanout = check_fanout(fanout, draft_len)
        if backup not in BACKUPS:
            raise ValueError(f"unknown backup {backup!r} for cache misses; choose one of: {', '.join(BACKUPS)}")
        if not 0.0 < residual_scale <= 1.0:
            raise ValueError(f"residual_scale (lambda) must lie in (0, 1] (1: no scaling), got {residual_scale}")
        self.sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=sample_seed)
        if residual_scale != 1.0 and self.sampling.greedy:
            raise ValueError(f"residual_scale={residual_scale} changes only sampled drafts; set temperature > 0 or "
                             f"residual_scale=1")
        opts = self._init_draft(draft, seed=seed, dtype=dtype, draft_strategy=draft_strategy)
        self._draft_device = draft_device
        dev_d = parse_draft_device(draft_device)  # a GPU this machine lacks fails here, before anything loads
        cfg = self._draft_cfg
        if max(self.fanout) + 1 > cfg.vocab_size:
            raise ValueError(f"fanout {list(self.fanout)} asks for {max(self.fanout)} bonus candidates at one depth but "
                             f"draft model {cfg.name} has {cfg.vocab_size} tokens; lower the fanout")
        self.S, self.N, self.backup, self.lam = draft_len, sum(self.fanout), backup, residual_scale
        self.spec = SpecConfig(draft_len=draft_len, num_drafts=1)
        self._record(**opts, draft_len=draft_len, fanout=list(self.fanout), backup=backup,
                     residual_scale=residual_scale, temperature=temperature, top_p=top_p, top_k=top_k,
                     sample_seed=sample_seed, draft_device=None if dev_d is None else str(dev_d))
        self.draft_device = dev_d  # None: the target's device
        self.remote = dev_d is not None  # the draft on its own device: transfers each round (module doc)

    def _shape(self):
        """The draft engine's W "drafting slots" per sequence are this drafter's slot regions (module doc): the
        chain's S + 1, one scratch slot, N branch slots. No row changes parents."""
        return self.S + 2 + self.N, self.S, False

    # reset ------------------------------------------------------------------------------------------
    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        """Prefill the draft on ``prompts`` (on its own device when ``draft_device`` names one); allocate the
        cache and the counters (fixed shapes)."""
        dev = torch.device(device)  # the target's device: the lookup and everything the engine reads
        dev_d = resolve_draft_device(self._draft_device, dev)  # the target's own GPU is refused there
        if dev_d is not None and self._draft_model is not None and self._draft_model.device != dev_d:
            raise ValueError(f"draft model {self._draft_cfg.name} lives on {self._draft_model.device} but "
                             f"draft_device is {dev_d}; load it there (models.loading.load_model(..., device="
                             f"'{dev_d}')) or pass the preset's name")
        with self._draft_side():  # Triton launches on the current device: the draft's for its prefill
            eng = self._reset_engine(prompts, dev_d or dev, max_new_tokens=max_new_tokens)
        dd, B, S, N, V = eng.model.device, eng.batch, self.S, self.N, eng.model.cfg.vocab_size
        self.backup_remote = self.remote and self.backup == "draft"  # the draft backup runs on the draft device
        self.gen = torch.Generator(device=dd if self.backup == "draft" else dev).manual_seed(self.sampling.seed)
        self.spec_gen = torch.Generator(device=dd).manual_seed(self.sampling.seed + 1)  # branch draws
        long = dict(dtype=torch.long, device=dev)
        # target side: the verdict, the round's drafts (and q), the cache as the lookup reads it, counters
        self.src = eng.home.to(dev, copy=True)  # (B,) draft slot after d_k of the last chain (first round: the prompt's)
        self.bonus = torch.zeros(B, **long)  # (B,) the last verdict's bonus (the pending token)
        self.v_acc, self.v_bonus = torch.zeros(B, **long), torch.zeros(B, **long)  # written by observe()
        self.drafts = torch.zeros(B, S, **long)  # this round's drafts
        self.cache = torch.zeros(B, N, 1 + S, **long)  # per branch: its key (bonus candidate), then its S drafts
        greedy = self.sampling.greedy
        self.q = None if greedy else torch.zeros(B, S, V, device=dev)
        self.branch_q = None if greedy else torch.zeros(B, N, S, V, device=dev)
        self.depths = branch_depths(self.fanout, device=dev)  # (N,) accepted length of each branch
        self.have_cache = torch.zeros(1, dtype=torch.bool, device=dev)  # False until the first speculate
        self.hit = torch.zeros(B, dtype=torch.bool, device=dev)  # this round's hits
        self.branch = torch.zeros(B, **long)  # this round's branch per row (0 where it missed)
        self.miss_any = torch.zeros((), dtype=torch.bool, device=dev)  # some row missed: the backup runs
        self.rounds = torch.zeros((), **long)  # rounds that found a cache (counters for benches)
        self.hits = torch.zeros(B, **long)  # hits per sequence over those rounds
        # draft side: slot regions, and what the draft calls read and write (aliases of the above on one device)
        base = B + torch.arange(B, device=dd) * eng.W  # (B,) first slot of each sequence's regions
        self.chain = base[:, None] + torch.arange(S + 1, device=dd)[None]  # (B, S+1) state after depth j
        self.chain_t = self.chain.to(dev)  # the lookup's copy (slot numbers)
        self.scratch = base + S + 1  # (B,)
        self.work = (base[:, None] + S + 2 + torch.arange(N, device=dd)[None]).reshape(B * N)  # (B*N,)
        self.branch_src = self.chain[:, branch_depths(self.fanout, device=dd)].reshape(B * N)  # chain slot per branch
        self._attention(eng, dd)
        if self.remote:
            self.io = torch.zeros(B, 2 + S, **long)  # send(): bonus | src | drafts, packed
            self.io_d = torch.zeros(B, 2 + S, dtype=torch.long, device=dd)
            self.bonus_d, self.src_d, self.drafts_d = self.io_d[:, 0], self.io_d[:, 1], self.io_d[:, 2:]
            self.cache_d = torch.zeros(B, N, 1 + S, dtype=torch.long, device=dd)
            self.branch_q_d = None if greedy else torch.zeros(B, N, S, V, device=dd)
            self.b_tokens = torch.zeros(B, S, **long)  # fetch_backup(): the draft backup's drafts (and q)
            self.b_tokens_d = torch.zeros(B, S, dtype=torch.long, device=dd)
            self.b_q = None if greedy else torch.zeros(B, S, V, device=dev)
            self.b_q_d = None if greedy else torch.zeros(B, S, V, device=dd)
        else:
            self.bonus_d, self.src_d, self.drafts_d = self.bonus, self.src, self.drafts
            self.cache_d, self.branch_q_d = self.cache, self.branch_q
        if self.remote and dd.type == "cuda":
            # the draft's prefill and the slot tables above were queued on the draft GPU's current stream; the
            # engine's streams there (created non-blocking) never wait on it, so the first round's speculation
            # could read slots the prefill has not written yet: finish them before any round starts
            torch.cuda.synchronize(dd)
        self._fresh = True  # host flag: the first round reads the pending token from the buffer

    def _attention(self, eng, dd) -> None:
        """Attention layers: ``AsyncKV`` over each prefilled cache (module doc) and the calls' position tensors;
        nothing for a draft without attention (its calls' positions are unused and stay zero)."""
        B, S, N = eng.batch, self.S, self.N
        long = dict(dtype=torch.long, device=dd)
        self.kv = None
        self.pos_chain = torch.zeros(B, S + 1, **long)
        self.pos_branch = torch.zeros(B * N, 1, **long)
        self.pos_backup = torch.zeros(B, 1, **long)
        if not eng.kv:
            return
        depth = branch_depths(self.fanout, device=dd)  # (N,)
        self.kv = [AsyncKV(kv.cache, batch=B, depth=S, branch_depth=depth) for kv in eng.kv]
        eng.kv = eng.ctx.kv = self.kv  # the engine's own drafting KV (DraftKV) is not used by these calls
        self.ncommit = torch.zeros(B, **long)  # accepted prefix of the last chain (0: none yet)
        self.branch_off = (depth + 1).repeat(B)  # (B*N,) position of a branch's first token past the chain's bonus
        self.chain_off = torch.arange(S + 1, device=dd)  # (S+1,) chain depths 0 .. S past the committed length
        self.pos_start = torch.zeros(B * N, **long)  # (B*N,) position of each branch's first token (speculate)

    def _chain_prefix(self, src: Tensor) -> Tensor:
        """(B,) tokens of the last chain that the state in slot ``src`` has absorbed (d_k's slot: k + 1; a
        sequence's home slot, before its first chain: 0)."""
        torch.mul(src - self.chain[:, 0] + 1, src >= self.engine.batch, out=self.ncommit)
        return self.ncommit

    def _draft_side(self):
        """The draft's GPU as the current device (its kernels launch there); nothing to switch on one device."""
        dev = self.draft_device
        return torch.cuda.device(dev) if self.remote and dev.type == "cuda" else nullcontext()

    def generators(self) -> list[torch.Generator]:
        """Generators the backup draws from (on the draft device when ``backup_remote``): a sampled ``draft``
        backup's and the ``random`` backup's, greedy or not."""
        return [self.gen] if self.backup == "random" or not self.sampling.greedy else []

    def speculate_generators(self) -> list[torch.Generator]:
        """Generators ``speculate`` draws from (the branches'): a graph capturing it registers them."""
        return [] if self.sampling.greedy else [self.spec_gen]

    # draft model calls ------------------------------------------------------------------------------
    def _call(self, ids: Tensor, src: Tensor, dst: Tensor, pos: Tensor, kind: str, call: int = 0) -> Tensor:
        """One slot-addressed draft call: ids (R, L) at positions ``pos`` from the states in slots src (R,), the
        state after token t into slot dst[r, t] -> (R, L, V) logits (fp32); attention layers attend as ``kind``
        (``AsyncKV``: chain, branch or backup, ``call`` its index)."""
        eng = self.engine
        for kv in self.kv or ():
            kv.set_call(kind, call)
        eng.ctx.step = StepInputs(ids, pos, src_slot=src, dst_slot=dst, kv_bound=eng.capacity)
        with decode_fusion_scope(eng.fusion):  # the draft's decode kernels, as in the engine's own calls
            return eng.model(ids, eng.ctx).float()

    def _draw(self, logits: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor | None]:
        """(R, V) logits -> (R,) tokens and the q they were drawn from (R, V) (None: greedy). Sampled: the draft
        distribution with its top max(fanout) + 1 tokens scaled by lambda (module doc)."""
        if self.sampling.greedy:
            return logits.argmax(-1), None
        q = rescale_top(target_probs(logits, self.sampling), self.lam, max(self.fanout) + 1)
        return draw(q, gen), q

    # propose (critical path) ------------------------------------------------------------------------
    @torch.no_grad()
    def lookup(self, buf: TokenBuffer) -> DraftTree:
        """The cache lookup of the last verdict: hit rows take their branch's drafts (and q); miss rows keep
        stale ones until ``backup_drafts`` fills them. Returns the round's ``DraftTree`` over static tensors."""
        self.engine.check_buffer(buf)
        if self._fresh:  # first round: no verdict, no cache: every row misses
            self.bonus.copy_(buf.pending())
            self.hit.zero_()
            self.miss_any.fill_(True)
            self._fresh = False
        else:
            cache_lookup_step(self.v_acc, self.v_bonus, self.chain_t, self.cache, self.depths, self.have_cache,
                              bonus=self.bonus, src=self.src, hit=self.hit, branch=self.branch, drafts=self.drafts,
                              miss_any=self.miss_any, rounds=self.rounds, hits=self.hits)
            if self.q is not None:
                rows = torch.arange(self.engine.batch, device=self.branch.device)
                self.q.copy_(torch.where(self.hit[:, None, None], self.branch_q[rows, self.branch], self.q))
        return DraftTree.from_chains(self.drafts[:, None], None if self.q is None else self.q[:, None])

    @torch.no_grad()
    def backup_drafts(self, buf: TokenBuffer) -> None:
        """The backup predictor's drafts into the miss rows of the round's drafts (fixed shapes: it runs for
        every row; hit rows keep their branch). With ``backup_remote`` the engine runs ``send``, ``backup_draft``
        (draft device), ``fetch_backup`` and ``merge_backup`` instead."""
        self._merge(*self._backup(buf))

    def _merge(self, tokens: Tensor, q: Tensor | None) -> None:
        self.drafts.copy_(torch.where(self.hit[:, None], self.drafts, tokens))
        if self.q is not None:
            self.q.copy_(torch.where(self.hit[:, None, None], self.q, q))

    def missed(self) -> bool:
        """Host: did any row miss the cache this round (so the backup must run)? Reads the lookup's flag: a sync."""
        return bool(self.miss_any)

    @torch.no_grad()
    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        """Lookup and backup in one fixed-shape call (the engine splits them: ``engine/speculate.py``)."""
        if self.remote:
            raise ValueError("async_draft with a draft_device runs through the engine only (engine/speculate.py "
                             "places its transfers); use generate() / Engine")
        tree = self.lookup(buf)
        self.backup_drafts(buf)
        return tree

    def _backup(self, buf: TokenBuffer) -> tuple[Tensor, Tensor | None]:
        """Drafts (B, S) and their q (B, S, V) (None: greedy) for every row, as a miss would take them."""
        B, S, V = self.engine.batch, self.S, self.engine.model.cfg.vocab_size
        if self.backup == "draft":
            return self._draft_backup(self.bonus_d, self.src_d)
        if self.backup == "ngram":
            tokens = ngram_drafts_device(buf.tokens, buf.length, ngram=NGRAM, num_drafts=1, draft_len=S)[:, 0]
        else:
            tokens = torch.randint(V, (B, S), device=self.bonus.device, generator=self.gen)
        one_hot = None if self.q is None else torch.nn.functional.one_hot(tokens, V).float()
        return tokens, one_hot

    def _draft_backup(self, tok: Tensor, src: Tensor) -> tuple[Tensor, Tensor | None]:
        """The synchronous draft from the state after d_k: feed b, then S - 1 drafts (draft device). With
        attention, the last chain's accepted prefix is not committed yet: the backup sees it as extra keys."""
        toks, qs = [], []
        if self.kv:
            n = self._chain_prefix(src)
            for kv in self.kv:
                kv.set_visible(n)
            base = self.kv[0].cache.length + n  # position of b
        for c in range(self.S):
            if self.kv:
                torch.add(base, c, out=self.pos_backup[:, 0])
            logits = self._call(tok[:, None], src, self.scratch[:, None], self.pos_backup, "backup", c)
            tok, q = self._draw(logits[:, -1], self.gen)
            toks.append(tok)
            qs.append(q)
            src = self.scratch
        return torch.stack(toks, 1), None if self.q is None else torch.stack(qs, 1)

    # the draft on its own device: transfers and the draft-side half of the backup -----------------------
    def send(self) -> None:
        """Target -> draft device: this round's bonus, start slot and drafts, packed (one copy)."""
        torch.cat([self.bonus[:, None], self.src[:, None], self.drafts], 1, out=self.io)
        self.io_d.copy_(self.io, non_blocking=True)

    @torch.no_grad()
    def backup_draft(self) -> None:
        """The ``draft`` backup on the draft device (after ``send``): its drafts into ``b_tokens_d`` (and q)."""
        with self._draft_side():
            tokens, q = self._draft_backup(self.bonus_d, self.src_d)
            self.b_tokens_d.copy_(tokens)
            if q is not None:
                self.b_q_d.copy_(q)

    def fetch_backup(self) -> None:
        """Draft -> target device: the draft backup's drafts (and q)."""
        self.b_tokens.copy_(self.b_tokens_d, non_blocking=True)
        if self.b_q is not None:
            self.b_q.copy_(self.b_q_d, non_blocking=True)

    @torch.no_grad()
    def merge_backup(self) -> None:
        """Target device: the fetched backup drafts into the miss rows."""
        self._merge(self.b_tokens, self.b_q)

    def fetch_cache(self) -> None:
        """Draft -> target device: the cache ``speculate`` filled (keys and branch drafts; q when sampling)."""
        self.cache.copy_(self.cache_d, non_blocking=True)
        if self.branch_q is not None:
            self.branch_q.copy_(self.branch_q_d, non_blocking=True)
        self.have_cache.fill_(True)

    # speculate (off the critical path) --------------------------------------------------------------
    @torch.no_grad()
    def speculate(self) -> None:
        """Fill the cache for the verdicts of the round being verified (module doc; on the draft device, after
        ``send`` when it is a device of its own). Reads this round's drafts, bonus and start slots; writes the
        chain and branch slots, keys, branch tokens and q."""
        with self._draft_side():
            B, S, N = self.engine.batch, self.S, self.N
            ids = torch.cat([self.bonus_d[:, None], self.drafts_d], 1)  # (B, 1+S): b, d_1 .. d_S
            if self.kv:  # the last chain's accepted prefix joins the committed keys; b sits at the committed length
                n = self._chain_prefix(self.src_d)
                for kv in self.kv:
                    kv.commit_chain(n)
                length = self.kv[0].cache.length
                torch.add(length[:, None], self.chain_off[None], out=self.pos_chain)
                torch.add(length[self.kv[0].branch_seq], self.branch_off, out=self.pos_start)
            logits = self._call(ids, self.src_d, self.chain, self.pos_chain, "chain")  # (B, 1+S, V), depths 0 .. S
            keys = bonus_candidates(logits, self.drafts_d, self.fanout)  # (B, N)
            tok, src = keys.reshape(B * N), self.branch_src
            for c in range(S):  # call c + 1: every branch one token deeper
                if self.kv:  # branch n's token of call c + 1 at position length + k_n + 1 + c
                    torch.add(self.pos_start, c, out=self.pos_branch[:, 0])
                logits = self._call(tok[:, None], src, self.work[:, None], self.pos_branch, "branch", c)
                tok, q = self._draw(logits[:, -1], self.spec_gen)
                self.cache_d[:, :, 1 + c] = tok.reshape(B, N)
                if q is not None:
                    self.branch_q_d[:, :, c] = q.reshape(B, N, -1)
                src = self.work
            self.cache_d[:, :, 0] = keys
        if not self.remote:
            self.have_cache.fill_(True)

    def observe(self, verdict) -> None:
        """Keep the verdict (k, b) on the device for the next lookup (never read by a running speculate)."""
        self.v_acc.copy_(verdict.accepted)
        self.v_bonus.copy_(verdict.bonus)

    def hit_counts(self) -> tuple[int, list[int]]:
        """Host copy of the counters: (rounds with a cache, hits per sequence). Synchronises: after a run."""
        return int(self.rounds), self.hits.tolist()

    def propose(self, history, pending) -> DraftTree:
        raise ValueError("async_draft proposes from the engine's device token buffer only (propose_device); run it "
                         "through generate() / Engine")
