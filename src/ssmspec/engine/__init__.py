from ssmspec.engine.engine import Engine
from ssmspec.engine.generate import GenerationOutput, StepRecord, generate

__all__ = ["Engine", "generate", "GenerationOutput", "StepRecord"]
