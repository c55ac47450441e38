"""Hostile peers against a live launcher: random bytes, frames without a handshake, truncated
and wrong handshake answers; and replayed handshake answers at the transport level.

The attacker is a worker of a real launch: it reads the launcher's address and port from its
environment (``SLURMRUN_LAUNCHER_ADDR`` / ``SLURMRUN_LAUNCHER_PORT``) and runs a hypothesis
test, one TCP connection per example. Every connection must get the 36-byte challenge and
nothing more (never the server's proof), the launcher must log each rejection, nothing any
attacker sent may be unpickled (``pickling.unpickle_count`` grows by the results only, and a
pickle that would create a file never runs), and the launch must still succeed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from driver_common import launcher_seen_from_a_worker
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import slurmrun
from slurmrun import authentication, pickling, transport

EXAMPLES = 4000  # connections the attacking worker opens
CHALLENGE = (
    len(authentication.HANDSHAKE_MAGIC) + authentication.NONCE_BYTES
)  # what a stranger may get
ANSWER = authentication.NONCE_BYTES + authentication.MAC_BYTES
ATTACKS = (
    "random",  # random bytes, sent without reading the challenge
    "frame",  # a well-formed (or cut) frame, some with a malicious pickle, without handshake
    "frame_after_challenge",  # the same, sent as the answer to the challenge
    "truncated_answer",  # fewer bytes than an answer, then end of stream
    "wrong_answer",  # an answer's worth of random bytes (and more)
    "wrong_secret",  # the real client handshake, with a wrong secret
)


class CreatesFileWhenUnpickled:
    """A pickle that proves it was unpickled: unpickling it creates `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def frame_bytes(header: dict[str, Any], body: bytes, buffers: list[bytes], keep: int) -> bytes:
    """A well-formed frame (magic, lengths, JSON header, body, buffers), cut after `keep`."""
    raw_header = json.dumps(header).encode()
    prefix = struct.pack("!4sIQI", transport.MAGIC, len(raw_header), len(body), len(buffers))
    lens = struct.pack(f"!{len(buffers)}Q", *(len(b) for b in buffers))
    whole = prefix + lens + raw_header + body + b"".join(buffers)
    return whole[:keep] if keep < len(whole) else whole


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the launcher sends until it closes (a reset counts as closed)."""
    got = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(4096):
            got += chunk
    return got


# ---------------------------------------------------------------- the attacking worker


def attack_the_launcher(examples: int, evil_path: str, done_path: str) -> dict[str, Any]:
    """Runs on rank 0: one hostile connection per hypothesis example; returns the counts."""
    addr, port = launcher_seen_from_a_worker()
    evil = pickle.dumps(CreatesFileWhenUnpickled(evil_path))
    counts = dict.fromkeys(ATTACKS, 0)
    violations: list[str] = []

    headers = st.dictionaries(
        st.sampled_from(["t", "local_rank", "exc_type", "hostname"]),
        st.one_of(st.sampled_from(["result", "error", "hello", "log"]), st.integers(-2, 9)),
        max_size=3,
    )
    frames = st.builds(
        frame_bytes,
        headers,
        st.one_of(st.just(evil), st.binary(max_size=200)),
        st.lists(st.binary(max_size=50), max_size=3),
        st.integers(0, 400),
    )
    attacks = st.one_of(
        st.tuples(st.just("random"), st.binary(max_size=300)),
        st.tuples(st.just("frame"), frames),
        st.tuples(st.just("frame_after_challenge"), frames),
        st.tuples(st.just("truncated_answer"), st.binary(max_size=ANSWER - 1)),
        st.tuples(st.just("wrong_answer"), st.binary(min_size=ANSWER, max_size=ANSWER + 64)),
        st.tuples(st.just("wrong_secret"), st.binary(min_size=32, max_size=32)),
    )

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(attacks)
    def one_connection(attack: tuple[str, Any]) -> None:
        kind, data = attack
        with socket.create_connection((addr, port), timeout=20) as s:
            if kind == "wrong_secret":
                try:
                    authentication.client_handshake(s, data, timeout=20)
                except authentication.AuthenticationError:
                    pass
                else:
                    violations.append("a wrong secret passed the handshake")
                got = read_to_end(s)
                if got:
                    violations.append(f"{kind}: {len(got)} bytes after the challenge")
            else:
                allowed = CHALLENGE  # random bytes and frames: sent before reading anything
                if kind in ("frame_after_challenge", "truncated_answer", "wrong_answer"):
                    challenge = transport.recv_exact(s, CHALLENGE)
                    assert bytes(challenge).startswith(authentication.HANDSHAKE_MAGIC)
                    allowed = 0
                with contextlib.suppress(OSError):  # the launcher may have hung up already
                    s.sendall(data)
                    s.shutdown(socket.SHUT_WR)
                got = read_to_end(s)
                if len(got) > allowed:
                    violations.append(f"{kind}: got {len(got)} bytes: more than a challenge")
        counts[kind] += 1

    one_connection()
    Path(done_path).write_text("done")
    return {"counts": counts, "violations": violations, "pid": os.getpid()}


def keep_working(done_path: str, ready_path: str) -> dict[str, Any]:
    """Runs on rank 1 during the attack: legitimate output and a result still get through."""
    Path(ready_path).write_text(str(os.getpid()))
    lines = 0
    deadline = time.time() + 120
    while not Path(done_path).exists() and time.time() < deadline:
        print(f"still working {lines}", flush=True)
        lines += 1
        time.sleep(0.05)
    return {"lines": lines, "environ": dict(os.environ)}


def attacker_or_worker(examples: int, tmp: str) -> dict[str, Any]:
    done, evil = f"{tmp}/attack_done", f"{tmp}/evil_was_unpickled"
    if os.environ["RANK"] == "0":
        Path(f"{tmp}/ready.0").write_text(str(os.getpid()))
        result = attack_the_launcher(examples, evil, done)
    else:
        result = keep_working(done, f"{tmp}/ready.1")
    result["secret_in_env"] = "SLURMRUN_SECRET" in os.environ
    return result


# ---------------------------------------------------------------- tests


@pytest.fixture
def recorded_secrets(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The secret of every launch in this test (to look for it where it must not be)."""
    import slurmrun.launcher.warm as launcher_module  # where a launch makes its secret

    secrets: list[bytes] = []
    real = launcher_module.new_secret

    def recording() -> bytes:
        secrets.append(real())
        return secrets[-1]

    monkeypatch.setattr(launcher_module, "new_secret", recording)
    return secrets


def command_lines_and_environ_of(pids: list[int]) -> tuple[list[str], list[str]]:
    lines, environs = [], []
    for pid in pids:
        with contextlib.suppress(psutil.Error, OSError):
            p = psutil.Process(pid)
            lines.append(" ".join(p.cmdline()))
            environs.append(Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"))
    return lines, environs


def assert_secret_nowhere(secret: bytes, seen: dict[str, Any], worker: dict[str, Any]) -> None:
    """Not on any command line, in no environment of the launch, in no log file."""
    assert "lines" in seen, "the launch's processes were never looked at"
    assert any(line.startswith("slurmrun agent (") for line in seen["lines"])
    assert not worker["secret_in_env"]
    assert "SLURMRUN_SECRET" not in worker["environ"]
    assert not any("SLURMRUN_SECRET" in env for env in seen["worker_environ"])
    # Agents (and the spawners forked from them) got it in their environment at exec, and
    # /proc/<pid>/environ would show that block forever: they overwrite it.
    assert len(seen["launch_environ"]) >= 4  # agent, spawner, 2 workers
    assert all("SLURMRUN_LAUNCHER_PORT" in env for env in seen["launch_environ"])
    log_files = [f for f in Path(os.environ["SLURMRUN_LOG_DIR"]).rglob("*") if f.is_file()]
    assert any(f.name.endswith(".agent.log") for f in log_files)
    for text in (secret.hex(), secret.hex().upper()):
        assert not any(text in line for line in seen["all_lines"]), "secret on a command line"
        assert not any(text in env for env in seen["worker_environ"]), "secret in a worker's env"
        assert not any(text in env for env in seen["launch_environ"]), "secret in an agent's env"
        assert not any(text in str(v) for v in worker["environ"].values())
        for log_file in log_files:
            data = log_file.read_bytes()
            assert text.encode() not in data and secret not in data, log_file


def test_thousands_of_hostile_connections_are_refused_and_the_launch_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, recorded_secrets: list[bytes]
) -> None:
    caplog.set_level("WARNING", logger="slurmrun")
    seen: dict[str, Any] = {}

    def look_at_processes_during_the_launch() -> None:
        """From a thread of the launcher: every process of the launch, while it runs."""
        deadline = time.time() + 60
        while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
            if time.time() > deadline:
                return
            time.sleep(0.05)
        procs = psutil.Process().children(recursive=True)
        seen["lines"], seen["launch_environ"] = command_lines_and_environ_of([p.pid for p in procs])
        workers = [int((tmp_path / f"ready.{r}").read_text()) for r in (0, 1)]
        _, seen["worker_environ"] = command_lines_and_environ_of(workers)
        everything, _ = command_lines_and_environ_of(psutil.pids())
        seen["all_lines"] = everything

    watcher = threading.Thread(target=look_at_processes_during_the_launch)
    watcher.start()
    before = pickling.unpickle_count
    result = slurmrun.launch(
        attacker_or_worker, (EXAMPLES, str(tmp_path)), workers_per_host=2, backend=None
    )
    watcher.join(10)
    unpickled = pickling.unpickle_count - before

    attacker, worker = result.values()
    assert attacker["violations"] == []
    assert sum(attacker["counts"].values()) == EXAMPLES
    assert all(attacker["counts"][kind] > 0 for kind in ATTACKS), attacker["counts"]
    assert worker["lines"] > 0
    assert not attacker["secret_in_env"]
    # nothing an attacker sent was unpickled: only the two results were
    assert unpickled == 2
    assert not (tmp_path / "evil_was_unpickled").exists()
    # every hostile connection was refused by the handshake, and said so
    # (in a bounded number of lines: the 1st, 10th, 100th, 1000th... and the total at the end)
    said = [r.getMessage() for r in caplog.records if "rejected before" in r.getMessage()]
    assert said[-1].startswith(f"slurmrun: {EXAMPLES} connection(s) rejected"), said
    assert len(said) <= 6, said

    (secret,) = recorded_secrets
    assert_secret_nowhere(secret, seen, worker)

    # and the next launch works as usual
    assert slurmrun.launch(lambda: 7, workers_per_host=1, backend=None).values() == [7]


def flood(port: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Garbage connections from a thread of the launcher itself, while agents connect."""
    rng = random.Random(5)
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(rng.randbytes(rng.randrange(0, 120)))
                s.shutdown(socket.SHUT_WR)
                read_to_end(s)
            counts["sent"] += 1
        except OSError:
            counts["refused"] += 1
            time.sleep(0.01)


def test_agents_connect_while_garbage_floods_the_launchers_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("SLURMRUN_LAUNCHER_PORT", str(port))
    stop = threading.Event()
    counts = {"sent": 0, "refused": 0}
    flooder = threading.Thread(target=flood, args=(port, stop, counts))
    flooder.start()
    try:
        before = pickling.unpickle_count
        result = slurmrun.launch(
            lambda: os.environ["RANK"], hostnames=["localhost", "localhost"], workers_per_host=1
        )
    finally:
        stop.set()
        flooder.join(10)
    assert result.values() == ["0", "1"]
    assert pickling.unpickle_count - before == 2
    assert counts["sent"] > 10, counts


def sleep_then_return(seconds: float) -> int:
    time.sleep(seconds)
    return int(os.environ["RANK"])


def forge_a_streamed_result(port: int, secrets: list[bytes], canary: str) -> dict[str, Any]:
    """With the real secret, sends a result for a worker that does not exist."""
    deadline = time.monotonic() + 30
    while not secrets and time.monotonic() < deadline:
        time.sleep(0.01)
    outcome: dict[str, Any] = {}
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        authentication.client_handshake(sock, secrets[0], 10)
        body = pickle.dumps(CreatesFileWhenUnpickled(canary))
        header = {"t": "result", "node_rank": 0, "local_rank": 7}
        transport.Connection(sock).send(header, body, [b"x" * (5 << 20)])
        outcome["sent"] = True
    return outcome


def test_a_streamed_result_for_a_worker_that_does_not_exist_fails_the_launch_unread(
    tmp_path: Path, recorded_secrets: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a peer that knows the secret cannot slip in a result that no worker announced."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("SLURMRUN_LAUNCHER_PORT", str(port))
    canary = str(tmp_path / "canary")
    outcome: dict[str, Any] = {}
    forger = threading.Thread(
        target=lambda: outcome.update(forge_a_streamed_result(port, recorded_secrets, canary))
    )
    forger.start()
    before = pickling.unpickle_count
    forged = r"unknown or finished worker.*local rank 7"
    with pytest.raises(slurmrun.AgentFailedError, match=forged):
        slurmrun.launch(sleep_then_return, (20,), workers_per_host=2, backend=None)
    forger.join(timeout=30)
    assert outcome.get("sent")
    assert pickling.unpickle_count == before and not os.path.exists(canary)


def test_the_canary_pickle_creates_its_file_when_unpickled(tmp_path: Path) -> None:
    """The attack's proof of unpickling works: were a frame unpickled, the file would exist."""
    path = tmp_path / "canary"
    pickle.loads(pickle.dumps(CreatesFileWhenUnpickled(str(path)))).close()
    assert path.exists()


# ---------------------------------------------------------------- the handshake, unit level


def _serve_once(sock: socket.socket, secret: bytes, outcome: dict[str, Any]) -> None:
    try:
        authentication.server_handshake(sock, secret, timeout=5)
        outcome["ok"] = True
    except authentication.AuthenticationError as e:
        outcome["error"] = e


def _recv_n(sock: socket.socket, n: int) -> bytes:
    return bytes(transport.recv_exact(sock, n))


def record_a_real_answer(secret: bytes) -> tuple[bytes, bytes]:
    """A real client and server handshake through us: returns (challenge, client answer)."""
    server_side, to_server = socket.socketpair()
    to_client, client_side = socket.socketpair()
    outcome: dict[str, Any] = {}
    server = threading.Thread(target=_serve_once, args=(server_side, secret, outcome))
    client = threading.Thread(target=authentication.client_handshake, args=(client_side, secret, 5))
    server.start()
    client.start()
    challenge = _recv_n(to_server, CHALLENGE)
    to_client.sendall(challenge)
    answer = _recv_n(to_client, ANSWER)
    to_server.sendall(answer)
    to_client.sendall(_recv_n(to_server, authentication.MAC_BYTES))
    server.join(5)
    client.join(5)
    assert outcome == {"ok": True}
    for s in (server_side, to_server, to_client, client_side):
        s.close()
    return challenge, answer


def replay(secret: bytes, answer: bytes) -> tuple[dict[str, Any], bytes]:
    server_side, attacker = socket.socketpair()
    outcome: dict[str, Any] = {}
    server = threading.Thread(target=_serve_once, args=(server_side, secret, outcome))
    server.start()
    challenge_b = _recv_n(attacker, CHALLENGE)
    attacker.sendall(answer)
    attacker.shutdown(socket.SHUT_WR)
    server.join(5)
    server_side.close()
    after = read_to_end(attacker)
    attacker.close()
    outcome["challenge"] = challenge_b
    return outcome, after


def test_a_recorded_handshake_answer_replayed_against_a_new_challenge_is_refused() -> None:
    secret = authentication.new_secret()
    challenge_a, answer = record_a_real_answer(secret)
    outcome, after = replay(secret, answer)
    assert outcome["challenge"] != challenge_a  # a fresh nonce every time
    assert isinstance(outcome.get("error"), authentication.AuthenticationError)
    assert "HMAC" in str(outcome["error"])
    assert after == b""  # the server never proved anything to the replayer


@settings(max_examples=300, deadline=None, database=None)
@given(answer=st.binary(min_size=0, max_size=ANSWER + 16))
def test_no_answer_without_the_secret_passes_the_handshake(answer: bytes) -> None:
    outcome, after = replay(authentication.new_secret(), answer)
    assert isinstance(outcome.get("error"), authentication.AuthenticationError)
    assert after == b""
