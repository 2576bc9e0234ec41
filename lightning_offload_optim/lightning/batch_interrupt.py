"""Ctrl-C during a training batch's optimizer steps is raised at the batch's end.

Raised from ``step()`` (where the optimizer alone would hold it, :mod:`..interrupts`), it would
come before Lightning counts the step: a checkpoint saved on it (``OnExceptionCheckpoint``)
would hold the step's update with loop counters that do not, and resuming would train the
batch twice; in manual optimization a later step of the same batch would be lost. Held from the
batch's first :class:`OffloadAdamW` step to after the batch's end hooks, it comes where a
Ctrl-C with torch's AdamW could, and the checkpoint resumes the same. The mixin and the monitor
both hold it (a module without the mixin still gets it from the monitor); one hold per trainer.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_offload_optim.interrupts import SigintHold
from lightning_offload_optim.lightning.optimizers import offload_adamw

#: Each trainer's hold, kept off the module and the callback: copies of either (``torch.save``,
#: ``AveragedModel``, ``ddp_spawn``) would otherwise carry the process's SIGINT handler.
_HOLDS: weakref.WeakKeyDictionary[pl.Trainer, SigintHold] = weakref.WeakKeyDictionary()


def hold_ctrl_c_until_batch_end(
    trainer: pl.Trainer | None, optimizer: torch.optim.Optimizer
) -> None:
    """From ``on_before_optimizer_step``: hold SIGINT from the batch's first OffloadAdamW step
    (a later step of the batch finds it held already)."""
    if trainer is None or offload_adamw(optimizer) is None:
        return
    if threading.current_thread() is not threading.main_thread():
        return  # signals reach the main thread only (and a stale hold is ended only there)
    if SigintHold.current() is None:
        _HOLDS[trainer] = hold = SigintHold(_fitting(trainer))
        hold.start()


def raise_held_ctrl_c(trainer: pl.Trainer | None) -> None:
    """End the trainer's hold, raising a Ctrl-C held since the batch's first step."""
    hold = _HOLDS.pop(trainer, None) if trainer is not None else None
    if hold is not None:
        hold.end()


def drop_stale_ctrl_c_hold(trainer: pl.Trainer | None) -> None:
    """A run of ``trainer`` starts: end a hold left by an earlier run without delivering its
    press. Lightning's path for an exception other than Ctrl-C runs none of the hooks that end
    a hold (nor ``teardown``), and the run the press was for is over; delivered later, it
    would stop the next ``fit`` or ``validate`` at once."""
    hold = _HOLDS.pop(trainer, None) if trainer is not None else None
    if hold is not None:
        hold.end(deliver=False)


def _fitting(trainer: pl.Trainer) -> Callable[[], bool]:
    """Whether ``trainer`` still runs (an exception ends it without the batch's end hooks)."""
    running = weakref.ref(trainer)
    return lambda: (t := running()) is not None and t.state.status == TrainerStatus.RUNNING
