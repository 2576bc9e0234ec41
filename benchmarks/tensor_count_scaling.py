"""Costs that grow with the number of parameter tensors, per tensor, at several counts.

A model with many small tensors (adapters, per-expert weights: 5,000 to 50,000 of them) must
not pay more per tensor as it grows. Two operations once did:

- ``load_state_dict`` of a copied state dict checked every loaded tensor against every host
  buffer of every arena (one arena per step on which parameters first got a gradient: many when
  MoE experts are first routed at different steps). Timed here with every tensor in one arena
  and with a new arena every 16 tensors; torch's fused AdamW loads the same state alongside.
- ``overlap_with`` built a hook wrapper per parameter. Timed over ``n / 2`` ``nn.Linear`` layers,
  with the optimizer's construction and the overlap's ``remove()``.

Per-tensor figures that stay flat as ``n`` grows are linear; the median of three runs each.

    python benchmarks/tensor_count_scaling.py             # about 1.5 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_offload_optim import OffloadAdamW


def median_seconds(run: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def trained(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], n: int, block: int):
    """An optimizer over ``n`` tensors of 64 elements whose first gradients came ``block`` at a
    time (an arena per step for OffloadAdamW), and a deep copy of its state dict."""
    params = [nn.Parameter(torch.randn(64)) for _ in range(n)]
    optimizer = make(params)
    for first in range(0, n, block):
        for p in params[first : first + block]:
            p.grad = torch.randn(64)
        optimizer.step()
    return optimizer, copy.deepcopy(optimizer.state_dict())


def load_row(n: int) -> list[str]:
    cells = []
    makers = [
        lambda ps: torch.optim.AdamW(ps, fused=True),
        lambda ps: OffloadAdamW(ps),
        lambda ps: OffloadAdamW(ps),
    ]
    for make, block in zip(makers, [n, n, 16], strict=True):
        optimizer, saved = trained(make, n, block)
        seconds = median_seconds(lambda o=optimizer, s=saved: o.load_state_dict(s))
        cells.append(f"{seconds / n * 1e6:.0f}")
    return cells


def overlap_row(n: int) -> str:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n // 2)))

    def hook() -> None:
        optimizer = OffloadAdamW(model.parameters(), force_staging=True)
        optimizer.overlap_with(model).remove()

    return f"{median_seconds(hook) / n * 1e6:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, nargs="+", default=[500, 2000, 8000])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| tensors | load, torch fused (µs/tensor) | load, OffloadAdamW, 1 arena | "
        "load, OffloadAdamW, an arena per 16 tensors | build + overlap_with + remove (µs/tensor) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in args.tensors:
        print(f"| {n} | {' | '.join(load_row(n))} | {overlap_row(n)} |", flush=True)


if __name__ == "__main__":
    main()
