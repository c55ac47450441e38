"""``breakpoint()`` in a rank, debugged from a notebook cell of a warm launcher (a real kernel).

nbclient cannot do this: it always runs its kernel client with ``allow_stdin = False``, so
input() in a cell raises StdinNotImplementedError (slurmrun then lets the rank go on). A
Jupyter frontend (JupyterLab, VS Code) allows stdin: this test talks to an ipykernel through
jupyter_client as such a frontend does, and answers the kernel's input requests.
"""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")

REPO = Path(__file__).resolve().parents[1]
LIMIT = 120

OPEN = """
import slurmrun
launcher = slurmrun.Launcher(workers_per_host=2, backend="gloo").open()
print("warm", launcher.run(lambda: 1).return_values)
"""
RUN = """
def work():
    import os
    mine = f"value-{os.environ['RANK']}"
    if os.environ["RANK"] == "1":
        breakpoint()
    return mine

print("second", launcher.run(work).return_values)
launcher.close()
"""


def _execute(kc, code: str, answers: list[str], allow_stdin: bool) -> str:
    """Runs `code`; answers each input request with the next of `answers`; returns its output."""
    msg_id = kc.execute(code, allow_stdin=allow_stdin)
    out: list[str] = []
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        with_input = False
        if allow_stdin:
            try:
                request = kc.get_stdin_msg(timeout=0.05)
            except queue.Empty:
                pass
            else:
                assert request["msg_type"] == "input_request"
                kc.input(answers.pop(0))
                with_input = True
        try:
            msg = kc.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            out.append(msg["content"]["text"])
        elif kind == "error":
            out.append("\n".join(msg["content"]["traceback"]))
        elif kind == "status" and msg["content"]["execution_state"] == "idle" and not with_input:
            return "".join(out)
    pytest.fail(f"the cell did not finish in {LIMIT} s; its output:\n{''.join(out)}")


@pytest.mark.parametrize("allow_stdin", [True, False], ids=["frontend-input", "no-input"])
def test_breakpoint_in_a_warm_launchers_cell(tmp_path: Path, allow_stdin: bool) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = str(REPO)
    env["SLURMRUN_LOG_DIR"] = str(tmp_path / "logs")
    env.pop("PYTHONBREAKPOINT", None)
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path), env=env)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        assert "warm [[1, 1]]" in _execute(kc, OPEN, [], allow_stdin)
        answers = ["p mine", "c"]
        out = _execute(kc, RUN, answers, allow_stdin)
        assert "second [['value-0', 'value-1']]" in out, out
        if allow_stdin:
            assert "(Pdb) [localhost rank 1] " in out, out
            assert "'value-1'" in out.split("second")[0], out
            assert answers == []
        else:
            assert "this notebook's frontend takes no input" in out, out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
