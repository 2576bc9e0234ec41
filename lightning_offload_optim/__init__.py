"""Lightning extension that keeps AdamW's optimizer state in host memory.

>>> from lightning_offload_optim import OffloadAdamW, OffloadMonitor, OffloadOptimizerMixin
"""

__version__ = "0.1.0"

from lightning_offload_optim.adamw import OffloadAdamW
from lightning_offload_optim.compat import MemoryEfficientAdamW
from lightning_offload_optim.lightning import OffloadMonitor, OffloadOptimizerMixin
from lightning_offload_optim.pipeline import StagingPool
from lightning_offload_optim.plan import MemoryPlan, plan

__all__ = [
    "MemoryEfficientAdamW",
    "MemoryPlan",
    "OffloadAdamW",
    "OffloadMonitor",
    "OffloadOptimizerMixin",
    "StagingPool",
    "plan",
]
