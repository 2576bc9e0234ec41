"""Run by test_model_parallel_overlap.py: Lightning's ModelParallelStrategy (FSDP2) on 2 CPU
processes with the mixin's ``overlap_step=True``, ``offload_resident=0.5`` and the staged
pipeline (``force_staging=True``, chunks of 64 elements) under the stream-ordering checker,
against torch AdamW doing the same fit; each saves a sharded checkpoint at step 2 and resumes.

Usage: python tests/model_parallel_overlap_fit.py OUTPUT_DIR. Lightning starts rank 1 by running
this script again. Each rank writes its full parameters (after the fit and after each resume),
what the checker found, and the optimizer's resident bytes to OUTPUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_models import AtTrainEnd, trainer
from model_parallel_fit import STEPS, ShardedModel, full, strategy
from stream_checker import StreamChecker

#: Resumes of the offload run (fitted with a resident share of 0.5) from its step-2 checkpoint,
#: into the same share, a larger one and none. A resume lays the state out in parameter order
#: (Lightning's load runs before any forward pass); the resident choice still follows the first
#: forward pass, so the same share keeps as much resident as the uninterrupted run.
RESUMES = {"resident-0.5": 0.5, "resident-0.9": 0.9, "resident-none": None}
COMMON = {"precision": "bf16-mixed", "gradient_clip_val": 0.05}
HPARAMS = {"warmup_steps": 1, "lr_schedule": "cosine", "force_staging": True}


def checked_fit(fit, model, **kwargs: Any) -> list[str]:
    """``fit.fit(model)`` under the stream-ordering checker; what it found."""
    with StreamChecker() as checker:
        fit.fit(model, **kwargs)
    return checker.violations[:10]


def optimizer_facts(fit, optimizer: str, end: AtTrainEnd) -> dict[str, Any]:
    """What the optimizer held as training ended (the mixin's ``on_train_end`` frees it)."""
    if optimizer != "offload":
        return {}
    return {
        "overlapping": end.overlap is not None,
        "resident_bytes": end.stats["resident_bytes"],
        "state_bytes": end.stats["state_bytes"],
        "step": int(fit.optimizers[0].state_dict()["state"][0]["step"]),
    }


def model(optimizer: str, resident: float | None) -> ShardedModel:
    offload = optimizer == "offload"
    return ShardedModel(
        optimizer=optimizer,
        overlap_step=offload,
        offload_resident=resident if offload else None,
        **HPARAMS,
    )


def run(out: Path, optimizer: str, resumes: dict[str, float | None]) -> dict[str, Any]:
    saver = ModelCheckpoint(
        out / f"ckpt-{optimizer}", "{step}", every_n_train_steps=2, save_top_k=-1
    )
    fit = trainer(
        out / optimizer,
        strategy=strategy("sharded"),
        devices=2,
        max_steps=STEPS,
        callbacks=[saver, end := AtTrainEnd()],
        enable_checkpointing=True,
        use_distributed_sampler=True,
        **COMMON,
    )
    trained = model(optimizer, 0.5)
    initial = [p.detach().clone() for p in trained.parameters()]
    violations = checked_fit(fit, trained)
    result: dict[str, Any] = {
        "initial": initial,
        "params": full(trained),
        "violations": violations,
        "facts": optimizer_facts(fit, optimizer, end),
        "rank": fit.global_rank,
        "resumed": {},
    }
    for name, resident in resumes.items():
        resumed = model(optimizer, resident)
        again = trainer(
            out / f"{optimizer}-resumed-{name}",
            strategy=strategy("sharded"),
            devices=2,
            max_steps=STEPS,
            callbacks=[end := AtTrainEnd()],
            **COMMON,
        )
        found = checked_fit(again, resumed, ckpt_path=out / f"ckpt-{optimizer}" / "step=2.ckpt")
        result["resumed"][name] = {
            "params": full(resumed),
            "violations": found,
            "facts": optimizer_facts(again, optimizer, end),
        }
    return result


def main(out: Path) -> None:
    results = {
        "offload": run(out, "offload", RESUMES),
        "torch": run(out, "torch", {"reference": None}),
    }
    torch.save(results, out / f"rank{results['offload']['rank']}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
