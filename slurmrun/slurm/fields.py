"""Reading what ``scontrol show job|node|partition|config`` prints, by fields, never by words.

``scontrol show job`` prints a record as lines: the first at the line's start (``JobId=...``),
every other indented by three spaces (five for the per-node lines of ``-d``), each holding
``Key=Value`` fields separated by one space. Most values hold no space; the free-text ones
(`JOB_FREE_TEXT`, `NODE_FREE_TEXT`) are the last field of their line and run to its end, and
may run on over more lines (a newline in a job's comment, a node's reason of several lines).
The user's own command lines (``Command=``; ``SubmitLine=`` since SLURM 25.11) run to the
``WorkDir=`` line that SLURM always prints next: they may hold anything, lines indented like
fields included (``bash -c`` scripts), and nothing in them is ever read as a field.
Layout: SLURM's ``src/scontrol/info_job.c`` and ``src/api/node_info.c``; the golden files of
``tests/golden/slurm/`` hold it as 22.05, 24.11 and 26.05 print it.

``scontrol -o`` (one line a record) cannot be read so: a free-text value there runs into the
next field. slurmrun never asks for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "JOB_FREE_TEXT",
    "NODE_FREE_TEXT",
    "Record",
    "config_fields",
    "first_record",
    "parse_records",
]

JOB_FREE_TEXT = frozenset(
    {
        "JobName",
        "Command",
        "SubmitLine",
        "WorkDir",
        "AdminComment",
        "SystemComment",
        "Comment",
        "Extra",
        "StdErr",
        "StdIn",
        "StdOut",
    }
)
"""Fields of ``scontrol show job`` whose values may hold spaces (each ends its line)."""
NODE_FREE_TEXT = frozenset({"OS", "Reason", "Comment", "Extra"})
"""Fields of ``scontrol show node`` whose values may hold spaces (each ends its line)."""
# The user's command lines, each run to the line of a field that SLURM prints after it always.
_COMMAND_LINE_ENDS = {"Command": ("SubmitLine", "WorkDir"), "SubmitLine": ("WorkDir",)}
# The first key of a per-node line of `scontrol show job -d` ("Nodes=n1 CPU_IDs=0-3 GRES=...");
# SLURM prints those lines before the job's "MinCPUsNode=" line, never after.
_NODE_LINE_KEY = "Nodes"
_NODE_LINE_INDENT = "     "  # where `show partition` has a "   Nodes=" field of its own
_AFTER_NODE_LINES = "MinCPUsNode"
# A field line: the record's first (no indent), an ordinary one (3 spaces) or a per-node line
# of `show job -d` (5 spaces); then a key ("CPUs/Task", "NtasksPerN:B:S:C", "AllocNode:Sid").
_FIELD_LINE = re.compile(r"(?P<indent> {3}(?: {2})?|)(?P<key>[A-Za-z][\w:/]*)=")
_WORD_KEY = re.compile(r"[A-Za-z][\w:/]*=")


@dataclass
class Record:
    r"""One record of ``scontrol show ...``.

    Attributes:
        fields: its fields (the first of a key wins), free-text values as printed (lines
            joined by ``\n``).
        node_lines: the per-node lines of ``scontrol show job -d``, each as its fields
            (``{"Nodes": "node[1-2]", "CPU_IDs": "0-3", "Mem": "0", "GRES": "gpu:2(IDX:0-1)"}``).
    """

    fields: dict[str, str] = field(default_factory=dict)
    node_lines: list[dict[str, str]] = field(default_factory=list)


def _line_fields(line: str, free_text: frozenset[str]) -> list[tuple[str, str]]:
    """The ``(key, value)`` fields of one field line, in order."""
    found: list[tuple[str, str]] = []
    rest = line.lstrip(" ")
    while rest:
        key, _, rest = rest.partition("=")
        if key in free_text:
            found.append((key, rest.rstrip()))
            break
        value, _, rest = rest.partition(" ")
        # A word that is no field of its own ("OS=Linux 6.1 #1" had OS not been free text)
        # belongs to the value before it.
        while rest and not _WORD_KEY.match(rest):
            word, _, rest = rest.partition(" ")
            value = f"{value} {word}" if word else value
        found.append((key, value))
        rest = rest.lstrip(" ")
    return found


def _field_line(line: str, open_key: str | None, record_key: str | None) -> re.Match[str] | None:
    """`_FIELD_LINE`'s match if `line` is a line of fields, None if it continues `open_key`."""
    match = _FIELD_LINE.match(line)
    if match is None:
        return None
    if open_key in _COMMAND_LINE_ENDS:  # the user's command line runs on to the field after it
        ends = _COMMAND_LINE_ENDS[open_key]
        return match if match["indent"] == "   " and match["key"] in ends else None
    if not match["indent"] and record_key is not None and match["key"] != record_key:
        return None  # an unindented line of a free-text value
    return match


def parse_records(text: str, free_text: frozenset[str] = JOB_FREE_TEXT) -> list[Record]:
    """The records of ``scontrol show job|node|partition`` output (not ``-o``).

    A record starts at a line that begins, unindented, with the first record's first key
    (``JobId``, ``NodeName``, ``PartitionName``); a text without one (a part of a record) is
    read as one record.

    Args:
        text: what scontrol printed.
        free_text: the fields whose values may hold spaces (`JOB_FREE_TEXT` for jobs,
            `NODE_FREE_TEXT` for nodes).

    Returns:
        The records, in order; empty when the text holds no field.
    """
    records: list[Record] = []
    record_key: str | None = None  # the key that starts a record ("JobId")
    open_key: str | None = None  # the free-text field that a line not of fields continues
    nodes_done = False
    for line in text.splitlines():
        match = _field_line(line, open_key, record_key)
        if match is None:
            if open_key is not None and line.strip():
                fields = records[-1].fields
                fields[open_key] = f"{fields[open_key]}\n{line.strip()}"
            continue
        if not match["indent"] or not records:
            record_key = record_key or (match["key"] if not match["indent"] else None)
            records.append(Record())
            nodes_done = False
        record = records[-1]
        open_key = None
        pairs = _line_fields(line, free_text)
        if match["key"] == _NODE_LINE_KEY and match["indent"] == _NODE_LINE_INDENT:
            if not nodes_done:
                record.node_lines.append(dict(pairs))
            continue
        nodes_done = nodes_done or match["key"] in (_AFTER_NODE_LINES, *_COMMAND_LINE_ENDS)
        for key, value in pairs:
            if key not in record.fields:
                record.fields[key] = value
            if key in free_text:
                open_key = key
    return records


def first_record(text: str, free_text: frozenset[str] = JOB_FREE_TEXT) -> Record:
    """The first record of scontrol's output (`parse_records`); an empty one if none.

    ``scontrol show job <array id>`` lists every task of the array, a heterogeneous job's
    id every component: the first is the job itself (the array's first task, the leader).
    """
    records = parse_records(text, free_text)
    return records[0] if records else Record()


def config_fields(text: str) -> dict[str, str]:
    """The fields of ``scontrol show config``: its ``Key = Value`` lines (the first wins).

    Args:
        text: what ``scontrol show config`` printed.
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" = ")
        key = key.strip()
        if sep and key and " " not in key:
            fields.setdefault(key, value.strip())
    return fields
