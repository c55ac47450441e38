"""The contract between launcher and agents (slurmrun/protocol.py)."""

from __future__ import annotations

from slurmrun import protocol


def test_an_agents_start_header_is_a_start_message_with_its_share() -> None:
    """The hand-out builds one header per run and adds each agent's share (protocol.py)."""
    shared = protocol.Start(
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
    header = protocol.start_header(shared, workers=4, rank_offset=8, node_rank=2, forward_ranks=[0])
    start = protocol.Start.from_header(header)
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
