"""OffloadAdamW(resident=...): part of the state stays on the device and is never copied.

Run on the staged pipeline (``force_staging=True``), where the CPU stands in for the device and
the stream-ordering checker (on for every test) sees the resident buffers as device memory.
"""

from __future__ import annotations

import copy

import numpy
import pytest
import torch
from conftest import (
    MasterCopyAdamW,
    assert_same,
    clone_params,
    make_params,
    set_grads,
    step_together,
)

from lightning_offload_optim import OffloadAdamW
from lightning_offload_optim import resident as resident_module
from lightning_offload_optim.resident import ResidentRanges, free_device_memory

SHAPES = [(64, 3), (100,), (64, 5), (7,), (640,)]  # 192, 100, 320, 7, 640 elements
STATE = 8 * (192 + 100 + 320 + 7 + 640)


def staged(params, **kwargs) -> OffloadAdamW:
    return OffloadAdamW(params, lr=0.05, force_staging=True, chunk_size=128, **kwargs)


# "auto" on a device that reports no free memory (the CPU, as MPS or XPU) keeps nothing; it
# raised from the second step on, asking CUDA for the device's size.
@pytest.mark.parametrize("resident", [0.0, 0.3, 0.99, 1.0, 8 * (192 + 100 + 320), "auto"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_bit_identical_to_torch_whatever_the_share(stream_order, resident, amsgrad):
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident=resident, amsgrad=amsgrad)
    theirs = torch.optim.AdamW(reference, lr=0.05, amsgrad=amsgrad, fused=True)
    generator = torch.Generator().manual_seed(0)
    step_together([ours, theirs], [params, reference], generator, 4, skip=lambda i: i == 3)
    stream_order.expect_none()
    assert_same(params, reference)
    saved = ours.state_dict()["state"]
    assert sorted(saved) == [0, 1, 2, 4]  # parameter 3 never had a gradient
    for index in saved:
        r = reference[index]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same([saved[index][key]], [theirs.state[r][key]])


def test_whole_parameters_in_order_stay_resident_and_are_not_copied():
    params = make_params(SHAPES)
    # 0.4 * 1259 elements: the first two parameters fit, the third (320) does not and is passed
    # over, the fourth (7) fits in what is left, the fifth (640) does not.
    opt = staged(params, resident=0.4)
    generator = torch.Generator().manual_seed(1)
    step_together([opt], [params], generator, 1)
    assert opt.memory_stats()["resident_bytes"] == 0  # chosen from the second step on
    step_together([opt], [params], generator, 2)
    assert opt.memory_stats()["resident_bytes"] == 8 * (192 + 100 + 7)
    moved = opt.last_step.resolve()
    assert moved.bytes_in == moved.bytes_out == STATE - 8 * (192 + 100 + 7)


def test_bf16_parameters_with_master_copies(stream_order):
    """Against torch fused AdamW on fp32 copies of the parameters, rounded after each step."""
    params = make_params(SHAPES, dtype=torch.bfloat16)
    reference = clone_params(params)
    everything = staged(params, resident=1.0)
    fp32 = MasterCopyAdamW([{"params": reference}], lr=0.05)
    step_together([everything, fp32], [params, reference], torch.Generator().manual_seed(2), 3)
    stream_order.expect_none()
    assert_same(params, reference)
    assert everything.memory_stats()["resident_bytes"] == everything.memory_stats()["state_bytes"]


def test_a_step_under_another_stream_is_ordered_before_what_follows_on_the_callers(
    stream_order,
):
    """A step queued under a stream of the user's (``with torch.cuda.stream(s)``) updates the
    resident state and uses the gradient scratch on that stream. What the optimizer itself queues
    later on the default stream must come after it, with no wait back by the user (which
    only the user's own reads of the parameters need): the write-back of resident state for
    ``state_dict()``, and the reuse of the freed buffers' memory."""
    from lightning_offload_optim.streams import device_module

    simulated = device_module(torch.device("cpu"))
    params = make_params(SHAPES, dtype=torch.bfloat16)
    reference = clone_params(params)
    opt = staged(params, resident=1.0)
    fp32 = MasterCopyAdamW([{"params": reference}], lr=0.05)
    generator = torch.Generator().manual_seed(5)
    for users_stream in (False, True):
        set_grads([params, reference], generator)
        if users_stream:  # after the gradients, as CUDA asks of the user
            stream = simulated.Stream()
            stream.wait_stream(simulated.current_stream())
            with simulated.stream(stream):
                opt.step()
        else:
            opt.step()
        fp32.step()
    saved = opt.state_dict()
    opt.release_device_memory()
    torch.empty(4096).fill_(1.0)  # the default stream's next allocation may reuse that memory
    stream_order.expect_none()
    expected = fp32.fp32.state_dict()["state"]
    for index, entry in saved["state"].items():
        assert_same(
            [entry["exp_avg"], entry["exp_avg_sq"]],
            [expected[index]["exp_avg"], expected[index]["exp_avg_sq"]],
        )
    assert_same(params, reference)


def test_checkpoints_are_the_same_whatever_the_share_and_load_into_any_share(stream_order):
    """Both checkpoints equal torch fused AdamW's, trained alongside from the start."""
    params = make_params(SHAPES)
    twins, reference = clone_params(params), clone_params(params)
    kept, offloaded = staged(params, resident=0.6), staged(twins)
    torch_opt = torch.optim.AdamW(reference, lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(3)
    step_together([kept, offloaded, torch_opt], [params, twins, reference], generator, 3)
    assert kept.memory_stats()["resident_bytes"] > 0
    saved, expected = kept.state_dict(), offloaded.state_dict()
    for index, entry in torch_opt.state_dict()["state"].items():
        for ours in (saved, expected):
            assert ours["state"][index].keys() == entry.keys()
            assert_same([ours["state"][index][k] for k in entry], list(entry.values()))
    # Offloaded state into a resident share, and the other way, then both train on alike.
    kept.load_state_dict(copy.deepcopy(expected))
    offloaded.load_state_dict(copy.deepcopy(saved))
    step_together([kept, offloaded, torch_opt], [params, twins, reference], generator, 2)
    stream_order.expect_none()
    assert_same(params, reference)
    assert_same(twins, reference)


@pytest.mark.parametrize(
    ("total_gib", "margin_gib"), [(10, 2), (40, 4)], ids=["2-gib-floor", "tenth-of-the-device"]
)
def test_auto_keeps_what_is_free_after_the_first_step_less_a_margin(
    monkeypatch, total_gib, margin_gib
):
    """The margin is a tenth of the device's memory, and at least 2 GiB."""
    gib = 1 << 30
    free = margin_gib * gib + 3000
    monkeypatch.setattr(resident_module, "free_device_memory", lambda device: free)
    monkeypatch.setattr(resident_module, "total_memory", lambda device: total_gib * gib)
    params = make_params(SHAPES)
    opt = staged(params, resident="auto")
    step_together([opt], [params], torch.Generator().manual_seed(4), 2)
    # 3000 bytes free beyond the margin: the first parameter (1536 B) and the second
    # (800 B) fit, the third (2560 B) does not, the fourth (56 B) does, the fifth does not.
    assert opt.memory_stats()["resident_bytes"] == 8 * (192 + 100 + 7)


@pytest.mark.parametrize(
    ("free_gib", "fraction", "expected_gib"), [(50, 1.0, 50), (50, 0.5, 10), (20, 1.0, 20)]
)
def test_auto_counts_only_what_the_allocator_may_still_take(
    monkeypatch, free_gib, fraction, expected_gib
):
    """A per-process memory fraction caps the caching allocator below what the device has
    free: "auto" must not plan beyond the cap (the next forward pass would run out), nor
    beyond what is free (other processes' memory) when the cap is higher."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free_gib * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * gib)
    free = resident_module.free_device_memory(torch.device("cuda", 0))
    assert free == expected_gib * gib


def test_resident_with_overlap(stream_order):
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))
    twin = copy.deepcopy(model)
    opt = OffloadAdamW(model.parameters(), force_staging=True, chunk_size=64, resident=0.5)
    opt.overlap_with(model)
    torch_opt = torch.optim.AdamW(twin.parameters(), fused=True)
    x = torch.ones(3, 8)
    for _ in range(4):
        for net, optimizer in ((model, opt), (twin, torch_opt)):
            net(x).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    model.state_dict()
    stream_order.expect_none()
    assert opt.memory_stats()["resident_bytes"] > 0
    assert_same(list(model.parameters()), list(twin.parameters()))


@pytest.mark.parametrize(
    ("resident", "error", "message"),
    [
        (1.5, ValueError, r"share of the state must be in \[0, 1\]"),
        (-1, ValueError, "bytes must be >= 0"),
        ("half", TypeError, "'auto' or None"),
        (True, TypeError, "'auto' or None"),
    ],
)
def test_bad_resident_arguments_are_refused(resident, error, message):
    with pytest.raises(error, match=message):
        OffloadAdamW(make_params(), resident=resident)


@pytest.mark.parametrize(
    ("given", "kept_elements"),
    [(numpy.float32(0.4), 192 + 100 + 7), (numpy.int64(8 * (192 + 100)), 192 + 100)],
)
def test_numpy_numbers_are_taken_as_the_python_ones(given, kept_elements):
    """A share or budget read from numpy (a config, a sweep) was refused; a numpy float is a
    share and a numpy int bytes, as their Python kinds are."""
    params = make_params(SHAPES)
    opt = OffloadAdamW(params, lr=0.05, force_staging=True, chunk_size=numpy.int64(128))
    opt.resident = given
    assert type(opt.resident) is (float if isinstance(given, numpy.floating) else int)
    step_together([opt], [params], torch.Generator().manual_seed(1), 2)
    assert opt.memory_stats()["resident_bytes"] == 8 * kept_elements
    assert opt.chunk_size == 128 and type(opt.chunk_size) is int
    with pytest.raises(ValueError, match=r"share of the state must be in \[0, 1\]"):
        opt.resident = numpy.float64(1.5)


def test_auto_does_not_shrink_when_it_chooses_again(monkeypatch):
    """The resident buffers held when "auto" chooses again (new parameters) are freed by the
    choice: they count as free."""
    free = 2 * (1 << 30) + 3000 + 8 * 640
    params = make_params(SHAPES)
    opt = staged(params, resident="auto")
    monkeypatch.setattr(
        resident_module, "free_device_memory", lambda d: free - opt.memory_stats()["resident_bytes"]
    )
    monkeypatch.setattr(resident_module, "total_memory", lambda device: 10 << 30)
    generator = torch.Generator().manual_seed(5)
    step_together([opt], [params], generator, 2, skip=lambda i: i == 4)
    # 8120 bytes over the margin: the first four parameters' state (4952 B) fits, the fifth's
    # (5120 B) does not fit beside it, before or after it joins.
    assert opt.memory_stats()["resident_bytes"] == 8 * (192 + 100 + 320 + 7)
    step_together([opt], [params], generator, 2)  # the last parameter joins: choose again
    assert opt.memory_stats()["resident_bytes"] == 8 * (192 + 100 + 320 + 7)


class _FakeArena:
    """Stands in for an arena of fp32 state (two keys) on ``device``: a CPU test cannot hold
    tensors on two devices, but the choice only reads where each arena lives and how large
    each parameter's state is."""

    def __init__(self, device: str, numel: int) -> None:
        self.device = torch.device(device)
        self.numel = numel

    @staticmethod
    def state_bytes(numel: int) -> int:
        return 8 * numel


def _slots(arena: _FakeArena, numels: list[int]) -> list:
    from types import SimpleNamespace

    offsets = [sum(numels[:i]) for i in range(len(numels))]
    return [
        SimpleNamespace(arena=arena, offset=offset, layout=SimpleNamespace(numel=numel))
        for offset, numel in zip(offsets, numels, strict=True)
    ]


def test_each_device_keeps_what_fits_in_its_own_budget(monkeypatch):
    """One process with parameters on two GPUs: "auto" sizes each device's share from that
    device's free memory (not the first arena's device for all), a byte budget holds on each
    device, and a share is a share of each device's state."""
    gib = 1 << 30
    free = {torch.device("cuda:0"): 2 * gib + 700, torch.device("cuda:1"): 2 * gib + 8000}
    monkeypatch.setattr(resident_module, "free_device_memory", lambda device: free[device])
    monkeypatch.setattr(resident_module, "total_memory", lambda device: 10 * gib)
    zero, one = arenas = [_FakeArena("cuda:0", 150), _FakeArena("cuda:1", 150)]
    slots = _slots(zero, [100, 50]) + _slots(one, [100, 50])
    auto = resident_module.budget_bytes("auto", arenas, held={torch.device("cuda:1"): 80})
    assert auto == {zero.device: 700, one.device: 8080}
    chosen = resident_module.choose_resident(slots, auto)
    # cuda:0 has room for the 50-element parameter only (400 B), cuda:1 for both (1200 B).
    assert chosen[zero].ranges == ((100, 150),)
    assert chosen[one].ranges == ((0, 150),)
    assert resident_module.budget_bytes(800, arenas) == {zero.device: 800, one.device: 800}
    assert resident_module.budget_bytes(0.5, arenas) == {zero.device: 600, one.device: 600}
    assert resident_module.budget_bytes(None, arenas) == {zero.device: 0, one.device: 0}


def test_resident_ranges_are_merged_and_empty_ones_dropped():
    """Adjacent parameters kept resident form one range (chunks may span their boundary)."""
    ranges = ResidentRanges.of([(10, 20), (0, 10), (30, 30), (40, 50)])
    assert ranges.ranges == ((0, 20), (40, 50))
    assert ranges.edges == {0, 20, 40, 50}
    assert ranges.device_start(5, 15) == 5
    assert ranges.device_start(45, 50) == 25


def test_no_free_memory_figure_off_cuda():
    assert free_device_memory(torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("share", "then"),
    [(0.5, {}), (1.0, {"resident": None}), (1.0, {"resident": 0.0})],
    ids=["same-share", "none-then", "zero-then"],
)
def test_state_is_kept_resident_again_after_release_device_memory(stream_order, share, then):
    """After ``release_device_memory()`` (a second ``fit``), the next steps allocate again and
    keep resident the share set by then (``then``): the same again, or none. Plans cut around
    the old share are dropped: a resident parameter is one chunk whatever ``chunk_size`` (it
    needs no staging), and staged, the 640-element one would take staging of 640 elements, past
    the 128 that ``chunk_size`` bounds it to. Results stay torch's."""
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident=share)
    torch_opt = torch.optim.AdamW(reference, lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(21)
    step_together([ours, torch_opt], [params, reference], generator, 2)
    before = ours.memory_stats()["resident_bytes"]
    assert before > 0
    ours.release_device_memory()
    assert ours.memory_stats()["resident_bytes"] == 0
    for name, value in then.items():
        setattr(ours, name, value)
    step_together([ours, torch_opt], [params, reference], generator, 2)
    stats = ours.memory_stats()
    assert stats["resident_bytes"] == (0 if then else before)
    if then:  # two staging sets of exp_avg and exp_avg_sq, 128 fp32 elements each
        assert stats["staging_bytes"] == 2 * 2 * 128 * 4
    assert_same(params, reference)
    stream_order.expect_none()


def test_a_share_set_anew_copies_only_the_state_it_does_not_keep(stream_order):
    """Chunk plans end where resident ranges do: plans cached for the old share (here none
    kept) would make a chunk straddle the new share's edge and copy resident state too."""
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident=0.0)
    theirs = torch.optim.AdamW(reference, lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(8)
    step_together([ours, theirs], [params, reference], generator, 3)
    ours.resident = 0.99  # the first four parameters: an edge inside a 128-element chunk
    step_together([ours, theirs], [params, reference], generator, 2)
    held = ours.memory_stats()["resident_bytes"]
    assert held == 8 * (192 + 100 + 320 + 7)
    moved = ours.last_step.resolve()
    assert moved.bytes_in == moved.bytes_out == STATE - held
    stream_order.expect_none()
    assert_same(params, reference)


def test_resident_set_anew_is_followed_from_the_next_step(stream_order):
    """``opt.resident`` set after construction: the next step keeps the new share (``0.0`` or
    ``None`` frees the resident buffers, which were kept before); an invalid value is refused
    when set, and the share set before stays. Results stay torch's throughout."""
    params = make_params(SHAPES)
    reference = clone_params(params)
    ours = staged(params, resident=1.0)
    torch_opt = torch.optim.AdamW(reference, lr=0.05, fused=True)
    generator = torch.Generator().manual_seed(8)
    step_together([ours, torch_opt], [params, reference], generator, 2)
    full = ours.memory_stats()["resident_bytes"]
    assert full > 0
    # 1 (a byte: nothing fits) after 1.0 (the whole state), which compares equal.
    for resident, expected in [(0.0, 0), (1.0, full), (1, 0), (1.0, full), (None, 0), (0.99, None)]:
        ours.resident = resident
        step_together([ours, torch_opt], [params, reference], generator, 1)
        held = ours.memory_stats()["resident_bytes"]
        assert held == expected if expected is not None else 0 < held < full
    held = ours.memory_stats()["resident_bytes"]
    with pytest.raises(ValueError, match=r"resident as a share of the state must be in \[0, 1\]"):
        ours.resident = 2.0
    assert ours.resident == 0.99  # the share set before stays
    step_together([ours, torch_opt], [params, reference], generator, 1)
    assert ours.memory_stats()["resident_bytes"] == held
    assert_same(params, reference)


@pytest.mark.parametrize(("share", "expected"), [(0.0995, 0), (0.1, 80)])
def test_a_share_never_rounds_the_budget_up(stream_order, share, expected):
    """A share of 0.0995 of 800 bytes of state is 79.6 bytes: the first parameter's 80 bytes do
    not fit (a budget rounded up would keep them); 0.1 is 80 bytes and keeps them."""
    params = make_params([(10,), (90,)])
    reference = clone_params(params)
    ours = OffloadAdamW(params, lr=0.05, force_staging=True, chunk_size=128, resident=share)
    theirs = torch.optim.AdamW(reference, lr=0.05, fused=True)
    step_together([ours, theirs], [params, reference], torch.Generator().manual_seed(0), 3)
    stream_order.expect_none()
    assert_same(params, reference)
    assert ours.memory_stats()["state_bytes"] == 800
    assert ours.memory_stats()["resident_bytes"] == expected
