"""SIGINT, SIGTERM and SIGHUP as one exception, so that an interrupted command cleans up and says what it kept.

``python -m ssmspec`` installs ``handle_signals()`` for the whole command. The first of these signals raises
``Interrupted`` in the main thread; every ``finally`` and ``except BaseException`` on the way up removes what
the command had started to write (the run's staging folder, the directories Hydra made, the children of a
queue), and ``ssmspec.cli.main`` prints one line, ``interrupted (SIGTERM): <what was kept, what was not>``,
and exits with 128 + the signal number, as a shell reports a process the signal ended.

A second signal while the first is being handled is ignored: the cleanup finishes. SIGKILL cannot be
caught; what a killed process leaves is removed by the next run (ssmspec/rundir.py, owner records).

A handler runs wherever the main thread happens to be, and some code drops an exception raised there: C code
that clears the error of a Python call it made (imports inside torch's and triton's start-up do), a
finaliser (``__del__``, a weakref callback: "Exception ignored in ..."). The command would then run on with
the signal spent. So an ``Interrupted`` that is freed before the command's top saw it (``reached_top``) re-arms
the handler and the signal is sent again a moment later, from a helper thread, so that it lands outside the
code that dropped it; an ``Interrupted`` dropped in a finaliser prints nothing (``sys.unraisablehook``).

``deferred()`` holds signals over a few lines that must not be cut in half (moving a finished run's files
into place, starting a child and recording it); a signal that arrives meanwhile is raised when the block
ends. ``allowed()`` lifts an outer ``deferred()`` for a stretch of work that may take long.

Kept free of torch and Hydra imports (the gpu_queue launcher, which Hydra imports on every command, uses it).
"""
from __future__ import annotations

import itertools
import os
import signal
import sys
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
        self.generation: int | None = None  # the handle_signals() block whose handler raised it (None: not a signal)
        self.seen = False  # the command's top caught it (reached_top)

    def reached_top(self) -> None:
        """The command caught it where it ends: a live signal, not one some library dropped."""
        self.seen = True

    def __del__(self) -> None:
        try:
            if self.generation is not None and not self.seen and self.generation == _gate.generation:
                _redeliver(self.signum)  # freed on the way up: someone dropped it
        except Exception:  # interpreter shutdown: module globals may be gone
            pass

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # what a shell reports for a process ended by this signal


class _Gate:
    """The handler's state: how deep inside deferred() we are, the signal held meanwhile, whether one fired, and
    which handle_signals() block is active (a number that changes on every entry and exit)."""

    def __init__(self, generation: int = 0) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.fired = False
        self.generation = generation


_gate = _Gate()
REDELIVER_S = 0.02  # how long after a dropped Interrupted the signal comes again


def _interrupted(signum: int) -> Interrupted:
    _gate.fired = True
    e = Interrupted(signum)
    e.generation = _gate.generation
    return e


def _handler(signum: int, frame) -> None:
    if _gate.fired:
        return  # already stopping: let the cleanup finish
    if _gate.depth:
        _gate.pending = signum
        return
    raise _interrupted(signum)


def _raise_pending() -> None:
    if _gate.pending is not None and not _gate.fired and _gate.depth == 0:
        signum, _gate.pending = _gate.pending, None
        raise _interrupted(signum)


def _redeliver(signum: int) -> None:
    """An Interrupted was dropped before the command's top: re-arm the handler and send the signal again from
    a helper thread (sent from here, the handler could run inside the very finaliser that dropped it)."""
    _gate.fired = False
    generation = _gate.generation

    def again() -> None:
        if _gate.generation == generation and not _gate.fired:
            os.kill(os.getpid(), signum)

    timer = threading.Timer(REDELIVER_S, again)
    timer.daemon = True
    timer.start()


def _unraisable(previous):
    def hook(args) -> None:
        if isinstance(args.exc_value, Interrupted) and args.exc_value.generation is not None:
            return  # a signal that landed in a finaliser: it comes again (Interrupted.__del__), no report
        previous(args)

    return hook


_generations = itertools.count(1)  # 0: no block ever active


def _next_generation() -> int:
    return next(_generations)


@contextmanager
def handle_signals() -> Iterator[None]:
    """Raise ``Interrupted`` on SIGINT / SIGTERM / SIGHUP inside the block (main thread only; elsewhere a
    no-op); the previous handlers come back afterwards (tests run the command line in-process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    saved, hook = _gate.__dict__.copy(), sys.unraisablehook
    _gate.__init__(generation=_next_generation())
    sys.unraisablehook = _unraisable(hook)
    for s in SIGNALS:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
        _gate.__dict__.update(saved)  # an Interrupted this block raised is spent now (its generation is gone)


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
