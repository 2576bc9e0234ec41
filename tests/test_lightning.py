"""The Lightning integration against torch.optim.AdamW under the same Trainer settings."""

from __future__ import annotations

import abc
import copy
import re
import traceback
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import MasterCopyAdamW, assert_same
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_models import (
    ManualModel,
    TinyModel,
    TwoOptimizerModel,
    make_data,
    torch_reference,
    trainer,
)
from torch.utils.data import DataLoader

from lightning_offload_optim import OffloadAdamW, OffloadOptimizerMixin


def fit(tmp_path, model_cls=TinyModel, model_kwargs=None, **trainer_kwargs: Any):
    """Train the offload and the torch variant alike; return both fitted modules."""
    models = []
    for optimizer in ("offload", "torch"):
        model = model_cls(optimizer=optimizer, **(model_kwargs or {}))
        # A fresh copy per run: a precision plugin holds a GradScaler whose scale evolves.
        trainer(tmp_path / optimizer, **copy.deepcopy(trainer_kwargs)).fit(model)
        models.append(model)
    return models


SETTINGS = {
    "32-true": {},
    "bf16-mixed": {"precision": "bf16-mixed"},
    # On the CPU "16-mixed" silently means bf16; the plugin forces fp16 autocast and GradScaler.
    "16-mixed": {"plugins": [MixedPrecision("16-mixed", "cpu")]},
    "clip-norm": {"gradient_clip_val": 0.05},
    "clip-value": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    "accumulate": {"accumulate_grad_batches": 3, "max_steps": 3},
    "accumulate-clip-bf16": {
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.05,
        "precision": "bf16-mixed",
    },
}


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_bit_identical_to_torch_adamw(tmp_path, settings):
    offload, reference = fit(tmp_path, **settings)
    assert isinstance(offload.trainer.optimizers[0], OffloadAdamW)
    assert_same(list(offload.parameters()), list(reference.parameters()))
    steps = offload.trainer.optimizers[0].state_dict()["state"][0]["step"]
    assert steps == reference.trainer.optimizers[0].state_dict()["state"][0]["step"]


def test_16_mixed_skips_non_finite_steps_like_torch(tmp_path):
    offload, reference = fit(
        tmp_path,
        model_kwargs={"nan_at_batch": 2},
        plugins=[MixedPrecision("16-mixed", "cpu")],
        max_epochs=1,
        max_steps=-1,
    )
    assert_same(list(offload.parameters()), list(reference.parameters()))
    step = offload.trainer.optimizers[0].state_dict()["state"][0]["step"]
    # 4 batches: the first overflows fp16 at GradScaler's initial scale, the third is infinite.
    assert step == 2
    assert offload.trainer.precision_plugin.scaler.get_scale() == 65536.0 / 4
    assert step == reference.trainer.optimizers[0].state_dict()["state"][0]["step"]


class MasterCopyReference(TinyModel):
    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "offload":
            return super().configure_optimizers()
        hp = self.hparams
        return MasterCopyAdamW(
            self.reference_param_groups(), lr=hp.lr, weight_decay=hp.weight_decay
        )


def test_bf16_true_keeps_fp32_state_and_master_copies_exactly(tmp_path):
    offload, reference = fit(tmp_path, MasterCopyReference, precision="bf16-true")
    opt = offload.trainer.optimizers[0]
    assert offload.net[0].weight.dtype == torch.bfloat16
    assert_same(list(offload.parameters()), list(reference.parameters()))
    fp32 = reference.trainer.optimizers[0]
    for p, r in zip(offload.parameters(), reference.parameters(), strict=True):
        state, master = opt.offloaded_state(p), fp32.masters[r]
        assert {v.dtype for v in state.values()} == {torch.float32}
        assert_same(
            [state["master_param"], state["exp_avg_sq"]],
            [master, fp32.fp32.state[master]["exp_avg_sq"]],
        )


def test_manual_optimization(tmp_path):
    offload, reference = fit(tmp_path, ManualModel)
    assert_same(list(offload.parameters()), list(reference.parameters()))


def test_two_offloaded_optimizers(tmp_path):
    offload, reference = fit(tmp_path, TwoOptimizerModel)
    assert all(isinstance(o, OffloadAdamW) for o in offload.trainer.optimizers)
    assert_same(list(offload.parameters()), list(reference.parameters()))


def test_warmup_cosine_schedule_from_hparams(tmp_path):
    kwargs = {"warmup_steps": 2, "lr_schedule": "cosine"}
    offload, reference = fit(tmp_path, model_kwargs=kwargs, max_steps=8)
    assert_same(list(offload.parameters()), list(reference.parameters()))
    lrs = offload.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    assert lrs[0] == pytest.approx(0.0)  # cosine reached its end (min_lr_ratio 0) at step 8


class StepLRModel(TinyModel):
    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2},
        }


def test_lightning_scheduler_config_with_torch_scheduler(tmp_path):
    offload, reference = fit(tmp_path, StepLRModel)
    assert offload.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 / 8)
    assert_same(list(offload.parameters()), list(reference.parameters()))


# ----------------------------------------------------------------------------- the mixin
def test_mixin_zero_configuration():
    class Plain(OffloadOptimizerMixin, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)

    model = Plain()
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, OffloadAdamW)
    decay, no_decay = optimizer.param_groups
    assert decay["params"] == [model.linear.weight]
    assert decay["weight_decay"] == 1e-2 and decay["lr"] == 1e-3
    assert no_decay["params"] == [model.linear.bias, model.norm.weight, model.norm.bias]
    assert no_decay["weight_decay"] == 0.0


def test_mixin_reads_hparams_and_can_decay_everything():
    class Tuned(OffloadOptimizerMixin, pl.LightningModule):
        def __init__(self, learning_rate=0.3, beta1=0.8, weight_decay=0.5, amsgrad=True):
            super().__init__()
            self.save_hyperparameters()
            self.save_hyperparameters({"no_decay_norm_and_bias": False})
            self.linear = torch.nn.Linear(4, 4)

    optimizer = Tuned().configure_optimizers()
    (group,) = optimizer.param_groups
    assert group["lr"] == 0.3 and group["betas"] == (0.8, 0.999)
    assert group["weight_decay"] == 0.5 and group["amsgrad"] is True


def test_lr_wins_over_learning_rate_where_both_are_saved():
    """``learning_rate`` is read only in place of a missing ``lr`` (the LR finder's attribute
    may be either; an ``lr`` the user set is not overridden by a leftover one)."""

    class BothRates(OffloadOptimizerMixin, pl.LightningModule):
        def __init__(self, lr: float = 0.1, learning_rate: float = 0.5) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.linear = torch.nn.Linear(4, 4)

    assert {g["lr"] for g in BothRates().configure_optimizers().param_groups} == {0.1}


def test_mixin_after_lightning_module_is_refused():
    with pytest.raises(TypeError, match="put OffloadOptimizerMixin before LightningModule"):

        class Wrong(pl.LightningModule, OffloadOptimizerMixin):
            pass


class _Regression(pl.LightningModule):
    """A module someone already trains: its own optimizer and schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(), batch_size=4)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=5e-3)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 2)]


def test_a_base_configure_optimizers_the_mixin_hides_is_warned_of_once():
    """Adopting the mixin in front of a module that has its own ``configure_optimizers``
    drops that one (its lr, groups and scheduler) for the mixin's: said once, where the mixin
    is put in front; not where a subclass inherits the choice, nor where the class defines
    its own ``configure_optimizers`` (wrapping the mixin's)."""
    with pytest.warns(UserWarning, match=r"before _Regression\.configure_optimizers") as said:

        class Adopted(OffloadOptimizerMixin, _Regression):
            pass

    assert len(said) == 1 and said[0].filename == __file__
    with pytest.warns(UserWarning, match="before _Regression") as said:

        class AdoptedAbstract(OffloadOptimizerMixin, _Regression, abc.ABC):  # ABCMeta.__new__
            pass

    assert len(said) == 1 and said[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Subclass(Adopted):
            pass

        class Wrapping(OffloadOptimizerMixin, _Regression):
            def configure_optimizers(self) -> Any:
                return super().configure_optimizers()

        class Plain(OffloadOptimizerMixin, pl.LightningModule):
            pass


@pytest.mark.parametrize("returns", ["torch AdamW", "super()", "OffloadAdamW"])
def test_a_configure_optimizers_that_bypasses_the_mixin_is_warned_of(tmp_path, returns):
    """Inheriting the mixin but keeping one's own ``configure_optimizers`` (the common way to
    adopt it) offloads nothing: the fit says so, naming the method, unless an optimizer is an
    OffloadAdamW (built by the mixin or by hand)."""

    class Kept(OffloadOptimizerMixin, _Regression):
        def configure_optimizers(self) -> Any:
            if returns == "super()":
                return super().configure_optimizers()
            if returns == "OffloadAdamW":
                return OffloadAdamW(self.parameters())
            return _Regression.configure_optimizers(self)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer(tmp_path, max_steps=2).fit(Kept())
    bypassed = [w for w in said if "none of its optimizers is an OffloadAdamW" in str(w.message)]
    if returns == "torch AdamW":
        assert len(bypassed) == 1
        assert "(AdamW): " in str(bypassed[0].message)
        assert "Kept.configure_optimizers replaces the mixin's" in str(bypassed[0].message)
    else:
        assert not bypassed


@pytest.mark.parametrize("configured_by", ["the mixin", "the module"])
def test_an_optimizer_a_strategy_wraps_is_not_taken_for_a_bypassed_mixin(configured_by):
    """DeepSpeed replaces the trainer's optimizers with its engine's (the documented way to use
    it is the mixin with ``offload_enabled=False``): that the mixin's ``configure_optimizers``
    ran is what counts, not the type of what the strategy keeps."""
    from types import SimpleNamespace

    model = TinyModel()
    model.hparams.offload_enabled = False
    if configured_by == "the mixin":
        model.configure_optimizers()
    wrapped = SimpleNamespace()  # a strategy's wrapper: no OffloadAdamW
    model._trainer = SimpleNamespace(callbacks=[], optimizers=[wrapped], lr_scheduler_configs=[])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model.on_fit_start()
    bypassed = [w for w in said if "none of its optimizers is an OffloadAdamW" in str(w.message)]
    assert len(bypassed) == (configured_by == "the module")


def test_the_bypass_warning_names_the_class_whose_method_replaced_the_mixins(monkeypatch):
    """Inherited, the replacing ``configure_optimizers`` is named where it is defined; a module
    with no optimizer at all, or a rank other than 0, says nothing."""
    from types import SimpleNamespace

    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    class Kept(OffloadOptimizerMixin, _Regression):
        def configure_optimizers(self) -> Any:
            return _Regression.configure_optimizers(self)

    class Inheriting(Kept):
        pass

    def bypass_warnings(model: pl.LightningModule, optimizers: list) -> list[str]:
        model._trainer = SimpleNamespace(
            callbacks=[], optimizers=optimizers, lr_scheduler_configs=[]
        )
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            model.on_fit_start()
        return [str(w.message) for w in said if "none of its optimizers" in str(w.message)]

    model = Inheriting()
    optimizer = torch.optim.AdamW(model.parameters())
    (said,) = bypass_warnings(model, [optimizer])
    assert "Inheriting inherits" in said and "Kept.configure_optimizers replaces" in said
    assert not bypass_warnings(Inheriting(), [])
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert not bypass_warnings(Inheriting(), [optimizer])


def test_mixin_rejects_an_unknown_schedule():
    model = TinyModel(lr_schedule="linear")
    with pytest.raises(ValueError, match="lr_schedule must be None, 'constant' or 'cosine'"):
        model.configure_optimizers()


def test_mixin_refuses_deepspeed_unless_offload_is_disabled():
    """DeepSpeed's engine wraps the optimizer and offloads the state itself: the mixin refuses
    it with an error naming the way out, and with ``offload_enabled=False`` gives torch's AdamW
    for it to wrap."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DeepSpeedStrategy

    model = TinyModel()
    # Not constructed: DeepSpeedStrategy's constructor needs deepspeed installed.
    model._trainer = SimpleNamespace(strategy=object.__new__(DeepSpeedStrategy))
    with pytest.raises(ValueError, match=r"strategy is DeepSpeed.*offload_enabled=False"):
        model.configure_optimizers()
    model.hparams.offload_enabled = False
    assert not model.configure_optimizers().enabled


def test_lightning_cli_sets_hyperparameters(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        TinyModel,
        args=[
            "fit",
            "--model.lr=0.05",
            "--model.weight_decay=0.2",
            "--model.warmup_steps=2",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=3",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.accelerator=cpu",
        ],
    )
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, OffloadAdamW)
    assert optimizer.param_groups[0]["weight_decay"] == 0.2
    assert optimizer.param_groups[0]["initial_lr"] == 0.05


def test_mixin_reads_beta2_alone_and_spares_every_bias():
    class Attention(OffloadOptimizerMixin, pl.LightningModule):
        def __init__(self, beta2: float = 0.95) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.attention = torch.nn.MultiheadAttention(8, 2)

    model = Attention()
    decay, no_decay = model.configure_optimizers().param_groups
    assert decay["betas"] == (0.9, 0.95)
    assert any(p is model.attention.in_proj_bias for p in no_decay["params"])
    assert not any(p is model.attention.in_proj_bias for p in decay["params"])


def test_cosine_schedule_needs_a_finite_training_length(tmp_path):
    model = TinyModel(lr_schedule="cosine")
    with pytest.raises(ValueError, match="needs the module attached to a Trainer"):
        model.configure_optimizers()  # no Trainer
    with pytest.raises(ValueError, match="max_steps or max_epochs"):
        trainer(tmp_path, max_steps=-1, max_epochs=-1).fit(model)


@pytest.mark.parametrize("overlap_step", [False, True])
def test_the_mixins_optimizer_is_freed_without_the_cycle_collector(overlap_step):
    """Its hooks (and the overlap's forward hooks) reference the optimizer weakly or not at
    all: pinned host buffers go when it goes."""
    import gc
    import weakref

    model = TinyModel(overlap_step=overlap_step, force_staging=overlap_step)
    optimizer = model.configure_optimizers()
    model.net[0].weight.grad = torch.ones_like(model.net[0].weight)
    optimizer.step()
    buffers = weakref.ref(optimizer._host.arenas[0].buffers["exp_avg"])
    gc.disable()
    try:
        del optimizer
        assert buffers() is None
    finally:
        gc.enable()


class Configured(OffloadOptimizerMixin, pl.LightningModule):
    def __init__(self, **hparams) -> None:
        super().__init__()
        self.save_hyperparameters(hparams)
        self.linear = torch.nn.Linear(4, 4)


def test_every_offload_hparam_reaches_the_optimizer():
    optimizer = Configured(
        eps=1e-5,
        offload_chunk_size=256,
        offload_pin_memory=False,
        offload_enabled=False,
        offload_resident=0.5,
    ).configure_optimizers()
    assert isinstance(optimizer, OffloadAdamW)
    assert all(g["eps"] == 1e-5 for g in optimizer.param_groups)
    assert optimizer.chunk_size == 256
    assert optimizer.pin_memory is False
    assert optimizer.enabled is False
    assert optimizer.resident == 0.5


@pytest.mark.parametrize(
    ("hparams", "error", "message", "note"),
    [
        (
            {"offload_resident": 1.5},
            ValueError,
            "resident as a share",
            "offload_resident=1.5 \\(resident\\)",
        ),
        (
            {"offload_chunk_size": "4Mi"},
            TypeError,
            "chunk_size",
            "offload_chunk_size='4Mi' \\(chunk_size\\)",
        ),
        (
            {"offload_enabled": "no"},
            TypeError,
            "enabled must be a bool",
            "offload_enabled='no' \\(enabled\\)",
        ),
        ({"learning_rate": "3e-4"}, ValueError, "lr='3e-4'", "learning_rate='3e-4' \\(lr\\)"),
        ({"betas": 0.9}, ValueError, "betas must be a pair", "betas=0.9 \\(betas\\)"),
        # in torch's words; the good hparams beside the bad one are not named
        (
            {"learning_rate": -1.0, "weight_decay": 0.1, "eps": 1e-8},
            ValueError,
            "Invalid learning rate",
            "learning_rate=-1.0 \\(lr\\)",
        ),
        ({"beta2": 1.5, "lr": 0.1}, ValueError, "Invalid beta", "beta2=1.5 \\(betas\\)"),
        ({"eps": -1.0, "lr": 0.1}, ValueError, "Invalid epsilon", "eps=-1.0 \\(eps\\)"),
    ],
)
def test_a_bad_hparam_is_named_in_the_optimizers_error(hparams, error, message, note):
    with pytest.raises(error, match=message) as raised:
        Configured(**hparams).configure_optimizers()
    # As a traceback shows it: a note after the message (the message's end on Python 3.10)
    shown = "".join(traceback.format_exception_only(type(raised.value), raised.value))
    assert shown.count("OffloadOptimizerMixin took") == 1
    assert re.search(  # naming just the bad hparams
        f"\nOffloadOptimizerMixin took OffloadAdamW's arguments from the hparams {note}$",
        shown.rstrip("\n"),
    )


def test_an_error_about_the_parameters_does_not_blame_the_hparams():
    class NoLayers(OffloadOptimizerMixin, pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": 3e-4, "weight_decay": 0.1})

    with pytest.raises(ValueError, match="empty parameter list") as raised:
        NoLayers().configure_optimizers()
    assert "OffloadOptimizerMixin took" not in "".join(
        traceback.format_exception_only(type(raised.value), raised.value)
    )


def test_a_bad_warm_up_hparam_is_refused_also_without_a_schedule():
    with pytest.raises(ValueError, match=r"warmup_steps must be an int >= 0, got 2\.5"):
        Configured(warmup_steps=2.5).configure_optimizers()  # int() made it 2 before
    with pytest.raises(ValueError, match="min_lr_ratio must be a number in"):
        Configured(min_lr_ratio="0.1").configure_optimizers()


@pytest.mark.parametrize(
    ("hparams", "refusal"),
    [
        ({"lr_schedule": "linear"}, "lr_schedule must be"),
        ({"warmup_steps": -1}, "warmup_steps must be"),
        ({"lr_schedule": "cosine"}, "needs the module attached to a Trainer"),  # no length
    ],
)
def test_a_bad_schedule_hparam_leaves_no_overlap_hooks_on_the_module(hparams, refusal):
    """The schedule's hparams are refused before the overlap's hooks go on: while the error
    (and its traceback, holding the optimizer) lives, the module carries none and pickles."""
    import pickle

    model = Configured(overlap_step=True, **hparams)
    with pytest.raises(ValueError, match=refusal) as raised:
        model.configure_optimizers()
    assert raised.value is not None
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    pickle.dumps(model)


def test_hparams_init_takes_but_did_not_save_are_named_in_a_warning():
    class Unsaved(OffloadOptimizerMixin, pl.LightningModule):
        def __init__(self, learning_rate: float = 3e-4, beta2: float = 0.95, depth: int = 2):
            super().__init__()  # no save_hyperparameters()
            self.linear = torch.nn.Linear(4, 4)

    with pytest.warns(UserWarning) as warned:
        optimizer = Unsaved().configure_optimizers()
    messages = [str(w.message) for w in warned]
    assert any("takes 'learning_rate'" in m and "default lr=0.001" in m for m in messages)
    assert any("takes 'beta2'" in m and "save_hyperparameters()" in m for m in messages)
    assert not any("depth" in m for m in messages)
    assert optimizer.param_groups[0]["lr"] == 1e-3  # what the warning says is used
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Configured(lr=3e-4).configure_optimizers()  # saved, or not taken: no warning


def test_a_module_class_made_per_trial_is_not_kept_alive():
    """A sweep that defines its module class per trial (or builds it with ``type()``): once its
    models and optimizers are dropped, nothing of the mixin's keeps the class (a cache of the
    classes whose ``__init__`` it read for the forgotten-hparams warning did), nor what the
    class holds."""
    import gc
    import weakref

    def trial() -> weakref.ref:
        class PerTrial(OffloadOptimizerMixin, pl.LightningModule):
            def __init__(self, depth: int = 2) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(4, 4)

        PerTrial().configure_optimizers()  # reads the defaults: hparams saved none
        return weakref.ref(PerTrial)

    classes = [trial() for _ in range(3)]
    gc.collect()
    assert [c() for c in classes] == [None, None, None]


def test_defaults_leave_resident_and_chunk_size_to_the_optimizer():
    optimizer = Configured().configure_optimizers()
    assert optimizer.resident is None and optimizer.enabled is True
    assert optimizer.chunk_size == OffloadAdamW([torch.nn.Parameter(torch.zeros(1))]).chunk_size


class EpsModel(TinyModel):
    """TinyModel with a large eps, which changes every update visibly."""

    def __init__(self, optimizer: str = "offload") -> None:
        super().__init__(optimizer)
        self.save_hyperparameters({"eps": 1e-2})

    def configure_optimizers(self):
        if self.hparams.optimizer == "offload":
            return super().configure_optimizers()
        return torch_reference(
            {"params": self.reference_param_groups(), "lr": 0.01, "weight_decay": 0.1, "eps": 1e-2}
        )


def test_eps_hparam_trains_like_torch_adamw_with_that_eps(tmp_path):
    models = []
    for optimizer in ("offload", "torch"):
        model = EpsModel(optimizer)
        trainer(tmp_path / optimizer).fit(model)
        models.append(model)
    assert_same(list(models[0].parameters()), list(models[1].parameters()))


class TwoBackbones(OffloadOptimizerMixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"lr": 0.01, "weight_decay": 0.1})
        torch.manual_seed(0)
        self.first = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.second = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.head = torch.nn.Linear(4, 1)
        for p in [*self.first.parameters(), *self.second.parameters()]:
            p.requires_grad_(False)


def test_each_group_added_later_gets_its_own_link():
    """Two backbones unfrozen one after the other (BaseFinetuning): an lr set by hand on the
    second's no-decay half reaches its decayed half, never the first backbone's groups."""
    model = TwoBackbones()
    optimizer = model.configure_optimizers()
    for backbone in (model.first, model.second):
        backbone.requires_grad_(True)
        optimizer.add_param_group({"params": list(backbone.parameters()), "lr": 0.001})
    assert len(optimizer.param_groups) == 6  # head decay + head bias, then 2 halves each
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # an epoch trains at the lrs the groups were added with
    optimizer.param_groups[-1]["lr"] = 0.005  # BackboneFinetuning sets param_groups[-1]
    optimizer.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.01, 0.01, 0.001, 0.001, 0.005, 0.005]


class BiasFree(OffloadOptimizerMixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4, bias=False)


def test_a_model_without_biases_or_norms_has_one_group_that_takes_a_torch_checkpoint():
    """No empty no-decay group: the groups match torch's AdamW over the same parameters, so an
    optimizer state saved by torch (one group) loads into the mixin's optimizer."""
    model = BiasFree()
    optimizer = model.configure_optimizers()
    assert [len(g["params"]) for g in optimizer.param_groups] == [1]
    reference = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    model.linear.weight.grad = torch.ones_like(model.linear.weight)
    reference.step()
    optimizer.load_state_dict(reference.state_dict())
    assert optimizer.state_dict()["state"][0]["step"] == 1


def test_a_group_added_without_decay_is_added_whole():
    """Nothing to spare in a ``weight_decay=0`` group: it is added as given, one group in the
    given order, as torch's add_param_group adds it (a split would change the group count that
    checkpoints and ``param_groups[-1]`` users rely on)."""
    model = TwoBackbones()
    optimizer = model.configure_optimizers()
    params = list(model.first.parameters())
    optimizer.add_param_group({"params": params, "lr": 0.001, "weight_decay": 0.0})
    assert len(optimizer.param_groups) == 3
    assert [id(p) for p in optimizer.param_groups[-1]["params"]] == [id(p) for p in params]
    assert optimizer.param_groups[-1]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "spared",
    [
        lambda m: list(m.first[1].parameters()),  # a LayerNorm unfrozen alone
        lambda m: [m.first[0].bias, m.second[0].bias],  # biases only (BitFit)
        lambda m: m.first[0].bias,  # a lone tensor, which torch takes as a list of one
    ],
    ids=["norm", "biases", "lone-tensor"],
)
def test_a_group_added_later_of_spared_parameters_only_gets_no_decay(spared):
    """Biases and norm weights added later are spared from decay even with nothing to split
    them from: one group at ``weight_decay=0``, trained as torch AdamW trains that group."""
    model = TwoBackbones()
    optimizer = model.configure_optimizers()
    params = spared(model)
    listed = [params] if isinstance(params, torch.Tensor) else params
    reference = [p.detach().clone().requires_grad_() for p in [model.head.weight, *listed]]
    head_bias = model.head.bias.detach().clone().requires_grad_()
    theirs = torch.optim.AdamW(
        [{"params": reference[:1]}, {"params": [head_bias], "weight_decay": 0.0}],
        lr=0.01,
        weight_decay=0.1,
        fused=True,
    )
    theirs.add_param_group({"params": reference[1:], "lr": 0.001, "weight_decay": 0.0})
    optimizer.add_param_group({"params": params, "lr": 0.001})
    assert len(optimizer.param_groups) == 3
    assert [id(p) for p in optimizer.param_groups[-1]["params"]] == [id(p) for p in listed]
    ours = [model.head.weight, *listed, model.head.bias]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(ours, [*reference, head_bias], strict=True):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        optimizer.step()
        theirs.step()
    assert_same(ours, [*reference, head_bias])


def test_a_group_with_a_parameter_already_held_is_refused_whole():
    """Split in two, its decayed half would be added before torch refused the half holding
    the parameter the optimizer already has: the group is given to torch whole instead."""
    model = TwoBackbones()
    optimizer = model.configure_optimizers()
    new, held = model.second[0].weight, model.head.bias  # decayed, spared

    def groups() -> list[tuple[list[int], dict]]:
        return [
            ([id(p) for p in g["params"]], {**g, "params": None}) for g in optimizer.param_groups
        ]

    before = groups()
    with pytest.raises(ValueError, match=r"parameter 1 of param group \d+ is parameter 0 of"):
        optimizer.add_param_group({"params": [new, held]})
    assert groups() == before


class RecordsEvalMode(TinyModel):
    """Which mode the module and its layers are in at each validation step."""

    def __init__(self, **hparams: Any) -> None:
        super().__init__(**hparams)
        self.modes: list[bool] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.modes.extend(module.training for module in self.modules())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(4), batch_size=4)


@pytest.mark.parametrize("overlap_step", [False, True])
def test_validation_runs_in_eval_mode_and_training_resumes_in_train_mode(tmp_path, overlap_step):
    """The mixin's ``on_validation_model_eval`` waits for the updates and then lets Lightning
    put the module in eval mode (dropout off, batch norm's running statistics used)."""
    model = RecordsEvalMode(force_staging=True, overlap_step=overlap_step)
    trainer(tmp_path, max_steps=2, val_check_interval=1, check_val_every_n_epoch=None).fit(model)
    # the sanity check's pass, then one after each of the two steps
    assert len(model.modes) == 3 * len(list(model.modules()))
    assert not any(model.modes)
    assert all(module.training for module in model.modules())


def test_offload_disabled_with_overlap_step_trains_like_torch_adamw(tmp_path):
    """``offload_enabled=False`` switches offloading off for a config that also asks for
    ``overlap_step``: there is nothing to overlap, and the run is torch's AdamW."""
    model = TinyModel(overlap_step=True)
    model.hparams.offload_enabled = False
    reference = TinyModel(optimizer="torch")
    trainer(tmp_path / "offload").fit(model)
    trainer(tmp_path / "torch").fit(reference)
    assert model.trainer.optimizers[0]._overlapping() is None
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


def test_offload_overlap_blocks_reach_overlap_with():
    """What ``offload_overlap_blocks`` returns is given to ``overlap_with`` (checked there: a
    module outside the overlapped one is refused)."""

    class WrongBlocks(TinyModel):
        def offload_overlap_blocks(self):
            return [torch.nn.Linear(2, 2)]  # not a submodule

    with pytest.raises(ValueError, match="blocks must be submodules"):
        WrongBlocks(overlap_step=True, force_staging=True).configure_optimizers()
    TinyModel(overlap_step=True, force_staging=True).configure_optimizers()  # no blocks: fine


def test_an_offload_adamw_is_found_in_a_wrapper_keeping_it_as_optim_and_nothing_else():
    """The Lightning parts see an OffloadAdamW itself or inside a wrapper that keeps it as
    ``optim`` (``ZeroRedundancyOptimizer``, ``PostLocalSGDOptimizer``), also one around the
    other; a wrapper of another optimizer is not taken for one (the monitor would read its
    memory stats)."""
    from lightning_offload_optim.lightning.optimizers import offload_optimizers

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optim: torch.optim.Optimizer) -> None:
            self.optim = optim
            super().__init__(optim.param_groups, {})

    params = [torch.nn.Parameter(torch.ones(3))]
    offload, sgd = OffloadAdamW(params), torch.optim.SGD(params, lr=0.1)
    found = offload_optimizers([sgd, Wrapper(sgd), Wrapper(offload), Wrapper(Wrapper(offload))])
    assert [id(o) for o in found] == [id(offload), id(offload)]
    # Up to four wrappers deep, as the lookup says; not five (it follows no cycle for ever).
    deep = offload
    for depth in range(1, 6):
        deep = Wrapper(deep)
        assert offload_optimizers([deep]) == ([offload] if depth <= 4 else []), depth
