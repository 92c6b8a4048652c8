"""Experiment ``trained_acceptance``: acceptance *measured* on the model pair the suite trains itself.

Every other end-to-end number drafts with the oracle, whose acceptance is designed (random weights accept no
real drafter). Here the target and its distilled draft come from ``python -m ssmspec train`` (``ssmspec.train``:
trained on the standard library's Python sources; trained now when the cache lacks the run named by
``bench.train``, read from ``.cache/train/<key>/`` otherwise), are loaded with ``load_model(dir)`` in float32 on
the run's device and decode real text through ``generate()``:

- prompt sets (``bench.sets``): ``validation``, the held-out validation files of the training corpus (the split
  the train run recorded in its manifest), tokenized with the trained tokenizer and cut into
  ``bench.num_prompts`` prompts of ``bench.prompt_len`` tokens, files taken in turn, each prompt from a seeded
  position (``bench.seed``); ``humaneval``, the first ``num_prompts`` HumanEval prompts, their last
  ``prompt_len`` tokens (a ``status: skipped`` row naming the fix when the set is not on disk);
- per set, greedy autoregressive decoding (``drafter: none``, the reference), then every drafter x strategy:
  ``draft_model`` (the distilled draft, chains of S for S in ``bench.draft_len``), ``png`` (prompt n-gram
  lookup, ``bench.png``, chains of S) and, when the target carries an MTP head (``mtp.layers`` of the train
  run), ``mtp`` (the head chained S times) under the chain strategies (``bench.chain_strategies``), and the draft's
  token trees (``bench.trees``: beam_tree, static_tree) under the tree strategies (``bench.tree_strategies``).

A row (``kind: decode``) records ``acceptance: measured``, ``pair: trained``, the train cache key and the
manifest's validation loss of both models and the draft's KL to the target; ``mean_accepted`` (accepted draft
tokens per decode step and running sequence), ``accepted_hist``, ``tokens_per_call`` (tokens emitted per target
call and sequence; the draft's own calls are not counted), ``model_calls`` (target calls), ``exact`` (every
sequence equals the autoregressive greedy output: greedy verification is lossless, so this must hold) and
the step times of ``generate()`` (``samples_ms`` and their summary): eager CPU timings of a tiny model, which
say how the loop behaves, not how fast anything is (``timing``).

With ``bench.throughput`` (the gpu profile), rows of ``kind: throughput`` time the same pair through the
captured engine at the batches it names (``bench/trained_throughput.py``): tokens/s of autoregressive decoding
and of the speculative lines with the acceptance measured on the set's prompts, and their ratio.

One more row per set (``kind: agreement``): over up to ``bench.agree_tokens`` tokens of the set (validation:
the validation files; humaneval: the whole prompts), in windows of ``bench.agree_window``, how often the draft's
top-1 next token equals the target's (``draft_target_top1``), and how often each model's top-1 is the token that
follows (``target_top1_acc``, ``draft_top1_acc``).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ssmspec.bench.inputs import track
from ssmspec.bench.real_drafters import measured_drafter
from ssmspec.bench.timing import summarize

log = logging.getLogger("ssmspec.bench.trained")

SETS = ("validation", "humaneval")


@dataclass
class Pair:
    """The trained target and draft of one family, and what the train run recorded about them."""

    target: object  # HybridLM
    draft: object  # HybridLM
    tokenizer: object  # the trained byte-level BPE (transformers' fast tokenizer)
    manifest: dict  # the cache entry's manifest.json
    entry: Path  # the cache entry (checkpoint directories below it)
    names: tuple[str, str]  # (target, draft) model names of the manifest
    info: dict  # columns every row carries: train run, key, models, their validation loss / KL


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]] = field(default_factory=list)  # cut to prompt_len tokens, for generate()
    texts: list[list[int]] = field(default_factory=list)  # whole token sequences, for the agreement row
    reason: str | None = None  # not None: skipped


def families(b: DictConfig) -> list[str]:
    """``bench.family``: one family of the train run or a list of them."""
    fam = b.family
    out = [str(f) for f in fam] if isinstance(fam, (list, tuple)) or OmegaConf.is_list(fam) else [str(fam)]
    if not out:
        raise ValueError("bench.family is empty; name a family of the train run, e.g. bench.family=mamba2")
    return out


def train_config(b: DictConfig) -> dict:
    """The composed train run ``bench.train`` (with ``bench.train_overrides``), every family of ``bench.family``
    checked against its models: a bad run, override or family fails here, before anything trains."""
    from ssmspec.train.command import compose_train

    overrides = [str(o) for o in b.get("train_overrides") or []]
    overrides += [f"cache_dir={b.cache_dir}"] if b.get("cache_dir") else []
    config = compose_train(str(b.train), overrides)
    trained = sorted(config.get("models") or {})
    for family in families(b):
        if family not in trained:
            raise ValueError(f"train run {b.train!r} trains no {family!r} pair (families: {trained}); set "
                             f"bench.family to one or more of them")
    return config


def train_run(b: DictConfig):
    """The train run ``bench.train`` (``train_config``, checked first), trained when not cached."""
    from ssmspec.train.run import train_pairs

    config = train_config(b)
    with torch.enable_grad():  # the runner calls benches under no_grad; training needs gradients
        return train_pairs(config)


def pair_info(b: DictConfig, family: str, result) -> tuple[dict, Path, Path]:
    """(columns every row of the pair carries, target checkpoint dir, draft checkpoint dir) of ``family`` in
    ``result`` (``train_run``)."""
    m = result.manifest
    targets = {s["family"]: name for name, s in m["models"].items() if s["role"] == "target"}
    t_name = targets[family]
    d_name = next(n for n, s in m["models"].items() if s["role"] == "draft" and s.get("target") == t_name)
    t_stats, d_stats = m["models"][t_name], m["models"][d_name]
    info = {"weights": f"trained {b.train}/{m['key']}", "pair": "trained", "train_run": str(b.train),
            "train_overrides": [str(o) for o in b.get("train_overrides") or []], "train_key": m["key"],
            "train_cache_hit": result.hit,
            "family": family, "target": t_name, "draft": d_name, "target_params": t_stats["params"],
            "draft_params": d_stats["params"], "target_val_loss": t_stats["val_loss"],
            "draft_val_loss": d_stats["val_loss"], "draft_val_kl": d_stats["val_kl"],
            "corpus_hash": m["corpus"]["hash"]}
    log.info("pair %s (%s): %s %d params, %s %d params", m["key"], "cache hit" if result.hit else "trained now",
             t_name, t_stats["params"], d_name, d_stats["params"])
    return info, result.entry / t_stats["path"], result.entry / d_stats["path"]


def load_pair(b: DictConfig, device: str, family: str, result) -> Pair:
    """The pair of ``family`` from ``result`` (``train_run``), loaded in float32 on ``device``."""
    from ssmspec.data.tokenizers import load_tokenizer
    from ssmspec.models.loading import load_model

    info, t_dir, d_dir = pair_info(b, family, result)
    target = load_model(t_dir, device=device, dtype=torch.float32)
    draft = load_model(d_dir, device=device, dtype=torch.float32)
    return Pair(target, draft, load_tokenizer(target), result.manifest, result.entry, (info["target"], info["draft"]),
                info)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def validation_set(pair: Pair, b: DictConfig) -> PromptSet:
    """``num_prompts`` prompts of ``prompt_len`` tokens from the held-out files, files taken in turn, each from
    a seeded position."""
    root = Path(pair.manifest["corpus"]["root"])
    files = pair.manifest["corpus"]["val_file_list"]
    T, n = int(b.prompt_len), int(b.num_prompts)
    try:
        texts = [_ids(pair.tokenizer, (root / f).read_bytes().decode("utf-8", errors="replace")) for f in files]
    except OSError as e:
        return PromptSet("validation", reason=f"a validation file of the train run is unreadable ({e}); retrain "
                                              f"with `python -m ssmspec train {b.train} --retrain`")
    usable = [t for t in texts if len(t) >= T]
    if not usable:
        return PromptSet("validation", reason=f"no validation file has prompt_len={T} tokens; lower bench.prompt_len")
    gen = torch.Generator().manual_seed(int(b.seed))
    prompts = []
    for i in range(n):
        ids = usable[i % len(usable)]
        start = int(torch.randint(0, len(ids) - T + 1, (1,), generator=gen))
        prompts.append(ids[start:start + T])
    return PromptSet("validation", prompts, texts)


def humaneval_set(pair: Pair, b: DictConfig) -> PromptSet:
    """The first ``num_prompts`` HumanEval prompts, their last ``prompt_len`` tokens; skipped when not on disk."""
    from ssmspec.data.prompts import FETCH_HINT, load_prompts

    try:
        got = load_prompts("humaneval", int(b.num_prompts), download=False)
    except ValueError as e:
        return PromptSet("humaneval", reason=f"{e} ({FETCH_HINT})")
    texts = [_ids(pair.tokenizer, p.text) for p in got]
    return PromptSet("humaneval", [t[-int(b.prompt_len):] for t in texts], texts)


@torch.no_grad()
def agreement_row(pair: Pair, pset: PromptSet, b: DictConfig) -> dict:
    """Top-1 agreement of draft and target, and each model's top-1 accuracy, over the set's tokens."""
    from ssmspec.train.forward import train_logits

    W, budget = int(b.agree_window), int(b.agree_tokens)
    windows: list[list[int]] = []
    for ids in pset.texts:
        for s in range(0, max(len(ids) - 1, 0), W):
            if budget <= 0:
                break
            w = ids[s:s + min(W + 1, budget + 1)]
            if len(w) >= 2:
                windows.append(w)
                budget -= len(w) - 1
    same = t_ok = d_ok = total = 0
    dev = pair.target.device
    for w in windows:
        ids = torch.tensor([w], device=dev)  # (1, L+1)
        t_top = train_logits(pair.target, ids[:, :-1]).argmax(-1)  # (1, L)
        d_top = train_logits(pair.draft, ids[:, :-1]).argmax(-1)  # (1, L)
        nxt = ids[:, 1:]
        same += int((t_top == d_top).sum())
        t_ok += int((t_top == nxt).sum())
        d_ok += int((d_top == nxt).sum())
        total += nxt.numel()
    return {"kind": "agreement", "set": pset.name, "status": "ok", "tokens": total,
            "draft_target_top1": same / max(total, 1), "target_top1_acc": t_ok / max(total, 1),
            "draft_top1_acc": d_ok / max(total, 1), "window": W}


def _lines(b: DictConfig, *, mtp: bool = False) -> list[dict]:
    """(drafter options, strategies) of every decode line but the autoregressive reference."""
    out = []
    for S in b.draft_len:
        out.append({"name": "draft_model", "draft_len": int(S), "strategies": list(b.chain_strategies)})
    for S in b.draft_len:
        out.append({"name": "png", **OmegaConf.to_container(b.png), "draft_len": int(S),
                    "strategies": list(b.chain_strategies)})
    if mtp:  # the target's own MTP head (trained with it: python -m ssmspec train ... mtp.layers=1)
        for S in b.draft_len:
            out.append({"name": "mtp", "draft_len": int(S), "strategies": list(b.chain_strategies)})
    for tree in b.trees:
        out.append({**OmegaConf.to_container(tree), "strategies": list(b.tree_strategies)})
    return out


def _label(opts: dict) -> str:
    """'draft_model', 'png 3..2', 'beam_tree 2x4', 'static_tree A' (S is its own column)."""
    name = opts["name"]
    if name == "png":
        return f"png {opts.get('ngram', 3)}..{opts.get('min_ngram', 1)}"
    if name == "beam_tree":
        return f"beam_tree {opts.get('beams', 3)}x{opts.get('depth', 4)}"
    if name == "static_tree":
        return f"static_tree {opts.get('shape', 'A')}"
    return name


def _drafter(opts: dict, pair: Pair):
    kw = {k: v for k, v in opts.items() if k not in ("name", "strategies")}
    return measured_drafter(opts["name"], target=pair.target, draft=pair.draft, **kw)


def decode_set(pair: Pair, prompts: list[list[int]], b: DictConfig, *, strategy: str, opts: dict | None,
               reference: list[list[int]] | None) -> tuple[dict, list[list[int]]]:
    """Decode ``prompts`` in groups of ``bench.batch`` with one line; (metrics, sequences)."""
    from ssmspec.engine.generate import generate

    bsz, new = int(b.batch), int(b.new_tokens)
    seqs, accepted, step_ms = [], [], []
    emitted = calls = call_rows = 0
    spec = None
    for g in range(0, len(prompts), bsz):
        group = prompts[g:g + bsz]
        drafter = _drafter(opts, pair) if opts else None
        spec = drafter.spec if drafter is not None else None
        out = generate(pair.target, group, max_new_tokens=new, strategy=strategy, drafter=drafter)
        seqs += out.sequences
        for s in out.steps[1:]:
            accepted += s.running_accepted()
            emitted += sum(s.emitted)
            step_ms.append(s.seconds * 1e3)
        calls += out.model_calls
        call_rows += out.model_calls * len(group)
    hist: dict[str, int] = {}
    for a in sorted(accepted):
        hist[str(a)] = hist.get(str(a), 0) + 1
    row = {"mean_accepted": sum(accepted) / max(len(accepted), 1), "accepted_hist": hist,
           "tokens_per_call": emitted / max(call_rows, 1), "model_calls": calls,
           "exact": seqs == reference if reference is not None else True, "tokens_emitted": emitted,
           "samples_ms": step_ms, **(summarize(step_ms) if step_ms else {}),
           "draft_len": spec.draft_len if spec else 0, "tree_size": spec.tree_size if spec else 0}
    return row, seqs


def run_acceptance(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``trained_acceptance`` (experiment contract; module doc)."""
    b = cfg.bench
    bad = [s for s in b.sets if s not in SETS]
    if bad:
        raise ValueError(f"bench.sets: unknown prompt sets {bad}; choose among {list(SETS)}")
    if int(b.batch) < 1 or int(b.num_prompts) < 1 or int(b.prompt_len) < 1 or int(b.new_tokens) < 1:
        raise ValueError("bench.batch, bench.num_prompts, bench.prompt_len and bench.new_tokens must be >= 1")
    if b.get("throughput"):
        from ssmspec.bench.trained_throughput import check_throughput

        check_throughput(b.throughput)  # before anything trains or runs
    result = train_run(b)
    for family in families(b):  # one pair at a time: its rows, then the next family's
        yield from _family_rows(cfg, load_pair(b, str(cfg.device), family, result))


def _family_rows(cfg: DictConfig, pair: Pair) -> Iterator[dict]:
    b = cfg.bench
    timing = f"eager generate() steps on {cfg.device}: how the loop behaves on a tiny model, not a benchmark"
    base = {**pair.info, "acceptance": "measured", "dtype": "float32", "batch": int(b.batch),
            "prompt_len": int(b.prompt_len), "new_tokens": int(b.new_tokens)}
    builders = {"validation": validation_set, "humaneval": humaneval_set}
    loaded: dict[str, list[list[int]]] = {}
    for name in b.sets:
        pset = builders[name](pair, b)
        loaded[name] = pset.prompts
        if pset.reason is not None:
            yield {**base, "kind": "decode", "set": name, "status": "skipped", "reason": pset.reason}
            continue
        yield {**base, **agreement_row(pair, pset, b)}
        head = {**base, "kind": "decode", "set": name, "prompts": len(pset.prompts), "status": "ok",
                "timing": timing}
        row, ref = decode_set(pair, pset.prompts, b, strategy="autoregressive", opts=None, reference=None)
        yield {**head, "drafter": "none", "S": 0, "strategy": "autoregressive", **row}
        for opts in track(_lines(b, mtp=pair.target.cfg.mtp_layers > 0), desc=f"trained_acceptance {name}"):
            for strategy in opts["strategies"]:
                row, _ = decode_set(pair, pset.prompts, b, strategy=strategy, opts=opts, reference=ref)
                cfg_row = {k: v for k, v in opts.items() if k != "strategies"}
                out = {**head, "drafter": _label(opts), "S": row["draft_len"], "strategy": strategy,
                       "drafter_config": cfg_row, **row}
                log.info("%-10s %-16s S=%d %-9s mean accepted %.3f exact %s", name, out["drafter"], out["S"],
                         strategy, out["mean_accepted"], out["exact"])
                yield out
    if b.get("throughput"):  # the captured engine's tokens/s with the measured acceptance (trained_throughput.py)
        from ssmspec.bench.trained_throughput import throughput_rows

        yield from throughput_rows(pair.entry, pair.manifest, pair.names, loaded, b, cfg,
                                   {k: v for k, v in base.items() if k not in ("dtype", "batch", "prompt_len")})
