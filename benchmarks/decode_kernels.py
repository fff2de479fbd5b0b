"""Where the time of a CUDA-core decode call goes (GPU): each kernel alone, both, and an empty kernel.

A decode call (T <= 16, the table's `gemv` configs) is two launches, GEMM1 per (token, slot) pair and
GEMM2 per token (kernels/moe_gemv.py). Each is timed alone as a CUDA graph of 8 calls over 4 layers'
weights (as consecutive layers of a model run, so the weights come from HBM, not L2), then both
together, and a graph of 8 empty kernels gives the launch cost inside a graph. Reports each
kernel's bytes per second against the copy rate, and optionally sweeps each kernel's configs alone.

    python benchmarks/decode_kernels.py --preset qwen3-30b-a3b --weights dense --tokens 1 --sweep
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402

from moekit.experts import triton_backend as ext  # noqa: E402
from moekit import presets  # noqa: E402
from moekit.experts import configs as expert_configs  # noqa: E402
from moekit.tools.bench.experts import routes  # noqa: E402
from moekit.tools.bench.timing import graph_time_us  # noqa: E402
from moekit.tools.tune import gemv_candidates, random_weights  # noqa: E402

LAYERS = 4
CALLS = 8


def _graph_us(fn_of_layer, layers) -> float:
    return graph_time_us([lambda w=layers[i % len(layers)]: fn_of_layer(w) for i in range(CALLS)])


def _stack_bytes(op: ext.WeightOperand) -> int:
    """Bytes of one expert: codes plus (4-bit) scales."""
    total = op.data.numel() * op.data.element_size()
    if op.format != "dense":
        total += op.scales.numel() * op.scales.element_size()
    return total // op.shape[0]


def profile(preset: str, weights: str, num_tokens: int, sweep: bool) -> dict:
    spec = presets.get(preset)
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    stacks = random_weights(spec, LAYERS, weight_format=weights)
    layers = [(ext.WeightOperand.of(a), ext.WeightOperand.of(b)) for a, b in stacks]
    x = torch.randn(num_tokens, H, device="cuda", dtype=torch.bfloat16)
    tw, ids = routes(spec, num_tokens)
    tw = tw.reshape(-1).contiguous()
    cfg, source = expert_configs.choose(num_tokens, E, k, 2 * I, H, x.device, x.dtype, layers[0][0].format)
    h = torch.randn(num_tokens * k, I, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(num_tokens, H, device="cuda", dtype=torch.bfloat16)
    flat_ids = ids.reshape(-1)

    def gemv1(w, c=cfg.gemm1):
        ext.gemv1(x, w[0], None, h, flat_ids, None, E, spec.activation, k, c)

    def gemv2(w, c=cfg.gemm2):
        ext.gemv2_tokens(h, w[1], None, tw, flat_ids, None, E, out, k, c)

    experts_hit = ids.unique().numel()
    bytes1, bytes2 = (experts_hit * _stack_bytes(layers[0][j]) for j in (0, 1))
    t1, t2 = _graph_us(gemv1, layers), _graph_us(gemv2, layers)
    both = _graph_us(lambda w: (gemv1(w), gemv2(w)), layers)
    empty = _graph_us(lambda w: torch.ops.aten.zero_(out[:1, :1]), layers)
    row = {"preset": preset, "weights": weights, "T": num_tokens, "config": str(cfg), "config_source": source,
           "gemm1_us": t1, "gemm2_us": t2, "both_us": both, "empty_kernel_us": empty,
           "gemm1_TBps": bytes1 / t1 / 1e6, "gemm2_TBps": bytes2 / t2 / 1e6, "floor_us": (bytes1 + bytes2) / 4.2e6}
    print(f"{preset} {weights} T={num_tokens}: gemm1 {t1:.1f} us ({row['gemm1_TBps']:.2f} TB/s), gemm2 {t2:.1f} us "
          f"({row['gemm2_TBps']:.2f} TB/s), both {both:.1f} us, empty kernel {empty:.1f} us, "
          f"floor {row['floor_us']:.1f} us  [{cfg}]", flush=True)
    if sweep:  # each kernel's configs alone: is the table's pair also each kernel's best?
        for which, name, fn in ((1, "gemm1", gemv1), (2, "gemm2", gemv2)):
            space = gemv_candidates(which, k, layers[0][which - 1].format)
            timed = sorted((_graph_us(lambda w, c=c: fn(w, c), layers), str(c)) for c in space)
            row[f"{name}_sweep"] = timed
            print(f"  {name} best alone: " + "; ".join(f"{us:.1f} us {c}" for us, c in timed[:3]), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b"])
    p.add_argument("--weights", nargs="+", default=["dense"], help="dense, mxfp4, nvfp4")
    p.add_argument("--tokens", nargs="+", type=int, default=[1])
    p.add_argument("--sweep", action="store_true", help="also time each kernel's configs alone")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "decode_kernels.json")
    args = p.parse_args(argv)
    rows = [profile(name, w, T, args.sweep) for name in args.preset for w in args.weights for T in args.tokens]
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
