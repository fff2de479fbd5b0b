"""Batch-invariant router GEMM: tiles that fill the SMs (GPU).

In batch-invariant mode the router GEMM's tiles grow with T by fixed thresholds (routing/tiers.py
invariant_kernel_config: 16 x 16 up to T=16, 16 x 32 to 256, 64 x 32 to 2048, 128 x 64 above), and the K splits fold
into each tile's program once the tiles reach one per INVARIANT_FOLD_SMS SMs. On an H100 the mode missed its 1.10x
target at T = 1024-4096 (router_gemm 1.23-2.25x) and deepseek-v3 T=64 (2.60x)
(benchmarks/results/archive/invariant_router_h100_2026-12-06.md): qwen3-30b-a3b T=4096 runs 64 tiles on 132 SMs,
mixtral-8x7b (one row block) 32, deepseek-v3 T=64 folds 32 tiles that each walk all of H=7168. A tile's rows and
columns do not change the order of a logit's K terms, nor does folding (the same additions), so other shapes give the
same bits. This measures, in the mode:

  shipped      invariant_kernel_config as it is
  fill         the same, the tile halved (128x64 -> 64x32 -> 16x32 -> 16x16) until the tiles fill the SMs
  fill, fold   fill, and the splits folded only where the tiles alone fill the SMs

each one's CUDA-graph time of router_gemm and fused_router against the default mode's, a probe token's bits alone and
in batches of 1..1000 (moekit._invariant.token_mismatch), and whether each variant's logits equal the shipped ones bit
for bit on the same inputs (T in --tokens).

    python benchmarks/ab_invariant_router_tiles.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moekit import _invariant, fused_router, presets, router_gemm
from moekit._calls import CheckedCalls
from moekit.routing import tiers
from moekit.routing import triton_backend as router_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_invariant_router import router_weights  # noqa: E402  (a sibling script: the same router per preset)

PRESETS = ["qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b"]
TOKENS = [64, 256, 1024, 4096, 16384]
TILES = [(128, 64), (64, 32), (16, 32), (16, 16)]  # the mode's tile shapes, largest first


def _tiles(num_tokens: int, num_experts: int, rank: int, block_t: int, block_r: int) -> int:
    return (tiers._triton.cdiv(num_experts, block_r) + tiers._triton.cdiv(rank, block_r)) * tiers._triton.cdiv(
        num_tokens, block_t)


def variant_config(fold_rule: str):
    """invariant_kernel_config with its tile shrunk until the tiles fill the SMs; ``fold_rule``: "shipped" (fold from
    one tile per INVARIANT_FOLD_SMS SMs) or "filled" (fold only where the tiles fill the SMs)."""
    shipped = tiers.invariant_kernel_config

    def config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms=132):
        base = shipped(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms)
        shapes = [s for s in TILES if s[0] <= base.block_t and s[1] <= base.block_r]
        block_t, block_r = shapes[-1]
        for bt, br in shapes:
            if _tiles(num_tokens, num_experts, rank, bt, br) >= num_sms:
                block_t, block_r = bt, br
                break
        splits, per_split = tiers.invariant_splits(hidden)
        tiles = _tiles(num_tokens, num_experts, rank, block_t, block_r)
        fold = splits > 1 and (tiles * tiers.INVARIANT_FOLD_SMS >= num_sms if fold_rule == "shipped"
                               else tiles >= num_sms)
        cfg = tiers.launch_config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms, block_t, block_r,
                                  tiers.INVARIANT_BLOCK_K, splits=1 if fold else splits, fin_t=1)
        return replace(cfg, splits=1 if fold else splits, k_per_split=per_split, s_chunk=1, fold_splits=fold)
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
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from moekit.tools.bench.timing import environment, graph_time_us, write_results

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    variants = {"shipped": None, "fill": variant_config("shipped"), "fill, fold": variant_config("filled")}
    lines = [f"# Batch-invariant router GEMM: tiles that fill the SMs ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16 x and router weights, CUDA graphs, us per call. "
             "same bits: the variant's logits against the shipped ones on the same inputs at every T; invariant: a "
             f"probe token alone and in batches of {', '.join(map(str, _invariant.SIZES))}.", "",
             "| preset | op | variant | same bits | invariant | " + " | ".join(f"T={t}" for t in args.tokens) + " |",
             "|---|---|---|---|---|" + "---|" * len(args.tokens)]
    records = []
    for name in args.presets:
        spec = presets.get(name)
        H = spec.hidden_size
        g = torch.Generator(device=dev).manual_seed(0)
        weight, bias, corr = router_weights(spec, dev, g)
        kwargs = spec.routing_kwargs() | ({"correction_bias": corr} if corr is not None else {})
        xs = {T: torch.randn(T, H, device=dev, generator=g).bfloat16() for T in args.tokens}
        probe = {"x": torch.randn(1, H, device=dev, generator=g).bfloat16()}
        others = {"x": torch.randn(max(_invariant.SIZES), H, device=dev, generator=g).bfloat16()}
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
                for label, config in variants.items():
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
        gpu = env["gpu"].split()[1].lower() if len(env["gpu"].split()) > 1 else "cpu"
        write_results(args.out, f"ab_invariant_router_tiles_{gpu}_{datetime.date.today().isoformat()}", env,
                      records, md)


if __name__ == "__main__":
    main()
