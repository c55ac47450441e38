"""Chaos for reservations: launchers on the login side killed, cut off or interrupted.

Twenty rounds, each a client process (the login side: no SLURM_* variables) that meets one
fault at a seeded random moment of one phase of a reservation's life: SIGKILL, Ctrl-C (SIGINT
to its process group, as a terminal sends it) or its network cut (every packet between the
login side and the keeper's port dropped in the keeper's node's namespace, then the client
killed once its run is judged gone). The phases: ``reserve`` (a reservation of its own, from
sbatch to its first run and the end of its ``with`` block), ``attach`` and ``run`` (on the
reservation the rounds share) and ``release`` (of the shared one). After each round: nothing
of the round left on any node or on the login side, the shared reservation still usable (or,
after a release, gone, and reserved again) and the next client's run correct. At the end: no
job left in the queue (a reservation whose client died before it knew the job id ends itself
after its idle timeout).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import slurmrun
from slurmrun.reservations import ReservationRecord
from slurmrun.slurm.queue import query_states
from tests.slurm.test_long_jobs_slurm import ensure_nft, nft_in

JOB_NAME = "slurmrun-test"
ROUNDS = 20
HEARTBEAT = 2.0  # the reservations' heartbeat timeout: a cut client is judged after it
SLACK = 5.0  # the issue's: a vanished client's run stopped within heartbeat + 5 s
IDLE = 3.0  # a reserve round's reservation ends itself this long after its client is gone
MARK = "SLURMRUN_CHAOS_ROUND"  # in every process a round's client starts (srun's too)

CLIENT = """
import os, sys, time
import slurmrun
phase, job, via, idle, folder = sys.argv[1:6]
def work(seconds):
    import os, time
    time.sleep(seconds)
    return os.environ["SLURMD_NODENAME"], int(os.environ["RANK"])
print("started", flush=True)
if phase == "reserve":
    r = slurmrun.reserve(
        nodes=1, time_min=3, idle_timeout=float(idle), heartbeat_timeout=@HB@, folder=folder,
        slurm_parameters={"job_name": @NAME@},
    )
    print("job", r.job_id, flush=True)
    with r:
        r.wait(60)
        print("ready", flush=True)
        print("values", slurmrun.launch(work, (2,), job=r.job_id, timeout=30).values(), flush=True)
    print("done", flush=True)
elif phase == "release":
    print("releasing", flush=True)
    print("released", slurmrun.release(job, timeout=30), flush=True)
else:
    with slurmrun.Launcher(job=job, timeout=30, heartbeat_timeout=@HB@) as launcher:
        print("attaching", flush=True)
        launcher.run(work, (0,))
        print("attached", flush=True)
        print("values", launcher.run(work, (3,)).values(), flush=True)
    print("done", flush=True)
""".replace("@HB@", repr(HEARTBEAT)).replace("@NAME@", repr(JOB_NAME))

# The moment of each phase a fault comes at: after the client printed `after`, a random
# delay up to `within` seconds (a cut comes only once the keeper is known).
MOMENTS = {
    "reserve": ("started", 3.0),
    "attach": ("started", 0.8),
    "run": ("attached", 2.5),
    "release": ("releasing", 1.2),
}
FAULTS = {
    "reserve": ("kill", "int", "cut"),
    "attach": ("kill", "int", "cut"),
    "run": ("kill", "int", "cut"),
    "release": ("kill", "int"),  # release speaks only to slurmctld, which is not ours to cut
}
CUT_WITHIN = 1.5  # a cut comes while the client's run (2 s or more) goes on
CUT_AFTER = {"reserve": "ready", "attach": "started", "run": "attached"}


@dataclass
class Client:
    """A round's client process and its lines, each with when it came."""

    proc: subprocess.Popen[str]
    lines: queue.Queue[tuple[float, str]]
    said: list[str]

    def wait_for(self, word: str, timeout: float) -> float | None:
        """When the client printed a line starting with `word`; None if it did not in time."""
        deadline = time.monotonic() + timeout
        for line in self.said:
            if line.startswith(word):
                return 0.0
        while (left := deadline - time.monotonic()) > 0:
            try:
                at, line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            self.said.append(line)
            if line.startswith(word):
                return at
            if line == "":
                return None
        return None


def start_client(tmp_path: Path, round_: int, args: list[str]) -> Client:
    """The client of round `round_`: ``phase job via idle_timeout`` in `args`."""
    work = tmp_path / f"round{round_}"
    work.mkdir()
    script = tmp_path / "client.py"
    if not script.exists():
        script.write_text(CLIENT)
    env = {**os.environ, MARK: str(work), "SLURMRUN_RESERVE_VIA": args[2]}
    proc = subprocess.Popen(
        [sys.executable, str(script), *args, str(tmp_path / "jobs")],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(work / "stderr", "w"),  # noqa: SIM115 - the child holds it
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C reaches it and its srun
    )
    lines: queue.Queue[tuple[float, str]] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((time.monotonic(), line.strip()))
        lines.put((time.monotonic(), ""))

    threading.Thread(target=read, daemon=True).start()
    return Client(proc, lines, [])


def marked(work: Path) -> list[str]:
    """Processes anywhere (login side and nodes share the pid namespace) of a round's client."""
    needle = f"{MARK}={work}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:120]!r}")
    return found


def workers(node_processes) -> list[str]:
    """Workers on any node (their titles: slurmrun.node.proctitle.worker_title)."""
    return [
        f"{p.node} {p.pid} {p.cmdline}"
        for ps in node_processes(wait=0).values()
        for p in ps
        if p.cmdline.startswith("slurmrun: ") and " rank " in p.cmdline
    ]


def jobs_from(work: Path) -> list[str]:
    """The jobs in the queue submitted from `work` (a reserve round's)."""
    cp = subprocess.run(
        ["squeue", "-h", "-o", "%A %T %Z"], capture_output=True, text=True, timeout=10, check=False
    )
    return [line for line in cp.stdout.splitlines() if line.endswith(f" {work}")]


def cut_rule(table: str, addr: str, port: int) -> str:
    return f"""
    table inet {table} {{
        chain i {{ type filter hook input priority 0; ip saddr {addr} tcp dport {port} drop; }}
        chain o {{ type filter hook output priority 0; ip daddr {addr} tcp sport {port} drop; }}
    }}
    """


def until(check, timeout: float, step: float = 0.1):  # type: ignore[no-untyped-def]
    """`check()` once it is falsy, or its last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (value := check()) and time.monotonic() < deadline:
        time.sleep(step)
    return value


def where() -> tuple[str, int]:
    return os.environ["SLURMD_NODENAME"], int(os.environ["RANK"])


@dataclass
class Chaos:
    """The rounds, the reservation they share, and what went wrong."""

    cluster: Any
    tmp_path: Path
    node_processes: Any
    nft: str
    seed: int
    shared: slurmrun.Reservation | None = None
    problems: list[str] = field(default_factory=list)
    reserve_rounds: list[Path] = field(default_factory=list)  # what idle timeouts end

    def reserve(self) -> None:
        """A fresh shared reservation (the last one released first)."""
        if self.shared is not None:
            with contextlib.suppress(Exception):
                self.shared.release(30)
        self.shared = slurmrun.reserve(
            nodes=2, time_min=5, idle_timeout=120, heartbeat_timeout=HEARTBEAT,
            folder=self.tmp_path / "jobs", slurm_parameters={"job_name": JOB_NAME},
        )  # fmt: skip
        self.shared.wait(60)

    def round(self, n: int, rng: random.Random) -> None:
        """One client, one fault at one moment; then the checks."""
        assert self.shared is not None
        phase = rng.choice(list(MOMENTS))
        fault = rng.choice(FAULTS[phase])
        delay = rng.uniform(0, min(MOMENTS[phase][1], CUT_WITHIN if fault == "cut" else 9.0))
        # The cut is of the keeper's port: a client through srun is not cut by it.
        srun = phase in ("attach", "run") and fault != "cut" and rng.random() < 0.3
        via = "srun" if srun else "direct"
        what = f"seed {self.seed} round {n}: {fault} at {delay:.2f} s of {phase} (via {via})"
        work = self.tmp_path / f"round{n}"
        # Ctrl-C'd, a client ends what it reserved: its idle timeout is not what ends it.
        idle = 120.0 if fault == "int" else IDLE
        client = start_client(self.tmp_path, n, [phase, self.shared.job_id, via, str(idle)])
        if phase == "reserve" and fault != "int":
            self.reserve_rounds.append(work)
        try:
            after = CUT_AFTER[phase] if fault == "cut" else MOMENTS[phase][0]
            if client.wait_for(after, 60) is None:
                self.problems.append(f"{what}: never said {after!r}: {client.said}")
            else:
                time.sleep(delay)
                self.fault(what, fault, client)
        finally:
            client.proc.kill()
            client.proc.wait(10)
        self.check(what, work, phase, fault)

    def fault(self, what: str, fault: str, client: Client) -> None:
        if fault == "kill":
            client.proc.kill()
        elif fault == "int":
            os.killpg(client.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                client.proc.wait(15)
            if client.proc.poll() is None:
                self.problems.append(f"{what}: still running 15 s after Ctrl-C")
        else:
            assert self.shared is not None
            job = self.shared.job_id
            mine = [line.split()[1] for line in client.said if line.startswith("job ")]
            record = ReservationRecord.read(mine[0] if mine else job)
            if record is None:
                self.problems.append(f"{what}: no record to cut")
                return
            table = f"slurmrun_chaos_{os.getpid()}"
            rule = cut_rule(table, self.cluster.launcher_addr, record.port)
            nft_in(self.cluster, record.node, self.nft, "-f", "-", stdin=rule)
            try:
                cut = time.monotonic()
                left = until(lambda: workers(self.node_processes), HEARTBEAT * 1.5 + SLACK)
                if left:
                    seconds = time.monotonic() - cut
                    self.problems.append(f"{what}: workers left {seconds:.1f} s after: {left}")
                client.proc.kill()
                client.proc.wait(10)
            finally:
                nft_in(self.cluster, record.node, self.nft, "delete", "table", "inet", table)

    def check(self, what: str, work: Path, phase: str, fault: str) -> None:
        """Nothing of the round left; the shared reservation usable; the next run right."""
        assert self.shared is not None
        if left := until(lambda: workers(self.node_processes), HEARTBEAT + SLACK):
            self.problems.append(f"{what}: workers left on the nodes: {left}")
        if left := until(lambda: marked(work), 10):
            self.problems.append(f"{what}: the client's processes left: {left}")
        if phase == "reserve" and fault == "int" and (left := until(lambda: jobs_from(work), 10)):
            self.problems.append(f"{what}: its reservation left for its idle timeout: {left}")
        if phase == "release":
            time.sleep(1.0)  # a scancel sent just before the kill shows by now
        if query_states([self.shared.job_id]).get(self.shared.job_id, "GONE") != "RUNNING":
            if phase != "release":
                self.problems.append(f"{what}: the shared reservation ended: {self.shared.state}")
            self.reserve()
        try:
            values = slurmrun.launch(where, job=self.shared.job_id, timeout=30).values()
        except Exception as e:
            self.problems.append(f"{what}: the next run failed: {type(e).__name__}: {e}")
            self.reserve()
            return
        record = ReservationRecord.read(self.shared.job_id)
        hosts = record.hostnames if record is not None else []
        if values != [(host, rank) for rank, host in enumerate(hosts)] or not hosts:
            self.problems.append(f"{what}: the next run's values: {values} on {hosts}")


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_twenty_rounds_of_clients_killed_cut_or_interrupted_leave_nothing_behind(
    slurm_cluster, tmp_path, monkeypatch, node_processes
):
    if slurm_cluster.mode != "netns":
        pytest.skip("needs the nodes in network namespaces of their own")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    seed = int(os.environ.get("SLURMRUN_CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    chaos = Chaos(slurm_cluster, tmp_path, node_processes, ensure_nft(), seed)
    started = time.monotonic()
    chaos.reserve()
    try:
        for n in range(ROUNDS):
            chaos.round(n, rng)
            print(f"round {n}: {time.monotonic() - started:.1f} s", flush=True)
    finally:
        assert chaos.shared is not None
        chaos.shared.release(30)
    for work in chaos.reserve_rounds:  # a lost reservation ends itself after its idle timeout
        if left := until(lambda work=work: jobs_from(work), IDLE + 15, 0.5):
            chaos.problems.append(f"seed {seed}: reserve round {work.name} left jobs: {left}")
    assert not chaos.problems, "\n".join(chaos.problems)
    assert node_processes() == {}
    print(f"seed {seed}: {ROUNDS} rounds in {time.monotonic() - started:.1f} s")


_INTERRUPTED = """
import slurmrun
print("started", flush=True)
slurmrun.reserve(
    nodes=1, time_min=3, idle_timeout=120, folder={folder!r},
    slurm_parameters={{"job_name": {name!r}}},
)
print("returned", flush=True)
"""


def test_ctrl_c_while_sbatch_answers_cancels_the_job_it_submitted(slurm_cluster, tmp_path):
    # A slow controller: sbatch has submitted the job, its answer (the job id) is late. A
    # terminal's Ctrl-C then reaches the client and sbatch (one process group): the job must
    # not be left to its idle timeout (120 s here), holding its node.
    real = subprocess.run(["which", "sbatch"], capture_output=True, text=True, check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f'#!/bin/bash\nout=$({real.stdout.strip()} "$@") || exit\n'
        f'touch {tmp_path}/submitted\nsleep 3\necho "$out"\n'
    )
    (bin_dir / "sbatch").chmod(0o755)
    script = _INTERRUPTED.format(folder=str(tmp_path / "jobs"), name=JOB_NAME)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "XDG_CONFIG_HOME": str(tmp_path),
    }
    client = subprocess.Popen(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert until(lambda: not (tmp_path / "submitted").exists(), 30) is False
        os.killpg(client.pid, signal.SIGINT)
        out, err = client.communicate(timeout=30)
    finally:
        client.kill()
    assert "KeyboardInterrupt" in err and "returned" not in out, (out, err)
    left = until(lambda: jobs_from(tmp_path), 10, 0.5)
    assert not left, f"the job sbatch submitted is left until its idle timeout: {left}"
