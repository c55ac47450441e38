"""slurmrun.launch on localhost: real agents, real forked workers, real gloo."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from driver_common import launcher_seen_from_a_worker

import slurmrun
from slurmrun import authentication, pickling, transport
from slurmrun.errors import RemoteTraceback
from slurmrun.launcher.run import Run
from slurmrun.node.worker import STREAM_MIN_BYTES

# ---------------------------------------------------------------- functions run on workers


def env_and_rank():
    import torch.distributed as dist

    keys = [
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ]
    return {k: os.environ.get(k) for k in keys} | {"initialized": dist.is_initialized()}


def all_reduce_sum():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_backend(), t.item()


def raise_on_rank_1_while_rank_0_waits():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("rank 1 has no such key")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here until the launcher stops it
    time.sleep(60)


def exit_on_rank_1(how: str):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("last words before dying", file=sys.stderr, flush=True)
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            import ctypes

            ctypes.string_at(0)
    dist.all_reduce(torch.ones(1))
    time.sleep(60)


def kill_own_agent():
    # worker -> spawner -> agent
    agent = psutil.Process().parent().parent()
    assert " ".join(agent.cmdline()) == "slurmrun agent (localhost)"
    if os.environ["LOCAL_RANK"] == "0":
        agent.kill()
    time.sleep(60)


def stop_own_agent():
    if os.environ["LOCAL_RANK"] == "0":
        psutil.Process().parent().parent().suspend()
    time.sleep(60)


class Unpicklable:
    def __reduce__(self):
        raise TypeError("Unpicklable refuses to be pickled")


def return_unpicklable():
    return {"fine": 1, "bad": Unpicklable()}


class UnpicklableError(Exception):
    def __init__(self):
        super().__init__("an error holding a lock")
        self.lock = threading.Lock()


def raise_unpicklable_error():
    raise UnpicklableError()


def return_tensors(n_bytes: int):
    import torch

    rank = int(os.environ["RANK"])
    big = torch.full((n_bytes // 4,), float(rank), dtype=torch.float32)
    return {
        "big": big,
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "empty": torch.zeros(0, 5),
    }


def be_a_hostile_peer():
    """Attack the launcher from a worker: wrong secret, garbage, truncated handshakes."""
    addr, port = launcher_seen_from_a_worker()
    assert "SLURMRUN_SECRET" not in os.environ, "the secret leaked into the workers' environment"
    refused = 0
    for attempt in ("wrong-secret", "garbage", "frame-without-handshake", "truncated"):
        with socket.create_connection((addr, port), timeout=5) as s:
            try:
                if attempt == "wrong-secret":
                    authentication.client_handshake(s, b"x" * 32, timeout=5)
                elif attempt == "garbage":
                    s.recv(36)
                    s.sendall(os.urandom(64))
                    if s.recv(100) == b"":
                        refused += 1
                    continue
                elif attempt == "frame-without-handshake":
                    s.sendall(b"SRF1" + os.urandom(200))
                    s.recv(36)
                    if s.recv(100) in (b"",):
                        refused += 1
                    continue
                else:
                    s.recv(36)
                    s.sendall(os.urandom(10))
                    s.shutdown(socket.SHUT_WR)
                    if s.recv(100) == b"":
                        refused += 1
                    continue
            except (authentication.AuthenticationError, ConnectionError):
                refused += 1
    return refused


def pids_then_sleep(path: str):
    me = psutil.Process()
    with open(f"{path}.{os.environ['RANK']}", "w") as f:
        f.write(" ".join(str(p.pid) for p in (me, me.parent(), me.parent().parent())))
    time.sleep(120)


def _holds(data, halves) -> bool:
    """Whether `data` holds the two halves of the secret, one right after the other.

    The scanning worker gets the secret in halves, which never lie side by side in its memory
    (a pickle or an object header separates them): a match is a real copy of the secret.
    """
    first, second = halves
    at = data.find(first)
    while at >= 0:
        if data[at + len(first) : at + len(first) + len(second)] == second:
            return True
        at = data.find(first, at + 1)
    return False


def _memory_holding(pid: int, patterns) -> list[str]:
    """The memory regions of process `pid` that hold one of `patterns` (halves, see _holds)."""
    found = []
    chunk_bytes = 8 << 20
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read().splitlines()
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split(maxsplit=5)
            perms, path = fields[1], fields[5].strip() if len(fields) > 5 else ""
            if not perms.startswith("r") or path in ("[vvar]", "[vvar_vclock]", "[vsyscall]"):
                continue
            if "w" not in perms and path not in ("", "[stack]", "[heap]"):
                continue  # a file's contents, as mapped: nothing the process wrote
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            tail = b""
            for at in range(lo, hi, chunk_bytes):
                try:
                    mem.seek(at)
                    chunk = tail + mem.read(min(chunk_bytes, hi - at))
                except OSError:
                    break
                if any(_holds(chunk, p) for p in patterns):
                    found.append(f"{path or 'anonymous'} {fields[0]}")
                    break
                tail = chunk[-64:]
    return found


def look_for_the_secret(raw_halves, hex_halves):
    """Runs on a worker: every place where this worker, or its spawner, holds the secret."""
    import gc

    hex_bytes = tuple(h.encode() for h in hex_halves)
    patterns = [raw_halves, hex_bytes]
    # Memory first: what this scan allocates could reuse (overwrite) freed memory.
    places = [f"worker memory: {r}" for r in _memory_holding(os.getpid(), patterns)]

    def check(value, where) -> None:
        if isinstance(value, str):
            hit = _holds(value, hex_halves)
        elif isinstance(value, (bytes, bytearray)):
            hit = _holds(value, raw_halves) or _holds(value, hex_bytes)
        else:
            return
        if hit:
            places.append(where)

    for obj in gc.get_objects():
        for ref in gc.get_referents(obj):
            check(ref, f"an object referred to by a {type(obj).__name__}")
    for top in sys._current_frames().values():
        frame = top
        while frame is not None:
            for name, value in frame.f_locals.items():
                check(value, f"local {name} of {frame.f_code.co_name}")
            frame = frame.f_back
    if "SLURMRUN_SECRET" in os.environ:
        places.append("os.environ")
    for name, value in os.environ.items():
        check(value, f"os.environ[{name!r}]")
    spawner = psutil.Process().parent()
    agent = spawner.parent()
    assert agent is not None and " ".join(agent.cmdline()) == "slurmrun agent (localhost)"
    for who, pid in (("worker", os.getpid()), ("spawner", spawner.pid)):
        with open(f"/proc/{pid}/environ", "rb") as f:
            check(f.read(), f"/proc/<{who}>/environ")
    if os.environ["RANK"] != "0":
        return {"places": places}
    return {
        "places": places + [f"spawner memory: {r}" for r in _memory_holding(spawner.pid, patterns)],
        # The agent holds the secret (it authenticates every connection): a scan that finds it
        # there shows that the scans above would have found it too.
        "in_agent_memory": bool(_memory_holding(agent.pid, [raw_halves])),
        "command_lines": [" ".join(p.cmdline()) for p in (psutil.Process(), spawner, agent)],
    }


# ---------------------------------------------------------------- tests: results


def test_every_rank_returns_and_sees_its_torchrun_style_environment():
    result = slurmrun.launch(env_and_rank, workers_per_host=2)
    assert result.hostnames == ["localhost"]
    assert len(result.return_values) == 1 and len(result.return_values[0]) == 2
    for rank in range(2):
        env = result.rank(rank)
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank)
        assert env["GROUP_RANK"] == "0"
        assert env["WORLD_SIZE"] == "2"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert int(env["MASTER_PORT"]) > 0
        assert env["initialized"] is True
    assert result.index("localhost", 1) == result.rank(1)
    with pytest.raises(IndexError):
        result.rank(2)
    with pytest.raises(IndexError):
        result.index("localhost", 2)
    with pytest.raises(ValueError):
        result.index("node9", 0)


def test_gloo_all_reduce_sums_over_all_workers():
    result = slurmrun.launch(all_reduce_sum, workers_per_host=2, backend="auto")
    assert result.values() == [("gloo", 3.0), ("gloo", 3.0)]


def test_nccl_without_a_gpu_per_worker_is_a_clear_error():
    # This machine has no GPU: every worker lacks one. On a GPU machine tests/gpu checks the
    # same rule with one worker more than there are GPUs.
    with pytest.raises(RuntimeError, match="backend 'nccl' needs one GPU per worker") as raised:
        slurmrun.launch(all_reduce_sum, workers_per_host=2, backend="nccl", timeout=60)
    message = str(raised.value)
    assert "sees 0 GPU(s)" in message and "backend='gloo'" in message, message


def test_launcher_class_runs_lambdas_closures_and_kwargs():
    offset = 100

    def closure(x, *, scale):
        return int(os.environ["RANK"]) * scale + x + offset

    launcher = slurmrun.Launcher(workers_per_host=2, backend="gloo")
    assert launcher.run(closure, (1,), {"scale": 10}).values() == [101, 111]
    assert launcher.run(lambda: "lambda").rank(0) == "lambda"


def test_two_hosts_entries_on_localhost_get_ranks_host_by_host():
    result = slurmrun.launch(
        env_and_rank, hostnames=["localhost", "localhost"], workers_per_host=[1, 2]
    )
    ranks = [
        [(v["RANK"], v["GROUP_RANK"], v["LOCAL_RANK"]) for v in host]
        for host in result.return_values
    ]
    assert ranks == [[("0", "0", "0")], [("1", "1", "0"), ("2", "1", "1")]]
    assert {v["WORLD_SIZE"] for v in result.values()} == {"3"}


def test_backend_none_skips_the_process_group():
    result = slurmrun.launch(env_and_rank, workers_per_host=1, backend=None)
    assert result.rank(0)["initialized"] is False
    assert result.rank(0)["RANK"] == "0"


def test_auto_workers_per_host_is_the_usable_cpu_count(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_JOBID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    result = slurmrun.launch(lambda: os.environ["WORLD_SIZE"], backend=None)
    assert len(result.values()) == len(os.sched_getaffinity(0))


@pytest.fixture
def streamed(monkeypatch):
    """Local ranks whose results reached the launcher over connections of their own."""
    seen: list[int] = []
    real = Run.on_streamed

    def spy(self, conn, result, frame):
        seen.append(result.local_rank)
        return real(self, conn, result, frame)

    monkeypatch.setattr(Run, "on_streamed", spy)
    return seen


@pytest.mark.parametrize("n_bytes", [64 << 10, 8 << 20])
def test_tensors_come_back_intact_through_out_of_band_buffers(n_bytes, streamed):
    import torch

    before = pickling.unpickle_count
    result = slurmrun.launch(return_tensors, (n_bytes,), workers_per_host=2)
    for rank in range(2):
        value = result.rank(rank)
        assert value["big"].dtype == torch.float32 and value["big"].numel() == n_bytes // 4
        assert torch.all(value["big"] == rank)
        value["big"] += 1  # the launcher owns writable memory
        assert torch.equal(value["bf16"], torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
        assert value["empty"].shape == (0, 5)
    assert pickling.unpickle_count - before == 2  # each result unpickled exactly once
    # Large results travel over a connection of their own per worker, small ones via the agent.
    assert sorted(streamed) == ([0, 1] if n_bytes >= STREAM_MIN_BYTES else [])


def test_large_numpy_results_outlive_the_launch():
    import gc

    import numpy as np

    result = slurmrun.launch(
        lambda: np.full(3 << 20, int(os.environ["RANK"]), dtype=np.int32), workers_per_host=2
    )
    arrays = result.values()
    del result
    gc.collect()
    for rank, array in enumerate(arrays):
        assert array.shape == (3 << 20,) and array.dtype == np.int32 and (array == rank).all()


def test_function_from_a_module_on_a_tweaked_sys_path_unpickles_on_workers(tmp_path, monkeypatch):
    (tmp_path / "my_private_module.py").write_text("def answer():\n    return 'from my module'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_private_module

    result = slurmrun.launch(my_private_module.answer, workers_per_host=1, backend=None)
    assert result.rank(0) == "from my module"


def test_two_launches_back_to_back():
    for _ in range(2):
        assert slurmrun.launch(all_reduce_sum, workers_per_host=2).values() == [("gloo", 3.0)] * 2


# ---------------------------------------------------------------- tests: failures


def test_worker_exception_is_reraised_at_once_while_other_ranks_wait_in_a_collective():
    start = time.monotonic()
    with pytest.raises(KeyError) as info:
        slurmrun.launch(raise_on_rank_1_while_rank_0_waits, workers_per_host=2, timeout=120)
    # Found by the error itself, not by the collective timeout (120 s): a bound that holds on
    # a loaded machine; how fast it is found is measured in benchmarks/.
    assert time.monotonic() - start < 60
    exc = info.value
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "raise_on_rank_1_while_rank_0_waits" in exc.__cause__.text
    assert any("rank 1 (host localhost, local rank 1)" in n for n in exc.__notes__)


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("exit", "exited with code 3"),
        ("sigkill", "killed by SIGKILL"),
        ("segfault", "killed by SIGSEGV"),
    ],
)
def test_worker_death_raises_worker_failed_with_cause_and_last_output(how, expected):
    start = time.monotonic()
    with pytest.raises(slurmrun.WorkerFailedError) as info:
        slurmrun.launch(exit_on_rank_1, (how,), workers_per_host=2, timeout=120)
    elapsed = time.monotonic() - start
    exc = info.value
    assert expected in str(exc)
    assert exc.hostname == "localhost" and exc.local_rank == 1 and exc.rank == 1
    if how == "segfault":
        assert "Segmentation fault" in exc.stderr_tail and "exit_on_rank_1" in exc.stderr_tail
    else:
        assert "last words before dying" in exc.stderr_tail
    assert exc.log_file and os.path.exists(exc.log_file)
    assert elapsed < 60, f"took {elapsed:.1f} s"  # not the collective timeout (120 s)


def test_killed_agent_raises_agent_failed():
    with pytest.raises(slurmrun.AgentFailedError) as info:
        slurmrun.launch(kill_own_agent, workers_per_host=2, timeout=120)
    assert "localhost" in str(info.value)
    assert "signal 9" in str(info.value)


def test_silent_agent_is_declared_dead_after_timeout():
    start = time.monotonic()
    with pytest.raises(slurmrun.AgentFailedError, match="sent nothing for 3 s"):
        slurmrun.launch(stop_own_agent, workers_per_host=1, timeout=3)
    assert time.monotonic() - start < 45  # not the workers' own end (60 s)


def test_unpicklable_return_value_names_the_problem():
    with pytest.raises(
        TypeError,
        match=r"return value of rank 0 \(dict\) could not be pickled.*Unpicklable refuses",
    ):
        slurmrun.launch(return_unpicklable, workers_per_host=1, backend=None)


def test_unpicklable_exception_becomes_worker_failed_with_its_text():
    with pytest.raises(
        slurmrun.WorkerFailedError, match="UnpicklableError: an error holding a lock"
    ) as info:
        slurmrun.launch(raise_unpicklable_error, workers_per_host=1, backend=None)
    assert "raise_unpicklable_error" in str(info.value)


def test_unpicklable_func_is_rejected_before_anything_starts():
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"func could not be pickled.*lock"):
        slurmrun.launch(lock.locked, workers_per_host=1)
    with pytest.raises(TypeError, match="func_args could not be pickled"):
        slurmrun.launch(print, (lock,), workers_per_host=1)
    assert psutil.Process().children() == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hostnames": []}, ValueError, "hostnames is empty"),
        ({"hostnames": "node1"}, ValueError, r"for one host, pass \['node1'\]"),
        ({"hostnames": ["localhost", ""]}, ValueError, "non-empty strings"),
        ({"workers_per_host": 0}, ValueError, "at least 1"),
        ({"workers_per_host": -2}, ValueError, "at least 1"),
        ({"workers_per_host": [1, 2]}, ValueError, r"2 counts \(1 2\) but hostnames names 1 host"),
        (
            {"hostnames": ["localhost"], "workers_per_host": [1, 0]},
            ValueError,
            "2 entries|positive",
        ),
        ({"workers_per_host": "many"}, ValueError, "int, a list of ints"),
        ({"backend": "tcp"}, ValueError, "backend must be one of"),
        ({"timeout": 0}, ValueError, "positive number of seconds"),
        # outside SLURM another host's agent starts over ssh: this one cannot even be resolved
        ({"hostnames": ["elsewhere-node"]}, RuntimeError, "cannot resolve node 'elsewhere-node'"),
    ],
)
def test_bad_input_is_rejected_before_anything_starts(kwargs, error, match, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    kwargs.setdefault("hostnames", ["localhost"])
    with pytest.raises(error, match=match):
        slurmrun.launch(print, **kwargs)
    assert psutil.Process().children() == []


def test_non_callable_func_is_rejected():
    with pytest.raises(TypeError, match="func must be callable"):
        slurmrun.launch("print")  # type: ignore[arg-type]


@pytest.mark.parametrize("arg", ["hostnames", "workers_per_host"])
def test_slurm_outside_an_allocation_raises_runtime_error(arg, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    with pytest.raises(RuntimeError, match="no SLURM allocation was found"):
        slurmrun.launch(print, **{arg: "slurm"})


# ---------------------------------------------------------------- tests: security


def test_peers_without_the_secret_are_refused_and_the_launch_goes_on(caplog):
    before = pickling.unpickle_count
    result = slurmrun.launch(be_a_hostile_peer, workers_per_host=1, backend=None)
    assert result.rank(0) == 4
    assert pickling.unpickle_count - before == 1  # only the real result
    # said in a bounded number of lines: the 1st, 10th, 100th... and the total at the end
    said = [r.message for r in caplog.records if "rejected before" in r.message]
    assert said[-1].startswith("slurmrun: 4 connection(s) rejected before they proved"), said


@pytest.mark.parametrize(
    ("backend", "env_file"),
    [("gloo", False), (None, False), ("gloo", True)],  # None: the spawner imports nothing
)
def test_the_secret_is_nowhere_in_a_worker_or_its_spawner(monkeypatch, tmp_path, backend, env_file):
    """Workers run the user's code: no object, frame, environment or byte of memory there
    (nor in the spawner they are forked from) may hold the secret that lets a peer talk to the
    launcher. The agent must hold it, and the scan must find it there."""
    import slurmrun.launcher.warm as launcher_module  # where a launch makes its secret

    secret = authentication.new_secret()
    monkeypatch.setattr(launcher_module, "new_secret", lambda: secret)
    hexed = secret.hex()
    (tmp_path / "env.sh").write_text("export FROM_ENV_FILE=1\n")
    result = slurmrun.launch(
        look_for_the_secret,
        ((secret[:16], secret[16:]), (hexed[:32], hexed[32:])),
        workers_per_host=2,
        backend=backend,
        env_file=tmp_path / "env.sh" if env_file else None,
    )
    rank0, rank1 = result.values()
    assert rank0["places"] == [] and rank1["places"] == []
    assert rank0["in_agent_memory"], "the scan did not find the secret in the agent"
    assert "slurmrun agent (localhost)" in rank0["command_lines"]
    for line in rank0["command_lines"]:
        assert hexed not in line.lower()


# A recorded answer replayed against a new challenge: tests/test_fuzz.py
# (test_a_recorded_handshake_answer_replayed_against_a_new_challenge_is_refused).


@pytest.mark.parametrize("padding", [0, 4000, 40000])  # how large the environment block is
def test_a_forgotten_variable_leaves_no_copy_in_memory(padding):
    """forget_variable (what the spawner does with the secret) leaves no byte of the value in
    the process, freed memory included: a copy of the environment block, once freed, kept it
    (seen in CI, where a large environment made the freed block outlive the spawner's few
    allocations; the launch test above caught it only some of the time)."""
    forgotten, kept = authentication.new_secret().hex(), authentication.new_secret().hex()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, slurmrun.node.spawner as s; s.forget_variable('FORGOTTEN');"
            " print(flush=True); sys.stdin.read()",
        ],
        env={**os.environ, "FORGOTTEN": forgotten, "KEPT": kept, "PADDING": "x" * padding},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"\n"
        halves = (forgotten[:32].encode(), forgotten[32:].encode())
        assert _memory_holding(child.pid, [halves]) == []
        with open(f"/proc/{child.pid}/environ", "rb") as f:
            assert b"FORGOTTEN" not in f.read()
        # the scan finds what was not forgotten: an empty answer above means something
        assert _memory_holding(child.pid, [(kept[:32].encode(), kept[32:].encode())])
    finally:
        child.communicate(timeout=10)


# ---------------------------------------------------------------- tests: interrupts


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_stops_every_agent_and_worker(tmp_path, sig):
    pid_file = tmp_path / "pids"
    script = tmp_path / "launch.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            import slurmrun, test_launch
            try:
                slurmrun.launch(
                    test_launch.pids_then_sleep, ({str(pid_file)!r},),
                    workers_per_host=2, backend=None,
                )
            except KeyboardInterrupt:
                print("KeyboardInterrupt raised", flush=True)
                raise
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pids.{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline, "workers never started"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.3)
    pids = {int(p) for r in range(2) for p in (tmp_path / f"pids.{r}").read_text().split()}
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    if sig == signal.SIGINT:
        assert b"KeyboardInterrupt raised" in out, err
    else:
        assert proc.returncode == 128 + signal.SIGTERM, err
    deadline = time.monotonic() + 30
    while any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    ):
        assert time.monotonic() < deadline, (
            f"left behind: {[p for p in pids if psutil.pid_exists(p)]}"
        )
        time.sleep(0.1)


def test_frames_beyond_limits_are_refused():
    a, b = socket.socketpair()
    conn = transport.Connection(a)
    import struct

    b.sendall(struct.pack("!4sIQI", b"SRF1", 1 << 30, 0, 0))
    with pytest.raises(transport.FrameError):
        conn.recv()
    b.sendall(struct.pack("!4sIQI", b"XXXX", 2, 0, 0))
    with pytest.raises(transport.FrameError):
        conn.recv()
    a.close()
    b.close()


def test_pickled_tensors_travel_outside_the_pickle_stream():
    import torch

    body, buffers = pickling.dumps({"t": torch.ones(1 << 20)})
    assert len(body) < 1024 and sum(b.raw().nbytes for b in buffers) == 4 << 20
    restored = pickling.loads(body, [bytearray(b.raw()) for b in buffers])
    assert torch.equal(restored["t"], torch.ones(1 << 20))


def test_waiting_for_an_agent_works_with_more_than_1024_open_files():
    """A launcher with a thousand agents connected holds fds past select()'s limit."""
    import resource

    from slurmrun.launcher.agents.starters import wait_exit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        proc = subprocess.Popen(["sleep", "0.2"])
        wait_exit(proc, 10)
        assert proc.returncode == 0
        proc = subprocess.Popen(["sleep", "30"])
        wait_exit(proc, 0.1)
        assert proc.returncode is None
        proc.kill()
        proc.wait()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
