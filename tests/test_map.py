"""`Launcher.map` on localhost (CPU slots): values in the items' order, every slot used, each
item in a world of its own; a raising, a dying and a hung item are retried on another slot or
recorded in `MapFailedError.results`, and the other items run to the end; nothing is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import slurmrun
from slurmrun import events
from slurmrun.launcher.map_book import MapBook
from slurmrun.launcher.map_progress import Progress, progress_line
from tests.test_warm import gone

OPTIONS = {"workers_per_host": 3, "backend": "gloo", "timeout": 60}


def where(item: int) -> tuple[int, int, str, str, str, int]:
    time.sleep(0.2)  # long enough that every slot gets items
    import torch.distributed as dist

    env = os.environ
    return (
        item * item,
        os.getpid(),
        env["RANK"],
        env["WORLD_SIZE"],
        env["MASTER_PORT"],
        dist.get_world_size(),
    )


def test_values_come_in_order_from_every_slot_each_in_its_own_world() -> None:
    values = slurmrun.Launcher(**OPTIONS).map(where, range(12))
    assert [v[0] for v in values] == [i * i for i in range(12)]
    pids = {v[1] for v in values}
    assert len(pids) == 3, "every slot ran items"
    assert {v[2:4] for v in values} == {("0", "1")}, "each item's world is its slot's alone"
    assert {v[5] for v in values} == {1}
    assert len({v[4] for v in values}) == 3, "each slot has its own MASTER_PORT"
    assert gone(pids)


def fail_on_2(item: int) -> int:
    if item == 2:
        raise ValueError(f"item {item} fails on {os.getpid()}")
    return item


def fail_once(item: tuple[int, str]) -> int:
    """Fails the first time it runs item 1 (a file says it ran), and says where it ran."""
    index, marker = item
    if index == 1 and not os.path.exists(marker):
        Path(marker).write_text(str(os.getpid()))
        raise KeyError("first try")
    return os.getpid()


def test_a_raising_item_is_retried_then_recorded_and_the_others_run() -> None:
    with pytest.raises(slurmrun.MapFailedError, match="1 of 5 items failed") as info:
        slurmrun.Launcher(**OPTIONS).map(fail_on_2, range(5), retries=1)
    results = info.value.results
    assert info.value.failed == [2]
    assert [results[i] for i in (0, 1, 3, 4)] == [0, 1, 3, 4]
    error = results[2]
    assert isinstance(error, ValueError)
    assert isinstance(error.__cause__, slurmrun_remote())
    assert "in fail_on_2" in str(error.__cause__), "the remote traceback is kept"


def slurmrun_remote() -> type:
    from slurmrun.errors import RemoteTraceback

    return RemoteTraceback


def test_a_retried_item_runs_again_on_another_slot(tmp_path: Path) -> None:
    marker = str(tmp_path / "tried")
    values = slurmrun.Launcher(**OPTIONS).map(fail_once, [(i, marker) for i in range(3)], retries=1)
    assert values[1] != int(Path(marker).read_text()), "retried on another slot"


def exit_on_1(item: int) -> int:
    if item == 1:
        os._exit(3)
    time.sleep(0.1)
    return os.getpid()


def test_an_item_whose_worker_dies_is_recorded_and_the_others_run() -> None:
    with pytest.raises(slurmrun.MapFailedError) as info:
        slurmrun.Launcher(**OPTIONS).map(exit_on_1, range(12))
    results = info.value.results
    assert info.value.failed == [1]
    assert isinstance(results[1], slurmrun.WorkerFailedError)
    assert "exited with code 3" in str(results[1])
    assert info.value.ended == "", "every item ran"
    pids = {r for i, r in enumerate(results) if i != 1}
    assert len(pids) >= 2, "the other slots ran the other items"
    assert gone(pids)


def exit_on_first_tries(item: tuple[int, str]) -> int:
    """Kills its worker the first two times it runs item 0 (files count the tries)."""
    index, folder = item
    tries = len(list(Path(folder).glob(f"{index}.*")))
    Path(folder, f"{index}.{tries}").write_text(str(os.getpid()))
    if index == 0 and tries < 2:
        os._exit(1)
    return os.getpid()


def test_one_slot_alone_survives_its_deaths_and_retries_the_item(tmp_path: Path) -> None:
    options = {**OPTIONS, "workers_per_host": 1}
    items = [(i, str(tmp_path)) for i in range(3)]
    values = slurmrun.Launcher(**options).map(exit_on_first_tries, items, retries=2)
    assert len(set(values)) <= 3
    assert len({p.read_text() for p in tmp_path.glob("0.*")}) == 3, "a new worker each try"


def hang_on_0(item: int) -> int:
    if item == 0:
        time.sleep(600)
    return item


def test_an_item_past_its_timeout_is_killed_and_recorded() -> None:
    start = time.monotonic()
    with pytest.raises(slurmrun.MapFailedError) as info:
        slurmrun.Launcher(**OPTIONS).map(hang_on_0, range(4), item_timeout=1.0, retries=1)
    assert time.monotonic() - start < 20
    assert info.value.failed == [0]
    assert isinstance(info.value.results[0], slurmrun.ItemTimeoutError)
    assert info.value.results[1:] == [1, 2, 3]
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def test_a_warm_launcher_maps_and_runs_again_on_the_same_agents_after_a_failed_map() -> None:
    with slurmrun.Launcher(**OPTIONS) as launcher:
        assert launcher.map(abs, [-1, -2]) == [1, 2]
        agents = {p.pid for p in psutil.Process().children()}
        with pytest.raises(slurmrun.MapFailedError):
            launcher.map(exit_on_1, range(3))
        assert launcher.run(os.getpid).values() != []
        assert launcher.map(abs, [-3]) == [3]
        assert launcher.map(abs, []) == []
        assert {p.pid for p in psutil.Process().children()} == agents


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"workers_per_item": 0}, slurmrun.OptionsValueError),
        ({"retries": -1}, slurmrun.OptionsValueError),
        ({"item_timeout": 0}, slurmrun.OptionsValueError),
        ({"workers_per_item": 4}, slurmrun.OptionsValueError),  # hosts run 3
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        slurmrun.Launcher(**OPTIONS).map(abs, [1], **kwargs)  # type: ignore[arg-type]
    assert not psutil.Process().children(recursive=True)


def note_pid_then_sleep(item: tuple[int, str]) -> None:
    index, folder = item
    Path(folder, f"{index}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_ctrl_c_stops_every_slot_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "map.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "import slurmrun\n"
        "from tests.test_map import OPTIONS, note_pid_then_sleep\n"
        "try:\n"
        f"    slurmrun.Launcher(**OPTIONS).map(note_pid_then_sleep, [(i, {str(tmp_path)!r})"
        " for i in range(9)])\n"
        "except KeyboardInterrupt:\n"
        "    print('KeyboardInterrupt raised', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 3:
        assert time.monotonic() < deadline, "the slots never started"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    launched = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert b"KeyboardInterrupt raised" in out, err
    assert sorted(p.name for p in tmp_path.glob("*.pid")) == ["0.pid", "1.pid", "2.pid"]
    assert gone(launched), "every agent and worker ended"


def reduce_ranks(item: int) -> tuple[int, str, str, int, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    if item == 1 and dist.get_rank() == 1:
        raise ValueError("rank 1 of item 1")  # rank 0 waits in the next all_reduce
    dist.all_reduce(t)
    return item, os.environ["RANK"], os.environ["WORLD_SIZE"], int(t.item()), os.getpid()


def test_items_of_two_workers_run_in_worlds_of_two_and_a_rank_failure_restarts_the_slot() -> None:
    options = {**OPTIONS, "workers_per_host": 4}
    with pytest.raises(slurmrun.MapFailedError) as info:
        slurmrun.Launcher(**options).map(reduce_ranks, range(6), workers_per_item=2)
    assert info.value.failed == [1]
    assert "rank 1 of item 1" in str(info.value.results[1])
    values = [v for i, v in enumerate(info.value.results) if i != 1]
    assert [v[:4] for v in values] == [(i, "0", "2", 6) for i in (0, 2, 3, 4, 5)]


def test_each_item_says_when_it_started_finished_failed_and_was_retried() -> None:
    seen: list[events.Event] = []
    with pytest.raises(slurmrun.MapFailedError):
        slurmrun.Launcher(**OPTIONS, on_event=seen.append).map(fail_on_2, range(4), retries=1)
    kinds = [e.kind for e in seen]
    assert kinds[0] == "launch_started" and kinds[-1] == "launch_finished"
    started = [e for e in seen if isinstance(e, events.ItemStarted)]
    assert sorted((e.index, e.attempt) for e in started) == [(0, 1), (1, 1), (2, 1), (2, 2), (3, 1)]
    assert sorted(e.index for e in seen if isinstance(e, events.ItemFinished)) == [0, 1, 3]
    failed = [(e.index, e.error, e.retried) for e in seen if isinstance(e, events.ItemFailed)]
    assert failed == [(2, "ValueError", True), (2, "ValueError", False)]
    assert all(e.host == "localhost" for e in started)


def keep(value: int) -> int:
    slurmrun.worker_state()["value"] = value
    return os.getpid()


def kept() -> object:
    return slurmrun.worker_state().get("value")


def test_a_map_on_a_keep_workers_launcher_ends_the_kept_workers_and_the_next_run_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with slurmrun.Launcher(**OPTIONS, keep_workers=True) as launcher:
        launcher.run(keep, (7,))
        assert launcher.map(abs, [-1, -2, -3]) == [1, 2, 3]
        assert launcher.run(kept).values() == [None, None, None]
        assert launcher.run(kept).values() == [None, None, None]
    assert caplog.text.count("has new workers on localhost") == 1, caplog.text
    assert "came after run" in caplog.text


def test_the_progress_line_counts_items_and_says_when_the_map_should_end() -> None:
    book = MapBook(10, retries=0)
    for _ in range(4):
        book.next_for((0, 0), alone=True)
    book.succeeded(0, "a")
    book.failed_on(1, (0, 0), ValueError())
    said: list[str] = []
    progress = Progress(said.append, started=100.0)
    progress.tick(book, 2, 104.0)
    assert said == [], "not before EVERY seconds"
    progress.tick(book, 2, 106.0)
    assert said == [
        "slurmrun: map of 10 items on 2 slots: 1 done, 2 running, 1 failed, 6 queued, 6.0 s, "
        "about 24 s left"
    ]
    final = progress_line(book, 2, 7.0, final=True)
    assert final == "slurmrun: map of 10 items on 2 slots: 1 done, 1 failed, 7.0 s"


def test_a_map_off_a_terminal_says_only_its_last_line(capfd: pytest.CaptureFixture[str]) -> None:
    slurmrun.Launcher(**OPTIONS).map(abs, range(3))
    err = capfd.readouterr().err
    assert "slurmrun: map of 3 items on 3 slots: 3 done, 0 failed" in err
    assert "running" not in err


def nap(item: float) -> float:
    time.sleep(item)
    return item


def test_imap_yields_each_value_as_it_comes_and_raises_the_failures_at_the_end() -> None:
    got: list[tuple[int, int]] = []
    with pytest.raises(slurmrun.MapFailedError) as info:
        got.extend(slurmrun.Launcher(**OPTIONS).imap(fail_on_2, [0, 1, 2, 3]))
    assert sorted(got) == [(0, 0), (1, 1), (3, 3)]
    assert info.value.failed == [2]
    with slurmrun.Launcher(**OPTIONS) as launcher:
        order = [index for index, _ in launcher.imap(nap, [1.5, 0.0, 0.0])]
    assert order[-1] == 0, "the slow item comes last"


def test_leaving_imap_early_ends_the_map_and_its_workers() -> None:
    start = time.monotonic()
    with slurmrun.Launcher(**OPTIONS) as launcher:
        for _index, value in launcher.imap(nap, [0.0] + [600.0] * 5):
            assert value == 0.0
            break
        assert launcher.map(abs, [-1]) == [1], "the launcher takes the next map"
    assert time.monotonic() - start < 30
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def test_workers_left_over_by_the_slots_run_no_item() -> None:
    options = {**OPTIONS, "workers_per_host": 3}
    values = slurmrun.Launcher(**options).map(reduce_ranks, [0, 2, 3], workers_per_item=2)
    assert [v[:4] for v in values] == [(i, "0", "2", 6) for i in (0, 2, 3)]
    assert len({v[4] for v in values}) == 1, "one slot of two; the third worker ran nothing"


def kill_my_agent(item: tuple[int, str, bool]) -> int:
    """Item 0 kills its node's agent (once, or `every` time it runs); the others nap.

    Returns its agent's pid; each agent killed leaves a file named by its pid.
    """
    index, folder, every = item
    agent = next(p for p in psutil.Process().parents() if p.name() == "slurmrun-agent")
    if index == 0 and (every or not list(Path(folder).glob("*.killed"))):
        Path(folder, f"{agent.pid}.killed").write_text("")
        os.kill(agent.pid, signal.SIGKILL)
        time.sleep(30)
    time.sleep(0.3)
    return agent.pid


LOSING = {"backend": None, "timeout": 60, "workers_per_host": 2, "max_restarts": 1}


def test_a_lost_nodes_items_run_on_the_others_without_using_their_retries(tmp_path: Path) -> None:
    hosts = ["localhost", "localhost"]
    items = [(i, str(tmp_path), False) for i in range(8)]
    start = time.monotonic()
    launcher = slurmrun.Launcher(**LOSING, hostnames=hosts, min_hosts=1)  # type: ignore[arg-type]
    values = launcher.map(kill_my_agent, items)  # retries=0: the node's loss is not the item's
    assert time.monotonic() - start < 30
    (killed,) = [int(p.name.split(".")[0]) for p in tmp_path.glob("*.killed")]
    assert values[0] != killed, "item 0 ran again on the other node"
    assert len(values) == 8 and all(isinstance(v, int) for v in values)
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def test_below_min_hosts_a_lost_node_fails_the_map_and_the_results_keep_what_finished(
    tmp_path: Path,
) -> None:
    hosts = ["localhost", "localhost"]
    items = [(i, str(tmp_path), False) for i in range(1, 4)] + [(0, str(tmp_path), False)]
    options = {**LOSING, "workers_per_host": 1}  # two slots: items 1 and 2 first, then 3 and 0
    launcher = slurmrun.Launcher(**options, hostnames=hosts, min_hosts=2)  # type: ignore[arg-type]
    with pytest.raises(slurmrun.MapFailedError, match=r"lost node.*min_hosts=2") as info:
        launcher.map(kill_my_agent, items)
    results = info.value.results
    assert [type(r) for r in results[:2]] == [int, int], "what finished before the loss is kept"
    assert info.value.failed == [2, 3], results
    assert all(isinstance(r, slurmrun.AgentFailedError) for r in results[2:]), results
    assert isinstance(info.value.__cause__, slurmrun.AgentFailedError)
    assert "min_hosts=2" in info.value.ended, "why the map ended early"
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def test_an_item_that_kills_every_node_it_runs_on_fails_after_its_second_node(
    tmp_path: Path,
) -> None:
    hosts = ["localhost"] * 3
    items = [(0, str(tmp_path), True)] + [(i, str(tmp_path), False) for i in range(1, 6)]
    options = {**LOSING, "workers_per_host": 1}
    launcher = slurmrun.Launcher(**options, hostnames=hosts, min_hosts=1)  # type: ignore[arg-type]
    with pytest.raises(slurmrun.MapFailedError) as info:
        launcher.map(kill_my_agent, items)
    assert info.value.failed == [0]
    assert isinstance(info.value.results[0], slurmrun.AgentFailedError)
    assert len(list(tmp_path.glob("*.killed"))) == 2, "a free try elsewhere, then retries=0"
    assert all(isinstance(r, int) for r in info.value.results[1:]), "the others ran to the end"


def noisy(item: int) -> int:
    """Writes bytes of its own to stdout (a line left open, a byte that is no UTF-8) and stderr."""
    time.sleep(0.2)  # every slot gets items
    sys.stdout.write(f"out {item}\nopen")
    sys.stdout.flush()
    os.write(1, b"\xff")
    os.write(2, f"err {item}\n".encode())
    print(f" end {item}", flush=True)
    return item


def test_each_items_output_is_in_a_file_of_its_own_and_the_terminal_shows_the_ranks_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLURMRUN_LOG_DIR", str(tmp_path))
    slurmrun.Launcher(**OPTIONS, show_ranks="all").map(noisy, range(6))
    (launch_dir,) = tmp_path.glob("20*")
    for item in range(6):
        written = (launch_dir / "items" / f"{item}.log").read_bytes()
        err = f"err {item}\n".encode()
        assert err in written, written
        out = f"out {item}\nopen\xff end {item}\n".encode("latin-1")
        assert written.replace(err, b"", 1) == out, "byte for byte"
    shown = capfd.readouterr().err
    assert all(f"err {item}" in shown for item in range(6)), "--ranks all: every slot's lines"
    slurmrun.Launcher(**OPTIONS).map(noisy, range(6))
    shown = capfd.readouterr().err
    assert 0 < sum(f"err {item}" in shown for item in range(6)) < 6, "rank 0's slot's alone"


def threads(item: int) -> tuple[str, int]:
    import torch

    return os.environ["OMP_NUM_THREADS"], torch.get_num_threads()


def test_a_users_omp_num_threads_is_kept_in_every_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert slurmrun.Launcher(**OPTIONS).map(threads, range(3)) == [("3", 3)] * 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0))
    share = cores // 3 if cores >= 3 else cores  # the slot's share of the cores (all if fewer)
    assert slurmrun.Launcher(**OPTIONS).map(threads, range(3)) == [(str(share), share)] * 3


def stop_my_agent_once(item: tuple[int, str]) -> int:
    """Item 0 stops its node's agent (SIGSTOP: silent, as a hung node) the first time."""
    index, folder = item
    agent = next(p for p in psutil.Process().parents() if p.name() == "slurmrun-agent")
    if index == 0 and not list(Path(folder).glob("*.stopped")):
        Path(folder, f"{agent.pid}.stopped").write_text("")
        agent.suspend()
        time.sleep(30)
    time.sleep(0.3)
    return agent.pid


def test_a_silent_nodes_items_run_on_the_others(tmp_path: Path) -> None:
    options = {**LOSING, "workers_per_host": 1, "heartbeat_timeout": 2.0}
    launcher = slurmrun.Launcher(**options, hostnames=["localhost"] * 2, min_hosts=1)  # type: ignore[arg-type]
    start = time.monotonic()
    values = launcher.map(stop_my_agent_once, [(i, str(tmp_path)) for i in range(4)])
    assert time.monotonic() - start < 20
    (stopped,) = [int(p.name.split(".")[0]) for p in tmp_path.glob("*.stopped")]
    assert values[0] != stopped, "item 0 ran again on the node that answers"
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()]
