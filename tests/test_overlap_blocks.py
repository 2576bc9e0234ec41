"""``overlap_with(module, blocks=...)``: each block's forward waits for all of its parameters at
once, and its submodules do not wait. Against ``torch.optim.AdamW(fused=True)`` under the
stream-ordering checker, with the staged pipeline on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_overlapped_alike, overlapped_pair, token_batches, train_alike
from torch import nn

from lightning_offload_optim.overlap import ForwardOverlap

RESIDENT = [None, 0.5]
RESIDENT_IDS = ["offloaded", "resident-0.5"]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.gate = nn.Parameter(torch.ones(width))  # the block's own parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(F.gelu(self.up(self.norm(x))))


class Tower(nn.Module):
    """An embedding, blocks (the last one called twice), and a head tied to the embedding."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.blocks[-1](x)
        return F.cross_entropy(F.linear(self.norm(x), self.embed.weight), tokens)


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_blocks_wait_for_all_of_their_parameters(stream_order, resident):
    """Every block parameter is read in the block's forward, after its hook ran, so none is
    updated early (waited for at the step itself): blocks overlap the next forward as modules
    do. The tied head reads the embedding's weight after the embedding's hook ran."""
    model, twin = Tower(), Tower()
    ours, theirs = overlapped_pair(model, twin, lr=0.01, resident=resident)
    ours.overlap_with(model, blocks=model.blocks)
    train_alike([(model, ours), (twin, theirs)], token_batches(5, seed=3))
    assert ours._overlap.early == set()
    assert_overlapped_alike(stream_order, ours, model, twin)


class Prelude(Tower):
    """From the second pass on, the forward runs a block's norm before the blocks (a path the
    watch, which stops at the first step, never saw)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.passes = getattr(self, "passes", 0) + 1
        x = self.embed(tokens)
        if self.passes > 1:
            x = self.blocks[2].norm(x)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(F.linear(self.norm(x), self.embed.weight), tokens)


def test_a_blocks_submodule_called_on_its_own_waits(stream_order):
    """Outside its block's forward, a submodule waits for its own parameters: called before its
    block in a pass, and in an evaluation between a step and the next forward."""
    model, twin = Prelude(), Prelude()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    ours.overlap_with(model, blocks=model.blocks)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, generator=generator)
    batches = [torch.randint(0, 10, (6,), generator=generator) for _ in range(4)]
    train_calling_a_blocks_module_between([(model, ours), (twin, theirs)], batches, x)
    assert_overlapped_alike(stream_order, ours, model, twin)


def train_calling_a_blocks_module_between(pairs: list, batches: list, x: torch.Tensor) -> None:
    """Train each (model, optimizer) pair, calling the second block's ``up`` on its own
    (an evaluation) between each step and the next forward."""
    for tokens in batches:
        for net, optimizer in pairs:
            net(tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                net.blocks[1].up(x)


def test_inside_a_blocks_forward_only_the_block_waits(stream_order, monkeypatch):
    """One wait per block per pass (each a graph break under ``torch.compile``), none for the
    modules in it; a module per wait without ``blocks``."""
    waits = []
    real = ForwardOverlap._before_forward

    def counted(self: ForwardOverlap, *args: Any) -> None:
        waits.append(args)
        real(self, *args)

    monkeypatch.setattr(ForwardOverlap, "_before_forward", counted)
    model = Tower()
    ours, _ = overlapped_pair(model, Tower(), lr=0.01)
    for blocks, expected in (((), 18), (model.blocks, 6)):
        ours.overlap_with(model, blocks=blocks)
        waits.clear()
        model(torch.arange(6)).backward()
        ours.step()
        ours.zero_grad()
        # embed, norm and, per block call (4: the last block twice), the block or its 4 modules
        # with parameters (the block itself, norm, up, down)
        assert len(waits) == expected
    ours.wait_for_updates()


@pytest.mark.parametrize(
    ("blocks", "error", "match"),
    [
        (lambda m: [nn.Linear(2, 2)], ValueError, "blocks must be submodules of the overlapped"),
        (lambda m: [m], ValueError, "not the module itself"),
        (lambda m: [m.blocks], ValueError, "ModuleList has none .pass the modules it holds"),
        (lambda m: m.blocks[0], TypeError, "blocks must be an iterable of modules"),
    ],
    ids=["outside", "the-module", "container", "not-iterable"],
)
def test_bad_blocks_are_refused_and_the_overlap_kept(stream_order, blocks, error, match):
    model, twin = Tower(), Tower()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    overlap = ours._overlap
    with pytest.raises(error, match=match):
        ours.overlap_with(model, blocks=blocks(model))
    assert ours._overlapping() is overlap
    train_alike([(model, ours), (twin, theirs)], token_batches(3, seed=3))
    assert_overlapped_alike(stream_order, ours, model, twin)


def test_a_block_whose_forward_raised_lets_its_modules_wait_again(stream_order):
    """A block's forward that raised (an out-of-memory caught by a batch-size search) has
    ended: its modules called on their own later (an evaluation between a step and the next
    forward) must wait for their parameters, not take the block for still running."""
    model, twin = Tower(), Tower()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    ours.overlap_with(model, blocks=model.blocks)

    def out_of_memory(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")

    model.blocks[1].forward = out_of_memory
    with pytest.raises(RuntimeError, match="simulated"):
        model(torch.zeros(6, dtype=torch.long))
    del model.blocks[1].forward
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    pairs = [(model, ours), (twin, theirs)]
    train_calling_a_blocks_module_between(pairs, token_batches(3, seed=3), x)
    assert_overlapped_alike(stream_order, ours, model, twin)
