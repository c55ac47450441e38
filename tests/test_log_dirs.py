"""The log root: a folder per launch, ``latest`` naming the newest, ignored by git when new."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import slurmrun
from slurmrun import variables
from slurmrun.launcher.agents.srun_step import SrunAgents
from slurmrun.log_dirs import resolve_log_dir


def say(word: str) -> str:
    print(word, flush=True)
    return word


def test_latest_names_the_newest_launch_by_a_relative_link(tmp_path, monkeypatch):
    root = tmp_path / "logs"
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(root))
    slurmrun.launch(say, ("first",), workers_per_host=1, backend=None)
    (first,) = root.glob("20*")
    latest = root / "latest"
    assert latest.is_symlink() and latest.resolve() == first.resolve()
    assert "first" in (latest / "localhost.0.log").read_text()

    slurmrun.launch(say, ("second",), workers_per_host=1, backend=None)
    (second,) = set(root.glob("20*")) - {first}
    assert latest.resolve() == second.resolve()
    assert "second" in (latest / "localhost.0.log").read_text()
    assert os.readlink(latest) == second.name  # relative: the tree can move
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [".gitignore", "latest", first.name, second.name]
    )  # no temporary link left behind

    moved = tmp_path / "moved"
    shutil.move(root, moved)
    assert "second" in (moved / "latest" / "localhost.0.log").read_text()


def test_the_default_root_in_a_git_checkout_is_ignored_by_git(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURMRUN_LOG_DIR", raising=False)
    subprocess.run(["git", "init", "-q"], check=True)
    log_dir = resolve_log_dir()
    assert Path(log_dir.path).parent == tmp_path / "slurmrun_logs"
    (Path(log_dir.path) / "node1.0.log").write_text("a line\n")
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert status.stdout == ""
    assert (tmp_path / "slurmrun_logs" / ".gitignore").read_text().splitlines()[-1] == "*"


def test_a_root_that_already_existed_gets_no_gitignore(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))  # the user's own directory
    resolve_log_dir()
    assert not (tmp_path / ".gitignore").exists()
    assert (tmp_path / "latest").is_symlink()


def test_a_dry_run_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))
    resolve_log_dir(create=False)
    assert not (tmp_path / "logs").exists()


def test_latest_is_left_alone_where_it_is_not_a_link(tmp_path, monkeypatch):
    # A directory the user named `latest` is theirs: the launch goes on without the link.
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "mine.txt").write_text("kept")
    log_dir = resolve_log_dir()
    assert os.path.isdir(log_dir.path)
    assert (tmp_path / "latest" / "mine.txt").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_concurrent_launches_leave_one_whole_link(tmp_path, monkeypatch):
    launches = 3
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    code = "from slurmrun.log_dirs import resolve_log_dir\nfor _ in range(30): resolve_log_dir()"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(launches)]
    assert [p.wait() for p in procs] == [0] * launches
    assert (tmp_path / "latest").resolve().parent == tmp_path.resolve()
    assert (tmp_path / "latest").resolve().is_dir()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# An srun agent that cannot see the launcher's log directory (SLURM 24.11+ creates the missing
# folders of srun's --output on the node): the mark, and what the agent leaves behind.
_AGENT = """
import json, os, sys
from slurmrun.log_mark import unseen_mark
print(json.dumps(unseen_mark(os.environ)), file=sys.stderr)
"""


def _agent(tmp_path, mark):
    """Runs `unseen_mark` as an srun agent would: its stdout a file in the mark's folder."""
    folder = os.path.dirname(mark)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "node1.agent.log"), "w") as out:
        done = subprocess.run(
            [sys.executable, "-c", _AGENT],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, variables.LOG_DIR_MARK_VAR: mark},
            check=True,
        )
    return json.loads(done.stderr)


def test_an_agent_that_sees_the_mark_says_nothing_and_removes_nothing(tmp_path):
    mark = tmp_path / "logs" / "run" / ".slurmrun-mark-1"
    mark.parent.mkdir(parents=True)
    mark.touch()
    assert _agent(tmp_path, str(mark)) == ""
    assert sorted(p.name for p in mark.parent.iterdir()) == [".slurmrun-mark-1", "node1.agent.log"]


def test_an_agent_that_cannot_see_the_mark_names_it_and_leaves_nothing(tmp_path):
    mark = tmp_path / "logs" / "run" / ".slurmrun-mark-1"  # the folder is the node's alone
    assert _agent(tmp_path, str(mark)) == str(mark)
    assert list((tmp_path / "logs").iterdir()) == []


def test_an_agent_leaves_another_agents_file_and_its_folder(tmp_path):
    mark = tmp_path / "logs" / "run" / ".slurmrun-mark-1"
    mark.parent.mkdir(parents=True)
    (mark.parent / "node2.agent.log").write_text("node2's")
    assert _agent(tmp_path, str(mark)) == str(mark)
    assert [p.name for p in mark.parent.iterdir()] == ["node2.agent.log"]


def test_srun_agents_write_their_mark_while_they_run(tmp_path):
    mark = tmp_path / ".slurmrun-mark-1"
    seen = tmp_path / "seen"
    script = (
        f"import os; open({str(seen)!r}, 'w').write(os.environ[{variables.LOG_DIR_MARK_VAR!r}])"
    )
    agents = SrunAgents(
        command=[sys.executable, "-c", script],
        log_path=str(tmp_path / "srun.log"),
        node_logs={},
        hostnames=["node1"],
        mark=str(mark),
    )
    agents.start(dict(os.environ))
    assert mark.exists()
    agents.stop(10.0)
    assert seen.read_text() == str(mark)  # the agents got its name
    assert not mark.exists()
