"""Per-step Python overhead: many small tensors, where the work per step is mostly bookkeeping.

OffloadAdamW does a little Python work per parameter each step (checks, views); torch's fused
AdamW does some too. Both run side by side, interleaved, on the same 2000 tensors of 64 fp32
elements; figures are the minimum and median over the timed steps, and their ratio.

    python benchmarks/step_overhead.py              # about 10 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_offload_optim import OffloadAdamW


def make_params(count: int, numel: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=generator)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(numel, generator=generator)
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    optimizers = {
        "torch AdamW fused": torch.optim.AdamW(make_params(args.tensors, args.numel), fused=True),
        "OffloadAdamW": OffloadAdamW(make_params(args.tensors, args.numel)),
        "OffloadAdamW, force_staging=True": OffloadAdamW(
            make_params(args.tensors, args.numel), force_staging=True
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for opt in optimizers.values():
        opt.step()  # state allocation
    for _ in range(args.steps):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    base = min(times["torch AdamW fused"])
    print(f"{args.tensors} tensors of {args.numel} fp32 elements, {args.steps} steps, interleaved")
    for name, values in times.items():
        print(
            f"  {name:34s} min {1000 * min(values):6.2f} ms  median "
            f"{1000 * statistics.median(values):6.2f} ms  x{min(values) / base:.2f}"
        )


if __name__ == "__main__":
    main()
