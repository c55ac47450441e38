"""Every performance figure the README and the docs quote is in the benchmark results file.

``benchmarks/results/latest.json`` is written by ``python benchmarks/run.py --json ...``: the
tables and targets of its run, the date and the machine (``meta``), and under ``recorded`` the
measurements the pages quote that run.py does not make (the GPU suite, before/after
comparisons, earlier runs and profiles), each with its date, machine and how it was measured;
run.py keeps them when it rewrites the file. A page that quotes a figure the file does not
hold, say an old run's ``0.36x`` or a rounded ``0.4-0.5x``, fails here with the page, the line
and the figure: copy the figure from the file, as the file writes it.

What counts as a figure (outside fenced code blocks): a ratio (``0.37x``, ``31.37x``), a
throughput (``947 MiB/s``), and a time with a decimal point or given as a range or as
approximate (``1.93 s``, ``0.1-0.2 s``, ``~35 ms``). Whole seconds (``30 s``, ``3 s``) are
timeouts and grace periods, settings rather than measurements, and are not checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "latest.json"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.])(?P<approx>~)?(?P<value>{_NUM}(?:\s?-\s?~?{_NUM})?)"
    r"(?:(?P<ratio>x)(?!\w)|\s?(?P<unit>MiB/s|GiB/s|s per GiB|ms\b|us\b|s\b))"
)
TIME_UNITS = {"s", "ms", "us", "s per GiB"}

# Phrases whose numbers are settings, not measurements: phrase -> why.
NOT_FIGURES: dict[str, str] = {
    "sampled every 0.1 s": "the benchmark harness's sampling interval",
}


def is_checked(m: re.Match[str]) -> bool:
    """Whether a match is a performance figure (see the module's docstring)."""
    if m["ratio"] or m["unit"] not in TIME_UNITS:
        return True
    return bool(m["approx"]) or "." in m["value"] or "-" in m["value"]


def normal(m: re.Match[str]) -> str:
    """The figure without spacing choices or a leading ~: ``1.8 - 7.6 s`` -> ``1.8-7.6 s``."""
    value = re.sub(r"\s*-\s*~?", "-", m["value"])
    return f"{value}x" if m["ratio"] else f"{value} {m['unit']}"


def figures(text: str) -> Iterator[tuple[int, str]]:
    """(line number, figure) of every checked figure outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            text_of_line = line
            for phrase in NOT_FIGURES:
                text_of_line = text_of_line.replace(phrase, "")
            for m in FIGURE.finditer(text_of_line):
                if is_checked(m):
                    yield number, normal(m)


def strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def results() -> dict[str, Any]:
    with open(RESULTS) as f:
        data: dict[str, Any] = json.load(f)
    return data


def in_results(data: dict[str, Any]) -> set[str]:
    """Every figure the results file writes (in its tables, targets and recorded measurements)."""
    found: set[str] = set()
    for key in ("tables", "targets", "recorded"):
        for text in strings(data.get(key, [])):
            found |= {normal(m) for m in FIGURE.finditer(text)}
    for table in data["tables"] + data.get("recorded", []):
        units = [re.search(r"MiB/s|GiB/s", h) for h in table.get("headers", [])]
        for row in table.get("rows", []):
            for unit, cell in zip(units, row, strict=False):
                if unit and re.fullmatch(_NUM, cell):  # a bare number under "MiB/s ..."
                    found.add(f"{cell} {unit[0]}")
    return found


def test_every_figure_a_page_quotes_is_in_the_results_file() -> None:
    known = in_results(results())
    missing = [
        f"{page.relative_to(REPO)}:{line}: {figure}"
        for page in PAGES
        for line, figure in figures(page.read_text())
        if figure not in known
    ]
    assert not missing, (
        f"figures quoted on a page but not in {RESULTS.relative_to(REPO)} (quote the file's "
        "figures as it writes them, or add the measurement to its `recorded` list with its "
        "date, machine and command):\n" + "\n".join(missing)
    )


def test_results_say_when_and_on_what_they_were_measured() -> None:
    data = results()
    machine = data["meta"]["machine"]
    for field in ("cpu_model", "cores", "mem_total_gib", "os", "slurm", "torch"):
        assert machine.get(field), f"meta.machine.{field} is empty in {RESULTS}"
    assert data["meta"]["date"]
    for entry in data["recorded"]:
        for field in ("title", "date", "machine", "how"):
            assert entry.get(field), f"recorded entry {entry.get('title')!r} has no {field}"


def test_the_rule_catches_figures_and_leaves_settings() -> None:
    text = (
        "It runs 0.4-0.5x the time of torchrun, 0.36x, **1.52 s** vs ~0.1 s and ~35 ms; "
        "1077 MiB/s; 0.5-3 s per GiB.\nSIGKILL after 30 s, a 3 s grace, port 6817, "
        "memory sampled every 0.1 s, 4096 x 8 workers.\n"
        "```python\nlauncher.run(train, (0.5,))  # ~2.5 s\n```\n"
    )
    assert [f for _, f in figures(text)] == [
        "0.4-0.5x",
        "0.36x",
        "1.52 s",
        "0.1 s",
        "35 ms",
        "1077 MiB/s",
        "0.5-3 s per GiB",
    ]
