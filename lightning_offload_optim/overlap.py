"""Let the next forward pass start while the optimizer step is still updating parameters.

With overlap on, :meth:`OffloadAdamW.step` queues each chunk's update on a side stream of the
device and returns without waiting. :class:`ForwardOverlap` then orders whoever reads the
parameters after their update, on the device (the host never blocks):

- each module's forward pre-hook makes the current stream wait for the last update of the
  module's own parameters (so the first layers compute while later layers' state still
  streams); it runs before other pre-hooks, FSDP2's all-gather among them;
- parameters that no hook reaches in the forward passes (owned by no module of the tree, or
  read by a parent) are updated first, and the caller's stream waits for them as soon as the
  step is queued; every module's ``state_dict`` pre-hook waits for all (checkpoints, of the
  whole model or a part), as does every module's ``load_state_dict`` pre-hook (a load writes
  the parameters);
- the first gradient the next backward pass computes for any parameter of the module (or any
  stepped one) waits for all updates: the backward may write gradients the updates still
  read, and not only where a gradient was kept: ``DistributedDataParallel(
  gradient_as_bucket_view=True)`` zeroes and all-reduces its persistent gradient buckets, the
  slots of parameters the forward skipped included, as soon as the first gradient arrives
  (under FSDP2 it never fires: autograd sees the unsharded parameters, and each unit's
  forward pre-hook has waited for the updates that read its sharded gradients already);
- ``zero_grad(set_to_none=False)``, ``load_state_dict`` and reads of the host state wait for
  everything (the optimizer calls :meth:`ForwardOverlap.wait_all` or the pipeline does), and
  the next ``step()`` queues its updates after these on the same stream;
- anything else that reads parameters outside a forward pass must call
  ``optimizer.wait_for_updates()`` first.

The first forward pass records the order in which parameters are first used; later steps
update chunks in that order, so the parameters the forward needs first are ready first. After
each forward pass of the module the copies of the next step's first chunks are queued, so they
run during the backward pass.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from lightning_offload_optim.sharding import is_part_of_a_larger_tensor, write_mark

if TYPE_CHECKING:
    from lightning_offload_optim.pipeline import StagingPipeline


_WRITTEN_WARNING = (
    "OffloadAdamW: {count} parameter(s) were written in place after a step queued their updates "
    "and before anything waited for them (a clamp or re-initialisation right after step()?): "
    "on a GPU the write and the update race, and the result is undefined. Call "
    "optimizer.wait_for_updates() before writing parameters outside a forward pass."
)

_UNHOOKED_WARNING = (
    "OffloadAdamW: no forward hook of the overlapped module ran before the last two steps, so "
    "they could not overlap a forward pass (each waited for its own updates). Is the module "
    "given to overlap_with() the one training calls, and called as module(x), not "
    "module.forward(x)?"
)

_WRAPPED_WARNING = (
    "OffloadAdamW: step() runs inside {wrapper}.step(), which may read or write the parameters "
    "as soon as it returns (ZeroRedundancyOptimizer broadcasts them, PostLocalSGDOptimizer "
    "averages them), where no hook can order it after the queued updates: each step now waits "
    "for its own updates, and overlap_with() saves nothing under this wrapper."
)


def _write_mark(param: Tensor) -> tuple[int, int, int]:
    """``write_mark``, less the version counters of a part of a larger tensor (a view of one
    flat buffer holding many parameters), which writes to any other part move; where its
    memory is still tells a replacement (``p.data = ...``)."""
    if is_part_of_a_larger_tensor(param):
        return 0, 0, param.data_ptr()
    return write_mark(param)


def _warn_at_the_callers_line(message: str) -> None:
    """``warnings.warn(message)`` attributed to the first frame outside this package, torch and
    Lightning: the user's line that stepped, ran the forward or called ``fit`` (the depth from
    the hook or the step varies with the wrappers in between)."""
    inside = tuple(
        str(Path(module.__file__).parent) + os.sep
        for module in (sys.modules["lightning_offload_optim"], torch, sys.modules.get("lightning"))
        if module is not None and module.__file__ is not None
    )
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, stacklevel=level if frame is not None else 2)


class ForwardOverlap:
    """The forward hooks of one module for one optimizer's pipeline, and the events they wait
    for. It holds the pipeline, not the optimizer: the module's hooks keep it alive, and they
    must not keep the optimizer's host buffers alive with it.

    A module's hook waits for the parameters it owns directly, and an FSDP2 unit's for every
    parameter of the unit (its all-gather reads them all). Parameters that no hook reached during
    the training forward passes before a step (a parent reads them, as
    ``nn.MultiheadAttention`` reads ``out_proj.weight``; the root's own when only a child is
    called, as a Lightning ``training_step`` does; parameters outside the tree) may be read
    before any hook runs: they are updated first, and the caller's stream waits for them as
    soon as the step is queued. So are those read before their own module's hook ran in the
    same pass, found by watching the forward passes before the first step (:class:`_ReadWatch`).
    Before a forward pass has been seen, it waits for everything.
    """

    def __init__(
        self,
        module: nn.Module,
        pipeline: StagingPipeline,
        prefetch: weakref.WeakMethod[Callable[[], None]] | None = None,
        blocks: Iterable[nn.Module] = (),
    ) -> None:
        self._pipeline = pipeline
        self._prefetch = prefetch
        self.removed = False
        #: Per parameter, the event after which its latest update is done (and its device).
        self.pending: dict[Tensor, tuple[Any, torch.device]] = {}
        #: Per parameter whose update the caller's stream has not waited for yet, its
        #: ``_write_mark`` when the update was queued: a write since then raced with the update.
        self._unordered: dict[Tensor, tuple[int, int, int]] = {}
        #: Parameters by first use in a forward pass, once one has run.
        self.order: dict[Tensor, int] = {}
        self._count = sum(1 for _ in module.parameters())  # order is complete at this size
        self._reached: set[int] = set()  # ids of parameters whose hook ran since the last step
        self._reached_in_pass: set[int] = set()  # ... in the watched pass now running
        # By parameter id, the handle of its gradient hook. Not the parameters, not even weakly:
        # torch.utils.swap_tensors (Module.to with swapping on, always for DTensors) refuses
        # weakly referenced ones.
        self._gradient_hooks: dict[int, RemovableHandle] = {}
        self.early: set[int] = set()  # ids of parameters no hook reached: updated first
        #: ids of the module's parameters an op read before their hook ran (see _ReadWatch).
        self.read_before_hook: set[int] = set()
        #: Parameters that compiled code read while watched, to note at the next hook or end.
        self._traced_reads: list[Tensor] = []
        self._module_params = {id(p) for p in module.parameters()}
        self._watch = _ReadWatch(self)  # notes reads until the first step
        self.early_version = 0  # changes whenever ``early`` does (chunk plans depend on it)
        self._unhooked_steps = 0  # steps in a row with no hook run since the one before
        self._wrapper_warned = False  # stepped inside another optimizer's step
        self._handles = []
        #: Per FSDP2 unit (by id), the parameters its all-gather reads.
        self._unit_params: dict[int, list[Tensor]] = {}
        blocks = _check_blocks(module, blocks)
        _refuse_script_modules(module)
        _guard_on_module_hooks()
        try:
            self._install_hooks(module, blocks)
        except BaseException:  # a hook torch refused: none of them stays on the module
            for handle in self._handles:
                handle.remove()
            raise

    def _install_hooks(self, module: nn.Module, blocks: set[int]) -> None:
        """Hook each submodule's forward, the saves and loads of any of them, and the
        parameters' gradients (handles in ``_handles``)."""
        in_units: set[int] = set()  # modules inside FSDP2 units: the unit's hook waits for them
        in_blocks: dict[int, _BlockRun] = {}  # modules inside blocks: their block's run
        for child in module.modules():  # parents first
            if _is_fsdp2_unit(child):
                params = self._unit_params[id(child)] = _unit_parameters(child)
                in_units.update(id(m) for m in child.modules())
                self._hook_forward(child, self._waits_for(params, child))
            elif id(child) in in_units:
                continue
            elif id(child) in in_blocks:
                self._hook_inside_block(child, in_blocks[id(child)])
            elif id(child) in blocks:
                run = _BlockRun()
                in_blocks.update((id(m), run) for m in child.modules() if m is not child)
                self._hook_block(child, run)
            elif params := list(child.parameters(recurse=False)):
                self._hook_forward(child, self._waits_for(params))

        def before_save(_module: nn.Module, prefix: str, *_: Any) -> None:
            # The module saved (no prefix) waits; its submodules then find nothing pending.
            # (Functions, not methods: a deep copy of the module shares them.)
            if prefix:
                self._join_if_pending()
            else:
                self.wait_all()

        def before_load(*_: Any) -> None:
            self._join_if_pending()

        # Any module's: a submodule saved alone (a backbone, an adapter), and the module a
        # wrapper saves instead of itself (Fabric's reads the one it wraps). A load writes the
        # parameters: after their updates.
        for child in module.modules():
            self._handles.append(child.register_state_dict_pre_hook(before_save))
            self._handles.append(child.register_load_state_dict_pre_hook(before_load))
        self._hook_gradients(module.parameters())
        after_forward, begin, end = map(
            _eager, (self._after_forward, self.begin_watch, self.end_watch)
        )
        self._handles.append(module.register_forward_hook(lambda *_: after_forward()))
        # Ahead of the module's own waiting hook, which marks its parameters reached this pass.
        self._handles.append(module.register_forward_pre_hook(lambda *_: begin(), prepend=True))
        self._handles.append(module.register_forward_hook(lambda *_: end(), always_call=True))

    def _waits_for(self, params: list[Tensor], unit: nn.Module | None = None) -> Callable[[], None]:
        """:meth:`_before_forward` for ``params``, run as Python under ``torch.compile``."""
        return _eager(functools.partial(self._before_forward, params, unit))

    def _hook_forward(self, module: nn.Module, hook: Callable[[], None]) -> None:
        """Run ``hook`` before ``module``'s forward, ahead of its other pre-hooks (FSDP2's)."""
        self._handles.append(module.register_forward_pre_hook(lambda _m, _a: hook(), prepend=True))

    def _hook_block(self, block: nn.Module, run: _BlockRun) -> None:
        """A block waits for all of its parameters (less those of FSDP2 units in it) and counts
        its running forward passes, during which its submodules need not wait."""
        wait = functools.partial(self._before_forward, _subtree_parameters([block]), None)

        def enter() -> None:
            run.running += 1
            wait()

        def leave(*_: Any) -> None:
            run.running -= 1

        self._hook_forward(block, _eager(enter))  # the count too: traced, a change would lag
        self._handles.append(block.register_forward_hook(_eager(leave), always_call=True))

    def _hook_inside_block(self, module: nn.Module, run: _BlockRun) -> None:
        """A module inside a block waits for its own parameters only when called outside the
        block's forward (between a step and the next forward, or before its block in a pass).
        The check is traced under ``torch.compile`` (a guard on ``run.running``): inside the
        block's compiled forward it is no graph break."""
        params = list(module.parameters(recurse=False))
        if params:
            self._hook_forward(
                module, functools.partial(_unless_running, run, self._waits_for(params))
            )

    def _after_forward(self) -> None:
        prefetch = self._prefetch() if self._prefetch is not None else None
        if prefetch is not None:
            prefetch()

    def _before_forward(self, params: list[Tensor], unit: nn.Module | None) -> None:
        if len(self.order) < self._count:  # until every parameter has been seen
            for param in params:
                self.order.setdefault(param, len(self.order))
        if torch.is_grad_enabled():  # a training forward (evaluation may call other modules)
            self._reached.update(id(p) for p in params)
        if self.watching:  # what this pass reads from here on is read after the hook
            self._note_traced_reads()
            self._reached_in_pass.update(id(p) for p in params)
        if not self.pending:
            return
        self._wait(p for p in params if p in self.pending)
        if unit is not None:
            self._order_all_gathers(unit, params)

    def _wait(self, params: Iterable[Tensor], stream: Any = None) -> None:
        """Make ``stream`` (the caller's current one by default) wait for the last updates of
        those of ``params`` that have one pending."""
        seen = set()
        params = list(params)
        if stream is None:
            self._ordered(params)
        for param in params:
            event, device = self.pending.get(param, (None, None))
            if event is not None and id(event) not in seen:
                seen.add(id(event))
                self._pipeline.caller_waits(event, device, stream)

    def _order_all_gathers(self, unit: nn.Module, params: list[Tensor]) -> None:
        """FSDP2 copies a unit's shards into its all-gather on streams of its own, which wait
        for the caller's stream only in the root's pre-forward: make them wait for this unit's
        updates, and for those of the units it prefetches (``set_modules_to_forward_prefetch``),
        before the unit's pre-forward queues those copies; the caller's stream waits for the
        prefetched units' updates as well. Where FSDP2's streams cannot be found (they are
        private), the caller's stream waits for every update instead, which orders the root's
        all-gathers after all of them."""
        streams, prefetched = _all_gather_streams(unit)
        if streams is None:
            self.wait_all()
            return
        ahead = [p for u in prefetched for p in self._unit_params.get(id(u), ())]
        for stream in streams:
            self._wait([*params, *ahead], stream)
        # An asynchronous unshard (FSDP2's ``unshard_async_op``) copies on the caller's stream.
        self._wait(ahead)

    def first_use(self, param: Tensor) -> int:
        """Where ``param`` was first used in the forward passes seen; after all of them if
        never."""
        return self.order.get(param, len(self.order))

    def rank(self, param: Tensor) -> int:
        """Where ``param``'s update goes: parameters read before any hook first, then by first
        use in the forward pass, then the rest."""
        return -1 if id(param) in self.early else self.first_use(param)

    def stepped(self, updates: Iterable[tuple[Tensor, Any, torch.device]]) -> None:
        """A step queued these updates (parameter, event after its update, device); order the
        caller's stream after those of parameters no hook reached in the training forward
        passes before it, or in any before (they stay "early": read before any hook)."""
        current = {param: (event, device) for param, event, device in updates}
        self.pending.update(current)  # a parameter without a gradient keeps its last event
        self._unordered.update((param, _write_mark(param)) for param in current)
        self._hook_gradients(current)  # parameters unfrozen or outside the module since
        reached, self._reached = self._reached, set()
        if not reached:  # no forward pass seen: nothing is known to wait later (nor watched)
            self._unhooked_steps += 1
            if self._unhooked_steps == 2:
                _warn_at_the_callers_line(_UNHOOKED_WARNING)
            self.wait_all()
            return
        self._unhooked_steps = 0
        self._note_traced_reads()
        self._watch.stopped = True  # nothing was pending before this step; now it is
        unreached = {
            id(p) for p in current if id(p) not in reached or id(p) in self.read_before_hook
        }
        if not unreached <= self.early:
            self.early |= unreached
            self.early_version += 1
        self._wait(p for p in current if id(p) in self.early)

    def stepped_inside(self, wrapper: str) -> None:
        """The step just queued ran inside another optimizer's ``step`` (``wrapper``): order the
        caller's stream after its updates at once (warned about once)."""
        if not self._wrapper_warned:
            self._wrapper_warned = True
            _warn_at_the_callers_line(_WRAPPED_WARNING.format(wrapper=wrapper))
        self.wait_all()

    def _hook_gradients(self, params: Iterable[Tensor]) -> None:
        """Hook :meth:`_before_gradient` on those of ``params`` that can get a gradient and
        have no hook yet (a parameter frozen now, or a lazy module's not yet materialized by a
        forward pass, is hooked once it is stepped). One hook serves them all: a wrapper each
        cost as much as the rest of ``overlap_with``. (Not kept on this object: a cycle through
        it would outlive the optimizer until the next garbage collection.)"""
        hook = None
        for param in params:
            if not param.requires_grad or is_lazy(param):
                continue
            if self._has_gradient_hook(param):
                # torch.utils.swap_tensors leaves the hooks dict on the parameter, but autograd
                # runs the hooks attached to the tensor swapped out. A swap cannot be told for
                # sure (a new tensor may get a freed one's address), so the dict is attached to
                # the parameter's tensor again at each step, as register_hook attaches it.
                param._backward_hooks = param._backward_hooks
                continue
            if hook is None:
                hook = _eager(self._before_gradient)
                hook.__torch_unserializable__ = True  # type: ignore[attr-defined]  # no warning
            handle = self._gradient_hooks[id(param)] = param.register_hook(hook)
            self._handles.append(handle)

    def _has_gradient_hook(self, param: Tensor) -> bool:
        """Whether the hook registered under ``param``'s id is in ``param``'s own hooks (a new
        parameter may reuse a dead one's id)."""
        handle = self._gradient_hooks.get(id(param))
        hooks = handle.hooks_dict_ref() if handle is not None else None
        return hooks is not None and hooks is param._backward_hooks and handle.id in hooks

    def _before_gradient(self, _grad: Tensor) -> None:
        """A backward pass computed a hooked parameter's gradient: before it (or DDP's
        reducer) writes any gradient, order its stream after every queued update."""
        self._join_if_pending()

    def _join_if_pending(self) -> None:
        """Order the current stream after every queued update, once (it clears ``pending``):
        before a backward writes gradients, or a ``load_state_dict`` the parameters."""
        if self.pending:
            self.wait_all()

    def wait_all(self) -> None:
        """Order the current streams after every update queued so far."""
        self._ordered(list(self._unordered))
        self._pipeline.join_updates()
        self.pending.clear()

    def _ordered(self, params: list[Tensor]) -> None:
        """The caller's stream is made to wait for these parameters' updates now: warn about
        those written in place before (their version counters moved on since their updates
        were queued), which raced with the updates."""
        written = 0
        for param in params:
            mark = self._unordered.pop(param, None)
            written += mark is not None and _write_mark(param) != mark
        if written:
            _warn_at_the_callers_line(_WRITTEN_WARNING.format(count=written))

    @property
    def watching(self) -> bool:
        """Whether forward passes are still watched for reads before hooks (until the first
        step)."""
        return not self._watch.stopped

    def begin_watch(self) -> None:
        """Watch a forward pass (or a Lightning ``training_step``) for parameters read before
        their hook, until the first step (see :class:`_ReadWatch`); calls nest, and each must
        be matched by :meth:`end_watch`."""
        self._note_traced_reads()
        if self._watch.begin():  # a new pass: its own module hooks have not run yet
            self._reached_in_pass.clear()

    def end_watch(self) -> None:
        self._note_traced_reads()
        self._watch.end()

    def _note_reads(self, values: Iterable[Any]) -> None:
        """Note the module's parameters among ``values`` (an op's inputs) that their hook has
        not reached in this pass. Traced by dynamo, the parameters are only listed: a test of
        their ``id`` would make it guard on each tensor's identity (an activation's too), and
        compile the code again for every call (soon past its recompile limit, after which
        that code never runs compiled). The hooks, which run as Python, note them before
        marking their own parameters reached (the graph's side effects come first)."""
        if torch.compiler.is_compiling():
            self._traced_reads.extend(v for v in values if isinstance(v, nn.Parameter))
            return
        for value in values:
            if (
                isinstance(value, Tensor)
                and id(value) in self._module_params
                and id(value) not in self._reached_in_pass
            ):
                self.read_before_hook.add(id(value))

    def _note_traced_reads(self) -> None:
        if self._traced_reads:
            reads, self._traced_reads = self._traced_reads, []
            self._note_reads(reads)

    def remove(self) -> None:
        """Wait for the queued updates and remove the hooks; the optimizer's steps are then
        synchronous again."""
        self.wait_all()
        self._watch.stopped = True
        self._watch.leave()  # this thread's forward pass may be running: its hook is gone
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._gradient_hooks.clear()
        self.removed = True


class _ReadWatch(TorchFunctionMode):
    """Watches the training forward passes before the first step for parameters that an op
    reads before their module's forward pre-hook ran: a parent reading a child's weight before
    calling the child (a tied decoder's ``F.linear(x, self.dec.weight.t())``,
    ``F.embedding(tokens, self.emb.weight)``). Their hook runs later in the same pass, so they
    count as reached, yet after a step that read would not wait: they are updated first and
    waited for at each step instead, as parameters no hook reaches. Nothing is pending before
    the first step, so watching only until then costs nothing later.

    An op reads a parameter's data when it returns tensors (a view included, as ``.T``) or
    Python values of its elements (``torch.equal``, ``.tolist()``, ``.item()``): not
    when it only reads or sets metadata (``.dtype``, ``.shape``, ``.grad``, ``requires_grad``,
    as ``zero_grad`` and Lightning's ``toggle_optimizer`` do). The mode is on a thread's stack
    while that thread's watched passes run (``begin``/``end`` nest per thread).

    Under ``torch.compile`` dynamo traces this mode into the watched passes' graphs (their
    notes are side effects, replayed by each run of the graph), but never compiles
    ``__torch_function__`` as a frame of its own (:func:`_never_a_compiled_frame`).
    """

    def __init__(self, overlap: ForwardOverlap) -> None:
        super().__init__()
        self.stopped = False
        self._overlap = weakref.ref(overlap)
        self._depth = threading.local()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        overlap = self._overlap()
        # A training pass (grad mode on as it began) is watched whole: also its reads under
        # no_grad, inside a custom autograd.Function's forward or a reentrant checkpoint.
        watched = (
            not self.stopped and overlap is not None and getattr(self._depth, "training", False)
        )
        if watched and _reads_data(func, result):
            overlap._note_reads(tree_leaves((args, kwargs)))
        return result

    def begin(self) -> bool:
        """Put the mode on this thread's stack; True where this begins a new outermost pass."""
        if self.stopped:  # the ends of passes begun before still take it off the stack
            return False
        depth = getattr(self._depth, "value", 0)
        if depth == 0:
            self._depth.training = torch.is_grad_enabled()  # an evaluation pass is not watched
            torch._C._push_on_torch_function_stack(self)
        self._depth.value = depth + 1
        return depth == 0

    def end(self) -> None:
        """After the stop, the first end takes it off the stack: also where a pass interrupted
        without its end (a ``KeyboardInterrupt`` skips ``always_call`` hooks) left it there."""
        depth = getattr(self._depth, "value", 0)
        if depth == 1 or (depth and self.stopped):
            self.leave()
        elif depth:
            self._depth.value = depth - 1

    def leave(self) -> None:
        """Off this thread's stack now, whatever the nesting."""
        if getattr(self._depth, "value", 0):
            self._depth.value = 0
            _remove_mode(self)


def _never_a_compiled_frame(function: Callable[..., Any]) -> bool:
    """Run ``function`` (and what it calls) eagerly whenever it is called from eager code under
    ``torch.compile``, while letting dynamo inline it where it traces a caller. Called from eager
    code between graphs, dynamo would compile the watch's ``__torch_function__`` as a frame of
    its own, once per op, with the ops' integer arguments soon made symbolic, which fails
    (``NYI SymInt equality``); with it never traced, each op a graph break, dynamo gives up on
    whole frames for good (a graph break at a Python operator cannot be resumed from). Dynamo's
    private API; False where a torch lacks it, and before torch 2.12, whose dynamo traced the
    watch all the same (no graph ran with the overlap on 2.9 to 2.11, and on 2.10 and 2.11 a
    tied weight's read failed torch's own guard check, "Guard failed on the same frame it was
    created"; measured on the CPU)."""
    if torch.__version__ < (2, 12):
        return False
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        set_code_exec_strategy(function.__code__, strategy)
    except (ImportError, TypeError, AttributeError):  # a torch without them
        return False
    return True


if not _never_a_compiled_frame(_ReadWatch.__torch_function__):
    # Never traced then: compiling does not fail, but more runs eagerly (the watched pass, and
    # on torch < 2.12 the torch.nn layers' own forward code, skipped after the hooks' breaks).
    _ReadWatch.__torch_function__ = torch.compiler.disable(_ReadWatch.__torch_function__)  # type: ignore[method-assign]

#: Properties whose value is a view of the tensor's data; other properties are metadata.
_VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
#: Ops that read a tensor's data into Python objects, not into tensors.
_READS_INTO_PYTHON = frozenset(
    {"equal", "allclose", "tolist", "item", "numpy", "__array__", "__repr__", "__format__"}
    | {"__bool__", "__float__", "__int__", "__index__", "__complex__", "is_nonzero"}
)


def _guard_on_module_hooks() -> None:
    """Make dynamo check, before it reuses code compiled for a module, that the module's hooks
    are as they were when compiled. By default (``skip_nnmodule_hook_guards``) it does not, and
    code compiled for a module without the overlap's hooks (this one before ``overlap_with``, or
    another instance of its class, a reference or a teacher) would run without them: its reads
    unordered. Code compiled before without that check is dropped."""
    import torch._dynamo

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset_code_caches()


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, run as Python even inside a ``torch.compile``'d forward (a graph break at each
    hooked module), as FSDP2 runs its own hooks: they order streams and queue copies from state
    that changes at every step, which a traced graph would replay as it was when traced."""
    return torch.compiler.disable(hook, recursive=True)


def _reads_data(func: Any, result: Any) -> bool:
    """Whether an op that got a parameter may have read (or aliased) its data."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _VIEW_PROPERTIES
    if name in ("__set__", "requires_grad_"):
        return False
    return name in _READS_INTO_PYTHON or any(
        isinstance(value, Tensor) for value in tree_leaves(result)
    )


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off the torch-function mode stack wherever it is, the others kept in order
    (a user's mode entered after it and still active must stay)."""
    above = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def _is_fsdp2_unit(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def _all_gather_streams(unit: nn.Module) -> tuple[list[Any] | None, list[nn.Module]]:
    """The streams on which FSDP2 copies ``unit``'s shards into its all-gathers ([] before its
    first forward pass sets them up), and the modules of the units it prefetches in its
    pre-forward; None for the streams where this torch keeps them elsewhere."""
    names = ("all_gather_copy_in_stream", "all_gather_stream")
    try:
        state = unit._get_fsdp_state()  # type: ignore[operator]
        context = state._comm_ctx
        prefetched = [m for s in state._states_to_forward_prefetch for m in s._modules]
    except AttributeError:
        return None, []
    if not hasattr(context, "device_handle"):  # set up with the streams, at the first forward
        return [], prefetched
    if not all(hasattr(context, n) for n in names):
        return None, []
    return [getattr(context, n) for n in names], prefetched


class _BlockRun:
    """How many forward passes of a block are running."""

    def __init__(self) -> None:
        self.running = 0


def _unless_running(run: _BlockRun, wait: Callable[[], None]) -> None:
    if not run.running:
        wait()


def _refuse_script_modules(module: nn.Module) -> None:
    """Scripted TorchScript modules (``torch.jit.script``) take no hooks: nothing would order
    their reads. (Traced ones take them; their submodules' hooks never run, so those parameters
    are waited for at the step, as any read no hook reaches.)"""
    for name, child in module.named_modules():
        if not isinstance(child, torch.jit.ScriptModule):
            continue
        try:
            child.register_forward_pre_hook(_no_hook).remove()
        except RuntimeError:
            where = f"submodule {name!r}" if name else "the module"
            raise TypeError(
                f"overlap_with: {where} is a scripted TorchScript module "
                f"({type(child).__name__}), which takes no forward hooks, so nothing could order "
                f"its reads after the queued updates. Overlap an eager module (torch.compile and "
                f"torch.jit.trace keep its hooks), or step without overlap_with()"
            ) from None


def _no_hook(*_: Any) -> None:
    pass


def _check_blocks(module: nn.Module, blocks: Iterable[nn.Module]) -> set[int]:
    """The ids of ``blocks``: submodules of ``module`` (not itself) that run a forward of their
    own (a container such as a ``ModuleList`` never runs, so nothing in it would wait)."""
    if not hasattr(blocks, "__iter__"):
        raise TypeError(
            f"overlap_with: blocks must be an iterable of modules (such as model.layers); "
            f"got {type(blocks).__name__}"
        )
    inside = {id(m) for m in module.modules() if m is not module}
    ids = set()
    for block in blocks:
        if not isinstance(block, nn.Module) or id(block) not in inside:
            raise ValueError(
                f"overlap_with: blocks must be submodules of the overlapped "
                f"{type(module).__name__} (not the module itself); got a "
                f"{type(block).__name__} that is not one"
            )
        # Not type(block).forward: torch.compile's wrapper sets its forward on the instance.
        if getattr(block.forward, "__func__", None) is nn.Module.forward:
            raise ValueError(
                f"overlap_with: a block must run a forward of its own; {type(block).__name__} "
                f"has none (pass the modules it holds)"
            )
        ids.add(id(block))
    return ids


def _unit_parameters(unit: nn.Module) -> list[Tensor]:
    """The parameters an FSDP2 unit all-gathers: its subtree's (with ``fully_shard([a, b])``,
    those of every module of the group, which the first of them to run gathers), less nested
    units'."""
    try:
        group = list(unit._get_fsdp_state()._modules)  # type: ignore[operator]
    except AttributeError:
        group = [unit]
    return _subtree_parameters(group)


def _subtree_parameters(group: list[nn.Module]) -> list[Tensor]:
    """The parameters of the subtrees of ``group``'s modules, less those of FSDP2 units nested
    in them (whose own hooks wait for theirs)."""
    members = {id(m) for m in group}
    nested = {
        id(p)
        for module in group
        for child in module.modules()
        if id(child) not in members and _is_fsdp2_unit(child)
        for p in child.parameters()
    }
    params = {id(p): p for module in group for p in module.parameters() if id(p) not in nested}
    return list(params.values())
