"""Entry-point plugins, for real: a package with its own pyproject.toml is pip-installed.

tests/plugins/fake_scheduler provides an allocation provider (``slurmrun.allocations``) that
reads a hostfile, and named resources (``slurmrun.resources``). It is installed with pip,
together with this checkout's slurmrun (whose own providers are entry points too), into a
``--target`` folder; scripts run with that folder on PYTHONPATH, so importlib.metadata
discovers the entry points from the installed ``.dist-info`` metadata, as in a user's venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "tests" / "plugins" / "fake_scheduler"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with slurmrun and fake-scheduler pip-installed into it."""
    src = tmp_path_factory.mktemp("src")
    # Copies: pip builds in the source tree (build/, *.egg-info), which must stay clean.
    shutil.copytree(PLUGIN, src / "plugin", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    (src / "slurmrun").mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / "slurmrun" / name)
    shutil.copytree(
        REPO / "slurmrun",
        src / "slurmrun" / "slurmrun",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src / "slurmrun"),
            str(src / "plugin"),
        ],
        check=True,
        timeout=240,
    )
    return target


def run_script(site: Path, tmp_path: Path, code: str, **env: str) -> dict[str, object]:
    """Runs `code` with `site` first on sys.path; it prints one JSON object last."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    environ.update(env, PYTHONPATH=str(site))
    cp = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    result: dict[str, object] = json.loads(cp.stdout.strip().splitlines()[-1])
    return result


def test_launch_uses_an_installed_scheduler_plugin(site: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost 2\n127.0.0.1 1\n")
    out = run_script(
        site,
        tmp_path,
        """
        import json, os
        from importlib.metadata import entry_points

        import slurmrun
        from slurmrun import providers

        registered = sorted(ep.name for ep in entry_points(group="slurmrun.allocations"))
        order = [name for name, _ in providers.providers()]
        result = slurmrun.launch(lambda: os.environ["RANK"], backend="gloo")
        print(json.dumps({
            "slurmrun": slurmrun.__file__,
            "registered": registered,
            "order": order,
            "hosts": result.hostnames,
            "values": result.values(),
            "plan": slurmrun.Launcher().dry_run(print).as_dict()["agents"],
        }))
        """,
        FAKE_SCHEDULER_HOSTFILE=str(hostfile),
    )
    assert str(out["slurmrun"]).startswith(str(site))  # the installed copy, with its metadata
    assert out["registered"] == ["fake", "hostfile", "localhost", "slurm"]
    assert out["order"] == ["fake", "slurm", "hostfile", "localhost"]
    assert out["hosts"] == ["localhost", "127.0.0.1"]
    assert out["values"] == ["0", "1", "2"]  # 2 workers, then 1, as the hostfile says
    assert out["plan"] == "local"


def test_without_the_plugins_variable_auto_falls_through_to_localhost(
    site: Path, tmp_path: Path
) -> None:
    out = run_script(
        site,
        tmp_path,
        """
        import json
        import slurmrun
        from slurmrun import providers

        found = providers.detect()
        result = slurmrun.launch(lambda: 1, workers_per_host=1)
        print(json.dumps({"provider": found.provider, "hosts": result.hostnames}))
        """,
    )
    assert out == {"provider": "localhost", "hosts": ["localhost"]}


def test_named_resources_reach_the_batch_script(site: Path, tmp_path: Path) -> None:
    out = run_script(
        site,
        tmp_path,
        """
        import json
        import slurmrun
        from slurmrun.resources import named_resources

        dry = slurmrun.submit(print, resources="gpu_x8", dry_run=True)
        mine = slurmrun.submit(print, resources="gpu_x8", nodes=3, dry_run=True,
                               slurm_parameters={"partition": "debug"})
        try:
            slurmrun.submit(print, resources="no_such_preset", dry_run=True)
        except ValueError as e:
            error = str(e)
        array = slurmrun.submit_array(print, [(1,), (2,)], resources="gpu_x8", dry_run=True)
        one = slurmrun.submit(print, resources="gpu_x8", nodes=1, cpus_per_worker=1, dry_run=True)
        print(json.dumps({"names": sorted(named_resources()), "script": str(dry),
                          "mine": mine.parameters, "error": error, "array": str(array),
                          "one": one.parameters}))
        """,
    )
    assert out["names"] == ["cpu_small", "gpu_x8"]
    script = str(out["script"])
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=12",
        "#SBATCH --mem=500G",
        "#SBATCH --partition=gpu",
    ):
        assert line in script
        assert line in str(out["array"])
    assert "#SBATCH --array=0-1%2" in str(out["array"])
    one = out["one"]  # given, even at the defaults' values: they win over the preset's
    assert isinstance(one, dict)
    assert (one["nodes"], one["cpus_per_task"], one["gpus_per_node"]) == (1, 1, 8)
    mine = out["mine"]
    assert isinstance(mine, dict)
    assert mine["nodes"] == 3 and mine["partition"] == "debug" and mine["mem"] == "500G"
    assert "no_such_preset" in str(out["error"]) and "gpu_x8" in str(out["error"])


def test_a_hostfile_outside_slurm_plans_ssh_agents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slurmrun
    from slurmrun import providers

    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the team's machines\nhostA slots=4\nhostB slots=2  # spare\n")
    monkeypatch.setenv(providers.HOSTFILE_VAR, str(hostfile))
    monkeypatch.setenv("SLURMRUN_LAUNCHER_ADDR", "192.0.2.1")  # hostA/B do not resolve here
    plan = slurmrun.Launcher(backend="gloo").dry_run(print)
    assert plan.agents == "ssh" and plan.hosts == ("hostA", "hostB")
    assert plan.expected_workers == (4, 2)
    assert plan.commands[0][:2] == ("ssh", "-T") and plan.commands[1][-2] == "hostB"
    assert "SLURMRUN_SECRET=" not in " ".join(plan.commands[0])
    hostfile.write_text("hostA slots=x\n")
    with pytest.raises(slurmrun.OptionsValueError, match="slots=N"):
        slurmrun.Launcher().dry_run(print)
    hostfile.write_text("# nobody yet\n")
    with pytest.raises(slurmrun.OptionsValueError, match="lists no host"):
        slurmrun.Launcher().run(print)
