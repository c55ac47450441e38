"""What peers can do to a launch on localhost: an idle warm launcher stays small, a flood of
silent connections does not slow a run, a handshake that broke off is retried while a wrong
secret is final, and every socket of a localhost launch listens on loopback only."""

from __future__ import annotations

import socket
import threading
import time

import psutil
import pytest

import slurmrun
from slurmrun.authentication import (
    AuthenticationError,
    HandshakeBrokeOff,
    ServerChallenge,
    client_handshake,
    new_secret,
    server_handshake,
)
from slurmrun.node.agent_connect import connect_with_backoff

OPTIONS = {"workers_per_host": 2, "backend": "gloo", "timeout": 120}


def one() -> int:
    return 1


def large() -> bytes:
    """A result large enough to travel over a connection of its own (STREAM_MIN_BYTES)."""
    return bytes(5 << 20)


def _listener_port(launcher: slurmrun.Launcher) -> int:
    warm = launcher._warm
    assert warm is not None and warm.pool is not None
    return int(warm.pool.server.getsockname()[1])


def test_an_idle_warm_launcher_does_not_queue_heartbeats() -> None:
    # heartbeat_timeout=1: every agent sends a heartbeat each 0.2 s (HEARTBEATS_PER_TIMEOUT)
    with slurmrun.Launcher(**{**OPTIONS, "heartbeat_timeout": 1.0}) as launcher:
        assert launcher.run(one).values() == [1, 1]
        warm = launcher._warm
        assert warm is not None and warm.pool is not None
        events = warm.pool.listener.events
        sizes = []
        for _ in range(6):  # 3 s idle: ~15 heartbeats from the agent
            time.sleep(0.5)
            sizes.append(events.qsize())
        assert max(sizes) <= 2, sizes
        assert launcher.run(one).values() == [1, 1], "heard from while idle: still alive"


def test_a_flood_of_silent_connections_does_not_slow_a_warm_run() -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        launcher.run(large)
        start = time.monotonic()
        launcher.run(large)
        baseline = time.monotonic() - start
        port = _listener_port(launcher)
        silent: list[socket.socket] = []
        try:
            for _ in range(1100):
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            start = time.monotonic()
            assert [len(v) for v in launcher.run(large).values()] == [5 << 20] * 2
            flooded = time.monotonic() - start
        finally:
            for sock in silent:
                sock.close()
        # the old listener took ~10 s here (1024 handshakes of 10 s each held the door)
        print(f"baseline {baseline:.2f} s, with the flood {flooded:.2f} s")
        assert flooded < max(5 * baseline, baseline + 2.0), (baseline, flooded)


def _serve_twice(server: socket.socket, secret: bytes, first: str) -> None:
    """The first connection is left silent (`"silent"`) or closed (`"close"`); then a real one."""
    sock, _ = server.accept()
    if first == "close":
        sock.close()
    else:
        held = sock  # silent: never greeted, closed only after the client gave up on it
    sock2, _ = server.accept()
    if first != "close":
        held.close()
    try:
        server_handshake(sock2, secret, 5.0)
    finally:
        sock2.close()


@pytest.mark.parametrize("first", ["silent", "close"])
def test_a_handshake_that_timed_out_or_broke_off_is_retried(first: str) -> None:
    secret = new_secret()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        serving = threading.Thread(target=_serve_twice, args=(server, secret, first), daemon=True)
        serving.start()

        def connect_once() -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            try:
                client_handshake(sock, secret, 0.5)
            except BaseException:
                sock.close()
                raise
            return sock

        sock, tries = connect_with_backoff(connect_once, 10.0)
        sock.close()
        serving.join(10)
    assert tries == 2


def test_a_server_without_the_secret_is_final() -> None:
    """A wrong proof ends the agent's tries at once: a wrong secret stays wrong."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def serve() -> None:  # a server of another launch: its proof is for another secret
            challenge = ServerChallenge(new_secret())
            while True:
                sock, _ = server.accept()
                with sock:
                    sock.sendall(challenge.greeting)
                    sock.recv(ServerChallenge.REPLY_BYTES, socket.MSG_WAITALL)
                    sock.sendall(bytes(32))

        threading.Thread(target=serve, daemon=True).start()
        tries = 0

        def connect_once() -> socket.socket:
            nonlocal tries
            tries += 1
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            with sock:
                client_handshake(sock, new_secret(), 5.0)
            return sock

        with pytest.raises(AuthenticationError, match="HMAC") as raised:
            connect_with_backoff(connect_once, 30.0)
    assert not isinstance(raised.value, HandshakeBrokeOff)
    assert tries == 1


def _listening(pids: set[int]) -> list[tuple[int, str, int]]:
    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found += [(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def test_every_socket_of_a_localhost_launch_listens_on_loopback() -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        launcher.run(one)  # agents started; each holds the next run's store port
        warm = launcher._warm
        assert warm is not None and warm.pool is not None
        agents = {a.hello.pid for a in warm.pool.agents.values()}
        family = set(agents)
        for pid in agents:
            family |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        idle = _listening(family | {psutil.Process().pid})
        store_port = warm.pool.agents[0].master_port
        during = launcher.run(_my_listeners)
    ports = {port for _, _, port in idle}
    assert store_port in ports, idle  # the held store port
    assert idle and all(ip == "127.0.0.1" for _, ip, _ in idle), idle
    seen = [entry for entries in during.values() for entry in entries]
    assert seen and all(ip == "127.0.0.1" for _, ip, _ in seen), seen


def _my_listeners() -> list[tuple[int, str, int]]:
    """Every listening socket of this worker, its spawner and its agent (the store's too)."""
    import torch.distributed as dist

    dist.barrier()
    me = psutil.Process()
    spawner = me.parent()
    agent = spawner.parent()
    return _listening({me.pid, spawner.pid, agent.pid})
