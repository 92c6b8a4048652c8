#!/usr/bin/env bash
# GPU check of the baseline install, from a bare venv, offline (under 3 minutes on one GPU):
#   1. a --system-site-packages venv in /tmp (the machine's torch, triton, transformers stay visible);
#   2. `python -m ssmspec.baselines install --from DIR` into it: no network, no CUDA compilation;
#   3. `python -m ssmspec.baselines check` must report mamba_ssm and fla importable, from that venv;
#   4. one kernel_parity point (mamba2-2.7b, batch 1) whose mamba_ssm row must be measured, not skipped.
# Usage, from the repository root:  bash tests/gpu_setup_check.sh [DIR]   (DIR defaults to .whl/)
# Fill DIR on a machine with network (.whl/ is git-ignored):
#   python -m ssmspec.baselines download .whl       # mamba-ssm sdist, fla-core and einops wheels
#   # only where the GPU machine lacks hydra (its runs need it), the project's pure-Python config stack:
#   pip download --no-deps --only-binary=:all: -d .whl hydra-core==1.3.2 omegaconf==2.3.0
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # published as an sdist only
# The project itself is used from src/ (PYTHONPATH), not installed: its other dependencies are not needed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$(cd "${1:-$root/.whl}" 2>/dev/null && pwd) \
  || { echo "gpu_setup_check: no folder ${1:-.whl}; fill it as this script's header says" >&2; exit 2; }
start=$SECONDS
work=$(mktemp -d /tmp/ssmspec-gpu-setup.XXXXXX)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH  # nothing carried elsewhere (a source tree of mamba_ssm, say) may stand in for the install
python3 -m venv --system-site-packages --without-pip "$work/venv"
py="$work/venv/bin/python"
# the machine's torch may live in another venv (not the system site): let the new venv see the site-packages
# of the python3 that runs this script, behind its own
python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
  > "$("$py" -c 'import site; print(site.getsitepackages()[0])')/_host_site.pth"
"$py" -m pip --version >/dev/null 2>&1 || "$py" -m ensurepip -q  # the system's pip serves the venv when present
export PYTHONPATH="$root/src"
cd "$work"  # not the repository root: src/ is on the path only through PYTHONPATH

echo "== install (from $dir, no index)"
"$py" -m ssmspec.baselines install --from "$dir"
echo "== check"
"$py" -m ssmspec.baselines check
"$py" - <<'PY'
import sys

import fla
import mamba_ssm

for mod in (mamba_ssm, fla):
    assert mod.__file__.startswith(sys.prefix), f"{mod.__name__} imported from {mod.__file__}, not the venv"
print(f"from the venv: {mamba_ssm.__file__}, {fla.__file__}")
PY

echo "== kernel_parity, one point"
"$py" -c "import hydra, omegaconf" 2>/dev/null \
  || "$py" -m pip install -q --no-index --find-links "$dir" hydra-core omegaconf
out="$work/kernel_parity"
"$py" -m ssmspec run experiment=kernel_parity profile=gpu "bench.presets=[mamba2-2.7b]" "bench.batch=[1]" \
  "bench.sweep_batch=[]" bench.warmup=2 bench.iters=10 "results_dir=$out"
"$py" -m ssmspec.summary "$out"  # exits 1 when a row was skipped for a missing baseline
"$py" - "$out/results.jsonl" <<'PY'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
ok = {r["impl"]: r["ms_p50"] for r in rows if r.get("status") == "ok"}
assert {"ours", "mamba_ssm"} <= ok.keys(), f"expected measured rows for ours and mamba_ssm, got {rows}"
print(f"kernel_parity mamba2-2.7b B=1: ours {ok['ours'] * 1e3:.1f} us, mamba_ssm {ok['mamba_ssm'] * 1e3:.1f} us")
PY
echo "gpu_setup_check: ok in $((SECONDS - start)) s"
