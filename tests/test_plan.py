"""The memory planner against what OffloadAdamW reports, and against hand-computed figures."""

from __future__ import annotations

import importlib
import json
import random
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy
import pytest
import torch
from torch import nn

import lightning_offload_optim
from lightning_offload_optim import MemoryPlan, OffloadAdamW, OffloadOptimizerMixin
from lightning_offload_optim.host_state import registered_empty
from lightning_offload_optim.plan import GB, main, plan

MACHINE = {"gpu_memory": 80 * GB, "host_memory": 1000 * GB}
#: The module (``lightning_offload_optim.plan`` names the function once the package is imported).
plan_module = importlib.import_module("lightning_offload_optim.plan")

#: Llama-2 sizes: (hidden, intermediate, layers, attention heads, key-value heads), parameters.
LLAMA_2 = {
    "7b": ((4096, 11008, 32, 32, 32), 6_738_415_616),
    "13b": ((5120, 13824, 40, 40, 40), 13_015_864_320),
    "70b": ((8192, 28672, 80, 64, 8), 68_976_648_192),
}


def llama_config(size: str) -> dict:
    (hidden, intermediate, layers, heads, kv_heads), _ = LLAMA_2[size]
    return {
        "vocab_size": 32000,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "tie_word_embeddings": False,
    }


TINY = {
    "vocab_size": 101,
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


class TinyLlama(nn.Module):
    """Hugging Face's Llama layout, written out by hand."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        hidden, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
        kv = c["num_key_value_heads"] * head_dim
        self.embed_tokens = nn.Embedding(c["vocab_size"], hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "q_proj": nn.Linear(hidden, hidden, bias=False),
                    "k_proj": nn.Linear(hidden, kv, bias=False),
                    "v_proj": nn.Linear(hidden, kv, bias=False),
                    "o_proj": nn.Linear(hidden, hidden, bias=False),
                    "gate_proj": nn.Linear(hidden, c["intermediate_size"], bias=False),
                    "up_proj": nn.Linear(hidden, c["intermediate_size"], bias=False),
                    "down_proj": nn.Linear(c["intermediate_size"], hidden, bias=False),
                    "input_layernorm": nn.RMSNorm(hidden),
                    "post_attention_layernorm": nn.RMSNorm(hidden),
                }
            )
            for _ in range(c["num_hidden_layers"])
        )
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, c["vocab_size"], bias=False)
        if c["tie_word_embeddings"]:
            self.lm_head.weight = self.embed_tokens.weight


class TinyMixtral(TinyLlama):
    """Hugging Face's Mixtral layout, written out by hand: Llama's, with a router and an MLP
    (w1, w2, w3) per expert in place of each layer's MLP."""

    def __init__(self, c: dict) -> None:
        super().__init__(c)
        hidden, inter, experts = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]

        def expert() -> nn.ModuleDict:
            shapes = {"w1": (hidden, inter), "w2": (inter, hidden), "w3": (hidden, inter)}
            return nn.ModuleDict({k: nn.Linear(*shape, bias=False) for k, shape in shapes.items()})

        for i, layer in enumerate(self.layers):
            attention = {k: layer[k] for k in ("q_proj", "k_proj", "v_proj", "o_proj")}
            norms = {k: layer[k] for k in ("input_layernorm", "post_attention_layernorm")}
            moe = {
                "gate": nn.Linear(hidden, experts, bias=False),
                "experts": nn.ModuleList(expert() for _ in range(experts)),
            }
            self.layers[i] = nn.ModuleDict(attention | moe | norms)


def mixed_model() -> nn.Module:
    """Odd shapes (rows not multiples of anything), fp32 and bf16 parameters, one frozen."""
    model = nn.Sequential(
        nn.Linear(13, 37), nn.Linear(37, 300), nn.LayerNorm(300), nn.Linear(300, 7, bias=False)
    )
    model[1].to(torch.bfloat16)
    model[3].to(torch.bfloat16)
    model[2].bias.requires_grad_(False)
    return model


def stepped(model: nn.Module, steps: int = 1, **options) -> OffloadAdamW:
    """OffloadAdamW after ``steps`` real steps over every trainable parameter, staged as on a
    GPU (resident state is chosen at the second)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return take_steps(OffloadAdamW(params, pin_memory=False, force_staging=True, **options), steps)


def take_steps(opt: OffloadAdamW, steps: int) -> OffloadAdamW:
    """``opt`` after ``steps`` steps with random gradients for every parameter it holds."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt


# ------------------------------------------------------------------ against the optimizer
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("chunk_size", [128, 1000, 1 << 22])
@pytest.mark.parametrize(
    "dtype", [None, torch.float32, torch.bfloat16], ids=["mixed", "fp32", "bf16"]
)
def test_memory_stats_match_a_real_step(amsgrad, chunk_size, dtype):
    model = mixed_model() if dtype is None else mixed_model().to(dtype)
    expected = plan(model, amsgrad=amsgrad, chunk_size=chunk_size, pin_memory=False, **MACHINE)
    assert (
        expected.memory_stats()
        == stepped(model, amsgrad=amsgrad, chunk_size=chunk_size).memory_stats()
    )


@pytest.mark.parametrize("resident", [None, 0.5])
def test_memory_stats_match_with_complex_double_and_16_bit_parameters(resident):
    """Complex parameters get arenas of their own (real views, twice the elements); fp64 ones
    keep fp64 state; bf16 and fp16 ones share one arena (fp32 state with a master copy)."""
    model = nn.Module()
    model.a = nn.Parameter(torch.randn(37, 5, dtype=torch.complex64))
    model.b = nn.Parameter(torch.randn(100))
    model.c = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    model.d = nn.Parameter(torch.randn(70, dtype=torch.float16))  # one chunk of 120 with e
    model.e = nn.Parameter(torch.randn(50, dtype=torch.bfloat16))
    expected = plan(model, chunk_size=128, resident=resident, pin_memory=False, **MACHINE)
    opt = stepped(model, 3, chunk_size=128, resident=resident)
    assert expected.memory_stats() == opt.memory_stats()
    assert len(opt._host.arenas) == 4


def test_precision_recasts_a_module_like_lightning():
    """bf16-true plans the module as if cast to bf16; the real cast agrees."""
    model = mixed_model().float()
    planned = plan(model, precision="bf16-true", pin_memory=False, **MACHINE)
    assert planned.memory_stats() == stepped(model.to(torch.bfloat16)).memory_stats()
    per_element = 12  # fp32 exp_avg, exp_avg_sq and master copy
    assert planned.state_bytes == per_element * planned.trainable


def test_pinned_host_bytes_are_page_rounded_buffers():
    model = nn.Linear(1000, 333)  # one fp32 arena, two keys
    numel = sum(p.numel() for p in model.parameters())
    buffer, _ = registered_empty(numel, torch.float32, register=lambda pointer, nbytes: 0)
    planned = plan(model, **MACHINE)
    assert planned.memory_stats()["host_bytes"] == 2 * buffer.untyped_storage().nbytes()
    assert planned.memory_stats()["pinned"] is True
    assert planned.state_bytes == 8 * numel


@pytest.mark.parametrize("resident", [0.0, 0.3, 0.7, 1.0, 3000], ids=lambda r: f"resident={r!r}")
@pytest.mark.parametrize("chunk_size", [128, 1 << 22])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["mixed", "bf16"])
def test_resident_state_and_copies_match_real_steps(resident, chunk_size, dtype):
    """From the second step on, the resident bytes are the optimizer's, and every later step
    copies the rest to the device and back, as the step's own record counts it."""
    model = mixed_model() if dtype is None else mixed_model().to(dtype)
    expected = plan(model, resident=resident, chunk_size=chunk_size, pin_memory=False, **MACHINE)
    opt = stepped(model, 3, resident=resident, chunk_size=chunk_size)
    assert expected.memory_stats() == opt.memory_stats()
    moved = opt.last_step.resolve()
    assert expected.copied_bytes == moved.bytes_in == moved.bytes_out
    assert expected.offload.gpu.device_state == expected.resident_bytes
    assert expected.state_bytes == expected.resident_bytes + expected.copied_bytes


@pytest.mark.parametrize("seed", range(30))
def test_random_models_plan_as_the_optimizer_steps(seed):
    """Random mixes of parameter dtypes (16-bit ones sharing an arena, complex and fp64 ones in
    their own), shapes, frozen parameters, amsgrad, chunk sizes and resident budgets."""
    rng = random.Random(seed)
    model = nn.Module()
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64]
    for i in range(rng.randint(1, 6)):
        shape = [rng.randint(1, 300)] if rng.random() < 0.6 else [rng.randint(1, 40)] * 2
        param = nn.Parameter(torch.randn(shape, dtype=rng.choice(dtypes)))
        setattr(model, f"p{i}", param.requires_grad_(i == 0 or rng.random() < 0.9))
    options = {
        "chunk_size": rng.choice([64, 128, 256, 1000, 1 << 22]),
        "resident": rng.choice([None, 0.0, rng.random(), 1.0, rng.randint(0, 20000)]),
        "amsgrad": rng.random() < 0.3,
    }
    expected = plan(model, pin_memory=False, **options, **MACHINE)
    opt = stepped(model, 3, **options)
    assert expected.memory_stats() == opt.memory_stats()
    moved = opt.last_step.resolve()
    assert expected.copied_bytes == moved.bytes_in == moved.bytes_out


def test_staging_grows_where_resident_ranges_cut_the_chunks():
    """A resident parameter of 3 elements before one of 128: from the second step a chunk
    starts after it and holds all 128 (the first step's chunks were 128 and 3), so staging
    grows to 128 elements per key, and buffers never shrink."""
    model = nn.Module()
    model.small = nn.Parameter(torch.randn(3))
    model.large = nn.Parameter(torch.randn(128))
    expected = plan(model, resident=24, chunk_size=128, pin_memory=False, **MACHINE)
    first = plan(model, chunk_size=128, pin_memory=False, **MACHINE)
    assert expected.resident_bytes == 24
    assert expected.offload.gpu.staging == 2 * 2 * 128 * 4 > first.offload.gpu.staging
    assert expected.memory_stats() == stepped(model, 3, resident=24, chunk_size=128).memory_stats()


def test_resident_keeps_whole_parameters_in_order_by_hand():
    """fp32 state is 8 B per element: 8000 (weight 1), 800 (bias 1), 8000 (weight 2) and 80 B
    (bias 2). Each is kept if it fits in what is left, so a large one is passed over for a
    smaller one after it."""
    model = nn.Sequential(nn.Linear(10, 100), nn.Linear(100, 10))
    by_bytes = plan(model, resident=9000, pin_memory=False, **MACHINE)
    assert by_bytes.resident_bytes == 8000 + 800 + 80  # weight 2 does not fit the 200 left
    assert by_bytes.copied_bytes == 8000
    half = plan(model, resident=0.5, pin_memory=False, **MACHINE)  # a budget of 8440 B
    assert half.resident_bytes == 8000 + 80  # bias 1 (800 B) does not fit the 440 left
    none = plan(model, pin_memory=False, **MACHINE)
    assert half.offload.gpu.device - none.offload.gpu.device == 8080  # on the GPU, once
    assert half.offload.gpu.host_state == none.offload.gpu.host_state  # the host keeps it all
    assert plan(model, resident=1.0, **MACHINE).copied_bytes == 0
    assert plan(model, **MACHINE).copied_bytes == plan(model, **MACHINE).state_bytes == 16880
    single = plan(8 * 10**6, resident=0.99, **MACHINE)  # one parameter, larger than the budget
    assert single.resident_bytes == 0 and single.copied_bytes == 64 * 10**6


class TwoLayers(OffloadOptimizerMixin, pl.LightningModule):
    """Weights of 1000 elements declared before their biases (100 and 10): the mixin's groups
    list both weights first, then the biases without decay."""

    def __init__(self, overlap_step: bool = False, offload_resident: int = 16000) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.first, self.second = nn.Linear(10, 100), nn.Linear(100, 10)

    def offload_optimizer_args(self) -> dict:
        return {**super().offload_optimizer_args(), "pin_memory": False, "force_staging": True}


def test_a_mixin_module_is_planned_in_its_param_groups_order():
    """16000 B: taken in the groups' order, both weights (8000 B each) stay resident and no
    bias does; in declared order the first bias would come before the second weight, leaving
    too little for it (8000 + 800 + 80). The plan follows the groups, as the optimizer does."""
    module = TwoLayers()
    expected = plan(module, resident=16000, pin_memory=False, **MACHINE)
    assert expected.resident_bytes == 16000
    opt = take_steps(module.configure_optimizers(), 3)
    assert expected.memory_stats() == opt.memory_stats()
    moved = opt.last_step.resolve()
    assert expected.copied_bytes == moved.bytes_in == moved.bytes_out == 880
    # Overlapping the step, the first forward pass sets the order: declared, for this module.
    assert plan(TwoLayers(overlap_step=True), resident=16000, **MACHINE).resident_bytes == 8880


class NamedGroups(TwoLayers):
    """Named parameters, as torch's optimizers take them, without the second layer's bias."""

    def offload_param_groups(self) -> list:
        named = [(n, p) for n, p in self.named_parameters() if n != "second.bias"]
        return [{"params": named[:1]}, {"params": named[1:]}]


class NeedsTrainer(TwoLayers):
    def offload_optimizer_args(self) -> dict:
        return {**super().offload_optimizer_args(), "lr": 1e-3 * self.trainer.world_size}


def test_a_mixin_module_is_planned_over_the_parameters_its_groups_name():
    """Groups of (name, parameter) pairs that leave out a bias: the plan reads the pairs and
    trains only what the groups give the optimizer (the left-out bias, though it requires a
    gradient, gets no state), as a real step does."""
    module = NamedGroups(offload_resident=0)
    expected = plan(module, pin_memory=False, **MACHINE)
    assert expected.state_bytes == 8 * (1000 + 100 + 1000)
    assert expected.memory_stats() == take_steps(module.configure_optimizers(), 2).memory_stats()


def test_a_mixin_whose_optimizer_args_need_a_trainer_is_planned_in_declared_order():
    with pytest.warns(UserWarning, match=r"NeedsTrainer.offload_optimizer_args\(\) raised") as w:
        planned = plan(NeedsTrainer(), resident=16000, **MACHINE)
    assert w[0].filename == __file__
    assert planned.resident_bytes == 8000 + 800 + 80  # declared order: the first bias fits first


class BareTensorGroups(TwoLayers):
    """Groups whose "params" is one tensor, as torch's add_param_group takes it."""

    def offload_param_groups(self) -> list:
        return [{"params": self.first.weight}, {"params": self.second.weight}]


class LeavesOutABias(TwoLayers):
    def offload_param_groups(self) -> list:
        return [{"params": [p for n, p in self.named_parameters() if n != "second.bias"]}]


def test_a_group_given_one_tensor_is_planned_over_that_tensor():
    """Not over the tensor's rows, as parameters of their own."""
    module = BareTensorGroups(offload_resident=0)
    expected = plan(module, pin_memory=False, **MACHINE)
    assert expected.parameters == 2110 and expected.trainable == 2000
    assert expected.state_bytes == 8 * (1000 + 1000)
    assert expected.memory_stats() == take_steps(module.configure_optimizers(), 2).memory_stats()


def test_parameters_the_groups_leave_out_still_count_as_the_models_weights():
    module = LeavesOutABias(offload_resident=0)
    planned, whole = plan(module, **MACHINE), plan(TwoLayers(offload_resident=0), **MACHINE)
    assert planned.parameters == sum(p.numel() for p in module.parameters()) == 2110
    assert planned.trainable == 2100
    assert planned.offload.gpu.params == whole.offload.gpu.params


def test_a_plain_module_is_planned_without_a_warning():
    """Only a mixin module has optimizer arguments to read (and to warn about)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned = plan(nn.Linear(10, 10), **MACHINE)
    assert planned.trainable == 110


def test_resident_auto_takes_what_headroom_and_margin_leave_by_hand():
    """One bf16 parameter of 8e6 elements: 16 MB of weights, 16 MB of gradients, two staging
    sets of 4 fp32 keys (moments, master copy, gradient scratch) of 4 Mi elements, and 96 MB of
    state. "auto" gets 90% of the GPU less that usage and its margin: 10% of the GPU, and at
    least 2 GiB."""
    common = {"precision": "bf16-true", "resident": "auto", "host_memory": 1000 * GB}
    usage = 32 * 10**6 + 2 * 4 * 4 * (1 << 22)
    roomy = plan(8 * 10**6, gpu_memory=100 * GB, **common)  # budget 90e9 - usage - 10e9
    assert roomy.offload.gpu.device == usage + 96 * 10**6
    assert roomy.resident_bytes == 96 * 10**6 and roomy.copied_bytes == 0
    floor = 2 << 30  # the margin's floor decides below 20 GB of GPU
    fits = 96 * 10**6 + usage + floor
    just = plan(8 * 10**6, gpu_memory=-(-fits * 10 // 9), **common)
    assert just.resident_bytes == 96 * 10**6
    short = plan(8 * 10**6, gpu_memory=-(-fits * 10 // 9) - 10, **common)
    assert short.resident_bytes == 0 and short.copied_bytes == 96 * 10**6
    tight = plan(8 * 10**6, gpu_memory=3 * GB, headroom=0.5, **common)  # 1.5e9 - usage < 2 GiB
    assert tight.resident_bytes == 0


def test_resident_counts_on_the_gpu_and_in_fits():
    seven = {"precision": "bf16-true", "gpu_memory": 80 * GB, "host_memory": 1000 * GB}
    auto = plan("7b", resident="auto", **seven)
    assert 0 < auto.resident_bytes < auto.state_bytes  # 80.9 GB of state: part of it fits
    assert auto.offload.fits_gpu is True
    assert auto.offload.gpu.device <= 0.9 * 80 * GB - 8 * GB  # the margin stays free
    everything = plan("7b", resident=1.0, **seven)
    assert everything.resident_bytes == everything.state_bytes
    assert everything.offload.fits_gpu is False  # 27 GB of weights and gradients + 80.9 GB
    assert everything.offload.gpu.host_state == auto.offload.gpu.host_state  # host holds all


def test_resident_per_fsdp2_rank_and_node():
    """37 rows over 2 ranks: 19 and 18 rows of fp32 state, each rank keeping its own shard."""
    whole = plan(37, strategy="fsdp2", gpus=2, resident=1.0, pin_memory=False, **MACHINE)
    assert [whole.memory_stats(r)["resident_bytes"] for r in range(2)] == [19 * 8, 18 * 8]
    assert whole.offload.node.device_state == 37 * 8 and whole.node_copied_bytes == 0
    budget = plan(37, strategy="fsdp2", gpus=2, resident=150, pin_memory=False, **MACHINE)
    assert [budget.memory_stats(r)["resident_bytes"] for r in range(2)] == [0, 18 * 8]
    assert budget.node_copied_bytes == budget.copied_bytes == 19 * 8
    ddp = plan(37, gpus=4, resident=150, pin_memory=False, **MACHINE)  # each rank all 37 rows
    assert ddp.resident_bytes == 0 and ddp.node_copied_bytes == 4 * 37 * 8


# ------------------------------------------------------------------ models and configs
@pytest.mark.parametrize("size", list(LLAMA_2))
def test_llama_2_parameter_counts(size, tmp_path):
    count = LLAMA_2[size][1]
    config = llama_config(size)
    (tmp_path / "config.json").write_text(json.dumps(config))
    sources = [config, SimpleNamespace(**config), tmp_path / "config.json", str(tmp_path), size]
    for source in sources:
        assert plan(source, **MACHINE).parameters == count


def test_meta_module_matches_its_config():
    for tied in (False, True):
        config = {**TINY, "tie_word_embeddings": tied}
        with torch.device("meta"):
            module = TinyLlama(config)
        hidden, inter, layers = 64, 172, 3
        layer = 2 * hidden * hidden + 2 * hidden * 32 + 3 * hidden * inter + 2 * hidden
        expected = (1 if tied else 2) * 101 * hidden + layers * layer + hidden
        options = {"precision": "bf16-true", "gpus": 3, "strategy": "fsdp2", **MACHINE}
        from_module, from_config = plan(module, **options), plan(config, **options)
        assert from_module.parameters == from_config.parameters == expected
        assert from_module.unit_parameters == from_config.unit_parameters == layer
        assert from_module.offload == from_config.offload
        assert from_module.adamw == from_config.adamw


def test_a_mixtral_config_counts_an_mlp_per_expert():
    """Read as Llama, a Mixtral config counted one MLP per layer (Mixtral-8x7B as 7.2B
    parameters, not 46.7B). Against the layout written out by hand, and Mixtral-8x7B's
    published count."""
    config = {**TINY, "model_type": "mixtral", "num_local_experts": 3}
    with torch.device("meta"):
        module = TinyMixtral(config)
    options = {"precision": "bf16-true", "gpus": 3, "strategy": "fsdp2", **MACHINE}
    from_module, from_config = plan(module, **options), plan(config, **options)
    assert from_module.parameters == from_config.parameters
    assert from_module.unit_parameters == from_config.unit_parameters
    assert from_module.offload == from_config.offload
    assert from_module.adamw == from_config.adamw
    mixtral_8x7b = {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
    }
    assert plan(mixtral_8x7b, **MACHINE).parameters == 46_702_792_704
    del mixtral_8x7b["num_local_experts"]  # transformers' MixtralConfig defaults to 8
    assert plan(mixtral_8x7b, **MACHINE).parameters == 46_702_792_704


# ------------------------------------------------------------------ strategies
def test_ddp_and_fsdp2_by_hand():
    mb = 10**6
    common = {"precision": "bf16-true", "gpus": 4, "nodes": 2, "pin_memory": False, **MACHINE}
    fsdp = plan(8 * mb, strategy="fsdp2", unit_params=mb, **common)
    # 1e6 bf16 elements per rank; 4 fp32 staging keys (moments, master, grad) of 1e6, once:
    # the rank's state is one chunk, which takes the first staging set only.
    assert fsdp.offload.gpu.params == fsdp.offload.gpu.grads == 2 * mb
    assert fsdp.offload.gpu.unsharded == 2 * mb
    assert fsdp.state_bytes == fsdp.offload.gpu.host_state == 12 * mb
    assert fsdp.offload.gpu.staging == 1 * 4 * 4 * mb
    assert fsdp.offload.gpu.device == 6 * mb + 16 * mb
    assert fsdp.offload.node.host_state == 4 * 12 * mb
    assert fsdp.adamw.gpu.device_state == 4 * mb  # bf16 moments on the device
    assert fsdp.adamw.gpu.device == 10 * mb

    ddp = plan(8 * mb, strategy="ddp", unit_params=mb, **common)
    assert ddp.offload.gpu.params == ddp.offload.gpu.grads == 16 * mb
    assert ddp.offload.gpu.unsharded == 0 and ddp.unit_parameters == 0
    assert ddp.state_bytes == 96 * mb
    assert ddp.offload.gpu.staging == 2 * 4 * 4 * (1 << 22)  # chunks of chunk_size, 4 Mi
    assert ddp.offload.node.host_state == 4 * 96 * mb
    assert ddp.adamw.node.device == 4 * ddp.adamw.gpu.device == 4 * (16 + 16 + 32) * mb


def test_fsdp2_shards_like_torch_chunk():
    """37 rows over 2 ranks: rank 0 updates 19 (and each stores 19, padded)."""
    uneven = plan(37, strategy="fsdp2", gpus=2, pin_memory=False, **MACHINE)
    assert uneven.state_bytes == 19 * 8
    assert uneven.memory_stats(1)["state_bytes"] == 18 * 8
    with pytest.raises(ValueError, match="node 0's ranks, 0 to 1; got 2"):
        uneven.memory_stats(2)
    assert uneven.offload.node.host_state == 37 * 8
    assert uneven.offload.node.params == 2 * 19 * 4


def test_fsdp2_state_per_gpu_is_close_to_a_share():
    for size in LLAMA_2:
        ddp = plan(size, precision="bf16-true", gpus=8, **MACHINE)
        fsdp = plan(size, precision="bf16-true", gpus=8, strategy="fsdp2", **MACHINE)
        assert fsdp.state_bytes == pytest.approx(ddp.state_bytes / 8, rel=0.01)
        assert fsdp.offload.node.host == pytest.approx(ddp.offload.gpu.host, rel=1e-4)
        layer = plan(size, precision="bf16-true", strategy="fsdp2", **MACHINE).unit_parameters
        assert fsdp.offload.gpu.unsharded == 2 * layer


def test_fits_leaves_headroom():
    seven = plan("7b", precision="bf16-true", gpu_memory=40 * GB, host_memory=100 * GB)
    assert seven.adamw.fits_gpu is False  # 53.9 GB
    assert seven.offload.fits_gpu is True  # 27.1 GB
    assert seven.offload.fits_host is True  # 80.9 GB of 90
    tight = plan("7b", precision="bf16-true", gpu_memory=40 * GB, host_memory=85 * GB)
    assert tight.offload.fits_host is False  # 80.9 GB > 90% of 85
    assert tight.adamw.fits_host is True


def test_fits_counts_headroom_the_exact_limit_and_the_whole_node():
    device = plan(1000, **MACHINE).offload.gpu.device
    assert plan(1000, gpu_memory=device, host_memory=GB, headroom=0.0).offload.fits_gpu
    tight = plan("7b", precision="bf16-true", gpu_memory=29 * GB, host_memory=1000 * GB)
    assert 0.9 * 29 * GB < tight.offload.gpu.device <= 29 * GB  # in the 10% headroom
    assert tight.offload.fits_gpu is False
    node = plan("7b", precision="bf16-true", gpus=8, gpu_memory=80 * GB, host_memory=100 * GB)
    assert node.offload.gpu.host < 90 * GB < node.offload.node.host  # one rank fits, 8 do not
    assert node.offload.fits_host is False


def test_torch_amsgrad_keeps_three_moments_on_the_device():
    assert plan(1000, amsgrad=True, **MACHINE).adamw.gpu.device_state == 3 * 1000 * 4


def test_uneven_fsdp2_shards_per_rank():
    """37 rows on 2 ranks: rank 0 holds 19 (the figure per GPU), gradients padded alike; 5 rows
    on 4 ranks: 2, 2, 1 and none."""
    uneven = plan(37, strategy="fsdp2", gpus=2, pin_memory=False, **MACHINE)
    assert uneven.offload.gpu.host_state == uneven.adamw.gpu.device_state == 19 * 8
    assert uneven.offload.node.grads == uneven.offload.node.params == 2 * 19 * 4
    sparse = plan(5, strategy="fsdp2", gpus=4, pin_memory=False, **MACHINE)
    assert [sparse.memory_stats(r)["state_bytes"] for r in range(4)] == [16, 16, 8, 0]


def test_ddp_memory_stats_of_every_rank_are_the_whole_state():
    ddp = plan(1000, gpus=2, strategy="ddp", **MACHINE)
    assert ddp.memory_stats(1) == ddp.memory_stats(0)


def test_modules_keep_their_own_dtypes_and_units():
    frozen = plan(nn.Linear(4, 4).requires_grad_(False), **MACHINE)
    assert frozen.memory_stats()["pinned"] is False  # nothing to pin
    own = plan(nn.Linear(3, 3), **MACHINE)
    assert own.precision is None and "parameters' own dtypes" in own.format()
    ids = nn.Module()
    ids.w = nn.Parameter(torch.zeros(10))
    ids.ids = nn.Parameter(torch.zeros(10, dtype=torch.int64), requires_grad=False)
    assert plan(ids, precision="bf16-true", **MACHINE).offload.gpu.params == 10 * 2 + 10 * 8
    blocks = nn.Module()
    blocks.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(40, 40)])
    assert plan(blocks, strategy="fsdp2", **MACHINE).unit_parameters == 40 * 40 + 40
    mixed = nn.Module()
    mixed.big = nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    mixed.small = nn.Parameter(torch.zeros(10))
    unit = plan(mixed, strategy="fsdp2", unit_params=100, **MACHINE)
    assert unit.offload.gpu.unsharded == 100 * 2  # in the dtype most parameters have
    none = plan(10, strategy="fsdp2", unit_params=0, **MACHINE)
    assert none.offload.gpu.unsharded == 0 and none.unit_parameters == 0


def test_config_defaults_and_biases():
    """Key-value heads default to the heads (Llama-1 configs have none); Qwen2-style configs
    add biases to the attention and MLP projections."""
    no_kv = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    assert plan(no_kv, **MACHINE).parameters == plan({**TINY, "num_key_value_heads": 4}).parameters
    biased = plan({**TINY, "attention_bias": True, "mlp_bias": True}, **MACHINE).parameters
    hidden, inter, layers, head_dim = 64, 172, 3, 16
    q_o, k_v = 2 * hidden, 2 * 2 * head_dim  # 4 heads, 2 key-value heads
    assert biased - plan(TINY, **MACHINE).parameters == layers * (q_o + k_v + 2 * inter + hidden)


def test_note_gives_what_is_left_on_one_gpu():
    two = plan(10**6, gpus=2, pin_memory=False, **MACHINE)
    left = (80 * GB - two.offload.gpu.device) / GB
    assert f"{left:.2f} GB with OffloadAdamW" in " ".join(two.format().split())


def test_exported_from_the_package():
    assert lightning_offload_optim.plan is plan
    assert isinstance(plan(10, **MACHINE), MemoryPlan)


def test_numpy_numbers_plan_as_the_python_ones():
    """Counts and settings read from numpy (a sweep's grid) were refused as "not an int"."""
    python = plan(10**6, gpus=2, chunk_size=1 << 20, resident=1 << 20, **MACHINE)
    given = {"gpus": numpy.int64(2), "chunk_size": numpy.int32(1 << 20)}
    numpys = plan(numpy.int64(10**6), **given, resident=numpy.int64(1 << 20), **MACHINE)
    assert numpys == python
    share = plan(10**6, resident=0.25, **MACHINE)
    assert plan(10**6, resident=numpy.float32(0.25), **MACHINE) == share
    slow = plan(10**6, bandwidth=12.5, **MACHINE)
    numpy_slow = plan(10**6, bandwidth=numpy.float32(12.5), **MACHINE)
    assert numpy_slow == slow and type(numpy_slow.bandwidth) is float
    memories = {name: numpy.int64(value) for name, value in MACHINE.items()}
    fitting = plan(10**6, **memories)
    assert fitting == plan(10**6, **MACHINE)
    assert fitting.offload.fits_gpu is True and type(fitting.gpu_memory) is int
    # Sizes written as whole floats (8e10), as the parameter count may be; pin_memory=None
    # pins, as OffloadAdamW does on a GPU.
    written = plan(10**6, gpu_memory=8e10, host_memory=1e12)
    assert written == plan(10**6, **MACHINE) and type(written.gpu_memory) is int
    assert plan(10**6, pin_memory=None, **MACHINE) == plan(10**6, pin_memory=True, **MACHINE)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        (10, {"precision": "bf16"}, "unknown precision 'bf16'"),
        (10, {"strategy": "fsdp"}, "unknown strategy 'fsdp'"),
        (10, {"gpus": 0}, "gpus must be an int of at least 1"),
        (10, {"nodes": 1.5}, "nodes must be an int"),
        (10, {"chunk_size": 32}, "chunk_size must be an int of at least 64"),
        (10, {"headroom": 1.0}, "headroom must be a number in"),
        (10, {"headroom": "0.1"}, "headroom must be a number in"),
        (10, {"headroom": None}, "headroom must be a number in"),
        (10, {"amsgrad": "no"}, "amsgrad must be True or False, got 'no'"),
        (10, {"pin_memory": "yes"}, "pin_memory must be True or False, got 'yes'"),
        (10, {"gpu_memory": 8.5e10 + 0.5}, "gpu_memory must be an int of at least 1"),
        (7.5, {}, "the parameter count must be a whole number, got 7.5"),
        (float("inf"), {}, "the parameter count must be a whole number, got inf"),
        (-5, {}, "the parameter count must be at least 1"),
        (0, {}, "the parameter count must be at least 1"),
        ({**TINY, "num_hidden_layers": 0}, {}, "has a size below 1"),
        ({**TINY, "num_attention_heads": 0}, {}, "has a size below 1"),
        ({**TINY, "num_key_value_heads": 0}, {}, "has a size below 1"),
        ({**TINY, "head_dim": 0}, {}, "has a size below 1"),
        ({**TINY, "model_type": "mixtral", "num_local_experts": -1}, {}, "has a size below 1"),
        ({"vocab_size": 10, "hidden_size": 8}, {}, "lacks intermediate_size, num_hidden_layers"),
        ("8b", {}, r"neither a parameter count \(7e9\), a preset"),
        ({**TINY, "model_type": "gpt_neox"}, {}, "a 'gpt_neox' model; the planner reads the Llama"),
        (10**9, {"chunk_size": 64}, "into about 15,625,000 chunks per step, more than the"),
        (10, {"resident": -1}, "resident as a number of bytes must be >= 0"),
        (10, {"resident": 1.5}, r"resident as a share of the state must be in \[0, 1\]"),
        (10, {"resident": "auto", "gpu_memory": None}, "resident='auto' needs the GPU's memory"),
        (10, {"bandwidth": 0}, "bandwidth must be a positive number of GB/s"),
        (10, {"bandwidth": True}, "bandwidth must be a positive number of GB/s"),
        (10, {"bandwidth": float("nan")}, "bandwidth must be a positive number of GB/s"),
    ],
)
def test_bad_input_is_refused(model, options, message, monkeypatch):
    monkeypatch.setattr(plan_module, "gpu_memory_here", lambda: None)  # as without a GPU
    with pytest.raises(ValueError, match=message):
        plan(model, **{**MACHINE, **options})


def test_a_whole_float_count_plans_as_the_int():
    """``plan(7e9)`` is how a count is often written; it was read as a config ("config float
    lacks vocab_size")."""
    assert plan(7e9, **MACHINE) == plan(7 * 10**9, **MACHINE)
    assert plan(numpy.float64(1e6), **MACHINE) == plan(10**6, **MACHINE)


@pytest.mark.parametrize("rank", [1.5, "0", None, True])
def test_memory_stats_of_a_rank_that_is_not_an_int_is_refused(rank):
    with pytest.raises(ValueError, match="rank must be an int"):
        plan(10, gpus=2, **MACHINE).memory_stats(rank)


def test_fsdp2_refuses_a_scalar_parameter_as_fully_shard_does():
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("temperature", nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(
        ValueError, match=r"Sequential has 1 scalar parameter\(s\), which fully_shard"
    ):
        plan(model, strategy="fsdp2", gpus=2, **MACHINE)
    assert plan(model, strategy="ddp", gpus=2, **MACHINE).trainable == 21


def test_a_non_model_is_refused():
    with pytest.raises(TypeError, match=r"give a count, a config or an nn\.Module"):
        plan(True, **MACHINE)
    with pytest.raises(TypeError, match="resident must be a share of the state"):
        plan(10, resident="half", **MACHINE)


# ------------------------------------------------------------------ CLI
def test_cli_prints_the_table(capsys):
    fsdp2 = ["--gpus", "8", "--strategy", "fsdp2", "--precision", "bf16-true"]
    result = main(["70b", *fsdp2, "--gpu-memory", "80GB", "--host-memory", "2TB"])
    out = capsys.readouterr().out
    assert result.gpus == 8 and result.gpu_memory == 80 * GB and result.host_memory == 2000 * GB
    assert "Llama-2 70B: 68,976,648,192 parameters" in out
    for row in ("optimizer state, host RAM", "total device", "fits GPU (80.0 GB)"):
        assert row in out
    host_row = next(line for line in out.splitlines() if line.startswith("total host RAM"))
    assert host_row.split()[-1] == f"{result.offload.node.host / GB:.2f}"


def test_cli_takes_counts_and_refuses_bad_input(capsys):
    result = main(["7e9", "--unit-params", "1000000", "--gpu-memory", "1GiB"])
    assert result.parameters == 7 * 10**9 and result.gpu_memory == 2**30
    with pytest.raises(SystemExit):
        main(["7b", "--gpus", "0"])
    assert "gpus must be an int of at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["7.5"])  # not truncated to 7 parameters
    assert main(["7e9", "--unit-params", "1e6", "--gpu-memory", "8e+10"]).gpu_memory == 80 * GB
    for option, text, message in (
        ("--gpu-memory", "80", "'80' would be 80 byte(s): give the size with its unit"),
        ("--host-memory", "1e400", "size '1e400' is too large"),  # not a traceback
        ("--unit-params", "many", "not a parameter count: 'many'"),
    ):
        with pytest.raises(SystemExit):
            main(["7e9", option, text])
        assert message in capsys.readouterr().err


def test_cli_reads_sizes_at_their_limits(capsys):
    """The smallest bare size, decimal units, negative exponents, and the largest sizes."""
    assert main(["7e9", "--gpu-memory", "1048576"]).gpu_memory == 2**20
    small = main(["7e9", "--gpu-memory", "512KB", "--host-memory", "1e-3TB"])
    assert (small.gpu_memory, small.host_memory) == (512_000, 10**9)
    for option, text, message in (
        ("--gpu-memory", "1e19", "size '1e19' is too large"),  # above 2**63
        ("--resident", "1e30", "resident 1e30 is neither a share"),
    ):
        with pytest.raises(SystemExit):
            main(["7e9", option, text])
        assert message in capsys.readouterr().err


def test_the_chunk_guard_counts_one_ranks_chunks(monkeypatch):
    """At most MAX_PLANNED_CHUNKS chunks per rank are planned; an FSDP2 rank plans its shard."""
    monkeypatch.setattr(plan_module, "MAX_PLANNED_CHUNKS", 8)  # chunk_size 1000 rounds to 960
    assert plan(8 * 960 + 959, chunk_size=1000, **MACHINE).parameters == 8 * 960 + 959
    with pytest.raises(ValueError, match="about 9 chunks per step, more than the 8 planned"):
        plan(9 * 960, chunk_size=1000, **MACHINE)
    assert plan(32_000, chunk_size=1000, strategy="fsdp2", gpus=4, **MACHINE).gpus == 4
    with pytest.raises(ValueError, match="about 9 chunks per step"):
        plan(36 * 960, chunk_size=1000, strategy="fsdp2", gpus=4, **MACHINE)


def test_cli_names_a_config_that_is_not_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{\n  'vocab_size': 10\n}")
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert f"{tmp_path / 'config.json'} is not valid JSON" in capsys.readouterr().err


def test_cli_plans_resident_state_and_copy_times(capsys):
    common = ["7b", "--precision", "bf16-true", "--gpu-memory", "80GB", "--host-memory", "1TB"]
    for text, value in (
        ("50%", 0.5),
        ("0.5", 0.5),
        ("1.0", 1.0),
        ("20GB", 20 * GB),
        ("2.5GB", 25 * GB // 10),  # a size with a decimal point is a size, not a share
        ("0.5GiB", 2**29),
        ("1.5e10", 15 * GB),  # bytes, as --gpu-memory 8e10
    ):
        assert main([*common, "--resident", text]).resident == value
    assert main([*common, "--resident", "1500"]).resident == 1500  # bytes, as an int in Python
    assert main([*common, "--resident", "0"]).resident == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*common, "--resident", "1"])  # one byte: more likely meant all of it
    assert "resident 1 would be 1 byte(s)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*common, "--resident", "-0.1"])
    assert "resident as a share of the state must be in [0, 1]" in capsys.readouterr().err
    result = main([*common, "--resident", "auto", "--bandwidth", "50"])
    out = " ".join(capsys.readouterr().out.split())
    seconds = result.copied_bytes / GB / 50
    assert f"keeps {result.resident_bytes / GB:.2f} GB of state on each GPU" in out
    assert f"copies the other {result.copied_bytes / GB:.2f} GB" in out
    assert f"about {seconds:.3g} s each way at 50 GB/s per direction" in out
    row = out.split("state copied per step, 1 way")[1].split()  # torch's 2 columns, then ours
    assert row[2] == f"{result.copied_bytes / GB:.2f}"
    with pytest.raises(SystemExit):
        main([*common, "--resident", "half"])
    assert "not a resident share or size: 'half'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*common, "--resident", "2.5"])
    assert "resident 2.5 is neither a share (at most 1.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*common, "--resident", "1e3"])  # as "1000": 1000 bytes
    assert "resident 1e3 would be 1000 byte(s)" in capsys.readouterr().err


def test_a_lazy_module_is_planned_once_a_forward_pass_has_given_its_shapes():
    """Unmaterialized lazy parameters have no shape: a clear error naming them and the way out
    (torch's own error spoke of load_state_dict); after a forward pass on the meta device the
    plan counts them."""
    with torch.device("meta"):
        model = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"lazy modules .*\(0\.weight, 0\.bias\); run a forward"):
        plan(model)
    model(torch.empty(2, 3, device="meta"))
    assert plan(model).state_bytes == 8 * (3 * 4 + 4 + 4 * 4 + 4)
