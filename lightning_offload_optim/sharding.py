"""DTensor parameters (FSDP2, tensor parallel): local shards in, DTensors out.

Each rank keeps host state for its local shard of every parameter, and the step works on local
tensors only, exactly as torch's fused AdamW does under the hood: the optimizer has one path for
plain and sharded parameters, and this module is where the two meet.

- :func:`local` is the tensor a rank updates: the local shard of a DTensor, else the tensor;
  :func:`local_grad` the gradient it reads, redistributed first where it is placed otherwise.
- :func:`like_param` wraps a host view of local state as a DTensor with the parameter's mesh,
  placements, global shape and stride, so ``torch.distributed.checkpoint`` writes each rank's
  shard straight from host memory.
- :func:`local_source` turns a loaded tensor (a DTensor of the same sharding, a replicated
  DTensor, or a full tensor) into this rank's shard. It needs no collectives, so a load that one
  rank refuses cannot leave the others waiting in one; other shardings are refused with an error
  that says how to reshard (``torch.distributed.checkpoint`` does it while reading).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    _DTENSOR: type | tuple = DTensor
except ImportError:  # a torch build without torch.distributed: no DTensors can exist
    DTensor = Replicate = Shard = _StridedShard = distribute_tensor = None  # type: ignore[assignment,misc]
    _DTENSOR = ()  # isinstance(x, ()) is False


def is_dtensor(tensor: object) -> bool:
    return isinstance(tensor, _DTENSOR)


def local(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this rank holds and updates: a DTensor's local shard (sharing its
    memory), or ``tensor`` itself."""
    if not isinstance(tensor, _DTENSOR):  # called per parameter per step: inlined
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def write_mark(param: Tensor) -> tuple[int, int, int]:
    """What moves on when ``param``'s values are written or replaced: its version counter
    (in-place ops, a DTensor's included), its local part's (a DTensor's shard, which this
    optimizer and writes through ``to_local()`` write directly) and where that part's memory
    is (``p.data = ...``, ``torch.utils.swap_tensors``, which bring counters of their own).
    Writes that move none of these (through ``p.data``; a distributed checkpoint loaded into
    DTensor shards) are not seen."""
    # A DTensor's own shard (not ``to_local()``, ten times slower; same version counter).
    part = param._local_tensor if isinstance(param, _DTENSOR) else param
    return param._version, part._version, part.data_ptr()


def is_part_of_a_larger_tensor(param: Tensor) -> bool:
    """Whether ``param`` spans only part of its memory, as a view of one flat buffer holding
    many parameters does: its version counter is the buffer's, which writes to any other part
    move, so it does not tell whether ``param`` itself was written. Not a DTensor: FSDP2 pads
    each shard's memory of its own, which nothing else writes."""
    if isinstance(param, _DTENSOR):
        return False
    return param.untyped_storage().nbytes() > param.numel() * param.element_size()


def describe_sharding(tensor: Tensor) -> str:
    if not is_dtensor(tensor):
        return "a plain tensor"
    return f"a DTensor with placements {tensor.placements} on {tensor.device_mesh}"


def check_grad_sharding(param: Tensor, grad: Tensor, where: str) -> None:
    """Refuse a gradient that is a DTensor where its parameter is not, or the reverse, or a
    DTensor on another mesh, as torch's fused AdamW does. Other placements are taken: the step
    redistributes the gradient to the parameter's (:func:`local_grad`)."""
    sharded = isinstance(param, _DTENSOR)
    if sharded == isinstance(grad, _DTENSOR) and (
        not sharded or grad.device_mesh == param.device_mesh
    ):
        return
    raise RuntimeError(
        f"the gradient of {where} is {describe_sharding(grad)}, the parameter "
        f"{describe_sharding(param)}; a DTensor parameter needs a DTensor gradient on its mesh "
        "(of any placements), a plain tensor a plain gradient"
    )


def local_grad(param: Tensor) -> Tensor:
    """The part of ``param.grad`` this rank's update reads: its local shard; where the gradient
    is placed unlike the parameter (a partial sum, as tensor parallelism's ``SequenceParallel``
    leaves the gradients of replicated norm weights), first redistributed to the parameter's
    placements, as torch's fused AdamW does on DTensors: a collective, which every rank must run
    for the same parameters. The result may be a new tensor or a view of ``param.grad`` (a
    replicated gradient's rows for a sharded parameter), which an unscaling update then writes,
    as torch's does."""
    grad = param.grad
    if isinstance(grad, _DTENSOR) and grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


def refuse_fsdp1(param: Tensor, where: str) -> None:
    """Refuse parameters managed by FSDP1 (``FullyShardedDataParallel``, Lightning's
    ``FSDPStrategy``), which marks them ``_fsdp_flattened``.

    FSDP1 flattens parameters into per-rank slices of a ``FlatParameter`` and converts optimizer
    state through its own ``optim_state_dict`` functions; Lightning runs it on GPUs only, so that
    path could not be checked against torch AdamW here. FSDP2 shards parameters as DTensors,
    which this optimizer supports and which PyTorch recommends over FSDP1. ``where`` names the
    parameter in the error.
    """
    if getattr(param, "_fsdp_flattened", False):
        raise ValueError(
            f"{where} is managed by FSDP1 "
            "(FullyShardedDataParallel / Lightning's FSDPStrategy), which OffloadAdamW does not "
            "support. Shard with FSDP2 instead: torch.distributed.fsdp.fully_shard, or in "
            "Lightning ModelParallelStrategy with fully_shard in configure_model "
            "(see docs/scaling.md)."
        )


def like_param(param: Tensor, state: Tensor) -> Tensor:
    """``state`` (host memory shaped like ``param``'s local shard) as ``param`` is: a DTensor
    over the same mesh and placements, with the global shape and stride, viewing ``state``.

    Built from the parameter's sharding spec, as FSDP2 builds its CPU-offloaded parameters:
    ``DTensor.from_local`` would copy host state to a CUDA mesh's device.
    """
    if not is_dtensor(param):
        return state
    meta = TensorMeta(param.shape, param.stride(), state.dtype)
    spec = dataclasses.replace(param._spec, tensor_meta=meta)
    return DTensor(state, spec, requires_grad=False)


def _local_slice(full: Tensor, param: Tensor) -> Tensor:
    """This rank's shard of ``full``, a tensor of ``param``'s global shape: a view where the
    shard is a block of ``full`` (``Shard``, and ``_StridedShard`` as FSDP2 lays it over a
    tensor-parallel shard), else a copy of the rows it takes."""
    if any(isinstance(p, _StridedShard) for p in param.placements):
        return _strided_local_part(full, param)
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return full[tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))]


def _strided_local_part(full: Tensor, param: Tensor) -> Tensor:
    """This rank's shard of ``full`` under placements with a ``_StridedShard``, which can
    take rows that are not one block (rows 0, 1, 4, 5 of 8 on the first of two ranks): the
    rows of each dimension are found by sharding their indices as ``param`` is sharded.

    ``distribute_tensor`` with ``src_data_rank=None`` takes each rank's part of a tensor
    every rank holds, without communicating; sharding only small index tensors keeps
    ``full`` off a CUDA mesh's device.
    """
    part = full
    for dim, size in enumerate(param.shape):
        placements = [
            p if isinstance(p, (Shard, _StridedShard)) and p.dim == dim else Replicate()
            for p in param.placements
        ]
        if all(isinstance(p, Replicate) for p in placements):
            continue
        shape = [1] * param.dim()
        shape[dim] = size
        indices = torch.arange(size).view(shape)
        try:
            mine = distribute_tensor(indices, param.device_mesh, placements, src_data_rank=None)
        except TypeError as error:  # a torch without src_data_rank
            raise ValueError(
                f"this torch cannot take a rank's part of a tensor sharded with {param.placements} "
                "without communicating; load it resharded with torch.distributed.checkpoint"
            ) from error
        rows = mine.to_local().reshape(-1).cpu()
        first = int(rows[0]) if rows.numel() else 0
        if torch.equal(rows, torch.arange(first, first + rows.numel(), device="cpu")):
            part = part.narrow(dim, first, rows.numel())
        else:
            part = part.index_select(dim, rows.to(full.device))
    return part


def local_source(source: Tensor, param: Tensor, what: str) -> Tensor:
    """The part of a loaded tensor (already checked to have ``param``'s global shape) that this
    rank's state holds, as a plain tensor; raises naming the mismatch (and ``what`` was loaded,
    the key and its parameter) when there is none without communicating."""
    if not is_dtensor(source):
        return _local_slice(source, param) if is_dtensor(param) else source
    if is_dtensor(param):
        same_mesh = source.device_mesh == param.device_mesh
        if same_mesh and source.placements == param.placements:
            return local(source)
        if same_mesh and all(isinstance(p, Replicate) for p in source.placements):
            return _local_slice(local(source), param)
    elif source.device_mesh.size() == 1:
        return local(source)
    raise ValueError(
        f"loaded {what} is {describe_sharding(source)} and the parameter is "
        f"{describe_sharding(param)}. Load it resharded: torch.distributed.checkpoint.load into "
        "the state dict of get_optimizer_state_dict(model, optimizer) reshards while reading, "
        "or save and load a full state dict (StateDictOptions(full_state_dict=True))."
    )
