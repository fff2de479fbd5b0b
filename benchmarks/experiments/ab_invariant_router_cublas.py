"""Batch-invariant router logits from cuBLAS in fixed chunks of rows? (GPU)

In batch-invariant mode moekit's router GEMM runs its own Triton kernel at every T (a fixed order of K terms), and
at T = 256-16384 it takes 1.2-2x the default mode's time, which runs cuBLAS there
(benchmarks/results/archive/invariant_router_tile_rule_h100_2026-12-06.md). cuBLAS picks its kernel (tile, split-K)
by the problem's shape, so a plain GEMM's row changes its bits with T. This asks whether a shape that never changes
keeps them: x's rows in chunks of C (the last one zero-padded), every chunk the same [C, H] @ [H, E] product, as one
strided-batched GEMM (torch.bmm with fp32 output) of T / C chunks, or one torch.mm per chunk:

  bmm C      torch.bmm(x.view(B, C, H), w.T expanded to [B, H, E], out_dtype=fp32): one launch; cuBLAS may still
             pick its kernel by the batch count B
  mm C       torch.mm(chunk, w.T, out_dtype=fp32) per chunk: the same call at every T, B launches

Each variant: a probe token's logits alone and among batches of 1..1000 at three positions, and at the T of the
timing (moekit._invariant.token_mismatch); CUDA-graph time against the default mode's router_gemm and the mode's
(the Triton kernel), T = 1..16384. A variant bitwise invariant on every preset and T, and near the default's time,
would be the mode's router GEMM at many tokens (T=1 included: one order at every T).

    python benchmarks/experiments/ab_invariant_router_cublas.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from moekit import _invariant, presets, router_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_invariant_router import router_inputs  # noqa: E402  (a sibling script: the same router per preset)

PRESETS = ["qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b"]
TOKENS = [1, 16, 64, 256, 1024, 4096, 16384]
CHUNKS = [64, 128, 256]


def chunked(weight: torch.Tensor, bias: torch.Tensor | None, chunk: int, batched: bool):
    """``x [T, H] -> fp32 logits [T, E]`` from fixed [chunk, H] products (the last chunk zero-padded)."""
    wt = weight.T
    kw = {"out_dtype": torch.float32} if weight.dtype != torch.float32 else {}  # fp32 inputs: fp32 already

    def logits(x: torch.Tensor) -> torch.Tensor:
        T, H = x.shape
        pad = -T % chunk
        if pad:
            x = torch.cat([x, x.new_zeros(pad, H)])
        blocks = x.shape[0] // chunk
        if batched:
            out = torch.bmm(x.view(blocks, chunk, H), wt.expand(blocks, *wt.shape), **kw)
            out = out.view(blocks * chunk, -1)
        else:
            out = torch.cat([torch.mm(part, wt, **kw) for part in x.split(chunk)])
        out = out[:T]
        return out + bias if bias is not None else out
    return logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--chunks", nargs="+", type=int, default=CHUNKS)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from moekit.tools.bench.timing import archive_stem, environment, graph_time_us, write_results

    dev = "cuda"
    env = environment()
    lines = [f"# Batch-invariant router logits from cuBLAS in fixed chunks ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16 x and router weights, fp32 logits, CUDA graphs, us "
             f"per call. invariant: a probe token alone and in batches of {', '.join(map(str, _invariant.SIZES))} and "
             "of every T timed, first, middle and last.", "",
             "| preset | variant | invariant | " + " | ".join(f"T={t}" for t in args.tokens) + " |",
             "|---|---|---|" + "---|" * len(args.tokens)]
    records = []
    for name in args.presets:
        spec = presets.get(name)
        weight, bias, _, xs, probe, others = router_inputs(spec, dev, args.tokens,
                                                           max(max(_invariant.SIZES), max(args.tokens)))
        sizes = sorted(set(_invariant.SIZES) | set(args.tokens))

        def row(label, call, invariant_check=True):
            mismatch = (_invariant.token_mismatch(lambda t: call(t["x"]), probe, others, sizes)
                        if invariant_check else "-")
            times = [graph_time_us([lambda x=xs[T]: call(x)] * 4) for T in args.tokens]
            verdict = "-" if mismatch == "-" else ("yes" if mismatch is None else mismatch)
            lines.append(f"| {name} | {label} | {verdict} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
            print(lines[-1], flush=True)
            records.append({"preset": name, "variant": label, "bitwise_invariant": mismatch is None,
                            "mismatch": None if mismatch in (None, "-") else mismatch,
                            "us": dict(zip(map(str, args.tokens), times))})

        row("default mode", lambda x: router_gemm(x, weight, bias), invariant_check=False)
        with _invariant.batch_invariant(True):
            row("invariant mode (Triton)", lambda x: router_gemm(x, weight, bias))
        for chunk in args.chunks:
            for batched in (True, False):
                row(f"{'bmm' if batched else 'mm'} {chunk}", chunked(weight, bias, chunk, batched))
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        write_results(args.out, archive_stem("ab_invariant_router_cublas", env), env, records, md)


if __name__ == "__main__":
    main()
