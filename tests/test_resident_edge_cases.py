"""Resident-state corners found by a mutation test of the suite (each test fails on a mutant
that survived it): "auto" keeping its choice while free memory falls, and the choice
following first use once an overlap starts (a stride change after steps with resident state
is a mode of ``test_parity.py``'s stride test). Against an independent
``torch.optim.AdamW(fused=True)`` under the stream-ordering checker.
"""

from __future__ import annotations

import torch
from conftest import assert_same, clone_params, make_params

from lightning_offload_optim import OffloadAdamW


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
    params = make_params([(64, 3), (100,), (64, 5), (7,), (640,)])
    reference = clone_params(params)
    opt = OffloadAdamW(params, lr=0.05, force_staging=True, chunk_size=128, resident="auto")
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
