"""OffloadAdamW behind Lightning's and Fabric's wrappers.

``self.optimizers()`` in a LightningModule returns a ``LightningOptimizer``, and
``fabric.setup`` returns a Fabric optimizer and a Fabric module; the optimizer wrappers subclass
OffloadAdamW's class and forward attribute reads to it, not writes. Every method called on them
must act on the optimizer itself: results equal torch's fused AdamW and, under the stream
checker (on for every test here), every access is ordered.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import assert_same, assert_state_offloaded, exact_reference, run_script
from lightning.pytorch.core.optimizer import LightningOptimizer
from test_overlap import Net

from lightning_offload_optim import OffloadAdamW

LR = 0.05


def fabric(precision: str = "32-true") -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=1, precision=precision)


def wrapped(kind: str, resident: float | None = None) -> tuple[torch.nn.Module, OffloadAdamW, Any]:
    """A ``Net``, OffloadAdamW over it (staged) and the wrapper a user would call it through."""
    model = Net()
    optimizer = OffloadAdamW(
        model.parameters(), lr=LR, force_staging=True, chunk_size=64, resident=resident
    )
    if kind == "lightning":
        return model, optimizer, LightningOptimizer(optimizer)
    model, wrapper = fabric().setup(model, optimizer)
    return model, optimizer, wrapper


def torch_twin() -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """A ``Net`` and torch's fused AdamW over it: the reference."""
    reference = Net()
    return reference, torch.optim.AdamW(reference.parameters(), lr=LR, fused=True)


def tokens(generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 10, (4, 5), generator=generator)


def step_alike(model, optimizer, reference, ref_opt, generator: torch.Generator) -> None:
    """One step of each pair on the same tokens (``optimizer`` through its wrapper, if one)."""
    batch = tokens(generator)
    for net, opt in ((model, optimizer), (reference, ref_opt)):
        net(batch).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()


def refused_setting(wrapper: Any, optimizer: OffloadAdamW, name: str) -> None:
    """Reading ``name`` through ``wrapper`` gives the optimizer's; setting it is refused."""
    assert getattr(wrapper, name) == vars(optimizer)[f"_{name}"]
    with pytest.raises(AttributeError, match=f"{name} is read-only: the constructor takes it"):
        setattr(wrapper, name, getattr(wrapper, name))


WRAPPERS = ["lightning", "fabric"]


@pytest.mark.parametrize("kind", WRAPPERS)
def test_no_method_called_through_a_wrapper_keeps_anything_on_the_wrapper(stream_order, kind):
    """Each public method of OffloadAdamW (and setting ``resident``), called through a wrapper,
    sets no attribute of the wrapper: what it sets is the optimizer's, which steps."""
    model, optimizer, wrapper = wrapped(kind, resident=0.5)
    own = dict(vars(wrapper))
    generator = torch.Generator().manual_seed(0)
    extra = torch.nn.Parameter(torch.ones(3))
    calls = {
        "overlap_with": lambda: wrapper.overlap_with(model),
        "add_param_group": lambda: wrapper.add_param_group({"params": [extra]}),
        "zero_grad": lambda: wrapper.zero_grad(set_to_none=False),
        "state_dict": wrapper.state_dict,
        "register_state_dict_post_hook": lambda: wrapper.register_state_dict_post_hook(
            lambda opt, state_dict: None, prepend=True
        ),
        "load_state_dict": lambda: wrapper.load_state_dict(optimizer.state_dict()),
        "offloaded_state": lambda: wrapper.offloaded_state(model.scale),
        "take_copies_between_steps": wrapper.take_copies_between_steps,
        "memory_stats": wrapper.memory_stats,
        "last_step": lambda: wrapper.last_step,
        "wait_for_updates": wrapper.wait_for_updates,
        "release_device_memory": wrapper.release_device_memory,
        "resident": lambda: setattr(wrapper, "resident", 0.25),
    }
    for setting in ("enabled", "chunk_size", "pin_memory", "force_staging", "staging_pool"):
        calls[setting] = partial(refused_setting, wrapper, optimizer, setting)
    public = {n for n in vars(OffloadAdamW) if not n.startswith("_")} - {"step"}
    assert public <= set(calls), f"not called here: {sorted(public - set(calls))}"
    for name, call in calls.items():
        model(tokens(generator)).logsumexp(-1).mean().backward()
        optimizer.step()
        call()
        assert vars(wrapper) == own, f"{name} set {sorted(set(vars(wrapper)) - set(own))}"
    assert optimizer.resident == 0.25
    optimizer.wait_for_updates()
    stream_order.expect_none()


@pytest.mark.parametrize("kind", WRAPPERS)
def test_overlap_set_through_a_wrapper_overlaps_the_optimizers_steps(stream_order, kind):
    """``wrapper.overlap_with(model)``: the optimizer's own step returns before its updates
    (Lightning and Fabric step the optimizer, not the wrapper), using the first chunks the
    forward copied in, and ends where torch's does."""
    model, optimizer, wrapper = wrapped(kind)
    wrapper.overlap_with(model)
    reference, ref_opt = torch_twin()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        step_alike(model, optimizer, reference, ref_opt, generator)
    update = optimizer._pipeline.pool.streams[torch.device("cpu")].update
    assert stream_order.current.clock.get(update.id, 0) < update.clock[update.id]
    moved = optimizer.last_step.resolve()  # each chunk once: the forward's copies were used
    assert moved.bytes_in == moved.bytes_out == optimizer.memory_stats()["state_bytes"]
    wrapper.wait_for_updates()
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("kind", WRAPPERS)
def test_release_and_a_resident_share_set_through_a_wrapper_reach_the_optimizer(stream_order, kind):
    """``release_device_memory()`` through a wrapper frees the resident state, which the next
    step keeps again; ``wrapper.resident = 0.0`` drops it from the next step on."""
    model, optimizer, wrapper = wrapped(kind, resident=1.0)
    optimizer.overlap_with(model)
    reference, ref_opt = torch_twin()
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):
        step_alike(model, optimizer, reference, ref_opt, generator)
    full = optimizer.memory_stats()["resident_bytes"]
    assert full == optimizer.memory_stats()["state_bytes"]
    wrapper.release_device_memory()
    assert optimizer.memory_stats()["resident_bytes"] == 0
    step_alike(model, optimizer, reference, ref_opt, generator)
    assert optimizer.memory_stats()["resident_bytes"] == full
    wrapper.resident = 0.0
    assert optimizer.resident == 0.0
    step_alike(model, optimizer, reference, ref_opt, generator)
    assert optimizer.memory_stats()["resident_bytes"] == 0
    optimizer.wait_for_updates()
    stream_order.expect_none()
    assert_same(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("kind", WRAPPERS)
def test_a_state_dict_loaded_through_a_wrapper_reaches_the_optimizer(stream_order, kind):
    """Saved through one wrapper, loaded through another into a fresh optimizer, which then
    steps as the uninterrupted torch AdamW does."""
    model, optimizer, wrapper = wrapped(kind)
    reference, ref_opt = torch_twin()
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        step_alike(model, optimizer, reference, ref_opt, generator)
    saved = wrapper.state_dict()
    resumed, resumed_opt, resumed_wrapper = wrapped(kind)
    resumed.load_state_dict(model.state_dict())
    resumed_wrapper.load_state_dict(saved)
    assert_state_offloaded(resumed_opt, list(resumed.parameters()))
    for _ in range(2):
        step_alike(resumed, resumed_opt, reference, ref_opt, generator)
    stream_order.expect_none()
    assert_same(list(resumed.parameters()), list(reference.parameters()))


def test_an_optimizer_keeping_another_under_the_wrappers_name_acts_on_itself(stream_order):
    """Only a wrapper (no host store of its own) stands for the optimizer under ``_optimizer``:
    a subclass keeping another OffloadAdamW there steps, saves and is set as itself."""

    class WithShadow(OffloadAdamW):
        def __init__(self, params, shadow) -> None:
            super().__init__(params, lr=LR, force_staging=True, chunk_size=64)
            self._optimizer = OffloadAdamW(shadow, lr=LR)

    model, (reference, ref_opt) = Net(), torch_twin()
    optimizer = WithShadow(model.parameters(), Net().parameters())
    step_alike(model, optimizer, reference, ref_opt, torch.Generator().manual_seed(6))
    assert sorted(optimizer.state_dict()["state"]) == sorted(ref_opt.state_dict()["state"])
    optimizer.resident = 0.5
    assert optimizer.resident == 0.5 and optimizer._optimizer.resident is None
    assert_same(list(model.parameters()), list(reference.parameters()))


def test_a_fabric_modules_state_dict_waits_for_the_updates(stream_order):
    """Fabric's module reads the module it wraps for ``state_dict()``: with the overlap set on
    the Fabric module, that read still waits for the queued updates."""
    model, optimizer, wrapper = wrapped("fabric")
    optimizer.overlap_with(model)
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        model(tokens(generator)).logsumexp(-1).mean().backward()
        wrapper.step()
        wrapper.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    stream_order.expect_none()
    optimizer.wait_for_updates()
    assert_same(list(weights.values()), list(model.state_dict().values()))


def train_save_and_resume(
    setup: Callable[[], tuple[L.Fabric, torch.nn.Module, Any]],
    loss: Callable[[torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
    split: int,
    checkpoint: Path,
    max_norm: float,
) -> tuple[torch.nn.Module, Any]:
    """A Fabric loop as Fabric's docs write it: ``setup()`` gives a Fabric, a model and an
    optimizer, which take ``batches[:split]`` (backward, clipping by norm, step) and are saved
    to ``checkpoint``; a new ``setup()`` loads it (the state stays on the host) and takes the
    rest. Returns that model and optimizer."""

    def train(runner: L.Fabric, model: torch.nn.Module, optimizer: Any, batch) -> None:
        runner.backward(loss(model(batch)))
        runner.clip_gradients(model, optimizer, max_norm=max_norm)
        optimizer.step()
        optimizer.zero_grad()

    runner, model, optimizer = setup()
    for batch in batches[:split]:
        train(runner, model, optimizer, batch)
    runner.save(checkpoint, {"model": model, "optimizer": optimizer})
    runner, model, optimizer = setup()
    runner.load(checkpoint, {"model": model, "optimizer": optimizer})
    assert_state_offloaded(optimizer.optimizer, list(model.parameters()))
    for batch in batches[split:]:
        train(runner, model, optimizer, batch)
    return model, optimizer


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_fabric_trains_clips_saves_and_resumes_as_torch_adamw(
    stream_order, tmp_path, precision, overlap
):
    """``fabric.setup``, ``fabric.backward``, ``fabric.clip_gradients``, ``fabric.save`` and
    ``fabric.load`` into a new model and optimizer: each step as torch's AdamW on the same
    gradients (bf16: fused AdamW on fp32 master copies), the state kept on the host."""
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    reference = Net().to(dtype)
    ref_opt = exact_reference(list(reference.parameters()), lr=LR)
    generator = torch.Generator().manual_seed(5)
    batches = [tokens(generator) for _ in range(5)]

    def setup() -> tuple[L.Fabric, torch.nn.Module, OffloadAdamW]:
        runner = fabric(precision)
        net = Net()
        model, optimizer = runner.setup(
            net, OffloadAdamW(net.parameters(), lr=LR, force_staging=True, chunk_size=64)
        )
        if overlap:
            optimizer.overlap_with(model)
        return runner, model, optimizer

    model, optimizer = train_save_and_resume(
        setup, lambda out: out.logsumexp(-1).mean(), batches, 3, tmp_path / "f.ckpt", 0.5
    )
    for batch in batches:
        reference(batch).float().logsumexp(-1).mean().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    optimizer.wait_for_updates()
    stream_order.expect_none()
    params = list(model.parameters())
    assert {p.dtype for p in params} == {dtype}
    assert_same(params, list(reference.parameters()))


@pytest.mark.no_stream_check  # the processes run the checker themselves
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_fabric_on_two_processes_trains_and_resumes_as_torch_adamw(tmp_path, strategy):
    """Fabric's DDP and ModelParallelStrategy (FSDP2, a distributed checkpoint) on 2 CPU
    processes (``tests/fabric_fit.py``): overlapped, half resident and staged, every access
    ordered, every rank's weights as torch's fused AdamW's, uninterrupted and resumed."""
    run_script("fabric_fit.py", strategy, tmp_path)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        ours, theirs = result["offload"], result["torch"]
        assert ours["violations"] == []
        assert ours["resident_bytes"] > 0
        assert ours["deferred"] == [True] * 3  # each run of steps overlapped
        assert_same(ours["params"], theirs["params"])
        assert_same(ours["resumed"], theirs["resumed"])
        assert_same(ours["resumed"], ours["params"])  # resuming changed nothing
