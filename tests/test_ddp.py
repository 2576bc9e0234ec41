"""strategy="ddp" with 2 CPU processes over gloo, against torch AdamW in the same setting."""

from __future__ import annotations

import torch
from conftest import assert_same, run_script


def test_ddp_two_processes_match_torch_adamw(tmp_path):
    run_script("ddp_fit.py", tmp_path, timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for result in ranks:
        assert_same(result["offload"]["params"], result["torch"]["params"])
        assert_same(result["offload"]["resumed"], result["torch"]["resumed"])
        assert result["offload"]["steps"] == 4
        # Logged every 2 steps, reduced over both ranks: each value covers 2 steps per rank.
        assert result["offload"]["interval_steps"] == 2.0
    # DDP keeps the replicas identical.
    assert_same(ranks[0]["offload"]["params"], ranks[1]["offload"]["params"])
