"""DeepSeek-V3's FP8 block-scaled expert GEMMs at prefill with other load pipelines (GPU; issue 28, item 4).

moekit's W8A8 GEMMs run at about 2x their FLOP floor at T=4096 (benchmarks/LIMITS.md): each 128-deep K step is one
FP8 tensor-core product promoted into the fp32 accumulator with its scales, in the same warps that issue the
loads. This microbenchmark runs that loop (_fp8_pipeline_kernels.py) over aligned 128-row blocks of
DeepSeek-V3's routed rows, GEMM1 ([rows, 7168] x [4096, 7168]^T) and GEMM2 ([rows, 2048] x [7168, 2048]^T), with
pointer loads or TMA, with and without Triton's warp specialization, and prints each variant's time, TFLOP/s on
the routed rows, and its fraction of the FP8 rate measured in the same run (torch._scaled_mm, one dense GEMM of
the same FLOPs); moekit's whole fused_experts call at the same T beside them. Each variant's output is checked
against float64 on a few row blocks before it is timed.

    python benchmarks/experiments/fp8_pipeline.py --tokens 4096 --out $OUT
    python benchmarks/experiments/fp8_pipeline.py --compile-only        (no GPU: builds every variant for sm_90)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fp8_pipeline_kernels import GROUP, fp8_grouped_kernel  # noqa: E402

from moekit import presets  # noqa: E402

E4M3 = torch.float8_e4m3fn
# Triton 3.6 specializes a loop on 4 warps only (it adds a load partition: 12 warps in all, `setmaxnreg` in the
# PTX); on 8 it builds the plain loop. 128x128 tiles on 4 warps spill without it, and pointer loads under it do not
# build (its NVGPUWarpSpecialization pass fails): `--compile-only` lists each variant's build
VARIANTS = [dict(BLOCK_M=128, BLOCK_N=bn, num_warps=w, STAGES=s, TMA=tma, WARP_SPECIALIZE=ws)
            for (bn, w), s, tma, ws in itertools.product(((128, 8), (128, 4), (64, 4)), (3, 4), (False, True),
                                                         (False, True))
            if (ws and tma and w == 4) or (not ws and (w == 8 or bn == 64))]
GROUP_M = 8


def name(v: dict) -> str:
    return (f"{v['BLOCK_M']}x{v['BLOCK_N']} w{v['num_warps']} s{v['STAGES']} "
            f"{'tma' if v['TMA'] else 'ptr'}{' ws' if v['WARP_SPECIALIZE'] else ''}")


def aligned_blocks(spec, T: int, block_m: int, device) -> torch.Tensor:
    """int32 [num_blocks]: each row block's expert, every expert's routed rows padded to whole blocks."""
    ids = torch.stack([torch.randperm(spec.num_experts)[:spec.top_k] for _ in range(T)])
    counts = torch.bincount(ids.flatten(), minlength=spec.num_experts)
    blocks = (counts + block_m - 1) // block_m
    return torch.repeat_interleave(torch.arange(spec.num_experts), blocks).to(device, torch.int32)


def gemm_case(num_experts: int, num_blocks: int, n: int, k: int, device, block_m: int = 128) -> dict:
    m = num_blocks * block_m
    w = torch.empty(num_experts, n, k, device=device, dtype=E4M3)
    for e in range(num_experts):  # one expert's float32 draw at a time (GEMM1's whole stack would be 30 GB)
        w[e] = torch.randn(n, k, device=device).mul_(0.5)
    return {"a": torch.randn(m, k, device=device).to(E4M3), "a_scale": torch.rand(m, k // GROUP, device=device) + 0.5,
            "w": w, "w_scale": torch.rand(num_experts, n // GROUP, k // GROUP, device=device) * 1e-2 + 1e-3,
            "out": torch.empty(m, n, device=device, dtype=torch.bfloat16)}


def launch(v: dict, c: dict, block_expert: torch.Tensor, warmup: bool = False):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = c["a"].shape
    e, n, _ = c["w"].shape
    a_desc = w_desc = None
    if v["TMA"]:
        a_desc = TensorDescriptor.from_tensor(c["a"], [v["BLOCK_M"], GROUP])
        w_desc = TensorDescriptor.from_tensor(c["w"].view(e * n, k), [v["BLOCK_N"], GROUP])
    grid = (block_expert.numel() * triton.cdiv(n, v["BLOCK_N"]),)
    return fp8_grouped_kernel.run(c["a"], c["a_scale"], c["w"], c["w_scale"], block_expert, c["out"], a_desc, w_desc,
                                  block_expert.numel(), n, k, BLOCK_M=v["BLOCK_M"], BLOCK_N=v["BLOCK_N"],
                                  GROUP_M=GROUP_M, TMA=v["TMA"], WARP_SPECIALIZE=v["WARP_SPECIALIZE"],
                                  STAGES=v["STAGES"], num_warps=v["num_warps"], grid=grid, warmup=warmup)


def reference_error(c: dict, block_expert: torch.Tensor, blocks=(0, 1, -1), block_m: int = 128) -> float:
    """Largest relative error (to each block's largest output) of the kernel's output on a few row blocks; inf if
    any output element was left unwritten (the callers fill it with NaN first) or is not finite."""
    if not torch.isfinite(c["out"]).all():
        return float("inf")
    worst = 0.0
    for b in blocks:
        b = b % block_expert.numel()
        e, rows = int(block_expert[b]), slice(b * block_m, (b + 1) * block_m)
        a = c["a"][rows].double() * c["a_scale"][rows].double().repeat_interleave(GROUP, 1)
        ws = c["w_scale"][e].double().repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
        ref = a @ (c["w"][e].double() * ws).T
        worst = max(worst, ((c["out"][rows].double() - ref).abs().max() / ref.abs().max()).item())
    return worst


def fp8_rate_tflops(flops: float, device) -> float:
    """torch._scaled_mm's rate on one dense GEMM of about ``flops`` (per-tensor scales)."""
    from moekit.tools.bench.timing import graph_time_us

    n = 4096
    m = max(128, int(flops / (2 * n * n)) // 128 * 128)
    a, b = torch.randn(m, n, device=device).to(E4M3), torch.randn(n, n, device=device).to(E4M3)
    one = torch.ones((), device=device)
    us = graph_time_us([lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16)], replays=20)
    return 2 * m * n * n / us / 1e6


def measure(T: int, device, variants=VARIANTS, gemms=("gemm1", "gemm2"), moekit_call=True) -> list[dict]:
    from moekit.tools.bench.timing import graph_time_us

    spec = presets.get("deepseek-v3")
    block_expert = aligned_blocks(spec, T, 128, device)
    H, I, E = spec.hidden_size, spec.intermediate_size, spec.num_experts
    routed = T * spec.top_k
    records = []
    for gemm, (n, k) in (("gemm1", (2 * I, H)), ("gemm2", (H, I))):
        if gemm not in gemms:
            continue
        t0 = time.perf_counter()
        c = gemm_case(E, block_expert.numel(), n, k, device)
        flops = 2 * routed * n * k
        rate = fp8_rate_tflops(flops, device)
        print(f"{gemm}: case and FP8 rate ({rate:.0f} TFLOP/s) in {time.perf_counter() - t0:.1f} s", flush=True)
        for v in variants:
            rec = {"T": T, "gemm": gemm, "variant": name(v), **v, "fp8_rate_tflops": rate}
            try:
                c["out"].fill_(float("nan"))
                launch(v, c, block_expert)
                rec["max_rel_err"] = reference_error(c, block_expert)
                rec["us"] = graph_time_us([lambda v=v: launch(v, c, block_expert)], replays=20)
                rec["tflops"] = flops / rec["us"] / 1e6
                rec["of_rate"] = rec["tflops"] / rate
            except Exception as exc:  # noqa: BLE001 - a variant that does not build is a result too
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            records.append(rec)
            print(row(rec), f"({time.perf_counter() - t0:.1f} s)", flush=True)
            t0 = time.perf_counter()
        c = None  # (the next GEMM's weights need the room)
        torch.cuda.empty_cache()
    if not moekit_call:
        return records
    records.append({"T": T, "gemm": "moekit fused_experts (W8A8, whole call)", "us": moekit_call_us(spec, T, device)})
    print(f"T={T} moekit fused_experts fp8_block+fp8_group: {records[-1]['us']:.1f} us", flush=True)
    return records


def moekit_call_us(spec, T: int, device) -> float:
    from moekit.experts import fused_experts
    from moekit.tools.bench.experts import routes
    from moekit.tools.bench.timing import graph_time_us
    from moekit.tools.tune import random_weights

    (q13, q2), = random_weights(spec, layers=1, weight_format="fp8_block")
    x = torch.randn(T, spec.hidden_size, device=device, dtype=torch.bfloat16)
    weights, ids = routes(spec, T)
    return graph_time_us([lambda: fused_experts(x, q13, q2, weights, ids, activation=spec.activation,
                                                act_quant="fp8_group")], replays=10)


def row(r: dict) -> str:
    if "error" in r:
        return f"| {r['T']} | {r['gemm']} | {r['variant']} | - | - | - | {r['error']} |"
    return (f"| {r['T']} | {r['gemm']} | {r['variant']} | {r['us']:.1f} | {r['tflops']:.0f} | {r['of_rate']:.2f} | "
            f"{r['max_rel_err']:.1e} |")


def compile_only() -> None:
    """Every variant built for sm_90 on this machine (no launch): registers, spills and whether it builds."""
    from triton.runtime import driver

    from moekit.tools import _sass
    from moekit.tools._fake_sm90 import Sm90Driver

    driver.set_active(Sm90Driver())
    os.environ["TRITON_INTERPRET"] = "0"
    block_expert = torch.zeros(4, dtype=torch.int32)
    c = {"a": torch.empty(512, 256, dtype=E4M3), "a_scale": torch.empty(512, 2), "w": torch.empty(2, 256, 256,
                                                                                                     dtype=E4M3),
         "w_scale": torch.empty(2, 2, 2), "out": torch.empty(512, 256, dtype=torch.bfloat16)}
    for v in VARIANTS:
        try:
            kernel = launch(v, c, block_expert, warmup=True)
            usage = _sass.ptxas_usage(kernel.asm["ptx"])[0]
            print(name(v), "builds:", usage, "spills in loops:", _sass.spills_in_loops(kernel))
        except Exception as exc:  # noqa: BLE001
            print(name(v), "does not build:", f"{type(exc).__name__}: {str(exc)[:300]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT", help="the variants whose names contain TEXT")
    p.add_argument("--gemms", nargs="+", default=["gemm1", "gemm2"], choices=["gemm1", "gemm2"])
    p.add_argument("--no-moekit", dest="moekit_call", action="store_false", help="skip moekit's whole call")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only()
    from moekit.tools.bench.timing import environment, write_results

    env, records = environment(), []
    torch.manual_seed(0)
    for T in args.tokens:
        variants = [v for v in VARIANTS if not args.only or any(t in name(v) for t in args.only)]
        records += measure(T, torch.device("cuda"), variants, args.gemms, args.moekit_call)
    lines = [f"# DeepSeek-V3 FP8 block-scaled expert GEMMs, load pipelines ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}. `benchmarks/experiments/fp8_pipeline.py`: "
             "one GEMM over aligned "
             "128-row blocks (each expert's routed rows padded to whole blocks), CUDA graphs; TFLOP/s on the routed "
             "rows; of rate: against torch._scaled_mm's dense FP8 rate in the same run; err: largest relative "
             "error against float64 on three row blocks.", "",
             "| T | GEMM | variant | us | TFLOP/s | of rate | err |", "|---|---|---|---|---|---|---|"]
    lines += [row(r) for r in records if "variant" in r]
    lines += ["", *(f"moekit fused_experts (W8A8, whole call: x's quantization, align, both GEMMs, combine) at "
                    f"T={r['T']}: {r['us']:.1f} us" for r in records if "variant" not in r)]
    write_results(args.out, "fp8_pipeline", env, records, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
