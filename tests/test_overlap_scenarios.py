"""Overlapped steps (``overlap_step=True`` / ``overlap_with``) in scenarios users hit, on the
staged pipeline (``force_staging=True``) under the stream-ordering checker, against
``torch.optim.AdamW(fused=True)`` on the same inputs.

Every scenario also runs with part of the state resident (``offload_resident=0.5`` / ``0.9``).
The two-process DDP scenarios run this file as a script (``python tests/test_overlap_scenarios.py
OUT``), as ``test_ddp.py`` runs ``ddp_fit.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    MasterCopyAdamW,
    assert_resident_as_asked,
    assert_same,
    overlapped_pair,
    run_script,
    token_batches,
    train_alike,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_models import make_data, torch_reference, trainer
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_offload_optim import OffloadAdamW, OffloadOptimizerMixin

RESIDENT = [None, 0.5, 0.9]
RESIDENT_IDS = ["offloaded", "resident-0.5", "resident-0.9"]


# ----------------------------------------------------------------------------- helpers
def reference_groups(module: nn.Module) -> list[dict[str, Any]]:
    """The mixin's grouping written out independently: biases and norm parameters undecayed."""
    decay, spared = [], []
    for child in module.modules():
        norm = isinstance(child, (nn.LayerNorm, nn.BatchNorm1d))
        for name, param in child.named_parameters(recurse=False):
            (spared if norm or name == "bias" else decay).append(param)
    return [g for g in ({"params": decay}, {"params": spared, "weight_decay": 0.0}) if g["params"]]


class Base(OffloadOptimizerMixin, pl.LightningModule):
    """``optimizer="offload"``: the mixin with ``overlap_step=True`` on the staged pipeline;
    ``"torch"``: torch fused AdamW over the same groups. Subclasses define ``build()``."""

    def __init__(
        self,
        optimizer: str = "offload",
        lr: float = 0.01,
        weight_decay: float = 0.1,
        offload_resident: float | None = None,
        **extra: Any,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.save_hyperparameters({"overlap_step": optimizer == "offload"})
        torch.manual_seed(0)
        self.build()
        self.val_losses: list[torch.Tensor] = []
        self.train_losses: list[torch.Tensor] = []

    def build(self) -> None:
        raise NotImplementedError

    def on_train_end(self) -> None:
        """Note the resident state before the mixin's hook frees it."""
        optimizer = self.trainer.optimizers[0]
        if isinstance(optimizer, OffloadAdamW):
            self.resident_at_end = optimizer.memory_stats()["resident_bytes"]
            assert_resident_as_asked(optimizer, self.resident_at_end)
        super().on_train_end()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(16), batch_size=4)

    def offload_optimizer_args(self) -> dict[str, Any]:
        args = super().offload_optimizer_args()
        args.update(force_staging=True, chunk_size=64)
        return args

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "offload":
            optimizer = super().configure_optimizers()
            assert optimizer._overlapping() is not None
            return optimizer
        return torch_reference(
            {
                "params": reference_groups(self),
                "lr": self.hparams.lr,
                "weight_decay": self.hparams.weight_decay,
            }
        )


def fit_pair(tmp_path: Path, cls: type[Base], resident=None, model_kwargs=None, **trainer_kwargs):
    """Fit the overlapped offload variant and the torch reference alike; return both."""
    models = []
    for optimizer in ("offload", "torch"):
        torch.manual_seed(123)  # the same dropout masks / shuffles for both runs
        model = cls(
            optimizer=optimizer,
            offload_resident=resident if optimizer == "offload" else None,
            **(model_kwargs or {}),
        )
        trainer(tmp_path / optimizer, **trainer_kwargs).fit(model)
        models.append(model)
    return models


def assert_losses_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    assert_same(a, b)


def assert_trained_alike(offload: Base, reference: Base, stream_order) -> None:
    """Every access ordered, and the same training losses and weights as the reference."""
    stream_order.expect_none()
    assert_losses_equal(offload.train_losses, reference.train_losses)
    assert_same(list(offload.parameters()), list(reference.parameters()))


# ------------------------------------------------------------- 1. validation between steps
class Validated(Base):
    """validation_step calls the submodules itself (the root's forward never runs in
    validation); training_step goes through ``self(x)``."""

    def build(self) -> None:
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.train_losses.append(loss.detach().clone())
        return loss

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(8, seed=5), batch_size=4)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self.head(self.encoder(x)), y)
        self.val_losses.append(loss.detach().clone())
        self.log("val_loss", loss)


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_validation_between_steps_sees_the_updated_weights(tmp_path, stream_order, resident):
    offload, reference = fit_pair(
        tmp_path, Validated, resident, max_steps=7, val_check_interval=2, limit_val_batches=2
    )
    stream_order.expect_none()
    # The sanity check, then 2 validation batches after every 2 training batches: each
    # validation loss equals torch's, computed with the weights after the same steps.
    assert len(offload.val_losses) == 2 + 2 * 3
    assert_losses_equal(offload.val_losses, reference.val_losses)
    assert_losses_equal(offload.train_losses, reference.train_losses)
    assert_same(
        [offload.trainer.callback_metrics["val_loss"]],
        [reference.trainer.callback_metrics["val_loss"]],
    )
    assert_same(list(offload.parameters()), list(reference.parameters()))


def hook_count(module: nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._state_dict_pre_hooks)
        for m in module.modules()
    ) + sum(len(p._backward_hooks or {}) for p in module.parameters())


def test_fit_end_frees_the_device_buffers_and_removes_the_overlap(tmp_path, stream_order):
    """After ``fit`` the optimizer holds nothing on the device (the mixin's ``on_train_end``)
    and the module none of the overlap's hooks (its ``teardown``: a later fit makes new
    optimizers; the Trainer keeps this one); the optimizer's state, resident state written back
    to the host, is torch's."""
    offload, reference = fit_pair(tmp_path, Validated, 0.5, max_steps=4, limit_val_batches=1)
    assert_trained_alike(offload, reference, stream_order)
    assert hook_count(offload) == hook_count(reference)
    kinds = [type(c) for c in offload.trainer.callbacks]  # none the mixin added is left
    assert kinds == [type(c) for c in reference.trainer.callbacks]
    optimizer = offload.trainer.optimizers[0]
    assert optimizer._overlapping() is None
    stats = optimizer.memory_stats()
    assert stats["staging_bytes"] == stats["resident_bytes"] == 0
    ours, theirs = optimizer.state_dict()["state"], reference.trainer.optimizers[0].state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        assert_same([ours[i][key] for i in sorted(ours)], [theirs["state"][i][key] for i in ours])


class ValidatedWithScale(Validated):
    """As Validated, with a root-level parameter read inside the root's forward in training
    and directly by validation_step."""

    def build(self) -> None:
        super().build()
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x) * self.scale)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self.head(self.encoder(x) * self.scale), y)
        self.val_losses.append(loss.detach().clone())
        self.log("val_loss", loss)


def test_validation_reading_a_root_parameter_directly(tmp_path, stream_order):
    """``scale`` is read by the root's forward in training, and directly by validation_step:
    the mixin's on_validation_model_eval orders validation after the last step's updates."""
    offload, reference = fit_pair(
        tmp_path, ValidatedWithScale, max_steps=6, val_check_interval=2, limit_val_batches=1
    )
    stream_order.expect_none()
    assert_losses_equal(offload.val_losses, reference.val_losses)
    assert_same(list(offload.parameters()), list(reference.parameters()))


def test_without_the_wait_at_validation_start_validation_races_the_update(
    tmp_path, stream_order, monkeypatch
):
    monkeypatch.setattr(
        OffloadOptimizerMixin,
        "on_validation_model_eval",
        pl.LightningModule.on_validation_model_eval,
    )
    fit_pair(tmp_path, ValidatedWithScale, max_steps=4, val_check_interval=2, limit_val_batches=1)
    assert any("_fused_adamw_" in v for v in stream_order.violations)
    stream_order.violations.clear()


class ReadsWeights(pl.Callback):
    """Reads the weights in one hook; callbacks' hooks run before the module's."""

    def __init__(self, hook: str) -> None:
        self.norms: list[torch.Tensor] = []
        setattr(self, hook, self.read)

    def read(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.norms.append(torch.stack([p.detach().norm() for p in pl_module.parameters()]))


@pytest.mark.parametrize(
    ("hook", "reads"), [("on_validation_start", 2), ("on_train_epoch_end", 2), ("on_train_end", 1)]
)
def test_a_callback_reading_the_weights_at_validation_epoch_or_training_end(
    tmp_path, stream_order, hook, reads
):
    """Two epochs of 4 steps, validation every 4 steps at most (none at ``on_train_*``, where
    the weights are read right after a step)."""
    norms = []
    validation = {"val_check_interval": 2, "limit_val_batches": 1, "max_steps": 4}
    for optimizer in ("offload", "torch"):
        reader = ReadsWeights(hook)
        trainer(
            tmp_path / optimizer,
            **(validation if hook == "on_validation_start" else {"limit_val_batches": 0}),
            num_sanity_val_steps=0,
            callbacks=[reader],
        ).fit(Validated(optimizer=optimizer))
        norms.append(reader.norms)
    stream_order.expect_none()
    assert len(norms[0]) == reads
    assert_same(norms[0], norms[1])


class StepsAtEpochEnd(Validated):
    """Manual optimization stepping every 3 batches, and the leftover batches in
    ``on_train_epoch_end``: the module's hook runs after the callbacks' (the mixin's epoch-end
    wait among them), so the update it queues is the last before ``on_train_end``."""

    def build(self) -> None:
        super().build()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.train_losses.append(loss.detach().clone())
        self.manual_backward(loss)
        if (batch_idx + 1) % 3 == 0:
            self.step_leftover()

    def on_train_epoch_end(self) -> None:
        self.step_leftover()
        super().on_train_epoch_end()

    def step_leftover(self) -> None:
        optimizer = self.optimizers()
        optimizer.step()
        optimizer.zero_grad()


def test_a_callback_reading_the_weights_at_training_end_after_a_step_at_epoch_end(
    tmp_path, stream_order
):
    """The mixin's ordering callback waits in ``on_train_end`` too, before the other callbacks
    read the weights: its epoch-end wait came before the module's own epoch-end step."""
    norms = []
    for optimizer in ("offload", "torch"):
        reader = ReadsWeights("on_train_end")
        trainer(
            tmp_path / optimizer,
            max_epochs=1,
            max_steps=-1,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[reader],
        ).fit(StepsAtEpochEnd(optimizer=optimizer))
        norms.append(reader.norms)
    stream_order.expect_none()
    assert len(norms[0]) == 1
    assert_same(norms[0], norms[1])


def test_model_pruning_at_epoch_ends_without_validation(tmp_path, stream_order):
    """Lightning's ``ModelPruning`` reads and rewrites a weight in ``on_train_epoch_end`` (no
    validation ordered it before) and makes the pruning permanent in ``on_train_end``."""
    from lightning.pytorch.callbacks import ModelPruning

    def pruning(model: Validated) -> ModelPruning:
        target = [(model.encoder[0], "weight")]
        return ModelPruning("l1_unstructured", parameters_to_prune=target, amount=0.3, verbose=0)

    models = []
    for optimizer in ("offload", "torch"):
        model = Validated(optimizer=optimizer)
        fit = trainer(tmp_path / optimizer, max_steps=8, limit_val_batches=0)
        fit.callbacks.append(pruning(model))
        fit.fit(model)
        models.append(model)
    stream_order.expect_none()
    assert (models[0].encoder[0].weight == 0).any()
    assert_same(list(models[0].parameters()), list(models[1].parameters()))


def test_weight_averaging_callbacks_turn_the_overlap_off(tmp_path, stream_order):
    """EMAWeightAveraging reads the weights in on_train_batch_end, right after each step and
    before this module's hooks: the mixin turns the overlap off (with a warning), and the
    averaged model equals the reference's."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    models = []
    for optimizer in ("offload", "torch"):
        model = Validated(optimizer=optimizer)
        fit = trainer(tmp_path / optimizer, max_steps=5, callbacks=[EMAWeightAveraging(decay=0.5)])
        if optimizer == "offload":
            with pytest.warns(UserWarning, match="overlap_step is turned off: EMAWeightAveraging"):
                fit.fit(model)
            assert fit.optimizers[0]._overlapping() is None
        else:
            fit.fit(model)
        models.append(model)  # on_train_end copied the average into the model
    stream_order.expect_none()
    assert_same(list(models[0].parameters()), list(models[1].parameters()))


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_validation_inside_an_accumulation_window_checkpoints_and_resume(
    tmp_path, stream_order, resident
):
    """Validation after 3 batches of windows of 2 (gradients of one batch accumulated, not
    stepped yet), a checkpoint saved at each validation (monitor="val_loss"), and a resumed
    run from the first one, against torch AdamW doing the same."""
    kwargs = {
        "max_steps": 5,
        "accumulate_grad_batches": 2,
        "val_check_interval": 3,
        "limit_val_batches": 2,
        "enable_checkpointing": True,
    }
    fitted, resumed = {}, {}
    for optimizer in ("offload", "torch"):
        folder = tmp_path / f"ckpt-{optimizer}"
        saver = ModelCheckpoint(folder, "{step}", monitor="val_loss", save_top_k=-1)
        model = Validated(
            optimizer=optimizer, offload_resident=resident if optimizer == "offload" else None
        )
        trainer(tmp_path / optimizer, callbacks=[saver], **kwargs).fit(model)
        fitted[optimizer] = model
        again = Validated(
            optimizer=optimizer, offload_resident=resident if optimizer == "offload" else None
        )
        trainer(tmp_path / f"{optimizer}-resumed", **{**kwargs, "enable_checkpointing": False}).fit(
            again, ckpt_path=folder / "step=1.ckpt"
        )
        resumed[optimizer] = again
    stream_order.expect_none()
    offload, reference = fitted["offload"], fitted["torch"]
    assert_losses_equal(offload.val_losses, reference.val_losses)
    assert_losses_equal(offload.train_losses, reference.train_losses)
    assert_same(list(offload.parameters()), list(reference.parameters()))
    assert_losses_equal(resumed["offload"].val_losses, resumed["torch"].val_losses)
    assert_same(list(resumed["offload"].parameters()), list(resumed["torch"].parameters()))


# ---------------------------------------------------- 2. accumulation + clipping + bf16-mixed
class Accumulated(Base):
    def build(self) -> None:
        self.net = nn.Sequential(
            nn.Linear(8, 32),
            nn.LayerNorm(32),
            nn.GELU(),
            nn.Linear(32, 16),
            nn.GELU(),
            nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.train_losses.append(loss.detach().clone())
        return loss


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
@pytest.mark.parametrize(
    ("algorithm", "precision"),
    [("norm", "bf16-mixed"), ("value", "bf16-mixed"), ("norm", "16-mixed")],
    ids=["norm-bf16", "value-bf16", "norm-fp16-gradscaler"],
)
def test_accumulation_with_clipping_and_mixed_precision(
    tmp_path, stream_order, resident, algorithm, precision
):
    from lightning.pytorch.plugins.precision import MixedPrecision

    def precision_kwargs() -> dict[str, Any]:  # a fresh GradScaler per Trainer
        if precision == "16-mixed":  # on the CPU, fp16 autocast needs the plugin
            return {"plugins": [MixedPrecision("16-mixed", "cpu")]}
        return {"precision": precision}

    models = []
    for optimizer in ("offload", "torch"):
        model = Accumulated(
            optimizer=optimizer, offload_resident=resident if optimizer == "offload" else None
        )
        trainer(
            tmp_path / optimizer,
            max_steps=5,
            accumulate_grad_batches=3,
            gradient_clip_val=0.05 if algorithm == "norm" else 0.01,
            gradient_clip_algorithm=algorithm,
            **precision_kwargs(),
        ).fit(model)
        models.append(model)
    offload, reference = models
    assert_trained_alike(offload, reference, stream_order)
    steps = offload.trainer.optimizers[0].state_dict()["state"][0]["step"]
    assert steps == reference.trainer.optimizers[0].state_dict()["state"][0]["step"] == 5


# ------------------------------------------------------------- 3. activation checkpointing
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Checkpointed(Base):
    """Blocks wrapped in non-reentrant activation checkpointing: their forward pre-hooks fire
    again during the backward pass's recomputation."""

    def build(self) -> None:
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(16) for _ in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.train_losses.append(loss.detach().clone())
        return loss


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_activation_checkpointing_lightning(tmp_path, stream_order, resident):
    offload, reference = fit_pair(tmp_path, Checkpointed, resident, max_steps=6)
    assert_trained_alike(offload, reference, stream_order)


class CheckpointedNet(nn.Module):
    """Plain PyTorch: the whole middle (two blocks) recomputed in one checkpoint, and the
    first block called twice (once inside the checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.a = Block(16)
        self.b = Block(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.embed(x))
        h = checkpoint(lambda t: self.b(self.a(t)), h, use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_activation_checkpointing_plain(stream_order, resident, set_to_none):
    model, twin = CheckpointedNet(), CheckpointedNet()
    optimizer, torch_opt = overlapped_pair(model, twin, lr=0.02, resident=resident)
    generator = torch.Generator().manual_seed(7)
    losses: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for _ in range(5):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
        for k, (net, opt) in enumerate(((model, optimizer), (twin, torch_opt))):
            loss = F.mse_loss(net(x), y)
            losses[k].append(loss.detach().clone())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    stream_order.expect_none()
    assert_resident_as_asked(optimizer)
    optimizer.wait_for_updates()
    assert_losses_equal(losses[0], losses[1])
    assert_same(list(model.parameters()), list(twin.parameters()))


def func_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, how: str):
    """The loss and the gradients of ``model``'s parameters at ``x``, computed by a
    ``torch.func`` transform over ``functional_call`` (per-sample and averaged for ``vmap``)."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (xb,)), yb)

    if how == "vmap-grad":  # per-sample gradients, as DP-SGD computes them
        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
        grads = per_sample(params, x.unsqueeze(1), y.unsqueeze(1))
        return loss(params, x, y), {name: g.mean(0) for name, g in grads.items()}
    if how == "vjp":
        value, pull_back = torch.func.vjp(lambda p: loss(p, x, y), params)
        return value, pull_back(torch.ones(()))[0]
    grads, value = torch.func.grad_and_value(loss)(params, x, y)
    return value, grads


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
@pytest.mark.parametrize("how", ["grad", "vmap-grad", "vjp"])
def test_forward_passes_inside_torch_func_transforms(stream_order, resident, how):
    """The forward runs inside a ``torch.func`` transform (per-sample gradients, a functional
    training loop): the overlap's hook after it queues the next step's first copies, which
    functorch refused as an in-place write into a tensor captured by the transform."""
    model, twin = (
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        for _ in range(2)
    )
    twin.load_state_dict(model.state_dict())
    optimizer, torch_opt = overlapped_pair(model, twin, lr=0.02, resident=resident)
    generator = torch.Generator().manual_seed(7)
    losses: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
        for k, (net, opt) in enumerate(((model, optimizer), (twin, torch_opt))):
            loss, grads = func_gradients(net, x, y, how)
            losses[k].append(loss.detach().clone())
            for name, param in net.named_parameters():
                param.grad = grads[name]
            opt.step()
            opt.zero_grad()
    stream_order.expect_none()
    assert_resident_as_asked(optimizer)
    optimizer.wait_for_updates()
    assert_losses_equal(losses[0], losses[1])
    assert_same(list(model.parameters()), list(twin.parameters()))


# ------------------------------------------- 4. an evaluation forward between step and forward
class EvalNet(nn.Module):
    """BatchNorm and dropout behave differently in eval mode; ``encoder`` is evaluated alone
    as well."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16)
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.encoder(x)))


def eval_loop(model, optimizer, mode: str) -> list[torch.Tensor]:
    torch.manual_seed(11)  # dropout masks
    generator = torch.Generator().manual_seed(3)
    x_val = torch.randn(6, 8, generator=generator)
    metrics = []
    for _ in range(5):
        x = torch.randn(8, 8, generator=generator)
        target = torch.randint(0, 3, (8,), generator=generator)
        model.train()
        F.cross_entropy(model(x), target).backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
        with context:
            if mode == "submodule":
                metrics.append(model.encoder(x_val).norm().clone())
            else:
                logits = model(x_val)
                metrics.append((logits.argmax(-1) == 1).float().mean().clone())
                metrics.append(logits.logsumexp(-1).mean().clone())
    return metrics


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "submodule"])
def test_an_evaluation_forward_between_step_and_next_forward(stream_order, resident, mode):
    model, twin = EvalNet(), EvalNet()
    optimizer = OffloadAdamW(
        model.parameters(), lr=0.05, force_staging=True, chunk_size=64, resident=resident
    )
    optimizer.overlap_with(model)
    ours = eval_loop(model, optimizer, mode)
    theirs = eval_loop(twin, torch.optim.AdamW(twin.parameters(), lr=0.05, fused=True), mode)
    stream_order.expect_none()
    assert_resident_as_asked(optimizer)
    assert_same(ours, theirs)
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same(list(model.buffers()), list(twin.buffers()))


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.norm(self.inp(x))))


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_bf16_parameters_evaluated_between_steps(stream_order, resident):
    """bf16 parameters (fp32 master copies, a gradient scratch in the staging buffers) against
    torch fused AdamW on fp32 masters whose bf16 rounding computes the same gradients."""
    model, twin = SmallNet().to(torch.bfloat16), SmallNet().to(torch.bfloat16)
    optimizer = OffloadAdamW(
        model.parameters(), lr=0.05, force_staging=True, chunk_size=64, resident=resident
    )
    optimizer.overlap_with(model)
    torch_opt = MasterCopyAdamW(list(twin.parameters()), lr=0.05)
    generator = torch.Generator().manual_seed(4)
    x_val = torch.randn(5, 8, generator=generator, dtype=torch.bfloat16)
    ours, theirs = [], []
    for _ in range(5):
        x = torch.randn(6, 8, generator=generator, dtype=torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        twin(x).float().pow(2).mean().backward()
        torch_opt.step()
        torch_opt.zero_grad()
        with torch.no_grad():
            ours.append(model(x_val).clone())
            theirs.append(twin(x_val).clone())
    stream_order.expect_none()
    assert_resident_as_asked(optimizer)
    assert_same(ours, theirs)
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))
    for p, t in zip(model.parameters(), twin.parameters(), strict=True):
        assert_same([optimizer.offloaded_state(p)["master_param"]], [torch_opt.masters[t]])


# --------------------------------- 5. a root-level parameter, a module reused, a changing forward
class RootParameter(Base):
    """training_step reads a root-level parameter itself and calls a submodule (the root's
    forward never runs); ``shared`` is called twice; ``extra`` runs on some steps only, in
    front of the rest (so the forward's order changes after the first step)."""

    def build(self) -> None:
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.extra = nn.Linear(8, 8)
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 1)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x)))))
        return self.out(self.norm(h))

    def uses_extra(self) -> bool:
        return self.global_step % 2 == self.hparams.extra_on

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x * self.scale
        if self.uses_extra():
            x = torch.tanh(self.extra(x))
        loss = F.mse_loss(self.body(x), y)
        self.train_losses.append(loss.detach().clone())
        return loss


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
@pytest.mark.parametrize("extra_on", [0, 1], ids=["even-steps", "odd-steps"])
def test_root_parameter_reused_module_and_a_branch_on_some_steps(
    tmp_path, stream_order, resident, extra_on
):
    offload, reference = fit_pair(
        tmp_path, RootParameter, resident, {"extra_on": extra_on}, max_steps=7
    )
    assert_trained_alike(offload, reference, stream_order)
    state = offload.trainer.optimizers[0].state
    assert state[offload.extra.weight]["step"] == (4 if extra_on == 0 else 3)
    assert state[offload.scale]["step"] == 7


class ReadsBeforeCalling(Base):
    """training_step reads the head's weight (a penalty) before the head runs, and looks the
    tokens up in the embedding's weight functionally before the embedding module runs."""

    def build(self) -> None:
        self.emb = nn.Embedding(10, 8)
        self.inp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        tokens = (x.abs() * 3).long().clamp(max=9)[:, 0]
        penalty = 1e-3 * self.head.weight.pow(2).sum()
        h = x + F.embedding(tokens, self.emb.weight) + self.emb(tokens)
        loss = F.mse_loss(self.head(torch.tanh(self.inp(h))), y) + penalty
        self.train_losses.append(loss.detach().clone())
        return loss


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_training_step_reading_weights_before_their_modules_run(tmp_path, stream_order, resident):
    """Their modules' hooks run later in the same pass, so these weights count as reached by
    a hook; the mixin watches training_step until the first step, sees the earlier reads, and
    those weights are then waited for at each step."""
    offload, reference = fit_pair(tmp_path, ReadsBeforeCalling, resident, max_steps=5)
    assert_trained_alike(offload, reference, stream_order)
    assert torch._C._len_torch_function_stack() == 0


class TiedReadFirst(nn.Module):
    """A tied autoencoder whose encoder reads the decoder's weight (transposed) before the
    decoder runs, and an embedding looked up functionally before its module runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.dec = nn.Embedding(10, 8), nn.Linear(4, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.emb.weight)
        out = self.dec(torch.tanh(F.linear(x, self.dec.weight.t())))
        return (out - self.emb(tokens)).pow(2).mean()


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_tied_weights_read_before_their_modules_run(stream_order, resident):
    """Plain PyTorch: the root's forward is watched until the first step."""
    model, twin = TiedReadFirst(), TiedReadFirst()
    ours, theirs = overlapped_pair(model, twin, lr=0.01, resident=resident)
    train_alike([(model, ours), (twin, theirs)], token_batches(5, seed=5))
    ours.wait_for_updates()
    stream_order.expect_none()
    assert_resident_as_asked(ours)
    assert_same(list(model.parameters()), list(twin.parameters()))


def test_the_watch_leaves_the_mode_stack_as_it_was():
    """The watch is a torch-function mode pushed for each forward pass until the first step: a
    user's mode around the forward keeps seeing every op, and is the only one left after."""

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    model = TiedReadFirst()
    ours = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    tokens = torch.arange(6)
    user = Counting()
    for _ in range(2):
        with user:
            before = Counting.calls
            loss = model(tokens)
            assert Counting.calls > before + 4  # it saw the forward's ops
            assert torch._C._len_torch_function_stack() == 1
            assert torch.overrides._get_current_function_mode() is user
        loss.backward()
        ours.step()
        ours.zero_grad()
    assert torch._C._len_torch_function_stack() == 0
    ours.wait_for_updates()


class ManualZeroGradFirst(Base):
    """Manual optimization in the documented order: ``toggle_optimizer`` (sets
    ``requires_grad`` on every parameter) and ``zero_grad`` (reads every ``.grad``) before the
    forward, which also casts its input to a weight's dtype (metadata only)."""

    def build(self) -> None:
        self.inp = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        self.toggle_optimizer(optimizer)
        optimizer.zero_grad()
        h = torch.tanh(self.inp(x.to(self.head.weight.dtype)))
        loss = F.mse_loss(self.head(h), y)
        self.train_losses.append(loss.detach().clone())
        self.manual_backward(loss)
        optimizer.step()
        self.untoggle_optimizer(optimizer)


def test_metadata_reads_before_the_forward_are_not_reads(tmp_path, stream_order):
    """Reading a weight's metadata or gradient, or setting ``requires_grad``, before its module
    runs does not make it wait at each step: nothing here is updated early (the overlap
    stays), and the result is the reference's."""
    offload, reference = fit_pair(tmp_path, ManualZeroGradFirst, max_steps=4)
    assert_trained_alike(offload, reference, stream_order)
    overlap = offload.trainer.optimizers[0]._overlap  # removed at the end of training
    assert overlap.read_before_hook == set() and overlap.early == set()
    assert "training_step" not in vars(offload)  # the watch's wrapper is gone after the step


class RaisesOnSecondBatch(ReadsBeforeCalling):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1:
            raise RuntimeError("bad batch")
        return super().training_step(batch, batch_idx)


def test_the_watch_is_off_the_stack_when_training_step_raises(tmp_path):
    model = RaisesOnSecondBatch(accumulate=2)
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer(tmp_path, max_steps=3, accumulate_grad_batches=2).fit(model)
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("interrupts", [1, 2])
def test_a_forward_interrupted_without_its_end_leaves_nothing_after_the_next(interrupts):
    """A ``KeyboardInterrupt`` skips the ``always_call`` forward hook that takes the watch off
    the stack (each leaves one level of its nesting); the end of the first forward after the
    first step does it, whatever that depth."""

    class Interrupted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)
            self.interrupt = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.interrupt:
                raise KeyboardInterrupt
            return self.layer(x).sum()

    model = Interrupted()
    ours = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    for _ in range(interrupts):
        with pytest.raises(KeyboardInterrupt):
            model(torch.ones(2, 8))
    assert torch._C._len_torch_function_stack() == 1
    model.interrupt = False
    model(torch.ones(2, 8)).backward()
    ours.step()
    model(torch.ones(2, 8))
    assert torch._C._len_torch_function_stack() == 0
    ours.wait_for_updates()


def test_removing_a_mode_keeps_the_others_in_order():
    from lightning_offload_optim.overlap import _remove_mode

    modes = [TorchFunctionMode() for _ in range(4)]
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)
    _remove_mode(modes[1])  # two modes above it
    left = [torch._C._get_function_stack_at(i) for i in range(3)]
    for mode in (modes[3], modes[0], modes[2]):
        _remove_mode(mode)
    assert left == [modes[0], modes[2], modes[3]]
    assert torch._C._len_torch_function_stack() == 0


class LateWideNet(nn.Module):
    """``narrow`` (36 elements) is trained from the first step, ``wide`` (108) from the third."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.narrow, self.wide = nn.Linear(8, 4), nn.Linear(8, 12)

    def forward(self, x: torch.Tensor, use_wide: bool) -> torch.Tensor:
        loss = self.narrow(x).pow(2).sum()
        return loss + self.wide(x).pow(2).sum() if use_wide else loss


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_a_wider_layer_first_used_later_grows_the_staging_buffers(stream_order, resident):
    """The forward pass before step 3 queues copies of step 2's first chunk into the staging
    buffers; step 3 needs larger ones (``wide`` joins) and allocates them: the queued copies
    went into the old buffers and must not be taken for the new ones' contents."""
    model, twin = LateWideNet(), LateWideNet()
    ours, theirs = overlapped_pair(model, twin, lr=0.01, resident=resident, chunk_size=256)
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        x = torch.randn(5, 8, generator=generator)
        for net, optimizer in ((model, ours), (twin, theirs)):
            net(x, use_wide=step >= 2).backward()
            optimizer.step()
            optimizer.zero_grad()
    model(x, use_wide=True)  # waits for the last updates
    stream_order.expect_none()
    assert_resident_as_asked(ours)
    assert_same(list(model.parameters()), list(twin.parameters()))


def mlp_pair(resident) -> tuple[nn.Module, nn.Module, OffloadAdamW, torch.optim.AdamW]:
    """A small MLP and its twin, with :func:`overlapped_pair`'s optimizers."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    twin = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    twin.load_state_dict(model.state_dict())
    return model, twin, *overlapped_pair(model, twin, lr=0.01, resident=resident)


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_state_dict_views_written_after_the_next_forward_pass(stream_order, resident):
    """``state_dict()`` views taken before a forward pass and written after it (a callback
    resetting moments in ``on_before_optimizer_step``): the next step uses the writes, as
    torch's does, though the forward pass would queue that step's first copies before them."""
    model, twin, ours, theirs = mlp_pair(resident)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(4, 8, generator=generator)
        for net, optimizer in ((model, ours), (twin, theirs)):
            views = optimizer.state_dict()["state"] if step == 2 else {}
            loss = net(x).pow(2).mean()
            for entry in views.values():
                entry["exp_avg"].mul_(0.5)
                entry["exp_avg_sq"].mul_(2.0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model(x)  # waits for the last updates
    stream_order.expect_none()
    assert_resident_as_asked(ours)
    assert_same(list(model.parameters()), list(twin.parameters()))


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_device_memory_released_between_steps(stream_order, resident):
    """``release_device_memory()`` after a step, then the parameters move (as Lightning moves
    the module to the CPU after ``fit``): no buffer is left, the parameters' old memory is not
    kept alive, and the next steps allocate again (state resident again) and train as torch's
    AdamW does, the resident state having been written back first."""
    model, twin, ours, theirs = mlp_pair(resident)
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        x = torch.randn(4, 8, generator=generator)
        for net, optimizer in ((model, ours), (twin, theirs)):
            net(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if step == 2:
            ours.release_device_memory()
            stats = ours.memory_stats()
            assert stats["staging_bytes"] == stats["resident_bytes"] == 0
            old = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]
            for p in model.parameters():
                p.data = p.data.clone()
            assert all(storage.expired() for storage in old)
    model(x)  # waits for the last updates
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(twin.parameters()))
    ours_state, theirs_state = ours.state_dict()["state"], theirs.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert_same([s[key] for s in ours_state.values()], [s[key] for s in theirs_state.values()])
    assert (ours.memory_stats()["resident_bytes"] > 0) == (resident is not None)


# --------------------------------------------------------------- 6. manual optimization
class Manual(Base):
    """Manual optimization: two ``step()`` calls per batch on disjoint sets of parameters
    (first the head on detached features, then the encoder through the updated head), and a
    scheduler stepping a tensor lr after each step. ``two_optimizers``: the two sets have
    optimizers of their own, both overlapping this module."""

    def build(self) -> None:
        self.automatic_optimization = False
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU())
        self.head = nn.Linear(32, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.optimizers()
        schedulers = self.lr_schedulers()
        if not isinstance(optimizers, list):
            optimizers, schedulers = [optimizers, optimizers], [schedulers, schedulers]
        head_opt, encoder_opt = optimizers
        x, y = batch
        loss = F.mse_loss(self.head(self.encoder(x).detach()), y)  # head gradients only
        head_opt.zero_grad()
        self.manual_backward(loss)
        head_opt.step()
        schedulers[0].step()
        self.train_losses.append(loss.detach().clone())
        loss = F.mse_loss(self.head(self.encoder(x)), y)  # reads the updated head
        encoder_opt.zero_grad()
        self.manual_backward(loss)
        for p in self.head.parameters():
            p.grad = None  # the second step updates the encoder only
        self.clip_gradients(encoder_opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        encoder_opt.step()
        schedulers[1].step()
        self.train_losses.append(loss.detach().clone())

    def configure_optimizers(self) -> Any:
        offload = self.hparams.optimizer == "offload"

        def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            lr = torch.tensor(0.02)
            if offload:
                opt = OffloadAdamW(
                    groups,
                    lr=lr,
                    weight_decay=0.1,
                    force_staging=True,
                    chunk_size=64,
                    resident=self.hparams.offload_resident,
                )
                opt.overlap_with(self)
                return opt
            return torch_reference({"params": groups, "lr": lr, "weight_decay": 0.1})

        head = {"params": list(self.head.parameters())}
        encoder = {"params": list(self.encoder.parameters()), "weight_decay": 0.05}
        if self.hparams.two_optimizers:
            optimizers = [make([head]), make([encoder])]
        else:  # one optimizer, two disjoint param groups stepped one at a time
            optimizers = [make([head, encoder])]
        schedulers = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7) for o in optimizers]
        return optimizers, schedulers


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
@pytest.mark.parametrize("two_optimizers", [False, True], ids=["one-optimizer", "two-optimizers"])
def test_manual_optimization_two_steps_per_batch_and_tensor_lr(
    tmp_path, stream_order, resident, two_optimizers
):
    offload, reference = fit_pair(
        tmp_path, Manual, resident, {"two_optimizers": two_optimizers}, max_steps=8
    )
    assert_trained_alike(offload, reference, stream_order)
    ours = [float(g["lr"]) for o in offload.trainer.optimizers for g in o.param_groups]
    theirs = [float(g["lr"]) for o in reference.trainer.optimizers for g in o.param_groups]
    assert ours == theirs and ours[0] < 0.02


# ------------------------------------------------------------------------------- 7. DDP
class AuxiliaryHead(Base):
    """An auxiliary loss head used on even steps only: last in the forward order, so its state
    is in the last chunks of each step, and no module of an odd step's forward waits for them."""

    def build(self) -> None:
        self.inp = nn.Linear(8, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 8)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.tanh(self.body(torch.tanh(self.inp(x))))
        loss = F.mse_loss(self.head(h), y)
        if self.global_step % 2 == 0:
            loss = loss + 0.1 * self.aux(h).pow(2).mean()
        self.train_losses.append(loss.detach().clone())
        return loss


def ddp_scenarios() -> dict[str, dict[str, Any]]:
    """A fresh dict per fit: a strategy object belongs to one Trainer."""
    from lightning.pytorch.strategies import DDPStrategy

    return {
        "validation": {
            "model": Validated,
            "resident": 0.5,
            "trainer": {
                "strategy": "ddp",
                "max_steps": 5,
                "val_check_interval": 2,
                "limit_val_batches": 1,
                "num_sanity_val_steps": 0,
                "gradient_clip_val": 0.05,
            },
        },
        "bucket-view": {
            "model": AuxiliaryHead,
            "resident": None,
            "trainer": {
                "strategy": DDPStrategy(find_unused_parameters=True, gradient_as_bucket_view=True),
                "max_steps": 5,
            },
        },
    }


def ddp_main(out: Path) -> None:
    """Run by ``ddp_results`` (and, for rank 1, by Lightning's DDP launcher): fit each scenario
    with the overlapped offload variant (under the stream-ordering checker) and with torch."""
    from stream_checker import StreamChecker

    results: dict[str, Any] = {}
    rank = 0
    for name in ddp_scenarios():
        results[name] = {}
        for optimizer in ("offload", "torch"):
            scenario = ddp_scenarios()[name]
            torch.manual_seed(123)
            resident = scenario["resident"] if optimizer == "offload" else None
            model = scenario["model"](optimizer=optimizer, offload_resident=resident)
            fit = trainer(
                out / name / optimizer,
                devices=2,
                use_distributed_sampler=True,
                **scenario["trainer"],
            )
            with StreamChecker() as checker:
                fit.fit(model)
            rank = fit.global_rank
            results[name][optimizer] = {
                "params": [p.detach().clone() for p in model.parameters()],
                "losses": model.train_losses,
                "val": model.val_losses,
                "steps": int(fit.optimizers[0].state_dict()["state"][0]["step"]),
                "violations": checker.violations[:10],
            }
    torch.save(results, out / f"rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    run_script(Path(__file__).name, out, timeout=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def check_ddp(ranks: list[dict[str, Any]], name: str) -> None:
    for result in ranks:
        offload, reference = result[name]["offload"], result[name]["torch"]
        assert_same(offload["params"], reference["params"])
        assert_losses_equal(offload["losses"], reference["losses"])
        assert_same(offload["val"], reference["val"])
        assert offload["steps"] == reference["steps"] == 5
        assert reference["violations"] == []
        assert offload["violations"] == []
    assert_same(ranks[0][name]["offload"]["params"], ranks[1][name]["offload"]["params"])


def test_ddp_two_processes_validation_clipping_resident(ddp_results):
    check_ddp(ddp_results, "validation")


# With DDP(gradient_as_bucket_view=True) each ``param.grad`` is a view of DDP's persistent
# gradient bucket: dropping it frees nothing, and the next backward's reducer zeroes the slots
# of parameters the forward skipped and all-reduces the whole bucket while the last step's
# update of ``aux`` (last in forward order, waited for by no module of an odd step's forward)
# may still read it. The gradient hook of ForwardOverlap orders the backward after the updates.
def test_ddp_gradient_as_bucket_view_with_a_parameter_unused_on_some_steps(ddp_results):
    check_ddp(ddp_results, "bucket-view")


class BranchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.aux = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = self.body(x)
        return h + self.aux(h) if use_aux else h


class TwoHeads(nn.Module):
    """Head ``a`` on even steps, ``b`` on odd ones: the first gradient of step 1's backward is
    ``b``'s, a parameter never stepped before, while DDP zeroes ``a``'s bucket slot."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, even: bool) -> torch.Tensor:
        h = self.body(x)
        return self.a(h) if even else self.b(h)


def train_under_ddp(
    tmp_path: Path, bucket_view: bool, net_class: type[nn.Module] = BranchNet
) -> tuple[nn.Module, nn.Module]:
    """One process, no Lightning, a forward that differs between even and odd steps; returns
    the overlapped offload model and the torch twin after three steps."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model, twin = net_class(), net_class()
        runs = []
        for net, opt in (
            (model, OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)),
            (twin, torch.optim.AdamW(twin.parameters(), fused=True)),
        ):
            if isinstance(opt, OffloadAdamW):
                opt.overlap_with(net)
            wrapped = DDP(net, find_unused_parameters=True, gradient_as_bucket_view=bucket_view)
            runs.append((wrapped, opt))
        for step in range(3):
            for wrapped, opt in runs:
                wrapped(torch.ones(2, 8), step % 2 == 0).sum().backward()
                opt.step()
                opt.zero_grad()
        runs[0][1].wait_for_updates()
    finally:
        dist.destroy_process_group()
    return model, twin


@pytest.mark.parametrize("net_class", [BranchNet, TwoHeads], ids=["branch", "two-heads"])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["grad-copies", "bucket-view"])
def test_ddp_with_a_parameter_unused_on_some_steps(tmp_path, stream_order, bucket_view, net_class):
    model, twin = train_under_ddp(tmp_path, bucket_view, net_class)
    assert_same(list(model.parameters()), list(twin.parameters()))
    stream_order.expect_none()


def test_without_the_gradient_hook_ddp_buckets_race_the_update(tmp_path, stream_order, monkeypatch):
    from lightning_offload_optim.overlap import ForwardOverlap

    monkeypatch.setattr(ForwardOverlap, "_before_gradient", lambda self, grad: None)
    train_under_ddp(tmp_path, bucket_view=True)
    assert any("_fused_adamw_" in v for v in stream_order.violations)
    stream_order.violations.clear()


if __name__ == "__main__":
    ddp_main(Path(sys.argv[1]))
