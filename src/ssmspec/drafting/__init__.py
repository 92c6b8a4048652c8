"""Drafters: propose a ``DraftTree`` under every sequence's pending token."""
from ssmspec.drafting.base import DraftTree, Drafter

__all__ = ["DraftTree", "Drafter"]
