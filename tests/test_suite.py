"""The suite's own rules: what `tests/run.sh --quick` runs of the cluster, and how it is split
(the cluster's xdist groups, and their turns on the cluster: tests/slurm/cluster_turn.py)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.slurm.cluster_turn import (
    ClusterTurns,
    ClusterTurnTimeout,
    ClusterTurnUpgrade,
    held_mode,
)
from tests.slurm.conftest import (
    CLUSTER_GROUP,
    CLUSTER_GROUPS,
    DEFAULT_SECONDS,
    FILE_SECONDS,
    GPU_FILES,
    VERSION_LEG_FILES,
    cluster_groups,
)

REPO = Path(__file__).resolve().parents[1]

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


def test_cluster_tests_are_dealt_to_the_cluster_groups_a_file_to_one(
    request: pytest.FixtureRequest,
) -> None:
    """Every test of tests/slurm/ carries one of the cluster's xdist groups, its file's."""
    items = request.session.items
    slurm = [item for item in items if "tests/slurm/" in item.nodeid]
    if not slurm:
        pytest.skip("no cluster test collected in this session")
    group_of: dict[str, str] = {}
    for item in slurm:
        groups = [m.args[0] for m in item.iter_markers("xdist_group")]
        assert len(groups) == 1, (item.nodeid, groups)
        assert group_of.setdefault(item.path.name, groups[0]) == groups[0], item.nodeid
    assert set(group_of.values()) <= {f"{CLUSTER_GROUP}-{i}" for i in range(1, CLUSTER_GROUPS + 1)}


def test_the_cluster_groups_are_dealt_longest_file_first_to_the_least_loaded() -> None:
    files = {path.name for path in SLURM_TESTS}
    group_of = cluster_groups(files)
    assert set(group_of) == files
    assert cluster_groups(set(sorted(files, reverse=True))) == group_of  # the same on every worker
    load: dict[str, float] = {}
    for name, group in group_of.items():
        load[group] = load.get(group, 0.0) + FILE_SECONDS.get(name, DEFAULT_SECONDS)
    assert len(load) == min(CLUSTER_GROUPS, len(files))
    # Greedy dealing: no group ends more than its last (smallest) file above another.
    largest = max(FILE_SECONDS.get(name, DEFAULT_SECONDS) for name in files)
    assert max(load.values()) - min(load.values()) <= largest


def test_the_files_whose_jobs_ask_for_gpus_share_the_first_group() -> None:
    asks = re.compile(r"--gpus|--gres[= ]gpu|gpus_per_node ?=|gpus_per_task ?=")
    gpu_files = {path.name for path in SLURM_TESTS if asks.search(path.read_text())}
    assert gpu_files == GPU_FILES, "update GPU_FILES in tests/slurm/conftest.py"
    group_of = cluster_groups({path.name for path in SLURM_TESTS})
    assert {group_of[name] for name in GPU_FILES} == {f"{CLUSTER_GROUP}-1"}


# A process that takes a turn on the cluster and logs when it got it and when it gave it back
TURN = """
import sys, time
from pathlib import Path
from tests.slurm.cluster_turn import ClusterTurns
folder, mode, name, go = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
with ClusterTurns(folder, wait=30).hold(mode, name):
    with open(folder / "log", "a") as log:
        log.write(f"{name} in\\n")
    while not go.exists():
        time.sleep(0.02)
    with open(folder / "log", "a") as log:
        log.write(f"{name} out\\n")
"""


def _turn(folder: Path, mode: str, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", TURN, str(folder), mode, name, str(folder / f"{name}.go")],
        cwd=REPO,
    )


def _log(folder: Path) -> list[str]:
    return (folder / "log").read_text().splitlines() if (folder / "log").exists() else []


def _holds_the_gate(folder: Path, pid: int) -> bool:
    """Whether process `pid` holds the flock of the turns' gate (/proc/locks)."""
    inode = (folder / "cluster-turn.gate").stat().st_ino
    locks = [line.split() for line in Path("/proc/locks").read_text().splitlines()]
    # "1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> 0 EOF"
    return any(
        lock[1] == "FLOCK" and lock[4] == str(pid) and lock[5].endswith(f":{inode}")
        for lock in locks
        if len(lock) > 5
    )


def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_an_exclusive_turn_waits_for_the_shared_ones_and_keeps_new_ones_out(
    tmp_path: Path,
) -> None:
    procs = []
    try:
        procs += [_turn(tmp_path, "shared", "a1"), _turn(tmp_path, "shared", "a2")]
        _until(lambda: len(_log(tmp_path)) == 2, "two shared turns at once")
        procs.append(_turn(tmp_path, "exclusive", "b"))
        _until(lambda: _holds_the_gate(tmp_path, procs[2].pid), "b waiting at the gate")
        procs.append(_turn(tmp_path, "shared", "c"))
        time.sleep(1.0)  # c tries for its turn meanwhile
        assert sorted(_log(tmp_path)) == ["a1 in", "a2 in"]  # neither b nor c came in
        (tmp_path / "a1.go").touch()
        time.sleep(0.5)
        assert "b in" not in _log(tmp_path)  # a2 still holds its shared turn
        (tmp_path / "a2.go").touch()
        _until(lambda: "b in" in _log(tmp_path), "the exclusive turn after the shared ones")
        time.sleep(0.5)
        assert "c in" not in _log(tmp_path)  # c, come while b waited, waits for b's end
        (tmp_path / "b.go").touch()
        (tmp_path / "c.go").touch()
        _until(lambda: "c out" in _log(tmp_path), "the shared turn after the exclusive one")
        log = _log(tmp_path)
        assert log.index("b out") < log.index("c in")
        assert [p.wait(10) for p in procs] == [0, 0, 0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_a_turn_that_waits_too_long_names_the_holder_and_one_inside_a_shared_turn_refuses(
    tmp_path: Path,
) -> None:
    holder = _turn(tmp_path, "exclusive", "holder")
    try:
        _until(lambda: _log(tmp_path) == ["holder in"], "the holder's turn")
        with (
            pytest.raises(ClusterTurnTimeout, match=r"t1 waited 0.5 s .* \['exclusive holder'\]"),
            ClusterTurns(tmp_path, wait=0.5).hold("shared", "t1"),
        ):
            pass
        (tmp_path / "holder.go").touch()
        assert holder.wait(10) == 0
    finally:
        holder.kill()
        holder.wait(10)
    turns = ClusterTurns(tmp_path, wait=5)
    with turns.hold("shared", "module"), turns.hold("shared", "its test"):
        assert held_mode() == "shared"
        with pytest.raises(ClusterTurnUpgrade), turns.hold("exclusive", "a test of the module"):
            pass
    assert held_mode() is None


def test_the_slurm_version_leg_names_existing_cluster_test_files() -> None:
    """`tests/run.sh` runs these files on sid's SLURM too: a renamed file must not drop out."""
    assert not VERSION_LEG_FILES - {path.name for path in SLURM_TESTS}
