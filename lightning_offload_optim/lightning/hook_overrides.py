"""A warning for each of the mixin's hooks that the user's module overrides without calling
``super()``, where the settings of the run need what that hook does.

Most of Lightning's own hooks do nothing, so overriding one without ``super()`` is the habit;
some of the mixin's order the overlapped step or free device memory. The check reads the
override's bytecode and takes it to call up where it names ``super`` or the hook itself, in
its body or in a function defined inside it: ``OffloadOptimizerMixin.on_fit_start(self)``
does, and so, wrongly, do ``LightningModule.on_fit_start(self)`` and
``self.child.on_fit_start()``; one that calls up only through a helper of another name is
warned about. An override under a decorator that does not ``functools.wraps`` it is not checked.
Hooks whose loss is small are not checked: the Ctrl-C hold (which later hooks end as well),
the checkpoint's metadata, ``teardown``'s
removal of the overlap's hooks (an optimizer's go with it).
"""

from __future__ import annotations

import inspect
import types
import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_only


def lost_without_super(*, offloaded: bool, overlap: bool, schedule: bool) -> dict[str, str]:
    """By hook, what a run with these settings loses where an override does not call up."""
    lost = {}
    if overlap:
        lost["on_fit_start"] = (
            "a weight-averaging callback does not turn the overlap off: it reads weights still "
            "being updated"
        )
        lost["on_train_start"] = (
            "weights that training_step reads before their module's forward (a penalty on a "
            "head's weight) are not found, and race with the updates"
        )
        lost["on_validation_model_eval"] = "validation is not ordered after the last step's updates"
    if schedule:
        peak = "an lr set before the first step (the LR finder's) is not the schedule's peak"
        lost["on_fit_start"] = f"{lost['on_fit_start']}; {peak}" if overlap else peak
    if offloaded:
        lost["on_train_end"] = "what the optimizers hold on the device is not freed after fit"
        if overlap:
            lost["setup"] = (
                "the callbacks' on_train_epoch_end and on_train_end (ModelCheckpoint's included) "
                "are not ordered after the last step's updates: they read weights still being "
                "updated; and the overlap's hooks stay on the module after a fit that raised "
                "before training started (in a callback's on_fit_start)"
            )
    return lost


@rank_zero_only
def warn_of_overrides_without_super(cls: type, mixin: type, lost: dict[str, str]) -> None:
    """Warn, at the override's own line, for each hook of ``lost`` where the chain of
    overrides from ``cls`` up to ``mixin`` breaks: an override that does not call up."""
    for hook, what in lost.items():
        for owner in cls.__mro__[: cls.__mro__.index(mixin)]:
            override = vars(owner).get(hook)
            if not isinstance(override, types.FunctionType):
                continue  # not defined here, or not a plain function (a partial...)
            override = inspect.unwrap(override)
            if override.__name__ not in (hook, "<lambda>"):
                break  # a decorator's function, which may call the hook: nothing to read
            code = override.__code__
            if not _calls_up(code, hook):
                warnings.warn_explicit(
                    f"{owner.__qualname__}.{hook} does not call super().{hook}(...), so {what}. "
                    f"Call it in the override.",
                    UserWarning,
                    code.co_filename,
                    code.co_firstlineno,
                    # As warnings.warn from the override's module: filters naming it apply,
                    # and its registry shows the warning once (a tuner builds optimizers again).
                    module=override.__module__,
                    registry=override.__globals__.setdefault("__warningregistry__", {}),
                    module_globals=override.__globals__,
                )
                break


def _calls_up(code: types.CodeType, hook: str) -> bool:
    if "super" in code.co_names or hook in code.co_names:
        return True
    nested = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return any(_calls_up(inner, hook) for inner in nested)
