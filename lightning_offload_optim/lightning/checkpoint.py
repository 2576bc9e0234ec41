"""Offload metadata recorded in Lightning checkpoints, and the check made when loading one."""

from __future__ import annotations

from typing import Any

import torch

from lightning_offload_optim.lightning.optimizers import offload_adamw
from lightning_offload_optim.validation import FORMAT_VERSION, check_format_version

#: Checkpoint key holding the metadata.
CHECKPOINT_KEY = "lightning_offload_optim"


def offload_metadata(optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """What a checkpoint records: package and format versions, each OffloadAdamW's settings."""
    from lightning_offload_optim import __version__

    return {
        "format_version": FORMAT_VERSION,
        "package_version": __version__,
        "optimizers": [
            {
                "index": index,
                "enabled": opt.enabled,
                "chunk_size": opt.chunk_size,
                "pin_memory": opt.pin_memory,
            }
            for index, wrapper in enumerate(optimizers)
            if (opt := offload_adamw(wrapper)) is not None
        ],
    }


def check_metadata(checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint written by a future, incompatible format; accept all others.

    Run from ``on_load_checkpoint``, before the optimizer exists; ``OffloadAdamW.load_state_dict``
    checks the version stored in its own state dict again, for runs without the mixin.
    """
    metadata = checkpoint.get(CHECKPOINT_KEY)
    if metadata is not None:
        written_by = f" (written by lightning-offload-optim {metadata.get('package_version', '?')})"
        check_format_version(metadata.get("format_version"), written_by)
