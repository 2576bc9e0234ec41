"""optimizer.overlap_with(module): step() returns before its updates finish; the next forward
waits for each module's own parameters only. Results must equal an ordinary step's, and the
stream-ordering checker (on for every test here) must find every access ordered.

On the CPU the staged pipeline (``force_staging=True``) runs on simulated streams under the
checker: the update on a side stream, the forward on the current stream.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    MasterCopyAdamW,
    assert_same,
    clamp_alike,
    fail_on_call,
    overlapped_pair,
    record_update_order,
    train_alike,
)
from torch import nn

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim.overlap import ForwardOverlap


class Net(nn.Module):
    """Layers registered in the reverse of their forward order, a tied weight (``embed`` and
    ``head``), a layer called twice, and a parameter the root uses directly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(16, 10, bias=False)
        self.twice = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.embed = nn.Embedding(10, 16)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = self.norm(x) * self.scale
        x = self.twice(torch.tanh(self.twice(x)))
        return self.head(x)


def train(model: nn.Module, optimizer, steps: int, set_to_none: bool = True) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 10, (4, 5), generator=generator)
        model(tokens).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)


def overlapped(dtype: torch.dtype = torch.float32) -> tuple[Net, OffloadAdamW]:
    model = Net().to(dtype)
    optimizer = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    optimizer.overlap_with(model)
    return model, optimizer


@pytest.mark.parametrize("set_to_none", [True, False])
def test_bit_identical_to_torch_and_every_access_ordered(stream_order, set_to_none):
    model, optimizer = overlapped()
    reference = Net()
    train(model, optimizer, 4, set_to_none)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True), 4)
    stream_order.expect_none()
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_bf16_parameters_with_master_copies(stream_order):
    """Against torch fused AdamW on fp32 masters (tied weights included)."""
    model, optimizer = overlapped(torch.bfloat16)
    reference = Net().to(torch.bfloat16)
    train(model, optimizer, 3)
    train(reference, MasterCopyAdamW(list(reference.parameters()), lr=0.05), 3)
    stream_order.expect_none()
    model.state_dict()  # waits for the updates
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_bf16_parameters_clamped_between_steps_keep_the_edits(stream_order):
    """Weights clamped after ``wait_for_updates()`` (as the docs ask before writing them
    outside a forward pass): the next overlapped step's master copies take the edits, read
    in order after the clamp, as fp32 AdamW on masters edited alike does."""
    model, optimizer = overlapped(torch.bfloat16)
    reference = Net().to(torch.bfloat16)
    masters = MasterCopyAdamW(list(reference.parameters()), lr=0.05)
    for _ in range(2):
        train(model, optimizer, 2)
        train(reference, masters, 2)
        clamp_alike(optimizer, model, reference, masters)
    train(model, optimizer, 1)
    train(reference, masters, 1)
    stream_order.expect_none()
    model.state_dict()  # waits for the updates
    assert_same(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("into", ["model", "submodule"])
def test_weights_loaded_into_the_module_right_after_a_step_wait_for_its_updates(stream_order, into):
    """``load_state_dict`` of the module (or of a submodule, directly) between a step and the
    next forward writes the parameters the queued updates still write: it waits for them."""
    model, optimizer = overlapped()
    reference = Net()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    train(model, optimizer, 2)
    train(reference, torch_opt, 2)
    other = Net()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    for net in (model, reference):
        if into == "model":
            net.load_state_dict(other.state_dict())
        else:
            net.norm.load_state_dict(other.norm.state_dict())
    train(model, optimizer, 2)
    train(reference, torch_opt, 2)
    stream_order.expect_none()
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("saved", ["model", "submodule", "wrapped"])
def test_weights_saved_right_after_a_step_are_read_after_its_updates(stream_order, saved):
    """``state_dict()`` of the module, of a submodule alone (a backbone or an adapter saved
    apart), or of a module holding it (a wrapper, such as DDP's, saving it under a prefix)
    between a step and the next forward: the saved weights are read after the queued updates
    wrote them, and are the updated weights."""
    model, optimizer = overlapped()
    reference = Net()
    train(model, optimizer, 2)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True), 2)
    part, twin = {
        "model": (model, reference),
        "submodule": (model.norm, reference.norm),
        "wrapped": (nn.ModuleDict({"module": model}), nn.ModuleDict({"module": reference})),
    }[saved]
    weights = [w.clone() for w in part.state_dict().values()]
    stream_order.expect_none()
    assert_same(weights, list(twin.state_dict().values()))


def test_saving_the_module_waits_once_not_once_per_submodule(stream_order, monkeypatch):
    """Each submodule's ``state_dict`` pre-hook runs inside the module's: only the module saved
    makes the caller's stream wait (on a GPU an event per wait)."""
    model, optimizer = overlapped()
    train(model, optimizer, 2)
    joins = []
    real = optimizer._pipeline.join_updates
    monkeypatch.setattr(optimizer._pipeline, "join_updates", lambda: joins.append(real()))
    model.state_dict()
    assert len(joins) == 1
    stream_order.expect_none()


@pytest.mark.parametrize("read_by", ["forward", "state_dict"])
def test_a_parameter_written_before_its_update_was_waited_for_is_reported(stream_order, read_by):
    """A clamp right after step(), before anything waited for the updates, races with them on
    a GPU (the checker sees it): the next wait for that parameter says so."""
    model, optimizer = overlapped()
    train(model, optimizer, 2)
    with torch.no_grad():
        model.norm.weight.clamp_(-0.1, 0.1)
    written = r"1 parameter\(s\) were written in place after a step"
    with pytest.warns(UserWarning, match=written) as warned:
        if read_by == "forward":
            model(torch.zeros(2, 3, dtype=torch.long))
        else:
            model.state_dict()
    assert {w.filename for w in warned} == {__file__}  # the line that read, not the package's
    assert any("device memory" in v for v in stream_order.violations)
    stream_order.violations.clear()


def in_one_flat_buffer(model: nn.Module) -> nn.Module:
    """``model`` with every parameter made a view of one flat buffer (contiguous parameter
    buffers): they share the buffer's version counter."""
    owners = [(m, n, p) for m in model.modules() for n, p in m.named_parameters(recurse=False)]
    flat = torch.cat([p.detach().reshape(-1) for *_, p in owners])
    offset = 0
    for module, name, p in owners:
        view = flat[offset : offset + p.numel()].view_as(p)
        setattr(module, name, nn.Parameter(view))
        offset += p.numel()
    return model


def test_parts_of_one_flat_buffer_written_by_another_optimizer_are_not_reported(stream_order):
    """Another optimizer's step writes its own parts of the buffer, which moves the version
    counter of every part: nothing wrote the overlapped parameters, so nothing is reported (a
    report is an error, pyproject). Trains as torch's fused AdamW and SGD on separate tensors."""

    def mlp() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    model, reference = in_one_flat_buffer(mlp()), mlp()
    ours = OffloadAdamW(model[0].parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    theirs = torch.optim.AdamW(reference[0].parameters(), lr=0.05, fused=True)
    sgds = [torch.optim.SGD(net[2].parameters(), lr=0.05) for net in (model, reference)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        inputs = torch.randn(6, 8, generator=generator)
        for net, adamw, sgd in ((model, ours, sgds[0]), (reference, theirs, sgds[1])):
            net(inputs).square().mean().backward()
            adamw.step()
            sgd.step()  # writes the last layer's parts of the buffer only
            adamw.zero_grad()
            sgd.zero_grad()
    stream_order.expect_none()
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))
    # A part replaced (not written in place) is still seen: its memory moved.
    model(inputs).square().mean().backward()
    ours.step()
    model[0].bias.data = torch.zeros(16)
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) were written in place"):
        ours.wait_for_updates()
    stream_order.violations.clear()


@pytest.mark.parametrize("wait", ["state_dict", "offloaded_state", "load_state_dict"])
def test_parameters_written_after_the_optimizer_waited_for_them_are_not_reported(
    stream_order, wait
):
    """The optimizer's own reads of its state order the caller's stream after every update:
    writing a weight after them (a rollback: load the state, then the weights) is no race."""
    model, optimizer = overlapped()
    train(model, optimizer, 2)
    if wait == "state_dict":
        optimizer.state_dict()
    elif wait == "offloaded_state":
        optimizer.offloaded_state(model.norm.weight)
    else:
        optimizer.load_state_dict(optimizer.state_dict())
    with torch.no_grad():
        model.norm.weight.clamp_(-0.1, 0.1)
    model(torch.zeros(2, 3, dtype=torch.long))  # a report would be an error (pyproject)
    stream_order.expect_none()


def test_parameters_written_after_a_forward_waited_for_them_are_not_reported(stream_order):
    """Once the caller's stream waited for a parameter's update (its module's forward, here an
    evaluation pass), writing it is ordered: no report, no race, at the next pass or step."""
    model, optimizer = overlapped()
    train(model, optimizer, 2)
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long))
        model.twice.weight.mul_(0.5)
    train(model, optimizer, 1)  # the warning would be an error (pyproject's filterwarnings)
    model.state_dict()
    stream_order.expect_none()


def test_step_returns_before_the_updates_and_the_forward_waits_per_module(stream_order):
    """Right after step() the current stream has not waited for the update stream; the first
    module's forward makes it wait for that module's parameters, not for all of them."""
    model, optimizer = overlapped()
    train(model, optimizer, 1)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    model(tokens).sum().backward()
    optimizer.step()
    streams = optimizer._pipeline.pool.streams[torch.device("cpu")]
    update, current = streams.update, stream_order.current
    assert current.clock.get(update.id, 0) < update.clock[update.id]  # not joined yet
    pending = optimizer._overlap.pending
    embed_event, _ = pending[model.embed.weight]  # also head.weight: they are tied
    model.embed(tokens)
    assert current.clock[update.id] >= embed_event.clock[update.id]
    assert current.clock[update.id] < update.clock[update.id]  # not everything
    stream_order.expect_none()


def test_updates_run_in_the_order_the_forward_uses_parameters(monkeypatch):
    """Registered in reverse: the first forward's order lays the state out and orders the
    chunks, so the first layers' parameters are ready first."""
    model, optimizer = overlapped()
    train(model, optimizer, 1)  # the first forward records the order
    updated = record_update_order(monkeypatch, optimizer)
    train(model, optimizer, 1)
    first_use = [
        model.scale,  # the root's own parameter: waited for when the root's forward starts
        model.embed.weight,  # also head.weight
        model.norm.weight,
        model.norm.bias,
        model.twice.weight,
        model.twice.bias,
    ]
    seen = list(dict.fromkeys(id(p) for p in updated))  # parameters split over chunks: once
    assert seen == [id(p) for p in first_use]


class CalledTwiceFirst(nn.Module):
    """``a`` is called twice before ``b`` runs, both registered in the reverse of that order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.b = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x))))).pow(2).mean()


def test_a_module_called_twice_before_the_others_keeps_its_first_use(stream_order, monkeypatch):
    """Performance (not results): a layer's second call in the same pass, before every
    parameter has been seen, must not move its parameters' first use after those of the layers
    that run later (the order must keep each parameter's first use, not its last), or the
    parameters the next forward needs first would be updated later. Results as torch's."""
    model, twin = CalledTwiceFirst(), CalledTwiceFirst()
    ours, theirs = overlapped_pair(model, twin, lr=0.05)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 8, generator=generator) for _ in range(3)]
    train_alike([(model, ours), (twin, theirs)], inputs[:1])  # the first forward records it
    updated = record_update_order(monkeypatch, ours)
    train_alike([(model, ours), (twin, theirs)], inputs[1:])
    first_use = [model.a.weight, model.a.bias, model.b.weight, model.b.bias]
    assert list(dict.fromkeys(id(p) for p in updated)) == [id(p) for p in first_use]
    stream_order.expect_none()
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))


@pytest.mark.parametrize("transposed", [False, True], ids=["grads-as-params", "grads-transposed"])
def test_fp16_parameters_under_grad_scaler(stream_order, transposed):
    """The updates unscale fp16 gradients by GradScaler's scale (see test_parity), which the
    scaler drops when step() returns, before the queued updates read it: its memory is kept for
    them. Gradients laid out unlike their parameters (``transposed``) are updated as copies,
    which the queued updates write back unscaled: the gradients' memory, freed by the next
    ``zero_grad``, is kept for those writes too. Against torch fused AdamW on fp32 masters given
    the same scale; the gradients are compared after the last step."""
    model, optimizer = overlapped(torch.float16)
    reference = Net().to(torch.float16)
    masters = MasterCopyAdamW(list(reference.parameters()), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        optimizer.zero_grad()
        masters.zero_grad()
        tokens = torch.randint(0, 10, (4, 5), generator=generator)
        scaler.scale(model(tokens).logsumexp(-1).mean()).backward()
        if transposed:
            for p in model.parameters():
                if p.dim() == 2:
                    p.grad = p.grad.t().contiguous().t()
        scale = torch.tensor(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        (reference(tokens).logsumexp(-1).mean() * scale).backward()
        masters.fp32.grad_scale = scale
        masters.step()
    stream_order.expect_none()
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))
    unscaled = [masters.masters[r].grad.half() for r in reference.parameters()]
    assert_same([p.grad for p in model.parameters()], unscaled)


class UsedSecond(nn.Module):
    """``big`` is registered (so laid out) first and used second: in forward order the chunk
    holding the end of its weight, with ``first``'s parameters, goes before the others."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big = nn.Linear(20, 10)
        self.first = nn.Linear(1, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(self.first(x))


@pytest.mark.parametrize("late", ["overlap-after-a-step", "loaded-before-a-forward"])
def test_a_split_gradient_laid_out_unlike_its_parameter_goes_back_whole(stream_order, late):
    """The state laid out in another order than the forward's (the overlap switched on after
    a step; a state dict loaded into an overlapped optimizer before any forward pass, as a
    resume does): the chunk holding the end of ``big.weight`` runs first. Its gradient, laid
    out unlike it and updated as a copy, goes back into ``p.grad`` once all of it is unscaled.
    Against torch's fused AdamW given the gradients laid out like the parameters."""
    model, twin = UsedSecond(), UsedSecond()
    optimizer = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    reference = torch.optim.AdamW(twin.parameters(), lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(2)
    for step in range(4):
        inputs = torch.randn(4, 1, generator=generator)
        for net in (model, twin):
            net(inputs).square().mean().mul(1000.0).backward()
        model.big.weight.grad = model.big.weight.grad.t().contiguous().t()
        if step > 0:  # the first step is an ordinary one: it lays the state out
            for opt in (optimizer, reference):
                opt.grad_scale, opt.found_inf = torch.tensor(1000.0), torch.tensor(0.0)
        for opt in (optimizer, reference):
            opt.step()
            opt.__dict__.pop("grad_scale", None)
            opt.__dict__.pop("found_inf", None)
        if step == 0 and late == "loaded-before-a-forward":
            saved = optimizer.state_dict()
            optimizer = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
            optimizer.overlap_with(model)
            optimizer.load_state_dict(saved)
        elif step == 0:
            optimizer.overlap_with(model)
        optimizer.wait_for_updates()
        assert_same([p.grad for p in model.parameters()], [p.grad for p in twin.parameters()])
        assert_same(list(model.parameters()), list(twin.parameters()))
        optimizer.zero_grad()
        reference.zero_grad()
    stream_order.expect_none()


def test_a_lazy_module_materialized_after_overlap_with(stream_order):
    """overlap_with before the first forward pass (the mixin calls it in configure_optimizers)
    on a lazy module: its parameters get their gradient hooks once materialized and stepped
    (torch refused hooks on them before), and train as with torch's fused AdamW."""

    def lazy_net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 10))

    model, twin = lazy_net(), lazy_net()
    optimizer = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    optimizer.overlap_with(model)
    reference = torch.optim.AdamW(twin.parameters(), lr=0.05, fused=True)
    for net, opt in ((model, optimizer), (twin, reference)):
        torch.manual_seed(3)  # the lazy weights are initialised at the first forward pass
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            net(torch.randn(4, 5, generator=generator)).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
    assert optimizer._overlap._has_gradient_hook(model[0].weight)
    stream_order.expect_none()
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))


def test_each_wait_is_needed(stream_order, monkeypatch):
    """Without the forward hooks' waits, the forward reads parameters the update still writes."""
    monkeypatch.setattr(ForwardOverlap, "_wait", lambda self, params: None)
    model, optimizer = overlapped()
    train(model, optimizer, 2)
    assert any("device memory" in v for v in stream_order.violations)
    stream_order.violations.clear()


def test_zero_grad_waits_for_the_update_to_read_the_gradients(stream_order, monkeypatch):
    model, optimizer = overlapped()
    monkeypatch.setattr(ForwardOverlap, "wait_all", lambda self: None)
    train(model, optimizer, 2, set_to_none=False)
    assert any("zero_" in v for v in stream_order.violations)
    stream_order.violations.clear()


def test_removed_overlap_steps_in_order_again(stream_order):
    model, optimizer = overlapped()
    train(model, optimizer, 1)
    optimizer._overlap.remove()
    reference = Net()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    train(reference, ref_opt, 1)
    train(model, optimizer, 2)
    train(reference, ref_opt, 2)
    for p in model.parameters():
        p.detach().clone()  # read with no wait: must be ordered by the synchronous step
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_the_next_steps_first_copies_start_after_the_forward(stream_order):
    """Queued by the forward's end (they do not depend on the gradients), used by the step,
    each chunk moved once."""
    model, optimizer = overlapped()
    train(model, optimizer, 1)
    pipeline = optimizer._pipeline
    loss = model(torch.zeros(2, 3, dtype=torch.long)).sum()
    assert sorted(pipeline._prefetched) == [0, 1]  # two staging buffers
    loss.backward()
    optimizer.step()
    assert pipeline._prefetched == {}
    moved = optimizer.last_step.resolve()
    assert moved.bytes_in == moved.bytes_out == optimizer.memory_stats()["state_bytes"]
    stream_order.expect_none()


def test_a_load_between_the_forward_and_the_step_discards_the_early_copies(stream_order):
    model, optimizer = overlapped()
    reference = Net()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    train(model, optimizer, 2)
    train(reference, torch_opt, 2)
    saved = copy.deepcopy(optimizer.state_dict())
    train(model, optimizer, 1)  # moves the state on
    tokens = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(9))
    loss = model(tokens).logsumexp(-1).mean()  # queues copies of the moved-on state
    optimizer.load_state_dict(saved)
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            p.copy_(r)
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    reference(tokens).logsumexp(-1).mean().backward()
    torch_opt.step()
    stream_order.expect_none()
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


class Attention(nn.Module):
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` itself (out_proj's forward never
    runs), and the root's own parameter is read before any module's forward, as in a Lightning
    ``training_step`` calling ``self.net(x * self.scale)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.scale = nn.Parameter(torch.ones(16))


def attention_steps(model: Attention, optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(2, 5, 16, generator=generator)
        model.net(x * model.scale).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_parameters_no_hook_reaches_are_updated_first_and_waited_for(stream_order):
    model, reference = Attention(), Attention()
    optimizer = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    optimizer.overlap_with(model)
    attention_steps(model, optimizer, 3)
    attention_steps(reference, torch.optim.AdamW(reference.parameters(), fused=True), 3)
    model.eval()
    with torch.no_grad():  # the fast path reads every weight in one op
        model.net(torch.ones(1, 5, 16) * model.scale)
    stream_order.expect_none()
    assert {id(model.scale), id(model.net.self_attn.out_proj.weight)} <= optimizer._overlap.early
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_a_tensor_lr_changed_by_a_scheduler_after_the_step(stream_order):
    model, reference = Net(), Net()
    optimizer = OffloadAdamW(
        model.parameters(), lr=torch.tensor(0.05), force_staging=True, chunk_size=64
    )
    optimizer.overlap_with(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(0.05), fused=True)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (optimizer, torch_opt)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 10, (4, 5), generator=generator)
        runs = zip((model, reference), (optimizer, torch_opt), schedulers, strict=True)
        for net, opt, scheduler in runs:
            net(tokens).logsumexp(-1).mean().backward()
            opt.step()
            scheduler.step()  # fill_ on the lr tensor the queued update reads
            opt.zero_grad()
    stream_order.expect_none()
    model.state_dict()
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_the_hooks_go_with_the_optimizer():
    import gc
    import weakref

    model, optimizer = overlapped()
    train(model, optimizer, 1)
    pipeline = weakref.ref(optimizer._pipeline)
    del optimizer
    gc.collect()
    assert pipeline() is None  # the module's hooks held it, with its staging buffers
    assert not any(m._forward_pre_hooks for m in model.modules())


class Switching(nn.Module):
    """The forward runs some modules only: ``mode`` names them. ``wide`` is fp64, so its state
    is an arena (and its chunks a staging-buffer kind) of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Linear(8, 8, bias=False).double()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        if "w" in mode:
            x = self.wide(x.double()).float()
        if "a" in mode:
            x = self.a(x)
        return self.b(x) if "b" in mode else x

    def training_step(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        """As a Lightning training_step: the root's forward is not called; ``scale`` is read
        before any hook runs."""
        return self(x * self.scale, mode) if mode.startswith("root") else self.b(x * self.scale)


@pytest.mark.parametrize(
    "pattern",
    [
        ["wab", "ab", "wb"],  # the step's chunks change in front of the early copies
        ["ab", "a", "b"],  # a parameter without a gradient for a step keeps its last event
        ["t", "t", "val", "t", "t"],  # an evaluation forward reaches the root's parameter
    ],
    ids=["early-copies-of-another-plan", "skipped-parameter", "evaluation-forward"],
)
def test_forward_patterns_that_change_between_steps(stream_order, pattern):
    model, reference = Switching(), Switching()
    optimizer = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    optimizer.overlap_with(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(1)
    for mode in pattern:
        x = torch.randn(4, 8, generator=generator)
        if mode == "val":
            with torch.no_grad():
                model(x * model.scale, "root-ab")
            continue
        for net, opt in ((model, optimizer), (reference, torch_opt)):
            (net.training_step(x, "b") if mode == "t" else net(x, mode)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    stream_order.expect_none()
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_a_parameter_frozen_between_backward_and_step(stream_order):
    """torch.optim steps a parameter that has a gradient even when it no longer requires one
    (frozen by a callback after backward): the overlap must not fail to hook it."""
    model, reference = Net(), Net()
    model.twice.requires_grad_(False)  # frozen when the overlap starts: not hooked then
    optimizer = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    optimizer.overlap_with(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    tokens = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(2))
    for net, opt in ((model, optimizer), (reference, torch_opt)):
        for step in range(3):
            net.twice.requires_grad_(True)
            net(tokens).logsumexp(-1).mean().backward()
            net.twice.requires_grad_(step == 2)  # frozen after the first backward
            opt.step()
            opt.zero_grad()
    stream_order.expect_none()
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_overlap_with_a_disabled_optimizer_is_refused():
    """A disabled OffloadAdamW steps as torch's AdamW: there is nothing to overlap, and hooks
    installed anyway would watch every forward pass for good (no overlapped step ends it)."""
    model = torch.nn.Linear(4, 2)
    optimizer = OffloadAdamW(model.parameters(), enabled=False)
    with pytest.raises(RuntimeError, match="overlap_with needs enabled=True"):
        optimizer.overlap_with(model)
    assert not model._forward_pre_hooks and torch._C._len_torch_function_stack() == 0
    model(torch.ones(1, 4))
    assert torch._C._len_torch_function_stack() == 0


def test_parameters_can_be_swapped_in_place_with_the_overlap_and_after_it(stream_order):
    """``torch.utils.swap_tensors`` (``load_state_dict(assign=True)`` and ``Module.to`` with
    swapping on) refuses parameters that anything references weakly: the overlap holds none,
    during or after it, and training goes on as torch's AdamW's over the swapped weights."""
    model, optimizer = overlapped()
    reference = Net()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    train(model, optimizer, 2)
    train(reference, torch_opt, 2)
    weights = {k: v * 0.5 for k, v in Net().state_dict().items()}
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for net in (model, reference):
            net.load_state_dict({k: v.clone() for k, v in weights.items()}, assign=True)
        train(model, optimizer, 2)
        train(reference, torch_opt, 2)
        stream_order.expect_none()
        optimizer.overlap_with(model).remove()
        model.to(torch.float64)  # swaps every parameter
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert_same(list(model.float().parameters()), list(reference.parameters()))


def backward_waits_after_a_step(model: nn.Module, optimizer, overlap, x) -> int:
    """Micro-batches whose forward runs before the step and backward after it, accumulating
    into the gradients the step's queued updates read: how many times that backward made the
    caller's stream wait for all updates (once, at its first gradient, is right)."""
    model(x).pow(2).sum().backward()
    loss = model(x).pow(2).sum()
    optimizer.step()
    calls = []
    real = overlap.wait_all
    overlap.wait_all = lambda: (calls.append(1), real())
    loss.backward()
    overlap.wait_all = real
    optimizer.step()
    optimizer.wait_for_updates()
    return len(calls)


@pytest.mark.parametrize("swaps", [0, 1, 5, "until-an-address-is-reused"])
def test_the_backward_after_a_step_waits_also_after_a_swap(stream_order, swaps):
    """``torch.utils.swap_tensors`` leaves a parameter's hooks dict on it but moves the hooks
    autograd runs with the tensor swapped out: the next step attaches them again, so the
    backward that accumulates into the gradients being read still waits (the checker sees the
    race otherwise). After a few swaps a new tensor often gets the address of one swapped out
    before (in CPython's allocator), so no record of where the tensor was can tell a swap."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    overlap = optimizer.overlap_with(model)
    x = torch.randn(3, 8)
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.wait_for_updates()
    if swaps == "until-an-address-is-reused":  # the tensor swapped in sits where the first was
        first = {id(p): p._cdata for p in model.parameters()}
        for _ in range(200):
            for p in model.parameters():
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone()))
            if any(first[id(p)] == p._cdata for p in model.parameters()):
                break
        else:
            pytest.skip("this allocator gave no freed address again in 200 swaps")
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for _ in range(swaps if isinstance(swaps, int) else 0):
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(weights, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert backward_waits_after_a_step(model, optimizer, overlap, x) == 1
    stream_order.expect_none()


def test_the_backward_after_a_step_waits_after_a_dtensor_module_is_moved(stream_order, mesh):
    """``Module.to`` swaps DTensor parameters even when nothing moves (``swap_tensors``, whatever
    the future flag), taking the overlap's gradient hook with the tensor swapped out: the next
    step attaches it again. (The checker's record of DTensor ops is not checked here.)"""
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
    optimizer = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    overlap = optimizer.overlap_with(model)
    x = distribute_tensor(torch.randn(3, 8), mesh, [Replicate()])
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.wait_for_updates()
    swapped_out = model.weight._cdata
    model.to("cpu")
    assert model.weight._cdata != swapped_out  # swapped, as this test assumes
    assert backward_waits_after_a_step(model, optimizer, overlap, x) == 1
    stream_order.violations.clear()


def test_the_gradient_hooks_registry_forgets_dead_parameters():
    """Replacing a layer frees its parameters, and CPython often gives a new parameter a dead
    one's id: a registry of ids would take the new one for hooked and never give it the
    gradient hook that orders the backward pass after the queued updates (DDP's bucket views
    need it). The registry holds no parameter (it would keep dead ones alive, or with weak
    references stop swap_tensors) but each hook's handle, which counts only while the hook is
    in that parameter's own hooks: a replacement stepped through a new param group gets its
    own hook."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = OffloadAdamW(model[0].parameters(), force_staging=True, chunk_size=64)
    overlap = optimizer.overlap_with(model)
    dead = [weakref.ref(p) for p in model[1].parameters()]  # hooked up front: in the module
    model[1] = nn.Linear(4, 1)
    gc.collect()
    assert all(ref() is None for ref in dead)
    assert [overlap._has_gradient_hook(p) for p in model.parameters()] == [True, True, False, False]
    optimizer.add_param_group({"params": list(model[1].parameters())})
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    assert all(len(p._backward_hooks or {}) == 1 for p in model[1].parameters())
    optimizer.wait_for_updates()
    # Where CPython did not reuse an id above, make it: a hook filed under a new parameter's id
    # but registered on another parameter does not count.
    new = nn.Parameter(torch.ones(2))
    overlap._gradient_hooks[id(new)] = overlap._gradient_hooks[id(model[0].weight)]
    assert not overlap._has_gradient_hook(new)


def test_fsdp2_streams_out_of_reach_fall_back_to_waiting_for_everything():
    """FSDP2's all-gather streams are private attributes: once FSDP2 has set up (it has a
    device handle) but they are not where this code looks, the overlap must say so (None: the
    root waits for every update) rather than find no stream to order."""
    from types import SimpleNamespace

    from lightning_offload_optim.overlap import _all_gather_streams

    context = SimpleNamespace()
    state = SimpleNamespace(_comm_ctx=context, _states_to_forward_prefetch=[])
    unit = SimpleNamespace(_get_fsdp_state=lambda: state)
    assert _all_gather_streams(unit) == ([], [])  # before the first forward: nothing set up
    context.device_handle = torch.cpu
    assert _all_gather_streams(unit) == (None, [])  # set up, streams renamed
    context.all_gather_copy_in_stream, context.all_gather_stream = "copy-in", "gather"
    assert _all_gather_streams(unit) == (["copy-in", "gather"], [])
    assert _all_gather_streams(SimpleNamespace()) == (None, [])  # no FSDP2 state at all


def test_no_copies_are_queued_ahead_of_a_step_refused_after_a_failed_one(stream_order, monkeypatch):
    """After a step that failed partway the optimizer refuses to step until a load: a forward
    pass (validation) must not queue copies of the half-updated state for that step (each
    moved for nothing, and counted as moved)."""
    from lightning_offload_optim import adamw as adamw_module

    model, optimizer = overlapped()
    train(model, optimizer, 2)
    checkpoint = copy.deepcopy(optimizer.state_dict())
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    fail_on_call(monkeypatch, adamw_module, "adamw_update", 2, RuntimeError("simulated fault"))
    with pytest.raises(RuntimeError, match="simulated fault"):
        optimizer.step()
    monkeypatch.undo()
    optimizer.take_copies_between_steps()  # what the failed step queued, if anything
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long))
    assert optimizer.take_copies_between_steps().resolve().bytes_in == 0
    optimizer.load_state_dict(checkpoint)
    stream_order.expect_none()
