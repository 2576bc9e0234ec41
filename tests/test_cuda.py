"""GPU checks (marker ``cuda``; skipped without CUDA). Run with ``benchmarks/gpu_checks.sh``."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import assert_same, clone_params, make_params, set_grads, step_together

from lightning_offload_optim import OffloadAdamW

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
SHAPES = [(4096, 1024), (1024,), (3, 1000, 333), (17,)]  # ~8M parameters
CHUNK = 1 << 20


@pytest.mark.parametrize("amsgrad", [False, True])
def test_bit_identical_to_torch_fused_on_cuda(amsgrad):
    params = make_params(SHAPES, device=CUDA)
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, weight_decay=0.1, amsgrad=amsgrad, chunk_size=CHUNK)
    torch_opt = torch.optim.AdamW(reference, lr=0.01, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    step_together([offload, torch_opt], [params, reference], torch.Generator().manual_seed(0), 3)
    assert_same(params, reference)
    for p, r in zip(params, reference, strict=True):
        assert_same([offload.offloaded_state(p)["exp_avg_sq"]], [torch_opt.state[r]["exp_avg_sq"]])


def test_bf16_parameters_match_fp32_master_reference_on_cuda():
    params = make_params(SHAPES, dtype=torch.bfloat16, device=CUDA)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    offload = OffloadAdamW(params, lr=0.01, chunk_size=CHUNK)
    fp32 = torch.optim.AdamW(masters, lr=0.01, fused=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        set_grads([params], generator)
        for p, m in zip(params, masters, strict=True):
            m.grad = p.grad.float()
        offload.step()
        fp32.step()
    assert_same(params, [m.detach().to(torch.bfloat16) for m in masters])


def test_host_buffers_are_pinned_and_not_rounded_up():
    params = make_params(SHAPES, device=CUDA)
    opt = OffloadAdamW(params, chunk_size=CHUNK)
    set_grads([params], torch.Generator().manual_seed(2))
    opt.step()
    stats = opt.memory_stats()
    assert stats["pinned"]
    assert all(b.is_pinned() for a in opt._host.arenas for b in a.buffers.values())
    assert stats["host_bytes"] / stats["state_bytes"] <= 1.02


def _device_tensors_in_state(opt) -> list[str]:
    return [
        f"{k} on {v.device}"
        for s in opt.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and v.device.type == "cuda"
    ]


def test_no_state_on_device_after_step_and_load_and_lightning_move():
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    params = make_params(SHAPES, device=CUDA)
    opt = OffloadAdamW(params, chunk_size=CHUNK)
    set_grads([params], torch.Generator().manual_seed(3))
    opt.step()
    assert _device_tensors_in_state(opt) == []
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True, map_location="cpu")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    resumed = OffloadAdamW(params, chunk_size=CHUNK)
    resumed.load_state_dict(checkpoint)
    _optimizer_to_device(resumed, CUDA)  # what Lightning does after restoring a checkpoint
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert _device_tensors_in_state(resumed) == []


def test_peak_device_memory_is_params_grads_staging_and_slack():
    params = make_params([(8192, 4096)] * 4, device=CUDA)  # 128M params: 512 MiB state moved
    opt = OffloadAdamW(params, chunk_size=CHUNK)
    set_grads([params], torch.Generator().manual_seed(4))
    opt.step()  # first step allocates staging
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()  # params + grads + staging
    param_bytes = sum(p.numel() * 4 for p in params)
    staging = 2 * 2 * CHUNK * 4
    assert baseline <= 2 * param_bytes + staging + (1 << 20)
    opt.step()
    torch.cuda.synchronize()
    slack = 4 << 20  # step counts on the device and allocator rounding
    assert torch.cuda.max_memory_allocated() <= baseline + slack


def test_parameter_moved_to_another_device_is_refused():
    params = make_params(device=CUDA)
    opt = OffloadAdamW(params)
    set_grads([params], torch.Generator().manual_seed(5))
    opt.step()
    params[0].data = params[0].data.cpu()
    params[0].grad = torch.randn_like(params[0])
    with pytest.raises(RuntimeError, match="device cpu"):
        opt.step()


def test_copies_overlap_the_update():
    """The profiler shows host<->device copies running while the AdamW kernel runs."""
    params = make_params([(8192, 4096)] * 4, device=CUDA)
    opt = OffloadAdamW(params, chunk_size=CHUNK)
    set_grads([params], torch.Generator().manual_seed(6))
    opt.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        opt.step()
        torch.cuda.synchronize()
    kernels, copies = [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        if "adam" in event.name.lower():
            kernels.append(span)
        elif "memcpy" in event.name.lower():
            copies.append(span)
    assert kernels and copies, [e.name for e in prof.events()][:20]
    overlapping = sum(1 for c in copies if any(k[0] < c[1] and c[0] < k[1] for k in kernels))
    assert overlapping > 0, "no copy overlapped an AdamW kernel"


def test_lightning_resume_keeps_state_off_the_device(tmp_path):
    """Lightning copies optimizer.state to the GPU after a restore; only step counts are there."""
    from lightning_models import TinyModel, trainer

    class Wide(TinyModel):
        def __init__(self) -> None:
            super().__init__()
            self.big = torch.nn.Linear(8192, 8192)  # 64M params: 512 MiB of AdamW state

        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) + self.big.weight.sum() * 0

    def fit(ckpt_path=None, steps=2):
        fitted, model = trainer(tmp_path, accelerator="gpu", max_steps=steps), Wide()
        fitted.fit(model, ckpt_path=ckpt_path)
        return fitted, model

    first, model = fit()
    first.save_checkpoint(tmp_path / "wide.ckpt")
    model_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # + grads
    del first, model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    resumed, _ = fit(tmp_path / "wide.ckpt", steps=4)
    state_bytes = resumed.optimizers[0].memory_stats()["state_bytes"]
    staging = 2 * 2 * 4 * (1 << 22)
    peak = torch.cuda.max_memory_allocated()
    assert peak <= model_bytes + staging + (64 << 20), (peak, model_bytes, state_bytes)
    assert _device_tensors_in_state(resumed.optimizers[0]) == []


def test_step_and_monitor_do_not_synchronise_on_steps_that_are_not_logged(tmp_path, monkeypatch):
    """torch's sync debug mode turns any device synchronisation in them into an error."""
    from lightning_models import ManualModel, trainer  # ManualModel: a no-op step closure

    from lightning_offload_optim import OffloadMonitor

    def strict(method):
        def run(self, *args, **kwargs):
            first_step = isinstance(self, OffloadAdamW) and not self.state
            torch.cuda.set_sync_debug_mode(0 if first_step else "error")  # first: allocation
            try:
                return method(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        return run

    monitor = OffloadMonitor(summary=False)
    monkeypatch.setattr(OffloadAdamW, "step", strict(OffloadAdamW.step))
    monkeypatch.setattr(
        OffloadMonitor, "on_train_batch_end", strict(OffloadMonitor.on_train_batch_end)
    )
    fitted = trainer(
        tmp_path, accelerator="gpu", max_steps=5, log_every_n_steps=50, callbacks=[monitor]
    )
    fitted.fit(ManualModel())
    assert monitor.totals["steps"] == 5  # all read by the end of fit


def test_many_tiny_arenas_next_to_large_ones_are_all_pinned():
    """Small host buffers share heap pages; registering a page twice fails. A bf16 model with a
    few fp32 parameters, amsgrad on one group, complex parameters: many small arenas, each
    registered on pages of its own, and training matches the references."""
    bf16 = make_params([(4096, 1024), (17,), (3,)], dtype=torch.bfloat16, device=CUDA)
    fp32 = make_params([(5,), (1,), (2048, 512)], device=CUDA, seed=1)
    complex_params = make_params([(3,), (2, 2)], dtype=torch.complex64, device=CUDA, seed=2)
    groups = [
        {"params": bf16},
        {"params": fp32, "amsgrad": True},
        {"params": complex_params},
    ]
    opt = OffloadAdamW(groups, chunk_size=CHUNK)
    reference = clone_params(fp32)
    torch_opt = torch.optim.AdamW(reference, amsgrad=True, fused=True)
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        set_grads([bf16 + fp32 + complex_params], generator)
        for r, p in zip(reference, fp32, strict=True):
            r.grad = p.grad.clone()
        opt.step()
        torch_opt.step()
    assert_same(fp32, reference)
    stats = opt.memory_stats()
    assert stats["pinned"] and len(opt._host.arenas) >= 3
    assert all(b.is_pinned() for a in opt._host.arenas for b in a.buffers.values())
    page_slack = 2 * 4096 * sum(len(a.buffers) for a in opt._host.arenas)
    assert stats["host_bytes"] <= stats["state_bytes"] + page_slack
    del opt  # unregistering waits for in-flight copies and must not fail
    torch.cuda.synchronize()


def test_refused_pinning_falls_back_and_the_next_kernels_run(monkeypatch):
    """A failed cudaHostRegister stays behind as CUDA's "last error", which torch's next kernel
    launch check would raise as its own error. Provoke a real failure (registering a range
    twice): the optimizer must warn once, keep the state pageable and train exactly."""
    from lightning_offload_optim import host_state

    real_register = host_state._cuda_host_register

    def refused(pointer: int, nbytes: int, device: torch.device) -> int:
        assert real_register(pointer, nbytes, device) == 0
        error = real_register(pointer, nbytes, device)  # already registered: a real error
        host_state._cuda_host_unregister(pointer)
        return error

    monkeypatch.setattr(host_state, "_cuda_host_register", refused)
    params = make_params(SHAPES, device=CUDA)
    reference = clone_params(params)
    with pytest.warns(UserWarning, match="could not pin host memory"):
        offload = OffloadAdamW(params, lr=0.01, chunk_size=CHUNK)
        torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=True)
        step_together([offload, torch_opt], [params, reference], torch.Generator(), 3)
    assert offload.memory_stats()["pinned"] is False
    assert_same(params, reference)


def test_fsdp2_on_one_gpu_matches_torch_and_resumes_through_dcp(tmp_path):
    """FSDP2 on a 1-rank CUDA mesh: steps bit-identical to torch fused AdamW on the same
    DTensors, state in pinned host memory as DTensors, and a torch.distributed.checkpoint save
    and in-place load that resumes bit-identically."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"file://{tmp_path}/rdv")
    try:
        mesh = init_device_mesh("cuda", (1,))

        def model() -> torch.nn.Module:
            torch.manual_seed(0)
            net = torch.nn.Sequential(
                torch.nn.Linear(64, 1000), torch.nn.LayerNorm(1000), torch.nn.Linear(1000, 3)
            )
            for layer in (net[0], net[2]):
                fully_shard(layer, mesh=mesh)
            return fully_shard(net, mesh=mesh)

        def train(net, optimizer, steps: range) -> None:
            for step in steps:
                generator = torch.Generator().manual_seed(step)
                x = torch.randn(16, 64, generator=generator).to(CUDA)
                net(x).pow(2).mean().backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
                optimizer.step()
                optimizer.zero_grad()

        ours, theirs = model(), model()
        offload = OffloadAdamW(ours.parameters(), lr=0.01, weight_decay=0.1, chunk_size=1 << 16)
        reference = torch.optim.AdamW(theirs.parameters(), lr=0.01, weight_decay=0.1, fused=True)
        train(ours, offload, range(3))
        train(theirs, reference, range(3))
        assert_same(
            [p.full_tensor() for p in ours.parameters()],
            [p.full_tensor() for p in theirs.parameters()],
        )
        saved = get_optimizer_state_dict(ours, offload)
        moments = [v for entry in saved["state"].values() for k, v in entry.items() if k != "step"]
        assert all(isinstance(v, DTensor) and v.to_local().is_pinned() for v in moments)
        assert offload.memory_stats()["pinned"]
        dcp.save(
            {"model": get_model_state_dict(ours), "optim": saved}, checkpoint_id=tmp_path / "ckpt"
        )

        resumed = model()
        fresh = OffloadAdamW(resumed.parameters(), lr=0.01, weight_decay=0.1, chunk_size=1 << 16)
        state = {
            "model": get_model_state_dict(resumed),
            "optim": get_optimizer_state_dict(resumed, fresh),
        }
        dcp.load(state, checkpoint_id=tmp_path / "ckpt")
        set_model_state_dict(resumed, state["model"])
        set_optimizer_state_dict(resumed, fresh, state["optim"])
        train(resumed, fresh, range(3, 5))
        train(theirs, reference, range(3, 5))
        assert_same(
            [p.full_tensor() for p in resumed.parameters()],
            [p.full_tensor() for p in theirs.parameters()],
        )
    finally:
        dist.destroy_process_group()
