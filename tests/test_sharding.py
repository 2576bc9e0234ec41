"""DTensor handling on one process (a 1-rank gloo group): state dict tensors that view the host
buffers on a mesh of any device type, and loaded tensors turned into this rank's part.

The 2-rank runs against torch AdamW are in test_sharded.py; these cover what they cannot.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conftest import MasterCopyAdamW, assert_same, sequence_parallel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim.sharding import like_param

pytestmark = pytest.mark.no_stream_check  # DTensor dispatch under the checker's recording mode


def dtensor_params(mesh, shapes, seed=0):
    """Parameters of ``shapes`` sharded on dimension 0 over ``mesh``."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=generator), mesh, [Shard(0)]))
        for s in shapes
    ]


def trained(mesh, shape=(6, 5)):
    (param,) = dtensor_params(mesh, [shape])
    opt = OffloadAdamW([param], lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        param.grad = distribute_tensor(torch.randn(shape, generator=generator), mesh, [Shard(0)])
        opt.step()
    return opt, param


def test_state_wraps_host_memory_whatever_the_mesh_device(mesh):
    """On a CUDA mesh, DTensor.from_local would copy host state to the GPU; the state must stay
    a view of the host buffer. (A mesh claiming another device type stands in for CUDA.)"""
    _, param = trained(mesh)
    other = copy.copy(mesh)
    other._device_type = "meta"
    on_other = DTensor.from_local(param.to_local(), other, param.placements, run_check=False)
    host = torch.zeros(param.shape)
    wrapped = like_param(on_other, host)
    assert wrapped.to_local().data_ptr() == host.data_ptr()
    assert wrapped.device_mesh is other and wrapped.placements == param.placements
    assert wrapped.shape == param.shape and wrapped.stride() == param.stride()


def test_state_dict_views_the_host_buffers_and_copies_of_it_own_their_memory(mesh):
    opt, _ = trained(mesh)
    entry = opt.state_dict()["state"][0]
    moment = entry["exp_avg"]
    assert isinstance(moment, DTensor) and opt._host.overlaps(moment.to_local())
    buffer = io.BytesIO()
    torch.save(entry, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(entry), torch.load(buffer, weights_only=True)):
        assert not opt._host.overlaps(copied["exp_avg"].to_local())
        assert_same([copied["exp_avg"].to_local()], [moment.to_local()])


@pytest.mark.parametrize(
    "convert",
    [
        lambda t: t.full_tensor(),
        lambda t: t.redistribute(t.device_mesh, [Replicate()]),
        lambda t: DTensor.from_local(t.to_local().clone(), t.device_mesh, t.placements),
    ],
    ids=["full-tensor", "replicated", "same-sharding"],
)
def test_loaded_full_and_replicated_tensors_are_taken_on_one_rank(mesh, convert):
    """On this 1-rank mesh a rank's part is the whole tensor: this checks that each form is
    accepted and loaded whole. Taking a rank's slice of it is checked on 2 ranks
    (``tests/test_sharded.py``: ``plain_full_tensors``, ``replicated_dtensors``)."""
    opt, param = trained(mesh)
    saved = opt.state_dict()
    expected = {k: v.full_tensor().clone() for k, v in saved["state"][0].items() if k != "step"}
    fresh = OffloadAdamW([param], lr=0.1)
    fresh.load_state_dict(
        {
            **saved,
            "state": {
                0: {k: v if k == "step" else convert(v) for k, v in saved["state"][0].items()}
            },
        }
    )
    loaded = fresh.offloaded_state(param)
    for key, value in expected.items():
        assert_same([loaded[key].full_tensor()], [value])


def test_state_sharded_otherwise_is_refused_naming_the_way_to_reshard(mesh):
    opt, param = trained(mesh, shape=(4, 4))
    saved = opt.state_dict()
    before = opt.offloaded_state(param)["exp_avg"].full_tensor()
    entry = saved["state"][0]
    entry["exp_avg"] = DTensor.from_local(entry["exp_avg"].to_local().clone(), mesh, [Shard(1)])
    refusal = r"loaded 'exp_avg' for parameter 0 .*Shard\(dim=1\).*torch.distributed.checkpoint"
    with pytest.raises(ValueError, match=refusal):
        opt.load_state_dict(saved)
    assert_same([opt.offloaded_state(param)["exp_avg"].full_tensor()], [before])


def test_fsdp2_overlapped_steps_wait_before_each_units_all_gather(mesh):
    """FSDP2 all-gathers a unit's shards in the unit's pre-forward hook, before any leaf's
    forward: the overlap waits there, for the whole unit. Same results as torch AdamW."""
    from stream_checker import StreamChecker
    from torch.distributed.fsdp import fully_shard

    def sharded() -> torch.nn.Module:
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)]
        model = torch.nn.Sequential(*blocks)
        for block in model:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model, reference = sharded(), sharded()
    torch_opt = torch.optim.AdamW(reference.parameters(), fused=True)
    x = torch.ones(2, 8)
    for _ in range(3):
        reference(x).sum().backward()
        torch_opt.step()
        torch_opt.zero_grad()
    with StreamChecker() as checker:
        opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
        opt.overlap_with(model)
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        model(x)
        opt.wait_for_updates()
    checker.expect_none()
    ours = [p.full_tensor() for p in model.parameters()]
    assert_same(ours, [p.full_tensor() for p in reference.parameters()])


@pytest.mark.parametrize("reshard", [True, False], ids=["resharded", "kept-gathered"])
def test_fsdp2_backward_through_a_graph_recorded_before_the_step_after_a_wait(mesh, reshard):
    """Under FSDP2 autograd cannot refuse a backward through a graph recorded before an
    overlapped step (it saved the gathered copies, not the sharded parameters, whose versions
    the step moves), so limitations.md asks for ``wait_for_updates()`` before it: then the
    backward's all-gathers are ordered and it uses the new weights, as after torch's fused
    AdamW."""
    from stream_checker import StreamChecker
    from torch.distributed.fsdp import fully_shard

    def sharded() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    def train(model, optimizer, wait) -> None:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            out = model(x)
            out.pow(2).mean().backward(retain_graph=True)
            optimizer.step()
            optimizer.zero_grad()
            wait()
            out.abs().mean().backward()  # the graph of the forward before the step
            optimizer.step()
            optimizer.zero_grad()

    model, reference = sharded(), sharded()
    train(reference, torch.optim.AdamW(reference.parameters(), fused=True), lambda: None)
    with StreamChecker() as checker:
        opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
        opt.overlap_with(model)
        train(model, opt, opt.wait_for_updates)
        opt.wait_for_updates()
    checker.expect_none()
    ours = [p.full_tensor() for p in model.parameters()]
    assert_same(ours, [p.full_tensor() for p in reference.parameters()])


def test_gradient_placed_otherwise_is_redistributed_and_unscaled_like_torch(mesh):
    """torch's fused AdamW redistributes a gradient to its parameter's placements (here
    Replicate to Shard(0), a view of the gradient) for the update, and under GradScaler's scale
    unscales that view in place; the offloaded step must leave parameters and gradients alike."""
    params = [dtensor_params(mesh, [(4, 3)])[0] for _ in range(2)]
    ours = OffloadAdamW(params[:1], lr=0.1, force_staging=True, chunk_size=64)
    reference = torch.optim.AdamW(params[1:], lr=0.1, fused=True)
    generator = torch.Generator().manual_seed(3)
    for step in range(3):
        grad = torch.randn(4, 3, generator=generator)
        for p in params:
            p.grad = distribute_tensor(grad.clone(), mesh, [Replicate()])
        if step == 2:
            for optimizer in (ours, reference):
                optimizer.grad_scale, optimizer.found_inf = torch.tensor(4.0), torch.tensor(0.0)
        ours.step()
        reference.step()
    assert_same([p.full_tensor() for p in params[:1]], [p.full_tensor() for p in params[1:]])
    assert params[0].grad.placements == (Replicate(),)
    assert_same([params[0].grad.to_local()], [params[1].grad.to_local()])
    assert not torch.equal(params[0].grad.to_local(), grad)  # unscaled, as torch's was


def test_gradient_on_another_mesh_is_refused(mesh):
    (param,) = dtensor_params(mesh, [(4, 3)])
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("other",))
    assert other != mesh
    opt = OffloadAdamW([param], lr=0.1)
    param.grad = distribute_tensor(torch.ones(4, 3), other, [Shard(0)])
    with pytest.raises(RuntimeError, match="needs a DTensor gradient on its mesh"):
        opt.step()


def test_sharded_gradient_of_a_plain_parameter_is_refused(mesh):
    param = torch.nn.Parameter(torch.randn(4, 3))
    opt = OffloadAdamW([param], lr=0.1)
    param.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match=r"is a DTensor .* the parameter a plain tensor"):
        opt.step()


@pytest.mark.parametrize(
    "shapes", [[(6, 5), (3, 7), (5,)], [(6, 5), (0, 3), (5,)]], ids=["dense", "empty"]
)
def test_state_of_parameters_past_the_first_saves_and_copies_like_torch(mesh, shapes):
    """Every parameter but the first has its state at an offset into the arena: saved,
    loaded and deep-copied state dicts hold torch AdamW's values (and no view of the host)."""
    params = dtensor_params(mesh, shapes)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OffloadAdamW(params, lr=0.1)
    torch_opt = torch.optim.AdamW(reference, lr=0.1, fused=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p, r in zip(params, reference, strict=True):
            g = torch.randn(p.shape, generator=generator)
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
            r.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        opt.step()
        torch_opt.step()
    ours, theirs = opt.state_dict()["state"], torch_opt.state_dict()["state"]
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(ours), torch.load(buffer, weights_only=True)):
        for index in range(len(shapes)):
            for key in ("exp_avg", "exp_avg_sq"):
                value = copied[index][key]
                assert isinstance(value, DTensor)
                assert not opt._host.overlaps(value.to_local())
                assert_same([value.full_tensor()], [theirs[index][key].full_tensor()])


def test_saved_dtensor_state_dict_is_the_size_of_torch_adamws(mesh):
    """``torch.save`` writes each local tensor's whole storage. The first parameter's state
    starts at offset 0 of a host buffer: its local tensor must not carry the whole buffer,
    or the file holds that buffer again beside every other parameter's state."""
    shapes = [(256, 64), (64,), (128, 32)]
    params = dtensor_params(mesh, shapes)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = OffloadAdamW(params, lr=0.1)
    torch_opt = torch.optim.AdamW(reference, lr=0.1, fused=True)
    for p, r in zip(params, reference, strict=True):
        p.grad = distribute_tensor(torch.ones(p.shape), mesh, [Shard(0)])
        r.grad = distribute_tensor(torch.ones(p.shape), mesh, [Shard(0)])
    opt.step()
    torch_opt.step()
    sizes = []
    for state_dict in (opt.state_dict(), torch_opt.state_dict()):
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        sizes.append(buffer.tell())
    ours, theirs = sizes
    assert ours <= 1.02 * theirs, f"saved {ours} bytes, torch AdamW {theirs}"


def test_state_of_low_precision_dtensor_parameters_is_float32_throughout(mesh):
    """bf16 parameters keep fp32 state: the DTensor's dtype must say so, as its shard does."""
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(
            distribute_tensor(
                torch.randn(s, generator=generator, dtype=torch.bfloat16), mesh, [Shard(0)]
            )
        )
        for s in [(6, 5), (3,)]
    ]
    opt = OffloadAdamW(params, lr=0.1)
    for p in params:
        p.grad = distribute_tensor(
            torch.randn(p.shape, generator=generator, dtype=torch.bfloat16), mesh, [Shard(0)]
        )
    opt.step()
    for entry in opt.state_dict()["state"].values():
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            value = entry[key]
            assert value.dtype == value.to_local().dtype == torch.float32
            assert value.full_tensor().dtype == torch.float32
    copied = copy.deepcopy(opt.state_dict())
    assert copied["state"][0]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize(
    "placement", [Shard(0), Replicate()], ids=["same-placements", "replicated"]
)
def test_state_on_another_mesh_is_refused(mesh, placement):
    """The parameter's own placements, or Replicate, on a mesh other than the parameter's say
    nothing of which rank holds what: refused, the state left as it was."""
    opt, param = trained(mesh, shape=(4, 4))
    saved = opt.state_dict()
    before = opt.offloaded_state(param)["exp_avg"].full_tensor()
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("other",))
    entry = saved["state"][0]
    entry["exp_avg"] = DTensor.from_local(
        entry["exp_avg"].to_local().clone() + 1, other, [placement]
    )
    with pytest.raises(ValueError, match=r"torch\.distributed\.checkpoint"):
        opt.load_state_dict(saved)
    assert_same([opt.offloaded_state(param)["exp_avg"].full_tensor()], [before])


def test_own_sharded_entries_swapped_between_parameters_are_loaded_right(mesh):
    """A DTensor state dict's local tensors are views that start inside the host buffers, not
    at their start. Two of them loaded swapped must still be seen to overlap the buffers:
    written in place one after the other, the second would read what the first overwrote."""
    params = dtensor_params(mesh, [(64,)] * 3)
    opt = OffloadAdamW(params, lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in params:
            p.grad = distribute_tensor(torch.randn(64, generator=generator), mesh, [Shard(0)])
        opt.step()
    saved = opt.state_dict()
    expected = {
        i: {k: v.full_tensor().clone() for k, v in entry.items() if k != "step"}
        for i, entry in saved["state"].items()
    }
    # Parameter 0 gets a copy of its own state; 1 and 2 get each other's (views of the buffers).
    swapped = {0: copy.deepcopy(saved["state"][0]), 1: saved["state"][2], 2: saved["state"][1]}
    opt.load_state_dict({**saved, "state": swapped})
    for position, source in ((0, 0), (1, 2), (2, 1)):
        loaded = opt.offloaded_state(params[position])
        for key, value in expected[source].items():
            assert_same([loaded[key].full_tensor()], [value])


def test_partially_replicated_state_on_a_2d_mesh_is_refused(mesh):
    """Only state replicated on every mesh dimension holds the whole tensor on each rank.
    (Replicate, Shard(0)) on a 2-D mesh (HSDP, FSDP + TP) is still sharded: sliced as if
    whole, a rank would load another rank's rows. It is refused, naming how to reshard."""
    mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    generator = torch.Generator().manual_seed(0)
    placements = [Shard(0), Replicate()]
    param = torch.nn.Parameter(
        distribute_tensor(torch.randn(4, 4, generator=generator), mesh2d, placements)
    )
    opt = OffloadAdamW([param], lr=0.1)
    param.grad = distribute_tensor(torch.randn(4, 4, generator=generator), mesh2d, placements)
    opt.step()
    saved = opt.state_dict()
    entry = saved["state"][0]
    entry["exp_avg"] = DTensor.from_local(
        entry["exp_avg"].to_local().clone(), mesh2d, [Replicate(), Shard(0)]
    )
    with pytest.raises(ValueError, match=r"torch\.distributed\.checkpoint"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("edit", ["clamp", "local_shard", "swap_tensors"])
def test_bf16_dtensor_weights_written_between_steps_reach_the_master_copies(mesh, edit):
    """Writes that move a DTensor's own version counter (a clamp) or its local shard's (written
    through ``to_local()`` without autograd), or swap in another tensor (its counter starts
    anew, its memory is elsewhere), all reach the master copy at the next step, element by
    element, as fp32 AdamW on masters edited alike."""

    def make(seed):
        generator = torch.Generator().manual_seed(seed)
        full = torch.randn(8, 4, generator=generator).bfloat16()
        return torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))

    param, twin, other = make(0), make(0), make(5)
    ours = OffloadAdamW([param], lr=1e-2)
    masters = MasterCopyAdamW([{"params": [twin]}], lr=1e-2)
    generator = torch.Generator().manual_seed(1)

    def step() -> None:
        grad = torch.randn(8, 4, generator=generator).bfloat16()
        for p, optimizer in ((param, ours), (twin, masters)):
            p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            optimizer.step()

    step()
    step()
    for p in (param, twin):
        if edit == "clamp":
            with torch.no_grad():
                p.clamp_(-0.1, 0.1)
        elif edit == "local_shard":
            with torch.no_grad():
                p.to_local().mul_(-0.5)
        else:
            new = distribute_tensor(other.detach().full_tensor(), mesh, [Shard(0)])
            torch.utils.swap_tensors(p, torch.nn.Parameter(new))
    masters.take_edits()
    step()
    assert_same([param.full_tensor()], [twin.full_tensor()])
    assert_same(
        [ours.offloaded_state(param)["master_param"].full_tensor()],
        [masters.masters[twin].full_tensor()],
    )


def test_a_dtensor_gradient_laid_out_unlike_its_parameter_goes_back_unscaled(mesh):
    """Under a scale (GradScaler's, sharded), a DTensor's local gradient laid out unlike its
    local parameter is updated as a copy, which goes back into the local gradient (the DTensor
    itself takes no plain tensor). Against a plain parameter given the same gradient."""
    torch.manual_seed(0)
    weight, grad = torch.randn(6, 4), torch.randn(4, 6).t() * 8  # laid out unlike the weight
    sharded = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    plain = torch.nn.Parameter(weight.clone())
    sharded.grad = DTensor.from_local(grad.clone(), mesh, [Shard(0)])
    plain.grad = grad.clone()
    for opt in (OffloadAdamW([sharded], lr=0.1), OffloadAdamW([plain], lr=0.1)):
        opt.grad_scale, opt.found_inf = torch.tensor(8.0), torch.tensor(0.0)
        opt.step()
    assert_same([sharded.to_local(), sharded.grad.to_local()], [plain, plain.grad])
    assert_same([plain.grad], [grad / 8])


def test_a_dtensor_over_part_of_a_buffer_keeps_its_version_counter_checked(mesh):
    """A DTensor's storage size counts its local tensor's offset: one over part of a buffer is
    not taken for a part of a larger tensor, whose writes the overlap could not tell apart."""
    from lightning_offload_optim.sharding import is_part_of_a_larger_tensor

    local = torch.randn(20)[2:8].view(2, 3)
    assert is_part_of_a_larger_tensor(local)
    assert not is_part_of_a_larger_tensor(DTensor.from_local(local, mesh, [Shard(0)]))


@pytest.mark.parametrize("resident", [None, 0.5], ids=["offloaded", "resident-0.5"])
def test_overlapped_tensor_parallel_steps_order_their_redistributed_gradients(mesh, resident):
    """Overlapped steps of a tensor-parallel block (a ``SequenceParallel`` norm, partial-sum
    gradients) read gradients after ``step()`` returns and the caller drops them: under the
    stream checker (which simulates the caching allocator handing freed memory out again) the
    update must hold them, and train exactly as torch's fused AdamW. On one rank the
    redistribution hands back the gradient's own memory; the temporaries of two ranks are
    checked in tests/test_sharded.py (``tensor_parallel_block_overlapped``)."""
    from stream_checker import StreamChecker
    from torch.distributed.tensor import Partial

    def block() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = torch.nn.Sequential(
            torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)
        )
        return sequence_parallel(layers, mesh)

    def train(model, optimizer) -> None:
        for step in range(3):
            x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()

    model, reference = block(), block()
    with StreamChecker() as checker:  # this module runs without it otherwise
        opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=resident)
        opt.overlap_with(model)
        train(model, opt)
        opt.wait_for_updates()
    checker.expect_none()
    train(reference, torch.optim.AdamW(reference.parameters(), fused=True))
    assert model[0].weight.placements == (Replicate(),)
    model(torch.randn(2, 5, 8)).pow(2).mean().backward()
    assert model[0].weight.grad.placements == (Partial(),)  # else this tests nothing new
    ours = [p.full_tensor() for p in model.parameters()]
    assert_same(ours, [p.full_tensor() for p in reference.parameters()])
