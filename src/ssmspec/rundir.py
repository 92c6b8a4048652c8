"""Output folders that survive interruption and concurrent runs: owner records, dead staging folders, the lock.

A run stages its files in ``<out>/.partial-<hex>/`` (ssmspec.runner.staged_dir) and moves them into ``<out>``
when it succeeds. A process killed with SIGKILL (or by the OOM killer, or a power cut) cannot remove that
folder, so each one holds ``.owner.json``: the owner's pid, host, boot id and process start time (field 22
of /proc/<pid>/stat, in clock ticks since boot), which tells a live owner from a dead one whose pid was
reused. ``sweep`` removes staging folders whose owner is dead, never one whose owner lives:

- same host, other boot id: dead (every process of the earlier boot is);
- same host, no such pid, a zombie, or a pid with another start time: dead;
- another host (a shared file system): alive, since nothing here can tell;
- no owner record (a version before this one, or killed in the instant between creating the folder and
  writing the record): dead once it is older than UNOWNED_GRACE_S and no run holds the folder's lock.

A run holds an exclusive ``flock`` on its output folder from start to end (``lock``): the lock lives on a
descriptor of the folder itself, so it leaves no file behind, and the kernel releases it however the
process ends. A second run into the same folder is refused at once (``Busy``) with the holder's pid, start
time and command line (from /proc/locks, else from its staging folder's owner record).

``python -m ssmspec clean`` (``make clean``) sweeps results/ and runs/, then empties runs/ except folders a
live run holds. Only the standard library is used here: ``make clean`` runs without the venv.
"""
from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL_PREFIX = ".partial-"
OWNER_FILE = ".owner.json"  # inside each staging folder; never moved into the run directory
UNOWNED_GRACE_S = 60.0  # a staging folder without an owner record younger than this may be being set up


# the owner of a staging folder ---------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of ``pid`` from /proc, or None when there is no such
    process (or no /proc)."""
    try:
        text = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
    return fields[0], int(fields[19])  # field 22: starttime


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def owner_record(pid: int | None = None) -> dict:
    """Who owns a staging folder: this process (or ``pid``), identified beyond pid reuse."""
    pid = os.getpid() if pid is None else pid
    stat = _proc_stat(pid)
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(), "start": stat[1] if stat else None,
            "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": sys.argv if pid == os.getpid() else None}


def read_owner(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None


def owner_alive(rec: dict) -> bool:
    """Whether the process a record names still runs (True when this machine cannot tell)."""
    if rec.get("host") != socket.gethostname():
        return True
    boot = _boot_id()
    if rec.get("boot_id") and boot and rec["boot_id"] != boot:
        return False
    pid = rec.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if Path("/proc/self/stat").exists():
        stat = _proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return rec.get("start") is None or rec["start"] == stat[1]
    try:  # no /proc (macOS): the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def new_partial(final: Path) -> Path:
    """Create ``final/.partial-<hex>/`` holding this process's owner record."""
    folder = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=final))
    scratch = folder / f"{OWNER_FILE}.tmp"  # written whole, then renamed: a reader never sees half a record
    scratch.write_text(json.dumps(owner_record()) + "\n")
    os.replace(scratch, folder / OWNER_FILE)
    return folder


def partial_is_dead(folder: Path) -> bool:
    rec = read_owner(folder)
    if rec is not None:
        return not owner_alive(rec)
    try:
        age = time.time() - folder.stat().st_mtime
    except OSError:
        return False
    return age > UNOWNED_GRACE_S and not locked_by_other(folder.parent)


def prune_empty(folder: Path, stop: Path, *, inclusive: bool = False) -> None:
    """Remove ``folder`` and its parents while they are empty and no other run holds them, up to ``stop``
    (``stop`` itself too when ``inclusive``); an empty folder another run has just made stays."""
    folder, stop = Path(folder).absolute(), Path(stop).absolute()
    while (stop in folder.parents or (inclusive and folder == stop)) and not locked_by_other(folder):
        try:
            folder.rmdir()  # fails on a folder that is not empty (or gone): the walk ends there
        except OSError:
            return
        folder = folder.parent


def sweep(top: Path, *, recursive: bool = False, prune: bool = False) -> list[Path]:
    """Remove the staging folders in ``top`` (every folder below it if ``recursive``) whose owner is dead;
    with ``prune``, also the folders left empty by that, up to ``top``. Returns the removed staging folders."""
    top = Path(top).absolute()
    if not top.is_dir():
        return []
    removed = []
    for here, dirs, _ in os.walk(top):
        for name in [d for d in dirs if d.startswith(PARTIAL_PREFIX)]:
            dirs.remove(name)  # never descend into a staging folder
            folder = Path(here) / name
            if partial_is_dead(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        if not recursive:
            break
    if prune:
        for folder in removed:
            prune_empty(folder.parent, top)
    return removed


# the output folder's lock -----------------------------------------------------------------------------
class Busy(RuntimeError):
    """Another process holds the folder's lock; the message names it."""


# (st_dev, st_ino) of a folder -> [descriptor, nesting] of the locks this process holds (the folder's identity,
# not its path: results_dir=../x and Hydra's normalised path name one folder)
_held: dict[tuple[int, int], list[int]] = {}


def _identity(folder: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _lock_owner_pids(folder: Path) -> list[int]:
    """Pids that /proc/locks lists with an exclusive flock on ``folder`` (Linux; else [])."""
    try:
        st = os.stat(folder)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        try:
            kind, pid, dev = parts[1], int(parts[4]), parts[5]
            major, minor, ino = dev.split(":")
        except (IndexError, ValueError):
            continue
        if kind == "FLOCK" and (int(major, 16), int(minor, 16), int(ino)) == (
                os.major(st.st_dev), os.minor(st.st_dev), st.st_ino):
            pids.append(pid)
    return pids


def _describe(pid: int) -> str:
    """``pid 1234, started 2026-01-02 10:11:12, python -m ssmspec run ...`` as far as /proc tells."""
    out = [f"pid {pid}"]
    stat = _proc_stat(pid)
    try:
        btime = next(int(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                     if ln.startswith("btime "))
        if stat:
            started = datetime.datetime.fromtimestamp(btime + stat[1] / os.sysconf("SC_CLK_TCK"))
            out.append(f"started {started:%Y-%m-%d %H:%M:%S}")
    except (OSError, StopIteration, ValueError):
        pass
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        words = [os.path.basename(argv[0].decode())] + [a.decode(errors="replace") for a in argv[1:]]
        cmd = " ".join(words)
        out.append(cmd if len(cmd) <= 160 else cmd[:157] + "...")
    except (OSError, IndexError):
        pass
    return ", ".join(out)


def busy_message(folder: Path, holder: str) -> str:
    """The ``error:`` line of a run refused because another one writes into ``folder``."""
    return (f"{folder} is in use by another run ({holder}); wait for it to finish, or choose another "
            f"results_dir")


def holder(folder: Path) -> str:
    """Who holds ``folder``'s lock, in words (``another process`` when nothing tells)."""
    pids = [p for p in _lock_owner_pids(folder) if p != os.getpid()]
    if pids:
        return _describe(pids[0])
    for p in sorted(Path(folder).glob(PARTIAL_PREFIX + "*")):
        rec = read_owner(p)
        if rec and owner_alive(rec):
            if rec.get("host") != socket.gethostname():  # this machine cannot tell whether it still runs
                return (f"pid {rec.get('pid')} on host {rec.get('host')}, started {rec.get('time')}, may still run "
                        f"there; remove it by hand if that run has ended")
            return _describe(int(rec["pid"]))
    return "another process"


def _try_lock(folder: Path) -> int | None:
    """A descriptor of ``folder`` holding its exclusive lock, or None when another process holds it."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def locked_by_other(folder: Path) -> bool:
    """Whether another process holds ``folder``'s lock (read from /proc/locks where it exists, so that
    looking takes no lock; elsewhere by trying it for an instant)."""
    folder = Path(folder).absolute()
    if _identity(folder) in _held or not folder.is_dir():
        return False
    if Path("/proc/locks").exists():
        return any(p != os.getpid() for p in _lock_owner_pids(folder))
    try:
        fd = _try_lock(folder)
    except OSError:
        return False
    if fd is None:
        return True
    os.close(fd)
    return False


@contextmanager
def lock(folder: Path) -> Iterator[Path]:
    """Hold ``folder``'s exclusive lock inside the block (created when missing; nested calls of this process
    share one lock). Raises ``Busy`` naming the holder when another process has it."""
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    key = _identity(folder)
    if key in _held:
        _held[key][1] += 1
    else:
        fd = _try_lock(folder)
        if fd is None:
            raise Busy(holder(folder))
        _held[key] = [fd, 1]
    try:
        yield folder
    finally:
        _held[key][1] -= 1
        if not _held[key][1]:
            os.close(_held.pop(key)[0])  # closing the descriptor releases the lock


# writability -----------------------------------------------------------------------------------------
def unwritable(folder: Path) -> str | None:
    """Why files cannot be created in ``folder`` (or in the folders that would be created for it), tried
    with a probe folder that is removed at once; None when they can."""
    folder = Path(folder).absolute()
    base = folder
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():  # results_dir itself a file: config.check_values names it
        return None if base == folder else f"{base} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ssmspec-probe-", dir=base))
    except OSError as e:
        return f"creating a folder in {base} failed: {e.strerror or e}"
    return None


# clean -----------------------------------------------------------------------------------------------
def _live(folder: Path) -> bool:
    """Whether a live run uses ``folder`` or anything below it (a held lock, or a staging folder of a live
    owner)."""
    for here, dirs, _ in os.walk(folder):
        if locked_by_other(Path(here)):
            return True
        for name in [d for d in dirs if d.startswith(PARTIAL_PREFIX)]:
            dirs.remove(name)
            if not partial_is_dead(Path(here) / name):
                return True
    return False


def _empty_except_live(folder: Path, kept: list[Path]) -> None:
    """Remove the folders inside ``folder`` (a live run uses something below it) that no live run uses;
    a folder a live run holds is kept whole, and so are the files beside it."""
    for entry in sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()):
        if not _live(entry):
            shutil.rmtree(entry, ignore_errors=True)
        elif locked_by_other(entry) or any(p.name.startswith(PARTIAL_PREFIX) for p in entry.iterdir()):
            kept.append(entry)
        else:
            _empty_except_live(entry, kept)


def clean(results: Path, runs: list[Path], *, remove_runs: bool) -> list[str]:
    """Remove dead staging folders under ``results`` and ``runs`` (and the folders that leaves empty);
    with ``remove_runs``, then remove the ``runs`` folders too, keeping any folder a live run uses.
    Returns what it did, one line per thing."""
    lines = []
    for top in [results, *runs]:
        for p in sweep(top, recursive=True, prune=True):
            lines.append(f"removed {p} (left by a run that has ended)")
    if remove_runs:
        for top in runs:
            if not top.is_dir():
                continue
            if not _live(top):
                shutil.rmtree(top, ignore_errors=True)
                lines.append(f"removed {top}")
                continue
            kept: list[Path] = []
            _empty_except_live(top, kept)
            lines += [f"kept {k}: a run is using it ({holder(k)})" for k in kept]
    return lines
