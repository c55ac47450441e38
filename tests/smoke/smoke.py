"""Smoke launches for an installed slurmrun in a fresh environment (tests/fresh_venv.sh).

    python smoke.py            tensors (bfloat16, dicts, views) over gloo, plain objects,
                               an exception, a dead worker
    python smoke.py --no-torch the same without torch (backend=None, no tensors)

A plain script, since the fresh environment has no pytest: it runs every check, prints one
line per check and a closing ``N passed, M failed`` line, and exits 1 if any check failed.
Run it from outside the checkout, so that the installed copy of slurmrun is the one imported.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys
import time
import traceback
from collections.abc import Callable

import slurmrun
from slurmrun.errors import RemoteTraceback

NO_TORCH = "--no-torch" in sys.argv[1:]
BACKEND = None if NO_TORCH else "gloo"
TIMEOUT = 120  # each launch's own bound (collectives, agents); a healthy one takes seconds
CHECKS: list[Callable[[], None]] = []


def check(func: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append(func)
    return func


class SmokeError(ValueError):
    pass


def launch(func, *args):
    return slurmrun.launch(
        func, args, hostnames=["localhost"], workers_per_host=2, backend=BACKEND, timeout=TIMEOUT
    )


# ---------------------------------------------------------------- functions run on workers


def plain_value(rank):
    return {"rank": rank, "text": "é" * rank, "nested": [(1, 2.5), {None, b"x"}], "big": "x" * 5000}


def plain_objects():
    return plain_value(int(os.environ["RANK"]))


def raise_on_rank_1():
    if os.environ["RANK"] == "1":
        raise SmokeError("rank 1 says no")
    return "fine"


def die_on_rank_1():
    if os.environ["RANK"] == "1":
        print("last words", file=sys.stderr, flush=True)
        os._exit(7)
    return "fine"


def a_tensor():
    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return t


def a_bfloat16_tensor():
    import torch

    return torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t() * (int(os.environ["RANK"]) + 1)


def a_dict_of_tensors():
    import torch

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {"base": base, "row": base[1], "big": torch.ones(1 << 20), "ints": torch.arange(4)}


# ---------------------------------------------------------------- checks


@check
def installed_copy_is_imported():
    where = os.path.dirname(slurmrun.__file__)
    assert "site-packages" in where, f"slurmrun imported from {where}, not from the venv"


@check
def every_import_is_a_declared_dependency():
    # pip would install an undeclared import anyway when a declared package needs it
    # (submitit needs cloudpickle): compare slurmrun's imports with its own metadata.
    def canonical(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    requires = importlib.metadata.requires("slurmrun") or []
    declared = {canonical(re.split(r"[\s<>=!~\[;(]", r, maxsplit=1)[0]) for r in requires}
    distributions = importlib.metadata.packages_distributions()
    package = os.path.dirname(slurmrun.__file__)
    missing = set()
    for name in sorted(os.listdir(package)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(package, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for top in {m.split(".")[0] for m in modules}:
                if top in sys.stdlib_module_names or top in ("slurmrun", "__future__"):
                    continue
                for dist in distributions.get(top, [top]):  # not installed: named as imported
                    if canonical(dist) not in declared:
                        missing.add(f"{top} (from {name}; distribution {dist})")
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


@check
def plain_objects_come_back():
    result = launch(plain_objects)
    assert result.values() == [plain_value(r) for r in range(2)], result.values()


def raised(func) -> Exception:
    try:
        launch(func)
    except Exception as exc:
        return exc
    raise AssertionError("the launch raised nothing")


@check
def a_worker_exception_is_reraised():
    exc = raised(raise_on_rank_1)
    assert type(exc) is SmokeError and str(exc) == "rank 1 says no", repr(exc)
    assert isinstance(exc.__cause__, RemoteTraceback), repr(exc.__cause__)
    # This script's functions are pickled by value: the worker's traceback still names this
    # file, the line and its source, with every cloudpickle (3.x renames it "<dynamic-code>").
    line = raise_on_rank_1.__code__.co_firstlineno + 2
    where = f'File "{os.path.abspath(__file__)}", line {line}, in raise_on_rank_1'
    text = exc.__cause__.text
    assert where in text and 'raise SmokeError("rank 1 says no")' in text, text
    notes = getattr(exc, "__notes__", [])
    assert any("rank 1 (host localhost, local rank 1)" in n for n in notes), notes


@check
def a_dead_worker_raises_worker_failed():
    exc = raised(die_on_rank_1)
    assert isinstance(exc, slurmrun.WorkerFailedError), repr(exc)
    assert "exited with code 7" in str(exc), str(exc)
    assert exc.rank == 1 and "last words" in exc.stderr_tail, exc.stderr_tail


@check
def the_console_script_runs_a_script():
    # The `slurmrun` command as pip installed it (console script beside this interpreter).
    import json
    import subprocess
    import tempfile

    command = os.path.join(os.path.dirname(sys.executable), "slurmrun")
    info = subprocess.run(
        [command, "info", "--json"], capture_output=True, text=True, timeout=60, check=False
    )
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["launch"]["hosts"] == ["localhost"], info.stdout
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "hello.py")
        with open(script, "w") as f:
            f.write("import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n")
        ran = subprocess.run(
            [command, "--workers-per-host", "2", script, "--epochs", "2"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            cwd=tmp,
            env={**os.environ, "SLURMRUN_LOG_DIR": os.path.join(tmp, "logs")},
            check=False,
        )
    assert ran.returncode == 0, ran.stderr
    assert "rank 0 ['--epochs', '2']" in ran.stdout, ran.stdout


if not NO_TORCH:

    @check
    def a_tensor_comes_back():
        import torch

        for value in launch(a_tensor).values():
            assert torch.equal(value, torch.full((3,), 3.0)), value

    @check
    def a_bfloat16_tensor_comes_back():
        import torch

        for rank, value in enumerate(launch(a_bfloat16_tensor).values()):
            expected = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t() * (rank + 1)
            assert value.dtype == torch.bfloat16 and value.stride() == expected.stride()
            assert torch.equal(value, expected), value

    @check
    def a_dict_of_tensors_comes_back():
        import torch

        for value in launch(a_dict_of_tensors).values():
            base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
            assert torch.equal(value["base"], base) and torch.equal(value["row"], base[1])
            value["base"][1, 0] = -1.0  # writable, and the row is a view of the same storage
            assert value["row"][0] == -1.0
            assert torch.equal(value["big"], torch.ones(1 << 20))
            assert value["ints"].tolist() == [0, 1, 2, 3]


def main() -> int:
    try:
        import numpy  # noqa: F401
    except ImportError:
        numpy_state = "absent"
    else:
        numpy_state = "present"
    cloudpickle = importlib.metadata.version("cloudpickle")
    print(
        f"smoke: Python {sys.version.split()[0]}, cloudpickle {cloudpickle}, numpy {numpy_state}, "
        f"backend {BACKEND}"
    )
    return run_checks(CHECKS)


def run_checks(checks: list[Callable[[], None]]) -> int:
    """Runs each check, printing ok/FAIL and its time, then the tally; 1 if any failed.

    tests/smoke/examples.py runs its checks with it too (both are copied side by side).
    """
    passed = failed = 0
    for func in checks:
        start = time.monotonic()
        try:
            func()
        except Exception:
            failed += 1
            print(f"FAIL {func.__name__}\n{traceback.format_exc()}", flush=True)
        else:
            passed += 1
            print(f"ok   {func.__name__} ({time.monotonic() - start:.1f} s)", flush=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
