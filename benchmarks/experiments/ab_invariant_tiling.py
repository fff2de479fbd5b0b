"""Batch-invariant experts: which of the default mode's tiling choices keep a token's bits (GPU).

The mode runs the aligned tensor-core GEMMs at every T with one K step per shape class and half-height tail blocks
off (moekit/experts/configs.py, _invariant_choose). With 16-bit activations a GEMM adds its K terms as a chain of
MMA instructions on one accumulator (tl.dot(a, w, acc)), whatever the K step, and the tile's row count was measured
to keep the bits (archive/ab_invariant_rows_2026-12-05.md): if so, a longer K step and half tails keep them too, and
the mode could run the default mode's own aligned configs. Per preset, format and T this runs

- ``invariant``: the mode's config;
- ``+half``: the same with half tails on in both GEMMs;
- ``bkN``: the same with another K step (stages scaled to the same bytes in flight);
- ``default``: the default mode's config at that T, where it is aligned;
- at T <= 16, no half tails (16-row blocks have none) but K steps up to 256, ``per_pair`` (dense weights: the
  per-pair tensor-core mode on the mode's tiles, two launches, no alignment; ab_invariant_per_pair.py compares its
  forms) and ``default`` whatever its mode (time only);

each timed (CUDA-graph replay over two layers) and checked bitwise: a probe token's output row in the T-token call
against the same token alone (T=1, the mode's own config), and the whole output against the ``invariant`` row's.

    python benchmarks/experiments/ab_invariant_tiling.py --out $OUT/tiling
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moekit import _invariant, presets  # noqa: E402
from moekit.experts import configs as expert_configs  # noqa: E402
from moekit.experts import fused_experts  # noqa: E402
from moekit.tools.bench.experts import routes  # noqa: E402
from moekit.tools.bench.timing import graph_time_us  # noqa: E402
from moekit.tools.tune import random_weights  # noqa: E402
from _results import row_writer, run_meta  # noqa: E402

CASES = {"gpt-oss-120b": ("mxfp4", "dense"), "qwen3-30b-a3b": ("nvfp4", "dense"), "mixtral-8x7b": ("dense",)}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _with(cfg, **opts):
    return replace(cfg, gemm1=replace(cfg.gemm1, **opts), gemm2=replace(cfg.gemm2, **opts))


def _k_step(cfg, block_k: int):
    g1, g2 = cfg.gemm1, cfg.gemm2
    stages = lambda g: max(2, min(6, g.num_stages * g.block_k // block_k))  # noqa: E731 - same bytes in flight
    return replace(cfg, gemm1=replace(g1, block_k=block_k, num_stages=stages(g1)),
                   gemm2=replace(g2, block_k=block_k, num_stages=stages(g2)))


def variants(spec, fmt: str, T: int, k_steps) -> list[tuple[str, object]]:
    dims = (T, spec.num_experts, spec.top_k, 2 * spec.intermediate_size, spec.hidden_size)
    inv = expert_configs.invariant_choice(*dims, torch.device("cuda"), torch.bfloat16, fmt)[0]
    _invariant.set_batch_invariant(False)
    default = expert_configs.choose(*dims, torch.device("cuda"), torch.bfloat16, fmt)[0]
    _invariant.set_batch_invariant(True)
    out = [("invariant", inv)]
    if T > 16:
        out.append(("+half", _with(inv, half_tails=True)))
    out += [(f"bk{bk}", _k_step(inv, bk)) for bk in k_steps if bk != inv.gemm1.block_k and (bk <= 128 or T <= 16)]
    if T <= 16 and fmt == "dense" and inv.mode == "aligned":  # the per-pair tensor-core mode on the mode's tiles
        out.append(("per_pair", replace(inv, mode="per_pair")))
    if default.mode == "aligned" or T <= 16:  # (at decode the default's time whatever its mode)
        out.append(("default", default))
    return out


def run(args, on_row=None) -> list[dict]:
    rows = []
    _invariant.set_batch_invariant(True)
    for name in args.presets:
        spec = presets.get(name)
        for fmt in CASES[name]:
            if fmt not in args.formats:
                continue
            layers = random_weights(spec, layers=2, weight_format=fmt)
            for T in args.tokens:
                torch.manual_seed(T)
                x = torch.randn(T, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
                tw, ids = routes(spec, T)
                pos = T // 2

                def call(w13, w2, config, x=x, tw=tw, ids=ids):
                    return fused_experts(x, w13, w2, tw, ids, activation=spec.activation, backend="triton",
                                         config=config)

                alone = fused_experts(x[pos:pos + 1].clone(), *layers[0], tw[pos:pos + 1].clone(),
                                      ids[pos:pos + 1].clone(), activation=spec.activation, backend="triton")
                base = None
                for label, cfg in variants(spec, fmt, T, args.k_steps):
                    decode = cfg.mode != "aligned"  # the default's decode mode: timed with the mode off (which
                    # refuses it), bits not compared
                    try:
                        _invariant.set_batch_invariant(not decode)
                        out = call(*layers[0], cfg)
                        base = out if base is None else base
                        probe, same = ((None, None) if decode else
                                       (_same_bits(out[pos:pos + 1], alone), _same_bits(out, base)))
                        us = graph_time_us([lambda w=w: call(*w, cfg) for w in layers], replays=10, warmup=2)
                        err = ""
                    except Exception as exc:  # noqa: BLE001 - a config that does not build is a result too
                        us, probe, same, err = float("nan"), None, None, f"{type(exc).__name__}: {str(exc)[:100]}"
                    _invariant.set_batch_invariant(True)
                    row = {"preset": name, "format": fmt, "T": T, "variant": label, "config": str(cfg), "us": us,
                           "probe_bits_as_alone": probe, "bits_as_invariant": same, "error": err}
                    rows.append(row)
                    if on_row is not None:
                        on_row(rows)
                    print(f"{name:14s} {fmt:6s} T={T:5d} {label:10s} {us:9.1f} us probe={probe} same={same} {err}",
                          flush=True)
            del layers
            torch.cuda.empty_cache()
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Batch-invariant experts: tiling choices and a token's bits ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}. Whole fused_experts calls, CUDA-graph replay over two "
             "layers. probe: the middle token's row has the bits of the same token alone (T=1, the mode's config); "
             "same: the whole output has the bits of the mode's config at that T.", "",
             "| preset | format | T | variant | us | / invariant | probe | same |", "|---|---|---|---|---:|---:|---|---|"]
    base = {(r["preset"], r["format"], r["T"]): r["us"] for r in rows if r["variant"] == "invariant"}
    for r in rows:
        b = base.get((r["preset"], r["format"], r["T"]))
        ratio = r["us"] / b if b else float("nan")
        extra = f" ({r['error']})" if r["error"] else ""
        lines.append(f"| {r['preset']} | {r['format']} | {r['T']} | {r['variant']}{extra} | {r['us']:.1f} | "
                     f"{ratio:.3f} | {r['probe_bits_as_alone']} | {r['bits_as_invariant']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--formats", nargs="+", default=["mxfp4", "nvfp4", "dense"])
    p.add_argument("--tokens", nargs="+", type=int, default=[64, 256, 1024, 4096])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "ab_invariant_tiling")
    p.add_argument("--k-steps", nargs="+", type=int, default=[128, 256])
    args = p.parse_args(argv)
    run(args, row_writer(args.out, run_meta(), markdown))


if __name__ == "__main__":
    main()
