"""The port an agent reports for a run's store, held listening until rank 0 takes it."""

from __future__ import annotations

import socket

import pytest

from slurmrun.node.store_port import StorePort


def _connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


def test_the_reported_port_listens_until_it_is_taken_and_then_a_new_one_does() -> None:
    store = StorePort()
    first = store.port
    assert store.held() and _connects(first)
    assert store.renew() == first  # held: the same port again
    listener = store.take()
    assert not store.held()
    assert listener.getsockname()[1] == first
    with pytest.raises(RuntimeError):
        store.take()
    listener.close()  # rank 0's store would hold it; gone with it
    assert not _connects(first)
    second = store.renew()
    assert store.held() and _connects(second)
    store.release()


def test_a_released_port_is_free_for_whoever_binds_it() -> None:
    store = StorePort()
    port = store.port
    store.release()
    assert not store.held()
    with socket.create_server(("", port)):  # a torchrun-style script's rank 0 binds it
        pass
    assert store.renew() != 0 and store.held()
    store.release()
