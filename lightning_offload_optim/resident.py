"""Keep part of the state on the device: the share that fits never crosses the link.

The resident state is whole parameters, chosen in the order the forward pass first uses them
(when the optimizer overlaps it; else as the param groups list them): each is kept if its state
fits in what is left of the budget, so the parameters the next forward needs first are ready at
once and the rest streams while their layers compute. Their host ranges need not be adjacent
(after a resume the host buffers keep the checkpoint's parameter order); on the device they are
packed one after another in buffers of their own, where the same fused kernel updates them in
place, never copied. The host buffers stay the state of record: the pipeline copies resident
state back before anyone reads them (``state_dict()``, checkpoints, ``offloaded_state``) and
reloads it after they are written (a load), so checkpoints look the same whatever the split.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_offload_optim.host_state import Arena, Slot

#: "auto" leaves this share of the device's memory free, and at least :data:`AUTO_MARGIN_BYTES`.
AUTO_MARGIN = 0.1
AUTO_MARGIN_BYTES = 2 << 30

Resident = float | int | str | None


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
    """``device``'s memory in bytes (a CUDA device: only those report free memory)."""
    return torch.cuda.get_device_properties(device).total_memory


def budget_bytes(
    resident: Resident, arenas: Sequence[Arena], held: Mapping[torch.device, int] | None = None
) -> dict[torch.device, int]:
    """Per device, the bytes of the state of ``arenas`` (those staged to a device) to keep
    resident there: a share of that device's state, the same number of bytes on each device,
    or what ``"auto"`` finds free on it; ``held``: resident bytes allocated now on each
    device, which the new choice replaces."""
    held = held or {}
    by_device: dict[torch.device, list[Arena]] = {}
    for arena in arenas:
        by_device.setdefault(arena.device, []).append(arena)
    budgets = {}
    for device, on_device in by_device.items():
        if resident == "auto":
            free = free_device_memory(device)
            if free is None:  # nothing known to be free: keep nothing
                budgets[device] = 0
                continue
            margin = auto_margin(total_memory(device))
            budgets[device] = max(0, free + held.get(device, 0) - margin)
        else:
            state = sum(a.state_bytes(a.numel) for a in on_device)
            budgets[device] = fixed_budget(resident, state)
    return budgets


def auto_margin(total: int) -> int:
    """Bytes ``"auto"`` leaves free on a device of ``total`` bytes."""
    return max(int(AUTO_MARGIN * total), AUTO_MARGIN_BYTES)


def fixed_budget(resident: float | int | None, state: int) -> int:
    """The resident budget on a device holding ``state`` bytes of state, for any ``resident``
    but ``"auto"``: none, a share of the state, or a number of bytes."""
    if resident is None:
        return 0
    if isinstance(resident, float):
        return int(resident * state)
    return int(resident)


def choose_resident(
    slots: Iterable[Slot], budgets: Mapping[torch.device, int]
) -> dict[Arena, ResidentRanges]:
    """The state to keep resident within ``budgets`` (bytes per device): ``slots`` in order of
    preference (the parameters the forward pass uses first), each whole parameter kept if its
    state fits in what is left of its device's budget, so one too large is passed over for
    smaller ones after it. Arenas with nothing resident are left out."""
    left = dict(budgets)
    taken: dict[Arena, list[tuple[int, int]]] = {}
    for slot in slots:
        nbytes = slot.arena.state_bytes(slot.layout.numel)
        if nbytes <= left.get(slot.arena.device, 0):
            left[slot.arena.device] -= nbytes
            taken.setdefault(slot.arena, []).append((slot.offset, slot.offset + slot.layout.numel))
    return {arena: ResidentRanges.of(pieces) for arena, pieces in taken.items()}


@dataclass(frozen=True)
class ResidentRanges:
    """The ranges ``[start, stop)`` of an arena kept on the device, sorted and apart (adjacent
    ones merged). On the device they lie one after another from offset 0."""

    ranges: tuple[tuple[int, int], ...] = ()
    #: Where each range starts on the device, and the total at the end.
    _device: list[int] = field(init=False, compare=False, repr=False)
    #: Every range's start and stop: a chunk never spans one (it is resident or not as a whole).
    edges: frozenset[int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        device = [0]
        for start, stop in self.ranges:
            device.append(device[-1] + stop - start)
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "edges", frozenset(e for r in self.ranges for e in r))

    @classmethod
    def of(cls, pieces: Iterable[tuple[int, int]]) -> ResidentRanges:
        """From disjoint ranges in any order; empty ones dropped, adjacent ones merged."""
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(p for p in pieces if p[1] > p[0]):
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        return cls(tuple(merged))

    @property
    def numel(self) -> int:
        """Elements kept on the device (per state key)."""
        return self._device[-1]

    def device_start(self, start: int, stop: int) -> int | None:
        """Where the host range ``[start, stop)`` lies in the device buffers, or None where it
        is not resident as a whole."""
        index = bisect.bisect_right(self.ranges, (start, math.inf)) - 1
        if index < 0 or stop > self.ranges[index][1]:
            return None
        return self._device[index] + start - self.ranges[index][0]

    def pieces(self) -> Iterator[tuple[slice, slice]]:
        """Per range, its slice of the host buffers and of the device buffers."""
        for (start, stop), device in zip(self.ranges, self._device, strict=False):
            yield slice(start, stop), slice(device, device + stop - start)
