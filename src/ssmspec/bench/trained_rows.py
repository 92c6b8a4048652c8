"""Rows of measured acceptance beside an experiment's oracle rows: the experiment's own bench, run again on the model
pairs the suite trains itself (``python -m ssmspec train``), with real prompts and real drafters.

The experiments FIGURES.md marks (acc) draft with the oracle on random weights: a designed acceptance. With
``bench.trained`` set, the runner (``runner.py``) calls the bench once more per trained pair after the oracle rows
(``rows``), on a config in which

- ``checkpoint`` is the trained target's checkpoint directory (its tokenizer files beside it), so the bench takes
  its "checkpoint=" path: the model, the prompt tokenizer and the measured drafters it has for real weights;
- ``bench.draft_checkpoint`` is the draft distilled from that target, for benches that draft with a draft model;
- ``data`` is the data config ``trained.data.name`` (conf/data/<name>.yaml, e.g. HumanEval), with the other keys
  of ``trained.data`` merged over it (``num_prompts``, ``max_prompt_len``);
- ``trained.bench`` is merged into ``bench`` (e.g. ``drafter: draft``) and ``trained`` itself dropped.

``bench.trained``::

    trained:
      train: tiny            # conf/train/<name>.yaml: trained on first use, read from its cache entry after
      train_overrides: []    # key=value overrides of that run
      cache_dir: null        # null: the train config's cache (<repo>/.cache/train)
      family: [mamba2]       # the pairs of that run to measure
      variants: null         # or [{name: ..., overrides: [key=value, ...]}, ...]: one train run per variant (e.g. a
      #                        draft trained for N steps); rows carry train_variant
      data: {name: humaneval, num_prompts: 8, max_prompt_len: 128}
      bench: {drafter: draft}  # bench keys for these rows
      only: false            # true: the experiment is measured on trained pairs only (no rows on random weights)

Every trained row carries ``pair: trained``, the train run, its cache key, the family and both models with their
validation loss (``bench/trained.py:pair_info``), and ``weights: trained <run>/<key>``; oracle rows carry
``pair: random`` (or ``checkpoint`` under ``checkpoint=``). The acceptance of a trained row is what the draft earns:
a row whose acceptance is the oracle's (``acceptance: oracle``) is an error, not a row. Plots draw the trained
rows in a figure of their own (``cli_report.py``), never mixed with the oracle's.
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator

from omegaconf import DictConfig, OmegaConf, open_dict

from ssmspec import paths

log = logging.getLogger("ssmspec.bench.trained_rows")


def _train_block(t: DictConfig, variant: dict | None) -> DictConfig:
    """The ``bench``-like block ``bench/trained.py:train_run`` reads, for one variant."""
    overrides = [str(o) for o in t.get("train_overrides") or []]
    overrides += [str(o) for o in (variant or {}).get("overrides") or []]
    return OmegaConf.create({"train": str(t.train), "train_overrides": overrides, "cache_dir": t.get("cache_dir"),
                             "family": OmegaConf.to_container(t.family) if OmegaConf.is_list(t.family)
                             else str(t.family)})


def data_config(spec) -> DictConfig:
    """``conf/data/<spec.name>.yaml`` with the rest of ``spec`` merged over it."""
    spec = OmegaConf.create(OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else dict(spec))
    name = str(spec.get("name") or "")
    folder = paths.CONF_DIR / "data"
    path = folder / f"{name}.yaml"
    if not name or not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        raise ValueError(f"bench.trained.data.name={name!r} names no data config; use one of {known}")
    return OmegaConf.merge(OmegaConf.load(path), spec)


def trained_configs(cfg: DictConfig) -> Iterator[tuple[DictConfig, dict]]:
    """(config, columns) per (variant, family) of ``cfg.bench.trained``: the config the bench runs on that trained
    pair, and the columns each of its rows gets. Trains what the cache lacks, once per variant."""
    from ssmspec.bench.trained import families, pair_info, train_run

    t = cfg.bench.get("trained")
    if not t:
        return
    variants = [dict(v) for v in t.get("variants") or []] or [None]
    for variant in variants:
        block = _train_block(t, variant)
        result = train_run(block)
        for family in families(block):
            info, t_dir, d_dir = pair_info(block, family, result)
            sub = copy.deepcopy(cfg)
            with open_dict(sub):
                del sub.bench["trained"]
                sub.bench = OmegaConf.merge(sub.bench, t.get("bench") or {})
                sub.bench.draft_checkpoint = str(d_dir)
                sub.checkpoint = str(t_dir)
                if t.get("data"):
                    sub.data = data_config(t.data)
            cols = {**info, "train_variant": (variant or {}).get("name")}
            yield sub, cols


def check_trained(cfg: DictConfig) -> None:
    """``bench.trained``'s train runs (every variant's overrides, its families) and data config, checked before
    any row is measured or any pair trains: one ValueError naming the fix."""
    from ssmspec.bench.trained import train_config

    t = cfg.bench.get("trained")
    if not t:
        return
    for variant in [dict(v) for v in t.get("variants") or []] or [None]:
        train_config(_train_block(t, variant))
    if t.get("data"):
        data_config(t.data)


def rows(bench: Callable[[DictConfig], Iterable[dict]], cfg: DictConfig) -> Iterator[dict]:
    """The bench's rows on ``cfg``, then (with ``bench.trained``) its rows on every trained pair."""
    check_trained(cfg)
    t = cfg.bench.get("trained")
    own = "checkpoint" if cfg.get("checkpoint") else "random"
    if not (t and t.get("only")):
        for row in bench(cfg):
            yield {**row, "pair": own} if t else row
    for sub, cols in trained_configs(cfg):
        log.info("trained rows: %s pair %s (%s)", cols["family"], cols["train_key"], cols["weights"])
        for row in bench(sub):
            row = dict(row)
            if row.get("acceptance") == "oracle" or row.get("drafter") == "oracle":
                raise ValueError(f"bench.trained: the row {row.get('line', '')!r} drafts with the oracle, whose "
                                 f"acceptance is designed; set bench.trained.bench.drafter to a real drafter "
                                 f"(draft, png, mtp) for the trained pair")
            yield {**row, **cols}
