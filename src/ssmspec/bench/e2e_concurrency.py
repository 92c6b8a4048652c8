"""Largest decode batch under a fixed HBM budget: ``replay_fig11_concurrency`` (seed 000, Fig. 11).

Per preset and line (``autoregressive`` standard decode, ``snapshot`` spec and ``replay`` spec at window
``bench.S``), the largest batch whose decode engine fits ``bench.budget_mib`` -- weights, the strategy's
state, the KV caches sized for ``bench.context + bench.new_tokens`` tokens per sequence, the token buffer and
one step's activations -- found by search:

1. plan search: doubling from batch 1, then bisection, on ``engine.memory.plan_bytes`` + the resident
   weights against the budget (no memory touched; exact to one sequence, capped at ``bench.max_batch``);
2. real probes: the engine at the plan's largest batch P is actually allocated, started (``start_synthetic``:
   the caches as if ``context`` tokens had been prefilled; serving prefills in chunks, so decode state is
   what bounds concurrency) and stepped ``bench.probe_steps`` times through the engine's own launch (the
   CUDA graphs captured: their pools count). On CUDA the allocator is capped at the budget
   (``torch.cuda.set_per_process_memory_fraction``), so a plan that underestimates ends in a real
   ``torch.OutOfMemoryError``: it is caught and reported as a probe row, and the search goes on downward
   (halving, then bisection between the last batch that ran and the first that did not). Never a crash.

Rows: ``kind: probe`` for every real probe (batch, status ok / oom, planned and measured peak bytes) and one
``kind: max_batch`` per line (max batch, bytes at that batch, ``limit``: ``plan`` when the next batch's plan
exceeds the budget, ``oom`` when a real probe above it ran out of memory, ``max_batch`` at the cap). The
drafts are random tokens (``bench.steps.random_drafter``): memory does not depend on acceptance. On CPU the
allocator cannot be capped: the plan sets the limit and the probe only shows that the engine runs.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.e2e import _is_oom
from ssmspec.bench.steps import random_drafter
from ssmspec.bench.steps_replay import model_for, release
from ssmspec.engine import Engine
from ssmspec.engine.memory import HEADROOM, fmt_bytes, free_bytes, plan_bytes
from ssmspec.strategies import SpecConfig, make_strategy

log = logging.getLogger("ssmspec.bench.e2e_concurrency")

STRATEGIES = ("autoregressive", "snapshot", "replay")


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _check(b: DictConfig) -> tuple[list[str], int, int]:
    strategies = [str(s) for s in b.strategies]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise ValueError(f"replay_fig11_concurrency: bench.strategies may hold {list(STRATEGIES)}, got {strategies}")
    S, R = int(b.S), int(b.R)
    if S < 1 or R < S + 1:
        raise ValueError(f"replay_fig11_concurrency needs S >= 1 and R >= S + 1 (one call of pending + S drafts), "
                         f"got S={S}, R={R}")
    if int(b.context) < 1 or int(b.new_tokens) < 1 or int(b.max_batch) < 1 or int(b.probe_steps) < 1:
        raise ValueError("replay_fig11_concurrency needs bench.context, new_tokens, max_batch and probe_steps >= 1")
    if float(b.budget_mib) <= 0:
        raise ValueError(f"bench.budget_mib is the memory budget in MiB, > 0; got {b.budget_mib}")
    return strategies, S, R


class Budget:
    """Plan and real probes of one model under ``budget`` bytes (module doc)."""

    def __init__(self, model, *, budget: int, context: int, new_tokens: int, graph: bool, probe_steps: int,
                 seed: int) -> None:
        self.model, self.budget, self.context, self.new_tokens = model, budget, context, new_tokens
        self.graph, self.probe_steps, self.seed = graph, probe_steps, seed
        self.weights = weight_bytes(model)

    def parts(self, strategy: str, spec: SpecConfig, batch: int) -> dict[str, int]:
        """Bytes of every part one engine at ``batch`` allocates (``engine.memory.plan_bytes``; no prefill)."""
        return plan_bytes(self.model.cfg, make_strategy(strategy), batch=batch, spec=spec,
                          kv_capacity=self.context + self.new_tokens + spec.nodes + 1, prefill_len=self.context,
                          dtype=self.model.dtype, prefill=False)

    def planned(self, strategy: str, spec: SpecConfig, batch: int) -> int:
        """Weights + everything one engine at ``batch`` allocates."""
        return self.weights + sum(self.parts(strategy, spec, batch).values())

    def plan_search(self, strategy: str, spec: SpecConfig, cap: int) -> tuple[int, int]:
        """(largest batch <= cap whose plan fits the budget (0: none), plan probes made): doubling, then bisection."""
        fits = lambda n: self.planned(strategy, spec, n) <= self.budget  # noqa: E731
        probes, lo, hi, n = 0, 0, None, 1
        while n <= cap:
            probes += 1
            if not fits(n):
                hi = n
                break
            lo, n = n, n * 2
        hi = cap + 1 if hi is None else hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            probes += 1
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo, probes

    def run_engine(self, strategy: str, spec: SpecConfig, batch: int) -> None:
        """Allocate the engine at ``batch``, start it and launch ``probe_steps`` steps (graphs captured on CUDA)."""
        model = self.model
        drafter = random_drafter(spec, model.cfg.vocab_size, batch, seed=self.seed) if spec.draft_len else None
        eng = Engine(model, batch=batch, prefill_len=self.context, max_new_tokens=self.new_tokens, strategy=strategy,
                     drafter=drafter, spec=spec, cuda_graph=self.graph, prefill=False)
        try:
            g = torch.Generator(device=model.device).manual_seed(self.seed)
            pending = torch.randint(3, model.cfg.vocab_size, (batch,), generator=g, device=model.device)
            eng.start_synthetic(self.context, pending)
            eng.time_steps(warmup=0, iters=self.probe_steps)
        finally:
            del eng

    def probe(self, strategy: str, spec: SpecConfig, batch: int) -> dict:
        """One real probe: a ``kind: probe`` row with status ok or oom (the error's first line)."""
        dev = self.model.device
        row = dict(kind="probe", batch=batch, planned_bytes=self.planned(strategy, spec, batch), measured_bytes=None)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            self.run_engine(strategy, spec, batch)
            row["status"] = "ok"
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not _is_oom(e):
                raise
            row.update(status="oom", reason=str(e).splitlines()[0])
        if dev.type == "cuda":
            row["measured_bytes"] = int(torch.cuda.max_memory_allocated(dev))
        release(str(dev))
        return row

    def search(self, strategy: str, spec: SpecConfig, cap: int) -> Iterator[dict]:
        """Probe rows, then the ``max_batch`` row (module doc: plan search, then real probes downward)."""
        top, plan_probes = self.plan_search(strategy, spec, cap)
        limit = "max_batch" if top == cap and self.planned(strategy, spec, cap + 1) <= self.budget else "plan"
        good, bad, probes = None, None, []
        n = top
        while n >= 1 and good is None:  # halve until an engine runs
            probes.append(self.probe(strategy, spec, n))
            yield probes[-1]
            if probes[-1]["status"] == "ok":
                good = probes[-1]
            else:
                bad, n = n, n // 2
        while good is not None and bad is not None and bad - good["batch"] > 1:  # bisect the real limit
            mid = (good["batch"] + bad) // 2
            probes.append(self.probe(strategy, spec, mid))
            yield probes[-1]
            if probes[-1]["status"] == "ok":
                good = probes[-1]
            else:
                bad = mid
        if bad is not None:
            limit = "oom"
        yield dict(kind="max_batch", max_batch=good["batch"] if good else 0, limit=limit,
                   planned_bytes=good["planned_bytes"] if good else None,
                   measured_bytes=good["measured_bytes"] if good else None,
                   plan_parts=self.parts(strategy, spec, good["batch"]) if good else None,
                   plan_probes=plan_probes, real_probes=len(probes), status="ok")


def _cap_allocator(device: torch.device, budget: int) -> float | None:
    """CUDA: cap the caching allocator at ``budget`` bytes; returns the fraction set (None on CPU)."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if budget > total:
        raise ValueError(f"bench.budget_mib={budget / 2**20:g} exceeds the device's {fmt_bytes(total)}; lower it")
    frac = budget / total
    torch.cuda.set_per_process_memory_fraction(frac, device)
    return frac


def run_fig11(cfg: DictConfig) -> Iterator[dict]:
    """Fig. 11: the largest decode batch under the budget per preset x line (module doc)."""
    b = cfg.bench
    strategies, S, R = _check(b)
    device = str(cfg.device)
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    budget, cap = int(float(b.budget_mib) * 2**20), int(b.max_batch)
    context, new_tokens = int(b.context), int(b.new_tokens)
    for preset in b.presets:
        model = model_for(cfg, preset, context + new_tokens + S + 2)
        bud = Budget(model, budget=budget, context=context, new_tokens=new_tokens, graph=graph,
                     probe_steps=int(b.probe_steps), seed=int(cfg.seed))
        if bud.weights >= budget:
            raise ValueError(f"replay_fig11_concurrency: {preset}'s weights take {fmt_bytes(bud.weights)}, more than "
                             f"the budget of {fmt_bytes(budget)}; raise bench.budget_mib")
        if model.device.type == "cpu" and budget > HEADROOM * (free_bytes("cpu") + bud.weights):
            raise ValueError(f"bench.budget_mib={budget / 2**20:g} exceeds the free memory of this machine "
                             f"({fmt_bytes(free_bytes('cpu'))}); lower it")
        release(device)  # the allocator's cache from building the model must not count against the cap
        frac = _cap_allocator(model.device, budget)
        try:
            for strategy in strategies:
                s = S if strategy != "autoregressive" else 0
                spec = SpecConfig(draft_len=s, buffer_size=R)
                line = "autoregressive" if not s else f"{strategy} spec S={s}"
                base = dict(model=preset, strategy=strategy, line=line, S=s, R=R if strategy == "replay" else None,
                            budget_bytes=budget, weights_bytes=bud.weights, context=context, new_tokens=new_tokens,
                            dtype=C.dtype_name(model.dtype), allocator_capped=frac is not None,
                            acceptance="random-drafts (memory only)" if s else "none")
                for row in bud.search(strategy, spec, cap):
                    row = {**base, **row}
                    if row["kind"] == "max_batch":
                        log.info("%s %s: max batch %d (%s)", preset, line, row["max_batch"], row["limit"])
                    yield row
        finally:
            if frac is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, model.device)
        del model, bud
        release(device)
