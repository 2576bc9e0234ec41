"""Run by test_model_parallel.py: Lightning's ModelParallelStrategy on 2 CPU processes, FSDP2
and tensor parallel, with OffloadAdamW through the mixin and with torch AdamW, each saving and
resuming.

Usage: python tests/model_parallel_fit.py OUTPUT_DIR. Lightning starts rank 1 by running this
script again. Each rank writes, per optimizer and checkpoint kind (sharded folder or one file),
the full parameters after a fit and after a resume from its mid-run checkpoint, what the
monitor logged, and the monitors' totals at the end of both.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from conftest import sequence_parallel
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_models import TinyModel, make_data, trainer
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_offload_optim import OffloadMonitor

STEPS = 4


class ShardedModel(TinyModel):
    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):  # validate() after fit() calls this again
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x).float(), y.float()))


class TensorParallelModel(ShardedModel):
    """A pre-norm block over 2 tokens of width 4 (each sample's 8 inputs), parallelized as
    Lightning's tensor-parallel docs do: each rank holds one token (``SequenceParallel``), so
    the norm's replicated weights get partial-sum gradients, which the step redistributes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.LayerNorm(4), torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)
        )

    def configure_model(self) -> None:
        if isinstance(self.net[1].weight, DTensor):  # validate() after fit() calls this again
            return
        sequence_parallel(self.net, self.device_mesh["tensor_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        token = self.device_mesh["tensor_parallel"].get_local_rank()
        return self.net(x.view(-1, 2, 4)[:, token : token + 1]).mean(dim=(1, 2)).unsqueeze(1)

    def train_dataloader(self) -> DataLoader:
        # Both ranks see every batch (one data-parallel rank): 2 batches of 8 per epoch, so the
        # checkpoint at step 2 ends an epoch, as under FSDP2 (2 ranks, 2 batches of 4 each).
        return DataLoader(make_data(), batch_size=8)

    def reference_param_groups(self) -> list[dict[str, Any]]:
        norm, linear1, _, linear2 = self.net
        return [
            {"params": [linear1.weight, linear2.weight]},
            {"params": [norm.weight, norm.bias, linear1.bias, linear2.bias], "weight_decay": 0.0},
        ]


#: Runs by kind: FSDP2 with sharded checkpoints or one file, and tensor parallel (sharded).
KINDS = ("sharded", "file", "tensor-parallel")


def strategy(kind: str) -> ModelParallelStrategy:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "tensor-parallel":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    return ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=kind == "sharded"
    )


def full(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def run(out: Path, optimizer: str, kind: str, common: dict[str, Any]) -> dict:
    name = f"{optimizer}-{kind}"
    model_class = TensorParallelModel if kind == "tensor-parallel" else ShardedModel
    monitor = OffloadMonitor(summary=False)
    saver = ModelCheckpoint(out / f"ckpt-{name}", "{step}", every_n_train_steps=2, save_top_k=-1)
    fit = trainer(
        out / name,
        strategy=strategy(kind),
        devices=2,
        max_steps=STEPS,
        callbacks=[monitor, saver],
        enable_checkpointing=True,
        use_distributed_sampler=True,
        log_every_n_steps=2,
        logger=CSVLogger(out / name),  # logged_metrics are kept where there is one
        **common,
    )
    # All but the FSDP2 sharded-checkpoint runs stage through separate buffers in small chunks,
    # as on a GPU.
    hparams = {"warmup_steps": 1, "lr_schedule": "cosine", "force_staging": kind != "sharded"}
    model = model_class(optimizer=optimizer, **hparams)
    initial = [p.detach().clone() for p in model.parameters()]
    fit.fit(model)
    resumed = model_class(optimizer=optimizer, **hparams)
    resumed_monitor = OffloadMonitor(summary=False)
    again = trainer(
        out / f"{name}-resumed",
        strategy=strategy(kind),
        devices=2,
        max_steps=STEPS,
        callbacks=[resumed_monitor],
        **common,
    )
    again.fit(resumed, ckpt_path=out / f"ckpt-{name}" / "step=2.ckpt")
    resumed_params = full(resumed)
    # As the docs' configure_model: validate after fit (configure_model runs again).
    (validated,) = again.validate(resumed, DataLoader(make_data(), batch_size=4), verbose=False)
    logged = {k: float(v) for k, v in fit.logged_metrics.items() if k.startswith("offload/")}
    optim = resumed.trainer.optimizers[0]
    return {
        "initial": initial,
        "params": full(model),
        "resumed": resumed_params,
        "val_loss": validated["val_loss"],
        "logged": logged,
        "totals": (dict(monitor.totals), dict(resumed_monitor.totals)),
        "state_bytes": optim.memory_stats()["state_bytes"] if optimizer == "offload" else 0,
        "rank": fit.global_rank,
    }


def main(out: Path) -> None:
    common = {"precision": "bf16-mixed", "gradient_clip_val": 0.05}
    results = {
        (optimizer, kind): run(out, optimizer, kind, common)
        for optimizer in ("offload", "torch")
        for kind in KINDS
    }
    rank = results["offload", "sharded"]["rank"]
    torch.save(results, out / f"rank{rank}.pt")
    # Lightning leaves the process group up at exit; one CI run of this script aborted while
    # exiting ("terminate called without an active exception"). Tear it down explicitly.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
