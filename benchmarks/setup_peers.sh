#!/usr/bin/env bash
# Installs the peers that benchmarks/run.py compares slurmrun with, without touching the
# project's own environment: torchrunx 0.4 needs cloudpickle>=3, so it gets a venv of its own
# that sees the system site-packages (the same torch) and shadows only cloudpickle.
#
#   bash benchmarks/setup_peers.sh          -> ~/.cache/slurmrun-bench/torchrunx-venv
#
# torchrun ships with torch; the "floor" needs nothing. run.py finds this venv by itself
# (or pass --torchrunx-python / set TORCHRUNX_PYTHON).
set -euo pipefail
VENV=${TORCHRUNX_VENV:-$HOME/.cache/slurmrun-bench/torchrunx-venv}
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
