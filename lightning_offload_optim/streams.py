"""Copy and compute streams for one device, written once for accelerators and the CPU.

On an accelerator the host->device copies, the update and the device->host copies run on three
streams ordered by events, so chunk ``i + 1`` loads while chunk ``i`` computes and chunk ``i - 1``
drains. On the CPU every stream and event operation is a no-op and the same pipeline code runs
in program order. The test suite swaps in simulated streams (:func:`device_module` is the seam)
that check the ordering on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch


def device_module(device: torch.device) -> ModuleType | Any | None:
    """The module whose ``Stream``, ``Event``, ``stream()`` and ``current_stream()`` serve
    ``device``; ``None`` where work runs in program order (the CPU, devices without streams)."""
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device)
    return module if hasattr(module, "Stream") else None


class PipelineStreams:
    """The streams of the staging pipeline on ``device``.

    The update runs on the caller's current stream, so it is ordered after the backward pass
    that produced the gradients and before the next forward pass, with no wait; or, when the
    step overlaps the next forward, on a side stream of its own (:attr:`update`), which waits
    for the caller's stream and which the forward's hooks wait for, parameter by parameter.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = device_module(device)
        self.is_async = self._module is not None
        self.copy_in: torch.Stream | None = None
        self.copy_out: torch.Stream | None = None
        self.update: torch.Stream | None = None
        if self._module is not None:
            self.copy_in = self._module.Stream(device)
            self.copy_out = self._module.Stream(device)
            self.update = self._module.Stream(device)

    def compute(self) -> torch.Stream | None:
        return self._module.current_stream(self.device) if self._module is not None else None

    @contextlib.contextmanager
    def on(self, stream: torch.Stream | None) -> Iterator[None]:
        """Run the enclosed work on ``stream`` (no-op on the CPU)."""
        if stream is None:
            yield
            return
        with self._module.stream(stream):
            yield

    def record(self, stream: torch.Stream | None, timing: bool = False) -> torch.Event | None:
        """An event marking the work queued so far on ``stream`` (timed if ``timing``)."""
        if stream is None:
            return None
        event = self._module.Event(enable_timing=timing)
        event.record(stream)
        return event

    def timed_join(self, stream: torch.Stream, other: torch.Stream) -> torch.Event | None:
        """A timed event on ``stream`` after the work queued so far on it and on ``other``
        (``stream`` waits for ``other`` from here on)."""
        self.wait(stream, self.record(other))
        return self.record(stream, timing=True)

    @staticmethod
    def wait(stream: torch.Stream | None, event: torch.Event | None) -> None:
        """Make ``stream`` wait for ``event`` on the device, without blocking the host."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    def used_by_update(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that the update stream reads ``tensor`` (a gradient the
        caller may free with ``zero_grad(set_to_none=True)`` before the update ran)."""
        if isinstance(self.update, torch.Stream):
            tensor.record_stream(self.update)

    def used_by_side_streams(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator that the side streams use ``tensor`` (allocated on the
        caller's stream), so its memory is not reused before their work is done."""
        for stream in (self.copy_in, self.copy_out, self.update):
            if isinstance(stream, torch.Stream):
                tensor.record_stream(stream)
