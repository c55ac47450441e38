"""A submitted map's finished items (`slurmrun.batch.map_done`): kept sealed, read back only
when this submission wrote them for that item."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmrun.batch.map_done import DoneItems
from slurmrun.batch.seal import new_nonce
from slurmrun.errors import JobFolderTamperedError

KEY = bytes(range(32))


def test_values_come_back_for_the_same_submission_only(tmp_path: Path) -> None:
    nonce = new_nonce()
    done = DoneItems(tmp_path, KEY, nonce)
    assert done.read(3) == {}
    done.write(0, {"loss": 0.5})
    done.write(2, [1, 2])
    assert DoneItems(tmp_path, KEY, nonce).read(3) == {0: {"loss": 0.5}, 2: [1, 2]}
    assert DoneItems(tmp_path, KEY, new_nonce()).read(3) == {}, "another submission's"
    assert oct(os.stat(tmp_path / "items_done").st_mode & 0o777) == "0o700"


def test_a_value_moved_to_another_items_name_or_changed_is_refused(tmp_path: Path) -> None:
    nonce = new_nonce()
    done = DoneItems(tmp_path, KEY, nonce)
    done.write(1, "one")
    folder = tmp_path / "items_done"
    (folder / "1_value.pkl").rename(folder / "0_value.pkl")
    with pytest.raises(JobFolderTamperedError, match="holds item 1's value, not item 0's"):
        done.read(2)
    (folder / "0_value.pkl").write_bytes(b"not sealed")
    with pytest.raises(JobFolderTamperedError, match="has no slurmrun seal"):
        done.read(2)
    DoneItems(tmp_path, bytes(32), nonce).write(0, "another key's")
    with pytest.raises(JobFolderTamperedError, match="its seal does not match its content"):
        done.read(1)
