"""The engine's side of asynchronous speculation (seed 002; the drafter is ``drafting/async_draft.py``).

A speculating drafter splits its proposal in two: ``lookup(buf)`` (the cache lookup of the last verdict: hit rows
take their cached branch; returns the step's ``DraftTree`` over static tensors) and ``backup_drafts(buf)`` (the backup
predictor, written into the miss rows of the same tensors), and has ``speculate()`` (fills the cache for the
verdicts of the round being verified) and ``missed()`` (host: did any row miss this round? a sync).

One launch, in order:

    lookup                 main stream (the draft graph)
    missed()? -> backup    the host reads one flag after the lookup; the backup graph runs only when a row missed,
                           so a round where every row hit has no drafting on the critical path but the lookup
    target || speculate    the target's graph on the main stream, queued first (the device starts verifying while the
                           host queues the rest), and the speculate graph on a side stream that waits for this
                           round's drafts only; the main stream then waits for the side stream (the next lookup
                           reads the cache)

The draft on its own device (the drafter's ``remote``: ``draft_device``, e.g. a second GPU). The side stream lives
on the draft's device and the drafter's transfers (``send``, ``fetch_cache``, ``fetch_backup``) are placed so that
no stream waits for more than it reads:

    lookup                                   main (target GPU)
    missed()? -> send, backup_draft,         draft GPU's side stream; the fetch makes main wait for the backup's
                 fetch_backup, merge_backup  drafts, then merges them on main (a ``draft`` backup; ``ngram`` and
                                             ``random`` backups run on main as above)
    target || send, speculate, fetch_cache  the target's graph on main first; send on a send stream of the target
                                             GPU that waits for this round's drafts (the side stream waits for the
                                             copy), speculate on the side stream, fetch_cache on the side stream into
                                             a receive stream of the target GPU, so main never waits for the
                                             speculation before its graph; main waits for the receive stream after
                                             it (the next lookup)

A cross-device copy (torch's ``copy_``) fences the current streams of both devices: the context managers here make
those the side stream and the send or receive stream, never main, whose target graph is already queued. The
copies run eagerly between graphs (a graph is captured on one device); three small ones a round.

The host check costs one synchronisation per step: the host can no longer queue the next step while the device
runs this one, so every step pays its graph launches (a few microseconds each) on the critical path. Seed 002's
engine decides the same way (its cache hits are read on the host). Eagerly (CPU, or ``cuda_graph=False``) the same
calls run in the same order, so a captured run equals an eager one.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ssmspec.engine.graphs import capture_on


class Speculation:
    """Graphs and streams of a speculating drafter inside one ``Engine`` (module doc)."""

    def __init__(self, drafter, device: torch.device, *, cuda: bool) -> None:
        self.drafter, self.device = drafter, torch.device(device)
        self.remote = bool(getattr(drafter, "remote", False))  # the draft on a device of its own
        draft_dev = getattr(drafter, "draft_device", None) or self.device
        # the speculate graph's stream (on the draft's device), and the target GPU's stream receiving the cache
        self.side = torch.cuda.Stream(draft_dev) if cuda else None
        self.recv = torch.cuda.Stream(self.device) if cuda and self.remote else None
        self.send_s = torch.cuda.Stream(self.device) if cuda and self.remote else None  # the target GPU's send copy
        self.draft_dev = torch.device(draft_dev)
        self.backup_graph: torch.cuda.CUDAGraph | None = None
        self.merge_graph: torch.cuda.CUDAGraph | None = None  # remote draft backup: the merge on the target GPU
        self.spec_graph: torch.cuda.CUDAGraph | None = None
        self.backups = 0  # rounds whose backup ran (host count: a row missed)

    def _on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _remote_backup(self) -> bool:
        return bool(getattr(self.drafter, "backup_remote", False))

    # drafting (critical path) -----------------------------------------------------------------------------
    def draft(self, step) -> None:
        """Eager drafting: lookup, then the backup when a row missed (module doc)."""
        step.set_drafts(self.drafter.lookup(step.buf))
        self._backup(step)

    def replay_draft(self, draft_graph: torch.cuda.CUDAGraph) -> None:
        draft_graph.replay()
        self._backup(None)

    def _backup(self, step) -> None:
        """The backup when some row missed (the host reads the flag: a sync); graphs once captured."""
        d = self.drafter
        if not d.missed():
            return
        self.backups += 1
        if not self._remote_backup():
            self.backup_graph.replay() if self.backup_graph is not None else d.backup_drafts(step.buf)
            return
        with self._on(self.side):  # main's current stream waits for fetch_backup (module doc)
            d.send()
            self.backup_graph.replay() if self.backup_graph is not None else d.backup_draft()
            d.fetch_backup()
        self.merge_graph.replay() if self.merge_graph is not None else d.merge_backup()

    # capture ----------------------------------------------------------------------------------------------
    def capture(self, step, register) -> torch.cuda.CUDAGraph:
        """Capture the lookup (returned: the engine's draft graph; it draws nothing), the backup and speculate
        graphs, each on the device whose tensors it touches."""
        d = self.drafter
        if self.remote:
            torch.cuda.synchronize(self.draft_dev)  # the eager first step's draft-side work is done
        draft_graph = torch.cuda.CUDAGraph()
        with capture_on(draft_graph, self.device):
            step.set_drafts(d.lookup(step.buf))
        self.backup_graph = torch.cuda.CUDAGraph()
        register(self.backup_graph, d.generators())
        with capture_on(self.backup_graph, self.draft_dev if self._remote_backup() else self.device):
            d.backup_draft() if self._remote_backup() else d.backup_drafts(step.buf)
        if self._remote_backup():
            self.merge_graph = torch.cuda.CUDAGraph()
            with capture_on(self.merge_graph, self.device):
                d.merge_backup()
        self.spec_graph = torch.cuda.CUDAGraph()
        register(self.spec_graph, d.speculate_generators())
        with capture_on(self.spec_graph, self.draft_dev, role="speculate"):  # it replays beside the target's graph
            d.speculate()
        return draft_graph

    # speculation || target ---------------------------------------------------------------------------------
    def _speculate(self) -> None:
        self.spec_graph.replay() if self.spec_graph is not None else self.drafter.speculate()

    def overlap(self, target) -> None:
        """Run ``target()`` (the target's step) while the drafter speculates: on a side stream (of the draft's
        device when remote) under CUDA graphs; eagerly on one device speculate first (the same results)."""
        d = self.drafter
        if self.side is None or (self.spec_graph is None and not self.remote):  # CPU, or eager: in order
            if self.remote:
                d.send()
            d.speculate()
            if self.remote:
                d.fetch_cache()
            target()
            return
        main = torch.cuda.current_stream(self.device)
        ready = main.record_event()  # this round's drafts are written
        target()  # queued first: the device starts verifying while the host queues the speculation
        if self.remote:
            with self._on(self.side), self._on(self.send_s):
                self.send_s.wait_event(ready)
                d.send()  # on send_s (the target GPU's current stream here), never behind the target's graph
            with self._on(self.side):
                self._speculate()
                with self._on(self.recv):
                    d.fetch_cache()
            main.wait_stream(self.recv)
            return
        self.side.wait_event(ready)
        with self._on(self.side):
            self._speculate()
        main.wait_stream(self.side)
