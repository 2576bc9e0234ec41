"""Resident-state corners found by mutation tests of the suite (each test fails on a mutant
that it alone, or only a random scenario, caught): "auto" keeping its choice while free memory
falls, the choice following first use once an overlap starts (a stride change after steps
with resident state is a mode of ``test_parity.py``'s stride test), and resident state written
back to the host only while it is newer than the host's (after a load, or moments replaced by
hand, a write-back would put the old device state over the new). Against an independent
``torch.optim.AdamW(fused=True)`` under the stream-ordering checker.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same, clone_params, make_params, step_together
from test_resident import SHAPES, STATE, staged

from lightning_offload_optim import OffloadAdamW

MOMENTS = ("exp_avg", "exp_avg_sq")


def test_auto_keeps_its_choice_while_nothing_is_laid_out_anew(monkeypatch, stream_order):
    """Performance (not results): "auto" chooses at the steps whose state is laid out anew
    (docs: "Chosen at the start of each step whose parameters' state is laid out anew or whose
    forward pass first used a parameter"). Free memory that drops later (activations, the
    allocator's cache) must not make every later step choose again: each change writes the
    resident state back and blocks the host."""
    from lightning_offload_optim import resident as resident_module

    gib = 1 << 30
    free = [2 * gib + 3000]
    monkeypatch.setattr(resident_module, "free_device_memory", lambda device: free[0])
    monkeypatch.setattr(resident_module, "total_memory", lambda device: 10 * gib)
    params = make_params(SHAPES)
    reference = clone_params(params)
    opt = staged(params, resident="auto")
    torch_opt = torch.optim.AdamW(reference, lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(4)

    def steps(n):
        for _ in range(n):
            for p, r in zip(params, reference, strict=True):
                g = torch.randn(p.shape, generator=generator)
                p.grad, r.grad = g.clone(), g.clone()
            opt.step()
            torch_opt.step()

    steps(2)
    chosen = opt.memory_stats()["resident_bytes"]
    assert chosen == 8 * (192 + 100 + 7)
    free[0] = 2 * gib - 2000  # the next forward passes took 5000 bytes
    steps(2)
    assert opt.memory_stats()["resident_bytes"] == chosen
    assert_same(params, reference)


class Reversed(torch.nn.Module):
    """Registered (and so listed in the param group) in the reverse of forward order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.second = torch.nn.Linear(8, 8, bias=False)
        self.first = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def is_resident(opt, param) -> bool:
    slot = opt._host.slots[param]
    return (
        slot.arena.resident.device_start(slot.offset, slot.offset + slot.layout.numel) is not None
    )


def test_overlap_switched_on_later_keeps_the_first_used_parameters_resident(stream_order):
    """Performance (not results): the resident share follows the forward order once it is
    known. Here the overlap starts after two plain steps (whose choice followed the param
    group): the next step must choose again, by first use."""
    model, twin = Reversed(), Reversed()
    opt = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64, resident=0.5)
    torch_opt = torch.optim.AdamW(twin.parameters(), lr=0.05, fused=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for step in range(4):
        if step == 2:
            opt.overlap_with(model)
        for net, o in ((model, opt), (twin, torch_opt)):
            net(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        if step == 1:
            assert is_resident(opt, model.second.weight)  # the param group's order
    opt.wait_for_updates()
    assert is_resident(opt, model.first.weight) and not is_resident(opt, model.second.weight)
    assert_same(model.parameters(), twin.parameters())


@pytest.mark.parametrize("read", ["state_dict", "offloaded_state"])
@pytest.mark.parametrize("written_by", ["load_state_dict", "hand"])
def test_state_written_into_the_host_is_read_back_before_the_next_step(
    stream_order, written_by, read
):
    """A resident run (whole state resident, updated on the device since the last read) gets
    new state on the host: torch's checkpoint of two steps before, loaded, or moments zeroed by
    hand in ``optimizer.state``. Read before any step, the state is that new state, as in torch;
    then both train on alike."""
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident=1.0)
    theirs = torch.optim.AdamW(reference, lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(9)
    step_together([ours, theirs], [params, reference], generator, 2)
    checkpoint = copy.deepcopy(theirs.state_dict())
    weights = [r.detach().clone() for r in reference]
    ours.state_dict()  # resident state written back: the host matches it for now
    step_together([ours, theirs], [params, reference], generator, 2)  # newer on the device
    assert ours.memory_stats()["resident_bytes"] == STATE
    if written_by == "load_state_dict":
        for optimizer in (ours, theirs):
            optimizer.load_state_dict(copy.deepcopy(checkpoint))
        with torch.no_grad():
            for p, r, w in zip(params, reference, weights, strict=True):
                p.copy_(w)
                r.copy_(w)
    else:
        for p, r in zip(params[1:3], reference[1:3], strict=True):
            ours.state[p]["exp_avg"] = torch.zeros_like(p)
            theirs.state[r]["exp_avg"] = torch.zeros_like(r)
    expected = theirs.state_dict()["state"]
    if read == "state_dict":
        saved = ours.state_dict()["state"]
        got = [[saved[i][k] for k in MOMENTS] for i in range(len(params))]
    else:
        got = [[ours.offloaded_state(p)[k] for k in MOMENTS] for p in params]
    for index, moments in enumerate(got):
        assert_same(moments, [expected[index][k] for k in MOMENTS])
    step_together([ours, theirs], [params, reference], generator, 2)
    stream_order.expect_none()
    assert_same(params, reference)
    expected = theirs.state_dict()["state"]
    for index, p in enumerate(params):
        state = ours.offloaded_state(p)
        assert_same([state[k] for k in MOMENTS], [expected[index][k] for k in MOMENTS])


def test_reading_the_state_again_copies_nothing(stream_order):
    """The resident state crosses the link back once per step at most: reads after the first
    (``state_dict()``, ``offloaded_state``, a copy of the optimizer) find the host up to date,
    and the copies between steps count it once."""
    params = make_params(SHAPES)
    opt = staged(params, resident=1.0)
    step_together([opt], [params], torch.Generator().manual_seed(10), 2)
    assert opt.memory_stats()["resident_bytes"] == STATE
    opt.take_copies_between_steps()
    opt.state_dict()
    opt.state_dict()
    opt.offloaded_state(params[0])
    copy.deepcopy(opt)
    moved = opt.take_copies_between_steps()
    assert (moved.bytes_in, moved.bytes_out) == (0, STATE)
    opt.state_dict()
    moved = opt.take_copies_between_steps()
    assert (moved.bytes_in, moved.bytes_out) == (0, 0)
    stream_order.expect_none()
