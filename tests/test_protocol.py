"""The contract between launcher and agents (slurmrun/protocol.py)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from slurmrun import map_messages, protocol


def _run_part() -> protocol.RunStart:
    return protocol.RunStart(
        sys_path=["/x"],
        cwd="/",
        env={"A": "1"},
        title="func f",
        run=7,
        world_size=12,
        master_addr="10.0.0.1",
        master_port=1234,
        backend="gloo",
        timeout=60.0,
        grace=3.0,
        log_level=20,
        log_dir="/logs",
    )


def test_an_agents_start_joins_the_runs_part_and_its_share() -> None:
    """The hand-out builds the run's part once (typed) and each agent's share (typed); one
    function joins them into the START header, which the agent reads as both."""
    run = _run_part()
    share = protocol.AgentShare(
        workers=4, rank_offset=8, node_rank=2, forward_ranks=[0], log_name="n#2"
    )
    header = protocol.start_header(run, share)
    start = protocol.parse(header)
    assert isinstance(start, protocol.Start)
    assert isinstance(start, protocol.RunStart) and isinstance(start, protocol.AgentShare)
    assert (start.run, start.log_name, start.title) == (7, "n#2", "func f")
    assert (start.workers, start.rank_offset, start.node_rank, start.forward_ranks) == (
        4,
        8,
        2,
        [0],
    )
    assert (start.world_size, start.master_port, start.env, start.log_dir) == (
        12,
        1234,
        {"A": "1"},
        "/logs",
    )
    assert header["t"] == protocol.Start.kind
    assert protocol.start_header(run, share) == header  # the run's part is taken once, unchanged


def test_start_is_its_two_parts_and_nothing_else() -> None:
    """A per-run or per-agent fact is one field of its part: START, the header and the node's
    worker spec carry it without another edit."""
    from slurmrun.node.worker import WorkerSpec

    def names(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    assert names(protocol.Start) == names(protocol.RunStart) | names(protocol.AgentShare)
    assert names(protocol.RunStart) >= names(protocol.Surroundings)
    assert names(WorkerSpec) == {"hostname", "start", "place"}


def test_each_worker_is_placed_from_its_agents_start() -> None:
    from slurmrun.node.worker import place_of

    share = protocol.AgentShare(workers=4, rank_offset=8, node_rank=2)
    start = protocol.parse(protocol.start_header(_run_part(), share))
    assert isinstance(start, protocol.Start)
    place = place_of(start, 3)
    assert (place.rank, place.local_rank, place.node_rank) == (11, 3, 2)
    assert (place.world_size, place.local_world_size, place.tasks_per_node) == (12, 4, "4(x3)")
    assert (place.master_addr, place.master_port) == ("10.0.0.1", 1234)


def test_every_kind_round_trips_through_its_header() -> None:
    messages = [
        protocol.End(run=3),
        protocol.Close(),
        protocol.Credit(cost=4096, run=3),
        protocol.Heartbeat(),
        protocol.Started(run=3, pids=[11, 12]),
        protocol.Idle(run=3, master_port=29500),
        protocol.Done(run=3),
        protocol.Died(
            run=3, local_rank=1, exitcode=-9, signal="SIGKILL", what="x", stderr_tail="tail"
        ),
        protocol.Terminating(),
        protocol.Unhealthy(run=3, why="GPU 3 is gone"),
        protocol.Log(stream="stdout", level=20, end="", local_rank=0, run=3),
        protocol.Result(streamed=True, node_rank=2, local_rank=1, run=3),
        protocol.Error(exc_type="ValueError", message="m", traceback="t", run=3),
        protocol.StreamRequest(),
        protocol.Func(),
        protocol.Stop(),
        protocol.AskStacks(run=3, request=7, answer_wait=0.5, purpose="sample"),
        protocol.Stacks(request=7, source="faulthandler", note="n", local_rank=1, run=3),
        protocol.Debugger(state=protocol.DebugState.PROMPT.value, where="node2 rank 5", run=3),
        protocol.DebugInput(run=3, local_rank=1, eof=True),
        protocol.DebugComplete(
            run=3, local_rank=1, request=2, text="sec", line="p sec", begidx=2, endidx=5
        ),
        protocol.DebugCompletions(request=2, matches=["secret_value"], local_rank=1, run=3),
        protocol.Attach(pid=123, host="login1"),
        protocol.Attached(session=2, hostnames=["node1", "node2"]),
        protocol.Refused(why="a launcher holds them", busy=True),
        protocol.Join(session=2, node_rank=1),
        protocol.Join(session=2, node_rank=-1, stream=4),
        protocol.Bridge(channel=4),
        map_messages.Item(run=3, local_rank=1, index=map_messages.NO_MORE),
        map_messages.ItemCancel(run=3, local_rank=1),
        map_messages.SlotRestart(run=3, local_rank=1),
        map_messages.ItemReady(local_rank=1, run=3),
        map_messages.ItemValue(index=7, local_rank=1, run=3),
        map_messages.ItemRaised(index=7, exc_type="KeyError", message="m", traceback="t", run=3),
    ]
    assert {type(m) for m in messages} | {protocol.Start, protocol.Hello} == set(
        protocol.KINDS.values()
    )
    for message in messages:
        assert protocol.parse(message.header()) == message


def test_a_kind_is_declared_by_its_class_alone() -> None:
    """Defining a message class enters its kind in KINDS (no constant, no list to edit); a kind
    taken by another class, or none at all, is refused when the class is defined."""
    import pytest

    @dataclasses.dataclass(frozen=True)
    class Probe(protocol.Message):
        kind: ClassVar[str] = "test_probe"
        n: int

    try:
        assert protocol.KINDS["test_probe"] is Probe
        assert protocol.parse(Probe(n=3).header()) == Probe(n=3)
        with pytest.raises(TypeError, match="'test_probe' is both Probe and Other"):

            class Other(protocol.Message):
                kind: ClassVar[str] = "test_probe"

        with pytest.raises(TypeError, match="Nameless names no kind"):

            class Nameless(protocol.Message):
                pass

    finally:
        del protocol.KINDS["test_probe"]


def test_kinds_and_events_spell_kind_alike() -> None:
    from slurmrun import events

    assert protocol.Start.kind == "start" and protocol.Heartbeat.kind == "hb"
    assert events.LaunchStarted.kind == "launch_started"
    assert not hasattr(protocol.Start, "KIND")


def test_an_unknown_kind_or_a_missing_field_is_a_protocol_error() -> None:
    import pytest

    with pytest.raises(protocol.ProtocolError, match="unknown message kind 'nope'"):
        protocol.parse({"t": "nope"})
    with pytest.raises(protocol.ProtocolError, match="'end' message without its fields"):
        protocol.parse({"t": "end"})


def test_texts_that_ride_in_a_header_are_clipped_to_the_limit() -> None:
    huge = "é" * 3_000_000
    died = protocol.Died(run=1, local_rank=0, exitcode=1, signal=None, what="x", stderr_tail=huge)
    error = protocol.Error(exc_type=huge, message=huge, traceback=huge, unpicklable=huge)
    for text in (died.stderr_tail, error.exc_type, error.message, error.traceback):
        assert len(text) <= protocol.TEXT_LIMIT and "characters cut" in text
    note = protocol.Stacks(request=1, note=huge).note
    assert len(note) <= 1000 and "characters cut" in note
    assert error.unpicklable is not None and len(error.unpicklable) <= protocol.TEXT_LIMIT
    from slurmrun.transport import MAX_HEADER_BYTES, encode_frame

    assert len(encode_frame(error.header())) < MAX_HEADER_BYTES
