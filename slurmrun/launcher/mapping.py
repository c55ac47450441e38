"""`Launcher.map`'s running: its checks, its one run (`MapRun`), and its outcome.

A map is one attempt on the launcher's agents (a warm launcher's, or new ones for a cold
call), whose run is a `slurmrun.launcher.map_run.MapRun`: the workers run the node's slot
loop (`slurmrun.map_messages.SLOT_LOOP`), each slot in a world of its own, and the items go
to the slots as they free up. The values come back in the items' order, or
`slurmrun.MapFailedError` holds every item's value or exception.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from slurmrun.errors import MapFailedError, OptionsTypeError, OptionsValueError
from slurmrun.events import LaunchStarted, Trace
from slurmrun.launcher.checks import check_call
from slurmrun.launcher.map_progress import Progress, progress_line
from slurmrun.launcher.map_run import MapRun
from slurmrun.launcher.warm import Warm, run_attempt, say, sigterm_as_exit
from slurmrun.logs import log_level
from slurmrun.map_messages import SLOT_LOOP
from slurmrun.pickling import dumps_inband
from slurmrun.titles import run_title

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options
    from slurmrun.launcher.plan import Plan
    from slurmrun.launcher.pool import AgentPool
    from slurmrun.launcher.run_setup import Call, Output, Watching

__all__ = ["MapCall", "check_map", "failure_message", "iter_map", "map_title", "run_map"]

# A failure's message lists this many failed items; `MapFailedError.results` holds them all.
LISTED = 5


class MapCall:
    """A checked map: the slot loop's pickled call, each item pickled, and how to run them."""

    def __init__(
        self,
        payload: bytes,
        items: list[bytes],
        *,
        workers_per_item: int,
        retries: int,
        item_timeout: float | None,
    ) -> None:
        self.payload = payload
        self.items = items
        self.workers_per_item = workers_per_item
        self.retries = retries
        self.item_timeout = item_timeout


def map_title(func: Callable[..., Any]) -> str:
    """What a map runs, for its workers' log files and process names."""
    return f"map of {run_title(func, (), {})}"


def check_map(  # noqa: PLR0917 - `Launcher.map`'s arguments
    cfg: Options,
    func: Callable[[Any], Any],
    items: Iterable[Any],
    workers_per_item: int,
    retries: int,
    item_timeout: float | None,
) -> MapCall:
    """Checks a map's options and arguments and pickles them, before anything starts.

    Raises:
        OptionsValueError, OptionsTypeError: what is wrong, and what to do.
    """
    if not callable(func):
        raise OptionsTypeError(f"func must be callable, got {type(func).__name__}")
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise OptionsTypeError(
            f"items must be an iterable of the items (a list, a range), got {type(items).__name__}"
        )
    if not _is_int(workers_per_item) or workers_per_item < 1:
        raise OptionsValueError(f"workers_per_item must be an int >= 1, got {workers_per_item!r}")
    counts = cfg.workers_per_host
    known = [counts] if isinstance(counts, int) else counts if isinstance(counts, list) else []
    if known and max(known) < workers_per_item:
        raise OptionsValueError(
            f"workers_per_item={workers_per_item}, but no host runs that many workers "
            f"(workers_per_host={counts!r}): a slot's workers are on one node. Ask for fewer "
            "workers per item, or more workers per host."
        )
    if not _is_int(retries) or retries < 0:
        raise OptionsValueError(f"retries must be an int >= 0, got {retries!r}")
    if item_timeout is not None and (
        not isinstance(item_timeout, int | float)
        or isinstance(item_timeout, bool)
        or not 0 < item_timeout < float("inf")
    ):
        raise OptionsValueError(
            f"item_timeout must be a positive number of seconds or None, got {item_timeout!r}"
        )
    payload = check_call(cfg, SLOT_LOOP, (func, workers_per_item, cfg.backend, cfg.timeout), {})
    pickled = []
    for index, item in enumerate(items):
        try:
            pickled.append(dumps_inband(item))
        except Exception as e:
            raise OptionsTypeError(
                f"item {index} ({type(item).__name__}) could not be pickled to send to a "
                f"worker: {type(e).__name__}: {e}. Items must be picklable by cloudpickle."
            ) from e
    return MapCall(
        payload,
        pickled,
        workers_per_item=workers_per_item,
        retries=retries,
        item_timeout=None if item_timeout is None else float(item_timeout),
    )


def run_map(  # noqa: PLR0917 - private: `Launcher.map` and `imap` call it
    cfg: Options,
    warm: Warm,
    plan: Plan,
    call: MapCall,
    on_settle: Callable[[int, Any], None] | None = None,
    stop: threading.Event | None = None,
) -> list[Any]:
    """Runs a checked map on the agents `warm` keeps (or new ones); its values in order.

    `on_settle` is called (on the map's thread) with each item's index and outcome once it
    has one, and `stop` set ends the map at once (`iter_map`).

    Raises:
        MapFailedError: items failed (every item has its outcome in ``results``).
        Exception: what a run raises when the map itself fails (an agent lost, Ctrl-C).
    """
    warm.check_unchanged(cfg, plan)
    if not call.items:
        return []
    trace = Trace(cfg.on_event)
    counts = plan.workers_per_host
    world_size = None if counts is None else sum(counts)
    trace.emit(LaunchStarted(hosts=tuple(plan.hostnames), world_size=world_size))
    runs: list[MapRun] = []

    def make(pool: AgentPool, run_call: Call, output: Output, watching: Watching) -> MapRun:
        slots_call = replace(
            run_call, backend=None, keep_workers=False, workers_per_item=call.workers_per_item
        )
        runs.append(
            MapRun(
                pool,
                slots_call,
                output,
                watching,
                items=call.items,
                per_item=call.workers_per_item,
                retries=call.retries,
                item_timeout=call.item_timeout,
                progress=Progress(say if shown and sys.stderr.isatty() else None),
                on_settle=on_settle,
                stop=stop,
                min_hosts=cfg.min_hosts,
            )
        )
        return runs[-1]

    shown = cfg.log_handlers is None and log_level() <= logging.INFO

    error: BaseException | None = None
    try:
        with sigterm_as_exit():
            run_attempt(cfg, warm, plan, call.payload, 0, trace, make)
    except BaseException as e:
        error = e
        raise
    finally:
        trace.finish(error)
    run = runs[-1]
    if run.stopped:
        return run.outcomes()  # (nobody reads them: `iter_map`'s consumer stopped)
    if shown:
        seconds = time.monotonic() - run.progress.started
        say(progress_line(run.book, len(run.slots), seconds, final=True))
    outcomes = run.outcomes()
    failed = sorted(run.book.failed)
    if run.fatal is not None:
        ended = run.fatal.message()
        message = f"{ended}\n{failure_message(outcomes, failed)}"
        raise MapFailedError(
            message, results=outcomes, failed=failed, ended=ended
        ) from run.fatal.error
    if failed:
        raise MapFailedError(failure_message(outcomes, failed), results=outcomes, failed=failed)
    return outcomes


def failure_message(outcomes: list[Any], failed: list[int]) -> str:
    """`MapFailedError`'s message: how many items failed, and the first few with their errors."""
    lines = [f"{len(failed)} of {len(outcomes)} items failed (their exceptions: .results)"]
    for index in failed[:LISTED]:
        error = outcomes[index]
        text = str(error).splitlines()[0] if str(error) else ""
        lines.append(f"  item {index}: {type(error).__name__}: {text}")
    if len(failed) > LISTED:
        lines.append(f"  ... and {len(failed) - LISTED} more")
    return "\n".join(lines)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_END = object()  # the map's thread is done
# How long a stopped map's thread may take to end its run (its workers' grace and more).
STOP_WAIT = 60.0

MapOn = Callable[[Callable[[int, Any], None], threading.Event], object]


def iter_map(run: MapOn) -> Iterator[tuple[int, Any]]:
    """`Launcher.imap`: each value as it comes, from ``run(on_settle, stop)`` on a thread.

    Stopping early (``break``, Ctrl-C, an exception in the loop's body) sets `stop`, which
    ends the map's run (its workers are stopped as at the end of any run), and waits for it.

    Raises:
        MapFailedError, Exception: what the map raised, once every value was yielded.
    """
    settled: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stop = threading.Event()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run(lambda *got: settled.put(got), stop)
        except BaseException as e:
            errors.append(e)
        finally:
            settled.put(_END)

    thread = threading.Thread(target=target, name="slurmrun-map", daemon=True)
    thread.start()
    try:
        with sigterm_as_exit():
            while (got := _next(settled)) is not _END:
                index, outcome = got
                if not isinstance(outcome, BaseException):
                    yield index, outcome
    finally:
        stop.set()
        thread.join(STOP_WAIT)
    if errors:
        raise errors[0]


def _next(settled: queue.SimpleQueue[Any]) -> Any:
    """The next thing the map's thread put, waiting in short steps (Ctrl-C gets through)."""
    while True:
        with contextlib.suppress(queue.Empty):
            return settled.get(timeout=0.1)
