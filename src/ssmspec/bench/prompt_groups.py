"""Real prompt sets decoded in groups through the engine, shared by the end-to-end benchmarks (``e2e_snl``,
``e2e``): the sets of ``data=`` tokenised (``load_sets``; local copies only), a group left-padded
(``pad_group``), one group prefilled and stepped to its token budget with every step timed (``decode``), and
the oracle drafter re-armed in place for each group an engine decodes (``GroupOracle``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf

from ssmspec.bench.inputs import synthetic_prompts
from ssmspec.data.prompts import FETCH_HINT, prompts_from_config, set_configs
from ssmspec.drafting.oracle import Oracle
from ssmspec.engine import Engine


class GroupOracle(Oracle):
    """The oracle drafter, re-armed in place for every group an engine decodes: ``reference`` is set before each
    prefill and ``reset`` copies it into the tensors the first reset made (a captured drafter graph reads those
    very tensors and advances that generator; new ones would be invisible to it). References must keep one width.
    Weyl draws go on where the last group stopped: each sequence's next draw is the one after the last it consumed
    (the table is refilled in place from there), so the draws a row counts are consecutive across groups."""

    def reset(self, prompts, *, batch: int, device, max_new_tokens: int | None = None) -> None:
        if getattr(self, "ref", None) is None:
            return super().reset(prompts, batch=batch, device=device, max_new_tokens=max_new_tokens)
        ref = torch.tensor(self.reference, dtype=torch.long)
        if ref.shape != self.ref.shape:
            raise ValueError(f"GroupOracle: references of shape {tuple(ref.shape)} after {tuple(self.ref.shape)}; "
                             f"pad every group's references to one width")
        self.ref.copy_(ref)
        self.plen.copy_(torch.tensor([len(p) for p in prompts], dtype=torch.long))
        if self.draws == "weyl":
            self.weyl_start = [s + n for s, n in zip(self.weyl_start, self.draw_idx.tolist())]
            self.table.copy_(torch.from_numpy(self.weyl.fill(self.weyl_start, self.table.shape[1])))
            self.draw_idx.zero_()


@dataclass
class PromptSet:
    """One prompt set's token lists, or why it was skipped."""

    name: str
    prompts: list[list[int]] = field(default_factory=list)
    reason: str | None = None  # not None: skipped


def load_sets(cfg: DictConfig, tokenizer, vocab_size: int) -> list[PromptSet]:
    """The prompt sets of ``cfg.data`` (``data/prompts.py:set_configs``), tokenised; never downloads."""
    out = []
    for d in set_configs(OmegaConf.to_container(cfg.data, resolve=True)):
        name = str(d["name"])
        if name == "synthetic":
            n = int(d.get("num_prompts") or 8)
            ids = synthetic_prompts(n, int(d["prompt_len"]), vocab_size, seed=int(d.get("seed", 0)),
                                    min_token_id=int(d.get("min_token_id", 3)))
            out.append(PromptSet(name, ids.tolist()))
            continue
        try:
            prompts = prompts_from_config(d, tokenizer, download=False)
        except ValueError as e:
            out.append(PromptSet(name, reason=f"{e} ({FETCH_HINT})" if FETCH_HINT not in str(e) else str(e)))
            continue
        toks = [p.tokens for p in prompts if p.tokens]
        bad = [t for p in toks for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids up to {max(bad)} do not fit the model's vocabulary of {vocab_size}; "
                             f"use the checkpoint's own tokenizer (its files next to config.json)")
        out.append(PromptSet(name, toks) if toks else PromptSet(name, reason=f"{name} has no prompts"))
    return out


@dataclass
class Decoded:
    """One group decoded by an engine."""

    sequences: list[list[int]]  # emitted tokens per sequence (the prefill's first token first)
    step_ms: list[float]  # decode steps, up to the one that finished the last sequence
    accepted: list[int]  # accepted drafts of every running sequence in every step
    emitted: int  # tokens the decode steps emitted (the prefill's first tokens excluded)
    prefill_ms: float
    step_wall_ms: list[float] = field(default_factory=list)  # wall clock from the first launch to each step's report
    full: list[list[int]] | None = None  # autoregressive line: the output past the budget (``Runner._cut``)


def pad_group(prompts: list[list[int]], width: int, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to ``width`` columns: ids, valid (B, width)."""
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[b, width - len(p):] = True
    return ids.to(device), valid.to(device)


@torch.no_grad()
def decode(eng: Engine, ids: torch.Tensor, valid: torch.Tensor, prompts: list[list[int]]) -> Decoded:
    """Prefill one group into ``eng`` and step until every sequence has its ``max_new_tokens`` (generate()'s
    loop: the host reads each report one step late on CUDA; the step launched past the end emits nothing and
    is not counted). ``step_wall_ms``: the host's clock from the first launch to the collection of each counted
    step's report, the wall-clock record of the timed loop (``timing.wall_check``)."""
    if eng.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = eng.prefill(ids, valid, prompts)  # syncs (host copy of the report)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    seqs = [list(t) for t in first.tokens]
    steps, walls, accepted, emitted = [], [], [], 0
    done, lag = all(first.done), 1 if eng.cuda else 0
    t0 = time.perf_counter()
    while not done:
        eng.launch()
        for rep, seconds in eng.collect(keep=lag):
            if done:
                continue
            steps.append(seconds * 1e3)
            walls.append((time.perf_counter() - t0) * 1e3)
            for b, (toks, a) in enumerate(zip(rep.tokens, rep.accepted)):
                if toks:  # running before this step
                    seqs[b].extend(toks)
                    accepted.append(a)
                    emitted += len(toks)
            done = all(rep.done)
        if len(steps) > eng.step.max_new_tokens + 1:
            raise RuntimeError("decode did not finish within max_new_tokens steps (engine bug)")
    eng.collect(keep=0)
    return Decoded(seqs, steps, accepted, emitted, prefill_ms, step_wall_ms=walls)
