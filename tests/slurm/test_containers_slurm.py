"""Agents and workers inside a real container runtime, the launcher outside, on the test cluster.

The runtime is Charliecloud's ``ch-run`` (Debian's charliecloud-runtime); the image is a
directory that tests/containers/build-image.sh builds on this machine from Debian's packages
and pip (python3, torch, this checkout's slurmrun in /opt/venv; cached between runs), marked
with ``VARIANT_ID=slurmrun-test-image`` in its /etc/os-release. The launcher runs in this
machine's Python, which is not the image's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.conftest import REPO

BUILD = REPO / "tests" / "containers" / "build-image.sh"
MARKER = "VARIANT_ID=slurmrun-test-image"
VENV_PYTHON = "/opt/venv/bin/python"
# ch-run needs USER; a login shell has it, a CI runner may not.
ENV = {"USER": os.environ.get("USER") or "root"}


@pytest.fixture(scope="module")
def image() -> str:
    """The image directory (built, or taken from the cache, with this checkout's slurmrun)."""
    cp = subprocess.run(
        ["bash", str(BUILD)], capture_output=True, text=True, timeout=1200, check=False
    )
    assert cp.returncode == 0, f"building the image failed:\n{cp.stderr[-3000:]}"
    return cp.stdout.strip().splitlines()[-1]


def _where() -> str:
    return f"""
import os, sys, slurmrun

def where():
    import wave  # a module the agent never imported: found on the image's own sys.path
    import torch.distributed as dist
    release = open("/etc/os-release").read()
    return (os.environ["SLURMD_NODENAME"], sys.executable, {MARKER!r} in release,
            dist.get_world_size(), slurmrun.__file__)
"""


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_a_function_and_a_script_run_inside_the_image_on_two_nodes(
    image: str, run_in_allocation: Any, node_processes: Any, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, wave\n"
        f"marked = {MARKER!r} in open('/etc/os-release').read()\n"
        "line = f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} {sys.executable}\"\n"
        "line += ' marked' if marked else ' NOT MARKED'\n"
        f"open(f\"{tmp_path}/rank{{os.environ['RANK']}}\", 'w').write(line)\n"
    )
    cp = run_in_allocation(
        ["-N2"],
        _where()
        + f"""
import subprocess
result = slurmrun.launch(where, backend="gloo", timeout=120,
                         agent_prefix=("ch-run", {image!r}, "--"), agent_python={VENV_PYTHON!r})
print("FUNCTION", result.values())
cp = subprocess.run(["slurmrun", "--agent-prefix", "ch-run {image} --", "--agent-python",
                     {VENV_PYTHON!r}, {str(script)!r}], capture_output=True, text=True,
                    timeout=120)
print("SCRIPT", cp.returncode, cp.stdout, cp.stderr)
print("LAUNCHER", sys.executable)
""",
        timeout=240,
        env=ENV,
    )
    values = eval(cp.stdout.split("FUNCTION ", 1)[1].splitlines()[0])
    assert [v[0] for v in values] == ["node1", "node2"]
    for node, python, marked, world, module in values:
        assert (python, marked, world) == (VENV_PYTHON, True, 2), node
        assert module.startswith("/opt/venv/lib/"), module  # the image's slurmrun
    launcher_python = cp.stdout.split("LAUNCHER ", 1)[1].strip()
    assert launcher_python != VENV_PYTHON  # the launcher ran outside the image
    script_out = cp.stdout.split("SCRIPT ", 1)[1]
    assert script_out.startswith("0 "), script_out
    for rank in (0, 1):
        said = (tmp_path / f"rank{rank}").read_text()
        assert said == f"rank {rank} of 2 {VENV_PYTHON} marked", script_out
    assert node_processes() == {}


def test_the_secret_is_on_no_command_line_of_any_node_with_a_container(
    image: str, run_in_allocation: Any
) -> None:
    # Every node shares this machine's process table: a worker inside the image reads every
    # process's command line; the launcher's side takes the secret from its srun's environment
    # (where SLURM's --export reads it), while the run is on.
    cp = run_in_allocation(
        ["-N2"],
        f"""
import os, psutil, slurmrun

def look():
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):  # no psutil in the image
        try:
            lines.append(open(f"/proc/{{pid}}/cmdline", "rb").read().replace(b"\\0", b" "))
        except OSError:
            pass
    return [line.decode(errors="replace") for line in lines]

secrets = set()

def grab(event):
    for p in psutil.Process().children(recursive=True):
        if p.name() == "srun":
            secrets.add(p.environ().get("SLURMRUN_SECRET"))

result = slurmrun.launch(look, workers_per_host=1, backend=None, timeout=120, on_event=grab,
                         agent_prefix=("ch-run", {image!r}, "--"), agent_python={VENV_PYTHON!r})
(secret,) = secrets - {{None}}
print("SECRET", len(secret))
for rank, lines in enumerate(result.values()):
    print("RUNTIMES", rank, sum("ch-run" in line for line in lines))
    print("WITH SECRET", rank, [line for line in lines if secret in line])
""",
        timeout=180,
        env=ENV,
    )
    out = cp.stdout
    assert int(out.split("SECRET ", 1)[1].split()[0]) >= 32, out  # found, where srun keeps it
    for rank in (0, 1):
        assert f"WITH SECRET {rank} []" in out, out
        # the command lines looked at include the runtime's on both nodes
        assert int(out.split(f"RUNTIMES {rank} ", 1)[1].split()[0]) >= 2, out


def test_srun_args_reach_the_agents_step_and_a_conflicting_one_is_refused(
    image: str, run_in_allocation: Any
) -> None:
    cp = run_in_allocation(
        ["-N2"],
        """
import os, slurmrun
values = slurmrun.launch(lambda: os.environ.get("SLURM_CPU_BIND_TYPE"), workers_per_host=1,
                         backend=None, timeout=120,
                         srun_args=("--cpu-bind=none", "--distribution=cyclic")).values()
print("BIND", values)
try:
    slurmrun.launch(print, srun_args=("--ntasks=4",))
except ValueError as e:
    print("REFUSED", e)
""",
        timeout=120,
    )
    assert "BIND ['none', 'none']" in cp.stdout, cp.stdout + cp.stderr
    assert "REFUSED srun_args item '--ntasks=4' conflicts with slurmrun's own --ntasks" in cp.stdout


@pytest.mark.parametrize(
    ("how", "said"),
    [
        # the image's own python3 has no slurmrun (it is in /opt/venv)
        (
            "agent_prefix=('ch-run', IMAGE, '--'), agent_python='/usr/bin/python3'",
            "slurmrun is not importable by the agents' Python",
        ),
        ("agent_prefix=('ch-run-missing', IMAGE, '--')", "'ch-run-missing' was not found on"),
    ],
)
def test_an_agent_that_cannot_start_in_the_container_is_named_with_the_fix(
    image: str, run_in_allocation: Any, how: str, said: str
) -> None:
    cp = run_in_allocation(
        ["-N2"],
        f"""
import slurmrun
IMAGE = {image!r}
try:
    slurmrun.launch(print, backend=None, timeout=60, {how})
except slurmrun.AgentFailedError as e:
    print("FAILED", e.hostname, "|", e)
""",
        timeout=120,
        env=ENV,
    )
    assert "FAILED node" in cp.stdout, cp.stdout + cp.stderr
    message = cp.stdout.split("|", 1)[1]
    assert said in message
    host = cp.stdout.split("FAILED ", 1)[1].split()[0]
    assert f"on {host}" in message  # the node, in the hint
    assert "Last lines of" in message  # and the node's own words


def test_another_slurmrun_inside_the_image_is_refused_at_the_handshake(
    image: str, run_in_allocation: Any, tmp_path: Path
) -> None:
    # Another release, installed where the image's Python finds it first (the agents' PYTHONPATH
    # passes into the container; the launcher's own has none): this checkout's package under a
    # distribution of version 9.9.9.
    other = tmp_path / "other"
    shutil.copytree(
        REPO / "slurmrun", other / "slurmrun", ignore=shutil.ignore_patterns("__pycache__")
    )
    info = other / "slurmrun-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slurmrun\nVersion: 9.9.9\n")
    cp = run_in_allocation(
        ["-N2"],
        f"""
import slurmrun
try:
    slurmrun.launch(print, backend=None, timeout=60, agent_prefix=("ch-run", {image!r}, "--"),
                    agent_python={VENV_PYTHON!r}, max_restarts=2,
                    extra_env_vars={{"PYTHONPATH": {str(other)!r}}})
except slurmrun.VersionMismatchError as e:
    print("REFUSED", e)
""",
        timeout=120,
        env=ENV,
    )
    assert "REFUSED the agent on node" in cp.stdout, cp.stdout + cp.stderr
    assert "runs slurmrun version 9.9.9" in cp.stdout
    assert f"from {other}/slurmrun" in cp.stdout
    assert "restarting" not in cp.stderr  # refused once, not retried


def test_slurmrun_info_inside_the_image_says_to_run_the_driver_outside(
    image: str, run_in_allocation: Any
) -> None:
    cp = run_in_allocation(
        ["-N1"],
        f"""
import subprocess
cp = subprocess.run(["ch-run", {image!r}, "--", "/opt/venv/bin/slurmrun", "info"],
                    capture_output=True, text=True, timeout=60)
print(cp.returncode, cp.stdout, cp.stderr)
""",
        timeout=120,
        env=ENV,
    )
    assert cp.stdout.startswith("0 "), cp.stdout + cp.stderr
    assert "inside a container (Charliecloud)" in cp.stdout
    assert "srun was not found on PATH" in cp.stdout
    assert "Run the launcher outside the container" in cp.stdout
