"""Batch-invariant router GEMM: every tile, its K splits folded and not (GPU).

A tile's rows and columns do not change the order of a logit's K terms, nor does folding the K splits into each
tile's program (the same additions), so batch-invariant mode picks both by shape (routing/tiers.py
invariant_kernel_config). This times router_gemm in the mode with each tile of SWEEP_TILES, folded and not, beside
the shipped choice and the default mode, in CUDA graphs; checks each variant's logits against the shipped ones bit
for bit on the same inputs (T in --tokens), and a probe token's bits alone and in batches of 1..1000
(moekit._invariant.token_mismatch). fused_router is timed with the shipped choice (it runs router_gemm's tiles).

    python benchmarks/experiments/ab_invariant_router_tiles.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moekit import _invariant, fused_router, presets, router_gemm
from moekit._calls import CheckedCalls
from moekit.routing import tiers
from moekit.routing import triton_backend as router_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_invariant_router import router_inputs  # noqa: E402  (a sibling script: the same router per preset)

PRESETS = ["qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b"]
TOKENS = [64, 256, 1024, 4096, 16384]
SWEEP_TILES = [(16, 16), (16, 32), (32, 32), (64, 32), (32, 64), (64, 64), (128, 64), (32, 128), (64, 128)]


def forced_config(block_t: int, block_r: int, fold: bool, token_finish: bool = False):
    """The mode's launch shape with this tile and this choice of folding, at every T. ``token_finish``: a GEMM
    without routing or LoRA finishes groups of tokens at once (the heuristic's finishing groups) instead of one token
    at a time: its finishing step only adds each split's partial sums in split order, an elementwise sum whose bits
    no layout changes (routing and the LoRA term reduce across a tile, so they keep one token)."""
    def config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms=132, ieee=False):
        splits, per_split = tiers.invariant_splits(hidden)
        folded = fold and splits > 1
        fin_t = None if token_finish and not fuse_topk and not rank else 1
        cfg = tiers.launch_config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms, block_t, block_r,
                                  tiers.INVARIANT_BLOCK_K, splits=1 if folded else splits, fin_t=fin_t)
        return replace(cfg, splits=1 if folded else splits, k_per_split=per_split, s_chunk=1, fold_splits=folded)
    return config


@contextlib.contextmanager
def invariant_config(config):
    real = tiers.invariant_kernel_config
    if config is not None:
        tiers.invariant_kernel_config = config
    router_backend._router_plan.cache_clear()
    CheckedCalls.forget_all()
    try:
        yield
    finally:
        tiers.invariant_kernel_config = real
        router_backend._router_plan.cache_clear()
        CheckedCalls.forget_all()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--no-timing", dest="timing", action="store_false", help="the bitwise checks only")
    p.add_argument("--tiles", nargs="+", default=[f"{t}x{r}" for t, r in SWEEP_TILES], help="e.g. 64x64 32x128")
    p.add_argument("--finish", choices=("one", "tokens", "both"), default="one",
                   help="unfolded variants' finishing step: one token at a time (as shipped), groups of tokens "
                        "(router_gemm only), or both")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from moekit.tools.bench.timing import archive_stem, environment, graph_time_us, write_results

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    tiles = [tuple(int(v) for v in tile.split("x")) for tile in args.tiles]
    variants = {"shipped": None}
    for bt, br in tiles:
        if args.finish in ("one", "both"):
            variants |= {f"{bt}x{br}{' fold' if fold else ''}": forced_config(bt, br, fold) for fold in (False, True)}
        if args.finish in ("tokens", "both"):
            variants[f"{bt}x{br} token groups"] = forced_config(bt, br, False, token_finish=True)
    lines = [f"# Batch-invariant router GEMM: every tile, folded and not ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16 x and router weights, CUDA graphs, us per call. "
             "same bits: the variant's logits against the shipped ones on the same inputs at every T; invariant: a "
             f"probe token alone and in batches of {', '.join(map(str, _invariant.SIZES))}.", "",
             "| preset | op | variant | same bits | invariant | " + " | ".join(f"T={t}" for t in args.tokens) + " |",
             "|---|---|---|---|---|" + "---|" * len(args.tokens)]
    records = []
    for name in args.presets:
        spec = presets.get(name)
        weight, bias, corr, xs, probe, others = router_inputs(spec, dev, args.tokens, max(_invariant.SIZES))
        kwargs = spec.routing_kwargs() | ({"correction_bias": corr} if corr is not None else {})
        ops = {"router_gemm": lambda x: router_gemm(x, weight, bias),
               "fused_router": lambda x: fused_router(x, weight, bias, top_k=spec.top_k, method=spec.routing,
                                                      **kwargs)}
        for op, call in ops.items():
            if args.timing:
                default = [graph_time_us([lambda x=xs[T]: call(x)] * 4) for T in args.tokens]
                lines.append(f"| {name} | {op} | default mode | - | - | " + " | ".join(f"{t:.1f}" for t in default)
                             + " |")
                records.append({"preset": name, "op": op, "variant": "default mode",
                                "us": dict(zip(map(str, args.tokens), default))})
            with _invariant.batch_invariant(True):
                with invariant_config(None):
                    shipped = {T: call(xs[T]) for T in args.tokens}
                for label, config in (variants if op == "router_gemm" else {"shipped": None}).items():
                    with invariant_config(config):
                        got = {T: call(xs[T]) for T in args.tokens}
                        same = all(all(torch.equal(a, b) for a, b in zip(
                            got[T] if isinstance(got[T], tuple) else (got[T],),
                            shipped[T] if isinstance(shipped[T], tuple) else (shipped[T],))) for T in args.tokens)
                        mismatch = _invariant.token_mismatch(lambda t: call(t["x"]), probe, others)
                        times = ([graph_time_us([lambda x=xs[T]: call(x)] * 4) for T in args.tokens]
                                 if args.timing else [])
                    lines.append(f"| {name} | {op} | {label} | {'yes' if same else 'NO'} | "
                                 f"{'yes' if mismatch is None else mismatch} | "
                                 + " | ".join(f"{t:.1f}" for t in times) + " |")
                    print(lines[-1], flush=True)
                    records.append({"preset": name, "op": op, "variant": label, "same_bits_as_shipped": same,
                                    "bitwise_invariant": mismatch is None, "mismatch": mismatch,
                                    "us": dict(zip(map(str, args.tokens), times))})
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        stem = "ab_invariant_router_tile_sweep" if args.finish == "one" else "ab_invariant_router_finish_groups"
        write_results(args.out, archive_stem(stem, env), env, records, md)


if __name__ == "__main__":
    main()
