"""Bad input: a clear error naming the problem, and nothing modified."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import (
    assert_same,
    clone_params,
    fail_on_call,
    make_params,
    set_grads,
    step_together,
)

from lightning_offload_optim import OffloadAdamW, StagingPool
from lightning_offload_optim import pipeline as pipeline_module


def trained(steps: int = 2, dtype: torch.dtype = torch.float32, **kwargs):
    params = make_params(dtype=dtype)
    opt = OffloadAdamW(params, **kwargs)
    generator = torch.Generator().manual_seed(0)
    step_together([opt], [params], generator, steps)
    set_grads([params], generator)
    return opt, params


def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_steps_on_like_torch(opt, params, before) -> None:
    """The optimizer still works, and exactly: its next step equals torch fused AdamW's from
    the snapshot taken before the failure, on the same gradients."""
    saved_params, saved_state = before
    reference = [torch.nn.Parameter(p.clone()) for p in saved_params]
    torch_opt = torch.optim.AdamW(reference, fused=True)
    torch_opt.load_state_dict(copy.deepcopy(saved_state))
    for p, r in zip(params, reference, strict=True):
        r.grad = None if p.grad is None else p.grad.clone()
    opt.step()
    torch_opt.step()
    assert_same(params, reference)


def assert_unchanged(opt, params, before):
    saved_params, saved_state = before
    assert_same(params, saved_params)
    now = opt.state_dict()
    assert len(now["param_groups"]) == len(saved_state["param_groups"])
    for group, saved in zip(now["param_groups"], saved_state["param_groups"], strict=True):
        assert group.keys() == saved.keys()
        for key, value in group.items():  # lr may be a tensor of any shape (refused)
            if torch.is_tensor(value):
                assert torch.equal(value, saved[key]), key
            else:
                assert value is saved[key] or value == saved[key], key  # nan is nan
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


@pytest.mark.parametrize(
    ("num_buffers", "error", "message"),
    [
        (0, ValueError, "num_buffers must be at least 1, got 0"),
        (2.0, TypeError, "num_buffers must be an int, got 2.0"),
        (True, TypeError, "num_buffers must be an int, got True"),
    ],
)
def test_a_staging_pool_needs_a_positive_int_of_buffers(num_buffers, error, message):
    with pytest.raises(error, match=message):
        StagingPool(num_buffers)


def test_chunk_size_must_be_an_int():
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        OffloadAdamW(make_params(), chunk_size=1e6)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"enabled": "false"}, TypeError, "enabled must be a bool, got 'false'"),  # bool() is True
        ({"force_staging": 1}, TypeError, "force_staging must be a bool, got 1"),
        ({"enabled": None}, TypeError, "enabled must be a bool, got None"),  # pin_memory's "auto"
        ({"force_staging": None}, TypeError, "force_staging must be a bool, got None"),
        ({"pin_memory": "yes"}, TypeError, "pin_memory must be a bool or None, got 'yes'"),
        (
            {"staging_pool": 2},
            TypeError,
            "staging_pool must be a StagingPool or None, got 2",
        ),
        # torch's own checks fail on these with a bare TypeError ("'<=' not supported ...").
        ({"lr": "1e-3"}, ValueError, "OffloadAdamW has lr='1e-3' \\(str\\); lr must be a finite"),
        ({"betas": 0.9}, ValueError, "OffloadAdamW has betas=0.9; betas must be a pair"),
        # torch's bare IndexError ("tuple index out of range").
        ({"betas": (0.9,)}, ValueError, r"OffloadAdamW has betas=\(0.9,\); betas must be a pair"),
        # torch takes it, and every step would refuse it.
        ({"lr": torch.tensor(1)}, ValueError, "param group 0 has lr=a torch.int64 tensor"),
        ({"eps": "1e-8"}, ValueError, "OffloadAdamW has eps='1e-8' \\(str\\)"),
    ],
)
def test_arguments_of_the_wrong_type_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        OffloadAdamW(make_params(), **kwargs)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("eps", -1.0, r"param group 1 has eps=-1.0 \(float\)"),
        ("lr", None, r"param group 1 has lr=None"),
        ("amsgrad", 1, r"param group 1 has amsgrad=1 \(int\); it must be a bool"),
    ],
)
def test_a_param_group_added_with_a_hyperparameter_every_step_refuses_is_refused_whole(
    key, value, message
):
    """torch checks only the constructor's hyperparameters; a group added later is checked
    where it is added (naming it), and is not added: the next step runs as before."""
    params = make_params()
    extra = torch.nn.Parameter(torch.ones(3))
    opt = OffloadAdamW(params[:3], lr=0.01)
    reference = clone_params(params[:3])
    torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=True)
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [extra], key: value})
    assert len(opt.param_groups) == 1
    extra.grad = torch.ones(3)
    step_together([opt, torch_opt], [params[:3], reference], torch.Generator().manual_seed(4), 2)
    assert_same(params[:3], reference)
    assert torch.equal(extra, torch.ones(3))


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


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("enabled", False),
        ("chunk_size", 128),
        ("pin_memory", True),
        ("force_staging", False),
        ("staging_pool", StagingPool()),
    ],
)
def test_settings_fixed_at_construction_are_refused_when_set(name, value):
    """Setting one after construction was ignored (``chunk_size``, ``pin_memory``,
    ``force_staging``: the buffers were laid out already) or broke the next step inside torch
    (``enabled=False`` handed host state to torch's kernel); now it is refused, naming the way
    out, and the optimizer steps on as built."""
    opt, params = trained(force_staging=True, chunk_size=64)
    before = snapshot(opt, params)
    settings = {n: getattr(opt, n) for n in ("enabled", "chunk_size", "pin_memory")}
    with pytest.raises(
        AttributeError,
        match=f"OffloadAdamW's {name} is read-only: .* OffloadAdamW\\(\\.\\.\\., {name}=",
    ):
        setattr(opt, name, value)
    with pytest.raises(AttributeError, match=f"{name} is read-only"):
        delattr(opt, name)
    assert {n: getattr(opt, n) for n in settings} == settings and opt.force_staging
    assert_steps_on_like_torch(opt, params, before)


@pytest.mark.parametrize(
    ("name", "hparam"),
    [
        ("enabled", "offload_enabled"),
        ("chunk_size", "offload_chunk_size"),
        ("pin_memory", "offload_pin_memory"),
        ("force_staging", None),
    ],
)
def test_a_fixed_setting_refused_names_the_mixins_hparam_only_where_there_is_one(name, hparam):
    """The refusal points a Lightning user to the mixin's hparam that sets it at construction
    (``offload_enabled``, ``offload_chunk_size``, ``offload_pin_memory``); ``force_staging``
    (for tests) has none, and naming an ``offload_force_staging`` would send users to an hparam
    the mixin does not read."""
    opt = OffloadAdamW(make_params())
    with pytest.raises(AttributeError) as refused:
        setattr(opt, name, getattr(opt, name))
    if hparam is None:
        assert "hparam" not in str(refused.value)
    else:
        assert f"(the mixin's hparam {hparam})" in str(refused.value)


def test_non_dense_parameter_is_refused_by_name_before_anything_changes():
    dense = torch.nn.Parameter(torch.randn(5))
    param = torch.nn.Parameter(torch.randn(3, 1).expand(3, 4))
    opt = OffloadAdamW([{"params": [dense]}, {"params": [param]}])
    dense.grad, param.grad = torch.ones(5), torch.ones(3, 4)
    before = dense.detach().clone()
    with pytest.raises(ValueError, match=r"parameter 0 of param group 1 has shape \(3, 4\)"):
        opt.step()
    assert torch.equal(dense, before) and not opt.state


@pytest.mark.parametrize("how", ["loaded", "set in optimizer.state"])
def test_state_for_a_non_dense_parameter_is_refused_by_name(how):
    """State loaded (or written into ``optimizer.state`` by hand) for a parameter that is not
    dense is refused naming it, before anything changes."""
    opt, params = trained()
    saved = copy.deepcopy(opt.state_dict())
    before = snapshot(opt, params)
    dense, entry = params[3].data, opt.state[params[3]]
    rows, cols = dense.shape
    wider = torch.zeros(rows, 2 * cols, dtype=dense.dtype)
    wider[:, ::2] = dense
    params[3].data = wider[:, ::2]
    with pytest.raises(ValueError, match=r"parameter 3 of param group 0 .*has shape"):
        if how == "loaded":
            opt.load_state_dict(saved)
        else:
            opt.state[params[3]] = saved["state"][3]
            opt.step()
    params[3].data, opt.state[params[3]] = dense, entry  # the test's own writes undone
    assert_unchanged(opt, params, before)


def test_a_parameter_made_non_dense_after_its_first_step_is_refused_by_name():
    """``p.data = x[:, ::2]`` keeps shape, dtype and device: only its strides change, which
    OffloadAdamW follows for dense layouts (channels_last) and must refuse, naming the
    parameter, where its elements have gaps; nothing is changed by the refused step."""
    opt, params = trained()
    before = snapshot(opt, params)
    rows, cols = params[3].shape
    wider = torch.zeros(rows, 2 * cols, dtype=params[3].dtype)
    wider[:, ::2] = params[3].detach()
    params[3].data = wider[:, ::2]
    with pytest.raises(ValueError, match=r"parameter 3 of param group 0 has shape"):
        opt.step()
    assert_unchanged(opt, params, before)


def fail_allocations(monkeypatch, what: str) -> None:
    """Make the pipeline's allocations raise out of memory ("simulated: ... ``what``")."""

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(f"simulated: out of accelerator memory {what}")

    monkeypatch.setattr(pipeline_module.torch, "empty", out_of_memory)


def test_allocation_failure_while_staging_leaves_everything_untouched(monkeypatch):
    opt, params = trained(force_staging=True, chunk_size=64)
    before = snapshot(opt, params)
    opt._pipeline.pool.buffers.clear()  # force a fresh allocation of the staging buffers
    fail_allocations(monkeypatch, "while staging")
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        opt.step()
    monkeypatch.undo()
    assert_unchanged(opt, params, before)
    assert_steps_on_like_torch(opt, params, before)


def test_resident_allocation_failure_leaves_everything_untouched_and_chooses_again(monkeypatch):
    """The second step chooses the resident state and allocates its device buffers before
    anything changes; out of memory there leaves model and state as they were, and the next
    step chooses again, bit-identical to torch."""
    params = make_params()
    reference = [p.detach().clone().requires_grad_() for p in params]
    ours = OffloadAdamW(params, force_staging=True, chunk_size=64, resident=0.5)
    theirs = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(3)
    step_together([ours, theirs], [params, reference], generator, 1)
    set_grads([params, reference], generator)
    before = snapshot(ours, params)
    fail_allocations(monkeypatch, "for resident state")
    with pytest.raises(torch.OutOfMemoryError, match="resident state"):
        ours.step()
    monkeypatch.undo()
    assert_unchanged(ours, params, before)
    assert ours.memory_stats()["resident_bytes"] == 0
    ours.step()
    theirs.step()
    assert ours.memory_stats()["resident_bytes"] > 0
    assert_same(params, reference)
    for index, entry in theirs.state_dict()["state"].items():
        assert_same(list(ours.state_dict()["state"][index].values()), list(entry.values()))


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
        (
            "groups",
            ValueError,
            "has 2 parameter groups, this optimizer has 1; they must be the groups it was saved "
            "with .*OffloadOptimizerMixin makes two unless its hparam no_decay_norm_and_bias",
        ),
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


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn], ids=str
)
def test_a_parameter_adamw_cannot_update_is_refused_by_name_once_it_has_a_gradient(dtype):
    """torch's AdamW takes an integer or float8 tensor among its parameters (a quantized
    layer's weight) and skips it while it has no gradient; given one, torch fails. Ours must
    not step it through an fp32 "master copy" and round the update back into it."""
    params = make_params()
    odd = torch.zeros(4).to(dtype)
    opt = OffloadAdamW([*params, odd])
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(0)
    step_together([opt, torch_opt], [params, reference], generator, 2)
    before = snapshot(opt, params)
    odd.grad = torch.ones(4).to(dtype)
    with pytest.raises(
        RuntimeError,
        match=rf"parameter {len(params)} of param group 0 is {dtype} and has a gradient",
    ):
        opt.step()
    assert_same(params, before[0])
    assert torch.equal(odd.float(), torch.zeros(4)) and odd not in opt.state
    odd.grad = None  # skipped again, as torch skips it
    step_together([opt, torch_opt], [params, reference], generator, 1)
    assert_same(params, reference)


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


# ----------------------------------------------------------------------------- all or nothing
def twins(**kwargs):
    """Two optimizers trained identically (same seeds), with the same next gradients set."""
    return trained(**kwargs), trained(**kwargs)


def assert_steps_like_twin(opt, params, twin, twin_params):
    """After a refused call, the optimizer steps to the same numbers as its untouched twin."""
    generator = torch.Generator().manual_seed(99)
    step_together([opt, twin], [params, twin_params], generator, 2)
    assert_same(params, twin_params)
    assert_same(
        [opt.state[p]["step"] for p in params], [twin.state[p]["step"] for p in twin_params]
    )


def three_groups(params):
    return [{"params": params[:2]}, {"params": params[2:4]}, {"params": params[4:]}]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("lr", None, r"param group 2 has lr=None"),
        ("lr", float("nan"), r"param group 2 has lr=nan"),
        ("betas", (0.9, 0.99, 0.5), r"param group 2 has betas=\(0.9, 0.99, 0.5\)"),
        ("betas", (1.0, 0.999), r"param group 2 has betas\[0\]=1.0"),
        ("eps", -1e-8, r"param group 2 has eps=-1e-08"),
        ("weight_decay", "0.1", r"param group 2 has weight_decay='0.1'"),
        ("amsgrad", None, r"param group 2 has amsgrad=None"),
        ("lr", True, r"param group 2 has lr=True \(bool\)"),
        ("eps", True, r"param group 2 has eps=True \(bool\)"),
        ("lr", torch.tensor([0.1, 0.2]), r"param group 2 has lr=.*1-element float"),
        ("lr", torch.tensor(1), r"param group 2 has lr=.*1-element float"),
        ("eps", float("inf"), r"param group 2 has eps=inf"),
        ("weight_decay", float("inf"), r"param group 2 has weight_decay=inf"),
        # An int tensor is refused as an int tensor lr is (never read as 1.0).
        ("eps", torch.tensor(1), r"param group 2 has eps=a torch.int64 tensor of shape \(\)"),
        ("betas", (torch.tensor(0), 0.9), r"param group 2 has betas\[0\]=a torch.int64 tensor"),
        # Not float()'s bare "a Tensor with 2 elements cannot be converted to Scalar".
        ("eps", torch.tensor([1e-8, 1e-8]), r"param group 2 has eps=a torch.float32 tensor of"),
        ("weight_decay", torch.tensor([0.1, 0.1]), r"weight_decay=a torch.float32 tensor of shape"),
    ],
)
@pytest.mark.parametrize(
    "mode", [{}, {"force_staging": True, "chunk_size": 64}], ids=["direct", "staged"]
)
def test_invalid_hyperparameter_in_a_later_group_changes_nothing(key, value, message, mode):
    """Torch checks hyperparameters only at construction; hand-edited ones are checked at every
    step, for all groups before the first update (groups 0 and 1 must not move)."""
    params = make_params()
    opt = OffloadAdamW(three_groups(params), **mode)
    step_together([opt], [params], torch.Generator().manual_seed(0), 2)
    set_grads([params], torch.Generator().manual_seed(1))
    good = opt.param_groups[2][key]
    opt.param_groups[2][key] = value
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert_unchanged(opt, params, before)
    opt.param_groups[2][key] = good
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(three_groups(reference), fused=True)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # not views of our buffers
    step_together([opt, torch_opt], [params, reference], torch.Generator().manual_seed(2), 2)
    assert_same(params, reference)


def test_gradient_of_transposed_shape_is_refused_before_any_update():
    """Same number of elements, other shape: the flat views would line up, wrongly. (torch
    refuses such a gradient when assigned; it arises when the parameter is reshaped after.)"""
    opt, params = trained()
    before = snapshot(opt, params)
    params[0].data = params[0].data.reshape(7, 300)  # the gradient stays (300, 7)
    with pytest.raises(RuntimeError, match=r"gradient of parameter 0 .* shape \(300, 7\) on"):
        opt.step()
    params[0].data = params[0].data.reshape(300, 7)
    assert_unchanged(opt, params, before)


def test_host_allocation_failure_for_new_parameters_changes_nothing(monkeypatch):
    """A new param group's first step needs host buffers; if they cannot be allocated, the
    parameters that already had state are not stepped either."""
    from lightning_offload_optim import host_state

    opt, params = trained()
    extra = make_params([(50,), (9,)], seed=5)
    opt.add_param_group({"params": extra, "lr": 0.1})
    for p in extra:
        p.grad = torch.randn_like(p)
    before = snapshot(opt, params)
    extra_before = [p.detach().clone() for p in extra]

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("simulated: out of host memory")

    monkeypatch.setattr(host_state, "host_empty", out_of_memory)
    with pytest.raises(RuntimeError, match="simulated: out of host memory"):
        opt.step()
    monkeypatch.undo()
    assert_unchanged(opt, params, before)
    assert_same(extra, extra_before)
    assert all(p not in opt.state for p in extra)
    assert opt.memory_stats()["state_bytes"] == 8 * sum(p.numel() for p in params)
    opt.step()  # and the optimizer works afterwards, with state for the new group
    assert all(opt.offloaded_state(p) for p in extra)


def test_failure_copying_step_counts_to_the_device_changes_nothing(monkeypatch):
    """The last preparation before the update: the counts' device copies (a GPU step)."""
    opt, params = trained(force_staging=True, chunk_size=64)
    before = snapshot(opt, params)

    def fail(*args):
        raise RuntimeError("simulated: device copy failed")

    monkeypatch.setattr(OffloadAdamW, "_steps_on_devices", staticmethod(fail))
    with pytest.raises(RuntimeError, match="simulated: device copy failed"):
        opt.step()
    assert_unchanged(opt, params, before)


@pytest.mark.parametrize("fault", [KeyboardInterrupt, RuntimeError])
def test_fault_partway_through_the_update_refuses_until_a_checkpoint_is_loaded(monkeypatch, fault):
    """Chunk 1 updated, chunk 2 not: that cannot be undone cheaply, so the optimizer refuses
    to step or save (never silently continues from a half-updated state) until a state dict is
    loaded; then it matches torch resuming from the same checkpoint."""
    from lightning_offload_optim import adamw as adamw_module

    opt, params = trained(force_staging=True, chunk_size=64)
    checkpoint = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    fault_in_second_chunk = fault("simulated fault in the second chunk")
    fail_on_call(monkeypatch, adamw_module, "adamw_update", 2, fault_in_second_chunk)
    with pytest.raises(fault, match="simulated fault"):
        opt.step()
    monkeypatch.undo()
    twin = copy.deepcopy(opt)  # holds the same half-updated state: refuses alike
    for call in (opt.step, opt.state_dict, twin.step, twin.state_dict):
        with pytest.raises(RuntimeError, match="failed partway through its update"):
            call()
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    opt.load_state_dict(checkpoint)
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    torch_opt.load_state_dict(checkpoint)
    step_together([opt, torch_opt], [params, reference], torch.Generator().manual_seed(3), 2)
    assert_same(params, reference)


def test_fault_partway_through_an_update_on_the_host_is_raised_as_it_is(monkeypatch):
    """Parameters on the host are updated in place (no staging, nothing to settle): a fault in
    the second chunk (an arena of another dtype) reaches the caller as it is, not replaced by
    an error of the clean-up, and the optimizer refuses to step until a load."""
    from lightning_offload_optim import adamw as adamw_module

    params = make_params([(10,)]) + make_params([(10,)], dtype=torch.float64)
    opt = OffloadAdamW(params)
    step_together([opt], [params], torch.Generator().manual_seed(0), 1)
    fail_on_call(monkeypatch, adamw_module, "adamw_update", 2, RuntimeError("simulated fault"))
    set_grads([params], torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="simulated fault"):
        opt.step()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="failed partway through its update"):
        opt.step()


def test_a_parameter_listed_twice_is_refused_at_construction():
    """torch only warns, then allocates its state once and steps it twice per step."""
    params = make_params()
    with pytest.raises(ValueError, match="parameter 1 of the new param group is listed again"):
        OffloadAdamW([params[0], params[1], params[2], params[1]])
    opt = OffloadAdamW(params[:2])
    with pytest.raises(ValueError, match="listed again at position 1"):
        opt.add_param_group({"params": [params[3], params[3]]})
    assert len(opt.param_groups) == 1


def test_a_state_dict_that_is_not_a_dict_is_refused_by_name():
    opt, params = trained()
    before = snapshot(opt, params)
    with pytest.raises(TypeError, match="state_dict must be a dict, got list"):
        opt.load_state_dict([before[1]])
    assert_unchanged(opt, params, before)


def test_a_parameter_in_two_groups_is_refused_naming_both_places():
    """torch refuses it too ("some parameters appear in more than one parameter group"),
    without saying which; nothing is added."""
    params = make_params()
    with pytest.raises(
        ValueError, match="parameter 1 of param group 1 is parameter 2 of param group 0 already"
    ):
        OffloadAdamW([{"params": params[:3]}, {"params": [params[3], params[2]]}])
    opt = OffloadAdamW([{"params": params[:2]}, {"params": params[2:4]}])
    with pytest.raises(ValueError, match="is parameter 1 of param group 1 already"):
        opt.add_param_group({"params": [params[4], params[3]]})
    # The first one held is named; torch's other refusals pass as they are.
    with pytest.raises(ValueError, match="parameter 1 of param group 2 is parameter 0 of"):
        opt.add_param_group({"params": [params[4], params[0], params[1]]})
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        opt.add_param_group({"params": [params[4] * 2]})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("name", ["grad_scale", "found_inf"])
def test_a_gradient_scale_that_grad_scaler_would_not_set_is_refused(name):
    """GradScaler sets 1-element float tensors; anything else, set by hand, is refused before
    anything changes."""
    (opt, params), (twin, twin_params) = trained(), trained()
    setattr(opt, name, torch.ones(2))
    with pytest.raises(TypeError, match=rf"optimizer.{name} is a torch.float32 tensor of shape"):
        opt.step()
    delattr(opt, name)
    assert_steps_like_twin(opt, params, twin, twin_params)


@pytest.mark.parametrize("where", ["same group", "other group"])
def test_a_parameter_added_again_to_the_param_groups_by_hand_is_refused_at_step(where):
    """Past add_param_group's check: torch steps it twice with one state; stepped unchecked,
    its two pieces of state diverged (the staged path then differed from the in-place one)."""
    (opt, params), (twin, twin_params) = trained(), trained()
    opt.add_param_group({"params": [], "lr": 0.5})
    group = opt.param_groups[0 if where == "same group" else 1]
    group["params"].append(params[2])
    set_grads([params], torch.Generator().manual_seed(1))
    where = "0" if where == "same group" else "1"
    with pytest.raises(
        ValueError, match=rf"of param group {where} is parameter 2 of param group 0"
    ):
        opt.step()
    group["params"].pop()
    assert_steps_like_twin(opt, params, twin, twin_params)


# ----------------------------------------------------------------------------- loading
@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"])
@pytest.mark.parametrize("value", [None, [0.0] * 5, 1.5], ids=["None", "list", "float"])
def test_non_tensor_state_is_refused_naming_parameter_and_key(key, value):
    """Accepting it left uninitialised host memory in place (moments of 1e32)."""
    (opt, params), (twin, twin_params) = (
        trained(amsgrad=True, dtype=torch.bfloat16),
        trained(amsgrad=True, dtype=torch.bfloat16),
    )
    broken = copy.deepcopy(opt.state_dict())
    broken["state"][3][key] = value
    with pytest.raises(
        ValueError, match=rf"loaded '{key}' for parameter 3 of param group 0 \(key 3\) is"
    ):
        opt.load_state_dict(broken)
    assert_steps_like_twin(opt, params, twin, twin_params)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (None, "is None"),
        ("3", "is '3'"),
        (torch.tensor(3.0, device="meta"), "on meta"),
        (torch.tensor([1.0, 2.0]), r"shape \(2,\)"),
        (-1.0, "is -1.0"),
        (float("inf"), "is inf"),
        (
            torch.tensor(float("nan")),
            "is a torch.float32 tensor of shape \\(\\) on cpu holding nan",
        ),
        (torch.tensor(-1.0), "tensor of shape \\(\\) on cpu holding -1.0;"),
        (True, r"is True \(bool\)"),  # not taken as 1
        (torch.tensor(True), r"is a torch.bool tensor of shape \(\) on cpu holding True"),
        (torch.tensor(3 + 0j), r"is a torch.complex64 tensor of shape \(\)"),
    ],
    ids=[
        *("None", "str", "meta", "two-elements", "negative", "inf", "nan", "negative-tensor"),
        *("bool", "bool-tensor", "complex-tensor"),
    ],
)
def test_bad_step_entry_is_refused_before_anything_changes(step, message):
    """Refused after the step counts, learning rates and new host buffers were installed."""
    (opt, params), (twin, twin_params) = twins()
    broken = copy.deepcopy(opt.state_dict())
    broken["state"][2]["step"] = step
    for group in broken["param_groups"]:
        group["lr"] = 0.5  # a refused load must not install these either
    with pytest.raises(ValueError, match=rf"loaded 'step' for parameter 2 .*{message}"):
        opt.load_state_dict(broken)
    assert opt.param_groups[0]["lr"] == twin.param_groups[0]["lr"]
    assert_steps_like_twin(opt, params, twin, twin_params)


def test_an_amsgrad_checkpoint_without_max_exp_avg_sq_is_refused():
    """Not loaded as if amsgrad were off, to fail at the next step with a misleading message."""
    (opt, params), (twin, twin_params) = twins(amsgrad=True)
    broken = copy.deepcopy(opt.state_dict())
    del broken["state"][1]["max_exp_avg_sq"]
    with pytest.raises(KeyError, match=r"parameter 1 .* is missing \['max_exp_avg_sq'\]"):
        opt.load_state_dict(broken)
    assert_steps_like_twin(opt, params, twin, twin_params)


def malformed(state_dict: dict, how: str) -> dict:
    broken = copy.deepcopy(state_dict)
    if how == "duplicate-ids":
        broken["param_groups"][0]["params"][4] = 0
    elif how == "tensor-entry":
        broken["state"][1] = torch.zeros(5)
    elif how == "list-moment":
        broken["state"][1]["exp_avg"] = broken["state"][1]["exp_avg"].tolist()
    elif how in ("version-str", "version-float", "version-bool"):
        broken["offload_format_version"] = {"version-str": "1", "version-float": 1.0}.get(how, True)
    elif how == "transposed-moment":
        broken["state"][0]["exp_avg"] = broken["state"][0]["exp_avg"].t().contiguous()
    elif how == "groups-not-a-list":
        broken["param_groups"] = "groups"
    elif how == "integer-moment":
        broken["state"][0]["exp_avg"] = torch.zeros(300, 7, dtype=torch.int64)
    elif how == "version-zero":
        broken["offload_format_version"] = 0
    elif how == "group-without-params":
        del broken["param_groups"][0]["params"]
    elif how == "state-a-list":
        broken["state"] = list(broken["state"].values())
    elif how == "meta-moment":
        broken["state"][1]["exp_avg"] = torch.empty(5, device="meta")
    return broken


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("duplicate-ids", r"list the parameter key 0 twice \(parameter 0 of param group 0 and"),
        ("tensor-entry", r"loaded state for parameter 1 .* is a torch.float32 tensor"),
        ("list-moment", r"loaded 'exp_avg' for parameter 1 .* is \[-?0\.\d+, .*\.\.\. \(list\)"),
        ("version-str", r"format version is '1' \(str\); format versions are integers"),
        ("version-float", r"format version is 1.0 \(float\)"),
        ("version-bool", r"format version is True \(bool\)"),
        ("transposed-moment", r"'exp_avg' for parameter 0 .* shape \(7, 300\), the parameter"),
        ("groups-not-a-list", r"'param_groups' must be a list of dicts"),
        ("integer-moment", r"'exp_avg' for parameter 0 .* is torch.int64"),
        ("version-zero", r"format version is 0 \(int\); format versions are integers >= 1"),
        ("group-without-params", r"'param_groups' must be a list of dicts with a 'params' list"),
        ("state-a-list", r"the loaded 'state' must be a dict, got list"),
        ("meta-moment", r"'exp_avg' for parameter 1 .* is on the meta device"),
    ],
)
def test_malformed_checkpoint_errors_name_the_real_problem(how, message):
    (opt, params), (twin, twin_params) = twins()
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(malformed(opt.state_dict(), how))
    assert_steps_like_twin(opt, params, twin, twin_params)


@pytest.mark.no_stream_check  # FSDP's own set-up, not our pipeline
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_parameters_are_refused_with_the_way_out(tmp_path, use_orig_params):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/rendezvous"
    )
    try:
        model = FullyShardedDataParallel(
            torch.nn.Linear(4, 3), device_id=torch.device("cpu"), use_orig_params=use_orig_params
        )
        with pytest.raises(ValueError, match=r"FSDP1.*fully_shard.*ModelParallelStrategy"):
            OffloadAdamW(model.parameters())
        opt = OffloadAdamW([torch.nn.Parameter(torch.zeros(2))])
        with pytest.raises(ValueError, match=r"parameter 0 of param group 1 .*FSDP1"):  # a lone
            opt.add_param_group({"params": next(model.parameters())})  # tensor, not in a list
        with pytest.raises(ValueError, match=r"parameter 0 of param group 1 .*FSDP1"):
            opt.add_param_group({"params": list(model.parameters())})
        assert len(opt.param_groups) == 1
        # Disabled, it is torch's AdamW (offload_enabled=False in the mixin), which takes them,
        # listed or alone in a group.
        reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
        first, *rest = model.parameters()
        disabled = OffloadAdamW([first], lr=0.1, enabled=False)
        torch_opt = torch.optim.AdamW(reference[:1], lr=0.1)
        for param, twin in zip(rest, reference[1:], strict=True):
            disabled.add_param_group({"params": param})
            torch_opt.add_param_group({"params": twin})
        for p, r in zip(model.parameters(), reference, strict=True):
            p.grad = torch.ones_like(p)
            r.grad = torch.ones_like(r)
        disabled.step()
        torch_opt.step()
        assert_same(list(model.parameters()), reference)
    finally:
        dist.destroy_process_group()


def test_step_count_without_moments_in_optimizer_state_is_refused():
    """An entry replaced by hand with only a step count: the moments are gone from it, so the
    step refuses it (naming the parameter) rather than stepping on whatever the buffers hold."""
    opt, params = trained()
    opt.state[params[1]] = {"step": torch.tensor(3.0)}
    before = [p.detach().clone() for p in params]
    with pytest.raises(KeyError, match=r"parameter 1 of param group 0 .*optimizer.state.*exp_avg"):
        opt.step()
    assert_same(params, before)


@pytest.mark.parametrize(
    "step", [torch.tensor(0), 2, torch.tensor([2.0], dtype=torch.float64)], ids=str
)
@pytest.mark.parametrize("mode", [{}, {"force_staging": True}], ids=["direct", "staged"])
def test_step_count_replaced_by_hand_is_taken_as_a_float32_count(mode, step):
    """``state[p]["step"] = torch.tensor(0)`` (a bias-correction reset): an int, a Python
    number or a 1-element tensor of another shape is taken as the count it holds, before the
    update advances any count, and the parameter steps as a torch AdamW given that count."""
    opt, params = trained(**mode)
    reference_params = clone_params(params)
    reference = torch.optim.AdamW(reference_params, fused=True)
    reference.load_state_dict(copy.deepcopy(opt.state_dict()))  # not views of our buffers
    opt.state[params[1]]["step"] = step
    reference.state[reference_params[1]]["step"] = torch.tensor(float(step))
    step_together([opt, reference], [params, reference_params], torch.Generator(), 2)
    assert_same(params, reference_params)
    steps = [opt.state[p]["step"] for p in params]
    assert all(s.dtype == torch.float32 and s.shape == () for s in steps)
    assert_same(steps, [reference.state[p]["step"] for p in reference_params])


@pytest.mark.parametrize("step", [-1.0, "3", None, torch.tensor([1.0, 2.0])], ids=str)
def test_bad_step_count_in_optimizer_state_is_refused_before_any_count_advances(step):
    """A step count replaced by hand with no count (or deleted) is refused, naming the
    parameter, before the update advances the other parameters' counts; put back, it steps
    as its twin does."""
    (opt, params), (twin, twin_params) = twins()
    kept = opt.state[params[1]]["step"]
    if step is None:
        del opt.state[params[1]]["step"]
    else:
        opt.state[params[1]]["step"] = step
    with pytest.raises(ValueError, match=r"'step' in optimizer.state for parameter 1 of param"):
        opt.step()
    opt.state[params[1]]["step"] = kept
    assert_steps_like_twin(opt, params, twin, twin_params)


def test_load_that_torch_refuses_changes_nothing_when_written_in_place():
    """Our checks pass this dict (an extra entry torch's own load cannot cast), torch's load
    refuses it: the moments must not have been written into the current buffers already."""
    opt, params = trained()
    before = snapshot(opt, params)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg"] = torch.full(params[0].shape, 123.0)
    saved["state"][0]["note"] = range(3)  # torch's _cast rebuilds it with type(value)(generator)
    reference = torch.optim.AdamW(clone_params(params), fused=True)
    with pytest.raises(TypeError):
        reference.load_state_dict(copy.deepcopy(saved))  # torch refuses it too
    with pytest.raises(TypeError):
        opt.load_state_dict(saved)
    assert_unchanged(opt, params, before)
    opt.step()  # not refused: nothing was half-written


def test_interrupted_in_place_load_refuses_until_the_next_load(monkeypatch):
    opt, params = trained()
    before = snapshot(opt, params)
    saved = copy.deepcopy(opt.state_dict())
    # The second of the in-place copies (the saved tensors are copies, so all are written).
    fail_on_call(monkeypatch, torch.Tensor, "copy_", 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        opt.load_state_dict(saved)
    monkeypatch.undo()
    with pytest.raises(
        RuntimeError, match=r"load_state_dict\(\) failed partway .*KeyboardInterrupt"
    ):
        opt.step()
    opt.load_state_dict(saved)
    assert_steps_on_like_torch(opt, params, before)
