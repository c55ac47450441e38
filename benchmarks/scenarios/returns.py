"""Large return values: each of 2 workers returns 64 MiB / 256 MiB / 1 GiB (tensor), a dict of
100 x 1 MiB tensors and a 1 GiB numpy array: effective MiB/s and the launcher's peak memory.
"""

from __future__ import annotations

from _harness import Run, mem_available_bytes, ratio
from report import (
    GIB,
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

from .launch import first_launch, launch_cases

TORCHRUNX_MEMORY_FACTOR = 10  # torchrunx holds about 10x the returned bytes (measured, 0.4.0)


def _returns_sizes(cfg: Config) -> list[int]:
    return [64, 256] if cfg.quick else [64, 256, 1024]


def _fits(nbytes_total: int, factor: float) -> bool:
    """Whether `factor` x the bytes (plus 2 GiB) fits in 60 % of the available memory."""
    return factor * nbytes_total + 2 * GIB <= 0.6 * mem_available_bytes()


def _returns_cases(cfg: Config) -> tuple[list[Case], list[str]]:
    py = cfg.python
    limit = int(0.85 * mem_available_bytes())
    cases: list[Case] = []
    notes: list[str] = []
    for mib in _returns_sizes(cfg):
        total = 2 * mib * MIB
        if not _fits(total, 3):
            notes.append(f"{mib} MiB skipped: not enough memory for 3x {total >> 20} MiB")
            continue
        m = str(mib)
        cases.append(
            Case(
                f"floor/{m}",
                [py, script("floor.py"), "--workers", "2", "--return-mib", m],
                mem_limit=limit,
            )
        )
        cases.append(
            Case(
                f"slurmrun/{m}",
                [
                    py,
                    script("bench_launch.py"),
                    "--tool",
                    "slurmrun",
                    "returns",
                    "--kind",
                    "tensor",
                    "--mib",
                    m,
                ],
                mem_limit=limit,
            )
        )
        if cfg.torchrunx_python and not cfg.quick:
            if not _fits(total, TORCHRUNX_MEMORY_FACTOR):
                notes.append(
                    f"torchrunx skipped at {mib} MiB: it holds ~{TORCHRUNX_MEMORY_FACTOR}x the "
                    f"returned {total >> 20} MiB, more than this machine can spare"
                )
            elif mib > 64 and not cfg.slow_peers:
                notes.append(
                    f"torchrunx at {mib} MiB: only with --slow-peers (~30 s a run at 256 MiB)"
                )
            else:
                cases.append(
                    Case(
                        f"torchrunx/{m}",
                        [
                            cfg.torchrunx_python,
                            script("bench_launch.py"),
                            "--tool",
                            "torchrunx",
                            "returns",
                            "--kind",
                            "tensor",
                            "--mib",
                            m,
                        ],
                        mem_limit=limit,
                    )
                )
    cases.append(
        Case(
            "slurmrun/nested",
            [py, script("bench_launch.py"), "--tool", "slurmrun", "returns", "--kind", "nested"],
            mem_limit=limit,
        )
    )
    if not cfg.quick and _fits(2 * GIB, 3):
        cases.append(
            Case(
                "slurmrun/numpy1024",
                [
                    py,
                    script("bench_launch.py"),
                    "--tool",
                    "slurmrun",
                    "returns",
                    "--kind",
                    "numpy",
                    "--mib",
                    "1024",
                ],
                mem_limit=limit,
            )
        )
    if cfg.quick:
        notes.append("--quick: 64 and 256 MiB only, no torchrunx, no numpy 1 GiB")
    return cases, notes


def _launch_time(run: Run) -> float:
    v = run.data["launch_s"]
    return float(v[0] if isinstance(v, list) else v)


def measure(cfg: Config, report: Report) -> None:
    """Large return values: effective throughput and launcher memory."""
    print("== returns: large return values, 2 workers", flush=True)
    cases, notes = _returns_cases(cfg)
    trivial: dict[str, dict[str, float | None]] = dict(
        report.data.get("launch", {}).get("medians", {})
    )
    # The trivial launch that "effective" subtracts is measured in the same rounds (load on a
    # shared machine drifts); --quick, and torchrunx (~10 s a run), reuse the launch scenario's.
    in_rounds = {"floor", "slurmrun"} if not cfg.quick else set()
    in_rounds |= {"floor", "slurmrun", "torchrunx"} - set(trivial)
    tools = {c.key.split("/")[0] for c in cases}
    base_cases = [
        c for c in launch_cases(cfg, 2, 1, True) if c.key.split("/")[0] in tools & in_rounds
    ]
    runs = run_rounds(cfg, base_cases + cases)
    for c in base_cases:
        trivial[c.key.split("/")[0]] = {"launch": med(runs.pop(c.key), first_launch)}
    measured_here = {c.key.split("/")[0] for c in base_cases}
    notes.append(
        "trivial launch subtracted for 'effective': "
        + ", ".join(
            f"{t} {fmt(trivial.get(t, {}).get('launch'))} "
            + ("(these rounds)" if t in measured_here else "(launch table)")
            for t in sorted(tools)
        )
    )
    table = Table(
        "Large returns: 2 workers each return the value (medians)",
        [
            "tool / value",
            "bytes returned",
            "launch call",
            "MiB/s plain",
            "MiB/s effective",
            "MiB/s after created",
            "launcher peak RSS - before",
            "÷ bytes",
            "process-tree peak RSS",
            "slurmrun/floor time",
        ],
    )
    stats: dict[str, dict[str, float | None]] = {}
    for key, rs in runs.items():
        tool, what = key.split("/")
        nbytes = med(rs, lambda r: r.data["bytes_returned"])
        launch = med(rs, _launch_time)
        base = trivial.get(tool, {}).get("launch")
        mem = med(rs, lambda r: r.data["peak_rss"] - r.data["rss_before"])
        s = {
            "bytes": nbytes,
            "launch": launch,
            "plain": None if not (nbytes and launch) else nbytes / MIB / launch,
            "effective": (
                None
                if not (nbytes and launch and base) or launch <= base
                else nbytes / MIB / (launch - base)
            ),
            "below_noise": float(bool(nbytes and launch and base and launch <= base)),
            "mem_delta": mem,
            "mem_ratio": ratio(mem, nbytes),
            "tree_peak": med(rs, lambda r: float(r.tree_peak_rss)),
        }
        after = med(rs, lambda r: r.data.get("after_created_s"))
        s["after_created"] = None if not (nbytes and after) else nbytes / MIB / after
        stats[key] = s
        floor_key = f"floor/{what}"
        vs_floor = (
            ratio(launch, stats[floor_key]["launch"])
            if tool != "floor" and floor_key in stats
            else None
        )
        table.rows.append(
            [
                f"{tool} / {_what_label(what)}",
                fmt(None if nbytes is None else nbytes / MIB, "MiB", 0),
                fmt(launch),
                fmt(s["plain"], "", 0),
                "n/m" if s["below_noise"] else fmt(s["effective"], "", 0),
                fmt(s["after_created"], "", 0),
                fmt(None if mem is None else mem / MIB, "MiB", 0),
                fmt_ratio(s["mem_ratio"]),
                fmt(None if s["tree_peak"] is None else s["tree_peak"] / MIB, "MiB", 0),
                fmt_ratio(vs_floor),
            ]
        )
    table.notes += [
        "effective = bytes / (launch call - the same tool's trivial launch call in this run); "
        "plain = bytes / launch call. Both include the workers creating the values. "
        "after created = bytes / (launch call returned - the last worker's value was created): "
        "the transfer alone (pickling, relays, receiving, unpickling, and the launch's end). "
        "n/m: not measurable, the launch with the value was no slower than the trivial one "
        "(the machine's noise exceeds the transfer time).",
        "launcher peak RSS - before: ru_maxrss of the launcher process minus its RSS just "
        "before the launch (after importing torch); 1.0x is the minimum (it holds the results).",
        "floor = 2 fresh processes that send the raw tensor bytes to the parent over loopback "
        "TCP (one connection each, received in parallel).",
        *notes,
    ]
    report.tables.append(table)
    report.data["returns"] = {"runs": raw(runs), "stats": stats}
    _returns_targets(stats, report)


def _what_label(what: str) -> str:
    if what == "nested":
        return "dict of 100 x 1 MiB tensors"
    if what.startswith("numpy"):
        return f"numpy {what[5:]} MiB"
    return f"tensor {what} MiB"


def _returns_targets(stats: dict[str, dict[str, float | None]], report: Report) -> None:
    tensor = {k: s for k, s in stats.items() if k.startswith("slurmrun/") and k[9:].isdigit()}
    effs = {k: s["effective"] for k, s in tensor.items()}
    worst = min((v for v in effs.values() if v is not None), default=None)
    detail = ", ".join(
        f"{k[9:]} MiB: {'n/m' if tensor[k]['below_noise'] else fmt(v, '', 0)} "
        f"(after created {fmt(tensor[k]['after_created'], '', 0)})"
        for k, v in effs.items()
    )
    report.targets.append(
        Target(
            "tensor returns >= 1 GiB/s effective (1024 MiB/s)",
            detail,
            ">= 1024 MiB/s each",
            None if worst is None else worst >= 1024,
        )
    )
    mem = {k: s["mem_ratio"] for k, s in stats.items() if k.startswith("slurmrun/")}
    worst_mem = max((v for v in mem.values() if v is not None), default=None)
    detail = ", ".join(f"{k[9:]}: {fmt_ratio(v)}" for k, v in mem.items())
    report.targets.append(
        Target(
            "launcher peak memory <= 1.2x bytes returned",
            detail,
            "<= 1.20x each",
            None if worst_mem is None else worst_mem <= 1.2,
        )
    )
