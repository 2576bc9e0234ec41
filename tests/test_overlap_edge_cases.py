"""Overlap corners found by a mutation test of the suite (each test fails on a mutant that
survived it): reads before any hook that one pass hides and another shows, parts frozen in
turn, an overlap switched on between backward and step, reads through ``.T``, a second
``overlap_with``, the update order and the allocator's view of the gradients, two overlapped
optimizers under the mixin, tuners and a failed ``fit``, a resident share set between
backward and step (found by a review). Each compares with an independent
``torch.optim.AdamW(fused=True)`` under the stream-ordering checker.
"""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_overlapped_alike,
    assert_same,
    clone_params,
    exact_reference,
    make_params,
    overlapped_pair,
    record_update_order,
    set_grads,
    train_alike,
)
from lightning_models import make_data, trainer
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_offload_optim import OffloadAdamW, OffloadOptimizerMixin
from lightning_offload_optim.lightning.mixin import _FitGuard
from lightning_offload_optim.overlap import ForwardOverlap
from lightning_offload_optim.pipeline import StagingPipeline


class FunctionalHead(nn.Module):
    """Training reads ``head.weight`` functionally (head's own hook never runs); evaluation
    calls ``head`` as a module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8, bias=False)  # 64 elements: one chunk of its own
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return F.linear(torch.tanh(self.body(x)), self.head.weight, self.head.bias)

    def evaluate(self, x):
        return self.head(torch.tanh(self.body(x)))


def test_evaluation_before_the_first_step_does_not_hide_functional_reads(stream_order):
    """An evaluation forward (no_grad, e.g. Lightning's sanity check) that calls ``head`` before
    the first training step must not count head's parameters as reached by a hook: the training
    forward reads them before any hook, so each step must wait for their update."""
    model, reference = FunctionalHead(), FunctionalHead()
    opt, ref_opt = overlapped_pair(model, reference, lr=0.05)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.evaluate(x)
        reference.evaluate(x)
    for _ in range(3):
        for net, o in ((model, opt), (reference, ref_opt)):
            net(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert_overlapped_alike(stream_order, opt, model, reference)


class TwoParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.x = nn.Linear(8, 8)
        self.y = nn.Linear(8, 8)


def test_alternating_frozen_parts_keep_the_events_of_the_part_not_stepped(stream_order):
    """Part ``x`` is frozen when the overlap is set up, ``y`` trains a step, then ``x`` is
    unfrozen and ``y`` frozen for a step (alternating schedules, fine-tuning): no gradient hook
    runs in that step's backward, so nothing has waited yet for ``y``'s first update. The next
    read of ``y`` through its module must still wait for it."""
    model, reference = TwoParts(), TwoParts()
    for net in (model, reference):
        net.x.requires_grad_(False)
    opt, ref_opt = overlapped_pair(model, reference, lr=0.05)
    inp = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for net, o in ((model, opt), (reference, ref_opt)):
        net.y(inp).pow(2).sum().backward()
        o.step()
        o.zero_grad()
        net.x.requires_grad_(True)
        net.y.requires_grad_(False)
        net.x(inp).pow(2).sum().backward()
        o.step()
        o.zero_grad()
    with torch.no_grad():
        out = model.y(inp)  # must wait for y's update of the first step
    stream_order.expect_none()
    assert torch.equal(out, reference.y(inp).detach())
    opt.wait_for_updates()
    assert_same(model.parameters(), reference.parameters())


class Attention(nn.Module):
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` itself: out_proj's hook never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def test_overlap_switched_on_between_backward_and_step(stream_order):
    """``overlap_with`` called after the backward: the first overlapped step has seen no forward
    pass, so it does not know which parameters the next forward reads before any hook
    (``out_proj.weight``): it must wait for all its updates."""
    model, reference = Attention(), Attention()
    opt = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 5, 16, generator=generator)
        for net, o in ((model, opt), (reference, ref_opt)):
            net(x).pow(2).mean().backward()
            if step == 0 and o is opt:
                opt.overlap_with(model)
            o.step()
            o.zero_grad()
    assert_overlapped_alike(stream_order, opt, model, reference)


class RootScale(nn.Module):
    """The root's own ``scale`` is read inside the root's forward (its hook reaches it) on some
    steps, and before any hook on others, where a training step calls the child directly
    (as a Lightning ``training_step`` calling ``self.b(x * self.scale)``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.b = nn.Linear(8, 8, bias=False)  # 64 elements: a chunk of its own

    def forward(self, x):
        return self.b(x * self.scale)

    def child_only(self, x):
        return self.b(x * self.scale)


def test_a_parameter_once_read_before_any_hook_is_waited_for_at_every_step(stream_order):
    """The first step finds ``scale`` read before any hook (nothing is pending before it, so
    that pass is safe): it is "early" from then on, never forgotten. A later step whose forward
    reached it through the root's hook must still wait for its update, since the next pass may
    read it before any hook again."""
    model, reference = RootScale(), RootScale()
    opt, ref_opt = overlapped_pair(model, reference, lr=0.05)
    generator = torch.Generator().manual_seed(1)
    for through_root in (False, True, False, True, False):
        x = torch.randn(4, 8, generator=generator)
        for net, o in ((model, opt), (reference, ref_opt)):
            (net(x) if through_root else net.child_only(x)).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert_overlapped_alike(stream_order, opt, model, reference)


class TiedTransposeProperty(nn.Module):
    """A tied autoencoder whose encoder reads the decoder's weight through the ``.T``
    property (not ``.t()``) before the decoder runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dec = nn.Linear(8, 16, bias=False)  # 128 elements: two chunks of 64
        self.other = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.dec.weight.T))  # reads dec.weight before dec's hook
        return self.dec(self.other(h)).pow(2).mean()


def test_a_weight_read_through_the_T_property_before_its_module(stream_order):
    model, reference = TiedTransposeProperty(), TiedTransposeProperty()
    opt, ref_opt = overlapped_pair(model, reference, lr=0.05)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 16, generator=generator) for _ in range(4)]
    train_alike([(model, opt), (reference, ref_opt)], inputs)
    assert_overlapped_alike(stream_order, opt, model, reference)


def test_overlap_with_called_again_replaces_the_first_overlap():
    """A second ``overlap_with`` (another module, or the same one again) must remove the
    first overlap's hooks: they would keep the pipeline (staging buffers) alive with the module
    after the optimizer is gone, and watch every forward pass forever."""
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    opt.overlap_with(model)
    opt.overlap_with(model)
    for _ in range(2):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_updates()
    pipeline = weakref.ref(opt._pipeline)
    del opt
    gc.collect()
    assert pipeline() is None
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_overlap_with_another_module_orders_the_updates_by_its_forward(stream_order, monkeypatch):
    """Performance (not results): after ``overlap_with`` a module that uses the same parameters
    in another order, the updates follow that module's forward, so its first layer is ready
    first; not the order of the chunk plans made for the first overlap, which are cached under
    the same key (same parameters, as many of them seen in the forward)."""
    a, b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    forward, backward = nn.Sequential(a, nn.Tanh(), b), nn.Sequential(b, nn.Tanh(), a)
    opt = OffloadAdamW([a.weight, b.weight], force_staging=True, chunk_size=64)
    x = torch.ones(2, 8)
    opt.overlap_with(forward)
    for _ in range(2):
        forward(x).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.overlap_with(backward)
    updated = record_update_order(monkeypatch, opt)
    backward(x).sum().backward()
    opt.step()
    opt.wait_for_updates()
    assert [id(p) for p in updated] == [id(b.weight), id(a.weight)]


def test_staging_grown_while_overlapped_updates_are_queued_is_kept_for_them(stream_order):
    """A step whose chunks outgrow the staging buffers (a layer without gradients at the
    first step has some now) replaces them while the last step's overlapped updates may still
    read the old ones: their memory is kept for the update stream too, not only for the copy
    streams, so the allocator hands it out again only after those updates. Results stay
    torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 32))
    twin = copy.deepcopy(model)
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=4096)
    ours.overlap_with(model)
    theirs = torch.optim.AdamW(twin.parameters(), lr=0.05, fused=True)
    x = torch.ones(2, 8)
    for net, opt in ((model, ours), (twin, theirs)):
        net[2].requires_grad_(False)
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()
    # The next gradients come without a forward pass of the module (nothing waited yet).
    generator = torch.Generator().manual_seed(1)
    set_grads([list(model.parameters()), list(twin.parameters())], generator)
    ours.step()
    theirs.step()
    ours.wait_for_updates()
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(twin.parameters()))


class LateFunctional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x, functional: bool):
        h = torch.tanh(self.a(x))
        return F.linear(h, self.b.weight) if functional else self.b(h)


def test_parameters_found_early_at_a_later_step_are_updated_first(stream_order, monkeypatch):
    """Performance (not results): once a step finds ``b.weight`` reached by no hook, the next
    steps update it first, so the wait for it at each step does not wait for everything else.
    The forward order is complete from the first step, so only ``early`` changes here."""
    model = LateFunctional()
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    opt.overlap_with(model)
    x = torch.ones(2, 8)
    for functional in (False, True):
        model(x, functional).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt._overlap.early == {id(model.b.weight)}
    # The functional read in the second pass raced the first step's update of b.weight: the
    # documented "once" of docs/limitations.md (a read outside its module first seen after
    # steps in which its module ran). This test is about the order of later updates.
    stream_order.violations.clear()
    updated = record_update_order(monkeypatch, opt)
    model(x, True).sum().backward()
    opt.step()
    opt.wait_for_updates()
    assert updated[0] is model.b.weight


class UnfreezesInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        self.b.requires_grad_(True)  # metadata only: not a read of b.weight's data
        return self.b(torch.tanh(self.a(x)))


def test_requires_grad_before_the_module_runs_is_not_a_read(stream_order):
    """Performance (not results): ``module.requires_grad_()`` before the module runs only sets
    metadata, so ``b.weight`` must not be waited for at each step (that would end the overlap
    of the next forward with b's update)."""
    model = UnfreezesInForward()
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    opt.overlap_with(model)
    for _ in range(2):
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_updates()
    assert opt._overlap.read_before_hook == set() and opt._overlap.early == set()


def test_arenas_know_their_last_copy_out_after_an_ordinary_step(stream_order):
    """Pinned host buffers are unregistered and freed (optimizer dropped, a load that lays the
    state out anew) once their arena's last-use events are done: after an ordinary staged step,
    with no later flush or interruption, those events must cover every copy-out queued into
    them, or the free would race the copies still writing (on CUDA, a write into freed pinned
    memory). Checked on the simulated streams, as tests/test_stream_order.py checks it after
    interrupted steps."""
    params = make_params([(300,), (70,), (5, 13)])
    reference = clone_params(params)
    opt = OffloadAdamW(params, force_staging=True, chunk_size=64)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        for p, r in zip(params, reference, strict=True):
            g = torch.randn(p.shape, generator=generator)
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    streams = opt._pipeline.pool.streams[torch.device("cpu")]
    copy_out = streams.copy_out
    for arena in opt._host.arenas:
        events = [e for e in arena._in_flight if e is not None]
        assert any(e.clock.get(copy_out.id, 0) >= copy_out.clock[copy_out.id] for e in events), (
            "the arena could be freed while the copy-out stream still writes into it"
        )
    assert_same(params, reference)


def test_an_overlapped_step_tells_the_allocator_the_update_reads_every_gradient(
    stream_order, monkeypatch
):
    """With overlap, ``step()`` returns before the update stream has read the gradients, and
    ``zero_grad()`` (set_to_none) then frees them: on CUDA the caching allocator would hand
    their memory to the next forward pass's activations while the queued update still reads
    it (silently wrong updates) unless every gradient is recorded as used by the update stream
    (``record_stream``). The CPU's simulated streams are not ``torch.Stream``s, so the record
    itself is a no-op here: check that the pipeline is told about each gradient."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64)
    opt.overlap_with(model)
    told = []
    real = StagingPipeline.used_by_update

    def spy(self, tensor):
        told.append(tensor.untyped_storage().data_ptr())
        return real(self, tensor)

    monkeypatch.setattr(StagingPipeline, "used_by_update", spy)
    model(torch.ones(2, 8)).sum().backward()
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    opt.step()
    opt.zero_grad()
    opt.wait_for_updates()
    assert grads <= set(told)


class TwoOptimizersReadFirst(OffloadOptimizerMixin, pl.LightningModule):
    """Manual optimization with two optimizers, both overlapping this module: ``inp`` in the
    first, ``head`` in the second. training_step reads the head's weight (a penalty) before
    the head runs; the root's forward is never called, so only the mixin's training_step watch
    can see that read, for each optimizer."""

    def __init__(self, optimizer: str = "offload") -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.inp = nn.Linear(8, 8, bias=False)  # 64 elements: one chunk
        self.head = nn.Linear(8, 8, bias=False)
        self.losses: list[torch.Tensor] = []

    def train_dataloader(self) -> DataLoader:
        data = make_data(16)
        x, y = data.tensors
        return DataLoader(torch.utils.data.TensorDataset(x, y.expand(-1, 8).clone()), batch_size=4)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()
        x, y = batch
        penalty = 1e-2 * self.head.weight.pow(2).sum()
        loss = F.mse_loss(self.head(torch.tanh(self.inp(x))), y) + penalty
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        self.losses.append(loss.detach().clone())

    def configure_optimizers(self) -> Any:
        def make(params):
            if self.hparams.optimizer == "torch":
                return torch.optim.AdamW(params, lr=0.02, fused=True)
            opt = OffloadAdamW(params, lr=0.02, force_staging=True, chunk_size=64)
            opt.overlap_with(self)
            return opt

        return [make(list(self.inp.parameters())), make(list(self.head.parameters()))]


def test_two_overlapped_optimizers_both_watch_training_step(tmp_path, stream_order):
    models = []
    for optimizer in ("offload", "torch"):
        model = TwoOptimizersReadFirst(optimizer)
        trainer(tmp_path / optimizer, max_steps=4).fit(model)
        models.append(model)
    offload, reference = models
    stream_order.expect_none()
    assert all(torch.equal(a, b) for a, b in zip(offload.losses, reference.losses, strict=True))
    assert_same(list(offload.parameters()), list(reference.parameters()))
    # overlap_with in the module's own configure_optimizers: teardown removes its hooks too.
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in offload.modules())


class ReadsHeadFirst(OffloadOptimizerMixin, pl.LightningModule):
    """``overlap_step`` on, with ``training_step`` reading the head's weight (a penalty) before
    the head runs; records at each step whether it overlaps."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.save_hyperparameters({"overlap_step": True, "lr": 0.02})
        torch.manual_seed(0)
        self.batch_size = batch_size  # BatchSizeFinder tunes it
        self.inp = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 8, bias=False)
        self.overlapping: list[bool] = []

    def offload_optimizer_args(self) -> dict[str, Any]:
        return {**super().offload_optimizer_args(), "force_staging": True, "chunk_size": 64}

    def train_dataloader(self) -> DataLoader:
        x, y = make_data(32).tensors
        return DataLoader(
            torch.utils.data.TensorDataset(x, y.expand(-1, 8).clone()), batch_size=self.batch_size
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        penalty = 1e-2 * self.head.weight.pow(2).sum()  # read before head's hook
        return F.mse_loss(self.head(torch.tanh(self.inp(x))), y) + penalty

    def on_before_optimizer_step(self, optimizer) -> None:
        self.overlapping.append(optimizer._overlapping() is not None)


@pytest.mark.parametrize("tuner", ["lr-finder", "batch-size-finder"])
def test_after_a_tuner_the_real_run_overlaps_and_watches_training_step(
    tmp_path, monkeypatch, tuner
):
    """Lightning's tuners train in their callback's ``on_fit_start``, before the module's, on
    the same optimizers, and end in ``on_train_end``: the real run must still overlap, and its
    ``training_step`` read of the head before the head's hook must still be found and waited
    for (the stream checker sees any unordered read)."""
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
    from lightning.pytorch.tuner import lr_finder

    monkeypatch.setattr(lr_finder._LRFinder, "suggestion", lambda self, **_: 0.01)
    finder = (
        LearningRateFinder(num_training_steps=3, early_stop_threshold=None)
        if tuner == "lr-finder"
        else BatchSizeFinder(mode="power", init_val=2, max_trials=2, steps_per_trial=2)
    )
    model = ReadsHeadFirst()
    trainer(tmp_path, max_steps=4, callbacks=[finder]).fit(model)
    assert len(model.overlapping) > 4 and all(model.overlapping[-4:])


class FailsOnce(ReadsHeadFirst):
    failed = False
    at_batch = 2

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.at_batch and not FailsOnce.failed:
            FailsOnce.failed = True
            raise RuntimeError("simulated: out of memory")
        return super().training_step(batch, batch_idx)


class RaisesAtFitStart(pl.Callback):
    """Fails where a tuner's trial runs: in a callback's ``on_fit_start``, after the module's
    ``configure_optimizers`` and before its ``on_fit_start``."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise RuntimeError("simulated: a tuner's trial failed")


@pytest.mark.parametrize(
    "at_batch",
    [0, 2, None, "lr-finder"],
    ids=["first-batch-watched", "after-steps", "in-a-callbacks-on_fit_start", "in-a-tuners-run"],
)
def test_a_fit_that_failed_leaves_the_module_copyable_and_the_retry_frees_the_old_pipeline(
    tmp_path, stream_order, at_batch
):
    """Lightning calls no ``on_train_end`` or ``teardown`` when ``fit`` raises (an OOM, say):
    moving the module (``to``, as Lightning's own teardown does) must wait for the queued
    updates; the module must still deep-copy and pickle while the Trainer lives (no hook or
    ``training_step`` watch of the overlap left on it: local functions do not pickle); and a
    retry with a new Trainer must not keep the old optimizer's pipeline (its device buffers)
    alive. Also where the fit fails before the module's ``on_fit_start`` (``at_batch=None``),
    once ``configure_optimizers`` has put the hooks on, and in the LR finder's run, which
    trains with callbacks of its own (``"lr-finder"``: its third batch fails)."""
    import pickle

    from lightning.pytorch.callbacks import LearningRateFinder

    FailsOnce.failed = False
    model = FailsOnce()
    model.at_batch = 2 if at_batch == "lr-finder" else at_batch
    hooks_before = {name: len(m._forward_pre_hooks) for name, m in model.named_modules()}
    failing = {None: [RaisesAtFitStart()], "lr-finder": [LearningRateFinder(num_training_steps=6)]}
    first = trainer(tmp_path, max_steps=6, callbacks=failing.get(at_batch, []))
    with pytest.raises(RuntimeError, match="simulated"):
        first.fit(model)
    model.to(torch.float64)  # reads every weight
    stream_order.expect_none()
    model.to(torch.float32)
    copy.deepcopy(model)
    assert {name: len(m._forward_pre_hooks) for name, m in model.named_modules()} == hooks_before
    assert "training_step" not in vars(model)
    pickle.loads(pickle.dumps(model))
    old = weakref.ref(first.optimizers[0]._pipeline)
    del first

    class OldPipeline(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            gc.collect()
            self.alive = old() is not None

    check = OldPipeline()
    trainer(tmp_path, max_steps=2, callbacks=[check]).fit(model)
    assert not check.alive


class OwnConfigureOptimizers(OffloadOptimizerMixin, pl.LightningModule):
    """The mixin's hooks with an overlapped OffloadAdamW of the module's own making."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(16), batch_size=4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> OffloadAdamW:
        optimizer = OffloadAdamW(self.parameters(), lr=0.02, force_staging=True, chunk_size=64)
        optimizer.overlap_with(self)
        return optimizer


class ReadsWeightsAtTheEnd(pl.Callback):
    """A log of the weights' norm at each epoch's end and training's end (as ``ModelPruning``
    reads them there), before the module's own hooks run."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.norm = sum(p.detach().norm() for p in pl_module.parameters())

    on_train_end = on_train_epoch_end


def test_callbacks_reading_weights_at_epoch_end_wait_with_the_modules_own_optimizer(
    tmp_path, stream_order
):
    """The callback that orders the others' epoch-end and end hooks after the last step's
    updates goes first whoever makes the overlapped optimizer, and takes the hooks off when a
    callback's ``on_fit_start`` raises."""
    import pickle

    fit = trainer(tmp_path, max_epochs=2, max_steps=-1, callbacks=[ReadsWeightsAtTheEnd()])
    fit.fit(OwnConfigureOptimizers())
    stream_order.expect_none()
    model = OwnConfigureOptimizers()
    with pytest.raises(RuntimeError, match="simulated"):
        trainer(tmp_path, callbacks=[RaisesAtFitStart()]).fit(model)
    assert not any(m._forward_pre_hooks for m in model.modules())
    pickle.dumps(model)


class ResidentFailsOnce(FailsOnce):
    """:class:`FailsOnce` with half its state resident; ``overlap_step`` as asked."""

    def __init__(self, overlap: bool) -> None:
        super().__init__()
        self.save_hyperparameters({"overlap_step": overlap, "offload_resident": 0.5})
        self.states: list[dict[str, Any]] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.states.append(copy.deepcopy(self.trainer.optimizers[0].state_dict()))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "not-overlapped"])
def test_a_fit_that_failed_frees_the_optimizers_device_memory(tmp_path, stream_order, overlap):
    """A sweep's failed trial (an OOM in a training step) must not keep its staging buffers and
    resident state on the device for the next trial: Lightning calls no ``on_train_end`` then,
    and frees only the state it finds in ``optimizer.state``. The resident state is written
    back first: the optimizer's state is the last step's."""
    FailsOnce.failed = False
    model = ResidentFailsOnce(overlap)
    fit = trainer(tmp_path, max_steps=6)
    with pytest.raises(RuntimeError, match="simulated"):
        fit.fit(model)
    optimizer = fit.optimizers[0]
    assert len(model.states) == 2  # two steps, then the failure
    assert optimizer.memory_stats()["staging_bytes"] == 0
    assert optimizer.memory_stats()["resident_bytes"] == 0
    stream_order.expect_none()
    last, now = model.states[-1]["state"], optimizer.state_dict()["state"]
    assert last.keys() == now.keys()
    for index, entry in last.items():
        assert_same(list(entry.values()), [now[index][key] for key in entry])


@pytest.mark.parametrize("failing", ["release_device_memory", "remove"])
def test_a_clean_up_that_fails_after_a_failed_fit_warns_and_the_others_still_run(
    tmp_path, monkeypatch, failing
):
    """Cleaning up after a failed fit may fail too (a device in an error state): the exception
    that ended the fit is the one raised, a warning says what was not released, and the other
    clean-ups still run (hooks that could not be removed still free the device memory)."""

    owner = OffloadAdamW if failing == "release_device_memory" else ForwardOverlap
    works = getattr(owner, failing)
    failed: list[bool] = []

    def broken(self: Any) -> None:  # once: the finalizers clean up later
        if not failed:
            failed.append(True)
            raise RuntimeError("device lost")
        works(self)

    monkeypatch.setattr(owner, failing, broken)
    FailsOnce.failed = False
    model = ResidentFailsOnce(overlap=True)
    fit = trainer(tmp_path, max_steps=6)
    warned = pytest.warns(UserWarning, match=r"could not be released: RuntimeError\('device lost")
    with warned, pytest.raises(RuntimeError, match="simulated"):
        fit.fit(model)
    if failing == "remove":
        stats = fit.optimizers[0].memory_stats()
        assert stats["staging_bytes"] == stats["resident_bytes"] == 0


class CountsGuards(pl.Callback):
    """Where the mixin's guards are among the trainer's callbacks, at each batch."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.seen.append([i for i, c in enumerate(trainer.callbacks) if isinstance(c, _FitGuard)])


def test_one_guard_leads_each_fit_also_when_a_failed_fit_is_retried_on_its_trainer(
    tmp_path, stream_order
):
    """A fit that raised leaves its guard among the trainer's callbacks (Lightning runs no
    ``teardown`` then): a retry on the same Trainer still runs with one guard, first, and a fit
    that ends takes it out."""
    FailsOnce.failed = False
    counter = CountsGuards()
    fit = trainer(tmp_path, max_steps=4, callbacks=[counter])
    model = FailsOnce()
    with pytest.raises(RuntimeError, match="simulated"):
        fit.fit(model)
    fit.fit(model)
    assert len(counter.seen) == 5  # three batches (the third raises), then the two left
    assert all(seen == [0] for seen in counter.seen)
    assert not any(isinstance(c, _FitGuard) for c in fit.callbacks)


class Plain(pl.LightningModule):
    """A module without the mixin, whose training step raises an error of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(16), batch_size=4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise ValueError("the plain module's own error")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_guard_left_by_a_failed_fit_lets_a_plain_modules_error_through(tmp_path):
    """The guard a failed fit left on its Trainer does nothing for a module without the
    mixin fitted next on that Trainer: its own error is the one raised."""
    FailsOnce.failed = False
    fit = trainer(tmp_path, max_steps=4)
    with pytest.raises(RuntimeError, match="simulated"):
        fit.fit(FailsOnce())
    assert isinstance(fit.callbacks[0], _FitGuard)  # left: what this test is about
    with pytest.raises(ValueError, match="the plain module's own error"):
        fit.fit(Plain())


class BypassesTheHooks(ReadsHeadFirst):
    """A ``training_step`` that calls the layers' ``forward`` methods: no hook runs."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head.forward(torch.tanh(self.inp.forward(x))), y)


def test_the_unhooked_warning_in_a_fit_names_the_users_fit_line(tmp_path, stream_order):
    """Under Lightning the step is called from Lightning's loops: the warning skips them too,
    to the user's ``fit`` line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, max_steps=3).fit(BypassesTheHooks())
    unhooked = [w for w in caught if "no forward hook of the overlapped module" in str(w.message)]
    assert [w.filename for w in unhooked] == [__file__]
    stream_order.expect_none()


def test_a_users_folder_named_like_a_skipped_package_is_the_users(tmp_path, monkeypatch):
    """The warnings skip frames by package folder: a user's folder whose name only begins like
    one of those (``lightning_runs/`` beside ``lightning/``) is the user's own."""
    import sys

    monkeypatch.setattr(sys.modules["lightning"], "__file__", str(tmp_path / "lib/__init__.py"))
    user_file = str(tmp_path / "lib_runs" / "train.py")
    source = (
        "def train(model, optimizer):\n"
        "    for _ in range(3):\n"
        "        model.forward(torch.ones(2, 4)).sum().backward()\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
    )
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(source, user_file, "exec"), namespace)
    model = nn.Linear(4, 2)
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace["train"](model, ours)
    unhooked = [w for w in caught if "no forward hook of the overlapped module" in str(w.message)]
    assert [w.filename for w in unhooked] == [user_file]
    ours.wait_for_updates()


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al., 2019) as optimizer libraries write it: a wrapper whose ``step``
    steps the inner optimizer, then, every ``k`` steps, moves the slow weights towards the
    parameters and sets the parameters to them, as soon as the inner step returns."""

    def __init__(self, inner: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        self.inner, self.k, self.alpha, self.steps = inner, k, alpha, 0
        self.fast = [p for group in inner.param_groups for p in group["params"]]
        self.slow = [p.detach().clone() for p in self.fast]

    def step(self, closure: Any = None) -> None:  # no decorator: its caller is the next frame
        self.inner.step()
        self.steps += 1
        if self.steps % self.k == 0:
            with torch.no_grad():
                for slow, fast in zip(self.slow, self.fast, strict=True):
                    slow.add_(fast - slow, alpha=self.alpha)
                    fast.copy_(slow)


class Harness:
    """A training harness whose own ``step`` steps the optimizer it is given."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()


@pytest.mark.parametrize(
    ("overlapped", "called"),
    [(True, "directly"), (True, "from-a-harness-step"), (False, "directly")],
    ids=["overlapped", "overlapped-from-a-harness-step", "not-overlapped"],
)
def test_a_wrapping_optimizer_reading_the_weights_in_its_step_is_ordered(
    stream_order, overlapped, called
):
    """A wrapper's ``step`` (Lookahead here; ``ZeroRedundancyOptimizer`` broadcasts the
    parameters, ``PostLocalSGDOptimizer`` averages them) reads and writes the parameters as soon
    as the inner step returns, where no hook can order it: the step waits for its own updates
    there, with one warning, and trains as torch AdamW under the same wrapper. Also where the
    wrapper is itself stepped by a method named ``step`` of something else (a harness). Without
    ``overlap_with`` the step is done when it returns: no warning, no failure."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    twin = copy.deepcopy(model)
    if overlapped:
        inner, torch_inner = overlapped_pair(model, twin, lr=0.02)
    else:
        inner = OffloadAdamW(model.parameters(), lr=0.02, force_staging=True, chunk_size=64)
        torch_inner = torch.optim.AdamW(twin.parameters(), lr=0.02, fused=True)
    ours, theirs = Lookahead(inner), Lookahead(torch_inner)
    stepping = {"directly": lambda o: o, "from-a-harness-step": Harness}[called]
    generator = torch.Generator().manual_seed(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
            for net, optimizer in ((model, ours), (twin, theirs)):
                F.mse_loss(net(x), y).backward()
                stepping(optimizer).step()
                optimizer.inner.zero_grad()
    inside = [w for w in caught if "runs inside Lookahead.step()" in str(w.message)]
    if overlapped:
        assert [w.filename for w in inside] == [__file__]  # once, at the user's line
    else:
        assert caught == []
    stream_order.expect_none()
    inner.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))


def test_a_backward_after_the_step_waits_for_the_updates_reading_the_gradients(stream_order):
    """The next micro-batch's forward runs before the step and its backward after it, with no
    ``zero_grad`` in between: the backward accumulates, in place, into gradients the queued
    updates still read. Its first gradient orders it after them (as for DDP's buckets). (One
    layer whose input needs no gradient: the graph saved no weight. One that did is refused, see
    test_a_backward_through_a_graph_recorded_before_the_step_is_refused.)"""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    reference = copy.deepcopy(model)
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    inputs = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(1))
    for net, optimizer in ((model, ours), (reference, torch_opt)):
        loss = net(inputs[0]).pow(2).sum()
        for x in inputs[1:]:
            loss.backward()
            loss = net(x).pow(2).sum()  # built before the step, backward after it
            optimizer.step()
    stream_order.expect_none()
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_no_unhooked_warning_for_isolated_steps_without_a_forward(stream_order):
    """A step repeated without a forward pass in between is one step no hook preceded; two of
    them far apart, with forward passes between, are not "the last two steps"."""
    model = nn.Linear(4, 2)
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            ours.step()
            ours.step()  # again, on the same gradients: no forward ran since the last step
            ours.zero_grad()
    stream_order.expect_none()


def test_a_forward_that_raises_before_the_first_step_leaves_no_watch_behind():
    """A forward that raises (an out-of-memory caught by a batch-size search) does not leave
    the read watch on the torch-function stack, where it would watch, and slow, every op
    outside the module until the first step, and mark reads there as reads before a hook."""

    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:  # before any submodule ran
                raise RuntimeError("out of memory (simulated)")
            return self.lin(x)

    model = Flaky()
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    overlap = ours.overlap_with(model)
    depth = torch._C._len_torch_function_stack()
    with pytest.raises(RuntimeError, match="simulated"):
        model(torch.ones(2, 4))
    assert torch._C._len_torch_function_stack() == depth
    model.lin.weight.sum()  # outside any forward: not a read before its hook
    model.fail = False
    model(torch.ones(2, 4)).sum().backward()
    assert torch._C._len_torch_function_stack() == depth
    assert not overlap.read_before_hook


class DeclaredLastUsedFirst(nn.Module):
    """``a`` is declared (laid out) first, ``b`` used first: overlapped steps order the chunks
    b, a; steps without the overlap in memory order, a, b."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8, bias=False)  # 64 elements: one chunk each
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.a(torch.tanh(self.b(x))).square().sum()


def test_copies_queued_in_backward_after_a_step_without_the_overlap(stream_order):
    """The overlap removed for a step and added again: the next forward queues no copies of the
    last overlapped step's chunks, whose staging buffers are no longer the ones the step
    between wrote each host range back from (the copy of b would read its host range before
    that step's write-back of it ends). Found by a review, with the checker."""
    model, reference = DeclaredLastUsedFirst(), DeclaredLastUsedFirst()
    opt = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, fused=True)
    inputs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    pairs = [(model, opt), (reference, ref_opt)]
    train_alike(pairs, inputs[0:1])  # laid out as declared: a, b
    overlap = opt.overlap_with(model)
    train_alike(pairs, inputs[1:2])  # chunks b, a
    overlap.remove()
    train_alike(pairs, inputs[2:3])  # chunks a, b
    opt.overlap_with(model)
    train_alike(pairs, inputs[3:4])
    train_alike(pairs, inputs[4:5])
    opt.wait_for_updates()
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(reference.parameters()))


def four_layers() -> nn.Module:
    """Four weights of 100 elements, each a chunk of its own at ``chunk_size=128``."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(10, 10, bias=False) for _ in range(4)))


def test_a_resident_share_set_between_backward_and_step_reloads_what_moved_turns(stream_order):
    """The first two parameters are resident; the forward queues the copy of the third into
    staging buffer 0, its turn in that plan. Setting ``resident = None`` before the step makes
    the third chunk's turn 2, which also takes buffer 0 after the first chunk has loaded into
    it: the copy queued ahead is not the third chunk's, so it loads again (it was updated
    from the first chunk's state). Found by a review, with the checker."""
    model, reference = four_layers(), four_layers()
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=128, resident=1600)
    opt.overlap_with(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), fused=True)
    for step in range(4):
        x = torch.full((3, 10), 0.5 + step)
        for net, o in ((model, opt), (reference, ref_opt)):
            net(x).pow(2).sum().backward()
            if step == 2 and o is opt:
                opt.resident = None
            o.step()
            o.zero_grad()
    assert_overlapped_alike(stream_order, opt, model, reference)


class SquaredSum(nn.Sequential):
    def forward(self, x):
        return super().forward(x).pow(2).sum()


def test_a_load_waits_for_a_copy_queued_ahead_that_the_step_left_unused(stream_order):
    """``a`` is resident; each forward pass queues the copy of ``b``'s chunk for the next step.
    With ``b`` frozen for that step nothing uses the copy, and nothing later on its stream
    (only resident updates run) orders it: a load writing the host buffers must still wait
    for it to finish reading them. Found by a review, with the checker."""
    torch.manual_seed(0)
    model = SquaredSum(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    reference = copy.deepcopy(model)
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=512)
    opt.overlap_with(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), fused=True)
    pairs = [(model, opt), (reference, ref_opt)]
    inputs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    train_alike(pairs, inputs[0:2])  # a resident from the second step
    for net in (model, reference):
        net[1].requires_grad_(False)
    train_alike(pairs, inputs[2:3])  # b's copy queued ahead, unused
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for net in (model, reference):
        net[1].requires_grad_(True)
    train_alike(pairs, inputs[3:4])
    assert_overlapped_alike(stream_order, opt, model, reference)


def test_an_arena_dropped_after_the_overlap_is_removed_is_freed():
    """After the overlap is removed, nothing keeps the last overlapped step's chunks, and with
    them arenas the host state dropped (their host and resident buffers), which
    ``memory_stats()`` no longer counts."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=0.5)
    overlap = opt.overlap_with(model)
    pair = [(lambda x: model(x).square().sum(), opt)]
    inputs = [torch.randn(2, 16, generator=torch.Generator().manual_seed(0))]
    train_alike(pair, inputs * 3)
    old = weakref.ref(opt._host.arenas[0])
    overlap.remove()
    opt.state.clear()  # a new phase of training: the state laid out anew
    train_alike(pair, inputs * 2)
    gc.collect()
    assert old() is None


# ------------------------------------------------ reads before a hook that the watch must see
class _TableLookup(torch.autograd.Function):
    """A custom (fused-kernel style) embedding lookup: its forward runs with grad off."""

    @staticmethod
    def forward(ctx, tokens, weight):
        ctx.save_for_backward(tokens)
        ctx.shape = weight.shape
        return weight[tokens]

    @staticmethod
    def backward(ctx, grad):
        (tokens,) = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        return None, torch.zeros(ctx.shape).index_add_(0, tokens.flatten(), flat)


class TiedLookup(nn.Module):
    """``head.weight`` is read as an embedding table before ``head``'s own hook runs, in one
    of several ways; ``tied=False`` takes the untied path, which calls only hooked modules."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.head.weight)

    def forward(self, tokens: torch.Tensor, tied: bool = True) -> torch.Tensor:
        if not tied:
            x = self.emb(tokens)
        elif self.how == "no_grad":
            with torch.no_grad():
                table = self.head.weight * 1.0
            x = F.embedding(tokens, table)
        elif self.how == "function":
            x = _TableLookup.apply(tokens, self.head.weight)
        elif self.how == "reentrant":
            x = checkpoint(self.lookup, tokens, use_reentrant=True) + self.emb(tokens) * 0
        elif self.how == "tolist":  # read into Python: no op returns a tensor of it
            x = F.embedding(tokens, torch.tensor(self.head.weight.tolist()))
        elif self.how == "equal":
            x = self.emb(tokens) * (not torch.equal(self.head.weight, self.emb.weight))
        else:
            x = self.lookup(tokens)
        return self.head(torch.tanh(self.mid(x))).logsumexp(-1).mean()


def train_tied(how="plain", passes=lambda step: [True], before_step=lambda step, opt, m: None):
    """Four overlapped steps against torch's fused AdamW; the checker sees every access."""
    model = TiedLookup(how)
    twin = copy.deepcopy(model)
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    reference = torch.optim.AdamW(twin.parameters(), lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        for tied in passes(step):
            tokens = torch.randint(0, 10, (3, 4), generator=generator)
            model(tokens, tied).backward()
            twin(tokens, tied).backward()
        before_step(step, ours, model)
        for optimizer in (ours, reference):
            optimizer.step()
            optimizer.zero_grad()
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))
    assert id(model.head.weight) in ours._overlapping().read_before_hook


@pytest.mark.parametrize("how", ["plain", "no_grad", "function", "reentrant", "tolist", "equal"])
def test_reads_before_the_hook_are_seen_whatever_the_grad_mode_inside_the_pass(how):
    """A training pass is watched whole: a read under no_grad, in a custom Function's forward
    or in a reentrant checkpoint (both run with grad off) is found and waited for, and so is
    one into Python values (``.tolist()``, ``torch.equal``), by ops that return no tensor."""
    train_tied(how)


def test_overlap_turned_on_between_backward_and_step_still_watches_later_passes():
    """A step that saw no forward waits for everything, and leaves the watch on for the next
    pass (which finds the read before the hook)."""

    def replace_overlap(step, optimizer, model):
        if step == 0:
            optimizer.overlap_with(model)

    train_tied(before_step=replace_overlap)


def test_a_read_before_the_hook_in_a_later_micro_batch_is_seen():
    """The first micro-batch calls only hooked modules; the second reads head.weight before
    head runs: 'reached' counts per pass, not since the last step."""
    train_tied(passes=lambda step: [False, True] if step == 0 else [True])


class HeadUsedLater(FunctionalHead):
    """Training reads ``head.weight`` functionally only from some step on (``head`` unused, so
    without gradients, before); evaluation calls ``head`` as a module."""

    def forward(self, x, use_head: bool = True):
        h = torch.tanh(self.body(x))
        return F.linear(h, self.head.weight, self.head.bias) if use_head else h


def test_an_evaluation_between_steps_does_not_count_as_a_hook_reaching_its_parameters(
    stream_order,
):
    """Which parameters no hook reaches is learnt from the training forward passes before each
    step: an evaluation pass (no_grad) that calls ``head`` as a module before a step does not
    reach it for the training passes, which read ``head.weight`` functionally. It first gets a
    gradient after the read watch stopped (the first step), so only "no training hook reached
    it" makes that step wait for its update, and the next training forward's functional read
    come after it."""
    model, reference = HeadUsedLater(), HeadUsedLater()
    opt, ref_opt = overlapped_pair(model, reference, lr=0.05)
    generator = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(3, 8, generator=generator)
        for net, o in ((model, opt), (reference, ref_opt)):
            net(x, use_head=step >= 2).pow(2).sum().backward()
            with torch.no_grad():  # between backward and step: nothing of head's to wait for
                net.evaluate(x)
            o.step()
            o.zero_grad()
    assert id(model.head.weight) in opt._overlap.early
    assert_overlapped_alike(stream_order, opt, model, reference)


def test_the_unhooked_warning_is_given_once_for_a_run_of_unhooked_steps(stream_order):
    """A run of steps that no hook of the overlapped module preceded warns once (at the second
    step), not at every later step; a hooked step starts the count again."""
    model = nn.Linear(4, 2)
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ours.overlap_with(nn.Linear(2, 2))  # not the module training calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            model(torch.ones(2, 4)).sum().backward()
            ours.step()
            ours.zero_grad()
    unhooked = [w for w in caught if "no forward hook of the overlapped module" in str(w.message)]
    assert len(unhooked) == 1
    assert unhooked[0].filename == __file__  # the user's line that stepped, not the package's
    stream_order.expect_none()


class EvaluationFastPath(nn.Module):
    """Training calls the layers; evaluation (grad off) reads their weights functionally, in a
    fused path of its own, as ``nn.MultiheadAttention``'s fast path does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        if torch.is_grad_enabled():
            return self.b(torch.tanh(self.a(x)))
        h = torch.tanh(F.linear(x, self.a.weight, self.a.bias))
        return F.linear(h, self.b.weight, self.b.bias)


def test_an_evaluation_pass_before_the_first_step_is_not_watched(stream_order):
    """Performance (not results): the read watch learns from training passes only. An
    evaluation pass of the module before the first step (Lightning's sanity check) whose fast
    path reads the weights before their modules' hooks must not make them "early", waited for
    at every step (no forward pass could then overlap their updates)."""
    model, reference = EvaluationFastPath(), EvaluationFastPath()
    opt, ref_opt = overlapped_pair(model, reference, lr=0.05)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(3, 8, generator=generator) for _ in range(4)]
    with torch.no_grad():
        model(inputs[0])
    train_alike(
        [(lambda x: model(x).pow(2).sum(), opt), (lambda x: reference(x).pow(2).sum(), ref_opt)],
        inputs,
    )
    assert opt._overlap.read_before_hook == set() and opt._overlap.early == set()
    assert_overlapped_alike(stream_order, opt, model, reference)


class InterruptedOnce(nn.Module):
    """Its forward raises ``KeyboardInterrupt`` once, after ``a`` ran (a Ctrl-C in the first
    training forward): the module's ``always_call`` hook that ends the watched pass is skipped."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.interrupt = True

    def forward(self, x):
        h = self.a(x)
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return h.sum()


def test_removing_the_overlap_after_an_interrupted_pass_takes_the_watch_off_the_stack(
    stream_order,
):
    """A pass interrupted before the first step leaves the read watch on the torch-function
    stack; removing the overlap then (a fit torn down after the Ctrl-C) must take it off, or it
    would watch every later op of the process, and no later pass would take it off."""
    model = InterruptedOnce()
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    overlap = ours.overlap_with(model)
    depth = torch._C._len_torch_function_stack()
    with pytest.raises(KeyboardInterrupt):
        model(torch.ones(2, 4))
    assert torch._C._len_torch_function_stack() == depth + 1  # the pass left it there
    overlap.remove()
    assert torch._C._len_torch_function_stack() == depth
    model(torch.ones(2, 4)).backward()
    ours.step()
    assert torch._C._len_torch_function_stack() == depth
    stream_order.expect_none()


class ScaledLinear(nn.Module):
    """The overlapped module reads a parameter of its own in its forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.scale).pow(2).mean()


def test_the_modules_own_parameters_read_in_its_forward_are_not_early(stream_order):
    """The module's own hook reaches its parameters before its forward reads them: they wait
    there, in forward order, not as "early" (updated first and waited for at every step). The
    watch for reads before hooks began after that hook and took the reads for early ones."""
    model, twin = ScaledLinear(), ScaledLinear()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    train_alike([(model, ours), (twin, theirs)], [torch.ones(2, 8)] * 3)
    assert ours._overlap.read_before_hook == set() and ours._overlap.early == set()
    assert_overlapped_alike(stream_order, ours, model, twin)


def test_state_cleared_by_hand_after_an_overlapped_step_starts_from_the_updated_weights(
    stream_order,
):
    """``optimizer.state.clear()`` between an overlapped step and another on the same gradients,
    with no forward pass in between: the second step starts bf16 parameters' master copies
    from the weights, which the first step's updates may still be writing. The copy waits for
    them. Against torch: fused AdamW on fp32 copies, started afresh from the updated weights."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch_opt = exact_reference(list(reference.parameters()), lr=0.05)
    for net, optimizer in ((model, ours), (reference, torch_opt)):
        net(x).float().pow(2).sum().backward()
        optimizer.step()
    ours.state.clear()
    torch_opt = exact_reference(list(reference.parameters()), lr=0.05)
    for optimizer in (ours, torch_opt):
        optimizer.step()
    stream_order.expect_none()
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_backward_through_a_graph_recorded_before_the_step_is_refused(stream_order, dtype):
    """Two losses from one forward pass with a step between their backward passes (a GAN's
    discriminator output reused after its step): the second backward reads weights saved by a
    forward before the step, while their update is queued. Autograd refuses it, as after torch's
    default (foreach) AdamW, instead of reading them unordered (fused AdamW reads the new ones);
    nothing is half applied and a fresh forward pass trains on. (Under the stream checker's
    dispatch mode foreach AdamW's version bumps are not seen, so it is not run alongside.)"""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)

    model, reference = make(), make()
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    ours.overlap_with(model)
    torch_opt = exact_reference(list(reference.parameters()), lr=0.05)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    outputs = [net(x) for net in (model, reference)]
    for out, optimizer in zip(outputs, (ours, torch_opt), strict=True):
        out.float().pow(2).mean().backward(retain_graph=True)
        optimizer.step()
        optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        outputs[0].float().abs().mean().backward()
    stream_order.expect_none()
    for net, optimizer in ((model, ours), (reference, torch_opt)):
        net(x).float().abs().mean().backward()  # forward again: trains on
        optimizer.step()
    assert_overlapped_alike(stream_order, ours, model, reference)


def hook_counts(model: nn.Module) -> list[int]:
    return [
        len(hooks)
        for m in model.modules()
        if not isinstance(m, torch.jit.ScriptModule)
        for hooks in (
            m._forward_pre_hooks,
            m._forward_hooks,
            m._state_dict_pre_hooks,
            m._load_state_dict_pre_hooks,
        )
    ] + [len(p._backward_hooks or {}) for p in model.parameters()]


class RefusesLoadHooks(nn.Linear):
    """A module that takes no load hook (as a TorchScript module takes no forward hook)."""

    def register_load_state_dict_pre_hook(self, hook):
        raise RuntimeError("load hooks are not supported here (simulated)")


@pytest.mark.parametrize(
    ("inner", "error", "match"),
    [
        (
            lambda: torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh())),
            TypeError,
            "submodule 'inner' is a scripted TorchScript module .RecursiveScriptModule.",
        ),
        (lambda: RefusesLoadHooks(8, 8), RuntimeError, "simulated"),
    ],
    ids=["torchscript", "a-hook-refused"],
)
def test_an_overlap_that_cannot_hook_every_module_leaves_no_hook_behind(
    stream_order, inner, error, match
):
    """``overlap_with`` over a module holding one that refuses hooks: a clear error, no hook
    left on the modules visited before it (each would keep the failed overlap and its pipeline
    alive, and wait or watch in every forward pass), and the optimizer's overlap as it was."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 8)
            self.inner = inner()

        def forward(self, x):
            return self.inner(self.first(x))

    model = Holder()
    ours = OffloadAdamW(model.parameters(), lr=0.05, force_staging=True, chunk_size=64)
    before = hook_counts(model)
    with pytest.raises(error, match=match):
        ours.overlap_with(model)
    assert hook_counts(model) == before
    assert ours._overlapping() is None


def test_a_traced_submodule_trains_as_torch_with_the_overlap(stream_order):
    """``torch.jit.trace``'s modules take hooks (only scripted ones are refused): the traced
    part's submodules run inside TorchScript, where no hook of theirs runs, so their parameters
    are waited for at the step; exact against torch AdamW, every access ordered."""

    class WithTraced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.first = nn.Linear(4, 8)
            inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
            self.inner = torch.jit.trace(inner, torch.ones(1, 8))

        def forward(self, x):
            return self.inner(self.first(x))

    model, twin = WithTraced(), WithTraced()
    ours, theirs = overlapped_pair(model, twin, lr=0.05)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        for net, optimizer in ((model, ours), (twin, theirs)):
            net(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_overlapped_alike(stream_order, ours, model, twin)
