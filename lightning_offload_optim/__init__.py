"""Lightning extension that keeps AdamW's optimizer state in host memory.

>>> from lightning_offload_optim import OffloadAdamW
"""

from lightning_offload_optim.adamw import OffloadAdamW
from lightning_offload_optim.compat import MemoryEfficientAdamW

__all__ = ["MemoryEfficientAdamW", "OffloadAdamW"]
__version__ = "0.1.0"
