"""The docs site builds with warnings as errors, and no code block in the docs can rot.

Every fenced block of README.md and docs/*.md is handled by its info string (the convention
is in docs/contributing.md): ``python`` blocks run on localhost, ``python {cluster}`` and
``python {login}`` blocks compile here and run on the test cluster
(tests/slurm/test_examples_slurm.py), ``python {script}`` blocks (scripts the ``slurmrun``
command runs) and ``python {site}`` blocks (for a site's setup: a container image) compile
here, ``bash`` commands are checked against the programs we
document and the repository's files (``slurmrun`` commands are dry-run), ``text`` lines on
the Troubleshooting page must be messages slurmrun's source can print.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]

PYTHON_KINDS = {"python", "python {cluster}", "python {login}", "python {script}", "python {site}"}
KNOWN_INFO = {*PYTHON_KINDS, "bash", "text"}
# Programs a documented command may start with.
KNOWN_PROGRAMS = {
    "bash",
    "pip",
    "python",
    "python3",
    "salloc",
    "sbatch",
    "scancel",
    "sinfo",
    "slurmrun",
    "squeue",
    "srun",
}
# Paths the commands write (they need not exist beforehand).
OUTPUTS = {"docs/_build", "docs/", "benchmarks/results/latest.json"}
# Scripts a reader writes; slurmrun commands run them as stubs.
USER_SCRIPTS = {"train.py", "my_driver.py", "args.txt"}  # args.txt: --map's (one line)


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    info: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(paths: list[Path] = PAGES) -> list[Block]:
    found = []
    for path in paths:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].startswith("```"):
                info, start = lines[i][3:].strip(), i
                i += 1
                while not lines[i].startswith("```"):
                    i += 1
                found.append(Block(path, start + 1, info, "\n".join(lines[start + 1 : i]) + "\n"))
            i += 1
    return found


def of_kind(*infos: str) -> list[pytest.param]:
    return [pytest.param(b, id=b.id) for b in blocks() if b.info in infos]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env["PYTHONPATH"] = str(REPO)
    env["SLURMRUN_LOG_DIR"] = str(tmp_path / "logs")
    return env


def run(argv: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs argv in tmp_path; on timeout kills its whole process group and fails."""
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{shlex.join(argv)} timed out after {timeout} s:\n{out}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


# --------------------------------------------------------------------------- the site
def test_docs_build_with_warnings_as_errors_and_document_every_public_name(tmp_path):
    pytest.importorskip("sphinx", reason="pip install -r docs/requirements.txt")
    out = tmp_path / "html"
    cp = run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(DOCS), str(out)],
        tmp_path,
        300,
    )
    assert cp.returncode == 0, cp.stdout
    import slurmrun

    api = (out / "api.html").read_text()
    missing = [name for name in slurmrun.__all__ if f'id="slurmrun.{name}"' not in api]
    assert not missing, f"docs/api.md does not document {missing}"


def test_options_tables_are_the_ones_generated_from_options():
    """An option added to `Options` (or a docstring changed) is in docs/api.md and cli.md."""
    from slurmrun.cli import doctables

    stale = []
    for name, (page, make) in doctables.TABLES.items():
        text = (REPO / page).read_text()
        try:
            if doctables.replace_table(text, name, make()) != text:
                stale.append(f"{page}: the options table {name!r} is not Options' own")
        except doctables.TableMarkersError as e:
            stale.append(f"{page}: {e}")
    assert not stale, "\n".join(stale) + f"\n(run {doctables.COMMAND})"


def test_every_page_is_in_the_site():
    import slurmrun  # noqa: F401 - the package must import for the toctree check to mean much

    index = (DOCS / "index.md").read_text()
    listed = set(re.findall(r"^([a-z_]+)$", index, flags=re.MULTILINE))
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= listed, f"pages missing from the toctree in docs/index.md: {pages - listed}"


# --------------------------------------------------------------------------- no rot
def test_every_block_has_an_info_string_the_tests_handle():
    unknown = [
        f"{b.id}: {b.info!r}"
        for b in blocks()
        if b.info not in KNOWN_INFO and not b.info.startswith("{")
    ]
    assert not unknown, f"blocks without a known info string (docs/contributing.md):\n{unknown}"


@pytest.mark.parametrize("block", of_kind("python"))
def test_python_block_runs_on_localhost(block: Block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.text)
    cp = run([sys.executable, str(script)], tmp_path, 240)
    assert cp.returncode == 0, f"{block.id} failed:\n{block.text}\n--- output\n{cp.stdout}"


@pytest.mark.parametrize(
    "block", of_kind("python {cluster}", "python {login}", "python {script}", "python {site}")
)
def test_cluster_block_compiles(block: Block):
    compile(block.text, block.id, "exec")


def commands(text: str) -> list[list[str]]:
    """The commands of a bash block: comments, shebang and #SBATCH lines skipped."""
    found = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in {"&&", ";", "|", "||"}:
                if command:
                    found.append(command)
                command = []
            else:
                command.append(word)
    return found


def check_command(argv: list[str], tmp_path: Path) -> None:
    program = argv[0]
    assert program in KNOWN_PROGRAMS, f"unknown program {program!r} in {shlex.join(argv)}"
    for arg in argv[1:]:
        if arg.startswith("-") or "://" in arg or arg in OUTPUTS or "/" not in arg:
            continue
        assert (REPO / arg).exists(), f"{shlex.join(argv)}: no file {arg} in the repository"
    if program == "slurmrun" or argv[:3] == [program, "-m", "slurmrun"]:
        args = argv[1:] if program == "slurmrun" else argv[3:]
        for name in USER_SCRIPTS:
            (tmp_path / name).write_text("print('stub')\n")
        if args[:1] != ["info"]:
            args = ["--dry-run", *args]
        cp = run([sys.executable, "-m", "slurmrun", *args], tmp_path, 120)
        assert cp.returncode == 0, f"{shlex.join(argv)} failed:\n{cp.stdout}"


@pytest.mark.parametrize("block", of_kind("bash"))
def test_bash_block_commands_exist_and_slurmrun_ones_parse(block: Block, tmp_path):
    found = commands(block.text)
    assert found, f"{block.id}: no command"
    for argv in found:
        check_command(argv, tmp_path)


@cache
def source_messages() -> list[re.Pattern[str]]:
    """Every string slurmrun's source can format, as a regex (formatted values: ``.*?``)."""
    patterns = []
    for path in (REPO / "slurmrun").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                parts = [
                    re.escape(v.value) if isinstance(v, ast.Constant) else "(.*?)"
                    for v in node.values
                ]
                constant = sum(len(v.value) for v in node.values if isinstance(v, ast.Constant))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts, constant = [re.escape(node.value)], len(node.value)
            else:
                continue
            if constant >= 12:  # a bare "{why}" or ": " would cover anything
                patterns.append(re.compile("".join(parts), re.DOTALL))
    return patterns


def printable(line: str) -> bool:
    """Whether `line` is a sequence of source messages (f-strings appended to each other)."""
    reachable, todo = {0}, [0]
    while todo:
        start = todo.pop()
        for pattern in source_messages():
            ends = set()
            if m := pattern.match(line, start):
                ends.add(m.end())
            if pattern.fullmatch(line, start):
                ends.add(len(line))
            for end in ends - reachable:
                if end > start:
                    reachable.add(end)
                    todo.append(end)
    return len(line) in reachable


def test_troubleshooting_quotes_messages_slurmrun_prints():
    quoted = [
        line
        for b in blocks([DOCS / "troubleshooting.md"])
        if b.info == "text"
        for line in b.text.splitlines()
        if line.strip()
    ]
    assert len(quoted) >= 10
    stale = [line for line in quoted if not printable(line)]
    assert not stale, "messages slurmrun no longer prints:\n" + "\n".join(stale)


def test_info_output_in_the_docs_is_the_golden_files_test_info_checks():
    """`slurmrun info`'s output is shown from tests/golden (kept equal to the real output by
    tests/test_info.py), never pasted into a page, where it goes stale."""
    pasted = [
        b.id for b in blocks() if "what launch() with defaults would do:" in b.text.splitlines()
    ]
    assert not pasted, f"`slurmrun info` output pasted (literalinclude its golden file): {pasted}"
    page = (DOCS / "info.md").read_text()
    for golden in ("info_outside_slurm.txt", "info_job_shell.txt"):
        assert f"```{{literalinclude}} ../tests/golden/{golden}" in page, golden
        assert (REPO / "tests" / "golden" / golden).exists()


def test_readme_links_the_docs_it_names_and_says_why_and_how_to_get_cpu_torch():
    text = (REPO / "README.md").read_text()
    unlinked = re.findall(r"`docs/\w+\.md`", text)
    assert not unlinked, f"README names docs without linking them: {unlinked}"
    links = re.findall(r"\]\(((?:docs/)[^)#]*)", text)
    assert "docs/comparison.md" in links, "README does not link the comparison page"
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    assert "**Why slurmrun.**" in text
    # PyPI's torch wheel for Linux is the CUDA build: a laptop without a GPU wants this index.
    install = [
        b.text for b in blocks([REPO / "README.md"]) if b.info == "bash" and "whl/cpu" in b.text
    ]
    cpu_index = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert install and cpu_index in install[0]
