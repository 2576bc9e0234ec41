"""``overlap_with(module, blocks=...)``: each block's forward waits for all of its parameters at
once, and its submodules do not wait. Against ``torch.optim.AdamW(fused=True)`` under the
stream-ordering checker, with the staged pipeline on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_overlapped_alike, overlapped_pair
from torch import nn

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


def train(pairs, steps: int = 5) -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        tokens = torch.randint(0, 10, (6,), generator=generator)
        for model, optimizer in pairs:
            model(tokens).backward()
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_blocks_wait_for_all_of_their_parameters(stream_order, resident):
    """Every block parameter is read in the block's forward, after its hook ran, so none is
    updated early (waited for at the step itself): blocks overlap the next forward as modules
    do. The tied head reads the embedding's weight after the embedding's hook ran."""
    model, twin = Tower(), Tower()
    ours, theirs = overlapped_pair(model, twin, lr=0.01, resident=resident)
    ours.overlap_with(model, blocks=model.blocks)
    train([(model, ours), (twin, theirs)])
    assert ours._overlap.early == set()
    assert_overlapped_alike(stream_order, ours, model, twin)


def test_submodules_of_blocks_do_not_wait(stream_order):
    """One hook per block: under ``torch.compile`` each hook is a graph break."""
    model = Tower()
    ours, _ = overlapped_pair(model, Tower(), lr=0.01)
    ours.overlap_with(model, blocks=model.blocks)
    for block in model.blocks:
        assert len(block._forward_pre_hooks) == 1
        assert all(not m._forward_pre_hooks for m in block.modules() if m is not block)
    assert len(model.embed._forward_pre_hooks) == 1  # outside the blocks: as before


def test_blocks_outside_the_module_are_refused_and_the_overlap_kept(stream_order):
    model, twin = Tower(), Tower()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    overlap = ours._overlap
    with pytest.raises(ValueError, match="blocks must be submodules of the overlapped Tower"):
        ours.overlap_with(model, blocks=[nn.Linear(2, 2)])
    assert ours._overlapping() is overlap
    train([(model, ours), (twin, theirs)], steps=3)
    assert_overlapped_alike(stream_order, ours, model, twin)
