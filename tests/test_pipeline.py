"""Chunk planning, host buffer layout, and what stays out of optimizer.state."""

from __future__ import annotations

import copy
import gc
import itertools
import mmap
import os
import random
import warnings

import pytest
import torch
from conftest import (
    accelerator_seen,
    assert_same,
    assert_state_offloaded,
    clone_params,
    forked_child_memory_map,
    make_params,
    overlapped_pair,
    set_grads,
    step_together,
)

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim.functional import SPLIT_ALIGNMENT
from lightning_offload_optim.host_state import MASTER_KEY, HostState
from lightning_offload_optim.pipeline import StagingPipeline, StagingPool, plan_chunks
from lightning_offload_optim.resident import ResidentRanges

MOMENTS = ("exp_avg", "exp_avg_sq")


def laid_out(params: list[torch.Tensor], keys: tuple[str, ...] = MOMENTS) -> HostState:
    """Pageable host state with ``keys`` for ``params``, laid out in their order."""
    host = HostState(pin_for=lambda device: False)
    host.adopt(host.allocate([(p, keys) for p in params]))
    return host


@pytest.mark.parametrize("seed", range(20))
def test_chunks_cover_each_active_element_once_within_bounds(seed):
    """Chunks tile the active state in aligned pieces within the bound, each resident or not as
    a whole. A resident parameter of an arena without a master copy (odd seeds have one) is
    never split: it needs no staging buffer, and each piece would cost an update and an event."""
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 700),) for _ in range(rng.randint(1, 12))]
    params = make_params(shapes)
    master = seed % 2 == 1
    host = laid_out(params, (*MOMENTS, MASTER_KEY) if master else MOMENTS)
    arena = host.arenas[0]
    kept = {i for i in range(len(params)) if rng.random() < 0.4}
    slots = [host.slots[p] for p in params]
    arena.resident = ResidentRanges.of(
        (slots[i].offset, slots[i].offset + slots[i].layout.numel) for i in kept
    )
    active = [i for i in range(len(params)) if rng.random() < 0.7]
    chunk_numel = SPLIT_ALIGNMENT * rng.randint(1, 6)
    chunks = plan_chunks([slots[i] for i in active], chunk_numel)

    covered = {
        i: torch.zeros(params[active[i]].numel(), dtype=torch.int32) for i in range(len(active))
    }
    pieces = dict.fromkeys(range(len(active)), 0)
    for chunk in chunks:
        assert chunk.numel > 0
        first = arena.resident.device_start(chunk.start, chunk.start + 1) is not None
        assert chunk.resident == first  # resident as a whole, or not at all
        if chunk.numel > chunk_numel:  # only a whole resident parameter, alone
            assert chunk.resident and not master and len(chunk.segments) == 1
        position = chunk.start
        for seg in chunk.segments:
            slot = slots[active[seg.index]]
            # Segments tile the chunk in order and map to the right place in the arena.
            assert slot.offset + seg.start == position
            position += seg.stop - seg.start
            # Splits inside a parameter fall on multiples of the alignment from its start.
            assert seg.start % SPLIT_ALIGNMENT == 0
            assert seg.stop == slot.layout.numel or seg.stop % SPLIT_ALIGNMENT == 0
            covered[seg.index][seg.start : seg.stop] += 1
            pieces[seg.index] += 1
        assert position == chunk.stop
    assert all(bool((c == 1).all()) for c in covered.values())
    for index, param in enumerate(active):
        if param in kept and not master:
            assert pieces[index] == 1
        elif params[param].numel() > chunk_numel:
            assert pieces[index] > 1


def test_inactive_parameters_split_chunks_so_their_state_is_not_moved():
    params = make_params([(10,), (10,), (10,)])
    host = laid_out(params)
    chunks = plan_chunks([host.slots[params[0]], host.slots[params[2]]], 1024)
    assert [(c.start, c.stop) for c in chunks] == [(0, 10), (20, 30)]


@pytest.mark.parametrize(
    "mode", [{}, {"force_staging": True, "chunk_size": 256}], ids=["direct", "staged"]
)
def test_a_chunk_never_runs_on_into_the_state_of_another_arena(mode):
    """Each arena (kind of state) is cut into chunks of its own: where the first active
    parameter of the next arena starts at the offset the last chunk of the previous one
    stops at, it still starts a chunk in its own arena, and the step is torch AdamW's."""
    generator = torch.Generator().manual_seed(0)
    dtypes = [torch.float32] * 2 + [torch.float64] * 2
    values = [torch.randn(100, generator=generator, dtype=d) for d in dtypes]
    params = [torch.nn.Parameter(v.clone()) for v in values]
    reference = [torch.nn.Parameter(v.clone()) for v in values]
    ours = OffloadAdamW(params, **mode)
    theirs = torch.optim.AdamW(reference, fused=True)
    step_together([ours, theirs], [params, reference], generator, 1)  # lays the state out
    first, second = sorted(ours._host.arenas, key=id)  # the order plan_chunks takes them in
    slots = [ours._host.slots[p] for p in params]
    # Active: the first arena's parameter at offset 0 (its chunk stops at 100), and the
    # second arena's parameter at offset 100.
    active = [(s.arena, s.offset) in ((first, 0), (second, 100)) for s in slots]
    assert sum(active) == 2
    step_together([ours, theirs], [params, reference], generator, 2, skip=lambda i: not active[i])
    assert_same(params, reference)


@pytest.mark.parametrize(
    ("dtype", "amsgrad", "bytes_per_element"),
    [(torch.float32, False, 8), (torch.float32, True, 12), (torch.bfloat16, False, 12)],
)
def test_state_lives_in_few_large_host_buffers(dtype, amsgrad, bytes_per_element):
    params = make_params(dtype=dtype)
    opt = OffloadAdamW(params, amsgrad=amsgrad)
    set_grads([params], torch.Generator().manual_seed(0))
    opt.step()
    numel = sum(p.numel() for p in params)
    stats = opt.memory_stats()
    assert stats["state_bytes"] == bytes_per_element * numel
    assert stats["host_bytes"] / stats["state_bytes"] <= 1.02
    assert len(opt._host.arenas) == 1
    assert len(opt._host.arenas[0].buffers) == bytes_per_element // 4
    assert_state_offloaded(opt, params)


def test_staging_buffers_are_bounded_by_chunk_size_not_model_size():
    small, large = make_params([(64 * 10,)]), make_params([(64 * 1000,)] * 3)
    sizes = []
    for params in (small, large):
        opt = OffloadAdamW(params, force_staging=True, chunk_size=256)
        set_grads([params], torch.Generator().manual_seed(0))
        opt.step()
        sizes.append(
            sum(
                t.numel()
                for bufs in opt._pipeline.pool.buffers.values()
                for b in bufs
                for t in b.values()
            )
        )
    assert sizes[0] == sizes[1] == 2 * 256 * 2  # two buffers of exp_avg and exp_avg_sq


@pytest.mark.parametrize(
    ("dtype", "bytes_per_element"), [(torch.float32, 8), (torch.bfloat16, 16)], ids=["fp32", "bf16"]
)
def test_a_step_of_one_chunk_holds_one_staging_set(dtype, bytes_per_element):
    """One optimizer per parameter (stepped in backward): each step is one chunk, which takes
    the first staging set only; a second set would hold the parameter's state twice over on the
    device. Two chunks of a kind take both sets, so that one loads while the other computes.
    Per element: the two moments, and for bf16 the master copy and the gradient scratch."""
    one = make_params([(1024,)], dtype=dtype)
    two = make_params([(1024,), (1024,)], dtype=dtype)
    alone = OffloadAdamW(one, force_staging=True, chunk_size=1024)
    pair = OffloadAdamW(two, force_staging=True, chunk_size=1024)
    step_together([alone], [one], torch.Generator().manual_seed(0), 2)
    step_together([pair], [two], torch.Generator().manual_seed(0), 2)
    assert alone.memory_stats()["staging_bytes"] == bytes_per_element * 1024
    assert pair.memory_stats()["staging_bytes"] == 2 * bytes_per_element * 1024


def test_pipelines_of_one_pool_take_its_sets_in_turn():
    """Pipelines of one shared pool hold two sets of the largest chunk between them, and each
    step starts at the set after the last step's, so the next optimizer's chunk loads while the
    last one's computes; a pipeline's own pool starts every step at its first (and, for steps
    of one chunk, only) set."""
    n = SPLIT_ALIGNMENT
    params = make_params([(n,), (n,)])
    host = laid_out(params)
    pool = StagingPool()
    pipelines = [StagingPipeline(n, force_staging=True, pool=pool) for _ in params]
    own = StagingPipeline(n, force_staging=True)
    used = []

    def update(chunk, views):
        used.append(views["exp_avg"].data_ptr())

    shared_turns = list(zip(pipelines, params, strict=True))
    alone = make_params([(n,)])
    host.adopt(host.allocate([(alone[0], MOMENTS)]))
    turns = [*shared_turns, *shared_turns, (own, alone[0]), (own, alone[0])]
    for pipeline, param in turns:
        chunks = plan_chunks([host.slots[param]], n)
        pipeline.prepare(chunks)
        pipeline.run(chunks, update)
    kind = (torch.device("cpu"), torch.float32)
    shared = [buffers["exp_avg"].data_ptr() for buffers in pool.buffers[kind]]
    (first,) = [buffers["exp_avg"].data_ptr() for buffers in own.pool.buffers[kind]]
    assert used == [shared[0], shared[1], shared[0], shared[1], first, first]
    assert pool.staging_bytes == own.staging_bytes * 2 == 2 * len(MOMENTS) * n * 4
    for pipeline in [*pipelines, own]:
        pipeline.wait_host()


def test_chunk_size_is_rounded_to_the_split_alignment():
    assert OffloadAdamW(make_params(), chunk_size=1000).chunk_size == 960


def test_offloaded_state_is_a_copy():
    params = make_params()
    opt = OffloadAdamW(params)
    assert opt.offloaded_state(params[0]) == {}
    set_grads([params], torch.Generator().manual_seed(0))
    opt.step()
    state = opt.offloaded_state(params[0])
    state["exp_avg"].fill_(123.0)
    assert not (opt.offloaded_state(params[0])["exp_avg"] == 123.0).any()


def test_overlap_with_the_host_buffers_is_exact_at_their_edges():
    """Loads write in place only when no source shares memory with the buffers, and mark the
    views lent earlier that they write over: a range that ends where a buffer starts, or
    starts where it ends, is not in it. Over the buffers of several arenas (parameters first
    stepped at different steps), found by binary search: ranges across gaps and buffers too."""
    params = make_params()
    opt = OffloadAdamW(params, pin_memory=False)
    generator = torch.Generator().manual_seed(0)
    for first in range(len(params)):  # one arena per step
        set_grads([params], generator, skip=lambda i, first=first: i > first)
        opt.step()
    buffers = [b for arena in opt._host.arenas for b in arena.buffers.values()]
    assert len(opt._host.arenas) == len(params)
    spans = [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in buffers]

    def covered(start: int, stop: int) -> bool:  # by any buffer, from their addresses alone
        return any(first < stop and start < last for first, last in spans)

    overlaps = opt._host._overlap_test()
    edges = sorted({edge for span in spans for edge in span})
    for start, stop in spans:
        for probe, nbytes, inside in [
            (start, 1, True),
            (stop - 1, 1, True),
            (start - 8, 8, False),
            (stop, 8, False),
        ]:
            expected = inside or covered(probe, probe + nbytes)
            assert overlaps(probe, nbytes) == expected, (probe - start, nbytes)
    for low, high in itertools.combinations(edges, 2):  # from any edge to any later one
        for probe, stop in [(low, high), (low - 1, high), (low + 1, high - 1)]:
            if probe < stop:
                assert overlaps(probe, stop - probe) == covered(probe, stop), (low, high)


def test_overlap_with_the_host_buffers_is_found_whatever_the_buffers_spans():
    """The search by address does not rely on the buffers being apart: spans nested in or
    overlapping others, and empty buffers, answer as a scan of every buffer would."""
    import types

    opt = OffloadAdamW(make_params(), pin_memory=False)
    base = torch.empty(400, dtype=torch.uint8)
    address = base.data_ptr()
    generator = random.Random(0)
    for _ in range(200):
        cuts = [sorted(generator.sample(range(401), 2)) for _ in range(generator.randint(1, 6))]
        buffers = {str(i): base[a:b] for i, (a, b) in enumerate(cuts)}
        opt._host.arenas = [types.SimpleNamespace(buffers=buffers)]
        touches = opt._host._overlap_test()
        for start in range(-2, 402, 7):
            for nbytes in (0, 1, 5, 60, 400):
                scan = nbytes > 0 and any(
                    a < b and a < start + nbytes and start < b for a, b in cuts
                )
                assert touches(address + start, nbytes) == scan, (cuts, start, nbytes)


def test_host_buffers_are_freed_with_the_optimizer():
    import gc
    import weakref

    params = make_params()
    opt = OffloadAdamW(params)
    set_grads([params], torch.Generator().manual_seed(0))
    opt.step()
    arena = weakref.ref(opt._host.arenas[0])
    gc.disable()  # freed by reference counting alone, not only by the cycle collector
    try:
        del opt
        assert arena() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", [{}, {"force_staging": True}], ids=["direct", "staged"])
def test_low_precision_gradient_scratch_is_bounded_by_chunk_size_and_counted(mode):
    """bf16 parameters need their gradients in fp32 for the update on the master copy. That
    scratch was two buffers the size of the whole model on the CPU, and uncounted."""
    sizes = []
    for shapes in ([(640,)], [(64_000,)] * 3):
        params = make_params(shapes, dtype=torch.bfloat16)
        opt = OffloadAdamW(params, chunk_size=256, **mode)
        set_grads([params], torch.Generator().manual_seed(0))
        opt.step()
        sizes.append(opt.memory_stats()["staging_bytes"])
    # Direct: one fp32 gradient scratch of one chunk. Staged: two buffers of one chunk for each
    # of exp_avg, exp_avg_sq, master_param and the gradient scratch.
    expected = 256 * 4 * (1 if not mode else 2 * 4)
    assert sizes == [expected, expected]


def test_memory_stats_for_float64_state():
    params = make_params([(10, 10), (7,)], dtype=torch.float64)
    opt = OffloadAdamW(params, amsgrad=True)
    set_grads([params], torch.Generator().manual_seed(0))
    opt.step()
    stats = opt.memory_stats()
    assert stats["state_bytes"] == 3 * 8 * 107  # three float64 moments
    assert stats["host_bytes"] == stats["state_bytes"]
    assert stats["staging_bytes"] == 0 and stats["pinned"] is False


def test_host_bytes_count_buffers_that_outlive_some_of_their_slots():
    """State cleared for one parameter is laid out afresh; its old slot stays allocated inside
    the arena the other parameters still use: host_bytes exceeds state_bytes by exactly that."""
    params = make_params()
    opt = OffloadAdamW(params)
    set_grads([params], torch.Generator().manual_seed(0))
    opt.step()
    del opt.state[params[1]]
    opt.step()
    stats = opt.memory_stats()
    numel = sum(p.numel() for p in params)
    assert stats["state_bytes"] == 8 * numel
    assert stats["host_bytes"] == 8 * numel + 8 * params[1].numel()
    assert len(opt._host.arenas) == 2


def test_registered_host_buffers_own_their_pages():
    """cudaHostRegister fails for a page that is already registered; small buffers from the C
    heap share pages. Every registered range is page-aligned, whole pages, inside its own
    allocation, and no two overlap; large ones are registered in pieces."""
    from lightning_offload_optim import host_state

    registered: list[tuple[int, int]] = []

    def register(pointer: int, nbytes: int) -> int:
        registered.append((pointer, nbytes))
        return 0

    page = host_state.PAGE_SIZE
    buffers = []
    for numel in [1, 3, 17, 1000, page // 4 + 1, 5]:
        buffer, pointers = host_state.registered_empty(numel, torch.float32, register)
        buffers.append(buffer)
        start, nbytes = registered[-1]
        assert pointers == [start] and start % page == 0 and nbytes % page == 0
        # torch's is_pinned() asks about the storage's start: it must be the registered one.
        assert buffer.untyped_storage().data_ptr() == buffer.data_ptr() == start
        assert 4 * numel <= nbytes == buffer.untyped_storage().nbytes() < 4 * numel + page
    ranges = sorted(registered)
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(ranges))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_pinned_buffers_are_not_inherited_by_forked_processes():
    """A DataLoader's workers are forked, each epoch: Linux would copy every pinned page of the
    state into each of them. The child must not have the mapping at all."""
    from lightning_offload_optim import host_state

    buffer, _ = host_state.registered_empty(10 * host_state.PAGE_SIZE, torch.uint8, lambda p, n: 0)
    start = buffer.data_ptr()
    assert not any(low <= start < high for low, high in forked_child_memory_map()), (
        "the child has the state's pages"
    )
    buffer.fill_(1)  # the parent's mapping is unaffected
    assert buffer.sum().item() == buffer.numel()


def test_registration_in_pieces_and_clean_up_after_a_failure(monkeypatch):
    from lightning_offload_optim import host_state

    page = host_state.PAGE_SIZE
    monkeypatch.setattr(host_state, "MAX_REGISTRATION_BYTES", 2 * page)
    calls, released = [], []

    def register(pointer: int, nbytes: int) -> int:
        calls.append(nbytes)
        return 0 if len(calls) < 3 else 712  # cudaErrorHostMemoryAlreadyRegistered

    numel = 5 * page // 4  # five pages of float32
    with pytest.raises(RuntimeError, match="failed with error 712"):
        host_state.registered_empty(numel, torch.float32, register, released.append)
    assert calls == [2 * page, 2 * page, page]
    assert len(released) == 2  # the pieces registered before the failure
    calls.clear()
    _, pointers = host_state.registered_empty(
        numel, torch.float32, lambda p, n: calls.append(n) or 0
    )
    assert calls == [2 * page, 2 * page, page] and len(pointers) == 3


def fake_cuda_pinning(monkeypatch: pytest.MonkeyPatch, capturing: list[bool]) -> list[int]:
    """Pinned arenas on the CPU: pages "registered" with no runtime, graph capture on while
    ``capturing[0]``, no release put off by other tests; returns the pointers unregistered."""
    from lightning_offload_optim import host_state

    unregistered: list[int] = []
    monkeypatch.setattr(host_state, "_cuda_host_unregister", unregistered.append)
    monkeypatch.setattr(
        host_state,
        "_pinned_empty",
        lambda numel, dtype, device: host_state.registered_empty(numel, dtype, lambda p, n: 0),
    )
    monkeypatch.setattr(host_state, "_capturing", lambda: capturing[0])
    monkeypatch.setattr(host_state, "_deferred_releases", [])
    return unregistered


def test_pinned_buffers_freed_during_a_graph_capture_are_released_after_it(monkeypatch):
    """Waiting for an event and cudaHostUnregister are not allowed while a CUDA graph is
    captured, and garbage collection may free an arena inside a capture
    (``torch.compile(mode="reduce-overhead")``): its release waits for the next pinned arena
    made outside a capture."""
    capturing = [False]
    unregistered = fake_cuda_pinning(monkeypatch, capturing)

    def trained_pinned() -> tuple[OffloadAdamW, list[int]]:
        params = make_params()
        with accelerator_seen():
            opt = OffloadAdamW(params, force_staging=True, chunk_size=64, pin_memory=True)
        step_together([opt], [params], torch.Generator().manual_seed(0), 1)
        pointers = [b.data_ptr() for a in opt._host.arenas for b in a.buffers.values()]
        assert opt.memory_stats()["pinned"] and pointers
        return opt, pointers

    class LastCopy:  # an arena's last copy, waited for only outside a capture
        def synchronize(self) -> None:
            assert not capturing[0], "an event waited for during a graph capture"
            waited.append(self)

    waited: list[LastCopy] = []
    opt, first = trained_pinned()
    for arena in opt._host.arenas:
        arena.written_by(LastCopy())
    del arena
    capturing[0] = True
    del opt
    gc.collect()
    assert unregistered == [] and waited == []
    capturing[0] = False
    second_opt, second = trained_pinned()
    assert sorted(unregistered) == sorted(first)
    assert len(waited) == len(first) // 2  # each arena's (two state keys each)
    del second_opt
    gc.collect()
    assert sorted(unregistered) == sorted(first + second)  # freed outside a capture: at once


def test_a_release_run_during_another_takes_each_deferred_buffer_once(monkeypatch):
    """A finalizer may run inside the release loop (garbage collection in Python code, another
    thread while an event wait lets go of the GIL) and take what the loop was about to."""
    from lightning_offload_optim import host_state

    unregistered: list[int] = []
    monkeypatch.setattr(host_state, "_cuda_host_unregister", unregistered.append)
    monkeypatch.setattr(host_state, "_deferred_releases", [([1], [None], [])])
    calls = [0]

    def capturing() -> bool:
        calls[0] += 1
        if calls[0] == 1:  # another arena's finalizer runs here
            host_state._release_pinned([2], [None], [])
        return False

    monkeypatch.setattr(host_state, "_capturing", capturing)
    host_state._release_deferred()
    assert sorted(unregistered) == [1, 2]


def test_pinning_failure_falls_back_to_pageable_memory_with_one_warning():
    """Hosts that cap pinned memory: the state stays pageable, training goes on exactly."""
    params = make_params()
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with pytest.warns(UserWarning) as warned:
        with accelerator_seen():
            opt = OffloadAdamW(params[:3], force_staging=True, chunk_size=64)
        assert opt.pin_memory is True
        torch_opt = torch.optim.AdamW(reference[:3], fused=True)
        generator = torch.Generator().manual_seed(0)
        step_together([opt, torch_opt], [params[:3], reference[:3]], generator, 2)
        opt.add_param_group({"params": params[3:]})  # a second allocation does not warn again
        torch_opt.add_param_group({"params": reference[3:]})
        step_together([opt, torch_opt], [params, reference], generator, 2)
    pin_warnings = [w for w in warned if "could not pin host memory" in str(w.message)]
    assert len(pin_warnings) == 1
    assert opt.memory_stats()["pinned"] is False
    assert_same(params, reference)


def test_pinning_failure_warns_once_across_loads():
    """A load lays the state out afresh: it must not retry pinning or warn again."""
    params = make_params()
    with pytest.warns(UserWarning) as warned:
        with accelerator_seen():
            opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
        step_together([opt], [params], torch.Generator().manual_seed(0), 1)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        step_together([opt], [params], torch.Generator().manual_seed(1), 1)
    assert sum("could not pin host memory" in str(w.message) for w in warned) == 1


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTFORK"), reason="Linux only")
def test_a_host_refusing_to_keep_pinned_pages_out_of_forks_falls_back_to_pageable(monkeypatch):
    """A kernel or sandbox that refuses madvise(MADV_DONTFORK) is a refusal to pin, not a
    crash: nothing is registered, the optimizer warns once, keeps its state pageable and steps
    as torch AdamW does (an advice value no kernel knows stands in for the refusal)."""
    from lightning_offload_optim import host_state

    registered = []
    monkeypatch.setattr(
        host_state,
        "_pinned_empty",
        lambda numel, dtype, device: host_state.registered_empty(
            numel, dtype, lambda p, n: registered.append(p) or 0
        ),
    )
    monkeypatch.setattr(host_state.mmap, "MADV_DONTFORK", 12345)
    params = make_params()
    reference = clone_params(params)
    with accelerator_seen():
        opt = OffloadAdamW(params, force_staging=True, chunk_size=64, pin_memory=True)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    with pytest.warns(UserWarning, match="could not pin host memory.*madvise"):
        step_together([opt, torch_opt], [params, reference], torch.Generator().manual_seed(2), 2)
    assert not registered and opt.memory_stats()["pinned"] is False
    assert_same(params, reference)


def test_host_out_of_memory_is_not_taken_for_a_pinning_failure(monkeypatch):
    """Only a refusal to pin falls back to pageable memory; running out of host memory is an
    error (silently retrying pageable would hide it and disable pinning for the run)."""
    from lightning_offload_optim import host_state

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("simulated: DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(host_state, "_pinned_empty", out_of_memory)
    params = make_params()
    with accelerator_seen():
        opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    set_grads([params], torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            opt.step()
    assert not opt.state and opt._host.pin_failed is False


def test_a_resolved_step_record_covers_the_resident_updates(stream_order):
    """The step's time ends after its last update as well as its last copy-out: resident
    chunks update on the compute stream after the copies are queued, so resolving the record
    (the monitor's ``step_ms``) must wait for them too."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64, resident=0.5)
    step_together([opt], [params], torch.Generator().manual_seed(0), 3)  # resident from step 2
    assert opt.memory_stats()["resident_bytes"] > 0
    done = torch.cpu.current_stream().record_event()  # after the step's work on the stream
    opt.last_step.resolve()
    assert done.query()


def test_chunks_follow_memory_order_not_step_order():
    """Slots given out of memory order (the step's order) are still cut in memory order: the
    state of adjacent parameters is one chunk, moved by one copy per key (P01)."""
    params = make_params([(10,), (20,), (30,), (40,)])
    host = laid_out(params)
    slots = [host.slots[p] for p in reversed(params)]
    chunks = plan_chunks(slots, 1024)
    assert [(c.start, c.stop) for c in chunks] == [(0, 100)]
    assert [s.index for s in chunks[0].segments] == [3, 2, 1, 0]


def test_a_parameter_that_exactly_fills_the_room_left_is_not_split():
    """A parameter whose state fits exactly in what is left of a chunk goes in whole, even when
    that room is not a multiple of the split alignment (P05)."""
    bound = 2 * SPLIT_ALIGNMENT
    params = make_params([(10,), (bound - 10,), (7,)])
    host = laid_out(params)
    chunks = plan_chunks([host.slots[p] for p in params], bound)
    assert [(c.start, c.stop) for c in chunks] == [(0, bound), (bound, bound + 7)]
    assert [(s.index, s.start, s.stop) for s in chunks[0].segments] == [
        (0, 0, 10),
        (1, 0, bound - 10),
    ]


def test_prefetch_skips_chunks_larger_than_the_staging_buffers():
    """Chunks larger than the staging buffers allocated so far are not queued ahead: the
    copies would not fit (P14)."""
    params = make_params([(4 * SPLIT_ALIGNMENT,)])
    host = laid_out(params)
    slots = [host.slots[p] for p in params]
    pipeline = StagingPipeline(SPLIT_ALIGNMENT, force_staging=True)
    pipeline.prepare(plan_chunks(slots, SPLIT_ALIGNMENT))
    pipeline.prefetch(plan_chunks(slots, 4 * SPLIT_ALIGNMENT))  # one chunk, 4x the buffers
    assert pipeline._prefetched == {}
    pipeline.wait_host()


def test_resident_chunks_take_no_staging_turn_so_the_first_staged_chunks_prefetch():
    """Chunks kept resident use no staging buffer: the first staged chunks after them still
    take the buffers in order, and are the ones queued ahead of the step (P17)."""
    params = make_params([(4 * SPLIT_ALIGNMENT,)])
    host = laid_out(params)
    pipeline = StagingPipeline(SPLIT_ALIGNMENT, force_staging=True)
    pipeline.set_resident({host.arenas[0]: ResidentRanges(((0, 2 * SPLIT_ALIGNMENT),))})
    chunks = plan_chunks([host.slots[p] for p in params], SPLIT_ALIGNMENT)
    assert [c.resident for c in chunks] == [True, True, False, False]
    pipeline.prepare(chunks)
    assert pipeline._sets(chunks)[0] == [0, 0, 0, 1]
    pipeline.run(chunks, lambda chunk, views: None)  # a step, then the next one's copies
    pipeline.prefetch(chunks)
    assert sorted(pipeline._prefetched) == [2, 3]
    assert [key[3] for key, _, _ in pipeline._prefetched.values()] == [0, 1]
    pipeline.wait_host()


def test_each_kind_of_state_takes_its_staging_buffers_in_turn_from_the_first():
    """Arenas of another dtype stage through buffer sets of their own: turns count per kind
    (device and dtype), so each kind's chunks alternate between its buffers and the first
    chunks of every kind are the ones queued ahead of the step."""
    n = SPLIT_ALIGNMENT
    params = make_params([(2 * n,)]) + make_params([(2 * n,)], dtype=torch.float64)
    host = laid_out(params)
    assert len(host.arenas) == 2
    pipeline = StagingPipeline(n, force_staging=True)
    chunks = plan_chunks([host.slots[p] for p in params], n)
    assert [c.arena for c in chunks][::2] == [c.arena for c in chunks][1::2]
    pipeline.prepare(chunks)
    assert pipeline._sets(chunks)[0] == [0, 1, 0, 1]
    pipeline.run(chunks, lambda chunk, views: None)  # a step, then the next one's copies
    pipeline.prefetch(chunks)
    assert sorted(pipeline._prefetched) == [0, 1, 2, 3]
    pipeline.wait_host()


def test_no_copies_are_queued_ahead_into_staging_buffers_released():
    """After :meth:`release` no staging buffer is held: the next step's copies are not queued
    ahead (there is nowhere to put them) until a step allocates buffers again."""
    params = make_params([(2 * SPLIT_ALIGNMENT,)])
    host = laid_out(params)
    pipeline = StagingPipeline(SPLIT_ALIGNMENT, force_staging=True)
    chunks = plan_chunks([host.slots[p] for p in params], SPLIT_ALIGNMENT)
    pipeline.prepare(chunks)
    pipeline.run(chunks, lambda chunk, views: None)
    pipeline.release()
    pipeline.prefetch(chunks)
    assert pipeline._prefetched == {} and pipeline.staging_bytes == 0
    pipeline.wait_host()


def test_copies_queued_ahead_are_dropped_when_prepare_grows_the_buffers():
    """A chunk queued ahead into a staging buffer that the next prepare replaces (a larger
    chunk this step) is loaded again into the new buffer, not updated from it unfilled (P10)."""
    n = SPLIT_ALIGNMENT
    params = make_params([(n,)] * 4)
    host = laid_out(params)
    for buffer in host.arenas[0].buffers.values():
        buffer.zero_()
    slots = [host.slots[p] for p in params]

    def update(chunk, views):
        views["exp_avg"].add_(1.0)

    pipeline = StagingPipeline(2 * n, force_staging=True)
    first = plan_chunks([slots[0], slots[2]], 2 * n)  # (0, n), (2n, 3n): buffers of n
    pipeline.prepare(first)
    pipeline.run(first, update)
    pipeline.prefetch(first)  # chunk 0 queued ahead into the buffers of n
    second = plan_chunks([slots[0], slots[2], slots[3]], 2 * n)  # (0, n), (2n, 4n)
    assert [(c.start, c.stop) for c in second] == [(0, n), (2 * n, 4 * n)]
    pipeline.prepare(second)  # the buffers grow to 2n
    pipeline.run(second, update)
    pipeline.wait_host()
    expected = torch.cat([torch.full((n,), v) for v in (2.0, 0.0, 2.0, 1.0)])
    assert torch.equal(host.arenas[0].buffers["exp_avg"], expected)


def test_writes_through_lent_state_views_after_a_forward_reach_the_next_step(stream_order):
    """After ``state_dict()`` the host buffers are lent out as views: a forward pass then queues
    no copies ahead (they would read the state before the caller writes through the views),
    so the next step sees the writes, as torch's AdamW does (P12)."""
    pairs = overlapped_nets()
    (model, ours), (reference, theirs) = pairs
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 16, generator=generator) for _ in range(3)]
    train(pairs, inputs[:2])
    lent = ours.state_dict()["state"]
    losses = [net(inputs[2]).square().mean() for net in (model, reference)]  # forward first
    for state in (lent, theirs.state_dict()["state"]):
        for entry in state.values():
            entry["exp_avg"].mul_(-3.0)  # then write through the views
    for loss, opt in zip(losses, (ours, theirs), strict=True):
        loss.backward()
        opt.step()
        opt.zero_grad()
    stream_order.expect_none()
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def overlapped_nets():
    """(model, OffloadAdamW overlapping its forward), (twin, torch fused AdamW), alike."""
    model, twin = TwoLayers(), TwoLayers()
    ours, theirs = overlapped_pair(model, twin, lr=0.05)
    return (model, ours), (twin, theirs)


def train(pairs, inputs):
    for x in inputs:
        for net, opt in pairs:
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()


def test_copies_queued_ahead_are_the_arenas_last_use(stream_order):
    """A copy-in queued ahead by a forward pass reads the host buffers: the arena must not be
    freed (pinned pages unregistered) before it is done, so it is noted as the last read (P15)."""
    pairs = overlapped_nets()
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    train(pairs, inputs[:2])
    (model, ours), _ = pairs
    model(inputs[2])  # queues the next step's first copies
    pipeline = ours._pipeline
    assert pipeline._prefetched
    copy_in = pipeline.pool.streams[torch.device("cpu")].copy_in
    for arena in ours._host.arenas:
        events = [e for e in arena._in_flight if e is not None]
        assert any(e.clock.get(copy_in.id, 0) >= copy_in.clock[copy_in.id] for e in events), (
            "the arena could be freed while the copy-in stream still reads it"
        )
    ours.wait_for_updates()


def test_copies_are_queued_ahead_again_after_a_step_that_read_lent_views(stream_order):
    """``state_dict()`` stops copies being queued ahead only until the next step reads the
    lent views: the forward passes after it queue them again, with the same results (P24)."""
    pairs = overlapped_nets()
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    train(pairs, inputs[:2])
    (model, ours), (reference, theirs) = pairs
    ours.state_dict()
    train(pairs, inputs[2:4])  # the first of these steps reads the lent views
    losses = [net(inputs[4]).square().mean() for net in (model, reference)]
    assert ours._pipeline._prefetched, "no copies queued ahead after the views were read"
    for loss, opt in zip(losses, (ours, theirs), strict=True):
        loss.backward()
        opt.step()
    stream_order.expect_none()
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_release_of_a_pinned_arena_waits_for_its_last_write_and_its_last_read(monkeypatch):
    """Unregistering (and unmapping) pinned memory while a copy still reads or writes it
    corrupts memory: the finalizer waits for both the last copy into the buffers
    (``written_by``) and the last copy out of them (``read_by``), and only then unregisters."""
    from lightning_offload_optim import host_state

    unregistered = fake_cuda_pinning(monkeypatch, [False])
    waited: list[tuple[str, int]] = []

    class Copy:
        def __init__(self, name: str) -> None:
            self.name = name

        def synchronize(self) -> None:
            waited.append((self.name, len(unregistered)))

    layout = host_state.ParamLayout.of(torch.zeros(300))
    arena = host_state.Arena([layout], MOMENTS, torch.float32, pin=True)
    assert arena.pinned
    arena.written_by(Copy("write"))
    arena.read_by(Copy("read"))
    del arena
    gc.collect()
    assert sorted(name for name, _ in waited) == ["read", "write"]
    assert all(done == 0 for _, done in waited), "waited after unregistering"
    assert len(unregistered) == 2  # one registration per key


def test_an_arena_of_empty_parameters_pins_nothing(monkeypatch):
    """A kind of state held only by zero-element parameters (a complex or bf16 tensor of shape
    (0, n) beside float ones) lays out no memory: asking to pin it must not map or register
    zero bytes (mmap refuses a zero length), and the step is still torch AdamW's."""
    unregistered = fake_cuda_pinning(monkeypatch, [False])
    values = [torch.randn(40, 3), torch.zeros(0, 5, dtype=torch.complex64)]
    params = [torch.nn.Parameter(v.clone()) for v in values]
    reference = [torch.nn.Parameter(v.clone()) for v in values]
    with accelerator_seen():
        ours = OffloadAdamW(params, force_staging=True, chunk_size=64, pin_memory=True)
    theirs = torch.optim.AdamW(reference, foreach=False)
    step_together([ours, theirs], [params, reference], torch.Generator().manual_seed(0), 3)
    assert_same(params, reference)
    assert [arena.pinned for arena in ours._host.arenas] == [True, False]
    assert ours.memory_stats()["pinned"]
    del ours
    gc.collect()
    assert len(unregistered) == 2  # the float arena's two keys; nothing for the empty one


def test_buffers_of_state_cleared_for_every_parameter_are_freed():
    """State cleared for all parameters (a fine-tuning phase that resets the optimizer) is laid
    out afresh: the old arena holds nothing and is dropped, not kept (host memory the size of
    the whole state, pinned on a GPU, leaked at each reset)."""
    params = make_params()
    opt = OffloadAdamW(params)
    generator = torch.Generator().manual_seed(0)
    step_together([opt], [params], generator, 1)
    for p in params:
        del opt.state[p]
    step_together([opt], [params], generator, 1)
    stats = opt.memory_stats()
    assert stats["state_bytes"] == 8 * sum(p.numel() for p in params)
    assert stats["host_bytes"] == stats["state_bytes"]
    assert len(opt._host.arenas) == 1


def test_an_optimizer_without_state_reports_nothing_pinned():
    """Before any state exists no buffer is page-locked: ``memory_stats()`` (and so the
    monitor's ``host_pinned``) says so."""
    opt = OffloadAdamW(make_params(), pin_memory=False)
    assert opt.memory_stats()["pinned"] is False
