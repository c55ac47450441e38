"""The physical floor of a launch: N fresh processes import torch, join gloo, all_reduce once.

    python benchmarks/floor.py --workers 2 [--return-mib 64]

The parent (which never imports torch) starts the N children with MASTER_ADDR=127.0.0.1 and
a free port (env:// rendezvous), waits for them, and prints one ``BENCH_JSON`` line with
the time from the first spawn to the last exit (``launch_s``).

With ``--return-mib M`` each child then also sends a float32 tensor of M MiB back to the
parent as raw bytes over loopback TCP (one connection per child, received in parallel into
preallocated buffers): the floor for returning results, with the parent's memory.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402 - the clock starts before any import
import ctypes  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import current_rss_bytes, emit, last_stamp, peak_rss_bytes  # noqa: E402

MIB = 1 << 20


def child(rank: int, world_size: int, return_mib: int) -> None:
    """One worker: import torch, init gloo over loopback, all_reduce, leave like slurmrun."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    ok = int(t.item()) == world_size
    if return_mib:
        value = torch.full((return_mib * MIB // 4,), float(rank), dtype=torch.float32)
        with open(os.path.join(os.environ["FLOOR_STAMP_DIR"], f"created-{rank}"), "w") as f:
            f.write(repr(time.time()))
        port = int(os.environ["FLOOR_RETURN_PORT"])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(rank.to_bytes(4, "big"))
            # the tensor's own memory, without numpy (a fresh venv has none)
            s.sendall((ctypes.c_ubyte * (return_mib * MIB)).from_address(value.data_ptr()))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if ok else 1)


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recv_all(sock: socket.socket, buf: bytearray) -> None:
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("child closed early")
        got += k


def _receive(server: socket.socket, nbytes: int, into: dict[int, bytearray]) -> None:
    """Receives one child's raw tensor bytes (rank first) into a fresh buffer."""
    sock, _ = server.accept()
    with sock:
        rank = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
        buf = bytearray(nbytes)
        _recv_all(sock, buf)
        into[rank] = buf


def parent(workers: int, return_mib: int) -> None:
    """Starts the children and waits for all of them (and their returned bytes)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    server = socket.create_server(("127.0.0.1", 0), backlog=workers)
    env["FLOOR_RETURN_PORT"] = str(server.getsockname()[1])
    received: dict[int, bytearray] = {}
    env["FLOOR_STAMP_DIR"] = stamp_dir = tempfile.mkdtemp(prefix="slurmrun-bench-stamps-")
    me = os.path.abspath(__file__)
    argv = ["--workers", str(workers), "--return-mib", str(return_mib)]
    rss_before = current_rss_bytes()
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen([sys.executable, me, "--child", str(r), *argv], env=env)
        for r in range(workers)
    ]
    receivers = [
        threading.Thread(target=_receive, args=(server, return_mib * MIB, received))
        for _ in range(workers if return_mib else 0)
    ]
    for t in receivers:
        t.start()
    for t in receivers:
        t.join()
    returned_at = time.time()
    codes = [p.wait() for p in procs]
    launch_s = time.perf_counter() - t0
    created = last_stamp(stamp_dir)
    shutil.rmtree(stamp_dir, ignore_errors=True)
    ok = all(c == 0 for c in codes) and len(received) == (workers if return_mib else 0)
    emit(
        {
            "launch_s": [launch_s] if not return_mib else launch_s,
            "after_created_s": None if created is None else returned_at - created,
            "bytes_returned": return_mib * MIB * workers,
            "rss_before": rss_before,
            "peak_rss": peak_rss_bytes(),
            "ok": ok,
            "script_s": time.perf_counter() - T_START,
        }
    )


def main() -> None:
    """Parent or child, by command line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--return-mib", type=int, default=0)
    parser.add_argument("--child", type=int, default=None, help="(internal) this child's rank")
    a = parser.parse_args()
    if a.child is None:
        parent(a.workers, a.return_mib)
    else:
        child(a.child, a.workers, a.return_mib)


if __name__ == "__main__":
    main()
