"""OffloadMonitor: what reaches the logger, when, and its checks."""

from __future__ import annotations

import csv
import gc
import logging
import re
import types
import warnings
import weakref

import pytest
import torch
from conftest import accelerator_seen, assert_same
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning_models import AtTrainEnd, TinyModel, TwoOptimizerModel, trainer

from lightning_offload_optim import OffloadAdamW, OffloadMonitor, host_state, pipeline, step_stats
from lightning_offload_optim.step_stats import COPY_IN, COPY_OUT, STEP, StepRecord, StepStats

NAMES = {
    "offload/h2d_ms",
    "offload/d2h_ms",
    "offload/h2d_gbps",
    "offload/d2h_gbps",
    "offload/step_ms",
    "offload/step_ms_max",
    "offload/memory_saved_bytes",
    "offload/resident_bytes",
    "offload/host_bytes",
    "offload/host_bytes_all_ranks",
    "offload/host_pinned",
    "offload/total_moved_bytes",
    "offload/staging_bytes",
    "offload/interval_steps",
}


def logged_rows(tmp_path, model, **trainer_kwargs):
    logger = CSVLogger(tmp_path, name="run")
    trainer(tmp_path, logger=logger, log_every_n_steps=2, **trainer_kwargs).fit(model)
    with open(logger.experiment.metrics_file_path) as f:
        return [row for row in csv.DictReader(f) if row.get("offload/step_ms")]


def test_metrics_reach_the_logger_at_its_cadence(tmp_path):
    model = TinyModel(force_staging=True)
    rows = logged_rows(tmp_path, model, callbacks=[OffloadMonitor(summary=False)])
    assert [int(r["step"]) for r in rows] == [1, 3, 5]  # log_every_n_steps=2, 6 steps
    assert rows[0].keys() >= NAMES
    numel = sum(p.numel() for p in model.parameters())
    state_bytes = 8 * numel  # exp_avg + exp_avg_sq in fp32
    for row in rows:
        assert float(row["offload/memory_saved_bytes"]) == state_bytes
        assert float(row["offload/host_bytes"]) == state_bytes
        assert float(row["offload/host_bytes_all_ranks"]) == state_bytes  # one rank
        assert float(row["offload/host_pinned"]) == 0.0
        # Two staging buffers of the largest chunk (64 elements) for exp_avg and exp_avg_sq.
        assert float(row["offload/staging_bytes"]) == 2 * 2 * 64 * 4
        assert float(row["offload/interval_steps"]) == 2
        assert float(row["offload/h2d_ms"]) > 0 and float(row["offload/h2d_gbps"]) > 0
        assert float(row["offload/step_ms_max"]) >= float(row["offload/step_ms"]) > 0
    # Each step moves the whole state in and out once.
    assert float(rows[-1]["offload/total_moved_bytes"]) == 6 * 2 * state_bytes


def test_staging_shared_by_optimizers_of_one_pool_is_logged_once(tmp_path):
    """Both optimizers report their pool's staging: summed, it was logged twice over."""
    model = TwoOptimizerModel("offload-pool")
    rows = logged_rows(tmp_path, model, callbacks=[OffloadMonitor(summary=False)])
    first, second = model.trainer.optimizers
    assert first.staging_pool is second.staging_pool
    # Two sets of the larger optimizer's one chunk, for exp_avg and exp_avg_sq.
    largest = max(sum(p.numel() for p in m.parameters()) for m in (model.net, model.other))
    assert float(rows[-1]["offload/staging_bytes"]) == 2 * 2 * largest * 4


def test_resident_and_offloaded_bytes_are_logged(tmp_path):
    model = TinyModel(force_staging=True, offload_resident=0.9, overlap_step=True)
    end = AtTrainEnd()
    rows = logged_rows(tmp_path, model, callbacks=[OffloadMonitor(summary=False), end])
    stats = end.stats
    assert 0 < stats["resident_bytes"] < stats["state_bytes"]
    last = rows[-1]
    assert float(last["offload/resident_bytes"]) == stats["resident_bytes"]
    assert (
        float(last["offload/memory_saved_bytes"]) == stats["state_bytes"] - stats["resident_bytes"]
    )


def test_direct_cpu_path_reports_no_copies(tmp_path):
    rows = logged_rows(tmp_path, TinyModel(), callbacks=[OffloadMonitor(summary=False)])
    assert [int(r["step"]) for r in rows] == [1, 3, 5]
    assert all(
        float(r["offload/h2d_ms"]) == 0 and float(r["offload/total_moved_bytes"]) == 0 for r in rows
    )
    assert all(float(r["offload/step_ms"]) > 0 for r in rows)


def test_progress_bar_shows_memory_saved(tmp_path):
    model = TinyModel()
    fitted = trainer(tmp_path, log_every_n_steps=1, callbacks=[OffloadMonitor(prog_bar=True)])
    fitted.fit(model)
    numel = sum(p.numel() for p in model.parameters())
    assert fitted.progress_bar_metrics["offload/memory_saved_gb"] == pytest.approx(8 * numel / 1e9)


def test_summary_at_the_end_of_fit(tmp_path, caplog):
    model = TinyModel(force_staging=True)
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks=[OffloadMonitor()]).fit(model)
    summary = [r.message for r in caplog.records if r.message.startswith("OffloadMonitor:")]
    assert len(summary) == 1
    (opt,) = model.trainer.optimizers
    state_bytes = opt.memory_stats()["state_bytes"]
    assert summary[0].startswith(f"OffloadMonitor: {state_bytes / 1e9:.3f} GB of optimizer state")
    assert "6 optimizer steps so far" in summary[0] and "GB/s" in summary[0]
    assert f"{6 * 2 * state_bytes / 1e9:.3f} GB moved." in summary[0]
    assert "GiB" not in summary[0]


def test_summary_figures_use_gb_and_per_step_means():
    """GB = 1e9 bytes, as in the metric names: the state here is 0.020 GB but 0.019 GiB."""
    param = torch.nn.Parameter(torch.zeros(2_500_000))
    opt = OffloadAdamW([param])
    param.grad = torch.ones_like(param)
    opt.step()
    state_bytes = opt.memory_stats()["state_bytes"]
    assert state_bytes == 20_000_000
    monitor = OffloadMonitor()
    monitor._optimizers = [opt]
    monitor.totals.update(
        steps=4,
        step_seconds=2.0,
        copy_in_seconds=0.5,
        copy_out_seconds=1.0,
        bytes_in=3e9,
        bytes_out=3e9,
    )
    text = monitor.summary_text()
    assert text == (
        f"OffloadMonitor: {state_bytes / 1e9:.3f} GB of optimizer state kept in host memory "
        "(this rank); 4 optimizer steps so far, 500.0 ms/step."
        "\n  host->device 125.0 ms/step (6.0 GB/s), device->host 250.0 ms/step (3.0 GB/s); "
        "6.000 GB moved."
    )
    assert re.match(r"OffloadMonitor: 0\.020 GB ", text)
    assert "GiB" not in text


def test_warns_once_without_offload_optimizer(tmp_path):
    monitor = OffloadMonitor()
    with pytest.warns(UserWarning, match="no enabled OffloadAdamW") as warned:
        trainer(tmp_path, callbacks=[monitor]).fit(TinyModel(optimizer="torch"))
    assert sum("no enabled OffloadAdamW" in str(w.message) for w in warned) == 1
    assert monitor.totals["steps"] == 0


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"prefix": ""}, ValueError), ({"prefix": 3}, ValueError), ({"prog_bar": "yes"}, TypeError)],
)
def test_arguments_are_validated_at_construction(kwargs, error):
    with pytest.raises(error, match="OffloadMonitor"):
        OffloadMonitor(**kwargs)


def test_step_records_resolve_without_the_monitor():
    model = torch.nn.Linear(4, 4)
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    assert opt.last_step is None
    records = []
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        records.append(opt.last_step)
        stats = opt.last_step.resolve()
        # Each step moves the whole state (exp_avg + exp_avg_sq of 20 fp32 elements) each way,
        # once: the second step's record does not carry the first one's bytes.
        assert opt.memory_stats()["state_bytes"] == 8 * 20
        assert stats.bytes_in == stats.bytes_out == opt.memory_stats()["state_bytes"]
        assert stats.copy_in_seconds > 0 and stats.copy_out_seconds > 0
        assert stats.step_seconds > 0
    assert records[0] is not records[1]


class FakeEvent:
    """A timing event that completes when told to; ``elapsed_time`` refuses unfinished ends,
    as CUDA's does."""

    def __init__(self, ms: float = 0.0, done: bool = True) -> None:
        self.ms = ms  # elapsed time from this (begin) event to its end
        self.done = done
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done, "elapsed_time of an unfinished event"
        return self.ms


def record_with_fake_events(last_done: bool) -> tuple[StepRecord, list[FakeEvent], FakeEvent]:
    """Two copy-in spans, one copy-out and one step span; the step's end is ``last_done``."""
    record = StepRecord()
    spans = [(COPY_IN, 125.0), (COPY_IN, 250.0), (COPY_OUT, 500.0), (STEP, 1000.0)]
    begins, ends = [], []
    for kind, ms in spans:
        begins.append(FakeEvent(ms))
        ends.append(FakeEvent(done=kind != STEP or last_done))
        record.add_span(kind, begins[-1], ends[-1])
    record.add_span(COPY_IN, None, FakeEvent(ms=1e6))  # unrecorded (CPU) ends are ignored
    record.bytes_in, record.bytes_out = 10, 20
    return record, begins, ends[-1]


EXPECTED = StepStats(
    copy_in_seconds=0.375, copy_out_seconds=0.5, step_seconds=1.0, bytes_in=10, bytes_out=20
)


def test_step_record_poll_never_blocks_and_sums_spans():
    record, begins, last = record_with_fake_events(last_done=False)
    assert record.poll() is None
    assert record.poll() is None
    assert last.synchronized == 0  # polling never waits
    last.done = True  # the device caught up
    assert record.poll() == EXPECTED
    assert last.synchronized == 0
    assert all(b.synchronized == 0 for b in begins)


def test_step_record_resolve_waits_for_its_end_events():
    record, begins, last = record_with_fake_events(last_done=False)
    assert record.poll() is None
    assert record.resolve() == EXPECTED  # sums both copy-in spans; ms -> s
    assert last.synchronized == 1
    assert all(b.synchronized == 0 for b in begins)  # only ends are waited for
    assert record.resolve() == record.poll() == EXPECTED  # read once, then kept
    assert last.synchronized == 1


def test_step_record_on_the_cpu_adds_wall_clock_spans():
    record = StepRecord()
    record.add_seconds(STEP, 0.25)
    record.add_seconds(STEP, 0.5)
    assert record.poll() == StepStats(0.0, 0.0, 0.75, 0, 0)


def test_with_accumulation_each_logged_row_covers_its_optimizer_steps(tmp_path):
    """Lightning drops step logs of accumulating batches; the monitor must not compute there."""
    rows = logged_rows(
        tmp_path,
        TinyModel(),
        callbacks=[OffloadMonitor(summary=False)],
        accumulate_grad_batches=2,
        max_steps=4,
        max_epochs=-1,
    )
    assert [int(r["step"]) for r in rows] == [1, 3]
    assert [float(r["offload/interval_steps"]) for r in rows] == [2.0, 2.0]


def test_interval_without_an_optimizer_step_logs_no_timings(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    logger = CSVLogger(tmp_path, name="run")
    trainer(
        tmp_path,
        logger=logger,
        log_every_n_steps=1,
        max_epochs=1,
        max_steps=-1,
        plugins=[MixedPrecision("16-mixed", "cpu")],  # one step overflows fp16 and is skipped
        callbacks=[OffloadMonitor(summary=False)],
    ).fit(TinyModel())
    with open(logger.experiment.metrics_file_path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("offload/interval_steps")]
    steps = [float(r["offload/interval_steps"]) for r in rows]
    assert sorted(steps) == [0.0, 1.0, 1.0, 1.0]
    for row, count in zip(rows, steps, strict=True):
        if count == 0:
            assert float(row["offload/step_ms"]) == 0.0  # not nan
        else:
            assert float(row["offload/step_ms"]) > 0


def test_steps_not_read_yet_are_counted_in_checkpoints(tmp_path, monkeypatch):
    """On a GPU a step's timing events are usually unfinished when the checkpoint is written."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_offload_optim.step_stats import StepRecord

    monkeypatch.setattr(StepRecord, "poll", lambda self: None)  # never finished when polled
    saver = ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=3, save_top_k=-1)
    monitor = OffloadMonitor(summary=False)
    trainer(tmp_path, max_steps=3, callbacks=[monitor, saver], enable_checkpointing=True).fit(
        TinyModel(force_staging=True)
    )
    saved = torch.load(tmp_path / "ckpt" / "step=3.ckpt", weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("OffloadMonitor")]
    assert state["totals"]["steps"] == 3
    assert monitor.totals["steps"] == 3


class FakeClock:
    """``time.perf_counter`` advancing by exactly 1 ms per call."""

    def __init__(self) -> None:
        self.calls = 0

    def perf_counter(self) -> float:
        self.calls += 1
        return self.calls / 1000


@pytest.mark.no_stream_check  # the production CPU path: spans timed with time.perf_counter
def test_logged_timings_are_per_step_sums_over_chunks(tmp_path, monkeypatch):
    clock = FakeClock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(step_stats, "time", fake_time)
    monkeypatch.setattr(pipeline, "time", fake_time)
    model = TinyModel(force_staging=True)
    end = AtTrainEnd()
    rows = logged_rows(tmp_path, model, callbacks=[OffloadMonitor(summary=False), end])
    assert [int(r["step"]) for r in rows] == [1, 3, 5]

    (opt,) = model.trainer.optimizers
    (plan,) = end.plans
    chunks = len(plan)
    assert chunks == 7  # 385 elements in chunks of 64: the sums below need several
    bytes_per_step = sum(c.numel for c in plan) * 4 * 2  # exp_avg + exp_avg_sq, fp32
    assert bytes_per_step == opt.memory_stats()["state_bytes"] == opt.last_step.resolve().bytes_in
    # A step reads the clock once at its start and end, and twice per chunk for each copy span.
    assert clock.calls == 6 * (2 + 4 * chunks)
    step_ms = 1.0 + 4 * chunks  # from the first call to the last
    expected = {
        "offload/interval_steps": 2.0,
        "offload/h2d_ms": chunks * 1.0,  # 1 ms per chunk, summed over chunks, mean over steps
        "offload/d2h_ms": chunks * 1.0,
        "offload/step_ms": step_ms,
        "offload/step_ms_max": step_ms,
        "offload/h2d_gbps": bytes_per_step / (chunks * 1e-3) / 1e9,
        "offload/d2h_gbps": bytes_per_step / (chunks * 1e-3) / 1e9,
    }
    # Logged as float64: the fake clock's sums are exact but for float64 rounding.
    for i, row in enumerate(rows):
        assert {k: float(row[k]) for k in expected} == pytest.approx(expected, rel=1e-12)
        moved = float(row["offload/total_moved_bytes"])
        assert moved == 2 * 2 * (i + 1) * bytes_per_step


class SlowFirstStep(FakeClock):
    """A second passes between the first step's start (the first call) and its first copy."""

    def perf_counter(self) -> float:
        return super().perf_counter() + (1.0 if self.calls > 1 else 0.0)


@pytest.mark.no_stream_check  # the production CPU path: spans timed with time.perf_counter
def test_the_slowest_step_is_that_of_its_rows_interval(tmp_path, monkeypatch):
    """A slow first step (a warm-up) is the maximum of the first row only."""
    fake_time = types.SimpleNamespace(perf_counter=SlowFirstStep().perf_counter)
    monkeypatch.setattr(step_stats, "time", fake_time)
    monkeypatch.setattr(pipeline, "time", fake_time)
    rows = logged_rows(tmp_path, TinyModel(force_staging=True), callbacks=[OffloadMonitor()])
    step_ms = 1.0 + 4 * 7  # as above: 7 chunks, 1 ms per clock call
    maxima = [float(r["offload/step_ms_max"]) for r in rows]
    assert maxima == pytest.approx([1000 + step_ms, step_ms, step_ms], rel=1e-12)


class PinningModel(TinyModel):
    """Builds its OffloadAdamW (pin_memory=None) as if an accelerator were available."""

    def __init__(self) -> None:
        super().__init__(force_staging=True)

    def configure_optimizers(self):
        # Only the optimizer's construction sees the patch (it decides there whether to pin);
        # Lightning's accelerator handling and the DataLoader never do.
        with accelerator_seen():
            optimizer = super().configure_optimizers()
        assert optimizer.pin_memory  # it will try to pin its host buffers
        return optimizer


def test_failed_pinning_falls_back_with_one_warning(tmp_path):
    """This CPU-only torch cannot pin: torch.empty(pin_memory=True) raises."""
    model = PinningModel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = logged_rows(tmp_path / "pin", model, callbacks=[OffloadMonitor(summary=False)])
    fallbacks = [w for w in caught if "could not pin host memory" in str(w.message)]
    assert len(fallbacks) == 1
    assert fallbacks[0].category is UserWarning
    assert [int(r["step"]) for r in rows] == [1, 3, 5]
    assert all(float(r["offload/host_pinned"]) == 0.0 for r in rows)
    (opt,) = model.trainer.optimizers
    assert opt.memory_stats()["pinned"] is False

    reference = TinyModel(optimizer="torch")
    trainer(tmp_path / "plain").fit(reference)
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_pinned_state_is_reported(tmp_path, monkeypatch):
    """host_pinned follows the optimizer's buffers: 1 where they are pinned (faked here)."""
    from lightning_offload_optim import host_state

    def fake_pinned(numel, dtype, device):
        return host_state.host_empty(numel, dtype), []  # pageable, but reported as pinned

    monkeypatch.setattr(host_state, "_pinned_empty", fake_pinned)
    model = PinningModel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = logged_rows(tmp_path, model, callbacks=[OffloadMonitor(summary=False)])
    assert not [w for w in caught if "could not pin" in str(w.message)]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]
    assert all(float(r["offload/host_pinned"]) == 1.0 for r in rows)


def test_a_disabled_offload_optimizer_is_not_monitored(tmp_path):
    """``offload_enabled=False`` gives torch AdamW behaviour: nothing is offloaded, so the
    monitor warns as for torch's AdamW and logs no offload figures."""
    model = TinyModel()
    model.hparams.offload_enabled = False
    monitor = OffloadMonitor(summary=False)
    with pytest.warns(UserWarning, match="no enabled OffloadAdamW"):
        fitted = trainer(tmp_path, log_every_n_steps=1, callbacks=[monitor])
        fitted.fit(model)
    assert not [k for k in fitted.logged_metrics if k.startswith("offload/")]
    assert monitor.totals["steps"] == 0


class StepsAlsoWithoutGradients(TinyModel):
    """Manual optimization that also calls ``step()`` before any gradient exists in the batch
    (a step with nothing to update, which makes no step record); ``stepped_before_fit``: its
    optimizer, made here, already took a step (its record is no step of the fit)."""

    def __init__(self, stepped_before_fit: bool = False) -> None:
        super().__init__(force_staging=True)
        self.automatic_optimization = False
        self.optimizer = None
        if stepped_before_fit:
            self.optimizer = OffloadAdamW(self.parameters(), force_staging=True, chunk_size=64)
            for p in self.parameters():
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.optimizer.zero_grad()

    def configure_optimizers(self):
        return self.optimizer or super().configure_optimizers()

    def training_step(self, batch, batch_idx) -> None:
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        opt.step()  # nothing to update
        x, y = batch
        self.manual_backward(((self(x) - y) ** 2).mean())
        opt.step()


@pytest.mark.parametrize("stepped_before_fit", [False, True])
def test_a_step_with_nothing_to_update_is_not_counted(tmp_path, stepped_before_fit):
    model = StepsAlsoWithoutGradients(stepped_before_fit)
    monitor = OffloadMonitor(summary=False)
    trainer(tmp_path, max_steps=12, callbacks=[monitor]).fit(model)  # 6 batches, 2 steps each
    (opt,) = model.trainer.optimizers
    state_bytes = opt.memory_stats()["state_bytes"]
    assert monitor.totals["steps"] == 6  # the updates only
    assert monitor.totals["bytes_in"] == 6 * state_bytes


def test_the_optimizer_does_not_keep_the_monitor_alive_after_fit(tmp_path):
    model = TinyModel(force_staging=True)
    monitor = OffloadMonitor(summary=False)
    trainer(tmp_path, callbacks=[monitor]).fit(model)
    (optimizer,) = model.trainer.optimizers  # kept by the user, e.g. to fit again
    gone = weakref.ref(monitor)
    del monitor, model
    gc.collect()
    assert gone() is None
    assert not optimizer._optimizer_step_post_hooks


class WithMoreState(TinyModel):
    """8,003,080 bytes of state instead of TinyModel's 3,080."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Parameter(torch.zeros(1_000_000))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + self.extra.sum()


class SummaryEachBatch(Callback):
    def __init__(self, monitor: OffloadMonitor) -> None:
        self.monitor, self.texts = monitor, []

    def on_train_batch_end(self, *args) -> None:
        self.texts.append(self.monitor.summary_text())


def test_a_monitor_fitted_again_summarises_the_new_fits_state(tmp_path):
    """The memory saved noted when the first fit ended is not the second fit's while it trains."""
    monitor = OffloadMonitor(summary=False)
    trainer(tmp_path / "first", max_steps=2, callbacks=[monitor]).fit(TinyModel())
    summaries = SummaryEachBatch(monitor)
    trainer(tmp_path / "second", max_steps=2, callbacks=[monitor, summaries]).fit(WithMoreState())
    assert all(t.startswith("OffloadMonitor: 0.008 GB of optimizer state") for t in summaries.texts)
    assert monitor.summary_text().startswith("OffloadMonitor: 0.008 GB")


def test_interval_totals_reduce_the_slowest_step_as_a_maximum_over_ranks():
    """Two ranks' intervals merged as torchmetrics merges them across ranks: counters and host
    bytes add up, the slowest step is the slower rank's (not the sum of both)."""
    from lightning_offload_optim.lightning.monitor import COUNTERS, IntervalTotals

    ranks = []
    for step_seconds in (0.003, 0.005):
        totals = IntervalTotals()
        values = torch.zeros(len(COUNTERS) + 2, dtype=torch.float64)  # + slowest, host bytes
        values[COUNTERS.index("steps")] = 1.0
        values[COUNTERS.index("step_seconds")] = values[-2] = step_seconds
        values[-1] = 100.0
        totals.update(values)
        ranks.append(totals)
    ranks[0].merge_state(ranks[1])
    sums, slowest, host_bytes = ranks[0].compute()
    assert slowest.item() == 0.005
    assert sums[COUNTERS.index("steps")].item() == 2.0
    assert sums[COUNTERS.index("step_seconds")].item() == 0.003 + 0.005
    assert host_bytes.item() == 200.0


@pytest.mark.parametrize("prog_bar", [False, True])
def test_without_a_logger_rows_are_reduced_only_for_the_progress_bar(
    tmp_path, monkeypatch, prog_bar
):
    """``logger=False``: a row no logger writes is not computed (its reduction is a collective
    on every logging step under DDP), unless the progress bar shows it. The totals and the
    summary count every step either way."""
    from lightning_offload_optim.lightning.monitor import IntervalTotals

    computed = []
    real = IntervalTotals.compute
    monkeypatch.setattr(IntervalTotals, "compute", lambda m: computed.append(1) or real(m))
    monitor = OffloadMonitor(summary=False, prog_bar=prog_bar)
    fitted = trainer(tmp_path, logger=False, log_every_n_steps=2, callbacks=[monitor])
    fitted.fit(TinyModel(force_staging=True))
    assert len(computed) == (3 if prog_bar else 0)  # 6 steps, every 2nd logs
    assert monitor.totals["steps"] == 6
    assert ("offload/memory_saved_gb" in fitted.progress_bar_metrics) == prog_bar


def test_summary_false_prints_no_summary(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks=[OffloadMonitor(summary=False)]).fit(TinyModel())
    assert not [r for r in caplog.records if r.message.startswith("OffloadMonitor:")]


def test_host_pinned_is_one_only_when_every_optimizer_is_pinned(tmp_path, monkeypatch):
    """Two OffloadAdamW, one pinned (faked, as in test_pinned_state_is_reported) and one not:
    the state is not all page-locked, so ``host_pinned`` is 0."""
    monkeypatch.setattr(
        host_state,
        "_pinned_empty",
        lambda numel, dtype, device: (host_state.host_empty(numel, dtype), []),
    )

    class HalfPinned(TwoOptimizerModel):
        def configure_optimizers(self):
            with accelerator_seen():  # only the first decides to pin
                pinned = OffloadAdamW(self.net.parameters(), lr=0.01, force_staging=True)
            pageable = OffloadAdamW(
                self.other.parameters(), lr=0.01, force_staging=True, pin_memory=False
            )
            return [pinned, pageable]

    model = HalfPinned()
    rows = logged_rows(tmp_path, model, callbacks=[OffloadMonitor(summary=False)])
    assert [o.memory_stats()["pinned"] for o in model.trainer.optimizers] == [True, False]
    assert rows and all(float(r["offload/host_pinned"]) == 0.0 for r in rows)


def test_each_rank_resumes_from_its_own_saved_totals(tmp_path):
    """A checkpoint of N ranks holds each rank's totals; resumed on as many ranks, each takes
    its own, on another number of ranks the saved rank's (``totals``)."""
    import torch.distributed as dist

    saved = dict.fromkeys(("steps", "bytes_in"), 1.0)
    this_rank = dict.fromkeys(("steps", "bytes_in"), 2.0)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'pg'}")
    try:
        monitor = OffloadMonitor()
        monitor.load_state_dict({"totals": saved, "totals_by_rank": [this_rank]})
        assert monitor.totals["steps"] == monitor.totals["bytes_in"] == 2.0
        monitor = OffloadMonitor()
        monitor.load_state_dict({"totals": saved, "totals_by_rank": [this_rank, this_rank]})
        assert monitor.totals["steps"] == monitor.totals["bytes_in"] == 1.0
    finally:
        dist.destroy_process_group()
