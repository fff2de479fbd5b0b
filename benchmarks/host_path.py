"""The Python work of an eager call, on any machine (no GPU): what moekit's own host code costs per call with the
kernels taken out, so that changes to it can be measured where the device is not at hand. The GPU's eager
benchmark (bench_eager.py) measures whole calls, launches included; this isolates the layers above them:

  FusedMoE.forward        the layer's own work, fused_router and fused_experts replaced by stubs
  fused_experts_into      the Triton backend's host path at qwen3-30b-a3b T=1 (decode: two GEMVs) and T=16 (the
                          aligned path: align, two GEMMs, combine) on the H200 table's configs, Launcher.launch
                          replaced by a stub (what is built for the launches, not the launches)

With --gpu-path, the public ops as a GPU serves them, on CPU tensors: Triton's driver reports sm_90, the
Triton backend and the router's one-launch kernel are taken as on a GPU at T=1, and every launch (and its
preparation) is a stub. fused_router, fused_experts, both back to back, and FusedMoE at qwen3-30b-a3b T=1: the
whole of moekit's host code per call (signature lookups, plans, buffers), and what FusedMoE adds to its parts.

    python benchmarks/host_path.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from moekit import _launch, presets
from moekit import layer as layer_module
from moekit.experts import ExpertsConfig
from moekit.experts import triton_backend
from moekit.tools.bench.timing import environment, write_results

TABLE = Path(__file__).resolve().parents[1] / "src/moekit/experts/tuned_configs.json"


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` loops of ``calls`` calls, after a warm-up."""
    for _ in range(100):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(times)[repeats // 2]


def fused_moe_own(preset: str, calls: int) -> float:
    spec = presets.get(preset).scaled()
    layer = layer_module.FusedMoE(spec, dtype=torch.float32)
    x = torch.randn(1, spec.hidden_size)
    routes = (torch.zeros(1, spec.top_k), torch.zeros(1, spec.top_k, dtype=torch.int32))
    out = torch.zeros(1, spec.hidden_size)
    real = layer_module.fused_router, layer_module.fused_experts
    layer_module.fused_router = lambda *a, **k: routes
    layer_module.fused_experts = lambda *a, **k: out
    try:
        with torch.no_grad():
            return per_call_us(lambda: layer(x), calls)
    finally:
        layer_module.fused_router, layer_module.fused_experts = real


def experts_host(num_tokens: int, calls: int) -> float:
    spec = presets.get("qwen3-30b-a3b")
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    table = json.loads(TABLE.read_text())["NVIDIA H200|triton-3.6.0|bfloat16"][f"E{E}_N{2 * I}_K{H}"]
    config = ExpertsConfig.from_dict(table[str(num_tokens)])
    w13 = torch.empty(1, 2 * I, H, dtype=torch.bfloat16).expand(E, -1, -1)
    w2 = torch.empty(1, H, I, dtype=torch.bfloat16).expand(E, -1, -1)
    x, tw = torch.randn(num_tokens, H).bfloat16(), torch.rand(num_tokens, k)
    ids = torch.randint(0, E, (num_tokens, k), dtype=torch.int32)
    out = torch.empty(num_tokens, H, dtype=torch.bfloat16)
    real = _launch.Launcher.launch
    _launch.Launcher.launch = lambda self, grid, args, kwargs: None
    try:
        return per_call_us(lambda: triton_backend.fused_experts_into(
            out, x, w13, w2, tw, ids, "silu_and_mul", None, None, None, config), calls)
    finally:
        _launch.Launcher.launch = real


@contextlib.contextmanager
def gpu_path_on_the_cpu():
    """The ops' GPU path on CPU tensors, launches stubbed (see the module's docstring); everything put back after."""
    from triton.runtime import driver

    from moekit import _triton, gate
    from moekit.experts import backends
    from moekit.routing import tiers
    from moekit.tools._fake_sm90 import Sm90Driver

    saved = [(obj, name, getattr(obj, name)) for obj, name in (
        (_triton, "can_launch"), (_triton, "num_sms"), (_triton, "dependent_launches"), (_triton, "tma_copies"),
        (_launch.Launcher, "launch"), (_launch.Launcher, "prepare"), (tiers, "fused_applies"), (backends, "BACKENDS"))]
    verifying, active = gate.enabled(), driver._active  # (no default driver to reset to on a machine without a GPU)
    driver.set_active(Sm90Driver())
    try:
        _triton.can_launch = lambda device: True
        _triton.num_sms = lambda device: 132
        _triton.dependent_launches = lambda device: True
        _triton.tma_copies = lambda device: False
        _launch.Launcher.launch = lambda self, grid, args, kwargs: None
        _launch.Launcher.prepare = lambda self, args, kwargs: (lambda *a, **k: True)
        tiers.fused_applies = lambda *a, **k: True
        backends.BACKENDS = tuple(dataclasses.replace(b, rejects=lambda call, explicit: None) if b.name == "triton"
                                  else b for b in backends.BACKENDS)
        gate.set_verification(False)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        gate.set_verification(verifying)
        driver._active = active


def gpu_path_records(calls: int) -> list[dict]:
    from moekit import FusedMoE, fused_experts, fused_router

    spec = presets.get("qwen3-30b-a3b")
    with gpu_path_on_the_cpu(), torch.no_grad():
        layer = FusedMoE(spec, dtype=torch.bfloat16)
        x = torch.randn(1, spec.hidden_size, dtype=torch.bfloat16)
        params, kwargs = layer._parameters, spec.routing_kwargs()
        tw, tid = layer.route(x)

        def router():
            return fused_router(x, layer.gate.weight, layer.gate.bias, top_k=spec.top_k, method=spec.routing, **kwargs)

        def experts(w=tw, i=tid):
            return fused_experts(x, params["w13"], params["w2"], w, i, activation=spec.activation)

        ops = {"fused_router": router, "fused_experts": experts, "fused_router then fused_experts on its routes":
               lambda: experts(*router()), "FusedMoE": lambda: layer(x)}
        return [{"what": f"{name}, qwen3-30b-a3b T=1, the GPU path on the CPU (launches stubbed)",
                 "us": per_call_us(fn, calls)} for name, fn in ops.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--label", default="", help="a name for the tree measured (e.g. a commit)")
    p.add_argument("--out", type=Path)
    p.add_argument("--gpu-path", action="store_true", help="also the public ops' GPU path with launches stubbed")
    p.add_argument("--gpu-path-only", action="store_true", help=argparse.SUPPRESS)  # (the child process of --gpu-path)
    args = p.parse_args()
    if args.gpu_path_only:
        print(json.dumps(gpu_path_records(args.calls)))
        return
    records = [{"what": f"FusedMoE.forward own ({name}, ops stubbed)", "us": fused_moe_own(name, args.calls)}
               for name in ("qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3")]
    records += [{"what": f"fused_experts_into, qwen3-30b-a3b T={t} (launches stubbed)",
                 "us": experts_host(t, args.calls)} for t in (1, 16)]
    if args.gpu_path:  # in a process of its own: the ops' caches keep what they decided under the stubs
        child = subprocess.run([sys.executable, __file__, "--gpu-path-only", "--calls", str(args.calls)], check=True,
                               capture_output=True, text=True, env=os.environ | {"TRITON_INTERPRET": "0"})
        records += json.loads(child.stdout.strip().splitlines()[-1])
    env = environment() | {"cpu": platform.processor() or platform.machine(), "label": args.label}
    title = f"# Host work per eager call, kernels taken out ({env['date']}{', ' + args.label if args.label else ''})"
    md = "\n".join([title, "", f"CPU {env['cpu']}, Python {env['python']}, torch {env['torch']}, triton "
                    f"{env['triton']}; median of 5 loops of {args.calls} calls.", "", "| what | us/call |", "|---|---|"]
                   + [f"| {r['what']} | {r['us']:.1f} |" for r in records]) + "\n"
    print(md)
    if args.out:
        write_results(args.out, f"host_path{'_' + args.label if args.label else ''}_{env['date']}", env, records, md)


if __name__ == "__main__":
    main()
