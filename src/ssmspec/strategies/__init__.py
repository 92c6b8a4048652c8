"""State-keeping strategies (DESIGN.md section 2). Importing this package registers every strategy."""
from ssmspec.strategies.base import (MambaParams, MixerInputs, SpecConfig, StepInputs, StrategyBase,
                                     make_strategy, register_strategy, strategy_names)
from ssmspec.strategies import autoregressive  # noqa: F401  (registers)
from ssmspec.strategies import stree  # noqa: F401  (registers)
from ssmspec.strategies import replay  # noqa: F401  (registers)
from ssmspec.strategies import snapshot  # noqa: F401  (registers)
from ssmspec.strategies import activation_replay  # noqa: F401  (registers)
from ssmspec.strategies import joint_attainment  # noqa: F401  (registers)

__all__ = ["MambaParams", "MixerInputs", "SpecConfig", "StepInputs", "StrategyBase", "make_strategy",
           "register_strategy", "strategy_names"]
