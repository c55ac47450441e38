"""A map's slot (`Launcher.map`): a worker that runs item after item in a world of its own.

The launcher ships `serve` (by name: `slurmrun.map_messages.SLOT_LOOP`) as the call of a run
whose workers are cut into slots. Each worker finds its slot from its place on the node,
makes the slot's world (its ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, ``MASTER_PORT``, its GPUs
in ``CUDA_VISIBLE_DEVICES``, its share of the node's cores and ``OMP_NUM_THREADS`` unless the
user set it, and the launcher's backend over that world alone), says ITEM_READY, and then
runs each ITEM its inbox thread puts in `items` (`slurmrun.node.inbox`) until there are no
more: the value or the exception of each goes back to the launcher, and an exception does
not end the loop.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from slurmrun import variables, worker_env
from slurmrun.devices import visible_gpu_count
from slurmrun.map_messages import NO_MORE, Item, ItemRaised, ItemReady, ItemValue
from slurmrun.pickling import dumps, loads
from slurmrun.transport import Connection, Frame

__all__ = ["SlotPlace", "agent", "items", "serve"]

# The inbox thread puts each ITEM here for the loop; set by `slurmrun.node.inbox.watch_agent`.
items: queue.Queue[Frame] = queue.Queue()
agent: Connection | None = None  # the worker's connection to its agent
# ``OMP_NUM_THREADS`` as the user set it, set by `slurmrun.node.worker` (None: not set): a
# slot sets it to its share of the cores only where the user did not.
users_threads: str | None = None


class SlotPlace:
    """Where a worker stands among its node's slots of `per_item` workers."""

    def __init__(self, local_rank: int, local_world: int, per_item: int) -> None:
        self.per_item = per_item
        self.count = local_world // per_item  # the node's slots
        self.index = local_rank // per_item  # this worker's slot (>= count: none)
        self.rank = local_rank % per_item  # its rank in the slot's world

    def gpus(self, environ: dict[str, str] | os._Environ[str]) -> str | None:
        """The slot's share of the node's GPUs, for ``CUDA_VISIBLE_DEVICES`` (None: no GPU)."""
        count = visible_gpu_count(environ)
        if count == 0:
            return None
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",")[:count] if visible is not None else [str(i) for i in range(count)]
        if len(ids) < self.count * self.per_item:  # fewer GPUs than workers: slots share them
            return ",".join(ids)
        return ",".join(ids[self.index * self.per_item : (self.index + 1) * self.per_item])

    def cpus(self, usable: list[int]) -> list[int]:
        """The slot's share of the cores `usable` (all of them if there are fewer than slots)."""
        share = len(usable) // self.count
        if share < 1:
            return usable
        return usable[self.index * share : (self.index + 1) * share]


def serve(func: Callable[[Any], Any], per_item: int, backend: str | None, timeout: float) -> None:
    """Runs the map's items given to this worker's slot, until the launcher has no more.

    Args:
        func: the map's function; each item is its one argument.
        per_item: the workers of a slot (`Launcher.map`'s ``workers_per_item``).
        backend: the launcher's backend, for the slot's own process group (None: none).
        timeout: the process group's timeout, in seconds.
    """
    place = SlotPlace(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]), per_item)
    if place.index >= place.count or agent is None:
        return  # a worker left over when the node's workers are not a multiple of per_item
    conn = agent
    _enter_slot(place)
    store, port = _world_port(place, backend, timeout)
    conn.send(ItemReady(port=port).header())
    if place.rank > 0:  # rank 0's port, which the launcher passes on once all are ready
        port = Item.from_header(items.get().header).port
    os.environ["MASTER_PORT"] = str(port)
    grouped = _join_group(place, backend, timeout, store, port)
    while True:
        frame = items.get()
        index = Item.from_header(frame.header).index
        if index == NO_MORE:
            break
        _run_item(conn, func, index, frame)
    if grouped:
        import torch.distributed as dist  # noqa: PLC0415 - imported by _join_group already

        dist.destroy_process_group()


def _run_item(conn: Connection, func: Callable[[Any], Any], index: int, frame: Frame) -> None:
    try:
        value = func(loads(frame.body, frame.buffers))
        body, buffers = dumps(value)
    except BaseException as exc:
        _flush()
        _send_raised(conn, index, exc)
        return
    _flush()
    conn.send(ItemValue(index=index).header(), body, buffers)


def _send_raised(conn: Connection, index: int, exc: BaseException) -> None:
    tb = exc.__traceback__
    skip = tb.tb_next if tb is not None and tb.tb_next is not None else tb  # our own frame
    text = "".join(traceback.format_exception(type(exc), exc, skip))
    unpicklable = None
    try:
        body, buffers = dumps(exc)
    except Exception as e:
        unpicklable = f"{type(e).__name__}: {e}"
        body, buffers = b"", []
    raised = ItemRaised(
        index=index,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=_text(exc),
        traceback=text,
        unpicklable=unpicklable,
    )
    conn.send(raised.header(), body, buffers)


def _enter_slot(place: SlotPlace) -> None:
    """The slot's world in this worker's environment, GPUs and cores (module docstring).

    ``MASTER_PORT`` is set once rank 0 made it (`_world_port`).
    """
    slot_place = worker_env.RankPlace(
        rank=place.rank,
        local_rank=place.rank,
        world_size=place.per_item,
        local_world_size=place.per_item,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=0,
        tasks_per_node=str(place.per_item),
    )
    values, _ = worker_env.worker_changes(
        os.environ, slot_place, os.environ.get(variables.JOB_ENV_VAR), pid=os.getpid()
    )
    os.environ.update(values)
    gpus = place.gpus(os.environ)
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    with contextlib.suppress(AttributeError, OSError):  # sched_*affinity: Linux only
        cpus = place.cpus(sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, cpus)
        if users_threads is not None:
            return  # the user's OMP_NUM_THREADS stands (the worker set torch's to it)
        threads = max(1, len(cpus) // place.per_item)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(threads)


def _world_port(place: SlotPlace, backend: str | None, timeout: float) -> tuple[Any, int]:
    """Rank 0's store of the slot's world (listening) and its port; a free port without one.

    Other ranks: none, and 0 (they learn the port from the launcher).
    """
    if place.rank > 0:
        return None, 0
    if backend is None or place.per_item == 1:  # no store to serve: a port the function may use
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return None, int(sock.getsockname()[1])
    import torch.distributed as dist  # noqa: PLC0415 - preloaded by the spawner

    store = dist.TCPStore(  # type: ignore[attr-defined]  # public; torch's stubs miss it
        "127.0.0.1",
        0,
        place.per_item,
        is_master=True,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    return store, int(store.port)


def _join_group(
    place: SlotPlace, backend: str | None, timeout: float, store: Any, port: int
) -> bool:
    """The slot's own process group; whether one was made.

    A world of one needs no store of TCP (an in-memory one); in a larger one, rank 0 serves
    the store on `port` (`_world_port`) and the others reach it there.
    """
    if backend is None:
        return False
    import torch  # noqa: PLC0415 - preloaded by the spawner
    import torch.distributed as dist  # noqa: PLC0415

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(place.rank)
    wait = timedelta(seconds=timeout)
    if place.per_item == 1:
        store = dist.HashStore()  # type: ignore[attr-defined]  # public; torch's stubs miss it
    elif store is None:
        store = dist.TCPStore(  # type: ignore[attr-defined]  # public; torch's stubs miss it
            "127.0.0.1", port, place.per_item, is_master=False, timeout=wait
        )
    dist.init_process_group(
        backend=backend, store=store, rank=place.rank, world_size=place.per_item, timeout=wait
    )
    if backend == "gloo" and place.per_item > 1:
        # gloo connects the slot's full mesh in each rank's init, and one rank may return from
        # it while another still connects: a slot given no item then ends at once, and closes
        # what the other still connects to (seen on the test cluster).
        dist.barrier()
    return True


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__} whose str() failed>"
