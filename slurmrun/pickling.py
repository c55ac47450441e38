"""Pickling for the wire: cloudpickle (protocol 5) with large buffers and tensors out of band.

Large values (tensors, numpy arrays) travel as raw out-of-band buffers (a frame's buffers in
`slurmrun.transport`): they are written from their own memory and received into preallocated
buffers that the unpickled objects then wrap without a copy. Unpickle (`loads`) only what came
from a peer that passed the handshake (`slurmrun.authentication`).

Tensors need no numpy (torch does not depend on it): a dense tensor is sent as its storage's
bytes, read in place through a ``ctypes`` array over the storage's address that holds a
reference to the storage, and rebuilt with its dtype, offset, shape and strides on a storage
that wraps the received buffer. Every dtype works (bfloat16, bool, complex, float8...), and
so do views: tensors of one storage in one pickled object share one buffer, and arrive sharing
one storage again. A Parameter stays a Parameter; ``requires_grad`` is kept (a non-leaf
arrives as a leaf, as after ``detach().requires_grad_()``); a conjugate view stays one. GPU
tensors arrive on the CPU: each CUDA storage's bytes go to the host in pinned chunks while
they are sent (`slurmrun.device_bytes`; in an in-band pickle, in one copy). Tensors that
are not plain dense ones (sparse, quantized, nested, subclasses, with attributes of their own)
are pickled as torch pickles them.

Only the bytes the tensors use are sent. `torch.save` sends whole storages, so a small view of
a huge tensor (``logits[:, -1]``) silently costs the whole; here each storage is cut to the
range its tensors in this object span (from the lowest to the highest byte any of them
reaches, so sharing survives). Finding that range takes a pass over the object first, so the
pickle is made twice when the cut saves `TRIM_MIN_BYTES` or more, and when the first pass
would have to copy (GPU storages, in-band pickles): the first pass then sends placeholders.

Code objects keep the file they came from. cloudpickle 3 renames the file of every function it
pickles by value (those of the driver script, a notebook, closures) to ``"<dynamic-code>"``,
which leaves tracebacks, pdb and stack dumps on the worker without the user's path and source
lines; each code object (nested ones included) is sent here with its ``co_filename`` and gets
it back on arrival, whatever cloudpickle's version.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import sys
import types
from collections.abc import Sequence
from typing import Any

import cloudpickle

from slurmrun.device_bytes import DeviceBytes
from slurmrun.torch_import import import_torch
from slurmrun.transport import LARGE_BUFFER_BYTES, Buffer, OutOfBand

__all__ = ["TRIM_MIN_BYTES", "dumps", "dumps_inband", "loads"]

# Counts every call of `loads`: tests use it to prove that hostile peers never reach unpickling.
unpickle_count = 0

_ALIGN = 16  # the largest element size (complex128): rebased offsets stay whole numbers
TRIM_MIN_BYTES = LARGE_BUFFER_BYTES  # unused storage bytes worth a second pickling pass

_StorageKey = tuple[str, int, int]  # device, address, bytes
_Deferred = dict[int, tuple[bytearray, DeviceBytes]]  # id(placeholder) -> (placeholder, bytes)


class _Storage:
    """A tensor storage (its bytes `lo:hi`), pickled once however many tensors view it."""

    def __init__(self, storage: Any, lo: int, hi: int) -> None:
        self.storage = storage
        self.lo = lo
        self.hi = hi

    def reduce(self, torch: Any, deferred: _Deferred | None) -> tuple[Any, ...]:
        """`deferred`: where CUDA storages go instead of being copied (out-of-band pickles)."""
        storage, lo, n = self.storage, self.lo, self.hi - self.lo
        if deferred is not None and storage.device.type == "cuda":
            # An empty placeholder buffer, which the buffer callback swaps for the device's bytes.
            marker = bytearray()
            deferred[id(marker)] = (marker, DeviceBytes(storage, lo, n))
            return (_rebuild_storage, (pickle.PickleBuffer(marker),))
        if storage.device.type != "cpu":
            # One copy of the used bytes to the CPU; every view of the storage rebuilds on it.
            part = torch.empty((0,), dtype=torch.uint8, device=storage.device)
            storage, lo = part.set_(storage, lo, (n,), (1,)).cpu().untyped_storage(), 0
        raw = (ctypes.c_ubyte * n).from_address(storage.data_ptr() + lo)
        raw._slurmrun_owner = storage  # type: ignore[attr-defined]  # the memory's owner lives on
        return (_rebuild_storage, (pickle.PickleBuffer(raw),))


def _rebuild_storage(data: Any) -> Any:
    torch = import_torch()  # only a value that holds tensors needs torch in the launcher

    if memoryview(data).nbytes == 0:
        return torch.empty((0,), dtype=torch.uint8).untyped_storage()
    return torch.frombuffer(data, dtype=torch.uint8).untyped_storage()


def _rebuild_tensor(  # noqa: PLR0917 - pickle calls it with positional arguments
    storage: Any,
    dtype: str,
    offset: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
    conj: bool,
) -> Any:
    torch = import_torch()  # only a value that holds tensors needs torch in the launcher

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise TypeError(f"not a torch dtype: {dtype!r}")
    if storage is None:
        tensor = torch.empty_strided(shape, stride, dtype=torch_dtype)
    else:
        tensor = torch.empty((0,), dtype=torch_dtype).set_(storage, offset, shape, stride)
    if conj:
        tensor = tensor.conj()
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_() if requires_grad else tensor


# cloudpickle's own reducer of code objects (the same table in 2.x and 3.x): its result is
# rebuilt and then given back the file name that cloudpickle 3 replaces.
_reduce_code = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _rebuild_code(make: Any, args: tuple[Any, ...], filename: str) -> types.CodeType:
    code: types.CodeType = make(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle ships no type hints
    """cloudpickle, plus plain CPU/GPU tensors as their storages' raw bytes, out of band.

    `spans` (storage key -> byte range to send) comes from a first pass over the same object,
    which records in `used` which bytes its tensors need. In that first pass, storages are
    whole, and those that would cost a copy (on a GPU, or in band) are empty placeholders.
    """

    def __init__(
        self,
        file: io.BytesIO,
        buffer_callback: Any = None,
        spans: dict[_StorageKey, tuple[int, int]] | None = None,
        deferred: _Deferred | None = None,
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self.spans = spans
        self.used: dict[_StorageKey, list[int]] = {}  # key -> [lo, hi]
        self.placeholders = False
        self._in_band = buffer_callback is None
        self._storages: dict[_StorageKey, _Storage] = {}
        # Out of band, CUDA storages go here and are sent from the device in chunks, uncopied.
        self.deferred = None if self._in_band else deferred

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is types.CodeType:
            make, args = _reduce_code(obj)
            return (_rebuild_code, (make, args, obj.co_filename))
        torch = sys.modules.get("torch")
        if torch is not None:
            if type(obj) is _Storage:
                # The first pass sends a placeholder where the real thing would cost a copy.
                copies = self._in_band or obj.storage.device.type not in {"cpu", "cuda"}
                if self.spans is None and copies:
                    self.placeholders = True
                    return (_rebuild_storage, (pickle.PickleBuffer(bytearray()),))
                return obj.reduce(torch, self.deferred)
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and _plain_tensor(torch, obj):
                return self._reduce_tensor(torch, obj)
        return super().reducer_override(obj)

    def _reduce_tensor(self, torch: Any, obj: Any) -> tuple[Any, ...]:
        t = obj.detach()
        if t.is_neg():
            t = t.resolve_neg()
        conj = bool(t.is_conj())
        if conj:
            t = t.conj()  # the same memory without the conjugate bit; set again on arrival
        dtype = str(t.dtype).removeprefix("torch.")
        shape, stride = tuple(t.shape), tuple(t.stride())
        flags = (bool(obj.requires_grad), type(obj) is torch.nn.Parameter, conj)
        if t.numel() == 0:
            return (_rebuild_tensor, (None, dtype, 0, shape, stride, *flags))
        storage = t.untyped_storage()
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + size * (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)))
        seen = self.used.setdefault(key, [lo, hi])
        seen[0], seen[1] = min(seen[0], lo), max(seen[1], hi)
        ref = self._storages.get(key)
        if ref is None:
            # A storage new in this pass (a resolved negative view's copy) is sent whole.
            span = (self.spans or {}).get(key, (0, storage.nbytes()))
            ref = self._storages[key] = _Storage(storage, *span)
        return (_rebuild_tensor, (ref, dtype, (lo - ref.lo) // size, shape, stride, *flags))

    def trimmed_spans(self) -> dict[_StorageKey, tuple[int, int]] | None:
        """The byte ranges to send instead of whole storages, when a second pass is worth it."""
        spans: dict[_StorageKey, tuple[int, int]] = {}
        unused = 0
        for key, (lo, hi) in self.used.items():
            spans[key] = (lo - lo % _ALIGN, hi)
            unused += key[2] - (hi - spans[key][0])
        return spans if self.placeholders or unused >= TRIM_MIN_BYTES else None


def _plain_tensor(torch: Any, obj: Any) -> bool:
    """A dense tensor with data and nothing else attached (others pickle as torch does)."""
    return bool(
        obj.layout == torch.strided
        and not (obj.is_quantized or obj.is_meta or obj.is_nested)
        and not obj.__dict__
    )


class _Collect:
    """The pickler's buffer callback: out-of-band buffers in order, CUDA ones as DeviceBytes."""

    def __init__(self) -> None:
        self.buffers: list[OutOfBand] = []
        self.deferred: _Deferred = {}

    def __call__(self, buffer: pickle.PickleBuffer) -> None:
        placeholder = self.deferred.get(id(buffer.raw().obj))
        self.buffers.append(buffer if placeholder is None else placeholder[1])


def _dump(obj: Any, out_of_band: bool) -> tuple[bytes, list[OutOfBand]]:
    spans = None
    for _ in range(2):
        collect = _Collect()
        buffers = collect.buffers
        out = io.BytesIO()
        pickler = _Pickler(out, collect if out_of_band else None, spans, collect.deferred)
        pickler.dump(obj)
        if spans is not None:
            break
        spans = pickler.trimmed_spans()
        if spans is None:
            break
    return out.getvalue(), buffers


def dumps(obj: Any) -> tuple[bytes, list[OutOfBand]]:
    """Pickles `obj` with cloudpickle (protocol 5), keeping large buffers out of band.

    CUDA tensors' bytes stay on the device as `DeviceBytes` until
    `slurmrun.transport.Connection.send` sends them.
    """
    return _dump(obj, out_of_band=True)


def dumps_inband(obj: Any) -> bytes:
    """Pickles `obj` like `dumps`, with every buffer inside the one returned bytes object."""
    return _dump(obj, out_of_band=False)[0]


def loads(body: Buffer | bytes | memoryview, buffers: Sequence[Any] = ()) -> Any:
    """Unpickles what `dumps` produced. Call only on frames from authenticated peers."""
    global unpickle_count  # noqa: PLW0603 - a process-wide counter is exactly what tests need
    unpickle_count += 1
    return pickle.loads(body, buffers=buffers)  # noqa: S301 - the peer proved the launch secret
