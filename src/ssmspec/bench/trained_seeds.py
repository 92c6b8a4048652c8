"""Experiment ``trained_seeds``: how much the *measured* acceptance of the trained draft moves with the training seed.

``trained_acceptance`` measures one training of each pair; a goal met there (the Mamba-2 pair's mean accepted
length at S = 4 on HumanEval >= 2.0) may be the luck of that training. Here the train run ``bench.train`` (with
``bench.train_overrides``) is trained once per seed of ``bench.seeds`` (``seed=<s>``; read from the cache when
the entry exists), keeping only the pair of ``bench.family``: the run's other families are deleted from its
``models`` with Hydra's ``~models.<name>`` override, so they are neither trained nor part of the cache key (the
overrides every seed ran with are the rows' ``train_overrides``: ``python -m ssmspec train <run> <overrides>``
trains the same entry). Everything else is ``bench/trained.py``'s: the pair loaded in float32 on the run's
device, the prompt sets, eager greedy ``generate()`` with the autoregressive reference first, then the distilled
draft's chains of S (``bench.draft_len``) under ``bench.chain_strategy`` (replay).

The train seed sets the weights, the batches and the corpus split (and, on a capped corpus such as ``tiny``'s,
which files make the corpus, hence the tokenizer): ``validation`` prompts come from each seed's own held-out
files (cut at positions seeded by ``bench.prompt_seed``), so the seeds are not measured on the same text there;
``humaneval`` prompts are the same for every seed (each seed's tokenizer cuts their last ``prompt_len`` tokens).

Rows ``kind: seed`` (one per family, seed, set and S): ``mean_accepted``, ``accepted_hist``, ``exact`` (every
sequence equals the autoregressive greedy output), the seed's ``train_key``, ``target_val_loss`` and
``draft_val_kl`` from its manifest, ``val_files`` (the seed's held-out files) and ``prompts_from``. Rows ``kind:
summary`` (one per family, set and S, after the seeds): ``n_seeds`` and the ``mean``, sample ``std``, ``min`` and
``max`` of the seeds' ``mean_accepted``, ``goal`` (``bench.goal_accepted``), ``seeds_at_goal`` (seeds with
``mean_accepted >= goal``) and ``goal_met_all``. A set missing on this machine (HumanEval not fetched) gives
skipped rows naming the fix. All rows carry ``acceptance: measured`` and ``pair: trained``.

``bench.variants`` (``[{name, overrides}]``; empty: the run as configured) measures several trainings of the same
seeds, e.g. drafts distilled for more steps: every seed is trained once per variant with the variant's overrides
after ``bench.train_overrides``; rows carry ``train_variant`` (its name) and the summary is per variant. A target
depends on none of the draft's settings (``train/targets.py``), so variants that change only the draft distil
from the seed's one target (trained by the first variant, read from the target cache by the others).
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable, Iterator

from omegaconf import DictConfig, OmegaConf

from ssmspec.bench.inputs import track
from ssmspec.bench.trained import (SETS, decode_set, families, humaneval_set, load_pair, train_config, train_run,
                                   validation_set)

log = logging.getLogger("ssmspec.bench.trained_seeds")

# the columns of decode_set's row a seed row keeps (its step times are eager CPU timings of a tiny model: left out)
DECODE_KEYS = ("mean_accepted", "accepted_hist", "exact", "tokens_per_call", "model_calls", "tokens_emitted")
PROMPTS_FROM = {"validation": "this seed's held-out validation files (its own corpus split)",
                "humaneval": "HumanEval, the same prompts for every seed"}


def check_seeds(seeds) -> list[int]:
    """``bench.seeds`` as distinct integers >= 0, in their order; one ValueError naming the fix otherwise."""
    values = list(seeds) if seeds is not None and (OmegaConf.is_list(seeds) or isinstance(seeds, (list, tuple))) \
        else None
    fix = "set bench.seeds to a list of distinct integers >= 0, e.g. bench.seeds=[0,1,2]"
    if not values:
        raise ValueError(f"bench.seeds is empty or not a list (got {seeds!r}); {fix}")
    bad = [s for s in values if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:
        raise ValueError(f"bench.seeds holds {bad}, not integers >= 0; {fix}")
    dup = sorted({s for s in values if values.count(s) > 1})
    if dup:
        raise ValueError(f"bench.seeds repeats {dup}: a seed trains the same pair twice; {fix}")
    return [int(s) for s in values]


def _check(b: DictConfig) -> list[int]:
    seeds = check_seeds(b.seeds)
    bad = [s for s in b.sets if s not in SETS]
    if bad or not b.sets:
        raise ValueError(f"bench.sets: unknown or no prompt sets {bad}; choose among {list(SETS)}")
    if int(b.batch) < 1 or int(b.num_prompts) < 1 or int(b.prompt_len) < 1 or int(b.new_tokens) < 1:
        raise ValueError("bench.batch, bench.num_prompts, bench.prompt_len and bench.new_tokens must be >= 1")
    if not b.draft_len or min(int(s) for s in b.draft_len) < 1:
        raise ValueError(f"bench.draft_len needs chain lengths S >= 1, got {list(b.draft_len)}")
    if _sets_seed(b.get("train_overrides")):
        raise ValueError("bench.train_overrides sets seed=, which bench.seeds sets per run; drop it and list the "
                         "seeds in bench.seeds")
    check_variants(b.get("variants"))
    return seeds


def _sets_seed(overrides) -> bool:
    """Whether Hydra overrides (``key=value``, ``+key=value``, ``~key``) set the train run's seed, which bench.seeds
    sets per run."""
    return any(str(o).lstrip("+~").split("=")[0] == "seed" for o in overrides or [])


VARIANT_FIX = "e.g. bench.variants=[{name: '900 steps', overrides: ['models.mamba2.distill.steps=900']}]"


def check_variants(variants) -> list[dict | None]:
    """``bench.variants`` as ``[{"name": str, "overrides": [str, ...]}]`` in their order, ``[None]`` when empty (the
    run as configured); one ValueError naming the fix otherwise."""
    if variants is None or (OmegaConf.is_list(variants) or isinstance(variants, (list, tuple))) and not len(variants):
        return [None]
    if not (OmegaConf.is_list(variants) or isinstance(variants, (list, tuple))):
        raise ValueError(f"bench.variants must be a list of {{name, overrides}} (got {variants!r}); {VARIANT_FIX}")
    out = []
    for i, v in enumerate(variants):
        v = OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
        if not isinstance(v, dict) or set(v) - {"name", "overrides"} or not str(v.get("name") or "").strip():
            raise ValueError(f"bench.variants[{i}] must be {{name: <label>, overrides: [key=value, ...]}}, got {v!r}; "
                             f"{VARIANT_FIX}")
        overrides = v.get("overrides") or []
        if not isinstance(overrides, (list, tuple)):
            raise ValueError(f"bench.variants[{i}].overrides must be a list of key=value strings, got {overrides!r}; "
                             f"{VARIANT_FIX}")
        if _sets_seed(overrides):
            raise ValueError(f"bench.variants[{i}] ({v['name']}) sets seed=, which bench.seeds sets per run; drop it")
        out.append({"name": str(v["name"]), "overrides": [str(o) for o in overrides]})
    names = [v["name"] for v in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"bench.variants repeats the name(s) {dup}: rows and summaries are told apart by name; "
                         f"rename them")
    return out


def seed_blocks(b: DictConfig, seeds: list[int], variant: dict | None = None) -> list[DictConfig]:
    """Per seed, the bench block ``bench/trained.py``'s functions read: the train run with ``seed=<s>``, the
    user's overrides, the variant's (``check_variants``; None: none) and the deletion of every family not measured
    (``~models.<name>``); every run composed and its families checked here, before anything trains."""
    wanted = families(b)
    base = {"train": str(b.train), "cache_dir": b.get("cache_dir"), "family": wanted,
            "train_overrides": [str(o) for o in b.get("train_overrides") or []]
            + list((variant or {}).get("overrides") or [])}
    trained = sorted(train_config(OmegaConf.create(base)).get("models") or {})
    others = [f"~models.{f}" for f in trained if f not in wanted]
    out = []
    for s in seeds:
        block = OmegaConf.create({**base, "train_overrides": [*base["train_overrides"], f"seed={s}", *others],
                                  "num_prompts": int(b.num_prompts), "prompt_len": int(b.prompt_len),
                                  "new_tokens": int(b.new_tokens), "batch": int(b.batch),
                                  "seed": int(b.prompt_seed)})  # trained.py's validation_set: prompt positions
        train_config(block)  # a bad override or family fails here
        out.append(block)
    return out


def summarize_seeds(rows: Iterable[dict], goal: float) -> list[dict]:
    """Rows ``kind: summary``, one per (variant, family, set, S) of the ``kind: seed`` rows with ``status: ok``, in the order
    they first appear: n_seeds, mean, sample std (None for one seed), min and max of ``mean_accepted``, the goal,
    how many seeds reach it, whether all do, and whether every seed's output was exact."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("kind") == "seed" and r.get("status") == "ok":
            groups.setdefault((r.get("train_variant"), r.get("family"), r["set"], r["S"]), []).append(r)
    out = []
    for (variant, family, name, S), rs in groups.items():
        vals = [float(r["mean_accepted"]) for r in rs]
        at_goal = sum(v >= goal for v in vals)
        out.append({"kind": "summary", "status": "ok", "train_variant": variant, "family": family, "set": name, "S": S,
                    "n_seeds": len(vals), "seeds": [r["seed"] for r in rs], "mean": statistics.fmean(vals),
                    "std": statistics.stdev(vals) if len(vals) > 1 else None, "min": min(vals), "max": max(vals),
                    "goal": float(goal), "seeds_at_goal": at_goal, "goal_met_all": at_goal == len(vals),
                    "all_exact": all(r["exact"] is True for r in rs), "acceptance": "measured", "pair": "trained"})
    return out


def run_seeds(cfg: DictConfig) -> Iterator[dict]:
    """Bench function of ``trained_seeds`` (experiment contract; module doc)."""
    b = cfg.bench
    seeds = _check(b)
    goal = float(b.goal_accepted)
    variants = check_variants(b.get("variants"))
    runs = [(v, seed, block) for v in variants  # every run composed and checked before the first trains
            for seed, block in zip(seeds, seed_blocks(b, seeds, v))]
    rows: list[dict] = []
    skipped: dict[tuple, str] = {}
    for variant, seed, block in track(runs, desc="trained_seeds"):
        result = train_run(block)
        name = None if variant is None else variant["name"]
        for family in families(block):
            for r in _seed_rows(cfg, block, seed, load_pair(block, str(cfg.device), family, result), name):
                if r["status"] != "ok":
                    skipped.setdefault((name, family, r["set"]), r["reason"])
                rows.append(r)
                yield r
    summary = summarize_seeds(rows, goal)
    yield from summary
    done = {(s["train_variant"], s["family"], s["set"]) for s in summary}
    for (name, family, set_name), reason in skipped.items():  # a set no seed could measure
        if (name, family, set_name) not in done:
            yield {"kind": "summary", "status": "skipped", "train_variant": name, "family": family, "set": set_name,
                   "n_seeds": 0, "goal": goal, "reason": reason, "acceptance": "measured", "pair": "trained"}


def _seed_rows(cfg: DictConfig, block: DictConfig, seed: int, pair, variant: str | None) -> Iterator[dict]:
    b = cfg.bench
    base = {**pair.info, "kind": "seed", "train_variant": variant, "seed": seed, "acceptance": "measured",
            "dtype": "float32",
            "batch": int(b.batch), "prompt_len": int(b.prompt_len), "new_tokens": int(b.new_tokens),
            "val_files": len(pair.manifest["corpus"]["val_file_list"]), "strategy": str(b.chain_strategy),
            "drafter": "draft_model"}
    builders = {"validation": validation_set, "humaneval": humaneval_set}
    for name in b.sets:
        pset = builders[name](pair, block)
        head = {**base, "set": name, "prompts_from": PROMPTS_FROM[name]}
        if pset.reason is not None:
            for S in b.draft_len:
                yield {**head, "S": int(S), "status": "skipped", "reason": pset.reason}
            continue
        _, ref = decode_set(pair, pset.prompts, block, strategy="autoregressive", opts=None, reference=None)
        for S in b.draft_len:
            opts = {"name": "draft_model", "draft_len": int(S)}
            row, _ = decode_set(pair, pset.prompts, block, strategy=str(b.chain_strategy), opts=opts, reference=ref)
            out = {**head, "status": "ok", "S": int(S), "prompts": len(pset.prompts),
                   **{k: row[k] for k in DECODE_KEYS}}
            log.info("%sseed %d %-10s S=%d mean accepted %.3f exact %s (pair %s)",
                     "" if variant is None else f"{variant}: ", seed, name, int(S), out["mean_accepted"],
                     out["exact"], out["train_key"])
            yield out
