"""A notebook with a warm launcher in an ``salloc`` session on the 3-node test cluster.

The driver (tests/notebook_driver.py) runs inside ``salloc -N3``, so its Jupyter kernel
inherits the allocation, as a notebook server started in an salloc session does; its checks
are those of tests/test_notebook.py. The cluster's nodes share this machine's PID namespace,
so the driver sees the workers it interrupted on every node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_notebook import DRIVER, REPO, check_notebook

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_notebook_in_an_salloc_session(run_in_allocation, tmp_path: Path) -> None:
    out = tmp_path / "notebook"
    kwargs = 'workers_per_host=2, backend="gloo", timeout=120'
    script = f"""
        import runpy, sys
        sys.argv = [{str(DRIVER)!r}, {str(out)!r}, {kwargs!r}]
        runpy.run_path({str(DRIVER)!r}, run_name="__main__")
    """
    run_in_allocation(["-N3"], script, timeout=600, env={"PYTHONPATH": str(REPO)})
    summary = json.loads((out / "summary.json").read_text())
    check_notebook(summary, workers=6)
    hosts = {line.split(":")[0] for line in summary["cells"][2]["stdout"].split("\r")[1:]}
    assert hosts == {"[node1"}, hosts  # rank 0 lives on the first node of the allocation
