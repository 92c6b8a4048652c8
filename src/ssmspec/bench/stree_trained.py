"""STree measured on the pairs the suite trains (seed 003): ``stree_tab5_hybrid_ratio`` (Table 5: tokens/s and
accepted length vs the share of attention layers of a hybrid target) and ``stree_tab6_draft_training`` (Table 6: the
same vs the draft's distillation steps), vanilla SD (a chain) against STree (a static tree) at every temperature.

Both are ``stree_tab3_e2e``'s lines (``bench/e2e_tree.py``: its ``Runner`` times the engine's steps) with the real
draft model, run once per trained pair: ``bench.trained`` (``bench/trained_rows.py``) trains one pair per variant
(``trained.variants``: the target's ``attention_share``, or ``distill.steps``; ``train/targets.py`` trains a target
that several variants share once) and calls this bench with ``checkpoint=`` the target and ``bench.draft_checkpoint``
its draft. There are no rows on random weights (``trained.only``): the oracle's acceptance would be designed, and
what these tables measure is how acceptance and the cost of a step move together.

Prompts: the set ``bench.trained.data`` names (HumanEval), through e2e_tree's ``Runner`` (``bench/tree_prompts.py``):
the prompts with at least ``bench.prompt_len`` tokens in the pair's tokenizer, their last ``prompt_len`` tokens, in
``bench.groups`` groups of ``batch``, each decoded by an engine of its own and pooled into one row (rows name ``set``,
``prompts``, ``groups`` and ``prompt_sha256``).

Lines: ``autoregressive``; ``chain S=<chain_S>`` (``bench.chain_strategy``, activation replay as the seed's SD;
the draft's chain, sampled at temperature > 0 and verified by speculative sampling); ``tree <shape>`` (``stree``,
the draft's static tree, verified by multi-step speculative sampling). Rows are e2e_tree's (tokens/s over the
summed step times, ``tau`` = mean accepted + 1, ``speedup`` over autoregressive at the same temperature; at
temperature 0 ``ref_match`` and ``exact``: the line's emitted tokens on the timed prompts against the target's
greedy autoregressive continuation of them -- greedy verification is lossless, so they must agree token for token
at float32; in bf16 on a GPU a near-tie may flip between batch shapes; ``None`` at temperature > 0) plus what sets
the pair apart, read from its train entry: ``attention_share`` and ``target_pattern`` (the target's config),
``draft_steps`` and ``draft_tokens`` (the entry's distillation loop), and ``speedup_per_tau`` (seed 003's
Speed-up / tau).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig

from ssmspec.bench.e2e_tree import Runner
from ssmspec.bench.tree_lines import Line, chain
from ssmspec.drafting.static_tree import resolve_shape
from ssmspec.models.loading import config_from_checkpoint

# Runner.run builds its model through a preset name; with checkpoint= it loads the checkpoint and the preset only
# sets the least KV-cache length (512 tokens). Rows name the trained target instead (``model``).
ROOM_PRESET = "tiny-hybrid"


def run_hybrid_ratio(cfg: DictConfig) -> Iterator[dict]:
    """Table 5: SD vs STree on each trained hybrid target (``trained.variants``: its attention share)."""
    yield from _rows(cfg, "stree_tab5_hybrid_ratio")


def run_draft_training(cfg: DictConfig) -> Iterator[dict]:
    """Table 6: SD vs STree with drafts distilled for each step count (``trained.variants``: distill.steps)."""
    yield from _rows(cfg, "stree_tab6_draft_training")


def pair_columns(target_dir: Path, draft_dir: Path) -> dict:
    """What sets a trained pair apart (module doc), from its checkpoints' config.json and its entry's manifest."""
    manifest = json.loads((target_dir.parent / "manifest.json").read_text())
    t_cfg = config_from_checkpoint(target_dir)
    mixers = [c for c in t_cfg.pattern if c in "MG*"]
    distill = manifest["config"]["distill"]
    return {"model": t_cfg.name, "attention_share": mixers.count("*") / len(mixers), "target_pattern": t_cfg.pattern,
            "draft_pattern": config_from_checkpoint(draft_dir).pattern, "draft_steps": int(distill["steps"]),
            "draft_tokens": int(distill["steps"]) * int(distill["batch"]) * int(distill["seq_len"])}


def _rows(cfg: DictConfig, what: str) -> Iterator[dict]:
    b = cfg.bench
    target, draft = cfg.get("checkpoint"), b.get("draft_checkpoint")
    if not target or not draft or not (Path(str(target)).parent / "manifest.json").is_file():
        raise ValueError(f"{what} is measured on the pairs the suite trains only: keep bench.trained (with "
                         f"only: true) so that every variant's target and draft come from `python -m ssmspec train`; "
                         f"checkpoint= and bench.draft_checkpoint= alone name no trained pair")
    run = Runner(cfg, what)
    if run.kind != "draft":
        raise ValueError(f"{what}: bench.drafter must be draft (the trained pair's draft model), got {run.kind!r}")
    S = int(b.chain_S)
    if S < 1:
        raise ValueError(f"{what}: bench.chain_S is the chain's draft length, >= 1; got {S}")
    parents = resolve_shape(b.shape)
    name = b.shape if isinstance(b.shape, str) else f"custom{len(parents)}"
    lines = [Line("autoregressive", "autoregressive"),
             Line(f"chain S={S}", str(b.chain_strategy), chain(S), shape=f"chain{S}"),
             Line(f"tree {name}", "stree", parents, shape=name)]
    temps = [(float(t), 0.0, 0.0) for t in b.temperature]  # (temperature, alpha, rank_decay): no oracle here
    if not temps or min(t for t, _, _ in temps) < 0:
        raise ValueError(f"{what}: bench.temperature needs values >= 0, got {list(b.temperature)}")
    pair = pair_columns(Path(str(target)), Path(str(draft)))
    for r in run.run(ROOM_PRESET, lines, temps, extra={k: v for k, v in pair.items() if k != "model"}):
        r["model"] = pair["model"]
        if r.get("status") == "ok":
            r["speedup_per_tau"] = r["speedup"] / r["tau"] if r.get("speedup") is not None else None
        yield r

