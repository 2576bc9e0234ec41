"""Optimizer state in a few large host buffers, one flat buffer per state key.

Parameters that share a device, a state dtype, a set of state keys and realness are laid out one
after another in an *arena*; a parameter's state is a slice of each of the arena's buffers.
Chunks of consecutive parameters are therefore contiguous slices, moved with one copy per key.
Complex parameters get arenas of their own, so every complex slot starts at an even offset and
its real view can be viewed as complex again.

Buffers of staged parameters are pinned (page-locked) when asked. On CUDA an allocation of our
own, whole pages of an anonymous mapping, is registered with the runtime: torch's pinned
allocator rounds every allocation up to a power of two (up to 2x the host RAM), and registering
an ordinary allocation that shares a page with another registered one fails. When pinning fails
(memlock limits, containers that cap pinned memory) the state stays in pageable memory, with one
warning.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import mmap
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from lightning_offload_optim.resident import ResidentRanges
from lightning_offload_optim.sharding import local

#: torch.optim.AdamW's state keys that live in host buffers (``step`` stays in ``optimizer.state``).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
#: The fp32 copy of a bf16/fp16 parameter that the update is computed on.
MASTER_KEY = "master_param"

#: Every key kept in host buffers.
OFFLOADED_KEYS = (*MOMENT_KEYS, MASTER_KEY)

PAGE_SIZE = mmap.PAGESIZE
#: One cudaHostRegister call fails at 512 GiB or more: larger buffers are registered in pieces.
MAX_REGISTRATION_BYTES = 256 << 30


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


class Offloaded:
    """What ``optimizer.state[param]`` holds under a key whose values live in host buffers.

    The key is listed where tools look for state names (a flattened distributed checkpoint
    rebuilds only the names it finds there), but no tensor is: Lightning copies every tensor in
    ``optimizer.state`` to the GPU when it resumes. ``state_dict()`` and
    ``offloaded_state(param)`` give the values.
    """

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"<{self.key} in host memory: see optimizer.offloaded_state(param)>"

    def __getattr__(self, name: str) -> Any:
        """Code that takes it for the tensor (``state["exp_avg"].norm()``, ``torch.norm`` reading
        ``.layout``) is told where the values are."""
        if name.startswith("__") or name == "key":  # protocols (copy, pickle) and unset slots
            raise AttributeError(name)
        raise AttributeError(
            f"optimizer.state holds no tensor for the offloaded {self.key!r}, so no {name!r}: "
            f"its values live in host buffers; read optimizer.offloaded_state(param)"
            f"[{self.key!r}] (or state_dict())"
        )

    def __reduce__(self) -> tuple:
        return (Offloaded, (self.key,))


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

    @cached_property  # read per parameter and step
    def permuted(self) -> bool:
        return self.order != tuple(range(len(self.order)))

    @classmethod
    def of(cls, param: Tensor, where: str = "a parameter") -> ParamLayout:
        """The layout of ``param``'s local part (its shard, for a DTensor); ``where`` names the
        parameter in the error for one that is not dense."""
        param = local(param)
        real = torch.view_as_real(param) if param.is_complex() else param
        order = tuple(sorted(range(real.dim()), key=lambda d: -real.stride(d)))
        if not real.permute(order).is_contiguous():
            raise ValueError(
                f"OffloadAdamW needs dense parameters; {where} has shape {tuple(param.shape)} "
                f"and strides {param.stride()} (overlapping or with gaps: expanded, or a "
                "strided slice of a larger tensor?)"
            )
        return cls(param.shape, param.stride(), param.dtype, param.device, real.numel(), order)

    def flat(self, tensor: Tensor) -> Tensor:
        """A flat, contiguous real view of a tensor laid out like the parameter (a copy if it is
        not: a gradient expanded from one element, a ``.real`` or ``[..., 0]`` view, whose flat
        view would be strided, and the fused kernel reads its tensors as contiguous)."""
        real = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        if self.permuted:
            real = real.permute(self.order)
        return real.reshape(-1).contiguous()

    def unflat(self, flat: Tensor) -> Tensor:
        """The inverse of :meth:`flat`: a view of ``flat`` shaped and strided like the param."""
        real_shape = tuple(self.shape) + ((2,) if self.dtype.is_complex else ())
        ordered_shape = [real_shape[d] for d in self.order]
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        real = flat.view(ordered_shape).permute(inverse)
        return torch.view_as_complex(real) if self.dtype.is_complex else real

    def describe(self) -> str:
        return (
            f"shape {tuple(self.shape)}, strides {self.stride}, dtype {self.dtype}, "
            f"device {self.device}"
        )


# ------------------------------------------------------------------------------ allocation
def host_empty(numel: int, dtype: torch.dtype) -> Tensor:
    """A pageable host buffer for state (the tests' stream checker watches this seam). The
    device is named: a default device set by the user (``torch.set_default_device("cuda")``)
    must not take the state off the host."""
    return torch.empty(numel, dtype=dtype, device="cpu")


def own_storage_view(view: Tensor) -> Tensor:
    """The same memory as ``view`` in a tensor whose storage is just the span it covers (a
    storage slice, which keeps the parent buffer alive).

    pickle, and ``torch.save`` of one tensor, write a tensor's whole storage: a view of a
    buffer shared by many parameters would write the buffer once per view. torch 2.13 also
    cannot deep-copy or ``torch.save`` a DTensor whose local tensor has a storage offset.
    """
    if view.numel() == 0:
        return view.new_empty(view.shape)
    offset, itemsize = view.storage_offset(), view.element_size()
    span = 1 + sum(
        (size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True)
    )
    storage = view.untyped_storage()[offset * itemsize : (offset + span) * itemsize]
    return view.new_empty(0).set_(storage, 0, view.shape, view.stride())


class PinningError(RuntimeError):
    """Host memory could not be page-locked (the state then stays pageable)."""


def _consume_cuda_error() -> None:
    """A failed CUDA runtime call leaves its error behind as the thread's "last error", and
    torch's next kernel launch check would raise it as its own. A tiny launch consumes it."""
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda")


def _cuda_host_register(pointer: int, nbytes: int, device: torch.device) -> int:
    """cudaHostRegister(Portable): page-lock a host range for every CUDA context."""
    with torch.cuda.device(device):
        error = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 1))
        if error != 0:
            _consume_cuda_error()
    return error


def _cuda_host_unregister(pointer: int) -> int:
    """cudaHostUnregister; the error code is returned (a release cannot do anything with it)."""
    error = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if error != 0:
        _consume_cuda_error()
    return error


def registered_empty(
    numel: int,
    dtype: torch.dtype,
    register: Callable[[int, int], int],
    unregister: Callable[[int], object] = _cuda_host_unregister,
) -> tuple[Tensor, list[int]]:
    """A flat host buffer whose pages belong to it alone, registered with ``register``.

    The memory is an anonymous mapping of whole pages: no other allocation shares a registered
    page (registering a page twice fails), and the buffer's storage starts at the registered
    address (torch's ``is_pinned()`` asks about the storage's start). Forked processes (a
    DataLoader's workers, each epoch) do not inherit it: Linux copies every pinned page of a
    private mapping into the child at ``fork()`` (since 5.9; before, the parent's next write
    moved it off the page the device reads), which for gigabytes of state per worker would
    exhaust the host. Ranges of :data:`MAX_REGISTRATION_BYTES` or more are registered in
    pieces. Returns the buffer and the registered pointers; raises :class:`PinningError` naming
    the error, also where the host refuses to keep the pages out of forks (nothing stays
    registered then).
    """
    nbytes = numel * dtype.itemsize
    rounded = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # not Windows
    mapping = mmap.mmap(-1, rounded, **private)
    if hasattr(mmap, "MADV_DONTFORK"):  # Linux
        try:
            mapping.madvise(mmap.MADV_DONTFORK)
        except OSError as error:  # a sandbox without it: pinned pages would be copied at fork
            mapping.close()
            raise PinningError(f"madvise(MADV_DONTFORK) failed: {error}") from error
    pages = torch.frombuffer(mapping, dtype=torch.uint8)
    registered: list[int] = []
    for offset in range(0, rounded, MAX_REGISTRATION_BYTES):
        pointer = pages.data_ptr() + offset
        error = register(pointer, min(MAX_REGISTRATION_BYTES, rounded - offset))
        if error != 0:
            for done in registered:
                unregister(done)
            raise PinningError(
                f"cudaHostRegister of {rounded / 2**30:.2f} GiB failed with error {error}"
            )
        registered.append(pointer)
    return pages[:nbytes].view(dtype), registered


def _pinned_empty(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, list[int]]:
    """A pinned host buffer for state staged to ``device``; :class:`PinningError` if the host
    refuses to pin it."""
    if device.type == "cuda":
        return registered_empty(numel, dtype, lambda p, n: _cuda_host_register(p, n, device))
    # Other accelerators: torch's pinned allocator (rounds sizes up to a power of two).
    try:
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True), []
    except RuntimeError as error:
        raise PinningError(str(error)) from error


#: Releases put off because this thread was capturing a CUDA graph when they came due.
_deferred_releases: list[tuple[list[int], list[torch.Event | None], list[Tensor]]] = []


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _release_pinned(
    pointers: list[int], in_flight: list[torch.Event | None], keep_alive: list[Tensor]
) -> None:
    """Finalizer: wait for the last copies into and out of the buffers, then unregister them.

    ``keep_alive`` holds the buffers, so their memory outlives the registration. Waiting for
    an event and unregistering are not allowed while a CUDA graph is captured (an arena may be
    garbage-collected inside a ``torch.compile(mode="reduce-overhead")`` capture): then the
    release waits for the next arena to be created or freed outside a capture.
    """
    _deferred_releases.append((pointers, in_flight, keep_alive))
    _release_deferred()


def _release_deferred() -> None:
    """Release the pinned buffers whose release was put off, unless a capture is on."""
    while not _capturing():
        try:  # a finalizer run meanwhile (garbage collection, another thread) may take it
            pointers, in_flight, keep_alive = _deferred_releases.pop()
        except IndexError:
            return
        for event in in_flight:
            if event is not None:
                event.synchronize()
        for pointer in pointers:
            _cuda_host_unregister(pointer)
        keep_alive.clear()


class Arena:
    """Host buffers, one per state key, for parameters laid out one after another.

    ``pin`` asks for page-locked buffers; :attr:`pinned` says whether they are. Copies still
    writing into pinned buffers when the arena is dropped are waited for before the memory is
    unpinned and freed. Raises :class:`PinningError` if pinning was asked for and failed.
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
        self.pinned = pin and self.numel > 0
        #: The ranges kept resident on the device (set by the pipeline).
        self.resident = ResidentRanges()
        self._in_flight: list[torch.Event | None] = [None, None]  # last write, last read
        self.buffers: dict[str, Tensor] = {}
        if not self.pinned:
            for key in keys:
                self.buffers[key] = host_empty(self.numel, dtype)
            return
        _release_deferred()  # memory put off at a capture goes before more is pinned
        registered: list[int] = []
        try:
            for key in keys:
                self.buffers[key], pointers = _pinned_empty(self.numel, dtype, self.device)
                registered.extend(pointers)
        except BaseException:
            for pointer in registered:
                _cuda_host_unregister(pointer)
            raise
        if registered:
            buffers = list(self.buffers.values())
            weakref.finalize(self, _release_pinned, registered, self._in_flight, buffers)

    def written_by(self, event: torch.Event | None) -> None:
        """Note the copy that last writes into the buffers (waited for before they are freed)."""
        self._in_flight[0] = event

    def read_by(self, event: torch.Event | None) -> None:
        """Note a copy out of the buffers queued ahead of a step (waited for before freeing)."""
        self._in_flight[1] = event

    def state_bytes(self, numel: int) -> int:
        """Bytes of state (every key) of ``numel`` elements of this arena."""
        return numel * self.dtype.itemsize * len(self.keys)

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
    #: The parameter's :func:`~lightning_offload_optim.sharding.write_mark` after this
    #: optimizer last wrote it (None: not since the state was laid out, loaded or lent out as
    #: views). A parameter whose mark moved on was written by someone else: its master copy
    #: takes the edits at the next step.
    param_mark: tuple[int, int, int] | None = None

    def view(self, key: str) -> Tensor:
        """The flat host slice holding ``key`` for this parameter."""
        return self.arena.buffers[key][self.offset : self.offset + self.layout.numel]

    def flat_param(self, param: Tensor) -> Tensor:
        """A flat real view of ``param``, a plain tensor (a DTensor's local shard), cached while
        its storage stays the same.

        A view of ``param.detach()``: a view of the parameter itself would hold a reference to
        it, and ``torch.utils.swap_tensors`` (``load_state_dict(assign=True)``, ``Module.to``
        with swapping on) refuses tensors that something else references.
        """
        pointer = param.data_ptr()
        if self._flat_param is None or self._flat_param[0] != pointer:
            self._flat_param = (pointer, self.layout.flat(param.detach()))
        return self._flat_param[1]

    def forget_param(self) -> None:
        """Drop the cached view of the parameter (it keeps the parameter's memory alive)."""
        self._flat_param = None

    def relayout(self, new: ParamLayout) -> None:
        """Reorder the state to the parameter's ``new`` strides (same shape, dtype and device).

        The state stays in the parameter's memory order, so the fused kernel sees parameter,
        gradient and state element for element. Values are unchanged.
        """
        for key in self.arena.keys:
            view = self.view(key)
            view.copy_(new.flat(self.layout.unflat(view).clone()))
        self.layout = new
        self.forget_param()


class HostState:
    """All offloaded state of one optimizer, keyed by parameter.

    ``pin_for(device)`` says whether state staged to ``device`` should be pinned. The first
    failure to pin warns once and keeps this optimizer's later buffers pageable too.
    """

    def __init__(self, pin_for: Callable[[torch.device], bool]) -> None:
        self.pin_for = pin_for
        self.pin_failed = False
        self.slots: dict[Tensor, Slot] = {}
        self.arenas: list[Arena] = []
        #: Storages of the views ``state_dict()`` lent, and those a load has written over since.
        self._lent: weakref.WeakSet = weakref.WeakSet()
        self._written_over: weakref.WeakSet = weakref.WeakSet()

    def allocate(self, requests: Sequence[tuple[Tensor, tuple[str, ...]]]) -> dict[Tensor, Slot]:
        """Lay out new parameters, one arena per kind; contents undefined.

        The slots are not part of this state until :meth:`adopt`, so a step that fails after
        allocating leaves the state as it was.
        """
        by_kind: dict[tuple, list[Tensor]] = {}
        for param, keys in requests:
            kind = (param.device, state_dtype(param), keys, param.is_complex())
            by_kind.setdefault(kind, []).append(param)
        new_slots: dict[Tensor, Slot] = {}
        for (device, dtype, keys, _), params in by_kind.items():
            layouts = [ParamLayout.of(p) for p in params]
            arena = self._arena(layouts, keys, dtype, device)
            for param, layout, offset in zip(params, layouts, arena.offsets, strict=True):
                new_slots[param] = Slot(arena, offset, layout)
        return new_slots

    def _arena(
        self, layouts: list[ParamLayout], keys: tuple[str, ...], dtype: torch.dtype, device
    ) -> Arena:
        if self.pin_failed or not self.pin_for(device):
            return Arena(layouts, keys, dtype, pin=False)
        try:
            return Arena(layouts, keys, dtype, pin=True)
        except PinningError as error:
            self.pin_failed = True
            warnings.warn(
                f"OffloadAdamW could not pin host memory for its state ({error}); keeping it "
                "in pageable memory, so host<->device copies are slower and do not overlap "
                "compute. Raise the locked-memory limit (ulimit -l, or the container's) or pass "
                "pin_memory=False to silence this. OffloadMonitor logs host_pinned=0.",
                stacklevel=5,
            )
            return Arena(layouts, keys, dtype, pin=False)

    def reusable(
        self, requests: Sequence[tuple[Tensor, tuple[str, ...]]]
    ) -> dict[Tensor, Slot] | None:
        """The current slots of the requested parameters, if every one has a slot with these
        keys and its parameter's current layout (so it can be written in place); else None."""
        found = {}
        for param, keys in requests:
            slot = self.slots.get(param)
            if slot is None or slot.arena.keys != keys or slot.layout != ParamLayout.of(param):
                return None
            found[param] = slot
        return found

    def lend(self, view: Tensor) -> Tensor:
        """``view`` as handed out by ``state_dict()``: with a storage of its own, remembered for
        as long as it (or any view of it) lives."""
        lent = own_storage_view(view)
        if lent.numel():
            self._lent.add(lent.untyped_storage())
        return lent

    def written_over(self, sources: Iterable[Tensor]) -> None:
        """A load wrote ``sources`` into the buffers in place: the views lent earlier, other
        than those loaded, now show the loaded state instead of what they were lent with."""
        loaded = {id(source.untyped_storage()) for source in sources}
        touches = self._overlap_test()
        for storage in list(self._lent):
            if id(storage) not in loaded and touches(storage.data_ptr(), storage.nbytes()):
                self._written_over.add(storage)
                self._lent.discard(storage)

    def was_written_over(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` views a lent storage that a load has written over since."""
        return tensor.untyped_storage() in self._written_over

    def overlaps(self, *tensors: Tensor) -> bool:
        """Whether any of ``tensors`` shares memory with any of the host buffers (pass them
        all in one call: each call sorts the buffers)."""
        touches = self._overlap_test()
        return any(
            touches(storage.data_ptr(), storage.nbytes())
            for tensor in tensors
            if tensor.device.type == "cpu" and tensor.numel()
            # all of the storage: a cautious answer is a safe one
            for storage in (tensor.untyped_storage(),)
        )

    def _overlap_test(self) -> Callable[[int, int], bool]:
        """A test of whether ``nbytes`` from address ``start`` share memory with a host buffer,
        by binary search: a load checks each of its tensors against the buffers of every arena
        (one per step on which parameters first got a gradient: many, for MoE experts first
        routed at different steps)."""
        spans = sorted(
            (b.data_ptr(), b.data_ptr() + b.nbytes)
            for a in self.arenas
            for b in a.buffers.values()
            if b.numel()
        )
        starts = [start for start, _ in spans]
        reach = list(itertools.accumulate((end for _, end in spans), max))  # furthest end so far

        def touches(start: int, nbytes: int) -> bool:
            last = bisect.bisect_left(starts, start + nbytes) - 1  # the last buffer starting before
            return nbytes > 0 and last >= 0 and reach[last] > start

        return touches

    def adopt(self, slots: dict[Tensor, Slot]) -> None:
        """Make allocated slots part of this state; free arenas no slot uses any more."""
        self.slots.update(slots)
        used = {id(slot.arena) for slot in self.slots.values()}
        known = {id(arena) for arena in self.arenas}
        self.arenas = [a for a in self.arenas if id(a) in used]
        for slot in slots.values():
            if id(slot.arena) not in known:
                known.add(id(slot.arena))
                self.arenas.append(slot.arena)

    def replace(self, slots: dict[Tensor, Slot]) -> None:
        """Make ``slots`` the whole state (a loaded checkpoint); free the arenas of the old one."""
        self.slots = {}
        self.arenas = []
        self.adopt(slots)

    @property
    def logical_bytes(self) -> int:
        """Bytes of state held: the sum over parameters and keys of numel * element size."""
        return sum(s.arena.state_bytes(s.layout.numel) for s in self.slots.values())

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the buffers occupy (more than logical_bytes by page rounding when pinned)."""
        return sum(a.allocated_bytes for a in self.arenas)

    @property
    def pinned(self) -> bool:
        """Whether every buffer holding state is page-locked (empty arenas hold none)."""
        holding = [a for a in self.arenas if a.numel]
        return bool(holding) and all(a.pinned for a in holding)
