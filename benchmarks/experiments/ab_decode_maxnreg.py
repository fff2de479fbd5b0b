"""Register caps on the decode GEMVs (GPU; issue 30's LoRA terms and LIMITS' open lead on gpt-oss's bf16 GEMV1), and
where W13's LoRA shrink runs at decode: a kernel of its own before GEMV1, or GEMV1's own programs
(``lora.DECODE_W13_SHRINK_BY_GEMV1``, variant "terms 168, shrink by GEMV1").
(Its variant with W2's LoRA shrink blocks added by GEMV2 instead of GEMV1's last program per pair ran once, slower:
benchmarks/results/archive/ab_decode_w2_sums_h100_2026-12-07.md; that kernel path has left the tree, its commit
is in results/archive/INDEX.md's Prototypes section.)

GEMV1 with both LoRA terms inside takes 204 registers at qwen3-30b-a3b's T=1 config (2 programs of 4 warps per SM
instead of 3), and gpt-oss-120b's bf16 GEMV1 takes 211 with or without adapters (sm_90 compiles, 2026-12-07). A
``maxnreg`` launch option caps them. Each variant runs in a process of its own (no launch plan or compiled kernel
carries over), the variants in turns, ``--rounds`` times; in each, the bench's own LoRA measurement
(moekit.tools.bench.lora: the call without and with adapters timed in turns in CUDA graphs over two layers'
weights, medians), so the overhead column is the figure results/lora.md reports.

    python benchmarks/experiments/ab_decode_maxnreg.py --out $OUT        (about 3 min)
    python benchmarks/experiments/ab_decode_maxnreg.py --check-entry     (the table's capped entry against itself
                                                                          uncapped and the default call, 30 s)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = {  # label: (cap of GEMV1 with both LoRA terms, cap of every GEMV1 launch without them, W13's shrink
    # computed by GEMV1's programs)
    "no cap": (None, None, False),
    "terms 168": (168, None, False),
    "GEMV1 168": (168, 168, False),
    "terms 168, shrink by GEMV1": (168, None, True),
}


def worker(preset: str, tokens: int, adapters: int, terms_cap: int | None, gemv1_cap: int | None,
           shrink_by_gemv1: bool = False) -> dict:
    import torch

    from moekit import presets
    from moekit.experts import lora as expert_lora
    from moekit.experts import triton_backend
    from moekit.tools.bench import lora as bench_lora
    from moekit.tools.bench.experts import Layer, _gen, reseed, routes

    expert_lora.DECODE_TERMS_MAXNREG = terms_cap  # (applied where GEMV1's uncapped build takes more)
    expert_lora.DECODE_W13_SHRINK_BY_GEMV1 = shrink_by_gemv1
    triton_backend._register_cap = lambda cfg: {}  # the table's own caps (GemmConfig.maxnreg) off: the variant decides
    if gemv1_cap:
        real = triton_backend._gemv1_constants

        def capped(*args, **kwargs):
            slots, packed, block_k, constants = real(*args, **kwargs)
            return slots, packed, block_k, type(constants)(constants, maxnreg=gemv1_cap)

        triton_backend._gemv1_constants = capped
        real_rows = triton_backend._gemv1_rows_constants
        triton_backend._gemv1_rows_constants = lambda *a, **k: type(c := real_rows(*a, **k))(c, maxnreg=gemv1_cap)
    spec = presets.get(preset)
    reseed(preset)
    layers = [Layer(spec, []) for _ in range(bench_lora.LAYERS)]
    lora = bench_lora.random_lora(spec, adapters, bench_lora.RANK)
    reseed(f"{preset} T={tokens}")
    cases = []
    for i in range(8):
        tw, tid = routes(spec, tokens)
        x = torch.randn(tokens, spec.hidden_size, device="cuda", generator=_gen("cuda")).bfloat16()
        cases.append((x, i % bench_lora.LAYERS, tw, tid))
    ids = [bench_lora.lora_ids(tokens, adapters) for _ in cases]
    rec = bench_lora._moekit(spec, layers, cases, lora, ids, print)
    return {"base_us": rec.get("moekit_us"), "lora_us": rec.get("moekit_lora_us")}


def check_entry(preset: str = "gpt-oss-120b", rounds: int = 5) -> None:
    """What the default call serves at T=1 on this GPU, timed in turns against the same config without its GEMV1 cap
    (CUDA graphs of 8 calls over two layers' weights)."""
    from dataclasses import replace

    import torch

    from moekit import presets
    from moekit.experts import configs, fused_experts
    from moekit.tools.bench.experts import Layer, _gen, reseed, routes
    from moekit.tools.bench.timing import graph_time_us

    spec = presets.get(preset)
    cfg, source = configs.choose(1, spec.num_experts, spec.top_k, 2 * spec.intermediate_size, spec.hidden_size,
                                 torch.device("cuda"), torch.bfloat16)
    print(torch.cuda.get_device_name(), cfg, source)
    reseed(preset)
    layers = [Layer(spec, []) for _ in range(2)]
    cases = []
    for i in range(8):
        tw, tid = routes(spec, 1)
        x = torch.randn(1, spec.hidden_size, device="cuda", generator=_gen("cuda")).bfloat16()
        cases.append((x, layers[i % 2], tw, tid))
    variants = {"served config": cfg, "its GEMV1 uncapped": replace(cfg, gemm1=replace(cfg.gemm1, maxnreg=None)),
                "default call": None}
    times: dict[str, list[float]] = {label: [] for label in variants}
    for _ in range(rounds):
        for label, c in variants.items():
            kw = {} if c is None else {"config": c}
            calls = [lambda x=x, L=L, tw=tw, tid=tid: fused_experts(
                x, L.w13, L.w2, tw, tid, activation=spec.activation, w13_bias=L.b13, w2_bias=L.b2, **kw)
                for x, L, tw, tid in cases]
            with torch.no_grad():
                times[label].append(graph_time_us(calls, replays=20))
    for label, t in times.items():
        print(f"{preset} T=1 {label:20s} median {statistics.median(t):.1f} us  {[round(v, 1) for v in t]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-120b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1])
    p.add_argument("--adapters", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path)
    p.add_argument("--check-entry", action="store_true", help="the table's entry at T=1 against itself uncapped")
    p.add_argument("--worker", nargs=3, metavar=("PRESET", "T", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.check_entry:
        return check_entry(args.presets[-1] if args.presets != p.get_default("presets") else "gpt-oss-120b")
    if args.worker:
        preset, tokens, variant = args.worker
        print("RESULT " + json.dumps(worker(preset, int(tokens), args.adapters, *VARIANTS[variant])))
        return
    from moekit.tools.bench.timing import archive_stem, environment, write_results

    runs: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for preset in args.presets:
            for T in args.tokens:
                for variant in args.variants:
                    done = subprocess.run([sys.executable, __file__, "--adapters", str(args.adapters), "--worker",
                                           preset, str(T), variant], capture_output=True, text=True)
                    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                    if not lines:
                        print(f"{preset} T={T} {variant}: failed\n{done.stderr[-2000:]}", flush=True)
                        continue
                    got = json.loads(lines[-1][7:])
                    runs.setdefault((preset, T, variant), []).append(got)
                    print(f"{preset} T={T} {variant:28s} base {got['base_us']:.1f} lora {got['lora_us']:.1f} us",
                          flush=True)
    env = environment()
    records, rows = [], []
    for (preset, T, variant), got in runs.items():
        base = statistics.median(g["base_us"] for g in got)
        with_lora = statistics.median(g["lora_us"] for g in got)
        records.append({"preset": preset, "T": T, "adapters": args.adapters, "variant": variant, "base_us": base,
                        "lora_us": with_lora, "overhead": with_lora / base - 1, "runs": got})
        rows.append(f"| {preset} | {T} | {variant} | {base:.1f} | {with_lora:.1f} | {with_lora / base - 1:+.0%} |")
    md = "\n".join([
        f"# Register caps on the decode GEMVs ({env['gpu']}, {env['date']})", "",
        f"torch {env['torch']}, triton {env['triton']}; bf16, rank 16, {args.adapters} adapter(s); each variant in a "
        f"process of its own, in turns, {args.rounds} rounds, medians; in each, the call without and with adapters "
        "timed in turns in CUDA graphs (moekit.tools.bench.lora). `benchmarks/experiments/ab_decode_maxnreg.py`.", "",
        "| preset | T | variant | no adapters us | with adapters us | overhead |", "|---|---|---|---|---|---|",
        *rows, ""])
    print(md)
    if args.out:
        write_results(args.out, archive_stem("ab_decode_maxnreg", env), env, records, md)


if __name__ == "__main__":
    main()
