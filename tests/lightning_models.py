"""Small LightningModules that train with OffloadAdamW or with torch's AdamW, otherwise alike."""

from __future__ import annotations

import functools
import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import DataLoader, TensorDataset

from lightning_offload_optim import OffloadAdamW, OffloadOptimizerMixin, StagingPool


def torch_reference(args: dict[str, Any]) -> torch.optim.AdamW:
    """torch.optim.AdamW(fused=True) with the arguments the mixin would give OffloadAdamW.

    ``_step_supports_amp_scaling`` is switched off so that, under 16-mixed, GradScaler unscales
    the gradients before the step as it does for OffloadAdamW (the fused kernel would otherwise
    divide inside the kernel, which rounds differently).
    """
    args = {k: v for k, v in args.items() if k not in ("pin_memory", "enabled", "chunk_size")}
    optimizer = torch.optim.AdamW(**args, fused=True)
    optimizer._step_supports_amp_scaling = False
    return optimizer


class AtTrainEnd(pl.Callback):
    """The first optimizer's ``memory_stats()`` and overlap as training ends: callbacks' hooks run
    before the module's, whose ``on_train_end`` (the mixin's) frees the device buffers and
    removes the overlap."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        offload = isinstance(optimizer, OffloadAdamW)
        self.stats = optimizer.memory_stats() if offload else {}
        self.overlap = optimizer._overlapping() if offload else None
        self.plans = list(optimizer._plans.values()) if offload else []  # the steps' chunks
        #: The parameters' memory now (Lightning moves the module to the CPU at teardown).
        self.storages = [StorageWeakRef(p.untyped_storage()) for p in pl_module.parameters()]


def reference_lr_factor(warmup: int, total: int | None, min_ratio: float, step: int) -> float:
    """The documented warm-up + cosine schedule, written out here independently of the mixin."""
    if step < warmup:
        return (step + 1) / warmup
    if total is None:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * progress)) / 2


def make_data(n: int = 16, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 8, generator=generator), torch.randn(n, 1, generator=generator)
    )


class TinyModel(OffloadOptimizerMixin, pl.LightningModule):
    """A small regression MLP; ``optimizer`` is ``"offload"`` or ``"torch"``."""

    def __init__(
        self,
        optimizer: str = "offload",
        lr: float = 0.01,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        lr_schedule: str | None = None,
        nan_at_batch: int = -1,
        force_staging: bool = False,
        overlap_step: bool = False,
        offload_resident: float | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y.float())
        if batch_idx == self.hparams.nan_at_batch:
            loss = loss * float("inf")
        self.log("loss", loss)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(), batch_size=4)

    def offload_optimizer_args(self) -> dict[str, Any]:
        args = super().offload_optimizer_args()
        if self.hparams.force_staging:
            args.update(force_staging=True, chunk_size=64)
        return args

    def reference_param_groups(self) -> list[dict[str, Any]]:
        """What the mixin should build, listed by hand: decay for the Linear weights only."""
        linear1, norm, _, linear2 = self.net
        return [
            {"params": [linear1.weight, linear2.weight]},
            {"params": [linear1.bias, norm.weight, norm.bias, linear2.bias], "weight_decay": 0.0},
        ]

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp.optimizer == "offload":
            return super().configure_optimizers()
        reference = torch_reference(
            {"params": self.reference_param_groups(), "lr": hp.lr, "weight_decay": hp.weight_decay}
        )
        if hp.warmup_steps <= 0 and hp.lr_schedule is None:
            return reference
        total = int(self.trainer.estimated_stepping_batches) if hp.lr_schedule == "cosine" else None
        factor = functools.partial(reference_lr_factor, hp.warmup_steps, total, 0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(reference, factor)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": reference, "lr_scheduler": schedule}


class ManualModel(TinyModel):
    """Manual optimization, one optimizer, with clipping done by hand."""

    def __init__(self, optimizer: str = "offload", **hparams: Any) -> None:
        super().__init__(optimizer, **hparams)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()


class TwoOptimizerModel(TinyModel):
    """GAN-style: two optimizers over two halves of the network, stepped alternately."""

    def __init__(self, optimizer: str = "offload") -> None:
        super().__init__(optimizer)
        self.automatic_optimization = False
        self.other = torch.nn.Linear(8, 8)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()
        x, y = batch
        loss_first = torch.nn.functional.mse_loss(self.net(self.other(x).detach()), y)
        first.zero_grad()
        self.manual_backward(loss_first)
        first.step()
        loss_second = self.other(x).pow(2).mean() - self.net(self.other(x)).mean()
        second.zero_grad()
        self.manual_backward(loss_second)
        second.step()

    def configure_optimizers(self) -> Any:
        groups = [self.net.parameters(), self.other.parameters()]
        if self.hparams.optimizer == "offload":
            return [OffloadAdamW(g, lr=0.01, weight_decay=0.1) for g in groups]
        if self.hparams.optimizer == "offload-pool":  # staged through one pool's buffers
            pool = StagingPool()
            return [OffloadAdamW(g, force_staging=True, staging_pool=pool) for g in groups]
        return [torch_reference({"params": g, "lr": 0.01, "weight_decay": 0.1}) for g in groups]


def trainer(tmp_path, **kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    return pl.Trainer(**{**defaults, **kwargs})
