"""Workers' output reaches the launcher (live and in files); the environment workers see."""

from __future__ import annotations

import io
import logging
import os
import random
import re
import subprocess
import sys
import time
import warnings

import pytest

import slurmrun
from slurmrun.launcher.output_stage import OutputStage
from slurmrun.launcher.records import RunOutput
from slurmrun.launcher.run import Run
from slurmrun.logs import LineAssembler, tail_file
from slurmrun.output import CRLF, EOF, LINE, MORE, PROGRESS, LineJoiner, cut_mark, line_end

# ---------------------------------------------------------------- functions run on workers


def chatty():
    rank = os.environ["RANK"]
    print(f"print from rank {rank}")
    os.write(1, f"os.write from rank {rank}\n".encode())
    subprocess.run(["echo", f"subprocess echo from rank {rank}"], check=True)
    print(f"stderr line from rank {rank}", file=sys.stderr)
    logging.getLogger("user.code").warning("logging record from rank %s", rank)
    warnings.warn(f"a warning from rank {rank}", stacklevel=1)
    logging.getLogger("user.code").debug("debug record from rank %s", rank)
    return rank


def progress_bar(shown_path):
    """Rank 0 makes its next update only once the launcher showed the first (or gives up)."""
    import tqdm

    if os.environ["RANK"] != "0":
        return True
    bar = tqdm.tqdm(total=3, mininterval=0, file=sys.stderr)
    bar.update(1)
    deadline = time.monotonic() + 60  # a launcher that holds updates back until the end
    while not os.path.exists(shown_path) and time.monotonic() < deadline:
        time.sleep(0.02)
    shown = os.path.exists(shown_path)
    bar.update(2)
    bar.close()
    return shown


def environment(names):
    return {name: os.environ.get(name) for name in names}


# ---------------------------------------------------------------- the live view and files


def test_rank0_output_is_live_with_prefixes_and_every_rank_has_a_file(capfd, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    assert slurmrun.launch(chatty, workers_per_host=2).values() == ["0", "1"]
    out, err = capfd.readouterr()
    assert "[localhost:0] print from rank 0" in out
    assert "[localhost:0] os.write from rank 0" in out
    assert "[localhost:0] subprocess echo from rank 0" in out
    assert "[localhost:0] stderr line from rank 0" in err
    assert "[localhost:0] WARNING:user.code: logging record from rank 0" in err
    assert "rank 1" not in out + err
    (launch_dir,) = tmp_path.glob("20*")  # and the link `latest`
    for rank in ("0", "1"):
        text = (launch_dir / f"localhost.{rank}.log").read_text()
        for expected in (
            f"print from rank {rank}",
            f"os.write from rank {rank}",
            f"subprocess echo from rank {rank}",
            f"stderr line from rank {rank}",
            f"WARNING:user.code: logging record from rank {rank}",
            f"UserWarning: a warning from rank {rank}",
        ):
            assert expected in text
        assert "debug record" not in text  # SLURMRUN_LOG_LEVEL defaults to INFO
    assert (launch_dir / "localhost.agent.log").exists()


def test_agents_write_the_files_and_send_the_launcher_only_what_it_shows(tmp_path, monkeypatch):
    # With the default handlers the launcher shows rank 0 alone: 32,768 workers' lines need
    # not all pass through it. The agents, which see the log directory, write the files.
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    received: list[tuple[int | None, str]] = []  # (rank, line) of what reached the launcher
    real = RunOutput.dispatch

    def spy(self, log, body, *args):
        received.extend((args[1], line) for line in bytes(body).decode().split("\n"))
        real(self, log, body, *args)

    monkeypatch.setattr(RunOutput, "dispatch", spy)
    result = slurmrun.launch(print_lines_then_return, (300, 1024), workers_per_host=3)
    assert result.world_size == 3
    assert {rank for rank, _ in received} == {0}, "only rank 0's records reach the launcher"
    assert [line for _, line in received if "line" in line] == [
        f"rank 0 line {i}" for i in range(300)
    ]
    (launch_dir,) = tmp_path.glob("20*")
    for rank in range(3):  # every line in its file, in order, by the time launch returned
        lines = (launch_dir / f"localhost.{rank}.log").read_text().splitlines()
        assert HEADER.fullmatch(lines[0]), lines[0]  # the run's header, then its lines
        assert lines[1:] == [f"rank {rank} line {i}" for i in range(300)]


HEADER = re.compile(r"=== slurmrun run (\d+), \d{4}-\d\d-\d\d \d\d:\d\d:\d\d, (.*) ===")


def silent() -> None:
    return None


def say_run(run: int) -> None:
    print(f"run {run} rank {os.environ['RANK']}")


def test_a_launch_whose_workers_print_nothing_leaves_a_file_per_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    slurmrun.launch(silent, workers_per_host=2, backend=None)
    (launch_dir,) = tmp_path.glob("20*")
    for rank in (0, 1):
        (line,) = (launch_dir / f"localhost.{rank}.log").read_text().splitlines()
        assert HEADER.fullmatch(line).groups() == ("1", "func silent"), line


@pytest.mark.parametrize("keep_workers", [False, True], ids=["new workers", "kept workers"])
def test_each_run_of_a_warm_launcher_starts_its_part_of_each_file_with_a_header(
    tmp_path, monkeypatch, keep_workers
):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    options = {"workers_per_host": 2, "backend": None, "keep_workers": keep_workers}
    with slurmrun.Launcher(**options) as launcher:
        launcher.run(say_run, (1,))
        launcher.run(say_run, (2,))
    (launch_dir,) = tmp_path.glob("20*")
    for rank in (0, 1):
        lines = (launch_dir / f"localhost.{rank}.log").read_text().splitlines()
        assert [HEADER.fullmatch(lines[0]).groups(), HEADER.fullmatch(lines[2]).groups()] == [
            ("1", "func say_run"),
            ("2", "func say_run"),
        ], lines
        assert lines[1::2] == [f"run 1 rank {rank}", f"run 2 rank {rank}"], lines


def test_files_the_launcher_writes_start_with_the_runs_header_too(tmp_path):
    # Agents over ssh: the launcher writes each worker's file (`_WorkerFiles`).
    from slurmrun.handlers import _WorkerFiles, begin_files
    from slurmrun.logs import run_header

    files = _WorkerFiles(str(tmp_path))
    begin_files([files], ["node1", "node2"], [2, 1], run_header(7, "script train.py"))
    files.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["node1.0.log", "node1.1.log", "node2.0.log"]
    for name in names:
        (line,) = (tmp_path / name).read_text().splitlines()
        assert HEADER.fullmatch(line).groups() == ("7", "script train.py")


def test_a_failures_tail_holds_the_last_runs_lines_only(tmp_path):
    from slurmrun.logs import run_header

    path = tmp_path / "node.0.log"
    path.write_bytes(run_header(1, "func f") + b"old line\n" + run_header(2, "func f") + b"new\n")
    assert tail_file(str(path)) == "new"


def test_log_level_and_empty_log_dir(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURMRUN_LOG_DIR", "")
    monkeypatch.setenv("SLURMRUN_LOG_LEVEL", "DEBUG")
    slurmrun.launch(chatty, workers_per_host=1)
    _, err = capfd.readouterr()
    assert "[localhost:0] DEBUG:user.code: debug record from rank 0" in err
    assert list(tmp_path.iterdir()) == []  # no ./slurmrun_logs, no files anywhere here


def test_bad_log_level_is_rejected_before_anything_starts(monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="SLURMRUN_LOG_LEVEL='LOUD' is not a logging level"):
        slurmrun.launch(chatty, workers_per_host=1)


def test_custom_handlers_replace_the_defaults_and_filter_by_host_and_rank(
    capfd, tmp_path, monkeypatch
):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "unused"))
    records: dict[str, list[logging.LogRecord]] = {"rank1": [], "all": []}

    class Collect(logging.Handler):
        def __init__(self, into):
            super().__init__()
            self.into = into

        def emit(self, record):
            self.into.append(record)

    handlers = [
        slurmrun.add_filter_to_handler(Collect(records["rank1"]), "localhost", 1, logging.INFO),
        slurmrun.add_filter_to_handler(Collect(records["all"]), log_level=logging.WARNING),
        slurmrun.file_handler(str(tmp_path / "rank1.log"), local_rank=1),
    ]
    slurmrun.launch(chatty, workers_per_host=2, log_handlers=handlers)
    out, err = capfd.readouterr()
    assert "print from rank" not in out + err  # the default terminal view was replaced
    assert not (tmp_path / "unused").exists() or not list((tmp_path / "unused").rglob("*.0.log"))
    assert {r.local_rank for r in records["rank1"]} == {1}
    assert {r.rank for r in records["rank1"]} == {1}
    assert {r.hostname for r in records["rank1"]} == {"localhost"}
    assert "print from rank 1" in [r.getMessage() for r in records["rank1"]]
    assert {r.levelno >= logging.WARNING for r in records["all"]} == {True}
    assert {r.local_rank for r in records["all"]} == {0, 1}
    assert "print from rank 1" in (tmp_path / "rank1.log").read_text()


def log_through_a_library_with_its_own_console_handler():
    # as `import lightning` does: its logger has a console handler and propagates to the root
    library = logging.getLogger("fw_library")
    library.setLevel(logging.INFO)
    library.addHandler(logging.StreamHandler())
    library.info("fw line once")
    logging.getLogger("fw_library.sub").warning("fw warning once")
    logging.getLogger("other").warning("other line once")  # only slurmrun's handler: a record


def test_a_line_a_library_logger_already_wrote_to_stderr_is_shown_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path / "logs"))
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    slurmrun.launch(
        log_through_a_library_with_its_own_console_handler,
        workers_per_host=1,
        log_handlers=[Collect()],
    )
    assert sum("fw line once" in line for line in seen) == 1, seen
    assert sum("fw warning once" in line for line in seen) == 1, seen
    assert sum("other line once" in line for line in seen) == 1, seen


def log_through_a_console_handler_on_the_root_logger():
    root = logging.getLogger()
    console = logging.StreamHandler()  # stderr: the agent's socket, as in a terminal
    root.addHandler(console)
    try:
        logging.getLogger("user.code").warning("root line once")
    finally:
        root.removeHandler(console)


def test_a_line_a_console_handler_on_the_root_logger_already_wrote_is_shown_once(monkeypatch):
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    slurmrun.launch(
        log_through_a_console_handler_on_the_root_logger,
        workers_per_host=1,
        backend=None,
        log_handlers=[Collect()],
    )
    assert sum("root line once" in line for line in seen) == 1, seen


def print_lines_then_return(lines: int, n_bytes: int):
    import torch

    rank = os.environ["RANK"]
    for i in range(lines):
        print(f"rank {rank} line {i}")
    return torch.zeros(n_bytes // 4)


@pytest.mark.parametrize("n_bytes", [1024, 8 << 20], ids=["via-agent", "own-connection"])
def test_output_printed_before_returning_is_handled_before_the_result(n_bytes, monkeypatch):
    # The launcher's loop takes a rank's lines before its result (the agent drains the
    # worker's output first), and its handlers have every line by the time launch returns.
    events: list[tuple[str, int]] = []
    shown: list[tuple[int, str]] = []

    class Collect(logging.Handler):
        def emit(self, record):
            shown.append((record.local_rank, record.getMessage()))

    real_put, real_result = OutputStage.put, Run._got_result

    def put(self, conn, log, body, **kwargs):
        events.extend(("line", log.local_rank) for _ in bytes(body).decode().split("\n"))
        return real_put(self, conn, log, body, **kwargs)

    def got_result(self, agent, local_rank, frame, now):
        events.append(("result", local_rank))
        return real_result(self, agent, local_rank, frame, now)

    monkeypatch.setattr(OutputStage, "put", put)
    monkeypatch.setattr(Run, "_got_result", got_result)
    slurmrun.launch(
        print_lines_then_return, (300, n_bytes), workers_per_host=2, log_handlers=[Collect()]
    )
    for rank in (0, 1):
        mine = [kind for kind, r in events if r == rank]
        assert mine == ["line"] * 300 + ["result"]
        assert [m for r, m in shown if r == rank] == [f"rank {rank} line {i}" for i in range(300)]


class Terminal(io.StringIO):
    """What a terminal gets written (the handler asks `isatty` to draw bars in place)."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_updates_in_place_and_promptly(capfd, tmp_path):
    shown = tmp_path / "shown"

    class Watch(logging.Handler):
        slurmrun_partial = True  # the bar's state before the next "\r" ends it

        def emit(self, record):
            if record.slurmrun_partial and "1/3" in record.getMessage():
                shown.touch()

    terminal = Terminal()
    handlers = [slurmrun.stream_handler(local_rank=0, stdout=terminal, stderr=terminal), Watch()]
    result = slurmrun.launch(progress_bar, (str(shown),), workers_per_host=2, log_handlers=handlers)
    # shown while rank 0 still waited before its next update, not delayed to the end
    assert result.rank(0) is True
    text = terminal.getvalue()
    assert "\r[localhost:0]  33%" in text
    assert text.count("\n") <= 2  # one final line, not a line per update
    assert "3/3" in text.rstrip("\n").splitlines()[-1]


def progress_without_a_final_newline():
    if os.environ["RANK"] == "0":
        for percent in range(0, 101, 25):
            os.write(1, f"{percent:3d}%\r".encode())
            time.sleep(0.01)  # read one by one: a state each
    return True


def test_where_stdout_is_not_a_terminal_a_progress_bar_shows_its_final_state_as_a_line(
    capfd, monkeypatch
):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", "")
    slurmrun.launch(progress_without_a_final_newline, workers_per_host=1, backend=None)
    out, _ = capfd.readouterr()  # a file, as in `python train.py > log`
    assert out.count("[localhost:0]") == 1
    assert "[localhost:0] 100%\n" in out
    assert "\r" not in out


def test_worker_error_names_its_log_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))

    def fail():
        print("about to fail", flush=True)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        slurmrun.launch(fail, workers_per_host=1, backend=None)
    (note,) = info.value.__notes__
    log_file = note.split("its log: ")[1]
    with open(log_file) as f:
        assert "about to fail" in f.read()


def print_then_abort():
    print("last words before abort", flush=True)
    os.write(2, b"C-level write to fd 2 without a newline")
    os.abort()


def test_last_output_before_a_c_level_abort_is_in_the_file_and_the_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    with pytest.raises(slurmrun.WorkerFailedError, match="SIGABRT") as info:
        slurmrun.launch(print_then_abort, workers_per_host=1, backend=None)
    for expected in ("last words before abort", "C-level write to fd 2 without a newline"):
        assert expected in info.value.stderr_tail
        assert expected in str(info.value)
        with open(info.value.log_file) as f:
            assert expected in f.read()


def test_agent_failure_names_the_agent_log(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))

    def kill_agent():
        import psutil

        psutil.Process().parent().parent().kill()
        time.sleep(60)

    with pytest.raises(slurmrun.AgentFailedError) as info:
        slurmrun.launch(kill_agent, workers_per_host=1, backend=None)
    assert info.value.log_file.endswith("localhost.agent.log")
    assert info.value.log_file in str(info.value)


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b"a\nb\n"], [("a", LINE), ("b", LINE)]),
        ([b"par", b"tial\n"], [("par", MORE), ("partial", LINE)]),
        (
            [b"\r 10%", b"\r 20%", b"\r100%\n"],
            [
                ("", PROGRESS),
                (" 10%", MORE),
                (" 10%", PROGRESS),
                (" 20%", MORE),
                (" 20%", PROGRESS),
                ("100%", LINE),
            ],
        ),
        ([b"x\r\ny\n"], [("x", CRLF), ("y", LINE)]),
        (
            [b"one\rtwo\rthree"],
            [("one", PROGRESS), ("two", PROGRESS), ("three", MORE), ("three", EOF)],
        ),
        ([b"end without newline"], [("end without newline", MORE), ("end without newline", EOF)]),
        # "\r\n" cut between two reads is still one line end, not an extra empty line
        ([b"x\r", b"\ny\n"], [("x", MORE), ("x", CRLF), ("y", LINE)]),
        # every "\r" is a state, an empty one too
        ([b"a\r\r\nb"], [("a", PROGRESS), ("", CRLF), ("b", MORE), ("b", EOF)]),
        # a character cut between two reads, and bytes that are not UTF-8, come back exactly
        ([b"\xc3", b"\xa9\xff\n"], [("é\udcff", LINE)]),
    ],
)
def test_line_assembler_cuts_lines_and_progress_states(chunks, expected):
    # The agent cuts (pieces of lines), the launcher joins: the records handlers get.
    got: list[tuple[str, str]] = []
    joiner = LineJoiner()

    def emit(piece: str, end: str) -> None:
        record = joiner.add(piece, end)
        if record is not None:
            got.append(record)

    lines = LineAssembler(emit)
    for chunk in chunks:
        lines.feed(chunk)
    lines.close()
    assert got == expected


def test_finished_records_joined_with_their_ends_are_the_bytes_written():
    rng = random.Random(6)
    data = rng.randbytes(200_001)
    got: list[tuple[str, str]] = []
    joiner = LineJoiner(progress=False)  # as the agent's, for the worker's file

    def emit(piece: str, end: str) -> None:
        record = joiner.add(piece, end)
        if record is not None:
            got.append(record)

    lines = LineAssembler(emit)
    for start in range(0, len(data), 777):
        lines.feed(data[start : start + 777])
    lines.close()
    joined = "".join(text + line_end(end) for text, end in got)
    assert joined.encode("utf-8", "surrogateescape") == data


def test_a_files_tail_shows_a_progress_bars_last_state_as_a_terminal_would(tmp_path):
    log = tmp_path / "w.log"
    log.write_bytes(b"start\n  0%\r 50%\r100%\rdone\r\nlast without an end")
    assert tail_file(str(log)) == "start\ndone\nlast without an end"


def test_a_line_past_the_limit_is_cut_there_and_said_once():
    got: list[tuple[str, str]] = []
    cuts: list[None] = []
    lines = LineAssembler(lambda piece, end: got.append((piece, end)), 4, lambda: cuts.append(None))
    lines.feed(b"abcdefghij\n")
    lines.close()
    # Where it was cut, the stream (and so the file, which the agent writes from it) says so.
    mark = cut_mark(4)
    assert "cut at 4 characters" in mark
    assert got == [("abcd" + mark, LINE), ("efgh" + mark, LINE), ("ij", LINE)]
    assert len(cuts) == 1


# ---------------------------------------------------------------- environment


def test_only_matching_variables_reach_workers(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("MY_PRIVATE_TOKEN", "hunter2")
    monkeypatch.setenv("EXTRA_ONE", "1")
    names = ["NCCL_DEBUG", "MY_PRIVATE_TOKEN", "EXTRA_ONE", "PATH"]
    got = slurmrun.launch(environment, (names,), workers_per_host=1, backend=None).rank(0)
    assert got == {
        "NCCL_DEBUG": "INFO",
        "MY_PRIVATE_TOKEN": None,
        "EXTRA_ONE": None,
        "PATH": os.environ["PATH"],
    }
    got = slurmrun.launch(
        environment, (names,), workers_per_host=1, backend=None, extra_env_vars=("EXTRA_*",)
    ).rank(0)
    assert got["EXTRA_ONE"] == "1"
    assert got["MY_PRIVATE_TOKEN"] is None


def test_env_file_exports_reach_workers(tmp_path):
    env_file = tmp_path / "env.sh"
    env_file.write_text("export FROM_ENV_FILE=yes\nMODEL_DIR=/data/models\nunset NOT_THERE\n")
    got = slurmrun.launch(
        environment,
        (["FROM_ENV_FILE", "MODEL_DIR"],),
        workers_per_host=2,
        backend=None,
        env_file=str(env_file),
    )
    assert got.values() == [{"FROM_ENV_FILE": "yes", "MODEL_DIR": "/data/models"}] * 2


def test_broken_env_file_fails_with_bashs_message_not_a_hang(tmp_path):
    env_file = tmp_path / "broken.sh"
    env_file.write_text("export A=1\nif then fi\n")
    start = time.monotonic()
    with pytest.raises(slurmrun.AgentFailedError, match="syntax error") as info:
        slurmrun.launch(environment, ([],), workers_per_host=1, env_file=str(env_file), timeout=60)
    assert "broken.sh" in str(info.value)
    assert time.monotonic() - start < 45  # bash's error, not the launch's timeout (60 s)


def test_missing_env_file_is_rejected_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        slurmrun.launch(environment, ([],), env_file=str(tmp_path / "nope.sh"))


def test_a_runs_header_names_the_function_or_the_script():
    from slurmrun.cli.script import run_script
    from slurmrun.titles import run_title

    assert run_title(run_script, ("/home/me/train.py", ["--lr", "1"]), {"module": False}) == (
        "script train.py"
    )
    assert run_title(run_script, ("pkg.main", []), {"module": True}) == "script -m pkg.main"
    assert run_title(say_run, (1,), {}) == "func say_run"
