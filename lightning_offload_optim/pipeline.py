"""Chunk planning and the staging pipeline that moves state to the parameters' device and back.

A step's state is cut into chunks of at most ``chunk_numel`` elements (a resident parameter
that needs no buffer is never split, see :func:`plan_chunks`). Each chunk is one
contiguous range of an arena (so one copy per state key), holding pieces of one or more
parameters. On an accelerator each chunk is copied into one of a few staging buffers on a copy
stream, updated on the compute stream, and copied back on a second copy stream; events order the
three, so copies overlap the update and the host never waits inside a step. Extra device memory
is ``num_buffers`` staging buffers whatever the model size (one where a step is one chunk).

When the parameters live on the host (CPU training) the update runs on the host buffers in place;
``force_staging=True`` runs the staged path there too, so CPU tests exercise it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_offload_optim.functional import SPLIT_ALIGNMENT
from lightning_offload_optim.host_state import MASTER_KEY, Arena, Slot
from lightning_offload_optim.resident import ResidentRanges
from lightning_offload_optim.step_stats import COPY_IN, COPY_OUT, STEP, StepRecord
from lightning_offload_optim.streams import PipelineStreams

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


def staging_needs(
    chunks: Iterable[Chunk], stages: Callable[[torch.device], bool], num_buffers: int
) -> dict[tuple[torch.device, torch.dtype], tuple[int, dict[str, int]]]:
    """What a step of ``chunks`` needs of staging, per kind of chunk (device and state dtype):
    how many buffer sets, and per key the elements of each (its largest chunk). A staged
    device (``stages``) gets ``num_buffers`` sets, so that a chunk loads while the one before it
    computes, but one where a single chunk of the kind needs buffers (it takes the first: one
    optimizer per parameter, stepped in backward, would otherwise hold twice its state in
    staging); a device updated in place needs one gradient scratch at most (its chunks run one
    after another). Kinds whose chunks need no buffer map to no keys."""
    needs: dict[tuple[torch.device, torch.dtype], tuple[int, dict[str, int]]] = {}
    for chunk in chunks:
        kind = (chunk.arena.device, chunk.arena.dtype)
        users, sizes = needs.get(kind, (0, {}))
        keys = buffer_keys(chunk, stages(chunk.arena.device))
        for key in keys:
            sizes[key] = max(sizes.get(key, 0), chunk.numel)
        needs[kind] = (users + bool(keys), sizes)
    return {
        kind: (num_buffers if stages(kind[0]) and users > 1 else 1, sizes)
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


class StagingPipeline:
    """Runs an update over chunks, staging them on the parameters' device when it is not the host.

    Args:
        chunk_numel: elements per chunk and per state key (a multiple of ``SPLIT_ALIGNMENT``).
        force_staging: stage through separate buffers even when parameters are on the CPU.
        num_buffers: staging buffers per device; two let one chunk load while another computes.
    """

    def __init__(self, chunk_numel: int, force_staging: bool = False, num_buffers: int = 2) -> None:
        self.chunk_numel = chunk_numel
        self.force_staging = force_staging
        self.num_buffers = num_buffers
        self._streams: dict[torch.device, PipelineStreams] = {}
        self._buffers: dict[tuple[torch.device, torch.dtype], list[dict[str, Tensor]]] = {}
        self._host_ready: dict[torch.device, torch.Event | None] = {}
        self._free: dict[tuple[torch.device, torch.dtype], list[torch.Event | None]] = {}
        self._resident: weakref.WeakKeyDictionary[Arena, _Resident] = weakref.WeakKeyDictionary()
        # Copy-ins queued ahead of a step, by chunk position: (arena id, start, stop, staging
        # buffer), and the event after the copy.
        self._prefetched: dict[int, tuple[tuple[int, int, int, int], torch.Event | None]] = {}
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
        needs = staging_needs(chunks, self.stages, self.num_buffers)
        for (device, dtype), (count, sizes) in needs.items():
            if not sizes:
                continue
            streams = self._streams_for(device)
            buffers = self._buffers.setdefault((device, dtype), [])
            buffers.extend({} for _ in range(count - len(buffers)))
            for buffer in buffers:
                for key, numel in sizes.items():
                    if key in buffer and buffer[key].numel() >= numel:
                        continue
                    buffer[key] = torch.empty(numel, dtype=dtype, device=device)
                    streams.used_by_side_streams(buffer[key])
                    self._prefetched = {}  # copies queued ahead went into the old buffers

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging buffers and gradient scratch held, on every device."""
        return sum(
            t.untyped_storage().nbytes()
            for buffers in self._buffers.values()
            for buffer in buffers
            for t in buffer.values()
        )

    def set_resident(self, chosen: dict[Arena, ResidentRanges]) -> None:
        """Keep ``chosen[arena]`` of each arena on its device (buffers allocated here, filled
        from the host at the next run); empty ranges keep none. Call :meth:`wait_host` first,
        so that resident state that is newer than the host's is not lost. If an allocation
        fails (out of device memory), the arenas not yet given buffers keep nothing resident."""
        for arena in chosen:  # the old buffers are freed first: the new ones may reuse them
            self._resident.pop(arena, None)
            arena.resident = ResidentRanges()
        for arena, ranges in chosen.items():
            if numel := ranges.numel:
                streams = self._streams_for(arena.device)
                buffers = {}
                for key in arena.keys:
                    buffers[key] = torch.empty(numel, dtype=arena.dtype, device=arena.device)
                    streams.used_by_side_streams(buffers[key])
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
        record = self._between_steps  # with copies queued before it and dropped by a load
        for index, (chunk, turn) in enumerate(zip(chunks, self._turns(chunks), strict=True)):
            if chunk.resident or not self.stages(chunk.arena.device) or turn >= self.num_buffers:
                continue
            number = turn  # the first turns take the buffers in order
            buffers = self._buffers.get((chunk.arena.device, chunk.arena.dtype), [])
            if len(buffers) <= number:
                continue
            if any(
                k not in buffers[number] or buffers[number][k].numel() < chunk.numel
                for k in chunk.arena.keys
            ):
                continue
            staged = {key: buffers[number][key][: chunk.numel] for key in chunk.arena.keys}
            # The last copy-out into this chunk's host range used the same buffer (the chunks
            # are the last step's, in the same places): the load's wait for it covers it.
            loaded = self._load(chunk, staged, number, record)
            chunk.arena.read_by(loaded)
            self._prefetched[index] = ((id(chunk.arena), chunk.start, chunk.stop, turn), loaded)

    def _turns(self, chunks: Sequence[Chunk]) -> list[int]:
        """Per chunk, how many staged chunks of its kind come before it. A kind's staged chunks
        take the staging buffer sets in turn (``turn % num_buffers``), so a chunk loads while
        the one before it computes; other chunks use the next one's gradient scratch (on the
        update's stream, in order)."""
        counts: dict[tuple[torch.device, torch.dtype], int] = {}
        turns = []
        for chunk in chunks:
            kind = (chunk.arena.device, chunk.arena.dtype)
            turns.append(counts.get(kind, 0))
            if self.stages(chunk.arena.device) and not chunk.resident:
                counts[kind] = turns[-1] + 1
        return turns

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
        record = self.take_between_steps()
        prefetched, self._prefetched = self._prefetched, {}
        self._views_lent = False  # the views' writes before this step are read now
        started = time.perf_counter()
        staged = {chunk.arena.device for chunk in chunks if self.stages(chunk.arena.device)}
        begins, computes = {}, {}
        self.updated = []
        for device in staged:
            streams = self._streams[device]
            compute = computes[device] = streams.update if overlap else streams.compute()
            if overlap:  # after the backward pass (and clipping) that made the gradients
                streams.wait(compute, streams.record(streams.compute()))
            begins[device] = streams.record(compute, timing=True)
            # Staging memory may have been in use on the compute stream just before (freshly
            # allocated), and the host buffers may still be written by the last copy-out.
            streams.wait(streams.copy_in, streams.record(compute))
            streams.wait(streams.copy_in, self._host_ready.get(device))
        try:
            for index, (chunk, turn) in enumerate(zip(chunks, self._turns(chunks), strict=True)):
                kind = (chunk.arena.device, chunk.arena.dtype)
                is_staged = chunk.arena.device in staged
                number = turn % self.num_buffers if is_staged else 0
                keys = self._staged_keys(chunk)
                buffer = self._buffers[kind][number] if keys else {}
                views = {key: buffer[key][: chunk.numel] for key in keys}
                if is_staged and chunk.resident:
                    compute = computes[chunk.arena.device]
                    self.updated.append(self._run_resident(chunk, views, update, record, compute))
                elif is_staged:
                    compute = computes[chunk.arena.device]
                    # A copy queued ahead is this chunk's if it went to the same range and
                    # buffer at the same turn: a plan changed since (a new resident share) may
                    # give the range a later turn, whose buffer an earlier chunk loads first.
                    ahead = prefetched.get(index)
                    loaded = (
                        ahead[1]
                        if ahead is not None
                        and ahead[0] == (id(chunk.arena), chunk.start, chunk.stop, turn)
                        else self._load(chunk, views, number, record)
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
        free = self._free.setdefault((device, chunk.arena.dtype), [None] * self.num_buffers)
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
    ) -> torch.Event | None:
        """Queue the copy of a chunk's host state into staging buffer ``number``; the event
        after it."""
        device = chunk.arena.device
        streams = self._streams[device]
        free = self._free.setdefault((device, chunk.arena.dtype), [None] * self.num_buffers)
        host = chunk.host_views()
        with streams.on(streams.copy_in):
            streams.wait(streams.copy_in, free[number])  # the last copy-out from this buffer
            with record.span(COPY_IN, streams, streams.copy_in) as copied:
                for key, view in host.items():
                    staged[key].copy_(view, non_blocking=True)
            loaded = copied.event
        record.bytes_in += chunk.arena.state_bytes(chunk.numel)
        return loaded

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
        them waits for it."""
        for device, compute in computes.items():
            streams = self._streams[device]
            streams.wait(streams.copy_out, streams.record(streams.copy_in))
            streams.wait(streams.copy_out, streams.record(compute))
            self._host_ready[device] = streams.record(streams.copy_out)
        for chunk in chunks:
            if chunk.arena.device in computes:
                chunk.arena.written_by(self._host_ready[chunk.arena.device])

    def release(self) -> None:
        """Free the staging and resident buffers once the work queued on them is done, the
        resident state written back to the host first: the next run allocates staging again,
        and state is kept resident again once it is chosen again."""
        self.wait_host()
        self.set_resident({arena: ResidentRanges() for arena in self._resident})
        self._buffers.clear()
        self._free.clear()
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

    def _streams_for(self, device: torch.device) -> PipelineStreams:
        if device not in self._streams:
            self._streams[device] = PipelineStreams(device)
        return self._streams[device]
