"""Bytes of a GPU tensor's storage, copied to the host chunk by chunk while they are sent.

A CUDA tensor returned by a worker has to cross to the host before it can go into a socket.
Copying it whole (``tensor.cpu()``) costs a pageable host buffer as large as the tensor,
written once by the copy and read again by the send, before the first byte leaves; on a
machine where first-touched memory is slow that copy alone runs at about the speed of the
send. Here the bytes go through two small pinned buffers instead: while one chunk is being
sent, the GPU's copy engine fills the other, so the copy hides behind the send and the worker
allocates no host memory the size of its result.
"""

from __future__ import annotations

import ctypes
import socket
from typing import Any

__all__ = ["CHUNK_BYTES", "DeviceBytes"]

CHUNK_BYTES = 8 << 20  # pinned; a copy of one takes well under a millisecond on a PCIe 4+ GPU


class DeviceBytes:
    """Bytes ``lo:lo + nbytes`` of a GPU storage, sent by `send_to` without a full host copy.

    It stands in an out-of-band buffer list where a `pickle.PickleBuffer` would (see
    `slurmrun.pickling.dumps`); the receiver gets plain bytes, as for a CPU tensor.
    """

    def __init__(self, storage: Any, lo: int, nbytes: int) -> None:
        self.storage = storage  # holds the memory until it is sent
        self.lo = lo
        self.nbytes = nbytes

    def send_to(self, sock: socket.socket, chunk_bytes: int = CHUNK_BYTES) -> None:
        """Writes the bytes into `sock`, double-buffered through pinned host memory."""
        if self.nbytes == 0:
            return
        import torch  # noqa: PLC0415 - only a GPU result gets here, and its worker has torch

        device = self.storage.device
        src = torch.empty((0,), dtype=torch.uint8, device=device)
        src.set_(self.storage, self.lo, (self.nbytes,), (1,))
        chunk = min(chunk_bytes, self.nbytes)
        pinned = [torch.empty((chunk,), dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        views = [(ctypes.c_ubyte * chunk).from_address(p.data_ptr()) for p in pinned]
        done = [torch.cuda.Event(), torch.cuda.Event()]  # type: ignore[no-untyped-call]
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # The copies wait for whatever the user's stream still has to do to the tensor.
        stream.wait_stream(torch.cuda.current_stream(device))
        starts = range(0, self.nbytes, chunk)

        def copy(i: int) -> None:
            start = starts[i]
            n = min(chunk, self.nbytes - start)
            with torch.cuda.stream(stream):
                pinned[i % 2][:n].copy_(src[start : start + n], non_blocking=True)
                done[i % 2].record(stream)

        copy(0)
        for i, start in enumerate(starts):
            if i + 1 < len(starts):
                copy(i + 1)  # into the other buffer, whose bytes were sent last round
            done[i % 2].synchronize()
            n = min(chunk, self.nbytes - start)
            sock.sendall(memoryview(views[i % 2]).cast("B")[:n])
