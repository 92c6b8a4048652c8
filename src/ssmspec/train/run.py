"""One training run (``python -m ssmspec train``): corpus -> tokenizer -> per family a target trained on
next-token loss and a draft distilled from it -> Hugging Face checkpoints, all in one cache entry.

Entry layout (``cache.py``: written whole or not at all)::

    <cache_dir>/<key>/tokenizer/            tokenizer.json, tokenizer_config.json
    <cache_dir>/<key>/<family>-target/      config.json, model.safetensors, tokenizer files (with the target's MTP
                                            head as mtp.* weights when the config has an mtp section: mtp.py)
    <cache_dir>/<key>/<family>-draft/       the same, for the draft
    <cache_dir>/<key>/train_log.jsonl       one line per evaluation of every model (trainer.py)
    <cache_dir>/<key>/curves.png            plots/training.py over the log
    <cache_dir>/<key>/manifest.json         corpus summary and hash, the resolved config, per model its size,
                                            training time, tokens seen, validation loss; every file's size

Targets are also cached by a key of their own (``targets.py``: corpus, tokenizer, target loop, MTP head, resolved
model config, seed), so runs that differ only in their drafts train each target once; every draft is distilled
from its target as loaded back from the checkpoint, so it is the same draft whether the target was trained by this
run or an earlier one. A models entry may give ``attention_share`` instead of placing attention in its pattern
(``attention_pattern``): the share of the pattern's mixer layers that become attention, evenly spaced. A family may
also set ``distill`` (``models.<family>.distill.steps=900``): fields over the run's ``distill`` loop for that
family's draft alone (a draft that pays for more steps beside one that does not; the targets are unchanged).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ssmspec import paths
from ssmspec.models.config import ModelConfig, load_preset
from ssmspec.models.model import build_model
from ssmspec.train.cache import Staging, cache_key, read_entry
from ssmspec.train.corpus import load_corpus
from ssmspec.train.distill import kl_to_target
from ssmspec.train.export import canonical_config, export_checkpoint
from ssmspec.train.mtp import head_settings, train_head, with_head
from ssmspec.train.targets import cached_target, target_key
from ssmspec.train.tokenizer import SPECIALS, encode_stream, save_tokenizer, train_tokenizer
from ssmspec.train.trainer import LoopConfig, check_memory, evaluate, fit, lm_loss, windows_for_eval

log = logging.getLogger(__name__)

TOP_KEYS = {"name", "seed", "device", "cache_dir", "corpus", "tokenizer", "train", "distill", "models", "mtp"}
CORPUS_KEYS = {"root", "max_bytes", "min_bytes", "val_fraction"}
TOKENIZER_KEYS = {"vocab_size", "min_frequency"}
NOT_IN_KEY = ("name", "cache_dir", "device")  # where and under which name: not what is trained


@dataclass
class TrainResult:
    entry: Path  # the cache entry
    manifest: dict
    hit: bool  # read from the cache, nothing trained


def _keys(node, known: set[str], where: str) -> dict:
    if not isinstance(node, dict):
        raise ValueError(f"{where} must be a mapping, got {node!r}")
    unknown = sorted(set(node) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known keys: {sorted(known)}")
    return node


def attention_pattern(pattern: str, share: float) -> str:
    """``pattern`` with ``share`` of its mixer layers (M, G, *) attention and the rest its SSM mixer, the attention
    layers evenly spaced, each closing its group (MambaInLlama's 50%: layers 1, 3, 5, ...; 25%: 3, 7, ...); the
    other blocks (MLP -, MoE E) stay. E.g. ('M-M-M-M-', 0.25) -> 'M-M-M-*-'."""
    ssm = sorted(set(pattern) & set("MG"))
    if len(ssm) != 1:
        raise ValueError(f"attention_share needs a pattern with one kind of SSM mixer (M or G) to trade for "
                         f"attention; got pattern {pattern!r}")
    mixers = [i for i, c in enumerate(pattern) if c in "MG*"]
    n, k = len(mixers), share * len(mixers)
    if not 0.0 <= share <= 1.0 or not math.isclose(k, round(k), abs_tol=1e-9):
        raise ValueError(f"attention_share={share:g} of the {n} mixer layers of pattern {pattern!r} is {k:g} layers; "
                         f"use a multiple of 1/{n} in [0, 1] (or a pattern with more layers)")
    k, out = round(k), list(pattern)
    for j, i in enumerate(mixers):
        out[i] = "*" if (j + 1) * k // n > j * k // n else ssm[0]
    return "".join(out)


def model_config(spec: dict, *, name: str, vocab_size: int, seed: int) -> ModelConfig:
    """A model of a ``models.<family>.<target|draft>`` entry: ``preset`` plus ModelConfig fields (and optionally
    ``attention_share``: ``attention_pattern`` of the pattern), the tokenizer's vocabulary and special ids, as the
    loader will read it back (``export.canonical_config``)."""
    spec = dict(spec)
    preset = spec.pop("preset", None)
    share = spec.pop("attention_share", None)
    if preset is None:
        raise ValueError(f"models entry {name!r} needs a preset (conf/model/<preset>.yaml) to start from")
    spec.update(name=name, vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                source=f"trained by ssmspec train (seed {seed})")
    try:
        fields = {**load_preset(preset).to_dict(), **spec}
        if share is not None:
            fields["pattern"] = attention_pattern(str(fields["pattern"]), float(share))
        return canonical_config(ModelConfig.from_dict(fields))
    except ValueError as e:
        raise ValueError(f"models entry {name!r}: {e}") from None


def family_loop(base: dict, extra: dict | None, family: str) -> LoopConfig:
    """The distillation loop of ``family``'s draft: the run's ``distill`` with ``models.<family>.distill``'s fields
    over it (None or empty: the run's loop)."""
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"models.{family}.distill must be a mapping of loop fields (e.g. "
                         f"models.{family}.distill.steps=900), got {extra!r}")
    return LoopConfig.from_dict({**base, **(extra or {})}, f"models.{family}.distill" if extra else "distill")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device={name!r} must be cpu, cuda or auto")
    return torch.device(name)


def train_pairs(cfg: dict, *, retrain: bool = False) -> TrainResult:
    """Run (or read from the cache) the training run ``cfg`` (a resolved conf/train/<name>.yaml)."""
    cfg = _keys(cfg, TOP_KEYS, "train config")
    seed, dev = int(cfg["seed"]), _device(str(cfg.get("device", "auto")))
    cc = _keys(cfg["corpus"], CORPUS_KEYS, "corpus")
    tc = _keys(cfg["tokenizer"], TOKENIZER_KEYS, "tokenizer")
    loops = {"train": LoopConfig.from_dict(cfg["train"], "train")}
    LoopConfig.from_dict(cfg["distill"], "distill")  # refused here even where every family's own loop overrides it
    head = head_settings(cfg.get("mtp"))  # MTP heads of the targets (train/mtp.py), None: none
    models = _keys(cfg["models"], set(cfg["models"] or {}), "models")
    if not models:
        raise ValueError("models is empty; name at least one family, e.g. models.mamba2.target.preset=tiny-mamba2")
    for fam, pair in models.items():
        _keys(pair, {"target", "draft", "distill"}, f"models.{fam}")
        for role in ("target", "draft"):  # refused before the corpus is read (the tokenizer sets the vocabulary)
            model_config(pair[role], name=f"{fam}-{role}", vocab_size=int(tc["vocab_size"]), seed=seed)
        loops[f"distill:{fam}"] = family_loop(cfg["distill"], pair.get("distill"), fam)
    corpus = load_corpus(root=cc.get("root"), max_bytes=int(cc.get("max_bytes") or 0),
                         val_fraction=float(cc.get("val_fraction", 0.1)), min_bytes=int(cc.get("min_bytes", 10_000)),
                         seed=seed)
    keyed = {k: v for k, v in cfg.items() if k not in NOT_IN_KEY}
    key = cache_key(corpus.digest, keyed, seed)
    cache_dir = Path(cfg.get("cache_dir") or paths.ROOT / ".cache" / "train")
    entry = cache_dir / key
    if entry.exists() and not retrain:
        return TrainResult(entry, read_entry(entry), hit=True)
    staging = Staging(cache_dir, key)
    with staging as tmp:
        manifest = _build(tmp, corpus, tc, loops, models, seed=seed, device=dev, head=head, cache_dir=cache_dir,
                          retrain=retrain)
        manifest.update(key=key, config=keyed)
        final = staging.commit(manifest, replace=retrain)  # not retraining: an entry there now is a racer's, kept
    return TrainResult(final, read_entry(final), hit=False)


def _build(tmp: Path, corpus, tc: dict, loops: dict, models: dict, *, seed: int, device, head=None,
           cache_dir: Path, retrain: bool = False) -> dict:
    from ssmspec.models.loading import load_model

    tok = train_tokenizer(corpus.texts("train"), vocab_size=int(tc["vocab_size"]),
                          min_frequency=int(tc.get("min_frequency", 2)))
    save_tokenizer(tok, tmp / "tokenizer")
    vocab = tok.get_vocab_size()
    assert tok.token_to_id(SPECIALS[2]) == 2
    train_stream = torch.tensor(encode_stream(tok, corpus.texts("train")), dtype=torch.long)
    val_stream = torch.tensor(encode_stream(tok, corpus.texts("val")), dtype=torch.long)
    log.info("corpus %s: %d bytes, %d train / %d validation files, %d / %d tokens (vocab %d)", corpus.digest[:12],
             corpus.n_bytes, len(corpus.train_files), len(corpus.val_files), train_stream.numel(),
             val_stream.numel(), vocab)
    log_file = tmp / "train_log.jsonl"
    log_file.touch()
    pairs = {}  # every model resolved (and refused) before anything trains
    for fam in sorted(models):
        t_cfg = with_head(model_config(models[fam]["target"], name=f"{fam}-target", vocab_size=vocab, seed=seed), head)
        d_cfg = model_config(models[fam]["draft"], name=f"{fam}-draft", vocab_size=vocab, seed=seed)
        if d_cfg.family != t_cfg.family:
            raise ValueError(f"models.{fam}: the draft's family {d_cfg.family!r} differs from the target's "
                             f"{t_cfg.family!r}; a draft is distilled within its family")
        check_memory(t_cfg, loops["train"], device)
        check_memory(d_cfg, loops[f"distill:{fam}"], device, frozen=t_cfg)
        pairs[fam] = t_cfg, d_cfg

    out: dict = {}
    for fam, (t_cfg, d_cfg) in pairs.items():
        key = target_key(corpus.digest, tmp / "tokenizer" / "tokenizer.json", loops["train"], head, t_cfg, seed)
        train = partial(_train_target, cfg=t_cfg, streams=(train_stream, val_stream), loop=loops["train"], head=head,
                        seed=seed, device=device, tokenizer_dir=tmp / "tokenizer")
        record = cached_target(cache_dir, key, t_cfg.name, into=tmp, log_file=log_file, train=train, retrain=retrain)
        out[t_cfg.name] = {"path": t_cfg.name, "family": fam, "role": "target", **record}
        target = load_model(tmp / t_cfg.name, device=device, dtype=torch.float32)  # as a reused one is read
        draft = build_model(d_cfg, seed=seed + 1, device=device)
        loop = loops[f"distill:{fam}"]
        val_d = windows_for_eval(val_stream, loop)
        stats = fit(draft, kl_to_target(target), train_stream, val_d, loop, seed=seed + 1, label=d_cfg.name,
                    log_file=log_file)
        stats = {"initial_val_kl": stats.pop("initial_val_loss"), "val_kl": stats.pop("val_loss"), **stats,
                 "val_loss": evaluate(draft, lm_loss, val_d, loop)}
        export_checkpoint(draft, tmp / d_cfg.name, tokenizer_dir=tmp / "tokenizer")
        out[d_cfg.name] = {"path": d_cfg.name, "family": fam, "role": "draft", "params": d_cfg.num_parameters(),
                           "target": t_cfg.name, **stats}
        del target, draft
    from ssmspec.plots.training import plot_training_curves

    plot_training_curves(log_file, tmp / "curves.png")
    return {"corpus": {**corpus.summary(), "train_file_list": list(corpus.train_files),
                       "val_file_list": list(corpus.val_files)},
            "tokenizer": {"vocab_size": vocab, "specials": list(SPECIALS)}, "seed": seed, "device": str(device),
            "models": out}


def _train_target(folder: Path, log_file: Path, *, cfg: ModelConfig, streams: tuple, loop: LoopConfig, head, seed: int,
                  device, tokenizer_dir: Path) -> dict:
    """Train the target ``cfg`` (and its MTP head, on the frozen target) and export it to ``folder/<name>``; its
    manifest record. ``targets.cached_target`` calls it when the target cache lacks the target."""
    train_stream, val_stream = streams
    target = build_model(cfg, seed=seed, device=device)
    stats = fit(target, lm_loss, train_stream, windows_for_eval(val_stream, loop), loop, seed=seed, label=cfg.name,
                log_file=log_file)
    if head is not None:  # the head on the frozen target, exported with it
        stats["mtp"] = train_head(target, train_stream, val_stream, head, seed=seed + 2, label=f"{cfg.name}-mtp",
                                  log_file=log_file)
    export_checkpoint(target, folder / cfg.name, tokenizer_dir=tokenizer_dir)
    return {"params": cfg.replace(mtp_layers=0).num_parameters(), **stats}  # the head's: stats["mtp"]


def describe(result: TrainResult) -> str:
    """Lines for the user: where the checkpoints are and what each model reached."""
    m = result.manifest
    head = "cache hit" if result.hit else "trained"
    lines = [f"{head}: {paths.shown(result.entry)} (corpus {m['corpus']['hash'][:12]}, seed {m['seed']})"]
    for name, s in sorted(m["models"].items()):
        extra = f", KL to target {s['val_kl']:.3f}" if s["role"] == "draft" else ""
        if "mtp" in s:
            extra = f", MTP head validation loss {s['mtp']['val_loss']:.3f}, agreement {s['mtp']['agreement']:.2f}"
        if s.get("target_cache_hit"):  # trained by an earlier run (train/targets.py), its time then
            extra += f" (cached target {s['target_key']}, not trained again)"
        lines.append(f"  {name:<22} {paths.shown(result.entry / s['path'])}  {s['params'] / 1e6:.2f}M params, "
                     f"{s['tokens_seen']:,} tokens, {s['train_time_s']:.1f} s, validation loss {s['val_loss']:.3f}"
                     f"{extra}")
    lines.append(f"  curves: {paths.shown(result.entry / 'curves.png')}; log: "
                 f"{paths.shown(result.entry / 'train_log.jsonl')}")
    return "\n".join(lines)

