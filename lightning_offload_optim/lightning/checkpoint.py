"""Offload metadata recorded in Lightning checkpoints, and the check made when loading one."""

from __future__ import annotations

from typing import Any

import torch

from lightning_offload_optim.adamw import OffloadAdamW

#: Checkpoint key holding the metadata.
CHECKPOINT_KEY = "lightning_offload_optim"
#: Version of the layout of offloaded optimizer state inside a checkpoint. A loader refuses a
#: newer one; older ones (and checkpoints without the key) load.
FORMAT_VERSION = 1


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
            for index, opt in enumerate(optimizers)
            if isinstance(opt, OffloadAdamW)
        ],
    }


def check_metadata(checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint written by a future, incompatible format; accept all others."""
    metadata = checkpoint.get(CHECKPOINT_KEY)
    if metadata is None:
        return
    version = metadata.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise RuntimeError(
            f"This checkpoint's offloaded optimizer state has format version {version!r} "
            f"(written by lightning-offload-optim {metadata.get('package_version', '?')}); this "
            f"installation reads versions up to {FORMAT_VERSION}. Upgrade lightning-offload-optim "
            "to resume from it."
        )
