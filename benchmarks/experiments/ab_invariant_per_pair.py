"""Batch-invariant experts at decode sizes: the aligned mode's four launches against the per-pair mode's three or
two (GPU).

Where the default mode runs a decode mode (T <= 2 in the heuristic, the tuned tables' GEMV buckets), batch-invariant
mode serves dense weights without alignment (moekit/experts/configs.py INVARIANT_PER_PAIR): GEMM1 per pair on the
aligned mode's 16-row tiles and K steps, then GEMM2 either per pair into the aligned mode's buffer and the combine
kernel (INVARIANT_PER_PAIR_SPLIT_SLOTS, three launches) or per token, each slot rounded as the combine's input (two
launches); 4-bit weights may take the three-launch form too (INVARIANT_PER_PAIR_4BIT, off). Per preset, format and T
this times (CUDA-graph replay over two layers)

- ``default``: the default mode's call (the mode off);
- ``aligned``: the mode's aligned config (what it served before the per-pair mode);
- ``per_pair split`` and ``per_pair tokens``: the two per-pair forms on the mode's tiles (4-bit: split only);

and checks bitwise that every token's row equals its row in a 64-token call in the mode (the aligned prefill path).

    python benchmarks/experiments/ab_invariant_per_pair.py --out $OUT/ab_invariant_per_pair   (about 2 min)
    python benchmarks/experiments/ab_invariant_per_pair.py --formats mxfp4 nvfp4 --out $OUT/ab_invariant_per_pair_4bit
"""

from __future__ import annotations

import argparse
import os
import sys
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

PROBE_BATCH = 64  # the aligned mode's rows at this T are the reference bits
FOUR_BIT_PRESETS = {"mxfp4": "gpt-oss-120b", "nvfp4": "qwen3-30b-a3b"}  # each format's checkpoint family


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


FLAGS = ("INVARIANT_PER_PAIR", "INVARIANT_PER_PAIR_SPLIT_SLOTS", "INVARIANT_PER_PAIR_4BIT")


def variants(spec, fmt: str, T: int) -> list[tuple[str, object, bool]]:
    """(label, config, the mode on) of each variant at T."""
    dims = (T, spec.num_experts, spec.top_k, 2 * spec.intermediate_size, spec.hidden_size)
    dev = torch.device("cuda")
    saved = {flag: getattr(expert_configs, flag) for flag in FLAGS}
    forms = [("aligned", False, True), ("per_pair split", True, True)] + (
        [("per_pair tokens", True, False)] if fmt == "dense" else [])
    out = []
    try:
        _invariant.set_batch_invariant(False)
        out.append(("default", expert_configs.choose(*dims, dev, torch.bfloat16, fmt)[0], False))
        _invariant.set_batch_invariant(True)
        for label, per_pair, split in forms:
            for flag, value in zip(FLAGS, (per_pair, split, per_pair)):
                setattr(expert_configs, flag, value)
            expert_configs._invariant_choose.cache_clear()
            cfg = expert_configs.invariant_choice(*dims, dev, torch.bfloat16, fmt)[0]
            if per_pair and cfg.mode != "per_pair":  # the mode aligns here: nothing to compare
                continue
            out.append((label, cfg, True))
    finally:
        for flag, value in saved.items():
            setattr(expert_configs, flag, value)
        expert_configs._invariant_choose.cache_clear()
    return out


def run(args, on_row=None) -> list[dict]:
    rows = []
    cases = [(name, fmt) for fmt in args.formats
             for name in (args.presets if fmt == "dense" else [FOUR_BIT_PRESETS[fmt]])]
    for name, fmt in cases:
        spec = presets.get(name)
        layers = random_weights(spec, layers=2, weight_format=fmt)
        torch.manual_seed(0)
        x_all = torch.randn(PROBE_BATCH, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        tw_all, ids_all = routes(spec, PROBE_BATCH)
        _invariant.set_batch_invariant(True)
        reference = fused_experts(x_all, *layers[0], tw_all, ids_all, activation=spec.activation, backend="triton")
        for T in args.tokens:
            x, tw, ids = x_all[:T].clone(), tw_all[:T].clone(), ids_all[:T].clone()
            for label, cfg, mode_on in variants(spec, fmt, T):
                def call(w13, w2, cfg=cfg, x=x, tw=tw, ids=ids):
                    return fused_experts(x, w13, w2, tw, ids, activation=spec.activation, backend="triton",
                                         config=cfg)
                try:
                    _invariant.set_batch_invariant(mode_on)
                    out = call(*layers[0])
                    bits = _same_bits(out, reference[:T]) if mode_on else None
                    us = graph_time_us([lambda w=w: call(*w) for w in layers], replays=20, warmup=3)
                    err = ""
                except Exception as exc:  # noqa: BLE001 - a config that does not build is a result too
                    us, bits, err = float("nan"), None, f"{type(exc).__name__}: {str(exc)[:100]}"
                _invariant.set_batch_invariant(True)
                row = {"preset": name, "format": fmt, "T": T, "variant": label, "config": str(cfg), "us": us,
                       "bits_as_in_batch": bits, "error": err}
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                print(f"{name:14s} {fmt:5s} T={T:3d} {label:16s} {us:8.1f} us bits={bits} {err}", flush=True)
        del layers
        torch.cuda.empty_cache()
    _invariant.set_batch_invariant(False)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Batch-invariant experts at decode sizes: aligned against per-pair ({meta['gpu']}, "
             f"{meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}; bf16 activations, CUDA-graph replay over two layers, us per call. "
             f"bits: every row equals the same token's row in a {PROBE_BATCH}-token call in batch-invariant mode "
             "(`benchmarks/experiments/ab_invariant_per_pair.py`).", "",
             "| preset | format | T | variant | us | / default | bits |", "|---|---|---:|---|---:|---:|---|"]
    base = {(r["preset"], r["format"], r["T"]): r["us"] for r in rows if r["variant"] == "default"}
    for r in rows:
        b = base.get((r["preset"], r["format"], r["T"]))
        extra = f" ({r['error']})" if r["error"] else ""
        lines.append(f"| {r['preset']} | {r['format']} | {r['T']} | {r['variant']}{extra} | {r['us']:.1f} | "
                     f"{r['us'] / b if b else float('nan'):.2f} | {r['bits_as_in_batch']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-120b", "mixtral-8x7b"],
                   choices=presets.names())
    p.add_argument("--formats", nargs="+", default=["dense"], choices=["dense", *FOUR_BIT_PRESETS],
                   help="dense runs --presets; each 4-bit format its checkpoint family's preset")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "ab_invariant_per_pair")
    args = p.parse_args(argv)
    run(args, row_writer(args.out, run_meta(), markdown))


if __name__ == "__main__":
    main()
