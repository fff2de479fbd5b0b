"""Where the time of a CUDA-core decode call goes (GPU): each kernel alone, both, and an empty kernel.

A decode call (T <= 16, the table's `gemv` configs) is two launches, GEMM1 per (token, slot) pair and
GEMM2 per token (kernels/moe_gemv.py). Each is timed alone as a CUDA graph of consecutive calls over 4 layers'
weights, each call with its own routing and input (as consecutive layers of a model run), then both together,
and a graph of as many empty kernels gives the launch cost inside a graph. The graphs hold as many calls (at
least 8) as make one replay of GEMM2 alone (the smaller kernel) read at least timing.MIN_REPLAY_BYTES of distinct
(layer, expert) weights, twice the 50 MB L2, so that the weights come from HBM, not L2 (each row records the
calls and the bytes one replay reads). Reports each kernel's bytes per second (mean over the calls of each
call's distinct experts) against the copy rate, and optionally sweeps each kernel's configs alone.

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
from moekit.tools.bench import floors  # noqa: E402
from moekit.tools.bench.experts import _gen, reseed, routes  # noqa: E402
from moekit.tools.bench.timing import COPY_BW, MIN_REPLAY_BYTES, graph_time_us  # noqa: E402
from moekit.tools.tune import gemv_candidates, random_weights  # noqa: E402

LAYERS = 4
CALLS = 8  # at least this many calls per graph
MAX_CALLS = 256  # and at most this many, whatever the bytes


def _graph_us(fn, layers, calls) -> float:
    """us per call of ``fn(layer weights, call inputs)`` over the calls, call i on layer i % LAYERS."""
    return graph_time_us([lambda i=i: fn(layers[i % len(layers)], calls[i]) for i in range(len(calls))])


def _stack_bytes(op: ext.WeightOperand) -> int:
    """Bytes of one expert: codes plus (4-bit) scales."""
    total = op.data.numel() * op.data.element_size()
    if op.format != "dense":
        total += op.scales.numel() * op.scales.element_size()
    return total // op.shape[0]


def draw_calls(spec, num_tokens: int, per_expert: float, layers: int = LAYERS, device="cuda") -> tuple[list, int]:
    """((x [T, H], topk_weights flat [T*k], topk_ids flat [T*k]) per timed call, each with its own routing; the
    distinct (layer, expert) pairs one replay reads). As many calls (CALLS to MAX_CALLS) as make those pairs'
    ``per_expert`` bytes reach MIN_REPLAY_BYTES: one routing reused by every call read the same few experts of
    each layer, which stayed in L2 from one replay to the next."""
    reseed(f"{spec.name} T={num_tokens} decode_kernels", device)
    calls, pairs = [], set()
    while len(calls) < CALLS or (len(pairs) * per_expert < MIN_REPLAY_BYTES and len(calls) < MAX_CALLS):
        tw, ids = routes(spec, num_tokens, device)
        pairs |= {(len(calls) % layers, e) for e in ids.unique().tolist()}
        x = torch.randn(num_tokens, spec.hidden_size, device=device, generator=_gen(device)).bfloat16()
        calls.append((x, tw.reshape(-1).contiguous(), ids.reshape(-1).contiguous()))
    return calls, len(pairs)


def profile(preset: str, weights: str, num_tokens: int, sweep: bool) -> dict:
    spec = presets.get(preset)
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    stacks = random_weights(spec, LAYERS, weight_format=weights)
    layers = [(ext.WeightOperand.of(a), ext.WeightOperand.of(b)) for a, b in stacks]
    per1, per2 = (_stack_bytes(layers[0][j]) for j in (0, 1))
    calls, pairs = draw_calls(spec, num_tokens, per2)
    cfg, source = expert_configs.choose(num_tokens, E, k, 2 * I, H, calls[0][0].device, calls[0][0].dtype,
                                        layers[0][0].format)
    h = torch.randn(num_tokens * k, I, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(num_tokens, H, device="cuda", dtype=torch.bfloat16)

    def gemv1(w, call, c=cfg.gemm1):
        x, _, flat_ids = call
        ext.gemv1(x, w[0], None, h, flat_ids, None, E, spec.activation, k, c)

    def gemv2(w, call, c=cfg.gemm2):
        _, tw, flat_ids = call
        ext.gemv2_tokens(h, w[1], None, tw, flat_ids, None, E, out, k, c)

    hit, per_call = floors.experts_hit([ids for _, _, ids in calls])  # each call reads its own experts
    bytes1, bytes2 = hit * per1, hit * per2
    t1, t2 = _graph_us(gemv1, layers, calls), _graph_us(gemv2, layers, calls)
    both = _graph_us(lambda w, call: (gemv1(w, call), gemv2(w, call)), layers, calls)
    empty = _graph_us(lambda w, call: torch.ops.aten.zero_(out[:1, :1]), layers, calls)
    row = {"preset": preset, "weights": weights, "T": num_tokens, "config": str(cfg), "config_source": source,
           "calls": len(calls), "experts_hit": hit, "experts_hit_per_call": per_call,
           "replay_bytes_gemm1": pairs * per1, "replay_bytes_gemm2": pairs * per2,
           "gemm1_us": t1, "gemm2_us": t2, "both_us": both, "empty_kernel_us": empty,
           "gemm1_TBps": bytes1 / t1 / 1e6, "gemm2_TBps": bytes2 / t2 / 1e6,
           "floor_us": (bytes1 + bytes2) / COPY_BW * 1e6}
    print(f"{preset} {weights} T={num_tokens}: gemm1 {t1:.1f} us ({row['gemm1_TBps']:.2f} TB/s), gemm2 {t2:.1f} us "
          f"({row['gemm2_TBps']:.2f} TB/s), both {both:.1f} us, empty kernel {empty:.1f} us, "
          f"floor {row['floor_us']:.1f} us  [{cfg}]; {len(calls)} calls per graph, one replay reads "
          f"{pairs * per1 / 1e6:.0f} MB (GEMM1) / {pairs * per2 / 1e6:.0f} MB (GEMM2) of weights", flush=True)
    if sweep:  # each kernel's configs alone: is the table's pair also each kernel's best?
        for which, name, fn in ((1, "gemm1", gemv1), (2, "gemm2", gemv2)):
            space = gemv_candidates(which, k, layers[0][which - 1].format)
            timed = sorted((_graph_us(lambda w, call, c=c: fn(w, call, c), layers, calls), str(c)) for c in space)
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
