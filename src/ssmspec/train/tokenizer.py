"""Byte-level BPE trained on the corpus with the ``tokenizers`` library (issue 24).

Ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>`` (the ids of ``data.tokenizers.ByteTokenizer`` and of Nemotron-H);
the 256 byte symbols follow, then the merges. Byte-level pre-tokenisation without a prefix space makes
``decode(encode(text)) == text`` for any text. Saved through transformers' ``PreTrainedTokenizerFast`` as
``tokenizer.json`` + ``tokenizer_config.json``, so ``AutoTokenizer.from_pretrained(dir)`` (and
``ssmspec.data.load_tokenizer``) read it offline.
"""
from __future__ import annotations

from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
MIN_VOCAB = 256 + len(SPECIALS)


def train_tokenizer(texts: list[str], *, vocab_size: int, min_frequency: int = 2):
    """A ``tokenizers.Tokenizer`` with at most ``vocab_size`` ids (fewer when the corpus runs out of merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"tokenizer.vocab_size={vocab_size} is smaller than the byte alphabet plus the special "
                         f"tokens ({MIN_VOCAB} = 256 bytes + {', '.join(SPECIALS)}); set tokenizer.vocab_size >= "
                         f"{MIN_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (transformers' fast-tokenizer layout) to ``out``."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2], model_max_length=1 << 20)
    fast.save_pretrained(str(out))


def load_trained_tokenizer(path: str | Path):
    """The tokenizer saved by ``save_tokenizer`` as a ``tokenizers.Tokenizer`` (fast batch encoding)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def encode_stream(tok, texts: list[str]) -> list[int]:
    """One token stream: every text's ids followed by ``<eos>`` (documents never run into each other)."""
    eos = tok.token_to_id(SPECIALS[2])
    out: list[int] = []
    for enc in tok.encode_batch(texts):
        out.extend(enc.ids)
        out.append(eos)
    return out
