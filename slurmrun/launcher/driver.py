"""`Launcher`: a launch's options that run it, and `launch`, one call of it.

`Launcher` is `Options` (the fields, `slurmrun.launcher.options`) with the running: the checks
of the call (`checks`), the plan (`plan`), the attempts (`attempts`), and the agents it keeps
between runs once open (`warm`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from slurmrun.keywords import check_keywords
from slurmrun.launcher.attempts import run_launch
from slurmrun.launcher.boundary import hide_internal_frames
from slurmrun.launcher.checks import check_call
from slurmrun.launcher.dryrun import DryRun, describe_call, plan_dry_run
from slurmrun.launcher.mapping import MapCall, check_map, iter_map, map_title, run_map
from slurmrun.launcher.options import LaunchOptions, Options, option_names
from slurmrun.launcher.plan import Plan, make_plan
from slurmrun.launcher.warm import Warm
from slurmrun.result import LaunchResult
from slurmrun.titles import run_title

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # the oldest Python supported (pyproject.toml)
    from typing_extensions import Unpack

if TYPE_CHECKING:
    from slurmrun.stacks.report import StackReport

__all__ = ["Launcher", "launch"]

T = TypeVar("T")


class Launcher(Options):
    """Options of a launch; `run` starts it. `launch(func, ...)` is `Launcher(...).run(func, ...)`.

    The options are the fields of `slurmrun.launcher.options.Options`, each documented there
    (docs/api.md has them at a glance).

    Example:
        >>> import slurmrun
        >>> result = slurmrun.Launcher(workers_per_host=2, backend="gloo").run(
        ...     lambda: __import__("os").environ["RANK"])
        >>> result.rank(1)
        '1'
    """

    # Not a dataclass of its own: its fields are `Options`', what tyro and the command read.
    # What it keeps between runs (`open` to `close`) is state, not an option: None when closed.
    _warm: Warm | None = None

    def run(
        self,
        func: Callable[..., T],
        func_args: Sequence[Any] = (),
        func_kwargs: dict[str, Any] | None = None,
    ) -> LaunchResult[T]:
        """Runs ``func(*func_args, **func_kwargs)`` on every worker and returns all results.

        Args:
            func: the function; shipped with cloudpickle, so lambdas and closures work.
            func_args: positional arguments for every worker.
            func_kwargs: keyword arguments for every worker.

        Returns:
            Every worker's return value (`LaunchResult.rank`, `LaunchResult.index`).

        Raises:
            OptionsValueError, OptionsTypeError: bad options or a bad call, before anything
                starts (a ValueError and a TypeError; both `slurmrun.OptionsError`).
            RuntimeError: ``"slurm"`` was asked for outside a SLURM job.
            WorkerFailedError: a worker died without returning.
            AgentFailedError: an agent died, went silent, or never started.
            Exception: whatever a worker raised, re-raised with its traceback as ``__cause__``.
        """
        try:
            kwargs = {} if func_kwargs is None else func_kwargs
            payload = check_call(self, func, func_args, kwargs)
            plan = replace(make_plan(self), title=run_title(func, tuple(func_args), kwargs))
            if self._warm is not None:
                return run_launch(self, self._warm, plan, payload)
            with self:  # a cold launch is a warm launcher used once
                return run_launch(self, self._opened(), replace(plan, once=True), payload)
        except BaseException as exc:
            hide_internal_frames(exc)  # the user's call line and the worker's traceback
            if sys.version_info < (3, 11):
                raise exc  # noqa: TRY201 - 3.10's bare raise would bring the whole traceback back
            raise

    def map(
        self,
        func: Callable[[Any], T],
        items: Iterable[Any],
        *,
        workers_per_item: int = 1,
        retries: int = 0,
        item_timeout: float | None = None,
    ) -> list[T]:
        """Calls ``func(item)`` once per item, on every slot of the allocation at once.

        Each item runs in a world of its own: a slot of ``workers_per_item`` workers of one
        node (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_PORT`` of that world, the
        launcher's backend over it alone), with only its own GPUs in ``CUDA_VISIBLE_DEVICES``
        and its share of the node's cores (``OMP_NUM_THREADS``). Items wait in a queue for a
        free slot; a slot's worker runs item after item. On a warm launcher (``with``), later
        maps reuse the agents. docs/sweeps.md says more.

        Args:
            func: the function; its one argument is an item (shipped with cloudpickle).
            items: the items (each pickled before anything starts).
            workers_per_item: the workers of a slot, all on one node; an item's value is
                its rank 0's, and its failure the first error of a rank (or a death).
            retries: how many times a failed item (it raised, its worker died, it ran past
                `item_timeout`) is tried again, on another slot where one is alive.
            item_timeout: seconds an item may run; past them its slot's workers are killed
                (and started again) and the item fails. None: no limit.

        Returns:
            Each item's return value, in the items' order.

        Raises:
            MapFailedError: items failed after their retries; the others ran to the end, and
                its ``results`` holds every item's value or exception (remote traceback kept).
            OptionsValueError, OptionsTypeError: bad options or arguments, before anything
                starts.
            AgentFailedError: an agent never started (a lost one: docs/sweeps.md).

        Example:
            >>> import slurmrun
            >>> slurmrun.Launcher(workers_per_host=2).map(lambda x: x * x, range(4))
            [0, 1, 4, 9]
        """
        try:
            call = check_map(self, func, items, workers_per_item, retries, item_timeout)
            return self._map(replace(make_plan(self), title=map_title(func)), call)
        except BaseException as exc:
            hide_internal_frames(exc)
            if sys.version_info < (3, 11):
                raise exc  # noqa: TRY201 - as in `run`
            raise

    def imap(
        self,
        func: Callable[[Any], T],
        items: Iterable[Any],
        *,
        workers_per_item: int = 1,
        retries: int = 0,
        item_timeout: float | None = None,
    ) -> Iterator[tuple[int, T]]:
        """`map`, whose values come as they are ready: ``(index, value)`` pairs.

        The arguments are `map`'s, checked before anything starts. The map runs on a thread
        of its own while you read; leaving the loop early (``break``, Ctrl-C, an exception)
        ends it, workers stopped. Failed items are not yielded: once every value was, a
        `MapFailedError` holds every item's outcome, as `map` raises it.

        Example:
            >>> import slurmrun
            >>> sorted(slurmrun.Launcher(workers_per_host=2).imap(abs, [-1, -2]))
            [(0, 1), (1, 2)]
        """
        call = check_map(self, func, items, workers_per_item, retries, item_timeout)
        plan = replace(make_plan(self), title=map_title(func))
        return iter_map(lambda on_settle, stop: self._map(plan, call, on_settle, stop))

    def _map(
        self,
        plan: Plan,
        call: MapCall,
        on_settle: Callable[[int, Any], None] | None = None,
        stop: threading.Event | None = None,
    ) -> list[Any]:
        if self._warm is not None:
            return run_map(self, self._warm, plan, call, on_settle, stop)
        with self:  # a cold map is a warm launcher used once
            return run_map(self, self._opened(), replace(plan, once=True), call, on_settle, stop)

    def stacks(self, timeout: float = 10.0) -> StackReport | None:
        """Every rank's Python stacks (all threads) during a run, from another thread.

        Workers answer themselves; one stuck in C code holding the GIL is dumped by
        faulthandler. The report is also written to the launch's log directory.

        Args:
            timeout: seconds to wait for the answers (ranks without one say so).

        Returns:
            The report (`print(report.format())`, `report.summary()`), or None when no run
            is in progress. docs/debugging.md shows one.

        Raises:
            ValueError: `timeout` is not a number of seconds above 0 (NaN, inf, negative)
                or is over a day.
        """
        warm = self._warm  # read once: `close` may drop it meanwhile
        return None if warm is None else warm.stacks(timeout)

    def dry_run(
        self,
        func: Callable[..., Any],
        func_args: Sequence[Any] = (),
        func_kwargs: dict[str, Any] | None = None,
    ) -> DryRun:
        """What `run` would start, without starting anything (no process, socket or file).

        Checks the options and the call as `run` does, and plans the launch the way `run`
        does: where `run` would raise before starting, this raises the same error.

        Args:
            func: the function `run` would run (checked, not called).
            func_args: positional arguments for every worker.
            func_kwargs: keyword arguments for every worker.

        Returns:
            The plan: `str()` prints it (hosts, workers, the srun command line, the names of
            the variables agents get); `DryRun.as_dict` and `DryRun.to_json` for scripts.

        Raises:
            OptionsError, ValueError, RuntimeError: as `run`, before anything starts.
        """
        kwargs = {} if func_kwargs is None else func_kwargs
        check_call(self, func, func_args, kwargs)
        plan = replace(make_plan(self, wait=False), once=self._warm is None)
        return replace(plan_dry_run(self, plan), workers_run=describe_call(func, func_args, kwargs))

    def __enter__(self) -> Launcher:
        """Keeps the agents (and their imports) from one `run` to the next until `close`.

        Each `run` inside the ``with`` block still forks fresh workers in a new process group;
        only the agents, with their spawners and imports, are kept. See `close` for the rules.

        Example:
            >>> import slurmrun
            >>> with slurmrun.Launcher(workers_per_host=2, backend="gloo") as launcher:
            ...     first = launcher.run(lambda: 1)
            ...     second = launcher.run(lambda: 2)  # ~10x faster: no agent starts
        """
        return self.open()

    def open(self) -> Launcher:
        """Keeps the agents from one `run` to the next until `close`: a ``with`` block's start.

        For a notebook, where a ``with`` block cannot span cells: open the launcher in one
        cell, run in the next ones, close it at the end (a kernel that exits or restarts ends
        the agents too). The agents start with the first `run`.

        Example:
            >>> import slurmrun
            >>> launcher = slurmrun.Launcher(workers_per_host=2, backend="gloo").open()
            >>> launcher.run(lambda: 1).rank(0)
            1
            >>> launcher.run(lambda: 2).rank(1)  # the same agents
            2
            >>> launcher.close()
        """
        self._opened()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Closes the agents (`close`)."""
        self.close()

    def close(self) -> None:
        """Stops the agents kept by a ``with`` block (workers first); does nothing otherwise.

        Rules of a warm launcher: an agent that fails during a run (its process, its node,
        its heartbeats) fails that run with AgentFailedError and the next run starts every
        agent again (one new srun step), as does an agent that died between runs (with a
        warning); a failed worker or a Ctrl-C ends only that run's workers (and every process
        they started). Changing ``hostnames``, ``workers_per_host`` or what agents start with
        (the variable patterns, env file, heartbeat and connect timeouts, backend None)
        between runs is an OptionsValueError: close the launcher first. The variables that
        ``default_env_vars`` and ``extra_env_vars`` select are read at every run: a change of
        ``os.environ`` between runs (``OMP_NUM_THREADS``, ``HF_HOME``) reaches the next run's
        workers, and a variable unset since is unset there. After `close`, `run` is a cold
        launch again.
        """
        warm, self._warm = self._warm, None
        if warm is not None:
            warm.close()

    def _opened(self) -> Warm:
        """The agents kept (`open`): those kept already, or a new `Warm` (none started yet)."""
        if self._warm is None:
            self._warm = Warm()
        return self._warm


def launch(
    func: Callable[..., T],
    func_args: Sequence[Any] = (),
    func_kwargs: dict[str, Any] | None = None,
    **options: Unpack[LaunchOptions],
) -> LaunchResult[T]:
    """Runs ``func(*func_args, **func_kwargs)`` on every worker of every host.

    ``launch(func, args, kwargs, **options)`` is ``Launcher(**options).run(func, args, kwargs)``.

    Args:
        func: the function; shipped with cloudpickle, so lambdas and closures work.
        func_args: positional arguments for every worker.
        func_kwargs: keyword arguments for every worker.
        **options: `Launcher`'s fields, by keyword (all but ``keep_workers``, a warm
            launcher's): ``hostnames``, ``workers_per_host``, ``backend``, ``timeout``,
            ``max_restarts``... Each is documented, with its default, in `Launcher`'s fields
            (`slurmrun.launcher.options.Options`), and in short in the API page's "Options at a
            glance".

    Returns:
        Every worker's return value, as `Launcher.run`.

    Raises:
        OptionsValueError, OptionsTypeError: bad options or a bad call, before anything starts;
            a misspelt option names its closest (``launch() got an unexpected keyword
            argument 'worker_per_host': did you mean workers_per_host?``).
        Exception: what `Launcher.run` raises.

    Example:
        >>> import slurmrun
        >>> slurmrun.launch(lambda x: x * 2, (21,), workers_per_host=1).rank(0)
        42
    """
    elsewhere = {"keep_workers": "a warm launcher: use Launcher(keep_workers=True) in a with block"}
    allowed = [name for name in option_names() if name not in elsewhere]
    try:
        check_keywords("launch", options, allowed, elsewhere)
        return Launcher(**options).run(func, func_args, func_kwargs)
    except BaseException as exc:
        hide_internal_frames(exc)  # as `Launcher.run`, without this frame
        if sys.version_info < (3, 11):
            raise exc  # noqa: TRY201 - 3.10's bare raise would bring the whole traceback back
        raise
