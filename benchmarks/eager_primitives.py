"""Host time of the pieces an eager moekit call is made of, on the GPU's host (GPU).

bench_eager.py measures whole calls; this measures, in one process, what they are built from: an empty Python call,
torch.empty and a reshape on CUDA, torch's F.linear (one kernel: the yardstick of the host's speed, which varies
several-fold between runs), a Triton launch of 1 and of 29 arguments through JITFunction.run and through
moekit._launch.Launcher, then moekit's eager calls at qwen3-30b-a3b's shapes, T=1. Each: the host's time per call of
2000 back-to-back calls (to the loop's last return, the GPU not waited for), median of 5 loops. ``--profile`` adds
cProfile tables of GateLinear, fused_experts and FusedMoE.

Two trees' host paths compare by running this with each on PYTHONPATH, in turns, on one machine:

    PYTHONPATH=src python benchmarks/eager_primitives.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moekit import FusedMoE, GateLinear, fused_experts, fused_router, presets, route, router_gemm
from moekit._launch import Launcher


@triton.jit
def _one_argument(p, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(p + i, i.to(tl.float32), mask=i < n)


@triton.jit
def _many_arguments(p, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
                    n, BLOCK: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(p + i, i.to(tl.float32), mask=i < n)  # 29 arguments, as the router kernel's launch


def host_us(fn, calls: int = 2000, loops: int = 5) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def cases(preset: str) -> dict:
    dev = "cuda"
    spec = presets.get(preset)
    E, H, k = spec.num_experts, spec.hidden_size, spec.top_k
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, H, device=dev, dtype=torch.bfloat16)
    buf = torch.empty(128, device=dev)
    logits = torch.randn(1, E, device=dev)
    one, many = Launcher(_one_argument), Launcher(_many_arguments)
    args29 = (buf, *[torch.empty(16, device=dev) for _ in range(10)], *range(100, 110), 1)
    many[(1,)](*args29, BLOCK=128, C1=1, C2=2, C3=3)  # Triton's path once, the signature bound
    bound = next(iter(many._bound.values()))
    device = torch.cuda.current_device()
    addresses29 = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args29)
    layer = FusedMoE(spec, dtype=torch.bfloat16, device=dev)
    gate = GateLinear(H, E, device=dev)
    with torch.no_grad():
        tw, tid = layer.route(x)
    kwargs = spec.routing_kwargs()
    return {
        "python call": lambda: None,
        "torch.empty(1, 128)": lambda: torch.empty(1, 128, device=dev),
        "x.reshape(-1, H)": lambda: x.reshape(-1, H),
        "F.linear bf16": lambda: F.linear(x, w),
        "triton 1 argument, JITFunction.run": lambda: _one_argument[(1,)](buf, 100, BLOCK=128),
        "triton 1 argument, Launcher": lambda: one[(1,)](buf, 100, BLOCK=128),
        "triton 29 arguments, JITFunction.run": lambda: _many_arguments[(1,)](*args29, BLOCK=128, C1=1, C2=2, C3=3),
        "triton 29 arguments, Launcher": lambda: many[(1,)](*args29, BLOCK=128, C1=1, C2=2, C3=3),
        # Triton's compiled launcher alone: a tensor argument costs a data_ptr() call and a driver query
        # (cuPointerGetAttribute), an address neither
        "compiled launcher, 29 arguments, 11 tensors": lambda: bound.launch((1,), device, args29),
        "compiled launcher, 29 arguments, 11 addresses": lambda: bound.launch((1,), device, addresses29),
        "router_gemm": lambda: router_gemm(x, w),
        "GateLinear": lambda: gate(x),
        "route": lambda: route(logits, k, spec.routing, **kwargs),
        "fused_router": lambda: fused_router(x, layer.gate.weight, layer.gate.bias, top_k=k, method=spec.routing,
                                             **kwargs),
        "fused_experts": lambda: fused_experts(x, layer.w13, layer.w2, tw, tid, activation=spec.activation),
        "FusedMoE": lambda: layer(x),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--only", nargs="+", default=None, help="the cases whose names contain one of these")
    p.add_argument("--profile", action="store_true", help="cProfile tables of GateLinear, fused_experts, FusedMoE")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from moekit.tools.bench.timing import archive_stem, environment, write_results

    env = environment()
    records, lines = [], [f"# Host time of an eager call's pieces ({env['gpu']}, {env['date']})", "",
                          f"torch {env['torch']}, triton {env['triton']}; {args.preset}, T=1; host us per call "
                          "(2000 calls, median of 5 loops).", "", "| piece | host us |", "|---|---|"]
    with torch.no_grad():
        todo = cases(args.preset)
        for name, fn in todo.items():
            if args.only and not any(o in name for o in args.only):
                continue
            us = host_us(fn)
            records.append({"piece": name, "preset": args.preset, "T": 1, "host_us": us})
            lines.append(f"| {name} | {us:.2f} |")
            print(lines[-1], flush=True)
        profiles = {}
        if args.profile:
            for name in ("GateLinear", "fused_experts", "FusedMoE"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(500):
                    todo[name]()
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
                profiles[name] = text.getvalue()
    md = "\n".join(lines) + "\n" + "".join(f"\n## cProfile: {n}, 500 calls\n\n```\n{t}```\n"
                                         for n, t in profiles.items())
    if args.out:
        write_results(args.out, archive_stem("eager_primitives", env), env, records, md)


if __name__ == "__main__":
    main()
