"""DeepSeek-V3's FP8 block-scaled GEMM1 at T=4096 as a Gluon producer/consumer kernel (issue 28, item 4; GPU).

fp8_loop_probe.py found Triton's loop (moekit's W8A8 GEMM) about 10% short of the same loop with no promotion at
all, and Triton 3.6's automatic warp specialization unusable for it. This runs _gluon_fp8_kernels.py's hand-written
pipeline on the same operands (fp8_pipeline.gemm_case over aligned row blocks of one routing draw): a TMA loader
warp, and an MMA partition that promotes each step's product either after waiting for it (as Triton's loop does) or
while the next step's product runs on the tensor cores (PIPELINED). Beside it, in the same run and on the same
operands, fp8_loop_probe_kernel's "scaled" loop (moekit's promotion, host TMA, 8 warps, 4 stages) and its
"accumulated" ceiling (no promotion). Every scaled variant is checked against float64 first (output poisoned with
NaN; max |out - ref| / max |ref| over three row blocks, at most 3e-2, the FP8 budget) and is timed only if it
passes; each runs in a subprocess of its own with a time limit (a barrier bug hangs rather than fails).

Per record: us, TFLOP/s on the routed rows, the share of the dense FP8 rate (torch._scaled_mm in the same run), the
rate of the products executed (padding rows included) and the bytes' rate against a copy's.

    python benchmarks/experiments/gluon_fp8.py --out $OUT         # GPU: check + time (about 3 minutes)
    python benchmarks/experiments/gluon_fp8.py --compile-only     # CPU: build every config for sm_90 (fake driver)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

if "--compile-only" in sys.argv:  # real JIT functions, not the interpreter (read when the kernels are defined)
    os.environ["TRITON_INTERPRET"] = "0"

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "src"))

import torch  # noqa: E402

MAX_REL = 3e-2  # the FP8 budget against float64


@dataclasses.dataclass(frozen=True)
class Config:
    bm: int = 128  # rows per block: 64 per MMA warpgroup
    bn: int = 128
    stages: int = 4
    pipelined: bool = True
    load_regs: int = 40

    def label(self) -> str:
        return f"gluon {self.bm}x{self.bn} s{self.stages}{' pipelined' if self.pipelined else ''}"


def candidates() -> list[Config]:
    return [Config(128, 128, 4, False), Config(128, 128, 4, True), Config(128, 128, 6, True),
            Config(64, 128, 4, False), Config(64, 128, 6, True), Config(64, 128, 8, True)]


# the Triton loop beside them (fp8_loop_probe_kernel): name -> (BLOCK_M, BLOCK_N, warps, stages, product)
TRITON = {"triton scaled 128x128 w8 s4": (128, 128, 8, 4, "scaled"),
          "triton scaled 64x128 w4 s4": (64, 128, 4, 4, "scaled"),
          "triton accumulated 128x128 w8 s4 (no promotion)": (128, 128, 8, 4, "accumulated")}


def variants() -> list[str]:
    return list(TRITON) + [c.label() for c in candidates()]


def smem_bytes(cfg: Config) -> int:
    return cfg.stages * (cfg.bm + cfg.bn) * 128


def _descs(cfg: Config, a: torch.Tensor, w2d: torch.Tensor):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t, rows):
        return TensorDescriptor.from_tensor(t, [rows, 128], gl.NVMMASharedLayout.get_default_for([rows, 128],
                                                                                              gl.float8e4nv))
    return desc(a, cfg.bm), desc(w2d, cfg.bn)


def launch(cfg: Config, c: dict, block_expert: torch.Tensor, warmup: bool = False):
    import triton

    from _gluon_fp8_kernels import fp8_grouped_ws_kernel

    e, n, k = c["w"].shape
    a_desc, w_desc = _descs(cfg, c["a"], c["w"].view(e * n, k))
    grid = (block_expert.numel() * triton.cdiv(n, cfg.bn),)
    args = (a_desc, w_desc, c["a_scale"], c["w_scale"], block_expert, c["out"], block_expert.numel(), n, k)
    opts = dict(STAGES=cfg.stages, GROUP_M=8, PIPELINED=cfg.pipelined, LOAD_REGS=cfg.load_regs,
                num_warps=cfg.bm // 16)
    if warmup:
        return fp8_grouped_ws_kernel.warmup(*args, grid=grid, **opts)
    return fp8_grouped_ws_kernel[grid](*args, **opts)


def compile_only() -> int:
    from triton.runtime import driver

    from moekit.tools import _sass
    from moekit.tools._fake_sm90 import Sm90Driver

    driver.set_active(Sm90Driver())
    e4m3 = torch.float8_e4m3fn
    failures = 0
    for cfg in candidates():
        c = {"a": torch.empty(4 * cfg.bm, 256, dtype=e4m3), "a_scale": torch.empty(4 * cfg.bm, 2),
             "w": torch.empty(2, 256, 256, dtype=e4m3), "w_scale": torch.empty(2, 2, 2),
             "out": torch.empty(4 * cfg.bm, 256, dtype=torch.bfloat16)}
        try:
            kernel = launch(cfg, c, torch.zeros(4, dtype=torch.int32), warmup=True)
            usage = _sass.ptxas_usage(kernel.asm["ptx"])[0]
            bad = usage["spill"] > 0
            print(f"{'SPILL' if bad else 'ok':5s} {cfg.label():32s} regs {usage['regs']:3d}  spill {usage['spill']:4d} B"
                  f"  smem {kernel.metadata.shared:6d} B", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on
            bad = True
            print(f"FAIL  {cfg.label():32s} {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
        failures += bad
    print(f"{failures} failed or spilled")
    return 1 if failures else 0


def one(variant: str, T: int) -> dict:
    """Check and time one variant in this process."""
    import triton

    from fp8_pipeline import GROUP_M, aligned_blocks, fp8_rate_tflops, gemm_case, reference_error

    from moekit import presets
    from moekit.tools.bench.timing import copy_rate, graph_time_us

    cfg = next((c for c in candidates() if c.label() == variant), None)
    bm = cfg.bm if cfg else TRITON[variant][0]
    spec = presets.get("deepseek-v3")
    torch.manual_seed(0)  # the same routing and operands for every variant
    block_expert = aligned_blocks(spec, T, bm, "cuda")
    n, k = 2 * spec.intermediate_size, spec.hidden_size
    c = gemm_case(spec.num_experts, block_expert.numel(), n, k, "cuda", block_m=bm)
    if cfg is not None:
        def run():
            launch(cfg, c, block_expert)
        product = "scaled"
    else:
        from _fp8_pipeline_kernels import fp8_loop_probe_kernel
        from triton.tools.tensor_descriptor import TensorDescriptor

        _, bn, warps, stages, product = TRITON[variant]
        a_desc = TensorDescriptor.from_tensor(c["a"], [bm, 128])
        w_desc = TensorDescriptor.from_tensor(c["w"].view(-1, k), [bn, 128])
        grid = (block_expert.numel() * triton.cdiv(n, bn),)

        def run():
            fp8_loop_probe_kernel[grid](c["a"], c["a_scale"], c["w"], c["w_scale"], block_expert, c["out"], a_desc,
                                        w_desc, block_expert.numel(), spec.num_experts, c["a"].shape[0], n, k,
                                        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=GROUP_M, STAGES=stages,
                                        WARP_SPECIALIZE=False, DEVICE_DESC=False, PRODUCT=product, num_warps=warps)
    rec = {"variant": variant, "T": T, "block_m": bm}
    c["out"].fill_(float("nan"))
    run()
    torch.cuda.synchronize()
    if product == "scaled":
        rec["max_rel_err"] = reference_error(c, block_expert, block_m=bm)
        if not rec["max_rel_err"] <= MAX_REL:
            rec["error"] = f"max rel err {rec['max_rel_err']:.1e} over {MAX_REL}"
            return rec
    rec["us"] = graph_time_us([run], replays=20)
    flops = 2 * T * spec.top_k * n * k
    executed = block_expert.numel() * bm
    rec["tflops"] = flops / rec["us"] / 1e6
    rec["of_fp8_rate"] = rec["tflops"] / fp8_rate_tflops(flops, "cuda")
    rec["padding_share"] = 1 - T * spec.top_k / executed
    rec["executed_of_fp8_rate"] = rec["of_fp8_rate"] * executed / (T * spec.top_k)
    rec["of_copy_rate"] = (spec.num_experts * n * k + executed * k) / (rec["us"] * 1e-6) / copy_rate()
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--limit", type=float, default=40.0, help="seconds a variant may take before it counts as hung")
    p.add_argument("--compile-only", action="store_true", help="CPU: build the configs for sm_90 and stop")
    p.add_argument("--one", choices=variants(), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only()
    if args.one:
        print(json.dumps(one(args.one, args.tokens)))
        return 0
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --compile-only)")
    from moekit.tools.bench.timing import archive_stem, environment, write_results

    from fp8_loop_probe import TABLE_HEAD, row, run_each

    env = environment()
    records = run_each(__file__, variants(), args.tokens, args.limit, row)
    lines = [f"# DeepSeek-V3 FP8 GEMM1 at T={args.tokens}: a Gluon producer/consumer loop ({env['gpu']}, "
             f"{env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}. `benchmarks/experiments/gluon_fp8.py`: GEMM1 over aligned "
             "row blocks (each expert's rows padded to whole blocks), CUDA graphs. TFLOP/s on the routed rows; of "
             "FP8: against torch._scaled_mm's dense rate in the same run; padding: the share of the rows multiplied "
             "that are padding; executed: the rate of all products multiplied; of copy: the weights' and rows' "
             "bytes against a device copy's rate; err: float64 check over three row blocks.", "",
             *TABLE_HEAD] + [row(r) for r in records]
    write_results(args.out, archive_stem("gluon_fp8", env), env, records, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
