"""Stragglers and hangs on the 3-node test cluster: a slow node named, a hang failed and restarted.

The launcher runs under ``salloc -N3`` with one gloo worker per node; its events come back as
JSON lines on stdout.
"""

from __future__ import annotations

import json
import subprocess

import pytest

SCRIPT = """
import json, os, pathlib, time
import slurmrun

def steps(slow_rank, hang_rank, seconds, stop):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    restarted = int(os.environ["SLURMRUN_RESTART_COUNT"]) > 0
    end = time.monotonic() + seconds
    step = 0
    while True:
        time.sleep(0.13 if rank == slow_rank else 0.1)  # rank `slow_rank` is 30% slower
        if rank == hang_rank and step == 10 and not restarted:
            time.sleep(3600)  # stuck outside the collective
        over = rank == 0 and (time.monotonic() > end or pathlib.Path(stop).exists())
        flag = torch.tensor([1.0 if over else 0.0])
        dist.all_reduce(flag)
        step += 1
        if flag.item() > 0:
            return step

def on_event(event):
    if event.kind in ("straggler", "restarting", "workers_started"):
        print("EVENT " + json.dumps(event.as_dict()), flush=True)
    if event.kind == "straggler":
        pathlib.Path("stop").touch()

slow, hang, seconds = ARGS
result = slurmrun.launch(
    steps, (slow, hang, seconds, "stop"), backend="gloo", timeout=60, on_event=on_event,
    hang_timeout=4.0, max_restarts=1, stragglers=True,
)
print("RESULT " + json.dumps(result.return_values), flush=True)
"""


def _events(cp: subprocess.CompletedProcess[str]) -> list[dict]:
    assert cp.returncode == 0, f"--- stdout\n{cp.stdout}\n--- stderr\n{cp.stderr}"
    return [json.loads(line[6:]) for line in cp.stdout.splitlines() if line.startswith("EVENT ")]


def _run(
    run_in_allocation, slow: int, hang: int, seconds: float
) -> subprocess.CompletedProcess[str]:
    script = SCRIPT.replace("ARGS", f"{slow}, {hang}, {seconds}")
    return run_in_allocation(["-N3"], script, timeout=120)


@pytest.mark.quick  # the smoke test of this file in `tests/run.sh --quick`
def test_a_rank_30_percent_slower_on_node3_is_named_within_20_s(run_in_allocation) -> None:
    events = _events(_run(run_in_allocation, slow=2, hang=-1, seconds=40.0))
    started = max(e["time"] for e in events if e["kind"] == "workers_started")
    found = [e for e in events if e["kind"] == "straggler"]
    assert found, events
    assert found[0]["rank"] == 2 and found[0]["host"] == "node3", found[0]
    assert found[0]["time"] - started < 20.0, found[0]["time"] - started
    assert found[0]["hot_frames"][0].startswith("steps ("), found[0]
    print(f"straggler named {found[0]['time'] - started:.1f} s after the workers started")


def test_a_rank_stuck_on_node2_fails_with_hang_error_and_is_restarted(run_in_allocation) -> None:
    events = _events(_run(run_in_allocation, slow=-1, hang=1, seconds=3.0))
    assert [e["error"] for e in events if e["kind"] == "restarting"] == ["HangError"]
    assert not [e for e in events if e["kind"] == "straggler"]


GPU_CHECK = """
import slurmrun

def gpus():
    import os
    return os.environ.get("CUDA_VISIBLE_DEVICES")

print("AUTO", slurmrun.launch(gpus, backend=None, workers_per_host=1).return_values)
try:
    slurmrun.launch(gpus, backend=None, workers_per_host=1, gpu_check="on")
except slurmrun.NodeUnhealthyError as e:
    print("UNHEALTHY", e.hostname, str(e).splitlines()[0])
"""


def test_gpu_check_on_the_fake_gpus_of_gres_names_the_node_and_the_missing_driver(
    run_in_allocation,
) -> None:
    # One node: when every node fails at once, the step's end can reach the launcher before
    # the reason (AgentFailedError, not NodeUnhealthyError): a race of its own.
    cp = run_in_allocation(["-N1", "--gres=gpu:2"], GPU_CHECK, timeout=90)
    out = cp.stdout
    assert "AUTO [['0,1']]" in out, out  # "auto": no driver on these nodes, no check
    (line,) = [x for x in out.splitlines() if x.startswith("UNHEALTHY ")]
    assert line.startswith("UNHEALTHY node"), line
    assert "failed its health check: GPU check: CUDA_VISIBLE_DEVICES=0,1 gives 2 GPU(s)" in line
    assert "but this node has no NVIDIA driver" in line, line
