"""SIGINT, SIGTERM and SIGHUP as one exception, so that an interrupted command cleans up and says what it kept.

``python -m ssmspec`` installs ``handle_signals()`` for the whole command. The first of these signals raises
``Interrupted`` in the main thread; every ``finally`` and ``except BaseException`` on the way up removes what
the command had started to write (the run's staging folder, the directories Hydra made, the children of a
queue), and ``ssmspec.cli.main`` prints one line, ``interrupted (SIGTERM): <what was kept, what was not>``,
and exits with 128 + the signal number, as a shell reports a process the signal ended.

A second signal while the first is being handled is ignored: the cleanup finishes. SIGKILL cannot be
caught; what a killed process leaves is removed by the next run (ssmspec/rundir.py, owner records).

``deferred()`` holds signals over a few lines that must not be cut in half (moving a finished run's files
into place, starting a child and recording it); a signal that arrives meanwhile is raised when the block
ends. ``allowed()`` lifts an outer ``deferred()`` for a stretch of work that may take long.

Kept free of torch and Hydra imports (the gpu_queue launcher, which Hydra imports on every command, uses it).
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Interrupted(KeyboardInterrupt):
    """One of SIGNALS arrived. ``detail`` is filled in on the way up by the code that knows what was kept;
    ``written`` lists run directories whose files were moved into place before the signal was raised;
    ``emptied`` lists directories the stopped work may have left empty, for the command to remove if it
    made them."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.detail: str | None = None
        self.written: list[Path] = []
        self.emptied: list[Path] = []

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # what a shell reports for a process ended by this signal


class _Gate:
    """The handler's state: how deep inside deferred() we are, the signal held meanwhile, whether one fired."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.fired = False


_gate = _Gate()


def _handler(signum: int, frame) -> None:
    if _gate.fired:
        return  # already stopping: let the cleanup finish
    if _gate.depth:
        _gate.pending = signum
        return
    _gate.fired = True
    raise Interrupted(signum)


def _raise_pending() -> None:
    if _gate.pending is not None and not _gate.fired and _gate.depth == 0:
        signum, _gate.pending = _gate.pending, None
        _gate.fired = True
        raise Interrupted(signum)


@contextmanager
def handle_signals() -> Iterator[None]:
    """Raise ``Interrupted`` on SIGINT / SIGTERM / SIGHUP inside the block (main thread only; elsewhere a
    no-op); the previous handlers come back afterwards (tests run the command line in-process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    saved = _gate.__dict__.copy()
    _gate.__init__()
    for s in SIGNALS:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _gate.__dict__.update(saved)


@contextmanager
def deferred() -> Iterator[None]:
    """Hold the signals inside the block; one that arrived meanwhile is raised as it ends."""
    _gate.depth += 1
    try:
        yield
    finally:
        _gate.depth -= 1
    _raise_pending()


@contextmanager
def allowed() -> Iterator[None]:
    """Let signals through inside the block even within ``deferred()`` (one held so far is raised now)."""
    depth, _gate.depth = _gate.depth, 0
    try:
        _raise_pending()
        yield
    finally:
        _gate.depth = depth
