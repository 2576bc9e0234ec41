"""Lightning's ModelParallelStrategy on 2 CPU processes (FSDP2; tensor parallel): OffloadAdamW
through the mixin against torch AdamW doing the same fit, sharded and single-file checkpoints,
and resumes."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, run_script
from model_parallel_fit import KINDS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("model_parallel")
    run_script("model_parallel_fit.py", out)
    assert (out / "ckpt-offload-sharded" / "step=2.ckpt" / ".metadata").is_file()
    assert (out / "ckpt-offload-file" / "step=2.ckpt").is_file()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("kind", KINDS)
def test_fit_and_resume_bit_identical_to_torch_adamw(ranks, kind):
    """bf16-mixed, gradient_clip_val and a warm-up + cosine schedule, resumed at step 2; tensor
    parallel with a SequenceParallel norm, whose weights get partial-sum gradients."""
    for result in ranks:
        ours, reference = result["offload", kind], result["torch", kind]
        assert not any(
            torch.equal(a, b) for a, b in zip(ours["initial"], ours["params"], strict=True)
        )
        assert_same(ours["params"], reference["params"])
        assert_same(ours["resumed"], reference["resumed"])
        assert_same(ours["resumed"], ours["params"])  # resuming changed nothing
        assert ours["val_loss"] == reference["val_loss"]  # validate() after fit() works


def test_monitor_reports_host_bytes_per_rank_and_summed(ranks):
    logged = [result["offload", "sharded"]["logged"] for result in ranks]
    state = [result["offload", "sharded"]["state_bytes"] for result in ranks]
    # Each rank holds the state of its own shards: 8 bytes per element of its shards.
    assert state[0] != state[1] and min(state) > 0
    for rank in (0, 1):
        assert logged[rank]["offload/host_bytes"] == state[rank]
        assert logged[rank]["offload/host_bytes_all_ranks"] == sum(state)
        assert logged[rank]["offload/interval_steps"] == 2.0


@pytest.mark.parametrize("kind", ["sharded", "file"])
def test_monitor_totals_resume_per_rank(ranks, kind):
    """A resumed run's totals end where the uninterrupted run's do, on each rank: the step
    torch's set_optimizer_state_dict makes to create the state it loads is no training step,
    and each rank continues from its own totals (the ranks' shards differ in size; the one-file
    runs stage, so bytes are copied)."""
    bytes_moved = []
    for result in ranks:
        uninterrupted, resumed = result["offload", kind]["totals"]
        for name in ("steps", "bytes_in", "bytes_out"):
            assert resumed[name] == uninterrupted[name], name
        assert uninterrupted["steps"] == 4
        bytes_moved.append(uninterrupted["bytes_in"])
    if kind == "file":
        assert bytes_moved[0] != bytes_moved[1] and min(bytes_moved) > 0
