"""What every drafter built on a draft model shares: building the draft, its ``DraftEngine`` (engine/draft.py),
the checks against the target, and the two ways to propose.

A drafter subclass fixes the shape of what it drafts (drafting rows per sequence W, depth S, whether rows
move to other parents) and implements ``_draft(root_logits)`` with ``self.engine.step``; ``propose_device``
is then ``absorb -> _draft`` on the device (capturable), and ``propose`` (host lists) runs the same after
as many absorb calls as a longer catch-up needs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.engine.draft import DraftEngine, draft_strategy
from ssmspec.models.config import ModelConfig, load_preset
from ssmspec.models.model import HybridLM, build_model
from ssmspec.strategies import strategy_names


def token_buffer(history: list[list[int]], prompt_len: list[int], device) -> TokenBuffer:
    """Host lists (every token so far, pending last) -> a ``TokenBuffer`` as the engine keeps it."""
    cap = max(len(h) for h in history)
    tokens = torch.zeros(len(history), cap, dtype=torch.long)
    for b, h in enumerate(history):
        tokens[b, :len(h)] = torch.tensor(h, dtype=torch.long)
    return TokenBuffer(tokens.to(device), torch.tensor([len(h) for h in history], device=device),
                       torch.tensor(prompt_len, device=device))


class ModelDrafterBase:
    """Mixin for drafters built on a draft model: ``draft`` is a ``HybridLM`` or a preset name (random
    weights from ``seed``, built at ``reset`` on the target's device in ``dtype``: default float32 on CPU,
    bfloat16 on CUDA); ``draft_strategy`` keeps the draft's state (one with state slots: ``snapshot``)."""

    on_device = True
    resumes = False  # observe() calls DraftEngine.resume after every verdict (chains of the draft's own tokens)

    def _init_draft(self, draft, *, seed: int, dtype: str | None, draft_strategy: str = "snapshot") -> dict:
        if isinstance(draft, HybridLM):
            self._draft_model, label = draft, draft.cfg.name
            self._draft_cfg = draft.cfg
        elif isinstance(draft, str):
            self._draft_model, label = None, draft
            self._draft_cfg = load_preset(draft)  # unknown presets fail here, with the list of names
        else:
            raise TypeError(f"draft must be a HybridLM or a model preset name, got {type(draft).__name__}")
        if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (float32, bfloat16, float64), got {dtype!r}")
        if draft_strategy not in strategy_names():
            raise ValueError(f"unknown draft_strategy {draft_strategy!r}; choose one of: {', '.join(strategy_names())}")
        self._draft_name, self._draft_seed, self._draft_dtype = label, seed, dtype
        self._draft_strategy = draft_strategy
        return {"draft": label, "seed": seed, "dtype": dtype, "draft_strategy": draft_strategy}

    def check_target(self, target: ModelConfig) -> None:
        """Refuse a draft the target cannot verify or whose state the draft strategy cannot roll back, naming
        both models (called when a run pairs the drafter with its target, before anything is allocated)."""
        cfg = self._draft_cfg
        if cfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {cfg.name} has a vocabulary of {cfg.vocab_size} tokens but target "
                             f"{target.name} has {target.vocab_size}; draft with a model of the target's tokenizer "
                             f"and vocabulary size (e.g. a smaller model of the same family)")
        try:
            draft_strategy(self._draft_strategy)
        except ValueError as e:
            raise ValueError(f"draft model {cfg.name} (drafting for {target.name}): {e}") from None

    def _shape(self) -> tuple[int, int, bool]:
        """(drafting rows per sequence W, depth S, rows move to other parents) of what this drafter drafts."""
        raise NotImplementedError

    def _reset_engine(self, prompts, device, *, max_new_tokens: int | None) -> DraftEngine:
        """Build the draft (first time) and its engine, and prefill."""
        self.device = torch.device(device)
        if self._draft_model is None:
            dtype = self._draft_dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
            self._draft_model = build_model(self._draft_cfg, seed=self._draft_seed, device=self.device,
                                            dtype=getattr(torch, dtype))
        W, S, reorders = self._shape()
        self.engine = DraftEngine(self._draft_model, width=W, depth=S, reorders=reorders, resumes=self.resumes,
                                  strategy=self._draft_strategy)
        # slack: the engine's last step may append a whole window past the budget, and its buffer keeps a spare
        self.engine.reset([list(p) for p in prompts], max_new_tokens=max_new_tokens, slack=self.spec.nodes + 2)
        return self.engine

    def _draft(self, root: Tensor) -> DraftTree:
        raise NotImplementedError

    def generators(self) -> list[torch.Generator]:
        """Device generators ``propose_device`` draws from (a graph capturing it registers them)."""
        return []

    @torch.no_grad()
    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        """The engine's buffer -> ``DraftTree``: one absorb call and a static drafting schedule, no host sync."""
        return self._draft(self.engine.absorb(buf))

    @torch.no_grad()
    def propose(self, history: list[list[int]], pending: Tensor) -> DraftTree:
        """Host lists (every token so far, pending last) -> ``DraftTree``, through the same device path after
        as many absorb calls as the longest catch-up needs (reads the device counters: host use only)."""
        eng = self.engine
        if len(history) != eng.batch:
            raise ValueError(f"history has {len(history)} sequences but the drafter was reset for {eng.batch}")
        buf = token_buffer(history, eng.prompt_len, eng.model.device)
        behind = (buf.length - eng.consumed).tolist()
        if min(behind) < 0:
            raise ValueError("history is shorter than what the draft model absorbed: call reset() first")
        for _ in range(-(-max(behind) // eng.A) - 1):  # all but the last call; propose_device makes that one
            eng.absorb(buf)
        return self.propose_device(buf)
