"""Small-scale correctness of what lets a launch scale: connect retries and the log writer.

Speed belongs to benchmarks/scale.py; these tests check behaviour with real sockets, a real
agent process and real files.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import slurmrun
from slurmrun import handlers, protocol, variables
from slurmrun.authentication import (
    ServerChallenge,
    client_handshake,
    new_secret,
    server_handshake,
)
from slurmrun.handlers import default_handlers
from slurmrun.launcher.records import dispatch, make_record
from slurmrun.node.agent import CONNECT_RETRY_VAR
from slurmrun.node.agent_connect import connect_with_backoff
from slurmrun.transport import Connection, recv_exact

AGENT_EXIT_WITHIN = 120.0  # a bound for a loaded 2-core machine, not a speed claim


def _refusing_port() -> socket.socket:
    """A bound socket that does not listen yet: connects to its port are refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def test_connect_retries_refused_connects_until_the_launcher_listens() -> None:
    server = _refusing_port()
    port = server.getsockname()[1]
    calls = 0

    def once() -> socket.socket:
        nonlocal calls
        calls += 1
        if calls == 4:
            server.listen()  # the launcher's backlog has room again
        return socket.create_connection(("127.0.0.1", port), timeout=10)

    with server:
        sock, tries = connect_with_backoff(once, budget=120.0)
        sock.close()
    assert tries == 4


def test_connect_gives_up_after_its_budget_saying_how_often_it_tried() -> None:
    with _refusing_port() as server:
        port = server.getsockname()[1]
        with pytest.raises(ConnectionError, match=r"tries over 0.5 s failed.*ConnectionRefused"):
            connect_with_backoff(
                lambda: socket.create_connection(("127.0.0.1", port), timeout=10), 0.5
            )


def test_a_handshake_the_launcher_broke_off_is_retried_within_the_budget() -> None:
    """The launcher closes a handshake without a word (a wrong proof, a deadline, a flood from
    one source): the agent cannot tell them apart, so it retries until its budget is spent,
    and then says how many tries failed (tests/test_peers.py: a server whose own proof is
    wrong is final at once)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    calls = 0
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:  # closed: the test is over
                return
            with conn, contextlib.suppress(OSError):  # AuthenticationError among them
                server_handshake(conn, new_secret(), 10)

    def once() -> socket.socket:
        nonlocal calls
        calls += 1
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            client_handshake(sock, new_secret(), 10)  # not the launcher's secret
        finally:
            sock.close()
        return sock

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with server, pytest.raises(ConnectionError, match=r"tries over 1 s failed"):
            connect_with_backoff(once, budget=1.0)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert calls > 1


def test_an_agent_that_cannot_reach_its_launcher_exits_1_naming_its_host() -> None:
    """The real agent process: the launcher's pool turns that exit into its error at once."""
    with _refusing_port() as server:
        env = {
            **os.environ,
            variables.SECRET_VAR: new_secret().hex(),
            variables.LAUNCHER_ADDR_VAR: "127.0.0.1",
            variables.PORT_VAR: str(server.getsockname()[1]),
            variables.PRELOAD_VAR: "",
            variables.HOSTNAME_VAR: "refused-node",
            CONNECT_RETRY_VAR: "1",
        }
        proc = subprocess.run(
            [sys.executable, "-m", "slurmrun.node.agent_main"],
            env=env,
            capture_output=True,
            text=True,
            timeout=AGENT_EXIT_WITHIN,
            check=False,
        )
    assert proc.returncode == 1, proc.stderr
    assert "slurmrun agent on refused-node: cannot reach the launcher at 127.0.0.1:" in proc.stderr
    assert "tries over 1 s failed" in proc.stderr


def _record(hostname: str, local_rank: int | None, msg: str, end: str = "\n") -> logging.LogRecord:
    log = protocol.Log(
        stream="stdout", level=20, end=end, local_rank=-1 if local_rank is None else local_rank
    )
    return make_record(log, hostname, local_rank, msg, end)


def test_worker_files_get_every_finished_line_in_order(tmp_path: os.PathLike[str]) -> None:
    """The writer thread: every line of every worker, in order, once the handlers close."""
    hosts = [f"node{i}" for i in range(64)]
    handlers = default_handlers(hosts, str(tmp_path), logging.INFO)
    handlers = handlers[2:]  # the files alone: the live view is not under test here
    for line in range(20):
        for host in hosts:
            for local_rank in range(4):
                dispatch(_record(host, local_rank, f"{host}:{local_rank} line {line}"), handlers)
    dispatch(_record("node0", 0, "50% [bar]", "\r"), handlers)  # a progress state: kept as written
    dispatch(_record("node0", None, "the agent's own line"), handlers)  # in its own file
    for handler in handlers:
        handler.close()
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 64 * 4
    for host in hosts:
        for local_rank in range(4):
            with open(os.path.join(tmp_path, f"{host}.{local_rank}.log"), "rb") as f:
                data = f.read()
            lines = "".join(f"{host}:{local_rank} line {i}\n" for i in range(20)).encode()
            assert data == (lines + b"50% [bar]\r" if (host, local_rank) == ("node0", 0) else lines)


def test_worker_files_hold_a_bounded_queue_a_slow_disk_slows_their_emit(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem slower than the output makes the handler wait, not its queue grow."""
    monkeypatch.setattr(handlers, "WRITER_QUEUE", 8)
    files = handlers._WorkerFiles(str(tmp_path))
    real_append = files._append

    def slow_append(key: tuple[str, int], pieces: list[tuple[bytes, str]]) -> bool:
        time.sleep(0.01)
        return real_append(key, pieces)

    monkeypatch.setattr(files, "_append", slow_append)
    longest = 0
    for i in range(200):
        files.handle(_record("node0", 0, f"line {i}"))
        longest = max(longest, files._queue.qsize())
    files.close()
    assert longest <= 8
    with open(os.path.join(tmp_path, "node0.0.log")) as f:
        assert f.read().splitlines() == [f"line {i}" for i in range(200)]


def chatty() -> int:
    import torch.distributed as dist

    for i in range(200):
        print(f"rank {dist.get_rank()} line {i}", flush=True)
    return dist.get_rank()


def test_a_launch_writes_every_line_of_every_rank_to_its_file(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    result = slurmrun.launch(chatty, workers_per_host=2, backend="gloo", timeout=120)
    assert result.return_values == [[0, 1]]
    (run_dir,) = [name for name in os.listdir(tmp_path) if name != "latest"]
    for local_rank in range(2):
        path = os.path.join(tmp_path, run_dir, f"{result.hostnames[0]}.{local_rank}.log")
        with open(path) as f:
            lines = f.read().splitlines()
        assert lines[0].startswith("=== slurmrun run 1, ")  # the run's header line
        assert lines[1:] == [f"rank {local_rank} line {i}" for i in range(200)]


def test_the_scale_benchmark_runs_its_fake_agents_against_a_real_launcher() -> None:
    # benchmarks/scale.py speaks the protocol by hand: a change to it (a hello's fields) must
    # not leave the benchmark failing unseen.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "scale.py")
    cp = subprocess.run(
        [sys.executable, script, "--agents", "16", "--workers", "2", "--logs"],
        capture_output=True,
        text=True,
        timeout=AGENT_EXIT_WITHIN,
        check=False,
    )
    lines = [line for line in cp.stdout.splitlines() if line.startswith("BENCH_JSON ")]
    assert lines, cp.stdout + cp.stderr
    report = json.loads(lines[-1].removeprefix("BENCH_JSON "))
    assert report["ok"], report["error"]
    assert report["log_lines"] == report["log_lines_expected"] > 0


def test_a_fake_agent_retries_a_broken_handshake_from_the_start() -> None:
    """The scale benchmark's fake agents, after a handshake broke off once they had answered
    the challenge, start the next connection's handshake afresh: the new greeting is read as
    a greeting, not taken for the old connection's proof ("server failed the HMAC challenge")."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    try:
        import fake_agents  # the benchmark's module, not the package's
    finally:
        sys.path.pop(0)
    secret = new_secret()
    server = socket.create_server(("127.0.0.1", 0))
    hellos: list[dict[str, object]] = []

    def serve() -> None:
        first, _ = server.accept()
        with first:  # greets, takes the agent's answer, and breaks off before its proof
            first.sendall(ServerChallenge(secret).greeting)
            with contextlib.suppress(EOFError):
                recv_exact(first, ServerChallenge.REPLY_BYTES)
        second, _ = server.accept()
        with second:
            server_handshake(second, secret, 10)
            frame = Connection(second).recv()
            hellos.append({} if frame is None else frame.header)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    loop, tally = fake_agents.Loop(), fake_agents.Tally()
    spec = fake_agents.FakeSpec(
        port=server.getsockname()[1], secret=secret, workers=1, logs=False, retry=True
    )
    with server:
        fake_agents.FakeAgent(loop, 0, spec, tally).connect()
        deadline = time.monotonic() + 30
        while not hellos and not tally.failures and time.monotonic() < deadline:
            loop.run_once(0.05)
        thread.join(timeout=30)
    assert not tally.failures, tally.failures
    assert tally.retries >= 1
    assert [h["t"] for h in hellos] == ["hello"]
