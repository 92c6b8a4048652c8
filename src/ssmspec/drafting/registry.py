"""Drafter registry (like strategies): ``@register_drafter(name)`` on a class, ``make_drafter(name, **options)``,
``drafter_names()``; ``conf/drafter/<name>.yaml`` holds the name and the options. ``none`` means no
drafter (standard decoding) and makes ``None``.

``DrafterBase`` carries what ``generate()`` and the results files read from any drafter: ``name``,
``is_tree``, ``spec`` (the ``SpecConfig`` its drafts fill) and ``describe()`` (name + options, recorded
with every result so an acceptance rate can always be traced to the drafter that produced it).
"""
from __future__ import annotations

import inspect
from typing import ClassVar

from torch import Tensor

from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.strategies.base import SpecConfig


class DrafterBase:
    """Shared plumbing. Subclasses set ``self.spec`` in ``__init__``, call ``_record(**options)`` with the
    options that define them, and implement ``propose``."""

    name: ClassVar[str] = "base"
    is_tree: bool = False  # proposes trees that are not D disjoint chains
    on_device: bool = False  # propose_device runs device ops only (CUDA-graph capturable)
    tree_options: ClassVar[str] = ""  # tree-only drafters: the options that shape the tree (for errors)

    def __init__(self) -> None:
        self.spec = SpecConfig()
        self._options: dict = {}

    def _record(self, **options) -> None:
        self._options = dict(options)

    def describe(self) -> dict:
        """{"name": ..., **options}: JSON-friendly (models appear by preset name)."""
        return {"name": self.name, **self._options, "on_device": self.on_device}

    def reset(self, prompts: list[list[int]], *, batch: int, device, max_new_tokens: int | None = None) -> None:
        """Called once before generation with every sequence's prompt ids."""

    def propose(self, history: list[list[int]], pending: Tensor) -> DraftTree:
        """history: per sequence every token so far, pending token last; pending (B,) on the target's device."""
        raise NotImplementedError

    def propose_device(self, buf: TokenBuffer) -> DraftTree:
        """Default for host drafters: copy the buffer to the host (a sync) and call ``propose``."""
        return self.propose(buf.to_lists(), buf.pending())

    def generators(self) -> list:
        """torch.Generators that propose_device draws from: a CUDA graph must register them, or every replay
        would repeat the random numbers drawn at capture. Drafters that sample override this."""
        return []

    def observe(self, verdict) -> None:
        """The step's verdict. The drafters here read what was accepted from ``history`` instead."""

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"{type(self).__name__}({opts})"


_REGISTRY: dict[str, type[DrafterBase]] = {}


def register_drafter(name: str):
    def wrap(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def drafter_names() -> list[str]:
    """Registered drafters, plus ``none``."""
    return sorted([*_REGISTRY, "none"])


def make_drafter(name: str, **options) -> DrafterBase | None:
    """The drafter registered as ``name`` built with ``options``; ``none`` gives None (no drafter)."""
    if name == "none":
        if options:
            raise ValueError(f"drafter 'none' takes no options, got {sorted(options)}")
        return None
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; choose one of: {', '.join(drafter_names())}")
    cls = _REGISTRY[name]
    params = inspect.signature(cls.__init__).parameters
    known = [k for k, p in params.items() if k != "self" and p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    chain_only = [k for k in unknown if k in ("draft_len", "num_drafts")]
    if chain_only and cls.tree_options:
        raise ValueError(f"drafter {name!r} builds one token tree per sequence: {chain_only} are chain settings; "
                         f"shape the tree with {cls.tree_options}, or use a chain drafter (png, draft_model, oracle)")
    if unknown:
        raise ValueError(f"drafter {name!r} has no option(s) {unknown}; its options are: {', '.join(known)}")
    return cls(**options)
