"""`beam_tree`: the beam-search token tree of seed 003 (section 5.1 and appendix C).

The draft model runs a beam search of ``beams`` (M) beams for ``depth`` (N) steps from the pending token,
scoring beams by summed log-probability, and *every* beam's token of every step is kept even if that beam
is later dropped: an N-layer tree with M tokens per layer (T = N*M nodes). Layer k's node j is node
1 + (k-1)*M + j; its parent is the layer k-1 beam it extended (the root for layer 1). Beam search is
deterministic, so ``q`` is None (one-hot under speculative sampling, which stays exact). ``propose_device``
runs it on the device (top-k over the flattened beam x vocabulary scores, rows reordered by index): no
host sync, capturable in a CUDA graph.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree
from ssmspec.drafting.registry import DrafterBase, register_drafter
from ssmspec.drafting.model_drafter import ModelDrafterBase
from ssmspec.strategies.base import SpecConfig


@register_drafter("beam_tree")
class BeamTree(ModelDrafterBase, DrafterBase):
    """N x M beam-search tree from ``draft`` (module doc)."""

    is_tree = True
    tree_options = "beams (M tokens per layer) and depth (N layers)"

    def __init__(self, *, draft="mamba2-130m", beams: int = 3, depth: int = 4, seed: int = 0,
                 dtype: str | None = None, draft_strategy: str = "snapshot") -> None:
        super().__init__()
        if beams < 1 or depth < 1:
            raise ValueError(f"beam_tree needs beams >= 1 and depth >= 1, got beams={beams}, depth={depth}")
        self.M, self.N = beams, depth
        self.spec = SpecConfig(draft_len=depth, tree_size=depth * beams)
        opts = self._init_draft(draft, seed=seed, dtype=dtype, draft_strategy=draft_strategy)
        self._record(**opts, beams=beams, depth=depth)

    def _shape(self):
        """M rows (one per beam), N deep; rows follow their parent beams."""
        return self.M, self.N, True

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        """Prefill the draft on ``prompts``; ``max_new_tokens`` sizes its KV cache (``DraftEngine.reset``)."""
        if self._draft_cfg.vocab_size < self.M:
            raise ValueError(f"beam_tree with {self.M} beams needs a vocabulary of at least {self.M} tokens")
        eng = self._reset_engine(prompts, device, max_new_tokens=max_new_tokens)
        self.base = torch.arange(len(prompts), device=eng.model.device)[:, None] * self.M  # (B, 1) first row

    def _draft(self, root: Tensor) -> DraftTree:
        """root (B, V) draft logits after the pending token -> the N x M beam tree (B, N*M)."""
        eng, M, N = self.engine, self.M, self.N
        logp = torch.log_softmax(root.float(), dim=-1)  # (B, V) at the root
        bsz, V = logp.shape
        scores, tok = logp.topk(M, dim=-1)  # (B, M) layer 1: the M most likely tokens
        layers = [tok]
        parents = [torch.zeros_like(tok)]
        rows = None  # the row each layer-1 beam continues from: the root's
        for k in range(2, N + 1):
            logits = eng.step(tok.reshape(-1), depth=k - 1, parents=rows)  # (B*M, V) after each layer k-1 beam
            cand = scores[..., None] + torch.log_softmax(logits.float(), dim=-1).reshape(bsz, M, V)  # (B, M, V)
            scores, flat = cand.reshape(bsz, M * V).topk(M, dim=-1)  # (B, M) best M extensions
            beam, tok = flat // V, flat % V  # parent beam in layer k-1, token
            rows = (self.base + beam).reshape(-1)  # layer k's beam j continues from row beam[j] (its parent)
            layers.append(tok)
            parents.append(1 + (k - 2) * M + beam)  # node number of the parent beam
        tokens = torch.cat(layers, dim=1).to(self.device)  # (B, N*M)
        return DraftTree(tokens, torch.cat(parents, dim=1).to(self.device), None, 0, N)
