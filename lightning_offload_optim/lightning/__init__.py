"""The Lightning-facing parts: the mixin, the monitor callback, checkpoint metadata."""

from lightning_offload_optim.lightning.mixin import OffloadOptimizerMixin
from lightning_offload_optim.lightning.monitor import OffloadMonitor

__all__ = ["OffloadMonitor", "OffloadOptimizerMixin"]
