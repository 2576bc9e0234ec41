"""Chunk planning, host buffer layout, and what stays out of optimizer.state."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_params, set_grads

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim.functional import SPLIT_ALIGNMENT
from lightning_offload_optim.host_state import HostState
from lightning_offload_optim.pipeline import plan_chunks


@pytest.mark.parametrize("seed", range(20))
def test_chunks_cover_each_active_element_once_within_bounds(seed):
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 700),) for _ in range(rng.randint(1, 12))]
    params = make_params(shapes)
    host = HostState(pin_for=lambda device: False)
    host.adopt(host.allocate([(p, ("exp_avg", "exp_avg_sq")) for p in params]))
    active = [i for i in range(len(params)) if rng.random() < 0.7]
    chunk_numel = SPLIT_ALIGNMENT * rng.randint(1, 6)
    chunks = plan_chunks([host.slots[params[i]] for i in active], chunk_numel)

    covered = {
        i: torch.zeros(params[active[i]].numel(), dtype=torch.int32) for i in range(len(active))
    }
    for chunk in chunks:
        assert 0 < chunk.numel <= chunk_numel
        position = chunk.start
        for seg in chunk.segments:
            slot = host.slots[params[active[seg.index]]]
            # Segments tile the chunk in order and map to the right place in the arena.
            assert slot.offset + seg.start == position == chunk.start + seg.offset
            position += seg.stop - seg.start
            # Splits inside a parameter fall on multiples of the alignment from its start.
            assert seg.start % SPLIT_ALIGNMENT == 0
            assert seg.stop == slot.layout.numel or seg.stop % SPLIT_ALIGNMENT == 0
            covered[seg.index][seg.start : seg.stop] += 1
        assert position == chunk.stop
    assert all(bool((c == 1).all()) for c in covered.values())


def test_inactive_parameters_split_chunks_so_their_state_is_not_moved():
    params = make_params([(10,), (10,), (10,)])
    host = HostState(pin_for=lambda device: False)
    host.adopt(host.allocate([(p, ("exp_avg", "exp_avg_sq")) for p in params]))
    chunks = plan_chunks([host.slots[params[0]], host.slots[params[2]]], 1024)
    assert [(c.start, c.stop) for c in chunks] == [(0, 10), (20, 30)]


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
    # Only the scalar step is in optimizer.state: Lightning copies every other tensor there
    # to the accelerator at set-up and after each resume.
    assert all(set(opt.state[p]) == {"step"} for p in params)
    assert all(opt.state[p]["step"].device.type == "cpu" for p in params)


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
                for bufs in opt._pipeline._buffers.values()
                for b in bufs
                for t in b.values()
            )
        )
    assert sizes[0] == sizes[1] == 2 * 256 * 2  # two buffers of exp_avg and exp_avg_sq


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
