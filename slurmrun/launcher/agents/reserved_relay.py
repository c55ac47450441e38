"""A launcher's way to a reservation's keeper where the keeper's port cannot be reached.

Sites that firewall their login nodes let nothing in or out but SLURM's own traffic; ``srun
--jobid J --overlap`` from the login node always works. `SrunRelay` runs the relay
(`slurmrun.node.keeper_relay`) on the keeper's node in such steps, and each `connect` is a
new channel over the stdin and stdout of one of them (`slurmrun.channels`), handed out as a
socket: the handshake and the frames over it are those of a direct connection.

A step's output reaches srun at about 20 MiB/s whatever its lines (slurmstepd passes it on
in small messages); `RELAYS` steps started together carry the channels in turn (each
agent's connection and each large result on another than the last), so that two ranks'
large results come twice as fast.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import IO

from slurmrun.channels import Mux
from slurmrun.launcher.agents.containers import slurmrun_root
from slurmrun.reservations import ReservationRecord

__all__ = ["SrunRelay", "relay_command"]

EXIT_WAIT = 5.0  # after its stdin closed, how long the relay's srun may take to exit
RELAYS = 2  # relay steps per launcher: each step's output is a bottleneck of its own

# The relay's start on the keeper's node: this slurmrun, found at the path given.
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from slurmrun.node import keeper_relay; sys.exit(keeper_relay.main())"
)


def relay_command(record: ReservationRecord) -> list[str]:
    """The srun command line that runs the relay on the keeper's node."""
    return [
        "srun",
        f"--jobid={record.job_id}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={record.node or record.hostnames[0]}",
        "--quiet",
        "--job-name=slurmrun-relay",
        sys.executable,
        "-c",
        _BOOTSTRAP,
        slurmrun_root(),
        record.host,
        str(record.port),
    ]


@dataclass
class SrunRelay:
    """The relays' srun steps, and the channels over them."""

    record: ReservationRecord
    log_path: str
    steps: list[tuple[subprocess.Popen[bytes], Mux]] = field(default_factory=list)
    opened: int = 0  # channels opened: the next goes to step `opened % RELAYS`
    _log: IO[bytes] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def connect(self) -> socket.socket:
        """A new channel to the keeper's port (the relays start with the first)."""
        with self._lock:
            if not self.steps:
                self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed by close()
                self.steps = [self._start(self._log) for _ in range(RELAYS)]
            _, mux = self.steps[self.opened % len(self.steps)]
            self.opened += 1
            return mux.open()

    def _start(self, log: IO[bytes]) -> tuple[subprocess.Popen[bytes], Mux]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
        if "SLURM_CONF" in os.environ:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        proc = subprocess.Popen(
            relay_command(self.record),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            start_new_session=True,  # a Ctrl-C reaches the launcher, which stops us
        )
        assert proc.stdin is not None and proc.stdout is not None  # noqa: S101, PT018
        mux = Mux(proc.stdout.fileno(), proc.stdin.fileno(), lines_in=True)
        threading.Thread(target=mux.pump, daemon=True).start()
        return proc, mux

    def close(self) -> None:
        """Ends the relays: their stdin closes, they exit (bounded; then srun is killed)."""
        for proc, _ in self.steps:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc, _ in self.steps:
            try:
                proc.wait(EXIT_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(EXIT_WAIT)
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
