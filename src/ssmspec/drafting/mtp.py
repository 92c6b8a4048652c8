"""`mtp`: chains of ``draft_len`` (S) tokens from the target's own multi-token-prediction head
(``models/mtp.py``), as vLLM drafts with the MTP heads of Qwen3.5, Qwen3-Next and Nemotron-3 (seed 000, Fig. 8).

Entry t of the head combines the target's final hidden state h_t with the embedding of token t + 1 and predicts
token t + 2; its attention keeps its own KV cache over the entries, one slot per position t (RoPE position t).
Each sequence keeps ``consumed`` entries committed (0 .. consumed - 1): every token the target has folded into its
state whose next token is known, i.e. the buffer length - 1 after each step. One draft step, on the device:

    absorb   one call of B rows x (1 + S) entries, right-padded: the entries the target verified since the last
             step (the pending token and the accepted drafts: their hidden states were handed over by the target,
             ``observe_hidden``; their next tokens are in the buffer, the bonus last); the valid keys join the KV
             cache; the head's output at the last one is the root
    chain    draft 1 = argmax lm_head(root); draft k + 1 from (the head's output for draft k, embedding of
             draft k) at depth k = 1 .. S - 1, one token per row, attending the committed entries and the
             chain's own keys (``DraftKV``), so rejected drafts never touch the cache

The hidden-state handoff (``engine/step.py``): a drafter with ``wants_hidden`` makes the target's step keep the
final hidden states of its verify forward (after the final norm: what the LM head reads) and hand over, after the
verdict, those of the pending token and the accepted path (B, 1 + S, d), gathered on the device by the verdict's
path; at prefill ``Engine.prefill`` hands over the prompt's (``observe_prompt``): entries 0 .. T - 2 are prefilled
into the cache and the last prompt token's state waits for its next token (the first one emitted). Both are device
copies into static buffers, so ``propose_device`` reads no host value and is captured in the drafter's graph.

Greedy drafts (``q`` None: one-hot for the verifiers, exact under speculative sampling too). The head must have
one layer (the published ones do); a target without a head is refused, naming how to get one.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.drafting.model_drafter import token_buffer
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.engine.context import RunContext
from ssmspec.engine.draft import DEFAULT_MAX_NEW_TOKENS
from ssmspec.models.config import ModelConfig
from ssmspec.models.kv_cache import DraftKV
from ssmspec.models.model import HybridLM
from ssmspec.models.mtp import mtp_hidden
from ssmspec.strategies.base import SpecConfig, StepInputs


def check_head(cfg: ModelConfig) -> None:
    """Refuse a model without an MTP head, naming the two ways to get one."""
    if not cfg.mtp_layers:
        raise ValueError(f"model {cfg.name!r} has no MTP head (mtp_layers=0), so the mtp drafter has nothing to chain; "
                         f"load a checkpoint that ships mtp.* weights (its config.json declares mtp_num_hidden_layers or "
                         f"num_nextn_predict_layers), or train a head on the target with `python -m ssmspec train ... "
                         f"mtp.layers=1` and load that target")


@register_drafter("mtp")
class MTPDrafter(DrafterBase):
    """Chains of ``draft_len`` tokens from ``target``'s MTP head (module doc)."""

    on_device = True
    wants_hidden = True  # the engine hands over the target's final hidden states (engine/step.py)

    def __init__(self, *, target: HybridLM | None = None, draft_len: int = 4) -> None:
        super().__init__()
        if draft_len < 1:
            raise ValueError(f"mtp needs draft_len >= 1, got {draft_len} (no speculation: use drafter=none)")
        if not isinstance(target, HybridLM):
            raise ValueError("the mtp drafter chains the target's own MTP head: pass target=<the target HybridLM> "
                             "(the run passes it when it builds the drafter)")
        check_head(target.cfg)
        self.target, self.S = target, draft_len
        self.spec = SpecConfig(draft_len=draft_len)
        self._record(target=target.cfg.name, draft_len=draft_len)

    def check_target(self, cfg: ModelConfig) -> None:
        """The head drafts for the model it belongs to only."""
        if cfg != self.target.cfg:
            raise ValueError(f"the mtp drafter chains the MTP head of {self.target.cfg.name!r} but runs with target "
                             f"{cfg.name!r}; build it with target= the model it drafts for")

    # reset ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        """Allocate every buffer for ``prompts``: the KV cache for the prompt, ``max_new_tokens`` (default
        ``DEFAULT_MAX_NEW_TOKENS``) and one step in flight; the prompt entries count as committed (zero keys and
        hidden states until ``observe_prompt`` fills them: a benchmark's synthetic start keeps them)."""
        model, cfg = self.target, self.target.cfg
        dev, dtype = model.device, model.dtype
        B, S, A = len(prompts), self.S, 1 + self.S
        plen = [len(p) for p in prompts]
        if not B or min(plen) == 0:
            raise ValueError("every prompt needs at least one token")
        budget = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        Tp, slack = max(plen), self.spec.nodes + 2  # the engine's last step may append a whole window
        capacity = Tp + budget + slack
        if model.mtp.attention_blocks and capacity > cfg.max_seq_len:
            if max_new_tokens is not None or Tp + slack >= cfg.max_seq_len:
                raise ValueError(f"the MTP head of {cfg.name} needs {capacity} KV slots (prompt {Tp} + max_new_tokens "
                                 f"{budget} + {slack} in flight) but the model allows max_seq_len={cfg.max_seq_len}; "
                                 f"raise max_seq_len, shorten the prompt or lower max_new_tokens")
            capacity = cfg.max_seq_len
        self.batch, self.capacity, self.prompt_len, self.prompt_max, self.slack = B, capacity, plen, Tp, slack
        self.kv = [DraftKV(B, 1, S, cfg.n_kv_heads, cfg.attn_head_dim, capacity, max_new=max(Tp, A), device=dev,
                           dtype=dtype) for _ in range(model.mtp.attention_blocks)]
        self.ctx = RunContext(None, self.kv, None)  # the head has no SSM block: no strategy
        self.consumed = torch.tensor(plen, device=dev) - 1  # (B,) committed entries; the last prompt token waits
        for kv in self.kv:
            kv.cache.length.copy_(self.consumed)
        self.hidden = torch.zeros(B, A, cfg.d_model, device=dev, dtype=dtype)  # target's h of entries consumed ..
        self.root = torch.zeros(B, cfg.d_model, device=dev, dtype=dtype)  # head output at the last committed entry
        self.anc = torch.arange(B, device=dev)[:, None].expand(B, max(S, 1))  # (B, S) a chain's ancestors: itself
        self._cols = torch.arange(A, device=dev)[None]  # (1, A)

    @torch.no_grad()
    def observe_prompt(self, ids: Tensor, valid: Tensor, hidden: Tensor) -> None:
        """The target's prefill: left-padded prompts ids, valid (B, T) and their final hidden states (B, T, d).
        Entries 0 .. n - 2 of every prompt (next token in the prompt) are prefilled into the cache; the last
        one's hidden state waits for the first emitted token (the next absorb). Columns that pad every row are
        dropped first: the KV scratch is sized at reset for the longest prompt, not the engine's prefill width."""
        common = int((~valid).sum(1).min())
        if common:
            ids, valid, hidden = ids[:, common:], valid[:, common:], hidden[:, common:]
        B, T = valid.shape
        dev = valid.device
        n, pads = valid.sum(1), (~valid).sum(1)
        self.hidden[:, 0].copy_(hidden[:, -1])
        self.consumed.copy_(n - 1)
        for kv in self.kv:
            kv.cache.length.zero_()
            kv.cache.start.zero_()
        if T == 1:
            return
        nxt, v = ids[:, 1:], valid[:, :-1]  # entry j: hidden j, token j + 1 (left padding: valid[:, j] decides)
        positions = (torch.arange(T - 1, device=dev)[None] - pads[:, None]).clamp(min=0)
        for kv in self.kv:
            kv.set_call("commit")
        self.ctx.step = StepInputs(nxt, positions, valid=v, prefill=True)
        mtp_hidden(self.target, nxt, hidden[:, :-1], self.ctx)
        slots = (torch.arange(self.capacity, device=dev)[None] + pads[:, None]).clamp(max=self.capacity - 1)
        rows, cols = torch.arange(B, device=dev), torch.arange(T - 1, device=dev)[None].expand(B, T - 1)
        for kv in self.kv:  # commit, then drop the left padding: entry j of row b sits at slot j
            c = kv.cache
            c.commit(rows, cols, torch.full((B,), T - 1, device=dev, dtype=torch.long))
            idx = slots[:, None, :, None].expand_as(c.k)
            c.k.copy_(c.k.gather(2, idx))
            c.v.copy_(c.v.gather(2, idx))
            c.length.copy_(n - 1)

    def observe_hidden(self, hidden: Tensor) -> None:
        """The target's final hidden states of the pending token and the accepted drafts, (B, 1+S', d) in path
        order (engine/step.py): the entries ``consumed`` .. of the next absorb. Device copy, capturable."""
        m = min(hidden.shape[1], self.hidden.shape[1])
        self.hidden[:, :m].copy_(hidden[:, :m])

    # one draft step ---------------------------------------------------------------------------------
    def check_buffer(self, buf: TokenBuffer) -> None:
        """Shape checks only (no device read)."""
        if buf.tokens.shape[0] != self.batch:
            raise ValueError(f"token buffer has {buf.tokens.shape[0]} sequences but the drafter was reset for "
                             f"{self.batch}")
        if self.kv and buf.capacity > self.capacity:
            raise ValueError(f"the token buffer holds up to {buf.capacity} tokens per sequence but the MTP head keeps "
                             f"{self.capacity} KV slots (sized at reset for prompt {self.prompt_max} + max_new_tokens + "
                             f"{self.slack}); pass reset(..., max_new_tokens={buf.capacity - self.prompt_max - self.slack})"
                             f" or more")

    def _absorb(self, buf: TokenBuffer) -> None:
        """The entries verified since the last step, in one call of width 1 + S (module doc); sets ``root``."""
        B, col = self.batch, self._cols
        n = (buf.length - 1 - self.consumed).clamp(min=0, max=col.shape[1])  # (B,) new entries
        valid = col < n[:, None]  # (B, A)
        ids = buf.tokens.gather(1, (self.consumed[:, None] + 1 + col).clamp(max=buf.capacity - 1))  # tokens t + 1
        ids = torch.where(valid, ids, self.target.cfg.pad_token_id)
        for kv in self.kv:
            kv.set_call("commit")
        self.ctx.step = StepInputs(ids, self.consumed[:, None] + col, valid=valid, kv_bound=self.capacity)
        g = mtp_hidden(self.target, ids, self.hidden, self.ctx)  # (B, A, d)
        last = g.gather(1, (n - 1).clamp(min=0)[:, None, None].expand(-1, 1, g.shape[-1]))[:, 0]  # (B, d)
        for kv in self.kv:
            kv.cache.commit(torch.arange(B, device=ids.device), col.expand(B, -1), n)
        self.root.copy_(torch.where((n > 0)[:, None], last, self.root))  # nothing new: keep the root
        self.consumed += n

    @torch.no_grad()
    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        """The engine's buffer -> one chain of S tokens per sequence (B, S); device ops only, no host sync."""
        self.check_buffer(buf)
        self._absorb(buf)
        model, h = self.target, self.root[:, None]  # (B, 1, d)
        tok = model.logits(self.root).argmax(-1)  # (B,) draft 1
        toks = [tok]
        for k in range(1, self.S):  # draft k + 1 from the head's output for draft k, at position consumed - 1 + k
            for kv in self.kv:
                kv.set_call("depth", k, self.anc)
            self.ctx.step = StepInputs(tok[:, None], (self.consumed - 1 + k)[:, None], kv_bound=self.capacity)
            h = mtp_hidden(model, tok[:, None], h, self.ctx)
            tok = model.logits(h[:, 0]).argmax(-1)
            toks.append(tok)
        return DraftTree.from_chains(torch.stack(toks, dim=1)[:, None])

    @torch.no_grad()
    def propose(self, history: list[list[int]], pending: Tensor) -> DraftTree:
        """Host lists (every token so far, pending last) -> the same chains as ``propose_device``. The head absorbs
        only entries whose target hidden states were handed over since the last step (reads the device counters:
        host use only)."""
        if len(history) != self.batch:
            raise ValueError(f"history has {len(history)} sequences but the drafter was reset for {self.batch}")
        buf = token_buffer(history, self.prompt_len, self.target.device)
        behind = (buf.length - 1 - self.consumed).tolist()
        if min(behind) < 0 or max(behind) > 1 + self.S:
            raise ValueError(f"history is {behind} entries ahead of the MTP head; it absorbs 0 .. 1 + draft_len = "
                             f"{1 + self.S} a step, with the target's hidden states of the last step (observe_hidden)")
        return self.propose_device(buf)

    def cache_bytes(self) -> int:
        """KV caches and hidden-state buffers of the head."""
        return sum(kv.nbytes() for kv in self.kv) + sum(t.numel() * t.element_size() for t in (self.hidden, self.root))
