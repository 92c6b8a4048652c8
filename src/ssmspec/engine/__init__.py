from ssmspec.engine.generate import GenerationOutput, StepRecord, generate

__all__ = ["generate", "GenerationOutput", "StepRecord"]
