"""The engine's side of asynchronous speculation (seed 002; the drafter is ``drafting/async_draft.py``).

A speculating drafter splits its proposal in two: ``lookup(buf)`` (the cache lookup of the last verdict: hit rows
take their cached branch; returns the step's ``DraftTree`` over static tensors) and ``backup_drafts(buf)`` (the backup
predictor, written into the miss rows of the same tensors), and has ``speculate()`` (fills the cache for the
verdicts of the round being verified) and ``missed()`` (host: did any row miss this round? a sync).

One launch, in order:

    lookup                 main stream (the draft graph)
    missed()? -> backup    the host reads one flag after the lookup; the backup graph runs only when a row missed,
                           so a round where every row hit has no drafting on the critical path but the lookup
    speculate || target    the speculate graph on a side stream, concurrently with the target's graph on the main
                           stream; the main stream then waits for the side stream (the next lookup reads the cache)

The host check costs one synchronisation per step: the host can no longer queue the next step while the device
runs this one, so every step pays its graph launches (a few microseconds each) on the critical path. Seed 002's
engine decides the same way (its cache hits are read on the host). Eagerly (CPU, or ``cuda_graph=False``) the same
calls run in the same order, so a captured run equals an eager one.
"""
from __future__ import annotations

import torch


class Speculation:
    """Graphs and stream of a speculating drafter inside one ``Engine`` (module doc)."""

    def __init__(self, drafter, device: torch.device, *, cuda: bool) -> None:
        self.drafter = drafter
        self.side = torch.cuda.Stream(device) if cuda else None  # the speculate graph's stream
        self.backup_graph: torch.cuda.CUDAGraph | None = None
        self.spec_graph: torch.cuda.CUDAGraph | None = None
        self.backups = 0  # rounds whose backup ran (host count: a row missed)

    def draft(self, step) -> None:
        """Eager drafting: lookup, then the backup when a row missed (module doc)."""
        step.set_drafts(self.drafter.lookup(step.buf))
        self._backup_eager(step)

    def _backup_eager(self, step) -> None:
        if self.drafter.missed():
            self.backups += 1
            self.drafter.backup_drafts(step.buf)

    def capture(self, step, register) -> torch.cuda.CUDAGraph:
        """Capture the lookup (returned: the engine's draft graph), the backup and speculate graphs."""
        d = self.drafter
        draft_graph = torch.cuda.CUDAGraph()
        register(draft_graph, d.generators())
        with torch.cuda.graph(draft_graph):
            step.set_drafts(d.lookup(step.buf))
        self.backup_graph = torch.cuda.CUDAGraph()
        register(self.backup_graph, d.generators())
        with torch.cuda.graph(self.backup_graph):
            d.backup_drafts(step.buf)
        self.spec_graph = torch.cuda.CUDAGraph()
        register(self.spec_graph, d.speculate_generators())
        with torch.cuda.graph(self.spec_graph):
            d.speculate()
        return draft_graph

    def replay_draft(self, draft_graph: torch.cuda.CUDAGraph) -> None:
        draft_graph.replay()
        if self.drafter.missed():  # waits for the lookup: the host decides whether the backup runs
            self.backups += 1
            self.backup_graph.replay()

    def overlap(self, target) -> None:
        """Run ``target()`` (the target's step) while the drafter speculates: side stream under graphs, else
        speculate first (the same results)."""
        if self.spec_graph is None:
            self.drafter.speculate()
            target()
            return
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self.spec_graph.replay()
        target()
        main.wait_stream(self.side)
