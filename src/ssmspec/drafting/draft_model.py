"""`draft_model`: chains from a small draft HybridLM (e.g. mamba2-130m drafting for mamba2-2.7b).

Each step the draft model's engine (``engine/draft.py``) absorbs what the target emitted since the last
step, resuming from its own state after the accepted drafts (``observe``: they are its tokens, fed at their
depths last step) so only the bonus is new, then continues ``draft_len`` tokens in one drafting row per chain
that starts from the committed state, so a rejected draft never needs rolling back. Greedy (``temperature=0``): the drafts are the draft model's
own greedy continuation of the committed prefix, and ``q`` is None (one-hot for the verifiers). With
``temperature > 0`` each token is sampled from the draft distribution (temperature / top-k / top-p) and
that distribution is recorded in ``DraftTree.q`` for speculative sampling; ``num_drafts`` chains are
then independent samples (identical under greedy drafting, so refused there: use ``beam_tree``).

``propose_device`` runs on the device with no host sync (CUDA-graph capturable): sampling draws from the
device generator ``gen`` made at ``reset``; a graph that captures it registers it first
(``torch.cuda.CUDAGraph.register_generator_state(drafter.gen)``) so each replay draws fresh numbers.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.drafting.model_drafter import ModelDrafterBase
from ssmspec.strategies.base import SpecConfig
from ssmspec.verify.distributions import SamplingConfig, target_probs


@register_drafter("draft_model")
class DraftModel(ModelDrafterBase, DrafterBase):
    """``num_drafts`` chains of ``draft_len`` tokens from ``draft`` (module doc)."""

    resumes = True  # observe() below

    def __init__(self, *, draft="mamba2-130m", draft_len: int = 4, num_drafts: int = 1, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, sample_seed: int = 0, seed: int = 0,
                 dtype: str | None = None, draft_strategy: str = "snapshot") -> None:
        super().__init__()
        if draft_len < 1 or num_drafts < 1:
            raise ValueError(f"draft_model needs draft_len >= 1 and num_drafts >= 1, got {draft_len}, {num_drafts} "
                             f"(no speculation: use drafter=none)")
        self.sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=sample_seed)
        if num_drafts > 1 and self.sampling.greedy:
            raise ValueError(f"num_drafts={num_drafts} greedy chains of one draft model are identical; sample them "
                             f"(temperature > 0) or draft a tree (beam_tree / static_tree)")
        self.S, self.D = draft_len, num_drafts
        self.spec = SpecConfig(draft_len=draft_len, num_drafts=num_drafts)
        opts = self._init_draft(draft, seed=seed, dtype=dtype, draft_strategy=draft_strategy)
        self._record(**opts, draft_len=draft_len, num_drafts=num_drafts, temperature=temperature, top_p=top_p,
                     top_k=top_k, sample_seed=sample_seed)

    def _shape(self):
        """One drafting row per chain, S deep; a chain's row never changes parents."""
        return self.D, self.S, False

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        """Prefill the draft on ``prompts``; ``max_new_tokens`` sizes its KV cache (``DraftEngine.reset``)."""
        eng = self._reset_engine(prompts, device, max_new_tokens=max_new_tokens)
        self.gen = torch.Generator(device=eng.model.device).manual_seed(self.sampling.seed)

    def generators(self) -> list[torch.Generator]:
        return [] if self.sampling.greedy else [self.gen]

    def observe(self, verdict) -> None:
        """The accepted drafts are this drafter's own tokens of one chain: the next absorb resumes from the
        draft's state after them instead of feeding them again (``DraftEngine.resume``). Device ops only."""
        if self.D == 1:  # one chain: its row is row 0 (``resume`` keeps it)
            self.engine.resume(None, verdict.accepted)
            return
        first = verdict.path[:, 1] if verdict.path.shape[1] > 1 else torch.zeros_like(verdict.accepted)
        chain = ((first - 1).clamp(min=0) // self.S).clamp(max=self.D - 1)  # node 1 + c*S + j: chain c
        self.engine.resume(chain, verdict.accepted)

    def _draft(self, root: Tensor) -> DraftTree:
        """root (B, V) draft logits after the pending token -> D chains of S tokens (B, D*S)."""
        eng, S, D = self.engine, self.S, self.D
        logits = root.repeat_interleave(D, dim=0) if D > 1 else root  # (B*D, V) at the root of each chain
        toks, qs = [], []
        for k in range(1, S + 1):
            if self.sampling.greedy:
                t = logits.argmax(-1)  # (B*D,)
            else:
                probs = target_probs(logits, self.sampling)  # (B*D, V)
                t = draw(probs, self.gen)
                qs.append(probs)
            toks.append(t)
            if k < S:  # greedy ranks the logits only: the model dtype's argmax is its exact fp32 upcast's
                logits = eng.step(t, depth=k, fp32=not self.sampling.greedy)
        bsz = root.shape[0]
        tokens = torch.stack(toks, dim=1).reshape(bsz, D, S).to(self.device)
        q = torch.stack(qs, dim=1).reshape(bsz, D, S, -1).to(self.device) if qs else None
        return DraftTree.from_chains(tokens, q)


def draw(probs: Tensor, gen: torch.Generator) -> Tensor:
    """(..., V) probabilities -> (...) int64 draws, on the device without a host sync: the exponential race
    argmax(p / E), E ~ Exp(1), picks token v with probability p_v. It is what ``torch.multinomial`` does for
    one sample after checking its input on the host, so the draws from one generator state are the same."""
    return (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(-1)
