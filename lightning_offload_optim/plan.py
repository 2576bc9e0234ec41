"""Plan memory before a run: bytes per GPU and per node, with and without OffloadAdamW.

Whether a model trains on a given machine is decided by arithmetic that is easy to get wrong by
hand (fp32 master copies, amsgrad, sharding, one optimizer copy per rank). This module does it
with OffloadAdamW's own rules: its state keys and dtypes (from ``host_state``), its host buffers
and their page rounding, and its chunk plan, so that the figures are the ones
``OffloadAdamW.memory_stats()`` reports on the run.

    python -m lightning_offload_optim.plan 70b --gpus 8 --strategy fsdp2 --precision bf16-true
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import operator
import os
import re
import textwrap
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_offload_optim.adamw import DEFAULT_CHUNK_SIZE
from lightning_offload_optim.functional import SPLIT_ALIGNMENT
from lightning_offload_optim.host_state import MASTER_KEY, PAGE_SIZE, state_dtype, state_keys
from lightning_offload_optim.pipeline import GRAD_KEY, plan_chunks
from lightning_offload_optim.resident import ResidentRanges

# The package imports this module for its ``plan`` function (which then shadows the module as
# ``lightning_offload_optim.plan``), so ``python -m lightning_offload_optim.plan`` finds it
# imported already. runpy warns about that on every run; here it is harmless (the command
# only runs ``main``).
warnings.filterwarnings(
    "ignore",
    message=r"'lightning_offload_optim\.plan' found in sys\.modules",
    category=RuntimeWarning,
)

#: Bytes in a GB, the project's unit.
GB = 10**9
#: Parameter dtype under each Lightning precision (a model created in fp32): the "-mixed" ones
#: keep fp32 weights and gradients and compute under autocast.
PRECISIONS: dict[str, torch.dtype] = {
    "64-true": torch.float64,
    "32-true": torch.float32,
    "bf16-mixed": torch.float32,
    "16-mixed": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}
#: Lightning's default, used for counts and configs when no precision is given.
DEFAULT_PRECISION = "32-true"
STRATEGIES = ("ddp", "fsdp2")
#: Staging buffer sets per device (StagingPipeline's ``num_buffers``): one loads while one computes.
STAGING_SETS = 2
#: Share of GPU and host memory that "fits" leaves free for what is not modelled.
DEFAULT_HEADROOM = 0.1

_LLAMA_2 = {"vocab_size": 32000, "tie_word_embeddings": False}
#: Llama-2 configs by size, for the CLI and for quick plans.
PRESETS: dict[str, dict[str, Any]] = {
    "7b": {
        **_LLAMA_2,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "13b": {
        **_LLAMA_2,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
    },
    "70b": {
        **_LLAMA_2,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
NOT_MODELLED = (
    "activations, DDP's gradient buckets (a second copy of the gradients unless "
    "gradient_as_bucket_view=True), FSDP2's prefetched unit and unsharded gradients, buffers, "
    "the CUDA context, allocator caching and temporaries"
)


# ------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class Usage:
    """Bytes one GPU holds (or all GPUs of a node), and the host RAM its optimizer state takes."""

    params: int
    grads: int
    unsharded: int  # FSDP2: one unit's parameters, gathered whole for forward and backward
    device_state: int
    staging: int
    host_state: int

    @property
    def device(self) -> int:
        return self.params + self.grads + self.unsharded + self.device_state + self.staging

    @property
    def host(self) -> int:
        return self.host_state

    def __add__(self, other: Usage) -> Usage:
        return Usage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class Footprint:
    """One optimizer's usage per GPU (rank 0, the largest shard) and per node (node 0, the
    largest), and whether it fits; ``None`` where the memory size is unknown."""

    gpu: Usage
    node: Usage
    fits_gpu: bool | None
    fits_host: bool | None


@dataclass(frozen=True)
class MemoryPlan:
    """What :func:`plan` found: the inputs it used and the bytes, as ints."""

    model: str
    parameters: int
    trainable: int
    precision: str | None  # None: the module's own parameter dtypes
    strategy: str
    gpus: int
    nodes: int
    amsgrad: bool
    chunk_size: int
    pin_memory: bool
    unit_parameters: int | None  # gathered whole per GPU under FSDP2; None: unknown, not counted
    gpu_memory: int | None
    host_memory: int | None
    headroom: float
    adamw: Footprint  # torch.optim.AdamW: state on the device, in the parameters' dtype
    offload: Footprint  # OffloadAdamW: state in host RAM
    rank_state_bytes: tuple[int, ...]  # OffloadAdamW's logical state, per rank of node 0
    rank_offload: tuple[Usage, ...]  # OffloadAdamW's usage, per rank of node 0 (DDP: one)

    @property
    def state_bytes(self) -> int:
        """OffloadAdamW's logical state on rank 0 (what would otherwise sit on the GPU)."""
        return self.rank_state_bytes[0]

    def memory_stats(self, rank: int = 0) -> dict[str, int | bool]:
        """What ``OffloadAdamW.memory_stats()`` should report on ``rank`` (of node 0) after the
        first step over every trainable parameter."""
        index = rank if self.strategy == "fsdp2" else 0
        if not 0 <= rank < self.gpus:
            raise ValueError(f"the plan holds node 0's ranks, 0 to {self.gpus - 1}; got {rank}")
        state = self.rank_state_bytes[index]
        return {
            "state_bytes": state,
            "host_bytes": self.rank_offload[index].host_state,
            "pinned": self.pin_memory and state > 0,
            "staging_bytes": self.rank_offload[index].staging,
            "resident_bytes": 0,
        }

    def format(self) -> str:
        """The plan as a text table, GB = 1e9 bytes."""
        world = self.gpus * self.nodes
        precision = self.precision or "parameters' own dtypes"
        title = (
            f"{self.model}: {self.parameters:,} parameters ({self.trainable:,} trainable), "
            f"{precision}, {self.strategy} on {self.nodes} node(s) x {self.gpus} GPU(s) "
            f"= {world} rank(s)"
        )
        lines = [
            *textwrap.wrap(title, 100),
            "",
            f"{'GB':<30}{'torch AdamW':>24}{'OffloadAdamW':>24}",
            f"{'':<30}" + f"{'per GPU':>12}{'per node':>12}" * 2,
        ]
        rows = [
            ("parameters", lambda u: u.params),
            ("gradients", lambda u: u.grads),
            ("FSDP2 unit, gathered", lambda u: u.unsharded),
            ("optimizer state, device", lambda u: u.device_state),
            ("staging buffers, device", lambda u: u.staging),
            ("optimizer state, host RAM", lambda u: u.host_state),
            ("total device", lambda u: u.device),
            ("total host RAM", lambda u: u.host),
        ]
        usages = (self.adamw.gpu, self.adamw.node, self.offload.gpu, self.offload.node)
        for label, value in rows:
            lines.append(f"{label:<30}" + "".join(f"{value(u) / GB:>12.2f}" for u in usages))
        lines.append(
            f"{_fits_label('fits GPU', self.gpu_memory):<30}"
            + "".join(f"{_yes_no(f.fits_gpu):>12}{'':>12}" for f in (self.adamw, self.offload))
        )
        lines.append(
            f"{_fits_label('fits host RAM', self.host_memory):<30}"
            + "".join(f"{'':>12}{_yes_no(f.fits_host):>12}" for f in (self.adamw, self.offload))
        )
        lines += ["", *self._notes()]
        return "\n".join(line.rstrip() for line in lines)

    __str__ = format

    def _notes(self) -> list[str]:
        notes = [
            "Per GPU: rank 0, which holds the largest shard; per node: the sum over node 0's "
            "GPUs (each rank keeps its own optimizer state in its node's RAM).",
            f"'fits' keeps {self.headroom:.0%} of each memory free for what is not modelled: "
            f"{NOT_MODELLED}. Activations alone can need more than that.",
        ]
        if self.strategy == "fsdp2":
            if self.unit_parameters is None:
                notes.append(
                    "FSDP2 unit: unknown for a parameter count and not counted (pass unit_params, "
                    "--unit-params: the parameters of one transformer layer)."
                )
            else:
                notes.append(
                    f"FSDP2 unit: {self.unit_parameters:,} parameters (one layer) gathered whole "
                    "in the parameters' dtype during forward and backward."
                )
        if self.gpu_memory is None:
            notes.append("GPU memory unknown (no GPU here): pass gpu_memory / --gpu-memory.")
        else:
            left = [(self.gpu_memory - f.gpu.device) / GB for f in (self.adamw, self.offload)]
            notes.append(
                f"Left on each GPU for activations and the rest: {left[0]:.2f} GB with torch "
                f"AdamW, {left[1]:.2f} GB with OffloadAdamW."
            )
        pinned = "pinned" if self.pin_memory else "pageable"
        notes.append(
            f"OffloadAdamW: chunk_size {self.chunk_size:,}, {pinned} host memory, "
            f"amsgrad {'on' if self.amsgrad else 'off'}. GB = 1e9 bytes."
        )
        return [line for note in notes for line in textwrap.wrap(note, 100)]


def _fits_label(label: str, memory: int | None) -> str:
    return f"{label} ({memory / GB:.1f} GB)" if memory is not None else f"{label} (unknown)"


def _yes_no(fits: bool | None) -> str:
    return "unknown" if fits is None else "yes" if fits else "no"


# ------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class _Param:
    """One parameter as the plan needs it: shape, dtype under the precision, trainable."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class _Model:
    name: str
    params: list[_Param]
    unit: list[_Param] | None  # one FSDP2 unit's parameters; None: unknown


def _config_value(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _from_config(config: Any, name: str, dtype: torch.dtype) -> _Model:
    """The parameters of a Llama-layout decoder (Llama, Mistral and alike), as Hugging Face
    lays them out: embeddings, per layer q/k/v/o and gate/up/down projections and two norms,
    a final norm, and an output head unless tied to the embeddings."""
    missing = [key for key in _REQUIRED_KEYS if _config_value(config, key) is None]
    if missing:
        raise ValueError(
            f"config {name} lacks {', '.join(missing)}; a Llama-layout config needs "
            f"{', '.join(_REQUIRED_KEYS)} (and optionally num_key_value_heads, head_dim, "
            "tie_word_embeddings, attention_bias, mlp_bias)"
        )
    vocab, hidden, inter, layers, heads = (int(_config_value(config, k)) for k in _REQUIRED_KEYS)

    def optional(key: str, default: int) -> int:  # an explicit 0 is a size, checked below
        value = _config_value(config, key)
        return default if value is None else int(value)

    kv_heads = optional("num_key_value_heads", heads)
    head_dim = optional("head_dim", hidden // heads if heads > 0 else 0)
    if min(vocab, hidden, inter, layers, heads, kv_heads, head_dim) < 1:
        raise ValueError(f"config {name} has a size below 1")
    attention_bias = bool(_config_value(config, "attention_bias"))
    mlp_bias = bool(_config_value(config, "mlp_bias"))

    def linear(out_features: int, in_features: int, bias: bool) -> list[_Param]:
        weight = _Param((out_features, in_features), dtype)
        return [weight, _Param((out_features,), dtype)] if bias else [weight]

    layer = [
        *linear(heads * head_dim, hidden, attention_bias),
        *linear(kv_heads * head_dim, hidden, attention_bias),
        *linear(kv_heads * head_dim, hidden, attention_bias),
        *linear(hidden, heads * head_dim, attention_bias),
        *linear(inter, hidden, mlp_bias),
        *linear(inter, hidden, mlp_bias),
        *linear(hidden, inter, mlp_bias),
        _Param((hidden,), dtype),
        _Param((hidden,), dtype),
    ]
    head = [] if _config_value(config, "tie_word_embeddings") else [_Param((vocab, hidden), dtype)]
    params = [_Param((vocab, hidden), dtype), *layer * layers, _Param((hidden,), dtype), *head]
    return _Model(name, params, layer)


def _from_module(module: nn.Module, dtype: torch.dtype | None) -> _Model:
    """A module's parameters (any device, meta included), cast to ``dtype`` where floating.

    The FSDP2 unit is the largest element of any ``nn.ModuleList`` (the blocks one applies
    ``fully_shard`` to); a module without one is a single unit."""

    def spec(p: nn.Parameter) -> _Param:
        cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
        return _Param(tuple(p.shape), cast, p.requires_grad)

    blocks = [
        list(block.parameters())
        for child in module.modules()
        if isinstance(child, nn.ModuleList)
        for block in child
    ]
    unit = max(blocks, key=lambda ps: sum(p.numel() for p in ps), default=module.parameters())
    return _Model(
        type(module).__name__, [spec(p) for p in module.parameters()], [spec(p) for p in unit]
    )


def _load_model(model: Any, dtype: torch.dtype | None) -> _Model:
    if isinstance(model, nn.Module):
        return _from_module(model, dtype)
    if dtype is None:
        dtype = PRECISIONS[DEFAULT_PRECISION]
    if isinstance(model, bool) or model is None:
        raise TypeError(f"cannot plan for {model!r}: give a count, a config or an nn.Module")
    if isinstance(model, int):
        if model < 1:
            raise ValueError(f"the parameter count must be at least 1, got {model}")
        return _Model("A parameter count", [_Param((model,), dtype)], None)
    if isinstance(model, str) and model.lower() in PRESETS:
        return _from_config(PRESETS[model.lower()], f"Llama-2 {model.upper()}", dtype)
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"{str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json"
            )
        return _from_config(json.loads(path.read_text()), str(path), dtype)
    return _from_config(model, type(model).__name__, dtype)


# ------------------------------------------------------------------------------ arithmetic
class _PlannedArena:
    """What :func:`~lightning_offload_optim.pipeline.plan_chunks` reads of an arena."""

    resident = ResidentRanges()  # the plan keeps no state resident on the device


@dataclass(frozen=True)
class _PlannedSlot:
    """What :func:`~lightning_offload_optim.pipeline.plan_chunks` reads of a host slot."""

    arena: object
    offset: int
    layout: _Param  # only its ``numel`` is read


def _largest_chunk(numels: Sequence[int], bound: int) -> int:
    """The largest chunk the pipeline's own planner cuts from an arena holding ``numels`` one
    after another, chunks bounded by ``bound``."""
    arena = _PlannedArena()
    offsets = itertools.accumulate(numels, initial=0)
    slots = [
        _PlannedSlot(arena, offset, _Param((numel,), torch.float32))
        for numel, offset in zip(numels, offsets, strict=False)
    ]
    return max((chunk.numel for chunk in plan_chunks(slots, bound)), default=0)


def _host_buffer_bytes(nbytes: int, pinned: bool) -> int:
    """Bytes one host buffer occupies: pinned ones are whole pages (host_state.registered_empty)."""
    if not pinned:
        return nbytes
    return -(-nbytes // PAGE_SIZE) * PAGE_SIZE


def _offload_usage(
    local: Sequence[tuple[_Param, int]], amsgrad: bool, bound: int, pin: bool
) -> tuple[int, int, int]:
    """OffloadAdamW on one rank: logical state bytes, host bytes, staging bytes.

    ``local`` pairs each trainable parameter with the elements of it this rank updates. Arenas
    and staging buffers follow HostState.allocate and StagingPipeline.prepare."""
    kinds: dict[torch.dtype, tuple] = {}
    arenas: dict[tuple, list[int]] = {}
    for param, numel in local:
        if param.dtype not in kinds:
            probe = torch.empty(0, dtype=param.dtype, device="meta")
            kinds[param.dtype] = (
                state_dtype(probe),
                state_keys(probe, amsgrad),
                probe.is_complex(),
            )
        kind = kinds[param.dtype]
        arenas.setdefault(kind, []).append(numel * (2 if param.dtype.is_complex else 1))
    state = host = 0
    staging: dict[tuple[torch.dtype, str], int] = {}
    for (dtype, keys, _), numels in arenas.items():
        nbytes = sum(numels) * dtype.itemsize
        state += nbytes * len(keys)
        host += _host_buffer_bytes(nbytes, pin) * len(keys)
        largest = _largest_chunk(numels, bound)
        for key in (*keys, GRAD_KEY) if MASTER_KEY in keys else keys:
            staging[dtype, key] = max(staging.get((dtype, key), 0), largest)
    staged = STAGING_SETS * sum(numel * dtype.itemsize for (dtype, _), numel in staging.items())
    return state, host, staged


def _rank_usages(
    params: Sequence[_Param],
    rows: Sequence[tuple[int, int]],
    unsharded: int,
    amsgrad: bool,
    bound: int,
    pin: bool,
) -> tuple[Usage, Usage, int]:
    """torch AdamW's and OffloadAdamW's usage on one rank, and OffloadAdamW's logical state.

    ``rows`` gives, per parameter, the dim-0 rows this rank updates and those its device
    stores (FSDP2 pads every shard to the first one's size)."""
    stored = grads = adamw_state = 0
    trainable: list[tuple[_Param, int]] = []
    for param, (local_rows, stored_rows) in zip(params, rows, strict=True):
        per_row = param.numel // max(param.shape[0], 1) if param.shape else 1
        itemsize = param.dtype.itemsize
        stored += stored_rows * per_row * itemsize
        if param.trainable:
            grads += stored_rows * per_row * itemsize
            adamw_state += local_rows * per_row * itemsize * (3 if amsgrad else 2)
            trainable.append((param, local_rows * per_row))
    state, host, staging = _offload_usage(trainable, amsgrad, bound, pin)
    adamw = Usage(stored, grads, unsharded, adamw_state, 0, 0)
    offload = Usage(stored, grads, unsharded, 0, staging, host)
    return adamw, offload, state


def _shard_rows(param: _Param, rank: int, world: int) -> tuple[int, int]:
    """Rows of dim 0 that ``rank`` updates and stores when sharded like FSDP2 (torch.chunk),
    over ``world`` ranks (1: not sharded)."""
    total = param.shape[0] if param.shape else 1
    size = -(-total // world)
    return max(0, min(size, total - rank * size)), size


# ------------------------------------------------------------------------------ machine
def gpu_memory_here() -> int | None:
    """Total memory of this machine's first GPU, or None without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def host_memory_here() -> int | None:
    """Physical RAM of this machine, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}, got {value!r}")
    return value


# ------------------------------------------------------------------------------ the plan
def plan(
    model: int | str | os.PathLike | Mapping[str, Any] | nn.Module | Any,
    *,
    precision: str | None = None,
    gpus: int = 1,
    nodes: int = 1,
    strategy: str = "ddp",
    amsgrad: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    pin_memory: bool = True,
    unit_params: int | None = None,
    gpu_memory: int | None = None,
    host_memory: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> MemoryPlan:
    """Bytes per GPU and per node for training ``model`` with and without OffloadAdamW.

    Args:
        model: a parameter count; a preset (``"7b"``, ``"13b"``, ``"70b"``: Llama-2); a Hugging
            Face config of the Llama layout, as a dict, an object with attributes, or a path to
            its ``config.json`` (or folder); or an ``nn.Module``, on any device (meta included),
            whose parameters with ``requires_grad`` are trained.
        precision: a Lightning precision; it sets the dtype of floating-point parameters
            (``"*-mixed"`` and ``"32-true"`` keep them fp32). ``None``: a module's own dtypes,
            else ``"32-true"``.
        gpus, nodes: GPUs per node and nodes; one rank per GPU.
        strategy: ``"ddp"`` (every rank holds everything) or ``"fsdp2"`` (dim 0 of every
            parameter sharded over all ranks, as ``fully_shard`` does).
        amsgrad, chunk_size, pin_memory: as OffloadAdamW's.
        unit_params: parameters FSDP2 gathers whole at a time (one transformer layer); known
            for configs and modules (the largest ``nn.ModuleList`` element), unknown for counts.
        gpu_memory, host_memory: bytes of one GPU and of one node's RAM; default: this
            machine's (GPU memory unknown without a GPU).
        headroom: share of each memory that "fits" leaves free for what is not modelled.

    Example:
        >>> p = plan(7 * 10**9, precision="bf16-true", gpus=8, strategy="fsdp2",
        ...          gpu_memory=80 * 10**9, host_memory=10**12)
        >>> p.state_bytes  # per rank: 7e9 / 8 parameters x (8 B of moments + 4 B master copy)
        10500000000
        >>> p.offload.gpu.device  # bf16 shard of params and grads, and two staging sets
        3634217728
        >>> p.adamw.gpu.device_state  # torch AdamW: bf16 moments on the device
        3500000000
        >>> p.offload.fits_gpu, p.offload.fits_host
        (True, True)
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    gpus = _positive_int("gpus", gpus)
    nodes = _positive_int("nodes", nodes)
    chunk_size = _positive_int("chunk_size", chunk_size, SPLIT_ALIGNMENT)
    if unit_params is not None:
        unit_params = _positive_int("unit_params", unit_params, 0)
    for name, value in (("gpu_memory", gpu_memory), ("host_memory", host_memory)):
        if value is not None:
            _positive_int(name, value)
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    if gpu_memory is None:
        gpu_memory = gpu_memory_here()
    if host_memory is None:
        host_memory = host_memory_here()

    spec = _load_model(model, PRECISIONS[precision] if precision else None)
    params = spec.params
    if precision is None and not isinstance(model, nn.Module):
        precision = DEFAULT_PRECISION
    unit_count, unit_bytes = _unit(spec, unit_params)
    if strategy == "ddp":
        unit_count = unit_bytes = 0
    bound = chunk_size - chunk_size % SPLIT_ALIGNMENT

    sharded = strategy == "fsdp2"
    shards = gpus * nodes if sharded else 1
    per_rank = [
        _rank_usages(
            params,
            [_shard_rows(p, rank, shards) for p in params],
            unit_bytes,
            amsgrad,
            bound,
            pin_memory,
        )
        for rank in (range(gpus) if sharded else [0])  # DDP ranks are all alike
    ]
    copies = 1 if sharded else gpus

    def footprint(which: int) -> Footprint:
        gpu = per_rank[0][which]
        node = functools.reduce(operator.add, [r[which] for r in per_rank] * copies)
        fits_gpu = None if gpu_memory is None else gpu.device <= (1 - headroom) * gpu_memory
        fits_host = None if host_memory is None else node.host <= (1 - headroom) * host_memory
        return Footprint(gpu, node, fits_gpu, fits_host)

    return MemoryPlan(
        model=spec.name,
        parameters=sum(p.numel for p in params),
        trainable=sum(p.numel for p in params if p.trainable),
        precision=precision,
        strategy=strategy,
        gpus=gpus,
        nodes=nodes,
        amsgrad=amsgrad,
        chunk_size=bound,
        pin_memory=pin_memory,
        unit_parameters=unit_count,
        gpu_memory=gpu_memory,
        host_memory=host_memory,
        headroom=headroom,
        adamw=footprint(0),
        offload=footprint(1),
        rank_state_bytes=tuple(r[2] for r in per_rank),
        rank_offload=tuple(r[1] for r in per_rank),
    )


def _unit(spec: _Model, unit_params: int | None) -> tuple[int | None, int]:
    """Parameters and bytes of one FSDP2 unit: ``unit_params`` in the dtype most parameters
    have, else the model's own unit; (None, 0) when neither is known."""
    if unit_params is not None:
        by_dtype: dict[torch.dtype, int] = {}
        for p in spec.params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel
        return unit_params, unit_params * max(by_dtype, key=by_dtype.__getitem__).itemsize
    if spec.unit is None:
        return None, 0
    return sum(p.numel for p in spec.unit), sum(p.numel * p.dtype.itemsize for p in spec.unit)


# ------------------------------------------------------------------------------ CLI
_UNITS = {"": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?b)?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 80GB, 141GiB or 8e10)")
    return int(float(match[1]) * _UNITS[match[2] or ""])


def _parse_model(text: str) -> int | str:
    """A parameter count (``6738415616``, ``7e9``, ``7_000_000_000``) or a preset or path."""
    try:
        number = float(text.replace("_", ""))
    except ValueError:
        return text
    if not number.is_integer():
        raise argparse.ArgumentTypeError(f"a parameter count must be whole, got {text!r}")
    return int(number)


def main(argv: Sequence[str] | None = None) -> MemoryPlan:
    """``python -m lightning_offload_optim.plan``: print the plan's table."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_offload_optim.plan",
        description="Bytes of parameters, gradients and optimizer state per GPU and per node, "
        "with torch AdamW and with OffloadAdamW (GB = 1e9 bytes).",
    )
    parser.add_argument(
        "model",
        type=_parse_model,
        help=f"a parameter count (7e9), a preset ({', '.join(PRESETS)}: Llama-2) or the path of "
        "a Hugging Face config.json (Llama layout)",
    )
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        help=f"Lightning precision (default {DEFAULT_PRECISION})",
    )
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="default ddp")
    parser.add_argument("--amsgrad", action="store_true")
    parser.add_argument(
        "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="OffloadAdamW's chunk_size"
    )
    parser.add_argument(
        "--no-pin-memory", dest="pin_memory", action="store_false", help="pageable host state"
    )
    parser.add_argument(
        "--unit-params", type=int, help="parameters of one FSDP2 unit (for a parameter count)"
    )
    parser.add_argument(
        "--gpu-memory", type=_parse_bytes, help="memory of one GPU (default: this machine's)"
    )
    parser.add_argument(
        "--host-memory", type=_parse_bytes, help="RAM of one node (default: this machine's)"
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        help=f"share of memory kept free by 'fits' (default {DEFAULT_HEADROOM})",
    )
    args = parser.parse_args(argv)
    try:
        result = plan(
            args.model,
            precision=args.precision,
            gpus=args.gpus,
            nodes=args.nodes,
            strategy=args.strategy,
            amsgrad=args.amsgrad,
            chunk_size=args.chunk_size,
            pin_memory=args.pin_memory,
            unit_params=args.unit_params,
            gpu_memory=args.gpu_memory,
            host_memory=args.host_memory,
            headroom=args.headroom,
        )
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    print(result)
    return result


if __name__ == "__main__":
    main()
