"""Run the GPU test suite and keep its record: what passed, on which device, at which code.

    python -m ssmspec.gputests [--out results/gpu-tests] [-- extra pytest args]

Runs ``pytest -m gpu tests`` (every test marked ``gpu``: the kernels at real sizes, captured decode steps,
the strategies' lossless checks on the GPU kernels) in a subprocess and writes, into ``--out`` (default
``results/gpu-tests``), through a staged folder so a failed or interrupted write leaves the old record:

- ``pytest.log``: the whole output (``-rfEs``: every failure, error and skip with its reason);
- ``summary.json``: passed / failed / errors / skipped / deselected counts, wall time, the command;
- ``env.json``: the device, driver, torch, triton and the provenance of ``ssmspec/provenance.py`` (source
  hash, the commit it equals), as every experiment's env.json.

``--spread`` spreads the xdist workers over every visible GPU: each worker sees all of them with its own first
(``CUDA_VISIBLE_DEVICES`` rotated, set by ``tests/conftest.py`` from ``SSMSPEC_TEST_GPUS`` before CUDA starts),
so tests on ``"cuda"`` run on the worker's GPU and the two-GPU tests still find a second one. Without it every
worker runs on GPU 0. Give as many workers as you like (``-- -n 8`` on four GPUs: two each).

The exit status is pytest's. The README quotes the counts of the committed record; the record is rewritten
by rerunning this, never by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ssmspec.paths import RESULTS_DIR, ROOT

SPREAD_ENV = "SSMSPEC_TEST_GPUS"  # GPUs the workers rotate over (--spread; read by tests/conftest.py)
COUNTS = ("passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed", "warnings")


def parse_counts(text: str) -> dict:
    """The counts of pytest's final summary line (``12 passed, 3 skipped in 4.5s``); zeros for the rest."""
    tail = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped|deselected)", line)]
    counts = dict.fromkeys(COUNTS, 0)
    if not tail:
        return counts
    for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?)", tail[-1]):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        counts[key] = int(n)
    return counts


def worker_gpus(worker: str | None, gpus: str) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the xdist worker ``worker`` (``gw3``) when the tests are spread over ``gpus``
    (comma-separated): all of them, rotated so the worker's own comes first (gw1 of 0,1,2,3 -> 1,2,3,0). None
    outside a worker (the controlling process) or without GPUs to spread over."""
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not worker or not ids:
        return None
    if not worker.startswith("gw") or not worker[2:].isdigit():
        raise ValueError(f"PYTEST_XDIST_WORKER={worker!r}: expected gw<N>")
    k = int(worker[2:]) % len(ids)
    return ",".join(ids[k:] + ids[:k])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python -m ssmspec.gputests", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu-tests", help="folder of the record")
    ap.add_argument("--spread", action="store_true",
                    help="spread the xdist workers over every visible GPU (module doc); pass -- -n N")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    import torch

    from ssmspec.bench.env import collect_env
    from ssmspec.runner import staged_dir

    if not torch.cuda.is_available():
        print("error: the GPU tests need a CUDA device; run this on a GPU machine", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider", "tests", *extra]
    child = dict(os.environ)
    if args.spread:
        if not any(a.startswith(("-n", "--numprocesses")) for a in extra):  # -n 8, -n8, -nauto, --numprocesses=8
            print("error: --spread spreads xdist workers: add them after --, e.g. "
                  "python -m ssmspec.gputests --spread -- -n 8", file=sys.stderr)
            return 2
        from hydra_plugins.ssmspec_launcher.gpu_queue import detect_devices

        child[SPREAD_ENV] = ",".join(detect_devices())  # as CUDA_VISIBLE_DEVICES names them
    env = collect_env(device="cuda", weights="random")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=child)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    sys.stdout.write(log[-4000:])
    summary = {**parse_counts(log), "exit_status": proc.returncode, "wall_s": round(wall, 1),
               "command": "python -m pytest " + " ".join(cmd[3:]),
               "spread_over_gpus": child.get(SPREAD_ENV) if args.spread else None}
    with staged_dir(args.out) as tmp:
        (tmp / "pytest.log").write_text(log)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (tmp / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    print(f"gpu tests: {summary['passed']} passed, {summary['failed']} failed, {summary['errors']} errors, "
          f"{summary['skipped']} skipped in {wall:.0f} s on {env['device_name']} at {env['git_sha'][:10]} "
          f"({env['source_check']}); record in {args.out}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
