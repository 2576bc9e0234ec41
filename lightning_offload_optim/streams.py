"""Copy and compute streams for one device, written once for accelerators and the CPU.

On an accelerator the host->device copies, the update and the device->host copies run on three
streams ordered by events, so chunk ``i + 1`` loads while chunk ``i`` computes and chunk ``i - 1``
drains. On the CPU every stream and event operation is a no-op and the same pipeline code runs
in program order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class PipelineStreams:
    """The three streams of the staging pipeline on ``device``.

    The compute stream is the caller's current stream, so the update is ordered after the
    backward pass that produced the gradients and before the next forward pass, with no wait.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        module = torch.get_device_module(device) if device.type != "cpu" else None
        # Devices whose module has no streams (MPS) run the pipeline in program order.
        self.is_async = module is not None and hasattr(module, "Stream")
        self.copy_in: torch.Stream | None = None
        self.copy_out: torch.Stream | None = None
        if self.is_async:
            self._module = module
            self.copy_in = module.Stream(device)
            self.copy_out = module.Stream(device)

    def compute(self) -> torch.Stream | None:
        return self._module.current_stream(self.device) if self.is_async else None

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

    @staticmethod
    def wait(stream: torch.Stream | None, event: torch.Event | None) -> None:
        """Make ``stream`` wait for ``event`` on the device, without blocking the host."""
        if stream is not None and event is not None:
            stream.wait_event(event)
