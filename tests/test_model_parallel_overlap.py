"""Lightning's ModelParallelStrategy (FSDP2) on 2 CPU processes with the mixin's
``overlap_step=True`` and ``offload_resident=0.5`` on the staged pipeline (``force_staging``,
chunks of 64 elements) under the stream-ordering checker, with bf16-mixed and gradient clipping,
against torch AdamW doing the same: the fit, a sharded checkpoint at step 2 and resumes from it
(into the same resident share, a larger one, and none)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, run_script

# The workers run their own checker around each fit (tests/model_parallel_overlap_fit.py).
pytestmark = pytest.mark.no_stream_check


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("model_parallel_overlap")
    run_script("model_parallel_overlap_fit.py", out, timeout=600)
    assert (out / "ckpt-offload" / "step=2.ckpt" / ".metadata").is_file()  # sharded
    assert (out / "ckpt-torch" / "step=2.ckpt" / ".metadata").is_file()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_overlapped_fit_bit_identical_to_torch_adamw_on_both_ranks(ranks):
    for result in ranks:
        ours, reference = result["offload"], result["torch"]
        assert ours["violations"] == [] and reference["violations"] == []
        facts = ours["facts"]
        assert facts["overlapping"] and facts["step"] == 4
        assert 0 < facts["resident_bytes"] <= facts["state_bytes"] // 2
        assert not any(
            torch.equal(a, b) for a, b in zip(ours["initial"], ours["params"], strict=True)
        )
        assert_same(ours["params"], reference["params"])
    assert_same(ranks[0]["offload"]["params"], ranks[1]["offload"]["params"])


@pytest.mark.parametrize("resume", ["resident-0.5", "resident-0.9", "resident-none"])
def test_sharded_resume_bit_identical_to_torch_adamws_resume(ranks, resume):
    """Saved at step 2 with part of the state resident; resumed into the same share (which keeps
    as much resident as the uninterrupted run, though the load lays the state out in another
    order), a larger one and none."""
    for result in ranks:
        ours = result["offload"]["resumed"][resume]
        reference = result["torch"]["resumed"]["reference"]
        assert ours["violations"] == [] and reference["violations"] == []
        assert ours["facts"]["overlapping"] and ours["facts"]["step"] == 4
        uninterrupted = result["offload"]["facts"]["resident_bytes"]
        expected = {"resident-0.5": uninterrupted, "resident-none": 0}
        if resume in expected:
            assert ours["facts"]["resident_bytes"] == expected[resume]
        else:
            assert (
                uninterrupted
                <= ours["facts"]["resident_bytes"]
                <= 0.9 * ours["facts"]["state_bytes"]
            )
        assert_same(ours["params"], reference["params"])
        assert_same(ours["params"], result["offload"]["params"])  # resuming changed nothing
