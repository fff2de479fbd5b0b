"""Batch-invariant fused_router in one launch? The fused kernel against router_gemm + the routing kernel (GPU).

In batch-invariant mode fused_router ran router_gemm and the routing kernel at every T: 11.5 against 7.2 us at
qwen3-30b-a3b T=1 on an H100 (benchmarks/results/archive/invariant_route_h100_2026-12-06.md), the routing kernel's
launch being the difference. The one-launch kernel under the mode takes the mode's GEMM (the same K splits and
steps) and routes one token per finishing step (FIN_T=1), but serves T <= 128 only; the routing kernel routes
routing_block_tokens(E) tokens per program. This measures, in the mode:

  unfused            router_gemm + the routing kernel at every T
  auto               as shipped (routing/tiers.py fused_applies: the fused kernel up to INVARIANT_FUSED_MAX_TOKENS)
  fused <= 128       the fused kernel up to T=128, unfused above
  fused <= 128, 1/p  the same with the routing kernel at one token per program (the fused kernel's tile)

whether each gives a probe token the same bits alone and in batches of 2..1000 at several positions
(moekit._invariant.token_mismatch), and each one's CUDA-graph time against the default mode's. A variant that is
bitwise invariant and faster is what fused_applies should serve under the mode.

    python benchmarks/experiments/ab_invariant_router.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from pathlib import Path

import torch

from moekit import _invariant, fused_router, presets
from moekit._calls import CheckedCalls
from moekit.routing import tiers
from moekit.routing import triton_backend as router_backend

PRESETS = ["qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b"]
TIMED_T = [1, 4, 16, 64, 128]


@contextlib.contextmanager
def routing_tokens_per_program(n: int | None):
    """The routing kernel at ``n`` tokens per program (None: as shipped)."""
    real = router_backend.routing_block_tokens
    if n is not None:
        router_backend.routing_block_tokens = lambda num_experts: n
    router_backend._routing_constants.cache_clear()
    try:
        yield
    finally:
        router_backend.routing_block_tokens = real
        router_backend._routing_constants.cache_clear()


def router_weights(spec, device, generator):
    """A preset's router at real size: (bf16 weight [E, H], fp32 bias [E] or None, fp32 correction bias or None)."""
    E, H = spec.num_experts, spec.hidden_size
    weight = (torch.randn(E, H, device=device, generator=generator) * H ** -0.5).bfloat16()
    bias = torch.randn(E, device=device, generator=generator) * 0.1 if spec.router_bias else None
    corr = torch.randn(E, device=device, generator=generator) * 0.1 if spec.correction_bias else None
    return weight, bias, corr


def router_inputs(spec, device, tokens, other_rows: int):
    """A preset's router (router_weights) and inputs drawn after it from one seeded generator: (weight, bias, corr,
    {T: x [T, H] bf16} for ``tokens``, a probe token {"x": [1, H]}, ``other_rows`` other tokens {"x": [n, H]})."""
    H = spec.hidden_size
    g = torch.Generator(device=device).manual_seed(0)
    weight, bias, corr = router_weights(spec, device, g)
    xs = {T: torch.randn(T, H, device=device, generator=g).bfloat16() for T in tokens}
    probe = {"x": torch.randn(1, H, device=device, generator=g).bfloat16()}
    others = {"x": torch.randn(other_rows, H, device=device, generator=g).bfloat16()}
    return weight, bias, corr, xs, probe, others


def router_call(spec, weight, bias, corr):
    kwargs = spec.routing_kwargs()
    if corr is not None:
        kwargs["correction_bias"] = corr

    def call(x, impl):
        return fused_router(x, weight, bias, top_k=spec.top_k, method=spec.routing, impl=impl, **kwargs)
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--no-timing", dest="timing", action="store_false", help="the bitwise checks only")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from moekit.tools.bench.timing import environment, graph_time_us, write_results

    # cpu (TRITON_INTERPRET=1, --no-timing): a smoke run; the unfused path there is torch's, so its bits differ
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    env = environment()
    lines = [f"# Batch-invariant fused_router: one launch or two ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16 x and router weights. bitwise: a probe token's "
             f"routes alone and in batches of {', '.join(map(str, _invariant.SIZES))} at three positions.", ""]
    variants = {"unfused": (None, None), "auto": ("auto", None), "fused <= 128": (tiers.FUSED_MAX_TOKENS, None),
                "fused <= 128, 1/p": (tiers.FUSED_MAX_TOKENS, 1)}
    records = []
    rows = ["| preset | variant | bitwise | " + " | ".join(f"T={t} us" for t in TIMED_T) + " |",
            "|---|---|---|" + "---|" * len(TIMED_T)]
    for name in args.presets:
        spec = presets.get(name)
        H = spec.hidden_size
        g = torch.Generator(device=dev).manual_seed(0)
        weight, bias, corr = router_weights(spec, dev, g)
        call = router_call(spec, weight, bias, corr)
        probe = {"x": torch.randn(1, H, device=dev, generator=g).bfloat16()}
        others = {"x": torch.randn(max(_invariant.SIZES), H, device=dev, generator=g).bfloat16()}
        if args.timing:
            default = [graph_time_us([lambda x=torch.randn(T, H, device=dev).bfloat16(): call(x, "auto")] * 8)
                       for T in TIMED_T]
            rows.append(f"| {name} | default mode (auto) | - | " + " | ".join(f"{t:.1f}" for t in default) + " |")
            records.append({"preset": name, "variant": "default mode (auto)", "bitwise": None,
                            "us": dict(zip(map(str, TIMED_T), default))})
        with _invariant.batch_invariant(True):
            for label, (limit, per_program) in variants.items():
                with routing_tokens_per_program(per_program):
                    def run(inputs, limit=limit):
                        x = inputs["x"]
                        if limit == "auto":
                            return call(x, "auto")
                        return call(x, "fused" if limit is not None and x.shape[0] <= limit else "unfused")
                    CheckedCalls.forget_all()  # decisions taken under another routing tile
                    mismatch = _invariant.token_mismatch(run, probe, others)
                    times = ([graph_time_us([lambda x=torch.randn(T, H, device=dev).bfloat16(): run({"x": x})] * 8)
                              for T in TIMED_T] if args.timing else [])
                rows.append(f"| {name} | {label} | {'yes' if mismatch is None else mismatch} | "
                            + " | ".join(f"{t:.1f}" for t in times) + " |")
                print(rows[-1], flush=True)
                records.append({"preset": name, "variant": label, "bitwise": mismatch is None,
                                "mismatch": None if mismatch is None else str(mismatch),
                                "us": dict(zip(map(str, TIMED_T), times))})
    md = "\n".join(lines + rows) + "\n"
    print(md)
    if args.out:
        write_results(args.out, f"ab_invariant_router_{datetime.date.today().isoformat()}", env, records, md)


if __name__ == "__main__":
    main()
