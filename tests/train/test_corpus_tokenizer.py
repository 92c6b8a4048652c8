"""The training corpus (stdlib sources: deterministic, hashed, split by file) and the byte-level BPE tokenizer
(lossless round trip, loadable by transformers' AutoTokenizer, refused below the byte alphabet)."""
import pytest

from ssmspec.train.corpus import load_corpus, source_files, stdlib_root
from ssmspec.train.tokenizer import MIN_VOCAB, encode_stream, save_tokenizer, train_tokenizer

CAP = 120_000


def test_corpus_is_deterministic_hashed_and_split_by_file():
    a, b = load_corpus(max_bytes=CAP, seed=0), load_corpus(max_bytes=CAP, seed=0)
    assert a == b and len(a.digest) == 64
    assert a.train_files and a.val_files and not set(a.train_files) & set(a.val_files)
    assert list(a.train_files) == sorted(a.train_files) and a.n_bytes <= CAP
    other = load_corpus(max_bytes=CAP, seed=1)
    assert other.digest != a.digest  # another seed picks other files under the cap


def test_corpus_leaves_out_tests_and_site_packages():
    files = source_files(stdlib_root())
    assert files and all(not {"test", "tests", "site-packages", "idle_test"} & set(f.split("/")[:-1]) for f in files)


def test_corpus_hash_follows_the_content(tmp_path):
    for i in range(12):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n" * 300)
    first = load_corpus(root=tmp_path, min_bytes=1000, val_fraction=0.3)
    (tmp_path / "m3.py").write_text("y = 1\n" * 300)
    assert load_corpus(root=tmp_path, min_bytes=1000, val_fraction=0.3).digest != first.digest


def test_empty_or_too_small_corpus_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="no .py files"):
        load_corpus(root=tmp_path)
    (tmp_path / "a.py").write_text("print(1)\n")
    with pytest.raises(ValueError, match="corpus too small.*corpus.max_bytes"):
        load_corpus(root=tmp_path, min_bytes=10_000)


def test_tokenizer_round_trip_and_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    corpus = load_corpus(max_bytes=CAP)
    tok = train_tokenizer(corpus.texts("train"), vocab_size=400)
    assert tok.get_vocab_size() == 400
    text = corpus.texts("val")[0][:2000] + "\n# ünïcode ✓\n"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    save_tokenizer(tok, tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert hf.encode(text) == tok.encode(text).ids and hf.decode(hf.encode(text)) == text
    assert encode_stream(tok, ["a = 1", "b"])[-1] == 2  # every document ends in <eos>


def test_vocab_below_the_byte_alphabet_is_refused():
    with pytest.raises(ValueError, match=f"tokenizer.vocab_size >= {MIN_VOCAB}"):
        train_tokenizer(["x = 1"], vocab_size=MIN_VOCAB - 1)
