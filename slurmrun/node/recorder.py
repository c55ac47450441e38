"""A rank's flight recorder, dumped for a hang's report (`slurmrun.protocol.StacksPurpose.HANG`).

torch's flight recorder (``TORCH_FR_BUFFER_SIZE``, which ``Launcher(flight_recorder=True)``
sets) keeps each rank's last collectives: NCCL's, and gloo's too since torch 2.6. When the
launcher finds a hang, each rank's inbox thread writes its recorder where torch's own dump on a
timeout goes (``TORCH_FR_DUMP_TEMP_FILE`` and the rank: ``python -m
torch.distributed.flight_recorder.fr_trace`` reads the folder) and says which collective it
began last: the rank behind the others is the one that did not begin the latest.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import tempfile

__all__ = ["dump_flight_recorder"]

# torch's, where TORCH_FR_DUMP_TEMP_FILE is unset
_DEFAULT_PREFIX = os.path.join(tempfile.gettempdir(), "nccl_trace_rank_")


def dump_flight_recorder() -> tuple[str, str]:
    """Writes this rank's flight recorder; returns the file and its last collective in words.

    ("", ""): no recorder (not turned on, no process group, a torch without one). Never
    raises: a hang's report must come whatever the recorder does.
    """
    if not (
        os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    ):
        return "", ""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    try:
        if c10d is None or not c10d.is_initialized():
            return "", ""
        from torch._C import _distributed_c10d as native  # noqa: PLC0415 - torch is loaded

        dump = getattr(native, "_dump_fr_trace", None)
        if c10d.get_backend() == "nccl" and hasattr(native, "_dump_nccl_trace"):
            dump = native._dump_nccl_trace  # NCCL's recorder is its own (CUDA events)
        if dump is None:
            return "", ""
        # Without stack traces: torch symbolizes them, about a second that the hang's report
        # would wait for (and fr_trace does not need them).
        try:
            raw = dump(includeStackTraces=False)
        except TypeError:  # a torch whose dump takes no such argument
            raw = dump()
        # Our own process's bytes, just made by torch: not data from elsewhere.
        entries = pickle.loads(raw).get("entries") or []  # noqa: S301
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or _DEFAULT_PREFIX
        path = f"{prefix}{c10d.get_rank()}"
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(raw)
    except Exception:  # another torch, a group being made: no dump, not an error
        return "", ""
    if not entries:
        return path, "no collective recorded"
    last = entries[-1]
    state = "" if last.get("retired") else f" ({last.get('state', '?')})"
    return path, f"{last.get('profiling_name', '?')} #{last.get('collective_seq_id', '?')}{state}"
