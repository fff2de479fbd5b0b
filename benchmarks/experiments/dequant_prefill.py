"""4-bit prefill as "decode each expert's weights once per call, then the bf16 GEMMs" (GPU; issue 28, part 3).

moekit's 4-bit tensor-core GEMMs decode every weight tile inside the MMA warps, once per row block; at prefill
sizes they take 1.3-1.7x bf16's time for a quarter of its weight bytes. The alternative measured here decodes the
whole stack once per call into a bf16 scratch stack (a streaming kernel, _dequant_kernels.py) and runs
moekit's bf16 experts on it. It pays the scratch's bytes (4-bit read, bf16 written, bf16 read again by the GEMMs)
to take the decode off the MMA warps, so it can win only where 4-bit time - bf16 time > the decode's time, i.e. at
large T. Per preset and T, in CUDA graphs, the same weights and routes:

  4-bit      fused_experts on the prepared 4-bit stacks (the table's configs)
  decode     the two stacks decoded into bf16 scratch (both launches)
  bf16       fused_experts on the scratch stacks (the bf16 table's configs)
  decode+bf16  the two together: the alternative, end to end

plus the decode's GB/s (4-bit bytes read + bf16 bytes written) and the alternative's output against the 4-bit
path's (relative Frobenius difference). Writes <out>/dequant_prefill.{json,md}.

    python benchmarks/experiments/dequant_prefill.py --presets qwen3-30b-a3b gpt-oss-120b --tokens 4096 16384
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dequant_kernels import dequantize_kernel  # noqa: E402

from moekit import presets  # noqa: E402
from moekit.experts import fused_experts  # noqa: E402
from moekit.experts.triton_backend import FORMAT_IDS  # noqa: E402
from moekit.formats import format_of  # noqa: E402
from moekit.tools.bench.experts import routes  # noqa: E402
from moekit.tools.bench.timing import environment, graph_time_us  # noqa: E402
from moekit.tools.tune import random_weights  # noqa: E402

NATIVE = {"gpt-oss-120b": "mxfp4", "qwen3-30b-a3b": "nvfp4"}
BLOCK_N, BLOCK_K = 32, 256


def dequantize_into(q, out: torch.Tensor) -> None:
    """A 4-bit stack [E, N, K] decoded into ``out`` [E, N, K] (bf16 or float32, K contiguous)."""
    E, N, K = q.shape
    fmt = format_of(q)
    scales = q.scales if fmt == "mxfp4" else q.linear_scales().view(torch.uint8)
    gs = q.global_scale.float().reshape(-1).expand(E).contiguous() if fmt == "nvfp4" else scales
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(K, BLOCK_K), E)
    dequantize_kernel[grid](q.data, q.data.stride(0), q.data.stride(1), scales, scales.stride(0), scales.stride(1), gs,
                            out, out.stride(0), out.stride(1), N, K, FORMAT=FORMAT_IDS[fmt],
                            PAIRS=q.layout == "pairs", BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def measure(name: str, T: int) -> dict:
    spec, fmt = presets.get(name), NATIVE[name]
    (q13, q2), = random_weights(spec, layers=1, weight_format=fmt)
    s13 = torch.empty(q13.shape, dtype=torch.bfloat16, device="cuda")
    s2 = torch.empty(q2.shape, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(T, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    weights, ids = routes(spec, T)

    def experts(w13, w2):
        return fused_experts(x, w13, w2, weights, ids, activation=spec.activation, backend="triton")

    def decode():
        dequantize_into(q13, s13)
        dequantize_into(q2, s2)

    def both():
        decode()
        return experts(s13, s2)

    four = experts(q13, q2).float()
    alt = both().float()
    rec = {"preset": name, "format": fmt, "T": T,
           "four_bit_us": graph_time_us([lambda: experts(q13, q2)], replays=10, warmup=2),
           "decode_us": graph_time_us([decode], replays=10, warmup=2),
           "bf16_us": graph_time_us([lambda: experts(s13, s2)], replays=10, warmup=2),
           "decode_bf16_us": graph_time_us([both], replays=10, warmup=2),
           "rel_diff": ((alt - four).norm() / four.norm()).item()}
    moved = sum(q.data.numel() + q.scales.numel() for q in (q13, q2)) + 2 * (s13.numel() + s2.numel())
    rec["decode_gbs"] = moved / rec["decode_us"] / 1e3
    rec["alt_over_four_bit"] = rec["decode_bf16_us"] / rec["four_bit_us"]
    return rec


def markdown(env: dict, records: list[dict]) -> str:
    lines = [f"# 4-bit prefill: decode once into bf16, then the bf16 GEMMs ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}. `benchmarks/experiments/dequant_prefill.py`: "
             "whole fused_experts "
             "calls in CUDA graphs; decode = both stacks into bf16 scratch (4-bit bytes read + bf16 bytes written); "
             "rel diff: the alternative's output against the 4-bit path's.", "",
             "| preset / format | T | 4-bit us | decode us | decode GB/s | bf16 us | decode + bf16 us | / 4-bit | "
             "rel diff |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['preset']} {r['format'].upper()} | {r['T']} | {r['four_bit_us']:.1f} | {r['decode_us']:.1f} "
                     f"| {r['decode_gbs']:.0f} | {r['bf16_us']:.1f} | {r['decode_bf16_us']:.1f} | "
                     f"{r['alt_over_four_bit']:.3f} | {r['rel_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=list(NATIVE), choices=list(NATIVE))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args(argv)
    env, records = environment(), []
    for name in args.presets:
        for T in args.tokens:
            records.append(measure(name, T))
            r = records[-1]
            print(f"{name} T={T}: 4-bit {r['four_bit_us']:.1f} us, decode {r['decode_us']:.1f} "
                  f"({r['decode_gbs']:.0f} GB/s), bf16 {r['bf16_us']:.1f}, decode+bf16 {r['decode_bf16_us']:.1f} "
                  f"({r['alt_over_four_bit']:.3f}x), diff {r['rel_diff']:.2e}", flush=True)
            torch.cuda.empty_cache()
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "dequant_prefill.json").write_text(json.dumps({"env": env, "records": records}, indent=1))
    (args.out / "dequant_prefill.md").write_text(markdown(env, records))
    print(markdown(env, records))


if __name__ == "__main__":
    main()
