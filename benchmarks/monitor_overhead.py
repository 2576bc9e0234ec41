"""What ``OffloadMonitor`` adds to a training step, logging every step and every 50th.

A small Lightning model on the CPU (steps of about 1 ms, so the monitor's own cost shows)
fitted with a ``CSVLogger``, without the monitor and with it, interleaved, the median of five
fits each. The monitor's cost per step is the difference: logging every step, mostly that of
writing a row; logging every 50th, that of following the steps.

    python benchmarks/monitor_overhead.py        # about 15 seconds on 2 CPU cores
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_offload_optim import OffloadMonitor, OffloadOptimizerMixin


class Small(OffloadOptimizerMixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.randn(256, 32), torch.randn(256, 1))
        return DataLoader(data, batch_size=8)


def seconds_per_step(steps: int, log_every: int, monitored: bool) -> float:
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=steps,
            log_every_n_steps=log_every,
            logger=CSVLogger(root),
            callbacks=[OffloadMonitor(summary=False)] if monitored else [],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        start = time.perf_counter()
        trainer.fit(Small())
        return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging intervals
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # its lines per fit
    print("| log every | step without the monitor (ms) | with it (ms) | the monitor (µs/step) |")
    print("| ---: | ---: | ---: | ---: |")
    for log_every in (1, 50):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for monitored in (False, True):
                times[monitored].append(seconds_per_step(args.steps, log_every, monitored))
        without, with_ = (statistics.median(times[m]) for m in (False, True))
        extra = (with_ - without) * 1e6
        print(
            f"| {log_every} | {without * 1e3:.2f} | {with_ * 1e3:.2f} | {extra:.0f} |", flush=True
        )


if __name__ == "__main__":
    main()
