"""CUDA-graph timing of latency-bound calls.

A graph holding ``calls`` consecutive invocations (each on different inputs, e.g. a different
layer's weights) is replayed many times; time per call = median replay time / calls. A lone
replay timed with events carries several microseconds of timer overhead, so single-call
timings of small kernels measure the timer, not the kernel.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence

import torch


def graph_time_us(fns: Sequence[Callable[[], object]], *, replays: int = 50, warmup: int = 3) -> float:
    """Median microseconds per call of ``fns`` (one call each) captured into one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times) / len(fns)


def eager_time_us(fns: Sequence[Callable[[], object]], *, reps: int = 20, warmup: int = 3) -> float:
    """Median microseconds per call without a graph (for implementations that cannot be captured)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for fn in fns:
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times) / len(fns)


def kernel_times_us(fn: Callable[[], object], calls: int = 10, warmup: int = 3) -> list[tuple[str, float, int]]:
    """(kernel name, device microseconds per call, launches per call) of each kernel ``fn`` runs (torch.profiler,
    mean over ``calls`` after ``warmup``): where a call's device time goes."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(ev.key, ev.device_time_total / calls, ev.count // calls) for ev in prof.key_averages()
            if ev.device_time_total > 0]


# The memory floors' rate: the H200's device-to-device copy, bytes read + written per second (shared/reference/gpu.md).
# The issues' targets are stated against it, so every table's floors use it; each run also measures its own GPU's
# copy (copy_rate, in the header): on another GPU the floors are that GPU's only after scaling by the two.
COPY_BW = 4.2e12

# A graph that replays the same small data (a router's weights, a decode kernel's few experts) finds it in L2 (50 MB
# on an H100 SXM and an H200) from the second replay on, and times the cache, not memory: benchmarks of such calls
# cycle over as many copies as make one replay touch at least MIN_REPLAY_BYTES, twice the L2, so that a replay
# finds none of the previous one's data there.
L2_BYTES = 50e6
MIN_REPLAY_BYTES = 2 * L2_BYTES


def calls_past_l2(bytes_per_call: float, at_least: int = 1) -> int:
    """Calls a graph needs, each on data of its own of ``bytes_per_call`` bytes, for one replay to touch at least
    MIN_REPLAY_BYTES; and at least ``at_least``."""
    return max(at_least, math.ceil(MIN_REPLAY_BYTES / max(bytes_per_call, 1.0)))


@functools.lru_cache(maxsize=None)
def copy_rate() -> float:
    """Bytes per second of a device-to-device copy of 1 GiB here, read + written, measured once per process."""
    us, nbytes = _timed_copy()
    torch.cuda.empty_cache()  # (its 2 GiB back to the GPU: peers size themselves by what is free)
    return nbytes / (us * 1e-6)


def _timed_copy() -> tuple[float, int]:
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return eager_time_us([lambda: dst.copy_(src)], reps=10), 2 * src.numel() * src.element_size()


def _copy_rate_if_room() -> float | None:
    """copy_rate() on a GPU with 2 GiB free for it (a run near the memory's end writes its results without it)."""
    if not torch.cuda.is_available():
        return None
    try:
        return copy_rate()
    except torch.cuda.OutOfMemoryError:
        return None


def copy_rate_words(env: dict) -> str:
    """A header's words for the memory floors' rate, and the copy rate the run measured where it did."""
    rate = env.get("copy_rate")
    return f"{COPY_BW / 1e12:.1f} TB/s (the H200's copy rate{f'; this run measured {rate / 1e12:.2f}' if rate else ''})"


def environment() -> dict:
    """GPU, versions and date for result files."""
    import datetime
    import platform

    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        **({"copy_rate": rate} if (rate := _copy_rate_if_room()) else {}),
    }


def archive_stem(name: str, env: dict) -> str:
    """An A/B's file stem for the archive: ``{name}_{gpu}_{date}`` (gpu: "h100", "h200"... from the device's name)."""
    words = env["gpu"].split()
    return f"{name}_{words[1].lower() if len(words) > 1 else 'gpu'}_{env['date']}"


def write_results(out, stem: str, env: dict, records: list, markdown: str, **extra) -> None:
    """``{stem}.md`` (the table) and ``{stem}.json`` (``{"env": ..., "records": [...]}`` and ``extra``'s keys)
    under ``out``."""
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(markdown)
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "records": records, **extra}, indent=1) + "\n")
