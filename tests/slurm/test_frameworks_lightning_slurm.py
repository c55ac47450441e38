"""Lightning under slurmrun on the real cluster: every rank must see one consistent world.

A Lightning DDP run in a 2-node x 2-task job, through ``slurmrun train.py`` in a batch script
(Lightning picks its torchrun path, TorchElasticEnvironment, or SLURMEnvironment when forced
through ``plugins``), and Fabric in a function that ``slurmrun.launch`` runs in an allocation.
Each rank writes what it saw (its rank, local rank, node rank, world size, the cluster
environment Lightning chose, its weights after training) into a JSON file of tmp_path.

Fabric works whether it makes the process group from the torchrun variables itself
(``backend=None``, as under torchrun) or finds the one slurmrun made (``backend="gloo"``).

Lightning's own SLURM requeue works under slurmrun as under srun, with SLURMEnvironment given
in ``plugins`` (slurmrun's workers look launched by torchrun, so Lightning would otherwise pick
TorchElasticEnvironment, which sets no USR1 handler: the signal kills the workers): SLURM's
USR1 reaches the workers (slurmstepd signals every process of the agents' step), Lightning's
handler saves its hpc checkpoint on every rank and rank 0 runs ``scontrol requeue``; the batch
script runs again and Lightning resumes from that checkpoint. A requeued job waits ~10 s (the
test cluster's cred_expire) before it starts again. The ranks take the signal parked at the same
step: Lightning saves that checkpoint (a collective: it ends in a barrier) inside the signal
handler, wherever each rank is, and ranks that take it at different points of a DDP step
deadlock (the barrier against the others' gradient all-reduce). That is Lightning's, and happens
under plain srun as well (Lightning-AI/pytorch-lightning#21406).

The batch jobs here are polled every 0.2 s rather than waited for with ``sbatch --wait``,
which looks after 2, 10, 42, 74 s: a job of 11 s took 42 s.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.slurm.conftest import ENDED_STATES, JOB_NAME, REPO, scontrol_job, wait_job
from tests.slurm.slurm_helpers import wait_for

# The batch script's `slurmrun`, the agents and the workers import this checkout's slurmrun;
# the spawner imports Lightning once per node, before forking the node's workers.
EXPORT = f"export PYTHONPATH={REPO} SLURMRUN_PRELOAD=torch,lightning.pytorch\n"
LAYOUT = "#SBATCH -N 2 --ntasks-per-node=2\n"

TRAIN = """
import argparse, json, os, pathlib, time

import torch
import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.environments import SLURMEnvironment

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--env", choices=["auto", "slurm", "slurm-requeue"], default="auto")
parser.add_argument("--max-steps", type=int, default=4)
parser.add_argument("--wait-at", type=int, default=-1)
args = parser.parse_args()
out = pathlib.Path(args.out)
out.mkdir(exist_ok=True)
rank = os.environ["RANK"]
started = []


def note(kind, what):
    # Appended to out/<kind>.<rank>, which outlives a run that SLURM kills.
    with open(out / f"{kind}.{rank}", "a") as f:
        f.write(f"{what} ")


class RecordingIO(TorchCheckpointIO):
    # Lightning writes checkpoints through this on global rank 0 only.
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        note("wrote", os.path.basename(path))
        super().save_checkpoint(checkpoint, path, storage_options)


class Record(Callback):
    # The step this run started from: 0, or the step of the checkpoint it resumed.
    def on_train_start(self, trainer, pl_module):
        started.append(trainer.global_step)

    # Every rank makes each checkpoint's contents (trainer.save_checkpoint is collective).
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        note("checkpointed", trainer.global_step)


class WaitForSignal(Callback):
    # The first run stops after step --wait-at and waits, for the test to signal the job: every
    # rank runs Lightning's handler (and its barrier) from here, none from inside a DDP step.
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        first_run = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if trainer.global_step == args.wait_at and first_run:
            (out / f"ready.{rank}").write_text(str(trainer.global_step))
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                time.sleep(0.1)


plugins = [RecordingIO()]
if args.env != "auto":
    plugins.append(SLURMEnvironment(auto_requeue=args.env == "slurm-requeue"))
L.seed_everything(1)
model = BoringModel()
initial = [p.detach().flatten().tolist() for p in model.parameters()]
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    num_nodes=2,
    strategy="ddp",
    max_steps=args.max_steps,
    limit_val_batches=0,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=out,
    plugins=plugins,
    callbacks=[
        ModelCheckpoint(
            dirpath=out / "checkpoints", filename="final", every_n_train_steps=args.max_steps
        ),
        Record(),
        WaitForSignal(),
    ],
)
trainer.fit(model)
env = trainer._accelerator_connector.cluster_environment
seen = {
    "global_rank": trainer.global_rank,
    "local_rank": trainer.local_rank,
    "node_rank": trainer.node_rank,
    "world_size": trainer.world_size,
    "is_global_zero": trainer.is_global_zero,
    "global_step": trainer.global_step,
    "started": started,
    "ckpt_path": trainer.ckpt_path,
    "environment": type(env).__name__,
    "env_world": [env.global_rank(), env.local_rank(), env.node_rank(), env.world_size()],
    "dist": [torch.distributed.get_rank(), torch.distributed.get_world_size()],
    "RANK": os.environ["RANK"],
    "WORLD_SIZE": os.environ["WORLD_SIZE"],
    "node": os.environ["SLURMD_NODENAME"],
    "job": os.environ["SLURM_JOB_ID"],
    "restarts": os.environ.get("SLURM_RESTART_COUNT", "0"),
    "initial": initial,
    "weights": [p.detach().flatten().tolist() for p in model.parameters()],
    "slurmrun": __import__("slurmrun").__file__,
}
(out / f"rank{rank}.json").write_text(json.dumps(seen))
"""


class BatchJob:
    """A batch job of tmp_path's, submitted without ``--wait``, polled until it ends."""

    def __init__(self, run_cmd, tmp_path: Path, script: str, name: str) -> None:
        path, self.log = tmp_path / f"{name}.sh", tmp_path / f"{name}.out"
        path.write_text(f"#!/bin/bash\n{script}")
        # --time=5: with --signal=USR1@90, SLURM's own USR1 comes long after any test here.
        argv = ["sbatch", "--parsable", f"--job-name={JOB_NAME}", "--time=5"]
        self.id = run_cmd([*argv, f"--output={self.log}", str(path)]).stdout.split(";")[0].strip()

    def field(self, name: str) -> str:
        return scontrol_job(self.id)[name]

    def ended(self) -> bool:
        return self.field("JobState") in ENDED_STATES

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        wait_for(predicate, timeout, what, output=self.output)

    def wait(self, timeout: float) -> str:
        """Waits for the job's end; returns its state."""
        return wait_job(self.id, timeout, self.log)["JobState"]


@pytest.fixture
def batch_job(run_cmd, tmp_path) -> Iterator[Callable[[str], BatchJob]]:
    """``batch_job(script)`` submits it; a job still running at the test's end is cancelled."""
    jobs: list[BatchJob] = []

    def submit(script: str) -> BatchJob:
        jobs.append(BatchJob(run_cmd, tmp_path, textwrap.dedent(script), f"job{len(jobs)}"))
        return jobs[-1]

    yield submit
    for job in jobs:
        with contextlib.suppress(Exception):
            if not job.ended():
                subprocess.run(["scancel", job.id], timeout=30, check=False)


def _train(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(TRAIN))
    return path


def _seen(out: Path, output: str) -> list[dict]:
    missing = [r for r in range(4) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote nothing\n{output}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _notes(out: Path, kind: str) -> list[list[str]]:
    """What each rank noted of `kind` (train.py's note), in order, over all runs of the job."""
    files = [out / f"{kind}.{r}" for r in range(4)]
    return [f.read_text().split() if f.exists() else [] for f in files]


def _assert_one_world(seen: list[dict], environment: str, output: str) -> None:
    """Ranks 0..3 in a 2 x 2 world, as Lightning, its environment, torch and the env see it."""
    assert [s["global_rank"] for s in seen] == [0, 1, 2, 3], output
    assert [s["local_rank"] for s in seen] == [0, 1, 0, 1]
    assert [s["node_rank"] for s in seen] == [0, 0, 1, 1]
    assert [s["node"] for s in seen] == ["node1", "node1", "node2", "node2"]
    assert {s["world_size"] for s in seen} == {4}
    assert [s["is_global_zero"] for s in seen] == [True, False, False, False]
    assert {s["environment"] for s in seen} == {environment}
    assert [s["env_world"] for s in seen] == [[r, r % 2, r // 2, 4] for r in range(4)]
    assert [s["dist"] for s in seen] == [[r, 4] for r in range(4)]
    assert [(s["RANK"], s["WORLD_SIZE"]) for s in seen] == [(str(r), "4") for r in range(4)]
    assert {s["slurmrun"] for s in seen} == {str(REPO / "slurmrun" / "__init__.py")}


def _assert_trained_alike(seen: list[dict], steps: int) -> None:
    """Every rank took `steps` steps and ends with the same weights, which training changed."""
    assert {s["global_step"] for s in seen} == {steps}
    weights = seen[0]["weights"]
    assert all(s["weights"] == weights for s in seen)  # DDP kept the replicas equal
    assert weights != seen[0]["initial"]


@pytest.mark.parametrize(
    ("env", "environment"),
    [("auto", "TorchElasticEnvironment"), ("slurm", "SLURMEnvironment")],
)
def test_lightning_ddp_under_slurmrun_sees_one_world(tmp_path, batch_job, env, environment):
    _train(tmp_path)
    out = tmp_path / "out"
    job = batch_job(
        f"{LAYOUT}{EXPORT}"
        f"{sys.executable} -m slurmrun train.py --out {out} --env {env} --max-steps 4\n"
    )
    assert job.wait(timeout=120) == "COMPLETED", job.output()
    seen = _seen(out, job.output())
    _assert_one_world(seen, environment, job.output())
    _assert_trained_alike(seen, 4)
    assert {s["job"] for s in seen} == {job.id}
    assert [(s["started"], s["ckpt_path"]) for s in seen] == [([0], None)] * 4
    # One checkpoint, made by every rank, written by rank 0, with the weights they ended with.
    assert _notes(out, "checkpointed") == [["4"]] * 4
    assert _notes(out, "wrote") == [["final.ckpt"], [], [], []]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["final.ckpt"]
    ckpt = torch.load(out / "checkpoints" / "final.ckpt", weights_only=False)
    assert ckpt["global_step"] == 4
    assert [t.flatten().tolist() for t in ckpt["state_dict"].values()] == seen[0]["weights"]


FABRIC = """
import json, os, sys

import slurmrun


def train(steps):
    import torch
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp")
    # The processes exist already: launch() starts none (the environment says it creates them
    # externally); it joins the process group, or finds slurmrun's.
    fabric.launch()
    fabric.seed_everything(1)
    model = torch.nn.Linear(8, 2)
    initial = [p.detach().flatten().tolist() for p in model.parameters()]
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(fabric.global_rank)  # every rank its own data
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).sum()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    env = fabric.strategy.cluster_environment
    return {
        "global_rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "world_size": fabric.world_size,
        "is_global_zero": fabric.is_global_zero,
        "environment": type(env).__name__,
        "env_world": [env.global_rank(), env.local_rank(), env.node_rank(), env.world_size()],
        "dist": [torch.distributed.get_rank(), torch.distributed.get_world_size()],
        "backend": torch.distributed.get_backend(),
        "RANK": os.environ["RANK"],
        "WORLD_SIZE": os.environ["WORLD_SIZE"],
        "node": os.environ["SLURMD_NODENAME"],
        "initial": initial,
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        "slurmrun": slurmrun.__file__,
    }


result = slurmrun.launch(train, (3,), workers_per_host=2, backend=BACKEND, timeout=60)
print("RESULT " + json.dumps([v for host in result.return_values for v in host]))
"""


@pytest.mark.parametrize(
    "backend",
    [None, pytest.param("gloo", marks=pytest.mark.quick)],  # quick: this file's smoke test
)
def test_fabric_in_slurmrun_launch_sees_one_world(run_in_allocation, backend):
    script = FABRIC.replace("BACKEND", repr(backend))
    cp = run_in_allocation(
        ["-N2", "--ntasks-per-node=2"],
        script,
        timeout=90,
        env={"PYTHONPATH": str(REPO), "SLURMRUN_PRELOAD": "torch,lightning.fabric"},
    )
    output = cp.stdout + cp.stderr
    lines = [line for line in cp.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, output
    seen = json.loads(lines[0].removeprefix("RESULT "))
    _assert_one_world(seen, "TorchElasticEnvironment", output)
    assert {s["backend"] for s in seen} == {"gloo"}
    weights = seen[0]["weights"]
    assert all(s["weights"] == weights for s in seen)
    assert weights != seen[0]["initial"]


def test_lightning_requeues_the_job_on_sigusr1_and_resumes_from_its_hpc_checkpoint(
    tmp_path, batch_job
):
    _train(tmp_path)
    out = tmp_path / "out"
    job = batch_job(
        f"{LAYOUT}#SBATCH --signal=SIGUSR1@90 --requeue --open-mode=append\n"
        f"{EXPORT}echo run ${{SLURM_RESTART_COUNT:-0}}\n"
        f"{sys.executable} -m slurmrun train.py --out {out} --env slurm-requeue"
        " --max-steps 6 --wait-at 3\n"
    )
    ready = [out / f"ready.{r}" for r in range(4)]
    job.wait_for(lambda: all(p.exists() for p in ready) or job.ended(), 90, "every rank at step 3")
    assert not job.ended(), job.output()
    # As SLURM signals ahead of the time limit: every step of the job, not the batch step.
    subprocess.run(["scancel", "--signal=USR1", job.id], check=True, timeout=30)
    job.wait_for(lambda: job.field("Restarts") == "1", 60, "the requeue")
    # SLURM holds a requeued job until its credentials expired (cred_expire=10) to restart it.
    assert job.wait(timeout=150) == "COMPLETED", job.output()
    output = job.output()
    assert job.field("Restarts") == "1"  # Lightning's requeue only: slurmrun added none
    assert "run 0" in output and "run 1" in output and "run 2" not in output
    hpc = out / "hpc_ckpt_1.ckpt"
    assert sorted(p.name for p in out.glob("*.ckpt")) == [hpc.name], output
    assert torch.load(hpc, weights_only=False)["global_step"] == 3
    seen = _seen(out, output)
    _assert_one_world(seen, "SLURMEnvironment", output)
    _assert_trained_alike(seen, 6)
    assert {s["restarts"] for s in seen} == {"1"}
    # Every rank took the signal: each made the hpc checkpoint at step 3 (rank 0 wrote it),
    # then the final one at step 6 in the second run.
    assert _notes(out, "checkpointed") == [["3", "6"]] * 4
    assert _notes(out, "wrote") == [["hpc_ckpt_1.ckpt", "final.ckpt"], [], [], []]
    # The second run resumed from the checkpoint Lightning saved on the signal.
    assert [(s["started"], s["ckpt_path"]) for s in seen] == [([3], str(hpc))] * 4
