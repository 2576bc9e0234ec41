"""Simulated streams and a happens-before checker for the staging pipeline, on the CPU.

On the CPU every stream and event of the pipeline is a no-op and work runs in program order, so
a missing wait cannot show up in a result. Under :class:`StreamChecker` the CPU gets simulated
streams and events instead (through ``streams.device_module``), the work still runs at once, and
every aten op is recorded (a ``TorchDispatchMode``) with the byte ranges it reads and writes, the
stream it is queued on, and a vector clock. Two accesses to overlapping bytes, at least one a
write, conflict unless an ordering path joins them: program order on one stream, an event
recorded on one stream and waited for by another, the host waiting for an event, or the host
queuing work after its own accesses. That is the model of CUDA streams that the pipeline relies
on (torch's ``torch.cuda._sanitizer`` applies it to whole storages; here ranges are tracked,
because chunks are slices of a few large buffers).

Memory is the host's if ``host_state.host_empty`` allocated it (the optimizer's host buffers);
everything else counts as device memory. An op touching only host memory runs on the host; any
other op is queued on the current simulated stream, and the host waits for it when it touches
host memory without ``non_blocking=True`` (a synchronous copy) or returns a Python value.

Accesses are recorded per storage address. An op's fresh output starts a new history; so does any
access through a storage other than the one that last used the address: memory is also allocated
where no op output shows it (FSDP2 regrows parameter storage with ``untyped_storage().resize_()``),
and the CPU's malloc hands freed memory out again at once. A storage over part of a live host
buffer (a storage slice, as ``state_dict()`` lends) is that buffer, at its offset.

The caching allocator is simulated where it frees and allocates: a device storage belongs to the
stream current when it was allocated, which may reuse its memory as soon as it is freed, for its
next allocation. Another stream's use of freed memory conflicts with that next allocation unless
it is ordered before it (an event the allocating stream waited for, or the host waited for), or
``tensor.record_stream(stream)`` named that stream (the simulated streams are of type
``torch.Stream``, so the calls reach the checker).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_map

HOST = 0
Clock = dict[int, int]


def _join(a: Clock, b: Clock) -> Clock:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}


class SimStream(torch.Stream):
    """A simulated stream: a vector clock that counts the work queued on it. A ``torch.Stream``
    (of the CPU) so that ``tensor.record_stream`` takes it; compared by identity."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __new__(cls, checker: StreamChecker, name: str) -> SimStream:
        # ``record_stream`` receives a plain torch.Stream with the same stream_id: the id.
        return super().__new__(cls, stream_id=next(checker.ids), device_index=-1, device_type=0)

    def __init__(self, checker: StreamChecker, name: str) -> None:
        self.checker = checker
        self.id = self.stream_id
        self.name = name
        self.clock: Clock = {self.id: 0}

    def wait_event(self, event: SimEvent) -> None:
        if event.clock is not None:
            self.clock = _join(self.clock, event.clock)

    def wait_stream(self, other: SimStream) -> None:
        self.clock = _join(self.clock, other.clock)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event or SimEvent(self.checker)
        event.record(self)
        return event

    def __repr__(self) -> str:
        return self.name


class SimEvent:
    """A simulated event: the clock of its stream when recorded, and a wall-clock time."""

    def __init__(self, checker: StreamChecker, enable_timing: bool = False) -> None:
        self.checker = checker
        self.enable_timing = enable_timing
        self.clock: Clock | None = None
        self.time = 0.0

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream or self.checker.current
        self.clock = dict(stream.clock)
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        if self.clock is not None:
            self.checker.host = _join(self.checker.host, self.clock)

    def query(self) -> bool:
        """Done only once the host has waited for it (directly or through a later event): the
        device may always be behind, so readers must cope with work not done yet."""
        return self.clock is None or all(
            self.checker.host.get(k, 0) >= v for k, v in self.clock.items()
        )

    def elapsed_time(self, end: SimEvent) -> float:
        """As CUDA's: both events timed, recorded and done, else an error."""
        for event in (self, end):
            if not event.enable_timing or event.clock is None or not event.query():
                raise RuntimeError(
                    "elapsed_time of an event created without enable_timing, not recorded or "
                    "not done yet"
                )
        return (end.time - self.time) * 1000


class SimDeviceModule:
    """What ``streams.device_module`` returns for the CPU under the checker."""

    def __init__(self, checker: StreamChecker) -> None:
        self.checker = checker
        self.names = itertools.count(1)

    def Stream(self, device: Any = None, priority: int = 0) -> SimStream:  # torch's spelling
        return SimStream(self.checker, f"side stream {next(self.names)}")

    def Event(self, enable_timing: bool = False) -> SimEvent:
        return SimEvent(self.checker, enable_timing)

    def current_stream(self, device: Any = None) -> SimStream:
        return self.checker.current

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        previous, self.checker.current = self.checker.current, stream
        try:
            yield
        finally:
            self.checker.current = previous


@dataclass
class Access:
    start: int
    stop: int
    write: bool
    actor: int  # stream id, or HOST
    tick: int  # the actor's clock value at this access
    what: str


class _Recorder(TorchDispatchMode):
    def __init__(self, checker: StreamChecker) -> None:
        super().__init__()
        self.checker = checker

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` trace under the checker: its ``aot_eager`` graphs then run
        their aten ops through this mode, and are recorded as eager ops are."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        # Tensor subclasses that wrap others (DTensor, the functional collectives'
        # AsyncCollectiveTensor) have no storage of their own: let them dispatch; the ops they
        # run on their inner tensors come back through this mode and are recorded.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func is torch.ops.aten.record_stream.default:  # no CPU kernel: the checker's alone
            self.checker.record_stream(*args, **kwargs)
            return None
        out = func(*args, **kwargs)
        wraps = False
        for value in _tensors((args, kwargs, out)):
            if isinstance(value, FakeTensor):
                # Tracing: FSDP2's hooks trace some ops even with the compile ignored, and
                # DTensor's sharding propagation runs ops on fake tensors it makes (no memory
                # to check).
                return out
            wraps = wraps or is_traceable_wrapper_subclass(value)
        # An op of plain tensors may return a wrapper (a collective's result): its inner
        # tensor was recorded as the op's output.
        plain = out
        if wraps:
            plain = tree_map(lambda v: None if is_traceable_wrapper_subclass(v) else v, out)
        self.checker.record_op(func, args, kwargs, plain)
        return out


#: Ops that read no data: views, ``set_`` (which points a tensor at memory, as a view does),
#: and the storage-size check of compiled graphs' inputs.
_NO_DATA = {"detach", "alias", "_unsafe_view", "lift_fresh", "_has_same_storage_numel", "set_"}
_SCHEMAS: dict[Any, tuple[str, bool, list[tuple[str, bool]]]] = {}


def _schema(func: Any) -> tuple[str, bool, list[tuple[str, bool]]]:
    """An op's name, whether it reads data, and its arguments' names and whether each is
    written, read from its schema once."""
    found = _SCHEMAS.get(func)
    if found is None:
        name = func._schema.name.split("::")[-1]
        arguments = [
            (a.name, a.alias_info is not None and a.alias_info.is_write)
            for a in func._schema.arguments
        ]
        found = _SCHEMAS[func] = (name, not (func.is_view or name in _NO_DATA), arguments)
    return found


class StreamChecker:
    """Check that every access the pipeline makes is ordered against conflicting ones.

    Use as a context manager; :attr:`violations` lists what was found. ``expect_none()`` raises
    with a readable report.
    """

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.compute = SimStream(self, "compute stream")
        self.current = self.compute
        self.host: Clock = {HOST: 0}
        self.host_storages: set[int] = set()
        #: The host buffers' addresses, sorted, and per address its size and storage.
        self.host_starts: list[int] = []
        self.host_buffers: dict[int, tuple[int, StorageWeakRef]] = {}
        self.history: dict[int, list[Access]] = {}
        self.owners: dict[int, StorageWeakRef] = {}  # per address, the storage last seen there
        #: Per device storage address: the stream that allocated it, the streams named by
        #: ``record_stream``, and whether its free is checked (another stream used it).
        self.allocated_on: dict[int, SimStream] = {}
        self.recorded: dict[int, set[int]] = {}
        self.watched: set[int] = set()
        #: Per stream id, other streams' uses of memory it freed: (actor, tick, description),
        #: to be ordered before its next allocation.
        self.freed_in_use: dict[int, list[tuple[int, int, str]]] = {}
        self.active = False
        self.violations: list[str] = []
        self._stack = contextlib.ExitStack()

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> StreamChecker:
        # Imported here, not at the top: conftest imports this module before pytest's logging
        # capture is set up, and importing Lightning then turns off its log propagation.
        from lightning_offload_optim import host_state, streams

        module = SimDeviceModule(self)
        real_device_module = streams.device_module
        real_host_empty = host_state.host_empty

        def device_module(device: torch.device) -> Any:
            return module if device.type == "cpu" else real_device_module(device)

        def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
            buffer = real_host_empty(numel, dtype)
            storage = buffer.untyped_storage()
            key = self._claim(storage)
            self.host_storages.add(key)
            if key not in self.host_buffers:
                bisect.insort(self.host_starts, key)
            self.host_buffers[key] = (storage.nbytes(), StorageWeakRef(storage))
            self.history.pop(key, None)  # fresh host memory: no earlier users
            return buffer

        patch = self._stack.enter_context(_patch_context())
        patch(streams, "device_module", device_module)
        patch(host_state, "host_empty", host_empty)
        # torch's own stream users on the CPU (FSDP2's all-gather and reduce-scatter streams,
        # through its device handle, the torch.cpu module) get simulated streams as well.
        for name in ("Stream", "Event", "current_stream", "stream"):
            patch(torch.cpu, name, getattr(module, name))
        self._stack.enter_context(_Recorder(self))
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False  # storages freed later are not checked
        self._stack.close()

    def expect_none(self) -> None:
        if self.violations:
            shown = "\n  ".join(self.violations[:10])
            raise AssertionError(
                f"{len(self.violations)} unordered conflicting accesses:\n  {shown}"
            )

    # ------------------------------------------------------------------ recording
    def record_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name, reads_data, arguments = _schema(func)
        if not reads_data:
            return
        accesses = []  # (tensor, write)
        inputs = set()
        for position, (argument, write) in enumerate(arguments):
            if position < len(args):
                value = args[position]
            elif argument in kwargs:
                value = kwargs[argument]
            else:
                continue
            for tensor in _tensors(value):
                accesses.append((tensor, write))
                inputs.add(tensor.untyped_storage().data_ptr())
        outputs = [t for t in _tensors(out) if t.untyped_storage().data_ptr() not in inputs]
        tensors = [t for t, _ in accesses] + outputs
        if not tensors:
            return
        for tensor in tensors:
            self._claim(tensor.untyped_storage())
        touches_host = any(self._is_host(t) for t in tensors)
        on_host = all(self._is_host(t) for t in tensors)
        for tensor in outputs:  # fresh memory: forget what earlier owners of the bytes did
            key = tensor.untyped_storage().data_ptr()
            self.history.pop(key, None)
            self.allocated_on[key] = self.current
            accesses.append((tensor, True))
        if on_host:
            self.host[HOST] += 1
            actor, clock, where = HOST, self.host, "the host"
        else:
            stream = self.current
            stream.clock = _join(stream.clock, self.host)  # queued after the host's past
            if outputs:
                self._allocating(stream)
            stream.clock[stream.id] += 1
            actor, clock, where = stream.id, stream.clock, stream.name
        what = f"{name} on {where}"
        for tensor, write in accesses:
            self._access(tensor, write, actor, clock, what)
        blocking = touches_host and not _non_blocking_copy(name, args, kwargs)
        values = _leaves(out)
        returns_value = any(isinstance(v, (bool, int, float, complex)) for v in values)
        if not on_host and (blocking or returns_value):
            self.host = _join(self.host, clock)  # the host waits for this op

    def _host_alias(self, storage: torch.UntypedStorage) -> tuple[int, int] | None:
        """(address, byte offset) of the live host buffer whose memory ``storage``, another
        storage object than the buffer's, lies in; None if there is none."""
        pointer = storage.data_ptr()
        index = bisect.bisect_right(self.host_starts, pointer) - 1
        while index >= 0:  # the nearest buffer below that is alive (live ones never overlap)
            key = self.host_starts[index]
            nbytes, owner = self.host_buffers[key]
            if not owner.expired():
                break
            del self.host_starts[index], self.host_buffers[key]
            index -= 1
        else:
            return None
        if pointer >= key + nbytes or owner.cdata == storage._cdata:
            return None
        return key, pointer - key

    def _resolve(self, storage: torch.UntypedStorage) -> tuple[int, int]:
        """The address whose history ``storage``'s accesses go to, and their byte offset."""
        return self._host_alias(storage) or (storage.data_ptr(), 0)

    def _claim(self, storage: torch.UntypedStorage) -> int:
        """The address of ``storage``; if another storage used it last (since freed, or moved
        by a resize), what that one did is forgotten: the memory was allocated anew. A slice
        of a live host buffer is that buffer."""
        if (alias := self._host_alias(storage)) is not None:
            return alias[0]
        key = storage.data_ptr()
        owner = self.owners.get(key)
        if owner is None or owner.expired() or owner.cdata != storage._cdata:
            self.history.pop(key, None)
            self.host_storages.discard(key)
            self.allocated_on.pop(key, None)
            self.recorded.pop(key, None)
            self.watched.discard(key)
            self.owners[key] = StorageWeakRef(storage)
        return key

    def record_stream(self, tensor: torch.Tensor, stream: torch.Stream) -> None:
        key = self._claim(tensor.untyped_storage())
        self.recorded.setdefault(key, set()).add(stream.stream_id)

    def _watch_free(self, storage: torch.UntypedStorage, key: int) -> None:
        """Check, when ``storage`` is freed, that the allocator could not hand its memory out
        while another stream still uses it."""
        self.watched.add(key)
        checker, cdata = weakref.ref(self), storage._cdata

        def freed() -> None:
            if (live := checker()) is not None:
                live._freed(key, cdata)

        weakref.finalize(storage, freed).atexit = False

    def _freed(self, key: int, cdata: int) -> None:
        owner = self.owners.get(key)
        if not self.active or owner is None or owner.cdata != cdata:
            return
        allocator = self.allocated_on[key]
        recorded = self.recorded.get(key, set())
        in_use = self.freed_in_use.setdefault(allocator.id, [])
        for earlier in self.history.get(key, []):
            if earlier.actor not in (HOST, allocator.id) and earlier.actor not in recorded:
                what = (
                    f"device memory ([{earlier.start}, {earlier.stop})) that {earlier.what} "
                    f"{'wrote' if earlier.write else 'read'}, freed with no record_stream of "
                    f"that stream, was free for the next allocation of {allocator.name}"
                )
                in_use.append((earlier.actor, earlier.tick, what))
        self.history.pop(key, None)
        self.watched.discard(key)

    def _allocating(self, stream: SimStream) -> None:
        """``stream`` allocates: memory it freed must no longer be in use by other streams."""
        for actor, tick, what in self.freed_in_use.pop(stream.id, []):
            if max(stream.clock.get(actor, 0), self.host.get(actor, 0)) < tick:
                self.violations.append(f"{what}, which came before that use was done")

    def _is_host(self, tensor: torch.Tensor) -> bool:
        return self._resolve(tensor.untyped_storage())[0] in self.host_storages

    def _access(
        self, tensor: torch.Tensor, write: bool, actor: int, clock: Clock, what: str
    ) -> None:
        if tensor.numel() == 0:
            return
        size = tensor.element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        storage = tensor.untyped_storage()
        key, base = self._resolve(storage)
        start = base + tensor.storage_offset() * size
        stop = start + extent * size
        history = self.history.setdefault(key, [])
        host = key in self.host_storages
        kind = "host buffer" if host else "device memory"
        allocator = self.allocated_on.get(key)  # None: allocated out of sight (another thread)
        unseen = host or allocator is None or key in self.watched
        if not unseen and actor not in (HOST, allocator.id):
            self._watch_free(storage, key)
        for earlier in history:
            overlaps = earlier.start < stop and start < earlier.stop
            if not overlaps or not (write or earlier.write):
                continue
            if clock.get(earlier.actor, 0) < earlier.tick:
                self.violations.append(
                    f"{what} {'writes' if write else 'reads'} {kind} bytes [{start}, {stop}) "
                    f"that {earlier.what} {'wrote' if earlier.write else 'read'} "
                    f"([{earlier.start}, {earlier.stop})) with no event ordering the two"
                )
        access = Access(start, stop, write, actor, clock[actor], what)
        history[:] = [
            a
            for a in history
            if not (
                a.actor == actor and start <= a.start and a.stop <= stop and (write or not a.write)
            )
        ]
        history.append(access)


def _non_blocking_copy(name: str, args: tuple, kwargs: dict) -> bool:
    if name == "copy_":
        return bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
    return name == "_to_copy" and bool(kwargs.get("non_blocking", False))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # most arguments
        return [value] if value.layout == torch.strided else []
    if not isinstance(value, (list, tuple, dict)):
        return []
    return [v for v in _leaves(value) if isinstance(v, torch.Tensor) and v.layout == torch.strided]


def _leaves(value: Any) -> list[Any]:
    """The leaves of an op's arguments or results: aten ops take and return only lists,
    tuples and (keyword arguments) dicts of them. Several times faster than
    ``torch.utils._pytree.tree_flatten``, which dominated the checker's time."""
    found: list[Any] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, (list, tuple)):
            pending.extend(reversed(item))
        elif isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
        else:
            found.append(item)
    return found


@contextlib.contextmanager
def _patch_context() -> Iterator[Any]:
    saved: list[tuple[Any, str, Any]] = []

    def patch(target: Any, name: str, value: Any) -> None:
        saved.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    try:
        yield patch
    finally:
        for target, name, value in reversed(saved):
            setattr(target, name, value)
