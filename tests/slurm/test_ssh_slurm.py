"""Hosts outside SLURM over ssh: a real sshd in each node's network namespace of the cluster.

The test setup generates its own host and client keys and runs one ``sshd -D`` per node (on
port 22 of the node's address, in its network and UTS namespaces, as slurm-cluster.sh runs
slurmd); ssh reaches them through a config file of the test (``ssh_config_file``). Nothing
of the machine's own ssh setup is used or changed. No SLURM job is involved: the launcher
runs outside any allocation, so ``hostnames=["node1", ...]`` starts agents over ssh.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

import slurmrun
from slurmrun import events
from slurmrun.errors import AgentFailedError

SSHD = "/usr/sbin/sshd"
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")),
    reason="openssh-server/openssh-client are not installed (slurm-cluster.sh installs them)",
)


@dataclass
class SshHosts:
    config: str  # the ssh config file (hosts node1..3, and "refusing")
    daemons: dict[str, subprocess.Popen[bytes]]  # node -> its sshd -D

    def connections(self, node: str) -> list[psutil.Process]:
        """The per-connection sshd processes of `node`'s daemon (not the agents they run)."""
        found = []
        try:
            for child in psutil.Process(self.daemons[node].pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    if child.name() in ("sshd", "sshd-session"):
                        found.append(child)
        except psutil.NoSuchProcess:
            pass
        return found


def _wait_listening(addr: str, ns: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        probe = subprocess.run(
            ["nsenter", f"--net=/run/netns/{ns}", "ss", "-Htln", f"src {addr}:22"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if probe.stdout.strip():
            return
        time.sleep(0.1)
    raise AssertionError(f"sshd did not listen on {addr}:22 in {ns}")


@pytest.fixture(scope="module")
def ssh_hosts(
    slurm_cluster: Any, tmp_path_factory: pytest.TempPathFactory, module_turn: None
) -> Iterator[SshHosts]:
    if slurm_cluster.mode != "netns":
        pytest.skip("needs the cluster's netns mode (an address of its own per node)")
    d = tmp_path_factory.mktemp("ssh")
    for key in ("host_key", "client_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
            check=True,
            timeout=30,
        )
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    lines = []
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for node, addr in zip(slurm_cluster.nodes, slurm_cluster.node_addrs, strict=True):
            config = d / f"sshd_{node}"
            config.write_text(
                f"ListenAddress {addr}:22\nHostKey {d / 'host_key'}\n"
                f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / node}.pid\n"
                "StrictModes no\nUsePAM no\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
                "PrintMotd no\nLogLevel ERROR\nMaxStartups 50\n"
            )
            ns = f"{slurm_cluster.netns_prefix}{node}"
            daemons[node] = subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{ns}",
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f'hostname {node} && exec {SSHD} -D -e -f "$0"',
                    str(config),
                ],
                stdout=open(d / f"sshd_{node}.log", "ab"),  # noqa: SIM115 - sshd keeps it
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            lines += [f"Host {node}", f"  HostName {addr}"]
        # A host whose address answers, but where nothing listens: the connection is refused.
        lines += ["Host refusing", f"  HostName {slurm_cluster.node_addrs[-1]}", "  Port 2222"]
        lines += [
            "Host *",
            "  User root",
            f"  IdentityFile {d / 'client_key'}",
            "  IdentitiesOnly yes",
            "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null",
            "  LogLevel ERROR",
        ]
        (d / "ssh_config").write_text("\n".join(lines) + "\n")
        deadline = time.monotonic() + 30
        for node, addr in zip(slurm_cluster.nodes, slurm_cluster.node_addrs, strict=True):
            _wait_listening(addr, f"{slurm_cluster.netns_prefix}{node}", deadline)
        yield SshHosts(str(d / "ssh_config"), daemons)
    finally:
        for proc in daemons.values():
            try:
                family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
            except psutil.NoSuchProcess:
                family = []
            for p in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.wait(timeout=10)


def _marked(mark: str) -> list[str]:
    """Processes (anywhere: the nodes share our PID namespace) whose environment has `mark`."""
    needle = f"SLURMRUN_TEST_SSH={mark}".encode()
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])}")
        except OSError:
            continue
    return found


def _none_left(mark: str, wait: float = 15.0) -> list[str]:
    deadline = time.monotonic() + wait
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def mark() -> Iterator[str]:
    """A variable that every agent, spawner and worker of the test carries; none may be left."""
    value = uuid.uuid4().hex
    yield value
    left = _none_left(value)
    for line in left:
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert left == [], f"processes left behind: {left}"


def where_am_i() -> tuple[str, int, str]:
    import socket

    import torch.distributed as dist

    t = __import__("torch").ones(1)
    dist.all_reduce(t)
    return socket.gethostname(), os.getpid(), f"{int(t.item())}"


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_a_launch_across_three_hosts_over_ssh(
    ssh_hosts: SshHosts, slurm_cluster: Any, mark: str
) -> None:
    kinds: list[str] = []
    result = slurmrun.launch(
        where_am_i,
        hostnames=list(slurm_cluster.nodes),
        workers_per_host=2,
        backend="gloo",
        timeout=120,
        extra_env_vars={"SLURMRUN_TEST_SSH": mark},
        ssh_config_file=ssh_hosts.config,
        on_event=lambda e: kinds.append(e.kind),
    )
    hosts = [h for h, _, _ in result.values()]
    assert hosts == [n for n in slurm_cluster.nodes for _ in range(2)]
    assert {s for _, _, s in result.values()} == {"6"}  # all_reduce over 6 workers on 3 hosts
    assert kinds.count("agent_connected") == 3 and kinds.count("workers_started") == 3


def test_hostnames_auto_takes_the_hosts_of_slurmrun_hostfile(
    ssh_hosts: SshHosts, slurm_cluster: Any, mark: str, tmp_path: Any, monkeypatch: Any
) -> None:
    first, _, last = slurm_cluster.nodes
    (tmp_path / "hosts").write_text(f"{first} slots=1\n{last} slots=2  # two here\n")
    monkeypatch.setenv("SLURMRUN_HOSTFILE", str(tmp_path / "hosts"))
    result = slurmrun.launch(
        where_am_i,
        backend="gloo",
        timeout=120,
        extra_env_vars={"SLURMRUN_TEST_SSH": mark},
        ssh_config_file=ssh_hosts.config,
    )
    assert [h for h, _, _ in result.values()] == [first, last, last]
    assert {s for _, _, s in result.values()} == {"3"}


def test_the_secret_is_on_no_command_line(
    ssh_hosts: SshHosts, slurm_cluster: Any, mark: str
) -> None:
    def command_lines() -> str:
        return "\n".join(
            " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
        )

    seen: list[str] = []
    result = slurmrun.launch(
        command_lines,
        hostnames=list(slurm_cluster.nodes[:2]),
        workers_per_host=1,
        backend=None,
        timeout=120,
        extra_env_vars={"SLURMRUN_TEST_SSH": mark},
        ssh_config_file=ssh_hosts.config,
        on_event=lambda e: seen.append(str(e)),
    )
    lines = result.rank(0)
    assert "import agent_main" in lines  # ssh's command line: the agents were being started
    assert "slurmrun agent (" in lines  # and running when it looked
    assert "SLURMRUN_SECRET=" not in lines and "SLURMRUN_SECRET_STDIN=1" in lines


def test_a_host_that_refuses_the_connection_is_named(
    ssh_hosts: SshHosts, slurm_cluster: Any, mark: str
) -> None:
    with pytest.raises(AgentFailedError, match="refusing") as info:
        slurmrun.launch(
            where_am_i,
            hostnames=[slurm_cluster.nodes[0], "refusing"],
            workers_per_host=1,
            backend="gloo",
            timeout=120,
            extra_env_vars={"SLURMRUN_TEST_SSH": mark},
            ssh_config_file=ssh_hosts.config,
        )
    assert info.value.hostname == "refusing"
    assert "Connection refused" in str(info.value)
    assert "code 255" in str(info.value)


def sleep_long() -> None:
    time.sleep(300)


def test_a_dropped_connection_fails_the_launch_and_ends_that_hosts_workers(
    ssh_hosts: SshHosts, slurm_cluster: Any, mark: str
) -> None:
    victim = slurm_cluster.nodes[1]
    pids: dict[str, tuple[int, ...]] = {}
    failed: list[events.AgentFailed] = []

    def on_event(event: events.Event) -> None:
        if isinstance(event, events.AgentFailed):
            failed.append(event)
        if isinstance(event, events.WorkersStarted):
            pids[event.host] = event.pids
            if len(pids) == len(slurm_cluster.nodes):
                for conn in ssh_hosts.connections(victim):  # the host's sshd goes down
                    conn.send_signal(signal.SIGKILL)

    with pytest.raises(AgentFailedError) as info:
        slurmrun.launch(
            sleep_long,
            hostnames=list(slurm_cluster.nodes),
            workers_per_host=2,
            backend=None,
            timeout=120,
            extra_env_vars={"SLURMRUN_TEST_SSH": mark},
            ssh_config_file=ssh_hosts.config,
            on_event=on_event,
        )
    assert info.value.hostname == victim
    assert len(pids[victim]) == 2
    assert [e.host for e in failed] == [victim]
    # the mark fixture checks that no agent, spawner or worker is left on any host


LAUNCHER = """
import json, sys
import slurmrun
from slurmrun import events

def sleep_long():
    import time
    time.sleep(300)

def on_event(event):
    if isinstance(event, events.WorkersStarted):
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps([event.host, event.pids]) + "\\n")

slurmrun.launch(
    sleep_long,
    hostnames=sys.argv[2].split(","),
    workers_per_host=2,
    backend=None,
    timeout=300,
    heartbeat_timeout=300,
    extra_env_vars={"SLURMRUN_TEST_SSH": sys.argv[3]},
    ssh_config_file=sys.argv[4],
    on_event=on_event,
)
"""


def test_an_agent_whose_ssh_connection_drops_stops_its_workers_by_itself(
    ssh_hosts: SshHosts, slurm_cluster: Any, mark: str, tmp_path: Any
) -> None:
    # The launcher is stopped (SIGSTOP) so that it cannot end anything, and its heartbeats'
    # timeout is far away: only the dropped ssh connection can end the victim's workers.
    (tmp_path / "launch.py").write_text(LAUNCHER)
    started = tmp_path / "started.jsonl"
    victim = slurm_cluster.nodes[1]
    launcher = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "launch.py"),
            str(started),
            ",".join(slurm_cluster.nodes),
            mark,
            ssh_hosts.config,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(_lines(started)) < len(slurm_cluster.nodes):
            assert launcher.poll() is None, launcher.communicate()[0]
            time.sleep(0.1)
        pids = dict(_lines(started))
        assert len(pids[victim]) == 2
        launcher.send_signal(signal.SIGSTOP)
        for conn in ssh_hosts.connections(victim):
            conn.send_signal(signal.SIGKILL)
        wait_until = time.monotonic() + 60
        while any(map(_alive, pids[victim])) and time.monotonic() < wait_until:
            time.sleep(0.1)
        gone = not any(map(_alive, pids[victim]))
        others = [p for n, ps in pids.items() if n != victim for p in ps]
        assert gone, "the victim's workers outlived its ssh connection"
        assert all(map(_alive, others))  # only that host's agent ended
    finally:
        launcher.send_signal(signal.SIGCONT)
    out = launcher.communicate(timeout=120)[0].decode()
    assert launcher.returncode != 0 and "AgentFailedError" in out
    assert f"the agent on {victim} failed" in out


def _lines(path: Any) -> list[tuple[str, list[int]]]:
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]  # type: ignore[misc]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
