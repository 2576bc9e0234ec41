"""Bad input: a clear error naming the problem, and nothing modified."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_same, make_params, set_grads, step_together

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim import pipeline as pipeline_module


def trained(steps: int = 2, **kwargs):
    params = make_params()
    opt = OffloadAdamW(params, **kwargs)
    generator = torch.Generator().manual_seed(0)
    step_together([opt], [params], generator, steps)
    set_grads([params], generator)
    return opt, params


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(opt, params, before):
    saved_params, saved_state = before
    assert_same(params, saved_params)
    now = opt.state_dict()
    assert now["param_groups"] == saved_state["param_groups"]
    for index, entry in saved_state["state"].items():
        assert_same(list(now["state"][index].values()), list(entry.values()))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"eps": -1e-8}, "Invalid epsilon"),
        ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1"),
        ({"weight_decay": -0.1}, "Invalid weight_decay"),
        ({"lr": torch.tensor([0.1, 0.2])}, "Tensor lr must be 1-element"),
        ({"chunk_size": 10}, "chunk_size must be at least 64"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadAdamW(make_params(), **kwargs)


def test_chunk_size_must_be_an_int():
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        OffloadAdamW(make_params(), chunk_size=1e6)


def test_sparse_gradient_is_refused_before_any_update():
    opt, params = trained()
    before = snapshot(opt, params)
    params[3].grad = params[3].grad.to_sparse()
    with pytest.raises(RuntimeError, match=r"sparse gradients \(parameter 3 of param group 0"):
        opt.step()
    assert_unchanged(opt, params, before)


@pytest.mark.parametrize(
    ("new_data", "message"),
    [
        (lambda p: torch.randn(3, 3), r"is now shape \(3, 3\)"),
        (lambda p: p.detach().double(), "dtype torch.float64"),
    ],
    ids=["shape", "dtype"],
)
def test_parameter_changed_between_steps_is_refused(new_data, message):
    """A device change is covered in test_cuda.py (this machine has one device)."""
    opt, params = trained()
    before = snapshot(opt, params)
    params[0].data = new_data(params[0])
    params[0].grad = torch.randn_like(params[0])
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    saved_params, saved_state = before
    assert_same(params[1:], saved_params[1:])
    assert_same(
        [opt.state[p]["step"] for p in params],
        [saved_state["state"][i]["step"] for i in range(len(params))],
    )


def test_switching_amsgrad_on_after_the_first_step_is_refused():
    opt, params = trained()
    before = snapshot(opt, params)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(RuntimeError, match="amsgrad cannot be switched on"):
        opt.step()
    opt.param_groups[0]["amsgrad"] = False
    assert_unchanged(opt, params, before)


def test_non_dense_parameter_is_refused():
    param = torch.nn.Parameter(torch.randn(3, 1).expand(3, 4))
    opt = OffloadAdamW([param])
    param.grad = torch.ones(3, 4)
    with pytest.raises(ValueError, match="needs dense parameters"):
        opt.step()


def test_allocation_failure_while_staging_leaves_everything_untouched(monkeypatch):
    opt, params = trained(force_staging=True, chunk_size=64)
    before = snapshot(opt, params)
    opt._pipeline._buffers.clear()  # force a fresh allocation of the staging buffers

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: out of accelerator memory while staging")

    monkeypatch.setattr(pipeline_module.torch, "empty", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        opt.step()
    monkeypatch.undo()
    assert_unchanged(opt, params, before)
    opt.step()  # and the optimizer still works afterwards


def corrupt(state_dict: dict, how: str) -> dict:
    broken = copy.deepcopy(state_dict)
    if how == "groups":
        broken["param_groups"].append(dict(broken["param_groups"][0], params=[]))
    elif how == "params":
        broken["param_groups"][0]["params"].pop()
    elif how == "shape":
        broken["state"][1]["exp_avg"] = torch.zeros(6)
    elif how == "missing":
        del broken["state"][2]["exp_avg_sq"]
    elif how == "unknown":
        broken["state"][99] = broken["state"][0]
    elif how == "layout":
        del broken["state"]
    elif how == "complex":
        broken["state"][0]["exp_avg"] = torch.zeros(300, 7, dtype=torch.complex64)
    return broken


@pytest.mark.parametrize(
    ("how", "error", "message"),
    [
        ("groups", ValueError, "has 2 parameter groups, this optimizer has 1"),
        ("params", ValueError, "param group 0 of the loaded state dict has 4 parameters"),
        ("shape", ValueError, r"'exp_avg' for parameter 1 of param group 0 \(key 1\) has shape"),
        (
            "missing",
            KeyError,
            r"parameter 2 of param group 0 \(key 2\) is missing \['exp_avg_sq'\]",
        ),
        ("unknown", KeyError, "entry for 99, which no param group lists"),
        ("layout", ValueError, "needs the keys 'state' and 'param_groups'"),
        ("complex", ValueError, "is torch.complex64, the parameter torch.float32"),
    ],
)
def test_bad_state_dict_is_refused_whole(how, error, message):
    opt, params = trained()
    before = snapshot(opt, params)
    with pytest.raises(error, match=message):
        opt.load_state_dict(corrupt(opt.state_dict(), how))
    assert_unchanged(opt, params, before)


def test_pin_memory_without_accelerator_warns_and_falls_back():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with pytest.warns(UserWarning, match="needs an accelerator to pin host memory"):
        opt = OffloadAdamW(make_params(), pin_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = OffloadAdamW(make_params())
    assert opt.pin_memory is False and default.pin_memory is False
    params = opt.param_groups[0]["params"]
    set_grads([params], torch.Generator().manual_seed(0))
    opt.step()
    assert opt.memory_stats()["pinned"] is False


def test_gradient_of_another_dtype_is_refused_before_any_update():
    opt, params = trained()
    before = snapshot(opt, params)
    params[2].grad_dtype = None  # torch lets a gradient's dtype differ once this is cleared
    params[2].grad = params[2].grad.double()
    with pytest.raises(
        RuntimeError, match=r"gradient of parameter 2 of param group 0 is torch\.float64"
    ):
        opt.step()
    assert_unchanged(opt, params, before)


@pytest.mark.no_stream_check  # DTensor dispatch under a recording mode
def test_dtensor_parameters_are_refused_clearly(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/rendezvous"
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        param.grad = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        opt = OffloadAdamW([param])
        with pytest.raises(RuntimeError, match="does not support DTensor parameters yet"):
            opt.step()
        assert not opt.state
    finally:
        dist.destroy_process_group()


def test_cleared_state_is_recreated_with_the_keys_now_needed():
    """After optimizer.state is cleared, amsgrad may be switched on: state starts afresh."""
    opt, params = trained()
    opt.state.clear()
    opt.param_groups[0]["amsgrad"] = True
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(reference, amsgrad=True, fused=True)
    for r, p in zip(reference, params, strict=True):
        r.grad = p.grad.clone()
    opt.step()
    torch_opt.step()
    assert_same(params, reference)
