"""The CPU stream-ordering checker sees every ordering step of the staging pipeline.

Each wait, each event that orders data (not the timing ones), each host synchronisation and
each note of an arena's last use (after which its pinned buffers may be freed) in
``pipeline.py`` is removed in turn; the checker must report a conflicting access for every such
mutant, and none for the pipeline as written.
"""

from __future__ import annotations

import ast
import bisect
import copy
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import fail_on_call, make_params, step_together
from stream_checker import StreamChecker
from torch.multiprocessing.reductions import StorageWeakRef

import lightning_offload_optim.pipeline
from lightning_offload_optim import OffloadAdamW, StagingPool, host_state
from lightning_offload_optim import adamw as adamw_module
from lightning_offload_optim.host_state import own_storage_view
from lightning_offload_optim.step_stats import COPY_IN, COPY_OUT, StepRecord

PIPELINE = Path(lightning_offload_optim.pipeline.__file__)


def _is_call(node: ast.AST, owner: str | None, method: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
        and (owner is None or getattr(node.func.value, "id", None) == owner)
    )


#: Calls that wait, and those that note an arena's last use (the events its pinned buffers are
#: freed after): (owner name or None for any, method).
_WAITS_AND_LAST_USES = [
    ("streams", "wait"),
    (None, "synchronize"),
    (None, "read_by"),
    (None, "written_by"),
]


def _ordering_targets(tree: ast.AST) -> list[ast.AST]:
    """Statements that wait (``streams.wait``, ``event.synchronize()``) or note an arena's last
    use (``read_by``, ``written_by``), data-ordering
    ``streams.record`` calls (those without ``timing=True``) and the ends of timed copies taken
    as data-ordering events (``copied.event``)."""
    targets: list[ast.AST] = []
    for node in ast.walk(tree):
        waits = isinstance(node, ast.Expr) and any(
            _is_call(node.value, owner, method) for owner, method in _WAITS_AND_LAST_USES
        )
        orders = _is_call(node, "streams", "record") and not any(
            k.arg == "timing" for k in node.keywords
        )
        span_ends = (
            isinstance(node, ast.Attribute)
            and node.attr == "event"
            and getattr(node.value, "id", None) == "copied"
        )
        if waits or orders or span_ends:
            targets.append(node)
    return targets


class _RemoveOne(ast.NodeTransformer):
    def __init__(self, target: ast.AST) -> None:
        self.target = target

    def visit(self, node: ast.AST) -> ast.AST:
        if node is self.target:
            return ast.Pass() if isinstance(node, ast.Expr) else ast.Constant(None)
        return super().visit(node)


def mutants() -> list[tuple[str, str]]:
    source = PIPELINE.read_text()
    found = []
    for index in range(len(_ordering_targets(ast.parse(source)))):
        tree = ast.parse(source)
        target = _ordering_targets(tree)[index]
        label = f"line {target.lineno}: {ast.unparse(target)}"
        mutated = ast.fix_missing_locations(_RemoveOne(target).visit(tree))
        found.append((label, ast.unparse(mutated)))
    return found


MUTANTS = mutants()


def load_pipeline(source: str) -> types.ModuleType:
    name = "lightning_offload_optim._pipeline_under_test"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    try:
        exec(compile(source, str(PIPELINE), "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


def scenario(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Staged steps that exercise every ordering of the pipeline, then reads of the host state.

    Four 64-element parameters and 64-element chunks: four chunks alternate between the two
    staging buffers, so buffers are reused within a step. The first step allocates the staging
    buffers with nothing else ordering them before the first copy-in. The second step updates
    only the last parameter, whose chunk then lands in the other buffer than before: only the
    wait for the previous step's last copy-out orders its copy-in. bf16 parameters join later,
    with a master copy and the gradient scratch. Last, steps interrupted right after a chunk's
    copy-in or copy-out was queued, and one in the update of a chunk whose copy-in was queued,
    each followed by reads of the state and a load of a checkpoint.

    Returns what the checker cannot see (frees are not aten ops): see :func:`_unsettled_arenas`.
    """
    fp32 = make_params([(64,), (64,), (64,), (64,)])
    bf16 = make_params([(64,), (64,)], dtype=torch.bfloat16, seed=1)
    params = fp32 + bf16
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64, amsgrad=True)
    generator = torch.Generator().manual_seed(0)
    step_together([opt], [params], generator, 1, skip=lambda i: i >= 4)
    step_together([opt], [params], generator, 1, skip=lambda i: i != 3)
    step_together([opt], [params], generator, 2)
    for param in params:
        opt.offloaded_state(param)
    checkpoint = copy.deepcopy(opt.state_dict())
    problems = []
    for interrupt in (_after_first(COPY_IN), _after_first(COPY_OUT), _inside_second_update):
        with monkeypatch.context() as patch:
            interrupt(patch)
            with pytest.raises(KeyboardInterrupt):
                step_together([opt], [params], generator, 1)
        for param in params:
            opt.offloaded_state(param)
        problems += _unsettled_arenas(opt)
        opt.load_state_dict(copy.deepcopy(checkpoint))
    return (
        problems
        + overlap_scenario(monkeypatch)
        + resident_scenario(monkeypatch)
        + shared_pool_scenario()
        + allocated_elsewhere_scenario(monkeypatch)
    )


def overlap_scenario(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Steps that overlap the next forward (``overlap_with``): the update waits for the
    backward's gradients, each layer's forward for its parameters, ``module.state_dict()`` and
    ``zero_grad(set_to_none=False)`` for all updates, a load for the copies a forward queued
    ahead of the next step, also after a step interrupted in its second chunk's update."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    opt.overlap_with(model)
    x = torch.ones(2, 8)

    def step() -> None:
        model(x).sum().backward()
        opt.step()

    for _ in range(2):
        step()
        opt.zero_grad()
    step()
    for tensor in model.state_dict().values():
        tensor.clone()
    step()
    opt.zero_grad(set_to_none=False)
    model(x)  # queues the next step's first copies, which a load must wait for
    problems = _unsettled_arenas(opt)  # they read the host buffers last
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    with monkeypatch.context() as patch:
        _inside_second_update(patch)
        with pytest.raises(KeyboardInterrupt):
            step()
    for param in model.parameters():
        param.clone()
    return problems + _unsettled_arenas(opt)


def resident_scenario(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """State resident on the device: uploaded at its first resident step, updated in place on
    the caller's stream or, overlapped, on the update stream, written back before reads of the
    host state, and uploaded again after a load writes the host buffers; also after a step
    interrupted after its first update. All of it resident: with staged chunks after the
    resident ones, their copy-outs would order the write-back."""
    params = make_params([(64,), (64,), (64,), (64,)])
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64, resident=1.0)
    generator = torch.Generator().manual_seed(2)
    problems = []
    for _ in range(3):  # right after the upload (the second step), its read is the last use
        step_together([opt], [params], generator, 1)
        problems += _unsettled_arenas(opt)
    for param in params:
        opt.offloaded_state(param)
    saved = copy.deepcopy(opt.state_dict())
    step_together([opt], [params], generator, 1)
    opt.load_state_dict(saved)
    step_together([opt], [params], generator, 2)
    opt.state_dict()
    with monkeypatch.context() as patch:  # the first chunk's update, then no copy-out
        _inside_second_update(patch)
        with pytest.raises(KeyboardInterrupt):
            step_together([opt], [params], generator, 1)
    for param in params:  # the resident state is written back first
        opt.offloaded_state(param)
    opt.load_state_dict(saved)

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    overlapped = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=1.0)
    overlapped.overlap_with(model)
    for _ in range(3):
        model(torch.ones(2, 8)).sum().backward()
        overlapped.step()
        overlapped.zero_grad()
    for param in model.parameters():
        overlapped.offloaded_state(param)
    model(torch.ones(2, 8)).sum().backward()
    return problems + _unsettled_arenas(opt) + _unsettled_arenas(overlapped)


def shared_pool_scenario() -> list[str]:
    """Optimizers of one :class:`StagingPool`: each step starts at the set after the last
    step's, so an optimizer of one chunk alternates between the sets and the copies its forward
    queues ahead go to the other set than its last copy-out from the same host range; and one
    overlapped optimizer's updates of resident state (on the update stream) use the gradient
    scratch that the next one, not overlapped, writes on the caller's stream. The copy streams
    are the pool's, so the last work on them is an arena's only while one optimizer used them."""
    pool = StagingPool()
    model = torch.nn.Linear(8, 4)
    ahead = OffloadAdamW(model.parameters(), force_staging=True, staging_pool=pool)
    ahead.overlap_with(model)
    for _ in range(3):
        model(torch.ones(2, 8)).sum().backward()
        ahead.step()
    problems = _unsettled_arenas(ahead)
    twins = [torch.nn.Linear(8, 8, dtype=torch.bfloat16) for _ in range(2)]
    optimizers = [
        OffloadAdamW(t.parameters(), force_staging=True, staging_pool=pool, resident=1.0)
        for t in twins
    ]
    optimizers[0].overlap_with(twins[0])
    for _ in range(3):
        for twin in twins:
            twin(torch.ones(2, 8, dtype=torch.bfloat16)).sum().backward()
        for opt in optimizers:
            opt.step()
    return problems


def allocated_elsewhere_scenario(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Buffers allocated on one stream by a step that stopped before its update, the next
    step on another: staging the pool grew before the step counts' copies failed, and resident
    buffers chosen by a step without gradients. The stream that allocated them went on using
    memory; the next step's updates and copies must come after that stream's earlier work."""
    caller = torch.cpu.current_stream()
    side = torch.cpu.Stream()
    pool = StagingPool()
    large, small = torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(4, 4, bias=False)
    grows = OffloadAdamW(large.parameters(), force_staging=True, staging_pool=pool)
    other = OffloadAdamW(small.parameters(), force_staging=True, staging_pool=pool)
    small(torch.ones(2, 4)).sum().backward()
    other.step()
    large(torch.ones(2, 16)).sum().backward()
    grow_then_fail_on(side, grows, monkeypatch)
    small(torch.ones(2, 4)).sum().backward()
    other.step()
    caller.wait_stream(side)

    model = torch.nn.Linear(16, 16, bias=False)
    opt = OffloadAdamW(model.parameters(), force_staging=True)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt.resident = 1.0
    side.wait_stream(caller)
    with torch.cpu.stream(side):
        torch.empty(256).fill_(1.0)  # memory the side stream used and freed, for the buffers
        opt.step()  # no gradients: resident buffers allocated on the side stream, nothing else
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    caller.wait_stream(side)
    return []


def grow_then_fail_on(
    stream: torch.Stream, optimizer: OffloadAdamW, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On ``stream`` (after the caller's work): memory used and freed, then a step of
    ``optimizer`` that grows its pool there and fails at the step counts' copies, before its
    update (all or nothing), leaving the grown buffers to the next step."""
    stream.wait_stream(torch.cpu.current_stream())
    with torch.cpu.stream(stream), monkeypatch.context() as patch:
        torch.empty(256).fill_(1.0)  # memory the stream used and freed, for the pool
        fail_on_call(patch, OffloadAdamW, "_steps_on_devices", 1, torch.OutOfMemoryError())
        with pytest.raises(torch.OutOfMemoryError):
            optimizer.step()


def _after_first(kind: str) -> Callable[[pytest.MonkeyPatch], None]:
    """Interrupt right after a chunk's copy-in or copy-out (``kind``) was queued, before its
    event is recorded: nothing waits for a copy-in interrupted so."""

    def interrupt(patch: pytest.MonkeyPatch) -> None:
        real_add_span = StepRecord.add_span

        def add_span(self, span_kind, begin, end):
            real_add_span(self, span_kind, begin, end)
            if span_kind == kind:
                raise KeyboardInterrupt("simulated")

        patch.setattr(StepRecord, "add_span", add_span)

    return interrupt


def _inside_second_update(patch: pytest.MonkeyPatch) -> None:
    """Interrupt in the update of a chunk whose copy-in is queued and whose copy-out is not."""
    fail_on_call(patch, adamw_module, "adamw_update", 2, KeyboardInterrupt("simulated"))


def _unsettled_arenas(opt: OffloadAdamW) -> list[str]:
    """Pinned buffers are unregistered and freed once their arena's last-use events (its last
    write and read) are done, so after an interrupted step they must cover all work queued on
    both copy streams."""
    streams = opt._pipeline.pool.streams[torch.device("cpu")]
    problems = []
    for arena in opt._host.arenas:
        events = [e for e in arena._in_flight if e is not None]  # the last write and read
        for stream in (streams.copy_in, streams.copy_out):
            if all(e.clock.get(stream.id, 0) < stream.clock[stream.id] for e in events):
                problems.append(f"an arena could be freed while the {stream} still uses it")
    return problems


def run_checked(pipeline: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(adamw_module, "StagingPipeline", pipeline.StagingPipeline)
    # Pools the scenarios make are the module's too (their methods order work as well).
    monkeypatch.setattr(adamw_module, "StagingPool", pipeline.StagingPool)
    monkeypatch.setattr(sys.modules[__name__], "StagingPool", pipeline.StagingPool)
    with StreamChecker() as checker:
        problems = scenario(monkeypatch)
    return checker.violations + problems


def test_the_harness_finds_every_ordering_step():
    """Fourteen waits, fifteen data-ordering events (four of them the ends of timed copies),
    two host waits and five notes of an arena's last use today: a new one counts too."""
    kinds = [label.split(": ", 1)[1].split("(")[0].split(".")[-1] for label, _ in MUTANTS]
    assert sorted(kinds) == (
        ["event"] * 4
        + ["read_by"] * 2
        + ["record"] * 11
        + ["synchronize"] * 2
        + ["wait"] * 14
        + ["written_by"] * 3
    )


@pytest.mark.no_stream_check  # it runs its own checker
def test_pipeline_as_written_is_ordered(monkeypatch):
    assert run_checked(load_pipeline(PIPELINE.read_text()), monkeypatch) == []


@pytest.mark.no_stream_check
@pytest.mark.parametrize(("label", "source"), MUTANTS, ids=[label for label, _ in MUTANTS])
def test_checker_fails_without_each_ordering_step(label, source, monkeypatch):
    violations = run_checked(load_pipeline(source), monkeypatch)
    assert violations, f"removing {label} went unnoticed"


@pytest.mark.no_stream_check  # it runs its own checker
def test_only_a_step_that_allocated_buffers_copies_in_after_the_callers_stream():
    """The first step allocates staging on the caller's stream, which may have used that
    memory just before: its copy-ins wait for the stream. A later step's copy-in of its first
    chunk does not wait for the backward that is still queued there (on a GPU the host runs
    ahead), so the copy overlaps its end; the update waits for both."""
    from lightning_offload_optim import streams

    (param,) = make_params([(64,)])
    opt = OffloadAdamW([param], force_staging=True)
    with StreamChecker() as checker:
        caller = streams.device_module(torch.device("cpu")).current_stream()
        for step in range(2):
            param.grad = torch.ones(64) * (step + 1)  # the end of a backward, on the caller's
            written = caller.clock[caller.id]
            opt.step()
            copy_in = opt._pipeline.pool.streams[torch.device("cpu")].copy_in
            waited = copy_in.clock.get(caller.id, 0) >= written
            assert waited == (step == 0), f"step {step}: copy-in after the backward: {waited}"
    checker.expect_none()


@pytest.mark.no_stream_check  # it runs its own checker
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("resident", [None, 1.0], ids=["staged", "resident"])
def test_a_step_reads_what_the_caller_queued_into_lent_views(resident, overlap):
    """``state_dict()`` lends views of the host buffers, which the caller may write until the
    next step: with a non-blocking copy from device memory, queued on its stream (a checkpoint
    loaded in place from GPU tensors). The step's copy-in, or resident upload, comes after."""
    model = torch.nn.Linear(8, 8, bias=False)
    opt = OffloadAdamW(model.parameters(), force_staging=True, resident=resident)
    if overlap:
        opt.overlap_with(model)
    with StreamChecker() as checker:
        for _ in range(2):
            model(torch.ones(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        lent = opt.state_dict()["state"][0]["exp_avg"]
        lent.copy_(torch.full((8, 8), 0.5), non_blocking=True)  # device memory, queued
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.wait_for_updates()
    checker.expect_none()


@pytest.mark.no_stream_check  # it runs its own checker
@pytest.mark.parametrize("grow", [False, True], ids=["same-sets", "sets-regrown"])
def test_optimizers_of_one_pool_on_streams_of_their_own_are_ordered(grow):
    """Each optimizer of a pool stepped on a stream of the caller's, the streams ordered only
    after the backward and before the next one (as for torch's AdamW): with resident bf16
    state their updates share the pool's gradient scratch, which the pool orders; and sets
    regrown (a larger optimizer's step) keep their memory from the stream that allocated them
    until the updates on the others are done."""
    sizes = [8, 8, 24] if grow else [8, 8]
    models = [torch.nn.Linear(n, n, dtype=torch.bfloat16) for n in sizes]
    pool = StagingPool()
    optimizers = [
        OffloadAdamW(m.parameters(), force_staging=True, staging_pool=pool, resident=1.0)
        for m in models
    ]
    with StreamChecker() as checker:
        caller = torch.cpu.current_stream()
        own = [torch.cpu.Stream() for _ in models]
        for _ in range(3):
            for model in models:
                x = torch.ones(2, model.in_features, dtype=torch.bfloat16)
                model(x).float().sum().backward()
            for opt, stream in zip(optimizers, own, strict=True):
                stream.wait_stream(caller)
                with torch.cpu.stream(stream):
                    opt.step()
                    opt.zero_grad()
                with torch.cpu.stream(own[0]):
                    torch.empty(64).fill_(1.0)  # the first stream allocates meanwhile
            for stream in own:
                caller.wait_stream(stream)
    checker.expect_none()


@pytest.mark.no_stream_check  # it runs its own checker
def test_an_update_failed_partway_leaves_the_pools_sets_to_the_next_optimizer_ordered():
    """A step failing after a chunk's update was queued, before its copy-out: the set it used
    is the next optimizer's (the pool's next set), whose copy-in must come after that update."""
    pool = StagingPool()
    models = [torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(8, 8, bias=False)]
    failing, other = (
        OffloadAdamW(m.parameters(), force_staging=True, staging_pool=pool, chunk_size=64)
        for m in models
    )
    real = adamw_module.adamw_update

    def update_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("simulated fault after the first chunk's update was queued")

    with StreamChecker() as checker:
        for opt, model in ((failing, models[0]), (other, models[1])):
            model(torch.ones(2, model.in_features)).sum().backward()
            opt.step()
        models[0](torch.ones(2, 16)).sum().backward()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(adamw_module, "adamw_update", update_then_fail)
            with pytest.raises(RuntimeError, match="simulated fault"):
                failing.step()
        models[1](torch.ones(2, 8)).sum().backward()
        other.step()
        other.offloaded_state(models[1].weight)
    checker.expect_none()


@pytest.mark.no_stream_check  # it runs its own checker
def test_buffers_a_grow_allocated_before_it_ran_out_of_memory_are_waited_for(monkeypatch):
    """A step's grow of a shared pool allocates two sets of three keys (amsgrad) and runs out
    of memory at the last one: the buffers it allocated stay in the pool, and the next step
    (another optimizer's, which needs nothing new) must still wait for the stream that used
    their memory just before."""
    pool = StagingPool()
    models = [torch.nn.Linear(8, 8, bias=False) for _ in range(2)]
    grows = OffloadAdamW(
        models[0].parameters(), force_staging=True, staging_pool=pool, amsgrad=True
    )
    other = OffloadAdamW(models[1].parameters(), force_staging=True, staging_pool=pool)
    with StreamChecker() as checker:
        for model in models:
            model(torch.ones(2, 8)).sum().backward()
        torch.empty(1024).fill_(1.0)  # the caller's stream used memory, then freed it
        with monkeypatch.context() as patch:  # the pipeline's sixth allocation fails
            in_pipeline = types.SimpleNamespace(**vars(torch))
            patch.setattr(lightning_offload_optim.pipeline, "torch", in_pipeline)
            fail_on_call(patch, in_pipeline, "empty", 6, torch.OutOfMemoryError("the last buffer"))
            with pytest.raises(torch.OutOfMemoryError, match="the last buffer"):
                grows.step()
        assert [len(b) for b in next(iter(pool.buffers.values()))] == [3, 2]
        other.step()
        other.wait_for_updates()
    checker.expect_none()


@pytest.mark.no_stream_check  # it runs its own checker
def test_allocations_on_two_streams_before_a_step_are_both_waited_for(monkeypatch):
    """The pool grows on one stream (a step that then failed at the step counts), resident
    buffers are allocated on another (a step without gradients): the next step, on a third,
    waits for both streams' earlier work, not only the last one's."""
    pool = StagingPool()
    large, small, resident = (torch.nn.Linear(n, n, bias=False) for n in (16, 4, 4))
    grows, other, keeps = (
        OffloadAdamW(m.parameters(), force_staging=True, staging_pool=pool)
        for m in (large, small, resident)
    )
    with StreamChecker() as checker:
        caller = torch.cpu.current_stream()
        first, second = torch.cpu.Stream(), torch.cpu.Stream()
        for model, opt in ((small, other), (resident, keeps)):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        large(torch.ones(2, 16)).sum().backward()
        grow_then_fail_on(first, grows, monkeypatch)
        second.wait_stream(caller)
        keeps.resident = 1.0
        with torch.cpu.stream(second):
            keeps.step()  # no gradients: its resident buffers are allocated on this stream
        caller.wait_stream(second)
        small(torch.ones(2, 4)).sum().backward()
        other.step()
        caller.wait_stream(first)
    checker.expect_none()


@pytest.mark.no_stream_check  # it runs its own checker
def test_no_copies_are_queued_ahead_into_buffers_a_step_allocated_then_failed(monkeypatch):
    """A step that grew the pool's sets and then failed before its update (all or nothing: the
    step counts' copies failed) leaves the new buffers to the next step, which waits for the
    caller's stream that allocated them: a forward's copies queued ahead into them would not."""
    pool = StagingPool()
    small, large = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(32, 16, bias=False)
    ahead = OffloadAdamW(small.parameters(), force_staging=True, staging_pool=pool)
    grows = OffloadAdamW(large.parameters(), force_staging=True, staging_pool=pool)
    ahead.overlap_with(small)
    with StreamChecker() as checker:
        for _ in range(2):
            small(torch.ones(2, 8)).sum().backward()
            ahead.step()
            ahead.zero_grad()
        large(torch.ones(2, 32)).sum().backward()
        grow_then_fail_on(torch.cpu.current_stream(), grows, monkeypatch)
        small(torch.ones(2, 8)).sum().backward()  # queues the next copies ahead
        ahead.step()
        ahead.wait_for_updates()
    checker.expect_none()


@pytest.mark.no_stream_check  # it runs its own checker
@pytest.mark.parametrize("offset", [0, 64], ids=["at-the-start", "inside"])
def test_accesses_through_a_slice_of_a_host_buffer_are_the_buffers(offset):
    """``state_dict()`` lends views whose storages are slices of the host buffers. An access
    through one is an access of the buffer at its offset: taken for a new storage at a used
    address, it made the checker forget the buffer's history (a load's in-place writes then
    went unchecked, and removing ``wait_host``'s wait for queued copy-ins went unnoticed)."""
    from lightning_offload_optim import host_state, streams

    on_the_host = "fill_ on the host writes host buffer"  # not a queued op: the host's own
    with StreamChecker() as checker:
        buffer = host_state.host_empty(128, torch.float32)
        side = streams.device_module(torch.device("cpu")).Stream()
        with torch.cpu.stream(side):
            torch.empty(32).copy_(buffer[offset : offset + 32], non_blocking=True)  # reading
        host_state.own_storage_view(buffer[offset + 8 : offset + 16]).fill_(1.0)
    assert len(checker.violations) == 1 and on_the_host in checker.violations[0]
    with StreamChecker() as checker:  # ordered by the host's wait, nothing is reported
        buffer = host_state.host_empty(128, torch.float32)
        side = streams.device_module(torch.device("cpu")).Stream()
        with torch.cpu.stream(side):
            torch.empty(32).copy_(buffer[offset : offset + 32], non_blocking=True)
        side.record_event().synchronize()
        host_state.own_storage_view(buffer[offset + 8 : offset + 16]).fill_(1.0)
    assert checker.violations == []
    with StreamChecker() as checker:  # a freed buffer once lay where this one's slice starts
        buffer = host_state.host_empty(128, torch.float32)
        gone = torch.empty(4).untyped_storage()
        dead = StorageWeakRef(gone)
        del gone
        start = buffer.data_ptr() + 4 * offset + 16  # below the slice written
        bisect.insort(checker.host_starts, start)
        checker.host_buffers[start] = (64, dead)
        side = streams.device_module(torch.device("cpu")).Stream()
        with torch.cpu.stream(side):
            torch.empty(32).copy_(buffer[offset : offset + 32], non_blocking=True)
        host_state.own_storage_view(buffer[offset + 8 : offset + 16]).fill_(1.0)
    assert len(checker.violations) == 1 and on_the_host in checker.violations[0]


@pytest.mark.no_stream_check  # it runs its own checker
def test_a_storage_starting_where_a_host_buffer_ends_is_not_that_buffer():
    """A view's storage is resolved to the live host buffer it lies in; one that starts at the
    buffer's end lies in the next allocation, whose history is its own."""
    memory = torch.empty(64)
    checker = StreamChecker()
    start = memory.data_ptr()
    checker.host_starts.append(start)
    checker.host_buffers[start] = (128, StorageWeakRef(memory.untyped_storage()))  # its half
    last = own_storage_view(memory[31:]).untyped_storage()
    assert checker._host_alias(last) == (start, 124)
    assert checker._host_alias(own_storage_view(memory[32:]).untyped_storage()) is None


# ----------------------------------------------------------- the checker's own model, directly
# Tiny scenarios on simulated streams (``torch.cpu``'s, which the checker replaces), each
# pinning down one rule of the model that the pipeline's scenarios above do not exercise on
# their own (found by a mutation run of stream_checker.py).


def _written_on(
    stream: torch.Stream, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Device memory allocated and written by ``stream``."""
    with torch.cpu.stream(stream):
        return torch.zeros(numel, dtype=dtype)


@pytest.mark.no_stream_check  # it runs its own checker
def test_an_event_is_done_only_once_the_host_waited_for_it_and_only_then_timed():
    """``query()`` says done only after the host waited (the device may always be behind), and
    ``elapsed_time`` refuses, as CUDA's does, events not done, not recorded or not timed: the
    step statistics must wait for (or poll) the ends of their spans."""
    with StreamChecker():
        side = torch.cpu.Stream()
        begin, end = torch.cpu.Event(enable_timing=True), torch.cpu.Event(enable_timing=True)
        untimed = torch.cpu.Event()
        assert end.query()  # not recorded: nothing to wait for
        with torch.cpu.stream(side):
            begin.record()
            torch.zeros(8)
            end.record()
            untimed.record()
        assert not end.query() and not untimed.query()
        with pytest.raises(RuntimeError, match="not done yet"):
            begin.elapsed_time(end)
        end.synchronize()
        assert end.query() and untimed.query()
        assert begin.elapsed_time(end) >= 0
        for first, second in ((begin, untimed), (untimed, end)):
            with pytest.raises(RuntimeError, match="enable_timing"):
                first.elapsed_time(second)
        never = torch.cpu.Event(enable_timing=True)
        with pytest.raises(RuntimeError, match="not recorded"):
            begin.elapsed_time(never)


@pytest.mark.no_stream_check  # it runs its own checker
@pytest.mark.parametrize(
    ("dtype", "write", "read", "conflicts"),
    [
        (torch.float32, lambda x: x[0:4].fill_(1), lambda x: x[3:8].sum(), True),
        (torch.float32, lambda x: x[0:4].fill_(1), lambda x: x[4:8].sum(), False),
        (torch.uint8, lambda x: x[0:4].fill_(1), lambda x: x[3:8].sum(), True),
        (
            torch.float32,
            lambda x: x.view(4, 4)[:, 1].fill_(1),
            lambda x: x.view(4, 4)[3].sum(),
            True,
        ),
        (torch.float32, lambda x: x.view(4, 4)[:, 1].fill_(1), lambda x: x[14:].sum(), False),
        (torch.float32, lambda x: x[5:6].fill_(1), lambda x: x[5].sum(), True),
    ],
    ids=["one-element-apart", "adjacent", "one-byte", "strided", "between-strides", "one-element"],
)
def test_accesses_conflict_exactly_where_their_bytes_overlap(dtype, write, read, conflicts):
    """Chunks are slices of a few large buffers: two accesses conflict iff their byte ranges
    overlap, by as little as one byte (or one element of a strided view), and not when they
    only touch."""
    with StreamChecker() as checker:
        side = torch.cpu.Stream()
        x = torch.zeros(16, dtype=dtype)
        side.wait_event(torch.cpu.current_stream().record_event())
        with torch.cpu.stream(side):
            write(x)
        read(x)  # on the compute stream, with no wait for the side stream
    assert len(checker.violations) == (1 if conflicts else 0), checker.violations


@pytest.mark.no_stream_check  # it runs its own checker
def test_an_in_place_ops_result_is_the_memory_it_wrote_not_fresh_memory():
    """In-place ops return their (view) argument: that result keeps the history of its bytes,
    which only a fresh allocation forgets, also for a view at an offset into its storage."""
    with StreamChecker() as checker:
        x = _written_on(torch.cpu.Stream(), 8)
        x[4:].add_(1)  # on the compute stream, with no wait for the side stream's write
    assert len(checker.violations) == 1 and "add_ on compute stream writes" in checker.violations[0]


@pytest.mark.no_stream_check  # it runs its own checker
@pytest.mark.parametrize("later", ["own-read", "own-partial-write", "other-streams-read"])
def test_later_accesses_forget_only_what_they_cover_for_their_own_stream(later):
    """A stream's history of a range is kept short: an access replaces only its own stream's
    earlier accesses that it covers and that are no more than it (a read never replaces a
    write). Another stream's access, or one covering part of an earlier one, replaces nothing:
    the earlier access still conflicts with what is not ordered after it."""
    with StreamChecker() as checker:
        side, other = torch.cpu.Stream(), torch.cpu.Stream()
        x = _written_on(side, 12)
        if later == "own-read":
            with torch.cpu.stream(side):
                x.sum()
            x.sum()  # on the compute stream, not ordered after the side stream's write
        elif later == "own-partial-write":
            with torch.cpu.stream(side):
                x[4:].fill_(1)
            x[:4].sum()  # reads what only the first write wrote
        else:
            made = side.record_event()
            other.wait_event(made)
            with torch.cpu.stream(side):
                x.sum()
            with torch.cpu.stream(other):
                x.sum()
            checker.current.wait_event(other.record_event())
            x.fill_(0)  # ordered after the other stream's read, not the side stream's
    assert len(checker.violations) == 1, checker.violations


@pytest.mark.no_stream_check  # it runs its own checker
def test_a_new_host_buffer_forgets_only_its_own_memory():
    """Host buffers allocated between two conflicting accesses of other memory change nothing
    about them."""
    with StreamChecker() as checker:
        x = _written_on(torch.cpu.Stream(), 8)
        host_state.host_empty(64, torch.float32)
        x.sum()
    assert len(checker.violations) == 1


@pytest.mark.no_stream_check  # it runs its own checker
def test_the_host_is_not_ordered_after_work_queued_on_its_current_stream():
    """Queued work runs later: the host reading a host buffer that a non-blocking copy queued
    on the current stream writes must first wait for it, as the copy-outs are waited for."""
    with StreamChecker() as checker:
        buffer = host_state.host_empty(8, torch.float32)
        torch.cpu.Stream()  # another stream exists
        buffer.copy_(torch.ones(8), non_blocking=True)  # queued on the compute stream
        buffer.mul_(2.0)  # on the host
    assert len(checker.violations) == 1
    assert "mul_ on the host writes host buffer" in checker.violations[0]


@pytest.mark.no_stream_check  # it runs its own checker
def test_a_clone_reads_its_argument():
    """Only views read no data: ``clone`` (as ``state_dict()`` copies are made) reads what it
    copies."""
    with StreamChecker() as checker:
        x = _written_on(torch.cpu.Stream(), 8)
        x.clone()  # on the compute stream, with no wait for the side stream
    assert len(checker.violations) == 1 and "clone on compute stream reads" in checker.violations[0]


@pytest.mark.no_stream_check  # it runs its own checker
def test_a_tensor_passed_as_a_keyword_out_argument_is_written():
    """``out=`` is a keyword argument of the op (``torch.where(..., out=master)`` in the
    update): the tensor passed is written, not fresh memory."""
    with StreamChecker() as checker:
        side = torch.cpu.Stream()
        x, out = torch.zeros(8), torch.zeros(8)
        side.wait_event(torch.cpu.current_stream().record_event())
        with torch.cpu.stream(side):
            out.sum()
        torch.add(x, 1, out=out)  # on the compute stream, not ordered after the read
    assert len(checker.violations) == 1 and "add on compute stream writes" in checker.violations[0]


@pytest.mark.no_stream_check  # it runs its own checker
@pytest.mark.parametrize(
    ("access", "waits"),
    [
        (lambda buffer: torch.empty(8).copy_(buffer), True),
        (lambda buffer: torch.empty(8).copy_(buffer, non_blocking=True), False),
        (lambda buffer: buffer.to(torch.float64), True),
        (lambda buffer: buffer.to(torch.float64, non_blocking=True), False),
        (
            lambda buffer: (torch.empty(8).copy_(buffer, non_blocking=True), torch.ones(1).item()),
            True,
        ),
    ],
    ids=["copy", "non-blocking-copy", "to", "non-blocking-to", "item"],
)
def test_the_host_waits_for_synchronous_copies_and_python_values(access, waits):
    """Queued work that touches host memory without ``non_blocking=True``, or returns a Python
    value, blocks the host until it ran: the host's next write of the buffer is ordered after
    the read; a non-blocking copy leaves them unordered."""
    with StreamChecker() as checker:
        buffer = host_state.host_empty(8, torch.float32)
        access(buffer)  # queued on the compute stream: it reads device memory as well
        buffer.fill_(1.0)  # on the host
    assert len(checker.violations) == (0 if waits else 1), checker.violations


def _freed_after_a_side_streams_read(wait: bool, record: bool) -> None:
    side = torch.cpu.Stream()
    x = torch.zeros(8)  # allocated on the compute stream
    side.wait_event(torch.cpu.current_stream().record_event())
    with torch.cpu.stream(side):
        x.sum()
    if record:
        x.record_stream(side)
    if wait:
        torch.cpu.current_stream().wait_event(side.record_event())
    del x
    torch.zeros(8)  # the compute stream's next allocation may reuse x's memory


def _freed_by_the_compute_stream_after_its_read_of_side_stream_memory() -> None:
    side = torch.cpu.Stream()
    with torch.cpu.stream(side):
        x = torch.zeros(8)  # the side stream's memory
    torch.cpu.current_stream().wait_event(side.record_event())
    x.sum()  # on the compute stream
    del x  # freed while the compute stream is current: still the side stream's memory
    with torch.cpu.stream(side):
        torch.zeros(8)


def _recorded_for_another_stream_than_the_one_reading() -> None:
    side, recorded = torch.cpu.Stream(), torch.cpu.Stream()
    x = torch.zeros(8)
    x.record_stream(recorded)  # before the side stream's use (as used_by_side_streams does)
    side.wait_event(torch.cpu.current_stream().record_event())
    with torch.cpu.stream(side):
        x.sum()
    del x
    torch.zeros(8)


def _two_frees_the_second_unordered() -> None:
    first, second = torch.cpu.Stream(), torch.cpu.Stream()
    x, y = torch.zeros(8), torch.zeros(8)
    made = torch.cpu.current_stream().record_event()
    first.wait_event(made)
    second.wait_event(made)
    with torch.cpu.stream(first):
        x.sum()
    with torch.cpu.stream(second):
        y.sum()
    torch.cpu.current_stream().wait_event(first.record_event())
    del x, y
    torch.zeros(8)


@pytest.mark.no_stream_check  # it runs its own checker
@pytest.mark.parametrize(
    ("scenario", "reported"),
    [
        (lambda: _freed_after_a_side_streams_read(wait=False, record=False), 1),
        (lambda: _freed_after_a_side_streams_read(wait=True, record=False), 0),
        (lambda: _freed_after_a_side_streams_read(wait=False, record=True), 0),
        (_freed_by_the_compute_stream_after_its_read_of_side_stream_memory, 1),
        (_recorded_for_another_stream_than_the_one_reading, 1),
        (_two_frees_the_second_unordered, 1),
    ],
    ids=[
        "unordered",
        "waited-for",
        "recorded",
        "allocating-stream",
        "other-stream-recorded",
        "two-frees",
    ],
)
def test_freed_device_memory_is_reused_only_after_other_streams_uses(scenario, reported):
    """The caching allocator hands freed memory to the next allocation of the stream that
    allocated it (whichever stream is current at the free): each other stream's use must be
    ordered before that allocation, or that very stream named by ``record_stream``; every
    such use is checked, not just the first freed."""
    with StreamChecker() as checker:
        scenario()
    assert len(checker.violations) == reported, checker.violations
    assert all("was free for the next allocation" in v for v in checker.violations)
