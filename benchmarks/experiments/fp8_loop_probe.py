"""What limits DeepSeek-V3's FP8 block-scaled GEMM1 loop at T=4096 (GPU; issue 28, item 4)?

fp8_pipeline.py found the loop at about a third of the dense FP8 rate with any load pipeline, and its warp-specialized
variants never finished. This probe runs fp8_loop_probe_kernel (_fp8_pipeline_kernels.py) over the same aligned
128-row blocks with one thing changed at a time: the product promoted with its scales (moekit's), promoted without
them, or accumulated in the tensor cores' accumulator (no promotion: the ceiling of the loop itself); host or device
TMA descriptors; Triton's warp specialization on or off; 128 or 256 columns; 128 or 64 rows per block (each
expert's rows padded to whole blocks: the padding rows are multiplied too, so each record gives the rate of the
products executed and the share of them that is padding, besides the bytes' rate against a copy's). Each variant runs in a subprocess of
its own with a time limit, since a warp-specialized build that deadlocks cannot be interrupted from Python; the
scaled variants are checked against float64 (as fp8_pipeline.py does) before they are timed.

    python benchmarks/experiments/fp8_loop_probe.py --out $OUT            (about 2 minutes on an H100)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # name: (BLOCK_M, BLOCK_N, num_warps, stages, warp-specialized, device descriptors, product)
    "scaled 128 w8 s4": (128, 128, 8, 4, False, False, "scaled"),
    "scaled 128 w8 s4 device-desc": (128, 128, 8, 4, False, True, "scaled"),
    "scaled 128 w4 s3 ws": (128, 128, 4, 3, True, False, "scaled"),
    "scaled 128 w4 s3 ws device-desc": (128, 128, 4, 3, True, True, "scaled"),
    "unscaled 128 w8 s4": (128, 128, 8, 4, False, False, "unscaled"),
    "unscaled 128 w4 s3 ws device-desc": (128, 128, 4, 3, True, True, "unscaled"),
    "unscaled 256 w8 s4": (128, 256, 8, 4, False, False, "unscaled"),
    "accumulated 128 w8 s4": (128, 128, 8, 4, False, False, "accumulated"),
    "accumulated 256 w8 s4": (128, 256, 8, 4, False, False, "accumulated"),
    # 64-row blocks: each expert's rows padded to 64, not 128 (less padding multiplied, more weight re-reads from L2)
    "scaled 64x128 w4 s4": (64, 128, 4, 4, False, False, "scaled"),
    "accumulated 64x256 w4 s4": (64, 256, 4, 4, False, False, "accumulated"),
}


def one(variant: str, T: int) -> dict:
    """Run one variant in this process: its time, rate and (scaled) error."""
    import torch
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _fp8_pipeline_kernels import fp8_loop_probe_kernel
    from fp8_pipeline import GROUP_M, aligned_blocks, fp8_rate_tflops, gemm_case, reference_error
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moekit import presets
    from moekit.tools.bench.timing import copy_rate, graph_time_us

    bm, bn, warps, stages, ws, device_desc, product = VARIANTS[variant]
    spec = presets.get("deepseek-v3")
    torch.manual_seed(0)  # the same routing for every variant
    block_expert = aligned_blocks(spec, T, bm, "cuda")
    n, k = 2 * spec.intermediate_size, spec.hidden_size
    c = gemm_case(spec.num_experts, block_expert.numel(), n, k, "cuda", block_m=bm)
    if device_desc:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    a_desc = TensorDescriptor.from_tensor(c["a"], [bm, 128])
    w_desc = TensorDescriptor.from_tensor(c["w"].view(-1, k), [bn, 128])
    grid = (block_expert.numel() * triton.cdiv(n, bn),)

    def launch():
        fp8_loop_probe_kernel[grid](c["a"], c["a_scale"], c["w"], c["w_scale"], block_expert, c["out"], a_desc, w_desc,
                                    block_expert.numel(), spec.num_experts, c["a"].shape[0], n, k, BLOCK_M=bm,
                                    BLOCK_N=bn, GROUP_M=GROUP_M, STAGES=stages, WARP_SPECIALIZE=ws,
                                    DEVICE_DESC=device_desc, PRODUCT=product, num_warps=warps)

    rec = {"variant": variant, "T": T}
    c["out"].fill_(float("nan"))
    launch()
    torch.cuda.synchronize()
    if product == "scaled":
        rec["max_rel_err"] = reference_error(c, block_expert, block_m=bm)
    rec["us"] = graph_time_us([launch], replays=20)
    flops = 2 * T * spec.top_k * n * k
    rec["tflops"] = flops / rec["us"] / 1e6
    rate = fp8_rate_tflops(flops, "cuda")
    rec["of_fp8_rate"] = rec["tflops"] / rate
    # the tensor cores also multiply the padding rows of each expert's last block: the rate they actually run at
    executed = block_expert.numel() * bm
    rec["padding_share"] = 1 - T * spec.top_k / executed
    rec["executed_of_fp8_rate"] = rec["of_fp8_rate"] * executed / (T * spec.top_k)
    # and the bytes the loop must stream at least: every expert's weights once, the gathered rows once
    rec["of_copy_rate"] = (spec.num_experts * n * k + executed * k) / (rec["us"] * 1e-6) / copy_rate()
    return rec


def run_each(script: str, variants, tokens: int, limit: float, show) -> list[dict]:
    """Each variant's record from ``script --one VARIANT --tokens T`` in a process of its own, killed after
    ``limit`` seconds (a hang is a record too); ``show(record)`` printed as each one ends."""
    records = []
    for variant in variants:
        t0 = time.time()
        try:
            done = subprocess.run([sys.executable, script, "--one", variant, "--tokens", str(tokens)],
                                  capture_output=True, text=True, timeout=limit)
            lines = done.stdout.strip().splitlines()
            rec = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "variant": variant, "error": done.stderr.strip().splitlines()[-1][:200] if done.stderr else "no output"}
        except subprocess.TimeoutExpired:
            rec = {"variant": variant, "error": f"hung: killed after {limit:.0f} s"}
        rec["seconds"] = round(time.time() - t0, 1)
        records.append(rec)
        print(show(rec), flush=True)
    return records


TABLE_HEAD = ("| variant | us | TFLOP/s | of FP8 | padding | executed of FP8 | of copy | err |",
              "|---|---|---|---|---|---|---|---|")


def row(r: dict) -> str:
    """A record as a line of TABLE_HEAD's table."""
    if "us" not in r:
        return f"| {r['variant']} | - | - | - | - | - | - | {r.get('error', 'no time')} |"
    err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "(unscaled)"
    return (f"| {r['variant']} | {r['us']:.1f} | {r['tflops']:.0f} | {r['of_fp8_rate']:.2f} | "
            f"{r['padding_share']:.2f} | {r['executed_of_fp8_rate']:.2f} | {r['of_copy_rate']:.2f} | {err} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--limit", type=float, default=50.0, help="seconds a variant may take before it counts as hung")
    p.add_argument("--one", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    from moekit.tools.bench.timing import archive_stem, environment, write_results

    if args.one:
        print(json.dumps(one(args.one, args.tokens)))
        return
    records = run_each(__file__, VARIANTS, args.tokens, args.limit, row)
    env = environment()
    lines = [f"# DeepSeek-V3 FP8 GEMM1 loop at T={args.tokens}: one change at a time ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}. `benchmarks/experiments/fp8_loop_probe.py`: "
             "fp8_loop_probe_kernel over aligned row blocks, CUDA graphs; a variant that hangs is killed. TFLOP/s on "
             "the routed rows; of FP8: against torch._scaled_mm's dense rate; padding: the share of the rows "
             "multiplied that are padding; executed: the rate of all products multiplied; of copy: the weights' "
             "and rows' bytes against a device copy's rate; err: float64 check (scaled variants; inf: not finite).",
             "", *TABLE_HEAD] + [row(r) for r in records]
    write_results(args.out, archive_stem("fp8_loop_probe", env), env, records, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
