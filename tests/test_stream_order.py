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
from lightning_offload_optim import OffloadAdamW
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
    return problems + overlap_scenario(monkeypatch) + resident_scenario(monkeypatch)


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
    streams = opt._pipeline._streams[torch.device("cpu")]
    problems = []
    for arena in opt._host.arenas:
        events = [e for e in arena._in_flight if e is not None]  # the last write and read
        for stream in (streams.copy_in, streams.copy_out):
            if all(e.clock.get(stream.id, 0) < stream.clock[stream.id] for e in events):
                problems.append(f"an arena could be freed while the {stream} still uses it")
    return problems


def run_checked(pipeline: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(adamw_module, "StagingPipeline", pipeline.StagingPipeline)
    with StreamChecker() as checker:
        problems = scenario(monkeypatch)
    return checker.violations + problems


def test_the_harness_finds_every_ordering_step():
    """Eleven waits, thirteen data-ordering events (four of them the ends of timed copies),
    two host waits and five notes of an arena's last use today: a new one counts too."""
    kinds = [label.split(": ", 1)[1].split("(")[0].split(".")[-1] for label, _ in MUTANTS]
    assert sorted(kinds) == (
        ["event"] * 4
        + ["read_by"] * 2
        + ["record"] * 9
        + ["synchronize"] * 2
        + ["wait"] * 11
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
