"""The Python work of an eager call, on any machine (no GPU): what moekit's own host code costs per call with the
kernels taken out, so that changes to it can be measured where the device is not at hand. The GPU's eager
benchmark (bench_eager.py) measures whole calls, launches included; this isolates the layers above them:

  FusedMoE.forward        the layer's own work, fused_router and fused_experts replaced by stubs
  fused_experts_into      the Triton backend's host path at qwen3-30b-a3b T=1 (decode: two GEMVs) and T=16 (the
                          aligned path: align, two GEMMs, combine) on the H200 table's configs, Launcher.launch
                          replaced by a stub (what is built for the launches, not the launches)

    python benchmarks/host_path.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import json
import platform
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--label", default="", help="a name for the tree measured (e.g. a commit)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    records = [{"what": f"FusedMoE.forward own ({name}, ops stubbed)", "us": fused_moe_own(name, args.calls)}
               for name in ("qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3")]
    records += [{"what": f"fused_experts_into, qwen3-30b-a3b T={t} (launches stubbed)",
                 "us": experts_host(t, args.calls)} for t in (1, 16)]
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
