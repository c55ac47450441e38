"""The script that `torchrun --standalone --nproc-per-node=N` runs: gloo, one all_reduce."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import emit


def main() -> None:
    """Joins the process group torchrun set up, all_reduces once, leaves."""
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if int(t.item()) != dist.get_world_size():
        raise SystemExit(1)
    if dist.get_rank() == 0:
        emit({"ok": True})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
