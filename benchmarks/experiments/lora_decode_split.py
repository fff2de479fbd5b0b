"""Where expert LoRA's decode time goes (GPU; issue 30): one token, rank 16, one adapter, the whole call in a CUDA
graph with both adapter terms, with W13's only, with W2's only, and without adapters; beside each, the device time
per kernel (torch.profiler, eager). The terms run inside the GEMVs (kernels/lora.py, decode terms): W13's needs its
shrink launched before GEMV1, W2's a reduction across GEMV1's programs that GEMV2 reads.

    python benchmarks/experiments/lora_decode_split.py --out $OUT         (about 60 s)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from moekit import FusedMoE, presets
from moekit.experts import ExpertsLoRA, fused_experts
from moekit.tools.bench.lora import lora_ids, random_lora
from moekit.tools.bench.timing import environment, graph_time_us, kernel_times_us


def split(name: str, rank: int = 16) -> list[dict]:
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
        for label, lora in variants.items():
            extra = {} if lora is None else dict(lora=lora, lora_ids=ids)

            def call(extra=extra):
                return fused_experts(x, layer.w13, layer.w2, tw, tid, **kw, **extra)

            us = sorted(graph_time_us([call]) for _ in range(3))[1]
            kernels = {k: round(t, 1) for k, t, _ in kernel_times_us(call, 10)}
            records.append({"preset": name, "T": 1, "rank": rank, "adapters": label, "graph_us": us,
                            "kernels_us": kernels})
            print(f"{name} T=1 {label:10s} {us:7.1f} us | {kernels}", flush=True)
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-120b"], choices=presets.names())
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args()
    records = [r for name in args.preset for r in split(name)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora_decode_split.json").write_text(json.dumps({"env": environment(), "records": records}, indent=1))


if __name__ == "__main__":
    main()
