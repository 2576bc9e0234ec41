"""The mixin's learning-rate schedule: linear warm-up, then cosine decay (or constant).

A step-wise :class:`~torch.optim.lr_scheduler.LRScheduler` that keeps working when training
changes under it: param groups added mid-training (``BaseFinetuning`` unfreezing a backbone),
learning rates set by hand between steps (``BackboneFinetuning``), and a resumed run whose
Trainer plans more (or fewer) steps than the run that wrote the checkpoint.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_offload_optim.validation import is_int, is_number

#: Param groups that share a value under this key take a hand-set learning rate together (the
#: decayed and non-decayed halves the mixin splits an added group into).
LINKED_GROUP_KEY = "lr_link"
_SHAPE = ("warmup_steps", "total_steps", "min_lr_ratio")


def set_by_hand(group: dict[str, Any], written: float) -> bool:
    """Whether ``group``'s lr is no longer the ``written`` one. A tensor lr holds what was
    written rounded to its dtype (a float32 tensor cannot hold most float lrs exactly)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        written = float(torch.as_tensor(written, dtype=lr.dtype))
    return float(lr) != written


def write_lr(group: dict[str, Any], lr: float) -> None:
    """Set ``group``'s lr as torch's schedulers do: into a tensor lr, which stays a tensor."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def link_hand_set_lrs(groups: Sequence[dict[str, Any]], previous: Sequence[float]) -> None:
    """Give an lr set by hand on a linked group to the groups linked to it.

    A group's lr is set by hand when it differs from ``previous`` (the lr each group had; groups
    added since have none). A link whose groups were set to different values is left alone.
    """
    hand_set: dict[Any, set[float]] = {}
    for group, lr in zip(groups, previous, strict=False):
        if LINKED_GROUP_KEY in group and set_by_hand(group, lr):
            hand_set.setdefault(group[LINKED_GROUP_KEY], set()).add(float(group["lr"]))
    for group in groups:
        values = hand_set.get(group[LINKED_GROUP_KEY], ()) if LINKED_GROUP_KEY in group else ()
        if len(values) == 1:
            write_lr(group, next(iter(values)))


def check_schedule(warmup_steps: Any, total_steps: Any, min_lr_ratio: Any) -> None:
    """Refuse a schedule shape :class:`WarmupCosineLR` cannot follow (``2.5`` warm-up steps
    too: it is not rounded); warn where the warm-up outlasts the schedule."""
    if not is_int(warmup_steps) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if total_steps is not None and (not is_int(total_steps) or total_steps < 1):
        raise ValueError(f"total_steps must be an int >= 1 or None, got {total_steps!r}")
    if not is_number(min_lr_ratio) or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be a number in [0, 1], got {min_lr_ratio!r}")
    if total_steps is not None and warmup_steps > total_steps:
        rank_zero_warn(
            f"warmup_steps={warmup_steps} is more than the schedule's {total_steps} steps: the "
            "learning rate never reaches its peak"
        )


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """Multiply each group's base lr by :meth:`factor` of the step.

    The factor rises linearly over ``warmup_steps`` (``(step + 1) / warmup_steps``, so the first
    step already trains), then falls along a half cosine from 1 at step ``warmup_steps`` to
    ``min_lr_ratio`` at step ``total_steps`` and stays there; with ``total_steps=None`` it
    stays 1 after the warm-up. Steps count optimizer steps from 0.

    - A group added after the scheduler was made follows the schedule from where it is: its base
      lr is its lr when first seen divided by the factor then in effect.
    - :meth:`follow_length` sizes the decay again before the first step, and
      :meth:`take_set_lrs_as_peaks` takes learning rates set by hand before the first step as
      the groups' base (peak) lrs: the mixin calls it as training starts, after Lightning's
      ``LearningRateFinder`` wrote its suggestion into every group (and into ``hparams.lr``,
      the mixin's peak lr).
    - A learning rate set by hand between steps is kept and scheduled from there the same way
      (and given to the groups linked to it by :data:`LINKED_GROUP_KEY`).
    - ``load_state_dict`` restores the progress and base lrs, but keeps this scheduler's shape:
      a resumed run follows the Trainer's current length, with a warning when it changed.

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> schedule = WarmupCosineLR(opt, warmup_steps=2, total_steps=6)
        >>> lrs = [opt.param_groups[0]["lr"]]
        >>> for _ in range(6):
        ...     opt.step()
        ...     schedule.step()
        ...     lrs.append(round(opt.param_groups[0]["lr"], 3))
        >>> lrs
        [0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int | None,
        min_lr_ratio: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        check_schedule(warmup_steps, total_steps, min_lr_ratio)
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self._written: list[float] = []  # the lr this scheduler last gave each group
        super().__init__(optimizer, last_epoch)
        # A hand-set lr reaches the linked groups before the step that uses it, not after.
        schedule = weakref.ref(self)  # the optimizer must not keep the scheduler alive

        def link_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if (live := schedule()) is not None:
                link_hand_set_lrs(optimizer.param_groups, live._written)

        optimizer.register_step_pre_hook(link_before_step)

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine

    def get_lr(self) -> list[float]:
        groups = self.optimizer.param_groups
        in_effect = self.factor(self.last_epoch - 1) if self.last_epoch > 0 else 1.0
        link_hand_set_lrs(groups, self._written)  # if not done before the step
        for i, group in enumerate(groups):
            added = i >= len(self.base_lrs)
            edited = i < len(self._written) and set_by_hand(group, self._written[i])
            if added:
                self.base_lrs.append(float(group["lr"]))
            if added or edited:
                self._rebase(i, float(group["lr"]), in_effect)
        self._written = [base * self.factor(self.last_epoch) for base in self.base_lrs]
        return list(self._written)

    def follow_length(self, total_steps: int) -> None:
        """Before the first step, decay over ``total_steps`` instead: the Trainer's length
        changed since this scheduler was made (``BatchSizeFinder`` scaled the batch size in
        its ``on_fit_start``, after ``configure_optimizers``). The first step's factor does
        not depend on the length."""
        if self.last_epoch != 0 or self.total_steps is None:
            return
        check_schedule(self.warmup_steps, total_steps, self.min_lr_ratio)
        self.total_steps = total_steps

    def take_set_lrs_as_peaks(self) -> None:
        """Before the first step, take each lr set by hand since this scheduler wrote it as the
        group's base (peak) lr, so that the first step uses the schedule's first factor of it;
        after it, such an lr is the current one (see the class). Only call it where nothing
        else drives the lrs (an LR finder's own run writes its own)."""
        if self.last_epoch != 0:
            return
        link_hand_set_lrs(self.optimizer.param_groups, self._written)
        for i, group in enumerate(self.optimizer.param_groups[: len(self._written)]):
            if set_by_hand(group, self._written[i]):
                self._rebase(i, float(group["lr"]), 1.0)
                self._written[i] = self.base_lrs[i] * self.factor(0)
                write_lr(group, self._written[i])
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]

    def _rebase(self, index: int, lr: float, in_effect: float) -> None:
        """Schedule group ``index`` from ``lr``, set while ``in_effect`` was the factor."""
        base = lr / in_effect if in_effect > 0 else lr
        self.base_lrs[index] = base
        self.optimizer.param_groups[index]["initial_lr"] = base

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore progress and base lrs; keep this scheduler's shape (the current run's)."""
        state = dict(state_dict)
        saved = {name: state.pop(name) for name in _SHAPE if name in state}
        legacy = state.pop("lr_lambdas", None)  # written by LambdaLR(WarmupCosine) in 0.1
        if legacy and isinstance(legacy[0], dict) and "total" in legacy[0]:
            saved = {
                "warmup_steps": legacy[0].get("warmup"),
                "total_steps": legacy[0].get("total"),
                "min_lr_ratio": legacy[0].get("min_ratio"),
            }
        super().load_state_dict(state)
        groups = self.optimizer.param_groups
        if "_written" not in state:
            self._written = [float(g["lr"]) for g in groups]
        current = {name: getattr(self, name) for name in _SHAPE}
        if saved and saved != current:
            rank_zero_warn(
                f"WarmupCosineLR: the checkpoint's schedule was {saved}, this run's is {current} "
                "(the Trainer's max_steps or max_epochs changed); the learning rate now follows "
                "this run's schedule from the restored step."
            )
            self._written = [base * self.factor(self.last_epoch) for base in self.base_lrs]
            for group, lr in zip(groups, self._written, strict=False):
                write_lr(group, lr)
            self._last_lr = [float(g["lr"]) for g in groups]  # not the live tensors
