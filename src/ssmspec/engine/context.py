"""What one model call needs besides its token ids."""
from __future__ import annotations

from dataclasses import dataclass

from ssmspec.models.kv_cache import KVCache
from ssmspec.strategies.base import StepInputs, StrategyBase


@dataclass
class RunContext:
    strategy: StrategyBase  # keeps conv + SSM state of every Mamba-2 block
    kv: list[KVCache]  # one per attention block
    step: StepInputs  # the current call's layout
