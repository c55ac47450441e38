"""The launchers' private control channel (`slurmrun.control`) and ``slurmrun stacks`` on one host.

Every test points XDG_RUNTIME_DIR at its own directory. The command-line tests run the fake
launchers and ``python -m slurmrun stacks`` in UTS namespaces of their own, all with one
hostname made for the test: launchers of other sessions on this machine (host ``vm``, in
/tmp/slurmrun-0) are then not on "this host" for them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurmrun import control
from slurmrun.control import ControlError, ControlServer, LauncherEntry, ask, launchers

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534

FAKE_LAUNCHER = textwrap.dedent(
    """
    import json, os, select, sys, time
    from slurmrun.control import ControlServer

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
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG_RUNTIME_DIR of this test (for this process and those it starts)."""
    path = tmp_path / "xdg"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    return env | {"PYTHONPATH": str(REPO)} | extra


def _in_host(host: str | None, args: list[str]) -> list[str]:
    if host is None:
        return [sys.executable, *args]
    return ["unshare", "--uts", sys.executable, "-c", IN_HOST, host, *args]


@pytest.fixture
def fake_launcher(tmp_path: Path, xdg: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``fake_launcher(what, reply, host=None, job_id="")``: a process serving a ControlServer.

    Its handler returns ``reply`` formatted with op, args (JSON) and pid. Returns once its
    socket is up; at the end every one is stopped and must have removed its files.
    """
    script = tmp_path / "fake_launcher.py"
    script.write_text(FAKE_LAUNCHER)
    started: list[subprocess.Popen[str]] = []

    def start(
        what: str, reply: str, host: str | None = None, job_id: str = ""
    ) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            _in_host(host, [str(script), what, reply]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(SLURM_JOB_ID=job_id) if job_id else _env(),
        )
        started.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        assert ready, "the fake launcher did not start its server within 10 s"
        assert proc.stdout.readline().strip() == str(xdg / "slurmrun" / f"{proc.pid}.sock")
        return proc

    yield start
    for proc in started:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
    assert list((xdg / "slurmrun").iterdir()) == []


def _stacks(
    args: list[str], host: str | None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _in_host(host, ["-m", "slurmrun", "stacks", *args]),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
        check=False,
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
    assert entry.socket == xdg / "slurmrun" / f"{proc.pid}.sock"
    assert time.time() - 10 < entry.started <= time.time()
    assert [e.pid for e in launchers("4242")] == [proc.pid]
    assert launchers("4243") == []
    assert ask(entry, "stacks", {"timeout": 3}) == f'stacks {{"timeout": 3}} from {proc.pid}'


def test_socket_and_entry_are_0600_in_a_0700_directory(fake_launcher, xdg):
    proc = fake_launcher("f", "x")
    directory = xdg / "slurmrun"
    assert _mode(directory) == 0o700
    assert _mode(directory / f"{proc.pid}.sock") == 0o600
    assert _mode(directory / f"{proc.pid}.json") == 0o600
    assert sorted(p.name for p in directory.iterdir()) == [f"{proc.pid}.json", f"{proc.pid}.sock"]


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
        assert (a.socket, b.socket) == (
            xdg / "slurmrun" / f"{os.getpid()}.sock",
            xdg / "slurmrun" / f"{os.getpid()}-1.sock",
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


@pytest.mark.parametrize("args", [["--timeout", "0"], ["12ab"], ["--pid", "x"]])
def test_stacks_bad_options_exit_2(xdg, args):
    out = _stacks(args, None)
    assert out.returncode == 2
    assert out.stderr.startswith("usage: slurmrun stacks")
