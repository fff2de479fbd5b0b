"""Low-precision experts benchmark (GPU): weights in a 4-bit or FP8 format in moekit's kernels
(W4A16, FP8 W8A8) against moekit's own bf16 experts and the best bf16 peer (torch grouped_mm),
measured in the same run; MXFP4 rows also time W4A8 (act_quant="fp8_group": the codes recoded to
E4M3 for FP8 tensor cores), checked against its own reference. Also `moekit bench --weights native`.

Cases: each preset in its checkpoint format by default (gpt-oss in MXFP4, qwen3 in NVFP4,
DeepSeek-V3 / Kimi-K2 in FP8 128x128 blocks as W8A8), or one format for all. Timing as the
experts benchmark (CUDA-graph replay; 8 calls over 4 layers for T <= 64, 2 layers for 256
experts). Floors: the low-bit bytes of the distinct experts hit (codes + scales) at 4.2 TB/s (timing.COPY_BW), or
the FLOPs at the measured bf16 rate (FP8: twice it), whichever is larger. Accuracy per row:
against float64 on the dequantized weights (W8A8: and E4M3-rounded activations), and (reported,
not gated) against the unquantized bf16 layer.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import torch

from ... import presets, reference
from ...experts import fused_experts
from ...formats import dequantize, prepare, quantize_experts
from ...metrics import rel_errors
from .experts import (Progress, _gen, _torch_grouped_mm, make_cases, matmul_rate, reseed, save, script_main,
                      time_impl)
from .timing import COPY_BW, copy_rate_words

FORMATS = ("mxfp4", "nvfp4", "fp8_block", "fp8_channel")


def preset_recipe(preset: str, weights: str) -> str:
    """The quantize recipe (moekit.formats.RECIPES) ``preset`` is benchmarked in: its checkpoint's for "native", else ``weights``."""
    if weights != "native":
        if weights not in FORMATS:
            raise ValueError(f"weights must be 'native' or one of {FORMATS}, got {weights!r}")
        return weights
    if preset not in NATIVE:
        raise ValueError(f"{preset} has no low-bit checkpoint format here; pass one of {FORMATS}")
    return NATIVE[preset]


NATIVE = {"gpt-oss-120b": "mxfp4", "gpt-oss-20b": "mxfp4", "qwen3-30b-a3b": "nvfp4", "deepseek-v3": "fp8_block",
          "kimi-k2": "fp8_block"}
"""Each preset's checkpoint format (``weights="native"``)."""
DEFAULT_PRESETS = ["gpt-oss-120b", "qwen3-30b-a3b", "deepseek-v3"]
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
BYTES_PER_WEIGHT = {"mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16, "fp8_block": 1 + 4 / (128 * 128), "fp8_channel": 1.0}


class LowBitLayer:
    """One layer: bf16 weights (for moekit bf16 and the peer) and their quantized copy."""

    def __init__(self, spec, fmt):
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        g = _gen("cuda")
        self.spec = spec
        self.w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g).mul_(H ** -0.5)
        self.w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g).mul_(I ** -0.5)
        self.b13 = self.b2 = None
        if spec.expert_bias:
            self.b13 = torch.randn(E, 2 * I, device="cuda", dtype=torch.bfloat16, generator=g).mul_(0.02)
            self.b2 = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=g).mul_(0.02)
        # 4-bit codes as FusedMoE keeps them (formats.prepare; FP8 stacks as they are)
        self.q13, self.q2 = prepare(quantize_experts(self.w13, fmt)), prepare(quantize_experts(self.w2, fmt))
        self.act_quant = "fp8_group" if fmt.startswith("fp8") else None

    def dequantized(self):
        return dequantize(self.q13), dequantize(self.q2)


def run(args, progress: Progress | None = None):
    progress = progress or Progress()
    rate = matmul_rate()
    records = []
    for name in args.presets:
        spec, fmt = presets.get(name), preset_recipe(name, args.weights)
        # deepseek-v3: a bf16 layer is 22.5 GB; two layers (and the error check's fp32 copy) fit in memory.
        reseed(f"{name} {fmt} weights")
        layers = [LowBitLayer(spec, fmt) for _ in range(min(args.layers, 2 if spec.num_experts > 128 else 4))]
        act = spec.activation

        def lowbit(x, layer, tw, tid, act_quant=None):  # the format's own activations unless told
            return fused_experts(x, layer.q13, layer.q2, tw, tid, activation=act, w13_bias=layer.b13, w2_bias=layer.b2,
                                 act_quant=act_quant or layer.act_quant)

        w4a8 = functools.partial(lowbit, act_quant="fp8_group")

        def bf16(x, layer, tw, tid):
            return fused_experts(x, layer.w13, layer.w2, tw, tid, activation=act, w13_bias=layer.b13, w2_bias=layer.b2)

        # W4A8 needs FP8 tensor cores (below, the oracle would time the torch backend instead)
        has_w4a8 = fmt == "mxfp4" and torch.cuda.get_device_capability() >= (8, 9)
        impls = {"moekit_lowbit": lowbit, "moekit_w4a8": w4a8 if has_w4a8 else None, "moekit_bf16": bf16,
                 "torch_grouped_mm": _torch_grouped_mm}
        for T in args.tokens:
            progress.case(name, T)
            cases = make_cases(spec, T, layers)
            hit = torch.unique(cases[0][3]).numel()
            params = 3 * spec.hidden_size * spec.intermediate_size
            row = {"preset": name, "format": fmt, "T": T, "experts_hit": hit,
                   # 4-bit runs bf16 tensor cores (on Hopper), W8A8 FP8 ones at twice the bf16 rate
                   "floor_lowbit_us": max(hit * params * BYTES_PER_WEIGHT[fmt] / COPY_BW,
                                          2 * T * spec.top_k * params / (rate * (2 if fmt.startswith("fp8") else 1))) * 1e6,
                   "floor_bf16_us": max(hit * params * 2 / COPY_BW, 2 * T * spec.top_k * params / rate) * 1e6}
            row["floor_us"] = row["floor_lowbit_us"]  # what `--metric floor` plots
            for impl, fn in impls.items():
                if fn is None:
                    row[impl], row[f"{impl}_mode"] = None, "-"  # W4A8: not MXFP4, or no FP8 tensor cores
                    continue
                row[impl], row[f"{impl}_mode"] = time_impl(impl, fn, cases)
            if row.get("moekit_lowbit"):
                x, layer, tw, tid = cases[0]
                if layer.act_quant:  # W8A8: float64 on dequantized weights AND quantize-dequantized activations
                    ref = reference.fused_experts_w8a8(x, layer.q13, layer.q2, tw, tid, activation=act,
                                                       w13_bias=layer.b13, w2_bias=layer.b2)
                else:
                    d13, d2 = layer.dequantized()
                    ref = reference.fused_experts(x, d13, d2, tw, tid, activation=act, w13_bias=layer.b13,
                                                  w2_bias=layer.b2)
                    del d13, d2
                row["lowbit_err_vs_dequantized"] = rel_errors(lowbit(*cases[0]), ref)[1]
                del ref
                ref16 = reference.fused_experts(x, layer.w13, layer.w2, tw, tid, activation=act, w13_bias=layer.b13,
                                                w2_bias=layer.b2)
                row["lowbit_err_vs_bf16_layer"] = rel_errors(lowbit(*cases[0]), ref16)[1]  # reported, not gated
                del ref16
                row["speedup_vs_bf16"] = row["moekit_bf16"] / row["moekit_lowbit"]
                row["lowbit_floor_ratio"] = row["moekit_lowbit"] / row["floor_lowbit_us"]
            if row.get("moekit_w4a8"):  # against float64 on the MXFP4 weights and E4M3-rounded activations
                x, layer, tw, tid = cases[0]
                ref = reference.fused_experts_w8a8(x, layer.q13, layer.q2, tw, tid, activation=act,
                                                   w13_bias=layer.b13, w2_bias=layer.b2)
                row["w4a8_err_vs_reference"] = rel_errors(w4a8(*cases[0]), ref)[1]
                row["w4a8_vs_lowbit"] = row["moekit_w4a8"] / row["moekit_lowbit"]
                del ref
            records.append(row)
            progress.row(row)
            del cases
        del layers
        torch.cuda.empty_cache()
        save(args, records, rate, markdown)
    return records, rate


def markdown(records, env, rate):
    cols = ["moekit_lowbit", "moekit_bf16", "torch_grouped_mm"]
    lines = _lowbit_table(records, env, rate, cols)
    w4a8 = [r for r in records if r.get("moekit_w4a8") is not None]
    if w4a8:
        lines += ["", "W4A8 (MXFP4 weights recoded to E4M3, activations in 1x128 E4M3 groups; an accuracy mode, not a "
                  "speed path: its error is against float64 on the MXFP4 weights and E4M3-rounded activations).", "",
                  "| preset | T | moekit_w4a8 | moekit_lowbit (W4A16) | moekit_bf16 | w4a8 / W4A16 time | err vs reference |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['T']} | {r['moekit_w4a8']:.1f} | {r['moekit_lowbit']:.1f} | "
                  f"{r['moekit_bf16']:.1f} | {r['w4a8_vs_lowbit']:.2f} | {r['w4a8_err_vs_reference']:.5f} |" for r in w4a8]
    return "\n".join(lines) + "\n"


def _lowbit_table(records, env, rate, cols) -> list[str]:
    lines = [f"# Low-bit experts benchmark ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}. us per call, CUDA-graph replay; 4-bit codes prepared "
             f"as FusedMoE keeps them (formats.prepare). bf16 matmul rate {rate / 1e12:.0f} TFLOP/s. lowbit floor = "
             f"max(packed bytes + scales of the experts hit at {copy_rate_words(env)}, FLOPs at the bf16 rate "
             "(FP8: twice it)).", "",
             "| preset | format | T | " + " | ".join(cols) + " | bf16 / lowbit | lowbit floor us | x floor | err vs dequant | err vs bf16 |",
             "|---|---|---|" + "---|" * (len(cols) + 5)]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in records:
        cells = [f(r.get(c)) if r.get(c) is not None else r.get(f"{c}_mode", "-") for c in cols]
        lines.append(f"| {r['preset']} | {r['format']} | {r['T']} | " + " | ".join(cells) +
                     f" | {f(r.get('speedup_vs_bf16'), 2)} | {f(r['floor_lowbit_us'])} | {f(r.get('lowbit_floor_ratio'), 2)}"
                     f" | {f(r.get('lowbit_err_vs_dequantized'), 5)} | {f(r.get('lowbit_err_vs_bf16_layer'), 4)} |")
    return lines


IMPLS = ["moekit_lowbit", "moekit_w4a8", "moekit_bf16", "torch_grouped_mm"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", "--presets", dest="presets", nargs="+", default=DEFAULT_PRESETS)
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--weights", default="native", help=f"'native' (each preset's checkpoint format) or one of {FORMATS}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    p.add_argument("--name", default="lowbit")


def main(argv=None) -> None:
    script_main(__doc__, add_arguments, run, markdown, argv)
