"""OffloadOptimizerMixin: ``configure_optimizers`` with OffloadAdamW, from ``self.hparams``."""

from __future__ import annotations

import functools
import inspect
import math
import re
import sys
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_offload_optim.adamw import OffloadAdamW
from lightning_offload_optim.lightning.batch_interrupt import (
    deliver_held_notices,
    deliver_held_signals,
    drop_stale_holds,
    hold_signals_until_batch_end,
)
from lightning_offload_optim.lightning.checkpoint import (
    CHECKPOINT_KEY,
    check_metadata,
    offload_metadata,
)
from lightning_offload_optim.lightning.hook_overrides import (
    lost_without_super,
    warn_of_overrides_without_super,
)
from lightning_offload_optim.lightning.optimizers import offload_optimizers
from lightning_offload_optim.lightning.schedule import (
    LINKED_GROUP_KEY,
    WarmupCosineLR,
    check_schedule,
    link_hand_set_lrs,
)

#: torch's normalisation modules (their weights are not decayed by default).
NORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
    torch.nn.RMSNorm,
)
#: Class names of normalisation modules outside torch.nn: LlamaRMSNorm, T5LayerNorm,
#: FusedRMSNorm, LayerNorm2d, GroupNorm32, LayerNormalization...
NORM_CLASS_NAME = re.compile(r"norm(alization)?\d*d?$", re.IGNORECASE)
#: The OffloadAdamW argument each hparam sets.
ARGUMENT_OF_HPARAM = {
    "lr": "lr",
    "learning_rate": "lr",
    "betas": "betas",
    "beta1": "betas",
    "beta2": "betas",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "amsgrad": "amsgrad",
    "offload_chunk_size": "chunk_size",
    "offload_pin_memory": "pin_memory",
    "offload_enabled": "enabled",
    "offload_resident": "resident",
}


def is_norm_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` normalises: a torch norm class, or any class named like one."""
    return isinstance(module, NORM_TYPES) or bool(NORM_CLASS_NAME.search(type(module).__name__))


def no_decay_parameters(model: torch.nn.Module) -> set[int]:
    """Ids of the parameters spared from weight decay: biases (``bias``, ``*_bias``) and norm
    weights (every parameter of a norm module, and parameters whose own name says ``norm``)."""
    spared = set()
    for module in model.modules():
        norm = is_norm_module(module)
        for name, param in module.named_parameters(recurse=False):
            if norm or name == "bias" or name.endswith("_bias") or "norm" in name.lower():
                spared.add(id(param))
    return spared


class OffloadOptimizerMixin:
    """Gives a LightningModule a ``configure_optimizers`` that returns :class:`OffloadAdamW`.

    Put it first in the bases. Hyperparameters come from ``self.hparams`` (what
    ``save_hyperparameters()`` stored, so ``LightningCLI`` and YAML set them), else the defaults:

    ========================  ============  ================================================
    hparam                    default       meaning
    ========================  ============  ================================================
    ``lr``                    1e-3          peak learning rate (``learning_rate`` also read)
    ``weight_decay``          1e-2          decoupled weight decay
    ``betas``                 (0.9, 0.999)  or ``beta1`` / ``beta2``
    ``eps``                   1e-8
    ``amsgrad``               False
    ``no_decay_norm_and_bias``  True        no weight decay for biases and norm weights,
                                            also in groups added later (BaseFinetuning)
    ``warmup_steps``          0             linear warm-up steps; > 0 turns the schedule on
    ``lr_schedule``           None          ``"cosine"``: warm-up then cosine decay over
                                            ``trainer.estimated_stepping_batches``
    ``min_lr_ratio``          0.0           final lr of the cosine, as a fraction of ``lr``
    ``offload_chunk_size``    4Mi           :class:`OffloadAdamW` ``chunk_size``
    ``offload_pin_memory``    None          :class:`OffloadAdamW` ``pin_memory``
    ``offload_enabled``       True          False gives plain ``torch.optim.AdamW`` behaviour
    ``offload_resident``      None          :class:`OffloadAdamW` ``resident``: state kept on
                                            the device (a share, bytes or ``"auto"``)
    ``overlap_step``          False         let the step overlap the next forward pass
                                            (:meth:`OffloadAdamW.overlap_with` this module,
                                            :meth:`offload_overlap_blocks` its blocks)
    ========================  ============  ================================================

    Norm weights are those of torch's norm modules, of any module whose class name ends in
    ``Norm`` (``LlamaRMSNorm``, ``T5LayerNorm``, ``LayerNorm2d``...), and parameters whose own
    name contains ``norm``. Override :meth:`offload_optimizer_args` to change groups or arguments.
    The schedule is :class:`WarmupCosineLR`, stepped every optimizer step; a resumed run follows the
    current Trainer's length. With ``overlap_step``, ``on_validation_model_eval`` waits for the
    queued updates, ``on_fit_start`` turns the overlap off where a weight-averaging callback reads
    the weights after each step, ``setup`` puts first among the trainer's callbacks one that waits
    before the others' ``on_train_epoch_end`` and ``on_train_end`` and cleans up after a fit that
    raised (``teardown`` takes it out), and ``on_train_start`` watches ``training_step`` until the
    first step; ``on_train_end`` frees what the optimizers hold on the device, and ``teardown``
    removes the overlap's hooks. Where ``on_fit_start`` finds an lr set before the first step
    (``LearningRateFinder``'s suggestion), it is the schedule's peak. A Ctrl-C from the first
    optimizer step of a batch on is raised at the end of the batch (``on_before_optimizer_step`` to
    ``on_train_batch_end``), where a scheduler's notice (SLURM's requeue signal) is delivered.
    Call ``super()`` where you override these hooks: ``configure_optimizers`` warns where an
    override the run needs does not
    (:mod:`~lightning_offload_optim.lightning.hook_overrides`).

    Example:
        >>> import lightning.pytorch as pl
        >>> class Model(OffloadOptimizerMixin, pl.LightningModule):
        ...     def __init__(self, lr: float = 3e-4, warmup_steps: int = 100):
        ...         super().__init__()
        ...         self.save_hyperparameters()
        ...         self.net = torch.nn.Linear(4, 4)
        >>> Model().offload_optimizer_args()["lr"]
        0.0003
    """

    offload_defaults: ClassVar[dict[str, Any]] = {
        "lr": 1e-3,
        "weight_decay": 1e-2,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "amsgrad": False,
        "no_decay_norm_and_bias": True,
        "warmup_steps": 0,
        "lr_schedule": None,
        "min_lr_ratio": 0.0,
        "offload_chunk_size": None,
        "offload_pin_memory": None,
        "offload_enabled": True,
        "offload_resident": None,
        "overlap_step": False,
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if pl.LightningModule in mro and mro.index(pl.LightningModule) < mro.index(
            OffloadOptimizerMixin
        ):
            raise TypeError(
                f"{cls.__name__}: put OffloadOptimizerMixin before LightningModule in the bases, "
                f"as in `class {cls.__name__}(OffloadOptimizerMixin, LightningModule)`; after it, "
                "Lightning's own configure_optimizers would shadow the mixin's."
            )
        if shadowed := _shadowed_configure_optimizers(cls):
            names = ", ".join(f"{k.__qualname__}.configure_optimizers" for k in shadowed)
            warnings.warn(
                f"{cls.__name__}: OffloadOptimizerMixin.configure_optimizers comes before "
                f"{names} in the bases, so the latter is not used (its optimizer, lr and "
                "schedulers are dropped): the mixin builds OffloadAdamW from self.hparams. To "
                f"keep parts of it, define configure_optimizers in {cls.__name__} and wrap "
                "super().configure_optimizers() (docs/quickstart.md).",
                stacklevel=_class_statement_level(),
            )

    def offload_hparam(self, name: str) -> Any:
        """``self.hparams[name]`` if saved, else the documented default (with a warning where
        ``__init__`` takes it: ``save_hyperparameters()`` was forgotten)."""
        hparams = getattr(self, "hparams", {})
        if name == "lr" and "lr" not in hparams and "learning_rate" in hparams:
            return hparams["learning_rate"]
        if name == "betas" and "betas" not in hparams and {"beta1", "beta2"} & hparams.keys():
            beta1, beta2 = self.offload_defaults["betas"]
            return (hparams.get("beta1", beta1), hparams.get("beta2", beta2))
        if name in hparams:
            return hparams[name]
        default = self.offload_defaults[name]
        argument = ARGUMENT_OF_HPARAM.get(name)
        aliases = {alias for alias, of in ARGUMENT_OF_HPARAM.items() if of == argument} | {name}
        if taken := sorted(aliases & _init_parameters(type(self))):
            warnings.warn(
                f"{type(self).__name__}.__init__ takes {', '.join(map(repr, taken))}, but "
                f"self.hparams does not hold it: OffloadOptimizerMixin uses the default "
                f"{name}={default!r}. It reads self.hparams: call self.save_hyperparameters() "
                "in __init__.",
                stacklevel=2,
            )
        return default

    def offload_param_groups(self) -> list[dict[str, Any]]:
        """Trainable parameters in two groups: decayed, and biases/norm weights without decay."""
        assert isinstance(self, torch.nn.Module)
        params = [p for p in self.parameters() if p.requires_grad]
        if not self.offload_hparam("no_decay_norm_and_bias"):
            return [{"params": params}]
        spared = no_decay_parameters(self)
        groups = [
            {"params": [p for p in params if id(p) not in spared]},
            {"params": [p for p in params if id(p) in spared], "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def offload_optimizer_args(self) -> dict[str, Any]:
        """Keyword arguments of :class:`OffloadAdamW`, ``params`` included. Override this."""
        args: dict[str, Any] = {
            "params": self.offload_param_groups(),
            "lr": self.offload_hparam("lr"),
            "betas": _as_tuple(self.offload_hparam("betas")),  # a list from YAML too, not 0.9
            "eps": self.offload_hparam("eps"),
            "weight_decay": self.offload_hparam("weight_decay"),
            "amsgrad": self.offload_hparam("amsgrad"),
            "pin_memory": self.offload_hparam("offload_pin_memory"),
            "enabled": self.offload_hparam("offload_enabled"),
        }
        if self.offload_hparam("offload_resident") is not None:
            args["resident"] = self.offload_hparam("offload_resident")
        if self.offload_hparam("offload_chunk_size") is not None:
            args["chunk_size"] = self.offload_hparam("offload_chunk_size")
        return args

    def offload_overlap_blocks(self) -> Iterable[torch.nn.Module]:
        """With ``overlap_step``: submodules that wait for all of their parameters at once
        (``blocks`` of :meth:`OffloadAdamW.overlap_with`), none by default. Return a
        transformer's layers where the module is ``torch.compile``'d: each waiting module is a
        graph break.

        Example:
            >>> class GPT(OffloadOptimizerMixin, pl.LightningModule):
            ...     def offload_overlap_blocks(self):
            ...         return self.layers
        """
        return ()

    def configure_optimizers(self) -> Any:
        """OffloadAdamW, with the warm-up/cosine schedule when the hyperparameters ask for it."""
        try:
            optimizer = OffloadAdamW(**self.offload_optimizer_args())
        except (TypeError, ValueError) as error:  # it names the argument: say which hparam
            hparams = getattr(self, "hparams", {})
            named = [
                f"{name}={hparams[name]!r} ({argument})"
                for name, argument in ARGUMENT_OF_HPARAM.items()
                if name in hparams and _names_argument(str(error), argument)
            ]
            if named:
                _add_note(
                    error,
                    "OffloadOptimizerMixin took OffloadAdamW's arguments from the hparams "
                    + ", ".join(named),
                )
            raise
        self._offload_configured = True  # whatever a strategy then wraps it in
        trainer = getattr(self, "_trainer", None)
        if optimizer.enabled:
            _refuse_deepspeed(trainer)
        # Checked before the overlap's hooks go on: an error (or a warning made one) leaves none.
        warmup = self.offload_hparam("warmup_steps")
        min_lr_ratio = self.offload_hparam("min_lr_ratio")
        check_schedule(warmup, None, min_lr_ratio)
        schedule = self.offload_hparam("lr_schedule")
        if schedule not in (None, "cosine", "constant"):
            raise ValueError(f"lr_schedule must be None, 'constant' or 'cosine', got {schedule!r}")
        scheduled = warmup > 0 or schedule == "cosine"
        total = _cosine_length(trainer) if schedule == "cosine" else None
        overlap = bool(self.offload_hparam("overlap_step")) and optimizer.enabled
        lost = lost_without_super(offloaded=optimizer.enabled, overlap=overlap, schedule=scheduled)
        warn_of_overrides_without_super(type(self), OffloadOptimizerMixin, lost)  # may be errors
        if overlap:
            assert isinstance(self, torch.nn.Module)
            optimizer.overlap_with(self, blocks=self.offload_overlap_blocks())  # until teardown
        if self.offload_hparam("no_decay_norm_and_bias"):
            assert isinstance(self, torch.nn.Module)
            split_groups_added_later(optimizer, self)
        if not scheduled:
            return optimizer
        scheduler = WarmupCosineLR(optimizer, warmup, total, min_lr_ratio)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def setup(self, stage: str) -> None:
        """Each run (``fit``, ``validate``...) starts without the holds of Ctrl-C and notices
        left by an earlier one that failed before its batch's end
        (:func:`~lightning_offload_optim.lightning.batch_interrupt.drop_stale_holds`). A
        fit puts :class:`_FitGuard` first among the trainer's callbacks, before
        ``configure_optimizers`` (the mixin's or the module's own) can put hooks on and any
        callback's ``on_fit_start`` can raise."""
        trainer = getattr(self, "_trainer", None)
        drop_stale_holds(trainer)
        if trainer is not None and stage == "fit":
            trainer.callbacks[:] = [_FitGuard(), *_without_guards(trainer.callbacks)]
        super().setup(stage)  # type: ignore[misc]

    def on_fit_start(self) -> None:
        """Turn ``overlap_step`` off, with a warning, where a callback averages the weights right
        after the steps (Lightning's ``WeightAveraging``, ``EMAWeightAveraging``,
        ``StochasticWeightAveraging``): callbacks run before this module's hooks, so it would
        read weights still being updated, and waiting for them first leaves nothing to overlap.
        Take an lr set before the first step (the LR finder's suggestion) as the schedule's
        peak."""
        trainer = getattr(self, "_trainer", None)
        averaging = _weight_averaging_callbacks(trainer.callbacks if trainer is not None else [])
        for overlap in self._offload_overlaps() if averaging else []:
            overlap.remove()
            warnings.warn(
                f"overlap_step is turned off: {type(averaging[0]).__name__} reads the "
                "weights right after each optimizer step, before the next forward pass "
                "could overlap the step.",
                stacklevel=2,
            )
        optimizers = trainer.optimizers if trainer is not None else []
        mixins_ran = getattr(self, "_offload_configured", False)
        if optimizers and not mixins_ran and not offload_optimizers(optimizers):
            owner = next(k for k in type(self).__mro__ if "configure_optimizers" in vars(k))
            rank_zero_warn(
                f"{type(self).__name__} inherits OffloadOptimizerMixin, but none of its "
                f"optimizers is an OffloadAdamW ({', '.join(type(o).__name__ for o in optimizers)}"
                f"): {owner.__qualname__}.configure_optimizers replaces the mixin's, so no "
                "optimizer state is offloaded. Remove it, or return (or wrap) "
                "super().configure_optimizers() there (docs/quickstart.md)."
            )
        for config in trainer.lr_scheduler_configs if trainer is not None else []:
            if isinstance(config.scheduler, WarmupCosineLR):  # after the tuners' callbacks
                if config.scheduler.total_steps is not None:
                    config.scheduler.follow_length(_cosine_length(trainer))
                config.scheduler.take_set_lrs_as_peaks()
        super().on_fit_start()  # type: ignore[misc]

    def on_train_start(self) -> None:
        """Watch ``training_step`` until the first step (:func:`_watch_training_step`), and
        append :class:`_FitGuard` to the run's callbacks where it is not among them: a tuner
        trains with callbacks of its own (``LearningRateFinder`` swaps its own back only when
        its run ends without an exception). Each training run starts here, a tuner's
        (``LearningRateFinder``, ``BatchSizeFinder``, which run in their ``on_fit_start``,
        before this module's) and the real one after it."""
        watched = hasattr(self.training_step, "_offload_replaced")  # a tuner's, still on
        if any(o.watching for o in self._offload_overlaps()) and not watched:
            _watch_training_step(self)
        trainer = getattr(self, "_trainer", None)
        callbacks = trainer.callbacks if trainer is not None else []
        if not any(isinstance(c, _FitGuard) for c in callbacks):  # a tuner's callbacks
            callbacks.append(_FitGuard())  # last: the LR finder reads its own at [0]
        super().on_train_start()  # type: ignore[misc]

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Hold Ctrl-C and notices from the batch's first step of an OffloadAdamW to its end
        (:mod:`~lightning_offload_optim.lightning.batch_interrupt`)."""
        super().on_before_optimizer_step(optimizer)  # type: ignore[misc]
        hold_signals_until_batch_end(getattr(self, "_trainer", None), optimizer)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Deliver a notice and raise a Ctrl-C held since the batch's first step: the counters,
        the schedulers and the callbacks' ``on_train_batch_end`` are done, as for a checkpoint
        saved there."""
        super().on_train_batch_end(outputs, batch, batch_idx)  # type: ignore[misc]
        self._end_batch_holds()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        """A hold left by an ``on_train_batch_end`` overridden without ``super()`` ends here, at
        the epoch's end, before validation or when training ends."""
        self._end_batch_holds()
        return super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    def on_train_epoch_end(self) -> None:
        self._end_batch_holds()
        super().on_train_epoch_end()  # type: ignore[misc]

    def _end_batch_holds(self) -> None:
        deliver_held_signals(getattr(self, "_trainer", None))

    def _remove_offload_overlaps(self) -> None:
        """Take the overlaps' hooks, and the ``training_step`` watch, off this module (their
        local functions do not pickle), after the queued updates."""
        for overlap in self._offload_overlaps():
            overlap.remove()
        _unwatch_training_step(self)

    def _offload_optimizers(self) -> list[OffloadAdamW]:
        trainer = getattr(self, "_trainer", None)
        optimizers = trainer.optimizers if trainer is not None else []
        return offload_optimizers(optimizers)

    def _offload_overlaps(self) -> list[Any]:
        """The forward overlaps of this trainer's OffloadAdamW optimizers that have one."""
        overlaps = [o._overlapping() for o in self._offload_optimizers()]
        return [o for o in overlaps if o is not None]

    def on_validation_model_eval(self) -> None:
        """With ``overlap_step``, order validation (whose steps may read parameters without the
        forward hooks, a root parameter say) after the last step's updates; Lightning calls
        this hook before any ``on_validation_start``, the callbacks' included."""
        self._end_batch_holds()
        self._wait_for_offload_updates()
        super().on_validation_model_eval()  # type: ignore[misc]

    def on_train_end(self) -> None:
        """Order what reads the weights after training (Lightning moves the module to the CPU
        at teardown) after the last step's updates, and free what the optimizers hold on the
        device (the Trainer keeps them, and Lightning frees only state it finds in
        ``optimizer.state``): :meth:`OffloadAdamW.release_device_memory`. A tuner's run
        (``BatchSizeFinder``) ends here too, and training goes on with the same optimizers:
        their next step allocates again."""
        self._end_batch_holds()
        for optimizer in self._offload_optimizers():
            optimizer.release_device_memory()  # waits for the queued updates first
        super().on_train_end()  # type: ignore[misc]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``to``, ``cpu``, ``half``... read every parameter: order them after the queued
        updates (Lightning moves the module to the CPU after ``fit``, also after one that
        raised, when no end hook ran)."""
        self._wait_for_offload_updates()
        return super()._apply(fn, recurse)  # type: ignore[misc]

    def _wait_for_offload_updates(self) -> None:
        for overlap in self._offload_overlaps():
            overlap.wait_all()

    def teardown(self, stage: str) -> None:
        """Remove the hooks of the trainer's optimizers' overlaps from this module, and
        :class:`_FitGuard`: a later fit makes new optimizers."""
        self._end_batch_holds()
        self._remove_offload_overlaps()
        trainer = getattr(self, "_trainer", None)
        if trainer is not None:
            trainer.callbacks[:] = _without_guards(trainer.callbacks)
        super().teardown(stage)  # type: ignore[misc]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        trainer = getattr(self, "_trainer", None)
        checkpoint[CHECKPOINT_KEY] = offload_metadata(trainer.optimizers if trainer else [])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_metadata(checkpoint)
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]


def _watch_training_step(module: OffloadOptimizerMixin) -> None:
    """Until the first step, run ``training_step`` under each overlap's watch for weights read
    before their module's forward (a penalty on a head's weight, a functional embedding lookup;
    see :class:`~lightning_offload_optim.overlap.ForwardOverlap`), which are then waited for at
    each step. The wrapper is an instance attribute, removed once no overlap watches; it wraps
    (and then gives back) the one ``trainer.fit(torch.compile(module))`` sets."""
    step = module.training_step
    replaced = vars(module).get("training_step")

    @functools.wraps(step)
    def watched(*args: Any, **kwargs: Any) -> Any:
        overlaps = [o for o in module._offload_overlaps() if o.watching]
        for overlap in overlaps:
            overlap.begin_watch()
        try:
            return step(*args, **kwargs)
        finally:
            for overlap in overlaps:
                overlap.end_watch()
            if not any(o.watching for o in module._offload_overlaps()):
                _unwatch_training_step(module)

    watched._offload_replaced = replaced  # type: ignore[attr-defined]
    module.training_step = watched  # type: ignore[method-assign]


def _unwatch_training_step(module: OffloadOptimizerMixin) -> None:
    """Give back the ``training_step`` that :func:`_watch_training_step` wrapped, if it is on."""
    watched = vars(module).get("training_step")
    if not hasattr(watched, "_offload_replaced"):
        return
    if watched._offload_replaced is None:
        del vars(module)["training_step"]
    else:
        module.training_step = watched._offload_replaced  # type: ignore[method-assign]


def _cosine_length(trainer: pl.Trainer | None) -> int:
    """The cosine's length: the Trainer's estimate of the optimizer steps it will take."""
    estimate = trainer.estimated_stepping_batches if trainer is not None else math.inf
    if not math.isfinite(estimate):
        raise ValueError(
            "lr_schedule='cosine' is sized from trainer.estimated_stepping_batches: it needs "
            "the module attached to a Trainer with max_steps or max_epochs set"
        )
    if estimate < 0 and trainer.limit_train_batches != 0:  # max_steps=-1, data of no length
        raise ValueError(
            "lr_schedule='cosine' is sized from trainer.estimated_stepping_batches, which is "
            f"{estimate}: the training data has no length (an IterableDataset); set the "
            "Trainer's max_steps"
        )
    return max(1, int(estimate))  # limit_train_batches=0, max_steps=0: no step to decay


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


def _init_parameters(cls: type) -> frozenset[str]:
    """Names ``cls.__init__`` takes. Not cached: a cache would keep every class it saw alive (a
    sweep that defines its module class per trial), for a few reads per ``fit``."""
    try:
        return frozenset(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):  # no signature to read (a C or wrapped __init__)
        return frozenset()


def _class_statement_level() -> int:
    """The ``stacklevel`` of the class statement, for a warning of the ``__init_subclass__``
    calling this: above it, any other ``__init_subclass__`` and metaclass ``__new__`` (``abc``'s,
    say)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_name in ("__new__", "__init_subclass__"):
        level, frame = level + 1, frame.f_back
    return level


def _shadowed_configure_optimizers(cls: type) -> list[type]:
    """Classes after OffloadOptimizerMixin and before LightningModule in ``cls``'s MRO whose
    ``configure_optimizers`` the mixin's hides, where no class before the mixin defines one
    (wrapping the mixin's) and no base of ``cls`` hid them already (it warned)."""
    mro = cls.__mro__
    start = mro.index(OffloadOptimizerMixin)
    if any("configure_optimizers" in vars(k) for k in mro[:start]):
        return []
    end = mro.index(pl.LightningModule) if pl.LightningModule in mro else len(mro)
    hidden = [k for k in mro[start + 1 : end] if "configure_optimizers" in vars(k)]
    for base in cls.__bases__:
        if hidden and base is not OffloadOptimizerMixin and issubclass(base, OffloadOptimizerMixin):
            said = set(_shadowed_configure_optimizers(base))
            hidden = [k for k in hidden if k not in said]
    return hidden


def _names_argument(message: str, argument: str) -> bool:
    """Whether an error is about ``argument``, in OffloadAdamW's words or torch's ("Invalid
    learning rate", "Invalid beta parameter", "Invalid epsilon value"); one about the
    parameters (an empty list) gets no note blaming the hparams."""
    words = {"lr": "lr|learning rate", "betas": "betas?", "eps": "eps|epsilon"}.get(argument)
    return re.search(rf"\b({words or argument})\b", message) is not None


def _add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; Python 3.10 has no notes (PEP 678), so there the note ends a
    one-string message."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    elif len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{note}",)


def _refuse_deepspeed(trainer: pl.Trainer | None) -> None:
    """DeepSpeed wraps the optimizer it is given in its own ZeRO engine, which manages the
    state (and offloads it, with ``offload_optimizer``) itself: the two were never checked
    together, and the engine's flat fp32 partitions replace the parameters this optimizer
    was given."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if trainer is not None and isinstance(trainer.strategy, DeepSpeedStrategy):
        raise ValueError(
            "OffloadOptimizerMixin: the Trainer's strategy is DeepSpeed, which brings its own "
            "optimizer offload (ZeRO-Offload); OffloadAdamW runs under DDP, FSDP2 "
            "(ModelParallelStrategy) or a single device. Use one of those, or set the hparam "
            "offload_enabled=False to get torch.optim.AdamW for DeepSpeed to wrap."
        )


class _FitGuard(pl.Callback):
    """Put first among the trainer's callbacks by the mixin's ``setup`` for a fit. Lightning
    calls the callbacks' ``on_train_epoch_end`` and ``on_train_end`` before the module's, and
    they may read the weights (a log of their norms, ``ModelPruning``): with ``overlap_step``
    it orders them after the last step's updates (on the device; the host does not block). And
    it cleans up after a ``fit`` that raised."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(pl_module, OffloadOptimizerMixin):
            pl_module._wait_for_offload_updates()

    on_train_end = on_train_epoch_end

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Lightning calls no ``on_train_end`` or ``teardown`` when ``fit`` raises (also in a
        callback's ``on_fit_start``, before the module's; a tuner's trial): the module would keep
        the overlaps' hooks while the Trainer lives (and not pickle), and the optimizers their
        staging buffers and resident state on the device, which the next trial of a sweep needs
        (Lightning frees only what it finds in ``optimizer.state``). Each part is tried on its
        own, and a failure is a warning: the exception that ended the fit is the one to see.
        Notices held since the batch's first step are delivered last (their handlers may save a
        checkpoint: the resident state is on the host by then)."""
        try:
            self._clean_up_after(pl_module, exception)
        finally:
            deliver_held_notices(trainer)

    @staticmethod
    def _clean_up_after(pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(pl_module, OffloadOptimizerMixin):
            return
        clean_ups = [overlap.remove for overlap in pl_module._offload_overlaps()]
        # Each optimizer writes its resident state back to the host before freeing it.
        clean_ups += [o.release_device_memory for o in pl_module._offload_optimizers()]
        failures = []
        for clean_up in clean_ups:
            try:
                clean_up()
            except Exception as error:
                failures.append(repr(error))
        _unwatch_training_step(pl_module)
        if failures:
            warnings.warn(
                f"OffloadOptimizerMixin: after the fit failed ({type(exception).__name__}), the "
                f"overlap's hooks or the optimizers' device memory could not be released: "
                f"{'; '.join(failures)}",
                stacklevel=3,
            )


def _without_guards(callbacks: list[Any]) -> list[Any]:
    return [c for c in callbacks if not isinstance(c, _FitGuard)]


def _weight_averaging_callbacks(callbacks: list[Any]) -> list[Any]:
    """Those of ``callbacks`` that read the weights right after optimizer steps."""
    import lightning.pytorch.callbacks as lightning_callbacks

    kinds = tuple(
        getattr(lightning_callbacks, name)
        for name in ("WeightAveraging", "StochasticWeightAveraging")  # the first: newer Lightning
        if hasattr(lightning_callbacks, name)
    )
    return [c for c in callbacks if isinstance(c, kinds)]


def split_groups_added_later(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Make ``optimizer.add_param_group`` spare biases and norm weights of ``model`` from weight
    decay, as the mixin's own groups do: a group added later (``BaseFinetuning`` unfreezing a
    backbone) becomes a decayed and a ``weight_decay=0`` group, linked so that an lr set by hand
    on one (``BackboneFinetuning``) reaches both; a group of spared parameters only is added
    whole at ``weight_decay=0``."""
    add = type(optimizer).add_param_group
    # Weak references: the optimizer must keep neither the model nor itself alive (a cycle
    # would leave its host buffers to the cyclic garbage collector).
    model_ref, optimizer_ref = weakref.ref(model), weakref.ref(optimizer)

    def add_param_group(param_group: dict[str, Any]) -> None:
        model, optimizer = model_ref(), optimizer_ref()
        assert optimizer is not None  # called through it
        params = param_group.get("params")
        if model is None or isinstance(params, set) or params is None:
            return add(optimizer, param_group)  # torch refuses a set
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        existing = {id(p) for g in optimizer.param_groups for p in g["params"]}
        decay = param_group.get("weight_decay", optimizer.defaults["weight_decay"])
        spared = no_decay_parameters(model)
        kept = [p for p in params if isinstance(p, torch.Tensor) and id(p) in spared]
        decayed = [p for p in params if not (isinstance(p, torch.Tensor) and id(p) in spared)]
        if decay == 0 or not kept or any(id(p) in existing for p in params):
            return add(optimizer, {**param_group, "params": params})  # refused whole, if at all
        if not decayed:  # nothing to split from: the whole group is spared
            return add(optimizer, {**param_group, "params": params, "weight_decay": 0.0})
        link = 1 + max((g.get(LINKED_GROUP_KEY, -1) for g in optimizer.param_groups), default=-1)
        add(optimizer, {**param_group, "params": decayed, LINKED_GROUP_KEY: link})
        add(optimizer, {**param_group, "params": kept, "weight_decay": 0.0, LINKED_GROUP_KEY: link})

    optimizer.add_param_group = add_param_group  # type: ignore[method-assign]

    def remember_lrs(optimizer: torch.optim.Optimizer) -> None:
        seen[:] = [float(g["lr"]) for g in optimizer.param_groups]

    seen: list[float] = []  # each group's lr at the previous step, or as created or loaded
    remember_lrs(optimizer)

    def link_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Without a schedule, only a hand-set lr changes between steps. With WarmupCosineLR,
        # whose new lrs differ from these too, its own hook (run next) links what this leaves.
        link_hand_set_lrs(optimizer.param_groups, seen)
        remember_lrs(optimizer)

    optimizer.register_step_pre_hook(link_before_step)
    optimizer.register_load_state_dict_post_hook(remember_lrs)  # a resume sets lrs anew
