"""``slurmrun --map ARGS_FILE [OPTIONS] SCRIPT [ARGS...]``: the script once per line of a file.

``--workers-per-item``, ``--retries`` and ``--item-timeout`` are `Launcher.map`'s options.

Each line of ARGS_FILE is split as a shell would (`shlex`, ``#`` starts a comment; blank and
comment-only lines are skipped) and its words are appended to the script's arguments: each
line is one item of a `slurmrun.Launcher.map`, run by `slurmrun.cli.script.run_item` in a
slot of its own, every slot of the allocation at once. The file is read, and refused if it
is missing, empty or has a line that does not split, before anything starts. At the end a
table gives each item's line, slot, time and exit status; the command's status is the first
failed item's (0 when every item finished). See docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurmrun.cli.command import UsageError
from slurmrun.cli.script import ScriptExit, run_item
from slurmrun.errors import ItemTimeoutError, MapFailedError, RemoteTraceback, WorkerFailedError
from slurmrun.events import Event, ItemFailed, ItemFinished, ItemStarted

if TYPE_CHECKING:
    from slurmrun.cli.command import Command
    from slurmrun.launcher.driver import Launcher

__all__ = [
    "MAP_OPTIONS",
    "ArgsLine",
    "Sweep",
    "item_status",
    "positive_seconds",
    "read_args_file",
    "read_sweep",
    "run_map_command",
    "whole_number",
]

# The status of an item past its timeout, as timeout(1) exits.
TIMEOUT_STATUS = 124
# Failed items whose traceback is printed; the table has every item.
TRACEBACKS = 5


@dataclass(frozen=True)
class ArgsLine:
    """One item: the words of line `number` of the args file."""

    number: int
    words: list[str]


# The command's own options of a map (each takes a value), for `split_command`.
MAP_OPTIONS = {"--map": True, "--workers-per-item": True, "--retries": True, "--item-timeout": True}


@dataclass(frozen=True)
class Sweep:
    """``--map``'s runs: the lines of its file, and the map's options (`Launcher.map`'s)."""

    lines: list[ArgsLine]
    workers_per_item: int = 1
    retries: int = 0
    item_timeout: float | None = None


def read_sweep(own_args: list[str]) -> Sweep | None:
    """``--map``'s file read and its options checked (`Command.own_args`); None: no map.

    Raises:
        UsageError: an option given twice or without a value, a bad number, a map's option
            without ``--map``, or a bad file (`read_args_file`).
    """
    given: dict[str, str] = {}
    for arg in own_args:
        name, has_value, value = arg.partition("=")
        if name not in MAP_OPTIONS:
            continue
        if name in given:
            raise UsageError(f"{name} is given twice: give it once")
        if not has_value:
            raise UsageError(f"{name} needs a value")
        given[name] = value
    if "--map" not in given:
        if given:
            raise UsageError(
                f"{next(iter(given))} goes with --map ARGS_FILE: it is an option of a map's "
                "runs (one per line of ARGS_FILE)"
            )
        return None
    return Sweep(
        read_args_file(given["--map"]),
        workers_per_item=_whole(given, "--workers-per-item", 1, least=1),
        retries=_whole(given, "--retries", 0, least=0),
        item_timeout=_seconds(given.get("--item-timeout")),
    )


def _whole(given: dict[str, str], name: str, default: int, *, least: int) -> int:
    text = given.get(name)
    if text is None:
        return default
    try:
        return whole_number(text, least)
    except ValueError as e:
        raise UsageError(f"{name}: {e}") from None


def _seconds(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return positive_seconds(text)
    except ValueError as e:
        raise UsageError(f"--item-timeout: {e}") from None


def whole_number(text: str, least: int) -> int:
    """A map option's count (``--retries``, ``--workers-per-item``): at least `least`.

    Raises:
        ValueError: `text` is not one; the message says so.
    """
    if not text.strip().isdigit() or int(text) < least:
        raise ValueError(f"{text!r} is not a whole number of at least {least}")
    return int(text)


def positive_seconds(text: str) -> float:
    """``--item-timeout``'s seconds: a finite number above 0.

    Raises:
        ValueError: `text` is not one; the message says so.
    """
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"give a number of seconds above 0, not {text!r}")
    return seconds


def read_args_file(path: str) -> list[ArgsLine]:
    """The items of ``--map``'s file: each line's words, blank and comment lines skipped.

    Raises:
        UsageError: the file is missing or unreadable, a line does not split (an unclosed
            quote), or no line holds words.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise UsageError(f"--map {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--map {path}: cannot read it ({e})") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise UsageError(
                f"--map {path}, line {number}: {e} ({line.strip()!r}); each line is split "
                "as a shell would, its words appended to the script's arguments"
            ) from None
        if words:
            lines.append(ArgsLine(number, words))
    if not lines:
        raise UsageError(
            f"--map {path} holds no line of arguments (blank lines and # comments are "
            "skipped): nothing to run"
        )
    return lines


@dataclass
class _Row:
    host: str = ""
    slot: int = -1
    started: float = 0.0
    seconds: float | None = None


class _Rows:
    """Each item's slot and time, from the map's events (on the events' thread)."""

    def __init__(self, count: int) -> None:
        self.rows = [_Row() for _ in range(count)]
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, ItemStarted):
                self.rows[event.index] = _Row(event.host, event.local_rank, event.time)
            elif isinstance(event, ItemFinished | ItemFailed):
                row = self.rows[event.index]
                row.seconds = event.time - row.started


def item_status(outcome: object) -> int:
    """An item's exit status, as the command's own would be for a run that ended so."""
    if not isinstance(outcome, BaseException):
        return 0
    if isinstance(outcome, ScriptExit):
        return outcome.code
    if isinstance(outcome, ItemTimeoutError):
        return TIMEOUT_STATUS
    if isinstance(outcome, WorkerFailedError) and outcome.exitcode:
        return 128 - outcome.exitcode if outcome.exitcode < 0 else outcome.exitcode
    return 1


def run_map_command(launcher: Launcher, cmd: Command, target: str, sweep: Sweep) -> int:
    """Runs the script once per line (`Launcher.map`); returns the command's status.

    Raises:
        Exception: what the map raises when it fails as a whole (`MapFailedError` aside).
    """
    lines = sweep.lines
    rows = _Rows(len(lines))
    own_group = launcher.backend is None  # the script makes its own: ended after each item
    func = functools.partial(run_item, target, cmd.script_args, cmd.module, own_group)
    try:
        dataclasses.replace(launcher, on_event=rows).map(
            func,
            [x.words for x in lines],
            workers_per_item=sweep.workers_per_item,
            retries=sweep.retries,
            item_timeout=sweep.item_timeout,
        )
        outcomes: list[object] = [None] * len(lines)
    except MapFailedError as e:
        outcomes = e.results
        _print_failures(e, lines)
    _print_table(lines, rows.rows, outcomes)
    statuses = [item_status(outcome) for outcome in outcomes]
    return next((status for status in statuses if status), 0)


def _print_failures(error: MapFailedError, lines: list[ArgsLine]) -> None:
    """Each failed item's traceback (the first `TRACEBACKS`), or its error."""
    for index in error.failed[:TRACEBACKS]:
        outcome = error.results[index]
        words = shlex.join(lines[index].words)
        print(f"slurmrun: item {index} (line {lines[index].number}: {words}):", file=sys.stderr)
        if isinstance(outcome, ScriptExit):
            print(f"  the script exited with status {outcome.code}", file=sys.stderr)
        elif isinstance(outcome, BaseException) and isinstance(outcome.__cause__, RemoteTraceback):
            print(outcome.__cause__.text.rstrip(), file=sys.stderr)
        else:
            print(f"  {type(outcome).__name__}: {outcome}", file=sys.stderr)
    if len(error.failed) > TRACEBACKS:
        print(f"slurmrun: ... and {len(error.failed) - TRACEBACKS} more", file=sys.stderr)


def _print_table(lines: list[ArgsLine], rows: list[_Row], outcomes: list[object]) -> None:
    """The summary: one row per item (line, slot, seconds, exit status, arguments)."""
    table = [("item", "line", "slot", "seconds", "exit", "args")]
    for index, (line, row, outcome) in enumerate(zip(lines, rows, outcomes, strict=True)):
        slot = f"{row.host}:{row.slot}" if row.host else "-"
        seconds = "-" if row.seconds is None else f"{row.seconds:.2f}"
        status = str(item_status(outcome))
        table.append((str(index), str(line.number), slot, seconds, status, shlex.join(line.words)))
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    failed = sum(1 for outcome in outcomes if isinstance(outcome, BaseException))
    print(
        f"slurmrun: {len(lines)} items, {len(lines) - failed} done, {failed} failed:",
        file=sys.stderr,
    )
    for r in table:
        cells = [cell.ljust(width) for cell, width in zip(r, widths, strict=False)]
        print("  " + "  ".join([*cells, r[5]]).rstrip(), file=sys.stderr)
