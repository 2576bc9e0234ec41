"""OffloadAdamW against torch.optim.AdamW on the same inputs.

The contract (docs/exactness.md): bit-identical to ``torch.optim.AdamW(fused=True)``, which
calls the same kernel; within fp32 rounding of torch's default (for-loop/foreach) AdamW.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import (
    SHAPES,
    MasterCopyAdamW,
    TiedNet,
    accelerator_seen,
    assert_same,
    assert_state_offloaded,
    clone_params,
    exact_reference,
    make_params,
    set_grads,
    step_in_backward,
    step_together,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.testing._internal.common_optimizers import optim_db

from lightning_offload_optim import OffloadAdamW, StagingPool
from lightning_offload_optim.adamw import DEFAULT_CHUNK_SIZE

# Direct update of host buffers (CPU params), and the staged pipeline with chunks smaller than
# most parameters (64 elements, so a 2100-element parameter spans 33 chunks), and a middle size.
MODES = {
    "direct": {},
    "staged-64": {"force_staging": True, "chunk_size": 64},
    "staged-1000": {"force_staging": True, "chunk_size": 1000},
}
HYPERPARAMETERS = {
    "defaults": {},
    "lr": {"lr": 0.05},
    "weight_decay": {"weight_decay": 0.3},
    "no_weight_decay": {"weight_decay": 0.0},
    "maximize": {"maximize": True},
    "amsgrad": {"amsgrad": True},
    "betas_eps": {"betas": (0.8, 0.95), "eps": 1e-5},
    "beta1_zero": {"betas": (0.0, 0.999)},  # no momentum: valid, as in torch
    "all": {"lr": 0.02, "weight_decay": 0.2, "amsgrad": True, "maximize": True},
}


def run_side_by_side(
    kwargs: dict,
    mode: dict,
    steps: int = 6,
    shapes=SHAPES,
    dtype=torch.float32,
    skip=lambda step, i: False,
    reference_kwargs: dict | None = None,
):
    params = make_params(shapes, dtype=dtype)
    reference = clone_params(params)
    offload = OffloadAdamW(params, **kwargs, **mode)
    if reference_kwargs is None:
        reference_kwargs = {"fused": True}
    torch_opt = torch.optim.AdamW(reference, **kwargs, **reference_kwargs)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        set_grads([params, reference], generator, skip=lambda i, s=step: skip(s, i))
        offload.step()
        torch_opt.step()
    return params, reference, offload, torch_opt


def assert_state_equal(offload: OffloadAdamW, torch_opt: torch.optim.Optimizer, params, reference):
    """Moments, step counts and (against a :class:`MasterCopyAdamW`) master copies equal."""
    for p, r in zip(params, reference, strict=True):
        if isinstance(torch_opt, MasterCopyAdamW):
            master = torch_opt.masters[r]
            state = torch_opt.fp32.state.get(master, {})
            expected = {"master_param": master} if state else {}
        else:
            state, expected = torch_opt.state.get(r, {}), {}
        expected |= {k: v for k, v in state.items() if k != "step"}
        got = offload.offloaded_state(p)
        assert got.keys() == expected.keys()
        assert_same([got[k] for k in expected], list(expected.values()))
        if expected:
            assert torch.equal(offload.state[p]["step"], state["step"].cpu())


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("kwargs", HYPERPARAMETERS.values(), ids=HYPERPARAMETERS.keys())
def test_bit_identical_to_torch_fused(kwargs, mode):
    params, reference, offload, torch_opt = run_side_by_side(kwargs, mode)
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)


@pytest.mark.parametrize("kwargs", HYPERPARAMETERS.values(), ids=HYPERPARAMETERS.keys())
def test_close_to_torch_default_implementation(kwargs):
    params, reference, _, _ = run_side_by_side(kwargs, MODES["staged-64"], reference_kwargs={})
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "optim_input",
    next(o for o in optim_db if o.optim_cls is torch.optim.AdamW).optim_inputs_func(device="cpu"),
    ids=lambda o: o.desc,
)
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_torch_own_adamw_inputs(optim_input, mode):
    params, reference, offload, torch_opt = run_side_by_side(optim_input.kwargs, mode)
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_param_groups_and_changing_hyperparameters(mode, dtype):
    """A schedule writing lr and betas (OneCycleLR) and hand edits reach every step; for bf16
    parameters, the update of their fp32 masters."""
    params = make_params(dtype=dtype)
    reference = clone_params(params)

    def groups(ps):
        return [
            {"params": ps[:2], "lr": 0.01, "weight_decay": 0.5},
            {"params": ps[2:4], "betas": (0.5, 0.9), "amsgrad": True},
            {"params": ps[4:], "lr": 0.1, "maximize": True, "eps": 1e-3},
        ]

    offload = OffloadAdamW(groups(params), lr=3e-3, **mode)
    if dtype == torch.float32:
        torch_opt = torch.optim.AdamW(groups(reference), lr=3e-3, fused=True)
    else:
        torch_opt = MasterCopyAdamW(groups(reference), lr=3e-3)
    schedulers = [
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.01, 0.2], total_steps=10)
        for opt in (offload, torch_opt)
    ]
    generator = torch.Generator().manual_seed(2)
    for step in range(8):
        set_grads([params, reference], generator)
        if step == 4:  # hand-edited hyperparameters between steps
            for opt in (offload, torch_opt):
                opt.param_groups[0]["weight_decay"] = 0.0
                opt.param_groups[1]["betas"] = (0.7, 0.99)
        offload.step()
        torch_opt.step()
        for scheduler in schedulers:
            scheduler.step()
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_tensor_lr(mode):
    params, reference, *_ = run_side_by_side({"lr": torch.tensor(0.01)}, mode)
    assert_same(params, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_torch_schedule_ending_at_a_rounded_negative_lr_steps_like_torch(mode):
    """torch's LinearLR(start_factor=0.1, end_factor=0.0) ends at lr = -3e-21, not 0: torch's
    AdamW steps on; so must this one (it checks lr at every step, torch only when created)."""
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=1e-3, **mode)
    torch_opt = torch.optim.AdamW(reference, lr=1e-3, fused=True)
    schedules = [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=0.0, total_iters=7)
        for opt in (offload, torch_opt)
    ]
    generator = torch.Generator().manual_seed(3)
    lrs = []
    for _ in range(10):
        step_together([offload, torch_opt], [params, reference], generator, 1)
        for schedule in schedules:
            schedule.step()
        lrs.append(offload.param_groups[0]["lr"])
    assert min(lrs) < 0  # the schedule did go below zero
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_l2_weight_decay_set_by_hand_steps_like_torch_adam(mode):
    """``decoupled_weight_decay=False`` in a param group (torch's AdamW reads it at every step)
    is Adam with L2 decay: equal to torch.optim.Adam(fused=True), not silently AdamW."""
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, weight_decay=0.5, amsgrad=True, **mode)
    offload.param_groups[0]["decoupled_weight_decay"] = False
    torch_adam = torch.optim.Adam(reference, lr=0.01, weight_decay=0.5, amsgrad=True, fused=True)
    step_together([offload, torch_adam], [params, reference], torch.Generator().manual_seed(4), 4)
    assert_same(params, reference)
    assert_state_equal(offload, torch_adam, params, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_tensor_betas_eps_and_weight_decay_step_like_torch(mode):
    """torch's fused AdamW takes 1-element tensors for eps and weight_decay, and betas as one
    2-element tensor."""
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, **mode)
    torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=True)
    for opt in (offload, torch_opt):
        opt.param_groups[0].update(
            betas=torch.tensor([0.8, 0.99]), eps=torch.tensor(1e-3), weight_decay=torch.tensor(0.3)
        )
    step_together([offload, torch_opt], [params, reference], torch.Generator().manual_seed(5), 3)
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_missing_gradients_and_frozen_parameters(mode):
    # Parameter 1 is frozen (never a gradient); 3 has gradients only on even steps.
    params, reference, offload, torch_opt = run_side_by_side(
        {"weight_decay": 0.1}, mode, steps=7, skip=lambda s, i: i == 1 or (i == 3 and s % 2)
    )
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)
    assert offload.offloaded_state(params[1]) == {}
    assert offload.state_dict()["state"].keys() == torch_opt.state_dict()["state"].keys()


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_parameters(mode, amsgrad, dtype):
    shapes = [(40, 3), (7,)]
    params = make_params(shapes, dtype=dtype)
    reference = clone_params(params)
    # torch's fused kernel takes no complex tensors; torch's own AdamW views complex parameters
    # as real pairs, so fused AdamW over real views of the same values is the exact reference.
    real_reference = [torch.nn.Parameter(torch.view_as_real(p.detach()).clone()) for p in params]
    offload = OffloadAdamW(params, amsgrad=amsgrad, **mode)
    torch_opt = torch.optim.AdamW(reference, amsgrad=amsgrad)
    fused_real = torch.optim.AdamW(real_reference, amsgrad=amsgrad, fused=True)
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        set_grads([params, reference], generator)
        for p, r in zip(params, real_reference, strict=True):
            r.grad = torch.view_as_real(p.grad).clone()
        for opt in (offload, torch_opt, fused_real):
            opt.step()
    assert_same([torch.view_as_real(p) for p in params], real_reference)
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)
        state = offload.offloaded_state(p)
        assert state["exp_avg"].dtype == dtype
        torch.testing.assert_close(state["exp_avg_sq"], torch_opt.state[r]["exp_avg_sq"])
    # In their own precision: torch's keys, no fp32 master copy, host memory for the moments.
    ours, torchs = offload.state_dict()["state"], torch_opt.state_dict()["state"]
    assert all(ours[i].keys() == torchs[i].keys() for i in torchs)
    moments = 3 if amsgrad else 2
    per_element = params[0].element_size()  # 8 or 16 bytes: the parameter's own precision
    assert offload.memory_stats()["state_bytes"] == moments * per_element * sum(
        p.numel() for p in params
    )


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_keep_fp32_state_and_master(mode, dtype):
    params = make_params(dtype=dtype)
    reference = clone_params(params)
    low_precision_reference = clone_params(params)
    offload = OffloadAdamW(params, lr=1e-2, **mode)
    fp32_reference = MasterCopyAdamW([{"params": reference}], lr=1e-2)
    torch_low_precision = torch.optim.AdamW(low_precision_reference, lr=1e-2)
    generator = torch.Generator().manual_seed(4)
    for _ in range(6):
        set_grads([params, reference, low_precision_reference], generator)
        for opt in (offload, fp32_reference, torch_low_precision):
            opt.step()
    # Exact: fp32 AdamW on the fp32 master copy, then rounded to the parameter dtype.
    assert_same(params, reference)
    for p, r in zip(params, reference, strict=True):
        state = offload.offloaded_state(p)
        master = fp32_reference.masters[r]
        assert {v.dtype for v in state.values()} == {torch.float32}
        assert_same([state["master_param"]], [master])
        assert_same([state["exp_avg_sq"]], [fp32_reference.fp32.state[master]["exp_avg_sq"]])
    # torch's own AdamW on low-precision params keeps low-precision state: for bf16 close, not
    # equal; for fp16, eps=1e-8 underflows to 0 and its exp_avg_sq underflows, giving inf.
    for p, r in zip(params, low_precision_reference, strict=True):
        assert torch.isfinite(p).all()
        if dtype == torch.bfloat16:
            torch.testing.assert_close(p, r, rtol=2e-2, atol=2e-2)


def test_float64_parameters_keep_float64_state():
    params, reference, offload, _ = run_side_by_side(
        {"weight_decay": 0.1}, MODES["staged-64"], dtype=torch.float64
    )
    assert_same(params, reference)
    assert offload.offloaded_state(params[0])["exp_avg"].dtype == torch.float64


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_channels_last_parameters(mode):
    params = [p.detach().to(memory_format=torch.channels_last) for p in make_params([(8, 3, 5, 5)])]
    params = [torch.nn.Parameter(p) for p in params]
    reference = clone_params(params)
    offload = OffloadAdamW(params, **mode)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        set_grads([params, reference], generator)  # contiguous grads for channels_last params
        # torch's fused kernel reads a gradient in the parameter's memory order whatever its
        # strides (wrong by 6e-3 here); OffloadAdamW reorders it, so give torch matching strides.
        for r in reference:
            r.grad = r.grad.contiguous(memory_format=torch.channels_last)
        offload.step()
        torch_opt.step()
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)


NON_DENSE_GRADIENTS = {
    # torch.autograd.grad(p.sum(), p) gives this: one element, stride 0.
    "expanded": lambda shape, g: torch.randn(1, generator=g).expand(shape),
    "complex-real": lambda shape, g: torch.randn(shape, dtype=torch.complex64, generator=g).real,
    "every-other": lambda shape, g: torch.randn((*shape[:-1], 2 * shape[-1]), generator=g)[
        ..., ::2
    ],
}


@pytest.mark.parametrize("gradient", NON_DENSE_GRADIENTS)
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_gradients_with_gaps_or_repeats_step_like_their_dense_copies(mode, gradient):
    """A gradient whose flat view is strided (repeated or spaced elements) is read element by
    element, not as contiguous memory (past the end of an expanded one's single element)."""
    params = make_params([(4097,), (5, 70)])
    reference = clone_params(params)
    offload = OffloadAdamW(params, **mode)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):
        for p, r in zip(params, reference, strict=True):
            p.grad = NON_DENSE_GRADIENTS[gradient](p.shape, generator)
            assert not p.grad.is_contiguous()
            r.grad = p.grad.contiguous()
        offload.step()
        torch_opt.step()
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)


def test_new_param_group_after_steps():
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params[:3], force_staging=True, chunk_size=64)
    torch_opt = torch.optim.AdamW(reference[:3], fused=True)
    generator = torch.Generator().manual_seed(6)
    for step in range(6):
        if step == 3:
            offload.add_param_group({"params": params[3:], "lr": 0.1})
            torch_opt.add_param_group({"params": reference[3:], "lr": 0.1})
        set_grads([params, reference], generator)
        offload.step()
        torch_opt.step()
    assert_same(params, reference)
    assert len(offload._host.arenas) == 2  # one allocation per step that brought new params


def test_enabled_false_is_torch_adamw():
    params, reference, offload, torch_opt = run_side_by_side(
        {"weight_decay": 0.1, "amsgrad": True}, {"enabled": False}, reference_kwargs={}
    )
    assert_same(params, reference)
    assert offload._host.arenas == []
    assert_same(
        [offload.state[p]["exp_avg"] for p in params],
        [torch_opt.state[r]["exp_avg"] for r in reference],
    )


def test_closure_runs_with_grad_and_returns_loss():
    model = torch.nn.Linear(4, 1)
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(16, 4)
    offload = OffloadAdamW(model.parameters(), lr=0.1)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, fused=True)

    def closure_for(net, opt):
        def closure():
            assert torch.is_grad_enabled()
            opt.zero_grad()
            loss = net(x).pow(2).mean()
            loss.backward()
            return loss

        return closure

    with torch.no_grad():
        for _ in range(3):
            loss = offload.step(closure_for(model, offload))
            expected = torch_opt.step(closure_for(reference, torch_opt))
            assert torch.equal(loss, expected)
    assert_same(list(model.parameters()), list(reference.parameters()))
    assert not getattr(offload, "_step_supports_amp_scaling", False)


@pytest.mark.parametrize("nothing", ["skipped", "no-gradients"])
def test_a_step_that_updates_nothing_still_returns_the_closures_loss(nothing):
    """torch's fused AdamW returns the closure's loss also when GradScaler's ``found_inf``
    skips the update, or no parameter has a gradient; ours returns early in both cases."""
    results = []
    for make in (OffloadAdamW, lambda ps: torch.optim.AdamW(ps, fused=True)):
        param = torch.nn.Parameter(torch.ones(8))
        opt = make([param])
        if nothing == "skipped":
            opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(1.0)

        def closure(param=param):
            loss = (param * 2).sum()
            if nothing == "skipped":
                loss.backward()
            return loss

        results.append((opt.step(closure), param.detach().clone()))
    (loss, param), (expected, expected_param) = results
    assert loss is not None and expected is not None
    assert_same([loss, param], [expected, expected_param])


def test_disabled_is_torch_adamw_with_its_default_kernel():
    """``enabled=False`` is exactly ``torch.optim.AdamW`` as constructed (not fused): its param
    groups do not claim ``fused=True``, which would switch torch's step to the fused kernel,
    whose bf16 rounding differs on the CPU. ``offloaded_state`` gives torch's state less the
    step count, as when enabled."""
    params = make_params(dtype=torch.bfloat16)
    reference = clone_params(params)
    offload = OffloadAdamW(params, weight_decay=0.1, amsgrad=True, enabled=False)
    torch_opt = torch.optim.AdamW(reference, weight_decay=0.1, amsgrad=True)
    assert offload.state_dict()["param_groups"] == torch_opt.state_dict()["param_groups"]
    step_together([offload, torch_opt], [params, reference], torch.Generator().manual_seed(6), 5)
    assert_same(params, reference)
    for p, r in zip(params, reference, strict=True):
        state, keys = offload.offloaded_state(p), ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        assert list(state) == keys
        assert_same(list(state.values()), [torch_opt.state[r][k] for k in keys])
    # Loaded as torch loads it: the state stays bf16 (offloaded, it would be upcast to fp32).
    resumed = OffloadAdamW(params, weight_decay=0.1, amsgrad=True, enabled=False)
    resumed.load_state_dict(copy.deepcopy(offload.state_dict()))
    assert {resumed.state[p]["exp_avg"].dtype for p in params} == {torch.bfloat16}
    step_together([resumed, torch_opt], [params, reference], torch.Generator().manual_seed(7), 2)
    assert_same(params, reference)


@pytest.mark.parametrize(
    "flags", [{"fused": True}, {"foreach": True}, {"foreach": False, "fused": None}]
)
def test_disabled_takes_torch_adamws_kernel_flags(flags):
    """Disabled, the kernel flags go to torch's AdamW as given (its kernels round bf16
    differently on the CPU, so a dropped flag shows in the weights), with what follows from
    them: groups, and a fused step that GradScaler leaves the gradients' scale to."""
    params = make_params(dtype=torch.bfloat16)
    reference = clone_params(params)
    offload = OffloadAdamW(params, weight_decay=0.1, enabled=False, **flags)
    torch_opt = torch.optim.AdamW(reference, weight_decay=0.1, **flags)
    assert offload.state_dict()["param_groups"] == torch_opt.state_dict()["param_groups"]
    assert offload._step_supports_amp_scaling == bool(flags.get("fused"))
    step_together([offload, torch_opt], [params, reference], torch.Generator().manual_seed(8), 3)
    assert_same(params, reference)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("fused", False), ("foreach", True), ("capturable", True), ("differentiable", True)],
)
def test_kernel_flags_an_offloaded_step_cannot_honour_are_refused_by_name(flag, value):
    """``torch.optim.AdamW(..., fused=True)`` with the class name changed works (the fused
    kernel is what runs; ``foreach=False`` too); a flag asking for another kernel, a
    capturable or a differentiable step is refused, naming it and the way out: in the
    constructor, and in a group added later (which stepped, silently not differentiable,
    before), leaving the groups as they were."""
    params = make_params()
    taken = OffloadAdamW(params[:1], fused=True, foreach=False, capturable=False)
    assert taken.param_groups[0]["fused"] is True
    with pytest.raises(ValueError, match=rf"so {flag}={value} cannot be honoured.*enabled=False"):
        OffloadAdamW(params, **{flag: value})
    message = rf"so {flag}={value} in param group 1 cannot be honoured.*enabled=False"
    with pytest.raises(ValueError, match=message):
        taken.add_param_group({"params": params[1:], flag: value})
    assert len(taken.param_groups) == 1
    taken.add_param_group({"params": params[1:], "fused": True, "foreach": False})
    assert taken.param_groups[1]["fused"] is True
    taken_list = "foreach=False, capturable=False, differentiable=False, fused=True are taken"
    with pytest.raises(ValueError, match=rf"so fused=1 cannot be honoured.*\({taken_list}\)"):
        OffloadAdamW(params, fused=1)  # a flag is a bool or None: 1 is not True
    with pytest.raises(AttributeError, match="follows its gradients' dtypes"):
        taken._step_supports_amp_scaling = True  # torch's constructor sets it for fused=True


def test_disabled_add_param_group_takes_what_torch_adamw_takes():
    """Disabled, ``add_param_group`` is torch's, which checks no hyperparameters (its
    constructor does): a group with a negative weight decay, which an enabled OffloadAdamW
    refuses, is taken and stepped as torch.optim.AdamW steps it."""
    first, second = make_params([(5,), (13, 17)])
    reference = clone_params([first, second])
    offload = OffloadAdamW([first], lr=0.05, enabled=False)
    torch_opt = torch.optim.AdamW(reference[:1], lr=0.05)
    offload.add_param_group({"params": [second], "weight_decay": -0.1})
    torch_opt.add_param_group({"params": [reference[1]], "weight_decay": -0.1})
    generator = torch.Generator().manual_seed(7)
    step_together([offload, torch_opt], [[first, second], reference], generator, 3)
    assert_same([first, second], reference)
    with pytest.raises(ValueError, match=r"param group 1 has weight_decay=-0\.1"):
        OffloadAdamW([first]).add_param_group({"params": [second], "weight_decay": -0.1})


@pytest.mark.parametrize("enabled", [True, False])
def test_step_hooks_run_once_a_step_as_in_torch(enabled):
    """Per-optimizer and global step pre/post hooks run once per step, around the update, as
    for torch.optim.AdamW (a disabled step calls torch's AdamW.step, which torch wraps with the
    same hooks once any AdamW has been built, as here)."""
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, enabled=enabled)
    torch_opt = torch.optim.AdamW(reference)
    calls: dict[str, list[str]] = {"offload": [], "torch": []}

    def record(name: str):
        def hook(opt, *args):
            calls["offload" if opt is offload else "torch"].append(name)

        return hook

    handles = [
        register_optimizer_step_pre_hook(record("global pre")),
        register_optimizer_step_post_hook(record("global post")),
    ]
    for opt in (offload, torch_opt):
        handles += [opt.register_step_pre_hook(record("pre"))]
        handles += [opt.register_step_post_hook(record("post"))]
    try:
        step_together(
            [offload, torch_opt], [params, reference], torch.Generator().manual_seed(3), 2
        )
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls["torch"]) == 8  # each of the four hooks once a step
    assert calls["offload"] == calls["torch"]  # and in torch's order


def test_memory_efficient_adamw_keeps_the_original_positional_signature():
    from lightning_offload_optim import MemoryEfficientAdamW

    params = make_params()
    reference = clone_params(params)
    legacy = MemoryEfficientAdamW(params, 0.01, (0.8, 0.99), 1e-6, 0.2, True, False, True)
    assert isinstance(legacy, OffloadAdamW) and isinstance(legacy, torch.optim.AdamW)
    assert legacy.pin_memory is False and legacy.enabled
    torch_opt = torch.optim.AdamW(reference, 0.01, (0.8, 0.99), 1e-6, 0.2, True, fused=True)
    generator = torch.Generator().manual_seed(7)
    step_together([legacy, torch_opt], [params, reference], generator, 3)
    assert_same(params, reference)


def test_memory_efficient_adamw_passes_the_keyword_settings_on():
    """The legacy name takes OffloadAdamW's keyword-only settings too (``maximize``,
    ``chunk_size``, ``force_staging``, ``resident``): each takes effect, none is dropped."""
    from lightning_offload_optim import MemoryEfficientAdamW

    params = make_params()
    reference = clone_params(params)
    legacy = MemoryEfficientAdamW(
        params, 0.01, maximize=True, chunk_size=128, force_staging=True, resident=0.5
    )
    assert (legacy.chunk_size, legacy.force_staging, legacy.resident) == (128, True, 0.5)
    assert legacy.param_groups[0]["maximize"] is True
    torch_opt = torch.optim.AdamW(reference, 0.01, maximize=True, fused=True)
    generator = torch.Generator().manual_seed(7)
    step_together([legacy, torch_opt], [params, reference], generator, 3)
    assert_same(params, reference)


def test_memory_efficient_adamw_passes_pin_memory_and_enabled_on():
    """The legacy name's last two positional arguments reach OffloadAdamW as given: with an
    accelerator present, ``pin_memory=False`` is not taken for the default (pin), and
    ``enabled=False`` gives a disabled optimizer."""
    from lightning_offload_optim import MemoryEfficientAdamW

    args = (0.01, (0.9, 0.999), 1e-8, 0.01, False)
    with accelerator_seen():  # where None would pin
        assert MemoryEfficientAdamW(make_params(), *args, False).pin_memory is False
        assert MemoryEfficientAdamW(make_params(), *args, None).pin_memory is True
    assert MemoryEfficientAdamW(make_params(), *args, None, False).enabled is False


def test_grad_scaler_steps_without_closure_and_skips_non_finite_steps():
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01)
    torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1) for _ in range(2)]
    for scaler in scalers:
        scaler.scale(torch.ones(()))  # initialises the scale, as scaling a loss would
    generator = torch.Generator().manual_seed(8)
    for step in range(5):
        set_grads([params, reference], generator)
        scale = scalers[0].get_scale()
        for ps in (params, reference):
            for p in ps:
                p.grad *= scale  # as if the loss had been scaled
            if step == 2:
                ps[1].grad[0] = float("inf")
        before = offload.offloaded_state(params[0])
        for scaler, opt in zip(scalers, (offload, torch_opt), strict=True):
            scaler.step(opt)
            scaler.update()
        if step == 2:  # skipped: state and parameters untouched
            after = offload.offloaded_state(params[0])
            assert_same(list(after.values()), list(before.values()))
    assert_same(params, reference)
    assert_same(
        [offload.state[p]["step"] for p in params], [torch_opt.state[r]["step"] for r in reference]
    )


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_grad_scaler_unscales_fp16_gradients_in_the_kernel_as_for_torch_fused(mode):
    """fp16 parameters (an fp32 master copy each) under GradScaler, as in plain PyTorch fp16
    training: its unscale_ refuses fp16 gradients, so, as for torch's fused AdamW, it leaves the
    scale (not a power of two here) to the kernel, which divides the gradients in place and
    skips a step with inf gradients. The reference: torch's fused AdamW on fp32 masters given
    the same scale; the gradients are left unscaled by both."""
    params = make_params(dtype=torch.float16)
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, **mode)
    masters = MasterCopyAdamW([{"params": reference}], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=1000)
    scaler.scale(torch.ones(()))  # initialises the scale, as scaling a loss would
    generator = torch.Generator().manual_seed(9)
    for step in range(4):
        set_grads([params, reference], generator)
        if step == 2:
            for p in (params[1], reference[1]):
                p.grad[0] = float("inf")
        assert offload._step_supports_amp_scaling
        masters.fp32.grad_scale = torch.tensor(scaler.get_scale())
        scaler.step(offload)
        if step != 2:  # skipped for inf, as GradScaler with torch's fused AdamW skips it
            masters.step()
        scaler.update()
    assert scaler.get_scale() == 500.0
    assert_same(params, reference)
    assert_same([p.grad for p in params], [masters.masters[r].grad.half() for r in reference])
    assert [float(offload.state[p]["step"]) for p in params] == [3.0] * len(params)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_grad_scaler_unscales_gradients_laid_out_unlike_their_parameters_in_place(mode):
    """A gradient laid out unlike its parameter (set by hand, or from ``autograd.grad``) is
    updated as a contiguous copy; GradScaler's callers read ``p.grad`` unscaled after the step,
    so the unscaled copy goes back into it (once whole, for a parameter split across chunks in
    staged-64). fp32 parameters beside fp16 ones are unscaled by the kernel too. Reference:
    torch's fused AdamW (on fp32 masters for fp16) given the gradients laid out like the
    parameters, which it reads right."""
    generator = torch.Generator().manual_seed(3)

    def permuted(dtype: torch.dtype) -> list[torch.nn.Parameter]:
        conv = torch.randn(4, 3, 3, 3, generator=generator).to(dtype)
        wide = torch.randn(20, 7, generator=generator).to(dtype)
        return [
            torch.nn.Parameter(conv.contiguous(memory_format=torch.channels_last)),
            torch.nn.Parameter(wide.t()),
        ]

    halves, singles = permuted(torch.float16), permuted(torch.float32)
    ref_halves, ref_singles = clone_params(halves), clone_params(singles)
    params, reference = [*halves, *singles], [*ref_halves, *ref_singles]
    offload = OffloadAdamW(params, lr=0.01, **mode)
    masters = MasterCopyAdamW([{"params": ref_halves}], lr=0.01)
    fp32 = torch.optim.AdamW(ref_singles, lr=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=1000)
    scaler.scale(torch.ones(()))
    for _ in range(3):
        for p, r in zip(params, reference, strict=True):
            p.grad = (torch.randn(p.shape, generator=generator) * 1000.0).to(p.dtype)
            r.grad = torch.empty_like(r).copy_(p.grad)  # laid out like the parameter
            assert p.grad.stride() != p.stride() and r.grad.stride() == r.stride()
        masters.fp32.grad_scale = fp32.grad_scale = torch.tensor(scaler.get_scale())
        scaler.step(offload)
        scaler.update()
        masters.step()
        fp32.step()
        assert_same(params, reference)
        unscaled = [masters.masters[r].grad.half() for r in ref_halves]
        assert_same([p.grad for p in params], [*unscaled, *(r.grad for r in ref_singles)])
        assert 0.5 < max(float(p.grad.abs().max()) for p in params) < 10.0  # not 1000x


def test_grad_scaler_unscales_fp32_and_bf16_gradients_itself():
    """Where GradScaler.unscale_ takes the gradients (no fp16 among them) it unscales them, so
    that Lightning can clip them (it refuses to clip for an optimizer that unscales itself)."""
    params = [*make_params(dtype=torch.float32), *make_params(dtype=torch.bfloat16)]
    offload = OffloadAdamW(params)
    assert not offload._step_supports_amp_scaling
    set_grads([params], torch.Generator().manual_seed(10))
    assert not offload._step_supports_amp_scaling
    params.append(torch.nn.Parameter(torch.ones(3, dtype=torch.float16)))
    offload.add_param_group({"params": params[-1:]})
    assert not offload._step_supports_amp_scaling  # no gradient yet
    params[-1].grad = torch.ones(3, dtype=torch.float16)
    assert offload._step_supports_amp_scaling
    assert not OffloadAdamW(params, enabled=False)._step_supports_amp_scaling


def trained_bf16_pair(mode: dict, seed: int, steps: int) -> tuple:
    """bf16 parameters stepped ``steps`` times by OffloadAdamW (``mode``) and by the exact
    reference (MasterCopyAdamW over copies) alike: params, reference, both optimizers and the
    generator of their gradients, to go on with."""
    params = make_params(dtype=torch.bfloat16)
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=1e-2, **mode)
    masters = MasterCopyAdamW([{"params": reference}], lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    step_together([offload, masters], [params, reference], generator, steps)
    return params, reference, offload, masters, generator


EDITS = {
    "clamp": lambda p: p.clamp_(-0.5, 0.5),  # WGAN-style clipping after each step
    "load": lambda p: p.copy_(p * -2.0 + 0.25),  # other weights loaded into the model
    "replace": lambda p: setattr(p, "data", p.data * -2.0 + 0.25),  # new memory, new counter
}


@pytest.mark.parametrize(
    "mode",
    [*MODES.values(), {"force_staging": True, "resident": 0.5}],
    ids=[*MODES.keys(), "resident-half"],
)
@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_low_precision_parameters_edited_between_steps_keep_the_edits(mode, edit):
    """An edit of a bf16 parameter between steps reaches its fp32 master copy at the next step
    (before, the master overwrote it), element by element: where the parameter no longer
    equals its rounded master, the master takes its value; elsewhere (also an element clamped
    that already rounded to the bound) the master keeps its extra precision."""
    params, reference, offload, masters, generator = trained_bf16_pair(mode, 5, 3)
    with torch.no_grad():
        for p, r in zip(params[:2], reference[:2], strict=True):
            edit(p)
            edit(r)
    masters.take_edits()
    step_together([offload, masters], [params, reference], generator, 2)
    assert_same(params, reference)
    for p, r in zip(params, reference, strict=True):
        assert_same([offload.offloaded_state(p)["master_param"]], [masters.masters[r]])


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_an_edited_parameter_of_a_later_group_in_a_shared_chunk_keeps_its_edit(mode):
    """Parameters of two param groups in one chunk: the kernel call of the second group takes
    the edit of its own edited parameter (not of the one at that place in the chunk)."""
    params = make_params(dtype=torch.bfloat16)
    reference = clone_params(params)

    def groups(ps: list[torch.nn.Parameter]) -> list[dict]:
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2, "weight_decay": 0.0}]

    offload = OffloadAdamW(groups(params), lr=1e-2, **mode)
    masters = MasterCopyAdamW(groups(reference), lr=1e-2)
    generator = torch.Generator().manual_seed(12)
    step_together([offload, masters], [params, reference], generator, 3)
    with torch.no_grad():
        for p in (params[3], reference[3]):
            EDITS["load"](p)
    masters.take_edits()
    step_together([offload, masters], [params, reference], generator, 2)
    assert_same(params, reference)


def test_master_copies_are_compared_only_for_parameters_written_since_the_last_step(monkeypatch):
    """Edits are found by the parameters' version counters: a step after which nobody wrote a
    parameter runs no comparison (an extra kernel per parameter and step); one after an edit
    compares that parameter only."""
    from lightning_offload_optim import adamw as adamw_module

    compared = []
    real = adamw_module.take_edits
    monkeypatch.setattr(
        adamw_module, "take_edits", lambda m, p: (compared.extend(p), real(m, p))[1]
    )
    params = make_params(dtype=torch.bfloat16)
    offload = OffloadAdamW(params, lr=1e-2, force_staging=True, chunk_size=64)
    generator = torch.Generator().manual_seed(8)
    step_together([offload], [params], generator, 3)
    assert compared == []
    with torch.no_grad():
        params[1].mul_(0.5)
    step_together([offload], [params], generator, 2)
    assert sum(t.numel() for t in compared) == params[1].numel()  # in 64-element chunks


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("how", ["load_state_dict", "into_state_dict"])
def test_loading_the_optimizer_state_alone_changes_no_weight(mode, how):
    """As with torch's AdamW, a load of the optimizer's state leaves the model's weights as they
    are: loaded master copies (here from two steps back) that no longer round to the weights
    take their values, element by element, at the next step. Also when written into the
    tensors ``state_dict()`` returns, as a distributed checkpoint loads in place."""
    params, reference, offload, masters, generator = trained_bf16_pair(mode, 7, 2)
    saved = copy.deepcopy(offload.state_dict())
    saved_fp32 = copy.deepcopy(masters.fp32.state_dict())
    saved_masters = {r: m.clone() for r, m in masters.masters.items()}
    step_together([offload, masters], [params, reference], generator, 2)
    if how == "load_state_dict":
        offload.load_state_dict(saved)
    else:
        for index, entry in offload.state_dict()["state"].items():
            for key, value in entry.items():
                value.copy_(saved["state"][index][key])
    masters.fp32.load_state_dict(saved_fp32)
    with torch.no_grad():
        for r, master in masters.masters.items():
            master.copy_(saved_masters[r])
    masters.take_edits()
    step_together([offload, masters], [params, reference], generator, 2)
    assert_same(params, reference)
    for p, r in zip(params, reference, strict=True):
        assert_same([offload.offloaded_state(p)["master_param"]], [masters.masters[r]])


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_model_weights_loaded_after_the_optimizer_state_keep_the_masters_precision(mode):
    """A resume that loads the optimizer's state first and the model's weights after (each
    write counts as an edit) continues exactly as the uninterrupted run: the weights round
    from the loaded master copies, which keep their extra precision."""
    params, reference, offload, masters, generator = trained_bf16_pair(mode, 6, 3)
    saved_state, saved_weights = copy.deepcopy(offload.state_dict()), clone_params(params)
    resumed = make_params(dtype=torch.bfloat16, seed=9)  # other weights until the load
    offload = OffloadAdamW(resumed, lr=1e-2, **mode)
    offload.load_state_dict(saved_state)
    with torch.no_grad():
        for p, saved in zip(resumed, saved_weights, strict=True):
            p.copy_(saved)
    step_together([offload, masters], [resumed, reference], generator, 2)
    assert_same(resumed, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_fp32_and_bf16_parameters_in_one_optimizer(mode):
    """Two arenas share the staging buffers of one device; each chunk uses only its own keys."""
    fp32 = make_params([(300, 7), (1000,)])
    bf16 = make_params([(40, 30), (17,)], dtype=torch.bfloat16, seed=1)
    fp32_reference = clone_params(fp32)
    bf16_reference = clone_params(bf16)
    offload = OffloadAdamW([*fp32, *bf16], lr=0.01, **mode)
    torch_fp32 = torch.optim.AdamW(fp32_reference, lr=0.01, fused=True)
    torch_masters = MasterCopyAdamW([{"params": bf16_reference}], lr=0.01)
    generator = torch.Generator().manual_seed(9)
    for _ in range(4):
        set_grads([fp32, fp32_reference], generator)
        set_grads([bf16, bf16_reference], generator)
        for opt in (offload, torch_fp32, torch_masters):
            opt.step()
    assert_same(fp32, fp32_reference)
    assert_same(bf16, bf16_reference)


def test_step_counts_are_float32_whatever_the_default_dtype():
    """The CUDA fused kernel reads step counts as float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        params, reference, offload, _ = run_side_by_side({}, MODES["direct"], steps=2)
    finally:
        torch.set_default_dtype(previous)
    assert all(offload.state[p]["step"].dtype == torch.float32 for p in params)
    assert_same(params, reference)


#: With all state resident on the device (chosen at the second step), the resident copy must
#: follow the new memory order too.
STRIDE_MODES = {
    **MODES,
    "staged-resident": {"force_staging": True, "chunk_size": 64, "resident": 1.0},
}


@pytest.mark.parametrize("mode", STRIDE_MODES.values(), ids=STRIDE_MODES.keys())
def test_stride_change_after_the_first_step_is_followed(mode):
    """``model.to(memory_format=torch.channels_last)`` after steps: torch's AdamW keeps going;
    so does OffloadAdamW, reordering the state to the new memory order. The reference is torch
    fused AdamW whose state is converted the same way (its kernel reads state in memory order)."""
    params = make_params([(8, 3, 5, 5), (6, 2, 3, 3), (40,)])
    reference = clone_params(params)
    offload = OffloadAdamW(params, weight_decay=0.1, amsgrad=True, **mode)
    torch_opt = torch.optim.AdamW(reference, weight_decay=0.1, amsgrad=True, fused=True)
    generator = torch.Generator().manual_seed(10)
    step_together([offload, torch_opt], [params, reference], generator, 2)
    for p, r in zip(params[:2], reference[:2], strict=True):
        p.data = p.data.contiguous(memory_format=torch.channels_last)
        r.data = r.data.contiguous(memory_format=torch.channels_last)
        for key, value in torch_opt.state[r].items():
            if key != "step":
                torch_opt.state[r][key] = value.contiguous(memory_format=torch.channels_last)
    for _ in range(3):
        set_grads([params, reference], generator)
        for ps in (params, reference):
            for p in ps[:2]:
                p.grad = p.grad.contiguous(memory_format=torch.channels_last)
        offload.step()
        torch_opt.step()
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)
    assert offload.state_dict()["state"][0]["exp_avg"].is_contiguous(
        memory_format=torch.channels_last
    )


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("how", ["data", "swap_tensors"])
def test_parameter_storage_replaced_with_the_same_shape(mode, how):
    """``p.data = new`` or ``module.load_state_dict(..., assign=True)`` with swapped tensors: the
    update must write the parameter's new storage, not a cached view of the old one."""
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, **mode)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(11)
    step_together([offload, torch_opt], [params, reference], generator, 2)
    for p, r in zip(params, reference, strict=True):
        new = torch.randn(p.shape, generator=generator)
        if how == "data":
            p.data = new.clone()
        else:
            torch.utils.swap_tensors(p, torch.nn.Parameter(new.clone()))
        r.data = new.clone()
    step_together([offload, torch_opt], [params, reference], generator, 2)
    assert_same(params, reference)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_complex32_parameters_step_on_fp32_masters_of_their_real_pairs(mode):
    """complex32 (pairs of fp16) is low precision like fp16: fp32 moments and an fp32 master
    copy, so it steps exactly as fused AdamW on fp32 copies of its real view, rounded."""
    params = [
        torch.nn.Parameter(p.detach().to(torch.complex32))
        for p in make_params([(40, 3), (7,)], dtype=torch.complex64)
    ]
    real_reference = [torch.nn.Parameter(torch.view_as_real(p.detach()).clone()) for p in params]
    offload = OffloadAdamW(params, lr=1e-2, **mode)
    masters = MasterCopyAdamW([{"params": real_reference}], lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p, r in zip(params, real_reference, strict=True):
            p.grad = torch.randn(p.shape, dtype=torch.complex64, generator=generator).to(p.dtype)
            r.grad = torch.view_as_real(p.grad).clone()
        offload.step()
        masters.step()
    assert_same([torch.view_as_real(p) for p in params], real_reference)
    assert offload.memory_stats()["state_bytes"] == sum(3 * 4 * 2 * p.numel() for p in params)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_complex_parameters_after_odd_real_ones_save_and_reload(mode):
    """A complex64 state slot after 3 fp32 elements would start at an odd offset, which cannot be
    viewed as complex: state_dict() raised. Complex parameters have arenas of their own."""
    real = make_params([(3,), (7,)], seed=2)
    complex_params = make_params([(5,), (2, 3)], dtype=torch.complex64, seed=3)
    params = [real[0], complex_params[0], real[1], complex_params[1]]
    reference = clone_params(params)
    offload = OffloadAdamW(params, amsgrad=True, **mode)
    torch_opt = torch.optim.AdamW(reference, amsgrad=True)
    generator = torch.Generator().manual_seed(12)
    step_together([offload, torch_opt], [params, reference], generator, 3)
    saved = offload.state_dict()
    for index in (1, 3):
        assert saved["state"][index]["exp_avg"].dtype == torch.complex64
        torch.testing.assert_close(
            saved["state"][index]["exp_avg_sq"], torch_opt.state[reference[index]]["exp_avg_sq"]
        )
    resumed = OffloadAdamW(params, amsgrad=True, **mode)
    resumed.load_state_dict(copy.deepcopy(saved))
    for p in params:
        state = resumed.offloaded_state(p)
        assert_same(list(state.values()), list(offload.offloaded_state(p).values()))
    step_together([resumed, torch_opt], [params, reference], generator, 2)
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


def test_varying_sets_of_active_parameters_keep_the_plan_cache_bounded():
    """Mixture-of-experts experts without tokens, conditional branches: a different set of
    parameters has gradients each step. Plans are cached, within a bound, and stay correct."""
    from lightning_offload_optim.adamw import PLAN_CACHE_SIZE

    shapes = [(64,)] * 10
    params = make_params(shapes)
    reference = clone_params(params)
    offload = OffloadAdamW(params, force_staging=True, chunk_size=128)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(13)
    for step in range(40):
        step_together(
            [offload, torch_opt],
            [params, reference],
            generator,
            1,
            skip=lambda i, s=step: bool((s >> (i % 6)) & 1),  # the bits of the step number
        )
        assert len(offload._plans) <= PLAN_CACHE_SIZE
    assert len(offload._plans) == PLAN_CACHE_SIZE
    assert_same(params, reference)
    assert_state_equal(offload, torch_opt, params, reference)


@pytest.mark.parametrize("force_staging", [False, True])
def test_a_parameter_given_new_memory_of_the_same_layout_is_updated_there(force_staging):
    """``param.data = ...`` (``Module.to``, ``load_state_dict(assign=True)``) gives the parameter
    new memory of the same shape, strides and dtype: the step updates the new memory, not a
    cached view of the old one."""
    params = make_params()
    reference = clone_params(params)
    opt = OffloadAdamW(params, force_staging=force_staging, chunk_size=64)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(0)
    step_together([opt, torch_opt], [params, reference], generator, 1)
    for p in (*params, *reference):
        p.data = p.data.clone()
    step_together([opt, torch_opt], [params, reference], generator, 2)
    assert_same(params, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "settings",
    [{}, {"force_staging": True, "chunk_size": 64}, {"force_staging": True, "resident": 0.5}],
    ids=["host", "staged", "resident"],
)
def test_state_stays_on_the_host_whatever_the_default_device(settings, dtype):
    """``torch.set_default_device("cuda")`` (or ``with torch.device(...)``) must not move the
    host state or the step counts off the host: every allocation names its device. The
    ``meta`` device stands in for a GPU here (a tensor made there holds no data). The steps,
    a save and a load under it match torch AdamW, whose state follows the parameters."""
    params = make_params(dtype=dtype)
    reference = clone_params(params)
    ours = OffloadAdamW(params, lr=0.01, **settings)
    theirs = exact_reference(reference, lr=0.01)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        set_grads([params, reference], generator)
        with torch.device("meta"):
            ours.step()
            saved = ours.state_dict()
            ours.load_state_dict(saved)
        theirs.step()
    assert_same(params, reference)
    assert_state_offloaded(ours, params)
    assert {v.device.type for s in ours.state_dict()["state"].values() for v in s.values()} == {
        "cpu"
    }


@pytest.mark.parametrize(
    "settings",
    [{}, {"force_staging": True, "chunk_size": 64}, {"force_staging": True, "resident": 0.5}],
    ids=["host", "staged", "resident"],
)
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_steps_inside_inference_mode_leave_buffers_usable_outside(settings, overlap):
    """torch AdamW steps inside ``torch.inference_mode()``: the buffers made there (host state,
    staging, step counts) must not be inference tensors, which nothing outside may write (the
    next forward's prefetch, a save of resident state, a load). Alternating in and out, with a
    save and a load outside, it trains as torch AdamW does."""
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(12, 4), torch.nn.Linear(12, 4)
    twin.load_state_dict(model.state_dict())
    ours = OffloadAdamW(model.parameters(), lr=0.01, **settings)
    if overlap:
        ours.overlap_with(model)
    theirs = torch.optim.AdamW(twin.parameters(), lr=0.01, fused=True)
    inputs = torch.randn(4, 6, 12, generator=torch.Generator().manual_seed(1))
    for i, x in enumerate(inputs):
        for net, optimizer in ((model, ours), (twin, theirs)):
            net(x).pow(2).mean().backward()
            with torch.inference_mode(i % 2 == 0):
                optimizer.step()
            optimizer.zero_grad()
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    if overlap:
        ours.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))


RESIDENT = {"force_staging": True, "resident": 1.0}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize(
    "settings",
    [{}, {"force_staging": True}, {"force_staging": True, "chunk_size": 64}, RESIDENT],
    ids=["direct", "staged", "staged-64", "resident"],
)
def test_a_step_count_tensor_written_into_several_entries_counts_for_each(settings, overlap):
    """One tensor written into every entry's ``step`` (a bias-correction reset by hand,
    ``zero = torch.tensor(0.0)``): each entry counts its own steps from it, as torch's AdamW
    given a tensor per entry does, in every mode, over two param groups, with a parameter left
    without a gradient at one step, and loaded from a state dict holding one such tensor.
    (torch's AdamW given the one tensor advances it once per parameter holding it, group by
    group, so its bias correction runs ahead: docs/exactness.md.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    twin = copy.deepcopy(model)

    def groups(net: torch.nn.Module) -> list[dict]:
        return [
            {"params": [net[0].weight, net[1].weight]},
            {"params": [net[0].bias, net[1].bias], "weight_decay": 0.0},
        ]

    ours = OffloadAdamW(groups(model), lr=0.05, **settings)
    if overlap:
        ours.overlap_with(model)
    theirs = torch.optim.AdamW(groups(twin), lr=0.05, fused=True)
    inputs = torch.randn(6, 4, 6, generator=torch.Generator().manual_seed(1))

    def train(batches: torch.Tensor) -> list[float]:
        for i, x in enumerate(batches):
            for net, optimizer in ((model, ours), (twin, theirs)):
                net(x).pow(2).mean().backward()
                if i == 0:
                    net[1].bias.grad = None  # not stepped: its count stays
                optimizer.step()
                optimizer.zero_grad()
        ours.wait_for_updates()
        assert_same(list(model.parameters()), list(twin.parameters()))
        steps = [float(ours.state[p]["step"]) for p in model.parameters()]
        assert steps == [float(theirs.state[p]["step"]) for p in twin.parameters()]
        return steps

    train(inputs[:2])
    zero = torch.tensor(0.0)
    for entry in ours.state.values():
        entry["step"] = zero
    for entry in theirs.state.values():
        entry["step"] = torch.tensor(0.0)
    assert train(inputs[2:4]) == [2.0, 2.0, 2.0, 1.0]  # weight, bias, weight, bias
    saved, twins = copy.deepcopy(ours.state_dict()), copy.deepcopy(theirs.state_dict())
    shared = torch.tensor(7.0)
    for entry in saved["state"].values():
        entry["step"] = shared
    for entry in twins["state"].values():
        entry["step"] = torch.tensor(7.0)
    ours.load_state_dict(saved)
    theirs.load_state_dict(twins)
    assert train(inputs[4:]) == [9.0, 9.0, 9.0, 8.0]


@pytest.mark.parametrize("pooled", [False, True], ids=["own-staging", "one-pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_optimizer_per_parameter_stepped_in_backward_matches_torch(dtype, pooled):
    """Exact against torch's fused AdamW (on fp32 master copies for bf16) stepped the same way,
    the tied weight stepped once per backward. The staging the optimizers hold together is
    their state's size at most (one set each), not twice it; through one StagingPool, two sets
    of the largest chunk in all (256 elements here: the embedding takes four chunks)."""
    ours, theirs = TiedNet(dtype), TiedNet(dtype)
    pool, chunk = (StagingPool(), 256) if pooled else (None, DEFAULT_CHUNK_SIZE)
    offload = step_in_backward(
        ours,
        lambda p: OffloadAdamW(
            [p], lr=0.01, force_staging=True, chunk_size=chunk, staging_pool=pool
        ),
    )
    if dtype == torch.float32:
        reference = step_in_backward(theirs, lambda p: torch.optim.AdamW([p], lr=0.01, fused=True))
    else:
        reference = step_in_backward(theirs, lambda p: MasterCopyAdamW([{"params": [p]}], lr=0.01))
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        tokens = torch.randint(50, (4, 6), generator=generator)
        ours(tokens).backward()
        theirs(tokens).backward()
    assert_same(list(ours.parameters()), list(theirs.parameters()))
    for param, twin in zip(ours.parameters(), theirs.parameters(), strict=True):
        state = offload[param].offloaded_state(param)
        expected = reference[twin].state[twin]
        if dtype == torch.bfloat16:
            expected = reference[twin].fp32.state[reference[twin].masters[twin]]
        assert torch.equal(state["exp_avg_sq"], expected["exp_avg_sq"])
        assert float(offload[param].state[param]["step"]) == 4
    stats = [o.memory_stats() for o in offload.values()]
    if pooled:  # fp32 moments, and for bf16 the master copy and the gradient scratch
        keys = 2 if dtype == torch.float32 else 4
        assert pool.staging_bytes == 2 * chunk * 4 * keys
        assert all(s["staging_bytes"] == pool.staging_bytes for s in stats)
        return
    scratch = 4 * sum(p.numel() for p in ours.parameters()) if dtype == torch.bfloat16 else 0
    assert sum(s["staging_bytes"] for s in stats) == sum(s["state_bytes"] for s in stats) + scratch


def test_optimizers_of_one_pool_overlapped_with_their_models_match_torch():
    """Two optimizers of one StagingPool, each overlapped with its own model: each forward
    queues its optimizer's next copies into the pool's next sets, the second model's over the
    first's, so the first optimizer's step must load its chunks again rather than update the
    other's state. Then one of them frees the pool's staging, and both step on alike."""
    pool = StagingPool()
    models = [torch.nn.Linear(8, 8) for _ in range(2)]
    twins = copy.deepcopy(models)
    optimizers = [
        OffloadAdamW(m.parameters(), lr=0.01, force_staging=True, staging_pool=pool) for m in models
    ]
    for model, opt in zip(models, optimizers, strict=True):
        opt.overlap_with(model)
    references = [torch.optim.AdamW(t.parameters(), lr=0.01, fused=True) for t in twins]
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 3:
            optimizers[1].release_device_memory()
            assert pool.staging_bytes == 0
        x = torch.randn(4, 8, generator=generator)
        for nets, opts in ((models, optimizers), (twins, references)):
            sum(net(x).square().sum() for net in nets).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    for model, twin, opt in zip(models, twins, optimizers, strict=True):
        opt.wait_for_updates()
        assert_same(list(model.parameters()), list(twin.parameters()))


@pytest.mark.no_stream_check  # the checker's dispatch mode is the main thread's only
def test_a_release_from_another_thread_waits_for_a_step_of_the_pool():
    """Autograd runs each device's backward hooks in a thread of its own: another optimizer of
    the pool freeing its buffers (``release_device_memory``) between a step's allocations and
    its update failed that update partway. The update prepares them again under the pool's
    lock, which a release waits for."""
    pool = StagingPool()
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    twin = copy.deepcopy(models[0])
    stepping, releasing = (
        OffloadAdamW(m.parameters(), lr=0.01, force_staging=True, staging_pool=pool) for m in models
    )
    reference = torch.optim.AdamW(twin.parameters(), lr=0.01, fused=True)
    prepared = threading.Event()
    real_copies = stepping._steps_on_devices

    def copies_later(*args, **kwargs):  # after the step's prepare(), before its update
        prepared.set()
        time.sleep(0.2)  # the other thread's release comes now
        return real_copies(*args, **kwargs)

    stepping._steps_on_devices = copies_later
    for net in (models[0], twin):
        net(torch.ones(2, 4)).sum().backward()
    errors = []
    thread = threading.Thread(target=lambda: _record_errors(stepping.step, errors))
    thread.start()
    prepared.wait(5)
    releasing.release_device_memory()
    thread.join()
    assert errors == []
    reference.step()
    assert_same(list(models[0].parameters()), list(twin.parameters()))


def _record_errors(call: Callable[[], Any], errors: list[BaseException]) -> None:
    try:
        call()
    except BaseException as error:
        errors.append(error)


@pytest.mark.parametrize("copier", ["deepcopy", "torch.save"])
def test_optimizers_of_one_pool_copied_together_share_a_new_pool(copier, tmp_path):
    """Deep-copied or saved and loaded together (a dict of per-parameter optimizers, as one
    object), optimizers of one pool share one new, empty pool, and step on as the originals."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    pool = StagingPool()
    optimizers = {
        name: OffloadAdamW([p], force_staging=True, staging_pool=pool)
        for name, p in model.named_parameters()
    }
    generator = torch.Generator().manual_seed(0)

    def train(net: torch.nn.Module, opts: dict[str, OffloadAdamW]) -> None:
        net(torch.randn(4, 8, generator=generator)).sum().backward()
        for opt in opts.values():
            opt.step()
            opt.zero_grad()

    train(model, optimizers)
    if copier == "deepcopy":
        copied_model, copied = copy.deepcopy((model, optimizers))
    else:
        torch.save((model, optimizers), tmp_path / "both.pt")
        copied_model, copied = torch.load(tmp_path / "both.pt", weights_only=False)
    pools = {id(opt.staging_pool) for opt in copied.values()}
    assert len(pools) == 1 and next(iter(copied.values())).staging_pool is not pool
    assert next(iter(copied.values())).staging_pool.staging_bytes == 0
    for _ in range(2):
        state = generator.get_state()
        train(model, optimizers)
        generator.set_state(state)
        train(copied_model, copied)
    assert_same(list(model.parameters()), list(copied_model.parameters()))
