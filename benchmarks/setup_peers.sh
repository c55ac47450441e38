#!/usr/bin/env bash
# Installs the peers that benchmarks/run.py and bench_warm.py compare slurmrun with, without
# touching the project's own environment: torchrunx 0.4 and Monarch (torchmonarch 0.7) need
# cloudpickle>=3, so each gets a venv of its own that sees the system site-packages (the same
# torch) and shadows only what it must.
#
#   bash benchmarks/setup_peers.sh          -> ~/.cache/slurmrun-bench/torchrunx-venv
#                                              ~/.cache/slurmrun-bench/monarch-venv
#
# torchrun ships with torch; the "floor" needs nothing. run.py and bench_warm.py find these
# venvs by themselves (or pass --torchrunx-python / --monarch-python, set TORCHRUNX_PYTHON /
# MONARCH_PYTHON).
set -euo pipefail
VENV=${TORCHRUNX_VENV:-$HOME/.cache/slurmrun-bench/torchrunx-venv}
MONARCH_VENV=${MONARCH_VENV:-$HOME/.cache/slurmrun-bench/monarch-venv}
PY=${PYTHON:-python3}
torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
"$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q "torchrunx==0.4.0"
torch_after=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
if [ "$torch_before" != "$torch_after" ]; then
  echo "setup_peers.sh: torchrunx pulled torch $torch_after (system has $torch_before)" >&2
  exit 1
fi
"$VENV/bin/python" -c 'import torchrunx; print("torchrunx", torchrunx.__version__, "in", __import__("sys").prefix)'

# Monarch's wheel asks for any cloudpickle, but 0.7.0 patches cloudpickle.cloudpickle's
# _function_getstate, which cloudpickle 2.1 (the system's) does not have.
"$PY" -m venv --system-site-packages "$MONARCH_VENV"
"$MONARCH_VENV/bin/python" -m pip install -q "torchmonarch==0.7.0" "cloudpickle>=3"
torch_after=$("$MONARCH_VENV/bin/python" -c 'import torch; print(torch.__version__)')
if [ "$torch_before" != "$torch_after" ]; then
  echo "setup_peers.sh: torchmonarch pulled torch $torch_after (system has $torch_before)" >&2
  exit 1
fi
"$MONARCH_VENV/bin/python" -c 'import monarch.actor, sys; print("torchmonarch 0.7.0 in", sys.prefix)'
