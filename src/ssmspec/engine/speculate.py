"""The engine's side of asynchronous speculation (seed 002; the drafter is ``drafting/async_draft.py``).

A speculating drafter splits its proposal in two: ``lookup(buf)`` (the cache lookup of the last verdict: hit rows
take their cached branch; returns the step's ``DraftTree`` over static tensors; it also writes the device flag
``miss_any``) and ``backup_drafts(buf)`` (the backup predictor, written into the miss rows of the same tensors), and
has ``backup_noise()`` (the backup's random numbers, drawn every round), ``speculate()`` (fills the cache for the
verdicts of the round being verified) and ``missed()`` (host: did any row miss this round? a sync, eager runs only).

One launch, in order:

    lookup, backup_noise   main stream: the draft graph
    if miss_any: backup    inside the same graph, a conditional node: the device decides whether the backup runs,
                           so no host waits on a flag and the host queues the next round while this one runs; a round
                           where every row hit has no drafting on the critical path but the lookup
    target || speculate    the target's graph on the main stream, queued first, and the speculate graph on a side
                           stream that waits for this round's drafts only; the main stream then waits for the side
                           stream (the next lookup reads the cache)

Where torch has no conditional nodes (``conditional_nodes()``: before torch 2.12) the host decides instead: it
reads ``missed()`` after the draft graph (a sync: the host cannot queue the next step while the device runs this
one, so every step pays its graph launches on the critical path) and replays the backup graph only when a row
missed, as seed 002's engine decides (its cache hits are read on the host).

The draft on its own device (the drafter's ``remote``: ``draft_device``, e.g. a second GPU). The side stream lives
on the draft's device and the drafter's transfers (``send``, ``fetch_cache``, ``fetch_backup``) are placed so that
no stream waits for more than it reads. With an ``ngram`` or ``random`` backup (on the target's GPU) the draft graph
is the one above; ``send`` then runs after it, beside the target. With the ``draft`` backup (on the draft's GPU):

    lookup                                   main (target GPU)
    send                                     a send stream of the target GPU, waiting for the lookup only: the
                                             bonus, start slot, hit flags and drafts to the draft GPU
    backup_noise, if a row missed: backup    the draft GPU's side stream, one graph with a conditional node
    fetch_backup, merge_backup               the backup's drafts back into a receive stream of the target GPU; main
                                             waits for it and merges them into its miss rows (every round: the
                                             round trip replaces the host's decision; where the host decides, the
                                             draws' graph runs every round and the round trip only in a round
                                             where a row missed, ``send`` beside the target otherwise)
    target || speculate, fetch_cache         the target's graph on main; speculate on the side stream (after the
                                             backup, which merged its tokens into the draft GPU's drafts), the
                                             cache back into the receive stream; main waits for it after its graph

A cross-device copy (torch's ``copy_``) fences the current streams of both devices: the context managers here make
those the side stream and the send or receive stream, never main, whose target graph is already queued. The
copies run eagerly between graphs (a graph is captured on one device).

Conditional nodes (CUDA >= 12.4, torch's ``CUDAGraph.begin_capture_to_if_node``) hold no random draws: the backup's
are drawn before the node, every round (``backup_noise``), so a captured run draws what an eager one draws. Eagerly
(CPU, or ``cuda_graph=False``) the host reads ``missed()`` in place of the node and the same calls run in the same
order, so a captured run equals an eager one.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch


def conditional_nodes() -> bool:
    """Whether this torch captures conditional CUDA graph nodes (``CUDAGraph.begin_capture_to_if_node``: torch
    2.12 and later, built with CUDA 12.4 or later)."""
    return hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


@contextmanager
def _if(graph: torch.cuda.CUDAGraph, pred: torch.Tensor):
    """Capture the body of the ``with`` block into a conditional node of ``graph`` that runs only when the bool
    scalar ``pred`` (on the capturing device) holds at replay."""
    graph.begin_capture_to_if_node(pred)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


class Speculation:
    """Graphs and streams of a speculating drafter inside one ``Engine`` (module doc)."""

    def __init__(self, drafter, device: torch.device, *, cuda: bool) -> None:
        self.drafter, self.device, self.cuda = drafter, torch.device(device), cuda
        self.remote = bool(getattr(drafter, "remote", False))  # the draft on a device of its own
        draft_dev = getattr(drafter, "draft_device", None) or self.device
        # the speculate graph's stream (on the draft's device), and the target GPU's streams sending and receiving
        self.side = torch.cuda.Stream(draft_dev) if cuda else None
        self.recv = torch.cuda.Stream(self.device) if cuda and self.remote else None
        self.send_s = torch.cuda.Stream(self.device) if cuda and self.remote else None
        self.draft_dev = torch.device(draft_dev)
        # captured rounds: the device decides whether the backup runs (a conditional node) where torch can
        self.on_device = cuda and conditional_nodes()
        self.backup_graph: torch.cuda.CUDAGraph | None = None  # the backup (the draft GPU's, for a remote draft)
        self.noise_graph: torch.cuda.CUDAGraph | None = None  # host decides, remote draft backup: its draws
        self.merge_graph: torch.cuda.CUDAGraph | None = None  # remote draft backup: the merge on the target GPU
        self.spec_graph: torch.cuda.CUDAGraph | None = None
        self._count: torch.Tensor | None = None  # rounds whose backup ran, on the backup's device
        self._sent = False  # this round's drafts went to the draft's device with the backup's round trip

    @property
    def backups(self) -> int:
        """Rounds whose backup ran (some row missed). Reads a device counter: a sync, after a run."""
        return 0 if self._count is None else int(self._count)

    def _counter(self) -> torch.Tensor:
        if self._count is None:
            dev = self.draft_dev if self._remote_backup() else self.device
            self._count = torch.zeros((), dtype=torch.long, device=dev)
        return self._count

    def _on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _remote_backup(self) -> bool:
        return bool(getattr(self.drafter, "backup_remote", False))

    # drafting (critical path) -----------------------------------------------------------------------------
    def draft(self, step) -> None:
        """Eager drafting: lookup, then the backup when a row missed (the host decides; module doc)."""
        d = self.drafter
        self._sent = False
        step.set_drafts(d.lookup(step.buf))
        if self._remote_backup():
            self._round_trip(None)
            return
        d.backup_noise()
        if d.missed():
            d.backup_drafts(step.buf)
            self._counter().add_(1)

    def replay_draft(self, draft_graph: torch.cuda.CUDAGraph) -> None:
        """Captured drafting: the draft graph (with ``on_device`` its conditional node runs the backup where a row
        missed; else the host reads the flag and replays the backup graph) and, for the draft backup on its own
        device, the round trip there (module doc)."""
        self._sent = False
        draft_graph.replay()
        if self.on_device:
            if self._remote_backup():
                self._round_trip(self.backup_graph)
            return
        if self.noise_graph is not None:
            with self._on(self.side):
                self.noise_graph.replay()  # every round: the draws an eager run makes
        if not self.drafter.missed():  # the host reads the flag: a sync
            return
        if self._remote_backup():
            self._round_trip(self.backup_graph)
        else:
            self.backup_graph.replay()

    def _round_trip(self, graph) -> None:
        """The draft backup on the draft's device: send, backup, fetch, merge (module doc). ``graph``: the draft
        device's backup graph (with ``on_device`` its noise and conditional node; else the backup alone, in a
        round where the host saw a miss); None: eagerly, the host decides."""
        d = self.drafter
        main = torch.cuda.current_stream(self.device) if self.cuda else None
        with self._on(self.side), self._on(self.send_s):
            if main is not None:
                self.send_s.wait_stream(main)  # this round's lookup
            d.send()
        self._sent = True
        with self._on(self.side):
            if graph is not None:
                graph.replay()
            else:  # eager: the host reads the flag the graph's conditional node reads (a sync)
                d.backup_noise()
                if bool(d.remote_miss_flag()):
                    d.backup_draft()
                    self._counter().add_(1)
            with self._on(self.recv):
                d.fetch_backup()
        if main is not None:
            main.wait_stream(self.recv)
        self.merge_graph.replay() if self.merge_graph is not None else d.merge_backup()

    # capture ----------------------------------------------------------------------------------------------
    def capture(self, step, register) -> torch.cuda.CUDAGraph:
        """Capture the draft graph (returned: the lookup and, unless the backup runs on the draft's device, the
        backup's draws and, with ``on_device``, the conditional backup), the backup graph (the draft device's for
        a remote draft backup), its draws' graph and the merge (a remote draft backup whose host decides) and the
        speculate graph, each on the device whose tensors it touches."""
        d = self.drafter
        count = self._counter()
        if self.remote:
            torch.cuda.synchronize(self.draft_dev)  # the eager first step's draft-side work is done
        draft_graph = torch.cuda.CUDAGraph()
        local = not self._remote_backup()
        if local:
            register(draft_graph, d.generators())
        with torch.cuda.graph(draft_graph):
            step.set_drafts(d.lookup(step.buf))
            if local:
                d.backup_noise()
                if self.on_device:
                    with _if(draft_graph, d.miss_any):
                        d.backup_drafts(step.buf)
                        count.add_(1)
        if local and not self.on_device:
            self.backup_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.backup_graph):
                d.backup_drafts(step.buf)
                count.add_(1)
        if not local:
            if not self.on_device and d.generators():  # a greedy draft backup draws nothing
                self.noise_graph = torch.cuda.CUDAGraph()
                register(self.noise_graph, d.generators())
                with self._capturing(self.noise_graph, self.draft_dev), torch.cuda.device(self.draft_dev):
                    d.backup_noise()
            self.backup_graph = torch.cuda.CUDAGraph()
            if self.on_device:
                register(self.backup_graph, d.generators())
            with self._capturing(self.backup_graph, self.draft_dev), torch.cuda.device(self.draft_dev):
                if self.on_device:
                    d.backup_noise()
                    with _if(self.backup_graph, d.remote_miss_flag()):
                        d.backup_draft()
                        count.add_(1)
                else:
                    d.backup_draft()
                    count.add_(1)
            self.merge_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.merge_graph):
                d.merge_backup()
        self.spec_graph = torch.cuda.CUDAGraph()
        register(self.spec_graph, d.speculate_generators())
        with self._capturing(self.spec_graph, self.draft_dev):
            d.speculate()
        return draft_graph

    def _capturing(self, graph: torch.cuda.CUDAGraph, device: torch.device):
        """Capture on ``device``: torch.cuda.graph's default capture stream lives on the first device that used
        it, so a graph of the draft's GPU gets a capture stream there."""
        if device == self.device:
            return torch.cuda.graph(graph)
        return torch.cuda.graph(graph, stream=torch.cuda.Stream(device))

    # speculation || target ---------------------------------------------------------------------------------
    def _speculate(self) -> None:
        self.spec_graph.replay() if self.spec_graph is not None else self.drafter.speculate()

    def overlap(self, target) -> None:
        """Run ``target()`` (the target's step) while the drafter speculates: on a side stream (of the draft's
        device when remote) under CUDA graphs; eagerly on one device speculate first (the same results)."""
        d = self.drafter
        sends = self.remote and not self._sent  # a draft backup's round trip sent this round's drafts already
        if self.side is None or (self.spec_graph is None and not self.remote):  # CPU, or eager: in order
            if sends:
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
            if sends:
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
