"""A/B on the GPU's host: repeated eager expert calls with the plans a checked signature keeps and without.

Plans (experts/triton_backend.py): DecodePlan for the GEMV decode path, CallPlan for the per-pair tensor-core GEMMs
and the aligned path (one-program align, GEMM1, GEMM2, combine), BatchedPlan for batched_experts (``--ops batched``:
M = 1 and 16 rows per expert, half of them valid on average, the configs the call chooses). fused_experts cases: the H200 table's GEMV decode configs at
T = 1 and 4 (passed as ``config=`` so that any GPU runs them), and moekit's heuristic configs (what a GPU without
a table runs: bf16 decode on the per-pair GEMMs, T = 16 and 64 aligned). "no plan" is the same backend with
``plans=False`` (every repeated call runs fused_experts_into in full). The two alternate, five rounds of three
300-call loops each; host time = the loop's wall time to its last return, divided by the calls (median). The
outputs of both must be the same bits. The torch bf16 router chain, timed the same way, is the host's yardstick
(hosts differ by up to 2x from one start to the next).

    python benchmarks/experiments/ab_call_plans.py --out benchmarks/results/archive
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from moekit import FusedMoE, batched_experts, fused_experts, presets
from moekit.experts import ExpertsConfig, backends, triton_backend
from moekit.experts import configs as expert_configs
from moekit.formats import quantize_experts
from moekit.tools.bench.eager import eager_loop_us
from moekit.tools.bench.timing import archive_stem, environment, write_results

TABLE = Path(__file__).resolve().parents[2] / "src/moekit/experts/tuned_configs.json"
# (preset, weight format, configs, token counts)
CASES = [("qwen3-30b-a3b", None, "h200", (1, 4)), ("qwen3-30b-a3b", "nvfp4", "h200", (1, 4)),
         ("gpt-oss-120b", None, "h200", (1, 4)), ("gpt-oss-120b", "mxfp4", "h200", (1, 4)),
         ("qwen3-30b-a3b", None, "heuristic", (1, 4, 16, 64)), ("gpt-oss-120b", None, "heuristic", (1, 4, 16)),
         ("qwen3-30b-a3b", "nvfp4", "heuristic", (1, 4, 16)), ("gpt-oss-120b", "mxfp4", "heuristic", (1, 4, 16))]
BATCHED_CASES = [("qwen3-30b-a3b", None, (1, 16)), ("gpt-oss-120b", None, (1, 16)),
                 ("qwen3-30b-a3b", "nvfp4", (1, 16)), ("gpt-oss-120b", "mxfp4", (1, 16))]  # (preset, format, M)
ROUNDS = 5


def host_us(fn) -> float:
    return eager_loop_us(fn, loop=300, rounds=3)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=["h200", "heuristic"], default=["h200", "heuristic"])
    p.add_argument("--formats", nargs="+", choices=["bf16", "mxfp4", "nvfp4"], default=["bf16", "mxfp4", "nvfp4"])
    p.add_argument("--ops", nargs="+", choices=["fused", "batched"], default=["fused"])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    table = json.loads(TABLE.read_text())
    with_plans = backends.BACKENDS
    without = tuple(dataclasses.replace(b, plans=False) for b in with_plans)
    env = environment()
    records, served = [], []
    for kind in (triton_backend.DecodePlan, triton_backend.CallPlan, triton_backend.BatchedPlan):
        kind.__call__ = lambda self, *a, real=kind.__call__: served.append((type(self).__name__, real(self, *a))) \
            or served[-1][1]
    cases = [(n, f, s, t, "fused") for n, f, s, t in CASES if "fused" in args.ops] + [
        (n, f, "chosen", m, "batched") for n, f, m in BATCHED_CASES if "batched" in args.ops]
    for name, fmt, source, tokens, op in cases:
        if (source not in args.configs and op == "fused") or (fmt or "bf16") not in args.formats:
            continue
        spec = presets.get(name)
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        layer = FusedMoE(spec, dtype=torch.bfloat16, device="cuda")
        w13, w2 = layer.w13.detach(), layer.w2.detach()
        if fmt:
            w13, w2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
        b13 = None if layer.w13_bias is None else layer.w13_bias.detach()
        b2 = None if layer.w2_bias is None else layer.w2_bias.detach()
        entries = table["NVIDIA H200|triton-3.6.0|bfloat16" + (f"|{fmt}" if fmt else "")][f"E{E}_N{2 * I}_K{H}"]
        for T in tokens:
            cfg = (ExpertsConfig.from_dict(entries[str(T)]) if source == "h200" else None if op == "batched" else
                   expert_configs.heuristic(T, E, spec.top_k, 2 * I, H, fmt or "dense"))
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                tw, tid = layer.route(x)
            gate = layer.gate.weight.detach()
            xb = torch.randn(E, T, H, device="cuda", dtype=torch.bfloat16)  # batched: T rows per expert
            counts = torch.randint(0, T + 1, (E,), device="cuda", dtype=torch.int32)
            valid = (torch.arange(T, device="cuda")[None, :] < counts[:, None])[..., None]

            def call():
                if op == "batched":
                    return batched_experts(xb, counts, w13, w2, activation=spec.activation, w13_bias=b13,
                                           w2_bias=b2)
                return fused_experts(x, w13, w2, tw, tid, activation=spec.activation, w13_bias=b13, w2_bias=b2,
                                     config=cfg)

            def kept(out):  # what both must agree on: the batched format's padding rows are unspecified
                return torch.where(valid, out, 0) if op == "batched" else out

            def chain():
                w, ids = torch.softmax(F.linear(x, gate).float(), dim=-1).topk(spec.top_k, dim=-1)
                return w / w.sum(-1, keepdim=True), ids

            times, outs = {True: [], False: []}, {}
            for _ in range(ROUNDS):
                for plans in (False, True):
                    backends.BACKENDS = with_plans if plans else without  # (a new registry: decisions re-made)
                    call()  # the checked call (it plans)
                    outs[plans] = kept(call()).clone()  # a repeated one (the plan's launches)
                    times[plans].append(host_us(call))
            backends.BACKENDS = with_plans
            served.clear()
            call()
            r = {"op": op, "preset": name, "format": fmt or "bf16", "configs": source,
                 "mode": cfg.mode if cfg is not None else "-", "T": T,
                 "plan": served[-1][0] if served and served[-1][1] else None,
                 "no_plan_us": statistics.median(times[False]),
                 "plan_us": statistics.median(times[True]), "torch_chain_us": host_us(chain),
                 "same_bits": torch.equal(outs[True], outs[False])}
            records.append(r)
            print(r, flush=True)
    md = "\n".join([
        f"# Eager expert calls with and without their plans ({env['gpu']}, {env['date']})", "",
        f"torch {env['torch']}, triton {env['triton']}. `benchmarks/experiments/ab_call_plans.py`: "
        "fused_experts on the H200 "
        "table's decode configs forced, or moekit's heuristic ones; batched_experts on the configs it chooses (T: rows "
        "per expert); host us per call (300-call loops to the last return; medians of 5 rounds in turns); the torch "
        "bf16 router chain as the host's yardstick.", "",
        "| op | preset | format | configs | mode | T | plan served | no plan | plan | plan / no plan | torch chain | "
        "same bits |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        + [f"| {r['op']} | {r['preset']} | {r['format']} | {r['configs']} | {r['mode']} | {r['T']} | "
           f"{r['plan'] or 'none'} | "
           f"{r['no_plan_us']:.1f} | {r['plan_us']:.1f} | "
           f"{r['plan_us'] / r['no_plan_us']:.2f} | {r['torch_chain_us']:.1f} | {r['same_bits']} |" for r in records])
    print(md)
    if args.out:
        write_results(args.out, archive_stem("ab_call_plans", env), env, records, md + "\n")


if __name__ == "__main__":
    main()
