"""Ctrl-C (a real SIGINT) while the optimizer updates: the update finishes, then the
``KeyboardInterrupt`` is raised, so the state is whole and can be saved, as torch's fused AdamW
(one kernel call, which Python cannot interrupt) always leaves it."""

from __future__ import annotations

import copy
import signal
import threading

import pytest
import torch
from conftest import (
    assert_same,
    clone_params,
    fail_on_call,
    make_params,
    overlapped_pair,
    step_together,
    train_alike,
)
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint
from lightning_models import TinyModel, trainer

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim import adamw as adamw_module
from lightning_offload_optim.interrupts import keyboard_interrupts_held


@pytest.fixture(autouse=True)
def default_sigint():
    """Each test starts with Python's own handler and gets it back (Lightning's shutdown
    ignores SIGINT for good)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def sigint_on_call(monkeypatch, target, name: str, numbers: set[int]) -> list[int]:
    """Send this process SIGINT inside the calls of ``target.name`` numbered ``numbers``."""
    real, calls = getattr(target, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) in numbers:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)
    return calls


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
    calls = sigint_on_call(monkeypatch, adamw_module, "adamw_update", {2})
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


def test_a_second_ctrl_c_interrupts_at_once(monkeypatch):
    """The user insists: the update stops between chunks, and the half-updated optimizer
    refuses to step or save, as after any fault partway through."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    step_together([opt], [params], torch.Generator().manual_seed(0), 1)
    calls = sigint_on_call(monkeypatch, adamw_module, "adamw_update", {2, 3})
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert len(calls) == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"failed partway through its update \(Keyboard"):
        opt.state_dict()


def test_ctrl_c_during_a_load_is_raised_after_it(monkeypatch):
    """Also after a step that failed partway: the load, whole, lifts the refusal to step."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    generator = torch.Generator().manual_seed(0)
    step_together([opt], [params], generator, 2)
    saved = copy.deepcopy(opt.state_dict())
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
    calls = sigint_on_call(monkeypatch, torch.Tensor, "copy_", {2})  # in-place writes
    with pytest.raises(KeyboardInterrupt):
        opt.load_state_dict(saved)
    assert len(calls) > 2
    monkeypatch.undo()
    step_together([opt, torch_opt], [params, reference], generator, 2)  # not refused
    assert_same(params, reference)


def test_a_held_ctrl_c_reaches_the_handler_it_was_meant_for_once():
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    with keyboard_interrupts_held():
        signal.raise_signal(signal.SIGINT)
        assert received == []
    assert received == [signal.SIGINT]
    with keyboard_interrupts_held():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the user insists: delivered at once
        assert received == [signal.SIGINT] * 2
    assert received == [signal.SIGINT] * 2


def test_nothing_is_held_where_ctrl_c_is_ignored_or_outside_the_main_thread():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with keyboard_interrupts_held():
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    errors = []

    def in_thread():
        try:
            with keyboard_interrupts_held():  # signal.signal would raise ValueError here
                pass
        except Exception as error:
            errors.append(error)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert errors == []


class CtrlCInStep(Callback):
    """Ctrl-C in the second chunk update of the optimizer step that follows ``at_step`` steps."""

    def __init__(self, monkeypatch, at_step: int) -> None:
        self.monkeypatch, self.at_step = monkeypatch, at_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.at_step:
            sigint_on_call(self.monkeypatch, adamw_module, "adamw_update", {2})


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_ctrl_c_in_a_lightning_step_saves_a_whole_checkpoint(tmp_path, monkeypatch, overlap):
    """Lightning's graceful shutdown runs ``OnExceptionCheckpoint``. Had the interrupt stopped
    the update partway, the optimizer would refuse to be saved and no checkpoint be written; it
    holds the step's weights and state, equal to torch's after as many steps."""
    model = TinyModel(force_staging=True, overlap_step=overlap)
    on_exception = OnExceptionCheckpoint(tmp_path / "ckpt", "interrupted")
    callbacks = [CtrlCInStep(monkeypatch, 2), on_exception]
    fit = trainer(tmp_path, max_steps=4, callbacks=callbacks, enable_checkpointing=True)
    with pytest.raises(SystemExit):  # Lightning exits after a KeyboardInterrupt
        fit.fit(model)
    monkeypatch.undo()
    saved = torch.load(tmp_path / "ckpt" / "interrupted.ckpt", weights_only=False)
    reference = TinyModel(optimizer="torch")
    fit = trainer(tmp_path / "reference", max_steps=3)  # the interrupted step was completed
    fit.fit(reference)
    for name, value in reference.state_dict().items():
        assert torch.equal(saved["state_dict"][name], value), name
    expected = fit.optimizers[0].state_dict()["state"]
    state = saved["optimizer_states"][0]["state"]
    for index, entry in expected.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[index][key].float(), entry[key].float()), (index, key)
