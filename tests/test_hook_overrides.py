"""The mixin warns where the module overrides one of its hooks without ``super()`` and the run's
settings need that hook (Lightning's own hooks do nothing, so leaving ``super()`` out is the
habit)."""

from __future__ import annotations

import functools
import inspect
import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_offload_optim import OffloadOptimizerMixin


class Base(OffloadOptimizerMixin, pl.LightningModule):
    def __init__(self, **hparams) -> None:
        super().__init__()
        self.save_hyperparameters(hparams)
        self.net = torch.nn.Linear(4, 4)


class WithoutSuper(Base):
    def on_fit_start(self) -> None:
        self.started = True

    def on_train_start(self) -> None:
        pass

    def on_validation_model_eval(self) -> None:
        self.eval()

    def on_train_end(self) -> None:
        pass

    def setup(self, stage: str) -> None:
        self.stage = stage


def about_super(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "does not call super" in str(w.message)]


def warnings_of(model: pl.LightningModule) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.configure_optimizers()
    return about_super(caught)


def hooks_named(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message).split(" does not")[0] for w in caught]


ORDERING = ("on_fit_start", "on_train_start", "on_validation_model_eval", "on_train_end", "setup")


def test_overrides_without_super_are_named_at_their_own_lines():
    caught = warnings_of(WithoutSuper(overlap_step=True))
    assert hooks_named(caught) == [f"WithoutSuper.{hook}" for hook in ORDERING]
    line = inspect.getsourcelines(WithoutSuper.on_fit_start)[1]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    assert "weight-averaging callback does not turn the overlap off" in str(caught[0].message)
    assert "not freed after fit" in str(caught[3].message)
    assert "not ordered after the last step's updates" in str(caught[4].message)
    assert "hooks stay on the module after a fit that raised" in str(caught[4].message)


@pytest.mark.parametrize(
    ("hparams", "expected"),
    [
        # no overlap: its ordering hooks are not needed
        ({}, ["WithoutSuper.on_train_end"]),
        ({"offload_enabled": False}, []),  # torch's AdamW: nothing held on the device
        (
            {"warmup_steps": 2},
            ["WithoutSuper.on_fit_start", "WithoutSuper.on_train_end"],
        ),
        ({"warmup_steps": 2, "overlap_step": True}, [f"WithoutSuper.{h}" for h in ORDERING]),
    ],
)
def test_only_hooks_the_runs_settings_need_are_checked(hparams, expected):
    caught = warnings_of(WithoutSuper(**hparams))
    assert hooks_named(caught) == expected
    if "warmup_steps" in hparams:  # on_fit_start's message names what this run loses
        message = str(caught[0].message)
        assert "schedule's peak" in message
        assert ("weight-averaging" in message) == ("overlap_step" in hparams)


def passes_through(hook):
    @functools.wraps(hook)
    def run(*args, **kwargs):
        return hook(*args, **kwargs)

    return run


class CallsUp(Base):
    """Every way of calling up: ``super()``, the mixin's hook by name, inside a nested function,
    under a decorator that wraps."""

    def on_fit_start(self) -> None:
        super().on_fit_start()

    def on_train_start(self) -> None:
        OffloadOptimizerMixin.on_train_start(self)

    def on_validation_model_eval(self) -> None:
        def later() -> None:
            super(CallsUp, self).on_validation_model_eval()

        later()

    @passes_through
    def on_train_end(self) -> None:
        super().on_train_end()


class BreaksTheChain(CallsUp):
    def on_fit_start(self) -> None:
        pass

    on_train_end = lambda self: None  # noqa: E731  (a lambda cannot call super())


class BelowTheBreak(BreaksTheChain):
    def on_fit_start(self) -> None:
        super().on_fit_start()  # reaches BreaksTheChain's, which stops there


class BreaksItAgain(BelowTheBreak):
    def on_fit_start(self) -> None:
        pass


def test_calling_up_in_any_way_is_seen_and_a_break_anywhere_in_the_chain_is_found():
    assert warnings_of(CallsUp(overlap_step=True)) == []
    broken = ["BreaksTheChain.on_fit_start", "BreaksTheChain.on_train_end"]
    for model in (BreaksTheChain, BelowTheBreak):
        assert hooks_named(warnings_of(model(overlap_step=True))) == broken
    # The override that runs first stops the chain: the break above it is not named again.
    again = ["BreaksItAgain.on_fit_start", "BreaksTheChain.on_train_end"]
    assert hooks_named(warnings_of(BreaksItAgain(overlap_step=True))) == again


def timed(hook):
    def run(self, *args):  # no functools.wraps: what it calls is not for the check to read
        return hook(self, *args)

    return run


class Decorated(Base):
    @timed
    def on_train_end(self) -> None:
        super().on_train_end()


def test_an_override_under_a_decorator_that_hides_it_is_not_checked():
    assert warnings_of(Decorated()) == []


def test_filters_naming_the_modules_module_and_other_ranks_silence_it(monkeypatch):
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module="test_hook_overrides")
        WithoutSuper().configure_optimizers()
    assert about_super(caught) == []
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert warnings_of(WithoutSuper()) == []  # DDP's other ranks: rank 0 warns


def test_each_override_is_warned_about_once_under_the_default_filter():
    """As a ``warnings.warn`` from the override's line would be: a tuner's run builds the
    optimizers again, and ``fit`` may run more than once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            WithoutSuper().configure_optimizers()
    assert hooks_named(about_super(caught)) == ["WithoutSuper.on_train_end"]


def test_an_overrides_warning_raised_as_an_error_leaves_no_hook_on_the_module():
    """Under ``-W error`` the warning is raised from ``configure_optimizers``: it comes before
    the overlap's hooks go on, so none is left on the module while the error (and its
    traceback, which holds the optimizer) is kept, in a notebook's last traceback say."""
    model = WithoutSuper(overlap_step=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="does not call super") as raised:
            model.configure_optimizers()
    assert raised.traceback  # kept
    assert not any(m._forward_pre_hooks for m in model.modules())
