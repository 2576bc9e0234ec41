"""OffloadMonitor: the logged figures are exact in the scenarios users hit.

Every expected value is derived here from the model's parameter sizes (TinyModel: 385 fp32
elements, chunks of 64 with ``force_staging=True``), never from the library's own counters.
Logged values go through ``LightningModule.log`` as float64, exact for byte counts. Bytes per
interval are read from the cumulative ``total_moved_bytes`` (both ways) and, per direction, from
``h2d_gbps * h2d_ms * interval_steps`` (GB/s * ms = 1e6 B).
"""

from __future__ import annotations

import itertools
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger
from lightning_models import ManualModel, TinyModel, TwoOptimizerModel, make_data, trainer
from torch.utils.data import DataLoader

from lightning_offload_optim import OffloadAdamW, OffloadMonitor
from lightning_offload_optim.pipeline import StagingPipeline
from lightning_offload_optim.step_stats import StepRecord

P = "offload/"
#: TinyModel: Linear(8, 32), LayerNorm(32), GELU, Linear(32, 1), in forward order.
FORWARD_ORDER = [8 * 32, 32, 32, 32, 32 * 1, 1]  # l1.weight, l1.bias, ln.weight, ln.bias, ...
NUMEL = sum(FORWARD_ORDER)  # 385
STATE = 2 * 4 * NUMEL  # exp_avg + exp_avg_sq, fp32: 3080 bytes
CHUNK = 64  # TinyModel(force_staging=True) sets chunk_size=64
#: The first two staged chunks of a step (two staging buffers): both full chunks of l1.weight.
PREFETCH = 2 * CHUNK * 2 * 4


class CaptureLogger(Logger):
    """Keeps every ``log_metrics`` call: (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []  # those with the monitor's values
        self.every_row: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = (step, {k: float(v) for k, v in metrics.items()})
        self.every_row.append(row)
        if any(k.startswith(P) for k in metrics):
            self.rows.append(row)

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def fit(tmp_path, model, monitor=None, **kwargs) -> tuple[CaptureLogger, OffloadMonitor]:
    logger = CaptureLogger()
    monitor = monitor or OffloadMonitor(summary=False)
    callbacks = [monitor, *kwargs.pop("callbacks", [])]
    kwargs.setdefault("log_every_n_steps", 1)
    trainer(tmp_path, logger=logger, callbacks=callbacks, **kwargs).fit(model)
    return logger, monitor


def fit_resume(tmp_path, model, ckpt_path, **kwargs) -> CaptureLogger:
    logger = CaptureLogger()
    callbacks = [OffloadMonitor(summary=False), *kwargs.pop("callbacks", [])]
    kwargs.setdefault("log_every_n_steps", 1)
    trainer(tmp_path, logger=logger, callbacks=callbacks, **kwargs).fit(model, ckpt_path=ckpt_path)
    return logger


def moved(rows) -> list[float]:
    """Bytes moved (both ways) in each logged interval, from the cumulative total."""
    totals = [0.0] + [m[P + "total_moved_bytes"] for _, m in rows]
    return [b - a for a, b in itertools.pairwise(totals)]


def direction(metrics: dict[str, float], way: str) -> float:
    """Bytes moved one way in the interval: GB/s * ms/step * steps (* 1e6 bytes)."""
    return metrics[f"{P}{way}_gbps"] * metrics[f"{P}{way}_ms"] * metrics[P + "interval_steps"] * 1e6


def assert_directions(rows, expected_in: list[int], expected_out: list[int]) -> None:
    got_in = [direction(m, "h2d") for _, m in rows]
    got_out = [direction(m, "d2h") for _, m in rows]
    assert got_in == pytest.approx(expected_in, rel=1e-5, abs=1e-3), "host->device bytes"
    assert got_out == pytest.approx(expected_out, rel=1e-5, abs=1e-3), "device->host bytes"


class CountPrefetches:
    """Counts prefetches that queued copies (so the overlap scenarios are not vacuous)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.queued = 0
        real = StagingPipeline.prefetch

        def prefetch(pipeline, chunks):
            before = dict(pipeline._prefetched)
            real(pipeline, chunks)
            if pipeline._prefetched and pipeline._prefetched != before:
                self.queued += 1

        monkeypatch.setattr(StagingPipeline, "prefetch", prefetch)


# --------------------------------------------------------------------------- 1. overlap


def test_overlap_prefetched_copies_count_once_in_their_step(tmp_path, monkeypatch):
    counter = CountPrefetches(monkeypatch)
    logger, monitor = fit(tmp_path, TinyModel(force_staging=True, overlap_step=True))
    rows = logger.rows
    assert [s for s, _ in rows] == [0, 1, 2, 3, 4, 5]
    assert counter.queued == 5  # before steps 2..6 (step 1 has no plan yet)
    assert [m[P + "interval_steps"] for _, m in rows] == [1.0] * 6
    assert moved(rows) == [2 * STATE] * 6
    assert_directions(rows, [STATE] * 6, [STATE] * 6)
    assert monitor.totals["bytes_in"] == monitor.totals["bytes_out"] == 6 * STATE


class StateDictAfterBackward(Callback):
    """Calls ``optimizer.state_dict()`` (which drops prefetched copies: the caller may write
    through its views) after the backward of the batches ``which`` selects: after the forward
    pass queued the next step's first copies, before the step."""

    def __init__(self, which) -> None:
        self.which = which

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.which(trainer.fit_loop.epoch_loop.batch_idx):
            trainer.optimizers[0].state_dict()


def test_overlap_prefetch_dropped_by_a_state_read_is_counted_once(tmp_path, monkeypatch):
    """Every batch: forward (queues the first two chunks), state_dict() drops those copies, the
    step copies the whole state in again. What crossed the link: the dropped copies and the
    whole state, once each."""
    counter = CountPrefetches(monkeypatch)
    logger, _ = fit(
        tmp_path,
        TinyModel(force_staging=True, overlap_step=True),
        callbacks=[StateDictAfterBackward(lambda batch: True)],
    )
    rows = logger.rows
    assert counter.queued == 5
    # Step 1 had nothing prefetched; steps 2..6 each copied PREFETCH bytes that were dropped.
    assert_directions(rows, [STATE] + [STATE + PREFETCH] * 5, [STATE] * 6)
    assert moved(rows) == [2 * STATE] + [2 * STATE + PREFETCH] * 5


def test_overlap_prefetch_dropped_by_state_dict_is_not_queued_again_before_the_step(
    tmp_path, monkeypatch
):
    """With accumulation, after ``state_dict()`` dropped the first micro-batch's copies, the
    second micro-batch's forward queues none: the views it handed out may be written until the
    step. The dropped copies crossed the link and count."""
    counter = CountPrefetches(monkeypatch)

    class Data(TinyModel):
        def train_dataloader(self):
            return DataLoader(make_data(24), batch_size=4)  # 6 batches: 3 steps of 2

    logger, _ = fit(
        tmp_path,
        Data(force_staging=True, overlap_step=True),
        callbacks=[StateDictAfterBackward(lambda batch: batch % 2 == 0)],
        accumulate_grad_batches=2,
        max_steps=3,
    )
    rows = logger.rows
    assert [m[P + "interval_steps"] for _, m in rows] == [1.0] * 3
    # Steps 2 and 3: the first micro-batch's prefetch is dropped, the second queues none.
    assert counter.queued == 2
    assert_directions(rows, [STATE, STATE + PREFETCH, STATE + PREFETCH], [STATE] * 3)


# --------------------------------------------------------------------------- 2. resident


def resident_numel(share: float, order: list[int]) -> int:
    """The documented choice: whole parameters in ``order``, each that fits in what is left of
    share * state."""
    budget = int(share * STATE)
    numel = 0
    for n in order:
        if (numel + n) * 8 <= budget:
            numel += n
    return numel


@pytest.mark.parametrize(("share", "overlap"), [(0.9, False), (0.9, True), (1.0, True)])
def test_resident_share_moves_only_the_rest(tmp_path, share, overlap):
    model = TinyModel(force_staging=True, offload_resident=share, overlap_step=overlap)
    saver = ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=4, save_top_k=-1)
    logger, monitor = fit(tmp_path, model, callbacks=[saver], enable_checkpointing=True)
    rows = logger.rows
    # With overlap the arena is laid out in forward order; else in param-group order (decayed
    # weights first): l1.weight, l2.weight, then the biases and norm weights.
    order = FORWARD_ORDER if overlap else [256, 32, 32, 32, 32, 1]
    resident = 8 * resident_numel(share, order)
    if share == 0.9:
        assert 0 < resident < STATE
    if share == 1.0:
        assert resident == STATE
    rest = STATE - resident
    for _, m in rows:
        assert m[P + "resident_bytes"] == (resident if _ >= 1 else 0)
        assert m[P + "memory_saved_bytes"] == STATE - m[P + "resident_bytes"]
        assert m[P + "host_bytes"] == STATE  # the host keeps the whole state of record
    # Step 1 lays the state out (all staged); step 2 chooses the prefix and uploads it; the
    # checkpoint after step 4 reads the state (state_dict()): the resident part is written back
    # then (counted with step 5, the next step) and step 5 uploads it again.
    expected_in = [STATE, resident + rest, rest, rest, resident + rest, rest]
    if overlap and resident:
        # The forward before step 2 queued the first two chunks of step 1's plan, before step 2
        # chose the prefix: those copies crossed the link but serve no chunk (now resident).
        expected_in[1] += PREFETCH
    expected_out = [STATE, rest, rest, rest, resident + rest, rest]
    assert_directions(rows, expected_in, expected_out)
    assert moved(rows) == [i + o for i, o in zip(expected_in, expected_out, strict=True)]
    # After the last row the mixin writes the resident part back as training ends: the totals
    # (and the summary) count it.
    assert monitor.totals["bytes_in"] == sum(expected_in)
    assert monitor.totals["bytes_out"] == sum(expected_out) + resident

    # Resumed from the checkpoint after step 4: the loaded state is laid out anew, the prefix
    # chosen and uploaded at the first step (5); total_moved_bytes continues from the checkpoint,
    # which counts the write-back of the resident part that reading the state for it made.
    resumed = fit_resume(
        tmp_path / "resumed",
        TinyModel(force_staging=True, offload_resident=share, overlap_step=overlap),
        tmp_path / "ckpt" / "step=4.ckpt",
    ).rows
    assert [s for s, _ in resumed] == [4, 5]
    before = sum(expected_in[:4]) + sum(expected_out[:4]) + resident
    assert_directions(resumed, [resident + rest, rest], [rest, rest])
    assert [m[P + "total_moved_bytes"] for _, m in resumed] == [
        before + resident + 2 * rest,
        before + resident + 4 * rest,
    ]
    for _, m in resumed:
        assert m[P + "resident_bytes"] == resident


class KeepsCheckpoints(Callback):
    def __init__(self) -> None:
        self.kept: list[dict] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.kept.append(checkpoint)  # as an asynchronous writer does, to save it later


def test_saved_totals_are_a_snapshot_not_the_live_totals(tmp_path):
    """A checkpoint dict kept past its save holds the totals of its step, not later ones."""
    monitor, keeper = OffloadMonitor(summary=False), KeepsCheckpoints()
    saver = ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=2, save_top_k=-1)
    model = TinyModel(force_staging=True, offload_resident=0.9)
    callbacks = [monitor, saver, keeper]
    trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True, max_steps=6).fit(model)
    assert len(keeper.kept) == 3
    key = monitor.state_key
    for step, kept in zip((2, 4, 6), keeper.kept, strict=True):
        on_disk = torch.load(tmp_path / "ckpt" / f"step={step}.ckpt", weights_only=False)
        assert kept["callbacks"][key]["totals"] == on_disk["callbacks"][key]["totals"]
        assert on_disk["callbacks"][key]["totals"]["steps"] == step


class KeyedMonitor(OffloadMonitor):
    """A monitor with a state key of its own, as Lightning asks of a callback used twice."""

    @property
    def state_key(self) -> str:
        return f"OffloadMonitor[{self.prefix}]"


def saved_bytes(tmp_path, monitor: OffloadMonitor) -> dict:
    saver = ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=4, save_top_k=-1)
    model = TinyModel(force_staging=True, offload_resident=0.9)
    trainer(tmp_path, callbacks=[monitor, saver], enable_checkpointing=True, max_steps=4).fit(model)
    saved = torch.load(tmp_path / "ckpt" / "step=4.ckpt", weights_only=False)["callbacks"]
    totals = saved[monitor.state_key]["totals"]
    return {k: totals[k] for k in ("steps", "bytes_in", "bytes_out")}


def test_a_monitor_with_its_own_state_key_saves_the_write_back_too(tmp_path):
    plain = saved_bytes(tmp_path / "plain", OffloadMonitor(summary=False))
    keyed = saved_bytes(tmp_path / "keyed", KeyedMonitor(summary=False, prefix="x/"))
    assert keyed == plain
    # In: the whole state, then the resident part once and the rest per step. Out: the same,
    # the resident part by the write-back that reading the state for the checkpoint made.
    assert plain["bytes_in"] == plain["bytes_out"] and plain["steps"] == 4


class Validated(TinyModel):
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(4), batch_size=4)


def test_copies_queued_after_the_last_step_count_in_the_totals(tmp_path, monkeypatch):
    """A validation pass after the last step queues the copies of a next step's first chunks
    (overlap), which no step follows to count them: the totals count them when training
    ends."""
    counter = CountPrefetches(monkeypatch)
    model = Validated(force_staging=True, overlap_step=True)
    _, monitor = fit(tmp_path, model, max_steps=4, num_sanity_val_steps=0)
    assert counter.queued == 4  # before steps 2, 3 and 4, and in the validation after step 4
    assert monitor.totals["bytes_in"] == 4 * STATE + PREFETCH
    assert monitor.totals["bytes_out"] == 4 * STATE
    assert monitor.totals["steps"] == 4  # copies between steps are no step


class StopAtBatch(Callback):
    """Stops training at the end of batch ``index``, after the monitor's hook, as a ``Timer``'s
    ``max_time`` does: Lightning then writes that batch's row although it is no logging step."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.index:
            trainer.should_stop = True


def test_training_stopped_between_logging_steps_writes_its_last_interval(tmp_path):
    logger, monitor = fit(
        tmp_path,
        TinyModel(force_staging=True),
        log_every_n_steps=2,
        max_steps=10,
        callbacks=[StopAtBatch(2)],
    )
    rows = logger.rows
    # A row at step 1 (steps 1-2). Stopped at the 3rd: Lightning writes its row without the
    # monitor's values (they would repeat step 1's), and the monitor writes step 3's figures
    # when training ends.
    assert [s for s, _ in rows] == [1, 2]
    assert [m[P + "interval_steps"] for _, m in rows] == [2.0, 1.0]
    assert moved(rows) == [4 * STATE, 2 * STATE]
    assert_directions(rows, [2 * STATE, STATE], [2 * STATE, STATE])
    assert monitor.totals["steps"] == 3


@pytest.mark.parametrize("prog_bar", [False, True])
def test_rows_hold_the_documented_names_and_no_others(tmp_path, prog_bar):
    from test_monitor import NAMES

    monitor = OffloadMonitor(summary=False, prog_bar=prog_bar)
    logger, _ = fit(tmp_path, TinyModel(), monitor, log_every_n_steps=2, max_steps=3)
    expected = NAMES | ({P + "memory_saved_gb"} if prog_bar else set())
    assert [set(m) for _, m in logger.rows] == [expected, expected]  # steps 1, and 2 at the end


class FailsAtStep(Callback):
    """Raises at the end of the batch of optimizer step ``step``, before the monitor's hook."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("failed on purpose")


@pytest.mark.parametrize("in_flight", [False, True], ids=["read-at-batch-end", "in-flight"])
def test_steps_of_a_failed_fit_count_in_the_totals_not_in_the_next_fits_rows(
    tmp_path, monkeypatch, in_flight
):
    """A fit that raised left steps unread: its third (its batch never reached the monitor),
    and, ``in_flight`` (a device step whose events are not done at its batch's end: every
    step until the next row), all three. The next fit of the same monitor writes only its own
    steps in its rows; the totals hold both fits'. Steps taken by hand after the failure, on
    the failed fit's optimizer, are no fit's."""
    if in_flight:
        monkeypatch.setattr(StepRecord, "poll", lambda record: None)
    monitor, model = OffloadMonitor(summary=False), TinyModel(force_staging=True)
    with pytest.raises(RuntimeError, match="failed on purpose"):
        fit(tmp_path, model, monitor, log_every_n_steps=4, callbacks=[FailsAtStep(3)])
    model.net(torch.randn(2, 8)).sum().backward()
    model.trainer.optimizers[0].step()
    logger, _ = fit(tmp_path, TinyModel(force_staging=True), monitor, log_every_n_steps=4)
    assert [(s, m[P + "interval_steps"]) for s, m in logger.rows] == [(3, 4.0), (5, 2.0)]
    assert moved(logger.rows)[1:] == [4 * STATE]  # the first total includes the failed fit's
    assert monitor.totals["steps"] == 3 + 6
    assert monitor.totals["bytes_in"] == (3 + 6) * STATE


class LogsBatchIndex(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("batch_index", float(batch_idx), on_step=True, on_epoch=False)


def test_the_row_training_stops_on_keeps_other_callbacks_values(tmp_path):
    """Leaving the monitor's values out of the row Lightning writes when training stops between
    logging steps leaves what other callbacks (here one before it) logged at that batch in it."""
    logger = CaptureLogger()
    callbacks = [LogsBatchIndex(), OffloadMonitor(summary=False), StopAtBatch(2)]
    trainer(tmp_path, logger=logger, callbacks=callbacks, log_every_n_steps=2, max_steps=10).fit(
        TinyModel(force_staging=True)
    )
    lightnings = [(s, m) for s, m in logger.every_row if "loss" in m]  # the monitor's has none
    assert [(s, m.get("batch_index")) for s, m in lightnings] == [(1, 1.0), (2, 2.0)]
    assert not any(k.startswith(P) for k in lightnings[1][1])


def test_the_row_written_when_training_ends_holds_the_memory_saved_too(tmp_path):
    """With ``prog_bar=True`` every row holds ``memory_saved_gb``, also the one the monitor
    writes itself for the steps after Lightning's last logging step, the same float64 value
    (a float logged through Lightning became float32)."""
    logger, _ = fit(
        tmp_path,
        TinyModel(force_staging=True, offload_resident=0.5),
        monitor=OffloadMonitor(summary=False, prog_bar=True),
        log_every_n_steps=2,
        max_steps=3,
    )
    resident = 8 * resident_numel(0.5, [256, 32, 32, 32, 32, 1])  # param-group order
    assert [s for s, _ in logger.rows] == [1, 2]
    for _, row in logger.rows:
        assert row[P + "memory_saved_gb"] == (STATE - resident) / 1e9


@pytest.mark.parametrize("log_every_n_steps", [1, 2])
def test_training_stopped_on_an_accumulating_batch_writes_no_empty_row(tmp_path, log_every_n_steps):
    """Batch 2 only accumulates. Logging every step, the step of batch 1 has its row: nothing is
    left to write. Logging every 2nd, the monitor writes it (an accumulating batch between
    them must not make it forget that step)."""
    logger, monitor = fit(
        tmp_path,
        TinyModel(force_staging=True),
        accumulate_grad_batches=2,
        log_every_n_steps=log_every_n_steps,
        max_steps=10,
        callbacks=[StopAtBatch(2)],
    )
    assert [(s, m[P + "interval_steps"]) for s, m in logger.rows] == [(0, 1.0)]
    assert moved(logger.rows) == [2 * STATE]
    assert monitor.totals["steps"] == 1


def test_no_rows_when_step_logging_is_off(tmp_path):
    """``log_every_n_steps=0``: Lightning writes no step rows, nor does the monitor."""
    logger, monitor = fit(tmp_path, TinyModel(force_staging=True), log_every_n_steps=0)
    assert logger.rows == []
    assert monitor.totals["steps"] == 6


class ResidentLarge(TinyModel):
    """A 64 MiB parameter kept resident at a share of 0.5, and 134,220,312 bytes of state
    offloaded: a byte count float32 cannot hold (it rounds to a multiple of 16)."""

    OFFLOADED, RESIDENT = 16_777_539, 8 << 20

    def __init__(self) -> None:
        super().__init__(force_staging=True, offload_resident=0.5)
        self.offloaded = torch.nn.Parameter(torch.zeros(self.OFFLOADED))
        self.kept = torch.nn.Parameter(torch.zeros(self.RESIDENT))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        extra = self.offloaded.mean() + self.kept.mean()
        return super().training_step(batch, batch_idx) + extra

    def offload_optimizer_args(self) -> dict[str, Any]:
        return {**super().offload_optimizer_args(), "chunk_size": 1 << 22}  # not 64: 400k chunks


def test_memory_saved_is_exact_and_the_summary_reports_it_while_training(tmp_path):
    """``memory_saved_bytes`` is logged exactly (float64), and the summary at the end of fit
    reports the state held off the device during training, not after the mixin wrote the
    resident part back."""
    monitor = OffloadMonitor(summary=True)
    logger, _ = fit(tmp_path, ResidentLarge(), monitor=monitor, max_steps=2)
    offloaded = 8 * ResidentLarge.OFFLOADED
    assert float(torch.tensor(offloaded, dtype=torch.float32)) != offloaded
    resident = 8 * (ResidentLarge.RESIDENT + NUMEL)  # the rest fits in what is left
    assert logger.rows[-1][1][P + "resident_bytes"] == resident
    assert logger.rows[-1][1][P + "memory_saved_bytes"] == offloaded
    assert monitor.summary_text().startswith(
        f"OffloadMonitor: {offloaded / 1e9:.3f} GB of optimizer state kept in host memory"
    )
    assert f"{offloaded / 1e9:.3f}" != f"{(offloaded + resident) / 1e9:.3f}"


# --------------------------------------------------------------------------- 3. accumulation


class Batches12(TinyModel):
    def train_dataloader(self):
        return DataLoader(make_data(48), batch_size=4)  # 12 batches: 4 steps of 3 per epoch


def test_accumulation_with_a_log_cadence_not_dividing_the_steps(tmp_path):
    model = Batches12(force_staging=True)
    saver = ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=4, save_top_k=-1)
    logger, monitor = fit(
        tmp_path,
        model,
        accumulate_grad_batches=3,
        log_every_n_steps=3,
        max_steps=7,
        callbacks=[saver],
        enable_checkpointing=True,
    )
    rows = logger.rows
    # Logged at the 3rd and 6th optimizer step; step 7, between two of Lightning's logging
    # steps, is written when training ends, at its own step.
    assert [s for s, _ in rows] == [2, 5, 6]
    assert [m[P + "interval_steps"] for _, m in rows] == [3.0, 3.0, 1.0]
    assert [m[P + "total_moved_bytes"] for _, m in rows] == [6 * STATE, 12 * STATE, 14 * STATE]
    assert_directions(rows, [3 * STATE, 3 * STATE, STATE], [3 * STATE, 3 * STATE, STATE])
    assert monitor.totals["steps"] == 7
    assert monitor.totals["bytes_in"] + monitor.totals["bytes_out"] == 7 * 2 * STATE

    # Resume from step 4 to step 9: logged at the 6th and 9th steps; totals continue.
    resumed = fit_resume(
        tmp_path / "resumed",
        Batches12(force_staging=True),
        tmp_path / "ckpt" / "step=4.ckpt",
        accumulate_grad_batches=3,
        log_every_n_steps=3,
        max_steps=9,
    ).rows
    assert [s for s, _ in resumed] == [5, 8]
    assert [m[P + "total_moved_bytes"] for _, m in resumed] == [6 * 2 * STATE, 9 * 2 * STATE]
    assert [m[P + "interval_steps"] for _, m in resumed] == [2.0, 3.0]  # steps 5-6, 7-9


# --------------------------------------------------------------------------- 4. GradScaler


class ScaleWatcher(Callback):
    """Which optimizer steps GradScaler skipped: the scale drops exactly on those."""

    def __init__(self) -> None:
        self.skipped: list[bool] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._scale = trainer.precision_plugin.scaler.get_scale()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.skipped.append(trainer.precision_plugin.scaler.get_scale() < self._scale)


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_gradscaler_skips_count_neither_as_steps_nor_bytes(tmp_path, overlap):
    from lightning.pytorch.plugins.precision import MixedPrecision

    watcher = ScaleWatcher()
    logger, monitor = fit(
        tmp_path,
        TinyModel(force_staging=True, overlap_step=overlap, nan_at_batch=2),
        callbacks=[watcher],
        plugins=[MixedPrecision("16-mixed", "cpu")],
        max_steps=8,
    )
    rows = logger.rows
    assert len(rows) == 8 == len(watcher.skipped)
    assert watcher.skipped[2] and watcher.skipped[6]  # the inf loss of batch 2 (each epoch)
    taken = [0.0 if s else 1.0 for s in watcher.skipped]
    assert [m[P + "interval_steps"] for _, m in rows] == taken
    assert moved(rows) == [2 * STATE * t for t in taken]
    assert_directions(rows, [STATE * t for t in taken], [STATE * t for t in taken])
    for (_, m), t in zip(rows, taken, strict=True):
        if not t:
            assert m[P + "step_ms"] == m[P + "h2d_ms"] == m[P + "h2d_gbps"] == 0.0
    assert monitor.totals["steps"] == sum(taken)


# --------------------------------------------------------------------------- 5. two optimizers


class TwoStaged(TwoOptimizerModel):
    """Manual optimization: ``net`` (385 elements) and ``other`` (Linear(8, 8): 72) with an
    OffloadAdamW each, stepped alternately every batch, on the staged pipeline."""

    def configure_optimizers(self):
        groups = [self.net.parameters(), self.other.parameters()]
        return [OffloadAdamW(g, force_staging=True, chunk_size=CHUNK) for g in groups]


def test_two_optimizers_are_summed(tmp_path):
    other = 2 * 4 * (8 * 8 + 8)  # 576 bytes
    logger, _ = fit(tmp_path, TwoStaged(), max_steps=8)  # 4 batches, 2 steps each
    rows = logger.rows
    # Logged per batch (Lightning's logging step counts batches that stepped; global_step
    # counts both optimizers' steps: 8).
    assert [s for s, _ in rows] == [0, 1, 2, 3]
    for _, m in rows:
        assert m[P + "interval_steps"] == 2.0
        assert m[P + "memory_saved_bytes"] == m[P + "host_bytes"] == STATE + other
        assert m[P + "host_bytes_all_ranks"] == STATE + other
        assert m[P + "resident_bytes"] == 0.0
    assert moved(rows) == [2 * (STATE + other)] * 4
    assert_directions(rows, [STATE + other] * 4, [STATE + other] * 4)


class SteppedTwice(ManualModel):
    """Manual optimization with one OffloadAdamW stepped twice per batch (an inner loop)."""

    def __init__(self) -> None:
        super().__init__(force_staging=True)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        for _ in range(2):
            opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self(x), y))
            opt.step()


def test_one_optimizer_stepped_twice_per_batch_counts_both_steps(tmp_path):
    """Every optimizer step counts, also a second one of the same optimizer in a batch."""
    logger, monitor = fit(tmp_path, SteppedTwice(), max_steps=8)  # 4 batches, 2 steps each
    rows = logger.rows
    assert len(rows) == 4
    assert [m[P + "interval_steps"] for _, m in rows] == [2.0] * 4
    assert moved(rows) == [2 * 2 * STATE] * 4
    assert monitor.totals["steps"] == 8


# --------------------------------------------------------------------------- 6. DDP


def test_ddp_host_bytes_summed_over_ranks_with_overlap(tmp_path):
    from conftest import run_script

    run_script(Path(__file__).name, tmp_path, timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for rows in ranks:
        assert [s for s, _ in rows] == [1, 3]
        for _, m in rows:
            assert m[P + "host_bytes"] == STATE
            assert m[P + "host_bytes_all_ranks"] == 2 * STATE
            assert m[P + "memory_saved_bytes"] == STATE
            assert m[P + "interval_steps"] == 2.0  # mean over ranks, 2 steps each
        # This rank's bytes: each step moves the whole state both ways.
        assert [m[P + "total_moved_bytes"] for _, m in rows] == [2 * 2 * STATE, 4 * 2 * STATE]


def test_a_zero_redundancy_optimizer_of_offload_adamw_is_monitored(tmp_path):
    """``ZeroRedundancyOptimizer(optimizer_class=OffloadAdamW)`` (docs/scaling.md) steps its
    OffloadAdamW inside its own ``step()``: the monitor logs that optimizer's figures (it
    warned that the Trainer had none and logged nothing), checkpoints record its settings, and
    the mixin (whose ``configure_optimizers`` the module replaced) frees its staging buffers
    when training ends, without warning that the module has no OffloadAdamW."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_offload_optim.lightning.checkpoint import offload_metadata

    class ZeroModel(TinyModel):
        def configure_optimizers(self) -> Any:
            return ZeroRedundancyOptimizer(
                self.parameters(), OffloadAdamW, lr=0.01, force_staging=True, chunk_size=CHUNK
            )

    capture = CaptureLogger()
    fitted = trainer(
        tmp_path,
        max_steps=4,
        logger=capture,
        callbacks=[OffloadMonitor(summary=False)],
        log_every_n_steps=2,
    )
    rendezvous = f"file://{tmp_path / 'pg'}"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=rendezvous)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "OffloadMonitor")
            warnings.filterwarnings("error", ".*inherits OffloadOptimizerMixin")
            fitted.fit(ZeroModel())
    finally:
        dist.destroy_process_group()
    assert [s for s, _ in capture.rows] == [1, 3]
    for _, m in capture.rows:
        assert m[P + "memory_saved_bytes"] == m[P + "host_bytes"] == STATE
        assert m[P + "interval_steps"] == 2.0
    assert [m[P + "total_moved_bytes"] for _, m in capture.rows] == [2 * 2 * STATE, 4 * 2 * STATE]
    assert fitted.optimizers[0].optim.memory_stats()["staging_bytes"] == 0
    settings = offload_metadata(fitted.optimizers)["optimizers"]
    assert settings == [{"index": 0, "enabled": True, "chunk_size": CHUNK, "pin_memory": False}]


def _ddp_main(out: Path) -> None:
    """Run as a script by the test above; Lightning's launcher starts rank 1 by running it
    again. Each rank saves the rows it logged (every rank logs; Lightning's loggers write on
    rank zero only)."""

    capture = CaptureLogger()  # not rank-zero-only, as Lightning's own loggers are
    fitted = trainer(
        out / "run",
        strategy="ddp",
        devices=2,
        max_steps=4,
        logger=capture,
        callbacks=[OffloadMonitor(summary=False)],
        use_distributed_sampler=True,
        log_every_n_steps=2,
    )
    fitted.fit(TinyModel(force_staging=True, overlap_step=True))
    torch.save(capture.rows, out / f"rank{fitted.global_rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _ddp_main(Path(sys.argv[1]))
