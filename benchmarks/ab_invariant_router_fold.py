"""Batch-invariant router GEMM at many tokens: folded K splits by a select per K step, or a K loop per split (GPU).

Above T x splits = 8192 the mode runs one program per tile over all of H, adding each 512-deep split's sum into the
total where the split ends (routing/kernels/router.py). The select form keeps one K loop and, on every step, selects
between the accumulator and zero and between the total and total + accumulator: the accumulator of one MMA is
read before the next may start. The loop form (RouterKernelConfig.fold_loops) runs a K loop per split, each
pipelined on its own, and adds its sum after it: the same additions. This checks the two give the same logits bit
for bit, that the loop form is batch-invariant (a probe token alone and in batches up to the largest T), and times
default mode, select and loops in turns (three rounds, medians), CUDA graphs, the shipped tiles.

    python benchmarks/ab_invariant_router_fold.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from moekit import _invariant, presets, router_gemm
from moekit.routing import tiers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_invariant_router import router_inputs  # noqa: E402  (a sibling script: the same router per preset)
from ab_invariant_router_tiles import invariant_config  # noqa: E402

PRESETS = ["qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3", "mixtral-8x7b"]
TOKENS = [1024, 2048, 4096, 8192, 16384]
ROUNDS = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from moekit.tools.bench.timing import archive_stem, environment, graph_time_us, write_results

    env = environment()

    def form(loops: bool):
        tiers.INVARIANT_FOLD_LOOPS = loops
        return invariant_config(None)  # (clears the cached launch shapes)

    lines = [f"# Batch-invariant router GEMM: folded K splits by a select per step or a loop per split "
             f"({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; bf16 x and router weights, fp32 logits, CUDA graphs, us "
             f"per call, medians of {ROUNDS} rounds in turns. same bits: loops' logits against select's on the same "
             "inputs at every T; invariant: a probe token alone and in batches of "
             f"{', '.join(map(str, _invariant.SIZES))} and of every T.", "",
             "| preset | T | folded | default us | select us | loops us | select / default | loops / default | "
             "same bits | loops invariant |", "|---|---|---|---|---|---|---|---|---|---|"]
    records = []
    for name in args.presets:
        spec = presets.get(name)
        weight, bias, _, xs, probe, _ = router_inputs(spec, "cuda", args.tokens, 1)
        call = lambda x: router_gemm(x, weight, bias)  # noqa: E731
        others = {"x": xs[max(args.tokens)]}
        with _invariant.batch_invariant(True):
            with form(False):
                select = {T: call(xs[T]) for T in args.tokens}
            with form(True):
                loops = {T: call(xs[T]) for T in args.tokens}
                mismatch = _invariant.token_mismatch(lambda t: call(t["x"]), probe, others,
                                                     tuple(_invariant.SIZES) + tuple(args.tokens))
        tiers.INVARIANT_FOLD_LOOPS = False
        for T in args.tokens:
            splits, _ = tiers.invariant_splits(spec.hidden_size)
            folded = splits > 1 and T * splits > tiers.INVARIANT_SPLIT_WORK
            times = {"default": [], "select": [], "loops": []}
            for _ in range(ROUNDS):
                times["default"].append(graph_time_us([lambda x=xs[T]: call(x)] * 4))
                with _invariant.batch_invariant(True):
                    for label, loops_on in (("select", False), ("loops", True)):
                        with form(loops_on):
                            times[label].append(graph_time_us([lambda x=xs[T]: call(x)] * 4))
            tiers.INVARIANT_FOLD_LOOPS = False
            us = {k: statistics.median(v) for k, v in times.items()}
            same = torch.equal(select[T], loops[T])
            rec = {"preset": name, "T": T, "folded": folded, "default_us": us["default"], "select_us": us["select"],
                   "loops_us": us["loops"], "same_bits": same, "loops_invariant": mismatch is None,
                   "mismatch": mismatch}
            records.append(rec)
            lines.append(f"| {name} | {T} | {'yes' if folded else 'no'} | {us['default']:.1f} | {us['select']:.1f} | "
                         f"{us['loops']:.1f} | {us['select'] / us['default']:.2f} | {us['loops'] / us['default']:.2f} | "
                         f"{'yes' if same else 'NO'} | {'yes' if mismatch is None else mismatch} |")
            print(lines[-1], flush=True)
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        write_results(args.out, archive_stem("ab_invariant_router_fold", env), env, records, md)


if __name__ == "__main__":
    main()
