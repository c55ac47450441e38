#!/usr/bin/env bash
# The GPU suite (issue 18) on a machine with NVIDIA GPUs and no network:
#
#   bash tests/gpu/run.sh WHEEL_DIR [pytest args...]
#
# WHEEL_DIR holds the wheels of tests/gpu/requirements.txt, downloaded beforehand on a machine
# with network (tests/gpu/README.md has the one command). The machine's own torch (a CUDA
# build) is used, never installed: the wheels (--no-index) and slurmrun from this tree go into a
# --target folder put first on PYTHONPATH; then it runs `pytest tests/gpu -m gpu` and prints a
# summary: GPUs, torch/CUDA/NCCL versions, pass/fail/skip counts, measurements.
#
# SLURMRUN_GPU_OUT: a folder that gets the pytest log, junit XML and summary (optional).
# Exit status: pytest's (2 when no CUDA GPU is visible, so nothing could run).
set -euo pipefail

say() { echo "tests/gpu/run.sh: $*" >&2; }

if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  say "usage: bash tests/gpu/run.sh WHEEL_DIR [pytest args...]  (see tests/gpu/README.md)"
  exit 2
fi
WHEELS="$(cd "$1" && pwd)"
shift
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  say "ERROR: $PYTHON cannot import torch; this script uses the machine's own CUDA build"
  exit 2
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/slurmrun-gpu.XXXXXX")"
# No venv: the machine's python3 may itself be a venv (torch in /opt/torch/.venv), and a venv
# made from it with --system-site-packages sees the base interpreter's packages, not torch.
# The wheels and slurmrun go into a --target folder put first on PYTHONPATH instead (agents
# and workers inherit it); the machine's own packages, torch among them, stay visible.
SITE="$WORK/site"
say "packages into $SITE (PYTHONPATH, before $PYTHON's own), wheels from $WHEELS"
pip_install() { "$PYTHON" -m pip install -q --no-index --no-compile --target "$SITE" "$@"; }
pip_install --find-links "$WHEELS" -r tests/gpu/requirements.txt
# No build isolation (it would fetch setuptools): the wheels' setuptools builds it.
PYTHONPATH="$SITE" pip_install --no-deps --no-build-isolation .
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
PY="$PYTHON"

export SLURMRUN_GPU_REPORT="$WORK/measurements.txt"
export SLURMRUN_LOG_DIR="$WORK/logs"
: >"$SLURMRUN_GPU_REPORT"

rc=0
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  # tests/gpu unless the arguments name test paths of their own (-k, -x... alone do not)
  paths=(tests/gpu)
  for arg in "$@"; do [[ "$arg" == tests/* ]] && paths=(); done
  # -p no:cacheprovider: the tree may be read-only; -rs lists why tests were skipped.
  set +e
  "$PY" -m pytest -m gpu -rs -p no:cacheprovider --junitxml="$WORK/junit.xml" "${paths[@]}" "$@" 2>&1 |
    tee "$WORK/pytest.log"
  rc=${PIPESTATUS[0]}
  set -e
else
  say "ERROR: torch sees no CUDA GPU here; nothing ran"
  rc=2
fi

{
echo
echo "================ slurmrun GPU suite: summary ================"
echo "date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)   host: $(hostname)"
echo "commit:  $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "GPUs:"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 |
  sed 's/^/  /' || echo "  (nvidia-smi failed)"
"$PY" - "$WORK/junit.xml" <<'PYEOF'
import os
import platform
import sys
import xml.etree.ElementTree as ET

import torch

nccl = "n/a"
if torch.cuda.is_available():
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:  # noqa: BLE001 - the summary reports whatever it can
        nccl = f"unknown ({exc})"
print(f"python:  {platform.python_version()}")
print(f"torch:   {torch.__version__}   CUDA {torch.version.cuda}   NCCL {nccl}")
print(f"visible: {torch.cuda.device_count()} GPU(s)")
path = sys.argv[1]
if os.path.exists(path):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    print(
        f"tests:   {passed} passed, {count['failures']} failed, {count['errors']} errors, "
        f"{count['skipped']} skipped (of {count['tests']})"
    )
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            for node in case.findall(tag):
                print(f"  {tag.upper()}: {case.get('classname')}.{case.get('name')}: "
                      f"{(node.get('message') or '')[:200]}")
else:
    print("tests:   none ran")
PYEOF
if [ -s "$SLURMRUN_GPU_REPORT" ]; then
  echo "measurements (printed, not asserted):"
  sed 's/^/  /' "$SLURMRUN_GPU_REPORT"
fi
echo "pytest exit status: $rc   (full output: $WORK/pytest.log, worker logs: $WORK/logs)"
} 2>&1 | tee "$WORK/summary.txt"
if [ -n "${SLURMRUN_GPU_OUT:-}" ]; then
  mkdir -p "$SLURMRUN_GPU_OUT"
  cp "$WORK/summary.txt" "$SLURMRUN_GPU_OUT/"
  for f in pytest.log junit.xml measurements.txt; do [ -e "$WORK/$f" ] && cp "$WORK/$f" "$SLURMRUN_GPU_OUT/"; done
  [ -d "$WORK/logs" ] && tar -czf "$SLURMRUN_GPU_OUT/worker-logs.tar.gz" -C "$WORK" logs
fi
exit "$rc"
