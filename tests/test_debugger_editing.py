"""The remote pdb's prompt is a local pdb's: readline editing, history, Tab answered by the rank.

Driven through a real pty with pexpect, typing keys as a person does (arrows are the escape
sequences a terminal sends). See tests/test_debugger.py for the launcher under a pty.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pexpect

from slurmrun.launcher.console import CompletionWanted
from tests.test_debugger import (  # noqa: F401 - _children: the autouse fixture ending launchers
    _children,
    _finish,
    _none_left_in,
    _spawn,
)

UP, LEFT = "\x1b[A", "\x1b[D"
QUICK = 10  # seconds for what follows a key at once (a launch's start has LIMIT)

SCRIPT = """
import os, time
rank = int(os.environ["RANK"])
secret_value = rank * 10 + 17
if rank == 1:
    time.sleep(float(os.environ.get("LATE", "0")))
for stop in range(int(os.environ.get("STOPS", "1"))):
    if rank == int(os.environ.get("STOPPING", rank)):
        breakpoint()
print(f"rank {rank} went on", flush=True)
"""

PROMPT = "(Pdb) [localhost rank 0] "


def _launch(tmp_path: Path, workers: int = 1, **env: str) -> pexpect.spawn:
    (tmp_path / "script.py").write_text(
        "import os\n" + "".join(f"os.environ[{k!r}] = {v!r}\n" for k, v in env.items()) + SCRIPT
    )
    child = _spawn(tmp_path, "-m", "slurmrun", "--workers-per-host", str(workers), "script.py")
    child.delaybeforesend = None  # (_type paces the keys)
    child.expect_exact(PROMPT)
    return child


def _type(child: pexpect.spawn, keys: str) -> None:
    """Types `keys` (one key, or text) as a terminal sends them, then lets readline take them."""
    child.send(keys)
    time.sleep(0.05)


def _answer(child: pexpect.spawn, keys: str, expected: str) -> None:
    _type(child, keys)
    child.send("\r")
    child.expect_exact(f"\r\n{expected}\r\n", timeout=QUICK)
    child.expect_exact(PROMPT, timeout=QUICK)


def test_up_arrow_recalls_the_previous_command_across_breakpoints(tmp_path: Path) -> None:
    # Before: the up arrow reached pdb as "^[[A" (*** SyntaxError).
    child = _launch(tmp_path, STOPS="2")
    _answer(child, "p secret_value", "17")
    _type(child, UP)
    _type(child, "\r")
    child.expect_exact("\r\n17\r\n", timeout=QUICK)
    child.expect_exact(PROMPT, timeout=QUICK)
    child.sendline("c")
    child.expect_exact(PROMPT, timeout=QUICK)  # the second breakpoint: same history
    _type(child, UP)
    _type(child, UP)  # ("c", then the command before it)
    _type(child, "\r")
    child.expect_exact("\r\n17\r\n", timeout=QUICK)
    child.expect_exact(PROMPT, timeout=QUICK)
    child.sendline("c")
    child.expect_exact("rank 0 went on", timeout=QUICK)
    assert _finish(child) == 0
    _none_left_in(tmp_path)


def test_left_arrow_moves_the_cursor_to_edit_the_line(tmp_path: Path) -> None:
    # Before: "p 17", Left, Left, "4+" gave *** SyntaxError: invalid non-printable U+001B.
    child = _launch(tmp_path)
    _type(child, "p 17")
    _type(child, LEFT)
    _type(child, LEFT)
    _answer(child, "4+", "21")
    child.sendline("c")
    assert _finish(child) == 0


def test_tab_completes_a_name_of_the_ranks_frame(tmp_path: Path) -> None:
    # Before: the tab went into the line (NameError: name 'sec' is not defined).
    child = _launch(tmp_path)
    _type(child, "p sec")
    _type(child, "\t")
    child.expect_exact("ret_value", timeout=QUICK)  # readline wrote the rest of the name
    _answer(child, "", "17")
    child.sendline("c")
    assert _finish(child) == 0


def test_a_rank_that_stops_while_a_prompt_is_up_is_told_above_the_prompt(
    tmp_path: Path,
) -> None:
    # Before: the notice came after "(Pdb) [localhost rank 0] ", and no prompt followed it.
    child = _launch(tmp_path, workers=2, LATE="2")
    _type(child, "p secret")  # typed before rank 1 stops
    child.expect_exact("localhost rank 1 stopped at a breakpoint too", timeout=QUICK)
    child.expect_exact(f"{PROMPT}p secret", timeout=QUICK)  # shown again, with what was typed
    _answer(child, "_value", "17")
    child.sendline("c")
    child.expect_exact("(Pdb) [localhost rank 1] ", timeout=QUICK)
    child.sendline("c")
    assert _finish(child) == 0


def test_q_ends_the_run_with_one_line_and_no_bdb_traceback(tmp_path: Path) -> None:
    # Before: a whole traceback through bdb.py ending in bdb.BdbQuit.
    child = _launch(tmp_path)
    child.sendline("q")
    assert _finish(child) == 1
    after = child.before.split("\r\n", 1)[1]  # (what follows the "q" typed)
    assert "the debugger was quit (q) in localhost rank 0" in after, after
    assert "Traceback" not in after and "bdb.py" not in after, after
    _none_left_in(tmp_path)


def test_tab_waits_a_bounded_time_for_a_rank_that_does_not_answer() -> None:
    wanted = CompletionWanted((0, 0), "sec", "p sec", 2, 5)
    start = time.monotonic()
    assert wanted.wait(threading.Event(), 0.3) == []
    assert time.monotonic() - start < 1.0
    wanted.give(["secret_value"])
    assert wanted.wait(threading.Event(), 0.3) == ["secret_value"]


def test_without_gnu_readline_lines_are_read_as_typed_and_notices_come_above_the_prompt(
    tmp_path: Path,
) -> None:
    # A Python on libedit (or without readline): the line as the terminal's own line
    # discipline gives it; the notice still ends with the prompt shown again.
    (tmp_path / "script.py").write_text("import os\nos.environ['LATE'] = '2'\n" + SCRIPT)
    no_readline = (
        "import runpy, sys\n"
        "import slurmrun.launcher.line_editor as editor\n"
        "editor._loaded = True  # (as _load() finds for a libedit Python: no editor)\n"
        "sys.argv = ['slurmrun', '--workers-per-host', '2', 'script.py']\n"
        "runpy.run_module('slurmrun', run_name='__main__', alter_sys=True)\n"
    )
    child = _spawn(tmp_path, "-c", no_readline)
    child.expect_exact(PROMPT)
    _type(child, "p secret")
    child.expect_exact("localhost rank 1 stopped at a breakpoint too", timeout=QUICK)
    child.expect_exact(PROMPT, timeout=QUICK)
    _answer(child, "_value", "17")
    child.sendline("c")
    child.expect_exact("(Pdb) [localhost rank 1] ", timeout=QUICK)
    child.sendline("c")
    assert _finish(child) == 0
