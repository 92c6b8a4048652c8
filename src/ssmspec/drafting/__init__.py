"""Drafters: propose a ``DraftTree`` under every sequence's pending token. Importing this package
registers every drafter (``make_drafter(name, **options)``, ``drafter_names()``)."""
from ssmspec.drafting.base import DraftTree, Drafter
from ssmspec.drafting.merge import merge_chains
from ssmspec.drafting.registry import DrafterBase, drafter_names, make_drafter, register_drafter
from ssmspec.drafting import png  # noqa: F401  (registers)
from ssmspec.drafting import draft_model  # noqa: F401  (registers)
from ssmspec.drafting import beam_tree  # noqa: F401  (registers)
from ssmspec.drafting import static_tree  # noqa: F401  (registers)
from ssmspec.drafting import oracle  # noqa: F401  (registers)

__all__ = ["DraftTree", "Drafter", "DrafterBase", "drafter_names", "make_drafter", "merge_chains",
           "register_drafter"]
