"""Input checks that a mutation run of validation.py found untested (each test fails on a
mutant that survived the suite): bad input is refused with an error naming the problem and
changes nothing; the good input next to it is taken, exactly as torch's fused AdamW takes it."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
from conftest import assert_same, clone_params, make_params, set_grads, step_together
from test_errors import (
    assert_steps_like_twin,
    assert_unchanged,
    snapshot,
    three_groups,
    trained,
    twins,
)

from lightning_offload_optim import OffloadAdamW

STAGED = {"force_staging": True, "chunk_size": 64}


# ----------------------------------------------------------------------------- hyperparameters
@pytest.mark.parametrize("mode", [{}, STAGED], ids=["direct", "staged"])
def test_fraction_hyperparameters_are_taken_as_the_floats_they_are(mode):
    """``numbers.Real`` lr and betas pass the check; they must reach the kernel as floats (a
    Fraction handed on as it is fails inside the update, after the step counts advanced)."""
    params = make_params()
    opt = OffloadAdamW(three_groups(params), lr=Fraction(1, 100), **mode)
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(three_groups(reference), lr=0.01, fused=True)
    opt.param_groups[2]["betas"] = (Fraction(1, 2), Fraction(3, 4))
    torch_opt.param_groups[2]["betas"] = (0.5, 0.75)
    step_together([opt, torch_opt], [params, reference], torch.Generator().manual_seed(2), 3)
    assert_same(params, reference)
    ours, theirs = opt.state_dict()["state"], torch_opt.state_dict()["state"]
    for index, entry in theirs.items():
        assert_same(list(ours[index].values()), list(entry.values()))


# ----------------------------------------------------------------------------- step counts
def test_entry_without_a_step_count_is_refused_naming_the_key():
    (opt, params), (twin, twin_params) = twins()
    before = snapshot(opt, params)
    broken = copy.deepcopy(opt.state_dict())
    del broken["state"][2]["step"]
    with pytest.raises(
        KeyError, match=r"parameter 2 of param group 0 \(key 2\) is missing \['step'\]"
    ):
        opt.load_state_dict(broken)
    assert_unchanged(opt, params, before)
    assert_steps_like_twin(opt, params, twin, twin_params)


# ----------------------------------------------------------------------------- GradScaler
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", [{}, STAGED], ids=["direct", "staged"])
def test_grad_scale_of_another_float_dtype_unscales_like_torch(dtype, mode):
    """A 1-element float tensor of any float dtype is taken (read as float32, as GradScaler's
    own scale is), never handed to the kernel as it is to fail partway through the update."""
    opt, params = trained(**mode)
    before = snapshot(opt, params)
    saved_params, saved_state = before
    reference = [torch.nn.Parameter(p.clone()) for p in saved_params]
    torch_opt = torch.optim.AdamW(reference, fused=True)
    torch_opt.load_state_dict(copy.deepcopy(saved_state))
    for p, r in zip(params, reference, strict=True):
        r.grad = p.grad.clone()
    opt.grad_scale = torch.tensor(4.0, dtype=dtype)
    opt.found_inf = torch.tensor(0.0)
    torch_opt.grad_scale = torch.tensor(4.0)
    torch_opt.found_inf = torch.tensor(0.0)
    opt.step()
    torch_opt.step()
    assert_same(params, reference)


@pytest.mark.parametrize("mode", [{}, STAGED], ids=["direct", "staged"])
def test_an_expanded_gradient_to_unscale_is_refused_before_anything_changes(mode):
    """The update writes gradients back unscaled; one whose elements share memory (expanded
    from one value) cannot take that. GradScaler's own check for infs, which writes the
    gradients in place, refuses it before ``step()``; a scale set by hand reaches the step,
    which refuses it before the update (the write came after the chunk's kernel: a step
    applied halfway). An empty one has nothing to write: it is taken."""
    (opt, params), (twin, twin_params) = twins(dtype=torch.float16, **mode)
    before = snapshot(opt, params)
    grad = params[1].grad
    params[1].grad = grad.reshape(-1)[:1].expand(grad.shape)
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
    with pytest.raises(
        RuntimeError,
        match=r"gradient of parameter 1 of param group 0 has .*"
        r"share memory .*strides \(0,\).*grad.clone\(\)",
    ):
        opt.step()
    assert_unchanged(opt, params, before)
    params[1].grad = params[1].grad.clone()  # taken once it has memory of its own
    twin_params[1].grad = params[1].grad.clone()
    for o in (opt, twin):
        o.grad_scale, o.found_inf = torch.tensor(4.0), torch.tensor(0.0)
        o.step()
        del o.grad_scale, o.found_inf
    assert_same(params, twin_params)
    assert_same([p.grad for p in params], [p.grad for p in twin_params])
    assert_steps_like_twin(opt, params, twin, twin_params)
    empty = torch.nn.Parameter(torch.zeros(3, 0, dtype=torch.float16))
    empty.grad = torch.zeros(1, 0, dtype=torch.float16).expand(3, 0)  # strides (0, 1)
    alone = OffloadAdamW([empty], **mode)
    alone.grad_scale, alone.found_inf = torch.tensor(4.0), torch.tensor(0.0)
    alone.step()
    assert float(alone.state[empty]["step"]) == 1.0


def test_zero_strides_on_dimensions_of_size_one_share_no_memory():
    """A gradient whose only zero strides are on dimensions of size 1 (a transposed one, whose
    size-1 dimension got stride 0) shares no memory: it is updated and unscaled as a contiguous
    copy of it would be."""

    def params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(2, 1, 3))]

    ours, twins = params(), params()
    grads = [torch.arange(6.0).mul(8).as_strided((2, 1, 3), (1, 0, 2))]
    assert not grads[0].is_contiguous()
    for p, twin, grad in zip(ours, twins, grads, strict=True):
        p.grad, twin.grad = grad, grad.clone()
        assert p.grad.stride() != p.stride()
    for opt in (OffloadAdamW(ours, lr=0.1), OffloadAdamW(twins, lr=0.1)):
        opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(0.0)
        opt.step()
    assert_same(ours, twins)
    assert_same([p.grad for p in ours], [p.grad for p in twins])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.tensor(4), r"optimizer.grad_scale is a torch.int64 tensor of shape \(\) on cpu"),
        (4.0, r"optimizer.grad_scale is 4.0 \(float\); GradScaler sets a 1-element float"),
    ],
    ids=["int-tensor", "python-float"],
)
def test_a_gradient_scale_of_another_kind_is_refused(value, message):
    (opt, params), (twin, twin_params) = trained(), trained()
    before = snapshot(opt, params)
    opt.grad_scale = value
    with pytest.raises(TypeError, match=message):
        opt.step()
    del opt.grad_scale
    assert_unchanged(opt, params, before)
    assert_steps_like_twin(opt, params, twin, twin_params)


# ----------------------------------------------------------------------------- optimizer.state
def test_step_count_on_the_meta_device_in_optimizer_state_is_refused_before_any_count_advances():
    (opt, params), (twin, twin_params) = twins()
    before = snapshot(opt, params)
    kept = opt.state[params[1]]["step"]
    opt.state[params[1]]["step"] = torch.tensor(2.0, device="meta")
    with pytest.raises(
        ValueError,
        match=r"'step' in optimizer.state for parameter 1 of param group 0 is .* on meta",
    ):
        opt.step()
    opt.state[params[1]]["step"] = kept
    assert_unchanged(opt, params, before)
    assert_steps_like_twin(opt, params, twin, twin_params)


# ----------------------------------------------------------------------------- loading
def test_real_moment_for_a_complex_parameter_is_refused_whole():
    """Not copied into the complex buffer as real parts with the imaginary parts zeroed."""

    def complex_trained():
        params = make_params([(3,), (2, 2)], dtype=torch.complex64, seed=2)
        opt = OffloadAdamW(params)
        step_together([opt], [params], torch.Generator().manual_seed(0), 2)
        set_grads([params], torch.Generator().manual_seed(1))
        return opt, params

    (opt, params), (twin, twin_params) = complex_trained(), complex_trained()
    before = snapshot(opt, params)
    broken = copy.deepcopy(opt.state_dict())
    broken["state"][1]["exp_avg"] = broken["state"][1]["exp_avg"].real.contiguous()
    with pytest.raises(
        ValueError,
        match=r"'exp_avg' for parameter 1 .* is torch.float32, the parameter torch.complex64",
    ):
        opt.load_state_dict(broken)
    assert_unchanged(opt, params, before)
    assert_steps_like_twin(opt, params, twin, twin_params)


def test_a_load_pre_hook_returning_no_state_dict_is_refused_whole():
    (opt, params), (twin, twin_params) = twins()
    before = snapshot(opt, params)
    handle = opt.register_load_state_dict_pre_hook(lambda optimizer, sd: list(sd.items()))
    with pytest.raises(ValueError, match="an optimizer state dict needs the keys 'state' and"):
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    handle.remove()
    assert_unchanged(opt, params, before)
    assert_steps_like_twin(opt, params, twin, twin_params)


def test_a_zero_byte_budget_is_accepted_and_a_negative_one_refused():
    """0 bytes (nothing resident) is a valid budget."""
    opt = OffloadAdamW([torch.nn.Parameter(torch.zeros(4))], resident=0)
    assert opt.resident == 0 and type(opt.resident) is int
    with pytest.raises(ValueError, match=r"resident as a number of bytes must be >= 0, got -1"):
        opt.resident = -1


@pytest.mark.parametrize(
    "mode", [{}, {"force_staging": True, "chunk_size": 64}], ids=["direct", "staged"]
)
def test_one_element_tensor_betas_step_like_torch_adamw_with_float_betas(mode):
    """Betas given as 1-element float tensors (a pair of them, or a shape-(2,) tensor) are
    taken as the floats they hold, as torch's AdamW takes them (float64 here, to hold exactly
    the floats given to torch)."""
    params = make_params()
    reference = clone_params(params)
    ours = OffloadAdamW(
        params,
        lr=0.01,
        betas=(torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.95, dtype=torch.float64)),
        **mode,
    )
    theirs = torch.optim.AdamW(reference, lr=0.01, betas=(0.8, 0.95), fused=True)
    step_together([ours, theirs], [params, reference], torch.Generator().manual_seed(1), 2)
    ours.param_groups[0]["betas"] = torch.tensor([0.7, 0.9], dtype=torch.float64)
    theirs.param_groups[0]["betas"] = (0.7, 0.9)
    step_together([ours, theirs], [params, reference], torch.Generator().manual_seed(2), 2)
    assert_same(params, reference)


def test_a_group_whose_amsgrad_key_was_deleted_is_refused_before_anything_changes():
    """``amsgrad`` has no default at step time (unlike ``decoupled_weight_decay``): a group
    without it is refused, and nothing changes."""
    params = make_params()
    opt = OffloadAdamW(params, lr=0.01)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    del opt.param_groups[0]["amsgrad"]
    with pytest.raises(
        ValueError, match=r"^param group 0 has amsgrad=None \(NoneType\); it must be a bool$"
    ):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert not opt.state
