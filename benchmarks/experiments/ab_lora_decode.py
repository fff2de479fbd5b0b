"""Decode LoRA: the adapters' terms inside the two GEMVs against the separate shrink/expand kernels (GPU).

fused_experts at T = 1 and 4 on the H200-tuned decode configurations (experts/tuned_configs.json, forced, so that
another GPU runs the same kernels), rank-16 adapters (one, and four mixed), CUDA-graph replay of 8 calls over 2
layers. "in the GEMVs": contiguous stacks (experts/lora.py decode_terms: one shrink launch, GEMV1 as its
programmatic dependent, W2's shrink reduced in GEMV1 and its term added in GEMV2); "separate": the same values in
strided stacks, which take the shrink/expand kernels (four more launches); "in the GEMVs, GEMV1 N columns"
(--gemv1-block-n): the terms in the GEMVs with GEMV1's column block widened from the tuned one (fewer programs,
each with the same epilogue: the wait for the shrink, W2's partial store, the arrival counter), against the same
tuned base. Prints a markdown table; --out also writes it (markdown and JSON), with the per-kernel device time of
the fused call at T=1.

    python benchmarks/experiments/ab_lora_decode.py --gemv1-block-n 32 64 --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from moekit import FusedMoE, fused_experts, presets
from moekit.experts import ExpertsConfig, ExpertsLoRA
from moekit.metrics import rel_errors
from moekit.tools.bench.lora import lora_ids, random_lora
from moekit.tools.bench.timing import archive_stem, environment, graph_time_us, kernel_times_us, write_results

TABLE_KEY = "NVIDIA H200|triton-3.6.0|bfloat16"
TABLE = Path(__file__).resolve().parents[2] / "src/moekit/experts/tuned_configs.json"


def strided(lora: ExpertsLoRA) -> ExpertsLoRA:
    """The same adapters with the rank axis of every stack not innermost (not contiguous)."""
    return ExpertsLoRA(*(t.transpose(2, 3).contiguous().transpose(2, 3) for t in (lora.w13_a, lora.w13_b, lora.w2_a,
                                                                                   lora.w2_b)), scaling=lora.scaling)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-120b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    p.add_argument("--gemv1-block-n", nargs="*", type=int, default=[], help="wider GEMV1 column blocks to try")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    table = json.loads(TABLE.read_text())[TABLE_KEY]
    env = environment()
    lines = [f"# Decode LoRA: terms in the GEMVs against separate kernels ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16, rank 16, H200-tuned decode configs, CUDA-graph "
             "replay (us per call).", "",
             "| preset | adapters | T | base us | variant | + LoRA us | overhead | max rel diff |",
             "|---|---|---|---|---|---|---|---|"]
    profiles, records = [], []
    torch.manual_seed(0)
    for name in args.presets:
        spec = presets.get(name)
        shape = f"E{spec.num_experts}_N{2 * spec.intermediate_size}_K{spec.hidden_size}"
        layers = [FusedMoE(spec, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        for n in (1, 4):
            lora = random_lora(spec, n, 16)
            for T in args.tokens:
                cfg = ExpertsConfig.from_dict(table[shape][str(T)])
                variants = {"in the GEMVs": (lora, cfg), "separate": (strided(lora), cfg)}
                for bn in args.gemv1_block_n if cfg.mode == "gemv" else ():
                    if bn != cfg.gemm1.block_n:
                        variants[f"in the GEMVs, GEMV1 {bn} columns"] = (lora, replace(cfg, gemm1=replace(cfg.gemm1,
                                                                                                      block_n=bn)))
                cases = []
                for i in range(8):
                    layer = layers[i % 2]
                    x = torch.randn(T, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
                    with torch.no_grad():
                        tw, tid = layer.route(x)
                    cases.append((layer, x, tw, tid, lora_ids(T, n)))

                def call(case, adapters, cfg=cfg):
                    layer, x, tw, tid, ids = case
                    kw = dict(activation=spec.activation, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, config=cfg)
                    if adapters is None:
                        return lambda: fused_experts(x, layer.w13, layer.w2, tw, tid, **kw)
                    return lambda: fused_experts(x, layer.w13, layer.w2, tw, tid, lora=adapters, lora_ids=ids, **kw)

                with torch.no_grad():
                    base = graph_time_us([call(c, None) for c in cases], replays=50)
                    separate = call(cases[0], *variants["separate"])().float()
                    for label, (adapters, variant_cfg) in variants.items():
                        us = graph_time_us([call(c, adapters, variant_cfg) for c in cases], replays=50)
                        diff = rel_errors(call(cases[0], adapters, variant_cfg)().float(), separate)[0]
                        records.append({"preset": name, "adapters": n, "T": T, "base_us": base, "variant": label,
                                        "gemv1_block_n": variant_cfg.gemm1.block_n, "lora_us": us,
                                        "max_rel_diff_vs_separate": diff})
                        lines.append(f"| {name} | {n} | {T} | {base:.1f} | {label} | {us:.1f} | {us / base - 1:+.0%} | "
                                     f"{diff:.1e} |")
                        print(lines[-1], flush=True)
                    if T == 1 and n == 1:
                        profiles += [f"{name} T=1: {k} {t:.1f} us x{c}" for k, t, c in
                                     kernel_times_us(call(cases[0], lora))]
        del layers
        torch.cuda.empty_cache()
    md = "\n".join(lines + ["", "Device time per kernel of the call with terms in the GEMVs (eager, torch.profiler; "
                                "GEMV2 starts early under PDL, so its time includes its wait):", ""]
                   + [f"- {line}" for line in profiles]) + "\n"
    print(md)
    if args.out:
        write_results(args.out, archive_stem("ab_lora_decode", env), env, records, md, kernels=profiles)


if __name__ == "__main__":
    main()
