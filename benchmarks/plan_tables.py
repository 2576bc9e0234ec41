"""The memory tables and figure of docs/scaling.md, from lightning_offload_optim.plan.

Llama-2 7B, 13B and 70B on one GPU and on a node of 8, under DDP and FSDP2, in bf16-true and
bf16-mixed, on a reference node of 8 x 80 GB GPUs and 2 TB of RAM. No GPU needed.

    python benchmarks/plan_tables.py    # markdown table to stdout, docs/figures/plan_memory.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from lightning_offload_optim.plan import GB, PRESETS, MemoryPlan, plan

FIGURE = Path(__file__).resolve().parent.parent / "docs" / "figures" / "plan_memory.png"
GPU_MEMORY = 80 * GB
HOST_MEMORY = 2000 * GB
#: (label, GPUs per node, strategy): one GPU alone, then a node of 8 under each strategy.
LAYOUTS = [("1 GPU", 1, "ddp"), ("8 GPUs, DDP", 8, "ddp"), ("8 GPUs, FSDP2", 8, "fsdp2")]
PRECISIONS = ("bf16-true", "bf16-mixed")


def plans() -> list[tuple[str, str, str, MemoryPlan]]:
    return [
        (
            size,
            precision,
            label,
            plan(
                size,
                precision=precision,
                gpus=gpus,
                strategy=strategy,
                gpu_memory=GPU_MEMORY,
                host_memory=HOST_MEMORY,
            ),
        )
        for size in PRESETS
        for precision in PRECISIONS
        for label, gpus, strategy in LAYOUTS
    ]


def fits(value: bool | None) -> str:
    return "yes" if value else "**no**"


def table(rows: list[tuple[str, str, str, MemoryPlan]]) -> str:
    lines = [
        "| model | precision | GPUs | per GPU, torch AdamW | per GPU, OffloadAdamW "
        "| host RAM per node, OffloadAdamW | fits GPU, torch AdamW "
        "| fits GPU and host, OffloadAdamW |",
        "| --- | --- | --- | ---: | ---: | ---: | :---: | :---: |",
    ]
    for size, precision, label, p in rows:
        offload_fits = p.offload.fits_gpu and p.offload.fits_host
        lines.append(
            f"| {size.upper()} | {precision} | {label} | {p.adamw.gpu.device / GB:.1f} "
            f"| {p.offload.gpu.device / GB:.1f} | {p.offload.node.host / GB:.1f} "
            f"| {fits(p.adamw.fits_gpu)} | {fits(offload_fits)} |"
        )
    return "\n".join(lines)


def figure(rows: list[tuple[str, str, str, MemoryPlan]], path: Path) -> None:
    """Per-GPU device bytes with and without offloading, and host bytes per node (bf16-true)."""
    shown = [r for r in rows if r[1] == "bf16-true"]
    names = [f"{size.upper()}\n{label.replace(', ', chr(10))}" for size, _, label, _ in shown]
    x = range(len(shown))
    fig, (device, host) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.38
    device.bar(
        [i - width / 2 for i in x],
        [p.adamw.gpu.device / GB for *_, p in shown],
        width,
        label="torch AdamW",
        color="tab:gray",
    )
    device.bar(
        [i + width / 2 for i in x],
        [p.offload.gpu.device / GB for *_, p in shown],
        width,
        label="OffloadAdamW",
        color="tab:blue",
    )
    device.axhline(
        GPU_MEMORY * 0.9 / GB,
        color="tab:red",
        linestyle="--",
        linewidth=1,
        label="90% of an 80 GB GPU",
    )
    device.set_yscale("log")
    device.set_ylabel("GB per GPU (params, grads, state, staging)")
    device.set_title("Device memory per GPU, bf16-true")
    host.bar(
        list(x),
        [p.offload.node.host / GB for *_, p in shown],
        0.6,
        color="tab:orange",
        label="OffloadAdamW state",
    )
    host.axhline(
        HOST_MEMORY * 0.9 / GB, color="tab:red", linestyle="--", linewidth=1, label="90% of 2 TB"
    )
    host.set_ylabel("GB per node")
    host.set_title("Host RAM per node, bf16-true")
    for ax in (device, host):
        ax.set_xticks(list(x), names, fontsize=7)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Planned memory (activations not modelled), Llama-2, GB = 1e9 bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args()
    rows = plans()
    print(table(rows))
    figure(rows, args.figure)


if __name__ == "__main__":
    main()
