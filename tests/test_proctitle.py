"""Process names in ps and top (slurmrun.node.proctitle), read by real workers of real launches."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import slurmrun
from slurmrun.titles import what_runs

REPO = Path(__file__).resolve().parents[1]


def names_on_this_node():
    """What a worker reads about itself, its spawner and its agent (scripts run its source too)."""
    import os

    def of(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/comm") as f:
            return {"cmdline": cmdline.decode(errors="replace"), "comm": f.read().strip()}

    def parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    spawner = parent(os.getpid())
    threads = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            threads.append(f.read().strip())
    return {
        "rank": int(os.environ["RANK"]),
        "worker": of(os.getpid()),
        "threads": threads,
        "spawner": of(spawner),
        "agent": of(parent(spawner)),
        "ps": os.popen(f"ps -o args= -p {os.getpid()}").read().strip(),
    }


def assert_named(seen: dict, what: str) -> None:
    rank = seen["rank"]
    title = f"slurmrun: {what} rank {rank} (localhost:{rank})"
    assert seen["worker"] == {"cmdline": title + "\0", "comm": f"slurmrun-r{rank}"}
    assert seen["ps"] == title  # what `ps aux` and `ps -f` show
    # Threads take their name from their creator: the worker named itself before starting any.
    assert set(seen["threads"]) == {f"slurmrun-r{rank}"}
    assert seen["spawner"] == {
        "cmdline": "slurmrun spawner (localhost)\0",
        "comm": "slurmrun-spawn",
    }
    assert seen["agent"] == {"cmdline": "slurmrun agent (localhost)\0", "comm": "slurmrun-agent"}


def test_workers_spawner_and_agent_are_named_for_ps_and_top_in_launch_mode():
    result = slurmrun.launch(names_on_this_node, workers_per_host=2, backend=None)
    seen = result.values()
    assert [s["rank"] for s in seen] == [0, 1]
    for s in seen:
        assert_named(s, "names_on_this_node")


@pytest.mark.parametrize("module", [False, True])
def test_workers_of_the_slurmrun_command_are_named_for_their_script(tmp_path, module):
    """A script's base name (or ``-m module``) and never its arguments: any user can read them."""
    body = inspect.getsource(names_on_this_node) + textwrap.dedent("""
        import json, os
        with open(f"rank{os.environ['RANK']}.json", "w") as f:
            json.dump(names_on_this_node(), f)
    """)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train_step.py").write_text(body)
    target = ["-m", "pkg.train_step"] if module else [str(tmp_path / "pkg" / "train_step.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path)])
    env["SLURMRUN_LOG_DIR"] = str(tmp_path / "logs")
    cp = subprocess.run(
        [sys.executable, "-m", "slurmrun", "--workers-per-host=2", *target, "--token", "hunter2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert cp.returncode == 0, cp.stderr
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert_named(seen, "-m pkg.train_step" if module else "train_step.py")


def a_function():
    pass


class Callable:
    def __call__(self):
        pass


class NameRaises:
    @property
    def __module__(self):
        raise RuntimeError("no module for you")


def test_what_a_worker_runs_is_named_without_its_arguments():
    from functools import partial

    from slurmrun.cli.script import run_script

    assert what_runs(run_script, ("/home/me/train.py", ["--token", "x"]), {}) == "train.py"
    assert what_runs(run_script, ("pkg.mod", []), {"module": True}) == "-m pkg.mod"
    assert what_runs(partial(a_function, "secret"), (), {}) == "a_function"
    assert what_runs(Callable(), (), {}) == "Callable"
    assert what_runs(NameRaises(), (), {}) == ""
    assert (
        what_runs(lambda: 0, (), {})
        == f"{test_what_a_worker_runs_is_named_without_its_arguments.__name__}.<lambda>"
    )


def test_a_title_too_long_for_the_command_line_is_cut_in_the_name_not_the_ranks():
    """The title overwrites the original command line: its length is all there is."""
    code = textwrap.dedent("""
        import sys
        from slurmrun.node.proctitle import set_title, worker_title
        set_title(worker_title(12, "gpu-node-017", 3, "a_" * 200 + ".py"))
        print(open("/proc/self/cmdline", "rb").read().decode(), flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        shown = child.stdout.readline().rstrip("\n")
        area = len(f"{sys.executable} -c {code} ")  # each argument ends with a NUL
        assert shown.startswith("slurmrun: a_a_")
        assert shown.endswith("... rank 12 (gpu-node-017:3)\0")
        assert len(shown.encode()) == area
    finally:
        child.communicate(timeout=10)


def test_setting_a_title_costs_microseconds():
    """A worker sets its title twice; a warm run takes ~60 ms."""
    code = textwrap.dedent("""
        import time
        from slurmrun.node.proctitle import set_title, worker_title
        start = time.perf_counter()
        for _ in range(1000):
            set_title(worker_title(5, "node2", 1, "train.py"), "slurmrun-r5")
        print((time.perf_counter() - start) / 1000)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    each = float(out.stdout)
    assert each < 0.0005, f"{each * 1e6:.0f} µs per title"
