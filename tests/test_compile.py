"""Overlapped steps with a ``torch.compile``'d model, under the stream-ordering checker, against
torch fused AdamW with the same model compiled the same way.

The overlap's hooks must run as Python at every forward pass (a graph break at each hooked
module), not be traced: they order streams and queue copies from state that changes at every
step. A traced hook's stream waits and event records are replayed as they were when traced,
and the next step's prefetched copies become part of the model's graph. The ``aot_eager``
backend runs the compiled graphs' aten ops through the checker, which records them as eager
ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_overlapped_alike,
    assert_resident_as_asked,
    assert_same,
    overlapped_pair,
    token_batches,
    train_alike,
)
from lightning_models import AtTrainEnd, TinyModel, trainer
from test_randomized import run_scenario
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_offload_optim import OffloadAdamW

RESIDENT = [None, 0.5]
RESIDENT_IDS = ["offloaded", "resident-0.5"]
#: Before torch 2.12 the overlap's read watch is kept out of compiled code (each op a graph
#: break), so the watched forward pass and parameter-free ops between hooks run eagerly.
WATCHED_PASS_COMPILES = torch.__version__ >= (2, 12)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles anew (no graph cached by another test's models), with dynamo's
    default of not checking module hooks, which the first ``overlap_with`` turns off."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        yield
    torch._dynamo.reset()


class Recorder:
    """An ``aot_eager`` backend that notes every tensor a compiled graph takes as input, and
    counts the graphs it compiled and the runs of them."""

    def __init__(self) -> None:
        self.graph_inputs: list[torch.Tensor] = []
        self.compiled = 0
        self.runs = 0
        self.ops_run: list[str] = []  # the ops of each graph run, by name
        self._aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def __call__(
        self, graph: torch.fx.GraphModule, example_inputs: list[Any]
    ) -> Callable[..., Any]:
        self.graph_inputs.extend(t for t in example_inputs if isinstance(t, torch.Tensor))
        self.compiled += 1
        run = self._aot_eager(graph, example_inputs)
        ops = [
            getattr(node.target, "__name__", str(node.target))
            for node in graph.graph.nodes
            if node.op in ("call_function", "call_method")
        ]

        def counted(*args: Any) -> Any:
            self.runs += 1
            self.ops_run.extend(ops)
            return run(*args)

        return counted

    def assert_no_host_state(self, stream_order: Any) -> None:
        """No compiled graph reads the optimizer's host buffers: the copies the overlap queues
        after a forward pass (the next step's first chunks) were not traced into the model's
        graph."""
        assert self.compiled, "nothing was compiled"
        traced = [
            t
            for t in self.graph_inputs
            if t.untyped_storage().data_ptr() in stream_order.host_storages
        ]
        assert not traced, f"{len(traced)} host buffers are inputs of compiled graphs"


class TiedMLP(nn.Module):
    """An MLP between a tied embedding and decoder whose weights are read before their modules
    run (so the read watch must see them through the compiled forward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.dec = nn.Embedding(10, 8), nn.Linear(4, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.mlp(F.embedding(tokens, self.emb.weight))
        out = self.dec(torch.tanh(F.linear(x, self.dec.weight.t())))
        return (out - self.emb(tokens)).pow(2).mean()


@pytest.mark.parametrize("inside", [False, True], ids=["compiled", "inside-compiled-parent"])
@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_compiled_model_steps_as_torch(stream_order, resident, inside):
    """``torch.compile(model)``, or of a parent that calls it (so the hooks on ``model`` itself,
    which start the watch and queue the prefetch, are inside the compiled code too). Compiled
    graphs run at every step, the one watched before the first step included, and none is
    compiled again after the second."""
    model, twin = TiedMLP(), TiedMLP()
    ours, theirs = overlapped_pair(model, twin, lr=0.01, resident=resident)
    recorder = Recorder()
    wrap = nn.Sequential if inside else (lambda net: net)
    compiled = torch.compile(wrap(model), backend=recorder)
    compiled_twin = torch.compile(wrap(twin), backend="aot_eager")
    compiled_by_step, runs_by_step = [], []
    for tokens in token_batches(5, seed=5):
        before = recorder.compiled, recorder.runs
        train_alike([(compiled, ours), (compiled_twin, theirs)], [tokens])
        compiled_by_step.append(recorder.compiled - before[0])
        runs_by_step.append(recorder.runs - before[1])
    assert min(runs_by_step if WATCHED_PASS_COMPILES else runs_by_step[1:]) > 0, runs_by_step
    assert compiled_by_step[2:] == [0, 0, 0], compiled_by_step
    recorder.assert_no_host_state(stream_order)
    # The watch saw the tied reads through the compiled forward: they are updated first.
    assert ours._overlap.early == {id(model.emb.weight), id(model.dec.weight)}
    stream_order.expect_none()
    assert_resident_as_asked(ours)
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))


class PenalisedHead(TinyModel):
    """Reads the head's weight in ``training_step`` before the forward pass (a penalty), which
    the mixin's watch of ``training_step`` must see; logs nothing (on torch 2.13 Lightning's
    ``self.log`` fails to compile). ``blocks``: the whole network waits as one block."""

    blocks = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        penalty = self.net[3].weight.square().sum()
        return F.mse_loss(self(x), y) + 0.01 * penalty

    def offload_overlap_blocks(self) -> Any:
        return [self.net] if self.blocks else []


class HooksAtTrainEnd(AtTrainEnd):
    """Also the forward pre-hooks of the network's modules (the overlap's are gone after)."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)
        self.hooks = [len(m._forward_pre_hooks) for m in pl_module.net.modules()]


@pytest.mark.parametrize("blocks", [False, True], ids=["modules", "blocks"])
@pytest.mark.parametrize("resident", RESIDENT, ids=RESIDENT_IDS)
def test_compiled_lightning_module_trains_as_torch(tmp_path, stream_order, resident, blocks):
    """``trainer.fit(torch.compile(module))``: Lightning compiles ``forward`` and
    ``training_step`` (instance attributes), which the mixin's watch wraps until the first step
    and then gives back."""
    recorder = Recorder()
    models = []
    at_end = HooksAtTrainEnd()  # the offload run's
    for optimizer, backend in (
        ("offload", recorder),
        ("torch", "aot_eager"),
    ):
        model = PenalisedHead(
            optimizer,
            force_staging=True,
            overlap_step=optimizer == "offload",
            offload_resident=resident if optimizer == "offload" else None,
        )
        model.blocks = blocks
        fit = trainer(
            tmp_path / optimizer,
            max_steps=5,
            callbacks=[at_end if optimizer == "offload" else AtTrainEnd()],
        )
        fit.fit(torch.compile(model, backend=backend))
        models.append(model)
    offload, reference = models
    recorder.assert_no_host_state(stream_order)
    stream_order.expect_none()
    assert_same(list(offload.parameters()), list(reference.parameters()))
    assert at_end.overlap.early == {id(offload.net[3].weight)}  # the watch saw the penalty
    assert (at_end.stats["resident_bytes"] > 0) == (resident is not None)
    assert not hasattr(offload.training_step, "_offload_replaced")
    # Lightning's compiled training_step, given back by the watch
    assert hasattr(vars(offload)["training_step"], "_torchdynamo_orig_callable")
    # The network has a hook of its own only as a block (it has no parameters of its own).
    assert at_end.hooks[0] == (1 if blocks else 0)


@pytest.mark.parametrize("seed", range(8))
def test_random_scenario_compiled_matches_torch(stream_order, seed):
    """``tests/test_randomized.py``'s scenarios with the training forward passes compiled:
    layers used late and in shuffled orders (recompiles), evaluation and state-dict reads and
    loads between steps. How much dynamo compiles of these depends on its version (torch 2.13
    compiles the layers; with 2.11, seed 0 compiled nothing: dynamo gave up on the loop over
    them); the tests above check that graphs run."""
    run_scenario(seed, torch.device("cpu"), compiled=Recorder())
    stream_order.expect_none()


@pytest.mark.parametrize("seed", range(4))
def test_random_scenario_compiled_with_fsdp2_matches_torch(stream_order, mesh, seed):
    """The same under FSDP2. Dynamo compiles little or nothing of these (as without the
    overlap: FSDP2's own hooks break the graph in the layer loop), but it goes through them."""
    run_scenario(seed, torch.device("cpu"), mesh, compiled=Recorder())
    stream_order.expect_none()


@pytest.mark.parametrize("first", ["this-model", "same-class-model"])
def test_code_compiled_before_the_overlap_calls_its_hooks(stream_order, first):
    """Code dynamo compiled for a module without the overlap's hooks, for this model before
    ``overlap_with`` or for another of its class after (a reference, a teacher), is not reused
    for the overlapped model: by default dynamo does not check hooks before reusing code, and
    the forward after the first step then read parameters being updated."""
    model, twin = TiedMLP(), TiedMLP()
    tokens = torch.arange(6)
    if first == "this-model":  # compiled and run without hooks
        compiled = torch.compile(model, backend="aot_eager")
        compiled(tokens).backward()
        twin(tokens).backward()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    if first == "same-class-model":
        compiled = torch.compile(model, backend="aot_eager")
        torch.compile(TiedMLP(), backend="aot_eager")(tokens).backward()  # no hooks
    train_alike([(compiled, ours), (twin, theirs)], token_batches(4, seed=5))
    assert ours._overlap.pending  # the hooks ran: the steps overlap
    stream_order.expect_none()
    ours.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))


def test_an_overlap_whose_hooks_never_run_warns(stream_order):
    """An overlap given a module that training does not call: the steps wait for their own
    updates (correct, not overlapped), and the user is told."""
    model, twin = TiedMLP(), TiedMLP()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    ours.overlap_with(nn.Linear(2, 2))
    with pytest.warns(UserWarning, match="no forward hook of the overlapped module ran"):
        train_alike([(model, ours), (twin, theirs)], token_batches(3, seed=5))
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(twin.parameters()))


@pytest.mark.parametrize("compiled", ["model", "each-block", "wrapped-blocks"])
def test_compiled_model_with_blocks_steps_as_torch(stream_order, compiled):
    """``overlap_with(model, blocks=...)`` under ``torch.compile`` of the model, of each block
    in place (``block.compile()``), or of each block wrapped (``torch.compile(block)`` in its
    place, given as the blocks): a block called twice, a head tied to the embedding."""
    from test_overlap_blocks import Tower

    model, twin = Tower(), Tower()
    recorder = Recorder()
    if compiled == "wrapped-blocks":
        model.blocks = nn.ModuleList(torch.compile(b, backend=recorder) for b in model.blocks)
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    ours.overlap_with(model, blocks=model.blocks)
    if compiled == "each-block":
        for block in model.blocks:
            block.compile(backend=recorder)
    net = torch.compile(model, backend=recorder) if compiled == "model" else model
    train_alike([(net, ours), (twin, theirs)], token_batches(4, seed=5))
    recorder.assert_no_host_state(stream_order)
    assert ours._overlap.early == set()
    assert_overlapped_alike(stream_order, ours, model, twin)


class OperatorsFirst(nn.Module):
    """Blocks whose forward starts with a Python operator and has parameter-free ops between
    their layers. A graph break at an op there (as a watch never traced made) cannot be
    resumed from: dynamo then runs the whole frame eagerly, for good."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.g = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * 0.5
            h = torch.tanh(self.fc(x)).sin() @ torch.ones(8, 8)
            return x + self.g(h).cos().exp()

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(self.Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per-block"])
def test_parameter_free_ops_run_compiled_after_the_first_step(stream_order, per_block):
    """From the second step on, each block's parameter-free ops run in compiled graphs (the
    hooks break the graph at the layers, not at these), and the model steps as torch."""
    model, twin = OperatorsFirst(), OperatorsFirst()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    recorder = Recorder()
    if per_block:
        for block in model.blocks:
            block.compile(backend=recorder)
    compiled = model if per_block else torch.compile(model, backend=recorder)
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        recorder.ops_run.clear()  # the last step's are checked
        train_alike([(compiled, ours), (twin, theirs)], [torch.randn(5, 8, generator=generator)])
    compiled_ops = ("mul", "tanh", "sin", "matmul", "cos", "exp") if WATCHED_PASS_COMPILES else ()
    for op in compiled_ops:
        assert recorder.ops_run.count(op) == 2, (op, recorder.ops_run)
    assert_overlapped_alike(stream_order, ours, model, twin)


class ReadsAhead(nn.Module):
    """A layer whose forward reads its output projection's weight before calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.linear(x, self.out.weight.t())  # before out's hook
        return x + self.out(torch.tanh(self.inner(x)))


class DeepReadsAhead(nn.Module):
    """More layers of one class than dynamo compiles a code object for (its recompile limit,
    8), each reading a weight before its hook."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(ReadsAhead() for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.skipif(not WATCHED_PASS_COMPILES, reason="the watched pass runs eagerly")
def test_reads_before_hooks_in_compiled_layers_are_seen_without_compiling_per_layer(
    stream_order,
):
    """Each layer compiled (``layer.compile()``): the watch, traced into the layers' code,
    sees each weight read before its hook, and compiles that code once for all 12 layers. A
    test of the tensors' identity in the traced watch made dynamo compile it again for every
    layer's call (its activations differ), past its recompile limit: no graph ran from the
    second step on."""
    model, twin = DeepReadsAhead(), DeepReadsAhead()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    recorder = Recorder()

    def unwatched(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """The graphs run as a compiler's kernels run, unseen by torch-function modes (with
        ``aot_eager`` the watch would also see the reads eagerly, as the graph runs)."""
        run = recorder(graph, example_inputs)

        def hidden(*args: Any) -> Any:
            with torch._C.DisableTorchFunction():
                return run(*args)

        return hidden

    for layer in model.layers:
        layer.compile(backend=unwatched)
    generator = torch.Generator().manual_seed(6)
    runs_by_step = []
    for _ in range(4):
        before = recorder.runs
        train_alike([(model, ours), (twin, theirs)], [torch.randn(5, 8, generator=generator)])
        runs_by_step.append(recorder.runs - before)
    assert min(runs_by_step) >= 12, runs_by_step
    assert ours._overlap.early == {id(layer.out.weight) for layer in model.layers}
    assert_overlapped_alike(stream_order, ours, model, twin)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.square().mean()


def test_checkpointed_blocks_compiled_each_train_as_torch(stream_order):
    """Non-reentrant activation checkpointing of blocks compiled one by one: the first step's
    recomputation must run the code its forward ran (a watched forward split at every op,
    recomputed as one graph, failed with ``CheckpointError``)."""
    model, twin = Checkpointed(), Checkpointed()
    ours, theirs = overlapped_pair(model, twin, lr=0.01)
    for net in (model, twin):
        for block in net.blocks:
            block.compile(backend="aot_eager")
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(5, 8, generator=generator) for _ in range(3)]
    train_alike([(model, ours), (twin, theirs)], inputs)
    assert_overlapped_alike(stream_order, ours, model, twin)


@pytest.mark.parametrize("compiled", ["step", "step-with-closure", "training-step"])
@pytest.mark.parametrize(
    "mode", [{}, {"force_staging": True, "chunk_size": 64}], ids=["direct", "staged"]
)
def test_a_compiled_step_runs_eagerly_and_steps_as_torch(compiled, mode):
    """``torch.compile(optimizer.step)`` (torch's recipe for compiling an optimizer), or a
    compiled training step calling ``step()``, runs the update eagerly (a closure given to the
    compiled step is compiled). Traced, the update failed inside (an internal error of torch's
    functionalization) after the step counts had advanced, and every later step was refused."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    def training_step(model: nn.Module, optimizer: Any, x: torch.Tensor) -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    ours_model, torch_model = net(), net()
    ours = OffloadAdamW(ours_model.parameters(), lr=0.01, **mode)
    theirs = torch.optim.AdamW(torch_model.parameters(), lr=0.01, fused=True)
    if compiled == "training-step":
        training_step_ours = torch.compile(training_step, backend="aot_eager")
    else:
        compiled_step = torch.compile(ours.step, backend="aot_eager")
        ours.step = compiled_step  # as the recipe's loop calls it
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 8, generator=generator)
        if compiled == "step":
            training_step(ours_model, ours, x)
        elif compiled == "step-with-closure":
            loss = ours.step(lambda x=x: ours_model(x).square().mean().backward() or x.sum())
            assert_same([loss], [x.sum()])
            ours.zero_grad()
        else:
            training_step_ours(ours_model, ours, x)
        training_step(torch_model, theirs, x)
    assert_same(list(ours_model.parameters()), list(torch_model.parameters()))
    for p, r in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        mine, torchs = ours.offloaded_state(p), theirs.state[r]
        assert_same(
            [mine["exp_avg"], mine["exp_avg_sq"]], [torchs["exp_avg"], torchs["exp_avg_sq"]]
        )


def test_a_disabled_optimizers_compiled_step_is_torchs_compiled_step():
    """``enabled=False`` is torch's AdamW under ``torch.compile`` too: its step is traced into
    the same graphs as torch's (kept eager, it made none) and steps alike."""
    from torch._dynamo.testing import CompileCounter

    params = [torch.randn(40, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    reference = [p.clone() for p in params]
    ours = OffloadAdamW(params, lr=0.01, weight_decay=0.1, enabled=False)
    theirs = torch.optim.AdamW(reference, lr=0.01, weight_decay=0.1)
    counters = [CompileCounter(), CompileCounter()]
    steps = [
        torch.compile(opt.step, backend=c) for opt, c in zip((ours, theirs), counters, strict=True)
    ]
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        grads = [torch.randn(40, generator=generator) for _ in params]
        for ps, step in ((params, steps[0]), (reference, steps[1])):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
            step()
    assert counters[1].frame_count > 0
    assert (counters[0].frame_count, counters[0].op_count) == (
        counters[1].frame_count,
        counters[1].op_count,
    )
    assert_same(params, reference)
