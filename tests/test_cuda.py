"""GPU checks (marker ``cuda``; skipped without CUDA). Run with ``benchmarks/gpu_checks.sh``."""

from __future__ import annotations

import copy
import gc
import io
import warnings

import pytest
import torch
from conftest import (
    MasterCopyAdamW,
    TiedNet,
    assert_same,
    clamp_alike,
    clone_params,
    exact_reference,
    forked_child_memory_map,
    make_params,
    sequence_parallel,
    set_grads,
    step_in_backward,
    step_together,
)
from torch import nn

from lightning_offload_optim import OffloadAdamW, StagingPool
from lightning_offload_optim.host_state import PAGE_SIZE

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


@pytest.mark.parametrize("reload", [False, True], ids=["steps", "own-state-reloaded"])
def test_bf16_parameters_match_fp32_master_reference_on_cuda(reload):
    """``reload``: the optimizer's own ``state_dict()`` loaded back in place after a step (as a
    distributed checkpoint's resume does): its master copies, on the host, are compared with
    the parameters on the GPU, and kept."""
    params = make_params(SHAPES, dtype=torch.bfloat16, device=CUDA)
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, chunk_size=CHUNK)
    fp32 = MasterCopyAdamW([{"params": reference}], lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        set_grads([params, reference], generator)
        offload.step()
        fp32.step()
        if reload and step == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no master copy taken for stale
                offload.load_state_dict(offload.state_dict())
    assert_same(params, reference)


def test_steps_on_a_users_stream_with_all_state_resident_match_torch_on_cuda():
    """The updates run on the user's stream; ``state_dict()`` writes the resident state back on
    a copy stream, which must come after them with no wait for that stream by the user."""
    params = make_params(SHAPES, device=CUDA)
    reference = clone_params(params)
    offload = OffloadAdamW(params, lr=0.01, chunk_size=CHUNK, resident=1.0)
    torch_opt = torch.optim.AdamW(reference, lr=0.01, fused=True)
    generator = torch.Generator().manual_seed(2)
    users = torch.cuda.Stream()
    for _ in range(3):
        set_grads([params, reference], generator)
        users.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(users):
            offload.step()
        torch_opt.step()
        # The test's own reads and frees (the next gradients) come after the updates read them.
        torch.cuda.current_stream().wait_stream(users)
    saved = offload.state_dict()["state"]
    for index, r in enumerate(reference):
        assert_same([saved[index]["exp_avg_sq"]], [torch_opt.state[r]["exp_avg_sq"]])
    assert_same(params, reference)


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
    gc.collect()  # what earlier tests left in reference cycles is not freed in the middle
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    resumed = OffloadAdamW(params, chunk_size=CHUNK)
    resumed.load_state_dict(checkpoint)
    _optimizer_to_device(resumed, CUDA)  # what Lightning does after restoring a checkpoint
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert _device_tensors_in_state(resumed) == []


def test_peak_device_memory_is_params_grads_staging_and_slack():
    # What earlier tests left (a failed one's traceback holds its tensors), and cached blocks
    # that a staging buffer would take whole (the allocator splits off no remainder of 1 MiB
    # or less), are not counted.
    gc.collect()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    params = make_params([(8192, 4096)] * 4, device=CUDA)  # 128M params: 512 MiB state moved
    opt = OffloadAdamW(params, chunk_size=CHUNK)
    set_grads([params], torch.Generator().manual_seed(4))
    opt.step()  # first step allocates staging
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()  # params + grads + staging
    param_bytes = sum(p.numel() * 4 for p in params)
    staging = 2 * 2 * CHUNK * 4
    assert baseline - start <= 2 * param_bytes + staging + (1 << 20)
    opt.step()
    torch.cuda.synchronize()
    slack = 4 << 20  # step counts on the device and allocator rounding
    assert torch.cuda.max_memory_allocated() <= baseline + slack


def test_a_tensor_lr_on_the_gpu_steps_parameters_on_the_host():
    """CPU parameters are updated in place on the host; an lr tensor kept on the GPU is copied
    to the host first and waited for: a non-blocking copy (torch's fused AdamW makes one)
    would hand the host kernel a buffer that the GPU, kept busy here, has not written yet."""
    params = make_params()
    reference = clone_params(params)
    ours = OffloadAdamW(params, lr=torch.tensor(0.01, device=CUDA))
    theirs = torch.optim.AdamW(reference, lr=torch.tensor(0.01), fused=True)
    generator = torch.Generator().manual_seed(8)
    for _ in range(3):
        torch.cuda._sleep(100_000_000)  # a copy of lr queued now would wait behind this
        step_together([ours, theirs], [params, reference], generator, 1)
    assert_same(params, reference)


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
    """The profiler shows host<->device copies running while the AdamW kernel runs. Chunks of
    4 Mi elements take about 0.6 ms per copy at 50 GB/s, well above the host's time to queue
    one (at 1 Mi the two are close, and a pipeline the host cannot keep ahead of would show
    no overlap however right its ordering)."""
    params = make_params([(8192, 4096)] * 4, device=CUDA)
    opt = OffloadAdamW(params, chunk_size=1 << 22)
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
    """Lightning copies optimizer.state to the GPU after a restore; only step counts are there,
    and the resumed fit's device memory grows by parameters, gradients and staging only."""
    import gc

    from lightning.pytorch.callbacks import Callback
    from lightning_models import TinyModel, trainer

    class Wide(TinyModel):
        def __init__(self) -> None:
            super().__init__()
            self.big = torch.nn.Linear(8192, 8192)  # 64M params: 512 MiB of AdamW state

        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) + self.big.weight.sum() * 0

    class StateOnDevice(Callback):
        """Read during the fit: at its end Lightning moves all optimizer state to the CPU."""

        def __init__(self) -> None:
            self.found: list[str] = []

        def on_train_batch_end(self, trainer, *args) -> None:
            self.found += _device_tensors_in_state(trainer.optimizers[0])

    def fit(ckpt_path=None, steps=2, callbacks=()):
        fitted = trainer(tmp_path, accelerator="gpu", max_steps=steps, callbacks=list(callbacks))
        model = Wide()
        fitted.fit(model, ckpt_path=ckpt_path)
        return fitted, model

    first, model = fit()
    first.save_checkpoint(tmp_path / "wide.ckpt")
    model_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # + grads
    del first, model
    gc.collect()  # the Trainer sits in reference cycles that hold the first run's optimizer
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # what stays allocated: cuBLAS workspaces
    on_device = StateOnDevice()
    resumed, _ = fit(tmp_path / "wide.ckpt", steps=4, callbacks=[on_device])
    state_bytes = resumed.optimizers[0].memory_stats()["state_bytes"]
    staging = 2 * 2 * 4 * (1 << 22)
    grown = torch.cuda.max_memory_allocated() - base
    assert grown <= model_bytes + staging + (16 << 20), (grown, model_bytes, state_bytes)
    assert on_device.found == []


@pytest.mark.parametrize(
    ("hparams", "unchecked_steps"),
    [({}, 1), ({"overlap_step": True, "offload_resident": 0.9, "force_staging": True}, 2)],
    ids=["plain", "overlap-resident"],
)
def test_step_and_monitor_do_not_synchronise_on_steps_that_are_not_logged(
    tmp_path, monkeypatch, hparams, unchecked_steps
):
    """torch's sync debug mode turns any stream or device synchronisation in them into an
    error, and so does waiting for an event (which that mode does not see). Not checked: the
    first step (allocation) and, with a resident share, the second (the share is chosen once
    the host buffers exist, after waiting for them)."""
    from lightning_models import ManualModel, trainer  # ManualModel: a no-op step closure

    from lightning_offload_optim import OffloadMonitor

    steps, checking = [], []
    event_synchronize = torch.cuda.Event.synchronize

    def refused_when_checking(event) -> None:
        assert not checking, "a step or the monitor waited for a CUDA event"
        event_synchronize(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", refused_when_checking)

    def strict(method):
        def run(self, *args, **kwargs):
            if isinstance(self, OffloadAdamW):
                steps.append(1)
            checked = not isinstance(self, OffloadAdamW) or len(steps) > unchecked_steps
            torch.cuda.set_sync_debug_mode("error" if checked else 0)
            checking.extend([True] if checked else [])
            try:
                return method(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                checking.clear()

        return run

    monitor = OffloadMonitor(summary=False)
    monkeypatch.setattr(OffloadAdamW, "step", strict(OffloadAdamW.step))
    monkeypatch.setattr(
        OffloadMonitor, "on_train_batch_end", strict(OffloadMonitor.on_train_batch_end)
    )
    fitted = trainer(
        tmp_path, accelerator="gpu", max_steps=5, log_every_n_steps=50, callbacks=[monitor]
    )
    # Optimizers of earlier tests, freed by the collector during a checked step, would wait
    # for their arenas' events there.
    gc.collect()
    fitted.fit(ManualModel(**hparams))
    assert monitor.totals["steps"] == 5  # all read by the end of fit


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_overlap_and_resident_match_torch_on_gpu(tmp_path, precision):
    """The mixin's overlap_step and offload_resident on a GPU, with clipping: bit-identical to
    torch's fused AdamW under the same Trainer."""
    from lightning_models import AtTrainEnd, TinyModel, trainer

    offload = TinyModel(overlap_step=True, offload_resident=0.9, force_staging=True)
    reference = TinyModel("torch")
    end = AtTrainEnd()
    for model in (offload, reference):
        settings = {"precision": precision, "gradient_clip_val": 0.05, "callbacks": [end]}
        trainer(tmp_path, accelerator="gpu", **settings).fit(model)
        if model is offload:
            assert end.stats["resident_bytes"] > 0 and end.overlap is not None
            # The mixin freed the device buffers and its cached views of the parameters, so
            # the GPU memory the parameters had before Lightning moved them to the CPU is free.
            stats = offload.trainer.optimizers[0].memory_stats()
            assert stats["resident_bytes"] == stats["staging_bytes"] == 0
            assert all(storage.expired() for storage in end.storages)
    assert_same(list(offload.parameters()), list(reference.parameters()))


def test_many_tiny_arenas_next_to_large_ones_are_all_pinned(monkeypatch):
    """Small host buffers share heap pages; registering a page twice fails. A bf16 model with a
    few fp32 parameters, amsgrad on one group, complex parameters: many small arenas, each
    registered on pages of its own, training matches the references, and every registered
    piece is unregistered without an error when the optimizer goes."""
    from lightning_offload_optim import host_state

    real_unregister, unregister_errors = host_state._cuda_host_unregister, []
    monkeypatch.setattr(
        host_state,
        "_cuda_host_unregister",
        lambda pointer: unregister_errors.append(real_unregister(pointer)),
    )
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
    page_slack = 2 * PAGE_SIZE * sum(len(a.buffers) for a in opt._host.arenas)
    assert stats["host_bytes"] <= stats["state_bytes"] + page_slack
    registered = len(unregister_errors)
    del opt  # unregistering waits for in-flight copies and must not fail
    gc.collect()
    torch.cuda.synchronize()
    assert len(unregister_errors) > registered and not any(unregister_errors[registered:])


def test_pinned_state_stays_out_of_forked_processes_and_keeps_training():
    """``MADV_DONTFORK`` on the registered pages: a forked child (a DataLoader worker) maps
    none of them, and the parent's pinned buffers keep working with the driver afterwards."""
    params = make_params(SHAPES, device=CUDA)
    reference = clone_params(params)
    opt = OffloadAdamW(params, chunk_size=CHUNK)
    torch_opt = torch.optim.AdamW(reference, fused=True)
    generator = torch.Generator().manual_seed(3)
    step_together([opt, torch_opt], [params, reference], generator, 1)
    buffers = [b for a in opt._host.arenas for b in a.buffers.values()]
    assert buffers and all(b.is_pinned() for b in buffers)
    mapped = forked_child_memory_map()
    for buffer in buffers:
        start = buffer.data_ptr()
        assert not any(low <= start < high for low, high in mapped)
    step_together([opt, torch_opt], [params, reference], generator, 2)
    assert_same(params, reference)


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


# Overlapping the step with the next forward (``overlap_with``) and resident state on real
# streams: the CPU suite checks every ordering on simulated streams; these check that the CUDA
# caching allocator, events and streams behave as those simulations assume, and that the
# overlap actually happens.


class Stack(nn.Module):
    """~54M fp32 parameters (430 MB of state, 52 chunks of 1 Mi elements): the updates are
    still running when the next forward pass starts. A weight tied between two layers and a
    layer called twice; only ops with deterministic CUDA kernels, so two copies train alike."""

    def __init__(self, width: int = 1024, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.twice = nn.Linear(width, width)
        self.out = nn.Linear(width, width, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        x = self.twice(torch.tanh(self.twice(x)))
        return self.out(x).pow(2).mean()


def train_stack(model: nn.Module, optimizer, steps: int, rows: int = 2048) -> list:
    """Forward, backward, clip, step, zero_grad; right after ``zero_grad`` the freed gradients'
    memory is filled with NaN if the caching allocator hands it out again (same sizes, same
    stream) while a queued update still reads it. Returns those tensors (keep them alive)."""
    generator = torch.Generator(device=CUDA).manual_seed(0)
    poison = []
    for _ in range(steps):
        x = torch.randn(rows, 1024, device=CUDA, generator=generator).to(model.inp.weight.dtype)
        model(x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        poison.append([torch.full_like(p, float("nan")) for p in model.parameters()])
    return poison


def overlapped_stack(
    overlap: bool, resident, dtype=torch.float32, chunk_size: int = CHUNK
) -> tuple[Stack, OffloadAdamW]:
    model = Stack().to(CUDA, dtype)
    optimizer = OffloadAdamW(
        model.parameters(), lr=1e-3, weight_decay=0.1, chunk_size=chunk_size, resident=resident
    )
    if overlap:
        optimizer.overlap_with(model)
    return model, optimizer


@pytest.mark.parametrize(
    ("overlap", "resident"),
    [(True, None), (False, 0.5), (True, 0.5), (True, "auto")],
    ids=["overlap", "resident-half", "overlap-resident-half", "overlap-resident-auto"],
)
def test_overlap_and_resident_match_torch_fused_on_cuda(overlap, resident):
    model, optimizer = overlapped_stack(overlap, resident)
    reference = Stack().to(CUDA)  # built alike: a deep copy would copy the overlap's hooks
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    train_stack(model, optimizer, 4)
    train_stack(reference, torch_opt, 4)
    # No explicit wait: state_dict() waits for the queued updates and writes resident state back.
    ours, theirs = optimizer.state_dict()["state"], torch_opt.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert_same([ours[i][key] for i in sorted(ours)], [theirs[i][key] for i in sorted(ours)])
    assert_same(list(model.state_dict().values()), list(reference.state_dict().values()))
    stats = optimizer.memory_stats()
    if resident == 0.5:
        assert 0 < stats["resident_bytes"] <= stats["state_bytes"] / 2
    elif resident == "auto":  # 430 MB of state fits next to any free memory we run with
        assert stats["resident_bytes"] == stats["state_bytes"]


def test_bf16_overlap_and_resident_match_the_plain_step_on_cuda():
    """bf16 parameters with fp32 masters, overlapped and half resident, against the plain step
    (itself checked against fp32 torch AdamW above)."""
    model, optimizer = overlapped_stack(True, 0.5, torch.bfloat16)
    plain, plain_opt = overlapped_stack(False, None, torch.bfloat16)
    train_stack(model, optimizer, 4)
    train_stack(plain, plain_opt, 4)
    assert_same(list(model.state_dict().values()), list(plain.state_dict().values()))
    ours, theirs = optimizer.state_dict()["state"], plain_opt.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        assert_same([ours[i][key] for i in sorted(ours)], [theirs[i][key] for i in sorted(ours)])


@pytest.mark.parametrize("overlap", [False, True])
def test_fp16_model_under_grad_scaler_matches_fp32_masters_on_cuda(overlap):
    """GradScaler leaves fp16 gradients' scale (not a power of two here) to step(), which
    divides them in the kernel as torch's fused AdamW does and skips the step whose gradients
    are inf; overlapped, the scale (freed when step() returns, then its memory filled with NaN
    if handed out again) is kept for the queued updates. Against fused AdamW on fp32 masters
    given the same scale."""
    model, optimizer = overlapped_stack(overlap, None, torch.float16)
    reference = Stack().to(CUDA, torch.float16)
    masters = MasterCopyAdamW(list(reference.parameters()), lr=1e-3, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=1000.0, growth_interval=1000)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    poison = []
    for step in range(4):
        x = torch.randn(256, 1024, device=CUDA, generator=generator).half()
        if step == 2:
            x[0, 0] = float("inf")
        scale = torch.full((), scaler.get_scale(), device=CUDA)
        scaler.scale(model(x)).backward()
        scaler.step(optimizer)
        poison.append([torch.full((), float("nan"), device=CUDA) for _ in range(8)])
        scaler.update()
        optimizer.zero_grad()
        if step != 2:
            (reference(x) * scale).backward()
            masters.fp32.grad_scale = scale
            masters.step()
            masters.zero_grad()
    assert scaler.get_scale() == 500.0
    optimizer.wait_for_updates()
    assert_same(list(model.parameters()), list(reference.parameters()))
    assert [float(s["step"]) for s in optimizer.state.values()] == [3.0] * len(optimizer.state)


def test_bf16_weights_clamped_between_overlapped_steps_keep_the_clamp_on_cuda():
    """bf16 weights clamped after ``wait_for_updates()`` between overlapped, half-resident
    steps: the masters take the clamp on the device, in order, as fp32 AdamW on masters
    clamped alike (no report of a racing write either: pytest makes it an error)."""
    model, optimizer = overlapped_stack(True, 0.5, torch.bfloat16)
    reference = Stack().to(CUDA, torch.bfloat16)
    masters = MasterCopyAdamW(list(reference.parameters()), lr=1e-3, weight_decay=0.1)
    for _ in range(3):
        train_stack(model, optimizer, 1)
        train_stack(reference, masters, 1)
        clamp_alike(optimizer, model, reference, masters)
    train_stack(model, optimizer, 1)
    train_stack(reference, masters, 1)
    assert_same(list(model.state_dict().values()), list(reference.state_dict().values()))
    ours = optimizer.state_dict()["state"]
    expected = [masters.masters[r] for r in reference.parameters()]
    assert_same([ours[i]["master_param"] for i in sorted(ours)], expected)
    assert optimizer.memory_stats()["resident_bytes"] > 0


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_fabric_overlapped_saves_right_after_a_step_and_resumes_like_torch_on_cuda(
    tmp_path, precision
):
    """Lightning Fabric on one GPU: the overlap set through Fabric's optimizer and module, half
    the state resident, ``fabric.save`` right after a step (the weights it writes are read after
    the queued updates) and ``fabric.load`` into a new model and optimizer (the state stays on
    the host); every step as torch's fused AdamW (bf16: on fp32 masters) on the same model."""
    import lightning as L
    from test_wrappers import train_save_and_resume

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    generator = torch.Generator(device=CUDA).manual_seed(0)
    batches = [torch.randn(2048, 1024, device=CUDA, generator=generator) for _ in range(4)]

    def setup() -> tuple[L.Fabric, nn.Module, OffloadAdamW]:
        fabric = L.Fabric(accelerator="cuda", devices=1, precision=precision)
        stack = Stack()
        optimizer = OffloadAdamW(
            stack.parameters(), lr=1e-3, weight_decay=0.1, chunk_size=CHUNK, resident=0.5
        )
        model, optimizer = fabric.setup(stack, optimizer)
        optimizer.overlap_with(model)
        return fabric, model, optimizer

    checkpoint = tmp_path / "fabric.ckpt"
    model, optimizer = train_save_and_resume(setup, lambda loss: loss, batches, 2, checkpoint, 1.0)
    saved = list(torch.load(checkpoint, weights_only=True)["model"].values())
    reference = Stack().to(CUDA, dtype)
    reference_opt = exact_reference(list(reference.parameters()), lr=1e-3, weight_decay=0.1)
    for i, x in enumerate(batches):
        reference(x.to(dtype)).float().backward()  # as Fabric casts the input and the loss
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        reference_opt.step()
        reference_opt.zero_grad()
        if i == 1:
            assert_same(saved, list(reference.state_dict().values()))
    assert_same(list(model.state_dict().values()), list(reference.state_dict().values()))
    assert optimizer.memory_stats()["resident_bytes"] > 0


def test_compiled_model_with_overlap_and_resident_half_matches_torch_fused_on_cuda():
    """``torch.compile``'d, the overlapped model steps as torch's AdamW on the same compiled
    model. On real streams dynamo can trace stream and event calls, which it must not do with
    the overlap's hooks (they run as Python: see ``tests/test_compile.py``). ``aot_eager``:
    dynamo is what meets the hooks; inductor never sees them."""
    torch._dynamo.reset()
    model, optimizer = overlapped_stack(True, 0.5)
    reference = Stack().to(CUDA)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    train_stack(torch.compile(model, backend="aot_eager"), optimizer, 4)
    train_stack(torch.compile(reference, backend="aot_eager"), torch_opt, 4)
    assert_same(list(model.state_dict().values()), list(reference.state_dict().values()))
    ours, theirs = optimizer.state_dict()["state"], torch_opt.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert_same([ours[i][key] for i in sorted(ours)], [theirs[i][key] for i in sorted(ours)])
    torch._dynamo.reset()


def _pipeline_streams(optimizer: OffloadAdamW):
    (streams,) = optimizer._pipeline.pool.streams.values()
    return streams


def _timed_event(stream=None) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def test_the_first_layers_compute_while_later_layers_still_update():
    """The point of overlap_with: the next forward's first layer finishes before the step's
    last update does (on the device, measured with events). Chunks of 16 MiB per key: the
    device spends longer on each than the host takes to queue it."""
    model, optimizer = overlapped_stack(True, None, chunk_size=1 << 22)
    train_stack(model, optimizer, 2)  # the first forward records the order; then chunks follow it
    first_layer = []
    model.layers[0].register_forward_hook(lambda *_: first_layer.append(_timed_event()))
    x = torch.randn(2048, 1024, device=CUDA)
    model(x).backward()
    optimizer.step()
    updates_done = _timed_event(_pipeline_streams(optimizer).update)
    model(x)
    torch.cuda.synchronize()
    ahead_ms = first_layer[-1].elapsed_time(updates_done)
    assert ahead_ms > 0, f"the first layer finished {-ahead_ms:.3f} ms after the last update"


def test_the_next_steps_first_copies_run_during_the_backward_pass():
    """After each forward pass the next step's first chunks are copied in (they do not depend
    on the gradients): queued, and done before the backward pass ends."""
    model, optimizer = overlapped_stack(True, None, chunk_size=1 << 22)
    train_stack(model, optimizer, 2)
    loss = model(torch.randn(8192, 1024, device=CUDA))
    assert optimizer._pipeline._prefetched, "no copy was queued after the forward pass"
    copies_done = _timed_event(_pipeline_streams(optimizer).copy_in)
    loss.backward()
    backward_done = _timed_event()
    torch.cuda.synchronize()
    assert copies_done.elapsed_time(backward_done) > 0
    optimizer.step()  # uses those copies
    optimizer.wait_for_updates()
    assert not torch.isnan(next(model.parameters())).any()


def test_a_steps_copy_in_runs_while_the_backward_still_computes():
    """A step not overlapped queues its copy-in with no wait for the backward still queued on
    the caller's stream (only a step that allocated buffers waits): the trainable first
    layer's state (one chunk) is on the device before the frozen layers' backward ends."""
    trainable = nn.Linear(4096, 4096, bias=False)
    frozen = [nn.Linear(4096, 4096).requires_grad_(False) for _ in range(6)]
    model = nn.Sequential(trainable, *frozen).to(CUDA)
    optimizer = OffloadAdamW(trainable.parameters(), chunk_size=1 << 24)
    x = torch.randn(8192, 4096, device=CUDA)
    for _ in range(2):  # the first step allocates the staging
        model(x).square().mean().backward()
        optimizer.step()
    model(x).square().mean().backward()
    backward_done = _timed_event()
    optimizer.step()
    copies_done = _timed_event(_pipeline_streams(optimizer).copy_in)
    torch.cuda.synchronize()
    assert copies_done.elapsed_time(backward_done) > 0, "the copy-in waited for the backward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_optimizers_of_one_pool_stepped_in_backward_match_torch_on_cuda(dtype):
    """One OffloadAdamW per parameter, stepped in backward through one StagingPool: exact
    against torch stepped the same way, the pool's two sets of the largest chunk the only
    staging."""
    ours, theirs = TiedNet(dtype).to(CUDA), TiedNet(dtype).to(CUDA)
    pool = StagingPool()
    offload = step_in_backward(
        ours, lambda p: OffloadAdamW([p], lr=0.01, chunk_size=256, staging_pool=pool)
    )
    if dtype == torch.float32:
        step_in_backward(theirs, lambda p: torch.optim.AdamW([p], lr=0.01, fused=True))
    else:
        step_in_backward(theirs, lambda p: MasterCopyAdamW([{"params": [p]}], lr=0.01))
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        tokens = torch.randint(50, (4, 6), generator=generator).to(CUDA)
        ours(tokens).backward()
        theirs(tokens).backward()
    assert_same(list(ours.parameters()), list(theirs.parameters()))
    keys = 2 if dtype == torch.float32 else 4  # the moments; the master copy, the scratch
    assert pool.staging_bytes == 2 * 256 * 4 * keys
    assert all(o.memory_stats()["staging_bytes"] == pool.staging_bytes for o in offload.values())


def test_ddp_bucket_views_with_a_head_skipped_on_odd_steps_match_torch_on_cuda(tmp_path):
    """DistributedDataParallel(gradient_as_bucket_view=True) keeps gradients in persistent
    buckets: the next backward zeroes and all-reduces the slot of a head the forward skipped,
    while the overlapped update of the step before may still read it. 1-rank NCCL, overlapped
    against torch fused AdamW under the same DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    class WithAuxiliaryHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack = Stack()
            self.aux = nn.Linear(1024, 4096)  # last in forward order: its chunks come last

        def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
            loss = self.stack(x)
            return loss + self.aux(x).pow(2).mean() if use_aux else loss

    def train(model: nn.Module, optimizer) -> None:
        wrapped = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=True)
        generator = torch.Generator(device=CUDA).manual_seed(0)
        for step in range(4):
            x = torch.randn(2048, 1024, device=CUDA, generator=generator)
            wrapped(x, step % 2 == 0).backward()
            optimizer.step()
            optimizer.zero_grad()

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"file://{tmp_path}/rdv")
    try:
        ours = WithAuxiliaryHead().to(CUDA)
        theirs = copy.deepcopy(ours)
        offload = OffloadAdamW(ours.parameters(), lr=1e-3, chunk_size=CHUNK)
        offload.overlap_with(ours)
        train(ours, offload)
        train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3, fused=True))
        assert_same(list(ours.state_dict().values()), list(theirs.state_dict().values()))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_on_one_gpu_overlapped_matches_torch(tmp_path):
    """parallelize_module on a 1-rank NCCL mesh with a SequenceParallel norm: its partial-sum
    gradients are redistributed (an NCCL all-reduce) into temporaries that the overlapped
    update reads on its own stream after step() returns; bit-identical to torch fused AdamW."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial

    def train(model: nn.Module, optimizer) -> None:
        generator = torch.Generator(device=CUDA).manual_seed(0)
        for _ in range(4):
            x = torch.randn(4, 256, 1024, device=CUDA, generator=generator)
            model(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            optimizer.zero_grad()

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"file://{tmp_path}/rdv")
    try:
        mesh = init_device_mesh("cuda", (1,))

        def block() -> nn.Module:
            torch.manual_seed(0)
            layers = nn.Sequential(nn.LayerNorm(1024), nn.Linear(1024, 4096), nn.GELU())
            layers.append(nn.Linear(4096, 1024))
            return sequence_parallel(layers.to(CUDA), mesh)

        ours, theirs = block(), block()
        offload = OffloadAdamW(ours.parameters(), lr=1e-3, chunk_size=CHUNK)
        offload.overlap_with(ours)
        train(ours, offload)
        offload.wait_for_updates()
        train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3, fused=True))
        ours(torch.randn(4, 256, 1024, device=CUDA)).pow(2).mean().backward()
        assert ours[0].weight.grad.placements == (Partial(),)  # else this tests nothing new
        assert_same(
            [p.full_tensor() for p in ours.parameters()],
            [p.full_tensor() for p in theirs.parameters()],
        )
    finally:
        dist.destroy_process_group()
