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
import json
import math
import operator
import os
import re
import textwrap
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from lightning_offload_optim.adamw import DEFAULT_CHUNK_SIZE
from lightning_offload_optim.functional import SPLIT_ALIGNMENT
from lightning_offload_optim.host_state import PAGE_SIZE, state_dtype, state_keys
from lightning_offload_optim.lightning.mixin import OffloadOptimizerMixin
from lightning_offload_optim.pipeline import plan_chunks, staging_needs
from lightning_offload_optim.resident import (
    Resident,
    ResidentRanges,
    auto_margin,
    choose_resident,
    fixed_budget,
)
from lightning_offload_optim.validation import check_resident, is_int, is_number

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
#: The most chunks per rank and step a plan cuts (it plans them one by one, as the optimizer
#: does; at the default chunk_size, 17 trillion parameters per rank).
MAX_PLANNED_CHUNKS = 1 << 22
#: Hugging Face ``model_type`` values laid out as Llama (Mixtral with an MLP per expert).
_LLAMA_LAYOUTS = ("llama", "mistral", "mixtral")
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
    resident: Resident  # OffloadAdamW's ``resident``
    bandwidth: float | None  # GB/s per direction of one GPU's link, for the copy-time note
    adamw: Footprint  # torch.optim.AdamW: state on the device, in the parameters' dtype
    offload: Footprint  # OffloadAdamW: state in host RAM, the resident share also on the GPU
    rank_state_bytes: tuple[int, ...]  # OffloadAdamW's logical state, per rank of node 0
    rank_offload: tuple[Usage, ...]  # OffloadAdamW's usage, per rank of node 0 (DDP: one)
    node_state_bytes: int  # OffloadAdamW's logical state, all ranks of node 0

    @property
    def state_bytes(self) -> int:
        """OffloadAdamW's logical state on rank 0 (what would otherwise sit on the GPU)."""
        return self.rank_state_bytes[0]

    @property
    def resident_bytes(self) -> int:
        """OffloadAdamW's state kept on rank 0's GPU (``resident``)."""
        return self.rank_offload[0].device_state

    @property
    def copied_bytes(self) -> int:
        """State rank 0 copies to its GPU and as much back at each step from the third on: all
        of it that is not resident. (The first step moves all of it both ways, and so does the
        first after a checkpoint: the resident part is written back for it and loaded again;
        the second step also loads the resident part, chosen then.)"""
        return self.state_bytes - self.resident_bytes

    @property
    def node_copied_bytes(self) -> int:
        """:attr:`copied_bytes` of all of node 0's GPUs together."""
        return self.node_state_bytes - self.offload.node.device_state

    def memory_stats(self, rank: int = 0) -> dict[str, int | bool]:
        """What ``OffloadAdamW.memory_stats()`` should report on ``rank`` (of node 0) after the
        first step over every trainable parameter (with ``resident``, after the second: the
        resident state is chosen then; for ``"auto"`` an estimate, since the optimizer
        measures the free memory)."""
        if not is_int(rank) or not 0 <= rank < self.gpus:
            raise ValueError(
                f"rank must be an int: the plan holds node 0's ranks, 0 to {self.gpus - 1}; "
                f"got {rank!r}"
            )
        index = rank if self.strategy == "fsdp2" else 0
        state = self.rank_state_bytes[index]
        return {
            "state_bytes": state,
            "host_bytes": self.rank_offload[index].host_state,
            "pinned": self.pin_memory and state > 0,
            "staging_bytes": self.rank_offload[index].staging,
            "resident_bytes": self.rank_offload[index].device_state,
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
        copied = (0, 0, self.copied_bytes, self.node_copied_bytes)
        lines.append(
            f"{'state copied per step, 1 way':<30}" + "".join(f"{c / GB:>12.2f}" for c in copied)
        )
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
        notes.append(self._copy_note())
        pinned = "pinned" if self.pin_memory else "pageable"
        notes.append(
            f"OffloadAdamW: chunk_size {self.chunk_size:,}, {pinned} host memory, "
            f"amsgrad {'on' if self.amsgrad else 'off'}. GB = 1e9 bytes."
        )
        return [line for note in notes for line in textwrap.wrap(note, 100)]

    def _copy_note(self) -> str:
        """What each step copies over a GPU's link, and what stays resident."""
        copied = f"{self.copied_bytes / GB:.2f} GB"
        gpu = "rank 0's GPU (the largest shard)" if self.strategy == "fsdp2" else "each GPU"
        if self.resident is None:
            note = (
                f"OffloadAdamW copies all of its state, {copied} on {gpu}, to the GPU and back "
                "at every step"
            )
        else:
            asked = self.resident
            if isinstance(asked, int):
                asked = f"{asked / GB:.2f} GB"
            note = (
                f"OffloadAdamW with resident={asked} keeps {self.resident_bytes / GB:.2f} GB of "
                f"state on {gpu} (whole parameters, in their order); it copies the other "
                f"{copied} to the GPU and back at each step from the third on (the first moves "
                "all of it both ways, the second also copies the resident part in)"
            )
        if self.bandwidth is not None:
            seconds = self.copied_bytes / GB / self.bandwidth
            note += (
                f": about {seconds:.3g} s each way at {self.bandwidth:g} GB/s per direction "
                "(arithmetic, bytes / bandwidth, not a measurement; the two directions can run "
                "at once where the link is full duplex, and with overlap_with part of the "
                "copies can run during the next forward pass)."
            )
        else:
            note += " (pass bandwidth, --bandwidth, for the time it takes)."
        if self.resident == "auto":
            note += (
                f" 'auto' is planned as what {1 - self.headroom:.0%} of the GPU leaves after the "
                f"planned usage and auto's margin of {auto_margin(self.gpu_memory) / GB:.2f} GB; "
                "a run measures free memory after its first step, activations included."
            )
        return note


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
    """The parameters of a Llama-layout decoder (Llama, Mistral, Mixtral), as Hugging Face
    lays them out: embeddings, per layer q/k/v/o and gate/up/down projections (Mixtral: a
    router and that MLP per expert) and two norms, a final norm, and an output head unless
    tied to the embeddings. Other architectures are refused: read as this layout they would
    be miscounted (GPT-NeoX has two MLP matrices, not three)."""
    model_type = _config_value(config, "model_type")
    if model_type is not None and model_type not in _LLAMA_LAYOUTS:
        raise ValueError(
            f"config {name} is a {model_type!r} model; the planner reads the Llama layout "
            f"({', '.join(_LLAMA_LAYOUTS)}) only. Plan the model itself, built on the meta "
            "device (with torch.device('meta'): model = AutoModelForCausalLM.from_config("
            "config); plan(model)), or its parameter count"
        )
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
    # Mixtral's; its config class defaults to 8 experts, which a saved config may leave out.
    experts = optional("num_local_experts", 8 if model_type == "mixtral" else 0)
    if min(vocab, hidden, inter, layers, heads, kv_heads, head_dim) < 1 or experts < 0:
        raise ValueError(f"config {name} has a size below 1")
    attention_bias = bool(_config_value(config, "attention_bias"))
    mlp_bias = bool(_config_value(config, "mlp_bias"))

    def linear(out_features: int, in_features: int, bias: bool) -> list[_Param]:
        weight = _Param((out_features, in_features), dtype)
        return [weight, _Param((out_features,), dtype)] if bias else [weight]

    gate, up, down = (
        linear(*shape, mlp_bias) for shape in ((inter, hidden),) * 2 + ((hidden, inter),)
    )
    mlp = [*gate, *down, *up] if experts else [*gate, *up, *down]  # Mixtral's w1, w2, w3
    layer = [
        *linear(heads * head_dim, hidden, attention_bias),
        *linear(kv_heads * head_dim, hidden, attention_bias),
        *linear(kv_heads * head_dim, hidden, attention_bias),
        *linear(hidden, heads * head_dim, attention_bias),
        *([_Param((experts, hidden), dtype), *mlp * experts] if experts else mlp),
        _Param((hidden,), dtype),
        _Param((hidden,), dtype),
    ]
    head = [] if _config_value(config, "tie_word_embeddings") else [_Param((vocab, hidden), dtype)]
    params = [_Param((vocab, hidden), dtype), *layer * layers, _Param((hidden,), dtype), *head]
    return _Model(name, params, layer)


def _from_module(module: nn.Module, dtype: torch.dtype | None) -> _Model:
    """A module's parameters (any device, meta included), cast to ``dtype`` where floating, in
    the order OffloadAdamW lays out their state and chooses the resident share: for an
    :class:`OffloadOptimizerMixin`, the parameters its optimizer takes (the others are not
    trained) in its param groups' order (decayed ones first), unless it overlaps the step, whose
    first forward pass sets the order; otherwise, and then, their declared order, which a
    forward pass mostly follows.

    The FSDP2 unit is the largest element of any ``nn.ModuleList`` (the blocks one applies
    ``fully_shard`` to); a module without one is a single unit."""
    declared = list(module.parameters())
    lazy = [name for name, p in module.named_parameters() if is_lazy(p)]
    if lazy:
        raise ValueError(
            f"plan: {type(module).__name__} has parameters of lazy modules whose shapes are not "
            f"known yet ({', '.join(lazy[:3])}{', ...' if len(lazy) > 3 else ''}); run a "
            "forward pass with a sample batch first (on the meta device it allocates nothing)"
        )
    optimized = _optimized(module)
    trained = {id(p) for p in (declared if optimized is None else optimized)}
    order = declared
    if optimized is not None:
        first, then = (
            (declared, optimized)
            if module.offload_hparam("overlap_step")
            else (optimized, declared)
        )
        taken = {id(p) for p in first}
        order = [*first, *(p for p in then if id(p) not in taken)]

    def spec(p: nn.Parameter) -> _Param:
        cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
        return _Param(tuple(p.shape), cast, p.requires_grad and id(p) in trained)

    blocks = [
        list(block.parameters())
        for child in module.modules()
        if isinstance(child, nn.ModuleList)
        for block in child
    ]
    unit = max(blocks, key=lambda ps: sum(p.numel() for p in ps), default=module.parameters())
    return _Model(type(module).__name__, [spec(p) for p in order], [spec(p) for p in unit])


def _optimized(module: nn.Module) -> list[Tensor] | None:
    """The parameters an :class:`OffloadOptimizerMixin`'s optimizer takes, in its param groups'
    order; None for other modules, and (with a warning) where ``offload_optimizer_args()``
    cannot run before training (an override that reads the trainer)."""
    if not isinstance(module, OffloadOptimizerMixin):
        return None
    try:
        given = module.offload_optimizer_args()["params"]
    except Exception as error:  # the user's override: plan on, in declared order
        warnings.warn(
            f"plan: {type(module).__name__}.offload_optimizer_args() raised {error!r}; planning "
            "every parameter with requires_grad, in declared order, not its param groups",
            stacklevel=5,  # plan()'s caller
        )
        return None

    def tensors(params: Any) -> list[Tensor]:  # as torch.optim.Optimizer reads them
        items = [params] if isinstance(params, Tensor) else list(params)
        return [item[1] if isinstance(item, tuple) else item for item in items]  # (name, p)

    # Not a bare tensor: torch's optimizers refuse one (an iterable of tensors or dicts).
    return [p for i in given for p in tensors(i["params"] if isinstance(i, dict) else [i])]


def _load_model(model: Any, dtype: torch.dtype | None) -> _Model:
    if isinstance(model, nn.Module):
        return _from_module(model, dtype)
    if dtype is None:
        dtype = PRECISIONS[DEFAULT_PRECISION]
    if isinstance(model, bool) or model is None:
        raise TypeError(f"cannot plan for {model!r}: give a count, a config or an nn.Module")
    model = _whole(model)  # 7e9, as counts are often written
    if is_number(model) and not is_int(model):
        raise ValueError(f"the parameter count must be a whole number, got {model!r}")
    if is_int(model):
        if model < 1:
            raise ValueError(f"the parameter count must be at least 1, got {model}")
        return _Model("A parameter count", [_Param((int(model),), dtype)], None)
    if isinstance(model, str) and model.lower() in PRESETS:
        return _from_config(PRESETS[model.lower()], f"Llama-2 {model.upper()}", dtype)
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"{str(model)!r} is neither a parameter count (7e9), a preset "
                f"({', '.join(PRESETS)}) nor a config.json"
            )
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
        return _from_config(config, str(path), dtype)
    return _from_config(model, type(model).__name__, dtype)


# ------------------------------------------------------------------------------ arithmetic
#: The device of every planned arena: a rank has one GPU.
_RANK_GPU = torch.device("cuda")


@dataclass(eq=False)
class _PlannedArena:
    """What :func:`~lightning_offload_optim.pipeline.plan_chunks` and
    :func:`~lightning_offload_optim.resident.choose_resident` read of an arena, and the slots
    laid out in it."""

    dtype: torch.dtype  # of the state
    keys: tuple[str, ...]
    slots: list[_PlannedSlot] = field(default_factory=list)
    numel: int = 0  # of its slots, one after another
    resident: ResidentRanges = field(default_factory=ResidentRanges)  # set once chosen
    device: torch.device = _RANK_GPU

    def state_bytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize * len(self.keys)


@dataclass(frozen=True)
class _PlannedSlot:
    """What the pipeline's chunk planner and the resident chooser read of a host slot."""

    arena: _PlannedArena
    offset: int
    layout: _Param  # only its ``numel`` is read


def _host_buffer_bytes(nbytes: int, pinned: bool) -> int:
    """Bytes one host buffer occupies: pinned ones are whole pages (host_state.registered_empty)."""
    if not pinned:
        return nbytes
    return -(-nbytes // PAGE_SIZE) * PAGE_SIZE


def _lay_out(
    local: Sequence[tuple[_Param, int]], amsgrad: bool
) -> tuple[list[_PlannedArena], list[_PlannedSlot]]:
    """OffloadAdamW's arenas on one rank (as HostState.allocate lays them out), and the slots
    of the parameters in their order. ``local`` pairs each trainable parameter with the
    elements of it this rank updates."""
    kinds: dict[torch.dtype, tuple] = {}
    arenas: dict[tuple, _PlannedArena] = {}  # by state dtype, keys and realness, as HostState
    slots = []
    for param, numel in local:
        if param.dtype not in kinds:
            probe = torch.empty(0, dtype=param.dtype, device="meta")
            kinds[param.dtype] = (
                state_dtype(probe),
                state_keys(probe, amsgrad),
                probe.is_complex(),
            )
        kind = kinds[param.dtype]
        if kind not in arenas:
            arenas[kind] = _PlannedArena(*kind[:2])
        arena = arenas[kind]
        real = numel * (2 if param.dtype.is_complex else 1)
        slots.append(_PlannedSlot(arena, arena.numel, _Param((real,), arena.dtype)))
        arena.slots.append(slots[-1])
        arena.numel += real
    return list(arenas.values()), slots


def _grow_staging(
    sets: dict[torch.dtype, list[dict[str, int]]], arenas: Sequence[_PlannedArena], bound: int
) -> int:
    """Grow ``sets`` (per state dtype, the staging sets' elements by key) to the chunks a step
    of ``arenas`` cuts, as StagingPipeline.prepare grows its buffers (never shrinking them, each
    set to the step's largest chunk): state keys for the chunks it stages, a gradient scratch
    for every chunk with a master copy. Returns the bytes of the staging sets."""
    chunks = [chunk for arena in arenas for chunk in plan_chunks(arena.slots, bound)]
    needs = staging_needs(chunks, lambda device: True, STAGING_SETS)  # a GPU's
    for (_, dtype), (count, sizes) in needs.items():
        if not sizes:
            continue
        held = sets.setdefault(dtype, [])
        held.extend({} for _ in range(count - len(held)))
        for buffer in held:
            for key, numel in sizes.items():
                buffer[key] = max(buffer.get(key, 0), numel)
    return sum(
        numel * dtype.itemsize for dtype, held in sets.items() for b in held for numel in b.values()
    )


def _resident_budget(
    resident: Resident, state: int, device: int, gpu_memory: int | None, headroom: float
) -> int:
    """OffloadAdamW's resident budget on one rank (``resident.budget_bytes``), with ``state``
    bytes of state and ``device`` bytes planned on its GPU without any resident. For
    ``"auto"``, which measures free memory after the first step, the plan takes what it
    leaves free of the GPU: its ``1 - headroom`` (what "fits" keeps for what is not modelled,
    activations among it) less the planned usage and "auto"'s own margin."""
    if resident != "auto":
        return fixed_budget(resident, state)
    assert gpu_memory is not None  # plan() refuses "auto" without it
    return max(0, int((1 - headroom) * gpu_memory) - device - auto_margin(gpu_memory))


def _rank_usages(
    params: Sequence[_Param],
    rows: Sequence[tuple[int, int]],
    unsharded: int,
    amsgrad: bool,
    bound: int,
    pin: bool,
    resident: Resident,
    gpu_memory: int | None,
    headroom: float,
) -> tuple[Usage, Usage, int]:
    """torch AdamW's and OffloadAdamW's usage on one rank, and OffloadAdamW's logical state.

    ``rows`` gives, per parameter, the dim-0 rows this rank updates and those its device
    stores (FSDP2 pads every shard to the first one's size). The resident state is chosen by
    the optimizer's own rule, over the parameters in their order (the first forward's order
    for a model that uses them as it declares them)."""
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
    arenas, slots = _lay_out(trainable, amsgrad)
    state = sum(arena.state_bytes(arena.numel) for arena in arenas)
    host = sum(
        _host_buffer_bytes(arena.numel * arena.dtype.itemsize, pin) * len(arena.keys)
        for arena in arenas
    )
    sets: dict[torch.dtype, list[dict[str, int]]] = {}
    staging = _grow_staging(sets, arenas, bound)  # the first step: nothing resident yet
    adamw = Usage(stored, grads, unsharded, adamw_state, 0, 0)
    offload = Usage(stored, grads, unsharded, 0, staging, host)
    budget = _resident_budget(resident, state, offload.device, gpu_memory, headroom)
    kept = 0
    for arena, ranges in choose_resident(slots, {_RANK_GPU: budget}).items():
        arena.resident = ranges
        kept += arena.state_bytes(ranges.numel)
    # From the second step on, chunks also end where resident ranges start or stop.
    staging = _grow_staging(sets, arenas, bound)
    return adamw, replace(offload, device_state=kept, staging=staging), state


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


def _whole(value: Any) -> Any:
    """``value`` as an int where it is a whole float (``7e9``, ``8e10``: counts and sizes are
    often written so), else unchanged."""
    if is_number(value) and not is_int(value) and math.isfinite(value) and value == int(value):
        return int(value)
    return value


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}, got {value!r}")
    return int(value)


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
    pin_memory: bool | None = True,
    unit_params: int | None = None,
    gpu_memory: int | None = None,
    host_memory: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
    resident: Resident = None,
    bandwidth: float | None = None,
) -> MemoryPlan:
    """Bytes per GPU and per node for training ``model`` with and without OffloadAdamW.

    Args:
        model: a parameter count (an int, or a whole float such as ``7e9``); a preset
            (``"7b"``, ``"13b"``, ``"70b"``: Llama-2); a Hugging Face config of the Llama
            layout (Llama, Mistral, Mixtral), as a dict, an object with attributes, or a path
            to its ``config.json`` (or folder); or an ``nn.Module``, on any device (meta
            included), whose parameters with ``requires_grad`` are trained (an
            ``OffloadOptimizerMixin``'s in its param groups' order, as its optimizer lays
            them out).
        precision: a Lightning precision; it sets the dtype of floating-point parameters
            (``"*-mixed"`` and ``"32-true"`` keep them fp32). ``None``: a module's own dtypes,
            else ``"32-true"``.
        gpus, nodes: GPUs per node and nodes; one rank per GPU.
        strategy: ``"ddp"`` (every rank holds everything) or ``"fsdp2"`` (dim 0 of every
            parameter sharded over all ranks, as ``fully_shard`` does).
        amsgrad, chunk_size, pin_memory: as OffloadAdamW's (``pin_memory=None`` pins, as the
            optimizer does on a GPU). One ``amsgrad`` for all parameters: a group of its own
            with another is not planned.
        unit_params: parameters FSDP2 gathers whole at a time (one transformer layer); known
            for configs and modules (the largest ``nn.ModuleList`` element), unknown for counts.
        gpu_memory, host_memory: bytes of one GPU and of one node's RAM; default: this
            machine's (GPU memory unknown without a GPU).
        headroom: share of each memory that "fits" leaves free for what is not modelled.
        resident: as OffloadAdamW's, on each GPU: a share of its state, bytes, or ``"auto"``
            (needs ``gpu_memory``: what is left of the GPU's ``1 - headroom`` after the plan's
            usage and "auto"'s margin; the optimizer measures free memory instead). Whole
            parameters in their order, each kept if it fits what is left, as the optimizer
            chooses; the rest is copied to the GPU and back at each step.
        bandwidth: GB/s per direction of one GPU's link (PCIe), to turn the bytes copied per
            step into seconds in the text output (arithmetic, not a measurement).

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
        >>> p.copied_bytes  # nothing resident: all of it to the GPU and back at every step
        10500000000
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
    if gpu_memory is not None:
        gpu_memory = _positive_int("gpu_memory", _whole(gpu_memory))
    if host_memory is not None:
        host_memory = _positive_int("host_memory", _whole(host_memory))
    pin_memory = True if pin_memory is None else pin_memory
    if not is_number(headroom) or not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a number in [0, 1), got {headroom!r}")
    for name, flag in (("amsgrad", amsgrad), ("pin_memory", pin_memory)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    resident = check_resident(resident)
    if bandwidth is not None and (not is_number(bandwidth) or not 0 < bandwidth < math.inf):
        raise ValueError(f"bandwidth must be a positive number of GB/s, got {bandwidth!r}")
    bandwidth = None if bandwidth is None else float(bandwidth)
    if gpu_memory is None:
        gpu_memory = gpu_memory_here()
    if host_memory is None:
        host_memory = host_memory_here()
    if resident == "auto" and gpu_memory is None:
        raise ValueError(
            "resident='auto' needs the GPU's memory, unknown here (no GPU): pass gpu_memory "
            "(--gpu-memory)"
        )

    spec = _load_model(model, PRECISIONS[precision] if precision else None)
    params = spec.params
    scalars = sum(1 for p in params if not p.shape)
    if strategy == "fsdp2" and scalars:
        raise ValueError(
            f"{spec.name} has {scalars} scalar parameter(s), which fully_shard refuses: make "
            "each a 1-D tensor of one element to shard it with FSDP2"
        )
    if precision is None and not isinstance(model, nn.Module):
        precision = DEFAULT_PRECISION
    unit_count, unit_bytes = _unit(spec, unit_params)
    if strategy == "ddp":
        unit_count = unit_bytes = 0
    bound = chunk_size - chunk_size % SPLIT_ALIGNMENT

    sharded = strategy == "fsdp2"
    shards = gpus * nodes if sharded else 1
    per_rank_trained = sum(p.numel for p in params if p.trainable) // shards
    if per_rank_trained // bound > MAX_PLANNED_CHUNKS:  # planned one by one, as the optimizer
        raise ValueError(
            f"chunk_size {bound:,} cuts a rank's {per_rank_trained:,} trained parameters into "
            f"about {per_rank_trained // bound:,} chunks per step, more than the "
            f"{MAX_PLANNED_CHUNKS:,} planned: each chunk queues a few device operations, so "
            f"the step would mostly launch them. Raise chunk_size (default {DEFAULT_CHUNK_SIZE:,})"
        )
    per_rank = [
        _rank_usages(
            params,
            [_shard_rows(p, rank, shards) for p in params],
            unit_bytes,
            amsgrad,
            bound,
            pin_memory,
            resident,
            gpu_memory,
            headroom,
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
        resident=resident,
        bandwidth=bandwidth,
        adamw=footprint(0),
        offload=footprint(1),
        rank_state_bytes=tuple(r[2] for r in per_rank),
        rank_offload=tuple(r[1] for r in per_rank),
        node_state_bytes=sum(r[2] for r in per_rank) * copies,
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


_SIZE = re.compile(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)\s*([kmgt]i?b)?\s*")
#: A size without a unit below this is refused: ``--gpu-memory 80`` means 80 GB, not bytes.
_SMALLEST_BARE_SIZE = 2**20


def _parse_bytes(text: str) -> int:
    """A size: a number of bytes (``8e10``, at least 1 MiB) or one with a unit (``80GB``)."""
    match = _SIZE.fullmatch(text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 80GB, 141GiB or 8e10)")
    size = float(match[1]) * _UNITS[match[2] or ""]
    if not math.isfinite(size) or size >= 2**63:
        raise argparse.ArgumentTypeError(f"size {text!r} is too large")
    if match[2] is None and 0 < size < _SMALLEST_BARE_SIZE:
        raise argparse.ArgumentTypeError(
            f"{text!r} would be {int(size)} byte(s): give the size with its unit (say 80GB)"
        )
    return int(size)


def _parse_resident(text: str) -> float | int | str:
    """``auto``, a share (``0.5``, ``50%``: a bare number up to 1, not a whole one) or a size
    (``20GB``, ``2.5GB``, ``2e10``), as ``resident``. A bare whole number below 1024 is
    refused: ``1`` is one byte, and more likely meant all."""
    text = text.strip().lower()
    hint = "say auto, a share such as 0.5 or 50%, or a size such as 20GB"
    if text == "auto":
        return text
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else None
        value = float(text) if share is None and not text.endswith("b") else None
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a resident share or size: {text!r} ({hint})"
        ) from None
    if share is not None:
        return share
    if value is None:  # with a unit
        return _parse_bytes(text)
    if value <= 1 and not text.isdigit():
        return value  # a share: negative ones are refused, named, by plan()
    if value.is_integer() and 0 < value < 1024:
        raise argparse.ArgumentTypeError(
            f"resident {text} would be {int(value)} byte(s): write a share with its decimal "
            "point (1.0 is all of the state) or as a percentage, or a size with its unit"
        )
    if not value.is_integer() or value >= 2**63:
        raise argparse.ArgumentTypeError(
            f"resident {text} is neither a share (at most 1.0, which is all of the state) nor "
            "a whole number of bytes"
        )
    return int(value)


def _parse_model(text: str) -> int | str:
    """A parameter count (``6738415616``, ``7e9``, ``7_000_000_000``) or a preset or path."""
    try:
        number = float(text.replace("_", ""))
    except ValueError:
        return text
    if not number.is_integer():
        raise argparse.ArgumentTypeError(f"a parameter count must be whole, got {text!r}")
    return int(number)


def _parse_count(text: str) -> int:
    """A parameter count, as the model argument takes one (``2e8``, ``200_000_000``)."""
    count = _parse_model(text)
    if isinstance(count, str):
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (say 2e8)")
    return count


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
        "--unit-params",
        type=_parse_count,
        help="parameters of one FSDP2 unit (for a parameter count), say 2e8",
    )
    parser.add_argument(
        "--gpu-memory", type=_parse_bytes, help="memory of one GPU (default: this machine's)"
    )
    parser.add_argument(
        "--host-memory", type=_parse_bytes, help="RAM of one node (default: this machine's)"
    )
    parser.add_argument(
        "--resident",
        type=_parse_resident,
        help="OffloadAdamW's resident state per GPU: a share (0.5 or 50%%), a size (20GB) or "
        "auto (needs the GPU's memory)",
    )
    parser.add_argument(
        "--bandwidth", type=float, help="GB/s per direction of a GPU's link, for copy times"
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
            resident=args.resident,
            bandwidth=args.bandwidth,
        )
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    print(result)
    return result


if __name__ == "__main__":
    main()
