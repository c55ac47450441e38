"""``slurmrun --map ARGS_FILE SCRIPT`` on localhost: the script once per line of the file, each
line's words appended to its arguments, packed on the slots; a table at the end, the first
failed item's exit status; a bad file refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_cli import _slurmrun, _write

# Each run writes its argv and pid to run<N>.json (N: its --n), makes its own process group
# and leaves it initialised (as many torchrun scripts do), and exits 3 when told.
SCRIPT = """
import json, os, sys
import torch.distributed as dist

dist.init_process_group("gloo")
assert dist.get_world_size() == 1
n = sys.argv[sys.argv.index("--n") + 1]
with open(f"run{n}.json", "w") as f:
    json.dump({"argv": sys.argv[1:], "pid": os.getpid(), "world": os.environ["WORLD_SIZE"]}, f)
if "--fail" in sys.argv:
    sys.exit(3)
"""


def test_map_runs_the_script_once_per_line_and_ends_with_a_table(tmp_path: Path) -> None:
    _write(tmp_path / "train.py", SCRIPT)
    (tmp_path / "args.txt").write_text(
        "# a sweep\n--n 0 --lr 0.1\n\n--n 1 --lr 'a b'\n--n 2 --fail  # this one fails\n--n 3\n"
    )
    out = _slurmrun(
        ["--map", "args.txt", "--workers-per-host", "2", "train.py", "--epochs", "2"], tmp_path
    )
    assert out.returncode == 3, out.stderr
    runs = [json.loads((tmp_path / f"run{n}.json").read_text()) for n in range(4)]
    assert [r["argv"] for r in runs] == [
        ["--epochs", "2", "--n", "0", "--lr", "0.1"],
        ["--epochs", "2", "--n", "1", "--lr", "a b"],
        ["--epochs", "2", "--n", "2", "--fail"],
        ["--epochs", "2", "--n", "3"],
    ]
    assert {r["world"] for r in runs} == {"1"}, "each run in a world of its own"
    assert len({r["pid"] for r in runs}) == 2, "two slots, each ran runs one after another"
    table = out.stderr[out.stderr.index("slurmrun: 4 items, 3 done, 1 failed:") :].splitlines()
    assert table[1].split() == ["item", "line", "slot", "seconds", "exit", "args"]
    rows = [row.split() for row in table[2:6]]
    assert [(r[0], r[1], r[4]) for r in rows] == [("0", "2", "0"), ("1", "4", "0"), ("2", "5", "3"),
                                                  ("3", "6", "0")]  # fmt: skip
    assert {r[2] for r in rows} <= {"localhost:0", "localhost:1"}
    assert table[3].endswith("--n 1 --lr 'a b'")
    assert "item 2 (line 5: --n 2 --fail)" in out.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--map args.txt: no such file"),
        ("# nothing\n\n", "--map args.txt holds no line of arguments"),
        ("--n 0\n--lr 'open\n", "--map args.txt, line 2: No closing quotation"),
    ],
)
def test_a_bad_args_file_is_refused_before_anything_starts(
    tmp_path: Path, content: str | None, message: str
) -> None:
    _write(tmp_path / "train.py", SCRIPT)
    if content is not None:
        (tmp_path / "args.txt").write_text(content)
    out = _slurmrun(["--map", "args.txt", "train.py"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"slurmrun: error: {message}" in out.stderr
    assert not list(tmp_path.glob("run*.json")), "nothing ran"
    assert not (tmp_path / "logs").exists(), "nothing started"


FLAKY = """
import os, sys
n = sys.argv[-1]
if not os.path.exists(f"tried{n}"):
    open(f"tried{n}", "w").close()
    sys.exit(5)
open(f"run{n}.json", "w").write("{}")
"""


def test_map_options_give_the_maps_retries(tmp_path: Path) -> None:
    _write(tmp_path / "flaky.py", FLAKY)
    (tmp_path / "args.txt").write_text("0\n1\n")
    args = ["--map", "args.txt", "--retries", "1", "--item-timeout", "60", "--workers-per-item"]
    out = _slurmrun([*args, "1", "--workers-per-host", "2", "flaky.py"], tmp_path)
    assert out.returncode == 0, out.stderr  # each failed once, then ran again
    assert sorted(p.name for p in tmp_path.glob("run*.json")) == ["run0.json", "run1.json"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--retries", "1"], "--retries goes with --map ARGS_FILE"),
        (["--map", "args.txt", "--retries", "x"], "--retries: 'x' is not a whole number"),
        (["--map", "args.txt", "--item-timeout", "0"], "--item-timeout: give a number of seconds"),
        (["--map", "args.txt", "--map", "args.txt"], "--map is given twice"),
    ],
)
def test_bad_map_options_are_refused_before_anything_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    _write(tmp_path / "train.py", SCRIPT)
    (tmp_path / "args.txt").write_text("--n 0\n")
    out = _slurmrun([*args, "train.py"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"slurmrun: error: {message}" in out.stderr
    assert not (tmp_path / "logs").exists(), "nothing started"
