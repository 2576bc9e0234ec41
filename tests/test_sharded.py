"""DTensor parameters (FSDP2, tensor parallel) on 2 CPU processes over gloo, against torch AdamW.

One launch per world size runs every scenario of tests/sharded_worker.py (starting processes
costs more than the scenarios); each test here checks one scenario's result on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_same, run_script
from sharded_worker import RANDOM_SEEDS

from lightning_offload_optim import plan

TWO_RANK_SCENARIOS = [
    "fsdp_steps",
    "fsdp_amsgrad",
    "fsdp_staged_small_chunks",
    "fsdp_bf16_params",
    "fsdp_mixed_precision_policy",
    "fsdp_overlapped",
    "fsdp_overlapped_forward_prefetch",
    "fsdp_overlapped_async_prefetch",
    "fsdp_overlapped_grouped",
    "fsdp_overlapped_streams_unknown",
    "tensor_parallel_placements",
    "tensor_parallel_block",
    "tensor_parallel_block_overlapped",
    pytest.param(
        "strided_shard_loads",
        marks=pytest.mark.skipif(
            torch.__version__ < (2, 12),
            reason="torch < 2.12 cannot gather a lone _StridedShard (the test's reference)",
        ),
    ),
    "refusals",
    "zero_redundancy",
    "zero_redundancy_overlapped",
    "sharded_state_dict",
    "distributed_checkpoint",
    "flattened_checkpoint",
    "full_state_dict",
    "torch_bf16_checkpoint_to_ours",
    "full_state_dict_broadcast",
    "deepcopy",
    "torch_save",
    "torch_to_ours",
    "ours_to_torch",
    "load_from_1",
    "plain_full_tensors",
    "replicated_dtensors",
]


def launch(world_size: int, phase: str, out: Path) -> list[dict]:
    run_script("sharded_worker.py", world_size, phase, out)
    return [torch.load(out / f"{phase}-rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Save on 1 rank, run everything on 2 (loading the 1-rank checkpoint), load on 1."""
    out = tmp_path_factory.mktemp("sharded")
    save = launch(1, "save", out)
    two = launch(2, "all", out)
    load = launch(1, "load2", out)
    return {"save": save, "all": two, "load2": load}


def results(runs, phase: str, scenario: str) -> list[dict]:
    found = [rank[scenario] for rank in runs[phase]]
    for rank, result in enumerate(found):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return found


@pytest.mark.parametrize("scenario", TWO_RANK_SCENARIOS)
def test_two_ranks_bit_identical_to_torch_adamw(runs, scenario):
    for result in results(runs, "all", scenario):
        assert_same(result["ours"], result["reference"])


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_scenarios_on_two_ranks_match_torch_adamw(runs, seed):
    """``tests/test_randomized.py``'s scenario ``seed`` under FSDP2 on 2 ranks, under the stream
    checker: parameters and state bit-identical to torch's (the worker asserts it, on every
    rank), no unordered access."""
    results(runs, "all", f"random_{seed}")


@pytest.mark.parametrize(("phase", "scenario"), [("save", "save_for_2"), ("load2", "load_from_2")])
def test_one_rank_bit_identical_to_torch_adamw(runs, phase, scenario):
    (result,) = results(runs, phase, scenario)
    assert_same(result["ours"], result["reference"])


@pytest.mark.parametrize(
    "scenario",
    [
        "fsdp_overlapped",
        "fsdp_overlapped_forward_prefetch",
        "fsdp_overlapped_async_prefetch",
        "fsdp_overlapped_grouped",
        "fsdp_overlapped_streams_unknown",
    ],
)
def test_overlapped_steps_order_fsdp2_all_gathers_after_the_updates(runs, scenario):
    """On 2 ranks FSDP2 all-gathers each unit's shards on streams of its own; under the
    checker's simulation of them every copy is ordered after the update it reads (also where
    this torch's FSDP2 keeps its streams out of the overlap's reach)."""
    for result in results(runs, "all", scenario):
        assert result["ours_violations"] == [] and result["reference_violations"] == []


@pytest.mark.parametrize(
    ("scenario", "race"),
    [
        ("fsdp_overlapped_without_all_gather_waits", "all_gather_copy_in on side"),
        ("fsdp_overlapped_without_prefetch_waits", "all_gather_copy_in on side"),
        ("fsdp_overlapped_async_without_prefetch_waits", "all_gather_copy_in on compute"),
        ("fsdp_overlapped_grouped_without_group", "all_gather_copy_in on side"),
    ],
)
def test_without_the_all_gather_waits_the_checker_sees_races(runs, scenario, race):
    """Each wait is needed: without the all-gather streams' waits (or those for the units a
    unit prefetches, or for every module of a group), the all-gathers read shards their
    updates still write; an asynchronous unshard copies on the caller's stream."""
    ranks = results(runs, "all", scenario)
    assert any(r["ours_violations"] for r in ranks)  # rank 1 holds no shard of `out`
    for result in ranks:
        assert result["reference_violations"] == []
        assert all(v.startswith(race) for v in result["ours_violations"])


def test_each_rank_holds_the_state_of_its_shards_only(runs):
    ranks = results(runs, "all", "fsdp_steps")
    # 37 rows split 19/18, 75 rows 38/37, 1 row 1/0 (rank 1's shards of `out` are empty).
    assert ranks[0]["local_numel"] == [19 * 6, 19, 19, 19, 38 * 37, 38, 75, 1]
    assert ranks[1]["local_numel"] == [18 * 6, 18, 18, 18, 37 * 37, 37, 0, 0]
    for result in ranks:
        assert result["state_bytes"] == 8 * sum(result["local_numel"])


def test_state_keeps_the_parameters_placements(runs):
    for result in results(runs, "all", "tensor_parallel_placements"):
        assert result["placements"] == [[p, p] for p in result["param_placements"]]


@pytest.mark.parametrize("scenario", ["tensor_parallel_block", "tensor_parallel_block_overlapped"])
def test_partial_sum_gradients_are_summed_for_the_update_and_left_as_they_were(runs, scenario):
    """The block's norm weights get partial sums (else the block would test nothing new); the
    overlapped update holds their redistributed temporaries until it has read them."""
    for result in results(runs, "all", scenario):
        assert "(Partial(sum),)" in result["ours_grad_placements"]
        assert result["ours_grad_placements"] == result["reference_grad_placements"]
        assert result["violations"] == []


def test_sharded_state_dict_is_dtensors_viewing_the_host_buffers(runs):
    for result in results(runs, "all", "sharded_state_dict"):
        assert result["all_dtensors"] and result["zero_copy"] and result["shapes_match"]


def test_sharded_resume_holds_the_state_once(runs):
    """Fresh optimizer, fake step, dcp.load into its state dict, set_optimizer_state_dict."""
    for phase, scenario in (("all", "distributed_checkpoint"), ("save", "save_for_2")):
        for result in results(runs, phase, scenario):
            assert result["peak_host_bytes"] == result["state_bytes"] > 0


def test_wrong_shardings_are_refused_on_every_rank(runs):
    for result in results(runs, "all", "refusals"):
        messages = result["messages"]
        assert "a plain tensor, the parameter a DTensor" in messages["gradient"]
        assert "Placements" not in messages["gradient"] and "Shard(dim=0)" in messages["gradient"]
        assert (
            "Shard(dim=1)" in messages["load"]
            and "torch.distributed.checkpoint" in messages["load"]
        )
        assert_same(result["ours"], result["reference"])  # the refused load changed nothing


@pytest.mark.parametrize(
    ("scenario", "options"),
    [
        ("fsdp_steps", {}),
        ("fsdp_staged_small_chunks", {"chunk_size": 64}),
        ("fsdp_bf16_params", {"chunk_size": 128, "precision": "bf16-true"}),
    ],
)
def test_planner_predicts_each_ranks_memory(runs, scenario, options):
    """The planner's figures for an FSDP2 run on 2 ranks, against what each rank reports
    (staged like a GPU run, pageable as on this CPU)."""
    from sharded_worker import Net

    planned = plan(Net(), strategy="fsdp2", gpus=2, pin_memory=False, **options)
    for rank, result in enumerate(results(runs, "all", scenario)):
        reported = result["memory"]
        expected = planned.memory_stats(rank)
        for key in ("state_bytes", "host_bytes"):
            assert reported[key] == expected[key], key
        if scenario != "fsdp_steps":  # staged; the plain CPU path stages nothing
            assert reported["staging_bytes"] == expected["staging_bytes"]


def test_zero_redundancy_load_is_adopted_into_host_memory(runs):
    """ZeroRedundancyOptimizer's load writes tensors into the inner optimizer's state; they
    are moved into host buffers (and the comparison above shows they are the loaded values)."""
    for result in results(runs, "all", "zero_redundancy"):
        assert result["only_steps_are_tensors"]


def test_zero_redundancy_over_an_overlapped_optimizer_orders_its_broadcasts(runs):
    """ZeroRedundancyOptimizer broadcasts the updated parameters inside its step: the inner
    overlapped step waits for its updates there (warned about once per rank), so no broadcast
    reads a parameter before its update (the parameters match ZeRO over torch AdamW above)."""
    for result in results(runs, "all", "zero_redundancy_overlapped"):
        assert result["ours_violations"] == [] and result["reference_violations"] == []
        warned = [w for w in result["ours_warnings"] if "ZeroRedundancyOptimizer.step()" in w]
        assert len(warned) == 1 and result["reference_warnings"] == []


def test_strict_load_of_a_checkpoint_without_master_copies_names_the_missing_key(runs):
    for result in results(runs, "all", "torch_bf16_checkpoint_to_ours"):
        assert "master_param" in result["strict_error"]
