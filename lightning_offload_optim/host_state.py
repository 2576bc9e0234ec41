"""Optimizer state in a few large host buffers, one flat buffer per state key.

Parameters that share a device, a state dtype and a set of state keys are laid out one after
another in an *arena*; a parameter's state is a slice of each of the arena's buffers. Chunks of
consecutive parameters are therefore contiguous slices, moved with one copy per key.

Buffers are pinned (page-locked) when asked. On CUDA an ordinary allocation is registered with
the runtime instead of using torch's pinned allocator, which rounds every allocation up to a
power of two (up to 2x the host RAM for one large buffer).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: torch.optim.AdamW's state keys that live in host buffers (``step`` stays in ``optimizer.state``).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
#: The fp32 copy of a bf16/fp16 parameter that the update is computed on.
MASTER_KEY = "master_param"


def state_dtype(param: Tensor) -> torch.dtype:
    """The dtype the state of ``param`` is kept in: at least float32, float64 for double params."""
    real = param.real.dtype if param.is_complex() else param.dtype
    return torch.promote_types(real, torch.float32)


def state_keys(param: Tensor, amsgrad: bool) -> tuple[str, ...]:
    """The host buffers ``param`` needs: the moments, and a master copy for low-precision params."""
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    if state_dtype(param) != (param.real.dtype if param.is_complex() else param.dtype):
        keys.append(MASTER_KEY)
    return tuple(keys)


@dataclass(frozen=True)
class ParamLayout:
    """How a parameter maps onto a flat, real, memory-ordered slice of state.

    Dense permuted layouts (channels_last) are kept in memory order, as ``zeros_like`` would.
    """

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    numel: int  # real elements: twice the parameter's numel for complex parameters
    order: tuple[int, ...]  # dims of the real view sorted from outermost to innermost in memory

    @classmethod
    def of(cls, param: Tensor) -> ParamLayout:
        real = torch.view_as_real(param) if param.is_complex() else param
        order = tuple(sorted(range(real.dim()), key=lambda d: -real.stride(d)))
        if not real.permute(order).is_contiguous():
            raise ValueError(
                f"OffloadAdamW needs dense parameters; got one of shape {tuple(param.shape)} "
                f"with strides {param.stride()} (overlapping or with gaps)"
            )
        return cls(param.shape, param.stride(), param.dtype, param.device, real.numel(), order)

    def flat(self, tensor: Tensor) -> Tensor:
        """A flat real view of a tensor laid out like the parameter (a copy if it is not)."""
        real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        ordered = real.permute(self.order)
        return ordered.reshape(-1)

    def unflat(self, flat: Tensor) -> Tensor:
        """The inverse of :meth:`flat`: a view of ``flat`` shaped and strided like the param."""
        real_shape = tuple(self.shape) + ((2,) if self.dtype.is_complex else ())
        ordered_shape = [real_shape[d] for d in self.order]
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        real = flat.view(ordered_shape).permute(inverse)
        return torch.view_as_complex(real) if self.dtype.is_complex else real

    def describe(self) -> str:
        return f"shape {tuple(self.shape)}, dtype {self.dtype}, device {self.device}"


def _register_pinned(buffer: Tensor) -> bool:
    """Page-lock an ordinary CUDA-visible host allocation in place; False if that failed."""
    cudart = torch.cuda.cudart()
    nbytes = buffer.numel() * buffer.element_size()
    return int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) == 0


def _unregister_pinned(pointers: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for pointer in pointers:
        cudart.cudaHostUnregister(pointer)


class Arena:
    """Host buffers, one per state key, for parameters laid out one after another."""

    def __init__(
        self,
        layouts: Sequence[ParamLayout],
        keys: tuple[str, ...],
        dtype: torch.dtype,
        pin: bool,
    ) -> None:
        self.keys = keys
        self.dtype = dtype
        self.device = layouts[0].device
        self.offsets: list[int] = []
        self.numel = 0
        for layout in layouts:
            self.offsets.append(self.numel)
            self.numel += layout.numel
        self.buffers: dict[str, Tensor] = {}
        registered: list[int] = []
        pinned_by = []
        for key in keys:
            self.buffers[key], how = _host_empty(self.numel, dtype, pin)
            pinned_by.append(how)
            if how == "registered" and self.numel:
                registered.append(self.buffers[key].data_ptr())
        self.pinned = all(how is not None for how in pinned_by)
        if registered:
            weakref.finalize(self, _unregister_pinned, registered)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers.values())


def _host_empty(numel: int, dtype: torch.dtype, pin: bool) -> tuple[Tensor, str | None]:
    """An uninitialised host buffer, pinned if asked: ``(buffer, how it was pinned or None)``."""
    if not pin:
        return torch.empty(numel, dtype=dtype), None
    if torch.cuda.is_available():
        buffer = torch.empty(numel, dtype=dtype)
        if numel == 0 or _register_pinned(buffer):
            return buffer, "registered"
    # Other accelerators, or registration refused: torch's pinned allocator (rounds up).
    return torch.empty(numel, dtype=dtype, pin_memory=True), "allocator"


@dataclass
class Slot:
    """Where one parameter's state lives: an arena and an offset into its buffers.

    ``master_ready`` is False until the master copy holds the parameter's value (set at the
    first step, or by a checkpoint that carried it).
    """

    arena: Arena
    offset: int
    layout: ParamLayout
    master_ready: bool = False

    def view(self, key: str) -> Tensor:
        """The flat host slice holding ``key`` for this parameter."""
        return self.arena.buffers[key][self.offset : self.offset + self.layout.numel]


class HostState:
    """All offloaded state of one optimizer, keyed by parameter."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.slots: dict[Tensor, Slot] = {}
        self.arenas: list[Arena] = []

    def allocate(self, requests: Sequence[tuple[Tensor, tuple[str, ...]]]) -> None:
        """Lay out new parameters, one arena per (device, dtype, keys), contents undefined."""
        by_kind: dict[tuple, list[Tensor]] = {}
        for param, keys in requests:
            by_kind.setdefault((param.device, state_dtype(param), keys), []).append(param)
        new_slots: dict[Tensor, Slot] = {}
        new_arenas = []
        for (_, dtype, keys), params in by_kind.items():
            layouts = [ParamLayout.of(p) for p in params]
            arena = Arena(layouts, keys, dtype, self.pin)
            new_arenas.append(arena)
            for param, layout, offset in zip(params, layouts, arena.offsets, strict=True):
                new_slots[param] = Slot(arena, offset, layout)
        self.slots.update(new_slots)
        self.arenas.extend(new_arenas)

    @property
    def logical_bytes(self) -> int:
        """Bytes of state held: the sum over parameters and keys of numel * element size."""
        return sum(
            s.layout.numel * s.arena.dtype.itemsize * len(s.arena.keys) for s in self.slots.values()
        )

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the buffers occupy (>= logical_bytes when slots were dropped)."""
        return sum(a.allocated_bytes for a in self.arenas)

    @property
    def pinned(self) -> bool:
        return bool(self.arenas) and all(a.pinned for a in self.arenas)
