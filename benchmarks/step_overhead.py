"""Per-step Python overhead: many small tensors, where the work per step is mostly bookkeeping.

OffloadAdamW does a little Python work per parameter each step (checks, views); torch's fused
AdamW does some too. Both run side by side, interleaved, on the same 2000 tensors of 64 fp32
elements; figures are the minimum and median over the timed steps, and their ratio.

The staged path (as on a GPU, forced here) also works per chunk: copies in and out, the update,
events. With ``chunk_size=64`` every tensor is a chunk of its own (2000 chunks, against one
chunk for all of them at the default size), so the difference of the two minimums, over the
1999 extra chunks, is the host's time per chunk: staged, and with all state resident (updated
in place on the device, never copied). On a GPU each torch operation also pays its launch.

    python benchmarks/step_overhead.py              # about 20 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_offload_optim import OffloadAdamW

CHUNKED = "OffloadAdamW, force_staging=True, a chunk per tensor"
CHUNKED_RESIDENT = "OffloadAdamW, force_staging=True, a chunk per tensor, resident=1.0"


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
        CHUNKED: OffloadAdamW(
            make_params(args.tensors, args.numel), force_staging=True, chunk_size=args.numel
        ),
        CHUNKED_RESIDENT: OffloadAdamW(
            make_params(args.tensors, args.numel),
            force_staging=True,
            chunk_size=args.numel,
            resident=1.0,
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(2):  # state allocation, then the resident choice
        for opt in optimizers.values():
            opt.step()
    for _ in range(args.steps):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    base = min(times["torch AdamW fused"])
    print(f"{args.tensors} tensors of {args.numel} fp32 elements, {args.steps} steps, interleaved")
    for name, values in times.items():
        print(
            f"  {name:58s} min {1000 * min(values):6.2f} ms  median "
            f"{1000 * statistics.median(values):6.2f} ms  x{min(values) / base:.2f}"
        )
    one_chunk = min(times["OffloadAdamW, force_staging=True"])
    for name in (CHUNKED, CHUNKED_RESIDENT):
        per_chunk = (min(times[name]) - one_chunk) / (args.tensors - 1)
        print(f"  host time per chunk, {name.split(', ', 2)[-1]}: {1e6 * per_chunk:.1f} us")


if __name__ == "__main__":
    main()
