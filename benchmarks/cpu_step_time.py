"""CPU step time of OffloadAdamW against torch.optim.AdamW (fused, foreach, for-loop), one run.

All optimizers get the same ~75M fp32 parameters in 22 tensors and are timed interleaved, step
by step, so they share the machine's state; figures are medians and ratios to fused AdamW.

    python benchmarks/cpu_step_time.py            # writes docs/figures/cpu_step_time.{png,json}
    python benchmarks/cpu_step_time.py --quick    # 5M parameters, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lightning_offload_optim import OffloadAdamW

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"


def make_params(total: int, count: int = 22) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    per = total // count
    params = []
    for i in range(count):
        numel = per + (i * 4099) % 1001  # uneven sizes, as in a real model
        p = torch.nn.Parameter(torch.randn(numel, generator=generator))
        p.grad = torch.randn(numel, generator=generator)
        params.append(p)
    return params


class PerParameterLoop(torch.optim.Optimizer):
    """The original design's shape: per parameter, copy state in, update, copy it back."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m = state["exp_avg"].to(p.device, copy=True)
                v = state["exp_avg_sq"].to(p.device, copy=True)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (v.sqrt() / (1 - beta2 ** state["step"]) ** 0.5).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1 ** state["step"]))
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)


OPTIMIZERS = {
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True),
    "OffloadAdamW": lambda ps: OffloadAdamW(ps),
    "OffloadAdamW staged": lambda ps: OffloadAdamW(ps, force_staging=True),
    "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
    "torch AdamW for-loop": lambda ps: torch.optim.AdamW(ps, foreach=False),
    "per-parameter loop": PerParameterLoop,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=75_000_000)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5M parameters, 5 steps")
    parser.add_argument("--out", type=Path, default=FIGURES)
    args = parser.parse_args()
    if args.quick:
        args.params, args.steps = 5_000_000, 5

    optimizers = {name: make(make_params(args.params)) for name, make in OPTIMIZERS.items()}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for opt in optimizers.values():  # warm-up: lazy state allocation
        opt.step()
    for _ in range(args.steps):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)

    numel = sum(p.numel() for p in next(iter(optimizers.values())).param_groups[0]["params"])
    baseline = statistics.median(times["torch AdamW fused"])
    results = {
        name: {
            "median_ms": 1000 * statistics.median(t),
            "ratio_to_fused": statistics.median(t) / baseline,
        }
        for name, t in times.items()
    }
    print(
        f"{numel / 1e6:.1f}M fp32 parameters, {args.steps} steps, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    for name, r in results.items():
        print(f"{name:24s} {r['median_ms']:8.1f} ms/step   {r['ratio_to_fused']:5.2f}x fused")

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "parameters": numel,
        "steps": args.steps,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }
    (args.out / "cpu_step_time.json").write_text(json.dumps({**meta, "results": results}, indent=2))
    plot(results, meta, args.out / "cpu_step_time.png")


def plot(results: dict, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    values = [results[n]["median_ms"] for n in names]
    colors = ["#4c72b0" if "Offload" in n else "#999999" for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
    ratios = [f" {results[name]['ratio_to_fused']:.2f}x" for name in names[::-1]]
    ax.bar_label(bars, ratios, fontsize=8)
    ax.set_xlabel("ms per optimizer step (median)")
    ax.set_title(
        f"AdamW step on CPU, {meta['parameters'] / 1e6:.0f}M fp32 params, "
        f"{meta['threads']} threads",
        fontsize=9,
    )
    ax.set_xlim(0, max(values) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
