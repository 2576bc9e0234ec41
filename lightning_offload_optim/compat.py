"""The original design's name and positional signature, kept so existing code keeps working."""

from __future__ import annotations

from torch import Tensor
from torch.optim.optimizer import ParamsT

from lightning_offload_optim.adamw import OffloadAdamW


class MemoryEfficientAdamW(OffloadAdamW):
    """:class:`OffloadAdamW` under its original name and positional argument order.

    Example:
        >>> import torch
        >>> opt = MemoryEfficientAdamW(torch.nn.Linear(2, 2).parameters(), 1e-3, (0.9, 0.999),
        ...                            1e-8, 1e-2, False, None, True)
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        pin_memory: bool | None = None,
        enabled: bool = True,
        **kwargs: object,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            pin_memory=pin_memory,
            enabled=enabled,
            **kwargs,  # type: ignore[arg-type]
        )
