"""trainer.fit(ckpt_path=...) with OffloadAdamW against torch AdamW doing the same save/resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import accelerator_seen, assert_same, assert_state_offloaded
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_models import TinyModel, trainer

from lightning_offload_optim import OffloadAdamW, OffloadMonitor
from lightning_offload_optim.lightning.checkpoint import (
    CHECKPOINT_KEY,
    FORMAT_VERSION,
    offload_metadata,
)

TOTAL_STEPS = 8  # two epochs of four batches


def checkpoints(tmp_path: Path, optimizer: str, every: int, **model_kwargs) -> Path:
    """Train TOTAL_STEPS steps, saving a checkpoint every ``every`` steps; return their folder."""
    folder = tmp_path / f"ckpt-{optimizer}"
    saver = ModelCheckpoint(folder, "{step}", every_n_train_steps=every, save_top_k=-1)
    trainer(tmp_path, max_steps=TOTAL_STEPS, callbacks=[saver], enable_checkpointing=True).fit(
        TinyModel(optimizer=optimizer, **model_kwargs)
    )
    return folder


def resume(tmp_path: Path, optimizer: str, ckpt: Path, callbacks=(), **model_kwargs) -> TinyModel:
    model = TinyModel(optimizer=optimizer, **model_kwargs)
    trainer(tmp_path, max_steps=TOTAL_STEPS, callbacks=list(callbacks)).fit(model, ckpt_path=ckpt)
    return model


@pytest.mark.parametrize("at", [4, 2], ids=["epoch-boundary", "mid-epoch"])
@pytest.mark.parametrize(
    ("before", "after"), [("offload", "offload"), ("torch", "offload")], ids=["offload", "torch"]
)
def test_resume_bit_identical_to_torch_doing_the_same(tmp_path, at, before, after):
    kwargs = {"warmup_steps": 2, "lr_schedule": "cosine"}
    resumed = resume(
        tmp_path / "a",
        after,
        checkpoints(tmp_path / "a", before, at, **kwargs) / f"step={at}.ckpt",
        **kwargs,
    )
    reference = resume(
        tmp_path / "b",
        "torch",
        checkpoints(tmp_path / "b", "torch", at, **kwargs) / f"step={at}.ckpt",
        **kwargs,
    )
    assert_same(list(resumed.parameters()), list(reference.parameters()))
    opt = resumed.trainer.optimizers[0]
    # Restored into host memory: Lightning's move of optimizer.state found only step counts.
    assert_state_offloaded(opt, list(opt.state))
    assert opt.state_dict()["state"][0]["step"] == TOTAL_STEPS


def test_offload_checkpoint_resumes_with_torch_adamw(tmp_path):
    """Switching offloading off for a running job: the checkpoint's param groups say
    ``fused=True`` (as torch's fused AdamW's do), which torch's load takes, so torch resumes on
    the fused kernel and trains on exactly as the all-torch run does."""
    folder = checkpoints(tmp_path, "offload", 4)
    resumed = resume(tmp_path, "torch", folder / "step=4.ckpt")
    reference = resume(
        tmp_path / "ref", "torch", checkpoints(tmp_path / "ref", "torch", 4) / "step=4.ckpt"
    )
    assert type(resumed.trainer.optimizers[0]) is torch.optim.AdamW
    assert resumed.trainer.optimizers[0].param_groups[0]["fused"] is True
    assert_same(list(resumed.parameters()), list(reference.parameters()))


def test_checkpoint_records_metadata_and_refuses_a_future_format(tmp_path):
    ckpt = checkpoints(tmp_path, "offload", 4) / "step=4.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    metadata = saved[CHECKPOINT_KEY]
    assert metadata["format_version"] == FORMAT_VERSION
    assert metadata["optimizers"] == [
        {"index": 0, "enabled": True, "chunk_size": 1 << 22, "pin_memory": False}
    ]
    saved[CHECKPOINT_KEY]["format_version"] = FORMAT_VERSION + 1
    future = tmp_path / "future.ckpt"
    torch.save(saved, future)
    with pytest.raises(RuntimeError, match=f"format version {FORMAT_VERSION + 1}.*Upgrade"):
        resume(tmp_path / "future", "offload", future)


def test_plain_lightning_checkpoint_without_metadata_loads(tmp_path):
    ckpt = checkpoints(tmp_path, "offload", 4) / "step=4.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    del saved[CHECKPOINT_KEY]
    plain = tmp_path / "plain.ckpt"
    torch.save(saved, plain)
    resumed = resume(tmp_path / "plain", "offload", plain)
    reference = resume(
        tmp_path / "ref", "torch", checkpoints(tmp_path / "ref", "torch", 4) / "step=4.ckpt"
    )
    assert_same(list(resumed.parameters()), list(reference.parameters()))
    assert resumed.trainer.optimizers[0].state_dict()["state"][0]["step"] == TOTAL_STEPS


def test_monitor_counters_continue_after_resume(tmp_path):
    folder = tmp_path / "ckpt"
    monitor = OffloadMonitor(summary=False)
    saver = ModelCheckpoint(folder, "{step}", every_n_train_steps=4, save_top_k=-1)
    trainer(tmp_path, max_steps=4, callbacks=[monitor, saver], enable_checkpointing=True).fit(
        TinyModel(force_staging=True)
    )
    moved = monitor.totals["bytes_in"]
    assert monitor.totals["steps"] == 4 and moved > 0
    resumed_monitor = OffloadMonitor(summary=False)
    resume(tmp_path / "b", "offload", folder / "step=4.ckpt", [resumed_monitor], force_staging=True)
    assert resumed_monitor.totals["steps"] == TOTAL_STEPS
    assert resumed_monitor.totals["bytes_in"] == 2 * moved


def test_overlapped_steps_fit_save_and_resume_like_torch(tmp_path, stream_order):
    """overlap_step=True on the staged pipeline: checkpoints saved between an overlapped step
    and the next forward, and the resumed run, equal torch AdamW's; every access is ordered."""
    kwargs = {"warmup_steps": 2, "lr_schedule": "cosine"}
    overlapped = {**kwargs, "overlap_step": True, "force_staging": True}
    resumed = resume(
        tmp_path / "a",
        "offload",
        checkpoints(tmp_path / "a", "offload", 2, **overlapped) / "step=2.ckpt",
        **overlapped,
    )
    reference = resume(
        tmp_path / "b",
        "torch",
        checkpoints(tmp_path / "b", "torch", 2, **kwargs) / "step=2.ckpt",
        **kwargs,
    )
    # No wait here: the mixin's on_train_end ordered reads of the weights after the updates.
    assert_same(list(resumed.parameters()), list(reference.parameters()))
    stream_order.expect_none()


def test_metadata_records_each_offload_optimizers_own_settings():
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    optimizers = [
        OffloadAdamW([params[0]], enabled=False),
        torch.optim.AdamW([params[1]]),
        OffloadAdamW([params[2]], chunk_size=64, pin_memory=False),
    ]
    assert offload_metadata(optimizers)["optimizers"] == [
        {"index": 0, "enabled": False, "chunk_size": optimizers[0].chunk_size, "pin_memory": False},
        {"index": 2, "enabled": True, "chunk_size": 64, "pin_memory": False},
    ]


def test_metadata_records_whether_the_host_state_is_pinned():
    """``pin_memory`` is the optimizer's own (resolved) setting, apart from the others: pinned
    where an accelerator is available (as in a GPU run), not pinned where staging is forced on
    the CPU."""
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    with accelerator_seen():
        pinned = OffloadAdamW([params[0]], pin_memory=None)  # built only: nothing pinned yet
    staged = OffloadAdamW([params[1]], pin_memory=False, force_staging=True)
    assert (pinned.pin_memory, staged.pin_memory) == (True, False)
    recorded = offload_metadata([pinned, staged])["optimizers"]
    assert [entry["pin_memory"] for entry in recorded] == [True, False]


def test_a_disabled_offload_run_records_enabled_false(tmp_path):
    model = TinyModel()
    model.hparams.offload_enabled = False  # plain torch AdamW behaviour
    saver = ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=2, save_top_k=-1)
    trainer(tmp_path, max_steps=2, callbacks=[saver], enable_checkpointing=True).fit(model)
    saved = torch.load(tmp_path / "ckpt" / "step=2.ckpt", weights_only=False)
    (entry,) = saved[CHECKPOINT_KEY]["optimizers"]
    assert entry["enabled"] is False
