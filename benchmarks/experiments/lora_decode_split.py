"""Where expert LoRA's decode time goes (GPU; issue 30): one token, rank 16, one adapter, the whole call in a CUDA
graph with both adapter terms, with W13's only, with W2's only, and without adapters; beside each, the device time
per kernel (torch.profiler, eager). The terms run inside the GEMVs (kernels/lora.py, decode terms): W13's needs its
shrink launched before GEMV1, W2's a reduction across GEMV1's programs that GEMV2 reads. (W13's shrink inside
GEMV1's K loop was timed against its launch with this script and was slower: commit ea7e20d has both.) The rows
without --maxnreg run GEMV1 with the terms uncapped (experts/lora.py DECODE_TERMS_MAXNREG off), the call without
adapters as the library serves it (on an H100, gpt-oss-120b's table entry caps its GEMV1).

    python benchmarks/experiments/lora_decode_split.py --out $OUT         (about 60 s)
    python benchmarks/experiments/lora_decode_split.py --maxnreg 168 --out $OUT   (and both terms at 168 registers)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from moekit import FusedMoE, presets
from moekit.experts import ExpertsLoRA, fused_experts
from moekit.experts import lora as expert_lora
from moekit.tools.bench.lora import lora_ids, random_lora
from moekit.tools.bench.timing import archive_stem, environment, graph_time_us, kernel_times_us, write_results


def split(name: str, rank: int = 16, maxnreg: int | None = None) -> list[dict]:
    spec = presets.get(name)
    torch.manual_seed(0)
    layer = FusedMoE(spec, dtype=torch.bfloat16, device="cuda")
    full = random_lora(spec, 1, rank)
    variants = {"none": None, "both terms": full, "W13 only": ExpertsLoRA(full.w13_a, full.w13_b, None, None, [2.0]),
                "W2 only": ExpertsLoRA(None, None, full.w2_a, full.w2_b, [2.0])}
    records = []
    with torch.no_grad():
        x = torch.randn(1, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        tw, tid = layer.route(x)
        ids = lora_ids(1, 1)
        kw = dict(activation=spec.activation, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
        runs = list(variants.items())
        shipped_cap = expert_lora.DECODE_TERMS_MAXNREG
        if maxnreg:  # both terms again with GEMV1's registers capped (experts/lora.py DECODE_TERMS_MAXNREG)
            runs.append((f"both terms, GEMV1 maxnreg {maxnreg}", full))
        for label, lora in runs:
            extra = {} if lora is None else dict(lora=lora, lora_ids=ids)
            expert_lora.DECODE_TERMS_MAXNREG = maxnreg if "maxnreg" in label else None

            def call(extra=extra):
                return fused_experts(x, layer.w13, layer.w2, tw, tid, **kw, **extra)

            rec = {"preset": name, "T": 1, "rank": rank, "adapters": label,
                   "graph_us": sorted(graph_time_us([call]) for _ in range(3))[1],
                   "kernels_us": {k: round(t, 1) for k, t, _ in kernel_times_us(call, 10)}}
            records.append(rec)
            print(f"{name} T=1 {label:10s} {rec['graph_us']:7.1f} us | {rec['kernels_us']}", flush=True)
        expert_lora.DECODE_TERMS_MAXNREG = shipped_cap
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-120b"], choices=presets.names())
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--maxnreg", type=int, help="also both terms with GEMV1's registers capped at this (e.g. 168: three "
                   "4-warp programs per SM)")
    args = p.parse_args()
    records = [r for name in args.preset for r in split(name, maxnreg=args.maxnreg)]
    env = environment()
    write_results(args.out, archive_stem("lora_decode_split", env), env, records, markdown(env, records))


def markdown(env: dict, records: list[dict]) -> str:
    """The table: each call's graph time, its excess over the same preset's call without adapters, its kernels."""
    none = {r["preset"]: r["graph_us"] for r in records if r["adapters"] == "none"}
    lines = [f"# Expert LoRA at one token: each term's share ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16, rank 16, one adapter, the whole fused_experts call "
             "in a CUDA graph (median of three); kernels: device time per kernel, eager, torch.profiler. "
             "`benchmarks/experiments/lora_decode_split.py`.", "",
             "| preset | adapters | graph us | over none | kernels (us) |", "|---|---|---|---|---|"]
    for r in records:
        over = r["graph_us"] - none[r["preset"]] if r["adapters"] != "none" else None
        kernels = ", ".join(f"{k} {v}" for k, v in r["kernels_us"].items())
        lines.append(f"| {r['preset']} | {r['adapters']} | {r['graph_us']:.1f} | "
                     f"{'-' if over is None else f'+{over:.1f}'} | {kernels} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
