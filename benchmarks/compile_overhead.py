"""What the overlap's hooks cost a ``torch.compile``'d model: each hooked module is a graph break.

The overlap's forward pre-hooks run as Python (``torch.compiler.disable``, as FSDP2's hooks do),
so a compiled forward runs one graph per stretch between hooked modules, and dynamo runs a
frame eagerly where a break falls inside a loop (the model's loop over its layers). This times
forward + backward (not the step) of a small GPT: eager, the whole model compiled, and each
block compiled (wrapped, so hooks on the wrappers run before the compiled code), with and
without ``overlap_with`` (a hook per module, or per block with ``blocks=``), each variant in a
process of its own (dynamo's caches are per code object, shared by every model), and counts the
compiled graphs each iteration runs. On the CPU the overlap's forward also copies the next
step's first chunks in (on a GPU those copies run on a side stream): compare overlap variants
with each other, and with "eager + overlap".

    python benchmarks/compile_overhead.py                  # about 2 minutes on 2 CPU cores
    python benchmarks/compile_overhead.py --device cuda    # on a GPU, inductor's kernels
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_end_to_end import FIGURES, GPT
from torch import nn

from lightning_offload_optim import OffloadAdamW

#: name: (what is compiled: "" nothing, "model" or "blocks" one by one; overlap; overlap blocks)
VARIANTS = {
    "eager": ("", False, False),
    "eager + overlap": ("", True, False),
    "compiled": ("model", False, False),
    "compiled + overlap": ("model", True, False),
    "compiled + overlap, blocks": ("model", True, True),
    "blocks compiled": ("blocks", False, False),
    "blocks compiled + overlap, blocks": ("blocks", True, True),
}


class GraphRuns:
    """Inductor, counting the runs of the graphs it compiled."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch._inductor import compile_fx

        run = compile_fx.compile_fx(graph, example_inputs)

        def counted(*args: Any) -> Any:
            self.runs += 1
            return run(*args)

        return counted


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace, variant: str) -> dict:
    """Time ``variant`` in this process: forward + backward per iteration, and the compiled
    graphs each runs (their count also shows frames that fell back to eager)."""
    compiled, overlap, blocks = VARIANTS[variant]
    device = torch.device(args.device)
    torch.manual_seed(0)
    tokens = torch.randint(0, 32000, (args.batch, args.seq + 1), device=device)
    model = GPT(args.width, args.layers, heads=4).to(device)
    graphs = GraphRuns()
    if compiled == "blocks":  # wrapped: hooks on the wrappers run before the compiled code
        model.blocks = nn.ModuleList(torch.compile(b, backend=graphs) for b in model.blocks)
    optimizer = OffloadAdamW(model.parameters(), lr=1e-4, force_staging=True)
    if overlap:
        optimizer.overlap_with(model, blocks=model.blocks if blocks else ())
    forward = torch.compile(model, backend=graphs) if compiled == "model" else model
    times = []
    for step in range(3 + args.steps):  # compiled twice: the first passes run eagerly
        synchronize(device)
        start = time.perf_counter()
        forward(tokens).backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            graphs.runs = 0
    return {
        "device": device.type,
        "variant": variant,
        "fwd_bwd_ms": round(1000 * statistics.median(times[3:]), 2),
        "min_ms": round(1000 * min(times[3:]), 2),
        "graphs_per_iteration": round(graphs.runs / args.steps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed, after 3 warm-up steps")
    parser.add_argument("--out", type=Path, default=FIGURES)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one, here
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args, args.variant)))
        return
    # Each variant in a process of its own: dynamo's caches are per code object, which every
    # model's modules share (Module._call_impl), so variants in one process would share them.
    rows = []
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--variant", variant, *sys.argv[1:]]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    medians = {row["variant"]: row["fwd_bwd_ms"] for row in rows}
    for row in rows:  # against the same model without the overlap, and against "compiled"
        without = medians[row["variant"].split(" + ")[0]]
        row["x_without_overlap"] = round(row["fwd_bwd_ms"] / without, 3)
        row["x_compiled"] = round(row["fwd_bwd_ms"] / medians["compiled"], 3)
        print(row)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"compile_overhead_{args.device.split(':')[0]}"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args, stem.with_suffix(".png"))
    print(f"wrote {stem}.csv and .png")


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    labels = [f"{r['variant']}: {r['graphs_per_iteration']:g} graphs" for r in rows]
    labels = [
        label.replace(": 0 graphs", "").replace(": 1 graphs", ": 1 graph") for label in labels
    ]
    bars = ax.barh(labels, [r["fwd_bwd_ms"] for r in rows], color="#4c72b0")
    ax.bar_label(bars, [f" {row['fwd_bwd_ms']} ms" for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("forward + backward, median (ms)")
    ax.set_title(
        f"GPT {args.width}x{args.layers} layers, {args.batch}x{args.seq} tokens, "
        f"{rows[0]['device']}: the overlap's graph breaks",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
