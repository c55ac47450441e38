"""The ``slurmrun`` command on localhost: real launches of scripts via ``python -m slurmrun``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import tyro

import slurmrun
from slurmrun.batch.folder import JobFolder
from slurmrun.cli.command import parse_launcher, split_command
from slurmrun.cli.main import main

REPO = Path(__file__).resolve().parents[1]
LIMIT = 180  # seconds for one command; a launch takes a few on a loaded 2-core machine

# Each rank writes what it saw to rank<RANK>.json in the working directory.
REPORT = """
import json, os, sys
def report(**more):
    seen = {k: os.environ.get(k) for k in
            ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    seen.update(argv=sys.argv, path0=sys.path[0], name=__name__, **more)
    with open(f"rank{os.environ['RANK']}.json", "w") as f:
        json.dump(seen, f)
"""


def _write(path: Path, *parts: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(textwrap.dedent(p) for p in parts))
    return path


def _slurmrun(
    args: list[str],
    cwd: Path,
    pythonpath: str = "",
    timeout: float = LIMIT,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")} | (env or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), pythonpath) if p)
    env["SLURMRUN_LOG_DIR"] = str(cwd / "logs")
    return subprocess.run(
        [sys.executable, "-m", "slurmrun", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _reports(cwd: Path, n: int) -> list[dict]:
    return [json.loads((cwd / f"rank{r}.json").read_text()) for r in range(n)]


# ---------------------------------------------------------------- scripts that run


def test_script_without_torch_distributed_runs_on_every_rank(tmp_path: Path) -> None:
    # Options after the script's path are the script's, even when they look like ours.
    _write(
        tmp_path / "scripts" / "plain.py",
        REPORT,
        """
        import sys
        report(torch_preloaded="torch" in sys.modules)
        sys.exit(0)
        """,
    )
    cp = _slurmrun(
        ["--workers-per-host", "2", "scripts/plain.py", "--timeout", "5", "--epochs", "2"], tmp_path
    )
    assert cp.returncode == 0, cp.stderr
    script = str(tmp_path / "scripts" / "plain.py")
    for rank, seen in enumerate(_reports(tmp_path, 2)):
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "2"
        assert seen["MASTER_ADDR"] and seen["MASTER_PORT"]
        assert seen["argv"] == [script, "--timeout", "5", "--epochs", "2"]
        assert seen["path0"] == str(tmp_path / "scripts")  # as `python scripts/plain.py`
        assert seen["name"] == "__main__"
        # The spawner imported torch once for the node, though no group is initialised.
        assert seen["torch_preloaded"] is True


@pytest.mark.parametrize("init_args", ['"gloo"', ""])
def test_torchrun_style_script_runs_unchanged(tmp_path: Path, init_args: str) -> None:
    _write(
        tmp_path / "train.py",
        REPORT,
        f"""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DistributedSampler

        was_initialised = dist.is_initialized()
        dist.init_process_group({init_args})
        model = DDP(torch.nn.Linear(2, 1))
        model(torch.ones(4, 2)).sum().backward()
        sampler = DistributedSampler(list(range(8)))
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        report(sum=t.item(), before=was_initialised, samples=list(sampler),
               backend=dist.get_backend())
        dist.destroy_process_group()
        """,
    )
    cp = _slurmrun(["--workers-per-host=2", "train.py"], tmp_path)
    assert cp.returncode == 0, cp.stderr
    seen = _reports(tmp_path, 2)
    assert [s["sum"] for s in seen] == [3.0, 3.0]
    assert [s["before"] for s in seen] == [False, False]  # slurmrun made no group of its own
    if init_args:  # without one, torch picks a backend per device lazily ("undefined" here)
        assert [s["backend"] for s in seen] == ["gloo", "gloo"]
    assert sorted(seen[0]["samples"] + seen[1]["samples"]) == list(range(8))


def test_backend_option_initialises_the_group_before_the_script(tmp_path: Path) -> None:
    _write(
        tmp_path / "uses_group.py",
        REPORT,
        """
        import torch
        import torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        report(sum=t.item())
        dist.destroy_process_group()  # then the worker must not destroy it again
        """,
    )
    cp = _slurmrun(["--backend", "gloo", "--workers-per-host", "2", "uses_group.py"], tmp_path)
    assert cp.returncode == 0, cp.stderr
    assert "Traceback" not in cp.stdout + cp.stderr
    assert [s["sum"] for s in _reports(tmp_path, 2)] == [2.0, 2.0]


def test_module_mode_runs_a_module_from_pythonpath(tmp_path: Path) -> None:
    mods = tmp_path / "mods"
    _write(mods / "pkg" / "__init__.py", "")
    _write(mods / "pkg" / "entry.py", REPORT, "\nreport()\n")
    work = tmp_path / "work"
    work.mkdir()
    cp = _slurmrun(
        ["--workers-per-host", "2", "-m", "pkg.entry", "--lr", "0.1"], work, pythonpath=str(mods)
    )
    assert cp.returncode == 0, cp.stderr
    for seen in _reports(work, 2):
        assert seen["argv"] == [str(mods / "pkg" / "entry.py"), "--lr", "0.1"]
        assert seen["name"] == "__main__"
        assert seen["path0"] == str(work)  # as `python -m`: the working directory first


# ---------------------------------------------------------------- exit statuses

FAILING = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    how = sys.argv[1]
    if how == "raise":
        raise ValueError("rank one cannot go on")
    if how == "exit":
        sys.exit(3)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)  # rank 0 is stopped by the launcher
"""


@pytest.mark.parametrize(("how", "status"), [("raise", 1), ("exit", 3), ("sigkill", 137)])
def test_exit_status_of_a_failing_rank(tmp_path: Path, how: str, status: int) -> None:
    _write(tmp_path / "fail.py", FAILING)
    cp = _slurmrun(["--workers-per-host", "2", "fail.py", how], tmp_path)
    assert cp.returncode == status, cp.stderr
    assert "rank 1 (host localhost, local rank 1)" in cp.stderr
    assert str(tmp_path / "logs") in cp.stderr  # where the rank's whole output is
    if how == "raise":
        # The remote traceback, starting at the script (runpy's frames are dropped).
        assert "ValueError: rank one cannot go on" in cp.stderr
        assert 'raise ValueError("rank one cannot go on")' in cp.stderr
        assert "runpy" not in cp.stderr
    if how == "sigkill":
        assert "SIGKILL" in cp.stderr


def test_ctrl_c_stops_every_worker_and_exits_130(tmp_path: Path) -> None:
    _write(
        tmp_path / "sleep.py",
        """
        import os, time
        with open(f"pid{os.environ['RANK']}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(f"pid{os.environ['RANK']}.tmp", f"pid{os.environ['RANK']}")
        time.sleep(120)
        """,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(PYTHONPATH=str(REPO), SLURMRUN_LOG_DIR=str(tmp_path / "logs"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmrun", "--workers-per-host", "2", "sleep.py"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + LIMIT
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.1)
        workers = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends (to the launcher alone here)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, stderr
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- options


def test_bad_options_exit_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _write(tmp_path / "never.py", "raise AssertionError('must not run')\n")
    for argv in (
        ["--workers-per-host", "two", str(script)],
        ["--no-such-option", "1", str(script)],
        ["--backend", "fast", str(script)],
    ):
        assert main(argv) == 2, argv
        assert "slurmrun: error: " in capsys.readouterr().err
    # Values of the right type that the launcher refuses; a missing script; no script at all.
    assert main(["--workers-per-host", "0", str(script)]) == 2
    assert "workers_per_host must be at least 1" in capsys.readouterr().err
    assert main(["--dry-run", "--max-restarts", "-1", str(script)]) == 2
    assert "max_restarts must be an int >= 0" in capsys.readouterr().err
    # Options refused by planning (the hosts found, the agents' srun options): usage errors too,
    # in the dry run as in the run.
    for dry in (["--dry-run"], []):
        assert main([*dry, "--min-hosts", "5", "--max-restarts", "1", str(script)]) == 2
        assert "min_hosts must be an int from 1 to the launch's 1" in capsys.readouterr().err
        assert main([*dry, "--srun-args", "--nodes=2", str(script)]) == 2
        assert "conflicts with slurmrun's own --nodes" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.py")]) == 2
    assert "can't open file" in capsys.readouterr().err
    assert main(["--workers-per-host", "2"]) == 2
    assert "no script given" in capsys.readouterr().err
    assert main(["-m", "no_such_module_here"]) == 2
    assert "No module named 'no_such_module_here'" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["http", "0", "70000"])
def test_a_bad_launcher_port_variable_is_a_usage_error_in_the_dry_run_and_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, port: str
) -> None:
    script = _write(tmp_path / "never.py", "raise AssertionError('must not run')\n")
    monkeypatch.setenv("SLURMRUN_LAUNCHER_PORT", port)
    for dry in (["--dry-run"], []):
        assert main([*dry, "--workers-per-host", "1", str(script)]) == 2
        err = capsys.readouterr().err
        assert f"SLURMRUN_LAUNCHER_PORT={port!r} is not a TCP port number" in err


def test_help_documents_each_option_from_the_field_docstrings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines are wrapped at the terminal's width
    for option in ("--hostnames", "--workers-per-host", "--backend", "--timeout"):
        assert option in out
    for option in ("--max-restarts", "--env-file", "--extra-env-vars", "--heartbeat-timeout"):
        assert option in out
    assert "Seconds without a heartbeat" in out
    assert "A bash file that each agent sources" in out
    assert "slurmrun [OPTIONS] SCRIPT [ARGS...]" in out
    assert "log-handlers" not in out  # not a CLI option
    assert "on-event" not in out


def test_tyro_round_trip_in_a_users_script() -> None:
    def parse(*args: str) -> slurmrun.Launcher:
        return tyro.cli(slurmrun.Launcher, args=list(args))

    assert parse() == slurmrun.Launcher()
    assert parse("--hostnames", "auto").hostnames == "auto"
    assert parse("--hostnames", "slurm").hostnames == "slurm"
    assert parse("--hostnames", "node1", "node2").hostnames == ["node1", "node2"]
    assert parse("--workers-per-host", "2").workers_per_host == 2
    assert parse("--workers-per-host", "2", "3").workers_per_host == [2, 3]
    assert parse("--workers-per-host", "slurm").workers_per_host == "slurm"
    assert parse("--backend", "None").backend is None
    assert parse("--backend", "gloo").backend == "gloo"
    launcher = parse(
        "--timeout", "30", "--max-restarts", "2", "--env-file", "env.sh",
        "--extra-env-vars", "WANDB_*", "MY_VAR", "--heartbeat-timeout", "5",
    )  # fmt: skip
    assert launcher == slurmrun.Launcher(
        timeout=30.0,
        max_restarts=2,
        env_file="env.sh",
        extra_env_vars=("WANDB_*", "MY_VAR"),
        heartbeat_timeout=5.0,
    )


def test_import_slurmrun_does_not_import_tyro() -> None:
    code = "import sys, slurmrun.launcher, slurmrun.cli.script; print('tyro' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("argv", "launcher_args", "target", "module", "script_args"),
    [
        (
            ["--hostnames", "node1", "node2", "train.py", "--timeout", "5"],
            ["--hostnames", "node1", "node2"],
            "train.py",
            False,
            ["--timeout", "5"],
        ),
        (["--timeout", "5", "train", "-m", "x"], ["--timeout", "5"], "train", False, ["-m", "x"]),
        (["--hostnames", "auto", "train", "a"], ["--hostnames", "auto"], "train", False, ["a"]),
        (["--workers-per-host", "2", "run", "3"], ["--workers-per-host", "2"], "run", False, ["3"]),
        (["--hostnames", "a", "--", "run", "--x"], ["--hostnames", "a"], "run", False, ["--x"]),
        (["--backend=gloo", "-m", "pkg.mod", "--y"], ["--backend=gloo"], "pkg.mod", True, ["--y"]),
        (["-mpkg", "1"], [], "pkg", True, ["1"]),
    ],
)
def test_split_command(
    argv: list[str], launcher_args: list[str], target: str, module: bool, script_args: list[str]
) -> None:
    cmd = split_command(argv)
    assert (cmd.launcher_args, cmd.target, cmd.module, cmd.script_args) == (
        launcher_args,
        target,
        module,
        script_args,
    )


def test_split_command_puts_a_verbs_own_options_apart() -> None:
    own = {"--nodes": True, "--no-requeue": False}
    argv = ["--nodes", "2", "--backend", "gloo", "--no-requeue", "--nodes=3", "-m", "pkg", "--x"]
    cmd = split_command(argv, own)
    assert cmd.own_args == ["--nodes=2", "--no-requeue", "--nodes=3"]
    assert cmd.launcher_args == ["--backend", "gloo"]
    assert (cmd.target, cmd.module, cmd.script_args) == ("pkg", True, ["--x"])


def test_extra_env_vars_words_parse_as_given() -> None:
    launcher = parse_launcher(["--extra-env-vars", "NCCL_DEBUG=INFO", "MY_*", "X=a=b,c"])
    assert launcher == slurmrun.Launcher(
        backend=None, extra_env_vars=("NCCL_DEBUG=INFO", "MY_*", "X=a=b,c")
    )


def test_extra_env_vars_reach_every_rank_of_a_script(tmp_path: Path) -> None:
    _write(
        tmp_path / "env.py",
        REPORT,
        """
        import os
        report(env={k: os.environ.get(k) for k in ("SET_HERE", "MY_PASSED", "MY_OTHER")})
        """,
    )
    cp = _slurmrun(
        ["--workers-per-host", "2", "--extra-env-vars", "SET_HERE=a b", "MY_*", "env.py"],
        tmp_path,
        env={"MY_PASSED": "yes"},
    )
    assert cp.returncode == 0, cp.stderr
    for seen in _reports(tmp_path, 2):
        assert seen["env"] == {"SET_HERE": "a b", "MY_PASSED": "yes", "MY_OTHER": None}


# ---------------------------------------------------------------- info and dry run


def test_info_subcommand_reports_the_localhost_plan_as_json(tmp_path: Path) -> None:
    out = _slurmrun(["info", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["slurm"] is None, info
    assert info["launch"]["hosts"] == ["localhost"]


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = _write(tmp_path / "train.py", f"open({str(marker)!r}, 'w').close()\n")
    out = _slurmrun(
        ["--dry-run", "--workers-per-host", "2", str(script), "--epochs", "2"], tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "localhost" in out.stdout
    assert "slurmrun.node.agent_main" in out.stdout  # the agent command it would run
    assert not marker.exists()
    assert not (tmp_path / "logs").exists()


def test_bad_options_and_calls_raise_one_typed_error_before_anything_starts() -> None:
    """`OptionsError` is the condition the command answers with status 2; it stays a
    ValueError or TypeError for callers that catch those."""
    cases = [
        ({"workers_per_host": 0}, (), slurmrun.OptionsValueError),
        ({"backend": "fast"}, (), slurmrun.OptionsValueError),
        ({"log_handlers": ["not a handler"]}, (), slurmrun.OptionsTypeError),
        ({}, ("a", threading.Lock()), slurmrun.OptionsTypeError),  # a lock cannot be pickled
    ]
    for options, args, error in cases:
        with pytest.raises(error) as raised:
            slurmrun.launch(print, args, **options)  # type: ignore[arg-type]
        assert isinstance(raised.value, slurmrun.OptionsError), options
        with pytest.raises(error):
            slurmrun.Launcher(**options).dry_run(print, args)  # type: ignore[arg-type]
    assert issubclass(slurmrun.OptionsValueError, ValueError)
    assert issubclass(slurmrun.OptionsTypeError, TypeError)


def test_a_reader_gone_ends_every_command_quietly(tmp_path):
    """Issue 45 (6e): ``slurmrun status 2 | head -1`` is no BrokenPipeError, for every command."""
    bare = tmp_path / "bin"  # no SLURM: `status` reads the job's folder
    bare.mkdir()
    files = JobFolder.of(tmp_path / "slurmrun_jobs", "2")
    files.path.mkdir(parents=True)
    files.submitted_pickle.write_bytes(b"")
    files.stderr.write_text("".join(f"line {i}\n" for i in range(20)))
    files.cache_state("FAILED")
    _write(tmp_path / "talk.py", "for i in range(20000):\n    print('line', i)\n")
    for args, status in (
        (["--help"], 141),
        (["--version"], 141),
        (["status", "2"], 141),
        (["logs", "2"], 0),  # prints nothing: its rank has no log
        (["jobs"], 141),
        (["--dry-run", "talk.py"], 141),  # issue 50: `slurmrun --dry-run ... | head`
        (["submit", "--help"], 0),  # argparse ignores the error itself
        (["--workers-per-host", "2", "talk.py"], 0),  # a launch runs on: the run's own status
    ):
        read, write = os.pipe()
        os.close(read)  # the reader has gone before anything is written
        try:
            done = subprocess.run(
                [sys.executable, "-m", "slurmrun", *args],
                cwd=tmp_path,
                env={
                    **os.environ,
                    "PYTHONPATH": str(REPO),
                    "PATH": str(bare),
                    "SLURMRUN_LOG_DIR": str(tmp_path / "logs"),
                },
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                timeout=LIMIT,
                check=False,
            )
        finally:
            os.close(write)
        # A launch's own lines (issue 46) go to stderr, which has its reader: nothing else does.
        own = r"slurmrun: (starting agents on .*|2 ranks on 1 host .*; logs: \S+)\n"
        assert (done.returncode, re.sub(own, "", done.stderr)) == (status, ""), args
