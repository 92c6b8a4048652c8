"""Run the GPU test suite and keep its record: what passed, on which device, at which code.

    python -m ssmspec.gputests [--out results/gpu-tests] [-- extra pytest args]

Runs ``pytest -m gpu tests`` (every test marked ``gpu``: the kernels at real sizes, captured decode steps,
the strategies' lossless checks on the GPU kernels) in a subprocess and writes, into ``--out`` (default
``results/gpu-tests``), through a staged folder so a failed or interrupted write leaves the old record:

- ``pytest.log``: the whole output (``-rfEs``: every failure, error and skip with its reason);
- ``summary.json``: passed / failed / errors / skipped / deselected counts, wall time, the command;
- ``env.json``: the device, driver, torch, triton and the provenance of ``ssmspec/provenance.py`` (source
  hash, the commit it equals), as every experiment's env.json.

The exit status is pytest's. The README quotes the counts of the committed record; the record is rewritten
by rerunning this, never by hand.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from ssmspec.paths import RESULTS_DIR, ROOT

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(prog="python -m ssmspec.gputests", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu-tests", help="folder of the record")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    import torch

    from ssmspec.bench.env import collect_env
    from ssmspec.runner import staged_dir

    if not torch.cuda.is_available():
        print("error: the GPU tests need a CUDA device; run this on a GPU machine", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider", "tests", *extra]
    env = collect_env(device="cuda", weights="random")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    sys.stdout.write(log[-4000:])
    summary = {**parse_counts(log), "exit_status": proc.returncode, "wall_s": round(wall, 1),
               "command": "python -m pytest " + " ".join(cmd[3:])}
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
