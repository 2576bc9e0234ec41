"""Shared helpers: run OffloadAdamW and a torch reference side by side on identical inputs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from stream_checker import StreamChecker


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def stream_order(request: pytest.FixtureRequest):
    """Every CPU test runs under the stream-ordering checker: the staged pipeline gets simulated
    streams, and any conflicting access without an ordering event fails the test."""
    if request.node.get_closest_marker("cuda") or request.node.get_closest_marker(
        "no_stream_check"
    ):
        yield None
        return
    with StreamChecker() as checker:
        yield checker
    checker.expect_none()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    """A 1-rank gloo process group and CPU device mesh: FSDP2 and DTensor in one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rendezvous = tmp_path_factory.mktemp("rendezvous") / "file"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{rendezvous}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sequence_parallel(
    block: torch.nn.Module, mesh: Any, norm: str = "0", up: str = "1", down: str = "3"
) -> torch.nn.Module:
    """``block`` (a pre-norm MLP, an ``nn.Sequential`` by default) tensor parallel over
    ``mesh`` as Lightning's docs and torchtitan shard one: each rank holds a slice of the
    sequence (dimension 1) through the norm (``SequenceParallel``, whose replicated weights get
    partial-sum gradients), the up projection split by columns, the down one by rows."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        norm: SequenceParallel(),
        up: ColwiseParallel(input_layouts=Shard(1)),
        down: RowwiseParallel(output_layouts=Shard(1)),
    }
    return parallelize_module(block, mesh, plan)


SHAPES = [(300, 7), (5,), (1000,), (13, 17), (2, 3, 4, 5)]


@contextlib.contextmanager
def accelerator_seen() -> Iterator[None]:
    """An accelerator "available" only inside: the optimizer decides there whether to pin, and
    torch's AdamW step outside asks an available accelerator for its stream, which a CUDA build
    of torch without a GPU cannot answer."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.accelerator, "is_available", lambda: True)
        yield


def make_params(
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=generator, dtype=dtype).to(device))
        for s in shapes
    ]


def clone_params(params: Sequence[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params]


def set_grads(
    params_sets: Sequence[Sequence[torch.Tensor]],
    generator: torch.Generator,
    skip: Callable[[int], bool] = lambda i: False,
) -> None:
    """Give every set the same random gradients (None where ``skip(i)``)."""
    for i, params in enumerate(zip(*params_sets, strict=True)):
        grad = None
        if not skip(i):
            grad = torch.randn(params[0].shape, generator=generator, dtype=params[0].dtype)
        for p in params:
            p.grad = None if grad is None else grad.to(p.device).clone()


def step_together(
    optimizers: Sequence[torch.optim.Optimizer],
    params_sets: Sequence[Sequence[torch.Tensor]],
    generator: torch.Generator,
    steps: int,
    skip: Callable[[int], bool] = lambda i: False,
) -> None:
    """``steps`` times: give every set the same random gradients, then step every optimizer."""
    for _ in range(steps):
        set_grads(params_sets, generator, skip)
        for optimizer in optimizers:
            optimizer.step()


def train_alike(pairs: Sequence[tuple[Callable[[Any], torch.Tensor], Any]], inputs: Any) -> None:
    """For each input, each (model, optimizer) pair in turn: forward (to a scalar loss),
    backward, step and ``zero_grad``."""
    for x in inputs:
        for model, optimizer in pairs:
            model(x).backward()
            optimizer.step()
            optimizer.zero_grad()


def token_batches(count: int, seed: int) -> list[torch.Tensor]:
    """``count`` batches of 6 tokens below 10."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 10, (6,), generator=generator) for _ in range(count)]


def forked_child_memory_map() -> list[tuple[int, int]]:
    """The address ranges mapped in a child forked now (it waits, untouched, while the parent
    reads them; anything it did first could map memory where the parent's was)."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a threaded process may deadlock the child; this child
        # makes only system calls (close, read, _exit), which take no lock another thread held.
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        child = os.fork()
    if child == 0:
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        with open(f"/proc/{child}/maps") as maps:
            return [
                (int(low, 16), int(high, 16))
                for low, high in (line.split()[0].split("-") for line in maps)
            ]
    finally:
        os.close(write)
        os.waitpid(child, 0)


def fail_on_call(
    monkeypatch: pytest.MonkeyPatch, target: object, name: str, number: int, error: BaseException
) -> None:
    """Make ``target.name`` raise ``error`` on its ``number``-th call; other calls run as usual."""
    real = getattr(target, name)
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)


#: Failures of the process group's transport, not of the code under test: a run whose stderr
#: shows one of these is run once more (a real bug that makes a rank fail this way fails again).
TRANSPORT_FAILURES = (
    "Address already in use",
    "EADDRINUSE",
    "failed to listen",
    "Connection reset by peer",
    "terminate called without an active exception",
)


def run_script(name: str, *args: object, timeout: int = 900) -> None:
    """Run ``tests/<name>`` (a multi-process scenario) with the package and the tests
    importable; fail with the end of its stderr if it fails. A failure of the gloo transport
    alone (:data:`TRANSPORT_FAILURES`) is retried once, and both runs' ends are shown if the
    second fails too."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    failures = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(here / name), *map(str, args)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode == 0:
            return
        failures.append(f"exit code {done.returncode}:\n{done.stderr[-5000:]}")
        if not any(f in done.stderr for f in TRANSPORT_FAILURES):
            break
    raise AssertionError("\n---- then ----\n".join(failures))


def assert_state_offloaded(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> None:
    """The only tensor in each ``optimizer.state`` entry is its step count (Lightning copies
    every other tensor there to the accelerator on set-up and resume); the offloaded keys are
    listed with :class:`Offloaded` marks, as a flattened distributed checkpoint needs."""
    # Imported here: importing Lightning before pytest's log capture starts detaches its logger.
    from lightning_offload_optim.host_state import Offloaded

    for i, p in enumerate(params):
        entry = optimizer.state[p]
        tensors = {k for k, v in entry.items() if isinstance(v, torch.Tensor)}
        assert tensors == {"step"}, f"parameter {i}: tensors under {sorted(tensors)}"
        assert entry["step"].device.type == "cpu"
        marks = {k for k, v in entry.items() if isinstance(v, Offloaded)}
        assert marks | {"step"} == set(entry), f"parameter {i}: {entry}"
        assert marks >= {"exp_avg", "exp_avg_sq"}
        assert all(entry[k].key == k for k in marks)


class MasterCopyAdamW(torch.optim.Optimizer):
    """The exact reference for bf16 parameters, in torch alone: fused AdamW on fp32 copies of
    them, fed their upcast gradients, the parameters rounded from the copies after each step.
    DTensor parameters get DTensor copies, sharded alike. Hyperparameters written into its
    groups (by a scheduler, or by hand) reach the fp32 AdamW at the next step."""

    def __init__(self, param_groups: list[dict[str, Any]], **defaults: Any) -> None:
        adamw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
        super().__init__(param_groups, adamw | {"amsgrad": False, "maximize": False} | defaults)
        params = [p for group in self.param_groups for p in group["params"]]
        self.masters = {p: p.detach().float() for p in params}
        self.fp32 = torch.optim.AdamW(
            [{**g, "params": [self.masters[p] for p in g["params"]]} for g in self.param_groups],
            fused=True,
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, fp32_group in zip(self.param_groups, self.fp32.param_groups, strict=True):
            fp32_group.update((k, v) for k, v in group.items() if k != "params")
        for p, master in self.masters.items():
            master.grad = None if p.grad is None else p.grad.float()
        self.fp32.step()
        for p, master in self.masters.items():
            p.copy_(master)
        return loss

    @torch.no_grad()
    def take_edits(self) -> None:
        """Parameters written since the last step: where one no longer equals its master
        rounded to its dtype, the master takes its value (the rule OffloadAdamW documents)."""
        for p, master in self.masters.items():
            master.copy_(torch.where(master.to(p.dtype) == p, master, p.float()))


def exact_reference(params: list[torch.Tensor], **defaults: Any) -> torch.optim.Optimizer:
    """What OffloadAdamW must equal over ``params``: torch's fused AdamW, or for bf16/fp16
    parameters :class:`MasterCopyAdamW`."""
    groups = [{"params": list(params)}]
    if params[0].dtype in (torch.bfloat16, torch.float16):
        return MasterCopyAdamW(groups, **defaults)
    return torch.optim.AdamW(groups, **defaults, fused=True)


def clamp_alike(
    optimizer: Any, model: torch.nn.Module, reference: torch.nn.Module, masters: MasterCopyAdamW
) -> None:
    """Clamp the weights of ``model`` (overlapped: after waiting for its optimizer's queued
    updates, as the docs ask) and of ``reference``, whose ``masters`` then take the edits."""
    optimizer.wait_for_updates()
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            p.clamp_(-0.02, 0.02)
            r.clamp_(-0.02, 0.02)
    masters.take_edits()


def overlapped_pair(
    model: torch.nn.Module,
    twin: torch.nn.Module,
    lr: float,
    resident: Any = None,
    chunk_size: int = 64,
) -> tuple[torch.optim.Optimizer, torch.optim.AdamW]:
    """OffloadAdamW over ``model`` (staged, overlapping its forward passes) and torch fused
    AdamW over ``twin``, alike."""
    from lightning_offload_optim import OffloadAdamW  # here: see assert_state_offloaded

    ours = OffloadAdamW(
        model.parameters(), lr=lr, force_staging=True, chunk_size=chunk_size, resident=resident
    )
    ours.overlap_with(model)
    return ours, torch.optim.AdamW(twin.parameters(), lr=lr, fused=True)


def record_update_order(monkeypatch: pytest.MonkeyPatch, optimizer: Any) -> list[torch.Tensor]:
    """A list that each later step's chunk updates extend with their parameters, in order."""
    updated: list[torch.Tensor] = []
    real = optimizer._update_chunk

    def spy(chunk, views, active, *rest):  # type: ignore[no-untyped-def]
        updated.extend(active[s.index].param for s in chunk.segments)
        return real(chunk, views, active, *rest)

    monkeypatch.setattr(optimizer, "_update_chunk", spy)
    return updated


def assert_resident_as_asked(optimizer: Any, resident_bytes: int | None = None) -> None:
    """State kept on the device (``resident_bytes``, by default what the optimizer holds now)
    exactly where a share was asked for: results are the same whatever the share, so only this
    shows that it took effect."""
    if resident_bytes is None:
        resident_bytes = optimizer.memory_stats()["resident_bytes"]
    assert (resident_bytes > 0) == (optimizer.resident not in (None, 0, 0.0))


def assert_overlapped_alike(
    stream_order: Any, optimizer: Any, model: torch.nn.Module, twin: torch.nn.Module
) -> None:
    """Every access ordered, state kept resident where asked, and once the queued updates are
    done the same weights."""
    stream_order.expect_none()
    assert_resident_as_asked(optimizer)
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(twin.parameters()))


def assert_same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x.detach().cpu(), y.detach().cpu()), (
            f"tensor {i}: max diff {(x.detach().cpu() - y.detach().cpu()).abs().max()}"
        )


class TiedNet(torch.nn.Module):
    """An embedding whose weight the output projection reuses, and a layer in between."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16, dtype=dtype)
        self.hidden = torch.nn.Linear(16, 16, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.hidden(self.embed(tokens)))
        return (hidden @ self.embed.weight.T).float().logsumexp(-1).mean()


def step_in_backward(
    model: torch.nn.Module, make: Callable[[torch.Tensor], Any]
) -> dict[torch.Tensor, Any]:
    """One optimizer per parameter, stepped (and its gradient freed) as soon as backward has
    accumulated the parameter's gradient: the PyTorch tutorial's "optimizer step in backward",
    torchtune's ``optimizer_in_bwd``."""
    optimizers = {p: make(p) for p in model.parameters()}

    def step(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step)
    return optimizers
