"""Run by test_ddp.py: fit with OffloadAdamW and with torch AdamW under DDP (2 CPU processes).

Usage: python tests/ddp_fit.py OUTPUT_DIR. Lightning's DDP launcher starts rank 1 by running
this script again; each rank writes its final parameters and monitor totals to OUTPUT_DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_models import TinyModel, trainer

from lightning_offload_optim import OffloadMonitor


def main(out: Path) -> None:
    results = {}
    for optimizer in ("offload", "torch"):
        monitor = OffloadMonitor(summary=False)
        saver = ModelCheckpoint(
            out / f"ckpt-{optimizer}", "{step}", every_n_train_steps=2, save_top_k=-1
        )
        fit = trainer(
            out / optimizer,
            strategy="ddp",
            devices=2,
            max_steps=4,
            callbacks=[monitor, saver],
            enable_checkpointing=True,
            use_distributed_sampler=True,
            log_every_n_steps=2,  # the monitor reduces its metrics across both ranks
            logger=CSVLogger(out / optimizer),  # logged_metrics are kept where there is one
        )
        model = TinyModel(optimizer=optimizer)
        fit.fit(model)
        # Resume from the mid-run checkpoint on both ranks and train to the end again.
        resumed = TinyModel(optimizer=optimizer)
        again = trainer(out / f"{optimizer}-resumed", strategy="ddp", devices=2, max_steps=4)
        again.fit(resumed, ckpt_path=out / f"ckpt-{optimizer}" / "step=2.ckpt")
        results[optimizer] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "resumed": [p.detach().clone() for p in resumed.parameters()],
            "steps": monitor.totals["steps"],
            "interval_steps": float(fit.logged_metrics.get("offload/interval_steps", 0.0)),
        }
    torch.save(results, out / f"rank{fit.global_rank}.pt")
    # Lightning leaves the process group up at exit; one CI run of this script aborted while
    # exiting ("terminate called without an active exception"). Tear it down explicitly.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
