"""A/B of batch-invariant mode's dense row blocks (GPU): as configured against at least 64 rows at every T.

Triton builds 16- and 32-row tiles from mma.sync and 64-row tiles up from wgmma: the PTX of tests/sm90_compile.py's
invariant variants (built for sm_90 on a CPU, 2026-12-05) has mma.sync at T <= 256 and wgmma at T >= 1024 for bf16
qwen3-30b-a3b and gpt-oss-120b, and wgmma at every T for their 4-bit formats. Whether the two instruction
families sum a K step's products in the same order decides whether the mode's dense path is invariant from decode
to prefill; this measures it (a probe token alone against the same token in the middle of batches of 2 to 4096)
and what 64-row tiles cost at decode (CUDA graphs of 8 calls); the same for the router GEMM's 16- against 64-token
tiles.

    python benchmarks/ab_invariant_rows.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

import torch

from moekit import _invariant, fused_experts, presets, router_gemm
from moekit.experts import configs
from moekit.routing import tiers
from moekit.routing import triton_backend as router_triton
from moekit.tools.bench.timing import environment, graph_time_us

BATCHES = (2, 16, 129, 1024, 4096)
TIMED = (1, 16)


def _at_least_64_rows(choose):
    def chooser(*args):
        cfg, why = choose(*args)
        if args[-1] == "dense" and cfg.block_m < 64:
            return dataclasses.replace(cfg, block_m=64), why + "; rows raised to 64 (A/B)"
        return cfg, why
    return chooser


def measure(name: str) -> dict:
    spec = presets.get(name)
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    w13, w2 = (rand(E, 2 * I, H) * 0.02).bfloat16(), (rand(E, H, I) * 0.02).bfloat16()
    b13, b2 = ((rand(E, 2 * I) * 0.02).bfloat16(), (rand(E, H) * 0.02).bfloat16()) if spec.expert_bias else (None, None)

    def call(x, ids, tw):
        return fused_experts(x, w13, w2, tw, ids, activation=spec.activation, w13_bias=b13, w2_bias=b2)

    def routes(T):
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(1)[:, :k].int()
        return ids, torch.softmax(rand(T, k), -1)

    rows = {}
    real = configs._invariant_choose
    for label, chooser in (("as configured", real), ("at least 64 rows", _at_least_64_rows(real))):
        configs._invariant_choose = chooser
        try:
            with _invariant.batch_invariant():
                row = {}
                for T in BATCHES:
                    x, (ids, tw) = rand(T, H).bfloat16(), routes(T)
                    p = T // 2
                    batch = call(x, ids, tw)[p]
                    alone = call(x[p:p + 1].clone(), ids[p:p + 1].clone(), tw[p:p + 1].clone())[0]
                    row[f"bitwise T={T}"] = bool(torch.equal(batch.view(torch.int16), alone.view(torch.int16)))
                for T in TIMED:
                    calls = [(rand(T, H).bfloat16(), *routes(T)) for _ in range(8)]
                    row[f"us T={T}"] = round(graph_time_us([lambda c=c: call(*c) for c in calls]), 1)
        finally:
            configs._invariant_choose = real
        rows[label] = row
        print(name, label, row, flush=True)
    return rows


def _router_tiles_of_64(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms=132):
    return tiers.launch_config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms, 64,
                               16 if num_tokens <= 16 else 32, tiers.INVARIANT_BLOCK_K, splits=1, fin_t=1)


def measure_router(name: str) -> dict:
    """The router GEMM in the mode: 16-token tiles up to T=256 (mma.sync) and 64 above (wgmma), against 64-token
    tiles at every T."""
    spec = presets.get(name)
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(spec.num_experts, spec.hidden_size, device="cuda", generator=gen).bfloat16()
    b = torch.randn(spec.num_experts, device="cuda", generator=gen) if spec.router_bias else None
    rows = {}
    real = tiers.invariant_kernel_config
    for label, config in (("as configured", real), ("64-token tiles", _router_tiles_of_64)):
        tiers.invariant_kernel_config = config
        router_triton._router_plan.cache_clear()  # launch shapes are made once per shape: forget the other arm's
        try:
            with _invariant.batch_invariant():
                row = {}
                for T in BATCHES:
                    x = torch.randn(T, spec.hidden_size, device="cuda", generator=gen).bfloat16()
                    p = T // 2
                    batch = router_gemm(x, w, b)[p]
                    alone = router_gemm(x[p:p + 1].clone(), w, b)[0]
                    row[f"bitwise T={T}"] = bool(torch.equal(batch, alone))
                for T in TIMED:
                    xs = [torch.randn(T, spec.hidden_size, device="cuda", generator=gen).bfloat16() for _ in range(8)]
                    row[f"us T={T}"] = round(graph_time_us([lambda x=x: router_gemm(x, w, b) for x in xs]), 1)
        finally:
            tiers.invariant_kernel_config = real
            router_triton._router_plan.cache_clear()
        rows[label] = row
        print(name, "router", label, row, flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-120b"], choices=presets.names())
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/archive"))
    args = p.parse_args(argv)
    results = {name: measure(name) for name in args.presets}
    results.update({f"{name} router_gemm": measure_router(name) for name in args.presets})
    env = environment()
    stem = f"ab_invariant_rows_{datetime.date.today().isoformat()}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    cols = [f"bitwise T={T}" for T in BATCHES] + [f"us T={T}" for T in TIMED]
    lines = [f"# Batch-invariant dense row blocks ({env['gpu']}, {env['date']})", "",
             "| preset | rows | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    lines += [f"| {name} | {label} | " + " | ".join(str(row[c]) for c in cols) + " |"
              for name, by in results.items() for label, row in by.items()]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
