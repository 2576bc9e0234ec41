"""OffloadAdamW: torch.optim.AdamW with its state in host memory.

The optimizer is thin: it validates, lays state out in :class:`HostState`, plans chunks and hands
each chunk to the one AdamW update in :mod:`lightning_offload_optim.functional`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial, wraps
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT
from torch.utils.hooks import RemovableHandle

from lightning_offload_optim.functional import SPLIT_ALIGNMENT, adamw_update, take_edits
from lightning_offload_optim.host_state import (
    MASTER_KEY,
    OFFLOADED_KEYS,
    Arena,
    HostState,
    Offloaded,
    ParamLayout,
    Slot,
    state_keys,
)
from lightning_offload_optim.interrupts import signals_held
from lightning_offload_optim.overlap import ForwardOverlap
from lightning_offload_optim.pipeline import (
    GRAD_KEY,
    Chunk,
    StagingPipeline,
    StagingPool,
    plan_chunks,
)
from lightning_offload_optim.resident import (
    ResidentRanges,
    budget_bytes,
    choose_resident,
)
from lightning_offload_optim.sharding import (
    like_param,
    local,
    local_grad,
    refuse_fsdp1,
    write_mark,
)
from lightning_offload_optim.step_stats import StepRecord
from lightning_offload_optim.validation import (
    FORMAT_KEY,
    FORMAT_VERSION,
    KERNEL_FLAGS_TAKEN,
    Hyperparameters,
    LoadedEntry,
    amp_scaling,
    check_entry,
    check_gradient,
    check_hyperparameters,
    check_kernel_flags,
    check_resident,
    checked_step,
    describe,
    group_hyperparameters,
    is_int,
    is_own_step,
    match_loaded_state,
)

#: Default elements per staged chunk and state key: 4 Mi elements, 16 MiB of fp32 per key.
DEFAULT_CHUNK_SIZE = 1 << 22
#: Chunk plans kept for reuse, one per set of parameters with gradients (usually one).
PLAN_CACHE_SIZE = 8
#: Constructor settings fixed once the optimizer is built (see :class:`_FixedSetting`).
_FIXED_SETTINGS = ("enabled", "chunk_size", "pin_memory", "force_staging", "staging_pool")
#: Those the mixin takes as hparams (``offload_<name>``).
_MIXIN_SETTINGS = ("enabled", "chunk_size", "pin_memory")
#: Constructor settings kept when the optimizer is copied or pickled.
_SETTINGS = (*_FIXED_SETTINGS, "resident")


@dataclass
class _Active:
    """A parameter updated in this step, with flat real views of it and its gradient. ``grad``
    is the local gradient the update reads: ``param.grad``'s shard, or a redistributed one."""

    param: Tensor
    slot: Slot
    group: int
    flat_param: Tensor
    grad: Tensor
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


class _FixedSetting:
    """A constructor setting that the host buffers, staging pipeline and step follow from the
    start: read-only afterwards, so that setting it says so instead of being ignored (or, for
    ``enabled``, breaking the next step). Kept in ``_<name>``; a Lightning or Fabric wrapper
    forwards the read of that to the optimizer."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}"

    def __get__(self, optimizer: Any, owner: type | None = None) -> Any:
        return self if optimizer is None else getattr(optimizer, self.slot)

    def __set__(self, optimizer: Any, value: Any) -> None:
        raise AttributeError(self._read_only(optimizer, f"{self.name}={value!r}"))

    def __delete__(self, optimizer: Any) -> None:
        raise AttributeError(self._read_only(optimizer, f"{self.name}=..."))

    def _read_only(self, optimizer: Any, argument: str) -> str:
        kind = type(_unwrapped(optimizer)).__name__
        hparam = (
            f" (the mixin's hparam offload_{self.name})" if self.name in _MIXIN_SETTINGS else ""
        )
        return (
            f"{kind}'s {self.name} is read-only: the constructor takes it{hparam}, and the host "
            f"state and staging are laid out for it. To change it, build a new "
            f"{kind}(..., {argument}) and load this one's state_dict() into it"
        )


def _unwrapped(optimizer: OffloadAdamW) -> OffloadAdamW:
    """The optimizer that Lightning's ``LightningOptimizer`` (what ``self.optimizers()``
    returns) or Fabric's optimizer wrapper stands for; ``optimizer`` itself otherwise. Both
    wrappers subclass the wrapped optimizer's class and forward reads of its attributes, not
    writes: one of its methods run on the wrapper would keep what it sets there (an overlap,
    a resident share) where the optimizer's own ``step()`` never sees it. An OffloadAdamW
    itself (its host store set) is never taken for a wrapper, whatever it keeps."""
    while "_host" not in vars(optimizer):
        inner = vars(optimizer).get("_optimizer")
        if not isinstance(inner, OffloadAdamW):
            break
        optimizer = inner
    return optimizer


def _stepping_wrapper(optimizer: OffloadAdamW) -> str | None:
    """The class of another optimizer whose ``step`` runs this step, if any: a wrapper such as
    ``ZeroRedundancyOptimizer`` (it broadcasts the parameters), ``PostLocalSGDOptimizer`` or a
    Lookahead (they average them) reads or writes the parameters as soon as this step returns.
    Lightning's and Fabric's wrappers stand for this optimizer and are not counted."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step":
            caller = frame.f_locals.get("self")
            if isinstance(caller, torch.optim.Optimizer) and _unwrapped(caller) is not optimizer:
                return type(caller).__name__
        frame = frame.f_back
    return None


def _on_the_optimizer(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` on the optimizer a Lightning or Fabric wrapper stands for (see
    :func:`_unwrapped`). Every public method that sets an attribute of the optimizer needs it;
    those that only read reach the optimizer's attributes through the wrappers' forwarding
    (``tests/test_wrappers.py`` calls each through both wrappers)."""

    @wraps(method)
    def run(self: OffloadAdamW, *args: Any, **kwargs: Any) -> Any:
        return method(_unwrapped(self), *args, **kwargs)

    return run


#: For the methods that make or keep buffers: made inside ``torch.inference_mode()`` (torch's
#: AdamW steps there too) they would be inference tensors, which nothing outside it may write.
_outside_inference_mode = torch.inference_mode(False)


class OffloadAdamW(torch.optim.AdamW):
    """AdamW whose state (moments, and an fp32 master copy of bf16/fp16 params) lives in host RAM.

    A drop-in for :class:`torch.optim.AdamW`: same hyperparameters, param groups, LR schedulers,
    closures and ``state_dict`` format. Parameters and gradients stay on their device; each step
    streams bounded chunks of state to it, updates them with torch's fused AdamW kernel, and
    streams them back, so the accelerator holds only the staging buffers. Results are
    bit-identical to ``torch.optim.AdamW(fused=True)`` (see docs/exactness.md).

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize: as :class:`torch.optim.AdamW`.
        foreach, capturable, differentiable, fused: taken where the offloaded step honours them
            (it always runs the fused kernel: ``fused=True``, ``foreach=False``), refused
            otherwise; with ``enabled=False``, passed to torch's AdamW as given.
        pin_memory: page-lock the host buffers (needed for copies that overlap compute).
            ``None`` pins when an accelerator is available; ``True`` without one warns and
            falls back to ordinary memory, as does a host that refuses to pin.
        enabled: ``False`` makes this exactly ``torch.optim.AdamW`` (state on the device).
        chunk_size: elements per staged chunk and state key (rounded down to a multiple of 64).
            Device memory used is ``2 * chunk_size * 4 bytes`` per state key, plus one more
            key's worth for bf16/fp16 parameters (their fp32 gradient scratch).
        force_staging: stage chunks through separate buffers even for CPU parameters (tests).
        staging_pool: a :class:`~lightning_offload_optim.StagingPool` whose staging buffers
            this optimizer shares with the others given it (one optimizer per parameter,
            stepped in backward); by default it has buffers of its own.
            These five are fixed once the optimizer is built: setting one raises.
        resident: state to keep on the device, where it is updated in place and never copied:
            a share of the state (``0.25``), a number of bytes per device, or ``"auto"`` (what
            is free on each device after the first step, within any per-process memory
            fraction, less a margin of 10% of the device's memory and at least 2 GiB; nothing
            where torch reports no free memory: only CUDA devices do).
            Whole parameters, those the forward pass uses first (see :meth:`overlap_with`;
            else as the param groups list them), each kept if it fits in what is left.
            Chosen at the start of each step whose parameters' state is laid out anew, whose
            forward pass first used a parameter (from the second step), or after the attribute
            ``resident`` is set anew; checkpoints are the same whatever the share.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = OffloadAdamW(model.parameters(), lr=1e-2)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
        >>> sorted(opt.offloaded_state(model.weight))
        ['exp_avg', 'exp_avg_sq']
    """

    enabled = _FixedSetting()
    chunk_size = _FixedSetting()
    pin_memory = _FixedSetting()
    force_staging = _FixedSetting()
    staging_pool = _FixedSetting()
    #: What torch's constructor set ``_step_supports_amp_scaling`` to (disabled only).
    _torch_amp_scaling = False

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """Whether ``GradScaler.step`` leaves the gradients' scale to :meth:`step` (setting
        ``grad_scale`` and ``found_inf``, taken as torch's fused AdamW takes them) instead of
        unscaling them first: only where there are fp16 gradients, which its ``unscale_``
        refuses. Elsewhere it unscales them, so that Lightning can clip unscaled gradients (it
        refuses to clip for an optimizer that unscales them itself). Disabled, torch's: True
        for ``fused=True``."""
        if not self.enabled:
            return self._torch_amp_scaling
        return any(
            p.grad is not None and p.grad.dtype == torch.float16
            for group in self.param_groups
            for p in group["params"]
        )

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        """Set by torch's constructor for ``fused=True``, given to it only where disabled."""
        if self.enabled:
            raise AttributeError(
                "OffloadAdamW's _step_supports_amp_scaling follows its gradients' dtypes"
            )
        self._torch_amp_scaling = value

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
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        pin_memory: bool | None = None,
        enabled: bool = True,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        force_staging: bool = False,
        resident: float | int | str | None = None,
        staging_pool: StagingPool | None = None,
    ) -> None:
        if not is_int(chunk_size):
            raise TypeError(f"chunk_size must be an int, got {chunk_size!r}")
        chunk_size = int(chunk_size)  # a numpy int too
        if chunk_size < SPLIT_ALIGNMENT:
            raise ValueError(f"chunk_size must be at least {SPLIT_ALIGNMENT}, got {chunk_size}")
        flags = {"enabled": enabled, "force_staging": force_staging, "pin_memory": pin_memory}
        for name, flag in flags.items():
            if not isinstance(flag, bool) and not (name == "pin_memory" and flag is None):
                kind = "a bool or None" if name == "pin_memory" else "a bool"
                raise TypeError(f"{name} must be {kind}, got {flag!r}")  # bool("false") is True
        if staging_pool is not None and not isinstance(staging_pool, StagingPool):
            raise TypeError(f"staging_pool must be a StagingPool or None, got {staging_pool!r}")
        kernel = {
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
        }
        if enabled:  # the fused kernel, always; disabled, torch's AdamW takes them as given
            check_kernel_flags(kernel)
            kernel = {}
        # Set before torch's constructor, whose add_param_group calls read them.
        self._enabled = enabled
        self._chunk_size = chunk_size - chunk_size % SPLIT_ALIGNMENT
        self._force_staging = force_staging
        self._staging_pool = staging_pool
        self.resident = resident
        self._pin_memory = _resolve_pin_memory(pin_memory) if enabled else False
        try:
            super().__init__(
                params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, **kernel
            )
        except (TypeError, IndexError):  # torch's checks meet lr="1e-3", betas=(0.9,) with this
            given = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
            check_hyperparameters(
                given | {"amsgrad": amsgrad, "maximize": maximize}, "OffloadAdamW"
            )
            raise
        self._start_offload()

    @property
    def resident(self) -> float | int | str | None:
        """The state to keep on the device (see the class's ``resident`` argument). Set anew,
        it is checked at once and followed from the next step."""
        return self._resident

    @resident.setter
    def resident(self, resident: float | int | str | None) -> None:
        _unwrapped(self)._resident = check_resident(resident)

    def _start_offload(self) -> None:
        """The host store, pipeline and caches (at construction and when copied or unpickled)."""
        pipeline = StagingPipeline(self.chunk_size, self.force_staging, pool=self.staging_pool)
        pin = self.pin_memory
        self._pipeline = pipeline
        # Closures over the pipeline only: no reference cycle keeping host buffers alive.
        self._host = HostState(lambda device: pin and pipeline.stages(device))
        self._plans: OrderedDict[tuple[int, ...], list[Chunk]] = OrderedDict()
        self._interrupted: str | None = None
        self._overlap: ForwardOverlap | None = None
        self._overlap_finalizer: weakref.finalize | None = None
        self._resident_for: tuple = ()  # what the resident choice was made for
        self._next_chunks: list[Chunk] = []
        self._offloaded_state_hook = super().register_state_dict_post_hook(
            OffloadAdamW._add_offloaded_state, prepend=True
        )

    def register_state_dict_post_hook(
        self, hook: Callable[..., dict | None], prepend: bool = False
    ) -> RemovableHandle:
        """As torch's, but the hook that puts the offloaded state into the dict stays first, so
        a hook prepended later also sees (and may replace) the state's tensors, as with torch's
        AdamW, instead of placeholders that overwrite its edits."""
        handle = super().register_state_dict_post_hook(hook, prepend)
        if prepend:
            hooks = self._optimizer_state_dict_post_hooks
            hooks.move_to_end(self._offloaded_state_hook.id, last=False)
        return handle

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but a parameter listed twice in one group is refused (torch only warns,
        then steps it twice per step), and one in an earlier group is named; so is a kernel
        flag the constructor refuses (``differentiable=True``: torch's fused AdamW refuses it at
        the step). Groups record ``fused=True``: that is the kernel used, and
        ``torch.optim.AdamW`` loading the state dict then uses it too. Its hyperparameters are
        checked here, as at every step: a group every step would refuse is refused now."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        group = len(self.param_groups)
        if params is not None and self.enabled:
            where = f"param group {group}"
            check_hyperparameters(self.defaults | param_group, where)
            check_kernel_flags(
                {k: v for k, v in param_group.items() if k in KERNEL_FLAGS_TAKEN}, where
            )
        if isinstance(params, Tensor) and self.enabled:
            refuse_fsdp1(params, f"parameter 0 of param group {group}")
        elif params is not None and not isinstance(params, (Tensor, set)):
            param_group["params"] = params = list(params)
            tensors = [p[1] if isinstance(p, tuple) else p for p in params]
            first: dict[int, int] = {}
            for position, param in enumerate(tensors):
                if self.enabled:  # disabled, it is torch's AdamW, which takes them
                    refuse_fsdp1(param, f"parameter {position} of param group {group}")
                if id(param) in first:
                    raise ValueError(
                        f"parameter {first[id(param)]} of the new param group is listed again "
                        f"at position {position}; list each parameter once"
                    )
                first[id(param)] = position
        try:
            super().add_param_group(param_group)
        except ValueError as error:  # torch's, before it adds anything: name the parameter
            if "more than one parameter group" not in str(error):
                raise
            raise ValueError(self._held_already(param_group["params"], group)) from None
        if self.enabled:
            _record_fused(self.param_groups[-1])

    def _held_already(self, params: list[Tensor], group: int) -> str:
        """Name the first of ``params`` (of new param group ``group``, as torch's check left
        them: tensors) that an earlier group holds already."""
        held = {id(p) for earlier in self.param_groups for p in earlier["params"]}
        position = next(i for i, p in enumerate(params) if id(p) in held)
        return (
            f"{describe(group, position)} is {describe(*self._place(params[position]))} "
            "already; a parameter can be in one param group only"
        )

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (with gradients enabled) if given, then one AdamW step; return its loss.

        All or nothing where it can be: hyperparameters of every group, gradients, parameter
        layouts, host and staging allocations and the step counts' copies to the device are all
        checked and made before the first parameter, moment or step count changes, so a step
        that raises for any of these leaves model and optimizer exactly as they were. A Ctrl-C
        (SIGINT, in the main thread) during the update is raised when the update ends, so the
        state can still be saved. An exception during the update itself (an error raised by a
        kernel or copy as it is queued) can leave some chunks updated and others not; that
        cannot be undone cheaply, so the optimizer then refuses further ``step()`` and
        ``state_dict()`` calls with an error until a state dict is loaded. (A device-side fault
        surfaces later, at some synchronisation, and usually leaves the CUDA context unusable.)
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.enabled:
            self._offloaded_step()
        else:  # torch's own step, compiled too where the caller compiles it
            _torch_adamw_step(self)
        return loss

    # Compiled (``torch.compile(opt.step)``, or a compiled loop calling it) it runs eagerly:
    # traced, its copies and streams failed inside the update, after the step counts advanced.
    @torch.compiler.disable
    @_outside_inference_mode
    def _offloaded_step(self) -> None:
        self._refuse_if_interrupted()
        grad_scale, skip = amp_scaling(self)
        if skip:  # GradScaler found inf/NaN gradients: nothing changes, as in torch's kernel
            return
        hyper = [group_hyperparameters(g, i) for i, g in enumerate(self.param_groups)]
        if self.resident is not None or self._pipeline.resident_bytes:  # set, or set to None
            self._choose_resident()
        active, new_slots = self._collect_active(unscales=grad_scale is not None)
        if not active:
            return
        chunks = self._plan(active, cache=not new_slots)
        self._pipeline.prepare(chunks)
        if new_slots:  # new master copies start from the weights, after updates writing them
            self.wait_for_updates()  # (state cleared by hand after an overlapped step)
        self._fill_new_state(active, new_slots)
        host_steps = [a.step for a in active]
        # Only parameters with a master copy can lose an edit (fp32 ones are their own state).
        with_master = [i for i, a in enumerate(active) if MASTER_KEY in a.slot.arena.keys]
        edited = _edited_since_last_step(active, with_master, new_slots)
        pin = self.pin_memory and not self._host.pin_failed
        device_steps = self._steps_on_devices(active, host_steps, pin, self._pipeline.stages)
        # Keyed as _update_chunk looks it up: one copy per device with chunks, none per parameter.
        devices = {chunk.arena.device for chunk in chunks} if grad_scale is not None else ()
        scales = {device: grad_scale.to(device) for device in devices}

        # Gradients updated as copies (laid out unlike their parameters) go back unscaled once
        # all their elements are: per such gradient, the elements left (with the overlap,
        # chunks run in forward order, not in the order of the state's memory).
        left = (
            {i: a.slot.layout.numel for i, a in enumerate(active) if _grad_copied(a)}
            if scales
            else {}
        )
        overlap = self._overlapping()
        if overlap is not None:  # the update reads these after step() returns
            for i, a in enumerate(active):
                self._pipeline.used_by_update(a.flat_grad)
                if i in left:  # and writes this one back
                    self._pipeline.used_by_update(a.grad)
            for step in {s.untyped_storage().data_ptr(): s for s in device_steps}.values():
                self._pipeline.used_by_update(step)  # the stacked copies of the step counts
            for scale in scales.values():  # GradScaler drops it when step() returns
                self._pipeline.used_by_update(scale)
            # A tensor lr may be changed (a scheduler's fill_) before the update reads it.
            hyper = [_snapshot_lr(h, self._pipeline) for h in hyper]

        def update(chunk: Chunk, views: dict[str, Tensor]) -> None:
            self._update_chunk(chunk, views, active, device_steps, hyper, edited, scales)
            if left:
                _unscaled_into_copied_grads(chunk, active, left)

        # Everything is checked and allocated: from here on the update runs (a Ctrl-C or a
        # scheduler's notice waits, and its handler runs once the pool's lock is let go: it
        # may wait for a thread using the pool). Another optimizer of the pool, in another
        # thread, may have released the staging since: prepared again (all or nothing still).
        with signals_held(), self._pipeline.pool.lock:
            self._pipeline.prepare_again(chunks)
            try:
                if new_slots:
                    self._host.adopt(new_slots)
                    self._plans.clear()
                    for a in active:
                        if a.param in new_slots:
                            self._mark_offloaded(a.param, a.slot, a.step)
                # A tensor increment: 4x faster than a Python scalar over many tensors on the CPU.
                torch._foreach_add_(host_steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
                self._pipeline.run(chunks, update, overlap=overlap is not None)
                if overlap is not None:
                    # Queued, not done: a backward through a graph recorded before this step
                    # would read these parameters while they are written. Marked as written,
                    # autograd refuses it, as after torch's foreach AdamW (fused marks nothing).
                    torch.autograd.graph.increment_version([a.param for a in active])
                for i in with_master:  # the updates, queued, have written the parameters
                    active[i].slot.param_mark = write_mark(active[i].param)
                # The next step's first copies start in backward, into the places of this
                # step's copy-outs (a step without the overlap leaves none to queue: older
                # chunks' copies would not wait for this step's copy-outs).
                self._next_chunks = chunks if overlap is not None else []
                if overlap is not None:
                    overlap.stepped(
                        (active[seg.index].param, event, chunk.arena.device)
                        for chunk, event in zip(chunks, self._pipeline.updated, strict=True)
                        if event is not None
                        for seg in chunk.segments
                    )
            except BaseException as error:
                self._interrupted = f"step() failed partway through its update ({_name(error)})"
                self._pipeline.join_updates()
                raise
        if overlap is not None and (wrapper := _stepping_wrapper(self)) is not None:
            overlap.stepped_inside(wrapper)

    @_on_the_optimizer
    def overlap_with(
        self, module: torch.nn.Module, blocks: Iterable[torch.nn.Module] = ()
    ) -> ForwardOverlap:
        """Let ``step()`` return before its updates finish, so ``module``'s next forward pass
        overlaps them: each submodule's forward waits (on the device) only for its own
        parameters. Results are bit-identical to an ordinary step.

        ``blocks`` (submodules of ``module`` with a forward of their own, such as a
        transformer's layers) wait for all of their parameters at once; the modules inside a
        block then wait only when called outside its forward. Under ``torch.compile`` every
        wait is a graph break, so fewer waits mean fewer graphs. An FSDP2 unit already waits so.
        For ``torch.compile``, this also makes dynamo check modules' hooks before it reuses code
        compiled for them, in the whole process and for good
        (``torch._dynamo.config.skip_nnmodule_hook_guards = False``), and the first time drops
        what it compiled before (``torch._dynamo.reset_code_caches()``).

        ``zero_grad()``, ``state_dict()``, ``load_state_dict()``, the next ``step()`` and
        ``state_dict()`` of ``module`` or any submodule wait by themselves; call
        :meth:`wait_for_updates` before reading parameters any other way between a step and
        the next forward pass. A backward through a graph recorded before a step that reads
        the weights it saved is refused by autograd (the step marks its parameters written), as
        after torch's foreach AdamW; under FSDP2 it is not: call :meth:`wait_for_updates`
        before it (docs/limitations.md). Returns the hooks' owner; ``.remove()`` it to step
        synchronously again (it waits for the queued updates). Only staged devices (GPUs)
        overlap; CPU parameters are updated in place at once.

        Example::

            optimizer = OffloadAdamW(model.parameters())
            optimizer.overlap_with(model)
        """
        if not self.enabled:
            raise RuntimeError(
                "overlap_with needs enabled=True: a disabled OffloadAdamW steps as "
                "torch.optim.AdamW does, with nothing to overlap"
            )
        # Built (and its arguments checked) before the old overlap goes: an error keeps that.
        overlap = ForwardOverlap(module, self._pipeline, weakref.WeakMethod(self._prefetch), blocks)
        if self._overlap is not None:
            self._overlap.remove()
        self._overlap = overlap
        # The module's hooks must not outlive this optimizer (nor keep its staging buffers).
        if self._overlap_finalizer is not None:
            self._overlap_finalizer.detach()  # the old overlap is removed already
        self._overlap_finalizer = weakref.finalize(self, self._overlap.remove)
        self._plans.clear()
        return self._overlap

    def _choose_resident(self) -> None:
        """Choose the resident state again when the arenas, or the parameters whose first use in
        the forward pass is known, changed since the last choice (a resume lays the state out
        before any forward pass: the choice follows the first one).

        Parameters are taken by first use, then as the param groups list them, never by where
        their state lies: a resumed run (laid out in declaration order) keeps what the
        uninterrupted run (laid out in forward order) keeps.
        """
        resident = self.resident
        arenas = [a for a in self._host.arenas if self._pipeline.stages(a.device)]
        overlap = self._overlapping()
        known = len(overlap.order) if overlap is not None else None
        # Weak references: dead arenas' ids may be reused.
        # The type too: 1 (a byte) == 1.0 (the whole state).
        key = (tuple(weakref.ref(a) for a in arenas), known, type(resident), resident)
        if key == self._resident_for:
            return
        staged = {id(a) for a in arenas}
        slots = self._host.slots
        listed = [p for g in self.param_groups for p in g["params"]]
        first_use = overlap.first_use if overlap is not None else lambda _: 0
        listed.sort(key=first_use)  # stable: ties stay in param-group order
        candidates = (slots[p] for p in listed if p in slots and id(slots[p].arena) in staged)
        # Resident buffers held now are freed by the new choice: "auto" may count them.
        held = self._pipeline.resident_bytes_by_device
        chosen = choose_resident(candidates, budget_bytes(resident, arenas, held))
        ranges = {a: chosen.get(a, ResidentRanges()) for a in arenas}
        if any(a.resident != r for a, r in ranges.items()):
            self._wait_host()  # resident state newer than the host's is written back
            self._plans.clear()  # chunks end where resident ranges do
            self._pipeline.set_resident(ranges)  # may raise: then chosen again at the next step
        self._resident_for = key

    @_outside_inference_mode
    def _prefetch(self) -> None:
        """Queue the copy-in of the last step's first chunks (called after a forward pass).
        The pass may run inside a ``torch.func`` transform (per-sample gradients), which would
        refuse the copies as in-place writes into captured tensors: they copy optimizer state,
        which no transform differentiates or batches, so they run outside it (as torch's own
        RNG state copies do)."""
        if self._interrupted is None and self._next_chunks:
            with torch._C._DisableFuncTorch():
                self._pipeline.prefetch(self._next_chunks)

    def _overlapping(self) -> ForwardOverlap | None:
        overlap = self._overlap
        return overlap if overlap is not None and not overlap.removed else None

    def wait_for_updates(self) -> None:
        """Order the current streams after every update queued so far (on the device; the host
        does not block). Needed only with :meth:`overlap_with`, before reading parameters
        outside a forward pass of the overlapped module."""
        overlap = self._overlapping()
        if overlap is not None:
            overlap.wait_all()

    def _wait_host(self) -> None:
        """Block until the host buffers hold the latest state, the caller's streams ordered
        after every queued update (through the overlap, which then knows they are)."""
        self.wait_for_updates()
        self._pipeline.wait_host()

    @_on_the_optimizer
    def release_device_memory(self) -> None:
        """Free what this optimizer holds on the devices: its staging buffers, the resident
        state (written back to the host first) and its cached views of the parameters, which
        would keep their device memory alive after the module moves (Lightning moves it to the
        CPU after ``fit``, while the Trainer keeps the optimizer). The next ``step()`` allocates
        what it needs again; results do not change. The mixin calls this when training ends.

        Example:
            >>> model = torch.nn.Linear(4, 4)
            >>> opt = OffloadAdamW(model.parameters(), force_staging=True, resident=0.5)
            >>> for _ in range(2):  # resident from the second step on
            ...     model(torch.ones(2, 4)).sum().backward()
            ...     opt.step()
            >>> opt.memory_stats()["resident_bytes"] > 0
            True
            >>> opt.release_device_memory()
            >>> opt.memory_stats()["resident_bytes"], opt.memory_stats()["staging_bytes"]
            (0, 0)
        """
        if not self.enabled:
            return
        self.wait_for_updates()
        self._pipeline.release()
        for slot in self._host.slots.values():
            slot.forget_param()
        self._plans.clear()  # chunks end where resident ranges did
        self._next_chunks = []
        self._resident_for = ()  # chosen again at the next step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's. With overlap, dropping the gradients (``set_to_none=True``, the default)
        needs no wait: the caching allocator keeps their memory until the queued updates have
        read them. Zeroing them in place waits for all queued updates, so the next forward
        pass does not overlap them."""
        if not set_to_none:
            self.wait_for_updates()
        super().zero_grad(set_to_none)

    def _refuse_if_interrupted(self) -> None:
        if self._interrupted is not None:
            raise RuntimeError(
                f"OffloadAdamW: an earlier {self._interrupted}, so parameters and optimizer "
                "state may be partly updated. Restore the model's weights and this optimizer's "
                "state from a checkpoint (load_state_dict) before stepping or saving again."
            )

    def _collect_active(self, unscales: bool) -> tuple[list[_Active], dict[Tensor, Slot]]:
        """Check this step's parameters and gradients (which it writes where it ``unscales``
        them); lay out (not yet adopt) state for new ones."""
        found: list[tuple[Tensor, Tensor, int, Slot | None, Tensor | None]] = []
        new: list[tuple[Tensor, tuple[str, ...]]] = []
        foreign: list[tuple[Tensor, int, int]] = []
        slots, states = self._host.slots, self.state
        listed: dict[int, tuple[int, int]] = {}
        counts: set[int] = set()  # the entries' step counts met so far, by id
        for g, group in enumerate(self.param_groups):
            for position, param in enumerate(group["params"]):
                if listed.setdefault(id(param), (g, position)) != (g, position):
                    raise ValueError(
                        f"{describe(g, position)} is {describe(*listed[id(param)])} again "
                        "(param groups edited by hand?); list each parameter once"
                    )
                if param.grad is None:
                    _count_of_its_own(states.get(param), counts)  # not advanced by another's
                    continue
                check_gradient(param, g, position, unscales)
                part = local(param)  # what this rank updates: itself, or a DTensor's shard
                state = states.get(param)
                slot = slots.get(param)
                if not state:  # a first step, or state cleared since
                    ParamLayout.of(part, describe(g, position))  # refuse a non-dense one by name
                    new.append((param, state_keys(param, group["amsgrad"])))
                    slot = None
                elif slot is None or _written_by_others(state):
                    foreign.append((param, g, position))
                elif group["amsgrad"] and "max_exp_avg_sq" not in slot.arena.keys:
                    raise RuntimeError(
                        f"{describe(g, position)} has no max_exp_avg_sq: amsgrad cannot be "
                        "switched on after the first step"
                    )
                else:
                    self._check_unchanged(param, part, slot, g, position)
                    step = state.get("step")
                    if not is_own_step(step):  # replaced (or deleted) by hand
                        where = f"'step' in optimizer.state for {describe(g, position)}"
                        state["step"] = checked_step(step, where)
                    _count_of_its_own(state, counts)
                found.append((param, part, g, slot, state["step"] if state else None))
        if foreign:
            self._adopt_state(foreign)
            return self._collect_active(unscales)
        # Everything is checked (on every rank alike, for the same parameters): gradients placed
        # unlike their parameters are redistributed now, before anything is allocated.
        grads = [local_grad(param) for param, *_ in found]
        overlap = self._overlapping()
        if new and overlap is not None and overlap.order:  # lay state out in forward order
            new.sort(key=lambda request: overlap.rank(request[0]))
        new_slots = self._host.allocate(new) if new else {}
        active = []
        for (param, part, g, slot, step), grad in zip(found, grads, strict=True):
            if slot is None:
                slot = new_slots[param]
                step = torch.zeros((), dtype=torch.float32, device="cpu")
            flat_param = slot.flat_param(part)
            active.append(_Active(param, slot, g, flat_param, grad, slot.layout.flat(grad), step))
        return active, new_slots

    def _check_unchanged(
        self, param: Tensor, part: Tensor, slot: Slot, group: int, position: int
    ) -> None:
        """Refuse a parameter whose shape, dtype or device changed; follow a stride change
        (``model.to(memory_format=torch.channels_last)``) by reordering its state. ``part`` is
        the parameter's local part (itself, or a DTensor's shard)."""
        layout = slot.layout
        now = (part.shape, part.dtype, part.device, part.stride())
        if now == (layout.shape, layout.dtype, layout.device, layout.stride):
            return
        if now[:3] != (layout.shape, layout.dtype, layout.device):
            raise RuntimeError(
                f"{describe(group, position)} changed since its optimizer state was created: "
                f"it was {layout.describe()} and is now shape {tuple(part.shape)}, strides "
                f"{part.stride()}, dtype {part.dtype}, device {part.device}. Move or cast "
                "the model before creating the optimizer, or create a new optimizer."
            )
        new = ParamLayout.of(part, describe(group, position))
        self._wait_host()
        slot.relayout(new)
        self._pipeline.host_written()

    def _chunk_limit(self, arena: Arena) -> int:
        """Chunks bound the staging and gradient-scratch memory; arenas updated in place with
        no scratch take one chunk, so the fused kernel sees every tensor at once."""
        if self._pipeline.stages(arena.device) or MASTER_KEY in arena.keys:
            return self.chunk_size
        return sys.maxsize

    def _plan(self, active: list[_Active], cache: bool) -> list[Chunk]:
        """The chunk plan for this set of active parameters, from a small LRU cache."""
        overlap = self._overlapping()
        order = overlap.order if overlap is not None else {}
        early = overlap.early if overlap is not None else set()
        version = overlap.early_version if overlap is not None else 0
        key = (*(id(a.slot) for a in active), len(order), version)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = plan_chunks([a.slot for a in active], self._chunk_limit)
        if overlap is not None and (order or early):  # first what the next forward uses first
            plan.sort(key=lambda c: min(overlap.rank(active[s.index].param) for s in c.segments))
        if cache:
            self._plans[key] = plan
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return plan

    @staticmethod
    def _fill_new_state(active: list[_Active], new_slots: dict[Tensor, Slot]) -> None:
        """Zero the moments in freshly allocated slots; a master copy (bf16/fp16 parameters)
        starts as the parameter itself. Fresh memory: nothing of the current state changes."""
        for a in active:
            if a.param in new_slots:
                for key in a.slot.arena.keys:
                    if key == MASTER_KEY:
                        a.slot.view(key).copy_(a.flat_param)
                    else:
                        a.slot.view(key).zero_()

    @staticmethod
    def _steps_on_devices(
        active: list[_Active],
        steps: list[Tensor],
        pin: bool,
        stages: Callable[[torch.device], bool],
    ) -> list[Tensor]:
        """Each step count after this step's increment, on its parameter's device, where the
        fused kernels read it. Host counts are advanced in place only once the update runs, so
        parameters updated in place on the host read ``steps`` themselves; staged ones get
        copies of ``steps + 1`` (pinned with the state, so the copy does not wait for the
        device; where pinning was refused, pageable). ``stages(device)`` says which are staged
        (CPU tests force staging, and so run this path too)."""
        devices = {a.param.device for a in active}
        if not any(stages(device) for device in devices):
            return steps
        stacked = torch.stack(steps).add_(1.0)
        if pin and any(device.type != "cpu" for device in devices):
            stacked = stacked.pin_memory()
        copies = {d: stacked.to(d, non_blocking=True).unbind() for d in devices}
        return [copies[a.param.device][i] for i, a in enumerate(active)]

    def _update_chunk(
        self,
        chunk: Chunk,
        views: dict[str, Tensor],
        active: list[_Active],
        steps: list[Tensor],
        hyper: list[Hyperparameters],
        edited: set[int],
        grad_scales: dict[torch.device, Tensor],
    ) -> None:
        """Apply AdamW to one chunk whose state is in ``views``, one kernel call per param group.
        The master copies of the ``edited`` parameters (indices into ``active``) first take
        their edits. Gradients are unscaled by ``grad_scales[device]`` where given (GradScaler),
        in place, as torch's fused kernel leaves them."""
        grad_scale = grad_scales.get(chunk.arena.device)
        # Segments tile the chunk: each state view is cut into their pieces in one call (the
        # fused kernel does not check that the tensors it pairs have the same sizes).
        if len(chunk.segments) == 1:
            pieces = {key: (view,) for key, view in views.items()}
        else:
            sizes = [seg.stop - seg.start for seg in chunk.segments]
            pieces = {key: view.split_with_sizes(sizes) for key, view in views.items()}
        calls: dict[int, _KernelLists] = {}
        for position, seg in enumerate(chunk.segments):
            a = active[seg.index]
            if a.group not in calls:
                calls[a.group] = _KernelLists()
            lists = calls[a.group]
            lists.add(a, seg.start, seg.stop, position)
            lists.steps.append(steps[seg.index])
            if seg.index in edited:
                lists.edited.append(len(lists.positions) - 1)
        with_master = MASTER_KEY in chunk.arena.keys
        for g, lists in calls.items():
            h = hyper[g]
            targets, grads = lists.params, lists.grads
            if with_master:  # bf16/fp16 params: update the fp32 master, then round
                targets = lists.pieces(pieces[MASTER_KEY])
                grads = lists.pieces(pieces[GRAD_KEY])
                torch._foreach_copy_(grads, lists.grads)
                if lists.edited:
                    take_edits(
                        [targets[i] for i in lists.edited], [lists.params[i] for i in lists.edited]
                    )
            adamw_update(
                targets,
                grads,
                lists.pieces(pieces["exp_avg"]),
                lists.pieces(pieces["exp_avg_sq"]),
                lists.pieces(pieces["max_exp_avg_sq"]) if h.amsgrad else [],
                lists.steps,
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                eps=h.eps,
                weight_decay=h.weight_decay,
                amsgrad=h.amsgrad,
                maximize=h.maximize,
                decoupled_weight_decay=h.decoupled_weight_decay,
                grad_scale=grad_scale,
            )
            if with_master:
                torch._foreach_copy_(lists.params, targets)
                if grad_scale is not None:  # the unscaled gradients, rounded
                    torch._foreach_copy_(lists.grads, grads)

    # ------------------------------------------------------------ checkpoints
    @_outside_inference_mode
    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format, loadable by it: per parameter ``step``, ``exp_avg``,
        ``exp_avg_sq`` (and ``max_exp_avg_sq``), plus ``master_param`` for bf16/fp16 params.

        The moments are fp32 views of the host buffers, as torch returns references to its state
        (what is written through them before the next ``step()`` is what that step uses; unlike
        torch's they do not follow later steps, so clone them to keep them past one), each with
        a storage of its own span (pickle writes a tensor's whole storage);
        for DTensor parameters they are DTensors with the parameter's mesh, placements, global
        shape and stride over this rank's host buffers, as torch AdamW's DTensor state is.
        """
        if self.enabled:
            self._refuse_if_interrupted()
            self._adopt_state(self._foreign_entries())
        return super().state_dict()  # the offloaded state is added by _add_offloaded_state

    @staticmethod
    def _add_offloaded_state(self: OffloadAdamW, state_dict: dict) -> dict:
        """state_dict post-hook (registered first): put the host state back under torch's keys."""
        if not self.enabled:
            return state_dict
        state_dict[FORMAT_KEY] = FORMAT_VERSION  # torch's AdamW ignores extra top-level keys
        self._wait_host()
        # The caller may write through the views until the next step (a checkpoint loaded in
        # place), also after the next forward pass.
        self._pipeline.lend_host_views()
        for slot in self._host.slots.values():  # masters written through the views may not
            slot.param_mark = None  # round to the weights: compared at the next step
        saved_params = (i for group in state_dict["param_groups"] for i in group["params"])
        params = (p for group in self.param_groups for p in group["params"])
        for index, param in zip(saved_params, params, strict=True):
            slot = self._host.slots.get(param)
            if state_dict["state"].get(index) and slot is not None:
                views = _views(param, slot, self._host.lend)
                state_dict["state"][index] = {**state_dict["state"][index], **views}
        return state_dict

    @_on_the_optimizer
    @_outside_inference_mode
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer or of ``torch.optim.AdamW``.

        Moments are copied straight into host buffers as fp32 (never through the device, never
        cast to a bf16 parameter's dtype). When every parameter keeps its layout they are
        written into the current buffers, so the state is never held twice (a distributed
        checkpoint loaded into this optimizer's own ``state_dict()`` costs no copy at all);
        the tensors of an earlier ``state_dict()`` then show the loaded state, and loading
        them again is refused (torch's would keep theirs: deep-copy one to keep it).
        State keys may be ints or parameter names, as long as the param groups list the same
        keys. For DTensor parameters each rank keeps its shard of DTensors sharded like the
        parameter, of replicated DTensors and of full tensors; other shardings are refused on
        every rank alike, without collectives.

        Load pre-hooks run first and may edit anything; then the dict is checked whole, and a
        refused dict leaves the optimizer unchanged. Post-hooks run last and see the loaded
        state. Loading also clears the refusal that follows an interrupted step.
        """
        if not self.enabled:
            super().load_state_dict(state_dict)
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        state_dict = state_dict.copy()  # shallow, as torch's: hooks may edit it
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        matched = match_loaded_state(state_dict, self.param_groups)
        stripped = {
            "state": {
                index: {k: v for k, v in entry.items() if k not in OFFLOADED_KEYS}
                if isinstance(entry, dict)
                else entry
                for index, entry in state_dict["state"].items()
            },
            # Without ``fused``, torch's cast leaves step counts where they are instead of
            # moving each to its parameter's device (they are kept on the host).
            "param_groups": [
                {k: v for k, v in group.items() if k != "fused"}
                for group in state_dict["param_groups"]
            ],
        }
        # Load hooks run here, around the whole load; a Ctrl-C or a notice waits for it.
        with signals_held(), self._load_hooks_suspended():
            self._write_state(
                matched, replace=True, then=partial(super().load_state_dict, stripped)
            )
            self._interrupted = None
            for group in self.param_groups:
                _record_fused(group)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _foreign_entries(self) -> list[tuple[Tensor, int, int]]:
        """Parameters whose ``optimizer.state`` entry holds state others wrote there."""
        return [
            (param, g, position)
            for g, group in enumerate(self.param_groups)
            for position, param in enumerate(group["params"])
            if (entry := self.state.get(param)) and _written_by_others(entry)
        ]

    def _adopt_state(self, entries: list[tuple[Tensor, int, int]]) -> None:
        """Move state found in ``optimizer.state`` into host buffers, checked as a load is. Keys
        that still hold :class:`Offloaded` marks (one moment replaced by hand) keep their values."""
        if not entries:
            return
        matched = []
        for param, g, position in entries:
            entry, slot = self.state[param], self._host.slots.get(param)
            views = _views(param, slot) if slot is not None else {}
            # Views of the buffers themselves: written in place, never copied.
            kept = {k: v for k, v in views.items() if isinstance(entry.get(k), Offloaded)}
            where = f"{describe(g, position)} (found in optimizer.state)"
            amsgrad = self.param_groups[g]["amsgrad"]
            matched.append(check_entry({**entry, **kept}, param, amsgrad, where))
        self._write_state(matched, replace=False)

    def _write_state(
        self, matched: list[LoadedEntry], *, replace: bool, then: Callable[[], Any] = lambda: None
    ) -> None:
        """Write checked entries into host buffers, calling ``then`` (torch's own load) before
        anything of this optimizer changes.

        The current buffers are written in place, after ``then``, when every parameter keeps its
        layout and no source overlaps another parameter's buffers: the state is then never held
        twice. Else new buffers are filled before ``then`` runs. Views an earlier
        ``state_dict()`` lent then show the loaded state: loading them again is refused, as
        they no longer hold the moments of their own step counts. A failure before the in-place
        writes leaves everything as it was; one during them leaves a mix, so the optimizer
        refuses to step until the next load. Afterwards the entries' ``optimizer.state`` holds
        their step counts, as float32 host copies, and :class:`Offloaded` marks; ``replace``
        drops every other slot.
        """
        for m in matched:
            for key, tensor in m.local.items():
                if self._host.was_written_over(tensor):
                    raise ValueError(
                        f"'{key}' for {describe(*self._place(m.param))} views this optimizer's "
                        "host buffers as an earlier state_dict() returned them, and a "
                        "load_state_dict() has written other state into them since (loads "
                        "write in place, so the state is never held twice). Keep a state dict "
                        "across a load as a copy: copy.deepcopy(optimizer.state_dict())"
                    )
        self._wait_host()  # the sources may be views of this optimizer's own buffers
        if replace:  # a load (adopted entries keep their own master copies as they are)
            self._drop_stale_masters(matched)
        requests = [(m.param, state_keys(m.param, m.amsgrad)) for m in matched]
        # A load of some parameters only would keep the others' buffers alive with nothing in them.
        whole = not replace or len(requests) == len(self._host.slots)
        slots = self._host.reusable(requests) if whole else None
        copies = self._loaded_copies(matched, slots) if slots is not None else None
        if copies is None or self._host.overlaps(*(src for _, src in copies)):
            slots = self._host.allocate(requests)
            _copy_all(self._loaded_copies(matched, slots))
            copies = []
        with signals_held():  # signals wait (load_state_dict holds them already)
            then()  # torch's own load first: it may still refuse, and leaves the buffers alone
            try:
                self._pipeline.host_written()  # resident state is reloaded from the host
                if copies:
                    self._host.written_over(t for m in matched for t in m.local.values())
                _copy_all(copies)
                if replace:
                    self._host.replace(slots)
                else:
                    self._host.adopt(slots)
                self._plans.clear()
                self._next_chunks = []  # they may hold arenas just dropped (and their buffers)
                for m in matched:
                    self._mark_offloaded(m.param, slots[m.param], m.step)
            except BaseException as error:
                what = "load_state_dict()" if replace else "adopting state found in .state"
                self._interrupted = f"{what} failed partway through writing it ({_name(error)})"
                raise

    def _place(self, param: Tensor) -> tuple[int, int]:
        """``param``'s param group and position in it, for an error message."""
        groups = enumerate(self.param_groups)
        return next(
            (g, i) for g, group in groups for i, p in enumerate(group["params"]) if p is param
        )

    def _drop_stale_masters(self, matched: list[LoadedEntry]) -> None:
        """Take the master copy from the parameter where the loaded one is this optimizer's own
        buffer and does not round to the parameter.

        A distributed checkpoint is loaded into the tensors of ``state_dict()``, master copies
        included; one written by ``torch.optim.AdamW`` has none (read with
        ``allow_partial_load``), which leaves in our buffer the master of the fake step DCP
        made before the model's weights were loaded. Those weights are the truth then, as when a
        torch AdamW state dict is loaded directly.
        """
        stale = 0
        for m in matched:
            slot, master = self._host.slots.get(m.param), m.local.get(MASTER_KEY)
            if slot is None or master is None or MASTER_KEY not in slot.arena.keys:
                continue
            own = slot.layout.flat(master).data_ptr() == slot.view(MASTER_KEY).data_ptr()
            if own and not _rounds_to(master, local(m.param)):
                m.local = {k: v for k, v in m.local.items() if k != MASTER_KEY}
                stale += 1
        if stale:
            warnings.warn(
                f"OffloadAdamW: the fp32 master copies of {stale} parameter(s) were loaded in "
                "place but do not round to the parameters (a distributed checkpoint without "
                "master copies, such as torch.optim.AdamW's, read with allow_partial_load); "
                "they are taken from the parameters. Load the model's weights before the "
                "optimizer's.",
                stacklevel=4,
            )

    @staticmethod
    def _loaded_copies(
        matched: list[LoadedEntry], slots: dict[Tensor, Slot]
    ) -> list[tuple[Tensor, Tensor]]:
        """(destination, source) flat pairs for the loaded tensors, less those that already are
        their destination (a load of this optimizer's own ``state_dict()``)."""
        copies = []
        for m in matched:
            slot = slots[m.param]
            for key in slot.arena.keys:
                # A torch AdamW checkpoint has no master copy: it is the parameter itself.
                source = m.local.get(key, local(m.param).detach() if key == MASTER_KEY else None)
                if source is None:
                    continue
                source, destination = slot.layout.flat(source), slot.view(key)
                same = (source.data_ptr(), source.dtype) == (
                    destination.data_ptr(),
                    slot.arena.dtype,
                )
                if not (same and source.is_contiguous()):
                    copies.append((destination, source))
        return copies

    def _mark_offloaded(self, param: Tensor, slot: Slot, step: Tensor) -> None:
        """Record ``param``'s step count and mark its offloaded keys in ``optimizer.state``."""
        entry = self.state[param]
        entry["step"] = step
        slot.param_mark = None  # the parameter may not round from the master copy now
        for key in OFFLOADED_KEYS:
            entry.pop(key, None)
        entry.update({key: Offloaded(key) for key in slot.arena.keys})

    @contextlib.contextmanager
    def _load_hooks_suspended(self) -> Iterator[None]:
        pre = self._optimizer_load_state_dict_pre_hooks
        post = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            yield
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre
            self._optimizer_load_state_dict_post_hooks = post

    # ------------------------------------------------------------ copy and pickle
    def __copy__(self) -> OffloadAdamW:
        """Refused where enabled: torch's shallow copy shares ``state`` with the original,
        which here would share the step counts but not the host buffers holding the moments
        (their hooks and finalizers belong to one object): half a share, stepping to other
        numbers than torch's. Disabled, torch's shallow copy."""
        if self.enabled:
            raise TypeError(
                "copy.copy(OffloadAdamW) is not supported: use copy.deepcopy(optimizer) for an "
                "independent optimizer, or the optimizer itself to share one"
            )
        copied = type(self).__new__(type(self))
        copied.__setstate__(self.__getstate__())
        return copied

    def __getstate__(self) -> dict[str, Any]:
        """torch's optimizer state, this optimizer's settings, and its host buffers whole (so
        ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the optimizer keep the moments)."""
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in _SETTINGS})
        if self.enabled:
            self._wait_host()
            members: dict[int, list[tuple[Tensor, int, ParamLayout]]] = {
                id(a): [] for a in self._host.arenas
            }
            for param, slot in self._host.slots.items():
                members[id(slot.arena)].append((param, slot.offset, slot.layout))
            state["offloaded"] = [(a.buffers, members[id(a)]) for a in self._host.arenas]
            state["interrupted"] = self._interrupted
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "offloaded" not in state and "_host" in self.__dict__:
            super().__setstate__(state)  # torch's load_state_dict installing the loaded state
            return
        state = dict(state)
        state.setdefault("staging_pool", None)  # pickled before the setting existed
        for name in _FIXED_SETTINGS:
            setattr(self, f"_{name}", state.pop(name))
        resident = state.pop("resident", None)  # None: pickled before the setting existed
        offloaded = state.pop("offloaded", [])
        interrupted = state.pop("interrupted", None)
        super().__setstate__(state)
        self.resident = resident
        self._start_offload()
        self._interrupted = interrupted
        requests, sources = [], []
        for buffers, members in offloaded:
            for param, offset, layout in members:
                requests.append((param, tuple(buffers)))
                sources.append((param, buffers, offset, layout))
        slots = self._host.allocate(requests)
        for param, buffers, offset, layout in sources:  # into buffers of its own, never aliased
            slot = slots[param]
            for key, buffer in buffers.items():
                # The saved memory order may predate a stride change not yet followed.
                saved = layout.unflat(buffer[offset : offset + layout.numel])
                slot.view(key).copy_(slot.layout.flat(saved))
        self._host.adopt(slots)

    # ------------------------------------------------------------ inspection
    def offloaded_state(self, param: Tensor) -> dict[str, Tensor]:
        """A copy of ``param``'s offloaded state, shaped like it: ``exp_avg``, ``exp_avg_sq``,
        ``max_exp_avg_sq`` (amsgrad) and ``master_param`` (bf16/fp16 params), all fp32 on the host
        (for a DTensor parameter, DTensors sharded like it over copies of this rank's shards).

        Copies, so inspecting never changes training; ``{}`` before the parameter's first step.
        """
        if not self.enabled:
            return {k: v.clone() for k, v in self.state.get(param, {}).items() if k != "step"}
        entry = self.state.get(param)
        if entry and _written_by_others(entry):
            self._adopt_state(self._foreign_entries())
        slot = self._host.slots.get(param)
        if slot is None or not self.state.get(param):
            return {}
        self._wait_host()
        return {key: view.clone() for key, view in _views(param, slot).items()}

    @property
    def last_step(self) -> StepRecord | None:
        """Timing and bytes moved of the latest step; ``poll()`` or ``resolve()`` it to read.

        Recorded with events, so reading it later costs the step nothing.
        """
        return self._pipeline.last_record

    def take_copies_between_steps(self) -> StepRecord:
        """The copies queued since the latest step, which the next step's record would
        include: those of the next step's first chunks queued during a forward pass, and
        resident state written back to the host (for a checkpoint, or by
        :meth:`release_device_memory`). Taken out of the next step's record: a monitor counts
        them so when training ends and no step follows."""
        return self._pipeline.take_between_steps()

    def memory_stats(self) -> dict[str, int | bool]:
        """Memory the optimizer holds, in bytes.

        ``state_bytes``: logical bytes of state (what would otherwise sit on the device);
        ``host_bytes``: bytes the host buffers occupy (page-rounded when pinned);
        ``pinned``: whether they are page-locked; ``staging_bytes``: staging buffers and fp32
        gradient scratch, on the parameters' devices (on the host for CPU parameters), those
        of its ``staging_pool`` where it was given one (shared with the pool's optimizers);
        ``resident_bytes``: state kept on the devices (``resident=``).
        """
        return {
            "state_bytes": self._host.logical_bytes,
            "host_bytes": self._host.allocated_bytes,
            "pinned": self._host.pinned,
            "staging_bytes": self._pipeline.staging_bytes,
            "resident_bytes": self._pipeline.resident_bytes,
        }


def _snapshot_lr(hyper: Hyperparameters, pipeline: StagingPipeline) -> Hyperparameters:
    """``hyper`` with a tensor lr copied now, on the caller's stream."""
    lr = hyper.lr
    if not isinstance(lr, Tensor):
        return hyper
    snapshot = lr.clone()
    pipeline.used_by_update(snapshot)
    return dataclasses.replace(hyper, lr=snapshot)


def _edited_since_last_step(
    active: list[_Active], with_master: list[int], new_slots: dict[Tensor, Slot]
) -> set[int]:
    """Those of the ``with_master`` indices into ``active`` whose parameter someone else wrote
    since this optimizer last did (or whose state was loaded since: a checkpoint's weights may
    have been loaded into the model after its optimizer state), less those laid out just now."""
    return {
        i
        for i in with_master
        if active[i].slot.param_mark != write_mark(active[i].param)
        and active[i].param not in new_slots
    }


def _rounds_to(master: Tensor, param: Tensor) -> bool:
    """Whether every element of ``master`` rounds to ``param``'s, a NaN to a NaN (an element
    that diverged leaves the rest of the master copy valid)."""
    rounded, param = master.to(param.dtype), param.detach().cpu()
    return bool(((rounded == param) | (rounded.isnan() & param.isnan())).all())


def _views(
    param: Tensor, slot: Slot, lend: Callable[[Tensor], Tensor] = lambda view: view
) -> dict[str, Tensor]:
    """``param``'s state by key: views of the host buffers shaped like the parameter (for a
    DTensor parameter, DTensors like it over this rank's shards), each passed through ``lend``."""
    return {
        key: like_param(param, lend(slot.layout.unflat(slot.view(key)))) for key in slot.arena.keys
    }


def _count_of_its_own(entry: dict[str, Any] | None, counts: set[int]) -> None:
    """Give ``entry`` a copy of its step count where an entry met before (whose count is in
    ``counts``) holds the same tensor: one tensor written into several entries by hand (a
    bias-correction reset) would be advanced once per parameter holding it. torch's AdamW does
    advance it so, group by group (on CUDA its increment of a repeated tensor is a race), and
    keeps it shared on loading only where it is float32 on the parameter's device."""
    step = entry.get("step") if entry else None
    if not isinstance(step, Tensor):
        return
    if id(step) in counts:
        entry["step"] = step = step.clone()
    counts.add(id(step))


def _written_by_others(entry: dict[str, Any]) -> bool:
    """Whether an ``optimizer.state`` entry holds state this optimizer did not write there (it
    marks its own with :class:`Offloaded`): ``ZeroRedundancyOptimizer.load_state_dict`` writes
    loaded state straight into the inner optimizer's ``state``, and users reset or replace
    moments by hand."""
    for key, value in entry.items():  # a loop, not all(): it runs per parameter and step
        if key in _OFFLOADED and not isinstance(value, Offloaded):
            return True
    return "exp_avg" not in entry


_OFFLOADED = frozenset(OFFLOADED_KEYS)


def _name(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _copy_all(copies: list[tuple[Tensor, Tensor]]) -> None:
    for destination, source in copies:
        destination.copy_(source)


def _record_fused(group: dict[str, Any]) -> None:
    """Mark a group ``fused=True`` (the kernel this optimizer runs) where torch's fused AdamW
    could take over its parameters, so a ``torch.optim.AdamW`` loading the saved groups runs
    that kernel too instead of its default implementation (not where a loaded group says
    ``differentiable=True``, which torch's fused AdamW refuses). A loaded ``foreach=True``
    goes back to None, as torch's constructor refuses it beside ``fused=True``."""
    if not group.get("differentiable") and all(p.is_floating_point() for p in group["params"]):
        group["fused"] = True
        if group.get("foreach"):
            group["foreach"] = None


class _KernelLists:
    """The per-segment tensors of one fused-kernel call."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.positions: list[int] = []  # the segments' positions in the chunk
        self.steps: list[Tensor] = []
        self.edited: list[int] = []  # positions in these lists of edited parameters' segments

    def add(self, a: _Active, start: int, stop: int, position: int) -> None:
        whole = start == 0 and stop == a.slot.layout.numel  # no new view object needed
        self.params.append(a.flat_param if whole else a.flat_param[start:stop])
        self.grads.append(a.flat_grad if whole else a.flat_grad[start:stop])
        self.positions.append(position)

    def pieces(self, chunk_pieces: tuple[Tensor, ...]) -> list[Tensor]:
        """This call's pieces of one state key, from the chunk's pieces of it."""
        return [chunk_pieces[i] for i in self.positions]


def _unscaled_into_copied_grads(chunk: Chunk, active: list[_Active], left: dict[int, int]) -> None:
    """A gradient laid out unlike its parameter is updated (unscaled) as a flat copy: once the
    chunks have unscaled all of it (``left``: elements still to do, by index into ``active``),
    the copy goes back into the gradient it was made from (``param.grad``, which GradScaler's
    callers read unscaled after ``step()``, or a redistributed one), as torch's fused AdamW
    leaves it."""
    for seg in chunk.segments:
        if seg.index in left:
            left[seg.index] -= seg.stop - seg.start
            if not left[seg.index]:
                a = active[seg.index]
                a.grad.copy_(a.slot.layout.unflat(a.flat_grad))


def _grad_copied(a: _Active) -> bool:
    """Whether the flat gradient the update reads is a copy (laid out unlike the parameter)."""
    return a.flat_grad.untyped_storage().data_ptr() != a.grad.untyped_storage().data_ptr()


def _torch_adamw_step(optimizer: torch.optim.AdamW) -> None:
    """torch.optim.AdamW.step itself, without running the optimizer's step hooks a second time."""
    step = torch.optim.AdamW.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)
