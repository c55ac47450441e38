"""Scale (simulated): a real launcher-side Session against 1..4096 fake agents x 8 workers
(benchmarks/scale.py).
"""

from __future__ import annotations

from _harness import ratio
from report import (
    MIB,
    Case,
    Config,
    Report,
    Table,
    Target,
    fmt,
    fmt_ratio,
    med,
    raw,
    run_rounds,
    script,
)

CHATTER_S = 2.0  # seconds of simulated output before the results (scale.py --chatter)


def measure(cfg: Config, report: Report) -> None:
    """Simulated agents against a real Session."""
    print("== scale: simulated agents x 8 workers against a real Session", flush=True)
    counts = [64, 1024, 4096] if cfg.quick else [1, 64, 256, 1024, 4096]
    log_counts = [64, 1024, 4096] if cfg.quick else [64, 256, 1024, 4096]
    cases = [
        Case(f"scale/{n}", [cfg.python, script("scale.py"), "--agents", str(n)]) for n in counts
    ]
    # The agents write their workers' files (srun agents do, on the shared filesystem): on a
    # cluster each node creates its own 8, here 2 processes of fake agents create all 32,768
    # in one directory on the launcher's 2 cores (~5 s). The launcher's share is measured with
    # the agents counting the lines instead (--no-agent-files); the "+files" rows have them
    # write, for the lines.
    no_files = ["--no-agent-files"]
    chatter_args = ["--chatter", str(CHATTER_S), *no_files]
    cases += [
        Case(
            f"scale+logs/{n}",
            [cfg.python, script("scale.py"), "--agents", str(n), "--logs", *no_files],
            cap_s=600.0,
        )
        for n in log_counts
    ]
    chatter = [
        Case(
            f"scale+chatter/{n}",
            [cfg.python, script("scale.py"), "--agents", str(n), *chatter_args],
            cap_s=600.0,
        )
        for n in (256, 1024, 4096)
    ]
    with_files = [
        Case(
            f"scale+logs+files/{n}",
            [cfg.python, script("scale.py"), "--agents", str(n), "--logs"],
            cap_s=600.0,
        )
        for n in (1024, 4096)
    ] + [
        Case(
            "scale+chatter+files/4096",
            [cfg.python, script("scale.py"), "--agents", "4096", "--chatter", str(CHATTER_S)],
            cap_s=600.0,
        )
    ]
    runs = run_rounds(cfg, [*cases, *chatter[:2]])
    # 32,768 ranks writing take long on the 2-core reference machine: one round
    runs.update(run_rounds(cfg, [*chatter[2:], *with_files], rounds=1))
    table = Table(
        "Scale (simulated): N agents x 8 workers against a real launcher Session (medians)",
        [
            "agents x workers",
            "logs",
            "connect wall",
            "hand-out+gather wall",
            "hand-out+gather CPU",
            "launch wall (all)",
            "launcher CPU (all)",
            "memory Δ",
            "per agent",
            "agents that retried connect: max (runs)",
            "log lines lost",
            "ok",
        ],
    )
    stats: dict[str, dict[str, float | None]] = {}
    for key, rs in runs.items():
        n = int(key.split("/")[1])
        s = {
            "agents": float(n),
            "connect": med(rs, lambda r: r.data["connect_wall_s"]),
            "hg_wall": med(rs, lambda r: r.data["handout_gather_wall_s"]),
            "hg_cpu": med(rs, lambda r: r.data["handout_gather_cpu_s"]),
            "total_wall": med(rs, lambda r: r.data["total_wall_s"]),
            "total_cpu": med(rs, lambda r: r.data["total_cpu_s"]),
            "mem": med(rs, lambda r: r.data["mem_delta"]),
            "connect_hg": med(
                rs, lambda r: r.data["connect_wall_s"] + r.data["handout_gather_wall_s"]
            ),
            "dropped": max(
                (float(r.data.get("retried_agents") or 0) for r in rs if r.data), default=None
            ),
            "runs_with_drops": float(sum(1 for r in rs if r.data.get("retried_agents"))),
            "lost": max(
                (
                    float(r.data.get("log_lines_expected", 0) - r.data.get("log_lines", 0))
                    for r in rs
                    if r.data
                ),
                default=None,
            ),
            "failed_runs": float(sum(1 for r in rs if not r.data.get("ok"))),
        }
        stats[key] = s
        oks = sum(1 for r in rs if r.data.get("ok"))
        errors = {
            f"{r.data.get('error', '')} ({r.data.get('fake_agent_failures')} fake agents saw: "
            f"{r.data.get('fake_agent_failure_example') or 'nothing'})"
            for r in rs
            if r.data and not r.data.get("ok")
        }
        mem = s["mem"]
        table.rows.append(
            [
                f"{n} x 8",
                key.split("/")[0].removeprefix("scale").removeprefix("+").replace("+", ", ")
                or "no",
                fmt(s["connect"]),
                fmt(s["hg_wall"], "s", 3),
                fmt(s["hg_cpu"], "s", 3),
                fmt(s["total_wall"]),
                fmt(s["total_cpu"]),
                fmt(None if mem is None else mem / MIB, "MiB", 1),
                fmt(None if mem is None else mem / 1024 / n, "KiB", 0),
                f"{fmt(s['dropped'], '', 0)} ({int(s['runs_with_drops'] or 0)}/{len(rs)})",
                fmt(s["lost"], "", 0),
                f"{oks}/{len(rs)}",
            ]
        )
        for e in sorted(errors):
            table.notes.append(f"{key}: a run failed: {e}")
    table.notes += [
        "Fake agents run in 2 separate processes, each one event loop for all of its agents "
        "(their CPU is not counted, but they share the 2 cores with the launcher). CPU = "
        "time.process_time() of the launcher process (all its threads). hand-out+gather = "
        "from the first start frame to the results unpickled. launch wall/CPU = the whole "
        "Session.run (connect, handshakes, hand-out, gather, stop).",
        "logs: each worker prints one line and the run uses its default log handlers, as a "
        "real launch does: agents write their workers' files and send the launcher rank 0's "
        "lines. Without 'files' the fake agents count the lines they would write (on a "
        "cluster each node creates its own files; here 2 processes create all of them, in "
        "one directory, on the launcher's 2 cores); with 'files' they write them. chatter: for "
        f"{CHATTER_S:g} s before its result rank 0 prints a progress-bar state every 10 ms "
        "and every other worker a line a second (hand-out+gather includes those seconds).",
        "agents that retried connect: fake agents connect with the real agent's bounded, "
        "jittered backoff (slurmrun.node.agent_connect.Backoff); most in one run, and runs "
        "with any. log lines lost: expected lines minus lines found in the files (or "
        "counted by the agents).",
    ]
    report.tables.append(table)
    report.data["scale"] = {"runs": raw(runs), "stats": stats}
    _scale_targets(stats, report)


def _scale_targets(stats: dict[str, dict[str, float | None]], report: Report) -> None:
    big = stats.get("scale+logs/4096", {})
    total = big.get("connect_hg")
    report.targets.append(
        Target(
            "4096x8 with a log line per worker: connect + hand-out + gather <= 3 s",
            fmt(total, "s", 2),
            "<= 3.00 s",
            None if total is None else total <= 3.0,
        )
    )
    for what, key in (("CPU", "total_cpu"), ("memory", "mem")):
        small, large = stats.get("scale+logs/64", {}).get(key), big.get(key)
        growth = ratio(large, small)
        report.targets.append(
            Target(
                f"with logs: launcher {what} linear in agents (64 -> 4096)",
                f"{fmt_ratio(growth)} for 64x agents",
                "<= 80x (linear, 25 % slack)",
                None if growth is None else growth <= 80,
            )
        )
    failed = sum(int(s.get("failed_runs") or 0) for k, s in stats.items() if "4096" in k)
    report.targets.append(
        Target(
            "4096 agents connect (backoff on a full backlog): every run ok",
            f"{failed} failed runs",
            "0",
            failed == 0,
        )
    )
    chatter = stats.get("scale+chatter/4096", {})
    hg = chatter.get("hg_wall")
    lost = stats.get("scale+chatter+files/4096", chatter).get("lost")
    report.targets.append(
        Target(
            "tqdm at 100/s on rank 0 + a line/s from 32,767 ranks: no line lost",
            fmt(lost, "", 0),
            "0",
            None if lost is None else lost == 0,
        )
    )
    quiet = big.get("hg_wall")
    report.targets.append(
        Target(
            "... and it does not slow the launch: hand-out+gather - chatter time <= 1.5x quiet",
            fmt(None if hg is None else hg - CHATTER_S, "s", 2) + f" vs {fmt(quiet, 's', 2)}",
            "<= 1.5x",
            None if hg is None or quiet is None else hg - CHATTER_S <= 1.5 * quiet,
        )
    )
