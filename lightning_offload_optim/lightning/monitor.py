"""OffloadMonitor: logs what offloading the optimizer state saves and what it costs."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics import MaxMetric, MeanMetric, SumMetric

from lightning_offload_optim.adamw import OffloadAdamW
from lightning_offload_optim.lightning.checkpoint import (
    CHECKPOINT_KEY,
    check_metadata,
    offload_metadata,
)
from lightning_offload_optim.step_stats import StepRecord, StepStats

#: Cumulative counters kept in the callback's checkpointed state.
COUNTERS = ("steps", "bytes_in", "bytes_out", "copy_in_seconds", "copy_out_seconds", "step_seconds")


class OffloadMonitor(Callback):
    r"""Log transfer time, bandwidth, step time and memory saved by :class:`OffloadAdamW`.

    Values go through ``LightningModule.log_dict``, so every logger (TensorBoard, CSV, MLflow,
    W&B) receives them, at the Trainer's ``log_every_n_steps``. Between logs they are aggregated
    with torchmetrics (mean, max, sums) and reduced across ranks when logged. Timings come from
    CUDA events read only when a value is logged (no synchronisation on other steps), or from the
    wall clock on the CPU. Metrics, under ``prefix`` (default ``offload/``):

    ============================  ======  ==========================================================
    name                          unit    meaning
    ============================  ======  ==========================================================
    ``h2d_ms`` / ``d2h_ms``       ms      host→device / device→host copy time per optimizer step
    ``h2d_gbps`` / ``d2h_gbps``   GB/s    achieved copy bandwidth (bytes / copy time, 1 GB = 1e9 B)
    ``step_ms`` / ``step_ms_max``  ms     optimizer step time, mean / max since the last log
    ``memory_saved_bytes``        bytes   optimizer state held on the host instead of the device
    ``host_bytes``                bytes   host memory the state buffers occupy
    ``host_pinned``               0/1     whether those buffers are page-locked
    ``peak_device_bytes``         bytes   ``torch.cuda.max_memory_allocated`` (CUDA only)
    ``total_moved_bytes``         bytes   state bytes copied both ways since the run began
    ============================  ======  ==========================================================

    On a CPU-only run parameters and state share the host: no copies are made (``h2d_ms`` is 0)
    unless the optimizer was built with ``force_staging=True``.

    Args:
        prefix: prefix of every metric name.
        prog_bar: also show ``memory_saved_gb`` in the progress bar.
        summary: print a summary at the end of ``fit`` (rank zero).

    Example::

        from lightning_offload_optim import OffloadMonitor, OffloadOptimizerMixin

        class Model(OffloadOptimizerMixin, L.LightningModule): ...

        trainer = L.Trainer(callbacks=[OffloadMonitor()], logger=CSVLogger("logs"))
        trainer.fit(Model())
    """

    def __init__(self, prefix: str = "offload/", prog_bar: bool = False, summary: bool = True):
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(
                f"OffloadMonitor(prefix=...) must be a non-empty string, got {prefix!r}"
            )
        for name, value in (("prog_bar", prog_bar), ("summary", summary)):
            if not isinstance(value, bool):
                raise TypeError(f"OffloadMonitor({name}=...) must be a bool, got {value!r}")
        self.prefix = prefix
        self.prog_bar = prog_bar
        self.summary = summary
        self.totals = dict.fromkeys(COUNTERS, 0.0)
        self._optimizers: list[OffloadAdamW] = []
        self._seen: dict[int, StepRecord | None] = {}
        self._pending: list[StepRecord] = []
        self._metrics: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._optimizers = [
            opt for opt in trainer.optimizers if isinstance(opt, OffloadAdamW) and opt.enabled
        ]
        if not self._optimizers:
            rank_zero_warn(
                "OffloadMonitor: the Trainer has no enabled OffloadAdamW optimizer; nothing will "
                "be logged. Use OffloadOptimizerMixin or return OffloadAdamW from "
                "configure_optimizers."
            )
            return
        self._seen = {id(opt): opt.last_step for opt in self._optimizers}
        self._metrics = {
            name: metric.to(pl_module.device)
            for name, metric in {
                "copy_in_ms": MeanMetric(),
                "copy_out_ms": MeanMetric(),
                "step_ms": MeanMetric(),
                "step_ms_max": MaxMetric(),
                "bytes_in": SumMetric(),
                "bytes_out": SumMetric(),
                "copy_in_seconds": SumMetric(),
                "copy_out_seconds": SumMetric(),
            }.items()
        }

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if not self._optimizers:
            return
        for opt in self._optimizers:
            record = opt.last_step
            if record is not None and record is not self._seen[id(opt)]:
                self._seen[id(opt)] = record
                self._pending.append(record)
        # Fold in steps whose events are done; keeps few events alive, never waits.
        self._pending = [r for r in self._pending if not self._fold(r.poll())]
        if trainer._logger_connector.should_update_logs:
            for record in self._pending:
                self._fold(record.resolve())
            self._pending = []
            pl_module.log_dict(self._compute_and_reset(pl_module), on_step=True, on_epoch=False)
            if self.prog_bar:
                saved = sum(opt.memory_stats()["state_bytes"] for opt in self._optimizers)
                pl_module.log(f"{self.prefix}memory_saved_gb", saved / 1e9, prog_bar=True)

    def _fold(self, stats: StepStats | None) -> bool:
        """Add one resolved step to the metrics and the totals; False if not resolved yet."""
        if stats is None:
            return False
        m = self._metrics
        m["copy_in_ms"].update(1000 * stats.copy_in_seconds)
        m["copy_out_ms"].update(1000 * stats.copy_out_seconds)
        m["step_ms"].update(1000 * stats.step_seconds)
        m["step_ms_max"].update(1000 * stats.step_seconds)
        m["bytes_in"].update(stats.bytes_in)
        m["bytes_out"].update(stats.bytes_out)
        m["copy_in_seconds"].update(stats.copy_in_seconds)
        m["copy_out_seconds"].update(stats.copy_out_seconds)
        self.totals["steps"] += 1
        self.totals["bytes_in"] += stats.bytes_in
        self.totals["bytes_out"] += stats.bytes_out
        self.totals["copy_in_seconds"] += stats.copy_in_seconds
        self.totals["copy_out_seconds"] += stats.copy_out_seconds
        self.totals["step_seconds"] += stats.step_seconds
        return True

    def _compute_and_reset(self, pl_module: pl.LightningModule) -> dict[str, float]:
        """This interval's values, reduced across ranks by torchmetrics; then a new interval."""
        values = {name: float(metric.compute()) for name, metric in self._metrics.items()}
        for metric in self._metrics.values():
            metric.reset()
        memory = [opt.memory_stats() for opt in self._optimizers]
        p = self.prefix
        logged = {
            f"{p}h2d_ms": values["copy_in_ms"],
            f"{p}d2h_ms": values["copy_out_ms"],
            f"{p}h2d_gbps": _rate(values["bytes_in"], values["copy_in_seconds"]),
            f"{p}d2h_gbps": _rate(values["bytes_out"], values["copy_out_seconds"]),
            f"{p}step_ms": values["step_ms"],
            f"{p}step_ms_max": values["step_ms_max"],
            f"{p}memory_saved_bytes": float(sum(m["state_bytes"] for m in memory)),
            f"{p}host_bytes": float(sum(m["host_bytes"] for m in memory)),
            f"{p}host_pinned": float(all(m["pinned"] for m in memory)),
            f"{p}total_moved_bytes": self.totals["bytes_in"] + self.totals["bytes_out"],
        }
        if pl_module.device.type == "cuda":
            logged[f"{p}peak_device_bytes"] = float(
                torch.cuda.max_memory_allocated(pl_module.device)
            )
        return logged

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._optimizers or not self.summary:
            return
        for record in self._pending:
            self._fold(record.resolve())
        self._pending = []
        rank_zero_info(self.summary_text())

    def summary_text(self) -> str:
        """A few lines on memory saved and what it cost, over the whole run (resumes included)."""
        t = self.totals
        steps = max(1.0, t["steps"])
        saved = sum(opt.memory_stats()["state_bytes"] for opt in self._optimizers)
        head = (
            f"OffloadMonitor: {saved / 2**30:.2f} GiB of optimizer state kept in host memory "
            f"over {int(t['steps'])} optimizer steps; optimizer step "
            f"{1000 * t['step_seconds'] / steps:.1f} ms/step."
        )
        if t["bytes_in"] == 0:
            return head + "\n  No copies: parameters and state share host memory (CPU training)."
        return head + (
            f"\n  host->device {1000 * t['copy_in_seconds'] / steps:.1f} ms/step "
            f"({_rate(t['bytes_in'], t['copy_in_seconds']):.1f} GB/s), "
            f"device->host {1000 * t['copy_out_seconds'] / steps:.1f} ms/step "
            f"({_rate(t['bytes_out'], t['copy_out_seconds']):.1f} GB/s)."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.totals.update(state_dict.get("totals", {}))

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CHECKPOINT_KEY] = offload_metadata(trainer.optimizers)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        check_metadata(checkpoint)


def _rate(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
