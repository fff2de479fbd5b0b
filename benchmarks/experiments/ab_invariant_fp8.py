"""Which tile dimension still moves a token's bits with T in batch-invariant mode with FP8 products? (GPU)

W8A8 (fp8_block weights) and W4A8 (mxfp4 weights) with FP8 activations run 64-row wgmma tiles at every T in the
mode (experts/configs.py FP8_DOT_FORMATS). On an H100 (2026-12-05) tests/test_batch_invariant.py's GPU test still
failed for 6 of 14 preset x format cases (kimi-k2 and qwen3-235b-a22b among them). This runs the mode's bitwise
probe (moekit._invariant.token_mismatch: a token alone against the same token in batches of 2 to 4096) with the
mode's configurations as shipped and with parts of them pinned to one value at every T:

  gemm2 128 wide   GEMM2's column tile (it follows T: 32, 64 or 128)
  all pinned       64-row blocks, GEMM1 128 wide on 8 warps, GEMM2 128 wide on 4 warps, stages and program order
  all but rows     the same, with the row block following T (64 or 128)
  all but gemm2    the same, with GEMM2's column tile following T

The first variant that is invariant names the dimension to pin in configs._invariant_choose.

    python benchmarks/experiments/ab_invariant_fp8.py --presets qwen3-235b-a22b --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path

import torch

import moekit
from moekit import _invariant, fused_experts, presets
from moekit.experts import configs
from moekit.tools.bench.timing import environment
from moekit.tools.verify import invariance_checks

SIZES = (1, 2, 7, 64, 129, 1000, 4096)
R = dataclasses.replace


def _pinned(cfg, rows=True, gemm2=True):
    g1 = R(cfg.gemm1, block_n=128, num_warps=8, num_stages=3, group_m=1)
    g2 = R(cfg.gemm2, num_warps=4, num_stages=4, group_m=1, **({"block_n": 128} if gemm2 else {}))
    return R(cfg, gemm1=g1, gemm2=g2, **({"block_m": 64} if rows else {}))


VARIANTS = {
    "as shipped": lambda cfg: cfg,
    "gemm2 128 wide": lambda cfg: R(cfg, gemm2=R(cfg.gemm2, block_n=128)),
    "all pinned": _pinned,
    "all but rows": lambda cfg: _pinned(cfg, rows=False),
    "all but gemm2": lambda cfg: _pinned(cfg, gemm2=False),
}


def measure(name: str, weights: str) -> dict:
    spec, dev = presets.get(name), torch.device("cuda")
    E, H, k = spec.num_experts, spec.hidden_size, spec.top_k
    w13, w2, b13, b2 = invariance_checks._weights(spec, torch.bfloat16, dev, weights)

    def tokens(n):
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(n)]).to(dev, torch.int32)
        return {"x": torch.randn(n, H, device=dev).bfloat16(), "tw": torch.rand(n, k, device=dev), "ids": ids}

    def run(t):
        return fused_experts(t["x"], w13, w2, t["tw"], t["ids"], activation=spec.activation, w13_bias=b13,
                             w2_bias=b2, act_quant="fp8_group")

    probe, others = tokens(1), tokens(max(SIZES))
    shipped, out = configs._invariant_choose, {}
    try:
        for label, pin in VARIANTS.items():
            configs._invariant_choose = lambda *a, pin=pin: (lambda c: (pin(c[0]), c[1]))(shipped(*a))
            try:
                out[label] = _invariant.token_mismatch(run, probe, others, SIZES) or "invariant"
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is a result too
                out[label] = f"{type(exc).__name__}: {str(exc)[:160]}"
            print(f"{name} {weights} {label}: {out[label]}", flush=True)
    finally:
        configs._invariant_choose = shipped
    del w13, w2
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["qwen3-235b-a22b"], choices=presets.names())
    p.add_argument("--weights", nargs="+", default=["fp8_block", "mxfp4"], choices=["fp8_block", "mxfp4"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/archive"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    moekit.set_batch_invariant(True)
    results = {f"{n} {w}": measure(n, w) for n in args.presets for w in args.weights}
    env = environment()
    stem = f"ab_invariant_fp8_{datetime.date.today().isoformat()}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"env": env, "sizes": SIZES, "results": results}, indent=1))
    lines = [f"# Batch-invariant FP8 products: which tile dimension moves the bits ({env['gpu']}, {env['date']})", "",
             f"A token alone against the same token in batches of {', '.join(map(str, SIZES[1:]))}.", "",
             "| preset, weights | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    lines += [f"| {case} | " + " | ".join(str(r[v]) for v in VARIANTS) + " |" for case, r in results.items()]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
