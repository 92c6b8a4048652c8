from ssmspec.models.config import ModelConfig, load_preset, preset_names
from ssmspec.models.loading import load_model
from ssmspec.models.model import HybridLM, build_model

__all__ = ["ModelConfig", "HybridLM", "build_model", "load_model", "load_preset", "preset_names"]
