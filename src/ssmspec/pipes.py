"""A closed stdout ends every command quietly: ``python -m ssmspec list | head -1`` prints its first line and
exits with status 141 (128 + SIGPIPE, what a shell reports for ``yes`` in ``yes | head -1``), nothing on stderr.

Python's recipe (docs of ``signal``, "Note on SIGPIPE") catches ``BrokenPipeError`` at the entry and points
stdout at /dev/null, so that the interpreter's last flush does not fail again. ``ssmspec run`` needs one step
more: a write into the closed pipe happens inside Hydra, which turns an exception of the job into a traceback
and exit status 1, or inside a logging handler, which prints "--- Logging error ---" and goes on. So for the
duration of ``cli.main`` stdout is wrapped (``GuardedStdout``) and such a write raises ``StdoutClosed``, a
``SystemExit``: Hydra and logging pass it through, the runner and the job remove what they staged (nothing
half-written), and ``cli.main`` exits.

Kept free of torch: ``import ssmspec.cli`` imports this module.
"""
from __future__ import annotations

import io
import os
from typing import TextIO

EXIT_PIPE = 141  # 128 + SIGPIPE


class StdoutClosed(SystemExit):
    """The reader of stdout went away (a SystemExit, so that Hydra and logging handlers let it through)."""

    def __init__(self) -> None:
        super().__init__(EXIT_PIPE)


class GuardedStdout:
    """``stream`` whose ``write`` / ``flush`` into a closed pipe raise ``StdoutClosed``; everything else
    (``fileno``, ``isatty``, ``encoding``, ...) is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise StdoutClosed() from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise StdoutClosed() from None

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def silence(stream: TextIO) -> int:
    """Point ``stream``'s file descriptor at /dev/null (what is still buffered goes there at exit, not into a
    second BrokenPipeError); returns ``EXIT_PIPE``."""
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # not a file (a test's capture): nothing to do
        return EXIT_PIPE
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    return EXIT_PIPE
