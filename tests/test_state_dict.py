"""Checkpoints: torch.optim.AdamW's format both ways, fp32 moments on load, names as keys."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from conftest import (
    MasterCopyAdamW,
    assert_same,
    assert_state_offloaded,
    clone_params,
    make_params,
    set_grads,
    step_together,
)

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim.host_state import MOMENT_KEYS

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
        assert_state_offloaded(second, params)


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
    assert_state_offloaded(offload, list(offload.state))


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
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
    """Against an uninterrupted torch fused AdamW on fp32 masters, the parameters rounded from
    them: the checkpoint carries the master copies and the moments exactly."""
    params = make_params(dtype=torch.bfloat16)
    reference = clone_params(params)
    first = OffloadAdamW(params, lr=0.01, weight_decay=0.1)
    torch_ref = MasterCopyAdamW([{"params": reference}], lr=0.01, weight_decay=0.1)
    generator = torch.Generator().manual_seed(4)
    step_together([first, torch_ref], [params, reference], generator, 3)
    second = OffloadAdamW(params, lr=0.01, weight_decay=0.1)
    second.load_state_dict(save_and_load(first.state_dict()))
    step_together([second, torch_ref], [params, reference], generator, 3)
    assert_same(params, reference)
    for p, r in zip(params, reference, strict=True):
        state, master = second.offloaded_state(p), torch_ref.masters[r]
        expected = [master, torch_ref.fp32.state[master]["exp_avg"]]
        assert_same([state["master_param"], state["exp_avg"]], expected)


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


@pytest.mark.parametrize("resumed", [False, True], ids=["saved", "saved-after-a-resume"])
def test_plain_torch_adamw_resumes_our_checkpoint_on_the_fused_kernel_exactly(resumed):
    """Saved groups say fused=True: a torch.optim.AdamW built without ``fused`` takes it from
    the checkpoint (as it takes every hyperparameter), so switching offloading off is exact;
    also for a checkpoint saved by an optimizer that was itself resumed from one."""
    params = make_params()
    uninterrupted = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, weight_decay=0.1)
    reference = torch.optim.AdamW(uninterrupted, lr=0.01, weight_decay=0.1, fused=True)
    generator = torch.Generator().manual_seed(10)
    step_together([offload, reference], [params, uninterrupted], generator, 3)
    if resumed:
        checkpoint = save_and_load(offload.state_dict())
        offload = OffloadAdamW(params, lr=0.01, weight_decay=0.1)
        offload.load_state_dict(checkpoint)
        step_together([offload, reference], [params, uninterrupted], generator, 1)
    plain = torch.optim.AdamW(params)  # default implementation unless told otherwise
    plain.load_state_dict(save_and_load(offload.state_dict()))
    assert all(group["fused"] is True for group in plain.param_groups)
    step_together([plain, reference], [params, uninterrupted], generator, 3)
    assert_same(params, uninterrupted)


def test_complex_parameters_save_their_state_as_complex_not_fused():
    """torch's fused kernel takes no complex tensors: their groups must not claim fused=True."""
    params = make_params([(4,)], dtype=torch.complex64)
    offload = OffloadAdamW(params)
    step_together([offload], [params], torch.Generator().manual_seed(11), 1)
    assert offload.state_dict()["param_groups"][0]["fused"] is None


def test_a_differentiable_checkpoint_saved_again_resumes_in_torch_as_torchs_own():
    """torch's fused AdamW refuses ``differentiable=True``: a loaded group saying so is not
    marked fused when saved again, so torch AdamW resumes our checkpoint as it resumes the
    original (its differentiable implementation), instead of raising at its first step."""
    params = make_params()
    ours_params, theirs_params = clone_params(params), clone_params(params)
    trained = torch.optim.AdamW(params, lr=0.01, fused=True)
    generator = torch.Generator().manual_seed(12)
    step_together([trained], [params], generator, 2)
    checkpoint = trained.state_dict()
    checkpoint["param_groups"][0].update(differentiable=True, fused=None)
    for p, q, r in zip(params, ours_params, theirs_params, strict=True):
        q.data.copy_(p)
        r.data.copy_(p)
    ours = OffloadAdamW(ours_params, lr=0.01)
    ours.load_state_dict(save_and_load(checkpoint))
    theirs = torch.optim.AdamW(theirs_params, lr=0.01)
    theirs.load_state_dict(save_and_load(checkpoint))
    resumed = torch.optim.AdamW(ours_params, lr=0.01)
    resumed.load_state_dict(save_and_load(ours.state_dict()))
    assert resumed.param_groups[0]["differentiable"] is True
    step_together([resumed, theirs], [ours_params, theirs_params], generator, 2)
    assert_same(ours_params, theirs_params)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda opt: pickle.loads(pickle.dumps(opt)),
    "torch.save": lambda opt: save_and_load_object(opt),
}


def save_and_load_object(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("copier", COPIES.values(), ids=COPIES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_of_the_optimizer_keep_the_state_and_own_their_buffers(mode, copier, dtype):
    """torch's AdamW survives deepcopy, pickle and torch.save of the optimizer object. Here the
    copy's property itself: it holds the original's state, in buffers of its own, and steps on
    exactly as the original does (the math against torch: the test after this one)."""
    params = make_params(dtype=dtype)
    offload = OffloadAdamW(params, lr=0.01, amsgrad=True, **mode)
    generator = torch.Generator().manual_seed(12)
    step_together([offload], [params], generator, 2)
    saved = save_and_load(offload.state_dict())
    copied = copier(offload)
    for setting in ("enabled", "chunk_size", "pin_memory", "force_staging", "resident"):
        assert getattr(copied, setting) == getattr(offload, setting), setting
    for index, entry in copied.state_dict()["state"].items():
        assert entry.keys() == saved["state"][index].keys()
        assert_same(list(entry.values()), list(saved["state"][index].values()))
    # The copy's buffers are its own: stepping it leaves the original's state untouched.
    original_pointers = {b.data_ptr() for a in offload._host.arenas for b in a.buffers.values()}
    copied_pointers = {b.data_ptr() for a in copied._host.arenas for b in a.buffers.values()}
    assert not original_pointers & copied_pointers
    twin_params = params_of(copied)
    step_together([copied], [twin_params], torch.Generator().manual_seed(13), 2)
    assert_same(list(offload.state_dict()["state"][0].values()), list(saved["state"][0].values()))
    # And it continues exactly like the original would have.
    step_together([offload], [params], torch.Generator().manual_seed(13), 2)
    assert_same(twin_params, params)
    assert_same(
        [copied.state[p]["step"] for p in twin_params], [offload.state[p]["step"] for p in params]
    )


def test_an_optimizer_pickled_before_staging_pools_existed_unpickles_with_staging_of_its_own():
    """Pickles made before the ``staging_pool`` setting lack it: the optimizer comes back with
    staging of its own and steps on exactly as the original."""
    params = make_params()
    offload = OffloadAdamW(params, lr=0.01, force_staging=True)
    step_together([offload], [params], torch.Generator().manual_seed(3), 2)
    state = offload.__getstate__()
    del state["staging_pool"]
    old = type(offload).__new__(type(offload))
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    assert old.staging_pool is None and not old._pipeline.pool.shared
    twin_params = params_of(old)
    step_together([old], [twin_params], torch.Generator().manual_seed(4), 2)
    step_together([offload], [params], torch.Generator().manual_seed(4), 2)
    assert_same(twin_params, params)


@pytest.mark.parametrize(
    "settings, fused",
    [({"force_staging": True, "chunk_size": 64}, True), ({"enabled": False}, None)],
    ids=["offloaded", "disabled"],
)
def test_copy_of_the_optimizer_matches_a_copy_of_torch_adamw(settings, fused):
    """A disabled optimizer's copy is a disabled optimizer too: still torch's own kernel."""
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, **settings)
    torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=fused)
    generator = torch.Generator().manual_seed(14)
    step_together([offload, torch_opt], [params, reference], generator, 2)
    offload_copy, torch_copy = copy.deepcopy(offload), copy.deepcopy(torch_opt)
    step_together(
        [offload_copy, torch_copy], [params_of(offload_copy), params_of(torch_copy)], generator, 3
    )
    assert_same(params_of(offload_copy), params_of(torch_copy))
    assert offload_copy.enabled == offload.enabled


def test_a_shallow_copy_is_refused_and_a_disabled_ones_shares_like_torchs():
    """torch's copy.copy shares the state with the original, so stepping either advances one
    optimizer. Enabled, a copy would share the step counts but not the host moments (stepping
    to other numbers): refused. Disabled, it is torch's: alternate steps equal one optimizer's."""
    params = make_params()
    offload = OffloadAdamW(params, lr=0.01)
    with pytest.raises(TypeError, match=r"copy\.copy\(OffloadAdamW\) is not supported"):
        copy.copy(offload)
    disabled = OffloadAdamW(params, lr=0.01, enabled=False)
    reference = clone_params(params)
    torch_opt = torch.optim.AdamW(reference, lr=0.01)
    generator = torch.Generator().manual_seed(14)
    step_together([disabled, torch_opt], [params, reference], generator, 1)
    shallow = copy.copy(disabled)
    for optimizer in (shallow, disabled, shallow):
        step_together([optimizer, torch_opt], [params, reference], generator, 1)
    assert_same(params, reference)
    assert shallow is not disabled and shallow.state is disabled.state and not shallow.enabled


def test_groups_loaded_from_a_foreach_adamw_make_a_torch_adamw_again():
    """A group says ``fused=True`` (the kernel run); one loaded from ``AdamW(foreach=True)``
    must not keep ``foreach=True`` beside it: torch's constructor refuses the pair, so code
    rebuilding an optimizer from saved groups' hyperparameters would fail."""
    params = make_params()
    reference = clone_params(params)
    foreach = torch.optim.AdamW(reference, lr=0.01, foreach=True)
    step_together([foreach], [reference], torch.Generator().manual_seed(3), 1)
    offload = OffloadAdamW(params, lr=0.01)
    offload.load_state_dict(foreach.state_dict())
    saved = offload.state_dict()["param_groups"][0]
    settings = {k: v for k, v in saved.items() if k not in ("params", "decoupled_weight_decay")}
    rebuilt = torch.optim.AdamW(clone_params(params), **settings)
    assert rebuilt.param_groups[0]["fused"] is True


def test_load_frees_the_buffers_it_replaces():
    """A load that needs new buffers (here amsgrad adds a key) must not leave the old ones
    alive through cached chunk plans or slots."""
    import gc
    import weakref

    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    step_together([opt], [params], torch.Generator().manual_seed(15), 2)
    old = [weakref.ref(buffer) for a in opt._host.arenas for buffer in a.buffers.values()]
    checkpoint = save_and_load(opt.state_dict())
    checkpoint["param_groups"][0]["amsgrad"] = True
    for entry in checkpoint["state"].values():
        entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()
    gc.disable()  # freed by reference counting alone
    try:
        opt.load_state_dict(checkpoint)
        assert all(ref() is None for ref in old)
    finally:
        gc.enable()
    step_together([opt], [params], torch.Generator().manual_seed(16), 1)
    assert opt.memory_stats()["host_bytes"] == opt.memory_stats()["state_bytes"]


def test_load_with_the_same_layout_writes_into_the_current_buffers():
    """No second copy of the state: the loaded values go into the buffers already held, and
    training goes on exactly as from the checkpoint."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    generator = torch.Generator().manual_seed(15)
    step_together([opt], [params], generator, 2)
    checkpoint = save_and_load(opt.state_dict())
    reference_params = clone_params(params)
    reference = torch.optim.AdamW(reference_params, fused=True)
    reference.load_state_dict(save_and_load(checkpoint))
    step_together([opt], [params], generator, 1)  # moves away from the checkpoint
    buffers = [b.data_ptr() for a in opt._host.arenas for b in a.buffers.values()]
    for p, r in zip(params, reference_params, strict=True):
        r.data.copy_(p)
    opt.load_state_dict(checkpoint)
    assert [b.data_ptr() for a in opt._host.arenas for b in a.buffers.values()] == buffers
    step_together([opt, reference], [params, reference_params], generator, 2)
    assert_same(params, reference_params)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_state_tensor_pickles_as_its_own_parameters_state_alone(mode, dtype):
    """Plain pickle (``broadcast_object_list``, multiprocessing) writes every tensor's whole
    storage, one tensor at a time: views of buffers shared by all parameters made a dict pickle
    to the buffers' size times the parameters'. Against the bytes of the state itself, and a
    single entry saved alone against a clone of it."""
    params = make_params(dtype=dtype)
    ours = OffloadAdamW(params, lr=0.01, **mode)
    step_together([ours], [params], torch.Generator().manual_seed(19), 2)
    saved = ours.state_dict()
    tensors = [t for entry in saved["state"].values() for t in entry.values()]
    payload = sum(t.numel() * t.element_size() for t in tensors)
    assert [t.untyped_storage().nbytes() for t in tensors] == [  # each its own bytes, no more
        t.numel() * t.element_size() for t in tensors
    ]
    assert len(pickle.dumps(saved)) < 1.1 * payload + 16384
    unpickled = pickle.loads(pickle.dumps(saved))
    for index, entry in saved["state"].items():
        assert_same(list(unpickled["state"][index].values()), list(entry.values()))
    sizes = []
    for tensor in (saved["state"][1]["exp_avg"], saved["state"][1]["exp_avg"].clone()):
        alone = io.BytesIO()
        torch.save(tensor, alone)
        sizes.append(alone.tell())
    assert sizes[0] == sizes[1]


def stepped_twins(mode: dict, seed: int):
    """Ours and fused torch AdamW (lr 0.01) over equal parameters, stepped twice alike; and the
    generator of the gradients to come."""
    params = make_params()
    reference = clone_params(params)
    ours = OffloadAdamW(params, lr=0.01, **mode)
    torchs = torch.optim.AdamW(reference, lr=0.01, fused=True)
    generator = torch.Generator().manual_seed(seed)
    step_together([ours, torchs], [params, reference], generator, 2)
    return ours, torchs, params, reference, generator


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_state_dict_a_load_wrote_over_is_refused_and_a_copy_rolls_back(mode):
    """Loads write in place (the state is held once), so an uncloned ``state_dict()`` taken
    before a load shows the loaded moments afterwards, but not its step counts: loading it
    again (a rollback) mixed the two silently. It is refused, naming the entry, and nothing
    changes; a deep copy rolls back as torch AdamW's own state dict does."""
    ours, torchs, params, reference, generator = stepped_twins(mode, 20)
    other_params = make_params(seed=1)
    other = torch.optim.AdamW(other_params, lr=0.01, fused=True)
    step_together([other], [other_params], torch.Generator().manual_seed(21), 3)
    other_state = save_and_load(other.state_dict())
    snapshot = ours.state_dict()
    kept = [copy.deepcopy(ours.state_dict()), copy.deepcopy(torchs.state_dict())]
    for optimizer in (ours, torchs):
        optimizer.load_state_dict(other_state)
    with pytest.raises(ValueError, match=r"'exp_avg' for parameter 0 of param group 0 views"):
        ours.load_state_dict(snapshot)
    step_together([ours, torchs], [params, reference], generator, 1)  # on the other state
    assert_same(params, reference)
    for optimizer, state in zip((ours, torchs), kept, strict=True):
        optimizer.load_state_dict(state)
    step_together([ours, torchs], [params, reference], generator, 2)
    assert_same(params, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_an_edited_own_state_dict_loads_again_as_in_torch(mode):
    """Views loaded into the buffers they view are not written over by that load: a state dict
    edited by hand (one moment halved, a new lr) loads, and loads again, as a copy of torch
    AdamW's does."""
    ours, torchs, params, reference, generator = stepped_twins(mode, 22)
    edited = [ours.state_dict(), copy.deepcopy(torchs.state_dict())]
    for state_dict in edited:
        state_dict["state"][1]["exp_avg"] = state_dict["state"][1]["exp_avg"] * 0.5
        state_dict["param_groups"][0]["lr"] = 0.02
    for _ in range(2):
        ours.load_state_dict(edited[0])
        torchs.load_state_dict(copy.deepcopy(edited[1]))  # torch's load aliases its tensors
    step_together([ours, torchs], [params, reference], generator, 2)
    assert_same(params, reference)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_state_dict_of_buffers_a_load_replaced_still_rolls_back(mode):
    """A load that needs new buffers (an amsgrad checkpoint adds a key) leaves the views lent
    before it on the old buffers, which nothing writes any more: after further in-place loads
    of the new layout, those views still hold their own state and roll back as torch's copy."""
    ours, torchs, params, reference, generator = stepped_twins(mode, 23)
    other_params = make_params(seed=1)
    old = [ours.state_dict(), copy.deepcopy(torchs.state_dict())]
    other = torch.optim.AdamW(other_params, lr=0.01, amsgrad=True, fused=True)
    step_together([other], [other_params], torch.Generator().manual_seed(24), 3)
    with_amsgrad = save_and_load(other.state_dict())
    for _ in range(2):  # new buffers, then in place
        for optimizer in (ours, torchs):
            optimizer.load_state_dict(save_and_load(with_amsgrad))
        step_together([ours, torchs], [params, reference], generator, 1)
        assert_same(params, reference)
    for optimizer, state_dict in zip((ours, torchs), old, strict=True):
        optimizer.load_state_dict(state_dict)
    step_together([ours, torchs], [params, reference], generator, 2)
    assert_same(params, reference)


def test_loaded_step_counts_are_not_shared_with_the_loaded_dict():
    """Steps advance in place: aliasing the dict's tensors would advance another optimizer's."""
    params = make_params()
    opt = OffloadAdamW(params)
    step_together([opt], [params], torch.Generator().manual_seed(17), 2)
    checkpoint = save_and_load(opt.state_dict())
    opt.load_state_dict(checkpoint)
    step_together([opt], [params], torch.Generator().manual_seed(18), 1)
    assert checkpoint["state"][0]["step"] == 2
    assert opt.state[params[0]]["step"] == 3


def add_hooks(optimizer, seen):
    def double_exp_avg(opt, state_dict):
        for entry in state_dict["state"].values():
            entry["exp_avg"] = entry["exp_avg"] * 2

    def look(opt):
        seen.append(copy.deepcopy(opt.state_dict()["state"][0]))
        opt.state["loaded_by_hook"] = True  # not a parameter: torch keeps it as it is

    optimizer.register_load_state_dict_pre_hook(double_exp_avg)
    optimizer.register_load_state_dict_post_hook(look)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_load_hooks_behave_as_in_torch(mode):
    """A pre-hook runs before anything is read and its edits take effect; a post-hook sees the
    loaded moments, and may write a non-parameter entry into optimizer.state."""
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, **mode)
    torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=True)
    generator = torch.Generator().manual_seed(19)
    step_together([offload, torch_opt], [params, reference], generator, 2)
    checkpoint = save_and_load(torch_opt.state_dict())
    seen: dict[str, list] = {"offload": [], "torch": []}
    add_hooks(offload, seen["offload"])
    add_hooks(torch_opt, seen["torch"])
    offload.load_state_dict(copy.deepcopy(checkpoint))
    torch_opt.load_state_dict(copy.deepcopy(checkpoint))
    for opt in (offload, torch_opt):
        assert opt.state["loaded_by_hook"] is True
    (ours,), (theirs,) = seen["offload"], seen["torch"]
    assert_same([ours["exp_avg"]], [checkpoint["state"][0]["exp_avg"] * 2])
    assert_same([ours["exp_avg"], ours["exp_avg_sq"]], [theirs["exp_avg"], theirs["exp_avg_sq"]])
    step_together([offload, torch_opt], [params, reference], generator, 2)
    assert_same(params, reference)
    # A state dict holding the non-parameter entry loads again, in both.
    again = save_and_load(offload.state_dict())
    assert again["state"]["loaded_by_hook"] is True
    OffloadAdamW(params, lr=0.01, **mode).load_state_dict(again)


def test_load_pre_hooks_edit_a_copy_of_the_callers_dict_as_in_torch():
    """torch hands its load pre-hooks a shallow copy: keys a hook sets or replaces at the top
    level do not reach the dict the caller passed (it may be loaded again, or saved)."""

    def hook(opt, state_dict):
        state_dict["touched_by_hook"] = True
        state_dict["param_groups"] = [dict(g, lr=0.5) for g in state_dict["param_groups"]]

    for opt in (OffloadAdamW(make_params()), torch.optim.AdamW(make_params(), fused=True)):
        step_together([opt], [opt.param_groups[0]["params"]], torch.Generator().manual_seed(9), 1)
        saved = opt.state_dict()
        groups = saved["param_groups"]
        opt.register_load_state_dict_pre_hook(hook)
        opt.load_state_dict(saved)
        assert "touched_by_hook" not in saved and saved["param_groups"] is groups
        assert opt.param_groups[0]["lr"] == 0.5


def test_loading_keeps_the_optimizers_machinery():
    """torch's load ends by calling __setstate__; that must not rebuild the pipeline, the host
    store or the state_dict hook (each load added another hook and forgot a pinning failure)."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    step_together([opt], [params], torch.Generator().manual_seed(20), 1)
    pipeline, host = opt._pipeline, opt._host
    for _ in range(3):
        opt.load_state_dict(save_and_load(opt.state_dict()))
    assert opt._pipeline is pipeline and opt._host is host
    assert len(opt._optimizer_state_dict_post_hooks) == 1


def test_copy_made_after_a_stride_change_keeps_the_moments():
    """The state is reordered at the next step; a copy taken before that must still read it in
    the order it was written."""
    params = [torch.nn.Parameter(torch.randn(8, 3, 5, 5))]
    opt = OffloadAdamW(params)
    step_together([opt], [params], torch.Generator().manual_seed(21), 2)
    expected = opt.offloaded_state(params[0])
    params[0].data = params[0].data.contiguous(memory_format=torch.channels_last)
    for copied in (copy.deepcopy(opt), save_and_load_object(opt)):
        state = copied.offloaded_state(params_of(copied)[0])
        assert_same(list(state.values()), list(expected.values()))


def test_empty_state_entries_load_as_torch_loads_them():
    """optimizer.state is a defaultdict: reading it for a parameter without state adds {}, which
    state_dict() then saves. torch's AdamW loads that; so does OffloadAdamW."""
    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(22)
    step_together([offload, torch_opt], [params, reference], generator, 2, skip=lambda i: i == 1)
    offload.state[params[1]], torch_opt.state[reference[1]]  # reading adds the {}
    saved = save_and_load(offload.state_dict())
    assert saved["state"][1] == {}
    for opt in (OffloadAdamW(params), torch.optim.AdamW(reference, fused=True)):
        opt.load_state_dict(copy.deepcopy(saved))
    offload.load_state_dict(copy.deepcopy(saved))
    torch_opt.load_state_dict(copy.deepcopy(saved))
    step_together([offload, torch_opt], [params, reference], generator, 2)
    assert_same(params, reference)


@pytest.mark.parametrize("written_on", ["step", "state_dict"])
def test_state_written_into_optimizer_state_is_adopted(written_on):
    """ZeroRedundancyOptimizer's load writes whole entries (moments as tensors) into
    ``optimizer.state``; they replace the offloaded state, whether the next call is a step or
    a state_dict(), and then live in host memory again."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    step_together([opt], [params], torch.Generator().manual_seed(1), 2)
    reference_params = make_params(seed=5)
    reference = torch.optim.AdamW(reference_params, fused=True)
    step_together([reference], [reference_params], torch.Generator().manual_seed(2), 3)
    for p, r in zip(params, reference_params, strict=True):
        p.data.copy_(r)
        opt.state[p] = {k: v.clone() for k, v in reference.state[r].items()}
    if written_on == "state_dict":
        saved = opt.state_dict()["state"]
        expected = reference.state_dict()["state"]
        for index, entry in expected.items():
            assert_same([saved[index][k] for k in entry], list(entry.values()))
    generator = torch.Generator().manual_seed(3)
    step_together([opt, reference], [params, reference_params], generator, 2)
    assert_same(params, reference_params)
    assert_state_offloaded(opt, params)


def test_an_entry_copied_by_hand_to_a_parameter_without_state_is_refused_whole():
    """Another parameter's entry (its placeholder marks) put under a parameter that has no host
    state yet holds nothing this parameter could start from: refused as found state is, naming
    it, and nothing changes."""
    params = make_params()
    opt = OffloadAdamW(params[:2])
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    opt.state[params[1]] = dict(opt.state[params[0]])
    params[1].grad = torch.ones_like(params[1])
    before = [p.detach().clone() for p in params[:2]]
    with pytest.raises(
        ValueError, match=r"parameter 1 of param group 0 \(found in optimizer.state"
    ):
        opt.step()
    assert_same(params[:2], before)


def test_a_hand_written_entry_is_adopted_with_its_own_groups_amsgrad():
    """A moment reset written into ``optimizer.state`` in torch's format, for a parameter of a
    group without amsgrad, is taken (no ``max_exp_avg_sq`` needed) although another group has
    amsgrad, as torch's AdamW takes it."""

    def train(make) -> list[torch.Tensor]:
        params = make_params()
        opt = make([{"params": params[:2], "amsgrad": True}, {"params": params[2:]}])
        generator = torch.Generator().manual_seed(8)
        step_together([opt], [params], generator, 2)
        opt.state[params[3]] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(params[3]),
            "exp_avg_sq": torch.zeros_like(params[3]),
        }
        step_together([opt], [params], generator, 2)
        return params

    ours = train(lambda groups: OffloadAdamW(groups, force_staging=True, chunk_size=64))
    assert_same(ours, train(lambda groups: torch.optim.AdamW(groups, fused=True)))


def test_a_bf16_runs_entries_written_into_an_fp32_models_state_are_adopted():
    """A bf16 run's state written into ``optimizer.state`` of the model cast to fp32 (as
    ZeroRedundancyOptimizer's load writes a checkpoint's entries): the master copies, which
    fp32 parameters have no use for, leave the entries with the other tensors, as a direct
    load drops them; an entry keeping one would count as written by others at every look.
    Training goes on as torch's AdamW given the same entries does."""
    low = make_params(dtype=torch.bfloat16)
    bf16 = OffloadAdamW(low, lr=0.01)
    step_together([bf16], [low], torch.Generator().manual_seed(17), 2)
    saved = save_and_load(bf16.state_dict())["state"]
    params = [torch.nn.Parameter(p.detach().float()) for p in low]
    reference = clone_params(params)
    ours = OffloadAdamW(params, lr=0.01, force_staging=True, chunk_size=64)
    theirs = torch.optim.AdamW(reference, lr=0.01, fused=True)
    for index, (p, r) in enumerate(zip(params, reference, strict=True)):
        ours.state[p] = {k: v.clone() for k, v in saved[index].items()}
        theirs.state[r] = {k: v.clone() for k, v in saved[index].items()}
    step_together([ours, theirs], [params, reference], torch.Generator().manual_seed(18), 2)
    assert_same(params, reference)
    assert_state_offloaded(ours, params)


@pytest.mark.parametrize("written_on", ["step", "state_dict", "offloaded_state"])
@pytest.mark.parametrize(
    "mode", [{}, {"force_staging": True, "chunk_size": 64}], ids=["direct", "staged"]
)
def test_one_moment_replaced_by_hand_is_adopted_and_the_others_kept(written_on, mode):
    """``opt.state[p]["exp_avg"] = zeros`` (a momentum reset) works in torch: the next step
    uses the new moment and the state's other tensors as they were. Here the other keys still
    hold their marks; they keep their values, whatever reads the state next."""
    params = make_params()
    reference_params = clone_params(params)
    opt = OffloadAdamW(params, amsgrad=True, **mode)
    reference = torch.optim.AdamW(reference_params, amsgrad=True, fused=True)
    generator = torch.Generator().manual_seed(4)
    step_together([opt, reference], [params, reference_params], generator, 2)
    for p, r in zip(params[1:3], reference_params[1:3], strict=True):
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
        reference.state[r]["exp_avg"] = torch.zeros_like(r)
    if written_on == "state_dict":
        opt.state_dict()
    elif written_on == "offloaded_state":
        assert torch.equal(opt.offloaded_state(params[2])["exp_avg"], torch.zeros_like(params[2]))
    step_together([opt, reference], [params, reference_params], generator, 2)
    assert_same(params, reference_params)
    for p, r in zip(params, reference_params, strict=True):
        state, expected = opt.offloaded_state(p), reference.state[r]
        assert_same([state[k] for k in MOMENT_KEYS], [expected[k] for k in MOMENT_KEYS])
    assert_state_offloaded(opt, params)


def test_a_moment_replaced_by_hand_keeps_the_fp32_master_copy(recwarn):
    """Also where the bf16 weight was edited by hand since: the edit reaches the master copy at
    the next step, not when the replaced moment is taken in."""
    params = make_params(dtype=torch.bfloat16)
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    step_together([opt], [params], torch.Generator().manual_seed(6), 2)
    before = opt.offloaded_state(params[0])
    with torch.no_grad():
        params[0].add_(1.0)
    opt.state[params[0]]["exp_avg_sq"] = torch.ones_like(params[0], dtype=torch.float32)
    after = opt.offloaded_state(params[0])
    assert not recwarn.list
    assert torch.equal(after["master_param"], before["master_param"])
    assert torch.equal(after["exp_avg"], before["exp_avg"])
    assert torch.equal(after["exp_avg_sq"], torch.ones_like(before["exp_avg_sq"]))


@pytest.mark.parametrize("into", ["offload", "torch"])
def test_max_exp_avg_sq_kept_after_amsgrad_is_switched_off_survives_a_load(into):
    """torch keeps ``max_exp_avg_sq`` when amsgrad is switched off by hand, saves and loads it,
    and can switch amsgrad on again; a load here must not drop it."""
    params = make_params()
    reference_params = clone_params(params)
    opt = OffloadAdamW(params, amsgrad=True)
    reference = torch.optim.AdamW(reference_params, amsgrad=True, fused=True)
    generator = torch.Generator().manual_seed(8)
    step_together([opt, reference], [params, reference_params], generator, 2)
    for optimizer in (opt, reference):
        optimizer.param_groups[0]["amsgrad"] = False
    step_together([opt, reference], [params, reference_params], generator, 1)
    saved = save_and_load(opt.state_dict() if into == "offload" else reference.state_dict())
    opt.load_state_dict(saved)
    assert all("max_exp_avg_sq" in entry for entry in opt.state_dict()["state"].values())
    for optimizer in (opt, reference):
        optimizer.param_groups[0]["amsgrad"] = True
    step_together([opt, reference], [params, reference_params], generator, 2)
    assert_same(params, reference_params)


@pytest.mark.parametrize(
    "step",
    [torch.tensor(2, dtype=torch.int32), torch.tensor(0.0), 0, torch.tensor([3.0])],
    ids=["int32", "zero", "0", "shape-1"],
)
@pytest.mark.parametrize("force_staging", [False, True], ids=["direct", "staged"])
def test_step_counts_of_any_valid_kind_load_as_in_torch(step, force_staging):
    """A step count of 0, integer tensors of either width and a 1-element tensor of shape
    (1,) are valid entries, kept as float32 scalars (the staged step stacks them)."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=force_staging)
    generator = torch.Generator().manual_seed(9)
    step_together([opt], [params], generator, 2)
    reference_params = clone_params(params)
    saved = save_and_load(opt.state_dict())
    saved["state"][1]["step"] = step
    reference = torch.optim.AdamW(reference_params, fused=True)
    reference.load_state_dict(save_and_load(saved))
    opt.load_state_dict(saved)
    assert float(opt.state[params[1]]["step"]) == float(step)
    step_together([opt, reference], [params, reference_params], generator, 2)
    assert_same(params, reference_params)


def test_loading_own_entries_swapped_between_parameters():
    """Entries that view this optimizer's own buffers, each loaded into another parameter:
    writing them in place one by one would read already-overwritten values."""
    params = make_params([(64, 3)] * 3)
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    generator = torch.Generator().manual_seed(21)
    step_together([opt], [params], generator, 2)
    saved = opt.state_dict()
    reference_params = clone_params(params)
    reference = torch.optim.AdamW(reference_params, fused=True)
    reference.load_state_dict(save_and_load(saved))
    rotated = {**saved, "state": {i: saved["state"][(i + 1) % 3] for i in range(3)}}
    expected = {**rotated, "state": save_and_load(rotated["state"])}
    opt.load_state_dict(rotated)
    reference.load_state_dict(expected)
    step_together([opt, reference], [params, reference_params], generator, 2)
    assert_same(params, reference_params)


def test_load_after_a_stride_change_takes_the_new_layout():
    """Buffers laid out for the old strides cannot be written in place with the new ones."""
    params = make_params([(4, 3, 5, 6)])
    opt = OffloadAdamW(params)
    generator = torch.Generator().manual_seed(22)
    step_together([opt], [params], generator, 1)
    saved = save_and_load(opt.state_dict())
    params[0].data = params[0].data.contiguous(memory_format=torch.channels_last)
    reference_params = clone_params(params)
    reference = torch.optim.AdamW(reference_params, fused=True)
    # torch's fused kernel pairs elements by memory position, so its state and gradients must
    # have the parameter's memory format (as autograd's gradients do).
    converted = save_and_load(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        moment = converted["state"][0][key]
        converted["state"][0][key] = moment.contiguous(memory_format=torch.channels_last)
    reference.load_state_dict(converted)
    opt.load_state_dict(saved)
    for _ in range(2):
        grad = torch.randn(params[0].shape, generator=generator)
        for p, optimizer in ((params[0], opt), (reference_params[0], reference)):
            p.grad = grad.contiguous(memory_format=torch.channels_last)
            optimizer.step()
    assert_same(params, reference_params)
    assert_same(
        [opt.offloaded_state(params[0])["exp_avg"]],
        [reference.state[reference_params[0]]["exp_avg"]],
    )


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_loaded_moments_with_other_strides_are_read_by_their_indices(mode):
    """Loaded moments may be views with strides of their own (a transposed or every-other-
    element view, from a converted or hand-made checkpoint): they are taken element by element
    as indexed, as torch's fused AdamW takes their contiguous copies. (Given the views
    themselves, torch's fused kernel reads their memory as contiguous, so its result depends on
    how the checkpoint was made.)"""
    params = make_params([(30, 7), (13,)])
    reference_params = clone_params(params)
    generator = torch.Generator().manual_seed(24)
    moments = [torch.rand(7, 30, generator=generator) for _ in range(2)]
    moments += [torch.rand(26, generator=generator) for _ in range(2)]

    def saved(contiguous: bool) -> dict:
        views = [moments[0].t(), moments[1].t(), moments[2][::2], moments[3][::2]]
        if contiguous:
            views = [v.contiguous() for v in views]
        return {
            "state": {
                0: {"step": torch.tensor(3.0), "exp_avg": views[0], "exp_avg_sq": views[1]},
                1: {"step": torch.tensor(3.0), "exp_avg": views[2], "exp_avg_sq": views[3]},
            },
            "param_groups": [{**OffloadAdamW(params).state_dict()["param_groups"][0]}],
        }

    opt = OffloadAdamW(params, **mode)
    opt.load_state_dict(saved(contiguous=False))
    reference = torch.optim.AdamW(reference_params, fused=True)
    reference.load_state_dict(saved(contiguous=True))
    step_together([opt, reference], [params, reference_params], generator, 2)
    assert_same(params, reference_params)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_step_counts_saved_as_python_numbers_load_as_counts_of_their_own(mode):
    """torch before 1.12 saved step counts as Python ints: equal ones are one object in a
    state dict, yet each is a count of its own, as torch's AdamW loads them (only a shared
    tensor stays shared). Each advances once per step."""
    params = make_params()
    reference_params = clone_params(params)
    reference = torch.optim.AdamW(reference_params, fused=True)
    step_together([reference], [reference_params], torch.Generator().manual_seed(25), 3)
    saved = copy.deepcopy(reference.state_dict())
    for entry in saved["state"].values():
        entry["step"] = 3
    for p, r in zip(params, reference_params, strict=True):
        p.data.copy_(r)
    opt = OffloadAdamW(params, **mode)
    opt.load_state_dict(saved)
    reference.load_state_dict(copy.deepcopy(saved))
    step_together([opt, reference], [params, reference_params], torch.Generator(), 2)
    assert_same(params, reference_params)
    assert [float(opt.state[p]["step"]) for p in params] == [5.0] * len(params)


def test_load_after_a_shape_change_takes_the_new_shape():
    """A parameter replaced by one of another shape (same size), then a checkpoint for the new
    shape loaded: the state is laid out anew, as torch's AdamW takes it."""
    params = make_params([(6, 40)])
    opt = OffloadAdamW(params)
    generator = torch.Generator().manual_seed(23)
    step_together([opt], [params], generator, 1)
    params[0].data = torch.randn(40, 6, generator=generator)
    reference_params = clone_params(params)
    reference = torch.optim.AdamW(reference_params, fused=True)
    step_together([reference], [reference_params], generator, 2)
    saved = save_and_load(reference.state_dict())
    for p, r in zip(params, reference_params, strict=True):
        p.data.copy_(r)
    opt.load_state_dict(saved)
    step_together([opt, reference], [params, reference_params], generator, 2)
    assert_same(params, reference_params)


def test_load_of_some_parameters_frees_the_others_buffers():
    """Loading state for some parameters only drops the others' state (as torch does); their
    buffers must not stay alive next to the new ones they get at their next step."""
    params = make_params()
    opt = OffloadAdamW(params)
    generator = torch.Generator().manual_seed(24)
    step_together([opt], [params], generator, 2)
    saved = save_and_load(opt.state_dict())
    saved["state"] = {i: saved["state"][i] for i in (0, 1)}
    opt.load_state_dict(saved)
    step_together([opt], [params], generator, 1)
    stats = opt.memory_stats()
    assert stats["host_bytes"] == stats["state_bytes"] == 8 * sum(p.numel() for p in params)


def test_entry_reduced_to_its_step_count_is_refused_by_state_dict_too():
    params = make_params()
    opt = OffloadAdamW(params)
    step_together([opt], [params], torch.Generator().manual_seed(25), 1)
    opt.state[params[1]] = {"step": torch.tensor(3.0)}
    with pytest.raises(KeyError, match=r"parameter 1 of param group 0 .*missing"):
        opt.state_dict()


@pytest.mark.parametrize("force_staging", [False, True])
def test_a_checkpoint_without_amsgrad_loads_into_an_optimizer_made_with_it(force_staging):
    """The saved param group's amsgrad says which moments an entry holds (the load then takes
    the saved group's settings, as torch's does): a checkpoint without amsgrad loads into an
    optimizer built with ``amsgrad=True`` and trains on as torch does."""
    params = make_params()
    opt = OffloadAdamW(params, force_staging=force_staging, chunk_size=64)
    generator = torch.Generator().manual_seed(0)
    step_together([opt], [params], generator, 2)
    saved = save_and_load(opt.state_dict())
    resumed_params, reference = clone_params(params), clone_params(params)
    resumed = OffloadAdamW(resumed_params, amsgrad=True, force_staging=force_staging, chunk_size=64)
    torch_opt = torch.optim.AdamW(reference, amsgrad=True, fused=True)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["amsgrad"] is False
    step_together([resumed, torch_opt], [resumed_params, reference], generator, 2)
    assert_same(resumed_params, reference)


def test_a_rollback_loading_the_optimizer_before_the_weights_keeps_the_saved_masters():
    """Rolling back to a bf16 checkpoint, the optimizer loaded before the model's weights: the
    saved master copies are the truth although they do not round to the parameters yet. Only a
    master that is this optimizer's own buffer (a DCP load in place) is taken from the
    parameter. Training then goes on as torch's fused AdamW on fp32 masters does."""
    params = make_params(dtype=torch.bfloat16)
    reference = clone_params(params)
    ours = OffloadAdamW(params, lr=0.05)
    torch_ref = MasterCopyAdamW([{"params": reference}], lr=0.05)
    step_together([ours, torch_ref], [params, reference], torch.Generator().manual_seed(5), 3)
    saved = save_and_load(ours.state_dict())
    weights = [p.detach().clone() for p in params]
    step_together([ours], [params], torch.Generator().manual_seed(6), 2)  # then roll back:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours.load_state_dict(saved)  # the optimizer first,
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)  # then the weights
    for index, param in enumerate(params):
        assert_same(
            [ours.offloaded_state(param)["master_param"]], [saved["state"][index]["master_param"]]
        )
    step_together([ours, torch_ref], [params, reference], torch.Generator().manual_seed(7), 2)
    assert_same(params, reference)


def test_masters_loaded_in_place_that_do_not_round_to_the_weights_are_taken_from_them():
    """A distributed checkpoint read into this optimizer's own ``state_dict()`` views (in
    place) with masters that do not round to the bf16 weights: the weights were not loaded
    first, or the masters are a fake step's. They are taken from the weights, with a warning
    saying so."""
    params = make_params(dtype=torch.bfloat16)
    opt = OffloadAdamW(params)
    step_together([opt], [params], torch.Generator().manual_seed(10), 1)
    saved = opt.state_dict()
    saved["state"][1]["master_param"].fill_(5.0)  # in place, as dcp.load writes
    with pytest.warns(UserWarning, match=r"master copies of 1 parameter\(s\).*do not round"):
        opt.load_state_dict(saved)
    assert_same([opt.offloaded_state(params[1])["master_param"]], [params[1].float()])


@pytest.mark.parametrize("how", ["deleted", "cleared"])
def test_offloaded_state_is_empty_once_the_entry_is_removed_by_hand(how):
    """torch starts a parameter's state afresh after ``del opt.state[p]`` or
    ``opt.state[p].clear()``; until then it holds none, and ``offloaded_state`` says so instead
    of returning the old host buffers."""
    params = make_params()
    opt = OffloadAdamW(params)
    step_together([opt], [params], torch.Generator().manual_seed(11), 1)
    if how == "deleted":
        del opt.state[params[2]]
    else:
        opt.state[params[2]].clear()
    assert opt.offloaded_state(params[2]) == {}
    assert opt.offloaded_state(params[1]).keys() == {"exp_avg", "exp_avg_sq"}


def test_every_param_group_saves_fused_as_torchs_fused_adamw_does():
    """Each group says ``fused=True``, those after the first too (given to the constructor or
    added later), as in the state dict of ``torch.optim.AdamW(fused=True)``: a group marked
    only where the first one was would send a plain torch AdamW resuming the checkpoint to its
    default kernel for that group, which is not exact."""
    params = make_params()
    reference = clone_params(params)

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:4], "lr": 0.02}]

    ours = OffloadAdamW(groups(params), lr=0.01)
    theirs = torch.optim.AdamW(groups(reference), lr=0.01, fused=True)
    ours.add_param_group({"params": params[4:], "weight_decay": 0.5})
    theirs.add_param_group({"params": reference[4:], "weight_decay": 0.5})
    step_together([ours, theirs], [params, reference], torch.Generator().manual_seed(14), 1)
    saved = save_and_load(ours.state_dict())
    assert saved["param_groups"] == theirs.state_dict()["param_groups"]
    plain = torch.optim.AdamW(groups(params), lr=0.01)  # default implementation unless told
    plain.add_param_group({"params": params[4:]})
    plain.load_state_dict(saved)
    assert [group["fused"] for group in plain.param_groups] == [True, True, True]


@pytest.mark.parametrize("how", ["deleted", "cleared"])
def test_state_dict_holds_no_state_for_an_entry_removed_by_hand_as_torchs(how):
    """After ``del opt.state[p]`` or ``opt.state[p].clear()`` the parameter has no state, and
    ``state_dict()`` says so as torch's AdamW's does (no entry, or an empty one), instead of
    listing the old host buffers under it (moments without a step count, which torch's
    ``load_state_dict`` would take for the state of a parameter that has none)."""
    params = make_params()
    reference = clone_params(params)
    ours = OffloadAdamW(params, lr=0.01)
    theirs = torch.optim.AdamW(reference, lr=0.01, fused=True)
    step_together([ours, theirs], [params, reference], torch.Generator().manual_seed(14), 2)
    for opt, p in ((ours, params[2]), (theirs, reference[2])):
        if how == "deleted":
            del opt.state[p]
        else:
            opt.state[p].clear()
    saved, expected = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert saved.keys() == expected.keys()
    assert {i: entry.keys() for i, entry in saved.items()} == {
        i: entry.keys() for i, entry in expected.items()
    }


def test_a_group_mixing_complex_and_real_parameters_does_not_claim_fused():
    """torch's fused kernel takes no complex tensors: a group holding one does not save
    ``fused=True``, which would stop ``torch.optim.AdamW`` from resuming the checkpoint."""
    params = [*make_params([(5,)]), *make_params([(4,)], dtype=torch.complex64, seed=1)]
    ours = OffloadAdamW(params, lr=0.01)
    step_together([ours], [params], torch.Generator().manual_seed(12), 1)
    saved = save_and_load(ours.state_dict())
    assert saved["param_groups"][0]["fused"] is None
    plain = torch.optim.AdamW(clone_params(params))
    plain.load_state_dict(saved)
    step_together([plain], [plain.param_groups[0]["params"]], torch.Generator().manual_seed(13), 1)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_diverged_element_keeps_the_rest_of_the_master_copy_through_an_in_place_load(mode, dtype):
    """One NaN element of a bf16/fp16 parameter (its master is NaN there too) does not make a
    load of the optimizer's own ``state_dict()`` (a distributed checkpoint loaded in place)
    take the whole master copy from the parameter: NaN rounds to NaN. Training goes on as torch's
    fused AdamW on fp32 masters does, NaN where it is NaN."""
    params = make_params(dtype=dtype)
    reference = clone_params(params)
    ours = OffloadAdamW(params, lr=0.05, **mode)
    torch_ref = MasterCopyAdamW([{"params": reference}], lr=0.05)
    generator = torch.Generator().manual_seed(8)
    set_grads([params, reference], generator)
    for p in (params[2], reference[2]):
        p.grad[7] = float("nan")
    for optimizer in (ours, torch_ref):
        optimizer.step()
    step_together([ours, torch_ref], [params, reference], generator, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no master copy is taken as stale
        ours.load_state_dict(ours.state_dict())
    step_together([ours, torch_ref], [params, reference], generator, 2)
    assert params[2][7].isnan()
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p, r, rtol=0, atol=0, equal_nan=True)


def test_torch_low_precision_state_set_through_dcps_flattened_dict_resumes_exactly():
    """torch's ``set_optimizer_state_dict`` with ``flatten_optimizer_state_dict=True`` (as
    torchtitan saves) rebuilds each key ``optimizer.state`` lists and hands ``{}`` for one the
    checkpoint lacks: ``master_param``, from torch AdamW over bf16 parameters. That is no master
    copy (it comes from the weights), not a malformed one. Reference: fp32 AdamW on fp32 copies,
    loaded from the same torch state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7)
    step_together([torch_opt], [list(model.parameters())], generator, 2)
    saved = copy.deepcopy(get_optimizer_state_dict(model, torch_opt, options=flat))

    resumed = copy.deepcopy(model)
    offload = OffloadAdamW(resumed.parameters(), lr=0.01)
    set_optimizer_state_dict(resumed, offload, saved, options=flat)
    reference = MasterCopyAdamW([{"params": list(model.parameters())}], lr=0.01)
    reference.fp32.load_state_dict(torch_opt.state_dict())
    for group in reference.fp32.param_groups:  # the load took the saved group's fused=None
        group["fused"] = True
    params = list(resumed.parameters())
    step_together([offload, reference], [params, list(model.parameters())], generator, 2)
    assert_same(params, list(model.parameters()))
    for p, r in zip(params, model.parameters(), strict=True):
        ours, master = offload.offloaded_state(p), reference.masters[r]
        keys = ["exp_avg", "exp_avg_sq"]
        expected = [reference.fp32.state[master][k] for k in keys] + [master]
        assert_same([ours[k] for k in keys] + [ours["master_param"]], expected)


@pytest.mark.parametrize("prepend", [False, True], ids=["appended", "prepended"])
def test_a_state_dict_post_hook_sees_and_edits_the_state_as_in_torch(prepend):
    """A post-hook casting the saved moments to bf16 (a smaller checkpoint) must see tensors
    and keep its edit, also when registered with ``prepend=True``: the hook that fills in the
    offloaded state must run before it."""
    seen = {}

    def shrink(opt, state_dict):
        seen[opt] = [type(v) for v in state_dict["state"][0].values()]
        for entry in state_dict["state"].values():
            entry["exp_avg"] = entry["exp_avg"].to(torch.bfloat16)
        return state_dict

    params = make_params()
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, force_staging=True, chunk_size=64)
    torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=True)
    step_together([offload, torch_opt], [params, reference], torch.Generator().manual_seed(3), 2)
    for opt in (offload, torch_opt):
        opt.register_state_dict_post_hook(shrink, prepend=prepend)
    ours, theirs = offload.state_dict(), torch_opt.state_dict()
    assert seen[offload] == seen[torch_opt] == [torch.Tensor] * 3
    for index, entry in theirs["state"].items():
        assert entry["exp_avg"].dtype == ours["state"][index]["exp_avg"].dtype == torch.bfloat16
        assert_same(list(ours["state"][index].values()), list(entry.values()))


def test_code_reading_optimizer_state_as_tensors_is_told_where_the_values_are():
    """``optimizer.state`` lists offloaded keys without tensors (Lightning would copy them to
    the device on resume); code written for torch's AdamW that reads them as tensors gets an
    error naming ``offloaded_state``, which gives the values, while copies and pickles of the
    state still work."""
    params = make_params()
    opt = OffloadAdamW(params)
    step_together([opt], [params], torch.Generator().manual_seed(12), 1)
    placeholder = opt.state[params[0]]["exp_avg_sq"]
    for read in (
        lambda: placeholder.sqrt(),
        lambda: torch.norm(placeholder),
        lambda: placeholder._version,
    ):
        with pytest.raises(AttributeError, match=r"offloaded_state\(param\)\['exp_avg_sq'\]"):
            read()
    assert repr(copy.deepcopy(opt.state[params[0]])["exp_avg_sq"]) == repr(placeholder)
    assert repr(pickle.loads(pickle.dumps(placeholder))) == repr(placeholder)
    assert torch.equal(
        opt.offloaded_state(params[0])["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"]
    )
