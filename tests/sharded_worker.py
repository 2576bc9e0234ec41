"""Run by test_sharded.py: OffloadAdamW on DTensor parameters, side by side with torch AdamW.

Usage: python tests/sharded_worker.py WORLD_SIZE PHASE OUT_DIR. Starts WORLD_SIZE CPU processes
over gloo; each runs every scenario of PHASE and saves ``{scenario: result}`` to
OUT_DIR/PHASE-rank{r}.pt. A result holds ``ours`` and ``reference`` tensor lists (compared by
the test) and whatever else the scenario records. A scenario that raises records the error and
the others still run, so one failure does not hide the rest.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import MasterCopyAdamW, sequence_parallel
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import lightning_offload_optim.host_state as host_state
from lightning_offload_optim import OffloadAdamW

STEPS = 3
HYPER = {"lr": 0.01, "weight_decay": 0.1}


# ------------------------------------------------------------------------------ models
class Net(nn.Module):
    """Uneven shards on 2 ranks: 37 rows split 19/18, 75 rows 38/37, and one row 1/0 (rank 1
    holds empty shards of ``out``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 37)
        self.norm = nn.LayerNorm(37)
        self.hidden = nn.Linear(37, 75)
        self.out = nn.Linear(75, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.norm(self.inp(x)))))


def sharded_net(mesh, dtype=torch.float32, mp_policy=None) -> nn.Module:
    torch.manual_seed(0)
    model = Net().to(dtype)
    kwargs = {"mesh": mesh} | ({"mp_policy": mp_policy} if mp_policy else {})
    for layer in (model.inp, model.hidden, model.out):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch(step: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, 6, generator=generator).to(dtype)


def train_step(model: nn.Module, optimizer, step: int, clip: bool = True, dtype=torch.float32):
    model(batch(step, dtype)).float().pow(2).mean().backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()
    optimizer.zero_grad()


def full(tensors) -> list[torch.Tensor]:
    return [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]


# ------------------------------------------------------------------------------ step scenarios
def fsdp_pair(mesh, make_ours, make_reference, dtype=torch.float32, mp_policy=None, clip=True):
    result = {}
    for name, make in (("ours", make_ours), ("reference", make_reference)):
        model = sharded_net(mesh, dtype, mp_policy)
        optimizer = make(model.parameters())
        for step in range(STEPS):
            train_step(model, optimizer, step, clip, dtype)
        result[name] = full(model.parameters())
        if name == "ours":
            result["memory"] = optimizer.memory_stats()
    return result


def fsdp_steps(mesh) -> dict:
    result = fsdp_pair(
        mesh,
        lambda p: OffloadAdamW(p, **HYPER),
        lambda p: torch.optim.AdamW(p, fused=True, **HYPER),
    )
    model = sharded_net(mesh)
    optimizer = OffloadAdamW(model.parameters(), **HYPER)
    train_step(model, optimizer, 0)
    local = [p.to_local() for p in model.parameters()]
    result["local_numel"] = [p.numel() for p in local]
    result["state_bytes"] = optimizer.memory_stats()["state_bytes"]
    return result


def fsdp_amsgrad(mesh) -> dict:
    return fsdp_pair(
        mesh,
        lambda p: OffloadAdamW(p, amsgrad=True, **HYPER),
        lambda p: torch.optim.AdamW(p, amsgrad=True, fused=True, **HYPER),
    )


def fsdp_staged_small_chunks(mesh) -> dict:
    return fsdp_pair(
        mesh,
        lambda p: OffloadAdamW(p, force_staging=True, chunk_size=64, **HYPER),
        lambda p: torch.optim.AdamW(p, fused=True, **HYPER),
    )


def fsdp_bf16_params(mesh) -> dict:
    return fsdp_pair(
        mesh,
        lambda p: OffloadAdamW(p, force_staging=True, chunk_size=128, **HYPER),
        lambda p: MasterCopyAdamW(p, **HYPER),
        dtype=torch.bfloat16,
    )


def overlapped_net(mesh, layout: str) -> nn.Module:
    """The sharded model of the overlap scenarios. ``layout``: "units" (each layer a unit),
    "prefetch" (each unit prefetches the next one's all-gather in its pre-forward, before that
    unit's own hook runs), "async-prefetch" (and unshards asynchronously, on the caller's
    stream), "grouped" (``fully_shard([hidden, out])``: one all-gather for both, in the
    pre-forward of the first to run)."""
    if layout != "grouped":
        model = sharded_net(mesh)
    else:
        torch.manual_seed(0)
        model = Net()
        fully_shard(model.inp, mesh=mesh)
        fully_shard([model.hidden, model.out], mesh=mesh)
        fully_shard(model, mesh=mesh)
    if layout in ("prefetch", "async-prefetch"):
        model.inp.set_modules_to_forward_prefetch([model.hidden])
        model.hidden.set_modules_to_forward_prefetch([model.out])
    if layout == "async-prefetch":
        for unit in (model, model.inp, model.hidden, model.out):
            unit._set_unshard_async_op(True)
    return model


def subtree_less_nested_units(unit: nn.Module) -> list[torch.Tensor]:
    """What the overlap took for a unit's parameters before groups were seen."""
    from lightning_offload_optim.overlap import _is_fsdp2_unit

    nested = {
        id(p) for c in unit.modules() if c is not unit and _is_fsdp2_unit(c) for p in c.parameters()
    }
    return [p for p in unit.parameters() if id(p) not in nested]


def fsdp_overlapped(layout: str, without: str | None = None) -> Callable:
    """``overlap_with`` the sharded model (staged in small chunks) under the
    stream-ordering checker, which also simulates FSDP2's all-gather streams: each unit's
    all-gather copies its shards on a stream of its own, which must wait for their updates
    (see :func:`overlapped_net` for ``layout``). ``without`` removes one of the waits:
    "all_gathers" all of them, "prefetched" those for the prefetched units, "group" the
    grouped modules' (the checker must then see races); "streams" hides FSDP2's streams from
    the overlap, which must then wait for everything."""

    def run(mesh) -> dict:
        import stream_checker

        from lightning_offload_optim import overlap

        result = {}
        for name in ("ours", "reference"):
            model = overlapped_net(mesh, layout)
            with (
                stream_checker.StreamChecker() as checker,
                stream_checker._patch_context() as patch,
            ):
                if without == "all_gathers":
                    patch(overlap.ForwardOverlap, "_order_all_gathers", lambda *_: None)
                elif without == "prefetched":
                    real = overlap._all_gather_streams
                    patch(
                        overlap, "_all_gather_streams", lambda unit, real=real: (real(unit)[0], [])
                    )
                elif without == "streams":
                    patch(overlap, "_all_gather_streams", lambda unit: (None, []))
                elif without == "group":
                    patch(overlap, "_unit_parameters", subtree_less_nested_units)
                if name == "ours":
                    # Half resident; all offloaded for the group, whose last update (out's)
                    # would else be ordered before hidden's by the resident choice.
                    resident = None if layout == "grouped" else 0.5
                    optimizer = OffloadAdamW(
                        model.parameters(),
                        force_staging=True,
                        chunk_size=64,
                        resident=resident,
                        **HYPER,
                    )
                    optimizer.overlap_with(model)
                else:
                    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
                for step in range(STEPS + 1):
                    train_step(model, optimizer, step)
                if name == "ours":
                    # Results are the same whatever the share: only this shows it took effect.
                    kept = optimizer.memory_stats()["resident_bytes"]
                    assert (kept > 0) == (resident is not None), (layout, kept)
                    optimizer.wait_for_updates()
            result[name] = full(model.parameters())
            result[f"{name}_violations"] = checker.violations[:5]
        return result

    return run


#: tests/test_randomized.py's scenarios on 2 ranks: layers 1 wide leave rank 1 empty shards,
#: byte budgets for the resident share count each rank's own state, and the checker simulates
#: FSDP2's all-gather streams beside the overlap's.
RANDOM_SEEDS = range(6)


def random_scenario(seed: int) -> Callable:
    def run(mesh) -> dict:
        import stream_checker
        from test_randomized import run_scenario

        with stream_checker.StreamChecker() as checker:
            run_scenario(seed, torch.device("cpu"), mesh)  # asserts bit-identical results
        checker.expect_none()
        return {}

    return run


def fsdp_mixed_precision_policy(mesh) -> dict:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fsdp_pair(
        mesh,
        lambda p: OffloadAdamW(p, **HYPER),
        lambda p: torch.optim.AdamW(p, fused=True, **HYPER),
        mp_policy=policy,
    )


def tensor_parallel_placements(mesh) -> dict:
    """Shard(1), Replicate(), uneven Shard(0) and an empty Shard(0) local shard."""
    layouts = [((5, 9), Shard(1)), ((4, 3), Replicate()), ((3, 4), Shard(0)), ((1, 4), Shard(0))]
    generator = torch.Generator().manual_seed(5)
    full_params = [torch.randn(shape, generator=generator) for shape, _ in layouts]
    result = {}
    for name, make in (
        ("ours", lambda p: OffloadAdamW(p, force_staging=True, chunk_size=64, **HYPER)),
        ("reference", lambda p: torch.optim.AdamW(p, fused=True, **HYPER)),
    ):
        params = [
            nn.Parameter(distribute_tensor(f.clone(), mesh, [placement]))
            for f, (_, placement) in zip(full_params, layouts, strict=True)
        ]
        optimizer = make(params)
        grads = torch.Generator().manual_seed(6)
        for _ in range(STEPS):
            for p, (shape, placement) in zip(params, layouts, strict=True):
                p.grad = distribute_tensor(torch.randn(shape, generator=grads), mesh, [placement])
            optimizer.step()
        result[name] = full(params)
        if name == "ours":
            state = optimizer.state_dict()["state"]
            result["placements"] = [
                [str(state[i][key].placements) for key in ("exp_avg", "exp_avg_sq")]
                for i in range(len(params))
            ]
    result["param_placements"] = [str((placement,)) for _, placement in layouts]
    return result


class ParallelBlock(nn.Module):
    """A pre-norm MLP block as tensor parallelism shards it (torchtitan, Lightning's docs)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def tensor_parallel_block(overlapped: bool) -> Callable:
    """``parallelize_module`` with a ``SequenceParallel`` norm, whose replicated weights get
    partial-sum gradients (redistributed by the step, as torch's fused AdamW does), clipped;
    staged. The last step runs under a GradScaler's scale: gradients placed like their
    parameters come back unscaled, the partial sums as they were, both as torch leaves them.
    ``overlapped``: steps overlap the next forward, under the stream checker, which must see
    the redistributed gradients (temporaries here, unlike on one rank) held for the update."""

    def train(model: nn.Module, optimizer) -> None:
        for step in range(STEPS + 1):
            # This rank's half of the sequence (dimension 1), as SequenceParallel takes it.
            generator = torch.Generator().manual_seed(100 + step)
            x = torch.randn(2, 6, 8, generator=generator).chunk(2, dim=1)[dist.get_rank()]
            model(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if step == STEPS:
                optimizer.grad_scale, optimizer.found_inf = torch.tensor(4.0), torch.tensor(0.0)
            optimizer.step()
            if step < STEPS:
                optimizer.zero_grad()

    def run(mesh) -> dict:
        import stream_checker

        result: dict = {}
        for name in ("ours", "reference"):
            torch.manual_seed(0)
            model = sequence_parallel(ParallelBlock(), mesh, "norm", "up", "down")
            if name == "reference":
                train(model, torch.optim.AdamW(model.parameters(), fused=True, **HYPER))
            else:
                optimizer = OffloadAdamW(
                    model.parameters(), force_staging=True, chunk_size=64, **HYPER
                )
                checking = stream_checker.StreamChecker() if overlapped else None
                with checking or contextlib.nullcontext():
                    if overlapped:
                        optimizer.overlap_with(model)
                    train(model, optimizer)
                    optimizer.wait_for_updates()
                result["violations"] = checking.violations[:5] if checking else []
            params = list(model.parameters())
            result[name] = full(params) + [p.grad.to_local() for p in params]
            result[f"{name}_grad_placements"] = [str(p.grad.placements) for p in params]
        return result

    return run


def strided_shard_loads(mesh) -> dict:
    """Full tensors and replicated DTensors loaded into parameters whose ``_StridedShard``
    placement takes rows that are not one block (rows 0, 1, 4, 5 of 8 on rank 0; uneven with
    9 rows; along dimension 1): each rank must take its own rows, not a block at its offset.
    With ``split_factor=1`` a rank's rows are one block, which must start at its offset.
    The reference is the saved state gathered by DTensor itself. (Every rank makes the same
    tensors and takes its part without a scatter, which uneven strided shards do not take.)"""
    layouts = [
        ((8, 3), _StridedShard(0, split_factor=2)),
        ((9, 4), _StridedShard(0, split_factor=2)),
        ((3, 8), _StridedShard(1, split_factor=2)),
        ((6, 2), _StridedShard(0, split_factor=1)),
    ]
    generator = torch.Generator().manual_seed(7)
    values = [torch.randn(shape, generator=generator) for shape, _ in layouts]

    def make() -> tuple[list[nn.Parameter], OffloadAdamW]:
        params = [
            nn.Parameter(distribute_tensor(v.clone(), mesh, [placement], src_data_rank=None))
            for v, (_, placement) in zip(values, layouts, strict=True)
        ]
        return params, OffloadAdamW(params, **HYPER)

    params, optimizer = make()
    for p, (shape, placement) in zip(params, layouts, strict=True):
        grad = torch.randn(shape, generator=generator)
        p.grad = distribute_tensor(grad, mesh, [placement], src_data_rank=None)
    optimizer.step()
    saved = optimizer.state_dict()
    keys = ("exp_avg", "exp_avg_sq")
    reference = [saved["state"][i][k].full_tensor() for i in range(len(params)) for k in keys]
    result = {"reference": reference * 2, "ours": []}
    for convert in (
        lambda t: t.full_tensor(),
        lambda t: t.redistribute(t.device_mesh, [Replicate()]),
    ):
        converted = copy.deepcopy(saved)
        for entry in converted["state"].values():
            entry.update({k: convert(entry[k]) for k in keys})
        fresh, fresh_optimizer = make()
        fresh_optimizer.load_state_dict(converted)
        loaded = [fresh_optimizer.offloaded_state(p) for p in fresh]
        result["ours"] += [state[k].full_tensor() for state in loaded for k in keys]
    return result


def refusals(mesh) -> dict:
    """Wrong inputs are refused on every rank alike, and no rank is left in a collective."""
    param = nn.Parameter(distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)]))
    optimizer = OffloadAdamW([param], **HYPER)
    param.grad = torch.ones(6, 4)  # a plain tensor: torch's fused AdamW refuses it too
    messages = {}
    try:
        optimizer.step()
    except RuntimeError as error:
        messages["gradient"] = str(error)
    param.grad = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
    optimizer.step()
    saved = optimizer.state_dict()
    before = optimizer.offloaded_state(param)["exp_avg"].full_tensor()
    entry = saved["state"][0]
    # Sharded along the other dimension: made locally, as a redistribute from Shard(0) to
    # Shard(1) takes gloo's all-to-all fallback: one run aborted with a heap corruption right
    # after gloo warned of that fallback (not reproduced in 40 more redistributions).
    entry["exp_avg"] = DTensor.from_local(torch.zeros(6, 2), mesh, [Shard(1)], run_check=False)
    try:
        optimizer.load_state_dict(saved)
    except ValueError as error:
        messages["load"] = str(error)
    dist.barrier()  # every rank got here: none waits in a collective
    after = optimizer.offloaded_state(param)["exp_avg"].full_tensor()
    return {"messages": messages, "ours": [after], "reference": [before]}


def zero_redundancy(mesh) -> dict:
    """ZeroRedundancyOptimizer(optimizer_class=...): train, consolidate, load into a fresh one
    (which writes the moments straight into the inner optimizer's ``state``), consolidate
    again before any step, and train on; torch AdamW does exactly the same."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    shapes = [(37, 6), (37,), (75, 37), (75,), (1, 75)]
    result: dict = {}
    for name, optimizer_class, kwargs in (
        ("ours", OffloadAdamW, HYPER),
        ("reference", torch.optim.AdamW, HYPER | {"fused": True}),
    ):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(shape)) for shape in shapes]
        grads = torch.Generator().manual_seed(7)

        def train(optimizer, steps: int, params=params, grads=grads) -> None:
            for _ in range(steps):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=grads)
                optimizer.step()

        def consolidated(optimizer) -> dict:
            optimizer.consolidate_state_dict(to=0)
            state = [optimizer.state_dict() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(state, src=0)
            return state[0]

        def zero(params=params, optimizer_class=optimizer_class, kwargs=kwargs):
            return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)

        first = zero()
        train(first, STEPS)
        saved = consolidated(first)
        second = zero()
        second.load_state_dict(saved)
        again = consolidated(second)  # before any step: what was loaded
        result[f"{name}_moments"] = [e["exp_avg_sq"] for e in again["state"].values()]
        train(second, 2)
        result[name] = [p.detach().clone() for p in params]
        if name == "ours":
            inner = second.optim.state.values()
            result["only_steps_are_tensors"] = all(
                {k for k, v in entry.items() if isinstance(v, torch.Tensor)} == {"step"}
                for entry in inner
            )
    result["ours"] += result.pop("ours_moments")
    result["reference"] += result.pop("reference_moments")
    return result


def zero_redundancy_overlapped(mesh) -> dict:
    """DDP with ZeroRedundancyOptimizer(optimizer_class=OffloadAdamW), the inner optimizer
    overlapped with the model, under the checker: ZeRO broadcasts each rank's updated
    parameters inside its step, right after the inner step returns, so that step must wait for
    its updates (with a warning). Same parameters as under ZeRO with torch AdamW."""
    import warnings

    import stream_checker
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    result: dict = {}
    for name, optimizer_class, kwargs in (
        ("ours", OffloadAdamW, HYPER | {"force_staging": True, "chunk_size": 64}),
        ("reference", torch.optim.AdamW, HYPER | {"fused": True}),
    ):
        torch.manual_seed(0)
        model = DistributedDataParallel(
            nn.Sequential(nn.Linear(6, 37), nn.Tanh(), nn.Linear(37, 75), nn.Linear(75, 3))
        )
        zero = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=optimizer_class, **kwargs
        )
        if name == "ours":
            zero.optim.overlap_with(model)
        inputs = torch.Generator().manual_seed(11 + dist.get_rank())
        with stream_checker.StreamChecker() as checker, warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                model(torch.randn(8, 6, generator=inputs)).pow(2).mean().backward()
                zero.step()
                zero.zero_grad()
            if name == "ours":
                zero.optim.wait_for_updates()
        result[name] = [p.detach().clone() for p in model.parameters()]
        result[f"{name}_violations"] = checker.violations[:5]
        result[f"{name}_warnings"] = [str(warning.message) for warning in w]
    return result


# ------------------------------------------------------------------------------ checkpoints
def trained(mesh, make, steps=STEPS):
    model = sharded_net(mesh)
    optimizer = make(model.parameters())
    for step in range(steps):
        train_step(model, optimizer, step)
    return model, optimizer


def ours(params):
    return OffloadAdamW(params, **HYPER)


def torchs(params):
    return torch.optim.AdamW(params, fused=True, **HYPER)


def uninterrupted(mesh) -> list[torch.Tensor]:
    model, _ = trained(mesh, torchs, steps=STEPS + 2)
    return full(model.parameters())


def resume_and_finish(model, optimizer) -> list[torch.Tensor]:
    for step in range(STEPS, STEPS + 2):
        train_step(model, optimizer, step)
    return full(model.parameters())


def round_trip(mesh, save: Callable, load: Callable, make_saver=ours, make_loader=ours) -> dict:
    """Train STEPS with ``make_saver``, pass the state through ``save`` and ``load`` into a fresh
    model and optimizer built by ``make_loader``, train 2 more steps; the reference trains
    STEPS + 2 uninterrupted with torch AdamW."""
    model, optimizer = trained(mesh, make_saver)
    carried = save(model, optimizer)
    fresh = sharded_net(mesh)
    fresh_optimizer = make_loader(fresh.parameters())
    load(fresh, fresh_optimizer, carried)
    return {"ours": resume_and_finish(fresh, fresh_optimizer), "reference": uninterrupted(mesh)}


def sharded_state_dict(mesh) -> dict:
    """get/set_optimizer_state_dict in memory; the state dict views the host buffers."""
    model, optimizer = trained(mesh, ours)
    state = get_optimizer_state_dict(model, optimizer)["state"]
    host = optimizer._host
    views = [v for entry in state.values() for k, v in entry.items() if k != "step"]
    result = round_trip(
        mesh,
        lambda m, o: get_optimizer_state_dict(m, o) | {"model": get_model_state_dict(m)},
        lambda m, o, sd: (
            set_model_state_dict(m, sd.pop("model")),
            set_optimizer_state_dict(m, o, sd),
        ),
    )
    result["all_dtensors"] = all(isinstance(v, DTensor) for v in views)
    result["zero_copy"] = all(host.overlaps(v.to_local()) for v in views if v.to_local().numel())
    result["shapes_match"] = all(
        v.shape == p.shape and v.placements == p.placements and v.stride() == p.stride()
        for (fqn, entry), p in zip(state.items(), model.parameters(), strict=True)
        for k, v in entry.items()
        if k != "step"
    )
    return result


def dcp_save(directory: Path, options=None) -> Callable:
    def save(model, optimizer):
        dcp.save(
            {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optimizer, options=options),
            },
            checkpoint_id=directory,
        )

    return save


def dcp_load(directory: Path, options=None, tracker=None) -> Callable:
    def load(model, optimizer, _):
        if tracker:
            tracker.start()
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=options),
        }
        dcp.load(state, checkpoint_id=directory)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
        if tracker:
            tracker.stop()

    return load


class HostBytes:
    """Live and peak bytes of host state buffers, counted at the allocation seam."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.real = host_state.host_empty

    def start(self) -> None:
        self.live = self.peak = 0

        def counted(numel: int, dtype: torch.dtype) -> torch.Tensor:
            tensor = self.real(numel, dtype)
            nbytes = tensor.untyped_storage().nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor.untyped_storage(), self.freed, nbytes)
            return tensor

        host_state.host_empty = counted

    def freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def stop(self) -> None:
        host_state.host_empty = self.real


def distributed_checkpoint(mesh, out: Path) -> dict:
    """dcp.save / dcp.load of a sharded state, loaded in place: peak host bytes of the resume.
    Also leaves checkpoints of ours and of torch AdamW for a run with another world size."""
    tracker = HostBytes()
    directory = out / f"dcp-{mesh.size()}"
    result = round_trip(mesh, dcp_save(directory), dcp_load(directory, tracker=tracker))
    model, optimizer = trained(mesh, ours)
    dcp_save(directory)(model, optimizer)
    result["peak_host_bytes"] = tracker.peak
    result["state_bytes"] = optimizer.memory_stats()["state_bytes"]
    dcp_save(out / f"dcp-torch-{mesh.size()}")(*trained(mesh, torchs))
    return result


def flattened_checkpoint(mesh, out: Path) -> dict:
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    directory = out / f"flat-{mesh.size()}"
    return round_trip(mesh, dcp_save(directory, options), dcp_load(directory, options))


def torch_bf16_checkpoint_to_ours(mesh, out: Path) -> dict:
    """A torch AdamW distributed checkpoint of bf16 parameters (bf16 moments, no master copy)
    resumed with OffloadAdamW: read with allow_partial_load, the master copies come from the
    loaded weights and the moments are upcast. The reference continues the torch-trained model
    with fp32 AdamW on fp32 copies, loaded from the same torch state."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    directory = out / "torch-bf16"
    model = sharded_net(mesh, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    for step in range(STEPS):
        train_step(model, optimizer, step, dtype=torch.bfloat16)
    dcp_save(directory)(model, optimizer)

    fresh = sharded_net(mesh, torch.bfloat16)
    ours_optimizer = OffloadAdamW(fresh.parameters(), **HYPER)
    state = {
        "model": get_model_state_dict(fresh),
        "optim": get_optimizer_state_dict(fresh, ours_optimizer),
    }
    result = {}
    try:
        dcp.load(state, checkpoint_id=directory)
    except BaseException as error:  # dcp.CheckpointException derives from BaseException
        result["strict_error"] = str(error)
    dcp.load(state, checkpoint_id=directory, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, ours_optimizer, state["optim"])

    reference = MasterCopyAdamW(model.parameters(), **HYPER)
    reference.fp32.load_state_dict(optimizer.state_dict())
    for step in range(STEPS, STEPS + 2):
        train_step(fresh, ours_optimizer, step, dtype=torch.bfloat16)
        train_step(model, reference, step, dtype=torch.bfloat16)
    result["ours"] = full(fresh.parameters())
    result["reference"] = full(model.parameters())
    return result


def full_state_dict(mesh) -> dict:
    options = StateDictOptions(full_state_dict=True)
    return round_trip(
        mesh,
        lambda m, o: (
            get_optimizer_state_dict(m, o, options=options) | {"model": get_model_state_dict(m)}
        ),
        lambda m, o, sd: (
            set_model_state_dict(m, sd.pop("model")),
            set_optimizer_state_dict(m, o, sd, options=options),
        ),
    )


def full_state_dict_broadcast(mesh) -> dict:
    save_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    load_options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def save(model, optimizer):
        return (
            get_model_state_dict(model),
            get_optimizer_state_dict(model, optimizer, options=save_options),
        )

    def load(model, optimizer, carried):
        set_model_state_dict(model, carried[0])
        set_optimizer_state_dict(model, optimizer, carried[1], options=load_options)

    return round_trip(mesh, save, load)


def in_memory(copier: Callable, make_saver=ours, make_loader=ours) -> Callable:
    def run(mesh) -> dict:
        return round_trip(
            mesh,
            lambda m, o: copier(
                {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)}
            ),
            lambda m, o, sd: (
                set_model_state_dict(m, sd["model"]),
                set_optimizer_state_dict(m, o, sd["optim"]),
            ),
            make_saver,
            make_loader,
        )

    return run


def loaded_as(convert: Callable) -> Callable:
    """``optimizer.load_state_dict`` of our own state dict with every DTensor converted."""

    def save(model, optimizer) -> dict:
        saved = optimizer.state_dict()
        saved["state"] = {
            index: {k: convert(v) if isinstance(v, DTensor) else v for k, v in entry.items()}
            for index, entry in saved["state"].items()
        }
        return saved | {"model": get_model_state_dict(model)}

    def load(model, optimizer, saved) -> None:
        set_model_state_dict(model, saved.pop("model"))
        optimizer.load_state_dict(saved)

    return lambda mesh: round_trip(mesh, save, load)


def saved_and_loaded(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def resumed_from(out: Path, world_size: int) -> Callable:
    """Load checkpoints written by ``world_size`` ranks, ours into ours and torch's into torch
    AdamW, and finish training both."""

    def run(mesh) -> dict:
        result = {}
        for name, make, directory in (
            ("ours", ours, out / f"dcp-{world_size}"),
            ("reference", torchs, out / f"dcp-torch-{world_size}"),
        ):
            fresh = sharded_net(mesh)
            optimizer = make(fresh.parameters())
            dcp_load(directory)(fresh, optimizer, None)
            result[name] = resume_and_finish(fresh, optimizer)
        return result

    return run


def scenarios(phase: str, out: Path) -> dict[str, Callable]:
    if phase == "save":  # 1 rank: a checkpoint for the 2-rank run
        return {"save_for_2": lambda mesh: distributed_checkpoint(mesh, out)}
    if phase == "load2":  # 1 rank: the checkpoint written by 2 ranks
        return {"load_from_2": resumed_from(out, 2)}
    return {
        "fsdp_steps": fsdp_steps,
        "fsdp_amsgrad": fsdp_amsgrad,
        "fsdp_staged_small_chunks": fsdp_staged_small_chunks,
        "fsdp_bf16_params": fsdp_bf16_params,
        "fsdp_mixed_precision_policy": fsdp_mixed_precision_policy,
        "fsdp_overlapped": fsdp_overlapped("units"),
        "fsdp_overlapped_forward_prefetch": fsdp_overlapped("prefetch"),
        "fsdp_overlapped_async_prefetch": fsdp_overlapped("async-prefetch"),
        "fsdp_overlapped_grouped": fsdp_overlapped("grouped"),
        "fsdp_overlapped_streams_unknown": fsdp_overlapped("prefetch", "streams"),
        "fsdp_overlapped_without_all_gather_waits": fsdp_overlapped("units", "all_gathers"),
        "fsdp_overlapped_without_prefetch_waits": fsdp_overlapped("prefetch", "prefetched"),
        "fsdp_overlapped_async_without_prefetch_waits": fsdp_overlapped(
            "async-prefetch", "prefetched"
        ),
        "fsdp_overlapped_grouped_without_group": fsdp_overlapped("grouped", "group"),
        "tensor_parallel_placements": tensor_parallel_placements,
        "tensor_parallel_block": tensor_parallel_block(overlapped=False),
        "tensor_parallel_block_overlapped": tensor_parallel_block(overlapped=True),
        "strided_shard_loads": strided_shard_loads,
        "refusals": refusals,
        "zero_redundancy": zero_redundancy,
        "zero_redundancy_overlapped": zero_redundancy_overlapped,
        "sharded_state_dict": sharded_state_dict,
        "distributed_checkpoint": lambda mesh: distributed_checkpoint(mesh, out),
        "flattened_checkpoint": lambda mesh: flattened_checkpoint(mesh, out),
        "full_state_dict": full_state_dict,
        "torch_bf16_checkpoint_to_ours": lambda mesh: torch_bf16_checkpoint_to_ours(mesh, out),
        "full_state_dict_broadcast": full_state_dict_broadcast,
        "deepcopy": in_memory(copy.deepcopy),
        "torch_save": in_memory(saved_and_loaded),
        "torch_to_ours": in_memory(lambda sd: sd, make_saver=torchs),
        "ours_to_torch": in_memory(lambda sd: sd, make_loader=torchs),
        "load_from_1": resumed_from(out, 1),
        "plain_full_tensors": loaded_as(lambda t: t.full_tensor()),
        "replicated_dtensors": loaded_as(
            lambda t: t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)
        ),
        **{f"random_{seed}": random_scenario(seed) for seed in RANDOM_SEEDS},
    }


def worker(rank: int, world_size: int, phase: str, out: Path) -> None:
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, init_method=f"file://{out}/rendezvous-{phase}"
    )
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for name, scenario in scenarios(phase, out).items():
        try:
            results[name] = scenario(mesh)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    torch.save(results, out / f"{phase}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    world, phase_name, out_dir = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(worker, (world, phase_name, out_dir), nprocs=world)
