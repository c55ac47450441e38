"""A worker hangs in an NCCL collective while another raises: the launcher reports the
raising rank's exception promptly, not an NCCL (or launch) timeout much later."""

from __future__ import annotations

import time

import pytest
from gpu_helpers import need_gpus

import slurmrun

pytestmark = pytest.mark.gpu

# NCCL's collective timeout is the launch's timeout: an answer that waited for it would take
# TIMEOUT seconds. PROMPT is generous (a loaded machine, NCCL set-up, teardown of wedged
# workers) and far below it.
TIMEOUT = 900
PROMPT = 180


class GaveUpError(RuntimeError):
    pass


def raise_while_others_hang(raiser: int) -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)  # everyone is in the NCCL group
    torch.cuda.synchronize()
    if dist.get_rank() == raiser:
        time.sleep(2)  # the others are inside the collective by now
        raise GaveUpError(f"rank {raiser} gives up")
    dist.all_reduce(t)  # waits for the raiser forever
    torch.cuda.synchronize()


@pytest.mark.timeout(TIMEOUT + 120)
def test_the_raising_rank_is_reported_not_an_nccl_timeout() -> None:
    n = need_gpus(2)
    raiser = n - 1
    start = time.monotonic()
    with pytest.raises(GaveUpError, match=f"rank {raiser} gives up") as raised:
        slurmrun.launch(raise_while_others_hang, (raiser,), timeout=TIMEOUT)
    took = time.monotonic() - start
    assert any(f"rank {raiser} (host" in note for note in getattr(raised.value, "__notes__", []))
    assert took < PROMPT, f"the exception came after {took:.0f} s (NCCL timeout {TIMEOUT} s)"
