"""Tokenizers that work offline.

- ``ByteTokenizer``: UTF-8 bytes shifted past three special ids (pad 0, bos 1, eos 2), for random-weight
  runs: every id lies below the model's vocabulary and ``decode(encode(text)) == text``. The special ids
  agree with Nemotron-H's pad / bos / eos.
- the checkpoint's own tokenizer: ``AutoTokenizer.from_pretrained`` on the directory ``load_model`` read
  (no hub access; the tokenizer files must lie next to config.json).

``load_tokenizer(model)`` picks between the two. Both expose ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``eos_token_id``, ``bos_token_id``, ``pad_token_id`` and ``len()``.
"""
from __future__ import annotations

import os
from pathlib import Path

_SPECIALS = 3  # pad, bos, eos
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ByteTokenizer:
    """Byte-level tokenizer: id = byte + 3; ids 0, 1, 2 are pad, bos, eos. Needs a vocabulary of >= 259."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    name = "byte"

    def __init__(self, vocab_size: int = 256 + _SPECIALS) -> None:
        if vocab_size < 256 + _SPECIALS:
            raise ValueError(f"the byte tokenizer needs vocab_size >= {256 + _SPECIALS} (256 bytes + pad/bos/eos), "
                             f"got {vocab_size}; use a model with a larger vocabulary or synthetic prompts "
                             f"(data=synthetic)")
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = [b + _SPECIALS for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """Ids -> text; special ids are dropped, ids past the byte range (a random model may emit them) are
        skipped too, and invalid UTF-8 becomes U+FFFD."""
        out = bytearray()
        for i in (int(t) for t in ids):
            if _SPECIALS <= i < 256 + _SPECIALS:
                out.append(i - _SPECIALS)
        return out.decode("utf-8", errors="replace")


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    return any((Path(path) / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(source=None, *, vocab_size: int | None = None):
    """A tokenizer for ``source``:

    - ``"byte"``: ``ByteTokenizer(vocab_size)``;
    - a directory: its ``AutoTokenizer``;
    - a ``HybridLM``: the tokenizer of the checkpoint it was loaded from, or the byte tokenizer sized to
      its vocabulary when it has random weights.

    A checkpoint without tokenizer files raises (mamba_ssm checkpoints ship none: they use
    EleutherAI/gpt-neox-20b's, which must be copied next to config.json).
    """
    if isinstance(source, str) and source == "byte":
        return ByteTokenizer(vocab_size or 256 + _SPECIALS)
    if isinstance(source, (str, os.PathLike)):
        return _auto_tokenizer(Path(source))
    if source is None:
        return ByteTokenizer(vocab_size or 256 + _SPECIALS)
    from ssmspec.models.loading import checkpoint_dir

    path = checkpoint_dir(source)
    if path is None:  # random weights
        return ByteTokenizer(source.cfg.vocab_size)
    return _auto_tokenizer(path)


def _auto_tokenizer(path: Path):
    if not path.is_dir() or not has_tokenizer_files(path):
        raise ValueError(f"{path}: no tokenizer files ({', '.join(_TOKENIZER_FILES)}); copy the checkpoint's "
                         f"tokenizer there (mamba2 checkpoints use EleutherAI/gpt-neox-20b's), or pass "
                         f"tokenizer='byte' for timing runs where the text does not matter")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
