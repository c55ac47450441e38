"""Hugging Face Trainer, Accelerate and submitit under slurmrun on the real cluster (CPU, gloo).

Each framework finds its world in the worker's environment: Accelerate's ``PartialState`` (the
Trainer's too) reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_*, submitit's
``SlurmJobEnvironment`` reads SLURM's task variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS,
SLURM_NODEID, SLURM_JOB_NUM_NODES). Every run is 2 nodes x 2 workers; each rank reports the
world as the framework sees it, and the training must really have been distributed: every rank
starts from weights of its own (seeded by its rank), sees samples no other rank sees, and ends
with the same weights as every other rank.

Models are tiny and built from configs (nothing is downloaded); the per-node spawner imports
the heavy modules once before it forks the workers (SLURMRUN_PRELOAD).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.slurm.conftest import JOB_NAME, REPO, _minutes, _run, wait_job

# The launcher, agents and workers import this checkout's slurmrun, whatever is installed.
PYTHONPATH = str(REPO)
SLURMRUN = f"{PYTHONPATH}/slurmrun/__init__.py"
HF_PRELOAD = "torch,transformers.trainer,transformers.models.bert.modeling_bert"
STEPS = 3
BATCH = 2
WORLD = [  # (node, local rank) of ranks 0..3 in a 2 x 2 run
    ("node1", 0),
    ("node1", 1),
    ("node2", 0),
    ("node2", 1),
]

# What every rank reports, whichever framework trains: where it runs and the training's proof.
COMMON = """
import hashlib, json, os, sys, warnings

def _digest(model):
    import torch
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()

def _where():
    import torch
    import torch.distributed as dist
    return {
        "node": os.environ.get("SLURMD_NODENAME"),
        "env_rank": int(os.environ["RANK"]),
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "dist_backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "slurmrun": sys.modules["slurmrun"].__file__,
    }

def _write(out_dir, view):
    with open(os.path.join(out_dir, f"rank{view['env_rank']}.json"), "w") as f:
        json.dump(view, f)
"""

# The HF Trainer: a one-layer BERT classifier, STEPS steps of BATCH samples per rank.
HF_TRAIN = (
    COMMON
    + f"""
def hf_train(out_dir):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(int(os.environ["RANK"]))  # weights of its own: DDP must make them one
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=8, num_labels=2)
    model = BertForSequenceClassification(config)
    initial = _digest(model)
    # Sample i starts with token i, so the collator can tell which samples this rank saw.
    data = [{{"input_ids": torch.tensor([i, 1 + i % 5, 2, 3]), "labels": torch.tensor(i % 2)}}
            for i in range(64)]
    seen = []

    def collate(batch):
        seen.extend(int(b["input_ids"][0]) for b in batch)
        return {{k: torch.stack([b[k] for b in batch]) for k in ("input_ids", "labels")}}

    with warnings.catch_warnings(record=True) as caught:  # what Accelerate says of the world
        warnings.simplefilter("always")
        args = TrainingArguments(
            output_dir=os.path.join(out_dir, "trainer"), use_cpu=True, max_steps={STEPS},
            per_device_train_batch_size={BATCH}, learning_rate=0.1, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        trainer.train()
    acc = trainer.accelerator
    view = dict(
        _where(),
        world_size=trainer.args.world_size,
        process_index=trainer.args.process_index,
        local_process_index=trainer.args.local_process_index,
        parallel_mode=str(trainer.args.parallel_mode),
        world_zero=trainer.is_world_process_zero(),
        local_zero=trainer.is_local_process_zero(),
        num_processes=acc.num_processes,
        distributed_type=str(acc.distributed_type),
        wrapped=type(trainer.model_wrapped).__name__,
        global_step=trainer.state.global_step,
        omp_warnings=[str(w.message) for w in caught if "OMP_NUM_THREADS" in str(w.message)],
        seen=seen,
        initial=initial,
        final=_digest(model),
    )
    _write(out_dir, view)
    return view
"""
)

HF_SCRIPT = HF_TRAIN + "\nhf_train(sys.argv[1])\n"

ACCELERATE_SCRIPT = (
    COMMON
    + f"""
import torch
from accelerate import Accelerator

with warnings.catch_warnings(record=True) as caught:  # what Accelerate says of the world
    warnings.simplefilter("always")
    accelerator = Accelerator(cpu=True)
torch.manual_seed(int(os.environ["RANK"]))  # weights of its own: DDP must make them one
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
initial = _digest(model)
ids = torch.arange(64)
features = torch.stack([ids / 64, ids % 3, ids % 5, ids.sqrt()], 1).float()
data = torch.utils.data.TensorDataset(ids, features, (ids % 2).float().unsqueeze(1))
loader = torch.utils.data.DataLoader(data, batch_size={BATCH})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
seen = []
for step, (idx, x, y) in enumerate(loader):
    if step == {STEPS}:
        break
    seen.extend(idx.tolist())
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
state = accelerator.state
_write(sys.argv[1], dict(
    _where(),
    num_processes=accelerator.num_processes,
    process_index=accelerator.process_index,
    local_process_index=accelerator.local_process_index,
    distributed_type=str(accelerator.distributed_type),
    backend=state.backend,
    main=accelerator.is_main_process,
    local_main=accelerator.is_local_main_process,
    device=str(accelerator.device),
    wrapped=type(model).__name__,
    omp_warnings=[str(w.message) for w in caught if "OMP_NUM_THREADS" in str(w.message)],
    seen=seen,
    initial=initial,
    final=_digest(accelerator.unwrap_model(model)),
))
accelerator.end_training()
"""
)

# Code that finds its rank with submitit, as code written for submitit jobs does, then joins a
# gloo group with the rank and size submitit gives it. The view is written before the group is
# joined, so a wrong world shows in it even when joining then fails.
SUBMITIT_SCRIPT = """
import json, os, socket, sys
from datetime import timedelta

import submitit
import torch
import torch.distributed as dist

job = submitit.JobEnvironment()
view = {
    "env_class": type(job).__name__,
    "global_rank": job.global_rank,
    "local_rank": job.local_rank,
    "num_tasks": job.num_tasks,
    "num_nodes": job.num_nodes,
    "node": job.node,
    "hostname": job.hostname,
    "hostnames": job.hostnames,
    "job_id": job.job_id,
    "slurm": {k: os.environ.get(k) for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
                                              "SLURM_NTASKS", "SLURM_JOB_NUM_NODES")},
    "env_rank": int(os.environ["RANK"]),
    "slurmrun": sys.modules["slurmrun"].__file__,
}
path = os.path.join(sys.argv[1], f"rank{view['env_rank']}.json")
with open(path, "w") as f:
    json.dump(view, f)
dist.init_process_group("gloo", rank=job.global_rank, world_size=job.num_tasks,
                        timeout=timedelta(seconds=30))
t = torch.tensor([float(job.global_rank + 1)])
dist.all_reduce(t)
view["sum"] = t.item()
with open(path, "w") as f:
    json.dump(view, f)
dist.destroy_process_group()
"""


# --------------------------------------------------------------------------- helpers
def _views(out_dir: Path, output: str) -> list[dict]:
    found = sorted(out_dir.glob("rank*.json"))
    assert [p.name for p in found] == [f"rank{r}.json" for r in range(4)], output
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]


def _assert_trained_together(views: list[dict], output: str) -> None:
    """Distributed training, not four trainings: ranks started apart, saw disjoint samples, and
    ended with one set of weights that differs from every rank's start."""
    assert len({v["initial"] for v in views}) == 4, output
    assert len({v["final"] for v in views}) == 1, output
    assert views[0]["final"] not in {v["initial"] for v in views}
    seen = [set(v["seen"]) for v in views]
    assert all(len(s) >= STEPS * BATCH for s in seen), seen
    assert len(set().union(*seen)) == sum(len(s) for s in seen), seen  # no sample on two ranks


def _assert_torch_world(views: list[dict]) -> None:
    assert {v["slurmrun"] for v in views} == {SLURMRUN}  # the workers ran the code under test
    assert [(v["node"], v["env_rank"]) for v in views] == [
        (node, rank) for rank, (node, _) in enumerate(WORLD)
    ]
    assert [v["dist_rank"] for v in views] == [0, 1, 2, 3]
    assert {v["dist_world"] for v in views} == {4}
    assert {v["dist_backend"] for v in views} == {"gloo"}
    # torchrun's OMP_NUM_THREADS=1 for two workers per node: without it Accelerate warns
    # "OMP_NUM_THREADS/MKL_NUM_THREADS unset" and sets a thread count of its own.
    assert [v["omp_warnings"] for v in views] == [[]] * 4
    assert {v["threads"] for v in views} == {1}


def _assert_hf_world(views: list[dict], output: str) -> None:
    _assert_torch_world(views)
    assert [
        (v["process_index"], v["local_process_index"], v["world_zero"], v["local_zero"])
        for v in views
    ] == [(0, 0, True, True), (1, 1, False, False), (2, 0, False, True), (3, 1, False, False)]
    assert {v["world_size"] for v in views} == {4}
    assert {v["num_processes"] for v in views} == {4}
    assert {v["parallel_mode"] for v in views} == {"ParallelMode.DISTRIBUTED"}
    assert {v["distributed_type"] for v in views} == {"DistributedType.MULTI_CPU"}
    assert {v["wrapped"] for v in views} == {"DistributedDataParallel"}
    assert {v["global_step"] for v in views} == {STEPS}
    _assert_trained_together(views, output)


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "backend",
    [pytest.param("gloo", marks=pytest.mark.quick), None],  # quick: this file's smoke test
)
def test_hf_trainer_in_launch_sees_the_launch_world(run_in_allocation, tmp_path, backend):
    """``slurmrun.launch(hf_train, workers_per_host=2)`` from a driver inside ``salloc``.

    backend="gloo": slurmrun makes the process group and Accelerate's PartialState adopts it
    (it initialises one only when none is); backend=None: PartialState makes it from
    RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, as under torchrun. Both give the same world.
    """
    out = tmp_path / "hf_launch"
    out.mkdir()
    driver = HF_TRAIN + textwrap.dedent(
        f"""
        import slurmrun
        result = slurmrun.launch(hf_train, ({str(out)!r},), workers_per_host=2,
                                 backend={backend!r}, timeout=120)
        print("RESULT " + json.dumps({{"hosts": result.hostnames, "values": result.return_values}}))
        """
    )
    cp = run_in_allocation(
        ["-N2", "--ntasks-per-node=2"],
        driver,
        timeout=120,
        env={"PYTHONPATH": PYTHONPATH, "SLURMRUN_PRELOAD": HF_PRELOAD},
    )
    output = cp.stdout + cp.stderr
    lines = [line for line in cp.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, output
    result = json.loads(lines[0][len("RESULT ") :])
    assert result["hosts"] == ["node1", "node2"]
    views = [v for host in result["values"] for v in host]
    assert views == _views(out, output)  # what launch returned is what each rank wrote
    _assert_hf_world(views, output)


# --------------------------------------------------------------------------- script mode, sbatch
# The three scripts run one after the other in one 2 x 2 batch job, each through its own
# `slurmrun script.py` line with its own log and exit status; a test per framework reads its
# part: one job start instead of three, and one wait (`_sbatch_and_poll`).
SCRIPTS = {  # name: (script, the spawner's preloads, slurmrun options)
    "hf": (HF_SCRIPT, HF_PRELOAD, ""),
    "accelerate": (ACCELERATE_SCRIPT, "torch,accelerate", ""),
    # JobEnvironment() picks the environment SUBMITIT_EXECUTOR names (submitit's own batch
    # scripts export SUBMITIT_EXECUTOR=slurm, and so does this job): SUBMITIT_* reaches the
    # workers by default (without it JobEnvironment() raises "Could not figure out which
    # environment the job is runnning in").
    "submitit": (SUBMITIT_SCRIPT, "torch,submitit", ""),
}


@dataclasses.dataclass(frozen=True)
class ScriptRun:
    returncode: int
    log: str  # the slurmrun command's output
    views: list[dict]  # rank r's view at index r; what was found if not exactly ranks 0..3


def _sbatch_and_poll(d: Path, timeout: float) -> str:
    """Submits d/job.sh and waits for its end (`wait_job`: polled); returns its id."""
    argv = ["sbatch", "--parsable", f"--job-name={JOB_NAME}", f"--time={_minutes(timeout)}"]
    out = d / "job.out"
    cp = _run([*argv, f"--output={out}", str(d / "job.sh")], timeout=30, check=True, cwd=d)
    job = cp.stdout.strip().split(";")[0]
    state = wait_job(job, timeout, out)["JobState"]
    assert state == "COMPLETED", f"job {job} {state}\n" + out.read_text()
    return job


@pytest.fixture(scope="module")
def batch_2x2(slurm_cluster, tmp_path_factory, module_turn) -> dict[str, ScriptRun]:
    """The batch job's three runs by name (submitted from the session's tmp dir: ours)."""
    d = tmp_path_factory.mktemp("frameworks_hf")
    lines = [
        "#!/bin/bash",
        "#SBATCH -N2 --ntasks-per-node=2",
        f"export PYTHONPATH={PYTHONPATH}",
        "export SUBMITIT_EXECUTOR=slurm",
    ]
    for name, (script, preload, options) in SCRIPTS.items():
        (d / f"train_{name}.py").write_text(textwrap.dedent(script))
        (d / name).mkdir()
        lines.append(
            f"SLURMRUN_PRELOAD={preload} {sys.executable} -m slurmrun {options} "
            f"{d}/train_{name}.py {d / name} > {d / name}.log 2>&1; echo $? > {d / name}.rc"
        )
    (d / "job.sh").write_text("\n".join(lines) + "\n")
    job = _sbatch_and_poll(d, timeout=150)
    runs = {}
    for name in SCRIPTS:
        rc = d / f"{name}.rc"
        log = (d / f"{name}.log").read_text() if (d / f"{name}.log").exists() else ""
        files = sorted((d / name).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        runs[name] = ScriptRun(
            returncode=int(rc.read_text()) if rc.exists() else -1,
            log=f"job {job}, {name}.log:\n{log}",
            views=[json.loads(p.read_text()) for p in files],
        )
    return runs


def _ran(run: ScriptRun) -> list[dict]:
    assert run.returncode == 0, run.log
    assert [v["env_rank"] for v in run.views] == [0, 1, 2, 3], run.log
    return run.views


def test_hf_trainer_script_under_sbatch(batch_2x2):
    """``slurmrun train.py`` with the HF Trainer in a 2 x 2 batch job: its world is the run's."""
    run = batch_2x2["hf"]
    _assert_hf_world(_ran(run), run.log)


def test_accelerate_script_under_sbatch(batch_2x2):
    """A plain ``Accelerator(cpu=True)`` loop through ``slurmrun script.py`` in a 2 x 2 job."""
    run = batch_2x2["accelerate"]
    views = _ran(run)
    _assert_torch_world(views)
    assert [
        (v["process_index"], v["local_process_index"], v["main"], v["local_main"]) for v in views
    ] == [(0, 0, True, True), (1, 1, False, False), (2, 0, False, True), (3, 1, False, False)]
    assert {v["num_processes"] for v in views} == {4}
    assert {v["distributed_type"] for v in views} == {"DistributedType.MULTI_CPU"}
    assert {v["backend"] for v in views} == {"gloo"}
    assert {v["device"].split(":")[0] for v in views} == {"cpu"}
    assert {v["wrapped"] for v in views} == {"DistributedDataParallel"}
    _assert_trained_together(views, run.log)


def test_submitit_job_environment_under_sbatch(batch_2x2):
    """``submitit.JobEnvironment()`` in a script of ``slurmrun script.py`` (2 x 2 job).

    With SUBMITIT_EXECUTOR=slurm passed on it is submitit's SlurmJobEnvironment, which reads
    SLURM_PROCID/LOCALID/NODEID/NTASKS and SLURM_JOB_NUM_NODES: slurmrun sets them per worker
    as srun would for a task of the run. With the agents' values instead (a task per node:
    SLURM_PROCID 0 on both workers of node1, SLURM_NTASKS 2, no SLURM_JOB_NUM_NODES), two
    workers claim rank 0 of a world of 2, and two of the four form that world on their own.
    """
    run = batch_2x2["submitit"]
    views = run.views
    seen = [(v["hostname"], v["global_rank"], v["local_rank"], v["node"]) for v in views]
    assert seen == [(node, rank, local, rank // 2) for rank, (node, local) in enumerate(WORLD)], (
        run.log
    )
    assert {(v["num_tasks"], v["num_nodes"]) for v in views} == {(4, 2)}, run.log
    assert {v["env_class"] for v in views} == {"SlurmJobEnvironment"}
    assert {v["slurmrun"] for v in views} == {SLURMRUN}
    assert {tuple(v["hostnames"]) for v in views} == {("node1", "node2")}
    assert [v["slurm"] for v in views] == [
        {
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(rank // 2),
            "SLURM_NTASKS": "4",
            "SLURM_JOB_NUM_NODES": "2",
        }
        for rank, (_, local) in enumerate(WORLD)
    ]
    # The gloo group made with submitit's rank and size: 1 + 2 + 3 + 4.
    assert {v.get("sum") for v in views} == {10.0}, run.log
    assert run.returncode == 0, run.log
