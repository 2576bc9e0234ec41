"""Finding the OffloadAdamW a Trainer's optimizer is, or steps."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_offload_optim.adamw import OffloadAdamW


def offload_adamw(optimizer: torch.optim.Optimizer) -> OffloadAdamW | None:
    """``optimizer`` itself if it is an OffloadAdamW, or the one it wraps as ``optim`` and
    steps in its own ``step()`` (``ZeroRedundancyOptimizer(optimizer_class=OffloadAdamW)``,
    ``PostLocalSGDOptimizer``); else None.

    Example:
        >>> import torch
        >>> offload_adamw(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])) is None
        True
    """
    if isinstance(optimizer, OffloadAdamW):
        return optimizer
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, OffloadAdamW) else None


def offload_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> list[OffloadAdamW]:
    """The OffloadAdamW optimizers among ``optimizers`` or wrapped by them, in their order."""
    return [found for o in optimizers if (found := offload_adamw(o)) is not None]
