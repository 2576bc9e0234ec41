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

    @property
    def permuted(self) -> bool:
        return self.order != tuple(range(len(self.order)))

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
        if not self.permuted:
            return real.reshape(-1)
        return real.permute(self.order).reshape(-1)

    def unflat(self, flat: Tensor) -> Tensor:
        """The inverse of :meth:`flat`: a view of ``flat`` shaped and strided like the param."""
        real_shape = tuple(self.shape) + ((2,) if self.dtype.is_complex else ())
        ordered_shape = [real_shape[d] for d in self.order]
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        real = flat.view(ordered_shape).permute(inverse)
        return torch.view_as_complex(real) if self.dtype.is_complex else real

    def describe(self) -> str:
        return f"shape {tuple(self.shape)}, dtype {self.dtype}, device {self.device}"


def _register_pinned(buffer: Tensor, device: torch.device) -> None:
    """Page-lock an ordinary host allocation in place, for every CUDA context (portable)."""
    cudart = torch.cuda.cudart()
    nbytes = buffer.numel() * buffer.element_size()
    with torch.cuda.device(device):
        error = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 1))  # Portable
    if error != 0:
        raise RuntimeError(
            f"could not pin {nbytes / 2**30:.2f} GiB of host memory for the optimizer state "
            f"(cudaHostRegister error {error}); the locked-memory limit (ulimit -l) may be too "
            "low. Pass pin_memory=False to keep the state in pageable memory (slower copies)."
        )


def _release_pinned(pointers: list[int], in_flight: list[torch.Event | None]) -> None:
    """Finalizer: wait for the last copy into the buffers, then unregister them."""
    if in_flight[0] is not None:
        in_flight[0].synchronize()
    cudart = torch.cuda.cudart()
    for pointer in pointers:
        cudart.cudaHostUnregister(pointer)


class Arena:
    """Host buffers, one per state key, for parameters laid out one after another.

    Buffers of parameters on an accelerator are pinned when ``pin`` (those of CPU parameters
    never are: nothing is copied). Copies still writing into them when the arena is dropped are
    waited for before the memory is unpinned and freed.
    """

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
        self.pinned = pin and self.device.type != "cpu"
        self._in_flight: list[torch.Event | None] = [None]
        registered: list[int] = []
        if self.pinned and self.device.type == "cuda" and self.numel:
            weakref.finalize(self, _release_pinned, registered, self._in_flight)
        self.buffers: dict[str, Tensor] = {}
        for key in keys:
            if not self.pinned or self.numel == 0:
                self.buffers[key] = torch.empty(self.numel, dtype=dtype)
            elif self.device.type == "cuda":
                self.buffers[key] = torch.empty(self.numel, dtype=dtype)
                _register_pinned(self.buffers[key], self.device)
                registered.append(self.buffers[key].data_ptr())
            else:  # other accelerators: torch's pinned allocator (rounds sizes up)
                self.buffers[key] = torch.empty(self.numel, dtype=dtype, pin_memory=True)

    def written_by(self, event: torch.Event | None) -> None:
        """Note the copy that last writes into the buffers (waited for before they are freed)."""
        self._in_flight[0] = event

    @property
    def allocated_bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers.values())


@dataclass
class Slot:
    """Where one parameter's state lives: an arena and an offset into its buffers."""

    arena: Arena
    offset: int
    layout: ParamLayout
    _flat_param: tuple[int, Tensor] | None = None

    def view(self, key: str) -> Tensor:
        """The flat host slice holding ``key`` for this parameter."""
        return self.arena.buffers[key][self.offset : self.offset + self.layout.numel]

    def flat_param(self, param: Tensor) -> Tensor:
        """A flat real view of ``param`` (cached while its storage stays the same)."""
        pointer = param.data_ptr()
        if self._flat_param is None or self._flat_param[0] != pointer:
            self._flat_param = (pointer, self.layout.flat(param))
        return self._flat_param[1]


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
