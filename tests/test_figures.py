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

The figures quoted together come from one run, so that a page never sets a figure beside one
measured another time (the machine drifts 2-3x within minutes). A run is one table of
run.py's invocation (one scenario: its tools alternate round by round; with the targets
measured in it) or one ``recorded`` entry; quoted together is one section of a page (from a
heading to the next). A section that gathers several runs on purpose (a summary) says so
with the line `SEVERAL_RUNS`; then each of its paragraphs, list items and table rows holds
one run's figures.
"""

from __future__ import annotations

import dataclasses
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
    "1.5 s offers nothing": "how long the debugger's Tab waits for the rank's answer",
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


def figures_of(node: Any) -> set[str]:
    """Every figure `node` (a table, a target, a recorded entry) writes, as `normal` writes it."""
    found = {normal(m) for text in strings(node) for m in FIGURE.finditer(text)}
    for table in node if isinstance(node, list) else [node]:
        if not isinstance(table, dict):
            continue
        units = [re.search(r"MiB/s|GiB/s", h) for h in table.get("headers", [])]
        for row in table.get("rows", []):
            for unit, cell in zip(units, row, strict=False):
                if unit and re.fullmatch(_NUM, cell):  # a bare number under "MiB/s ..."
                    found.add(f"{cell} {unit[0]}")
    return found


@dataclasses.dataclass(frozen=True)
class Run:
    """One run: its figures, and what names it in a page (its date; run.py's also "this run")."""

    figures: frozenset[str]
    named: re.Pattern[str]


def runs(data: dict[str, Any]) -> dict[str, Run]:
    """Each run, by its name: run.py's invocation (its tables and targets: one run, of
    ``meta.date``) and each recorded entry."""
    day = data["meta"]["date"][:10]
    found = {
        f"run.py's run of {day} (tables, targets)": Run(
            frozenset(figures_of(data["tables"]) | figures_of(data["targets"])),
            re.compile(rf"{day}|\b(?:this|the latest|the same) run\b"),
        )
    }
    for entry in data["recorded"]:
        found[f"recorded {entry['date']}: {entry['title']}"] = Run(
            frozenset(figures_of(entry)), re.compile(re.escape(entry["date"][:10]))
        )
    return found


def in_results(data: dict[str, Any]) -> set[str]:
    """Every figure the results file writes (in its tables, targets and recorded measurements)."""
    return set().union(*(run.figures for run in runs(data).values()))


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


SEVERAL_RUNS = "<!-- figures: several runs, each named where it is quoted with another -->"


def quoted_together(text: str) -> Iterator[tuple[list[int], bool]]:
    """The line numbers of each group of lines whose figures come from one run (each
    section), or name their runs (in a section with the `SEVERAL_RUNS` line: each of its
    paragraphs, list items and table rows: then with True)."""
    lines = text.splitlines()
    starts, fenced = [0], False
    for i, line in enumerate(lines):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            starts.append(i)
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=False):
        section = list(range(start + 1, end + 1))  # 1-based
        if SEVERAL_RUNS not in lines[start:end]:
            yield section, False
            continue
        group: list[int] = []
        for number in section:
            line = lines[number - 1]
            if not line.strip() or re.match(r"\s*(?:[-*|]|\d+\.)\s", line):
                if group:
                    yield group, True
                group = []
            if line.strip():
                group.append(number)
        if group:
            yield group, True


def mixed(text: str, every_run: dict[str, Run]) -> list[str]:
    """Each group of `quoted_together` whose figures no one run holds, with its figures' runs
    (a figure in no run is `test_every_figure_a_page_quotes_is_in_the_results_file`'s); in a
    `SEVERAL_RUNS` section, a group that names a run of each figure passes."""
    lines = text.splitlines()
    quoted = list(figures(text))
    found = []
    for group, several in quoted_together(text):
        held = [
            (n, f, {name for name, run in every_run.items() if f in run.figures})
            for n, f in quoted
            if n in set(group)
        ]
        held = [(n, f, names) for n, f, names in held if names]
        if not held or set.intersection(*(names for _, _, names in held)):
            continue
        words = " ".join(lines[n - 1] for n in group)
        if several and all(any(every_run[r].named.search(words) for r in rs) for *_, rs in held):
            continue
        found.append(
            f"line {group[0]}:\n"
            + "\n".join(f"    line {n}: {f} ({' or '.join(sorted(r))})" for n, f, r in held)
        )
    return found


def test_the_figures_quoted_together_come_from_one_run() -> None:
    every_run = runs(results())
    found = [
        f"{page.relative_to(REPO)}:{where}"
        for page in PAGES
        for where in mixed(page.read_text(), every_run)
    ]
    assert not found, (
        "figures of different runs quoted together (quote one run's, or give each run a "
        f"section; a summary section says {SEVERAL_RUNS!r} and keeps each paragraph, list "
        "item and table row to one run):\n" + "\n".join(found)
    )


def test_the_one_run_rule_holds_in_a_section_and_in_each_paragraph_of_a_summary() -> None:
    every_run = {
        "A": Run(frozenset({"1.93 s", "0.44x"}), re.compile("2026-11-25|this run")),
        "B": Run(frozenset({"0.49x", "1.93 s"}), re.compile("2026-11-22")),
    }
    one_section = "## Speed\n\n| x | 1.93 s | 0.44x |\n\nAs a command, 0.49x.\n"
    assert len(mixed(one_section, every_run)) == 1
    assert mixed(one_section.replace("0.49x", "0.44x"), every_run) == []
    two_sections = one_section.replace("As a", "## The command\n\nAs a")
    assert mixed(two_sections, every_run) == []
    summary = f"# Summary\n{SEVERAL_RUNS}\n- 0.44x here,\n- 0.49x there; 1.93 s\n"
    assert mixed(summary, every_run) == []
    mixing = summary.replace("there;", "there, 0.44x")
    assert len(mixed(mixing, every_run)) == 1
    assert mixed(mixing.replace("there", "on 2026-11-22, this run"), every_run) == []
    named_in_a_plain_section = one_section.replace("command,", "command on 2026-11-22,")
    assert len(mixed(named_in_a_plain_section, every_run)) == 1
    fenced = "## A\n0.44x\n```bash\n# not a heading\n```\n0.49x\n"
    assert len(mixed(fenced, every_run)) == 1
