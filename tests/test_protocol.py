"""The contract between launcher and agents (slurmrun/protocol.py)."""

from __future__ import annotations

from slurmrun import protocol


def test_an_agents_start_header_is_a_start_message_with_its_share() -> None:
    """The hand-out builds one header per run and adds each agent's share (protocol.py)."""
    shared = protocol.Start(
        run=7,
        workers=0,
        rank_offset=0,
        world_size=12,
        node_rank=0,
        master_addr="10.0.0.1",
        master_port=1234,
        backend="gloo",
        timeout=60.0,
        grace=3.0,
        log_level=20,
        sys_path=["/x"],
        cwd="/",
        env={"A": "1"},
        log_dir="/logs",
    ).header()
    header = protocol.start_header(
        shared, workers=4, rank_offset=8, node_rank=2, forward_ranks=[0], log_name="n#2"
    )
    start = protocol.parse(header)
    assert isinstance(start, protocol.Start)
    assert (start.run, start.log_name) == (7, "n#2")
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
    assert header["t"] == protocol.START and shared["workers"] == 0  # shared is left as it was


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
        protocol.Log(stream="stdout", level=20, end="", local_rank=0, run=3),
        protocol.Result(streamed=True, node_rank=2, local_rank=1, run=3),
        protocol.Error(exc_type="ValueError", message="m", traceback="t", run=3),
        protocol.StreamRequest(),
        protocol.Func(),
        protocol.Stop(),
        protocol.AskStacks(run=3, request=7, answer_wait=0.5),
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
    ]
    assert {type(m) for m in messages} | {protocol.Start, protocol.Hello} == set(
        protocol.KINDS.values()
    )
    for message in messages:
        assert protocol.parse(message.header()) == message


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
