"""GPU micro-benchmark: OffloadAdamW step time against the PCIe bound and torch's fused AdamW.

The bound: a step must move every state byte host->device and back, 8 bytes/param each way for
fp32 params (12 with a bf16 param's fp32 master). With measured pinned bandwidths ``h2d`` and
``d2h``: ``8N/h2d + 8N/d2h`` if the two directions cannot overlap, ``max(8N/h2d, 8N/d2h)`` if
they can (full duplex); the copies of both directions are also timed together, which gives the
bound this machine actually has: ``bytes each way / min(concurrent h2d, d2h rate)``. The target
(issue 8) is a step within 1.15x of that measured bound. Figures come from one run, side by
side; written to ``gpu_step_time.{json,csv,png}``.

    python benchmarks/gpu_step_time.py --out docs/figures  # sized for ~2 min on an H200 (estimate)
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from lightning_offload_optim import OffloadAdamW, host_state

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"


def bandwidth(
    direction: str, nbytes: int = 1 << 30, repeats: int = 5, registered: bool = False
) -> float:
    """Pinned host<->device copy bandwidth in GB/s (median of ``repeats``), from torch's pinned
    allocator (``cudaHostAlloc``) or, ``registered``, from memory pinned as OffloadAdamW pins
    its state (``cudaHostRegister`` on an mmap): the two may differ, on a virtual machine."""
    pointers: list[int] = []
    if registered:
        host, pointers = host_state._pinned_empty(nbytes, torch.uint8, torch.device("cuda"))
    else:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src, dst = (host, device) if direction == "h2d" else (device, host)
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    host_state._release_pinned(pointers, [], [host])  # the copies are done (end.synchronize)
    return nbytes / statistics.median(times[1:]) / 1e9


def concurrent_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s per direction when host->device and device->host copies run at once (on two
    streams, as the pipeline runs them): the slower direction's rate."""
    up_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    down_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    up_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    down_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        pairs = ((up_dev, up_host), (down_host, down_dev))
        for stream, (dst, src) in zip(streams, pairs, strict=True):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record()
        for end in ends:
            end.synchronize()
        times.append(max(start.elapsed_time(end) for end in ends) / 1000)
    return nbytes / statistics.median(times[1:]) / 1e9


def launch_queue_depth(kind: str, limit: int = 4096, hold_ms: float = 1000.0) -> int | None:
    """How many operations of ``kind`` (``"kernel"``, ``"copy"`` host->device from pinned
    memory, which torch follows with an event of its own, ``"event"`` record) one busy CUDA
    stream takes before queuing the next blocks the host; None if
    ``limit`` went in freely. The stream is held by a spin kernel of about ``hold_ms``, then
    operations are queued one by one, each timed on the host: the first that takes over 100 ms
    waited for the queue to drain. Decides whether a step's ~5 operations per chunk on each copy
    stream can block ``step()`` (see ``call_ms``)."""
    stream = torch.cuda.Stream()
    small = torch.zeros(256, device="cuda")
    host = torch.zeros(256).pin_memory()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # the second at the clock the first raised from idle
        start.record(stream)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(10_000_000)
        end.record(stream)
        end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    operations = {
        "kernel": lambda: small.add_(1.0),
        "copy": lambda: small.copy_(host, non_blocking=True),
        "event": lambda: torch.cuda.Event().record(stream),
    }
    operation = operations[kind]
    depth = None
    with torch.cuda.stream(stream):
        operation()  # loads its kernel first: a lazy load may wait for the device
        stream.synchronize()
        torch.cuda._sleep(int(hold_ms * cycles_per_ms))
        for index in range(limit):
            began = time.perf_counter()
            operation()
            if time.perf_counter() - began > 0.1:
                depth = index
                break
    stream.synchronize()
    return depth


def make_params(total: int, dtype: torch.dtype, count: int = 24) -> list[torch.nn.Parameter]:
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(total // count, device="cuda", dtype=dtype))
        p.grad = torch.randn_like(p)
        params.append(p)
    return params


def time_steps(opt: torch.optim.Optimizer, steps: int) -> tuple[float, float, int, int]:
    """Median step time and median time until ``step()`` returns, in ms; peak device memory in
    bytes over those steps; and the bytes the last step copied one way (0 for torch's AdamW),
    after two untimed steps (the first allocates; a resident share is chosen at the second). A
    step's time runs from the call, with the device idle, until all of its work is done, copies
    back to the host included (they run on streams of their own, which an event on the caller's
    stream would not wait for). The call returns before that unless a full CUDA launch queue
    (about 1000 entries a stream) blocks it: then the next forward pass is queued late."""
    opt.step()
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, calls = [], []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        calls.append(1000 * (time.perf_counter() - start))
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    record = getattr(opt, "last_step", None)
    moved = record.resolve().bytes_in if record is not None else 0
    peak = torch.cuda.max_memory_allocated()
    return statistics.median(times), statistics.median(calls), peak, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1_000_000_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=FIGURES)
    args = parser.parse_args()

    h2d, d2h, both = bandwidth("h2d"), bandwidth("d2h"), concurrent_bandwidth()
    print(
        f"{torch.cuda.get_device_name()}: pinned h2d {h2d:.1f} GB/s, d2h {d2h:.1f} GB/s, "
        f"both at once {both:.1f} GB/s each"
    )
    registered: dict[str, float | str] = {}
    for direction in ("h2d", "d2h"):
        try:
            registered[direction] = bandwidth(direction, registered=True)
        except Exception as error:  # report, and measure the rest
            registered[direction] = f"failed: {error!r}"
    print(f"pinned as OffloadAdamW pins its state (cudaHostRegister), GB/s: {registered}")
    depths: dict[str, int | str | None] = {}
    for kind in ("kernel", "copy", "event"):
        try:
            depths[kind] = launch_queue_depth(kind)
        except Exception as error:  # report, and measure the rest
            depths[kind] = f"failed: {error!r}"
    print(f"operations a busy stream queues before the host blocks (None: over 4096): {depths}")
    result = {
        "device": torch.cuda.get_device_name(),
        "h2d_gbps": h2d,
        "d2h_gbps": d2h,
        "concurrent_gbps_each_way": both,
        "registered_h2d_gbps": registered["h2d"],
        "registered_d2h_gbps": registered["d2h"],
        "launch_queue_depth": depths,
        "torch": torch.__version__,
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for dtype, moved in ((torch.float32, 8), (torch.bfloat16, 12)):
        params = make_params(args.params, dtype)
        numel = sum(p.numel() for p in params)
        half_duplex = 1000 * (moved * numel / h2d + moved * numel / d2h) / 1e9
        full_duplex = 1000 * max(moved * numel / h2d, moved * numel / d2h) / 1e9
        measured = 1000 * moved * numel / both / 1e9
        candidates = {
            f"OffloadAdamW chunk {c >> 20}Mi": lambda ps, c=c: OffloadAdamW(ps, chunk_size=c)
            for c in (1 << 20, 1 << 22, 1 << 24)
        }
        candidates["OffloadAdamW resident=0.5"] = lambda ps: OffloadAdamW(ps, resident=0.5)
        if dtype == torch.float32:
            candidates["torch AdamW fused (state on GPU)"] = lambda ps: torch.optim.AdamW(
                ps, fused=True
            )
        for name, make in candidates.items():
            try:
                opt = make(params)
                ms, call_ms, peak, moved_bytes = time_steps(opt, args.steps)
                # pageable state times the slow path (no bound method kept: it holds the optimizer)
                pinned = opt.memory_stats()["pinned"] if isinstance(opt, OffloadAdamW) else ""
            except Exception:  # report, and measure the others
                traceback.print_exc()
                continue
            finally:  # this optimizer's host state (GBs) goes before the next is made
                opt = None
                gc.collect()
                torch.cuda.empty_cache()
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "optimizer": name,
                "params": numel,
                "ms": ms,
                "call_ms": call_ms,
                "peak_gib": peak / 2**30,
                "pinned": pinned,
                "bound_half_duplex_ms": half_duplex,
                "bound_full_duplex_ms": full_duplex,
                "ratio_to_half_duplex_bound": ms / half_duplex,
                "bound_measured_ms": measured,
                "ratio_to_measured_bound": ms / measured,
                # what this step moved (less with a resident share) over the measured rate
                "moved_gb_each_way": moved_bytes / 1e9,
                "ratio_to_its_bytes_bound": ms / (1000 * moved_bytes / both / 1e9)
                if moved_bytes
                else "",
            }
            result["rows"].append(row)
            ratio = row["ratio_to_its_bytes_bound"]  # "" where nothing was copied
            print(
                f"{row['dtype']:9s} {name:34s} {ms:8.1f} ms (returns {call_ms:6.1f})"
                f"  peak {peak / 2**30:6.2f} GiB"
                f"  bound {full_duplex:.1f}-{half_duplex:.1f} ms, measured {measured:.1f} ms"
                + (f" (x{ratio:.2f} its bytes' bound)" if ratio else "")
            )
            write(result, args.out)  # after each row: a run cut short keeps what it measured
        del params
        torch.cuda.empty_cache()


def write(result: dict, out: Path) -> None:
    rows = result["rows"]
    (out / "gpu_step_time.json").write_text(json.dumps(result, indent=2))
    with open(out / "gpu_step_time.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(result, out / "gpu_step_time.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['dtype']}: {r['optimizer']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    ax.barh(labels[::-1], [r["ms"] for r in rows][::-1], color="#4c72b0")
    for i, r in enumerate(rows[::-1]):
        ax.plot([r["bound_full_duplex_ms"], r["bound_half_duplex_ms"]], [i, i], "k|-", ms=12)
    ax.set_xlabel("ms per step (bars); PCIe bound full-half duplex (black)")
    ax.set_title(f"{result['device']}, {rows[0]['params'] / 1e9:.1f}B params", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
