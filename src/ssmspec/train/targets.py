"""Targets cached by a key of their own, so that train runs which differ only in their drafts (distillation steps,
draft architecture) train each target once: ``stree_tab6_draft_training`` measures drafts distilled for 3 step
counts from one target, and ``stree_tab5_hybrid_ratio``'s 50% target is the one it reuses.

    <cache_dir>/targets/<key>/<family>-target/   the checkpoint, as in a run's entry (tokenizer files beside it)
    <cache_dir>/targets/<key>/train_log.jsonl    the evaluations of the target (and of its MTP head)
    <cache_dir>/targets/<key>/manifest.json      key, the resolved model config, the target's manifest record

key = sha256 of (corpus hash, the trained tokenizer's tokenizer.json, the target loop, the MTP head's settings, the
target's resolved ``ModelConfig``, seed, format): everything the target's weights depend on and nothing of the
drafts. A pattern written out and the same pattern made by ``attention_share`` resolve to one config, so one key.
Entries are written whole or not at all (``cache.Staging``); a run's own entry (``run.py``) still holds a copy of
the checkpoint, so it stays self-contained, and its key (the whole train config) is what it always was.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from ssmspec.models.config import ModelConfig
from ssmspec.train.cache import FORMAT, Staging, read_entry

log = logging.getLogger(__name__)

FOLDER = "targets"  # below the train cache_dir
LOG = "train_log.jsonl"


def target_key(corpus_hash: str, tokenizer_json: Path, loop, head, cfg: ModelConfig, seed: int) -> str:
    """The key of a target (module doc); ``loop`` the target's LoopConfig, ``head`` its HeadSettings or None."""
    blob = json.dumps({"stage": "target", "corpus": corpus_hash, "format": FORMAT, "seed": seed,
                       "tokenizer": hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest(),
                       "loop": dataclasses.asdict(loop), "mtp": dataclasses.asdict(head) if head else None,
                       "model": cfg.to_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_target(cache_dir: Path, key: str, name: str, *, into: Path, log_file: Path,
                  train: Callable[[Path, Path], dict], retrain: bool = False) -> dict:
    """Copy the checkpoint ``name`` of target ``key`` into ``into/<name>`` and its log lines onto ``log_file``;
    train it first when the cache lacks it (or ``retrain``): ``train(folder, log)`` writes the checkpoint
    ``folder/<name>`` and the log ``log`` and returns the target's manifest record. Returns that record with
    ``target_key`` and ``target_cache_hit``."""
    folder = Path(cache_dir) / FOLDER
    entry, hit = folder / key, True
    if retrain or not entry.exists():
        hit = False
        staging = Staging(folder, key)
        with staging as tmp:
            record = train(tmp, tmp / LOG)
            entry = staging.commit({"key": key, "model": name, "record": record}, replace=retrain)
    manifest = read_entry(entry)
    shutil.copytree(entry / name, into / name)
    with open(log_file, "a") as f:
        f.write((entry / LOG).read_text())
    if hit:
        log.info("%s: cached target %s (trained in %.1f s then), not trained again", name, key,
                 manifest["record"].get("train_time_s", 0.0))
    return {**manifest["record"], "target_key": key, "target_cache_hit": hit}
