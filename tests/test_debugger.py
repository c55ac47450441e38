"""``breakpoint()`` in a rank opens pdb in the launcher's terminal: driven through a real pty.

Each test starts a launcher (the ``slurmrun`` command, or a script calling `slurmrun.launch`)
in a pseudo-terminal with pexpect and types into it as a person would.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import termios
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pexpect
import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
LIMIT = 60


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = str(REPO)
    env["SLURMRUN_LOG_DIR"] = str(tmp_path / "logs")
    env.pop("PYTHONBREAKPOINT", None)
    return env


_spawned: list[pexpect.spawn] = []


def _spawn(tmp_path: Path, *args: str) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable,
        list(args),
        cwd=str(tmp_path),
        env=_env(tmp_path),
        encoding="utf-8",
        timeout=LIMIT,
        dimensions=(40, 200),
    )
    child.logfile_read = open(tmp_path / "terminal.txt", "w")  # noqa: SIM115 - closed by pexpect
    _spawned.append(child)
    return child


def _slurmrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``slurmrun`` command without a terminal (stdin empty)."""
    return subprocess.run(
        [sys.executable, "-m", "slurmrun", *args],
        cwd=tmp_path,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
    )


def _finish(child: pexpect.spawn) -> int:
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus is not None, child.signalstatus
    return child.exitstatus


@pytest.fixture(autouse=True)
def _children() -> Iterator[list[pexpect.spawn]]:
    """What a failed test left running is ended (the launcher stops its workers)."""
    yield _spawned
    while _spawned:
        child = _spawned.pop()
        if child.isalive():
            child.kill(signal.SIGTERM)
            child.close(force=True)


def _none_left_in(tmp_path: Path) -> None:
    """No process of the launch is left: none runs in its directory (workers and agents do)."""
    time.sleep(0.5)  # what was stopped last has a moment to go
    left = []
    for p in psutil.process_iter(["pid", "status", "cwd", "cmdline"]):
        if p.info["pid"] == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if p.info["cwd"] and Path(p.info["cwd"]).is_relative_to(tmp_path):
            left.append(p.info["cmdline"])
    assert not left, left


SCRIPT = """
import os
rank = int(os.environ["RANK"])
some_local = {"rank": rank, "value": rank * 10 + 7}
if rank == 1:
    breakpoint()
    some_local["after"] = "continued"
    for _ in range(3):
        breakpoint()  # (told once)
print(f"rank {rank} finished with {some_local}", flush=True)
"""


def test_breakpoint_in_rank_1_of_a_script_opens_pdb_in_the_terminal(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    child = _spawn(tmp_path, "-m", "slurmrun", "--workers-per-host", "2", "script.py")
    child.expect(r"-> some_local\[\"after\"\] = \"continued\"")
    child.expect_exact("(Pdb) [localhost rank 1] ")
    child.sendline("p some_local['value']")
    child.expect(r"\r\n17\r\n")
    child.expect_exact("(Pdb) [localhost rank 1] ")
    child.sendline("p rank, __name__")
    child.expect_exact("(1, '__main__')")
    # Meanwhile, from another terminal: rank 1 is where it stopped, not inside pdb.
    other = _slurmrun(tmp_path, "stacks")
    assert other.returncode == 0, other.stderr
    assert "rank 1 (localhost): working: <module> (script.py:7)\n" in other.stdout, other.stdout
    assert "Thread MainThread (in pdb) (most recent call last):" in other.stdout, other.stdout
    child.sendline("c")
    for _ in range(3):
        child.expect_exact("(Pdb) [localhost rank 1] ")
        child.sendline("c")
    assert _finish(child) == 0
    # Rank 0 (shown in the terminal) ran on; rank 1 went on after `c` (its log file).
    text = (tmp_path / "terminal.txt").read_text()
    assert "rank 0 finished with {'rank': 0, 'value': 7}" in text
    logs = list((tmp_path / "logs").glob("*/*1.log")) + list((tmp_path / "logs").glob("*/*/*1*"))
    assert any("'after': 'continued'" in p.read_text() for p in logs if p.is_file()), logs
    _none_left_in(tmp_path)


DRIVER = """
import slurmrun

def work(tag):
    import os
    rank = int(os.environ["RANK"])
    mine = f"{tag}-{rank}"
    breakpoint()
    return mine

with slurmrun.Launcher(workers_per_host=2, backend="gloo") as launcher:
    print("first", launcher.run(work, ("a",)).return_values, flush=True)
    print("second", launcher.run(work, ("b",)).return_values, flush=True)
"""


def test_two_ranks_at_breakpoints_take_turns_in_a_warm_launcher(tmp_path: Path) -> None:
    # Function mode and a warm launcher: both ranks stop; the second waits for the first
    # session to end (the launcher says so), then gets the terminal; again in the next run.
    (tmp_path / "driver.py").write_text(DRIVER)
    child = _spawn(tmp_path, "driver.py")
    for tag in ("a", "b"):
        child.expect(r"\(Pdb\) \[localhost rank (\d)\] ")
        first = int(child.match.group(1))
        child.expect_exact(f"localhost rank {1 - first} stopped at a breakpoint too")
        child.sendline("p mine")
        child.expect_exact(f"'{tag}-{first}'")
        child.sendline("c")
        child.expect_exact(f"(Pdb) [localhost rank {1 - first}] ")
        child.sendline("p mine")
        child.expect_exact(f"'{tag}-{1 - first}'")
        child.sendline("c")
        expected = "first" if tag == "a" else "second"
        child.expect_exact(f"{expected} [['{tag}-0', '{tag}-1']]")
    assert _finish(child) == 0
    _none_left_in(tmp_path)


LISTED_DRIVER = """
import slurmrun


def work():
    before = "a line pdb lists"
    breakpoint()
    return before  # the line pdb stops at


if __name__ == "__main__":
    print("returned", slurmrun.launch(work, workers_per_host=1, backend=None).values())
"""


def test_pdb_in_a_function_of_the_driver_script_names_and_lists_its_source(
    tmp_path: Path,
) -> None:
    # The function is pickled by value (cloudpickle 3 renames its file "<dynamic-code>"):
    # pdb must still show the script's path and line, and `l`/`ll` its source.
    driver = tmp_path / "driver.py"
    driver.write_text(LISTED_DRIVER)
    child = _spawn(tmp_path, "driver.py")
    child.expect_exact(f"> {driver}(8)work()")
    child.expect_exact("(Pdb) [localhost rank 0] ")
    child.sendline("l")
    child.expect(r"  6  \s+before = \"a line pdb lists\"")
    child.expect(r"  8  ->\s+return before  # the line pdb stops at")
    child.expect_exact("(Pdb) [localhost rank 0] ")
    child.sendline("ll")
    child.expect(r"  5  \s+def work\(\):")
    child.expect_exact("(Pdb) [localhost rank 0] ")
    child.sendline("c")
    child.expect_exact("returned ['a line pdb lists']")
    assert _finish(child) == 0
    _none_left_in(tmp_path)


def test_ctrl_c_during_a_session_ends_the_run(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    child = _spawn(tmp_path, "-m", "slurmrun", "--workers-per-host", "2", "script.py")
    child.expect_exact("(Pdb) [localhost rank 1] ")
    child.send("p some")  # (a line in the editing: readline has the terminal in its mode)
    time.sleep(0.2)
    child.sendintr()
    child.expect(pexpect.EOF)
    modes = termios.tcgetattr(child.child_fd)[3]  # the terminal is given back as it was
    assert modes & termios.ICANON and modes & termios.ECHO, modes
    assert _finish(child) == 130
    _none_left_in(tmp_path)


def test_without_a_terminal_a_breakpoint_is_reported_and_the_rank_goes_on(
    tmp_path: Path,
) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    cp = _slurmrun(tmp_path, "--workers-per-host", "2", "script.py")
    assert cp.returncode == 0, cp.stderr
    assert cp.stderr.count("localhost rank 1 stopped at a breakpoint (") == 1, cp.stderr
    assert "script.py(7)<module>()" in cp.stderr
    assert "this launch has no terminal to debug in" in cp.stderr


def test_processes_that_a_worker_started_are_told_they_cannot_debug(tmp_path: Path) -> None:
    # A fork (a DataLoader worker) holds the worker's connection, a new program does not:
    # neither may open a session.
    script = textwrap.dedent(
        """
        import os, subprocess, sys
        if os.environ["RANK"] == "0":
            code = "breakpoint(); print('child went on')"
            subprocess.run([sys.executable, "-c", code], check=True)
            pid = os.fork()
            if pid == 0:
                breakpoint()
                print("fork went on", flush=True)
                os._exit(0)
            assert os.waitpid(pid, 0)[1] == 0
        """
    )
    (tmp_path / "script.py").write_text(script)
    cp = _slurmrun(tmp_path, "--workers-per-host", "1", "script.py")
    assert cp.returncode == 0, cp.stderr
    # (a line that reaches the agent in two reads is drawn twice, as a progress bar would be)
    told = set(re.findall(r"in process (\d+) ignored: only a worker process itself", cp.stderr))
    assert len(told) == 2, cp.stderr
    assert "child went on" in cp.stdout
    assert "fork went on" in cp.stdout


def test_pythonbreakpoint_0_is_kept_and_slurmrun_breakpoint_still_stops(tmp_path: Path) -> None:
    # The user's PYTHONBREAKPOINT=0 reaches the workers (PYTHON* is passed on): breakpoint()
    # does nothing there, while slurmrun.breakpoint() asks for a session all the same.
    (tmp_path / "script.py").write_text(
        textwrap.dedent(
            """
            import os, slurmrun
            breakpoint()
            if os.environ["RANK"] == "0":
                seen = os.environ["PYTHONBREAKPOINT"]
                slurmrun.breakpoint()
                print("after the session", flush=True)
            """
        )
    )
    env = _env(tmp_path) | {"PYTHONBREAKPOINT": "0"}
    child = pexpect.spawn(
        sys.executable,
        ["-m", "slurmrun", "--workers-per-host", "2", "script.py"],
        cwd=str(tmp_path),
        env=env,
        encoding="utf-8",
        timeout=LIMIT,
    )
    _spawned.append(child)
    child.expect_exact("(Pdb) [localhost rank 0] ")
    child.sendline("p seen")
    child.expect_exact("'0'")
    child.sendline("c")
    child.expect_exact("after the session")
    assert _finish(child) == 0
    assert "rank 1" not in child.before


def test_slurmrun_breakpoint_outside_a_launch_is_plain_pdb(tmp_path: Path) -> None:
    code = "import slurmrun\nx = 41 + 1\nslurmrun.breakpoint()\nprint('went on', x)\n"
    child = _spawn(tmp_path, "-c", code)
    child.expect_exact("(Pdb) ")
    child.sendline("p x")
    child.expect_exact("42")
    child.sendline("c")
    child.expect_exact("went on 42")
    assert _finish(child) == 0


KEPT_DRIVER = """
import os, sys
import slurmrun

def stop_here():
    breakpoint()
    return os.getpid()

def never_calls_breakpoint():
    x = 1
    y = x + 1  # line 11: run 1 sets a breakpoint here
    return sys.gettrace() is None, y, os.getpid()

with slurmrun.Launcher(workers_per_host=1, backend=None, keep_workers=True) as launcher:
    pid = launcher.run(stop_here).rank(0)
    print("first ended", flush=True)
    untraced, y, same = launcher.run(never_calls_breakpoint).rank(0)
    print("second", untraced, y, same == pid, flush=True)  # (the same kept worker)
"""


def test_a_breakpoint_set_in_one_run_of_a_kept_worker_is_gone_in_the_next(
    tmp_path: Path,
) -> None:
    # `b driver.py:11` in run 1, then `c`: run 2 of the same (kept) worker calls that line
    # without any breakpoint(), and must neither stop there nor run under pdb's trace.
    driver = tmp_path / "driver.py"
    driver.write_text(KEPT_DRIVER)
    assert "line 11" in KEPT_DRIVER.splitlines()[10]
    child = _spawn(tmp_path, str(driver))
    child.expect_exact("(Pdb) [localhost rank 0] ")
    child.sendline(f"b {driver}:11")
    child.expect_exact(f"Breakpoint 1 at {driver}:11")
    child.expect_exact("(Pdb) [localhost rank 0] ")
    child.sendline("c")
    child.expect_exact("first ended")
    seen = child.expect_exact(["second True 2 True", "(Pdb) [localhost rank 0] "])
    assert seen == 0, f"run 2 stopped in pdb, or ran traced: {child.before[-300:]!r}"
    assert _finish(child) == 0
    _none_left_in(tmp_path)


LINGERING_DRIVER = """
import threading, time
import slurmrun

def leave_a_thread_in_pdb():
    entered = threading.Event()

    def lingering():
        where = "thread-of-run-1"
        entered.set()
        breakpoint()

    threading.Thread(target=lingering, daemon=True).start()
    entered.wait()
    time.sleep(1.0)  # (it is waiting for its line in pdb)
    return "first"

def stop_in_run_2():
    where = "main-of-run-2"
    breakpoint()
    return "second"

with slurmrun.Launcher(workers_per_host=1, backend=None, keep_workers=True) as launcher:
    print("first", launcher.run(leave_a_thread_in_pdb).rank(0), flush=True)
    print("second", launcher.run(stop_in_run_2).rank(0), flush=True)
"""


def test_a_pdb_left_waiting_by_one_run_takes_no_line_typed_in_the_next(tmp_path: Path) -> None:
    # Run 1 ends while a thread of its kept worker waits in pdb for a line; every line
    # typed in run 2's session must reach run 2's pdb, never the thread left from run 1.
    (tmp_path / "driver.py").write_text(LINGERING_DRIVER)
    child = _spawn(tmp_path, "driver.py")
    child.expect_exact("first first")
    for _ in range(6):
        child.expect_exact("(Pdb) [localhost rank 0] ")
        child.sendline("p where")
        seen = child.expect_exact(["'main-of-run-2'", "'thread-of-run-1'"])
        assert seen == 0, "a line typed in run 2 went to the pdb that run 1 left"
    child.expect_exact("(Pdb) [localhost rank 0] ")
    child.sendline("c")
    child.expect_exact("second second")
    assert _finish(child) == 0
    _none_left_in(tmp_path)


# ---------------------------------------------------------------- job control of a shell

SHELL_PROMPT = "shell-ready$ "


def _shell(tmp_path: Path) -> pexpect.spawn:
    """An interactive bash (job control on) in a pty, as a person's terminal has."""
    env = _env(tmp_path) | {"PS1": SHELL_PROMPT, "PROMPT_COMMAND": ""}
    child = pexpect.spawn(
        "bash",
        ["--norc", "--noprofile", "-i"],
        cwd=str(tmp_path),
        env=env,
        encoding="utf-8",
        timeout=LIMIT,
        dimensions=(40, 200),
    )
    child.logfile_read = open(tmp_path / "terminal.txt", "w")  # noqa: SIM115 - closed by pexpect
    _spawned.append(child)
    child.expect_exact(SHELL_PROMPT)
    return child


def _exit_code(shell: pexpect.spawn, job: str) -> int:
    shell.sendline(f"wait {job}; echo exit-code=$?")
    shell.expect(r"exit-code=(\d+)")
    return int(shell.match.group(1))


def _wait_for_file_text(path: Path, text: str, within: float) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        seen = path.read_text() if path.exists() else ""
        if text in seen:
            return seen
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} within {within} s: {seen[-600:]!r}")


def test_a_launcher_in_the_background_of_a_shell_lets_a_stopped_rank_go_on(
    tmp_path: Path,
) -> None:
    # `python train.py > log &`: stdin is still the terminal, but the shell owns it. The
    # launcher must not read it (the prompt would go to the log, and reading stops it with
    # SIGTTIN once the person types in the shell): it says where the rank stopped, as a
    # batch job's does, and the run goes on while the person works in the shell.
    (tmp_path / "script.py").write_text(SCRIPT)
    shell = _shell(tmp_path)
    shell.sendline(f"{sys.executable} -m slurmrun --workers-per-host 2 script.py > out.txt 2>&1 &")
    shell.expect_exact(SHELL_PROMPT)
    shell.sendline("echo typed-in-the-shell")
    shell.expect_exact("typed-in-the-shell")
    out = _wait_for_file_text(tmp_path / "out.txt", "stopped at a breakpoint", 30)
    assert _exit_code(shell, "%1") == 0, out
    out = (tmp_path / "out.txt").read_text()
    assert out.count("localhost rank 1 stopped at a breakpoint (") == 1, out
    assert "script.py(7)<module>()" in out, out
    assert "runs in the background of its terminal" in out, out
    assert "(Pdb)" not in out, out
    shell.sendline("exit")
    _finish(shell)
    _none_left_in(tmp_path)


STOPPED_DRIVER = """
import time
import slurmrun

def work():
    print("working", flush=True)
    time.sleep(6)
    return "done"

print(slurmrun.launch(work, workers_per_host=1, backend=None, heartbeat_timeout=1.5).rank(0))
"""


def test_a_launcher_stopped_with_ctrl_z_longer_than_heartbeat_timeout_finishes_after_fg(
    tmp_path: Path,
) -> None:
    # Ctrl-Z stops the launcher (its heartbeats too) for longer than heartbeat_timeout, the
    # person runs something else, then fg: the agents, alive all along, must not have given
    # up on it, nor may the launcher blame them for the silence it did not read.
    (tmp_path / "driver.py").write_text(STOPPED_DRIVER)
    shell = _shell(tmp_path)
    shell.sendline(f"{sys.executable} driver.py")
    shell.expect_exact("working")
    time.sleep(0.3)
    shell.sendcontrol("z")
    shell.expect_exact(SHELL_PROMPT)
    shell.sendline("sleep 4; fg")  # 2.7 x heartbeat_timeout
    index = shell.expect_exact(["done", "Error"])
    assert index == 0, shell.before[-600:]
    shell.expect_exact(SHELL_PROMPT)
    shell.sendline("echo exit-code=$?")
    shell.expect(r"exit-code=(\d+)")
    assert shell.match.group(1) == "0"
    shell.sendline("exit")
    _finish(shell)
    _none_left_in(tmp_path)
