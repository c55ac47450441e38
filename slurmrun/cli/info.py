"""``slurmrun info [--json]``: what slurmrun detects, and what `launch()` with defaults would do.

Starts nothing: it reads the environment, asks ``scontrol`` (with a time limit) where the
environment does not tell, and plans a launch with `Launcher.dry_run`'s planning steps. With
``--job JOB_ID`` it plans a launch on that reservation's agents (`slurmrun.reserve`), and says
how the launcher would reach them (straight to the keeper's port, which it knocks on, or
through ``srun --overlap``) and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import hostlist

from slurmrun import launcher
from slurmrun.cli.command import SHELL_WORDS
from slurmrun.devices import usable_cpu_count, visible_gpu_count
from slurmrun.launcher.agents.containers import driver_container
from slurmrun.launcher.dryrun import DryRun, plan_dry_run
from slurmrun.launcher.plan import make_plan
from slurmrun.slurm.cluster import slurm_version
from slurmrun.slurm.job import SlurmAllocation, own_job_id, slurm_allocation
from slurmrun.slurm.job_end import job_end
from slurmrun.slurm.scontrol import SCONTROL_SOURCE, scontrol, scontrol_gpus

__all__ = ["gather", "main", "render"]

_NO_JOB = "not inside a SLURM job (neither SLURM_JOB_ID nor SLURM_JOBID is set)"


def gather(cfg: launcher.Launcher | None = None) -> dict[str, Any]:
    """Everything ``slurmrun info`` shows, as plain data (what ``--json`` prints).

    Args:
        cfg: the options of the launch to plan (``--srun-args``, ``--agent-prefix``...);
            None: ``Launcher()``.

    Returns:
        ``{"slurm": ..., "this_process": ..., "launch": ..., "warnings": [...]}``: ``slurm`` is
        None outside a job; ``launch`` is `DryRun.as_dict` of ``Launcher()``, or None when no
        launch could be planned (the warnings say why).
    """
    warnings: list[str] = []
    try:
        alloc = slurm_allocation()
    except ValueError as e:
        alloc = None
        warnings.append(f"the SLURM job's variables cannot be read, launch() would fail: {e}")
    slurm = _slurm_section(alloc, warnings) if alloc is not None else None
    here = _this_process(alloc)
    plan = _launch_section(cfg or launcher.Launcher(), warnings)
    if alloc is not None and plan is not None:
        _check_gpus(alloc, slurm, here, plan, warnings)
    return {"slurm": slurm, "this_process": here, "launch": plan, "warnings": warnings}


def _slurm_section(alloc: SlurmAllocation, warnings: list[str]) -> dict[str, Any]:
    sources = dict(alloc.sources)
    gpus = alloc.gpus_per_node
    if gpus is None:
        # The agents' step asks scontrol too (make_plan: job_gpus_per_node).
        per_host = scontrol_gpus(alloc.job_id)
        if per_host is not None and all(h in per_host for h in alloc.hostnames):
            gpus = [per_host[h] for h in alloc.hostnames]
            sources["gpus_per_node"] = SCONTROL_SOURCE
    raw = os.environ.get(sources["hostnames"], "")
    ask = _asked_once(scontrol)  # `scontrol show config`: for the version and the job's end
    step = alloc.driver_step
    if step is not None and step.num_tasks > 1:
        warnings.append(
            f"this runs in step {step.step_id} of {step.num_tasks} tasks: launch() refuses to "
            "start from it, since every task would launch on every node. Start the script "
            "once (in the salloc shell or the batch script, or `srun -N1 -n1 python ...`)."
        )
    return {
        "job_id": alloc.job_id,
        "step": None
        if step is None
        else {"step_id": step.step_id, "num_tasks": step.num_tasks, "proc_id": step.proc_id},
        "nodelist": raw or hostlist.collect_hostlist(alloc.hostnames),
        "hostnames": list(alloc.hostnames),
        "nodes": [
            {
                "hostname": host,
                "cpus": alloc.cpus_per_node[i],
                "gpus": None if gpus is None else gpus[i],
                "tasks": None if alloc.tasks_per_node is None else alloc.tasks_per_node[i],
            }
            for i, host in enumerate(alloc.hostnames)
        ],
        "sources": sources,
        "version": slurm_version(ask),
        "ending": _ending(alloc, ask),
    }


def _asked_once(
    scontrol: Callable[[Sequence[str]], str | None],
) -> Callable[[Sequence[str]], str | None]:
    """`scontrol`, whose answer to the same arguments is asked once and kept."""
    answers: dict[tuple[str, ...], str | None] = {}

    def ask(args: Sequence[str]) -> str | None:
        key = tuple(args)
        if key not in answers:
            answers[key] = scontrol(args)
        return answers[key]

    return ask


def _ending(
    alloc: SlurmAllocation, scontrol: Callable[[Sequence[str]], str | None]
) -> dict[str, Any] | None:
    end = job_end(own_job_id() or alloc.job_id, scontrol)
    return None if end is None else {**dataclasses.asdict(end), "preemptible": end.preemptible}


def _this_process(alloc: SlurmAllocation | None) -> dict[str, Any]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    in_job = False
    if alloc is not None:
        try:
            alloc.node_index(host)
            in_job = True
        except ValueError:
            pass
    return {
        "hostname": host,
        "node_of_the_job": in_job,
        "gpus": visible_gpu_count(),
        "gpus_source": "/dev/nvidia*" if visible is None else "CUDA_VISIBLE_DEVICES",
        "cpus": usable_cpu_count(),
        "container": driver_container(os.environ),
    }


def _launch_section(cfg: launcher.Launcher, warnings: list[str]) -> dict[str, Any] | None:
    try:
        try:
            plan = make_plan(cfg, wait=False)  # a reservation still starting: said, not awaited
        except RuntimeError:
            # A step of several tasks: _slurm_section said so. Show what one task would do.
            plan = make_plan(cfg, check_driver_step=False, wait=False)
        return plan_dry_run(cfg, plan).as_dict()
    except (RuntimeError, ValueError, OSError) as e:
        what = "does not resolve" if "resolve" in str(e) else "cannot be planned"
        warnings.append(f"launch() would fail: the launch {what}: {e}")
        return None


def _check_gpus(
    alloc: SlurmAllocation,
    slurm: dict[str, Any] | None,
    here: dict[str, Any],
    plan: dict[str, Any],
    warnings: list[str],
) -> None:
    """Warns where workers would see fewer GPUs than the job has."""
    if plan["agents"] != "srun" or slurm is None:
        return
    step_gpus = 0
    for arg in plan["commands"][0]:
        if arg.startswith("--gres=gpu:"):
            step_gpus = int(arg.rsplit(":", 1)[1])
    job_gpus = {n["hostname"]: n["gpus"] for n in slurm["nodes"] if n["gpus"] is not None}
    if here["node_of_the_job"] and here["gpus"] and here["hostname"] not in job_gpus:
        job_gpus[here["hostname"]] = here["gpus"]
    short = {h: g for h, g in job_gpus.items() if g > step_gpus}
    if not short:
        return
    listed = ", ".join(f"{h}: {g}" for h, g in short.items())
    if step_gpus == 0:
        warnings.append(
            f"the job has GPUs ({listed}) but the agents' step would ask for none, so workers "
            "would see no GPU (and use gloo): slurmrun could not tell the GPUs per node from "
            "SLURM's variables or scontrol. Pass workers_per_host, or ask for GPUs per node "
            "(--gpus-per-node)."
        )
    else:
        warnings.append(
            f"nodes have different GPU counts ({listed}); the agents' step can only ask for "
            f"{step_gpus} on every node, so the others' extra GPUs stay unused"
        )


def render(info: dict[str, Any]) -> str:
    """The text ``slurmrun info`` prints, from `gather`'s data."""
    lines = ["slurmrun info"]
    slurm = info["slurm"]
    if slurm is None:
        lines.append(f"  SLURM:            {_NO_JOB}: launch() runs on this machine")
    else:
        sources = slurm["sources"]
        lines.append(f"  SLURM job:        {slurm['job_id']} (from {sources['job_id']})")
        version = slurm.get("version")
        lines.append(
            f"  SLURM version:    {version} (scontrol show config: SLURM_VERSION)"
            if version
            else "  SLURM version:    unknown (scontrol show config did not answer)"
        )
        step = slurm["step"]
        lines.append(
            "  step:             "
            + (
                "none: the job's own shell (salloc or the batch script)"
                if step is None
                else f"{step['step_id']}, {step['num_tasks']} task(s), this is task "
                f"{step['proc_id']} (from {sources['driver_step']})"
            )
        )
        lines.append(
            f"  nodes:            {slurm['nodelist']} (from {sources['hostnames']}) = "
            f"{', '.join(slurm['hostnames'])}"
        )
        width = max(len("node"), *(len(h) for h in slurm["hostnames"]))
        lines.append(f"    {'node':<{width}}  {'CPUs':>5}  {'GPUs':>5}  {'tasks':>5}")
        for node in slurm["nodes"]:
            cells = [_cell(node[k]) for k in ("cpus", "gpus", "tasks")]
            lines.append(f"    {node['hostname']:<{width}}  " + "  ".join(f"{c:>5}" for c in cells))
        for key, label in (("cpus_per_node", "CPUs"), ("gpus_per_node", "GPUs")):
            lines.append(f"    {label} from {sources.get(key, _UNKNOWN[key])}")
        lines.append(f"    tasks from {sources.get('tasks_per_node', _UNKNOWN['tasks_per_node'])}")
        if slurm.get("ending") is not None:
            lines += _ending_lines(slurm["ending"])
    here = info["this_process"]
    lines.append(
        f"  this process:     on {here['hostname']}, sees {here['gpus']} GPU(s) (from "
        f"{here['gpus_source']}), may use {here['cpus']} CPU(s)"
        + (f", inside a container ({here['container']})" if here.get("container") else "")
    )
    plan = info["launch"]
    if plan is not None:
        given = info.get("options")
        lines.append(f"what launch() with {'these options' if given else 'defaults'} would do:")
        lines += DryRun(**_dry_run_fields(plan)).lines()[1:]
    if info["warnings"]:
        lines.append("warnings:")
        lines += [f"  - {w}" for w in info["warnings"]]
    else:
        lines.append("warnings: none")
    return "\n".join(lines)


def _ending_lines(end: dict[str, Any]) -> list[str]:
    """When SLURM ends the job, and how long its SIGTERM leaves the workers to checkpoint."""

    def seconds(value: int | None) -> str:
        return "?" if value is None else f"{value}"

    kill = f"SIGKILL {seconds(end['kill_wait'])} s later (KillWait)"
    ends = f", ends {end['end_time']}" if end["end_time"] else ""
    lines = [f"  time limit:       {end['time_limit']}{ends}; then SIGTERM, and {kill}"]
    where = f"{end['preempt_mode']} (partition {end['partition']})"
    if not end["preemptible"]:
        mode = end["preempt_mode"] or "unknown"
        lines.append(f"  preemption:       none ({mode}, {end['preempt_type'] or '?'})")
    elif (end["preempt_type"] or "").endswith("/qos"):
        lines.append(f"  preemption:       {where}; the job's QOS sets its GraceTime")
    elif end["grace_time"] == 0:
        lines.append(f"  preemption:       {where}, GraceTime 0: ended at once")
    else:
        lines.append(
            f"  preemption:       {where}; then SIGTERM, again {seconds(end['grace_time'])} s "
            f"later (GraceTime), and {kill}"
        )
    lines.append("    workers get SLURM's SIGTERM themselves, and all of that time to checkpoint")
    return lines


_UNKNOWN = {
    "cpus_per_node": "?",
    "gpus_per_node": "nowhere: no variable tells and scontrol did not answer; each agent "
    "counts the GPUs its step sees",
    "tasks_per_node": "nowhere (no variable tells, scontrol did not answer): 1 per node",
}


def _cell(value: int | None) -> str:
    return "?" if value is None else str(value)


def _dry_run_fields(plan: dict[str, Any]) -> dict[str, Any]:
    fields = {k: v for k, v in plan.items() if k not in ("world_size", "expected_world_size")}
    for key in ("hosts", "workers_per_host", "expected_workers", "env_names", "warnings"):
        if fields[key] is not None:
            fields[key] = tuple(fields[key])
    fields["commands"] = tuple(tuple(c) for c in fields["commands"])
    fields["env_shown"] = tuple((name, value) for name, value in fields.get("env_shown", ()))
    fields["worker_env"] = tuple((name, value) for name, value in fields.get("worker_env", ()))
    fields["worker_unset"] = tuple(fields.get("worker_unset", ()))
    return fields


def _joined(argv: list[str]) -> list[str]:
    """``--srun-args '--x=1'`` as ``--srun-args=--x=1``: argparse takes a value like an option."""
    out: list[str] = []
    words = iter(argv)
    for arg in words:
        joined = f"{arg}={next(words, '')}" if arg in SHELL_WORDS else arg
        out.append(joined)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``slurmrun info [--json]``; returns the exit status (0; 2 for bad arguments).

    Args:
        argv: the arguments after ``info``; None: ``sys.argv[1:]``.
    """
    parser = argparse.ArgumentParser(
        prog="slurmrun info",
        description="Show what slurmrun detects in this SLURM job (or on this machine) and "
        "what launch() with default options would start. Starts nothing.",
    )
    parser.add_argument("--json", action="store_true", help="print the same as JSON")
    helps = {
        "srun_args": "options added to the agents' srun line, one quoted string",
        "agent_prefix": "the command agents run under (a container), one quoted string",
    }
    for name, field_name in SHELL_WORDS.items():
        parser.add_argument(name, default="", metavar="'WORDS'", help=helps[field_name])
    parser.add_argument("--agent-python", default=None, help="the agents' interpreter")
    parser.add_argument(
        "--job",
        default=None,
        metavar="JOB_ID",
        help="plan a launch on this reservation's agents (slurmrun reserve), and say how "
        "they would be reached: straight to its keeper's port, or through srun --overlap",
    )
    args = parser.parse_args(_joined(list(sys.argv[1:] if argv is None else argv)))
    try:
        cfg = launcher.Launcher(
            srun_args=tuple(shlex.split(args.srun_args)),
            agent_prefix=tuple(shlex.split(args.agent_prefix)),
            agent_python=args.agent_python,
            job=args.job,
        )
        info = gather(cfg)
        if cfg != launcher.Launcher():
            info["options"] = {k: v for k, v in vars(args).items() if k != "json" and v}
    except (TypeError, ValueError) as e:  # options refused before anything is planned
        print(f"slurmrun info: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(info, indent=2) if args.json else render(info)
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
