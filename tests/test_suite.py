"""The suite's own rules: what `tests/run.sh --quick` runs of the cluster, and how it is split."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.slurm.conftest import CLUSTER_GROUP, VERSION_LEG_FILES

SLURM_TESTS = sorted((Path(__file__).parent / "slurm").glob("test_*.py"))


def _quick_tests(path: Path) -> list[str]:
    """The test functions of a file marked ``pytest.mark.quick``, or one of whose parameters is."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marks = {
                ast.unparse(n)
                for d in node.decorator_list
                for n in ast.walk(d)
                if isinstance(n, ast.Attribute)
            }
            if "pytest.mark.quick" in marks:
                found.append(node.name)
    return found


@pytest.mark.parametrize("path", SLURM_TESTS, ids=lambda p: p.name)
def test_every_cluster_test_file_has_one_quick_smoke_test(path: Path) -> None:
    # A new cluster feature gets its smoke test in the developer's loop (`run.sh --quick`).
    assert len(_quick_tests(path)) == 1, f"{path.name}: mark exactly one test @pytest.mark.quick"


def test_cluster_tests_are_one_xdist_group(request: pytest.FixtureRequest) -> None:
    """Every test of tests/slurm/ carries the cluster's xdist group (one worker runs them all)."""
    items = request.session.items
    slurm = [item for item in items if "tests/slurm/" in item.nodeid]
    if not slurm:
        pytest.skip("no cluster test collected in this session")
    groups = {m.args[0] for item in slurm for m in item.iter_markers("xdist_group")}
    assert groups == {CLUSTER_GROUP}
    assert all(item.get_closest_marker("xdist_group") for item in slurm)


def test_the_slurm_version_leg_names_existing_cluster_test_files() -> None:
    """`tests/run.sh` runs these files on sid's SLURM too: a renamed file must not drop out."""
    assert not VERSION_LEG_FILES - {path.name for path in SLURM_TESTS}
