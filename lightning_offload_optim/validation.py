"""Checks made before anything changes: arguments, hyperparameters, gradients, and loaded state
dicts.

Each check raises an error that names the param group, the parameter and the key at fault, so
:class:`~lightning_offload_optim.OffloadAdamW` can refuse bad input before its first mutation.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_offload_optim.host_state import (
    MASTER_KEY,
    MOMENT_KEYS,
    OFFLOADED_KEYS,
    ParamLayout,
)
from lightning_offload_optim.resident import Resident
from lightning_offload_optim.sharding import check_grad_sharding, local, local_source

#: Version of the layout of offloaded state in ``state_dict()`` (key :data:`FORMAT_KEY`). A newer
#: one is refused on load; older ones, and torch AdamW state dicts without the key, load.
FORMAT_VERSION = 1
FORMAT_KEY = "offload_format_version"
#: Keys of per-parameter state, used to tell a parameter's entry from other saved state.
PER_PARAM_KEYS = frozenset({"step", *MOMENT_KEYS, MASTER_KEY})


def describe(group: int, position: int) -> str:
    return f"parameter {position} of param group {group}"


def _kind(value: Any) -> str:
    """``value`` for an error message: a tensor's kind (and its value if it holds one), or a
    repr cut at 80 characters (a list given for a moment prints no whole list)."""
    if isinstance(value, Tensor):
        kind = f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
        # Not a DTensor's: reading one element of a sharded tensor is a collective.
        if value.numel() == 1 and type(value) is Tensor and value.device.type != "meta":
            kind += f" holding {value.item()!r}"
        return kind
    text = repr(value)
    return f"{text if len(text) <= 80 else text[:77] + '...'} ({type(value).__name__})"


def is_number(value: Any) -> bool:
    """A real number, not a bool (``True`` is an int to Python, never meant as 1.0 here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: torch.optim.AdamW's kernel choices, and the values an offloaded step honours: it always
#: runs torch's fused kernel, eagerly, outside autograd.
KERNEL_FLAGS_TAKEN: dict[str, tuple[bool | None, ...]] = {
    "foreach": (None, False),
    "capturable": (False,),
    "differentiable": (False,),
    "fused": (None, True),
}


def check_kernel_flags(flags: Mapping[str, Any], where: str = "") -> None:
    """Refuse a ``torch.optim.AdamW`` kernel flag an offloaded step cannot honour, by name
    (``where``: the param group that gives it, if not the constructor)."""
    for name, value in flags.items():
        if not any(value is taken for taken in KERNEL_FLAGS_TAKEN[name]):
            taken = ", ".join(f"{n}={v[-1]}" for n, v in KERNEL_FLAGS_TAKEN.items())
            raise ValueError(
                f"OffloadAdamW runs torch's fused AdamW kernel on the state it streams, so "
                f"{name}={value!r}{f' in {where}' if where else ''} cannot be honoured: leave "
                f"it out ({taken} are taken), or pass enabled=False for torch's AdamW with it"
            )


def check_resident(resident: Resident) -> Resident:
    """Validate the ``resident`` argument: a share of the state (a float in [0, 1]), a byte
    budget (an int >= 0), ``"auto"`` or ``None`` (nothing resident)."""
    if resident is None or (isinstance(resident, str) and resident == "auto"):
        return resident
    if is_int(resident):
        resident = int(resident)  # numpy ints too, as floats below: the checks use int and float
    elif is_number(resident):
        resident = float(resident)
    else:
        raise TypeError(
            f"resident must be a share of the state (a float in [0, 1]), a number of bytes "
            f"(an int), 'auto' or None; got {resident!r}"
        )
    if isinstance(resident, float) and not (0.0 <= resident <= 1.0 and math.isfinite(resident)):
        raise ValueError(f"resident as a share of the state must be in [0, 1], got {resident}")
    if isinstance(resident, int) and resident < 0:
        raise ValueError(f"resident as a number of bytes must be >= 0, got {resident}")
    return resident


# ------------------------------------------------------------------------------ hyperparameters
@dataclass(frozen=True)
class Hyperparameters:
    """One param group's AdamW hyperparameters, checked."""

    lr: float | Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    decoupled_weight_decay: bool  # False: L2 decay added to the gradient, as torch's Adam


def _scalar(value: Any) -> Any:
    """A 1-element float tensor's value (torch's kernels take those too), else ``value``."""
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        return float(value)
    return value


def group_hyperparameters(group: Mapping[str, Any], index: int) -> Hyperparameters:
    """Check a param group's hyperparameters (they may have been edited by hand) and return them.

    Example:
        >>> group_hyperparameters({"lr": 0.1, "betas": (0.9, 0.99, 0.5)}, 1)
        Traceback (most recent call last):
        ...
        ValueError: param group 1 has betas=(0.9, 0.99, 0.5); betas must be a pair (beta1, beta2)
    """
    return check_hyperparameters(group, f"param group {index}")


def check_hyperparameters(group: Mapping[str, Any], where: str) -> Hyperparameters:
    """Check AdamW hyperparameters (a param group's, or the optimizer's arguments), naming
    ``where`` they come from in an error."""
    lr = group.get("lr")
    if isinstance(lr, Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"{where} has lr={_kind(lr)}; a tensor lr must be 1-element float")
    elif not (is_number(lr) and math.isfinite(lr)):
        # Any sign, as torch at step time: its LinearLR(end_factor=0) can end at -3e-21.
        raise ValueError(
            f"{where} has lr={_kind(lr)}; lr must be a finite number or a 1-element tensor"
        )
    else:
        lr = float(lr)  # the kernel takes no other numbers.Real (a Fraction)
    betas = group.get("betas")
    if isinstance(betas, Tensor) and betas.shape == (2,):
        betas = tuple(betas)
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise ValueError(f"{where} has betas={betas!r}; betas must be a pair (beta1, beta2)")
    checked = []
    for i, beta in enumerate(map(_scalar, betas)):
        if not (is_number(beta) and 0.0 <= beta < 1.0):
            raise ValueError(f"{where} has betas[{i}]={_kind(beta)}; it must be in [0, 1)")
        checked.append(float(beta))
    for name in ("eps", "weight_decay"):
        value = _scalar(group.get(name))
        if not (is_number(value) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{where} has {name}={_kind(value)}; it must be a finite number >= 0")
        checked.append(float(value))
    flags = []
    for name, default in (("amsgrad", None), ("maximize", None), ("decoupled_weight_decay", True)):
        flag = group.get(name, default)
        if not isinstance(flag, bool):
            raise ValueError(f"{where} has {name}={_kind(flag)}; it must be a bool")
        flags.append(flag)
    return Hyperparameters(lr, *checked, *flags)


# ------------------------------------------------------------------------------ gradients
#: What a step updates (torch's AdamW too); integer, bool and float8 tensors it refuses.
UPDATABLE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.complex32,
        torch.complex64,
        torch.complex128,
    }
)


def check_gradient(param: Tensor, group: int, position: int, unscales: bool) -> None:
    """Refuse what the fused kernel cannot take, before anything is modified; where the step
    ``unscales`` gradients (GradScaler's scale), what it cannot write back."""
    grad = param.grad
    assert grad is not None
    where = describe(group, position)
    if param.dtype not in UPDATABLE_DTYPES:
        raise RuntimeError(
            f"{where} is {param.dtype} and has a gradient: AdamW updates float32, float64, "
            "bfloat16 and float16 parameters (and complex ones), as torch's does; give it no "
            "gradient (it is then skipped) or leave it out of the optimizer"
        )
    if grad.is_sparse:
        raise RuntimeError(
            f"OffloadAdamW does not support sparse gradients ({where}); use "
            "torch.optim.SparseAdam for sparse embeddings"
        )
    check_grad_sharding(param, grad, where)
    if (grad.dtype, grad.device, grad.shape) != (param.dtype, param.device, param.shape):
        raise RuntimeError(
            f"the gradient of {where} is {grad.dtype} of shape {tuple(grad.shape)} on "
            f"{grad.device}, the parameter {param.dtype} of shape {tuple(param.shape)} on "
            f"{param.device}; they must match"
        )
    if unscales and _shares_memory_within(local(grad)):
        raise RuntimeError(
            f"the gradient of {where} has elements that share memory (strides "
            f"{local(grad).stride()}: expanded?); a step given GradScaler's scale unscales "
            "gradients in place, as torch's fused AdamW does: give it a gradient of its own "
            "(grad.clone())"
        )


def _shares_memory_within(tensor: Tensor) -> bool:
    """Whether two elements of ``tensor`` may be one memory location: some dimension's stride
    does not pass the furthest offset the dimensions of smaller strides reach."""
    if tensor.is_contiguous():  # an empty one too (nothing to write)
        return False
    dims = zip(tensor.shape, tensor.stride(), strict=True)
    reach = 0
    for stride, size in sorted((stride, n) for n, stride in dims if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


# ------------------------------------------------------------------------------ state dicts
def check_format_version(version: Any, written_by: str = "") -> None:
    """Refuse offloaded state written in a newer format than this installation reads."""
    if version is None:
        return
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(
            f"malformed offloaded optimizer state{written_by}: its format version is "
            f"{_kind(version)}; format versions are integers >= 1"
        )
    if version > FORMAT_VERSION:
        raise RuntimeError(
            f"This offloaded optimizer state has format version {version}{written_by}; this "
            f"installation of lightning-offload-optim reads versions up to {FORMAT_VERSION}. "
            "Upgrade lightning-offload-optim to load it."
        )


@dataclass
class LoadedEntry:
    """A saved per-parameter state entry, matched to its parameter and checked.

    ``local`` holds the entry's offloaded tensors as this rank's part of them, shaped like the
    parameter's local shard (the tensors themselves for plain parameters); ``step`` is the
    entry's step count as a float32 scalar of its own (steps advance it in place).
    """

    param: Tensor
    amsgrad: bool
    local: dict[str, Tensor]
    step: Tensor


def checked_step(value: Any, what: str) -> Tensor:
    """A step count as the optimizer keeps it, a float32 scalar of its own on the host (the
    kind torch's fused AdamW keeps), from any number or 1-element tensor holding a finite
    count >= 0; ``what`` names the value in the error otherwise."""
    if isinstance(value, Tensor):
        ok = (
            value.numel() == 1
            and value.device.type != "meta"
            and (value.is_floating_point() or value.dtype in (torch.int32, torch.int64))
        )
    else:
        ok = is_number(value)
    if not ok or not (math.isfinite(float(value)) and float(value) >= 0):
        raise ValueError(
            f"{what} is {_kind(value)}; expected a finite number >= 0 or a 1-element tensor "
            "holding one"
        )
    return torch.as_tensor(value, device="cpu").detach().to(torch.float32, copy=True).reshape(())


def amp_scaling(optimizer: Any) -> tuple[Tensor | None, bool]:
    """The gradients' scale that ``GradScaler.step`` set on ``optimizer`` (``grad_scale``; None
    when it was unscaled already or no scaler is at work), and whether the scaler found inf or
    NaN gradients (``found_inf``), so that the step is skipped. Reading ``found_inf`` waits for
    the device, as ``GradScaler`` does itself before skipping a step for other optimizers."""
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if value is not None and not (
            isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point()
        ):
            raise TypeError(
                f"optimizer.{name} is {_kind(value)}; GradScaler sets a 1-element float tensor"
            )
    if grad_scale is not None:
        grad_scale = grad_scale.detach().to(torch.float32).reshape(())
    return grad_scale, found_inf is not None and bool(found_inf)


def is_own_step(value: Any) -> bool:
    """Whether a step count in ``optimizer.state`` is of the optimizer's own kind (else it was
    replaced by hand, and :func:`checked_step` makes it one)."""
    return (
        isinstance(value, Tensor)
        and value.dtype is torch.float32
        and value.is_cpu
        and value.dim() == 0
    )


def _check_tensor(name: str, value: Any, param: Tensor, where: str) -> Tensor:
    """Check a loaded state tensor against its parameter; return this rank's part of it."""
    expected = f"a tensor of shape {tuple(param.shape)}"
    if not isinstance(value, Tensor):
        raise ValueError(f"loaded {name!r} for {where} is {_kind(value)}; expected {expected}")
    if value.shape != param.shape:
        raise ValueError(
            f"loaded {name!r} for {where} has shape {tuple(value.shape)}, the parameter has "
            f"shape {tuple(param.shape)}"
        )
    if value.is_complex() != param.is_complex() or not (
        value.is_floating_point() or value.is_complex()
    ):
        raise ValueError(
            f"loaded {name!r} for {where} is {value.dtype}, the parameter {param.dtype}"
        )
    if value.device.type == "meta":
        raise ValueError(f"loaded {name!r} for {where} is on the meta device: it holds no values")
    part = local_source(value, param, f"{name!r} for {where}")
    if part.shape != local(param).shape:
        raise ValueError(
            f"loaded {name!r} for {where} holds a local shard of shape {tuple(part.shape)} on "
            f"this rank, the parameter one of shape {tuple(local(param).shape)}"
        )
    return part


def check_entry(entry: Any, param: Tensor, amsgrad: bool, where: str) -> LoadedEntry:
    """Check one parameter's saved state entry (``step`` and its tensors) and match it."""
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"loaded state for {where} is {_kind(entry)}; expected a dict of state such as "
            "'step', 'exp_avg' and 'exp_avg_sq'"
        )
    ParamLayout.of(param, where)  # refuse a non-dense parameter by name
    # torch's set_optimizer_state_dict, unflattening a flattened dict, gives {} for each key
    # this optimizer's state lists and the checkpoint lacks (master_param, from torch AdamW).
    entry = {k: v for k, v in entry.items() if k not in PER_PARAM_KEYS or not _empty_dict(v)}
    # A max_exp_avg_sq kept after amsgrad was switched off is kept, as torch keeps it.
    amsgrad = amsgrad or "max_exp_avg_sq" in entry
    required = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    missing = [k for k in required if k not in entry]
    if missing:
        raise KeyError(f"loaded state for {where} is missing {missing}")
    step = checked_step(entry["step"], f"loaded 'step' for {where}")
    parts = {
        name: _check_tensor(name, entry[name], param, where)
        for name in OFFLOADED_KEYS
        if name in entry
    }
    return LoadedEntry(param, amsgrad, parts, step)


def _empty_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and not value


def match_loaded_state(
    state_dict: Mapping[str, Any], param_groups: list[dict[str, Any]]
) -> list[LoadedEntry]:
    """Pair each saved state entry with its parameter, or raise naming what does not fit.

    Checks the whole dict (layout, groups, keys, every tensor and step count) so that loading
    can change nothing until it is known to succeed. Entries for keys no param group lists are
    left to torch's loading, which keeps them as they are, unless they look like a parameter's
    state (then the checkpoint is for another model, and that is an error).
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("an optimizer state dict needs the keys 'state' and 'param_groups'")
    check_format_version(state_dict.get(FORMAT_KEY))
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, Sequence) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), Sequence) for g in saved_groups
    ):
        raise ValueError("the loaded 'param_groups' must be a list of dicts with a 'params' list")
    if not isinstance(saved_state, Mapping):
        raise ValueError(f"the loaded 'state' must be a dict, got {type(saved_state).__name__}")
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
            f"{len(param_groups)}; they must be the groups it was saved with (AdamW over "
            "model.parameters() has one, OffloadOptimizerMixin makes two unless its hparam "
            "no_decay_norm_and_bias is False)"
        )
    owner: dict[Any, tuple[Tensor, bool, str]] = {}
    for g, (saved, group) in enumerate(zip(saved_groups, param_groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {g} of the loaded state dict has {len(saved['params'])} "
                f"parameters, this optimizer's has {len(group['params'])}"
            )
        for position, (key, param) in enumerate(zip(saved["params"], group["params"], strict=True)):
            if key in owner:
                raise ValueError(
                    f"the loaded param groups list the parameter key {key!r} twice "
                    f"({owner[key][2]} and {describe(g, position)}); each key must name one "
                    "parameter"
                )
            owner[key] = (param, bool(saved.get("amsgrad", False)), describe(g, position))
    matched = []
    for key, entry in saved_state.items():
        if key not in owner:
            if isinstance(entry, Mapping) and entry.keys() & PER_PARAM_KEYS:
                raise KeyError(f"loaded state has an entry for {key!r}, which no param group lists")
            continue
        param, amsgrad, where = owner[key]
        where = f"{where} (key {key!r})"
        if _empty_dict(entry):
            continue  # no state yet (torch's state is a defaultdict: reading it adds {})
        matched.append(check_entry(entry, param, amsgrad, where))
    return matched
