"""Prompts of the STree end-to-end experiments (``bench/e2e_tree.py``) and the row of a point decoded over several
prompt groups.

Where the prompts come from (``data=``):

- ``synthetic`` (the oracle rows' default): one group of ``batch`` seeded random token prompts of
  ``bench.prompt_len`` tokens (``data.seed``, ``data.min_token_id``), the same for every line;
- a prompt set (``humaneval``, ``mtbench``, ``gsm8k``: ``data/prompts.py``, local copies only), tokenized by the
  model's own tokenizer (the checkpoint's files; the byte tokenizer on random weights) through
  ``prompt_groups.load_sets``: the prompts with at least ``prompt_len`` tokens, in the set's order, each cut to its
  last ``prompt_len`` tokens (the end of a prompt is what the model continues). Shorter prompts are skipped rather
  than padded, so every group is one (batch, prompt_len) tensor with no padding and every line prefills the same
  tokens (HumanEval in the tiny pair's 512-token BPE: all 164 prompts have 64 tokens or more, 147 have 128).
Rows name the set, the prompts decoded and a digest of their token ids (``group_fields``).

``bench.groups`` (default 1): groups of ``batch`` prompts decoded per point -- group g of batch B holds the
eligible prompts g B .. (g + 1) B - 1 -- each by an engine of its own (a drafter's captured graph reads the buffers
its ``reset`` made, so a group is never re-prefilled into an engine). ``merge_rows`` pools the groups' timed steps
into one row: samples, accepted counts, tokens and wall clock summed, every ratio recomputed from the sums. More
than one group needs a measured drafter and a prompt set: the oracle's reference and Weyl draws are one group's.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter

import torch
from omegaconf import DictConfig

from ssmspec.bench.designed import designed_fields
from ssmspec.bench.inputs import synthetic_prompts
from ssmspec.bench.prompt_groups import load_sets
from ssmspec.bench.timing import summarize, wall_check


def set_name(cfg: DictConfig) -> str:
    return str(cfg.data.get("name", "synthetic"))


def check_groups(cfg: DictConfig, kind: str, what: str) -> int:
    """``bench.groups`` checked against the drafter and the prompt source."""
    G = int(cfg.bench.get("groups") or 1)
    if G < 1:
        raise ValueError(f"{what}: bench.groups is the prompt groups decoded per point, >= 1; got {G}")
    if G > 1 and (kind == "oracle" or set_name(cfg) == "synthetic"):
        raise ValueError(f"{what}: bench.groups={G} decodes several groups of a prompt set with a measured drafter; "
                         f"the oracle's reference and draws are one group's and synthetic prompts are one group: "
                         f"set bench.groups=1, or data=<set> with bench.drafter=draft (or self)")
    return G


def eligible_prompts(cfg: DictConfig, model, prompt_len: int, what: str) -> list[list[int]] | None:
    """The set's prompts with >= ``prompt_len`` tokens, each its last ``prompt_len`` (module doc); None: synthetic."""
    if set_name(cfg) == "synthetic":
        return None
    from ssmspec.data.tokenizers import load_tokenizer

    sets = load_sets(cfg, load_tokenizer(model), model.cfg.vocab_size)
    if len(sets) != 1:
        raise ValueError(f"{what} decodes one prompt set; choose one with data=<set> (got {len(sets)}: "
                         f"{', '.join(p.name for p in sets)})")
    if sets[0].reason is not None:
        raise ValueError(f"{what}: {sets[0].reason}")
    return [p[-prompt_len:] for p in sets[0].prompts if len(p) >= prompt_len]


def prompt_groups(cfg: DictConfig, eligible: list[list[int]] | None, *, batch: int, groups: int, prompt_len: int,
                  vocab_size: int, device, what: str) -> list[torch.Tensor]:
    """``groups`` (batch, prompt_len) token tensors on ``device`` (module doc)."""
    if eligible is None:
        return [synthetic_prompts(batch, prompt_len, vocab_size, seed=int(cfg.data.get("seed", 0)),
                                  min_token_id=int(cfg.data.get("min_token_id", 3)), device=device)]
    need = batch * groups
    if len(eligible) < need:
        raise ValueError(f"{what}: {set_name(cfg)} has {len(eligible)} prompts of at least bench.prompt_len="
                         f"{prompt_len} tokens but batch {batch} x bench.groups={groups} needs {need}; lower "
                         f"bench.prompt_len, bench.groups or the batch (or raise data.num_prompts)")
    return [torch.tensor(eligible[g * batch:(g + 1) * batch], dtype=torch.long, device=device) for g in range(groups)]


def group_fields(cfg: DictConfig, groups: list[torch.Tensor]) -> dict:
    """Columns naming what a point decoded: the set, the prompts and groups, and ``prompt_sha256`` (the first 16
    hex digits of the SHA-256 of the groups' token ids as a JSON list of lists of lists)."""
    ids = json.dumps([g.tolist() for g in groups]).encode()
    return {"set": set_name(cfg), "prompts": sum(g.shape[0] for g in groups), "groups": len(groups),
            "prompt_sha256": hashlib.sha256(ids).hexdigest()[:16]}


def merge_rows(rows: list[dict]) -> dict:
    """One row from the rows of one line decoded over several groups: their timed steps pooled (module doc)."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[0])
    samples = [s for r in rows for s in r["samples_ms"]]
    hist: Counter = Counter()
    for r in rows:
        hist.update({int(k): v for k, v in r["accepted_hist"].items()})
    accepted = [a for a, n in sorted(hist.items()) for _ in range(n)]
    emitted = sum(r["tokens_emitted"] for r in rows)
    seconds, wall = sum(samples) * 1e-3, sum(r["loop_wall_ms"] for r in rows)
    out.update(summarize(samples), samples_ms=samples, **wall_check(samples, wall),
               accepted_hist={str(k): v for k, v in sorted(hist.items())},
               mean_accepted=sum(accepted) / len(accepted), tokens_emitted=emitted, tokens_per_s=emitted / seconds,
               tokens_per_s_wall=emitted / (wall * 1e-3), tokens_per_step=emitted / len(accepted))
    out.update(designed_fields(expected=out["expected_accepted"], accepted=accepted, seconds=seconds,
                               tokens_per_s=out["tokens_per_s"]))
    matches = [r["ref_match"] for r in rows if r.get("ref_match") is not None]
    out["ref_match"] = sum(matches) / len(matches) if len(matches) == len(rows) else None
    if "draft_samples_ms" in out:
        draft = [s for r in rows for s in r["draft_samples_ms"]]
        q = summarize(draft)
        out.update(draft_samples_ms=draft, draft_ms=q["ms_p50"], draft_ms_p90=q["ms_p90"],
                   draft_call_ms=q["ms_p50"] / out["draft_calls"])
    return out
