"""Finding the OffloadAdamW a Trainer's optimizer is, or steps."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_offload_optim.adamw import OffloadAdamW

#: How many wrappers deep an OffloadAdamW is looked for (and no cycle is followed for ever).
_WRAPPERS_DEEP = 4


def offload_adamw(optimizer: torch.optim.Optimizer) -> OffloadAdamW | None:
    """``optimizer`` itself if it is an OffloadAdamW, or the one it wraps as ``optim`` and
    steps in its own ``step()`` (``ZeroRedundancyOptimizer(optimizer_class=OffloadAdamW)``,
    ``PostLocalSGDOptimizer``, also one around the other); else None.

    Example:
        >>> import torch
        >>> offload_adamw(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])) is None
        True
    """
    for _ in range(1 + _WRAPPERS_DEEP):  # the optimizer itself, then each wrapper's
        if isinstance(optimizer, OffloadAdamW):
            return optimizer
        optimizer = getattr(optimizer, "optim", None)
    return None


def offload_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> list[OffloadAdamW]:
    """The OffloadAdamW optimizers among ``optimizers`` or wrapped by them, in their order."""
    return [found for o in optimizers if (found := offload_adamw(o)) is not None]
