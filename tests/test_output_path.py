"""What a worker writes reaches handlers and log files exactly: any bytes, any line length.

Two warm launchers serve most tests (each test its own): `custom` hands every record to a
collecting handler and to the launcher's own per-worker files (`_WorkerFiles`, as for agents
over ssh); `default` keeps the default handlers, so its agent writes each worker's file
(`WorkerLog`). Output
comes from rank 1, which the default handlers do not show live.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import slurmrun
from slurmrun.handlers import _WorkerFiles
from slurmrun.launcher.run import Run

OPTIONS = {"hostnames": ["localhost"], "workers_per_host": 2, "backend": None, "timeout": 120}

# ---------------------------------------------------------------- functions run on workers


def write_pieces(fd: int, pieces: list[bytes], pauses: list[bool], pause: float = 0.002) -> int:
    """Rank 1 writes `pieces` to `fd`, pausing `pause` s after some (the agent reads between)."""
    if os.environ["RANK"] != "1":
        return 0
    for piece, paused in zip(pieces, pauses, strict=True):
        view = memoryview(piece)
        while view:
            view = view[os.write(fd, view) :]
        if paused:
            time.sleep(pause)
    return len(pieces)


def log_big(text: str) -> None:
    if os.environ["RANK"] == "1":
        logging.getLogger("big").warning(text)


# ---------------------------------------------------------------- launchers and what they got


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def finished(self, stream: str, rank: int = 1) -> bytes:
        """What the worker wrote to `stream`: each record's text and how it ended, joined."""
        return b"".join(
            (r.getMessage() + r.slurmrun_end).encode("utf-8", "surrogateescape")
            for r in self.of(stream, rank)
        )

    def of(self, stream: str, rank: int = 1) -> list[logging.LogRecord]:
        return [r for r in self.records if r.rank == rank and r.stream == stream]


@dataclass
class Launchers:
    custom: slurmrun.Launcher
    collect: Collect
    files: _WorkerFiles
    files_dir: Path
    default: slurmrun.Launcher
    default_dir: Path
    seen: dict[Path, int] = field(default_factory=dict)

    def run_both(self, func, *args) -> None:
        self.collect.records.clear()
        self.custom.run(func, args)
        self.files.close()  # its writer thread: every queued line is in the file
        self.default.run(func, args)

    def new_bytes(self, path: Path) -> bytes:
        """What `path` got since the last look (the launchers are warm: files grow)."""
        data = path.read_bytes() if path.exists() else b""
        start, self.seen[path] = self.seen.get(path, 0), len(data)
        return data[start:]

    def check_files(self, expected: bytes) -> None:
        # Both launchers have a directory there; only the default one's agent writes files.
        agent_files = list(self.default_dir.glob("20*/localhost.1.log"))  # not via `latest`
        assert len(agent_files) <= 1
        if agent_files:
            # Written by the agent, after the run's header line (`slurmrun.logs.run_header`),
            # which starts a new line if the last run's output left one unended.
            new_line = self.after(agent_files[0], b"-") == b"\n-"
            header, _, got = self.new_bytes(agent_files[0]).partition(b" ===\n")
            assert header.startswith(b"\n=== slurmrun run " if new_line else b"=== slurmrun run ")
            assert got == expected
        else:
            assert not expected
        launcher_file = self.files_dir / "localhost.1.log"
        wanted = self.after(launcher_file, expected)
        assert self.new_bytes(launcher_file) == wanted  # by the launcher

    def after(self, path: Path, expected: bytes) -> bytes:
        """`expected` as a run appends it to `path`: on a new line after one left unended."""
        seen = self.seen.get(path, 0)
        if not expected or not seen:
            return expected
        with path.open("rb") as f:
            f.seek(seen - 1)
            return expected if f.read(1) in (b"\n", b"\r") else b"\n" + expected


@pytest.fixture
def launchers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Launchers]:
    files_dir, default_dir = tmp_path / "launcher-files", tmp_path / "agent-files"
    files_dir.mkdir()
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(default_dir))  # read when the agents start
    collect, files = Collect(), _WorkerFiles(str(files_dir))
    with (
        slurmrun.Launcher(**OPTIONS, log_handlers=[collect, files]) as custom,
        slurmrun.Launcher(**OPTIONS) as default,
    ):
        yield Launchers(custom, collect, files, files_dir, default, default_dir)


# ---------------------------------------------------------------- tests


def test_a_3_mb_line_and_a_3_mb_logging_record_arrive_whole(launchers: Launchers) -> None:
    line = "█" * 1_000_000  # 3 MB of UTF-8; 6 MB once JSON-escaped
    launchers.run_both(write_pieces, 1, [(line + "\n").encode()], [False])
    assert launchers.collect.finished("stdout") == (line + "\n").encode()
    launchers.check_files((line + "\n").encode())
    launchers.run_both(log_big, line)
    (record,) = [r for r in launchers.collect.records if r.name == "big"]
    assert record.getMessage() == line
    launchers.check_files(f"WARNING:big: {line}\n".encode())


def test_a_character_split_between_two_reads_arrives_whole(launchers: Launchers) -> None:
    # The agent reads 64 KiB at a time: the first read ends inside "é" (0xC3 0xA9).
    first, second = b"a" * 65535 + b"\xc3", b"\xa9 and the rest\n"
    launchers.run_both(write_pieces, 2, [first, second], [True, False])
    expected = ("a" * 65535 + "é and the rest\n").encode()
    assert launchers.collect.finished("stderr") == expected
    launchers.check_files(expected)


def test_an_unfinished_line_growing_by_small_writes_costs_the_wire_its_length(
    launchers: Launchers, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = [0]
    real = Run.on_message

    def count(
        self: Run, agent: object, message: object, frame: slurmrun.transport.Frame, now: float
    ) -> None:
        if frame.header.get("t") == "log":
            wire[0] += len(json.dumps(frame.header)) + len(frame.body)
        real(self, agent, message, frame, now)  # type: ignore[arg-type]

    monkeypatch.setattr(Run, "on_message", count)
    pieces = [b"x" * 1000] * 200 + [b"\n"]  # one 200 kB line, in 200 writes read one by one
    launchers.custom.run(write_pieces, (1, pieces, [True] * len(pieces)))
    assert launchers.collect.finished("stdout")[-1001:] == b"x" * 1000 + b"\n"
    print(f"LOG bytes on the wire for a 200 kB line: {wire[0]}")
    assert wire[0] < 2 * 200_000, f"{wire[0]} bytes on the wire for a 200 kB line"


# Bytes a worker may write: text with multibyte characters, bytes that are not UTF-8 (stray
# continuation bytes, cut sequences), line ends of every kind (progress states too).
_CHARS = ["a", "é", "█", "中", "😀", " "]
_SEGMENTS = st.tuples(
    st.sampled_from(["text", "invalid", "newlines", "random"]), st.integers(1, 1 << 19)
)


def _segment(rng: random.Random, kind: str, n: int) -> bytes:
    if kind == "text":
        return "".join(rng.choices(_CHARS, k=n // 2)).encode()
    if kind == "invalid":
        return rng.choice([b"\x80", b"\xff", b"\xe2\x96", b"\xf0\x9f\x98", b"\xed\xa0\x80"])
    if kind == "newlines":
        return rng.choice([b"\n", b"\r", b"\r\n"]) * (n % 3 + 1)
    return rng.randbytes(n)


def test_any_bytes_in_any_writes_reach_handlers_and_files_exactly(launchers: Launchers) -> None:
    @settings(
        max_examples=4,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        segments=st.lists(_SEGMENTS, min_size=1, max_size=8),
        seed=st.integers(0, 2**32),
        cuts=st.integers(0, 100),
        fd=st.sampled_from([1, 2]),
    )
    def check(segments: list[tuple[str, int]], seed: int, cuts: int, fd: int) -> None:
        rng = random.Random(seed)
        data = b"".join(_segment(rng, kind, n) for kind, n in segments)
        points = sorted({0, len(data), *(rng.randrange(len(data) + 1) for _ in range(cuts))})
        pieces = [data[a:b] for a, b in itertools.pairwise(points)]
        pauses = [rng.random() < 0.3 for _ in pieces]
        launchers.run_both(write_pieces, fd, pieces, pauses)
        expected = data  # byte for byte, also without a final line end
        assert launchers.collect.finished("stdout" if fd == 1 else "stderr") == expected
        launchers.check_files(expected)

    check()


def test_random_bytes_with_bare_carriage_returns_reach_the_files_byte_exact(
    launchers: Launchers,
) -> None:
    data = random.Random(6).randbytes(200_001)
    assert data.count(b"\r") > 700 and not data.endswith(b"\n")
    pieces = [data[i : i + 20_000] for i in range(0, len(data), 20_000)]
    launchers.run_both(write_pieces, 1, pieces, [True] * len(pieces))
    assert launchers.collect.finished("stdout") == data
    launchers.check_files(data)


def test_a_progress_bar_without_a_final_newline_keeps_its_states_in_the_files(
    launchers: Launchers,
) -> None:
    states = [f"{p:3d}%\r".encode() for p in range(0, 101, 10)]
    launchers.run_both(write_pieces, 2, states, [True] * len(states))
    launchers.check_files(b"".join(states))  # `cat` shows the final state: 100%
    records = launchers.collect.of("stderr")
    assert [(r.getMessage(), r.slurmrun_end) for r in records] == [
        (s.decode()[:-1], "\r") for s in states
    ]


def test_a_handler_gets_each_finished_line_once_not_its_growing_states(
    launchers: Launchers,
) -> None:
    long_line, accents = "x" * 3_000_000, "é" * 100_000
    data = f"{long_line}\n{accents}\n".encode()
    pieces = [data[i : i + 100_000] for i in range(0, len(data), 100_000)]
    launchers.custom.run(write_pieces, (1, pieces, [True] * len(pieces)))
    records = launchers.collect.of("stdout")
    assert [(r.getMessage(), r.slurmrun_end, r.slurmrun_partial) for r in records] == [
        (long_line, "\n", False),
        (accents, "\n", False),
    ]


def test_a_handler_that_asks_for_partial_lines_gets_them_marked(tmp_path: Path) -> None:
    class Partial(Collect):
        slurmrun_partial = True

    plain, partial = Collect(), Partial()
    pieces = [b"Enter", b" a number: ", b"42\n"]
    # Pauses long enough that the agent reads the prompt before the rest, also on a busy machine.
    args = (1, pieces, [True] * 3, 0.3)
    slurmrun.launch(write_pieces, args, **OPTIONS, log_handlers=[plain, partial])
    assert [(r.getMessage(), r.slurmrun_partial) for r in plain.of("stdout")] == [
        ("Enter a number: 42", False)
    ]
    got = [(r.getMessage(), r.slurmrun_end, r.slurmrun_partial) for r in partial.of("stdout")]
    assert got[-1] == ("Enter a number: 42", "\n", False)
    assert all(end == "" and marked for _, end, marked in got[:-1])
    assert ("Enter a number: ", "", True) in got  # a prompt shows before its line ends


# ---------------------------------------------------------------- handlers that fail


def greet() -> str:
    print(f"hello from rank {os.environ['RANK']}")
    return os.environ["RANK"]


def test_a_handler_that_raises_is_reported_once_and_the_results_stand(
    capfd: pytest.CaptureFixture[str],
) -> None:
    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise OSError(28, "No space left on device")

    collect = Collect()
    result = slurmrun.launch(greet, **OPTIONS, log_handlers=[Broken(), collect])
    assert result.values() == ["0", "1"]
    assert collect.finished("stdout", rank=0) == b"hello from rank 0\n"  # the others still get it
    _, err = capfd.readouterr()
    assert err.count("slurmrun: the log handler") == 1
    assert "No space left on device" in err


def test_file_handler_in_a_missing_directory_is_refused_when_created(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"directory .*/missing does not exist: create it"):
        slurmrun.file_handler(str(tmp_path / "missing" / "x.log"))
    slurmrun.file_handler(str(tmp_path / "x.log"))  # a writable directory is fine
