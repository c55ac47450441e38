"""The worker: one process per GPU (or CPU) that joins the process group and runs `func`.

Workers are forked by the agent's spawner, which has imported torch already, so a worker
starts in milliseconds. A worker talks only to its agent, over private socketpairs; a large
result goes into a connection to the launcher that the agent opened, authenticated and handed
over (see `_send_result`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta

from slurmrun import protocol, variables, worker_env
from slurmrun.node import debugger, import_notes, inbox, slot
from slurmrun.node.proctitle import set_title, worker_comm, worker_title
from slurmrun.output import MAX_LINE, log_frame
from slurmrun.pickling import dumps, loads
from slurmrun.titles import what_runs
from slurmrun.transport import Connection, Frame, OutOfBand, nbytes

__all__ = ["STREAM_GRANTED", "STREAM_MIN_BYTES", "STREAM_REFUSED", "WorkerSpec", "run_worker"]

# Results this large go to the launcher over a connection of their own (see `_send_result`).
STREAM_MIN_BYTES = 4 << 20
STREAM_GRANTED = b"y"
STREAM_REFUSED = b"n"
# The agent answers within its connect and handshake timeouts; this only bounds a wedged one.
STREAM_WAIT = 90.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to know before it receives `func`.

    Attributes:
        hostname: its node's name, as the launcher knows it.
        start: the START its agent got for the run (`slurmrun.start_parts`).
        place: where the worker stands in the run.
    """

    hostname: str
    start: protocol.Start
    place: worker_env.RankPlace


def place_of(start: protocol.Start, local_rank: int) -> worker_env.RankPlace:
    """Where the worker of `local_rank` stands in the run that `start` begins."""
    counts = start.tasks_per_node
    if not counts:  # every node runs `workers`
        counts = worker_env.compress_counts([start.workers] * -(-start.world_size // start.workers))
    return worker_env.RankPlace(
        rank=start.rank_offset + local_rank,
        local_rank=local_rank,
        world_size=start.world_size,
        local_world_size=start.workers,
        node_rank=start.node_rank,
        master_addr=start.master_addr,
        master_port=start.master_port,
        tasks_per_node=counts,
    )


def _redirect_output(stdout: socket.socket, stderr: socket.socket) -> None:
    """Points file descriptors 1 and 2 at the agent, so C code and subprocesses are caught too."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, sock in ((1, stdout), (2, stderr)):
        os.dup2(sock.fileno(), fd)
        sock.close()
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


class _ChannelHandler(logging.Handler):
    """Sends `logging` records (and captured `warnings`) to the agent: LOG messages, no pickle."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self._conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        if _written_already(record):
            return
        try:
            msg = record.getMessage()
            if record.exc_info:
                msg += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            if len(msg) > MAX_LINE:  # what the launcher holds of a line (slurmrun.output)
                msg = f"{msg[:MAX_LINE]} [slurmrun: {len(msg) - MAX_LINE} characters cut]"
            self._conn.send(*log_frame("logging", msg, level=record.levelno, name=record.name))
        except Exception:  # logging must never break the user's function
            self.handleError(record)


def _written_already(record: logging.LogRecord) -> bool:
    """Whether a handler on the way to the root logger wrote `record` to stdout or stderr.

    Those are the agent's sockets, so the line is output already; a library that gives its
    own logger a console handler and lets records propagate (``lightning`` does), or a
    console handler beside ours on the root logger, would show each line twice. Python calls
    a logger's handlers before its parent's, so they ran; of the root's, those added before
    ours ran, and the others will run.
    """
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        for handler in logger.handlers:
            if (
                isinstance(handler, logging.StreamHandler)
                and record.levelno >= handler.level
                and _is_output(handler.stream)
            ):
                return True
        logger = logger.parent if logger.propagate else None
    return False


def _is_output(stream: object) -> bool:
    try:
        return getattr(stream, "fileno", lambda: -1)() in (1, 2)
    except (OSError, ValueError):  # closed, or not a file
        return False


def _capture_logging(conn: Connection, level: int) -> None:
    root = logging.getLogger()
    root.addHandler(_ChannelHandler(conn))
    root.setLevel(level)
    logging.captureWarnings(True)


def _set_environment(spec: WorkerSpec) -> None:
    """The worker's environment: the run's variables, then its world's (`slurmrun.worker_env`)."""
    for name in spec.start.unset:
        os.environ.pop(name, None)
    os.environ.update(spec.start.env)
    slot.users_threads = os.environ.get("OMP_NUM_THREADS")  # before slurmrun's default
    values, removed = worker_env.worker_changes(
        os.environ, spec.place, os.environ.get(variables.JOB_ENV_VAR), pid=os.getpid()
    )
    for name in removed:
        os.environ.pop(name, None)
    os.environ.update(values)
    _match_thread_count(os.environ.get("OMP_NUM_THREADS"))
    mask = os.environ.get(variables.WORKER_UMASK_VAR, "")
    if mask.isdigit():  # a submitted job's: the submitter's umask, not the job's private one
        os.umask(int(mask, 8) & 0o777)
        os.environ["SLURM_UMASK"] = mask  # for the steps and jobs the function starts


def _enter_launchers_place(spec: WorkerSpec) -> None:
    """The launcher's ``sys.path`` and working directory (kept where the latter is missing)."""
    own = [p for p in sys.path if p not in spec.start.sys_path] if spec.start.own_path else []
    sys.path[:] = [*spec.start.sys_path, *own]
    with contextlib.suppress(OSError):
        os.chdir(spec.start.cwd)


def _match_thread_count(value: str | None) -> None:
    """Makes torch's thread count what ``OMP_NUM_THREADS`` says.

    The spawner imported torch (and its OpenMP) before this worker's variables were set.
    """
    torch = sys.modules.get("torch")
    if torch is None or value is None or not value.isdigit() or int(value) < 1:
        return
    if torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))


_COMM_ERROR_MARKERS = ("gloo/transport", "Connection reset by peer", "NCCL", "Connection closed by")


def _is_communication_error(exc: BaseException) -> bool:
    """Whether `exc` is likely a consequence of another rank failing (its peer went away)."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    if isinstance(dist_error, type) and isinstance(exc, dist_error):
        return True
    text = _safe_str(exc)
    return isinstance(exc, RuntimeError) and any(m in text for m in _COMM_ERROR_MARKERS)


def _flush_stdio() -> None:
    # Before a result or an error: the agent forwards what is already written first.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _send_error(conn: Connection, exc: BaseException) -> bool:
    """Sends the exception to the launcher; False if that failed (the worker then exits).

    Its texts are clipped in the header (`protocol.clip`): a header has a size limit, and an
    error's message can be a tensor's repr. The whole traceback travels as the frame's last
    buffer, for the agent to write into the worker's log file.
    """
    _flush_stdio()
    tb_text = debugger.quit_line(exc) or _user_traceback(exc)
    cut = "the worker's log file"
    unpicklable = None
    try:
        body, buffers = dumps(exc)
    except Exception as pickling_error:
        unpicklable = _safe_str(pickling_error)
        body, buffers = b"", []
    error = protocol.Error(
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=protocol.clip(_safe_str(exc), where=cut),
        traceback=protocol.clip(tb_text, where=cut),
        # The launcher waits a moment for a root cause before raising such an error.
        secondary=_is_communication_error(exc),
        unpicklable=unpicklable,
        full_traceback=True,
    )
    try:
        conn.send(error.header(), body, [*buffers, tb_text.encode(errors="replace")])
    except OSError as e:
        # Nobody else will report this error: say so where the agent reports a death from.
        print(tb_text, file=sys.stderr)
        print(f"slurmrun: this worker could not send its error to the agent ({e})", file=sys.stderr)
        _flush_stdio()
        return False
    return True


def _user_traceback(exc: BaseException) -> str:
    """The formatted traceback of `exc`, from the first frame that is not slurmrun's own.

    The worker's own frames (`run_worker`, unpickling the call, joining the process group)
    would come first otherwise; a traceback wholly inside slurmrun keeps its last frame.
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and _is_own(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_own(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _send_result(
    conn: Connection,
    streams: socket.socket,
    spec: WorkerSpec,
    body: bytes,
    buffers: list[OutOfBand],
    *,
    stays: bool = False,
) -> None:
    """Sends the pickled result: large ones over a connection of their own, others via `conn`.

    For a large result the worker asks its agent for a connection to the launcher (opened and
    authenticated by the agent, passed over `streams` as a file descriptor), writes the frame
    into it straight from the result's memory, and then announces it through the agent, so
    that the announcement arrives behind everything the worker printed before.
    """
    size = len(body) + sum(nbytes(b) for b in buffers)
    if size >= STREAM_MIN_BYTES:
        conn.send(protocol.StreamRequest().header())
        streams.settimeout(STREAM_WAIT)
        _, fds, _, _ = socket.recv_fds(streams, 1, 1)
        if fds:
            with socket.socket(fileno=fds[0]) as sock:
                own = protocol.Result(
                    streamed=True,
                    node_rank=spec.place.node_rank,
                    local_rank=spec.place.local_rank,
                    run=spec.start.run,
                )
                Connection(sock).send(own.header(), body, buffers)
            conn.send(protocol.Result(streamed=True, stays=stays).header())
            return
    conn.send(protocol.Result(stays=stays).header(), body, buffers)


def _safe_str(obj: object) -> str:
    try:
        return str(obj)
    except Exception:
        return f"<{type(obj).__name__} whose str() failed>"


def _check_gpu_of_own(spec: WorkerSpec, gpus: int) -> None:
    """NCCL needs a GPU per worker of a host (two ranks on one GPU is an NCCL error)."""
    if spec.place.local_rank < gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"{gpus} GPU(s)" + ("" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})")
    raise RuntimeError(
        f"backend 'nccl' needs one GPU per worker, but host {spec.hostname} runs "
        f"{spec.place.local_world_size} worker(s) and this worker "
        f"(local rank {spec.place.local_rank}) "
        f"sees {shown}. Use workers_per_host='auto' (one worker per GPU), at most {gpus} "
        "worker(s) on this host, or backend='gloo' for CPU workers."
    )


def _init_process_group(spec: WorkerSpec, store_listener: socket.socket | None = None) -> bool:
    if spec.start.backend is None:
        if store_listener is not None:
            store_listener.close()
        return False
    import torch  # noqa: PLC0415 - preloaded by the spawner, so this costs nothing
    import torch.distributed as dist  # noqa: PLC0415

    backend = spec.start.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        _check_gpu_of_own(spec, torch.cuda.device_count())
        torch.cuda.set_device(spec.place.local_rank)
    timeout = timedelta(seconds=spec.start.timeout)
    # The store env:// would make, made here so that rank 0 can serve it on the socket its
    # agent held listening: the other ranks' early connects wait in its backlog instead of
    # being refused and retried after a backoff. Every rank makes its store the same way
    # (env:// would add a prefix of its own to the keys).
    listen_fd = store_listener.detach() if store_listener is not None else None  # the store's
    store = dist.TCPStore(  # type: ignore[attr-defined]  # public; torch's stubs miss it
        spec.place.master_addr,
        spec.place.master_port,
        spec.place.world_size,
        is_master=spec.place.rank == 0,
        timeout=timeout,
        master_listen_fd=listen_fd if spec.place.rank == 0 else None,
    )
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=spec.place.rank,
        world_size=spec.place.world_size,
        timeout=timeout,
    )
    # Joining is not a barrier: without one, a fast rank whose function needs no collective
    # can finish and tear down its connections while a slow rank is still connecting to it.
    if backend == "nccl":
        dist.barrier(device_ids=[spec.place.local_rank])
    else:
        dist.barrier()
    return True


def _end_process_group() -> None:
    """Ends the process group before the worker exits (unless `func` did, as torchrun scripts do).

    NCCL's ``destroy_process_group`` takes about 0.5 s (measured on an H100: it joins the
    watchdog threads), a third of a warm launch. The worker exits right after and the exit
    frees every NCCL and CUDA resource, so NCCL workers only wait for their GPU's queued work.
    """
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
    else:
        dist.destroy_process_group()


def _default_user_signals() -> None:
    """SIGUSR1 and SIGUSR2 as a Python program starts with them, unless kept ignored.

    The agent ignores them; the user's code decides, unless the launch says they stay
    ignored (a submitted job: SLURM's --signal=USR2@90 must not kill its workers).
    """
    keep = os.environ.get(variables.IGNORED_SIGNALS_VAR, "").split(",")
    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        if signum.name not in keep:
            signal.signal(signum, signal.SIG_DFL)


def run_worker(  # noqa: PLR0917 - the spawner passes the worker's sockets in order
    spec: WorkerSpec,
    sock: socket.socket,
    stdout: socket.socket,
    stderr: socket.socket,
    streams: socket.socket,
    store_listener: socket.socket | None = None,
    *,
    imports: int | None = None,
    early: bool = False,
) -> None:
    """Entry point of a worker process (forked by the agent's spawner).

    `store_listener`: rank 0's, the listening socket of the run's store (see
    `slurmrun.node.store_port`). `imports`: the pipe for what the run imported, for the
    spawner to preload (`slurmrun.node.preloads`); None: learning is off. `early`: each
    import is noted there as it starts, too (`slurmrun.node.import_notes`).
    """
    # First of all: an import from here on is noted as it starts (the spawner's are known).
    notes = import_notes.Notes(imports, set(sys.modules), early=early)
    # First, before any thread starts: threads inherit the comm (top's name) of their creator.
    set_title(
        worker_title(spec.place.rank, spec.hostname, spec.place.local_rank),
        worker_comm(spec.place.rank),
    )
    _redirect_output(stdout, stderr)
    _default_user_signals()
    faulthandler.enable(all_threads=False)  # a segfault prints its stack into the worker's log
    inbox.arm_stacks_signal(streams)
    _set_environment(spec)
    _enter_launchers_place(spec)
    conn = Connection(sock)
    _capture_logging(conn, spec.start.log_level)
    debugger.attach(conn, f"{spec.hostname} rank {spec.place.rank}")
    code = 0
    try:
        frame = conn.recv()
        while frame is not None and not isinstance(protocol.parse(frame.header), protocol.Func):
            frame = conn.recv()
        if frame is None:
            os._exit(71)
        inbox.watch_agent(conn)
        code = _serve(spec, conn, streams, frame, store_listener, notes)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    # Skip interpreter teardown: after an error the process group may be wedged in a collective.
    os._exit(code)


def _serve(  # noqa: PLR0917 - private, called once
    spec: WorkerSpec,
    conn: Connection,
    streams: socket.socket,
    frame: Frame,
    store_listener: socket.socket | None,
    imports: import_notes.Notes,
) -> int:
    """Runs the call in `frame`, and a kept worker's later calls; returns the exit code.

    A kept worker (`WorkerSpec.keep`) keeps its process group, its imports and
    `slurmrun.worker_state()` from one run to the next; it exits after an error, or once its
    process group is gone (the function destroyed it: the next run needs a new one).
    """
    initialised = False
    while True:
        try:
            func, args, kwargs = loads(frame.body, frame.buffers)
            what = what_runs(func, args, kwargs)
            set_title(worker_title(spec.place.rank, spec.hostname, spec.place.local_rank, what))
            if not initialised:
                initialised = _init_process_group(spec, store_listener)
            try:
                result = func(*args, **kwargs)
            finally:  # before the result: the run may be ended as soon as it arrives
                imports.report()
        except BaseException as exc:
            return 1 if _send_error(conn, exc) else 70
        try:
            body, buffers = dumps(result)
        except Exception as exc:
            error = TypeError(
                f"the return value of rank {spec.place.rank} ({type(result).__qualname__}) could "
                f"not be pickled to send back to the launcher: {_safe_str(exc)}. Return "
                "plain data, tensors or numpy arrays (convert other objects first)."
            )
            error.__cause__ = exc  # its traceback shows where pickling failed
            return 1 if _send_error(conn, error) else 70
        # Said with the result, so that the agent never hands the next run to a worker that
        # is on its way out (one whose function ended its process group).
        stays = spec.start.keep and (not initialised or _group_alive())
        _flush_stdio()
        _send_result(conn, streams, spec, body, buffers, stays=stays)
        del body, buffers, result, func, args, kwargs
        if not stays:
            if initialised:
                _end_process_group()
            return 0
        frame = inbox.next_call()
        run = protocol.Func.from_header(frame.header).run  # a kept worker's next run
        spec = replace(spec, start=replace(spec.start, run=run))


def _group_alive() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and bool(dist.is_initialized())
