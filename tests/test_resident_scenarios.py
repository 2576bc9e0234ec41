"""OffloadAdamW(resident=...) in scenarios a demanding user hits, on the staged pipeline
(``force_staging=True``) under the stream-ordering checker, against
``torch.optim.AdamW(fused=True)`` on the same inputs (bit-identical).

Covers what test_resident.py does not: param groups added after some steps (the resident choice
is made again), parameters that first get a gradient late, loads mid-training into another share
(with overlap, between a step and the next forward and between a forward and its backward),
reads of the state and copies of the optimizer between an overlapped step and the next forward,
amsgrad with bf16 and complex parameters, gaps around the end of the resident state,
accumulated gradients zeroed in place, steps that are all resident or have no resident chunk,
FSDP2, byte budgets / "auto" at their edges, and a resume keeping the parameters the
forward pass uses first (laid out in another order).
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import (
    MasterCopyAdamW,
    assert_same,
    clone_params,
    make_params,
    set_grads,
    step_together,
)
from torch import nn

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim import resident as resident_module

SHAPES = [(64, 3), (100,), (64, 5), (7,), (640,)]  # 192, 100, 320, 7, 640 elements
NUMELS = [192, 100, 320, 7, 640]
LR = 0.05


def staged(params, chunk_size=128, **kwargs) -> OffloadAdamW:
    kwargs.setdefault("lr", LR)
    return OffloadAdamW(params, force_staging=True, chunk_size=chunk_size, **kwargs)


def reference_for(params, **kwargs) -> torch.optim.AdamW:
    kwargs.setdefault("lr", LR)
    return torch.optim.AdamW(params, fused=True, **kwargs)


def mlp(seed: int = 0) -> nn.Sequential:
    """192 + 24 | 384 + 16 | 128 + 8 elements in three Linear layers."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 8)
    )


def mlp_pair(resident, overlap: bool = True):
    """An MLP with OffloadAdamW (staged, lr 1e-3) and its twin with torch's; overlapped if
    ``overlap``."""
    model, twin = mlp(), mlp()
    ours = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=resident)
    if overlap:
        ours.overlap_with(model)
    return model, twin, ours, reference_for(twin.parameters(), lr=1e-3)


def batch(generator: torch.Generator) -> torch.Tensor:
    return torch.randn(5, 8, generator=generator)


def train(pairs, generator: torch.Generator, steps: int, set_to_none: bool = True) -> None:
    """``steps`` times: the same batch through every (model, optimizer), backward, step,
    zero_grad."""
    for _ in range(steps):
        x = batch(generator)
        for model, optimizer in pairs:
            model(x).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)


def assert_same_state(ours: OffloadAdamW, theirs: torch.optim.Optimizer) -> None:
    """Every moment and step count of ``ours.state_dict()`` equals torch's."""
    saved, expected = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert sorted(saved) == sorted(expected)
    for index, entry in expected.items():
        for key, value in entry.items():
            mine = saved[index][key]
            assert torch.equal(mine.float().cpu(), value.float().cpu()), (index, key)


def resident_bytes(opt: OffloadAdamW) -> int:
    return opt.memory_stats()["resident_bytes"]


# ------------------------------------------------------------- 1. param groups added late
def test_add_param_group_after_some_steps_chooses_again(stream_order):
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params[:3], resident=0.5)
    theirs = reference_for(reference[:3])
    generator = torch.Generator().manual_seed(0)
    step_together([ours, theirs], [params, reference], generator, 3)
    # 0.5 of 8 * 612 bytes: parameters 0 and 1 (8 * 292 bytes) fit, parameter 2 does not.
    assert resident_bytes(ours) == 8 * 292
    for opt, group in ((ours, params[3:]), (theirs, reference[3:])):
        opt.add_param_group({"params": group, "lr": 0.02, "weight_decay": 0.0})
    step_together([ours, theirs], [params, reference], generator, 4)
    stream_order.expect_none()
    # 0.5 of 8 * 1259 bytes = 5036: the first arena whole (4896), then parameter 3 (56).
    assert resident_bytes(ours) == 8 * (612 + 7)
    assert_same(params, reference)
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_add_param_group_of_a_model_layer_with_overlap(stream_order, overlap):
    model, twin = mlp(), mlp()
    ours = OffloadAdamW(
        [*model[0].parameters(), *model[2].parameters()],
        force_staging=True,
        chunk_size=64,
        resident=0.5,
    )
    theirs = reference_for([*twin[0].parameters(), *twin[2].parameters()], lr=1e-3)
    if overlap:
        ours.overlap_with(model)
    generator = torch.Generator().manual_seed(1)
    train([(model, ours), (twin, theirs)], generator, 3)
    before = resident_bytes(ours)
    assert before > 0
    ours.add_param_group({"params": list(model[4].parameters()), "lr": 3e-3})
    theirs.add_param_group({"params": list(twin[4].parameters()), "lr": 3e-3})
    train([(model, ours), (twin, theirs)], generator, 4)
    model(batch(generator))  # the next forward pass waits for the last updates
    stream_order.expect_none()
    assert resident_bytes(ours) > before
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_layer_first_trained_at_step_five(stream_order, overlap):
    model, twin, ours, theirs = mlp_pair(0.6, overlap)
    for net in (model, twin):
        net[2].requires_grad_(False)
    generator = torch.Generator().manual_seed(2)
    train([(model, ours), (twin, theirs)], generator, 4)
    first = resident_bytes(ours)
    for net in (model, twin):
        net[2].requires_grad_(True)
    train([(model, ours), (twin, theirs)], generator, 4)
    model(batch(generator))
    stream_order.expect_none()
    assert first > 0 and resident_bytes(ours) > first
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same_state(ours, theirs)


# ------------------------------------------------------------- 2. loads mid-training
def source_state(share, seed: int, frozen_layer: int | None = None) -> dict:
    """A state dict of an OffloadAdamW (``share`` resident, overlapped) trained on other data,
    taken between an overlapped step and the next forward pass."""
    model = mlp()
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=share)
    opt.overlap_with(model)
    if frozen_layer is not None:
        model[frozen_layer].requires_grad_(False)
    train([(model, opt)], torch.Generator().manual_seed(seed), 3)
    return copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize(
    ("source", "target"), [(0.0, 0.7), (0.7, 0.0), (0.5, 0.5)], ids=["0-0.7", "0.7-0", "0.5-0.5"]
)
@pytest.mark.parametrize("when", ["after_step", "after_forward"])
def test_load_mid_training_into_another_share_with_overlap(stream_order, source, target, when):
    model, twin, ours, theirs = mlp_pair(target)
    pairs = [(model, ours), (twin, theirs)]
    generator = torch.Generator().manual_seed(3)
    train(pairs, generator, 3)
    saved = source_state(source, seed=10)
    if when == "after_step":  # between an overlapped step and the next forward pass
        ours.load_state_dict(copy.deepcopy(saved))
        theirs.load_state_dict(copy.deepcopy(saved))
        train(pairs, generator, 3)
    else:  # after a forward pass (its copies of the next chunks are queued), before backward
        x = batch(generator)
        losses = [net(x).pow(2).sum() for net in (model, twin)]
        ours.load_state_dict(copy.deepcopy(saved))
        theirs.load_state_dict(copy.deepcopy(saved))
        for loss, (_, opt) in zip(losses, pairs, strict=True):
            loss.backward()
            opt.step()
            opt.zero_grad()
        train(pairs, generator, 2)
    model(batch(generator))
    stream_order.expect_none()
    if target:
        assert resident_bytes(ours) > 0
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("target", [0.5, 1.0])
def test_load_in_place_of_own_earlier_state_with_overlap(stream_order, target):
    """Back to an earlier checkpoint of the same optimizer (written into its buffers in place)."""
    model, twin, ours, theirs = mlp_pair(target)
    pairs = [(model, ours), (twin, theirs)]
    generator = torch.Generator().manual_seed(4)
    train(pairs, generator, 2)
    saved = copy.deepcopy(ours.state_dict())
    buffers = [id(a) for a in ours._host.arenas]
    train(pairs, generator, 3)
    ours.load_state_dict(copy.deepcopy(saved))
    theirs.load_state_dict(copy.deepcopy(saved))
    assert [id(a) for a in ours._host.arenas] == buffers  # written in place
    train(pairs, generator, 3)
    model(batch(generator))
    stream_order.expect_none()
    assert resident_bytes(ours) > 0
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same_state(ours, theirs)


def test_load_of_fewer_parameters_lays_state_out_anew_and_chooses_again(stream_order):
    """A checkpoint without state for one layer (frozen there) cannot be written in place: new
    host buffers, so the resident prefix is chosen again; twice in a row as well."""
    model, twin, ours, theirs = mlp_pair(0.5)
    pairs = [(model, ours), (twin, theirs)]
    generator = torch.Generator().manual_seed(5)
    train(pairs, generator, 3)
    assert resident_bytes(ours) > 0
    for seed in (11, 12):  # two loads before any step
        saved = source_state(0.3, seed=seed, frozen_layer=2)
        ours.load_state_dict(copy.deepcopy(saved))
        theirs.load_state_dict(copy.deepcopy(saved))
    train(pairs, generator, 3)
    model(batch(generator))
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same_state(ours, theirs)
    # Half the state that now exists stays resident whatever arenas the loads left behind.
    total = ours.memory_stats()["state_bytes"]
    assert 0 < resident_bytes(ours) <= total // 2


# ------------------------------------------------------------- 3. reads and copies
def test_reads_between_an_overlapped_step_and_the_next_forward(stream_order):
    model, twin, ours, theirs = mlp_pair(0.5)
    pairs = [(model, ours), (twin, theirs)]
    generator = torch.Generator().manual_seed(6)
    for _ in range(4):
        train(pairs, generator, 1)  # ends after a step, before the next forward
        stats = ours.memory_stats()
        assert stats["resident_bytes"] <= stats["state_bytes"] // 2
        assert_same_state(ours, theirs)
        for p, r in zip(model.parameters(), twin.parameters(), strict=True):
            state = ours.offloaded_state(p)
            assert_same(
                [state["exp_avg"], state["exp_avg_sq"]],
                [theirs.state[r]["exp_avg"], theirs.state[r]["exp_avg_sq"]],
            )
    assert resident_bytes(ours) > 0
    model(batch(generator))
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(twin.parameters()))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_of_an_overlapped_resident_optimizer_step_alike(stream_order, how):
    model, twin, ours, theirs = mlp_pair(0.5)
    generator = torch.Generator().manual_seed(7)
    train([(model, ours), (twin, theirs)], generator, 3)
    # Between an overlapped step and the next forward pass: copying waits by itself.
    if how == "deepcopy":
        copied = copy.deepcopy(ours)
    elif how == "pickle":
        copied = pickle.loads(pickle.dumps(ours))
    else:
        buffer = io.BytesIO()
        torch.save(ours, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert copied.resident == 0.5
    copy_params = [p for g in copied.param_groups for p in g["params"]]
    assert_same(copy_params, list(twin.parameters()))
    for _ in range(3):
        x = batch(generator)
        model(x).pow(2).sum().backward()
        twin(x).pow(2).sum().backward()
        for c, p in zip(copy_params, model.parameters(), strict=True):
            c.grad = p.grad.clone()
        for opt in (ours, theirs, copied):
            opt.step()
            opt.zero_grad()
    model(batch(generator))
    stream_order.expect_none()
    assert resident_bytes(copied) > 0
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same(copy_params, list(twin.parameters()))
    assert_same_state(copied, theirs)
    assert_same_state(ours, theirs)


# ------------------------------------------------------------- 4. amsgrad, bf16, complex, gaps
def test_amsgrad_bf16_and_complex_parameters_with_a_resident_share(stream_order):
    bf16 = make_params([(64, 3), (33,), (100,)], dtype=torch.bfloat16, seed=1)
    fp32 = make_params([(50,), (7, 9)], seed=2)
    cplx = make_params([(40, 3), (7,)], dtype=torch.complex64, seed=3)
    masters = [nn.Parameter(p.detach().float()) for p in bf16]
    fp32_ref = clone_params(fp32)
    cplx_ref = [nn.Parameter(torch.view_as_real(p.detach()).clone()) for p in cplx]
    ours = staged(
        [
            {"params": bf16, "amsgrad": True},
            {"params": fp32, "weight_decay": 0.1},
            {"params": cplx, "amsgrad": True},
        ],
        resident=0.5,
    )
    theirs = reference_for(
        [
            {"params": masters, "amsgrad": True},
            {"params": fp32_ref, "weight_decay": 0.1},
            {"params": cplx_ref, "amsgrad": True},
        ]
    )
    generator = torch.Generator().manual_seed(8)
    for step in range(6):
        skip = {1} if step % 2 else {4}  # gaps: the second bf16 and second fp32 parameters
        for i, (p, r) in enumerate(
            zip([*bf16, *fp32, *cplx], [*masters, *fp32_ref, *cplx_ref], strict=True)
        ):
            if i in skip:
                p.grad = r.grad = None
                continue
            p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            r.grad = torch.view_as_real(p.grad).clone() if p.is_complex() else p.grad.to(r.dtype)
        ours.step()
        theirs.step()
    stream_order.expect_none()
    assert 0 < resident_bytes(ours) <= ours.memory_stats()["state_bytes"] // 2
    assert_same(bf16, [m.detach().to(torch.bfloat16) for m in masters])
    assert_same(fp32, fp32_ref)
    assert_same([torch.view_as_real(p) for p in cplx], cplx_ref)
    for p, r in zip([*bf16, *cplx], [*masters, *cplx_ref], strict=True):
        state = ours.offloaded_state(p)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            mine = torch.view_as_real(state[key]) if p.is_complex() else state[key]
            assert_same([mine], [theirs.state[r][key]])
        if p.dtype == torch.bfloat16:
            assert_same([state["master_param"]], [r])


@pytest.mark.parametrize("amsgrad", [False, True])
def test_gaps_around_the_end_of_the_resident_prefix(stream_order, amsgrad):
    """Byte budget ending after parameter 1 (of 5): parameters on either side of the boundary,
    and the first one, go without gradients on some steps."""
    keys = 3 if amsgrad else 2
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident=4 * keys * (192 + 100), amsgrad=amsgrad)
    theirs = reference_for(reference, amsgrad=amsgrad)
    generator = torch.Generator().manual_seed(9)
    gaps = [set(), set(), {1}, {2}, {1, 2}, {0}, {0, 1}, set(), {0, 1, 3}, set()]
    for step_gaps in gaps:
        set_grads([params, reference], generator, skip=lambda i, g=step_gaps: i in g)
        ours.step()
        theirs.step()
        if step_gaps == {1, 2}:
            assert_same_state(ours, theirs)  # a read in between flushes the resident part
    stream_order.expect_none()
    assert resident_bytes(ours) == 4 * keys * (192 + 100)
    assert_same(params, reference)
    assert_same_state(ours, theirs)


# ------------------------------------------------------------- 5. accumulation, all / none
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_accumulated_gradients_zeroed_in_place(stream_order, overlap):
    model, twin, ours, theirs = mlp_pair(0.5, overlap)
    generator = torch.Generator().manual_seed(10)
    for _ in range(4):
        for _ in range(3):  # three micro-batches per step
            x = batch(generator)
            for net in (model, twin):
                net(x).pow(2).sum().backward()
        for opt in (ours, theirs):
            opt.step()
            opt.zero_grad(set_to_none=False)
    model(batch(generator))
    stream_order.expect_none()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert resident_bytes(ours) > 0
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_steps_all_resident_and_without_any_resident_chunk(stream_order, overlap):
    """resident=1.0: nothing is copied once chosen. A byte budget holding layer 0 only, with
    layer 0 frozen on some steps: those steps have no resident chunk."""
    model, twin, everything, theirs = mlp_pair(1.0, overlap)
    generator = torch.Generator().manual_seed(11)
    train([(model, everything), (twin, theirs)], generator, 3)
    moved = everything.last_step.resolve()
    assert moved.bytes_in == moved.bytes_out == 0
    assert resident_bytes(everything) == everything.memory_stats()["state_bytes"]
    model(batch(generator))
    assert_same(list(model.parameters()), list(twin.parameters()))

    model2, twin2 = mlp(1), mlp(1)
    layer0 = 8 * (192 + 24)
    some = OffloadAdamW(model2.parameters(), force_staging=True, chunk_size=64, resident=layer0)
    theirs2 = reference_for(twin2.parameters(), lr=1e-3)
    if overlap:
        some.overlap_with(model2)
    pairs = [(model2, some), (twin2, theirs2)]
    train(pairs, generator, 2)
    for frozen in (True, True, False, True, False):
        for net in (model2, twin2):
            net[0].requires_grad_(not frozen)
        train(pairs, generator, 1)
        if frozen:  # no resident chunk in this step: all of the rest was copied
            moved = some.last_step.resolve()
            # (with overlap, bytes_in also counts copies queued after the forward pass for the
            # last step's plan, which a changed plan does not use)
            assert moved.bytes_out == some.memory_stats()["state_bytes"] - layer0
            assert moved.bytes_in >= moved.bytes_out
    model2(batch(generator))
    stream_order.expect_none()
    assert resident_bytes(some) == layer0
    assert_same(list(model2.parameters()), list(twin2.parameters()))
    assert_same_state(some, theirs2)


# ------------------------------------------------------------- 6. FSDP2
@pytest.mark.no_stream_check  # checked below, around our optimizer only
def test_fsdp2_with_a_resident_share_and_overlap(mesh):
    from stream_checker import StreamChecker
    from torch.distributed.fsdp import fully_shard

    def sharded() -> nn.Module:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
        model = nn.Sequential(*blocks)
        for block in model:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model, reference = sharded(), sharded()
    torch_opt = torch.optim.AdamW(reference.parameters(), fused=True)
    generator = torch.Generator().manual_seed(12)
    inputs = [torch.randn(2, 8, generator=generator) for _ in range(4)]
    for x in inputs:
        reference(x).sum().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    with StreamChecker() as checker:
        opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=0.5)
        opt.overlap_with(model)
        for x in inputs:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        saved = opt.state_dict()
        model(inputs[0])
        opt.wait_for_updates()
    checker.expect_none()
    assert 0 < opt.memory_stats()["resident_bytes"] <= opt.memory_stats()["state_bytes"] // 2
    assert_same(
        [p.full_tensor() for p in model.parameters()],
        [p.full_tensor() for p in reference.parameters()],
    )
    expected = torch_opt.state_dict()["state"]
    for index, entry in expected.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same([saved["state"][index][key].full_tensor()], [entry[key].full_tensor()])


# ------------------------------------------------------------- 7. budgets
@pytest.mark.parametrize(
    ("budget", "expected"),
    [(8 * 192 - 1, 8 * 107), (8 * 192, 8 * 192), (8 * (192 + 100 + 320), 8 * 612), (0, 0)],
    # below the first: the second and fourth parameters (apart on the host) are kept instead
    ids=["below-first", "first-exactly", "three-exactly", "zero"],
)
def test_byte_budgets_at_parameter_boundaries(stream_order, budget, expected):
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident=budget)
    theirs = reference_for(reference)
    generator = torch.Generator().manual_seed(13)
    step_together([ours, theirs], [params, reference], generator, 4)
    stream_order.expect_none()
    assert resident_bytes(ours) == expected
    moved = ours.last_step.resolve()
    assert moved.bytes_in == 8 * sum(NUMELS) - expected
    assert_same(params, reference)
    assert_same_state(ours, theirs)


@pytest.mark.parametrize("change", ["shrinks", "grows"])
def test_auto_follows_free_memory_when_it_chooses_again(stream_order, monkeypatch, change):
    """ "auto" chooses at step 2 with some memory free, and again when a parameter first gets a
    gradient (new arena), with less or more free then."""
    gib = 1 << 30
    free = {"bytes": 2 * gib + 8 * 292}  # parameters 0 and 1 fit
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident="auto")
    monkeypatch.setattr(
        resident_module,
        "free_device_memory",
        lambda device: free["bytes"] - ours.memory_stats()["resident_bytes"],
    )
    monkeypatch.setattr(resident_module, "total_memory", lambda device: 10 * gib)
    theirs = reference_for(reference)
    generator = torch.Generator().manual_seed(14)
    for _ in range(3):
        set_grads([params, reference], generator, skip=lambda i: i == 3)
        ours.step()
        theirs.step()
    assert resident_bytes(ours) == 8 * 292
    free["bytes"] = 2 * gib + (8 * 192 if change == "shrinks" else 8 * 1000)
    for _ in range(3):  # parameter 3 joins (a new arena): "auto" chooses again
        set_grads([params, reference], generator)
        ours.step()
        theirs.step()
    stream_order.expect_none()
    # shrinks: parameter 0 only; grows: the first arena's first three parameters (8 * 612 B),
    # then the new arena's parameter 3 (56 B) within the 8000 B.
    assert resident_bytes(ours) == (8 * 192 if change == "shrinks" else 8 * (612 + 7))
    assert_same(params, reference)
    assert_same_state(ours, theirs)


# ------------------------------------------------------------- 8. which parameters
class Reversed(nn.Module):
    """Three Linear layers declared in the reverse of the order the forward pass uses them:
    ``first`` 192 + 24, ``middle`` 384 + 16, ``last`` 128 + 8 elements."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.last, self.middle, self.first = nn.Linear(16, 8), nn.Linear(24, 16), nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def resident_names(opt: OffloadAdamW, model: nn.Module) -> set[str]:
    """The parameters whose state ``opt`` keeps resident on the device."""
    names = set()
    for name, param in model.named_parameters():
        slot = opt._host.slots.get(param)
        stop = None if slot is None else slot.offset + slot.layout.numel
        if slot is not None and slot.arena.resident.device_start(slot.offset, stop) is not None:
            names.add(name)
    return names


def test_a_resume_keeps_the_parameters_the_forward_pass_uses_first(stream_order):
    """A resume lays the state out in parameter (declaration) order, before any forward pass;
    the resident choice still follows the forward order, as in the uninterrupted run: 0.3 of
    the state keeps ``first`` (216 elements) and, in what is left, ``last.bias`` (8), which lie
    apart on the host then. Bit-identical to torch through the resume, a state dict taken
    between steps (resident state written back range by range) and the steps after it."""
    model, twin = Reversed(), Reversed()
    ours = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=0.3)
    ours.overlap_with(model)
    theirs = reference_for(twin.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(21)
    train([(model, ours), (twin, theirs)], generator, 3)
    kept = {"first.weight", "first.bias", "last.bias"}
    assert resident_names(ours, model) == kept
    saved, saved_torch = copy.deepcopy(ours.state_dict()), copy.deepcopy(theirs.state_dict())

    resumed, resumed_twin = Reversed(), Reversed()
    resumed.load_state_dict(model.state_dict())
    resumed_twin.load_state_dict(twin.state_dict())
    again = OffloadAdamW(resumed.parameters(), force_staging=True, chunk_size=64, resident=0.3)
    again.overlap_with(resumed)
    again.load_state_dict(saved)
    again_torch = reference_for(resumed_twin.parameters(), lr=1e-3)
    again_torch.load_state_dict(saved_torch)
    slots = again._host.slots
    assert slots[resumed.last.weight].offset < slots[resumed.first.weight].offset  # declared
    for steps in (2, 2):
        train([(model, ours), (resumed, again), (resumed_twin, again_torch)], generator, steps)
        assert resident_names(again, resumed) == kept
        assert resident_bytes(again) == resident_bytes(ours) == 8 * (216 + 8)
        assert_same_state(again, again_torch)  # between a step and the next forward
    resumed(batch(generator))
    ours.wait_for_updates()
    stream_order.expect_none()
    assert_same(list(resumed.parameters()), list(resumed_twin.parameters()))
    assert_same(list(resumed.parameters()), list(model.parameters()))


def test_steps_after_the_choice_never_block_the_host(stream_order, monkeypatch):
    """The resident choice waits for the host buffers once (at the second step; after a resume,
    at its first); overlapped steps and forward passes after it never wait for an event on the
    host, which on a GPU would stall the queue the overlap depends on. Nor does an evaluation
    forward pass that first uses a module (the order it records grows, the choice stays)."""
    from stream_checker import SimEvent

    waits = []
    synchronize = SimEvent.synchronize
    monkeypatch.setattr(SimEvent, "synchronize", lambda e: (waits.append(e), synchronize(e)))
    generator = torch.Generator().manual_seed(22)

    def run(steps: int, resume_from: dict | None = None) -> OffloadAdamW:
        net = nn.ModuleDict({"body": Reversed(), "probe": nn.Linear(8, 2)})
        opt = OffloadAdamW(net.parameters(), force_staging=True, chunk_size=64, resident=0.3)
        opt.overlap_with(net)
        if resume_from is not None:
            opt.load_state_dict(resume_from)
        first = 1 if resume_from is not None else 2  # the steps up to the choice may wait
        train([(net["body"], opt)], generator, first)
        waits.clear()
        train([(net["body"], opt)], generator, steps)
        with torch.no_grad():
            net["probe"](batch(generator))  # first used: the forward order grows
        train([(net["body"], opt)], generator, steps)
        assert waits == []
        assert resident_bytes(opt) == 8 * (216 + 8)
        net["body"](batch(generator))
        return opt

    saved = run(2).state_dict()
    run(2, resume_from=saved)
    stream_order.expect_none()


class LayerDrop(nn.Module):
    """Eight layers of 64 x 64 + 64; the forward pass skips layer ``skip``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))

    def forward(self, x: torch.Tensor, skip: int | None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x.pow(2).sum()


def test_layers_skipped_in_turn_keep_the_choice(stream_order, monkeypatch):
    """Gradients zeroed in place (so a skipped layer still steps, with a zero gradient): each
    step skips another layer, which the overlap then updates first ("early", not reached by
    its hook). That is not a new first use: the resident choice stays, with no host wait, no
    re-upload, and the bytes moved stay those of the other half. Bit-identical to torch."""
    from stream_checker import SimEvent

    waits = []
    synchronize = SimEvent.synchronize
    monkeypatch.setattr(SimEvent, "synchronize", lambda e: (waits.append(e), synchronize(e)))
    model, twin = LayerDrop(), LayerDrop()
    ours = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=4096, resident=0.5)
    ours.overlap_with(model)
    theirs = reference_for(twin.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(23)
    half = 8 * 4 * (64 * 64 + 64)  # four layers' moments
    for step in range(10):
        waits.clear()
        x = torch.randn(4, 64, generator=generator)
        skip = 9 - step if step >= 2 else None
        for net, optimizer in ((model, ours), (twin, theirs)):
            net(x, skip).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        if step >= 2:  # the choice (at the second step) waits for the host buffers
            assert waits == []
        if step >= 1:
            assert resident_bytes(ours) == half
            assert ours.last_step.resolve().bytes_out == half  # resolve() waits
    assert len(ours._overlap.early) == 2 * 8  # every layer's weight and bias, in turn
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same_state(ours, theirs)


def test_a_resume_keeps_the_same_parameters_outside_the_forward_pass():
    """Parameters that no forward hook reaches (outside the overlapped module) tie in the forward
    order; the tie goes by the param groups' order, not by where the state lies (forward order
    uninterrupted, declaration order after a resume): both runs keep the same one. The budget
    keeps the four layer tensors and then a bf16 vector (its master copy is a third key) or an
    fp32 one, not both. Both runs train as torch fused AdamW on fp32 masters does."""

    def build_weights():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        vectors = [
            nn.Parameter(torch.randn(64, dtype=torch.bfloat16)),
            nn.Parameter(torch.randn(64)),
        ]
        return model, vectors

    def build():
        model, vectors = build_weights()
        opt = OffloadAdamW(
            [vectors[0], *model.parameters(), vectors[1]],
            force_staging=True,
            chunk_size=64,
            resident=8 * (2 * 72) + 12 * 64,
        )
        opt.overlap_with(model)
        return model, vectors, opt

    def train_on(model, vectors, opt, inputs):
        for x in inputs:
            loss = model(x).pow(2).sum()
            (loss + sum((v.float() * x.mean()).pow(2).sum() for v in vectors)).backward()
            opt.step()
            opt.zero_grad()

    generator = torch.Generator().manual_seed(24)
    inputs = [torch.randn(4, 8, generator=generator) for _ in range(6)]
    model, vectors, opt = build()
    train_on(model, vectors, opt, inputs[:3])
    saved = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy([*model.parameters(), *vectors])
    train_on(model, vectors, opt, inputs[3:])
    resumed, resumed_vectors, again = build()
    with torch.no_grad():
        for param, weight in zip([*resumed.parameters(), *resumed_vectors], weights, strict=True):
            param.copy_(weight)
    again.load_state_dict(saved)
    train_on(resumed, resumed_vectors, again, inputs[3:])
    for run, net, vecs in ((opt, model, vectors), (again, resumed, resumed_vectors)):
        net.vectors = nn.ParameterList(vecs)  # named for resident_names
        assert resident_names(run, net) == {"0.weight", "0.bias", "1.weight", "1.bias", "vectors.0"}
        run.wait_for_updates()
    reference, reference_vectors = build_weights()
    params = [reference_vectors[0], *reference.parameters(), reference_vectors[1]]
    train_on(reference, reference_vectors, MasterCopyAdamW(params, lr=1e-3), inputs)
    expected = [*reference.parameters(), *reference_vectors]
    assert_same(list(model.parameters()), expected)  # the vectors are registered last now
    assert_same(list(resumed.parameters()), expected)


# ------------------------------------------------- loads and edits through the state dict
def test_a_load_that_lays_state_out_anew_frees_the_old_state_with_overlap(stream_order):
    """A load that cannot write in place (the checkpoint has no state for one layer) replaces
    every arena: the last step's chunk plan, kept for the prefetch after the next forward, must
    not keep the old arenas (their host buffers and resident device buffers) alive, nor queue
    copies out of them."""
    import gc
    import weakref

    model, twin, ours, theirs = mlp_pair(0.5)
    pairs = [(model, ours), (twin, theirs)]
    generator = torch.Generator().manual_seed(15)
    train(pairs, generator, 3)
    old_arena = weakref.ref(ours._host.arenas[0])
    saved = source_state(0.3, seed=16, frozen_layer=2)
    ours.load_state_dict(copy.deepcopy(saved))
    theirs.load_state_dict(copy.deepcopy(saved))
    gc.collect()
    held_after_load = resident_bytes(ours)
    old_alive = old_arena() is not None
    train(pairs, generator, 1)
    bytes_in = ours.last_step.resolve().bytes_in
    train(pairs, generator, 2)
    model(batch(generator))
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert_same_state(ours, theirs)
    # The step after the load copies the new state in once (its resident part included).
    state_bytes = ours.memory_stats()["state_bytes"]
    assert (held_after_load, old_alive, bytes_in) == (0, False, state_bytes)


@pytest.mark.parametrize("share", [None, 0.5])
def test_state_dict_tensors_are_references_to_the_state_as_torch_s(stream_order, share):
    """torch's state_dict() tensors are its live state: an edit through them changes the next
    step. Ours are views of the host buffers; the resident part must be reloaded from them."""
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident=share)
    theirs = reference_for(reference)
    generator = torch.Generator().manual_seed(17)
    step_together([ours, theirs], [params, reference], generator, 3)
    for opt in (ours, theirs):
        for entry in opt.state_dict()["state"].values():
            entry["exp_avg"].mul_(0.5)
            entry["exp_avg_sq"].mul_(2.0)
    step_together([ours, theirs], [params, reference], generator, 2)
    stream_order.expect_none()
    assert_same(params, reference)
    assert_same_state(ours, theirs)


def test_the_step_span_ends_after_a_resident_update_queued_last(stream_order):
    """The resident parameter lies after the staged one on the host, so its update is queued
    after the last copy-out: the step's timed span must still end after it (the monitor's step
    time would leave it out)."""
    params = make_params([(640,), (7,)])
    ours = staged(params, resident=8 * 7)
    step_together([ours], [params], torch.Generator().manual_seed(0), 3)
    assert resident_bytes(ours) == 8 * 7
    chunks = next(iter(ours._plans.values()))
    assert [chunk.resident for chunk in chunks][-1]  # the resident chunk comes last
    [(_, _, end)] = [span for span in ours.last_step._events if span[0] == "step"]
    for update in ours._pipeline.updated:
        assert all(end.clock.get(k, -1) >= tick for k, tick in update.clock.items())
