"""OffloadMonitor: logs what offloading the optimizer state saves and what it costs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.hooks import RemovableHandle
from torchmetrics import Metric

from lightning_offload_optim.adamw import OffloadAdamW
from lightning_offload_optim.lightning.batch_interrupt import (
    deliver_held_notices,
    deliver_held_signals,
    drop_stale_holds,
    hold_signals_until_batch_end,
)
from lightning_offload_optim.lightning.checkpoint import (
    CHECKPOINT_KEY,
    check_metadata,
    offload_metadata,
)
from lightning_offload_optim.lightning.optimizers import offload_optimizers
from lightning_offload_optim.step_stats import StepRecord, StepStats

#: Cumulative counters kept in the callback's checkpointed state.
COUNTERS = ("steps", "step_seconds", "copy_in_seconds", "copy_out_seconds", "bytes_in", "bytes_out")


class OffloadMonitor(Callback):
    r"""Log transfer time, bandwidth, step time and memory saved by :class:`OffloadAdamW`.

    Values go to every logger of the Trainer (TensorBoard, CSV, MLflow, W&B), in rows of their
    own at Lightning's step, at the Trainer's ``log_every_n_steps``: written directly, as
    ``LearningRateMonitor`` writes, not through ``LightningModule.log`` (a few hundred
    microseconds per value). Between logs they are summed (and the slowest step kept) as plain
    numbers, and reduced across ranks with torchmetrics when logged; steps no logged row holds
    when training ends (or stops) are written then. Timings come from
    CUDA events read only when a value is logged (no synchronisation on other steps), or from the
    wall clock on the CPU. Units: ms, bytes, and GB = 1e9 bytes. Every figure describes one rank:
    times and bandwidths are means over the steps of all ranks, ``step_ms_max`` is the slowest
    step of any rank, ``host_bytes_all_ranks`` sums all ranks (under DDP every rank holds the
    whole state; under FSDP2 / ModelParallel each holds its shards'), the rest are this rank's
    own. Metrics, under ``prefix`` (default ``offload/``):

    ============================  ======  ==========================================================
    name                          unit    meaning
    ============================  ======  ==========================================================
    ``h2d_ms`` / ``d2h_ms``       ms      host→device / device→host copy time per optimizer step
    ``h2d_gbps`` / ``d2h_gbps``   GB/s    achieved copy bandwidth (bytes / copy time)
    ``step_ms`` / ``step_ms_max``  ms     optimizer step time, mean / max since the last log
    ``memory_saved_bytes``        bytes   optimizer state held on the host instead of the device
    ``resident_bytes``            bytes   optimizer state kept on the device (``resident=``)
    ``host_bytes``                bytes   host memory the state buffers occupy (this rank)
    ``host_bytes_all_ranks``      bytes   the same summed over all ranks (per node when one node)
    ``host_pinned``               0/1     whether those buffers are page-locked (0 after a fallback)
    ``staging_bytes``             bytes   the optimizers' staging buffers and gradient scratch
                                          (a ``StagingPool``'s counted once)
    ``peak_device_bytes``         bytes   ``torch.cuda.max_memory_allocated`` (CUDA only)
    ``total_moved_bytes``         bytes   state bytes copied both ways, over every fit of this
                                          monitor and across resumes (restored from checkpoints)
    ``interval_steps``            count   optimizer steps per rank the values cover
    ============================  ======  ==========================================================

    On a CPU-only run parameters and state share the host: no copies are made (``h2d_ms`` is 0)
    unless the optimizer was built with ``force_staging=True``.

    A Ctrl-C during a batch's optimizer steps is raised after the batch's end hooks, after
    Lightning counted the steps, as with the mixin, so the checkpoint ``OnExceptionCheckpoint``
    saves resumes exactly, also for a module that returns :class:`OffloadAdamW` from its own
    ``configure_optimizers``; a scheduler's notice (SLURM's requeue signal, whose Lightning
    handler saves a checkpoint) is delivered there too.

    Args:
        prefix: prefix of every metric name.
        prog_bar: also show ``memory_saved_gb`` in the progress bar.
        summary: print a summary at the end of ``fit`` (rank zero).

    Example:
        >>> import tempfile
        >>> from lightning.pytorch.loggers import CSVLogger
        >>> from lightning_offload_optim import OffloadMonitor, OffloadOptimizerMixin
        >>> class Model(OffloadOptimizerMixin, pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Linear(4, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.net(batch).square().mean()
        ...     def train_dataloader(self):
        ...         return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
        >>> trainer = pl.Trainer(
        ...     max_steps=2, log_every_n_steps=1, logger=CSVLogger(tempfile.mkdtemp()),
        ...     callbacks=[OffloadMonitor(summary=False)], enable_progress_bar=False,
        ...     enable_model_summary=False, enable_checkpointing=False,
        ... )
        >>> trainer.fit(Model())
        >>> trainer.logged_metrics["offload/memory_saved_bytes"]  # 5 parameters' two moments
        40.0
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
        self._hooks: list[RemovableHandle] = []
        self._seen: dict[int, StepRecord | None] = {}
        self._pending: list[StepRecord] = []
        self._unlogged = False  # a training batch ended since the last row the monitor wrote
        self._new_interval()
        self._saved_at_train_end: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        drop_stale_holds(trainer)  # from a run that failed before its batch's end

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Steps of a fit that raised, not read yet (a device step in flight): counted in the
        # totals, not in this fit's first row.
        self._fold_pending()
        self._optimizers = [opt for opt in offload_optimizers(trainer.optimizers) if opt.enabled]
        if not self._optimizers:
            rank_zero_warn(
                "OffloadMonitor: the Trainer has no enabled OffloadAdamW optimizer; nothing will "
                "be logged. Use OffloadOptimizerMixin or return OffloadAdamW (or a "
                "ZeroRedundancyOptimizer of OffloadAdamW) from configure_optimizers."
            )
            return
        # Updated once per row, on the module's device, where it reduces across ranks.
        self._interval = IntervalTotals()
        self._unlogged = False
        self._new_interval()
        self._saved_at_train_end = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Count every step from here, also of an optimizer stepped more than once in a batch;
        not before: under ModelParallelStrategy torch's ``set_optimizer_state_dict`` steps once,
        with lr 0, to create the state that a resume then loads."""
        self._seen = {id(opt): opt.last_step for opt in self._optimizers}
        self._remove_hooks()
        self._hooks = [opt.register_step_post_hook(self._stepped) for opt in self._optimizers]

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Hold Ctrl-C and notices to the batch's end, also for a module without the mixin
        (:mod:`~lightning_offload_optim.lightning.batch_interrupt`). The mixin's
        ``on_train_batch_end`` ends the hold after every callback's; without the mixin the
        monitor ends it at the next hook after all of them: the next batch's start,
        validation's start or the epoch's end."""
        hold_signals_until_batch_end(trainer, optimizer)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        deliver_held_signals(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        deliver_held_signals(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        deliver_held_signals(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if not self._optimizers:
            return
        # Fold in steps whose events are done; keeps few events alive, never waits.
        self._pending = [r for r in self._pending if not self._fold(r.poll())]
        if not self._logs_now(trainer, pl_module):
            # Batches that step count (the same on every rank: the flush reduces across them).
            self._unlogged |= not _accumulating(trainer, pl_module)
            return
        logged = self._write_row(
            trainer, pl_module, trainer.fit_loop.epoch_loop._batches_that_stepped
        )
        if self.prog_bar:  # the loggers have it in the row
            name = f"{self.prefix}memory_saved_gb"
            gigabytes = torch.tensor(logged[name], dtype=torch.float64)
            pl_module.log(name, gigabytes, prog_bar=True, logger=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Note the memory saved before the state leaves the device (the mixin writes resident
        state back when training ends, after the callbacks), and write to the loggers the steps
        since the monitor's last row, which no row holds (training stopped, or ended, between
        two of Lightning's logging steps)."""
        if not self._optimizers:
            return
        self._saved_at_train_end = sum(_saved_bytes(opt.memory_stats()) for opt in self._optimizers)
        if not self._unlogged or trainer.log_every_n_steps == 0 or not trainer.loggers:
            return  # every step is in a row, step rows are off, or no logger writes one
        step = max(0, trainer.fit_loop.epoch_loop._batches_that_stepped - 1)  # the last batch's
        self._write_row(trainer, pl_module, step)

    def _write_row(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int
    ) -> dict[str, float]:
        """Write the interval's values to the loggers (``trainer.logged_metrics`` keeps them),
        on every rank: the values are reduced across ranks. Returns them."""
        self._fold_pending()
        logged = self._compute_and_reset(pl_module)
        if self.prog_bar:
            logged[f"{self.prefix}memory_saved_gb"] = (
                logged[f"{self.prefix}memory_saved_bytes"] / 1e9
            )
        self._unlogged = False
        trainer._logger_connector.log_metrics(logged, step=step)
        return logged

    def _fold_copies_between_steps(self) -> None:
        for optimizer in self._optimizers:
            self._fold(optimizer.take_copies_between_steps().resolve(), steps=0.0)

    def _stepped(self, optimizer: OffloadAdamW, args: Any, kwargs: Any) -> None:
        """Step post-hook: queue the step's record (a step with nothing to update makes none)."""
        record = optimizer.last_step
        if record is not None and record is not self._seen[id(optimizer)]:
            self._seen[id(optimizer)] = record
            self._pending.append(record)

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()  # the optimizers must not keep this callback alive

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Lightning calls no ``teardown`` when ``fit`` raises: steps made by hand afterwards
        are not this monitor's. Notices held since the batch's first step are delivered."""
        self._remove_hooks()
        deliver_held_notices(trainer)

    def _new_interval(self) -> None:
        self._sums = dict.fromkeys(COUNTERS, 0.0)  # since the last row
        self._slowest = 0.0  # the slowest step's seconds

    def _logs_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Whether this batch gets a row: Lightning writes its step metrics (the same on every
        rank), and a logger or the progress bar shows it (else no collective reduces it)."""
        if _accumulating(trainer, pl_module):
            return False  # Lightning drops step logs of accumulating batches
        return (
            bool(trainer.loggers or self.prog_bar) and trainer._logger_connector.should_update_logs
        )

    def _fold_pending(self) -> None:
        """Fold in every step not read yet, waiting for their last events (logging, saving)."""
        for record in self._pending:
            self._fold(record.resolve())
        self._pending = []

    def _fold(self, stats: StepStats | None, steps: float = 1.0) -> bool:
        """Add one resolved step (or copies between steps, ``steps=0``) to the interval's
        metrics and the totals; False if unresolved."""
        if stats is None:
            return False
        values = (
            steps,
            stats.step_seconds,
            stats.copy_in_seconds,
            stats.copy_out_seconds,
            float(stats.bytes_in),
            float(stats.bytes_out),
        )
        for name, value in zip(COUNTERS, values, strict=True):
            self._sums[name] += value
            self.totals[name] += value
        self._slowest = max(self._slowest, stats.step_seconds)
        return True

    def _compute_and_reset(self, pl_module: pl.LightningModule) -> dict[str, float]:
        """This interval's values, reduced across ranks by torchmetrics; then a new interval.

        An interval whose optimizer steps were all skipped (GradScaler) logs zero times, with
        ``interval_steps`` 0.
        """
        memory = [opt.memory_stats() for opt in self._optimizers]
        host_bytes = float(sum(m["host_bytes"] for m in memory))
        mine = [*self._sums.values(), self._slowest, host_bytes]
        self._new_interval()
        self._interval.update(torch.tensor(mine, dtype=torch.float64, device=pl_module.device))
        totals, slowest, host_bytes_all_ranks = self._interval.compute()
        sums = dict(zip(COUNTERS, totals.tolist(), strict=True))
        world_size = max(1, pl_module.trainer.world_size)
        self._interval.reset()
        p = self.prefix
        logged = {
            f"{p}memory_saved_bytes": float(sum(_saved_bytes(m) for m in memory)),
            f"{p}resident_bytes": float(sum(m["resident_bytes"] for m in memory)),
            f"{p}host_bytes": host_bytes,
            f"{p}host_bytes_all_ranks": float(host_bytes_all_ranks),
            f"{p}host_pinned": float(all(m["pinned"] for m in memory)),
            f"{p}staging_bytes": float(sum(_staging_bytes(self._optimizers, memory))),
            f"{p}total_moved_bytes": self.totals["bytes_in"] + self.totals["bytes_out"],
            f"{p}interval_steps": sums["steps"] / world_size,
        }
        per_step = _per_step(sums)  # an interval whose steps were all skipped logs zeros
        logged |= {f"{p}{name}": value for name, value in per_step.items()}
        logged[f"{p}step_ms_max"] = 1000 * float(slowest)
        if pl_module.device.type == "cuda":
            logged[f"{p}peak_device_bytes"] = float(
                torch.cuda.max_memory_allocated(pl_module.device)
            )
        return logged

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._optimizers:
            return
        # Copies no step follows to count them: a validation pass's copies of the next step's
        # first chunks, resident state written back as training ended.
        self._fold_copies_between_steps()
        self._fold_pending()
        if self.summary:
            rank_zero_info(self.summary_text())

    def summary_text(self) -> str:
        """A few lines on memory saved and what it cost, on this rank, over every fit of this
        monitor (resumes included). GB = 1e9 bytes, as in the metric names."""
        t = self.totals
        per_step = _per_step(t)
        saved = self._saved_at_train_end
        if saved is None:  # training has not ended
            saved = sum(_saved_bytes(opt.memory_stats()) for opt in self._optimizers)
        head = (
            f"OffloadMonitor: {saved / 1e9:.3f} GB of optimizer state kept in host memory "
            f"(this rank); {int(t['steps'])} optimizer steps so far, "
            f"{per_step['step_ms']:.1f} ms/step."
        )
        if t["bytes_in"] == 0:
            return head + "\n  No copies: parameters and state share host memory (CPU training)."
        return head + (
            f"\n  host->device {per_step['h2d_ms']:.1f} ms/step ({per_step['h2d_gbps']:.1f} GB/s), "
            f"device->host {per_step['d2h_ms']:.1f} ms/step ({per_step['d2h_gbps']:.1f} GB/s); "
            f"{(t['bytes_in'] + t['bytes_out']) / 1e9:.3f} GB moved."
        )

    def state_dict(self) -> dict[str, Any]:
        if self._optimizers:
            self._fold_pending()  # steps whose timings were not read yet count too
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from this rank's saved totals; on another number of ranks than saved, from
        those of the rank that saved the checkpoint."""
        rank, world_size = _rank_and_world_size()
        by_rank = state_dict.get("totals_by_rank")
        if by_rank is not None and len(by_rank) == world_size:
            self.totals.update(by_rank[rank])
        else:
            self.totals.update(state_dict.get("totals", {}))

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Lightning took :meth:`state_dict` before the optimizers' state, whose reading wrote
        resident state back to the host: count that copy now, in the saved totals too (the
        resumed run's optimizer never makes it; the run goes on counting it in this interval).
        Every rank's totals are saved: only one rank's callback state reaches the checkpoint,
        and FSDP2 ranks copy their own shards' state. Called on every rank, as saving is."""
        checkpoint[CHECKPOINT_KEY] = offload_metadata(trainer.optimizers)
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        if self._optimizers and saved is not None:
            self._fold_copies_between_steps()
            saved["totals"] = dict(self.totals)
            if trainer.world_size > 1:
                mine = torch.tensor([self.totals[name] for name in COUNTERS], dtype=torch.float64)
                gathered = trainer.strategy.all_gather(mine.to(pl_module.device))
                rows = gathered.reshape(trainer.world_size, len(COUNTERS)).tolist()
                saved["totals_by_rank"] = [dict(zip(COUNTERS, row, strict=True)) for row in rows]

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        check_metadata(checkpoint)


class IntervalTotals(Metric):
    """Sums of :data:`COUNTERS` and the slowest step time since the last log, and the host
    bytes held now, across ranks (one update per log: this rank's figures)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        zeros = torch.zeros(len(COUNTERS), dtype=torch.float64)
        self.add_state("sums", default=zeros, dist_reduce_fx="sum")
        scalar = torch.zeros((), dtype=torch.float64)
        self.add_state("slowest", default=scalar, dist_reduce_fx="max")
        self.add_state("host_bytes", default=scalar.clone(), dist_reduce_fx="sum")

    def update(self, figures: torch.Tensor) -> None:
        """This rank's sums ordered as :data:`COUNTERS`, its slowest step and its host bytes."""
        self.sums = figures[: len(COUNTERS)]
        self.slowest, self.host_bytes = figures[len(COUNTERS)], figures[len(COUNTERS) + 1]

    def compute(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sums, self.slowest, self.host_bytes


def _rank_and_world_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _accumulating(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether this batch only accumulates gradients (no optimizer step)."""
    return trainer.fit_loop._should_accumulate() and pl_module.automatic_optimization


def _saved_bytes(stats: dict[str, Any]) -> int:
    """Optimizer state an OffloadAdamW holds on the host rather than on the device."""
    return int(stats["state_bytes"]) - int(stats["resident_bytes"])


def _per_step(sums: dict[str, float]) -> dict[str, float]:
    """Mean times per optimizer step (ms) and bandwidths (GB/s) from summed :data:`COUNTERS`."""
    steps = max(sums["steps"], 1.0)
    return {
        "h2d_ms": 1000 * sums["copy_in_seconds"] / steps,
        "d2h_ms": 1000 * sums["copy_out_seconds"] / steps,
        "h2d_gbps": _rate(sums["bytes_in"], sums["copy_in_seconds"]),
        "d2h_gbps": _rate(sums["bytes_out"], sums["copy_out_seconds"]),
        "step_ms": 1000 * sums["step_seconds"] / steps,
    }


def _rate(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _staging_bytes(optimizers: list[OffloadAdamW], memory: list[dict]) -> Iterable[int]:
    """Each optimizer's staging, a pool's once (its optimizers all report the pool's)."""
    held = {
        id(opt.staging_pool or opt): m["staging_bytes"]
        for opt, m in zip(optimizers, memory, strict=True)
    }
    return held.values()
