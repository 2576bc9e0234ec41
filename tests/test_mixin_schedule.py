"""The mixin's learning-rate schedule and param groups, checked against independent references.

The references never reuse the mixin's schedule or groups: torch's own schedulers, the schedule
formula written out in ``lightning_models.reference_lr_factor``, and parameter lists made by hand.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import assert_same
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning, ModelCheckpoint
from lightning_models import TinyModel, make_data, reference_lr_factor, trainer
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torch.utils.data import DataLoader

from lightning_offload_optim import OffloadOptimizerMixin
from lightning_offload_optim.lightning.schedule import LINKED_GROUP_KEY, WarmupCosineLR

LR = 0.01


class LrRecorder(pl.Callback):
    """The lr of every param group at each optimizer step, keyed by the 0-based step."""

    def __init__(self) -> None:
        self.lrs: dict[int, list[float]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module, optimizer) -> None:
        step = trainer.global_step
        assert step not in self.lrs, "one record per optimizer step"
        self.lrs[step] = [float(g["lr"]) for g in trainer.optimizers[0].param_groups]


def torch_schedule_lrs(steps: int, scheduler_factory) -> list[float]:
    """The lr torch's own scheduler gives at each of ``steps`` steps, on a dummy SGD."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    scheduler = scheduler_factory(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def fit_recording(tmp_path: Path, model: pl.LightningModule, **trainer_kwargs: Any) -> LrRecorder:
    recorder = LrRecorder()
    callbacks = [recorder, *trainer_kwargs.pop("callbacks", [])]
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    trainer(tmp_path, callbacks=callbacks, **trainer_kwargs).fit(model, ckpt_path=ckpt_path)
    return recorder


# ------------------------------------------------------------------ 1. schedule values
def test_warmup_cosine_values_match_torch_schedulers(tmp_path):
    model = TinyModel(lr=LR, warmup_steps=3, lr_schedule="cosine")
    model.hparams.min_lr_ratio = 0.1
    recorder = fit_recording(tmp_path, model, max_steps=10)
    # Warm-up (s + 1) / 3 for s < 3, then a cosine from 1 at step 3 to 0.1 at step 10.
    expected = torch_schedule_lrs(
        10,
        lambda opt: SequentialLR(
            opt,
            [
                LinearLR(opt, start_factor=1 / 3, end_factor=1.0, total_iters=2),
                CosineAnnealingLR(opt, T_max=7, eta_min=0.1 * LR),
            ],
            milestones=[3],
        ),
    )
    assert sorted(recorder.lrs) == list(range(10))
    got = [recorder.lrs[s][0] for s in range(10)]
    assert got == pytest.approx(expected, rel=1e-9)
    # Every group is scheduled alike (the no-decay group too).
    assert all(lrs[1] == pytest.approx(lrs[0], rel=1e-12) for lrs in recorder.lrs.values())


def test_warmup_only_then_constant(tmp_path):
    recorder = fit_recording(tmp_path, TinyModel(lr=LR, warmup_steps=4), max_steps=8)
    got = [recorder.lrs[s][0] for s in range(8)]
    expected = [LR * (s + 1) / 4 for s in range(4)] + [LR] * 4
    assert got == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ 2. resume, longer horizon
SCHEDULE = {"warmup_steps": 2, "lr_schedule": "cosine"}


class FollowNewHorizon(pl.Callback):
    """For the torch reference: after a resume, set the lr of the restored step from the
    formula with this run's length (LambdaLR would train it at the checkpoint's stale lr)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module) -> None:
        total = int(trainer.estimated_stepping_batches)
        factor = reference_lr_factor(2, total, 0.0, trainer.global_step)
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = group["initial_lr"] * factor


def save_then_resume(
    tmp_path: Path, optimizer: str, at: int, first: int, second: int, callbacks=()
) -> tuple[TinyModel, LrRecorder, list[str]]:
    """Train a ``max_steps=first`` run, checkpointing at step ``at``; resume from there with
    ``max_steps=second``. Return the resumed model, its lrs and the resume's schedule warnings."""
    folder = tmp_path / "ckpt"
    saver = ModelCheckpoint(folder, "{step}", every_n_train_steps=at, save_top_k=-1)
    trainer(tmp_path / "first", max_steps=first, callbacks=[saver], enable_checkpointing=True).fit(
        TinyModel(optimizer=optimizer, lr=LR, **SCHEDULE)
    )
    model = TinyModel(optimizer=optimizer, lr=LR, **SCHEDULE)
    recorder = LrRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path / "second", max_steps=second, callbacks=[recorder, *callbacks]).fit(
            model, ckpt_path=folder / f"step={at}.ckpt"
        )
    messages = [str(w.message) for w in caught if "schedule" in str(w.message)]
    return model, recorder, messages


def test_resume_with_more_steps_follows_the_new_horizon(tmp_path):
    model, recorder, messages = save_then_resume(tmp_path / "offload", "offload", 4, 4, 10)
    assert len(messages) == 1, messages
    assert "WarmupCosineLR" in messages[0]
    assert "'total_steps': 4" in messages[0] and "'total_steps': 10" in messages[0]
    assert sorted(recorder.lrs) == list(range(4, 10))
    got = [recorder.lrs[s][0] for s in range(4, 10)]
    expected = [LR * reference_lr_factor(2, 10, 0.0, s) for s in range(4, 10)]
    assert got == pytest.approx(expected, rel=1e-9)
    assert min(got) > 0  # the checkpoint's horizon (4) would give 0 from step 4 on

    reference, _, reference_messages = save_then_resume(
        tmp_path / "torch", "torch", 4, 4, 10, callbacks=[FollowNewHorizon()]
    )
    assert reference_messages == []
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_resume_with_the_same_horizon_does_not_warn(tmp_path):
    _, recorder, messages = save_then_resume(tmp_path, "offload", 3, 6, 6)
    assert messages == []
    got = [recorder.lrs[s][0] for s in range(3, 6)]
    expected = [LR * reference_lr_factor(2, 6, 0.0, s) for s in range(3, 6)]
    assert got == pytest.approx(expected, rel=1e-9)


# ------------------------------------------------------------------ 3. norm weights, no decay
class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class T5LayerNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class LayerNorm2d(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))


class GroupNorm32(nn.GroupNorm):
    pass


class QKNormAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.q_norm_weight = nn.Parameter(torch.ones(dim))
        self.kNorm = nn.Parameter(torch.ones(dim))  # a name that says norm in capitals
        self.pos_bias = nn.Parameter(torch.zeros(dim))


class NormalHead(nn.Linear):
    """Named like a norm ("Normal...") but a plain projection: its weight is decayed."""


class ManyNorms(OffloadOptimizerMixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.rms = LlamaRMSNorm(8)
        self.t5 = T5LayerNorm(8)
        self.ln2d = LayerNorm2d(8)
        self.gn = GroupNorm32(2, 8)
        self.attention = QKNormAttention(8)
        self.linear = nn.Linear(8, 8)
        self.head = NormalHead(8, 4, bias=False)


def test_norm_weights_of_non_torch_norm_classes_are_not_decayed():
    model = ManyNorms()
    decayed = [model.embed.weight, model.attention.proj.weight, model.linear.weight]
    decayed.append(model.head.weight)
    spared = [model.rms.weight, model.t5.weight, model.ln2d.weight, model.ln2d.bias]
    spared += [model.gn.weight, model.gn.bias, model.attention.q_norm_weight]
    spared += [model.attention.kNorm]
    spared += [model.attention.pos_bias, model.linear.bias]
    assert len(decayed) + len(spared) == len(list(model.parameters()))  # the lists are complete

    decay_group, spared_group = model.configure_optimizers().param_groups
    assert {id(p) for p in decay_group["params"]} == {id(p) for p in decayed}
    assert {id(p) for p in spared_group["params"]} == {id(p) for p in spared}
    assert len(decay_group["params"]) == len(decayed)
    assert len(spared_group["params"]) == len(spared)
    assert decay_group["weight_decay"] == 1e-2 and spared_group["weight_decay"] == 0.0


# ------------------------------------------------------------------ 4. groups added later
class BackboneModel(OffloadOptimizerMixin, pl.LightningModule):
    def __init__(
        self,
        lr: float = LR,
        weight_decay: float = 0.1,
        warmup_steps: int = 2,
        lr_schedule: str | None = "cosine",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(), batch_size=4)  # 4 steps an epoch


class UnfreezeAtEpochOne(BaseFinetuning):
    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch: int, optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer)


def test_group_added_by_base_finetuning_is_split_and_follows_the_schedule(tmp_path):
    model = BackboneModel()
    backbone_before = [p.detach().clone() for p in model.backbone.parameters()]
    recorder = fit_recording(
        tmp_path, model, max_epochs=3, max_steps=-1, callbacks=[UnfreezeAtEpochOne()]
    )
    assert model.trainer.global_step == 12

    groups = model.trainer.optimizers[0].param_groups
    assert len(groups) == 4
    head_decay, _, added_decay, added_spared = groups
    linear, norm = model.backbone
    assert [id(p) for p in head_decay["params"]] == [id(model.head.weight)]
    assert [id(p) for p in added_decay["params"]] == [id(linear.weight)]
    assert {id(p) for p in added_spared["params"]} == {
        id(linear.bias),
        id(norm.weight),
        id(norm.bias),
    }
    assert len(added_spared["params"]) == 3
    assert added_decay["weight_decay"] == 0.1 and added_spared["weight_decay"] == 0.0
    assert LINKED_GROUP_KEY in added_decay
    assert added_decay[LINKED_GROUP_KEY] == added_spared[LINKED_GROUP_KEY]
    assert LINKED_GROUP_KEY not in head_decay or (
        head_decay[LINKED_GROUP_KEY] != added_decay[LINKED_GROUP_KEY]
    )
    # The backbone trained after the unfreeze.
    assert all(
        not torch.equal(a, b)
        for a, b in zip(backbone_before, model.backbone.parameters(), strict=True)
    )

    assert sorted(recorder.lrs) == list(range(12))
    for step in range(12):
        lrs = recorder.lrs[step]
        head = LR * reference_lr_factor(2, 12, 0.0, step)
        assert lrs[0] == pytest.approx(head, rel=1e-9), step
        assert lrs[1] == pytest.approx(head, rel=1e-9), step
        if step < 4:
            assert len(lrs) == 2, step
        else:
            assert lrs[2:] == pytest.approx([head / 10, head / 10], rel=1e-9), step


@pytest.mark.parametrize("schedule", [True, False], ids=["warmup-cosine", "no-schedule"])
def test_backbone_finetuning_hand_set_lr_reaches_both_halves(tmp_path, schedule):
    """BackboneFinetuning sets ``param_groups[-1]["lr"]`` at each epoch start: the no-decay half
    only. Its linked decayed half must train at that lr from the very next step on."""
    kwargs = {} if schedule else {"warmup_steps": 0, "lr_schedule": None}
    model = BackboneModel(**kwargs)
    recorder = fit_recording(
        tmp_path,
        model,
        max_epochs=3,
        max_steps=-1,
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
    )
    assert model.trainer.global_step == 12
    assert len(model.trainer.optimizers[0].param_groups) == 4

    def factor(step: int) -> float:
        return reference_lr_factor(2, 12, 0.0, step) if schedule else 1.0

    # Epoch 1: added at 0.1 of the head's lr; epoch 2 (step 8): set by hand to twice that
    # (BackboneFinetuning's default lambda_func); the schedule scales both from there.
    for step in range(4, 12):
        if step < 8:
            expected = 0.1 * LR * factor(step)
        else:
            expected = 0.2 * LR * factor(4) * factor(step) / factor(8)
        assert recorder.lrs[step][2:] == pytest.approx([expected, expected], rel=1e-9), step


class BackboneFinetuningOnResume(BackboneFinetuning):
    """BackboneFinetuning, with the backbone trainable again in a run resumed after the
    unfreeze epoch (Lightning restores the added groups, not ``requires_grad``)."""

    def finetune_function(self, pl_module, epoch: int, optimizer) -> None:
        if epoch > self.unfreeze_backbone_at_epoch:
            self.make_trainable(pl_module.backbone)
        super().finetune_function(pl_module, epoch, optimizer)


@pytest.mark.parametrize("schedule", [True, False], ids=["warmup-cosine", "no-schedule"])
def test_hand_set_lr_reaches_both_halves_after_a_resume(tmp_path, schedule):
    """Resumed from the checkpoint at the end of epoch 1, the first step of epoch 2 (where
    BackboneFinetuning sets the no-decay half's lr by hand) gives both halves that lr, and the
    run ends as the uninterrupted one does."""
    kwargs = {} if schedule else {"warmup_steps": 0, "lr_schedule": None}
    runs = {}
    for name, ckpt_path in (("full", None), ("resumed", tmp_path / "full" / "epoch=1.ckpt")):
        model = BackboneModel(**kwargs)
        saver = ModelCheckpoint(
            tmp_path / name, "{epoch}", save_top_k=-1, save_on_train_epoch_end=True
        )
        finetuning = BackboneFinetuningOnResume(unfreeze_backbone_at_epoch=1)
        recorder = fit_recording(
            tmp_path / name,
            model,
            max_epochs=3,
            max_steps=-1,
            callbacks=[finetuning, saver],
            enable_checkpointing=True,
            ckpt_path=ckpt_path,
        )
        runs[name] = (model, recorder)
    (full, full_lrs), (resumed, resumed_lrs) = runs["full"], runs["resumed"]
    assert sorted(resumed_lrs.lrs) == list(range(8, 12))
    for step in range(8, 12):
        halves = full_lrs.lrs[step][2:]
        assert halves[0] == halves[1] and resumed_lrs.lrs[step] == full_lrs.lrs[step], step
    assert_same(list(resumed.parameters()), list(full.parameters()))


class RecordsSteps(TinyModel):
    """Records, at each optimizer step (an LR finder's included: it swaps the Trainer's
    callbacks for its own), the first group's lr and whether the step overlaps."""

    def on_before_optimizer_step(self, optimizer) -> None:
        vars(self).setdefault("lrs", []).append(float(optimizer.param_groups[0]["lr"]))
        vars(self).setdefault("overlapping", []).append(optimizer._overlapping() is not None)


def test_the_lr_finders_suggestion_becomes_the_peak_of_the_warm_up(tmp_path, monkeypatch):
    """Lightning's LearningRateFinder runs its own steps at its own lrs (the finder's steps must
    use them, or its suggestion is off), then writes its suggestion into ``hparams.lr`` and into
    every param group: the schedule warms up to it and decays from it, and the real run still
    overlaps its steps."""
    from lightning.pytorch.callbacks import LearningRateFinder
    from lightning.pytorch.tuner import lr_finder

    suggestion, tries, steps = 0.003, 5, 10
    monkeypatch.setattr(lr_finder._LRFinder, "suggestion", lambda self, **_: suggestion)
    model = RecordsSteps(warmup_steps=4, lr_schedule="cosine", overlap_step=True)
    finder = LearningRateFinder(
        min_lr=1e-4, max_lr=1e-1, num_training_steps=tries, early_stop_threshold=None
    )
    trainer(tmp_path, max_steps=steps, callbacks=[finder]).fit(model)
    assert model.hparams.lr == suggestion
    assert len(model.lrs) == tries + steps
    assert model.lrs[:tries] == pytest.approx(finder.optimal_lr.results["lr"], rel=1e-9)
    expected = [suggestion * reference_lr_factor(4, steps, 0.0, step) for step in range(steps)]
    assert model.lrs[tries:] == pytest.approx(expected, rel=1e-9)
    assert all(model.overlapping)
    # The finder's steps ran on the same optimizer: after the fit none of its hooks is left.
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


class ScalableBatch(TinyModel):
    """TinyModel whose batch size the BatchSizeFinder can scale (``hparams.batch_size``)."""

    def __init__(self, batch_size: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(32), batch_size=self.hparams.batch_size)


def test_the_cosine_spans_the_run_after_the_batch_size_finder_callback(tmp_path):
    """Lightning's BatchSizeFinder callback scales the batch size in its on_fit_start, after
    configure_optimizers sized the cosine from the old epoch length (32 steps, not 16 at the
    batch size found): the schedule follows the run that trains, to its end."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    model = ScalableBatch(batch_size=2, warmup_steps=2, lr_schedule="cosine")
    finder = BatchSizeFinder(mode="power", max_trials=2, steps_per_trial=1)
    recorder = fit_recording(tmp_path, model, max_steps=-1, max_epochs=2, callbacks=[finder])
    assert model.hparams.batch_size == 4
    expected = [LR * reference_lr_factor(2, 16, 0.0, step) for step in range(16)]
    assert [recorder.lrs[s][0] for s in range(16)] == pytest.approx(expected, rel=1e-9)


class Streamed(TinyModel):
    """TinyModel fed by an IterableDataset without a length."""

    def train_dataloader(self) -> DataLoader:
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                yield from make_data()

        return DataLoader(Stream(), batch_size=4)


def test_a_cosine_over_data_without_length_asks_for_max_steps(tmp_path):
    """Lightning estimates -1 steps for an IterableDataset without max_steps: the error says
    what to set, not that an internal total_steps was -1."""
    model = Streamed(warmup_steps=2, lr_schedule="cosine")
    with pytest.raises(
        ValueError, match=r"which is -1: .*IterableDataset.*set the Trainer's max_st"
    ):
        trainer(tmp_path, max_steps=-1, max_epochs=1).fit(model)
    recorder = fit_recording(tmp_path, Streamed(warmup_steps=2, lr_schedule="cosine"), max_steps=4)
    expected = [LR * reference_lr_factor(2, 4, 0.0, step) for step in range(4)]
    assert [recorder.lrs[s][0] for s in range(4)] == pytest.approx(expected, rel=1e-9)


def test_a_cosine_over_no_training_steps_lets_the_fit_run(tmp_path):
    """limit_train_batches=0 (validation only) trains no step: nothing to size, no error."""
    model = TinyModel(warmup_steps=2, lr_schedule="cosine")
    run = trainer(tmp_path, max_steps=-1, max_epochs=1, limit_train_batches=0)
    run.fit(model)
    assert run.global_step == 0


def test_a_set_of_parameters_is_refused_as_torch_refuses_it():
    """torch refuses a set (its order changes between runs); the mixin's split must not
    accept one first."""
    model = BackboneModel(warmup_steps=0, lr_schedule=None)
    optimizer = model.configure_optimizers()
    with pytest.raises(TypeError, match="ordered collections"):
        optimizer.add_param_group({"params": set(model.backbone.parameters())})


# ------------------------------------------------------------------ 5. WarmupCosineLR alone
def run_sgd(optimizer, scheduler, steps: int, before_step=lambda step: None) -> list[list[float]]:
    """Step ``steps`` times; return the lr each group's update actually used at each step."""
    used = []
    for step in range(steps):
        before_step(step)
        params = [g["params"][0] for g in optimizer.param_groups]
        for p in params:  # SGD with a gradient of 1 from 0: the new value is -lr
            p.data.zero_()
            p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()
        used.append([-p.item() for p in params])
    return used


def param() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float64, requires_grad=True)


def sgd(*lrs: float) -> torch.optim.SGD:
    return torch.optim.SGD([{"params": [param()], "lr": lr} for lr in lrs], lr=1.0)


def expected_factor(step: int) -> float:
    return reference_lr_factor(2, 10, 0.2, step)


def test_group_added_mid_way_keeps_its_ratio():
    optimizer = sgd(1.0)
    scheduler = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)

    def add(step: int) -> None:
        if step in (1, 5):  # in the warm-up, and in the cosine: at 0.25 and 3 times group 0
            ratio = 0.25 if step == 1 else 3.0
            optimizer.add_param_group({"params": [param()], "lr": ratio * expected_factor(step)})

    used = run_sgd(optimizer, scheduler, 12, add)
    for step, row in enumerate(used):
        factor = expected_factor(step)
        assert row[0] == pytest.approx(factor, rel=1e-12), step
        if step >= 1:
            assert row[1] == pytest.approx(0.25 * factor, rel=1e-12), step
        if step >= 5:
            assert row[2] == pytest.approx(3.0 * factor, rel=1e-12), step


def test_hand_set_lr_is_kept_and_scheduled_from_there():
    optimizer = sgd(1.0, 1.0)
    scheduler = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)

    def set_by_hand(step: int) -> None:
        if step == 4:
            optimizer.param_groups[1]["lr"] = 0.5

    used = run_sgd(optimizer, scheduler, 11, set_by_hand)
    for step, (first, second) in enumerate(used):
        assert first == pytest.approx(expected_factor(step), rel=1e-12), step
        if step < 4:
            assert second == pytest.approx(expected_factor(step), rel=1e-12), step
        else:  # 0.5 trains step 4, later steps scale it as the schedule does
            expected = 0.5 * expected_factor(step) / expected_factor(4)
            assert second == pytest.approx(expected, rel=1e-12), step


def test_hand_set_lr_before_the_first_step_is_the_peak():
    """Set before any step (as the LR finder does) and taken as the peak, an lr is the base the
    warm-up rises to, for the linked groups too; the other group keeps its own."""
    optimizer = sgd(1.0)
    for _ in range(2):
        optimizer.add_param_group({"params": [param()], "lr": 0.1, LINKED_GROUP_KEY: 7})
    scheduler = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)
    optimizer.param_groups[2]["lr"] = 0.4
    scheduler.take_set_lrs_as_peaks()
    used = run_sgd(optimizer, scheduler, 11)
    for step, (first, *linked) in enumerate(used):
        factor = expected_factor(step)
        assert first == pytest.approx(factor, rel=1e-12), step
        assert linked == pytest.approx([0.4 * factor] * 2, rel=1e-12), step


def test_hand_set_lr_reaches_linked_groups_in_the_same_step():
    optimizer = sgd(1.0, 1.0)
    for _ in range(2):
        optimizer.add_param_group({"params": [param()], "lr": 0.1, LINKED_GROUP_KEY: 7})
    scheduler = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)

    def set_by_hand(step: int) -> None:
        if step == 3:
            optimizer.param_groups[3]["lr"] = 0.4
        if step == 6:  # both halves set apart: each keeps its own
            optimizer.param_groups[2]["lr"] = 0.3
            optimizer.param_groups[3]["lr"] = 0.6

    used = run_sgd(optimizer, scheduler, 10, set_by_hand)
    for step in range(10):
        assert used[step][:2] == pytest.approx([expected_factor(step)] * 2, rel=1e-12), step
        if step < 3:
            linked = [0.1 * expected_factor(step)] * 2
        elif step < 6:  # from step 3 itself, not one step late
            linked = [0.4 * expected_factor(step) / expected_factor(3)] * 2
        else:
            linked = [lr * expected_factor(step) / expected_factor(6) for lr in (0.3, 0.6)]
        assert used[step][2:] == pytest.approx(linked, rel=1e-12), step


def test_tensor_lrs_keep_their_base_and_stay_tensors():
    """A float32 tensor lr holds what the schedule writes rounded to float32: that is not an lr
    set by hand (taken so, a group added with one had its base re-derived from the rounded
    value at every step, drifting), and an lr given to a linked group goes into its tensor, as
    torch's schedulers write one (it was replaced by a float)."""
    optimizer = sgd(1.0)
    for _ in range(2):
        optimizer.add_param_group(
            {"params": [param()], "lr": torch.tensor(0.1), LINKED_GROUP_KEY: 7}
        )
    linked_lrs = [g["lr"] for g in optimizer.param_groups[1:]]
    scheduler = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)
    bases = []

    def add_and_set(step: int) -> None:
        if step == 1:
            lr = torch.tensor(0.3 * expected_factor(1), dtype=torch.float32)
            optimizer.add_param_group({"params": [param()], "lr": lr})
        if step == 4:
            optimizer.param_groups[2]["lr"].fill_(0.4)
        if step >= 2:
            bases.append(scheduler.base_lrs[3])

    used = run_sgd(optimizer, scheduler, 10, add_and_set)
    assert len(set(bases)) == 1  # the added group's base, taken once
    assert [g["lr"] for g in optimizer.param_groups[1:3]] == linked_lrs  # the same tensors
    for step in range(10):
        factor = expected_factor(step)
        linked = 0.1 * factor if step < 4 else 0.4 * factor / expected_factor(4)
        assert used[step][1:3] == pytest.approx([linked] * 2, rel=1e-6), step
        if step >= 1:
            assert used[step][3] == pytest.approx(0.3 * factor, rel=1e-6), step


def test_lrs_reported_after_a_load_of_another_shape_are_not_the_live_tensors():
    """A load whose schedule shape differs writes the lrs of this run's shape into the groups'
    tensors; ``get_last_lr()`` reports them as they were then, as torch's schedulers do (a later
    edit of a group's tensor does not change it)."""

    def scheduled(total: int) -> tuple[torch.optim.Optimizer, WarmupCosineLR]:
        optimizer = torch.optim.SGD([param()], lr=torch.tensor(1.0, dtype=torch.float64))
        return optimizer, WarmupCosineLR(optimizer, warmup_steps=2, total_steps=total)

    optimizer, schedule = scheduled(10)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    resumed_optimizer, resumed = scheduled(20)
    with pytest.warns(UserWarning, match="the checkpoint's schedule was"):
        resumed.load_state_dict(schedule.state_dict())
    reported = [float(lr) for lr in resumed.get_last_lr()]
    assert reported == [pytest.approx(expected_factor_over(20, 4))]
    resumed_optimizer.param_groups[0]["lr"].fill_(0.5)
    assert [float(lr) for lr in resumed.get_last_lr()] == reported


def expected_factor_over(total: int, step: int) -> float:
    return reference_lr_factor(2, total, 0.0, step)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1, "total_steps": 10}, "warmup_steps must be an int >= 0"),
        ({"warmup_steps": 2.5, "total_steps": 10}, r"warmup_steps must be an int >= 0, got 2\.5"),
        ({"warmup_steps": True, "total_steps": 10}, "warmup_steps must be an int"),
        ({"warmup_steps": 2, "total_steps": 0}, "total_steps must be an int >= 1"),
        ({"warmup_steps": 2, "total_steps": 10.0}, "total_steps must be an int >= 1"),
        ({"warmup_steps": 2, "total_steps": 10, "min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"warmup_steps": 2, "total_steps": 10, "min_lr_ratio": -0.1}, "min_lr_ratio"),
        ({"warmup_steps": 2, "total_steps": 10, "min_lr_ratio": "0"}, "min_lr_ratio"),
    ],
)
def test_argument_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmupCosineLR(sgd(1.0), **kwargs)


def test_a_warm_up_longer_than_the_schedule_warns():
    with pytest.warns(UserWarning, match="warmup_steps=12 is more than the schedule's 10 steps"):
        WarmupCosineLR(sgd(1.0), warmup_steps=12, total_steps=10)


def test_factor_past_the_end_stays_at_the_minimum():
    schedule = WarmupCosineLR(sgd(1.0), warmup_steps=0, total_steps=4, min_lr_ratio=0.3)
    assert [schedule.factor(s) for s in (0, 4, 5, 100)] == pytest.approx(
        [1.0, 0.3, 0.3, 0.3], rel=1e-12
    )
    assert schedule.factor(2) == pytest.approx(0.3 + 0.7 * (1 + math.cos(math.pi / 2)) / 2)


def _param() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float64, requires_grad=True)


def test_min_lr_ratio_one_is_accepted_and_means_constant_after_warmup():
    """min_lr_ratio is documented as [0, 1]: 1.0 (warm-up, then the peak lr) is a valid choice."""
    optimizer = torch.optim.SGD([_param()], lr=0.1)
    reference_opt = torch.optim.SGD([_param()], lr=0.1)
    schedule = WarmupCosineLR(optimizer, warmup_steps=3, total_steps=10, min_lr_ratio=1.0)
    reference = torch.optim.lr_scheduler.LambdaLR(
        reference_opt, lambda s: reference_lr_factor(3, 10, 1.0, s)
    )
    for _ in range(12):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(
            reference_opt.param_groups[0]["lr"], rel=1e-12
        )
        optimizer.step()
        schedule.step()
        reference_opt.step()
        reference.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1, rel=1e-12)


def test_hand_set_lr_between_the_step_and_the_scheduler_step_reaches_linked_groups():
    """Lightning steps a step-interval scheduler after ``on_train_batch_end``: an lr set by hand
    there (after ``optimizer.step()``, before ``scheduler.step()``) on one linked group must reach
    the groups linked to it, as one set before the step does."""
    optimizer = torch.optim.SGD([{"params": [_param()], "lr": 1.0}], lr=1.0)
    for _ in range(2):
        optimizer.add_param_group({"params": [_param()], "lr": 0.1, LINKED_GROUP_KEY: 3})
    schedule = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)
    used = []
    for step in range(8):
        for group in optimizer.param_groups:
            (p,) = group["params"]
            p.data.zero_()
            p.grad = torch.ones_like(p)
        optimizer.step()
        used.append([-g["params"][0].item() for g in optimizer.param_groups])
        if step == 3:  # after step 3's update, before the scheduler moves to step 4
            optimizer.param_groups[2]["lr"] = 0.4
        schedule.step()

    def factor(s: int) -> float:
        return reference_lr_factor(2, 10, 0.2, s)

    for step, (first, *linked) in enumerate(used):
        assert first == pytest.approx(factor(step), rel=1e-12), step
        # 0.4 was set while step 3's factor was in effect: both halves scale it alike
        expected = 0.1 * factor(step) if step <= 3 else 0.4 * factor(step) / factor(3)
        assert linked == pytest.approx([expected, expected], rel=1e-12), step


def test_take_set_lrs_as_peaks_after_the_first_step_changes_nothing():
    """Documented: after the first step a hand-set lr is the current one, not a peak, so
    ``take_set_lrs_as_peaks`` leaves it (and the schedule from it) alone."""
    optimizer = torch.optim.SGD([_param()], lr=1.0)
    schedule = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)
    for _ in range(3):
        optimizer.step()
        schedule.step()
    optimizer.param_groups[0]["lr"] = 0.5  # set by hand while step 3's factor is in effect
    schedule.take_set_lrs_as_peaks()
    assert optimizer.param_groups[0]["lr"] == 0.5
    optimizer.step()
    schedule.step()

    def factor(s: int) -> float:
        return reference_lr_factor(2, 10, 0.2, s)

    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * factor(4) / factor(3), rel=1e-12)


def test_a_scheduler_rebuilt_with_last_epoch_continues_from_added_and_hand_set_groups():
    """torch's way to resume outside Lightning: a new scheduler built with ``last_epoch`` reads
    each group's ``initial_lr``. A group added mid-way and a group whose lr was set by hand must
    carry the base lr the schedule uses for them, so the rebuilt scheduler continues the same."""
    optimizer = torch.optim.SGD([{"params": [_param()], "lr": 1.0}, {"params": [_param()]}], lr=1.0)
    schedule = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)
    for step in range(5):
        if step == 1:
            optimizer.add_param_group({"params": [_param()], "lr": 0.3})
        if step == 3:
            optimizer.param_groups[1]["lr"] = 0.5
        optimizer.step()
        schedule.step()
    before = [g["lr"] for g in optimizer.param_groups]
    rebuilt = WarmupCosineLR(optimizer, 2, 10, 0.2, last_epoch=schedule.last_epoch - 1)
    assert rebuilt.last_epoch == schedule.last_epoch
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(before, rel=1e-12)


def _legacy_state(schedule: WarmupCosineLR) -> dict:
    """The state dict 0.1 wrote: LambdaLR(WarmupCosine) keeps the lambda object's attributes
    under ``lr_lambdas`` and has neither the shape keys nor ``_written``."""
    state = {k: v for k, v in schedule.state_dict().items() if k not in ("_written",)}
    for name in ("warmup_steps", "total_steps", "min_lr_ratio"):
        state.pop(name)
    state["lr_lambdas"] = [{"warmup": 2, "total": 10, "min_ratio": 0.2}]
    return state


def test_a_legacy_lambda_lr_checkpoint_resumes_on_the_schedule():
    def run(resume_at: int | None) -> list[float]:
        optimizer = torch.optim.SGD([_param()], lr=1.0)
        schedule = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)
        lrs = []
        for step in range(10):
            if step == resume_at:
                saved_opt, saved_sched = optimizer.state_dict(), _legacy_state(schedule)
                optimizer = torch.optim.SGD([_param()], lr=1.0)
                schedule = WarmupCosineLR(
                    optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2
                )
                optimizer.load_state_dict(saved_opt)  # Lightning's order: optimizer first
                schedule.load_state_dict(saved_sched)
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
        return lrs

    expected = [reference_lr_factor(2, 10, 0.2, s) for s in range(10)]
    assert run(None) == pytest.approx(expected, rel=1e-12)
    assert run(4) == pytest.approx(expected, rel=1e-12)


def test_a_legacy_lambda_lr_checkpoint_resumed_with_a_longer_horizon_follows_it():
    """The 0.1 schedule's shape is read from ``lr_lambdas``: a resume whose Trainer plans more
    steps warns and follows this run's horizon from the restored step, as for a current one."""
    optimizer = torch.optim.SGD([_param()], lr=1.0)
    schedule = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    saved_opt, saved_sched = optimizer.state_dict(), _legacy_state(schedule)

    optimizer = torch.optim.SGD([_param()], lr=1.0)
    schedule = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=20, min_lr_ratio=0.2)
    optimizer.load_state_dict(saved_opt)
    with pytest.warns(UserWarning, match="'total_steps': 10"):
        schedule.load_state_dict(saved_sched)
    lrs = []
    for _ in range(4, 12):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs == pytest.approx(
        [reference_lr_factor(2, 20, 0.2, s) for s in range(4, 12)], rel=1e-12
    )


def test_get_last_lr_reports_the_peaks_taken_before_the_first_step():
    """After ``take_set_lrs_as_peaks`` (the LR finder's suggestion), ``get_last_lr()`` (what
    user code and loggers read) gives the lrs the first step uses, not the discarded ones."""
    optimizer = torch.optim.SGD([_param(), _param()], lr=1.0)
    schedule = WarmupCosineLR(optimizer, warmup_steps=4, total_steps=10)
    optimizer.param_groups[0]["lr"] = 0.2
    schedule.take_set_lrs_as_peaks()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 / 4, rel=1e-12)
    assert schedule.get_last_lr() == [optimizer.param_groups[0]["lr"]]


def test_a_legacy_checkpoint_of_the_same_schedule_resumes_without_a_warning():
    """A 0.1 checkpoint (the shape under ``lr_lambdas`` as warmup, total and min_ratio) resumed
    with the same shape is not a changed horizon: no warning, and the lrs follow warm-up then
    cosine, written out by hand."""

    def expected(step: int, warmup: int = 2, total: int = 10, low: float = 0.2) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / (total - warmup))
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))

    def make():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return optimizer, WarmupCosineLR(
            optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.2
        )

    optimizer, schedule = make()
    for _ in range(4):
        optimizer.step()
        schedule.step()
    legacy = {k: v for k, v in schedule.state_dict().items() if k != "_written"}
    for name in ("warmup_steps", "total_steps", "min_lr_ratio"):
        legacy.pop(name)
    legacy["lr_lambdas"] = [{"warmup": 2, "total": 10, "min_ratio": 0.2}]
    saved_optimizer = optimizer.state_dict()
    optimizer, schedule = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.load_state_dict(saved_optimizer)
        schedule.load_state_dict(legacy)
    assert not [w for w in caught if "WarmupCosineLR" in str(w.message)]
    lrs = []
    for _ in range(4, 10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs == pytest.approx([expected(s) for s in range(4, 10)], rel=1e-12)


# ------------------------------------------------------------------ 5. edge cases
def _sgd(lr: float = 1.0) -> torch.optim.SGD:
    return torch.optim.SGD([torch.zeros(1, dtype=torch.float64, requires_grad=True)], lr=lr)


def _run(optimizer, schedule, steps: range) -> list[float]:
    lrs = []
    for _ in steps:
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        schedule.step()
    return lrs


def test_a_warm_up_as_long_as_the_schedule_reaches_its_peak_and_does_not_warn():
    """A warm-up as long as the schedule reaches factor 1 on its last step: no 'never reaches
    its peak' warning."""
    optimizer = _sgd()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule = WarmupCosineLR(optimizer, warmup_steps=4, total_steps=4)
    assert not [w for w in caught if "never reaches its peak" in str(w.message)]
    assert _run(optimizer, schedule, range(4)) == pytest.approx([0.25, 0.5, 0.75, 1.0], rel=1e-12)


def test_follow_length_after_the_first_step_changes_nothing():
    """``follow_length`` acts only before the first step; once stepping, the schedule keeps its
    horizon."""
    optimizer = _sgd()
    schedule = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10)
    lrs = _run(optimizer, schedule, range(1))
    schedule.follow_length(20)
    assert schedule.total_steps == 10
    lrs += _run(optimizer, schedule, range(1, 10))
    assert lrs == pytest.approx([reference_lr_factor(2, 10, 0.0, s) for s in range(10)], rel=1e-12)


def test_an_lr_set_by_hand_just_before_a_checkpoint_is_kept_after_resuming():
    """An lr set by hand after step k and saved before step k+1 is, after loading, scheduled
    from there (hand * f(s) / f(k)), as without the save and load, not from base * f(s)."""

    def make():
        optimizer = _sgd()
        return optimizer, WarmupCosineLR(
            optimizer, warmup_steps=2, total_steps=10, min_lr_ratio=0.1
        )

    optimizer, schedule = make()
    _run(optimizer, schedule, range(4))  # last_epoch == 4: the lr in effect is f(4)
    optimizer.param_groups[0]["lr"] = 0.3  # by hand (BackboneFinetuning-style) between steps
    saved_opt, saved_sched = optimizer.state_dict(), schedule.state_dict()
    optimizer, schedule = make()
    optimizer.load_state_dict(saved_opt)  # Lightning's order: optimizer first
    schedule.load_state_dict(saved_sched)
    lrs = _run(optimizer, schedule, range(4, 10))
    factor = [reference_lr_factor(2, 10, 0.1, s) for s in range(10)]
    assert lrs == pytest.approx([0.3 * factor[s] / factor[4] for s in range(4, 10)], rel=1e-12)


def test_a_state_dict_recording_no_schedule_shape_loads_without_a_shape_change_warning():
    """A scheduler state that records no shape (a plain torch LambdaLR's, from a run that used
    its own schedule) is no changed horizon: no 'the checkpoint's schedule was {}' warning."""
    optimizer = _sgd()
    other = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for _ in range(3):
        optimizer.step()
        other.step()
    saved_opt, saved_sched = optimizer.state_dict(), other.state_dict()
    optimizer = _sgd()
    schedule = WarmupCosineLR(optimizer, warmup_steps=2, total_steps=10)
    optimizer.load_state_dict(saved_opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule.load_state_dict(saved_sched)
    assert not [w for w in caught if "WarmupCosineLR" in str(w.message)]
    assert schedule.last_epoch == 3
    # The lr restored with the optimizer is the one the next step uses.
    assert optimizer.param_groups[0]["lr"] == 1.0
