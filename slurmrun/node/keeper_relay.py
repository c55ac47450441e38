"""The relay on a reservation's keeper node, for a launcher that cannot reach the keeper's port.

The launcher runs it with ``srun --jobid J --overlap`` on the keeper's node
(`slurmrun.launcher.agents.reserved_relay`): each channel that the launcher opens over its
stdin and stdout (`slurmrun.channels`) becomes a connection to the keeper's port, there on the
node, and the keeper sees a launcher as if it had connected itself (it still proves the
reservation's secret). Its stdout carries the channels: nothing else may be written there.
"""

from __future__ import annotations

import socket
import sys

from slurmrun.channels import Mux

__all__ = ["main"]

CONNECT_TIMEOUT = 10.0


def main(argv: list[str] | None = None) -> int:
    """Relays stdin/stdout's channels to the keeper at ``HOST PORT`` until stdin ends."""
    host, port = (sys.argv[1:] if argv is None else argv)[:2]

    def opened(channel: int) -> socket.socket | None:
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
        except OSError as e:
            print(f"slurmrun relay: cannot reach the keeper at {host}:{port}: {e}", file=sys.stderr)
            return None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    Mux(sys.stdin.fileno(), sys.stdout.fileno(), opened, lines_out=True).pump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
