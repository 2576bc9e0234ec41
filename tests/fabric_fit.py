"""Run by test_wrappers.py: Lightning Fabric on 2 CPU processes (gloo), DDP or
ModelParallelStrategy (FSDP2), OffloadAdamW overlapped, half resident and staged under the
stream-ordering checker, against torch's fused AdamW doing the same: bf16-mixed,
``fabric.clip_gradients``, ``fabric.save`` after 3 steps, 2 more steps; then a new model and
optimizer ``fabric.load`` that checkpoint and take the same 2 steps.

Usage: python tests/fabric_fit.py STRATEGY OUTPUT_DIR (STRATEGY: ddp or fsdp2). Fabric starts
rank 1 by running this script again. Each rank writes to OUTPUT_DIR/rank{r}.pt its full
parameters (uninterrupted and resumed), what the checker found, the resident bytes and whether
the last steps returned before their updates; it fails if a loaded state is not kept on the host.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from conftest import assert_state_offloaded
from lightning.fabric.strategies import ModelParallelStrategy
from stream_checker import StreamChecker
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from lightning_offload_optim import OffloadAdamW

LR = 0.01


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 40)
        self.blocks = nn.ModuleList(nn.Linear(40, 40) for _ in range(2))
        self.out = nn.Linear(40, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.out(x)


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def batch(step: int, rank: int) -> Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def full(model: nn.Module) -> list[Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]


def run(fabric: L.Fabric, kind: str, checkpoint: Path) -> dict[str, Any]:
    def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = fabric.setup_module(Net())
        if kind == "offload":
            optimizer = OffloadAdamW(
                model.parameters(), lr=LR, force_staging=True, chunk_size=64, resident=0.5
            )
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        optimizer = fabric.setup_optimizers(optimizer)
        if kind == "offload":
            optimizer.overlap_with(model)
        return model, optimizer

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[Tensor]:
        """Take ``steps``; then the full parameters (read after the queued updates)."""
        for step in steps:
            fabric.backward(model(batch(step, fabric.global_rank)).pow(2).mean())
            fabric.clip_gradients(model, optimizer, max_norm=0.05)
            optimizer.step()
            optimizer.zero_grad()
        if kind == "offload":  # the last step returned before its updates were done
            update = optimizer.optimizer._pipeline.pool.streams[torch.device("cpu")].update
            deferred.append(checker.current.clock.get(update.id, 0) < update.clock[update.id])
            optimizer.wait_for_updates()
        return full(model)

    deferred: list[bool] = []

    with StreamChecker() as checker:
        model, optimizer = setup()
        train(model, optimizer, range(3))
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
        uninterrupted = train(model, optimizer, range(3, 5))
        kept = optimizer.memory_stats()["resident_bytes"] if kind == "offload" else 0
        resumed, resumed_optimizer = setup()
        fabric.load(checkpoint, {"model": resumed, "optimizer": resumed_optimizer})
        if kind == "offload":
            assert_state_offloaded(resumed_optimizer.optimizer, list(resumed.parameters()))
        again = train(resumed, resumed_optimizer, range(3, 5))
    return {
        "params": uninterrupted,
        "resumed": again,
        "violations": checker.violations[:10],
        "resident_bytes": kept,
        "deferred": deferred,
    }


def main(strategy_name: str, out: Path) -> None:
    strategy = (
        ModelParallelStrategy(shard, data_parallel_size=2, tensor_parallel_size=1)
        if strategy_name == "fsdp2"
        else "ddp"
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    results = {kind: run(fabric, kind, out / f"{kind}.ckpt") for kind in ("offload", "torch")}
    torch.save(results, out / f"rank{fabric.global_rank}.pt")
    fabric.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
