"""Prompt sets (HumanEval, MT-Bench, GSM8K) and offline tokenizers; ``python -m ssmspec.data.fetch``
puts the data sets that do not ship inside a package under ``.data/`` (gitignored)."""
from ssmspec.data.prompts import DATASETS, Prompt, load_prompts, prompts_from_config
from ssmspec.data.tokenizers import ByteTokenizer, load_tokenizer

__all__ = ["DATASETS", "ByteTokenizer", "Prompt", "load_prompts", "load_tokenizer", "prompts_from_config"]
