"""What one optimizer step moved and how long it took, measured without stalling the step.

On an accelerator every chunk's copies are bracketed by timing events on their copy stream and
the step by events on the compute and copy-out streams. Nothing waits for them: a record is
resolved later, when its events have completed (:meth:`StepRecord.poll`, non-blocking) or when a
reader needs the numbers now (:meth:`StepRecord.resolve`, waits for the last event only). On the
CPU the same spans are timed with ``time.perf_counter``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lightning_offload_optim.streams import PipelineStreams

COPY_IN, COPY_OUT, STEP = "copy_in", "copy_out", "step"


@dataclass(frozen=True)
class StepStats:
    """Resolved figures of one step. Times in seconds, volumes in bytes."""

    copy_in_seconds: float
    copy_out_seconds: float
    step_seconds: float
    bytes_in: int
    bytes_out: int


@dataclass
class SpanEnd:
    """The event after a span's work, set when the span ends (``None`` on the CPU)."""

    event: torch.Event | None = None


class StepRecord:
    """Collects spans of one step; turns into :class:`StepStats` once its events are done."""

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
        self._seconds = {COPY_IN: 0.0, COPY_OUT: 0.0, STEP: 0.0}
        self._events: list[tuple[str, torch.Event, torch.Event]] = []
        self._result: StepStats | None = None

    @contextlib.contextmanager
    def span(
        self, kind: str, streams: PipelineStreams, stream: torch.Stream | None
    ) -> Iterator[SpanEnd]:
        """Time the work the block queues on ``stream`` (wall clock on the CPU). The event
        that ends the span also marks that work for whatever must wait for it: a stream holds
        only about a thousand queued operations before the host blocks, so none is spared."""
        end = SpanEnd()
        if stream is None:
            start = time.perf_counter()
            yield end
            self._seconds[kind] += time.perf_counter() - start
            return
        begin = streams.record(stream, timing=True)
        yield end
        end.event = streams.record(stream, timing=True)
        self.add_span(kind, begin, end.event)

    def add_span(self, kind: str, begin: torch.Event | None, end: torch.Event | None) -> None:
        """Add a span whose ends were recorded elsewhere (a step starts and ends on two streams)."""
        if begin is not None and end is not None:
            self._events.append((kind, begin, end))

    def add_seconds(self, kind: str, seconds: float) -> None:
        self._seconds[kind] += seconds

    def poll(self) -> StepStats | None:
        """The figures if every event has completed, else None; never blocks."""
        if self._result is None and all(end.query() for _, _, end in self._events):
            self._finish()
        return self._result

    def resolve(self) -> StepStats:
        """The figures, waiting for this step's last event if needed (not the whole device)."""
        if self._result is None:
            for _, _, end in self._events:
                end.synchronize()
            self._finish()
        assert self._result is not None
        return self._result

    def _finish(self) -> None:
        for kind, begin, end in self._events:
            self._seconds[kind] += begin.elapsed_time(end) / 1000
        self._events.clear()
        self._result = StepStats(
            self._seconds[COPY_IN],
            self._seconds[COPY_OUT],
            self._seconds[STEP],
            self.bytes_in,
            self.bytes_out,
        )
