"""Ctrl-C, and a scheduler's notice, during a training batch's optimizer steps wait for the
batch's end.

Raised from ``step()`` (where the optimizer alone would hold it, :mod:`..interrupts`), it would
come before Lightning counts the step: a checkpoint saved on it (``OnExceptionCheckpoint``)
would hold the step's update with loop counters that do not, and resuming would train the
batch twice; in manual optimization a later step of the same batch would be lost. Held from the
batch's first :class:`OffloadAdamW` step to after the batch's end hooks, it comes where a
Ctrl-C with torch's AdamW could, and the checkpoint resumes the same. The mixin and the monitor
both hold it (a module without the mixin still gets it from the monitor); one hold per trainer.
The same goes for the notices of :data:`..interrupts.NOTICE_SIGNALS` (Lightning's SLURM
auto-requeue handler saves the checkpoint the requeued job resumes from inside SIGUSR1's
handler): their handlers run at the batch's end, after Lightning counted the steps.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_offload_optim.interrupts import NoticeHold, SigintHold
from lightning_offload_optim.lightning.optimizers import offload_adamw

#: Each trainer's hold, kept off the module and the callback: copies of either (``torch.save``,
#: ``AveragedModel``, ``ddp_spawn``) would otherwise carry the process's SIGINT handler.
_HOLDS: weakref.WeakKeyDictionary[pl.Trainer, SigintHold] = weakref.WeakKeyDictionary()
_NOTICE_HOLDS: weakref.WeakKeyDictionary[pl.Trainer, NoticeHold] = weakref.WeakKeyDictionary()


def hold_signals_until_batch_end(
    trainer: pl.Trainer | None, optimizer: torch.optim.Optimizer
) -> None:
    """From ``on_before_optimizer_step``: hold SIGINT and the notices from the batch's first
    OffloadAdamW step (a later step of the batch finds them held already)."""
    if trainer is None or offload_adamw(optimizer) is None:
        return
    if threading.current_thread() is not threading.main_thread():
        return  # signals reach the main thread only (and a stale hold is ended only there)
    if SigintHold.current() is None:
        _HOLDS[trainer] = hold = SigintHold(_fitting(trainer))
        hold.start()
    if trainer not in _NOTICE_HOLDS:
        _NOTICE_HOLDS[trainer] = notices = NoticeHold(_fitting(trainer))
        notices.start()


def deliver_held_signals(trainer: pl.Trainer | None) -> None:
    """End the trainer's holds: call the handlers of notices held since the batch's first
    step, then raise a Ctrl-C held since then."""
    try:
        deliver_held_notices(trainer)
    finally:
        hold = _HOLDS.pop(trainer, None) if trainer is not None else None
        if hold is not None:
            hold.end()


def deliver_held_notices(trainer: pl.Trainer | None) -> None:
    """A run of ``trainer`` raised (``on_exception``, before Lightning gives back the handlers
    it saved): deliver the notices held since the batch's first step now. Their handlers may
    save or requeue still, and the hold, which refers to Lightning's handlers and through them
    to the trainer, must not outlive the run."""
    notices = _NOTICE_HOLDS.pop(trainer, None) if trainer is not None else None
    if notices is not None:
        notices.end()


def drop_stale_holds(trainer: pl.Trainer | None) -> None:
    """A run of ``trainer`` starts: end the holds left by an earlier run without delivering
    what they hold. Lightning's path for an exception other than Ctrl-C runs none of the hooks
    that end a hold (nor ``teardown``), and the run the press or notice was for is over;
    delivered later, a press would stop the next ``fit`` or ``validate`` at once."""
    if trainer is None:
        return
    for hold in (_NOTICE_HOLDS.pop(trainer, None), _HOLDS.pop(trainer, None)):
        if hold is not None:
            hold.end(deliver=False)


def _fitting(trainer: pl.Trainer) -> Callable[[], bool]:
    """Whether ``trainer`` still runs (an exception ends it without the batch's end hooks)."""
    running = weakref.ref(trainer)
    return lambda: (t := running()) is not None and t.state.status == TrainerStatus.RUNNING
