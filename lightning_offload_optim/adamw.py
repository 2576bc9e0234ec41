"""OffloadAdamW: torch.optim.AdamW with its state in host memory.

The optimizer is thin: it validates, lays state out in :class:`HostState`, plans chunks and hands
each chunk to the one AdamW update in :mod:`lightning_offload_optim.functional`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from lightning_offload_optim.functional import SPLIT_ALIGNMENT, adamw_update
from lightning_offload_optim.host_state import (
    MASTER_KEY,
    MOMENT_KEYS,
    HostState,
    Slot,
    state_keys,
)
from lightning_offload_optim.pipeline import (
    GRAD_KEY,
    Chunk,
    StagingPipeline,
    plan_chunks,
)
from lightning_offload_optim.step_stats import StepRecord

#: Version of the layout of offloaded state in ``state_dict()`` (key :data:`FORMAT_KEY`). A newer
#: one is refused on load; older ones, and torch AdamW state dicts without the key, load.
FORMAT_VERSION = 1
FORMAT_KEY = "offload_format_version"

#: Default elements per staged chunk and state key: 4 Mi elements, 16 MiB of fp32 per key.
DEFAULT_CHUNK_SIZE = 1 << 22


@dataclass
class _Active:
    """A parameter updated in this step, with flat real views of it and its gradient."""

    param: Tensor
    slot: Slot
    group: int
    flat_param: Tensor
    flat_grad: Tensor
    step: Tensor


def _resolve_pin_memory(pin_memory: bool | None) -> bool:
    available = torch.accelerator.is_available()
    if pin_memory is None:
        return available
    if pin_memory and not available:
        warnings.warn(
            "OffloadAdamW(pin_memory=True) needs an accelerator to pin host memory and none is "
            "available; keeping the optimizer state in ordinary (pageable) host memory.",
            stacklevel=3,
        )
        return False
    return bool(pin_memory)


def check_format_version(version: Any, written_by: str = "") -> None:
    """Refuse offloaded state written in a newer format than this installation reads."""
    if version is None:
        return
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise RuntimeError(
            f"This offloaded optimizer state has format version {version!r}{written_by}; this "
            f"installation of lightning-offload-optim reads versions up to {FORMAT_VERSION}. "
            "Upgrade lightning-offload-optim to load it."
        )


def _describe(group: int, position: int) -> str:
    return f"parameter {position} of param group {group}"


def _check_gradient(param: Tensor, group: int, position: int) -> None:
    """Refuse what the fused kernel cannot take, before anything is modified."""
    grad = param.grad
    assert grad is not None
    where = _describe(group, position)
    if grad.is_sparse:
        raise RuntimeError(
            f"OffloadAdamW does not support sparse gradients ({where}); use "
            "torch.optim.SparseAdam for sparse embeddings"
        )
    if type(param).__name__ == "DTensor" or type(grad).__name__ == "DTensor":
        raise RuntimeError(
            f"OffloadAdamW does not support DTensor parameters yet ({where}): FSDP2 and "
            "ModelParallel shard parameters as DTensors"
        )
    if (grad.dtype, grad.device, grad.shape) != (param.dtype, param.device, param.shape):
        raise RuntimeError(
            f"the gradient of {where} is {grad.dtype} of shape {tuple(grad.shape)} on "
            f"{grad.device}, the parameter {param.dtype} of shape {tuple(param.shape)} on "
            f"{param.device}; they must match"
        )


class OffloadAdamW(torch.optim.AdamW):
    """AdamW whose state (moments, and an fp32 master copy of bf16/fp16 params) lives in host RAM.

    A drop-in for :class:`torch.optim.AdamW`: same hyperparameters, param groups, LR schedulers,
    closures and ``state_dict`` format. Parameters and gradients stay on their device; each step
    streams bounded chunks of state to it, updates them with torch's fused AdamW kernel, and
    streams them back, so the accelerator holds only the staging buffers. Results are
    bit-identical to ``torch.optim.AdamW(fused=True)`` (see docs/exactness.md).

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize: as :class:`torch.optim.AdamW`.
        pin_memory: page-lock the host buffers (needed for copies that overlap compute).
            ``None`` pins when an accelerator is available; ``True`` without one warns and
            falls back to ordinary memory.
        enabled: ``False`` makes this exactly ``torch.optim.AdamW`` (state on the device).
        chunk_size: elements per staged chunk and state key (rounded down to a multiple of 64).
            Device memory used is about ``2 * chunk_size * 4 bytes * number of state keys``.
        force_staging: stage chunks through separate buffers even for CPU parameters (tests).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = OffloadAdamW(model.parameters(), lr=1e-2)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
        >>> sorted(opt.offloaded_state(model.weight))
        ['exp_avg', 'exp_avg_sq']
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        pin_memory: bool | None = None,
        enabled: bool = True,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        force_staging: bool = False,
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
        if chunk_size < SPLIT_ALIGNMENT:
            raise ValueError(f"chunk_size must be at least {SPLIT_ALIGNMENT}, got {chunk_size}")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
        self.enabled = bool(enabled)
        self.chunk_size = chunk_size - chunk_size % SPLIT_ALIGNMENT
        self.pin_memory = _resolve_pin_memory(pin_memory) if self.enabled else False
        self._host = HostState(self.pin_memory)
        self._pipeline = StagingPipeline(self.chunk_size, force_staging)
        self._plans: dict[tuple[int, ...], list[Chunk]] = {}
        # A plain function, not a bound method: no reference cycle keeping host buffers alive.
        self.register_state_dict_post_hook(OffloadAdamW._add_offloaded_state, prepend=True)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (with gradients enabled) if given, then one AdamW step; return its loss.

        Everything is validated and allocated before any parameter or state is modified, so a
        step that raises leaves the optimizer and the model as they were.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.enabled:
            _torch_adamw_step(self)
            return loss

        active = self._collect_active()
        if not active:
            return loss
        chunks = self._plan(active)
        self._pipeline.prepare(chunks)
        self._initialise_new_state(active)
        steps = [a.step for a in active]
        torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
        device_steps = self._steps_on_devices(active)

        def update(chunk: Chunk, views: dict[str, Tensor]) -> None:
            self._update_chunk(chunk, views, active, device_steps)

        self._pipeline.run(chunks, update)
        return loss

    def _collect_active(self) -> list[_Active]:
        """Validate this step's parameters and lay out state for new ones (no mutation of state)."""
        found: list[tuple[Tensor, int]] = []
        new: list[tuple[Tensor, tuple[str, ...]]] = []
        for g, group in enumerate(self.param_groups):
            for position, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                _check_gradient(param, g, position)
                slot = self._host.slots.get(param)
                if slot is not None:
                    self._check_unchanged(param, slot, g, position)
                if slot is None or (group["amsgrad"] and "max_exp_avg_sq" not in slot.arena.keys):
                    # New state: a first step, or state cleared (amsgrad on) since the last one.
                    if self.state.get(param):
                        why = (
                            "no offloaded state; was optimizer.state edited by hand?"
                            if slot is None
                            else "no max_exp_avg_sq: amsgrad cannot be switched on after the "
                            "first step"
                        )
                        raise RuntimeError(f"{_describe(g, position)} has a step count but {why}")
                    new.append((param, state_keys(param, group["amsgrad"])))
                found.append((param, g))
        if new:
            self._host.allocate(new)
            self._plans.clear()
        active = []
        for param, g in found:
            slot = self._host.slots[param]
            state = self.state.get(param)
            step = state["step"] if state else torch.zeros((), dtype=torch.float32)
            flat_grad = slot.layout.flat(param.grad)
            active.append(_Active(param, slot, g, slot.flat_param(param), flat_grad, step))
        return active

    def _plan(self, active: list[_Active]) -> list[Chunk]:
        """The chunk plan for this set of active parameters (cached: usually the same each step).

        Chunks bound the staging memory; when nothing is staged (CPU parameters updated in
        place) one chunk per arena lets the fused kernel see every tensor at once.
        """
        key = tuple(id(a.slot) for a in active)
        if key not in self._plans:
            staged = any(self._pipeline.stages(a.param.device) for a in active)
            chunk_numel = self.chunk_size if staged else sys.maxsize
            self._plans[key] = plan_chunks([a.slot for a in active], chunk_numel)
        return self._plans[key]

    @staticmethod
    def _check_unchanged(param: Tensor, slot: Slot, group: int, position: int) -> None:
        layout = slot.layout
        if (param.shape, param.dtype, param.device, param.stride()) != (
            layout.shape,
            layout.dtype,
            layout.device,
            layout.stride,
        ):
            raise RuntimeError(
                f"{_describe(group, position)} changed since its optimizer state was created: "
                f"it was {layout.describe()} and is now shape {tuple(param.shape)}, dtype "
                f"{param.dtype}, device {param.device}. Move or cast the model before creating "
                "the optimizer, or create a new optimizer."
            )

    def _initialise_new_state(self, active: list[_Active]) -> None:
        """Zero the moments of parameters stepping for the first time; their master copy (bf16
        and fp16 parameters) starts as the parameter itself."""
        fresh = [a for a in active if not self.state.get(a.param)]
        if not fresh:
            return
        self._pipeline.wait_host()  # a slot reused after optimizer.state was cleared
        for a in fresh:
            for key in a.slot.arena.keys:
                if key == MASTER_KEY:
                    a.slot.view(key).copy_(a.flat_param)
                else:
                    a.slot.view(key).zero_()
            self.state[a.param]["step"] = a.step

    @staticmethod
    def _steps_on_devices(active: list[_Active]) -> list[Tensor]:
        """Each active parameter's step count on its device, where the fused kernels read it."""
        on_host = [a.step for a in active]
        devices = {a.param.device for a in active}
        if devices == {torch.device("cpu")}:
            return on_host
        stacked = torch.stack(on_host)
        if torch.cuda.is_available():  # pinned, so the copy does not wait for the device
            stacked = stacked.pin_memory()
        copies = {d: stacked.to(d, non_blocking=True) for d in devices}
        return [copies[a.param.device][i] for i, a in enumerate(active)]

    def _update_chunk(
        self,
        chunk: Chunk,
        views: dict[str, Tensor],
        active: list[_Active],
        steps: list[Tensor],
    ) -> None:
        """Apply AdamW to one chunk whose state is in ``views``, one kernel call per param group."""
        calls: dict[int, _KernelLists] = {}
        for seg in chunk.segments:
            a = active[seg.index]
            if a.group not in calls:
                calls[a.group] = _KernelLists()
            lists = calls[a.group]
            lists.add(
                a,
                seg.start,
                seg.stop,
                slice(seg.offset, seg.offset + seg.stop - seg.start),
            )
            lists.steps.append(steps[seg.index])
        for g, lists in calls.items():
            group = self.param_groups[g]
            targets, grads = lists.params, lists.grads
            with_master = MASTER_KEY in chunk.arena.keys
            if with_master:  # bf16/fp16 params: update the fp32 master, then round
                targets = [views[MASTER_KEY][s] for s in lists.state]
                grads = [views[GRAD_KEY][s] for s in lists.state]
                torch._foreach_copy_(grads, lists.grads)
            beta1, beta2 = group["betas"]
            adamw_update(
                targets,
                grads,
                [views["exp_avg"][s] for s in lists.state],
                [views["exp_avg_sq"][s] for s in lists.state],
                [views["max_exp_avg_sq"][s] for s in lists.state] if group["amsgrad"] else [],
                lists.steps,
                lr=group["lr"],
                beta1=float(beta1),
                beta2=float(beta2),
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                amsgrad=group["amsgrad"],
                maximize=group["maximize"],
            )
            if with_master:
                torch._foreach_copy_(lists.params, targets)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format, loadable by it: per parameter ``step``, ``exp_avg``,
        ``exp_avg_sq`` (and ``max_exp_avg_sq``), plus ``master_param`` for bf16/fp16 params.

        The moments are fp32 views of the host buffers, as torch returns references to its state.
        """
        return super().state_dict()  # the offloaded state is added by _add_offloaded_state

    @staticmethod
    def _add_offloaded_state(self: OffloadAdamW, state_dict: dict) -> dict:
        """state_dict post-hook (registered first): put the host state back under torch's keys."""
        if not self.enabled:
            return state_dict
        state_dict[FORMAT_KEY] = FORMAT_VERSION  # torch's AdamW ignores extra top-level keys
        self._pipeline.wait_host()
        saved_params = (i for group in state_dict["param_groups"] for i in group["params"])
        params = (p for group in self.param_groups for p in group["params"])
        for index, param in zip(saved_params, params, strict=True):
            slot = self._host.slots.get(param)
            if index in state_dict["state"] and slot is not None:
                moments = {key: slot.layout.unflat(slot.view(key)) for key in slot.arena.keys}
                state_dict["state"][index] = {**state_dict["state"][index], **moments}
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer or of ``torch.optim.AdamW``.

        Moments are copied straight into host buffers as fp32 (never through the device, never
        cast to a bf16 parameter's dtype). State keys may be ints or parameter names, as long as
        the param groups list the same keys. The dict is checked whole before anything changes.
        """
        if not self.enabled:
            super().load_state_dict(state_dict)
            return
        matched = self._match_loaded(state_dict)
        self._pipeline.wait_host()  # the entries may be views of this optimizer's own buffers
        host = HostState(self.pin_memory)
        host.allocate([(param, state_keys(param, amsgrad)) for param, _, amsgrad in matched])
        for param, entry, _ in matched:
            slot = host.slots[param]
            for key in slot.arena.keys:
                source = entry.get(key, param.detach() if key == MASTER_KEY else None)
                if source is not None:  # a torch AdamW checkpoint has no master copy
                    slot.view(key).copy_(slot.layout.flat(source))
        offloaded = (*MOMENT_KEYS, MASTER_KEY)
        stripped = {
            "state": {
                index: {k: v for k, v in entry.items() if k not in offloaded}
                for index, entry in state_dict["state"].items()
            },
            "param_groups": state_dict["param_groups"],
        }
        super().load_state_dict(stripped)
        self._host = host
        self._plans.clear()
        for state in self.state.values():  # a fused or capturable AdamW saves steps on its device
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device="cpu")

    def _match_loaded(self, state_dict: Mapping[str, Any]) -> list[tuple[Tensor, dict, bool]]:
        """Pair each saved state entry with its parameter, or raise naming what does not fit."""
        if (
            not isinstance(state_dict, Mapping)
            or not {"state", "param_groups"} <= state_dict.keys()
        ):
            raise ValueError("an optimizer state dict needs the keys 'state' and 'param_groups'")
        check_format_version(state_dict.get(FORMAT_KEY))
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        owner: dict[Any, tuple[Tensor, bool, str]] = {}
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {g} of the loaded state dict has {len(saved['params'])} "
                    f"parameters, this optimizer's has {len(group['params'])}"
                )
            for position, (key, param) in enumerate(
                zip(saved["params"], group["params"], strict=True)
            ):
                owner[key] = (
                    param,
                    bool(saved.get("amsgrad", False)),
                    _describe(g, position),
                )
        matched = []
        for key, entry in state_dict["state"].items():
            if key not in owner:
                raise KeyError(f"loaded state has an entry for {key!r}, which no param group lists")
            param, amsgrad, where = owner[key]
            required = ["step", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
            missing = [k for k in required if k not in entry]
            if missing:
                raise KeyError(f"loaded state for {where} (key {key!r}) is missing {missing}")
            for name in (*MOMENT_KEYS, MASTER_KEY):
                value = entry.get(name)
                if value is None:
                    continue
                if not isinstance(value, Tensor) or value.shape != param.shape:
                    found = tuple(value.shape) if isinstance(value, Tensor) else type(value)
                    raise ValueError(
                        f"loaded {name!r} for {where} has shape {found}, the parameter has "
                        f"shape {tuple(param.shape)}"
                    )
                if value.is_complex() != param.is_complex():
                    raise ValueError(
                        f"loaded {name!r} for {where} is {value.dtype}, the parameter {param.dtype}"
                    )
            matched.append((param, entry, amsgrad))
        return matched

    # ------------------------------------------------------------ inspection
    def offloaded_state(self, param: Tensor) -> dict[str, Tensor]:
        """A copy of ``param``'s offloaded state, shaped like it: ``exp_avg``, ``exp_avg_sq``,
        ``max_exp_avg_sq`` (amsgrad) and ``master_param`` (bf16/fp16 params), all fp32 on the host.

        Copies, so inspecting never changes training; ``{}`` before the parameter's first step.
        """
        if not self.enabled:
            return {k: v.clone() for k, v in self.state.get(param, {}).items() if k != "step"}
        slot = self._host.slots.get(param)
        if slot is None or not self.state.get(param):
            return {}
        self._pipeline.wait_host()
        return {key: slot.layout.unflat(slot.view(key)).clone() for key in slot.arena.keys}

    @property
    def last_step(self) -> StepRecord | None:
        """Timing and bytes moved of the latest step; ``poll()`` or ``resolve()`` it to read.

        Recorded with events, so reading it later costs the step nothing.
        """
        return self._pipeline.last_record

    def memory_stats(self) -> dict[str, int | bool]:
        """Host memory the offloaded state uses.

        ``state_bytes``: logical bytes of state (what would otherwise sit on the device);
        ``host_bytes``: bytes the host buffers occupy; ``pinned``: whether they are page-locked.
        """
        return {
            "state_bytes": self._host.logical_bytes,
            "host_bytes": self._host.allocated_bytes,
            "pinned": self._host.pinned,
        }


class _KernelLists:
    """The per-segment tensors of one fused-kernel call."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.state: list[slice] = []
        self.steps: list[Tensor] = []

    def add(self, a: _Active, start: int, stop: int, state: slice) -> None:
        whole = start == 0 and stop == a.slot.layout.numel  # no new view object needed
        self.params.append(a.flat_param if whole else a.flat_param[start:stop])
        self.grads.append(a.flat_grad if whole else a.flat_grad[start:stop])
        self.state.append(state)


def _torch_adamw_step(optimizer: torch.optim.AdamW) -> None:
    """torch.optim.AdamW.step itself, without running the optimizer's step hooks a second time."""
    step = torch.optim.AdamW.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)
