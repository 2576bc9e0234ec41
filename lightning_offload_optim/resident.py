"""Keep part of the state on the device: the share that fits never crosses the link.

Each arena may keep a *resident* prefix, whole parameters from its start, in device buffers of
its own: those chunks are updated there in place with the same fused kernel and are never
copied. Arenas are laid out in the order the forward pass first uses parameters (when the
optimizer overlaps it), so the resident prefix holds the parameters the next forward needs
first and the rest streams while their layers compute. The host buffers stay the state of
record: the pipeline copies resident state back before anyone reads them
(``state_dict()``, checkpoints, ``offloaded_state``) and reloads it after they are written (a
load), so checkpoints look the same whatever the split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_offload_optim.host_state import Arena

#: "auto" leaves this share of the device's memory free, and at least :data:`AUTO_MARGIN_BYTES`.
AUTO_MARGIN = 0.1
AUTO_MARGIN_BYTES = 2 << 30

Resident = float | int | str | None


def check_resident(resident: Resident) -> Resident:
    """Validate the ``resident`` argument: a share of the state (a float in [0, 1]), a byte
    budget (an int >= 0), ``"auto"`` or ``None`` (nothing resident)."""
    if resident is None or resident == "auto":
        return resident
    if isinstance(resident, bool) or not isinstance(resident, (int, float)):
        raise TypeError(
            f"resident must be a share of the state (a float in [0, 1]), a number of bytes "
            f"(an int), 'auto' or None; got {resident!r}"
        )
    if isinstance(resident, float) and not (0.0 <= resident <= 1.0 and math.isfinite(resident)):
        raise ValueError(f"resident as a share of the state must be in [0, 1], got {resident}")
    if isinstance(resident, int) and resident < 0:
        raise ValueError(f"resident as a number of bytes must be >= 0, got {resident}")
    return resident


def free_device_memory(device: torch.device) -> int | None:
    """Bytes this process may still allocate on ``device``, or None where torch cannot say (the
    CPU): what the device has free, and no more than the caching allocator's cap
    (``torch.cuda.set_per_process_memory_fraction``) leaves beyond what it has reserved."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    # The getter is newer than our oldest supported torch; without it, assume no cap.
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    cap = int(fraction * total)
    return max(0, min(free, cap - torch.cuda.memory_reserved(device)))


def total_memory(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def budget_bytes(resident: Resident, arenas: Sequence[Arena], held: int = 0) -> int:
    """The bytes of the state of ``arenas`` (those staged to a device) to keep resident;
    ``held``: resident bytes allocated now, which the new choice replaces."""
    if resident is None or not arenas:
        return 0
    if resident == "auto":
        free = free_device_memory(arenas[0].device)
        if free is None:
            return 0
        margin = max(int(AUTO_MARGIN * total_memory(arenas[0].device)), AUTO_MARGIN_BYTES)
        return max(0, free + held - margin)
    if isinstance(resident, float):
        return int(resident * sum(a.state_bytes(a.numel) for a in arenas))
    return int(resident)


def resident_prefixes(arenas: Sequence[Arena], ends: Sequence[list[int]], budget: int) -> list[int]:
    """Per arena (in order), the elements of its resident prefix: the whole parameters from its
    start that fit in what is left of ``budget`` bytes. ``ends[i]`` lists where each parameter
    of arena ``i`` ends, in memory order (so a prefix never splits a parameter)."""
    prefixes = []
    for arena, arena_ends in zip(arenas, ends, strict=True):
        per_element = arena.state_bytes(1)
        numel = 0
        for end in arena_ends:
            if end * per_element > budget:
                break
            numel = end
        budget -= numel * per_element
        prefixes.append(numel)
    return prefixes
