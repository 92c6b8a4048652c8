"""Drafters: propose a ``DraftTree`` under every sequence's pending token. Importing this package
registers every drafter (``make_drafter(name, **options)``, ``drafter_names()``)."""
from ssmspec.drafting import async_draft, beam_tree, draft_model, mtp, oracle, png, static_tree  # noqa: F401  (register)
from ssmspec.drafting.base import Drafter, DraftTree
from ssmspec.drafting.merge import merge_chains
from ssmspec.drafting.registry import DrafterBase, drafter_names, make_drafter, register_drafter

__all__ = ["DraftTree", "Drafter", "DrafterBase", "drafter_names", "make_drafter", "merge_chains",
           "register_drafter"]
