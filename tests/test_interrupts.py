"""Ctrl-C (a real SIGINT) while the optimizer updates: the update finishes, then the
``KeyboardInterrupt`` is raised, so the state is whole and can be saved, as torch's fused AdamW
(one kernel call, which Python cannot interrupt) always leaves it. A scheduler's notice
(SIGUSR1, SIGTERM), whose handler saves a checkpoint, likewise runs when the update ends."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import pickle
import signal
import sys
import threading
import time
import types
import weakref

import lightning.pytorch as pl
import pytest
import torch
from conftest import (
    assert_same,
    clone_params,
    fail_on_call,
    make_params,
    overlapped_pair,
    set_grads,
    step_together,
    train_alike,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerStatus
from lightning_models import TinyModel, make_data, trainer
from torch.utils.data import DataLoader

from lightning_offload_optim import OffloadAdamW, OffloadMonitor, StagingPool, interrupts
from lightning_offload_optim import adamw as adamw_module
from lightning_offload_optim.interrupts import signals_held
from lightning_offload_optim.lightning.batch_interrupt import (
    deliver_held_signals,
    hold_signals_until_batch_end,
)


@pytest.fixture(autouse=True)
def default_sigint():
    """Each test starts with Python's own handler and gets it back (Lightning's shutdown
    ignores SIGINT for good), and gets back the notice signals' handlers."""
    notices = {signum: signal.getsignal(signum) for signum in interrupts.NOTICE_SIGNALS}
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
    for signum, handler in notices.items():
        signal.signal(signum, handler)


SIGUSR1 = signal.SIGUSR1
NOTICES = [signal.SIGTERM, SIGUSR1]


def signal_on_call(
    monkeypatch, target, name: str, numbers: set[int], signum: int = signal.SIGINT
) -> list[int]:
    """Send this process ``signum`` inside the calls of ``target.name`` numbered ``numbers``."""
    real, calls = getattr(target, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) in numbers:
            signal.raise_signal(signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)
    return calls


def started_hold_over_a_recorder() -> tuple[interrupts.SigintHold, list[int]]:
    """A started hold of SIGINT meant for a handler that records what it receives."""
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    hold = interrupts.SigintHold()
    hold.start()
    return hold, received


def errors_in_another_thread(work) -> list[Exception]:
    """Run ``work`` in a thread of its own; what it raised."""
    errors = []

    def run() -> None:
        try:
            work()
        except Exception as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return errors


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_ctrl_c_during_the_update_is_raised_after_it(monkeypatch, overlap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    twin = copy.deepcopy(model)
    opt, torch_opt = overlapped_pair(model, twin, lr=0.01)
    if not overlap:
        opt.overlap_with(model).remove()
    inputs = torch.randn(4, 8, 16)
    pairs = [
        (lambda x: model(x).square().sum(), opt),
        (lambda x: twin(x).square().sum(), torch_opt),
    ]
    train_alike(pairs, inputs[:2])
    for forward, _ in pairs:
        forward(inputs[2]).backward()
    calls = signal_on_call(monkeypatch, adamw_module, "adamw_update", {2})
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert len(calls) > 2  # the chunks after the interrupt were updated too
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.undo()
    torch_opt.step()
    saved = opt.state_dict()  # not refused: the step is whole (and waited for)
    for index, entry in torch_opt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved["state"][index][key], entry[key]), (index, key)
    assert_same(list(model.parameters()), list(twin.parameters()))
    for _, optimizer in pairs:
        optimizer.zero_grad()
    train_alike(pairs, inputs[3:])
    opt.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))


@pytest.mark.parametrize("later", [True, False], ids=["later", "same-press"])
def test_a_second_ctrl_c_still_waits_for_the_update(monkeypatch, later):
    """An impatient user presses twice (or a launcher forwards one press twice): the update
    still ends whole, and one ``KeyboardInterrupt`` follows. A half-updated optimizer would
    refuse to be saved, and Lightning's graceful shutdown would save nothing."""
    if later:
        monkeypatch.setattr(interrupts, "SAME_PRESS_SECONDS", 0.0)
    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    step_together([opt], [params], torch.Generator().manual_seed(0), 1)
    calls = signal_on_call(monkeypatch, adamw_module, "adamw_update", {2, 3})
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert len(calls) > 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert opt.state_dict()["state"][0]["step"] == 2  # whole


def staged_after_two_steps():
    """A staged OffloadAdamW over ``make_params()`` after two steps: the parameters, the
    optimizer, the gradients' generator and a copy of its state dict."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    generator = torch.Generator().manual_seed(0)
    step_together([opt], [params], generator, 2)
    return params, opt, generator, copy.deepcopy(opt.state_dict())


def test_ctrl_c_during_a_load_is_raised_after_it(monkeypatch):
    """Also after a step that failed partway: the load, whole, lifts the refusal to step."""
    params, opt, generator, saved = staged_after_two_steps()
    weights = clone_params(params)
    fail_on_call(monkeypatch, adamw_module, "adamw_update", 2, RuntimeError("simulated"))
    with pytest.raises(RuntimeError, match="simulated"):
        step_together([opt], [params], generator, 1)
    monkeypatch.undo()
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    calls = signal_on_call(monkeypatch, torch.Tensor, "copy_", {2})  # in-place writes
    with pytest.raises(KeyboardInterrupt):
        opt.load_state_dict(saved)
    assert len(calls) > 2
    monkeypatch.undo()
    step_together([opt, torch_opt], [params, reference], generator, 2)  # not refused
    assert_same(params, reference)


def test_ctrl_c_while_state_written_into_optimizer_state_is_adopted(monkeypatch):
    """State put in ``optimizer.state`` (``ZeroRedundancyOptimizer``'s load, a hand edit) is
    copied into host buffers when the next step starts; a Ctrl-C then stops that step before
    its update, with the state whole, not refused."""
    params, opt, generator, saved = staged_after_two_steps()
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    for index, param in enumerate(params):
        opt.state[param] = {k: v.clone() for k, v in saved["state"][index].items()}
    weights = clone_params(params)
    set_grads([params, reference], generator)
    calls = signal_on_call(monkeypatch, torch.Tensor, "copy_", {2})
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert len(calls) > 2
    monkeypatch.undo()
    assert_same(params, weights)  # not updated
    torch_opt.step()
    opt.step()
    assert_same(params, reference)


def test_a_held_ctrl_c_reaches_the_handler_it_was_meant_for_once(monkeypatch):
    handler = lambda signum, frame: received.append(signum)  # noqa: E731
    received = []
    signal.signal(signal.SIGINT, handler)
    with signals_held():
        with signals_held():  # nested: the outer block holds
            signal.raise_signal(signal.SIGINT)
        assert received == []
    assert received == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_hold_delivers_an_insisting_ctrl_c_as_soon_as_no_update_runs(monkeypatch):
    """The mixin's hold spans a batch: a second press (0.5 s or more after the first) is the
    user insisting, delivered at once, but never inside an update."""
    monkeypatch.setattr(interrupts, "SAME_PRESS_SECONDS", 0.0)
    hold, received = started_hold_over_a_recorder()
    signal.raise_signal(signal.SIGINT)
    with signals_held():  # an update inside the hold
        signal.raise_signal(signal.SIGINT)
        assert received == []
    assert received == [signal.SIGINT]  # once, when the update ended
    assert not hold.holding
    hold = interrupts.SigintHold()
    hold.start()
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGINT)
    assert received == [signal.SIGINT] * 2  # at once: no update runs
    hold.end()
    assert received == [signal.SIGINT] * 2


def test_an_ended_hold_installed_again_gives_sigint_back():
    """Lightning saves the handlers at the start of a ``fit`` or ``validate`` and restores them
    at its end: one started during a hold that ended meanwhile puts the ended hold back."""
    received = []
    handler = lambda signum, frame: received.append(signum)  # noqa: E731
    signal.signal(signal.SIGINT, handler)
    hold = interrupts.SigintHold()
    hold.start()
    saved = signal.getsignal(signal.SIGINT)
    hold.end()
    signal.signal(signal.SIGINT, saved)
    signal.raise_signal(signal.SIGINT)
    assert received == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is handler


def test_an_update_in_another_thread_leaves_the_main_threads_hold_alone(monkeypatch):
    monkeypatch.setattr(interrupts, "SAME_PRESS_SECONDS", 0.0)
    hold, received = started_hold_over_a_recorder()
    errors = []

    def until(condition) -> None:  # the main thread runs the handler, soon
        deadline = time.monotonic() + 5
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.001)

    def update_elsewhere() -> None:
        try:
            with signals_held():
                signal.raise_signal(signal.SIGINT)  # reaches the main thread's hold
                until(lambda: hold.arrived)
                signal.raise_signal(signal.SIGINT)  # the user insists: no main-thread update
                until(lambda: received)
        except Exception as error:
            errors.append(error)

    thread = threading.Thread(target=update_elsewhere)
    thread.start()
    until(lambda: not thread.is_alive())  # runs Python, so the handler runs (join() would not)
    assert errors == []
    assert received == [signal.SIGINT]
    assert not hold.holding


def test_a_trainer_stepping_in_another_thread_leaves_a_stale_hold_to_the_main_thread():
    """A hold whose trainer stopped is ended where it is found, which only the main thread may
    do (``signal.signal``): a fit in another thread holds nothing and must not fail on it."""
    stale = interrupts.SigintHold(alive=lambda: False)
    stale.start()
    optimizer = OffloadAdamW(make_params())
    trainer = Callback()  # any weakly referable object
    assert errors_in_another_thread(lambda: hold_signals_until_batch_end(trainer, optimizer)) == []
    assert stale.holding  # left to the main thread


def test_an_update_under_an_ended_hold_installed_again_still_runs_whole():
    """Lightning restores the handler it saved during a hold (the hold itself, ended since):
    an update then holds SIGINT on its own instead of joining the ended hold."""
    hold = interrupts.SigintHold()
    hold.start()
    saved = signal.getsignal(signal.SIGINT)
    hold.end()
    signal.signal(signal.SIGINT, saved)
    inside = []
    with pytest.raises(KeyboardInterrupt), signals_held():
        signal.raise_signal(signal.SIGINT)
        inside.append("update finished")
    assert inside == ["update finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_hold_ended_while_replaced_gives_sigint_back_once_restored():
    """A fit replaces the handler during the hold and restores the ended hold later: the next
    press reaches the handler the hold had taken over, which is installed again."""
    received = []

    def handler(signum, frame):
        received.append(signum)

    signal.signal(signal.SIGINT, handler)
    hold = interrupts.SigintHold()
    hold.start()
    saved = signal.signal(signal.SIGINT, lambda signum, frame: None)
    hold.end()  # no longer holding: only forgets it holds
    signal.signal(signal.SIGINT, saved)
    signal.raise_signal(signal.SIGINT)
    assert received == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_press_that_could_not_be_delivered_is_not_delivered_by_a_later_hold():
    hold, received = started_hold_over_a_recorder()
    signal.raise_signal(signal.SIGINT)  # held
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(-signum))  # taken over
    hold.end()  # cannot deliver: not holding any more
    hold.start()
    hold.end()  # no press in this hold
    assert received == []


def test_a_held_press_is_delivered_when_its_handler_was_given_back_by_someone_else():
    """Lightning restores the handlers it saved when a fit ends, before the module's
    ``teardown``: the hold's handler is gone, but the press is still the restored one's."""
    hold, received = started_hold_over_a_recorder()
    signal.raise_signal(signal.SIGINT)  # held
    signal.signal(signal.SIGINT, hold._meant_for)  # given back by someone else
    hold.end()
    hold.end()
    assert received == [signal.SIGINT]


def test_an_insisting_press_waits_for_the_outermost_update(monkeypatch):
    monkeypatch.setattr(interrupts, "SAME_PRESS_SECONDS", 0.0)
    _, received = started_hold_over_a_recorder()
    signal.raise_signal(signal.SIGINT)
    with signals_held():
        with signals_held():
            signal.raise_signal(signal.SIGINT)  # the user insists
        assert received == []  # the outer update still runs
    assert received == [signal.SIGINT]


def test_holds_that_cannot_hold_change_nothing(monkeypatch):
    """A second hold while one holds, a hold outside the main thread, and one where SIGINT is
    handled outside Python (``getsignal`` gives None) leave the handler as it was."""
    first, second = interrupts.SigintHold(), interrupts.SigintHold()
    first.start()
    second.start()
    assert not second.holding
    first.end()
    second.end()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    elsewhere = interrupts.SigintHold()
    assert errors_in_another_thread(lambda: (elsewhere.start(), elsewhere.end())) == []
    monkeypatch.setattr(interrupts, "_getsignal", lambda signum: None)
    outside = interrupts.SigintHold()
    outside.start()
    outside.end()
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_hold_whose_owner_stopped_delivers_at_once():
    """A hold whose end never came (Lightning skips the module's hooks after an exception, and
    its own restore of the handlers when a callback's ``on_exception`` raises) must not swallow
    the next Ctrl-C at the prompt."""
    received = []
    handler = lambda signum, frame: received.append(signum)  # noqa: E731
    signal.signal(signal.SIGINT, handler)
    running = [True]
    interrupts.SigintHold(alive=lambda: running[0]).start()
    running[0] = False
    signal.raise_signal(signal.SIGINT)
    assert received == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is handler
    # Nor does it take over an update: that update holds a Ctrl-C itself, to its end.
    interrupts.SigintHold(alive=lambda: running[0]).start()
    with signals_held():
        signal.raise_signal(signal.SIGINT)
        assert received == [signal.SIGINT]
    assert received == [signal.SIGINT] * 2
    assert signal.getsignal(signal.SIGINT) is handler


def test_an_event_loop_hears_of_a_held_ctrl_c_once():
    """asyncio's ``add_signal_handler`` reads the signals from the wakeup file descriptor:
    sending the held one again would write it there twice."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    os.set_blocking(read, False)
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    previous = signal.set_wakeup_fd(write)
    try:
        with signals_held():
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.set_wakeup_fd(previous)
    assert os.read(read, 100) == bytes([signal.SIGINT])
    os.close(read)
    os.close(write)


def test_nothing_is_held_where_ctrl_c_is_ignored_or_outside_the_main_thread():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with signals_held():
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    def update() -> None:
        with signals_held():  # signal.signal would raise ValueError here
            pass

    assert errors_in_another_thread(update) == []


class CtrlC(Callback):
    """Ctrl-C (or ``signum``) in the second chunk update of the step that follows ``at`` steps
    ("step"; with ``twice`` sent again right after that update, as launchers that forward the
    terminal's signal do), or in the callbacks' hook at the end of the batch of that step
    ("batch end") or at the start of the next batch ("next batch start")."""

    def __init__(
        self, monkeypatch, at: int, where: str, twice: bool = False, signum: int = signal.SIGINT
    ) -> None:
        self.monkeypatch, self.at, self.where, self.twice = monkeypatch, at, where, twice
        self.signum = signum
        self.sent = False

    def send(self) -> None:
        self.sent = True
        signal.raise_signal(self.signum)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.where == "step" and not self.sent and trainer.global_step == self.at:
            self.sent = True
            signal_on_call(self.monkeypatch, adamw_module, "adamw_update", {2}, self.signum)
            if self.twice:
                hook = optimizer.register_step_post_hook(lambda *args: hook.remove() or self.send())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.where == "batch end" and not self.sent and trainer.global_step > self.at:
            self.send()
        self.stepped = trainer.global_step > self.at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.where == "next batch start" and not self.sent and getattr(self, "stepped", 0):
            self.send()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.where == "epoch end" and not self.sent and getattr(self, "stepped", 0):
            self.send()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.where == "train end" and not self.sent and getattr(self, "stepped", 0):
            self.send()


class TwoStepsPerBatch(TinyModel):
    """Manual optimization stepping the one optimizer twice per batch, on its halves."""

    def __init__(self, **hparams) -> None:
        super().__init__(**hparams)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx) -> None:
        opt = self.optimizers()
        for x, y in zip(*(part.chunk(2) for part in batch), strict=True):
            opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self(x), y))
            opt.step()


class EndHookWithoutSuper(TinyModel):
    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        pass  # the mixin's hook, which raises the held Ctrl-C, does not run


class EpochHooksWithoutSuper(EndHookWithoutSuper):
    """None of the mixin's batch and epoch hooks runs: training's end raises the Ctrl-C."""

    def on_train_batch_start(self, batch, batch_idx) -> None:
        pass

    def on_train_epoch_end(self) -> None:
        pass


class TrainEndWithoutSuper(EpochHooksWithoutSuper):
    """Not even the mixin's ``on_train_end`` runs: its ``teardown`` raises the Ctrl-C, after
    Lightning gave SIGINT back to the handler it saved."""

    def on_train_end(self) -> None:
        pass


class WithoutMixin(pl.LightningModule):
    """TinyModel's network, data and param groups, with OffloadAdamW from a ``configure_optimizers``
    of its own: no mixin, so only the monitor holds Ctrl-C to the batch's end."""

    forward = TinyModel.forward
    training_step = TinyModel.training_step
    train_dataloader = TinyModel.train_dataloader
    reference_param_groups = TinyModel.reference_param_groups

    def __init__(self, **hparams) -> None:
        super().__init__()
        self.save_hyperparameters({"nan_at_batch": -1})
        self.net = TinyModel().net
        self.batch_ends: list[int] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.batch_ends.append(self.trainer.global_step)

    def configure_optimizers(self) -> OffloadAdamW:
        groups = self.reference_param_groups()
        return OffloadAdamW(groups, lr=0.01, weight_decay=0.1, force_staging=True, chunk_size=64)


def interrupted_then_resumed(
    root, monkeypatch, model: type[TinyModel], model_kwargs, ctrl_c: CtrlC
) -> tuple[dict, TinyModel]:
    """The checkpoint ``OnExceptionCheckpoint`` saves after ``ctrl_c`` and the model resumed
    from it to the end (6 batches); with the monitor only where the module has no mixin."""
    on_exception = OnExceptionCheckpoint(root / "ckpt", "interrupted")
    monitor = [OffloadMonitor(summary=False)] if model is WithoutMixin else []
    callbacks = [ctrl_c, *monitor, on_exception]
    with pytest.raises(SystemExit):  # Lightning exits after a KeyboardInterrupt
        trainer(root, callbacks=callbacks, enable_checkpointing=True).fit(model(**model_kwargs))
    monkeypatch.undo()
    if model is TrainEndWithoutSuper and "optimizer" not in model_kwargs:  # ours, at teardown
        # Lightning ignores SIGINT while it shuts down, and gives back only the handlers its
        # signal connector still holds: none after its teardown (so for any Ctrl-C raised
        # from a teardown hook).
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    path = root / "ckpt" / "interrupted.ckpt"
    resumed = model(**model_kwargs)
    resume = trainer(root / "resumed", max_steps=6 * steps_per_batch(model), callbacks=monitor)
    resume.fit(resumed, ckpt_path=path)
    return torch.load(path, weights_only=False), resumed


def steps_per_batch(model: type[TinyModel]) -> int:
    return 2 if issubclass(model, TwoStepsPerBatch) else 1


def assert_same_checkpoint(saved: dict, expected: dict) -> None:
    assert saved["global_step"] == expected["global_step"]
    assert saved["loops"] == expected["loops"]
    for name, value in expected["state_dict"].items():
        assert torch.equal(saved["state_dict"][name], value), name
    state = saved["optimizer_states"][0]["state"]
    for index, entry in expected["optimizer_states"][0]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[index][key].float(), entry[key].float()), (index, key)


@pytest.mark.parametrize(
    ("model", "overlap", "twice", "torch_at"),
    [
        (TinyModel, False, False, "batch end"),
        (TinyModel, True, False, "batch end"),
        (TinyModel, False, True, "batch end"),
        (TwoStepsPerBatch, False, False, "batch end"),
        (EndHookWithoutSuper, False, False, "next batch start"),
        (EndHookWithoutSuper, False, False, "epoch end"),
        (EpochHooksWithoutSuper, False, False, "train end"),
        (TrainEndWithoutSuper, False, False, "train end"),
        (WithoutMixin, False, False, "next batch start"),
        (WithoutMixin, False, False, "epoch end"),
    ],
    ids=[
        "plain",
        "overlap",
        "sent-twice",
        "two-steps-per-batch",
        "end-hook-without-super",
        "end-hook-without-super-last-step",
        "batch-and-epoch-hooks-without-super",
        "train-end-without-super",
        "monitor-without-mixin",
        "monitor-without-mixin-last-step",
    ],
)
def test_ctrl_c_in_a_lightning_step_saves_a_checkpoint_that_resumes_exactly(
    tmp_path, monkeypatch, model, overlap, twice, torch_at
):
    """Lightning's graceful shutdown runs ``OnExceptionCheckpoint``. Had the interrupt stopped
    the update partway, the optimizer would refuse to be saved; raised from ``step()``, the
    checkpoint would hold the step with loop counters that do not count it, and the resume
    would train that batch twice (or, with two steps per batch, lose the second). The mixin
    raises it at the end of the batch: the checkpoint is the one torch's AdamW gives for a
    Ctrl-C there, and resumes the same. A launcher's second copy of the signal changes
    nothing; without the end hook's ``super()``, or without the mixin but with the monitor,
    the next batch's start or the epoch's end raises it."""
    at = 5 if torch_at in ("epoch end", "train end") else 2 * steps_per_batch(model)  # last, 3rd
    kwargs = {"force_staging": True, "overlap_step": overlap}
    ours = CtrlC(monkeypatch, at, "step", twice)
    warned = "on_train_end does not call super" if model is TrainEndWithoutSuper else None
    with pytest.warns(UserWarning, match=warned) if warned else contextlib.nullcontext():
        saved, resumed = interrupted_then_resumed(
            tmp_path / "ours", monkeypatch, model, kwargs, ours
        )
    theirs = CtrlC(monkeypatch, at, torch_at)
    expected, reference = interrupted_then_resumed(
        tmp_path / "torch",
        monkeypatch,
        TinyModel if model is WithoutMixin else model,
        {"optimizer": "torch"},
        theirs,
    )
    assert saved["global_step"] == at + steps_per_batch(model)
    assert_same_checkpoint(saved, expected)
    assert_same(list(resumed.parameters()), list(reference.parameters()))


class BatchEnds(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize("model", [TinyModel, WithoutMixin], ids=["mixin", "monitor-only"])
def test_every_batch_end_hook_runs_before_the_held_ctrl_c(tmp_path, monkeypatch, model):
    """The hold ends after every ``on_train_batch_end`` (in the mixin's, which runs last, or in
    the monitor's next hook): a callback after the monitor and a checkpoint callback saving
    every step (Lightning runs it last) see the interrupted step; so does, without the mixin,
    the module's own hook."""
    after, every_step = BatchEnds(), ModelCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1)
    callbacks = [CtrlC(monkeypatch, 2, "step"), OffloadMonitor(summary=False), after, every_step]
    module = model(force_staging=True)
    with pytest.raises(SystemExit):
        trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True).fit(module)
    assert after.steps == [1, 2, 3]
    saved = sorted(path.name for path in tmp_path.glob("*.ckpt"))
    assert saved == [f"epoch=0-step={step}.ckpt" for step in (1, 2, 3)]
    assert getattr(module, "batch_ends", [1, 2, 3]) == [1, 2, 3]


class ValidatedWithoutEndHook(EndHookWithoutSuper):
    def validation_step(self, batch, batch_idx) -> None:
        self.validated = True

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(4), batch_size=4)


class ValidatedWithoutMixin(WithoutMixin):
    validation_step = ValidatedWithoutEndHook.validation_step
    val_dataloader = ValidatedWithoutEndHook.val_dataloader


@pytest.mark.parametrize(
    "model", [ValidatedWithoutEndHook, ValidatedWithoutMixin], ids=["mixin", "monitor-only"]
)
def test_a_held_ctrl_c_is_raised_before_validation_after_the_batch(tmp_path, monkeypatch, model):
    """Where the batch's end hooks do not raise it (the mixin's skipped by an override without
    ``super()``; the monitor's next hooks without the mixin), validation after the batch (which
    may take minutes) must not run with the press held: ``on_validation_model_eval`` or the
    monitor's ``on_validation_start`` raises it."""
    model = model(force_staging=True)
    monitor = [OffloadMonitor(summary=False)] if isinstance(model, WithoutMixin) else []
    fit = trainer(
        tmp_path,
        callbacks=[CtrlC(monkeypatch, 1, "step"), *monitor],
        val_check_interval=2,
        num_sanity_val_steps=0,
    )
    with pytest.raises(SystemExit):
        fit.fit(model)
    assert fit.global_step == 2  # the press came in the step of batch 1, validated after it
    assert not getattr(model, "validated", False)


class PressThenFail(Callback):
    """A Ctrl-C (or ``signum``) in the step of the second batch, then an unrelated error in this
    callback's ``on_train_batch_end``, before any hook that ends the hold."""

    def __init__(self, monkeypatch, signum: int = signal.SIGINT) -> None:
        self.monkeypatch, self.signum = monkeypatch, signum
        self.failed = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 1 and not self.failed:
            signal_on_call(self.monkeypatch, adamw_module, "adamw_update", {2}, self.signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2 and not self.failed:
            self.failed = True
            raise RuntimeError("unrelated failure")


@pytest.mark.parametrize(
    "model", [ValidatedWithoutEndHook, ValidatedWithoutMixin], ids=["mixin", "monitor-only"]
)
def test_a_press_held_in_a_fit_that_failed_does_not_stop_the_next_run(tmp_path, monkeypatch, model):
    """Lightning's path for an exception other than Ctrl-C runs no hook that ends the hold (it
    gives SIGINT back itself). The press was for the failed fit: the next ``validate`` or
    ``fit`` of the same trainer must run, not stop at once."""
    model = model(force_staging=True)
    monitor = [OffloadMonitor(summary=False)] if isinstance(model, WithoutMixin) else []
    fit = trainer(tmp_path, callbacks=[PressThenFail(monkeypatch), *monitor])
    with pytest.raises(RuntimeError, match="unrelated failure"):
        fit.fit(model)
    monkeypatch.undo()
    assert fit.global_step == 2  # the press was held in the second step
    fit.validate(model, verbose=False)
    assert model.validated
    fit.fit(model)  # the rest of the steps
    assert fit.global_step == 6
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("model", [TinyModel, WithoutMixin], ids=["mixin", "monitor-only"])
def test_a_notice_held_in_a_fit_that_failed_is_delivered_and_the_trainer_freed(
    tmp_path, monkeypatch, model
):
    """The fit fails after the batch's step, before the hooks that end the hold: the notice
    reaches its handler as the failure is handled (it may still save, or requeue the job), the
    next ``fit`` of the trainer holds a notice of its own to that batch's end again, and a
    failed fit's hold does not keep its trainer (and the model and state with it) alive."""
    delivered = []
    signal.signal(SIGUSR1, lambda number, frame: delivered.append(fit.global_step))
    module = model(force_staging=True)
    monitor = [OffloadMonitor(summary=False)] if model is WithoutMixin else []
    fit = trainer(tmp_path, callbacks=[PressThenFail(monkeypatch, SIGUSR1), *monitor])
    with pytest.raises(RuntimeError, match="unrelated failure"):
        fit.fit(module)
    monkeypatch.undo()
    assert delivered == [2]
    fit.callbacks.append(CtrlC(monkeypatch, 3, "step", signum=SIGUSR1))
    fit.fit(module)
    assert delivered == [2, 4]  # the fourth step counted
    monkeypatch.undo()
    freed = failed_fit(tmp_path / "failed", PressThenFail(monkeypatch), model)
    monkeypatch.undo()
    gc.collect()
    assert freed() is None


def failed_fit(root, callback: Callback, model) -> weakref.ref:
    """A fit of ``model`` (with a monitor where it has no mixin) that ``callback`` makes fail;
    its trainer, weakly. Nothing else here may keep it: ``pytest.raises`` would keep the
    traceback's frames, and Lightning gives the callbacks the module's ``log``."""
    monitor = [OffloadMonitor(summary=False)] if model is WithoutMixin else []
    failed = trainer(root, callbacks=[callback, *monitor])
    try:
        failed.fit(model(force_staging=True))
    except RuntimeError as error:
        assert "unrelated failure" in str(error)
    return weakref.ref(failed)


class FaultInStep(Callback):
    """A fault partway through the update of the third step: the optimizer then refuses to be
    saved, so ``OnExceptionCheckpoint`` raises in Lightning's exception handling, which then
    skips its restore of the signal handlers."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch = monkeypatch

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 2:
            fail_on_call(self.monkeypatch, adamw_module, "adamw_update", 2, RuntimeError("fault"))


def test_no_ctrl_c_is_swallowed_after_a_fit_that_failed_in_its_exception_handling(
    tmp_path, monkeypatch
):
    handler = signal.getsignal(signal.SIGINT)
    callbacks = [FaultInStep(monkeypatch), OnExceptionCheckpoint(tmp_path / "ckpt")]
    fit = trainer(tmp_path, callbacks=callbacks, enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="failed partway through its update"):
        fit.fit(TinyModel(force_staging=True))
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt):  # the first press, at once
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_fitted_module_does_not_carry_the_sigint_handler(tmp_path):
    """Copies of the module (``AveragedModel``, ``ddp_spawn``, ``torch.save``) would carry the
    process's handler, which need not be picklable."""
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    model = TinyModel(force_staging=True)
    trainer(tmp_path).fit(model)
    pickle.loads(pickle.dumps(model))


class RecordsHoldsInSteps(TinyModel):
    """Records, in each optimizer's step, whether a Ctrl-C hold is on."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        self.held: list[bool] = []
        # A post-hook: Lightning runs the closure (and on_before_optimizer_step) inside step().
        optimizer.register_step_post_hook(
            lambda *_: self.held.append(interrupts.SigintHold.current() is not None)
        )
        return optimizer


def test_no_ctrl_c_is_held_for_a_torch_optimizer(tmp_path):
    """Only OffloadAdamW's steps hold Ctrl-C to the batch's end; a torch optimizer returned by a
    module with the mixin, under the monitor, is interrupted where torch alone would be."""
    model = RecordsHoldsInSteps(optimizer="torch")
    trainer(tmp_path, max_steps=3, callbacks=[OffloadMonitor(summary=False)]).fit(model)
    assert model.held == [False, False, False]

    offload = RecordsHoldsInSteps()
    trainer(tmp_path / "offload", max_steps=3).fit(offload)
    assert offload.held == [True, True, True]  # the check above can see a hold


class ZeroRecordsHolds(RecordsHoldsInSteps):
    """A ``ZeroRedundancyOptimizer`` of OffloadAdamW: its inner step records the hold."""

    def configure_optimizers(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(self.parameters(), OffloadAdamW, lr=0.01)
        self.held: list[bool] = []
        zero.optim.register_step_post_hook(
            lambda *_: self.held.append(interrupts.SigintHold.current() is not None)
        )
        return zero


@pytest.mark.parametrize("monitored", [False, True], ids=["mixin", "monitor"])
def test_ctrl_c_is_held_for_an_offload_adamw_inside_a_zero_redundancy_optimizer(
    tmp_path, monitored
):
    """``ZeroRedundancyOptimizer(optimizer_class=OffloadAdamW)`` steps an OffloadAdamW: its
    steps hold Ctrl-C to the batch's end too (the hold looked at the wrapper only)."""
    import torch.distributed as dist

    model = ZeroRecordsHolds()
    callbacks = [OffloadMonitor(summary=False)] if monitored else []
    rendezvous = f"file://{tmp_path / 'pg'}"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=rendezvous)
    try:
        trainer(tmp_path, max_steps=3, callbacks=callbacks).fit(model)
    finally:
        dist.destroy_process_group()
    assert model.held == [True, True, True]


@pytest.mark.parametrize("signum", NOTICES, ids=lambda n: signal.Signals(n).name)
def test_a_notice_handler_saving_during_the_update_saves_the_whole_step(monkeypatch, signum):
    """A scheduler's requeue or preemption notice arriving between two chunks: its handler
    (Lightning's SLURM auto-requeue handler saves a checkpoint from inside it) runs once, when
    the update ends, and saves the whole step, as torch's fused AdamW (one kernel call) always
    leaves it; run between the chunks, it saved the new step counts beside old moments."""
    params = make_params()
    reference = clone_params(params)
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(0)
    step_together([opt, torch_opt], [params, reference], generator, 1)
    saved = []

    def save(number, frame):
        saved.append((number, copy.deepcopy(opt.state_dict()), clone_params(params)))

    signal.signal(signum, save)
    calls = signal_on_call(monkeypatch, adamw_module, "adamw_update", {2}, signum)
    step_together([opt, torch_opt], [params, reference], generator, 1)
    assert len(calls) > 2  # the notice came between chunks
    assert signal.getsignal(signum) is save
    assert [number for number, *_ in saved] == [signum]
    _, state, weights = saved[0]
    assert_same(weights, reference)
    for index, entry in torch_opt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state["state"][index][key], entry[key]), (index, key)


@pytest.mark.no_stream_check  # the checker's dispatch mode is the main thread's only
def test_a_notice_handler_waiting_for_a_thread_that_saves_optimizers_of_one_pool(monkeypatch):
    """A preemptible job's SIGTERM handler saves the optimizers' state in a worker thread and
    waits for it. Held during a step, it runs once the step has let go of its staging pool's
    lock, which the worker's ``state_dict()`` of an optimizer of the pool needs: run inside
    the step, worker and handler waited for each other."""
    pool = StagingPool()
    models = [torch.nn.Linear(8, 8) for _ in range(2)]
    optimizers = [
        OffloadAdamW(m.parameters(), force_staging=True, staging_pool=pool) for m in models
    ]
    saved = []

    def save_in_a_worker(signum, frame):
        worker = threading.Thread(target=lambda: saved.append([o.state_dict() for o in optimizers]))
        worker.start()
        worker.join(timeout=5)
        assert saved, "the worker waited for the step holding the pool"

    signal.signal(signal.SIGTERM, save_in_a_worker)
    calls = signal_on_call(monkeypatch, adamw_module, "adamw_update", {1}, signal.SIGTERM)
    for model in models:
        model(torch.ones(2, 8)).sum().backward()
    optimizers[0].step()
    assert calls and len(saved) == 1
    assert saved[0][0]["state"][0]["step"] == 1


def test_a_notice_during_a_load_sees_the_loaded_state_whole(monkeypatch):
    params, opt, generator, saved = staged_after_two_steps()
    step_together([opt], [params], generator, 1)  # the state now differs from ``saved``
    seen = []
    signal.signal(signal.SIGUSR1, lambda n, f: seen.append(copy.deepcopy(opt.state_dict())))
    calls = signal_on_call(monkeypatch, torch.Tensor, "copy_", {2}, signal.SIGUSR1)
    opt.load_state_dict(saved)
    assert len(calls) > 2
    assert len(seen) == 1
    for index, entry in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(seen[0]["state"][index][key], entry[key]), (index, key)


def recorders(received: list) -> None:
    """Each notice signal's handler appends what it receives to ``received``."""
    for signum in NOTICES:
        signal.signal(signum, lambda number, frame: received.append(number))


def test_notices_reach_their_handlers_once_each_in_order_after_the_outer_update():
    received = []
    recorders(received)
    with signals_held():
        with signals_held():  # nested: the outer block holds
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGTERM)  # pending already: once, as the system keeps it
        assert received == []
    assert received == [signal.SIGTERM, signal.SIGUSR1]  # as they came, not by number


def test_notices_are_given_back_and_delivered_after_a_failed_update_each_despite_the_others():
    """An update that raises still gives the signals back and delivers what it held; a handler
    that raises (a SIGTERM handler ending the process after saving) does not stop the rest."""
    received = []
    recorders(received)
    exiting = lambda number, frame: sys.exit(3)  # noqa: E731
    signal.signal(signal.SIGTERM, exiting)
    with pytest.raises(SystemExit), signals_held():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGUSR1)
        raise RuntimeError("the update failed")
    assert received == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGTERM) is exiting
    signal.raise_signal(signal.SIGUSR1)
    assert received == [signal.SIGUSR1] * 2  # at once: nothing holds it any more


def test_a_notice_runs_before_a_held_ctrl_c_and_an_insisting_press_stops_its_handler(
    monkeypatch,
):
    """The notice's handler (a checkpoint save) runs once the update ended, with its signal
    given back, before the Ctrl-C held during the update is raised; a second press inside that
    handler is raised there, as the update it waited for is over."""
    monkeypatch.setattr(interrupts, "SAME_PRESS_SECONDS", 0.0)
    seen = []

    def saving(number, frame):
        seen.append(signal.getsignal(number) is saving)
        signal.raise_signal(signal.SIGINT)  # the user insists
        seen.append("saved")

    signal.signal(signal.SIGUSR1, saving)
    with pytest.raises(KeyboardInterrupt), signals_held():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGUSR1)
    assert seen == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_notice_handler_installed_during_an_update_takes_its_signal_at_once():
    """Nothing is held for, or given back to, a handler that another took over meanwhile; a
    signal left to its default action (ending the process) or ignored is not taken over."""
    first, second = [], []
    signal.signal(signal.SIGUSR1, lambda number, frame: first.append(number))
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    replacement = lambda number, frame: second.append(number)  # noqa: E731
    with signals_held():
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        signal.raise_signal(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, replacement)
        signal.raise_signal(signal.SIGUSR1)
        assert second == [signal.SIGUSR1]
    assert first == [] and second == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is replacement


@pytest.mark.parametrize("how", ["installed again", "called by a wrapper", "owner stopped"])
def test_a_notice_hold_that_ended_or_whose_owner_stopped_passes_signals_on(how):
    """Something that saved the hold's handler and restores it after the hold ended (as
    Lightning restores the handlers it saved), or a handler that took it over and calls it (as
    Lightning composes the handlers it finds: a tuner's trial that failed mid-batch), does not
    swallow the signal for good; nor does a hold whose fit stopped without ending it."""
    received = []
    recorders(received)
    running = [True]
    hold = interrupts.NoticeHold(alive=lambda: running[0])
    hold.start()
    saved = signal.getsignal(SIGUSR1)
    if how == "installed again":
        hold.end()
        signal.signal(SIGUSR1, saved)
    elif how == "called by a wrapper":
        signal.signal(SIGUSR1, lambda number, frame: saved(number, frame))
        hold.end()
    else:
        running[0] = False
    signal.raise_signal(SIGUSR1)
    assert received == [SIGUSR1]
    if how != "called by a wrapper":
        assert signal.getsignal(SIGUSR1) is not saved  # the recorder, given back
    signal.raise_signal(SIGUSR1)
    assert received == [SIGUSR1] * 2


def test_notices_are_delivered_before_a_held_ctrl_c_at_an_update_and_at_a_batch_end():
    """A handler of a notice saves a checkpoint: it runs before a held Ctrl-C is raised (which
    ends the run), after an update and at the end of a Lightning batch alike."""
    order = []
    signal.signal(signal.SIGINT, lambda number, frame: order.append("Ctrl-C"))
    signal.signal(SIGUSR1, lambda number, frame: order.append("notice"))
    with signals_held():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(SIGUSR1)
    assert order == ["notice", "Ctrl-C"]

    class Running:  # what the batch's hold asks of a trainer
        state = types.SimpleNamespace(status=TrainerStatus.RUNNING)

    running = Running()
    hold_signals_until_batch_end(running, OffloadAdamW(make_params()))
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(SIGUSR1)
    assert order == ["notice", "Ctrl-C"]
    deliver_held_signals(running)
    assert order == ["notice", "Ctrl-C"] * 2


@pytest.mark.parametrize(
    ("model", "torch_at"),
    [
        (TinyModel, "batch end"),
        (TwoStepsPerBatch, "batch end"),
        (WithoutMixin, "next batch start"),
    ],
    ids=["mixin", "two-steps-per-batch", "monitor-without-mixin"],
)
def test_slurm_auto_requeue_during_a_step_saves_and_resumes_as_torch_adamw(
    monkeypatch, tmp_path, model, torch_at
):
    """Lightning's SLURM auto-requeue handler saves the checkpoint the requeued job resumes
    from, from inside SIGUSR1's handler. With the notice between two chunks of the third
    batch's first step, the handler runs after Lightning counted the batch's steps (at its end;
    with the monitor alone, at the next batch's start): the checkpoint equals, loops included,
    torch AdamW's for a notice there, and resumes the same. Run between the chunks, it saved
    the new step counts beside old moments; at the step's end, a step its counters do not
    count."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    slurm = {"NTASKS": "1", "JOB_ID": "7", "JOB_NAME": "train", "PROCID": "0", "LOCALID": "0"}
    for name, value in {**slurm, "NODEID": "0"}.items():
        monkeypatch.setenv(f"SLURM_{name}", value)
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: the requeue itself fails, logged
    at = 2 * steps_per_batch(model)
    runs = {
        "offload": (model, {"force_staging": True}, "step"),
        "torch": (TinyModel if model is WithoutMixin else model, {"optimizer": "torch"}, torch_at),
    }
    saved, resumed = {}, {}
    for name, (module, kwargs, where) in runs.items():
        root = tmp_path / name
        monitor = [OffloadMonitor(summary=False)] if module is WithoutMixin else []
        with pytest.MonkeyPatch.context() as patch:
            notice = CtrlC(patch, at, where, signum=SIGUSR1)
            steps = 4 * steps_per_batch(model)
            slurm = [SLURMEnvironment()]
            fit = trainer(root, max_steps=steps, plugins=slurm, callbacks=[notice, *monitor])
            fit.fit(module(**kwargs))
        assert notice.sent
        saved[name] = torch.load(root / "hpc_ckpt_1.ckpt", weights_only=False)
        resumed[name] = module(**kwargs)
        resume = trainer(root / "resumed", max_steps=6 * steps_per_batch(model), callbacks=monitor)
        resume.fit(resumed[name], ckpt_path=root / "hpc_ckpt_1.ckpt")
    assert saved["offload"]["global_step"] == at + steps_per_batch(model)
    assert_same_checkpoint(saved["offload"], saved["torch"])
    assert_same(list(resumed["offload"].parameters()), list(resumed["torch"].parameters()))
