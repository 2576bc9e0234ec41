"""OffloadOptimizerMixin: ``configure_optimizers`` with OffloadAdamW, from ``self.hparams``."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch

from lightning_offload_optim.adamw import OffloadAdamW
from lightning_offload_optim.lightning.checkpoint import (
    CHECKPOINT_KEY,
    check_metadata,
    offload_metadata,
)

#: Modules whose weights are normalisation scales (not decayed by default).
NORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
    torch.nn.RMSNorm,
)


class OffloadOptimizerMixin:
    """Gives a LightningModule a ``configure_optimizers`` that returns :class:`OffloadAdamW`.

    Put it first in the bases. Hyperparameters come from ``self.hparams`` (what
    ``save_hyperparameters()`` stored, so ``LightningCLI`` and YAML set them), else the defaults:

    ========================  ============  ================================================
    hparam                    default       meaning
    ========================  ============  ================================================
    ``lr``                    1e-3          peak learning rate (``learning_rate`` also read)
    ``weight_decay``          1e-2          decoupled weight decay
    ``betas``                 (0.9, 0.999)  or ``beta1`` / ``beta2``
    ``eps``                   1e-8
    ``amsgrad``               False
    ``no_decay_norm_and_bias``  True        no weight decay for biases and norm weights
    ``warmup_steps``          0             linear warm-up steps; > 0 turns the schedule on
    ``lr_schedule``           None          ``"cosine"``: warm-up then cosine decay over
                                            ``trainer.estimated_stepping_batches``
    ``min_lr_ratio``          0.0           final lr of the cosine, as a fraction of ``lr``
    ``offload_chunk_size``    4Mi           :class:`OffloadAdamW` ``chunk_size``
    ``offload_pin_memory``    None          :class:`OffloadAdamW` ``pin_memory``
    ``offload_enabled``       True          False gives plain ``torch.optim.AdamW`` behaviour
    ========================  ============  ================================================

    Override :meth:`offload_optimizer_args` to change groups or arguments.

    Example:
        >>> import lightning.pytorch as pl
        >>> class Model(OffloadOptimizerMixin, pl.LightningModule):
        ...     def __init__(self, lr: float = 3e-4, warmup_steps: int = 100):
        ...         super().__init__()
        ...         self.save_hyperparameters()
        ...         self.net = torch.nn.Linear(4, 4)
        >>> Model().offload_optimizer_args()["lr"]
        0.0003
    """

    offload_defaults: ClassVar[dict[str, Any]] = {
        "lr": 1e-3,
        "weight_decay": 1e-2,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "amsgrad": False,
        "no_decay_norm_and_bias": True,
        "warmup_steps": 0,
        "lr_schedule": None,
        "min_lr_ratio": 0.0,
        "offload_chunk_size": None,
        "offload_pin_memory": None,
        "offload_enabled": True,
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if pl.LightningModule in mro and mro.index(pl.LightningModule) < mro.index(
            OffloadOptimizerMixin
        ):
            raise TypeError(
                f"{cls.__name__}: put OffloadOptimizerMixin before LightningModule in the bases, "
                f"as in `class {cls.__name__}(OffloadOptimizerMixin, LightningModule)`; after it, "
                "Lightning's own configure_optimizers would shadow the mixin's."
            )

    def offload_hparam(self, name: str) -> Any:
        """``self.hparams[name]`` if saved, else the documented default."""
        hparams = getattr(self, "hparams", {})
        if name == "lr" and "lr" not in hparams and "learning_rate" in hparams:
            return hparams["learning_rate"]
        if name == "betas" and "betas" not in hparams and {"beta1", "beta2"} & hparams.keys():
            beta1, beta2 = self.offload_defaults["betas"]
            return (hparams.get("beta1", beta1), hparams.get("beta2", beta2))
        return hparams.get(name, self.offload_defaults[name])

    def offload_param_groups(self) -> list[dict[str, Any]]:
        """Trainable parameters in two groups: decayed, and biases/norm weights without decay."""
        assert isinstance(self, torch.nn.Module)
        if not self.offload_hparam("no_decay_norm_and_bias"):
            return [{"params": [p for p in self.parameters() if p.requires_grad]}]
        no_decay_ids = set()
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, NORM_TYPES) or name == "bias" or name.endswith("_bias"):
                    no_decay_ids.add(id(param))
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if id(p) not in no_decay_ids]},
            {"params": [p for p in params if id(p) in no_decay_ids], "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def offload_optimizer_args(self) -> dict[str, Any]:
        """Keyword arguments of :class:`OffloadAdamW`, ``params`` included. Override this."""
        args: dict[str, Any] = {
            "params": self.offload_param_groups(),
            "lr": self.offload_hparam("lr"),
            "betas": tuple(self.offload_hparam("betas")),
            "eps": self.offload_hparam("eps"),
            "weight_decay": self.offload_hparam("weight_decay"),
            "amsgrad": self.offload_hparam("amsgrad"),
            "pin_memory": self.offload_hparam("offload_pin_memory"),
            "enabled": self.offload_hparam("offload_enabled"),
        }
        if self.offload_hparam("offload_chunk_size") is not None:
            args["chunk_size"] = self.offload_hparam("offload_chunk_size")
        return args

    def configure_optimizers(self) -> Any:
        """OffloadAdamW, with the warm-up/cosine schedule when the hyperparameters ask for it."""
        optimizer = OffloadAdamW(**self.offload_optimizer_args())
        warmup = int(self.offload_hparam("warmup_steps"))
        schedule = self.offload_hparam("lr_schedule")
        if schedule not in (None, "cosine", "constant"):
            raise ValueError(f"lr_schedule must be None, 'constant' or 'cosine', got {schedule!r}")
        if warmup <= 0 and schedule != "cosine":
            return optimizer
        total = None
        if schedule == "cosine":
            trainer = getattr(self, "_trainer", None)
            estimate = trainer.estimated_stepping_batches if trainer is not None else math.inf
            if not math.isfinite(estimate):
                raise ValueError(
                    "lr_schedule='cosine' is sized from trainer.estimated_stepping_batches: it "
                    "needs the module attached to a Trainer with max_steps or max_epochs set"
                )
            total = int(estimate)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, WarmupCosine(warmup, total, float(self.offload_hparam("min_lr_ratio")))
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        trainer = getattr(self, "_trainer", None)
        checkpoint[CHECKPOINT_KEY] = offload_metadata(trainer.optimizers if trainer else [])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_metadata(checkpoint)
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]


class WarmupCosine:
    """LambdaLR multiplier (an object, so it pickles): linear from 0 to 1 over ``warmup``
    steps, then cosine to ``min_ratio`` at ``total`` steps; 1 after warm-up if ``total`` is None.
    """

    def __init__(self, warmup: int, total: int | None, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.total is None:
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
