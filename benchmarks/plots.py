"""Plots of a benchmark run (called by run.py --plots DIR, or on a saved JSON file).

    python benchmarks/plots.py results.json docs/

Writes ``bench_launch.png`` (launch call vs workers on localhost; simulated scale series)
and ``bench_returns.png`` (return throughput and launcher memory vs size).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

MIB = 1 << 20
STYLE: dict[str, dict[str, Any]] = {
    "slurmrun": {"color": "tab:blue", "marker": "o"},
    "floor": {"color": "tab:gray", "marker": "s"},
    "torchrun": {"color": "tab:green", "marker": "^"},
    "torchrunx": {"color": "tab:red", "marker": "D"},
    "slurmrun-warm": {"color": "tab:cyan", "marker": "*", "markersize": 10},  # its 1st run
}


def _launch_panel(ax: Axes, data: dict[str, Any]) -> None:
    series: dict[str, dict[Any, Any]] = data.get("launch_sweep", {}).get("series", {})
    if not series:
        series = {t: {2: m["launch"]} for t, m in data.get("launch", {}).get("medians", {}).items()}
    for tool, points in series.items():
        xs = sorted((int(w), v) for w, v in points.items() if v is not None)
        if xs:
            ax.plot([x for x, _ in xs], [v for _, v in xs], label=tool, **STYLE.get(tool, {}))
    ax.set_xticks([1, 2, 4])
    ax.set_xlabel("workers on localhost (2 CPU cores)")
    ax.set_ylabel("launch call, median (s)")
    ax.set_title("Trivial launch (one all_reduce) vs workers")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()


def _scale_panel(ax: Axes, data: dict[str, Any]) -> None:
    stats: dict[str, dict[str, Any]] = data.get("scale", {}).get("stats", {})
    anchor: tuple[int, float] | None = None
    for prefix, what, color in (
        ("scale/", "", "tab:blue"),
        ("scale+logs/", ", 1 log line/worker", "tab:orange"),
    ):
        pts = sorted(
            (int(k.split("/")[1]), s["hg_wall"], s["hg_cpu"])
            for k, s in stats.items()
            if k.startswith(prefix) and s.get("hg_wall")
        )
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], color=color, marker="o", label=f"wall{what}")
        ax.plot(
            xs,
            [p[2] for p in pts],
            color=color,
            marker="x",
            linestyle="--",
            label=f"launcher CPU{what}",
        )
        if anchor is None:
            anchor = next(((x, w) for x, w, _ in pts if x >= 64), None)
    if anchor is not None:
        xs = [1, 4096]
        ax.plot(
            xs,
            [anchor[1] * x / anchor[0] for x in xs],
            color="gray",
            linewidth=0.8,
            linestyle=":",
            label="linear (through 64 agents)",
        )
    big = stats.get("scale+logs/4096", {}).get("connect_hg")
    if big:
        ax.plot(
            [4096],
            [big],
            color="tab:orange",
            marker="D",
            linestyle="none",
            label="connect + hand-out + gather, 1 log line/worker",
        )
    ax.plot([1024], [2.0], color="tab:red", marker="_", markersize=14, linestyle="none")
    ax.plot([4096], [3.0], color="tab:red", marker="_", markersize=14, linestyle="none")
    ax.plot(
        [], [], color="tab:red", marker="_", linestyle="none", label="targets: 1024: 2 s, 4096: 3 s"
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 64, 256, 1024, 4096], ["1", "64", "256", "1024", "4096"])
    ax.set_xlabel("simulated agents (x 8 workers each)")
    ax.set_ylabel("hand-out + gather, median (s)")
    ax.set_title("Simulated scale: real launcher Session, fake agents")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _returns_points(
    stats: dict[str, dict[str, Any]], tool: str, field: str
) -> list[tuple[float, float]]:
    pts = []
    for key, s in stats.items():
        t, what = key.split("/")
        if t == tool and what.isdigit() and s.get(field) is not None:
            pts.append((int(what), float(s[field])))
    return sorted(pts)


def _returns_panels(ax_rate: Axes, ax_mem: Axes, data: dict[str, Any]) -> None:
    stats: dict[str, dict[str, Any]] = data.get("returns", {}).get("stats", {})
    for tool in ("slurmrun", "floor", "torchrunx"):
        for field, style in (("effective", "-"), ("after_created", "--")):
            pts = _returns_points(stats, tool, field)
            if pts:
                ax_rate.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    linestyle=style,
                    label=f"{tool} ({field.replace('_', ' ')})",
                    **STYLE[tool],
                )
        pts = _returns_points(stats, tool, "mem_ratio")
        if pts:
            dashed: dict[str, Any] = {"linestyle": "--"} if tool == "floor" else {}
            ax_mem.plot(
                [p[0] for p in pts], [p[1] for p in pts], label=tool, **STYLE[tool], **dashed
            )
    ax_rate.axhline(1024, color="tab:red", linewidth=0.8, linestyle="--", label="target 1 GiB/s")
    for ax in (ax_rate, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xticks([64, 256, 1024], ["64 MiB", "256 MiB", "1 GiB"])
        ax.set_xlabel("tensor returned by each of 2 workers")
        ax.grid(alpha=0.3)
    ax_rate.set_yscale("log")
    ax_rate.set_ylabel("MiB/s of returned bytes, median (log)")
    ax_rate.set_title("Return throughput (effective: noisy, see docs)")
    ax_rate.legend(fontsize=8)
    ax_mem.axhline(1.2, color="tab:red", linewidth=0.8, linestyle="--", label="target 1.2x")
    ax_mem.set_ylabel("launcher peak RSS increase ÷ bytes returned")
    ax_mem.set_title("Launcher memory")
    ax_mem.set_ylim(bottom=0)
    ax_mem.legend(fontsize=8)


def make_plots(data: dict[str, Any], out_dir: str) -> list[str]:
    """Writes the two PNGs into `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    _launch_panel(a, data)
    _scale_panel(b, data)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bench_launch.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    _returns_panels(a, b, data)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bench_returns.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main() -> None:
    """plots.py RESULTS.json OUT_DIR."""
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        data = json.load(f)
    for path in make_plots(data, sys.argv[2]):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
