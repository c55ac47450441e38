"""Tensors through the transport and through real launches: every dtype, views, no numpy."""

from __future__ import annotations

import mmap
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import slurmrun
from slurmrun import pickling
from slurmrun.node.worker import STREAM_MIN_BYTES

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental", "ignore:Sparse invariant checks"
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every dtype torch has (float8s, bits, sub-byte ints...), but quantized ones: those are not
# plain tensors and pickle as torch pickles them.
DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    - {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4},
    key=str,
)


def made(dtype: torch.dtype, n: int = 12) -> torch.Tensor:
    """`n` elements of `dtype` with distinct bytes (dtypes without arithmetic included)."""
    return torch.arange(n * dtype.itemsize, dtype=torch.uint8).view(dtype)


def raw_bytes(t: torch.Tensor) -> list[int]:
    """The tensor's element bytes in logical order (works for dtypes without `==`)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8).tolist()


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    # A negative view (the imaginary part of a conjugate view) is sent resolved, as a copy.
    assert a.stride() == b.stride() or a.is_neg()
    assert a.requires_grad == b.requires_grad and a.is_conj() == b.is_conj()
    assert b.device.type == "cpu"
    assert raw_bytes(a.cpu()) == raw_bytes(b)


def out_of_band(obj):
    """dumps/loads as the launcher does it: buffers received into fresh writable memory."""
    body, buffers = pickling.dumps(obj)
    received = []
    for b in buffers:
        raw = b.raw()
        buf = mmap.mmap(-1, raw.nbytes) if raw.nbytes else bytearray()
        buf[:] = raw
        received.append(buf)
    return pickling.loads(body, received), body, buffers


def in_band(obj):
    return pickle.loads(pickling.dumps_inband(obj))


ROUND_TRIPS = [out_of_band, lambda obj: (in_band(obj), None, None)]


# ---------------------------------------------------------------- dumps / loads


@pytest.mark.parametrize("trip", ROUND_TRIPS, ids=["out-of-band", "in-band"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(dtype, trip):
    t = made(dtype).reshape(3, 4)
    (back, *_) = trip(t)
    same_tensor(t, back)


def cases():
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    leaf = torch.ones(3, requires_grad=True)
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    return {
        "contiguous": torch.arange(5, dtype=torch.int64),
        "transposed": base.t(),
        "strided": base[1:, ::2],
        "expanded": torch.tensor([7.0]).expand(3, 4),
        "zero-d": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "empty view": base[2:2],
        "bfloat16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "requires grad": leaf,
        "non-leaf": leaf * 2,
        "parameter": torch.nn.Parameter(torch.randn(2, 3)),
        "frozen parameter": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "int parameter": torch.nn.Parameter(torch.arange(3), requires_grad=False),
        "conj view": z.conj(),
        "neg view": z.conj().imag,
    }


@pytest.mark.parametrize("trip", ROUND_TRIPS, ids=["out-of-band", "in-band"])
@pytest.mark.parametrize("name", list(cases()))
def test_tensor_kinds_come_back_as_what_they_were(name, trip):
    t = cases()[name]
    (back, *_) = trip(t)
    same_tensor(t, back)
    if t.is_leaf and t.requires_grad:
        assert back.is_leaf


@pytest.mark.parametrize("trip", ROUND_TRIPS, ids=["out-of-band", "in-band"])
def test_views_of_one_storage_stay_one_storage(trip):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    value = {"rows": base[1:3], "t": base.t(), "col": base[:, 2], "whole": base, "again": base}
    (back, *_) = trip(value)
    for key, t in value.items():
        same_tensor(t, back[key])
    assert back["again"] is back["whole"]
    pointers = {back[k].untyped_storage().data_ptr() for k in value}
    assert len(pointers) == 1
    back["t"][2, 1] = -1.0  # element (1, 2) of base
    assert back["rows"][0, 2] == -1.0 and back["col"][1] == -1.0 and back["whole"][1, 2] == -1.0


def test_parameters_stay_parameters_sharing_storage_with_plain_views():
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    back, _, _ = out_of_band([p, p.detach()[2:]])
    assert type(back[0]) is torch.nn.Parameter and back[0].requires_grad
    assert type(back[1]) is torch.Tensor
    with torch.no_grad():
        back[0][3] = 100.0
    assert back[1][1] == 100.0


def test_results_are_writable_memory():
    for trip in ROUND_TRIPS:
        (back, *_) = trip({"a": torch.zeros(1000), "b": torch.zeros(3, dtype=torch.bfloat16)})
        back["a"] += 1
        back["b"][0] = 2
        assert back["a"].sum() == 1000 and back["b"][0] == 2


def test_a_small_view_of_a_huge_storage_sends_only_its_bytes():
    huge = torch.zeros(4 << 20)  # 16 MiB
    huge[1_000_000:1_000_010] = torch.arange(10.0)
    view = huge[1_000_000:1_000_010]
    back, _, buffers = out_of_band(view)
    assert sum(b.raw().nbytes for b in buffers) < 64
    same_tensor(view, back)
    assert len(pickling.dumps_inband(view)) < 1024
    same_tensor(view, in_band(view))


def test_views_far_apart_in_one_storage_send_their_span_and_stay_shared():
    huge = torch.arange(4 << 20, dtype=torch.float32)
    first, last = huge[10:20], huge[3 << 20 : (3 << 20) + 5]
    back, _, buffers = out_of_band((first, last))
    span = ((3 << 20) + 5) * 4 - 32  # from `first` (byte 40, aligned down to 16) to `last`
    assert sum(b.raw().nbytes for b in buffers) == span
    same_tensor(first, back[0])
    same_tensor(last, back[1])
    assert back[0].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()


def test_whole_tensors_are_sent_from_their_own_memory_once():
    t = torch.ones(1 << 20)
    body, buffers = pickling.dumps({"t": t, "same": t})
    assert len(body) < 1024 and len(buffers) == 1
    assert buffers[0].raw().nbytes == 4 << 20
    # zero-copy: the buffer is the tensor's memory itself
    assert torch.frombuffer(buffers[0], dtype=torch.float32).data_ptr() == t.data_ptr()


def test_buffers_keep_their_tensor_alive():
    body, buffers = pickling.dumps(torch.full((1 << 14,), 5.0))
    # The tensor is gone from here; its storage must live on in the buffer (were it freed,
    # these allocations of the same small size would take its memory and overwrite it).
    filler = [torch.zeros(1 << 14) for _ in range(8)]
    back = pickling.loads(body, [bytearray(b.raw()) for b in buffers])
    assert torch.all(back == 5.0)
    del filler


def test_tensors_torch_pickles_itself_still_round_trip():
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    tagged = torch.ones(2)
    tagged.tag = "kept"  # type: ignore[attr-defined]
    (back_sparse, back_tagged), _, _ = out_of_band((sparse, tagged))
    assert torch.equal(back_sparse.to_dense(), sparse.to_dense())
    assert back_tagged.tag == "kept" and torch.equal(back_tagged, tagged)


def test_numpy_arrays_keep_working():
    np = pytest.importorskip("numpy")
    a = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)[:, ::2]
    back, _, buffers = out_of_band({"a": a, "t": torch.ones(3)})
    assert buffers  # out of band
    assert back["a"].dtype == a.dtype and (back["a"] == a).all()
    back["a"][0, 0] = -1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tensors_arrive_on_the_cpu_sharing_storage():
    base = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    value = {"a": base[10:20], "b": base[15:30], "p": torch.nn.Parameter(base[:4].clone())}
    for trip in ROUND_TRIPS:
        (back, *_) = trip(value)
        for key, t in value.items():
            same_tensor(t, back[key])
        assert back["a"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()


# ---------------------------------------------------------------- real launches


def return_tensor_kinds(n_big: int):
    import torch

    rank = int(os.environ["RANK"])
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
    return {
        "rows": base[1:3],
        "t": base.t(),
        "big": torch.full((n_big,), float(rank), dtype=torch.bfloat16),
        "bool": torch.tensor([True, bool(rank)]),
        "zero-d": torch.tensor(rank),
        "empty": torch.empty(0, 3),
        "param": torch.nn.Parameter(torch.ones(2) * rank),
        "grad": torch.ones(2, requires_grad=True),
        "conj": torch.tensor([1 + 1j]).conj(),
    }


@pytest.mark.parametrize("n_big", [16, STREAM_MIN_BYTES], ids=["via agent", "streamed"])
def test_launch_returns_tensors_as_they_were(n_big):
    result = slurmrun.launch(return_tensor_kinds, (n_big,), workers_per_host=2)
    for rank in range(2):
        value = result.rank(rank)
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
        same_tensor(base[1:3], value["rows"])
        same_tensor(base.t(), value["t"])
        assert value["rows"].untyped_storage().data_ptr() == value["t"].untyped_storage().data_ptr()
        value["t"][0, 1] = -5.0
        assert value["rows"][0, 0] == -5.0
        big = value["big"]
        assert big.dtype == torch.bfloat16 and big.shape == (n_big,) and torch.all(big == rank)
        big += 1  # writable
        assert value["bool"].tolist() == [True, bool(rank)]
        assert value["zero-d"].shape == () and value["zero-d"].item() == rank
        assert value["empty"].shape == (0, 3)
        assert type(value["param"]) is torch.nn.Parameter and value["param"].requires_grad
        assert value["grad"].requires_grad and value["grad"].is_leaf
        assert value["conj"].is_conj() and value["conj"].resolve_conj().tolist() == [1 - 1j]


# ---------------------------------------------------------------- without numpy

NO_NUMPY_SCRIPT = """
import os, sys, warnings
warnings.simplefilter("ignore")  # torch warns that it could not initialise numpy
import torch
import slurmrun
from slurmrun import pickling

assert "numpy" not in sys.modules or sys.modules["numpy"] is None, "numpy was imported"
try:
    import numpy
except ImportError:
    pass
else:
    raise SystemExit("numpy is importable: this test proves nothing")

def check_no_numpy():
    try:
        import numpy
    except ImportError:
        return True
    return False

def work():
    import torch
    rank = int(os.environ["RANK"])
    base = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + rank
    return {"t": base.t(), "row": base[1], "p": torch.nn.Parameter(torch.ones(2)),
            "no numpy": check_no_numpy()}

x = torch.arange(10, dtype=torch.float32)
body, buffers = pickling.dumps({"x": x[2:], "y": x.reshape(2, 5).t()})
back = pickling.loads(body, [bytearray(b.raw()) for b in buffers])
assert torch.equal(back["x"], x[2:]) and torch.equal(back["y"], x.reshape(2, 5).t())

result = slurmrun.launch(work, workers_per_host=2)
for rank in range(2):
    v = result.rank(rank)
    assert v["no numpy"], "a worker could import numpy"
    expected = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + rank
    assert torch.equal(v["t"], expected.t()) and torch.equal(v["row"], expected[1])
    assert type(v["p"]) is torch.nn.Parameter
print("NO-NUMPY OK")
"""


def test_tensors_travel_where_numpy_cannot_be_imported(tmp_path):
    # A `numpy` package that fails to import, first on the path of the launcher and (through
    # PYTHONPATH) of its agents and workers: importing numpy fails everywhere, as in a venv
    # without it, while torch still imports.
    blocker = tmp_path / "block" / "numpy"
    blocker.mkdir(parents=True)
    # ModuleNotFoundError, as for a missing package: torch catches exactly that one.
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError('blocked', name='numpy')\n")
    script = tmp_path / "no_numpy.py"
    script.write_text(textwrap.dedent(NO_NUMPY_SCRIPT))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "block"), REPO])
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0 and "NO-NUMPY OK" in proc.stdout, proc.stdout + proc.stderr
