"""Low-precision experts benchmark (GPU): weights in a 4-bit or FP8 format in moekit's kernels
(W4A16, FP8 W8A8) against moekit's own bf16 experts and the best bf16 peer (torch grouped_mm),
measured in the same run; MXFP4 rows also time W4A8 (act_quant="fp8_group": the codes recoded to
E4M3 for FP8 tensor cores), checked against its own reference. Also `moekit bench --weights native`.

Cases: each preset in its checkpoint format by default (gpt-oss in MXFP4, qwen3 in NVFP4,
DeepSeek-V3 / Kimi-K2 in FP8 128x128 blocks as W8A8), or one format for all. Timing as the
experts benchmark (CUDA-graph replay; 8 calls, each with its own routing, over 4 layers for T <= 64, 2 layers
for 256 experts). Floors (floors.py, as the experts benchmark's): the bytes the timed calls read and write at
4.2 TB/s (timing.COPY_BW): the distinct experts each call hits (mean over the calls) as stored (codes, scales,
global scales, biases), plus x and out; or the FLOPs at the measured bf16 rate (FP8: twice it), whichever is
larger. Accuracy per row, at every T (checks.py: every row up to T = 1024, 256 random rows above), each against
its budget (moekit.metrics): moekit's low-bit call against float64 on the dequantized weights (W8A8 and W4A8: and
E4M3-rounded activations), moekit bf16 and the torch grouped_mm peer against float64 on the bf16 weights, and
(reported, not gated) the low-bit call against the unquantized bf16 layer.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import torch

from ... import presets, reference
from ...experts import fused_experts
from ...formats import prepare, quantize_experts
from ...metrics import experts_tolerance, within
from . import checks, floors
from .experts import (Progress, _gen, _torch_grouped_mm, make_cases, matmul_rate, reseed, save, script_main,
                      time_impl)
from .timing import copy_rate_words

FORMATS = ("mxfp4", "nvfp4", "fp8_block", "fp8_channel")


def preset_recipe(preset: str, weights: str) -> str:
    """The quantize recipe (moekit.formats.RECIPES) ``preset`` is benchmarked in: its checkpoint's for "native",
    else ``weights``."""
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
# Codes and block scales per weight, for estimates (per-channel FP8 scales, global scales and biases left out): the
# floors count the stored tensors' bytes instead (floors.expert_bytes)
BYTES_PER_WEIGHT = {"mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16, "fp8_block": 1 + 4 / (128 * 128), "fp8_channel": 1.0}


class LowBitLayer:
    """One layer: bf16 weights (for moekit bf16 and the peer) and their quantized copy."""

    def __init__(self, spec, fmt, device="cuda"):
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        g = _gen(device)
        self.spec = spec
        self.w13 = torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16, generator=g).mul_(H ** -0.5)
        self.w2 = torch.randn(E, H, I, device=device, dtype=torch.bfloat16, generator=g).mul_(I ** -0.5)
        self.b13 = self.b2 = None
        if spec.expert_bias:
            self.b13 = torch.randn(E, 2 * I, device=device, dtype=torch.bfloat16, generator=g).mul_(0.02)
            self.b2 = torch.randn(E, H, device=device, dtype=torch.bfloat16, generator=g).mul_(0.02)
        # 4-bit codes as FusedMoE keeps them (formats.prepare; FP8 stacks as they are)
        self.q13, self.q2 = prepare(quantize_experts(self.w13, fmt)), prepare(quantize_experts(self.w2, fmt))
        self.act_quant = "fp8_group" if fmt.startswith("fp8") else None


def make_layers(spec, fmt: str, n: int, device="cuda") -> list[LowBitLayer]:
    """``n`` layers of the preset's weights in ``fmt``, drawn from their own seed."""
    reseed(f"{spec.name} {fmt} weights", device)
    return [LowBitLayer(spec, fmt, device) for _ in range(n)]


def implementations(spec, w4a8: bool) -> dict:
    """{column: fn(x, layer, topk_weights, topk_ids), or None where it does not run}. ``w4a8``: MXFP4 weights on a GPU
    with FP8 tensor cores (below, the oracle would time the torch backend instead)."""
    act = spec.activation

    def lowbit(x, layer, tw, tid, act_quant=None):  # the format's own activations unless told
        return fused_experts(x, layer.q13, layer.q2, tw, tid, activation=act, w13_bias=layer.b13, w2_bias=layer.b2,
                             act_quant=act_quant or layer.act_quant)

    def bf16(x, layer, tw, tid):
        return fused_experts(x, layer.w13, layer.w2, tw, tid, activation=act, w13_bias=layer.b13, w2_bias=layer.b2)

    return {"moekit_lowbit": lowbit, "moekit_w4a8": functools.partial(lowbit, act_quant="fp8_group") if w4a8 else None,
            "moekit_bf16": bf16, "torch_grouped_mm": _torch_grouped_mm}


def floor_fields(spec, fmt: str, T: int, cases, rate: float) -> dict:
    """The row's floors (floors.py): the experts the timed calls hit (mean over the calls), one expert's bytes as
    stored in the format and in bf16 (biases included), the low-bit floor (4-bit runs bf16 tensor cores on Hopper,
    W8A8 FP8 ones at twice the bf16 rate) and the bf16 one."""
    layer = cases[0][1]
    hit, per_call = floors.experts_hit([tid for _, _, _, tid in cases])
    lowbit_bytes = floors.expert_bytes(spec.num_experts, layer.q13, layer.q2, layer.b13, layer.b2)
    bf16_bytes = floors.expert_bytes(spec.num_experts, layer.w13, layer.w2, layer.b13, layer.b2)
    lowbit, lowbit_kind = floors.floor_us(spec, T, hit, lowbit_bytes, rate * (2 if fmt.startswith("fp8") else 1))
    bf16, bf16_kind = floors.floor_us(spec, T, hit, bf16_bytes, rate)
    return {"experts_hit": hit, "experts_hit_per_call": per_call, "expert_bytes_lowbit": lowbit_bytes,
            "expert_bytes_bf16": bf16_bytes, "floor_lowbit_us": lowbit, "floor_lowbit_kind": lowbit_kind,
            "floor_bf16_us": bf16, "floor_bf16_kind": bf16_kind, "floor_us": lowbit}  # floor_us: `--metric floor`


# Each column's output check: (its reference, its error keys in the row (RMS, max))
CHECKS = {"moekit_lowbit": ("lowbit", "lowbit_err_vs_dequantized", "lowbit_max_err_vs_dequantized"),
          "moekit_w4a8": ("w8a8", "w4a8_err_vs_reference", "w4a8_max_err_vs_reference"),
          "moekit_bf16": ("bf16", "moekit_bf16_err", "moekit_bf16_max_err"),
          "torch_grouped_mm": ("bf16", "torch_grouped_mm_err", "torch_grouped_mm_max_err")}


def _references(spec, act_quant):
    """{name: fn(x, layer, tw, tid) -> float64}: "lowbit", the low-bit call's own (float64 on the dequantized weights,
    one expert at a time; W8A8: on E4M3-rounded activations too), "w8a8" (MXFP4 W4A8's) and "bf16" (the unquantized
    layer's)."""
    act = spec.activation

    def on(weights, fn=reference.fused_experts):
        return lambda x, layer, tw, tid: fn(x, *weights(layer), tw, tid, activation=act, w13_bias=layer.b13,
                                            w2_bias=layer.b2)

    quantized, bf16 = (lambda layer: (layer.q13, layer.q2)), (lambda layer: (layer.w13, layer.w2))
    w8a8 = on(quantized, reference.fused_experts_w8a8)
    return {"lowbit": w8a8 if act_quant else on(quantized), "w8a8": w8a8, "bf16": on(bf16)}


def measure(spec, fmt: str, T: int, cases, impls: dict, rate: float) -> dict:
    """One row: the floors, each column's time, and each timed column's output against its float64 reference on the
    timed calls (checks.py), the worst over the calls."""
    layer = cases[0][1]
    row = {"preset": spec.name, "format": fmt, "T": T, "layers": len({id(c[1]) for c in cases}),
           **floor_fields(spec, fmt, T, cases, rate)}
    for impl, fn in impls.items():
        if fn is None:
            row[impl], row[f"{impl}_mode"] = None, "-"  # W4A8: not MXFP4, or no FP8 tensor cores
            continue
        row[impl], row[f"{impl}_mode"] = time_impl(impl, fn, cases)
    rows = checks.checked_rows(T, f"{spec.name} {fmt} T={T}")
    row["checked_rows"], row["checked_calls"] = checks.rows_words(T, rows), len(cases)
    ref_fns, refs, outs = _references(spec, layer.act_quant), {}, {}
    for impl, (ref, rms_key, max_key) in CHECKS.items():
        if row.get(impl) is None:
            continue
        if ref not in refs:
            refs[ref] = checks.references(ref_fns[ref], cases, rows)
        outs[impl] = checks.outputs(impls[impl], cases, rows)
        row[max_key], row[rms_key] = checks.worst(outs[impl], refs[ref])
    if "moekit_lowbit" in outs:  # the quantization's own error: reported, not gated
        refs.setdefault("bf16", checks.references(ref_fns["bf16"], cases, rows))
        row["lowbit_err_vs_bf16_layer"] = checks.worst(outs["moekit_lowbit"], refs["bf16"])[1]
    if row.get("moekit_lowbit"):
        row["speedup_vs_bf16"] = row["moekit_bf16"] / row["moekit_lowbit"]
        row["lowbit_floor_ratio"] = row["moekit_lowbit"] / row["floor_lowbit_us"]
    if row.get("moekit_w4a8"):
        row["w4a8_vs_lowbit"] = row["moekit_w4a8"] / row["moekit_lowbit"]
    return row


def run(args, progress: Progress | None = None):
    progress = progress or Progress()
    rate = matmul_rate()
    records = []
    for name in args.presets:
        spec, fmt = presets.get(name), preset_recipe(name, args.weights)
        # deepseek-v3: a bf16 layer is 22.5 GB; two layers (and the error check's references) fit in memory.
        layers = make_layers(spec, fmt, min(args.layers, 2 if spec.num_experts > 128 else 4))
        # W4A8 needs FP8 tensor cores (below, the oracle would time the torch backend instead)
        impls = implementations(spec, fmt == "mxfp4" and torch.cuda.get_device_capability() >= (8, 9))
        for T in args.tokens:
            progress.case(name, T)
            cases = make_cases(spec, T, layers)
            row = measure(spec, fmt, T, cases, impls, rate)
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
        tol = _budget("moekit_w4a8", {})
        lines += ["", "W4A8 (MXFP4 weights recoded to E4M3, activations in 1x128 E4M3 groups; an accuracy mode, not a "
                  "speed path: its error is against float64 on the MXFP4 weights and E4M3-rounded activations, budget "
                  f"{checks.budget_words(tol)}).", "",
                  "| preset | T | moekit_w4a8 | moekit_lowbit (W4A16) | moekit_bf16 | w4a8 / W4A16 time | "
                  "err vs reference |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['T']} | {r['moekit_w4a8']:.1f} | {r['moekit_lowbit']:.1f} | "
                  f"{r['moekit_bf16']:.1f} | {r['w4a8_vs_lowbit']:.2f} | "
                  f"{_err(r, 'w4a8_err_vs_reference', 'w4a8_max_err_vs_reference', tol)} |" for r in w4a8]
    return "\n".join(lines) + "\n"


def _err(r, rms_key, max_key, tol, digits=5) -> str:
    """A row's RMS error (``digits`` decimals), flagged when it or the max error is over ``tol``."""
    rms = r.get(rms_key)
    if rms is None:
        return "-"
    return f"{rms:.{digits}f}" + ("" if within(tol, r.get(max_key), rms) else " **over budget**")


def _lowbit_table(records, env, rate, cols) -> list[str]:
    bf16_tol = experts_tolerance()
    lines = [f"# Low-bit experts benchmark ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}. us per call, CUDA-graph replay (T <= 64: 8 calls, each "
             "with its own routing); 4-bit codes prepared as FusedMoE keeps them (formats.prepare). bf16 matmul rate "
             f"{rate / 1e12:.0f} TFLOP/s. lowbit floor = max(bytes of the distinct experts each timed call hits (mean "
             "over the calls) as stored (codes, scales, global scales, biases) + x + out at "
             f"{copy_rate_words(env)}, FLOPs at the bf16 rate (FP8: twice it)).",
             "",
             "Errors: relative RMS against float64, the worst of the timed calls (every row up to T = "
             f"{checks.FULL_CHECK_MAX_T}, {checks.SAMPLE_ROWS} rows drawn at random above). moekit_lowbit against "
             "float64 on its dequantized weights (FP8 W8A8: and E4M3-rounded activations; budget "
             f"{checks.budget_words(experts_tolerance(w8a8=True))}, else {checks.budget_words(bf16_tol)}); "
             f"moekit_bf16 and torch_grouped_mm against float64 on the bf16 weights (budget "
             f"{checks.budget_words(bf16_tol)}); **over budget** flags either error over it. 'lowbit vs bf16 layer': "
             "the low-bit call against the unquantized layer (the quantization's error; reported, not gated)."]
    if any("experts_hit_per_call" not in r for r in records):
        lines.append("Rows without experts_hit_per_call in the JSON (earlier runs): their floor counts the first timed "
                     "call's experts and their code and block-scale bytes only.")
    lines += ["", "| preset | format | T | " + " | ".join(cols) + " | bf16 / lowbit | lowbit floor us | x floor | "
              "err vs dequant | moekit_bf16 err | torch_grouped_mm err | lowbit vs bf16 layer |",
              "|---|---|---|" + "---|" * (len(cols) + 7)]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in records:
        lowbit_tol = _budget("moekit_lowbit", r)
        cells = [f(r.get(c)) if r.get(c) is not None else r.get(f"{c}_mode", "-") for c in cols]
        lines.append(f"| {r['preset']} | {r['format']} | {r['T']} | " + " | ".join(cells) +
                     f" | {f(r.get('speedup_vs_bf16'), 2)} | {f(r['floor_lowbit_us'])}"
                     f" | {f(r.get('lowbit_floor_ratio'), 2)}"
                     f" | {_err(r, 'lowbit_err_vs_dequantized', 'lowbit_max_err_vs_dequantized', lowbit_tol)}"
                     f" | {_err(r, 'moekit_bf16_err', 'moekit_bf16_max_err', bf16_tol)}"
                     f" | {_err(r, 'torch_grouped_mm_err', 'torch_grouped_mm_max_err', bf16_tol)}"
                     f" | {f(r.get('lowbit_err_vs_bf16_layer'), 4)} |")
    over = [(impl, r["preset"], r["T"]) for r in records for impl, (_, rms_key, max_key) in CHECKS.items()
            if r.get(rms_key) is not None and not within(_budget(impl, r), r.get(max_key), r[rms_key])]
    if over:
        lines += ["", checks.over_budget_words(over)]
    return lines


def _budget(impl: str, r: dict):
    """A column's error budget in a row: FP8 activations (W8A8 formats' low-bit call, W4A8) or bf16's."""
    return experts_tolerance(w8a8=impl == "moekit_w4a8" or (impl == "moekit_lowbit" and r["format"].startswith("fp8")))


IMPLS = ["moekit_lowbit", "moekit_w4a8", "moekit_bf16", "torch_grouped_mm"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", "--presets", dest="presets", nargs="+", default=DEFAULT_PRESETS)
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--weights", default="native",
                   help=f"'native' (each preset's checkpoint format) or one of {FORMATS}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    p.add_argument("--name", default="lowbit")


def main(argv=None) -> None:
    script_main(__doc__, add_arguments, run, markdown, argv)
