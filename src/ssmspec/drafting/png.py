"""`png`: prompt n-gram lookup drafting, PNG(n, d) of seed 001 (section 5.2, after prompt-lookup decoding).

Each step, the last ``ngram`` tokens of a sequence (pending token included) are looked up in everything
before them (prompt and output so far); the ``draft_len`` tokens that followed an earlier occurrence are a
draft. Up to ``num_drafts`` distinct drafts are kept: longest n-gram first (n, n-1, ..., ``min_ngram``),
most recent occurrence first within one n. Seed 001's PNG(6, 2) drafts 2 chains of 6 tokens; here the
match length is its own option, so that setting reads ``num_drafts=2, draft_len=6`` with ``ngram`` n.

Fill rules (deterministic, every draft valid): a continuation that runs into the end of the history is
padded by repeating its last token; when fewer than ``num_drafts`` drafts are found the rest repeat the
pending token ``draft_len`` times (a guess like any other: verified, usually rejected).

``merge=True`` merges the drafts into one prefix tree (shared prefixes verified once; fixed size
``num_drafts * draft_len``, see ``drafting/merge.py``), which needs a strategy that verifies trees.

On the device (``ngram_drafts_device``, used by ``propose_device``): the same drafts as the host lookup, as
fixed-shape tensor ops over the engine's token buffer, so the engine captures the lookup in its drafter
graph. Every earlier end position e of a match gets the length m(e) of the suffix match ending there (capped
at ``ngram`` and at the history); the host's order -- longest n first, most recent first -- is the order of
(m(e), e) descending, and a match's continuation depends on e only (the tokens after e). ``num_drafts``
rounds each take the best remaining e and drop every candidate with the same continuation (the host's
"distinct drafts"). ``merge=True`` merges on the host (``merge_chains`` walks token lists): that drafter
is not on the device and says so (``on_device`` False).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.drafting.merge import merge_chains
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.strategies.base import SpecConfig


def ngram_drafts(history: list[int], *, ngram: int, num_drafts: int, draft_len: int,
                 min_ngram: int = 1) -> list[list[int]]:
    """The PNG drafts of one sequence: ``num_drafts`` lists of ``draft_len`` tokens (fill rules above)."""
    hist = torch.tensor(history, dtype=torch.long)
    L = hist.numel()
    drafts: list[list[int]] = []
    for n in range(min(ngram, L - 1), min_ngram - 1, -1):
        if len(drafts) == num_drafts:
            break
        key = hist[L - n:]  # (n,) the suffix, pending token last
        windows = hist[:L - 1].unfold(0, n, 1)  # (L-n, n): every earlier n-gram with a token after it
        starts = (windows == key).all(dim=1).nonzero()[:, 0].flip(0).tolist()  # most recent first
        for i in starts:
            cont = history[i + n:i + n + draft_len]
            cont = cont + [cont[-1]] * (draft_len - len(cont))
            if cont not in drafts:
                drafts.append(cont)
                if len(drafts) == num_drafts:
                    break
    while len(drafts) < num_drafts:
        drafts.append([history[-1]] * draft_len)
    return drafts


def ngram_drafts_device(tokens: Tensor, length: Tensor, *, ngram: int, num_drafts: int, draft_len: int,
                        min_ngram: int = 1) -> Tensor:
    """``ngram_drafts`` for every row at once, on the device. tokens (B, C) int64 (row b valid in columns
    < length[b], pending token last), length (B,) -> drafts (B, num_drafts, draft_len). No host sync."""
    bsz, C = tokens.shape
    dev = tokens.device
    last = (length - 1).clamp(min=0)  # (B,) column of the pending token
    e = torch.arange(C, device=dev)[None]  # (1, C) candidate end columns of a match
    # m(e): how many of the last ``ngram`` tokens match backwards from e
    run = torch.ones(bsz, C, dtype=torch.bool, device=dev)
    m = torch.zeros(bsz, C, dtype=torch.long, device=dev)
    for j in range(ngram):
        key = tokens.gather(1, (last - j).clamp(min=0)[:, None])  # (B, 1) j-th token from the end
        at = tokens.gather(1, (e - j).clamp(min=0).expand(bsz, C))  # (B, C)
        run = run & (e - j >= 0) & (at == key)
        m = m + run.long()
    m = torch.minimum(m, last[:, None])  # an n-gram needs n <= L - 1 tokens before the pending one
    ok = (e <= last[:, None] - 1) & (m >= min_ngram)  # a token must follow the match inside the history
    score = torch.where(ok, m * C + e, -1)  # (B, C) longest match first, most recent first
    # continuation of e: tokens e+1 .. e+S, repeating the history's last token past its end
    k = torch.arange(draft_len, device=dev)
    cont_idx = torch.minimum(e[..., None] + 1 + k, last[:, None, None])  # (B, C, S)
    conts = tokens.gather(1, cont_idx.reshape(bsz, C * draft_len)).reshape(bsz, C, draft_len)
    fill = tokens.gather(1, last[:, None]).expand(bsz, draft_len)  # (B, S) pending token repeated
    drafts = []
    for _ in range(num_drafts):
        best = score.argmax(1)  # (B,)
        found = score.gather(1, best[:, None])[:, 0] >= 0
        pick = conts.gather(1, best[:, None, None].expand(bsz, 1, draft_len))[:, 0]  # (B, S)
        drafts.append(torch.where(found[:, None], pick, fill))
        same = (conts == pick[:, None, :]).all(-1) & found[:, None]  # (B, C) same continuation: not distinct
        score = score.masked_fill(same, -1)
    return torch.stack(drafts, dim=1)


@register_drafter("png")
class PromptNgram(DrafterBase):
    """PNG(n, d): ``num_drafts`` chains of ``draft_len`` tokens from n-gram matches in the history."""

    def __init__(self, *, ngram: int = 3, num_drafts: int = 1, draft_len: int = 4, min_ngram: int = 1,
                 merge: bool = False) -> None:
        super().__init__()
        if ngram < 1 or not (1 <= min_ngram <= ngram):
            raise ValueError(f"png needs 1 <= min_ngram <= ngram, got min_ngram={min_ngram}, ngram={ngram}")
        if num_drafts < 1 or draft_len < 1:
            raise ValueError(f"png needs num_drafts >= 1 and draft_len >= 1, got {num_drafts}, {draft_len} "
                             f"(no speculation: use drafter=none)")
        self.ngram, self.min_ngram, self.num_drafts, self.draft_len, self.merge = (
            ngram, min_ngram, num_drafts, draft_len, merge)
        self.is_tree = merge
        self.on_device = not merge  # merge_chains walks host lists
        nodes = num_drafts * draft_len
        self.spec = (SpecConfig(draft_len=draft_len, tree_size=nodes) if merge
                     else SpecConfig(draft_len=draft_len, num_drafts=num_drafts))
        self.device = torch.device("cpu")
        self._record(ngram=ngram, num_drafts=num_drafts, draft_len=draft_len, min_ngram=min_ngram, merge=merge)

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        self.device = torch.device(device)

    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        if self.merge:
            return super().propose_device(buf)
        tokens = ngram_drafts_device(buf.tokens, buf.length, ngram=self.ngram, num_drafts=self.num_drafts,
                                     draft_len=self.draft_len, min_ngram=self.min_ngram)
        return DraftTree.from_chains(tokens)

    def propose(self, history: list[list[int]], pending: Tensor) -> DraftTree:
        rows = [ngram_drafts(h, ngram=self.ngram, num_drafts=self.num_drafts, draft_len=self.draft_len,
                             min_ngram=self.min_ngram) for h in history]
        tokens = torch.tensor(rows, dtype=torch.long)  # (B, D, S)
        if self.merge:
            return merge_chains(tokens, size=self.spec.tree_size, device=self.device)
        return DraftTree.from_chains(tokens.to(self.device))
