"""Randomised Lightning runs: the mixin's OffloadAdamW (staged, under the stream-ordering checker)
against torch fused AdamW over the same param groups, with the schedule written out by hand
(``lightning_models.TinyModel``), bit-identical.

Each seed draws the precision, gradient accumulation, clipping, validation between steps,
warm-up and cosine schedule, ``overlap_step``, ``offload_resident``, and whether the run is
checkpointed at some step and resumed from there in a fresh Trainer. These are the settings
users combine; the hand-written scenarios cover them a few at a time.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_models import TinyModel, make_data, trainer
from torch.utils.data import DataLoader

MAX_STEPS = 6


class Validated(TinyModel):
    """TinyModel with a validation loop; the losses it sees are kept."""

    def __init__(self, **hparams: Any) -> None:
        super().__init__(**hparams)
        self.val_losses: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(torch.nn.functional.mse_loss(self(x).float(), y).detach())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(8, seed=1), batch_size=4)


def draw(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    accumulate = rng.choice([1, 2])
    return {
        "hparams": {
            "warmup_steps": rng.choice([0, 2]),
            "lr_schedule": rng.choice([None, "cosine"]),
        },
        "offload": {
            "overlap_step": rng.random() < 0.7,
            "offload_resident": rng.choice([None, 0.5, 0.9, 1.0, 900]),
        },
        "trainer": {
            "precision": rng.choice(["32-true", "bf16-mixed"]),
            "accumulate_grad_batches": accumulate,
            "gradient_clip_val": rng.choice([None, 0.05]),
            "val_check_interval": rng.choice([None, 2, 3]),
        },
        # at the end of an epoch (4 batches): a mid-epoch resume replays another order of data
        "resume_at": rng.choice([None, 4 // accumulate, 4]),
    }


def fit(root: Path, model: Validated, case: dict, ckpt_path: Path | None = None) -> None:
    kwargs = dict(case["trainer"], max_steps=MAX_STEPS, limit_val_batches=2)
    if kwargs.pop("val_check_interval") is None:
        kwargs["limit_val_batches"] = 0
    else:
        kwargs["val_check_interval"] = case["trainer"]["val_check_interval"]
    if case["resume_at"] is not None and ckpt_path is None:
        every = ModelCheckpoint(
            root / "ckpt", "{step}", every_n_train_steps=case["resume_at"], save_top_k=-1
        )
        kwargs.update(callbacks=[every], enable_checkpointing=True)
    trainer(root, num_sanity_val_steps=0, **kwargs).fit(model, ckpt_path=ckpt_path)


@pytest.mark.parametrize("seed", range(16))
def test_random_lightning_run_matches_torch(tmp_path, stream_order, seed):
    case = draw(seed)
    offload = Validated(force_staging=True, **case["hparams"], **case["offload"])
    reference = Validated(optimizer="torch", **case["hparams"])
    fit(tmp_path / "offload", offload, case)
    fit(tmp_path / "torch", reference, case)
    assert len(offload.val_losses) == len(reference.val_losses)
    assert_same(offload.val_losses, reference.val_losses)
    assert_same(list(offload.parameters()), list(reference.parameters()))
    if case["resume_at"] is not None:
        resumed = Validated(force_staging=True, **case["hparams"], **case["offload"])
        ckpt = tmp_path / "offload" / "ckpt" / f"step={case['resume_at']}.ckpt"
        fit(tmp_path / "resumed", resumed, case, ckpt_path=ckpt)
        assert_same(list(resumed.parameters()), list(reference.parameters()))
    stream_order.expect_none()
