"""The launchers' private control channel (`slurmrun.stacks.control`) and ``slurmrun stacks``.

Every test points XDG_RUNTIME_DIR at its own directory. The command-line tests run the fake
launchers and ``python -m slurmrun stacks`` in UTS namespaces of their own, all with one
hostname made for the test: launchers of other sessions on this machine (host ``vm``, in
/tmp/slurmrun-0) are then not on "this host" for them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurmrun.stacks import control
from slurmrun.stacks.control import ControlError, ControlServer, LauncherEntry, ask, launchers
from slurmrun.stacks.control_dir import answers

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534

FAKE_LAUNCHER = textwrap.dedent(
    """
    import json, os, select, sys, time
    from slurmrun.stacks.control import ControlServer

    what, reply = sys.argv[1], sys.argv[2]

    def handler(op, args):
        if op == "fail":
            raise RuntimeError("asked to fail")
        return reply.format(op=op, args=json.dumps(args, sort_keys=True), pid=os.getpid())

    server = ControlServer(handler, what=what, job_id=os.environ.get("SLURM_JOB_ID", ""))
    server.start()
    print(server.socket, flush=True)
    select.select([sys.stdin], [], [], 60)  # until the test closes our stdin
    server.close()
    """
)
# Runs argv[2:] (python's arguments) in a new UTS namespace whose hostname is argv[1].
IN_HOST = (
    "import os, socket, sys; socket.sethostname(sys.argv[1]); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


@pytest.fixture
def xdg(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR of this test (for this process and those it starts).

    Under /tmp, not pytest's tmp_path: a socket's path holds 107 bytes, and pytest-xdist's
    tmp_path with a test's name and ``slurmrun/<host>-<pid>.sock`` is longer.
    """
    path = Path(tempfile.mkdtemp(prefix="xdg-", dir="/tmp"))
    path.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    return env | {"PYTHONPATH": str(REPO)} | extra


def _in_host(host: str | None, args: list[str]) -> list[str]:
    if host is None:
        return [sys.executable, *args]
    return ["unshare", "--uts", sys.executable, "-c", IN_HOST, host, *args]


@pytest.fixture
def fake_launcher(tmp_path: Path, xdg: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``fake_launcher(what, reply, host=None, job_id="", cwd=None)``: a ControlServer's process.

    Its handler returns ``reply`` formatted with op, args (JSON) and pid. Returns once its
    socket is up; at the end every one is stopped and must have removed its files.
    """
    script = tmp_path / "fake_launcher.py"
    script.write_text(FAKE_LAUNCHER)
    started: list[subprocess.Popen[str]] = []

    def start(
        what: str, reply: str, host: str | None = None, job_id: str = "", cwd: Path | None = None
    ) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            _in_host(host, [str(script), what, reply]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(SLURM_JOB_ID=job_id) if job_id else _env(),
            cwd=cwd,
        )
        started.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        assert ready, "the fake launcher did not start its server within 10 s"
        name = f"{host or socket.gethostname()}-{proc.pid}.sock"
        assert proc.stdout.readline().strip() == str(xdg / "slurmrun" / name)
        return proc

    yield start
    for proc in started:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
    assert list((xdg / "slurmrun").iterdir()) == []


def _stacks(
    args: list[str], host: str | None, timeout: float = 30, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _in_host(host, ["-m", "slurmrun", "stacks", *args]),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def _entry(pid: int) -> LauncherEntry:
    (entry,) = [e for e in launchers() if e.pid == pid]
    return entry


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --------------------------------------------------------------------------- the channel
def test_round_trip_finds_the_launcher_and_returns_its_handlers_reply(fake_launcher, xdg):
    proc = fake_launcher("train.py", "{op} {args} from {pid}", job_id="4242")
    entry = _entry(proc.pid)
    assert (entry.host, entry.job_id, entry.what) == (socket.gethostname(), "4242", "train.py")
    assert entry.socket == xdg / "slurmrun" / f"{socket.gethostname()}-{proc.pid}.sock"
    assert time.time() - 10 < entry.started <= time.time()
    assert [e.pid for e in launchers("4242")] == [proc.pid]
    assert launchers("4243") == []
    assert ask(entry, "stacks", {"timeout": 3}) == f'stacks {{"timeout": 3.0}} from {proc.pid}'


def test_socket_and_entry_are_0600_in_a_0700_directory(fake_launcher, xdg):
    proc = fake_launcher("f", "x")
    directory = xdg / "slurmrun"
    stem = f"{socket.gethostname()}-{proc.pid}"
    assert _mode(directory) == 0o700
    assert _mode(directory / f"{stem}.sock") == 0o600
    assert _mode(directory / f"{stem}.json") == 0o600
    assert sorted(p.name for p in directory.iterdir()) == [f"{stem}.json", f"{stem}.sock"]


def test_handler_exception_becomes_an_error_reply(fake_launcher):
    entry = _entry(fake_launcher("f", "fine").pid)
    with pytest.raises(ControlError, match="RuntimeError: asked to fail"):
        ask(entry, "fail")
    assert ask(entry, "stacks") == "fine"


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: (p.mkdir(mode=0o700), os.chmod(p, 0o750)), "has mode 750"),
        (lambda p: (p.mkdir(mode=0o700), os.chmod(p, 0o701)), "has mode 701"),
        (lambda p: (p.mkdir(mode=0o700), os.chown(p, NOBODY, NOBODY)), "belongs to uid 65534"),
        (lambda p: (p.with_name("to").mkdir(mode=0o700), p.symlink_to("to")), "not a directory"),
        (lambda p: p.write_text(""), "not a directory"),
    ],
    ids=["group", "others", "owner", "symlink", "file"],
)  # fmt: skip
def test_runtime_dir_refuses_a_directory_others_can_reach(xdg, make, says):
    make(xdg / "slurmrun")
    with pytest.raises(ControlError, match=says):
        control.runtime_dir()
    with pytest.raises(ControlError, match=says):
        launchers()
    server = ControlServer(lambda op, args: "", what="f")
    server.start()  # a launch goes on without its control socket
    assert server.socket is None
    server.close()


def test_runtime_dir_is_private_under_xdg_and_falls_back_to_tmp(xdg, monkeypatch):
    path = control.runtime_dir()
    assert path == xdg / "slurmrun"
    assert _mode(path) == 0o700
    os.chown(xdg, NOBODY, NOBODY)  # an XDG_RUNTIME_DIR not ours is not used
    assert control.runtime_dir(create=False) == Path(f"/tmp/slurmrun-{os.getuid()}")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert control.runtime_dir(create=False) == Path(f"/tmp/slurmrun-{os.getuid()}")


def test_start_without_a_private_directory_warns_once_and_carries_on(xdg, caplog):
    (xdg / "slurmrun").mkdir(mode=0o755)
    control._warned.clear()
    servers = [ControlServer(lambda op, args: "", what="f") for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="slurmrun"):
        for server in servers:
            server.start()
    assert [s.socket for s in servers] == [None, None]
    (record,) = caplog.records
    assert "no control socket" in record.getMessage()
    assert "has mode 755" in record.getMessage()


PEER = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(sys.argv[1])
    except OSError as e:
        sys.exit(f"refused: {type(e).__name__}")
    try:
        s.sendall(b'{"op": "stacks", "args": {}}\\n')
        print("reply:", s.recv(1000))
    except (ConnectionResetError, BrokenPipeError) as e:  # closed with our request unread
        print("reply: b''")
    """
)


def _as_nobody(sock: Path) -> str:
    python = "/usr/bin/python3"  # ours may lie where nobody cannot reach (/root/.pyenv)
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} for user nobody to run")
    out = subprocess.run(
        [python, "-c", PEER, str(sock)],
        user=NOBODY,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return (out.stdout + out.stderr).strip()


@pytest.fixture
def open_xdg(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An XDG_RUNTIME_DIR that others can traverse (pytest's basetemp is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="slurmrun-test-xdg-", dir="/tmp"))
    path.chmod(0o711)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path)


def test_a_peer_of_another_uid_gets_nothing(open_xdg):
    replies: list[str] = []
    with ControlServer(lambda op, args: replies.append(op) or "secret", what="f") as server:
        assert server.socket is not None
        assert _as_nobody(server.socket) == "refused: PermissionError"  # the 0700 directory
        # Should the modes not keep it out (a filesystem that ignores them): SO_PEERCRED does.
        os.chmod(server.socket.parent, 0o711)
        os.chmod(server.socket, 0o666)
        assert _as_nobody(server.socket) == "reply: b''"
        assert replies == []
        os.chmod(server.socket.parent, 0o700)
        assert ask(_entry(os.getpid()), "stacks") == "secret"


def _raw(sock: Path, data: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sock))
        with contextlib.suppress(BrokenPipeError):  # it stopped reading; its reply is there
            s.sendall(data)
        reply = b""
        while chunk := s.recv(1 << 16):
            reply += chunk
    return dict(json.loads(reply))


@pytest.mark.parametrize(
    ("request_bytes", "error"),
    [
        (b"x" * (control.MAX_REQUEST + 1) + b"\n", "request longer than 65536 bytes"),
        (b"y" * (4 * control.MAX_REQUEST), "request longer than 65536 bytes"),
        (b"{not json\n", "garbled request: not a JSON line"),
        (b'["stacks"]\n', "garbled request"),
        (b'{"op": 3, "args": {}}\n', "garbled request"),
        (b'{"op": "stacks", "args": [1]}\n', "garbled request"),
        (b"\xff\xfe\n", "garbled request"),
    ],
    ids=["long-line", "no-newline", "not-json", "list", "op-int", "args-list", "not-utf8"],
)
def test_oversize_or_garbled_request_gets_an_error_reply_and_the_server_goes_on(
    xdg, request_bytes, error
):
    with ControlServer(lambda op, args: f"{op} {args}", what="f") as server:
        assert server.socket is not None
        reply = _raw(server.socket, request_bytes)
        assert reply["ok"] is False
        assert error in reply["error"]
        assert _raw(server.socket, b'{"op": "stacks", "args": {"a": 1}}\n') == {
            "ok": True,
            "text": "stacks {'a': 1}",
        }


def test_a_silent_client_does_not_keep_others_from_an_answer(xdg):
    with (
        ControlServer(lambda op, args: "answer", what="f") as server,
        socket.socket(socket.AF_UNIX) as silent,
    ):
        assert server.socket is not None
        silent.connect(str(server.socket))
        assert ask(_entry(os.getpid()), "stacks", timeout=2) == "answer"


def test_a_silent_client_gets_an_error_after_the_read_timeout(xdg, monkeypatch):
    monkeypatch.setattr(control, "READ_TIMEOUT", 0.3)
    with (
        ControlServer(lambda op, args: "answer", what="f") as server,
        socket.socket(socket.AF_UNIX) as silent,
    ):
        assert server.socket is not None
        silent.connect(str(server.socket))
        silent.settimeout(5)
        started = time.monotonic()
        reply = json.loads(silent.recv(1000))
        assert 0.2 < time.monotonic() - started < 2
        assert reply == {"ok": False, "error": "no request in 0.3 s"}


def test_a_launcher_slower_than_the_timeout_gives_a_clear_error(xdg):
    with ControlServer(lambda op, args: time.sleep(2) or "late", what="f"):
        started = time.monotonic()
        with pytest.raises(ControlError, match=r"did not answer within 0\.5 s"):
            ask(_entry(os.getpid()), "stacks", timeout=0.5)
        assert time.monotonic() - started < 1.5


def test_stale_entry_of_a_dead_pid_is_removed_and_other_hosts_kept(xdg):
    directory = control.runtime_dir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, host in (("stale", socket.gethostname()), ("remote", "node9")):
        entry = {"pid": dead.pid, "host": host, "job_id": "", "started": 1.0, "what": name}
        (directory / f"{name}.json").write_text(json.dumps(entry))
        (directory / f"{name}.sock").write_text("")
    assert [e for e in launchers() if e.pid == dead.pid] == []
    assert sorted(p.name for p in directory.iterdir()) == ["remote.json", "remote.sock"]


def test_close_removes_its_files_is_idempotent_and_ask_then_says_it_ended(xdg):
    server = ControlServer(lambda op, args: "up", what="f")
    server.start()
    entry = _entry(os.getpid())
    assert ask(entry, "stacks") == "up"
    server.close()
    server.close()
    assert list(control.runtime_dir().iterdir()) == []
    assert [e for e in launchers() if e.pid == os.getpid()] == []
    with pytest.raises(ControlError, match="it probably ended"):
        ask(entry, "stacks")


def test_two_servers_of_one_process_each_get_a_socket(xdg):
    with (
        ControlServer(lambda op, args: "one", what="a") as a,
        ControlServer(lambda op, args: "two", what="b") as b,
    ):
        stem = f"{socket.gethostname()}-{os.getpid()}"
        assert (a.socket, b.socket) == (
            xdg / "slurmrun" / f"{stem}.sock",
            xdg / "slurmrun" / f"{stem}-1.sock",
        )
        mine = {e.what: ask(e, "x") for e in launchers() if e.pid == os.getpid()}
        assert mine == {"a": "one", "b": "two"}


# --------------------------------------------------------------------------- slurmrun stacks
@pytest.fixture
def host() -> str:
    return f"ctl-{uuid.uuid4().hex[:8]}"


def test_stacks_prints_the_launchers_reply(fake_launcher, host):
    proc = fake_launcher("train.py", "rank 0: main <- {op} {args}", host=host)
    out = _stacks(["--timeout", "7"], host)
    assert (out.returncode, out.stderr) == (0, ""), out
    assert out.stdout == 'rank 0: main <- stacks {"timeout": 7.0}\n'
    assert proc.poll() is None


def test_stacks_without_a_launcher_says_so_and_exits_1(xdg, host):
    out = _stacks([], host)
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == (
        f"slurmrun stacks: error: no slurmrun launch of yours runs on this host ({host}); "
        "for a submitted job, pass its id: slurmrun stacks JOB_ID\n"
    )


def test_stacks_asks_every_launcher_or_the_pid_given(fake_launcher, host):
    first = fake_launcher("first.py", "stacks of {pid}", host=host)
    second = fake_launcher("second_func", "stacks of {pid}", host=host)
    both = _stacks([], host)
    assert both.returncode == 0, both
    lines = both.stdout.splitlines()
    assert [line.split(",")[0] for line in lines[::2]] == [
        f"=== launcher pid {second.pid}: second_func",  # newest first
        f"=== launcher pid {first.pid}: first.py",
    ]
    assert lines[1::2] == [f"stacks of {second.pid}", f"stacks of {first.pid}"]
    one = _stacks(["--pid", str(first.pid)], host)
    assert (one.returncode, one.stdout) == (0, f"stacks of {first.pid}\n")
    missing = _stacks(["--pid", "1"], host)
    assert missing.returncode == 1
    assert "no slurmrun launch of yours has pid 1" in missing.stderr
    assert f"{first.pid} (first.py)" in missing.stderr


def test_stacks_of_a_job_asks_its_launcher_on_this_host(fake_launcher, host):
    fake_launcher("train.py", "job launcher", host=host, job_id="777")
    fake_launcher("other.py", "not this one", host=host, job_id="778")
    out = _stacks(["777"], host)
    assert (out.returncode, out.stdout) == (0, "job launcher\n"), out
    here = _stacks(["779", "--here"], host)
    assert here.returncode == 1
    assert f"no slurmrun launch of job 779 runs on {host}" in here.stderr


@pytest.mark.parametrize("args", [["--timeout", "0"], ["12ab"], ["--pid", "x"],
                                  ["--all", "--pid", "12"]])  # fmt: skip
def test_stacks_bad_options_exit_2(xdg, args):
    out = _stacks(args, None)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: slurmrun stacks")


@pytest.mark.parametrize("seconds", ["inf", "nan", "-1", "0", "1e300", "301", "x"])
def test_stacks_refuses_a_timeout_it_cannot_wait_before_asking(fake_launcher, host, seconds):
    fake_launcher("train.py", "never asked", host=host)
    out = _stacks(["--timeout", seconds], host)
    assert (out.returncode, out.stdout) == (2, ""), out
    assert out.stderr.endswith(
        f"slurmrun stacks: error: argument --timeout: expected a number of seconds > 0 and at "
        f"most 300, got {seconds!r}\n"
    )


# --------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0, 0.0, 1e300])
def test_ask_refuses_a_timeout_that_is_not_a_number_of_seconds(xdg, bad):
    with ControlServer(lambda op, args: "answer", what="f"):
        entry = _entry(os.getpid())
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds > 0"):
            ask(entry, "stacks", timeout=bad)
        assert ask(entry, "stacks") == "answer"


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "-1", "0", '"5"', "true", "null"])
def test_a_request_timeout_that_is_not_a_number_of_seconds_gets_an_error_reply(xdg, bad):
    seen: list[dict[str, Any]] = []
    with ControlServer(lambda op, args: seen.append(args) or "answer", what="f") as server:
        assert server.socket is not None
        reply = _raw(server.socket, b'{"op": "stacks", "args": {"timeout": %s}}\n' % bad.encode())
        assert reply["ok"] is False
        assert reply["error"].startswith("the request's timeout must be a number of seconds > 0")
        assert seen == []
        assert _raw(server.socket, b'{"op": "stacks", "args": {"timeout": 1e9}}\n')["ok"]
        assert _raw(server.socket, b'{"op": "stacks", "args": {"timeout": 2}}\n')["ok"]
        assert seen == [{"timeout": control.MAX_WAIT}, {"timeout": 2}]


def test_a_client_over_the_limit_gets_the_busy_reply(xdg):
    release = threading.Event()
    answering = threading.Semaphore(0)

    def handler(op: str, args: dict[str, Any]) -> str:
        answering.release()
        release.wait(20)
        return "late answer"

    replies: list[str] = []
    with ControlServer(handler, what="f") as server:
        assert server.socket is not None
        entry = _entry(os.getpid())
        threads = [
            threading.Thread(target=lambda: replies.append(ask(entry, "stacks", timeout=30)))
            for _ in range(control.MAX_ANSWERING)
        ]
        for thread in threads:
            thread.start()
        try:
            for _ in threads:
                assert answering.acquire(timeout=10)
            busy = "busy: 16 requests are being answered; try again"
            assert _raw(server.socket, b'{"op": "stacks", "args": {}}\n') == {
                "ok": False,
                "error": busy,
            }
            with pytest.raises(ControlError, match=busy):
                ask(entry, "stacks", timeout=5)
        finally:
            release.set()
            for thread in threads:
                thread.join(10)
    assert replies == ["late answer"] * control.MAX_ANSWERING


def test_a_request_trickled_a_byte_at_a_time_gets_the_read_deadline_and_holds_no_slot(
    xdg, monkeypatch
):
    monkeypatch.setattr(control, "READ_TIMEOUT", 1.0)
    with ControlServer(lambda op, args: "answer", what="f") as server:
        assert server.socket is not None
        trickles = [socket.socket(socket.AF_UNIX) for _ in range(control.MAX_ANSWERING + 4)]
        try:
            for s in trickles:
                s.connect(str(server.socket))
            started = time.monotonic()
            replies: dict[int, tuple[float, bytes]] = {}
            asked = False
            while len(replies) < len(trickles) and time.monotonic() - started < 4:
                for i, s in enumerate(trickles):
                    with contextlib.suppress(OSError):
                        s.send(b" ")  # well within READ_TIMEOUT of the last byte
                    if i not in replies and select.select([s], [], [], 0)[0]:
                        replies[i] = (time.monotonic() - started, s.recv(1000))
                if not asked and time.monotonic() - started > 0.3:
                    assert ask(_entry(os.getpid()), "stacks", timeout=2) == "answer"
                    asked = True
                time.sleep(0.2)
        finally:
            for s in trickles:
                s.close()
    assert asked
    assert sorted(replies) == list(range(len(trickles)))
    for seconds, reply in replies.values():
        assert 0.8 < seconds < 2.5
        assert json.loads(reply) == {"ok": False, "error": "no request in 1 s"}


# --------------------------------------------------------------------------- socket names
def _listening(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.listen()
    return s


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def test_the_socket_is_named_by_host_and_pid_and_another_hosts_live_socket_is_left_alone(xdg):
    # A launcher of node9 with our pid, on a /tmp that the nodes share.
    directory = control.runtime_dir()
    pid = os.getpid()
    theirs = [directory / f"{pid}.sock", directory / f"node9-{pid}.sock"]
    entry = {"pid": pid, "host": "node9", "job_id": "", "started": 1.0, "what": "theirs"}
    (directory / f"node9-{pid}.json").write_text(json.dumps(entry))
    listeners = [_listening(path) for path in theirs]
    try:
        with ControlServer(lambda op, args: "ours", what="f") as server:
            assert server.socket == directory / f"{socket.gethostname()}-{pid}.sock"
            assert [e.what for e in launchers() if e.pid == pid] == ["f"]
            assert ask(_entry(pid), "stacks") == "ours"
        assert all(_answers(path) for path in theirs)
        assert sorted(p.name for p in directory.iterdir()) == sorted(
            [f"{pid}.sock", f"node9-{pid}.sock", f"node9-{pid}.json"]
        )
    finally:
        for listener in listeners:
            listener.close()


def test_a_live_socket_where_ours_would_be_is_never_removed_a_stale_one_is(xdg):
    # A process of another pid namespace with our pid, or a launcher that lost its entry.
    directory = control.runtime_dir()
    stem = f"{socket.gethostname()}-{os.getpid()}"
    live = _listening(directory / f"{stem}.sock")
    try:
        with ControlServer(lambda op, args: "ours", what="f") as server:
            assert server.socket == directory / f"{stem}-1.sock"
            assert ask(_entry(os.getpid()), "stacks") == "ours"
        assert _answers(directory / f"{stem}.sock")
    finally:
        live.close()  # its file stays: stale now
    with ControlServer(lambda op, args: "ours", what="f") as server:
        assert server.socket == directory / f"{stem}.sock"
        assert ask(_entry(os.getpid()), "stacks") == "ours"


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
def test_an_xdg_runtime_dir_that_others_can_write_is_not_used(xdg, mode):
    os.chmod(xdg, mode)
    assert control.runtime_dir(create=False) == Path(f"/tmp/slurmrun-{os.getuid()}")
    assert not (xdg / "slurmrun").exists()


# --------------------------------------------------------------------------- whose launches
def test_stacks_asks_the_launches_started_from_this_directory_and_counts_the_others(
    fake_launcher, host, tmp_path
):
    a, b, c = (tmp_path / name for name in ("a", "b", "c"))
    for folder in (a, b, c):
        folder.mkdir()
    first = fake_launcher("a1.py", "stacks of {pid}", host=host, cwd=a)
    second = fake_launcher("a2.py", "stacks of {pid}", host=host, cwd=a)
    third = fake_launcher("b.py", "stacks of {pid}", host=host, cwd=b)

    from_a = _stacks([], host, cwd=a)
    assert from_a.returncode == 0, from_a
    shown = [line for line in from_a.stdout.splitlines() if not line.startswith("=== ")]
    assert shown == [f"stacks of {second.pid}", f"stacks of {first.pid}"]
    assert from_a.stderr == (
        "slurmrun stacks: 1 other launch of yours runs on this host, started from another "
        "directory and terminal: slurmrun stacks --all asks it too\n"
    )
    from_b = _stacks([], host, cwd=b)
    assert (from_b.returncode, from_b.stdout) == (0, f"stacks of {third.pid}\n"), from_b
    assert "2 other launches of yours run on this host" in from_b.stderr

    every = _stacks(["--all"], host, cwd=b)
    assert (every.returncode, every.stderr) == (0, ""), every
    shown = [line for line in every.stdout.splitlines() if not line.startswith("=== ")]
    assert shown == [f"stacks of {p.pid}" for p in (third, second, first)]

    elsewhere = _stacks([], host, cwd=c)
    assert (elsewhere.returncode, elsewhere.stdout) == (1, ""), elsewhere
    assert elsewhere.stderr.startswith(
        f"slurmrun stacks: error: no slurmrun launch of yours on this host ({host}) was "
        f"started from {c} or this terminal; 3 others run: "
    )
    for proc, folder in ((first, a), (second, a), (third, b)):
        assert f"{proc.pid} (" in elsewhere.stderr
        assert f"in {folder})" in elsewhere.stderr
    assert "--pid PID asks one, --all every one" in elsewhere.stderr
    one = _stacks(["--pid", str(third.pid)], host, cwd=c)
    assert (one.returncode, one.stdout, one.stderr) == (0, f"stacks of {third.pid}\n", "")


TERMINAL = textwrap.dedent(
    """
    import json, os, subprocess, sys
    tty, script, started_in, asked_from = sys.argv[1:]
    os.setsid()
    os.close(os.open(tty, os.O_RDWR))  # our controlling terminal from now on
    launcher = subprocess.Popen(
        [sys.executable, script, "term.py", "stacks of {pid}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=started_in,
    )
    launcher.stdout.readline()
    out = subprocess.run(
        [sys.executable, "-m", "slurmrun", "stacks"],
        capture_output=True, text=True, cwd=asked_from, timeout=30,
    )
    launcher.stdin.close()
    launcher.wait(10)
    print(json.dumps([launcher.pid, out.returncode, out.stdout, out.stderr]))
    """
)


def test_stacks_asks_the_launches_of_this_terminal_wherever_they_were_started(
    fake_launcher, host, tmp_path
):
    a, b, c = (tmp_path / name for name in ("a", "b", "c"))
    for folder in (a, b, c):
        folder.mkdir()
    fake_launcher("b.py", "stacks of {pid}", host=host, cwd=b)  # not in the terminal
    master, slave = os.openpty()
    try:
        out = subprocess.run(
            _in_host(host, ["-c", TERMINAL, os.ttyname(slave), str(tmp_path / "fake_launcher.py"),
                            str(a), str(c)]),
            capture_output=True, text=True, env=_env(), timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(slave)
        os.close(master)
    assert out.returncode == 0, out
    pid, status, stdout, stderr = json.loads(out.stdout)
    assert (status, stdout) == (0, f"stacks of {pid}\n"), stderr
    assert "1 other launch of yours runs on this host" in stderr


def test_a_socket_path_too_long_to_exist_is_no_live_socket() -> None:
    # No socket can be there: the name is free (binding it then fails, and says so), not
    # "held by a live process" (every name was, and the launcher said so wrongly).
    assert not answers(Path("/tmp") / ("x" * 120))
