"""Agents under a prefix command and with the site's srun options, without a cluster.

The container runtime itself runs on the SLURM test cluster (tests/slurm/test_containers_slurm.py);
here: the options' checks (before anything starts), the command they make, a real launch
under a prefix on localhost, the command line's quoting, and what is said for the usual
mistakes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import slurmrun
from slurmrun.cli.command import parse_launcher, split_command
from slurmrun.launcher.agents.containers import (
    agent_command_of,
    driver_container,
    no_srun_message,
    start_hint,
)
from slurmrun.versions import (
    mismatch,
    missing_dependency,
    protocol_fingerprint,
    slurmrun_version,
)


@pytest.mark.parametrize(
    ("arg", "own"),
    [
        ("--nodes=2", "--nodes"),
        ("-N2", "--nodes"),
        ("--nodel=node1", "--nodelist"),  # srun takes a long option's unambiguous start
        ("--gres=gpu:1", "--gres"),
        ("--output=x.log", "--output"),
        ("--export=ALL", "--export"),
        ("-c", "--cpus-per-task"),
        ("--pty", "--pty"),
    ],
)
def test_an_srun_option_slurmrun_sets_is_refused_before_anything_starts(arg, own):
    own_option = f"conflicts with slurmrun's own {own}"
    with pytest.raises(slurmrun.OptionsValueError, match=own_option) as info:
        slurmrun.Launcher(srun_args=(arg,), workers_per_host=1).dry_run(print)
    assert repr(arg) in str(info.value)


@pytest.mark.parametrize("arg", ["none", "--cpu-bind none"])
def test_an_srun_option_must_be_one_word(arg):
    with pytest.raises(slurmrun.OptionsValueError, match=r"one word|its own item"):
        slurmrun.Launcher(srun_args=("--cpu-bind", arg)).dry_run(print)


def test_a_string_where_words_are_wanted_says_how_to_write_them():
    with pytest.raises(slurmrun.OptionsTypeError, match=r"agent_prefix=\('ch-run'"):
        slurmrun.Launcher(agent_prefix="ch-run /img --").dry_run(print)  # type: ignore[arg-type]


def test_options_srun_knows_and_slurmrun_does_not_set_are_taken():
    cfg = slurmrun.Launcher(srun_args=("--cpu-bind=none", "--mpi=pmix", "--reservation=r", "-l"))
    assert agent_command_of(cfg).srun_args == cfg.srun_args


def test_the_agent_command_puts_the_interpreter_after_the_prefix_or_at_python():
    plain = agent_command_of(slurmrun.Launcher())
    assert plain.agent() == [sys.executable, "-m", "slurmrun.node.agent_main"]
    assert not plain.contained
    ch = agent_command_of(slurmrun.Launcher(agent_prefix=("ch-run", "/img", "--")))
    assert ch.agent() == ["ch-run", "/img", "--", "python3", "-m", "slurmrun.node.agent_main"]
    placed = agent_command_of(
        slurmrun.Launcher(
            agent_prefix=("podman-hpc", "run", "img", "{python}", "-X", "faulthandler"),
            agent_python="/opt/venv/bin/python",
        )
    )
    assert placed.agent() == [
        "podman-hpc", "run", "img", "/opt/venv/bin/python", "-X", "faulthandler",
        "-m", "slurmrun.node.agent_main",
    ]  # fmt: skip
    # pyxis: the srun option alone puts the agent in the image, whose python is not ours
    pyxis = agent_command_of(slurmrun.Launcher(srun_args=("--container-image=nvcr#torch",)))
    assert pyxis.contained and pyxis.agent()[0] == "python3"


def test_a_launch_runs_its_agents_and_workers_under_the_prefix(tmp_path: Path):
    # `env` stands in for a runtime here: it runs the agent with one variable more, which
    # its workers inherit; the container runtimes themselves run on the cluster.
    result = slurmrun.launch(
        lambda: (os.environ.get("UNDER_PREFIX"), os.getppid() != os.getpid()),
        workers_per_host=2,
        backend=None,
        agent_prefix=("env", "UNDER_PREFIX=yes", "{python}"),
        agent_python=sys.executable,
    )
    assert result.values() == [("yes", True), ("yes", True)]


def test_the_command_line_takes_srun_args_and_the_prefix_as_one_quoted_string(tmp_path: Path):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    cmd = split_command(
        ["--srun-args", "--cpu-bind=none --mpi=pmix", "--agent-prefix=ch-run '/my img' --",
         "--workers-per-host", "1", str(script), "--srun-args", "x"]
    )  # fmt: skip
    assert cmd.target == str(script) and cmd.script_args == ["--srun-args", "x"]
    launcher = parse_launcher(cmd.launcher_args, words=cmd.words)
    assert launcher.srun_args == ("--cpu-bind=none", "--mpi=pmix")
    assert launcher.agent_prefix == ("ch-run", "/my img", "--")
    assert launcher.workers_per_host == 1
    out = subprocess.run(
        [sys.executable, "-m", "slurmrun", "--dry-run", "--agent-prefix",
         "ch-run /img --", "--workers-per-host", "1", str(script)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "ch-run /img" in out and "-- python3 -m slurmrun.node.agent_main" in out


def test_an_agent_that_runs_another_slurmrun_is_refused_with_both_versions():
    same = {"hostname": "node2", "version": slurmrun_version(), "protocol": protocol_fingerprint()}
    assert mismatch(same) is None
    older = {**same, "version": "0.0.1", "python": "/opt/venv/bin/python", "where": "/opt/x"}
    said = mismatch(older)
    assert said is not None
    assert "node2 runs slurmrun version 0.0.1 (/opt/venv/bin/python, from /opt/x)" in said
    assert f"this launcher runs slurmrun {slurmrun_version()}" in said
    assert "another protocol" in str(mismatch({**same, "protocol": "0123456789ab"}))
    assert mismatch({"hostname": "node2"}) is not None  # a release from before the handshake


def test_the_usual_start_failures_get_what_to_do():
    missing = start_hint("/usr/bin/python3: Error ... No module named 'slurmrun'", "node1")
    assert missing is not None and "not importable" in missing and "on node1" in missing
    assert slurmrun_version() in missing and "pip install" in missing
    runtime = start_hint("slurmstepd: error: execve(): ch-run: No such file or directory", "n2")
    assert runtime is not None and "'ch-run' was not found on n2" in runtime
    dropped = start_hint("slurmrun.node.agent: SLURMRUN_SECRET is not set; agents...", "n3")
    assert dropped is not None and "podman needs --env-host" in dropped
    assert start_hint("Traceback: KeyError", "n1") is None


def test_an_agent_python_without_slurmruns_dependencies_is_told_what_to_install(tmp_path: Path):
    """Issue 45 (6b): the interpreter, what it lacks and how to install it; no traceback."""
    # A Python without cloudpickle and the rest (slurmrun itself comes from PYTHONPATH).
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
        check=True,
        timeout=120,
    )
    python = str(tmp_path / "bare" / "bin" / "python")
    with pytest.raises(slurmrun.AgentFailedError) as info:
        slurmrun.launch(lambda: 1, workers_per_host=1, backend=None, agent_python=python)
    said = str(info.value)
    assert "Traceback" not in said, said
    assert f"{python} (Python {sys.version.split()[0]}) cannot import 'cloudpickle'" in said
    assert f"`{python} -m pip install " in said
    assert "or set agent_python (--agent-python) to an interpreter that has them" in said
    assert len(said.splitlines()) <= 4, said
    hint = start_hint(f"slurmrun.node.agent: {missing_dependency('yaml')}", "n1")
    assert hint is not None and "the agents' Python on n1 lacks a package slurmrun needs" in hint


def test_a_driver_in_a_container_without_srun_is_told_to_run_outside(tmp_path: Path):
    assert driver_container({}, root=str(tmp_path)) is None
    assert driver_container({"APPTAINER_CONTAINER": "/img.sif"}, str(tmp_path)) == "Apptainer"
    assert driver_container({"CH_RUNNING": "Weird Al Yankovic"}, str(tmp_path)) == "Charliecloud"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".containerenv").write_text("")
    assert driver_container({}, root=str(tmp_path)) == "podman"
    said = no_srun_message({"CH_RUNNING": "Weird Al Yankovic"}, str(tmp_path / "none"))
    assert "inside a container (Charliecloud)" in said and "Run the launcher outside" in said
    assert "container" not in no_srun_message({}, str(tmp_path / "none")).split(":", 1)[1]


def test_slurmrun_info_shows_the_agents_command_with_the_prefix(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    out = subprocess.run(
        [sys.executable, "-m", "slurmrun", "info", "--json", "--agent-prefix",
         "apptainer exec --nv img.sif"],
        capture_output=True, text=True, timeout=60, check=True, env=env, cwd=tmp_path,
    ).stdout  # fmt: skip
    info = json.loads(out)
    assert info["launch"]["commands"][0][-7:] == [
        "apptainer", "exec", "--nv", "img.sif", "python3", "-m", "slurmrun.node.agent_main"
    ]  # fmt: skip
    assert info["options"] == {"agent_prefix": "apptainer exec --nv img.sif"}


def test_the_version_an_agent_reports_is_the_one_importlib_metadata_finds(tmp_path: Path):
    from importlib.metadata import version

    assert slurmrun_version() == version("slurmrun")
    other = tmp_path / "slurmrun-9.9.9.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: slurmrun\nVersion: 9.9.9\n")
    code = "import slurmrun.versions as v; print(v.slurmrun_version())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path,
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == "9.9.9"  # the first on sys.path, as importlib.metadata takes it
