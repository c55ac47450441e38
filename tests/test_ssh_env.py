"""ssh agents get their variables on stdin: no value of the launch is on any process's command
line, and the dry run shows names, with ``<set>`` for those that look secret. A fake ``ssh`` on
PATH runs the remote command here, reading its stdin like the real one."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import slurmrun

TOKEN = "hf_do_not_show_3c6a9d0e"
FAKE_SSH = f"""#!{sys.executable}
import os, sys
with open(os.environ["FAKE_SSH_ARGV"], "a") as f:  # ssh's own command line, as ps shows it
    f.write(" ".join(sys.argv) + "\\n")
args = sys.argv[1:]
i = 0
while args[i].startswith("-"):
    i += 2 if args[i] in ("-o", "-F") else 1
if "-G" in args[:i]:
    print("hostname 127.0.0.1")
    sys.exit(0)
os.execvp("sh", ["sh", "-c", " ".join(args[i + 1 :])])
"""


@pytest.fixture
def fake_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ssh = tmp_path / "bin" / "ssh"
    ssh.parent.mkdir()
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ssh.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_ARGV", str(tmp_path / "ssh_argv"))
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURMRUN_LAUNCHER_ADDR", "127.0.0.1")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("MY_SETTING", "visible-value")


def env_of_worker() -> tuple[str, str]:
    time.sleep(1.0)  # long enough for the command lines to be read meanwhile
    return os.environ["HF_TOKEN"], os.environ["MY_SETTING"]


OPTIONS = {"workers_per_host": 1, "backend": None, "extra_env_vars": ("HF_TOKEN", "MY_SETTING")}


def test_ssh_agents_get_their_variables_with_no_value_on_a_command_line(
    fake_ssh: None, tmp_path: Path
) -> None:
    lines: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            for proc in psutil.process_iter(["cmdline"]):
                lines.append(" ".join(proc.info["cmdline"] or []))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = slurmrun.launch(env_of_worker, hostnames=["fakehost"], **OPTIONS)
    finally:
        done.set()
        watcher.join(10)
    assert result.values() == [(TOKEN, "visible-value")]
    assert "slurmrun agent (fakehost)" in lines  # the agent ran (named by slurmrun.node.proctitle)
    # ssh itself lives a moment here (it execs the remote command): it wrote its command line
    lines += (tmp_path / "ssh_argv").read_text().splitlines()
    assert any("/ssh -T" in line for line in lines), "ssh was seen"
    leaks = [line for line in lines if TOKEN in line or "visible-value" in line]
    assert leaks == []


def test_an_ssh_dry_run_shows_set_for_secret_looking_names(fake_ssh: None) -> None:
    plan = slurmrun.Launcher(hostnames=["fakehost"], **OPTIONS).dry_run(env_of_worker)
    text = str(plan)
    assert TOKEN not in text and TOKEN not in plan.to_json()
    assert "HF_TOKEN='<set>'" in text or "HF_TOKEN=<set>" in text
    assert "MY_SETTING=visible-value" in text
    assert all(TOKEN not in arg for command in plan.commands for arg in command)


def test_agents_are_pointed_at_the_launchers_own_slurmrun() -> None:
    """ssh and srun agents import the slurmrun of the launcher (a checkout, not the installed)."""
    from slurmrun.launcher.agents.starters import package_pythonpath

    root = package_pythonpath({"PYTHONPATH": "/elsewhere"}).split(os.pathsep)[0]
    assert os.path.samefile(os.path.join(root, "slurmrun"), os.path.dirname(slurmrun.__file__))
