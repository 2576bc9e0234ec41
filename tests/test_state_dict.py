"""Checkpoints: torch.optim.AdamW's format both ways, fp32 moments on load, names as keys."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import assert_same, clone_params, make_params, set_grads, step_together

from lightning_offload_optim import OffloadAdamW

MODES = {"direct": {}, "staged": {"force_staging": True, "chunk_size": 128}}


def save_and_load(state_dict: dict) -> dict:
    """A round trip through torch.save and torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize(
    ("before", "after"),
    [("offload", "offload"), ("offload", "torch"), ("torch", "offload")],
)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_resume_matches_uninterrupted_run(mode, before, after, amsgrad):
    def make(kind, params):
        if kind == "torch":
            return torch.optim.AdamW(params, lr=0.01, amsgrad=amsgrad, fused=True)
        return OffloadAdamW(params, lr=0.01, amsgrad=amsgrad, **mode)

    params = make_params()
    uninterrupted = clone_params(params)
    reference = torch.optim.AdamW(uninterrupted, lr=0.01, amsgrad=amsgrad, fused=True)
    first = make(before, params)
    generator = torch.Generator().manual_seed(0)
    step_together([first, reference], [params, uninterrupted], generator, 3)
    checkpoint = save_and_load(first.state_dict())
    second = make(after, params)
    # torch's load takes every hyperparameter from the checkpoint, ``fused`` included: saved
    # groups say fused=True, so torch stays on the fused kernel and exact.
    second.load_state_dict(checkpoint)
    step_together([second, reference], [params, uninterrupted], generator, 3)
    assert_same(params, uninterrupted)
    assert_same(
        [second.state_dict()["state"][i]["exp_avg_sq"] for i in range(len(params))],
        [reference.state_dict()["state"][i]["exp_avg_sq"] for i in range(len(params))],
    )
    if after == "offload":
        assert all(set(second.state[p]) == {"step"} for p in params)


def test_state_dict_matches_torch_format():
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, amsgrad=True)
    torch_opt = torch.optim.AdamW(reference, amsgrad=True, fused=True)
    generator = torch.Generator().manual_seed(1)
    step_together([offload, torch_opt], [params, reference], generator, 2, skip=lambda i: i == 2)
    ours, theirs = offload.state_dict(), torch_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert ours["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert ours["state"][index][key].shape == value.shape
            assert ours["state"][index][key].dtype == value.dtype
    # The state dict does not put the offloaded tensors into optimizer.state.
    assert all(set(offload.state[p]) == {"step"} for p in offload.state)


def test_parameter_names_as_state_keys():
    params = make_params()
    offload = OffloadAdamW(params, lr=0.01)
    generator = torch.Generator().manual_seed(2)
    step_together([offload], [params], generator, 2)
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=True)
    torch_opt.load_state_dict(offload.state_dict())
    # torch.distributed.checkpoint keys state by fully qualified parameter names.
    saved = offload.state_dict()
    names = {i: f"layer{i}.weight" for i in range(len(params))}
    by_name = {
        "state": {names[i]: entry for i, entry in saved["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in saved["param_groups"]
        ],
    }
    resumed = OffloadAdamW(params, lr=0.01)
    resumed.load_state_dict(save_and_load(by_name))
    step_together([resumed, torch_opt], [params, reference], generator, 2)
    assert_same(params, reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_checkpoint_keeps_fp32(dtype):
    params = make_params(dtype=dtype)
    first = OffloadAdamW(params, lr=0.01)
    step_together([first], [params], torch.Generator().manual_seed(3), 3)
    checkpoint = save_and_load(first.state_dict())
    assert checkpoint["state"][0]["exp_avg"].dtype == torch.float32
    assert checkpoint["state"][0]["master_param"].dtype == torch.float32
    second = OffloadAdamW(params, lr=0.01)
    second.load_state_dict(checkpoint)
    loaded = second.offloaded_state(params[0])
    assert loaded["exp_avg"].dtype == torch.float32
    assert_same([loaded["exp_avg"]], [checkpoint["state"][0]["exp_avg"]])
    assert_same([loaded["master_param"]], [checkpoint["state"][0]["master_param"]])


def test_low_precision_resume_matches_uninterrupted_run():
    params = make_params(dtype=torch.bfloat16)
    uninterrupted = clone_params(params)
    first = OffloadAdamW(params, lr=0.01, weight_decay=0.1)
    reference = OffloadAdamW(uninterrupted, lr=0.01, weight_decay=0.1)
    generator = torch.Generator().manual_seed(4)
    step_together([first, reference], [params, uninterrupted], generator, 3)
    second = OffloadAdamW(params, lr=0.01, weight_decay=0.1)
    second.load_state_dict(save_and_load(first.state_dict()))
    step_together([second, reference], [params, uninterrupted], generator, 3)
    assert_same(params, uninterrupted)


def test_torch_low_precision_checkpoint_is_upcast_and_master_taken_from_params():
    params = make_params(dtype=torch.bfloat16)
    torch_opt = torch.optim.AdamW(params, lr=0.01)
    generator = torch.Generator().manual_seed(5)
    step_together([torch_opt], [params], generator, 2)
    checkpoint = save_and_load(torch_opt.state_dict())
    offload = OffloadAdamW(params, lr=0.01)
    offload.load_state_dict(checkpoint)
    state = offload.offloaded_state(params[0])
    assert state["exp_avg"].dtype == torch.float32
    assert_same([state["exp_avg"]], [checkpoint["state"][0]["exp_avg"].float()])
    set_grads([params], generator)
    offload.step()  # the master copy starts from the bf16 parameter itself
    master = offload.offloaded_state(params[0])["master_param"]
    assert_same([master.to(torch.bfloat16)], [params[0]])


def test_load_keeps_fp32_moments_for_bf16_params():
    """torch's own load would cast fp32 moments to the parameter dtype (bf16)."""
    params = make_params(dtype=torch.bfloat16)
    fp32_moments = {
        i: {
            "step": torch.tensor(5.0),
            "exp_avg": torch.randn(p.shape) * 1e-3 + 1.0,
            "exp_avg_sq": torch.rand(p.shape) + 1.0,
        }
        for i, p in enumerate(params)
    }
    offload = OffloadAdamW(params)
    saved = offload.state_dict()
    offload.load_state_dict({"state": fp32_moments, "param_groups": saved["param_groups"]})
    for i, p in enumerate(params):
        state = offload.offloaded_state(p)
        assert_same([state["exp_avg"]], [fp32_moments[i]["exp_avg"]])
        assert_same([state["exp_avg_sq"]], [fp32_moments[i]["exp_avg_sq"]])


def test_state_dict_waits_for_staged_writes_and_survives_later_steps_as_torch_does():
    params = make_params()
    offload = OffloadAdamW(params, force_staging=True, chunk_size=64)
    generator = torch.Generator().manual_seed(6)
    step_together([offload], [params], generator, 2)
    snapshot = save_and_load(offload.state_dict())
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    torch_opt.load_state_dict(snapshot)
    step_together([offload, torch_opt], [params, reference], generator, 2)
    assert_same(params, reference)


def test_master_copy_is_filled_when_loading_a_checkpoint_without_one():
    params = make_params(dtype=torch.bfloat16)
    torch_opt = torch.optim.AdamW(params, lr=0.01)
    step_together([torch_opt], [params], torch.Generator().manual_seed(7), 1)
    offload = OffloadAdamW(params, lr=0.01)
    offload.load_state_dict(save_and_load(torch_opt.state_dict()))
    for index, param in enumerate(params):  # before any step, the saved master is the parameter
        assert_same([offload.state_dict()["state"][index]["master_param"]], [param.float()])


def test_state_dict_from_a_future_format_is_refused():
    params = make_params()
    offload = OffloadAdamW(params)
    step_together([offload], [params], torch.Generator().manual_seed(8), 1)
    saved = offload.state_dict()
    assert saved["offload_format_version"] == 1
    future = {**saved, "offload_format_version": 2}
    with pytest.raises(RuntimeError, match=r"format version 2.*Upgrade lightning-offload-optim"):
        OffloadAdamW(params).load_state_dict(future)
