"""Lightning DDP with accelerator="gpu" under slurmrun: Lightning makes its NCCL group from the
torchrun variables slurmrun sets, every rank sees one consistent world, and training runs."""

from __future__ import annotations

import pytest
from gpu_helpers import need_gpus

import slurmrun

pytestmark = pytest.mark.gpu


def train_on_gpu(tmp: str) -> dict[str, object]:
    import os

    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen: dict[str, object] = {}

    class Record(Callback):
        # While training: Lightning's teardown moves the model back to the CPU.
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seen["backend"] = torch.distributed.get_backend()
            seen["dist"] = [torch.distributed.get_rank(), torch.distributed.get_world_size()]
            seen["device"] = str(next(pl_module.parameters()).device)

    L.seed_everything(1)
    model = BoringModel()
    trainer = L.Trainer(
        accelerator="gpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
        strategy="ddp",
        max_steps=4,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
        callbacks=[Record()],
    )
    trainer.fit(model)
    env = trainer._accelerator_connector.cluster_environment
    return {
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "environment": type(env).__name__,
        **seen,
        "RANK": int(os.environ["RANK"]),
    }


@pytest.mark.timeout(600)
def test_lightning_ddp_on_gpus(tmp_path) -> None:
    pytest.importorskip("lightning")
    n = need_gpus(1)
    # backend=None: Lightning makes the process group itself, as under torchrun.
    result = slurmrun.launch(train_on_gpu, (str(tmp_path),), backend=None, timeout=300)
    seen = result.values()
    assert [s["RANK"] for s in seen] == list(range(n))
    for rank, s in enumerate(seen):
        assert s["global_rank"] == rank and s["local_rank"] == rank, s
        assert s["world_size"] == n and s["dist"] == [rank, n], s
        assert s["environment"] == "TorchElasticEnvironment", s
        assert s["backend"] == "nccl" and s["device"] == f"cuda:{rank}", s
        assert s["global_step"] == 4, s
