"""Chunk planning and the staging pipeline that moves state to the parameters' device and back.

A step's state is cut into chunks of at most ``chunk_numel`` elements (a resident parameter
that needs no buffer is never split, see :func:`plan_chunks`). Each chunk is one
contiguous range of an arena (so one copy per state key), holding pieces of one or more
parameters. On an accelerator each chunk is copied into one of a few staging buffers on a copy
stream, updated on the compute stream, and copied back on a second copy stream; events order the
three, so copies overlap the update and the host never waits inside a step. Extra device memory
is ``num_buffers`` staging buffers whatever the model size (one where a step is one chunk).
Optimizers given one :class:`StagingPool` share its buffers and streams, taking the buffers in
turn, so that many optimizers stepped one after another hold ``num_buffers`` chunks in all.

When the parameters live on the host (CPU training) the update runs on the host buffers in place;
``force_staging=True`` runs the staged path there too, so CPU tests exercise it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_offload_optim.functional import SPLIT_ALIGNMENT
from lightning_offload_optim.host_state import MASTER_KEY, Arena, Slot
from lightning_offload_optim.interrupts import notices_held
from lightning_offload_optim.resident import ResidentRanges
from lightning_offload_optim.step_stats import COPY_IN, COPY_OUT, STEP, StepRecord
from lightning_offload_optim.streams import PipelineStreams
from lightning_offload_optim.validation import is_int

#: Key of the staging scratch that low-precision gradients are cast into.
GRAD_KEY = "grad"


@dataclass
class Segment:
    """The piece ``[start, stop)`` of active parameter ``index`` (flat, real), inside a chunk.
    A chunk's segments tile it in order."""

    index: int
    start: int
    stop: int


@dataclass
class Chunk:
    """A contiguous range ``[start, stop)`` of one arena, moved and updated as a unit."""

    arena: Arena
    start: int
    stop: int
    segments: list[Segment] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def resident(self) -> bool:
        """Whether the chunk lies in its arena's resident state (kept on the device)."""
        return self.arena.resident.device_start(self.start, self.stop) is not None

    def host_views(self) -> dict[str, Tensor]:
        return {key: buf[self.start : self.stop] for key, buf in self.arena.buffers.items()}


def plan_chunks(slots: Sequence[Slot], chunk_numel: int | Callable[[Arena], int]) -> list[Chunk]:
    """Cut the state of the active parameters (``slots``, in step order) into chunks.

    ``chunk_numel`` bounds the chunks, for all arenas or per arena. Parameters are taken in
    memory order; a gap (a parameter without a gradient this step) starts a new chunk, so no
    state is moved that is not updated. A parameter larger than the room left is split at a
    multiple of :data:`SPLIT_ALIGNMENT` from its start, except one whose state is resident in
    an arena without a master copy: its chunk needs no buffer (:func:`buffer_keys`), so it is
    never split; one larger than the room left starts a chunk of its own (one update and one
    event for the parameter, not one per ``chunk_numel`` of it).
    """
    limit = chunk_numel if callable(chunk_numel) else lambda arena: chunk_numel
    order = sorted(range(len(slots)), key=lambda i: (id(slots[i].arena), slots[i].offset))
    chunks: list[Chunk] = []
    current: Chunk | None = None
    for index in order:
        slot = slots[index]
        bound = limit(slot.arena)
        whole = _needs_no_buffer(slot)
        done = 0
        while done < slot.layout.numel:
            position = slot.offset + done
            contiguous = (
                current is not None
                and current.arena is slot.arena
                and current.stop == position
                # a non-empty chunk ends where a resident range starts or stops
                and not (current.numel and position in slot.arena.resident.edges)
            )
            room = bound - current.numel if contiguous else 0
            take = slot.layout.numel - done
            if take > room and not (whole and contiguous and not current.numel):
                take = 0 if whole else room - room % SPLIT_ALIGNMENT
            if take <= 0:
                current = Chunk(slot.arena, position, position)
                chunks.append(current)
                continue
            current.segments.append(Segment(index, done, done + take))
            current.stop += take
            done += take
    return chunks


#: A kind of chunk, staged through buffer sets of its own: the device and the state's dtype.
Kind = tuple[torch.device, torch.dtype]


def staging_needs(
    chunks: Iterable[Chunk],
    stages: Callable[[torch.device], bool],
    num_buffers: int,
    shared: bool = False,
) -> dict[Kind, tuple[int, dict[str, int]]]:
    """What a step of ``chunks`` needs of staging, per kind of chunk (device and state dtype):
    how many buffer sets, and per key the elements of each (its largest chunk). A staged
    device (``stages``) gets ``num_buffers`` sets, so that a chunk loads while the one before it
    computes, but one where a single chunk of the kind needs buffers and the buffers are not
    ``shared`` with other optimizers (it takes the first: one optimizer per parameter, stepped
    in backward, would otherwise hold twice its state in staging); a device updated in place
    needs one gradient scratch at most (its chunks run one after another). Kinds whose chunks
    need no buffer map to no keys."""
    needs: dict[Kind, tuple[int, dict[str, int]]] = {}
    for chunk in chunks:
        kind = (chunk.arena.device, chunk.arena.dtype)
        users, sizes = needs.get(kind, (0, {}))
        keys = buffer_keys(chunk, stages(chunk.arena.device))
        for key in keys:
            sizes[key] = max(sizes.get(key, 0), chunk.numel)
        needs[kind] = (users + bool(keys), sizes)
    return {
        kind: (num_buffers if stages(kind[0]) and (users > 1 or shared) else 1, sizes)
        for kind, (users, sizes) in needs.items()
    }


def _needs_no_buffer(slot: Slot) -> bool:
    """Whether the slot's whole state, as one chunk on a staging device, needs no buffer (it is
    resident in an arena without a master copy), so it needs no bound either."""
    whole = Chunk(slot.arena, slot.offset, slot.offset + slot.layout.numel)
    return not buffer_keys(whole, stages=True)


ChunkUpdate = Callable[[Chunk, dict[str, Tensor]], None]


def buffer_keys(chunk: Chunk, stages: bool) -> tuple[str, ...]:
    """The buffers a chunk needs (:meth:`StagingPipeline.prepare` sizes them, the memory
    planner counts them): its state keys when its device ``stages`` and it is not resident,
    and a gradient scratch when the update runs on an fp32 master copy."""
    keys = chunk.arena.keys if stages and not chunk.resident else ()
    return (*keys, GRAD_KEY) if MASTER_KEY in chunk.arena.keys else keys


@dataclass
class _Resident:
    """Device buffers holding an arena's resident ranges one after another, per state key."""

    buffers: dict[str, Tensor]
    valid: bool = False  # they hold what the host buffers hold (or newer)
    dirty: bool = False  # they hold newer values than the host buffers

    def pairs(self, arena: Arena) -> Iterator[tuple[Tensor, Tensor]]:
        """Per state key and resident range of ``arena``, its host view and device view."""
        for key, buffer in self.buffers.items():
            for on_host, on_device in arena.resident.pieces():
                yield arena.buffers[key][on_host], buffer[on_device]


class StagingPool:
    """Staging buffers and copy streams, shared by the optimizers built with the same pool.

    Each :class:`~lightning_offload_optim.OffloadAdamW` stages its chunks through buffers of its
    own by default: up to ``num_buffers`` chunk-sized sets per device. Optimizers given one
    pool take their chunks through its sets in turn instead (a step starts at the set after the
    one the last step used, so the next optimizer's first chunk loads while the last one's
    chunk computes), and together hold ``num_buffers`` sets of their largest chunk. That is the
    memory of one optimizer where one optimizer per parameter is stepped in backward (the
    PyTorch tutorial's "optimizer step in backward"); without a pool they would hold about
    their whole state on the device again, one set each.

    The optimizers of a pool step one at a time: a lock orders their steps, the copies they
    queue ahead and their releases, called from several threads (autograd runs each device's
    backward hooks in a thread of its own). Each may step on a stream of the caller's; the
    pool orders its steps one after another on the device too, whatever their streams.
    ``release_device_memory()`` of any of them frees the pool's buffers; the next step
    allocates them again. Pickled or deep-copied together, optimizers share a new pool.

    Example:
        >>> from lightning_offload_optim import OffloadAdamW, StagingPool
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        >>> pool = StagingPool()
        >>> optimizers = {p: OffloadAdamW([p], staging_pool=pool) for p in model.parameters()}
        >>> for p in model.parameters():  # each parameter steps as soon as its gradient is ready
        ...     _ = p.register_post_accumulate_grad_hook(lambda p: optimizers[p].step())
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> all(optimizers[p].state[p]["step"] == 1 for p in model.parameters())
        True
    """

    def __init__(self, num_buffers: int = 2) -> None:
        if not is_int(num_buffers):
            raise TypeError(f"num_buffers must be an int, got {num_buffers!r}")
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be at least 1, got {num_buffers}")
        self.num_buffers = int(num_buffers)
        #: Whether optimizers share it: a step then takes the sets from where the last left off.
        self.shared = True
        self.streams: dict[torch.device, PipelineStreams] = {}
        #: Per kind of chunk (device, state dtype), the buffer sets, and per set the event after
        #: the last copy-out from it (``None``: nothing queued, or no streams).
        self.buffers: dict[Kind, list[dict[str, Tensor]]] = {}
        self.free: dict[Kind, list[torch.Event | None]] = {}
        #: Per kind and set, a token of the last copy-in into it: a copy queued ahead of a step
        #: is still there if its token is.
        self.loads: dict[tuple[Kind, int], object] = {}
        #: Per kind, the set the next step starts with (where the pool is shared).
        self.next_set: dict[Kind, int] = {}
        #: Devices where buffers were allocated since the last step, and per allocation the
        #: event after it on the stream that allocated them, which may have used the memory
        #: just before (the caching allocator's reuse): the next step's updates and copy-ins
        #: wait for them. Other steps' copy-ins do not wait, so the first overlaps the end of
        #: the backward.
        self.fresh: dict[torch.device, list[torch.Event | None]] = {}
        #: Per device, the streams updates ran on (their buffers' memory is freed only after
        #: the work queued there), and the event after the last step's updates.
        self.computes: dict[torch.device, set[torch.Stream]] = {}
        self.last_update: dict[torch.device, torch.Event | None] = {}
        #: How many times its buffers were released (a step prepared before one prepares again).
        self.releases = 0
        self.lock = threading.RLock()

    @classmethod
    def private(cls, num_buffers: int) -> StagingPool:
        """A pool of one optimizer's own: every step starts at the first set."""
        pool = cls(num_buffers)
        pool.shared = False
        return pool

    def __repr__(self) -> str:
        return f"StagingPool(num_buffers={self.num_buffers})"

    def __reduce__(self) -> tuple[type, tuple[int]]:
        """Pickled (or deep-copied) as an empty pool: buffers and streams belong to a process.
        Optimizers pickled together share the new one, as pickle keeps one object once."""
        return (type(self), (self.num_buffers,))

    def streams_for(self, device: torch.device) -> PipelineStreams:
        if device not in self.streams:
            self.streams[device] = PipelineStreams(device)
        return self.streams[device]

    def grow(self, needs: dict[Kind, tuple[int, dict[str, int]]]) -> None:
        """Allocate what :func:`staging_needs` says that the pool does not hold yet. A set
        reallocated no longer holds what was loaded into it."""
        for (device, dtype), (count, sizes) in needs.items():
            if not sizes:
                continue
            streams = self.streams_for(device)
            buffers = self.buffers.setdefault((device, dtype), [])
            buffers.extend({} for _ in range(count - len(buffers)))
            allocated = False
            try:  # what was allocated is in the pool, also if a later allocation fails
                for number, buffer in enumerate(buffers):
                    for key, numel in sizes.items():
                        if key in buffer and buffer[key].numel() >= numel:
                            continue
                        if key in buffer:
                            self.retire(device, [buffer[key]])
                        buffer[key] = torch.empty(numel, dtype=dtype, device=device)
                        streams.used_by_side_streams(buffer[key])
                        self.loads.pop(((device, dtype), number), None)
                        allocated = True
            finally:
                if allocated:
                    self.allocated(device)

    def allocated(self, device: torch.device) -> None:
        """Buffers were just allocated on ``device``, on the caller's current stream there."""
        streams = self.streams_for(device)
        self.fresh.setdefault(device, []).append(streams.record(streams.compute()))

    def free_events(self, kind: Kind) -> list[torch.Event | None]:
        return self.free.setdefault(kind, [None] * self.num_buffers)

    def updated_on(self, device: torch.device, stream: torch.Stream | None) -> None:
        """A step's updates run on ``stream`` (a caller's, or the update stream)."""
        if isinstance(stream, torch.Stream):
            self.computes.setdefault(device, set()).add(stream)

    def retire(self, device: torch.device, tensors: Iterable[Tensor]) -> None:
        """Buffers about to be freed: their memory goes back to the stream that allocated
        them, for its next allocation, only after the updates queued on other streams."""
        for tensor in tensors:
            for stream in self.computes.get(device, ()):
                tensor.record_stream(stream)

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers and gradient scratch held, on every device."""
        return sum(
            t.untyped_storage().nbytes()
            for buffers in self.buffers.values()
            for buffer in buffers
            for t in buffer.values()
        )

    def release(self) -> None:
        """Free the buffers (the allocator keeps their memory until the side streams' work
        queued on them is done)."""
        for (device, _), buffers in self.buffers.items():
            self.retire(device, [t for buffer in buffers for t in buffer.values()])
        self.buffers.clear()
        self.free.clear()
        self.loads.clear()
        self.next_set.clear()
        self.releases += 1


class StagingPipeline:
    """Runs an update over chunks, staging them on the parameters' device when it is not the host.

    Args:
        chunk_numel: elements per chunk and per state key (a multiple of ``SPLIT_ALIGNMENT``).
        force_staging: stage through separate buffers even when parameters are on the CPU.
        num_buffers: staging buffers per device; two let one chunk load while another computes.
        pool: the :class:`StagingPool` to stage through, shared with other pipelines; by
            default one of its own with ``num_buffers`` sets.
    """

    def __init__(
        self,
        chunk_numel: int,
        force_staging: bool = False,
        num_buffers: int = 2,
        pool: StagingPool | None = None,
    ) -> None:
        self.chunk_numel = chunk_numel
        self.force_staging = force_staging
        self.pool = pool if pool is not None else StagingPool.private(num_buffers)
        self.num_buffers = self.pool.num_buffers
        # The event after the last copy-out into this pipeline's host buffers, per device.
        self._host_ready: dict[torch.device, torch.Event | None] = {}
        self._resident: weakref.WeakKeyDictionary[Arena, _Resident] = weakref.WeakKeyDictionary()
        # Copy-ins queued ahead of a step, by chunk position: (arena id, start, stop, staging
        # set), the event after the copy, and the load's token (see StagingPool.loads).
        self._prefetched: dict[int, tuple[tuple[int, int, int, int], torch.Event | None, object]]
        self._prefetched = {}
        self._prepared_at = -1  # the pool's releases when prepare() last ran
        # The host buffers are lent out as views until the next step: no copies queue ahead.
        self._views_lent = False
        #: Copies queued between steps (prefetches, write-backs of resident state): the next
        #: step's record counts them.
        self._between_steps = StepRecord()
        self.last_record: StepRecord | None = None
        self.updated: list[torch.Event | None] = []

    def take_between_steps(self) -> StepRecord:
        """The copies queued since the last run (a fresh record counts the next ones)."""
        record, self._between_steps = self._between_steps, StepRecord()
        return record

    def stages(self, device: torch.device) -> bool:
        return self.force_staging or device.type != "cpu"

    def prepare(self, chunks: Sequence[Chunk]) -> None:
        """Allocate every buffer the chunks need, before anything is mutated.

        Buffers hold the largest chunk (at most ``chunk_numel``), so a small model does not
        reserve full-size staging; :func:`staging_needs` says how many sets of them.
        """
        with notices_held(), self.pool.lock:
            self.pool.grow(staging_needs(chunks, self.stages, self.num_buffers, self.pool.shared))
            self._prepared_at = self.pool.releases

    def prepare_again(self, chunks: Sequence[Chunk]) -> None:
        """:meth:`prepare` again if the pool's buffers were released since (by another thread:
        call it holding the pool's lock, up to :meth:`run`)."""
        if self._prepared_at != self.pool.releases:
            self.prepare(chunks)

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers and gradient scratch held (the pool's, shared with
        the other optimizers of a :class:`StagingPool`), on every device."""
        return self.pool.staging_bytes

    @property
    def _streams(self) -> dict[torch.device, PipelineStreams]:
        return self.pool.streams

    def set_resident(self, chosen: dict[Arena, ResidentRanges]) -> None:
        """Keep ``chosen[arena]`` of each arena on its device (buffers allocated here, filled
        from the host at the next run); empty ranges keep none. Call :meth:`wait_host` first,
        so that resident state that is newer than the host's is not lost. If an allocation
        fails (out of device memory), the arenas not yet given buffers keep nothing resident."""
        for arena in chosen:  # the old buffers are freed first: the new ones may reuse them
            if (old := self._resident.pop(arena, None)) is not None:
                self.pool.retire(arena.device, old.buffers.values())
            arena.resident = ResidentRanges()
        for arena, ranges in chosen.items():
            if numel := ranges.numel:
                streams = self.pool.streams_for(arena.device)
                buffers = {}
                for key in arena.keys:
                    buffers[key] = torch.empty(numel, dtype=arena.dtype, device=arena.device)
                    streams.used_by_side_streams(buffers[key])
                self.pool.allocated(arena.device)
                self._resident[arena] = _Resident(buffers)
                arena.resident = ranges

    @property
    def resident_bytes(self) -> int:
        """Bytes of state kept resident on the devices."""
        return sum(self.resident_bytes_by_device.values())

    @property
    def resident_bytes_by_device(self) -> dict[torch.device, int]:
        """Bytes of state kept resident, per device."""
        held: dict[torch.device, int] = {}
        for arena, resident in self._resident.items():
            nbytes = sum(t.untyped_storage().nbytes() for t in resident.buffers.values())
            held[arena.device] = held.get(arena.device, 0) + nbytes
        return held

    def host_written(self) -> None:
        """The host buffers were written (a load): reload resident state from them, and drop
        copies queued ahead of the step."""
        for resident in self._resident.values():
            resident.valid = False
        self._prefetched = {}

    def lend_host_views(self) -> None:
        """The host buffers were handed out as views (``state_dict()``) that the caller may write
        through until the next step, after a forward pass too: reload resident state from
        them, and queue no copies ahead of that step (they could read the host before the
        caller's writes)."""
        self.host_written()
        self._views_lent = True

    def prefetch(self, chunks: Sequence[Chunk]) -> None:
        """Queue now the copy-in of the first chunks of the next step (as many as there are
        staging buffers, with buffers already allocated), e.g. while the backward pass runs, so
        the link is busy before the step begins. The state does not depend on the gradients;
        :meth:`run` uses these copies for the same chunks in the same places."""
        if self._prefetched or self._views_lent:
            return  # queued already (another forward pass before the same step), or lent
        with notices_held(), self.pool.lock:
            self._prefetch(chunks)

    def _prefetch(self, chunks: Sequence[Chunk]) -> None:
        record = self._between_steps  # with copies queued before it and dropped by a load
        for device in {chunk.arena.device for chunk in chunks if self.stages(chunk.arena.device)}:
            streams = self._streams.get(device)
            if streams is not None:  # after the last copy-out into the host buffers
                streams.wait(streams.copy_in, self._host_ready.get(device))
        sets, _ = self._sets(chunks)
        taken: dict[Kind, int] = {}
        for index, (chunk, number) in enumerate(zip(chunks, sets, strict=True)):
            if chunk.resident or not self.stages(chunk.arena.device):
                continue
            if chunk.arena.device in self.pool.fresh:  # the next step's copies wait for those
                continue
            kind = (chunk.arena.device, chunk.arena.dtype)
            taken[kind] = taken.get(kind, 0) + 1
            if taken[kind] > self.num_buffers:  # the first chunks take the sets in order
                continue
            buffers = self.pool.buffers.get(kind, [])
            if len(buffers) <= number:
                continue
            if any(
                k not in buffers[number] or buffers[number][k].numel() < chunk.numel
                for k in chunk.arena.keys
            ):
                continue
            staged = {key: buffers[number][key][: chunk.numel] for key in chunk.arena.keys}
            loaded, token = self._load(chunk, staged, number, record)
            chunk.arena.read_by(loaded)
            position = (id(chunk.arena), chunk.start, chunk.stop, number)
            self._prefetched[index] = (position, loaded, token)

    def _sets(self, chunks: Sequence[Chunk]) -> tuple[list[int], dict[Kind, int]]:
        """Per chunk, the staging set it takes; and per kind, the set the next step starts
        with. A kind's staged chunks take the sets in turn, from the first (or, in a shared
        pool, from the one after the last step's), so a chunk loads while the one before it
        computes; other chunks use the next one's gradient scratch (on the update's stream,
        in order)."""
        turns: dict[Kind, int] = {}
        sets = []
        for chunk in chunks:
            kind = (chunk.arena.device, chunk.arena.dtype)
            if kind not in turns:
                turns[kind] = self.pool.next_set.get(kind, 0) if self.pool.shared else 0
            sets.append(turns[kind] % self.num_buffers)
            if self.stages(chunk.arena.device) and not chunk.resident:
                turns[kind] += 1
        return sets, {kind: turn % self.num_buffers for kind, turn in turns.items()}

    def _staged_keys(self, chunk: Chunk) -> tuple[str, ...]:
        return buffer_keys(chunk, self.stages(chunk.arena.device))

    def run(
        self, chunks: Sequence[Chunk], update: ChunkUpdate, overlap: bool = False
    ) -> StepRecord:
        """Call ``update(chunk, views)`` for every chunk, ``views`` holding its state by key.

        ``views`` also holds a :data:`GRAD_KEY` scratch for chunks with a master copy. Staged
        chunks are written back to the host asynchronously; :meth:`wait_host` waits for that,
        also after a step interrupted partway (:meth:`_settle`). With ``overlap`` the updates
        run on each device's update stream, after the work queued so far on the caller's
        stream, which does not wait for them: :attr:`updated` holds, per chunk, the event after
        which its parameters are updated (``None`` where it ran in program order). Returns the
        step's :class:`StepRecord` (also kept as :attr:`last_record`).
        """
        with self.pool.lock:
            return self._run(chunks, update, overlap)

    def _run(self, chunks: Sequence[Chunk], update: ChunkUpdate, overlap: bool) -> StepRecord:
        record = self.take_between_steps()
        prefetched, self._prefetched = self._prefetched, {}
        lent, self._views_lent = self._views_lent, False  # their writes are read now
        started = time.perf_counter()
        staged = {chunk.arena.device for chunk in chunks if self.stages(chunk.arena.device)}
        begins, computes = {}, {}
        self.updated = []
        for device in staged:
            streams = self._streams[device]
            compute = computes[device] = streams.update if overlap else streams.compute()
            if overlap:  # after the backward pass (and clipping) that made the gradients
                streams.wait(compute, streams.record(streams.compute()))
            if self.pool.shared:  # after the pool's last step, on whatever stream it ran
                streams.wait(compute, self.pool.last_update.get(device))
            self.pool.updated_on(device, compute)
            begins[device] = streams.record(compute, timing=True)
            # Memory just allocated, which the stream that allocated it may have used just
            # before, or host buffers the caller's stream may still write (through views lent,
            # with non-blocking copies): the updates and the copy-ins come after.
            fresh = self.pool.fresh.pop(device, None)
            for allocated in fresh or ():
                streams.wait(compute, allocated)
            if fresh is not None or lent:
                streams.wait(streams.copy_in, streams.record(compute))
            # The host buffers may still be written by the last copy-out.
            streams.wait(streams.copy_in, self._host_ready.get(device))
        sets, next_sets = self._sets(chunks)
        try:
            for index, (chunk, number) in enumerate(zip(chunks, sets, strict=True)):
                kind = (chunk.arena.device, chunk.arena.dtype)
                is_staged = chunk.arena.device in staged
                number = number if is_staged else 0
                keys = self._staged_keys(chunk)
                buffer = self.pool.buffers[kind][number] if keys else {}
                views = {key: buffer[key][: chunk.numel] for key in keys}
                if is_staged and chunk.resident:
                    compute = computes[chunk.arena.device]
                    self.updated.append(self._run_resident(chunk, views, update, record, compute))
                elif is_staged:
                    compute = computes[chunk.arena.device]
                    # A copy queued ahead is this chunk's if it went to the same range and set
                    # and no copy went there since: a plan changed since (a new resident share)
                    # may give the range a later set or turn, and another optimizer of a shared
                    # pool may have used the set.
                    ahead = prefetched.get(index)
                    loaded = (
                        ahead[1]
                        if ahead is not None
                        and ahead[0] == (id(chunk.arena), chunk.start, chunk.stop, number)
                        and self.pool.loads.get((kind, number)) is ahead[2]
                        else self._load(chunk, views, number, record)[0]
                    )
                    self.updated.append(
                        self._run_staged(chunk, views, update, number, record, compute, loaded)
                    )
                else:
                    update(chunk, views | chunk.host_views())
                    self.updated.append(None)
        except BaseException:
            self._settle(computes, chunks)
            raise
        self.pool.next_set.update(next_sets)
        if self.pool.shared:
            for device in staged:
                streams = self._streams[device]
                self.pool.last_update[device] = streams.record(computes[device])
        timed_on_device = False
        for device in staged:
            streams = self._streams[device]
            if streams.is_async:
                # Ends after the last copy-out and the last update. The copy-out stream follows
                # the update from here on, so what it queues later (resident state written
                # back) and the memory recorded for it come after the update, even when the
                # update ran on a stream of the caller's that nothing of ours waits for.
                end = streams.timed_join(streams.copy_out, computes[device])
                record.add_span(STEP, begins[device], end)
                timed_on_device = True
        if not timed_on_device:
            record.add_seconds(STEP, time.perf_counter() - started)
        self.last_record = record
        return record

    def _run_staged(
        self,
        chunk: Chunk,
        staged: dict[str, Tensor],
        update: ChunkUpdate,
        number: int,
        record: StepRecord,
        compute: torch.Stream | None,
        loaded: torch.Event | None,
    ) -> torch.Event | None:
        """Update on ``compute`` one chunk loaded (``loaded``) into staging buffer ``number``,
        and write it back; the event after its update."""
        device = chunk.arena.device
        streams = self._streams[device]
        free = self.pool.free_events((device, chunk.arena.dtype))
        host = chunk.host_views()
        streams.wait(compute, loaded)
        with streams.on(compute):
            update(chunk, staged)
        computed = streams.record(compute)
        with streams.on(streams.copy_out):
            streams.wait(streams.copy_out, computed)
            with record.span(COPY_OUT, streams, streams.copy_out) as copied:
                for key, view in host.items():
                    view.copy_(staged[key], non_blocking=True)
            free[number] = self._host_ready[device] = copied.event
            chunk.arena.written_by(free[number])
        record.bytes_out += chunk.arena.state_bytes(chunk.numel)
        return computed

    def _load(
        self, chunk: Chunk, staged: dict[str, Tensor], number: int, record: StepRecord
    ) -> tuple[torch.Event | None, object]:
        """Queue the copy of a chunk's host state into staging set ``number``; the event after
        it, and the copy's token (now the set's in :attr:`StagingPool.loads`)."""
        device = chunk.arena.device
        streams = self._streams[device]
        free = self.pool.free_events((device, chunk.arena.dtype))
        token = self.pool.loads[((device, chunk.arena.dtype), number)] = object()
        host = chunk.host_views()
        with streams.on(streams.copy_in):
            streams.wait(streams.copy_in, free[number])  # the last copy-out from this buffer
            with record.span(COPY_IN, streams, streams.copy_in) as copied:
                for key, view in host.items():
                    staged[key].copy_(view, non_blocking=True)
            loaded = copied.event
        record.bytes_in += chunk.arena.state_bytes(chunk.numel)
        return loaded, token

    def _run_resident(
        self,
        chunk: Chunk,
        scratch: dict[str, Tensor],
        update: ChunkUpdate,
        record: StepRecord,
        compute: torch.Stream | None,
    ) -> torch.Event | None:
        """Update one chunk in its arena's resident buffers, loading them first if stale."""
        streams = self._streams[chunk.arena.device]
        resident = self._resident[chunk.arena]
        ranges = chunk.arena.resident
        if not resident.valid:
            with streams.on(streams.copy_in):
                with record.span(COPY_IN, streams, streams.copy_in) as copied:
                    for host, device in resident.pairs(chunk.arena):
                        device.copy_(host, non_blocking=True)
                uploaded = copied.event
                streams.wait(compute, uploaded)
                chunk.arena.read_by(uploaded)
            record.bytes_in += chunk.arena.state_bytes(ranges.numel)
            resident.valid = True
        start = ranges.device_start(chunk.start, chunk.stop)
        views = {key: b[start : start + chunk.numel] for key, b in resident.buffers.items()}
        with streams.on(compute):
            update(chunk, views | scratch)
        resident.dirty = True
        return streams.record(compute)

    def _flush_resident(self) -> None:
        """Queue copies of resident state newer than the host's back into the host buffers,
        on the copy-out stream, which every run (and :meth:`_settle`) left ordered after the
        updates that wrote it."""
        for arena, resident in list(self._resident.items()):
            if not resident.dirty:
                continue
            streams = self._streams[arena.device]
            record = self._between_steps
            with streams.on(streams.copy_out):
                with record.span(COPY_OUT, streams, streams.copy_out) as copied:
                    for host, device in resident.pairs(arena):
                        host.copy_(device, non_blocking=True)
                self._host_ready[arena.device] = copied.event
                arena.written_by(self._host_ready[arena.device])
            record.bytes_out += arena.state_bytes(arena.resident.numel)
            resident.dirty = False

    def _settle(
        self, computes: dict[torch.device, torch.Stream | None], chunks: Sequence[Chunk]
    ) -> None:
        """After a fault partway through :meth:`run` (on the ``computes`` streams, by device):
        copies and updates may have been queued whose events were never recorded. Order the
        copy-out stream after all of them, as a finished run does, and mark its work so far
        as the host buffers' last use, so that reading them (:meth:`wait_host`) or freeing
        them waits for it, and as the last use of every staging set of the pool (which other
        optimizers of a shared one go on using) and the pool's last update."""
        for device, compute in computes.items():
            streams = self._streams[device]
            streams.wait(streams.copy_out, streams.record(streams.copy_in))
            streams.wait(streams.copy_out, streams.record(compute))
            settled = self._host_ready[device] = streams.record(streams.copy_out)
            self.pool.last_update[device] = settled
            for kind, free in self.pool.free.items():
                if kind[0] == device:
                    free[:] = [settled] * len(free)
        for chunk in chunks:
            if chunk.arena.device in computes:
                chunk.arena.written_by(self._host_ready[chunk.arena.device])

    def release(self) -> None:
        """Free the staging and resident buffers once the work queued on them is done, the
        resident state written back to the host first: the next run allocates staging again,
        and state is kept resident again once it is chosen again. A shared pool's staging is
        freed for all its optimizers."""
        with notices_held(), self.pool.lock:
            self.wait_host()
            self.set_resident({arena: ResidentRanges() for arena in self._resident})
            self.pool.release()
            self._prefetched = {}

    def caller_waits(
        self, event: torch.Event | None, device: torch.device, stream: torch.Stream | None = None
    ) -> None:
        """Make ``stream`` (by default the caller's current stream on ``device``) wait, on the
        device, for ``event``."""
        streams = self._streams[device]
        streams.wait(stream if stream is not None else streams.compute(), event)

    def used_by_update(self, tensor: Tensor) -> None:
        """``tensor`` is read by an update that may run after the caller frees it."""
        if tensor.device in self._streams:
            self._streams[tensor.device].used_by_update(tensor)

    def join_updates(self) -> None:
        """Make the caller's streams wait (on the device) for every update queued so far."""
        for streams in self._streams.values():
            streams.wait(streams.compute(), streams.record(streams.update))

    def wait_host(self) -> None:
        """Block until every staged chunk and all resident state have been written back to the
        host buffers; order the caller's streams after every queued update (on the device)."""
        with notices_held(), self.pool.lock:
            self._wait_host()

    def _wait_host(self) -> None:
        self._flush_resident()
        self.join_updates()
        # Copies still reading the host buffers: those queued ahead, also ones a changed plan
        # or a load dropped unused (nothing else waits for those), and resident uploads.
        for streams in self._streams.values():
            if (read := streams.record(streams.copy_in)) is not None:
                read.synchronize()
        for event in self._host_ready.values():
            if event is not None:
                event.synchronize()
