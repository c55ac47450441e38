"""Simulated scale: a real launcher-side pool and run against N fake agents x W fake workers.

    python benchmarks/scale.py --agents 4096 --workers 8 [--logs] [--chatter S] [--no-retry]

The fake agents (`fake_agents.py`) run in separate, forked processes (2 by default; their CPU
time is not the launcher's), thousands per process in one event loop. Each speaks the real
protocol of `slurmrun.transport`: TCP connect (with the real agent's retry schedule,
`slurmrun.node.agent_connect.Backoff`), HMAC handshake, ``hello``,
then after ``start`` one ``result`` frame per worker (a pickled int), a heartbeat and
``done``; END: ``idle``; CLOSE. Connects that had to be retried are counted; with
``--no-retry`` a fake agent tries once and fails (and so does the launch) as a real agent
with ``SLURMRUN_CONNECT_RETRY=0`` would. With ``--logs`` every worker also prints one line
first and the run uses its default log handlers, as a real launch does: as srun agents do, the
fake agents write each worker's file into the log directory (`slurmrun.logs.WorkerLog`, their
processes' time) and send the launcher only rank 0's lines, which it shows live. With
``--chatter S`` (implies ``--logs``), for S seconds before its result rank 0 prints a progress
bar state 100 times a second and every other worker one line a second; the result then counts
the lines that reached the files.

This process is the launcher: it measures wall and CPU time (``time.process_time``: all its
threads) of each phase, and its memory (peak RSS minus RSS before the launch). Prints one
``BENCH_JSON`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import current_rss_bytes, emit, peak_rss_bytes
from fake_agents import CONNECT_TIMEOUT, FakeSpec, fake_agents_main

from slurmrun.launcher.listener import LISTEN_BACKLOG
from slurmrun.launcher.pool import AgentPool

try:  # a version before the typed-event loop (issue 24) calls the run a Session
    from slurmrun.launcher.run import Run as Session
except ImportError:  # pragma: no cover - for before/after tables against older trees
    from slurmrun.launcher.session import Session  # type: ignore[no-redef]
from slurmrun.authentication import new_secret
from slurmrun.pickling import dumps_inband

# ------------------------------------------------------------------ launcher side (this process)


@dataclasses.dataclass
class FakeStarter:
    """An `AgentStarter` whose agents live in the fake-agent processes (one event loop each)."""

    pipes: list[multiprocessing.connection.Connection]
    failed: dict[int | None, int] = dataclasses.field(default_factory=dict)
    reasons: list[str] = dataclasses.field(default_factory=list)
    finished: set[int] = dataclasses.field(default_factory=set)
    retried_agents: int = 0
    counted_lines: int = 0
    retries: int = 0

    def _poll(self, timeout: float = 0.0) -> None:
        live = [p for i, p in enumerate(self.pipes) if i not in self.finished]
        for pipe in multiprocessing.connection.wait(live, timeout) if live else []:
            assert isinstance(pipe, multiprocessing.connection.Connection)
            while pipe.poll():
                msg = pipe.recv()
                if msg[0] == "fail":
                    self.failed[int(msg[1])] = 1
                    self.reasons.append(str(msg[2]))
                elif msg[0] == "finished":
                    self.finished.add(self.pipes.index(pipe))
                    self.retried_agents += int(msg[1])
                    self.counted_lines += int(msg[3]) if len(msg) > 3 else 0
                    self.retries += int(msg[2])
                    break

    def __getattr__(self, name: str) -> Any:
        """Hooks that later versions of `AgentStarter` add are no-ops for fake agents."""
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    def agent_hello(self, node_rank: int, hello: Mapping[str, Any]) -> None:
        """Fake agents need nothing from their hello."""

    def start(self, env: Mapping[str, str]) -> None:
        """Tells the fake agents to connect."""
        for pipe in self.pipes:
            pipe.send(("go",))

    def exit_codes(self) -> dict[int | None, int]:
        """Fake agents that failed count as agents that exited with code 1."""
        self._poll()
        return dict(self.failed)

    def log_file(self, node_rank: int | None) -> str | None:
        """Fake agents write no log."""
        return None

    def stop(self, grace: float) -> None:
        """Waits for every fake agent thread to end (they end on stop)."""
        deadline = time.monotonic() + grace
        while len(self.finished) < len(self.pipes) and time.monotonic() < deadline:
            self._poll(timeout=max(0.0, deadline - time.monotonic()))


class TimedSession(Session):
    """A `Session` that notes the wall and CPU clock when hand-out and collection run."""

    marks: dict[str, tuple[float, float]]

    def _mark(self, name: str) -> None:
        self.marks[name] = (time.perf_counter(), time.process_time())

    def _hand_out(self) -> None:
        self._mark("handout_start")
        super()._hand_out()
        self._mark("handout_end")

    def _collect(self) -> Any:
        self._mark("collect_start")
        result = super()._collect()
        self._mark("collect_end")
        return result


def _trivial() -> int:
    return 0


def _session(
    agents: int, secret: bytes, starter: FakeStarter, server: socket.socket, log_dir: str | None
) -> TimedSession:
    """A TimedSession with the arguments launcher.py gives a real one (those this version has)."""
    pool = AgentPool(
        hostnames=[f"node{i}" for i in range(agents)],
        starter=starter,
        server=server,
        secret=secret,
        connect_timeout=CONNECT_TIMEOUT,
        silence=CONNECT_TIMEOUT,
    )
    wanted: dict[str, Any] = {
        "pool": pool,
        "hostnames": [f"node{i}" for i in range(agents)],
        "workers_per_host": None,
        "backend": "gloo",
        "timeout": CONNECT_TIMEOUT,
        "agent_timeout": CONNECT_TIMEOUT,
        "grace": 3.0,
        "payload": dumps_inband((_trivial, (), {})),
        "secret": secret,
        "starter": starter,
        "server": server,
        "start_header": {"sys_path": list(sys.path), "cwd": os.getcwd(), "env": {}},
        "surroundings": _surroundings(),
        "local_master": False,
        "handlers": None if log_dir else [],
        "log_dir": log_dir,
        "agents_write_logs": True,  # as srun agents do: they see the (shared) log directory
    }
    wanted |= _run_parts(wanted)
    names = {f.name for f in dataclasses.fields(Session)}
    session = TimedSession(**{k: v for k, v in wanted.items() if k in names})
    session.marks = {}
    return session


def _run_parts(wanted: dict[str, Any]) -> dict[str, Any]:
    """The same, as a version whose run takes one object per concern takes them ({}: older)."""
    try:
        from slurmrun.launcher.run_setup import Call, Output, Watching
    except ImportError:
        return {}
    call = Call(
        payload=wanted["payload"],
        surroundings=wanted["surroundings"],
        workers_per_host=wanted["workers_per_host"],
        backend=wanted["backend"],
        timeout=wanted["timeout"],
        grace=wanted["grace"],
        local_master=wanted["local_master"],
    )
    output = Output(
        handlers=wanted["handlers"],
        log_dir=wanted["log_dir"],
        agents_write_logs=wanted["agents_write_logs"],
    )
    return {"call": call, "output": output, "watching": Watching()}


def _surroundings() -> object:
    """Where the run's workers run, as this version takes it (None: a version before it)."""
    try:
        from slurmrun.start_parts import Surroundings
    except ImportError:
        return None
    return Surroundings(sys_path=list(sys.path), cwd=os.getcwd(), env={})


def start_fake_agents(
    agents: int, spec: FakeSpec, procs: int
) -> tuple[list[multiprocessing.connection.Connection], list[multiprocessing.process.BaseProcess]]:
    """Forks `procs` processes that hold the fake agents between them, ready for "go"."""
    ctx = multiprocessing.get_context("fork")
    pipes: list[multiprocessing.connection.Connection] = []
    processes: list[multiprocessing.process.BaseProcess] = []
    for p in range(min(procs, agents)):
        mine, theirs = ctx.Pipe()
        ranks = list(range(p, agents, procs))
        process = ctx.Process(target=fake_agents_main, args=(theirs, ranks, spec), daemon=True)
        process.start()
        pipes.append(mine)
        processes.append(process)
    for pipe in pipes:
        if pipe.recv()[0] != "ready":
            raise RuntimeError("fake agents did not start")
    return pipes, processes


def _raise_fd_limit() -> None:
    """One socket per fake agent on each side: 4096 agents need more than the usual 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _count_lines(log_dir: str) -> int:
    lines = 0
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name), "rb") as f:
            lines += f.read().count(b"\n")
    return lines


def measure(
    agents: int,
    workers: int,
    logs: bool,
    procs: int = 2,
    retry: bool = True,
    *,
    chatter: float = 0.0,
    agent_files: bool = True,
) -> dict[str, Any]:
    """Runs one simulated launch and returns its timings and memory."""
    _raise_fd_limit()
    logs = logs or chatter > 0
    server = socket.create_server(("127.0.0.1", 0), backlog=LISTEN_BACKLOG)
    secret = new_secret()
    spec = FakeSpec(server.getsockname()[1], secret, workers, logs, retry, chatter, agent_files)
    pipes, processes = start_fake_agents(agents, spec, procs)
    # Where a real launch puts its logs by default (./slurmrun_logs), not /tmp: on the
    # reference machine creating a file in /tmp takes ~750 us, elsewhere on the same disk 25 us.
    logs_base = os.path.join(os.getcwd(), "slurmrun_logs")
    if logs:
        os.makedirs(logs_base, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix="scale-", dir=logs_base) if logs else None
    starter = FakeStarter(pipes)
    session = _session(agents, secret, starter, server, log_dir)
    rss_before = current_rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    error = ""
    ok = False
    try:
        session.pool.open({})
        session.marks["connected"] = (time.perf_counter(), time.process_time())
        result = session.run()
        ok = list(result.values()) == list(range(agents * workers))
    except Exception as e:
        error = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        session.pool.close()
    t1, c1 = time.perf_counter(), time.process_time()
    peak = peak_rss_bytes()
    for process in processes:
        process.join(timeout=10.0 if ok else 0.5)
        if process.is_alive():
            process.kill()
    ranks = agents * workers
    expected = (
        (ranks + (ranks - 1) * -(-int(chatter * 100) // 100) + 1 if chatter else ranks)
        if logs
        else 0
    )
    lines = 0
    if log_dir:
        lines = _count_lines(log_dir) + starter.counted_lines
        shutil.rmtree(log_dir, ignore_errors=True)
    m = session.marks
    out: dict[str, Any] = {
        "agents": agents,
        "workers": workers,
        "logs": logs,
        "ok": ok,
        "error": error,
        "fake_agent_failures": len(starter.failed),
        "retried_agents": starter.retried_agents,
        "connect_retries": starter.retries,
        "chatter_s": chatter,
        "agent_files": agent_files,
        "log_lines": lines,
        "log_lines_expected": expected,
        "fake_agent_failure_example": starter.reasons[0] if starter.reasons else "",
        "total_wall_s": t1 - t0,
        "total_cpu_s": c1 - c0,
        "rss_before": rss_before,
        "peak_rss": peak,
        "mem_delta": max(0, peak - rss_before),
    }
    if "handout_start" in m and "collect_end" in m:
        out.update(
            connect_wall_s=m["handout_start"][0] - t0,
            connect_cpu_s=m["handout_start"][1] - c0,
            handout_wall_s=m["handout_end"][0] - m["handout_start"][0],
            gather_wall_s=m["collect_start"][0] - m["handout_end"][0],
            collect_wall_s=m["collect_end"][0] - m["collect_start"][0],
            handout_gather_wall_s=m["collect_end"][0] - m["handout_start"][0],
            handout_gather_cpu_s=m["collect_end"][1] - m["handout_start"][1],
            shutdown_wall_s=t1 - m["collect_end"][0],
        )
    return out


def main() -> None:
    """Parses the command line, runs one simulated launch, prints its BENCH_JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--logs", action="store_true", help="one stdout line per worker")
    parser.add_argument("--fake-procs", type=int, default=2, help="processes of fake agents")
    parser.add_argument(
        "--no-retry", action="store_true", help="fake agents try to connect once, no retry"
    )
    parser.add_argument(
        "--chatter",
        type=float,
        default=0.0,
        help="seconds of rank 0's progress bar (100/s) and a line a second from the others",
    )
    parser.add_argument(
        "--no-agent-files",
        action="store_true",
        help="fake agents count the lines they would write instead of creating the files "
        "(on a cluster each node creates its own; here all share 2 cores and one directory)",
    )
    a = parser.parse_args()
    emit(
        measure(
            a.agents,
            a.workers,
            a.logs,
            a.fake_procs,
            not a.no_retry,
            chatter=a.chatter,
            agent_files=not a.no_agent_files,
        )
    )


if __name__ == "__main__":
    main()
