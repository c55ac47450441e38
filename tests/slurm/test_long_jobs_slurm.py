"""Long jobs on the real cluster (issue 12, section 3): agents give up on a vanished launcher.

When the launcher's host vanishes (network cut, power-off: no FIN, no RST), nothing tells its
agents; without a bound of their own they would read forever, retransmit for about 15 minutes,
and keep their GPUs all that time. Agents must notice within ``heartbeat_timeout`` and stop
their workers.

The test makes the launcher's host vanish for one node: the launcher process is frozen
(SIGSTOP, so that it takes no action of its own, such as ending the srun step) and a firewall
rule in node2's network namespace drops every packet between node2 and the launcher's port, so
node2's agent sees neither data nor acknowledgements. The rule is scoped to that port, so other
jobs on the shared cluster are not disturbed, and always removed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CUT_NODE = "node2"
HEARTBEAT_TIMEOUT = 3.0
# Added to heartbeat_timeout: the agent's SIGTERM to its workers, their exit and the agent's
# own, on 2 cores shared by 3 nodes (and other sessions' tests).
SLACK = 10.0

LAUNCHER = r"""
import json, os, sys, time
import slurmrun

WORK = @WORK@


def work():
    rank = int(os.environ["RANK"])
    node = os.environ.get("SLURMD_NODENAME", "")
    with open(os.path.join(WORK, f"ready.{rank}"), "w") as f:
        f.write(node)
    # Ranks print steadily, so that the agents have data in flight when the traffic stops.
    while True:
        print("step", rank, flush=True)
        time.sleep(0.05)


with open(os.path.join(WORK, "launcher.pid"), "w") as f:
    f.write(str(os.getpid()))
try:
    slurmrun.launch(work, workers_per_host=2, timeout=60, heartbeat_timeout=@HBT@)
    outcome = {"error": None}
except BaseException as e:
    outcome = {"error": type(e).__name__, "message": str(e)}
print("RESULT " + json.dumps(outcome), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def ensure_nft() -> str:
    """The nft command; installs Debian's nftables package if it is missing."""
    nft = shutil.which("nft")
    if nft is None:
        subprocess.run(
            ["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", "-qq", "nftables"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            capture_output=True,
            timeout=600,
            check=False,
        )
        nft = shutil.which("nft")
    if nft is None:
        pytest.fail("nft is missing and `apt-get install nftables` did not provide it")
    return nft


def nft_in(cluster, node: str, nft: str, *args: str, stdin: str | None = None) -> None:
    ns = f"/run/netns/{cluster.netns_prefix}{node}"
    subprocess.run(
        ["nsenter", f"--net={ns}", nft, *args],
        input=stdin,
        text=True,
        capture_output=True,
        timeout=30,
        check=True,
    )


def agent_processes(node_processes, node: str) -> list[str]:
    """This session's agent, spawner and workers on `node` (slurmstepd is not counted)."""
    procs = node_processes(wait=0).get(node, [])
    titles = ("slurmrun agent (", "slurmrun spawner (", "slurmrun: ")  # slurmrun.node.proctitle
    return [f"{p.pid} {p.cmdline}" for p in procs if p.cmdline.startswith(titles)]


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_agents_stop_their_workers_when_the_launcher_vanishes(
    run_in_allocation, slurm_cluster, node_processes, tmp_path: Path
) -> None:
    if slurm_cluster.mode != "netns":
        pytest.skip("needs the nodes in network namespaces of their own")
    nft = ensure_nft()
    port = free_port()
    table = f"slurmrun_test_{os.getpid()}_{port}"
    script = LAUNCHER.replace("@WORK@", repr(str(tmp_path))).replace(
        "@HBT@", repr(HEARTBEAT_TIMEOUT)
    )
    rule = f"""
    table inet {table} {{
        chain out {{
            type filter hook output priority 0;
            ip daddr {slurm_cluster.launcher_addr} tcp dport {port} drop
        }}
        chain in {{
            type filter hook input priority 0;
            ip saddr {slurm_cluster.launcher_addr} tcp sport {port} drop
        }}
    }}
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            run_in_allocation,
            ["-N3"],
            script,
            240,
            check=False,
            # This checkout's slurmrun (agents get its path from the launcher's import).
            env={
                "SLURMRUN_LAUNCHER_PORT": str(port),
                "PYTHONPATH": str(REPO),
                "SLURMRUN_LOG_DIR": str(tmp_path / "logs"),
            },
        )
        deadline = time.monotonic() + 170  # the allocation may wait for busy nodes
        while len(list(tmp_path.glob("ready.*"))) < 6:
            assert not running.done(), running.result().stdout + running.result().stderr
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
        assert agent_processes(node_processes, CUT_NODE)
        launcher = int((tmp_path / "launcher.pid").read_text())
        left: list[str] = []
        os.kill(launcher, signal.SIGSTOP)
        try:
            nft_in(slurm_cluster, CUT_NODE, nft, "-f", "-", stdin=rule)
            cut = time.monotonic()
            while (left := agent_processes(node_processes, CUT_NODE)) and (
                time.monotonic() - cut < HEARTBEAT_TIMEOUT + SLACK
            ):
                time.sleep(0.1)
            gone_after = time.monotonic() - cut
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                nft_in(slurm_cluster, CUT_NODE, nft, "delete", "table", "inet", table)
            os.kill(launcher, signal.SIGCONT)
        cp = running.result()
    print(f"{CUT_NODE}'s agent and workers gone {gone_after:.2f} s after the cut")
    assert not left, f"still on {CUT_NODE} after {gone_after:.1f} s: {left}"
    agent_log = "\n".join(p.read_text() for p in (tmp_path / "logs").rglob(f"{CUT_NODE}*"))
    assert f"the launcher sent nothing for {HEARTBEAT_TIMEOUT:g} s" in agent_log, agent_log
    outcome = next(
        (json.loads(line[7:]) for line in cp.stdout.splitlines() if line.startswith("RESULT ")),
        None,
    )
    assert outcome is not None, cp.stdout + cp.stderr
    # Thawed, the launcher finds its agents silent or gone.
    assert outcome["error"] == "AgentFailedError", outcome
    assert node_processes() == {}
