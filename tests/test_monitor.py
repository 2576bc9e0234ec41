"""OffloadMonitor: what reaches the logger, when, and its checks."""

from __future__ import annotations

import csv
import logging

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning_models import TinyModel, trainer

from lightning_offload_optim import OffloadMonitor

NAMES = {
    "offload/h2d_ms",
    "offload/d2h_ms",
    "offload/h2d_gbps",
    "offload/d2h_gbps",
    "offload/step_ms",
    "offload/step_ms_max",
    "offload/memory_saved_bytes",
    "offload/host_bytes",
    "offload/host_pinned",
    "offload/total_moved_bytes",
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
        assert float(row["offload/host_pinned"]) == 0.0
        assert float(row["offload/h2d_ms"]) > 0 and float(row["offload/h2d_gbps"]) > 0
        assert float(row["offload/step_ms_max"]) >= float(row["offload/step_ms"]) > 0
    # Each step moves the whole state in and out once.
    assert float(rows[-1]["offload/total_moved_bytes"]) == 6 * 2 * state_bytes


def test_direct_cpu_path_reports_no_copies(tmp_path):
    rows = logged_rows(tmp_path, TinyModel(), callbacks=[OffloadMonitor(summary=False)])
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
    with caplog.at_level(logging.INFO):
        trainer(tmp_path, callbacks=[OffloadMonitor()]).fit(TinyModel(force_staging=True))
    summary = [r.message for r in caplog.records if r.message.startswith("OffloadMonitor:")]
    assert len(summary) == 1
    assert "6 optimizer steps so far" in summary[0] and "GB/s" in summary[0]


def test_warns_once_without_offload_optimizer(tmp_path):
    monitor = OffloadMonitor()
    with pytest.warns(UserWarning, match="no enabled OffloadAdamW") as warned:
        trainer(tmp_path, callbacks=[monitor]).fit(TinyModel(optimizer="torch"))
    assert sum("OffloadAdamW" in str(w.message) for w in warned) == 1
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
    from lightning_offload_optim import OffloadAdamW

    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    assert opt.last_step is None
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    stats = opt.last_step.resolve()
    assert stats.bytes_in == stats.bytes_out == 8 * 20
    assert opt.last_step.poll() == stats


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
