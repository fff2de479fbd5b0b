"""A/B of explicit expert-kernel configs against the shipped table, in one device call.

Whole `fused_experts` calls (alignment included), CUDA-graph replay over two layers' weights, each
config's output compared with the table config's. For kernel changes whose effect depends on the
block shape (e.g. a config the tuner skips because it spills outside the K loop).

    python benchmarks/ab_configs.py --preset deepseek-v3 --weights fp8_block --tokens 4096 \\
        --config table 128:128,128,8,3,8:128,128,8,3,8

A config is ``table``, ``table+OPT+OPT...`` (the table's config with options in both GEMMs) or
``BLOCK_M:gemm1:gemm2`` with each GEMM as ``block_n,block_k,num_warps,num_stages,group_m[,OPT...]``.
OPT: ``tma`` (TMA weight boxes), ``half`` (half tail blocks), ``rows`` (GemmConfig.row_scaled: CUDA-core fp16x2
products on activation rows scaled inside the kernel, GEMM1 on kernels/gemv1_rows.py), ``stagesN`` / ``bnN`` /
``bkN`` / ``wN`` (pipeline stages, block_n, block_k, warps), ``packed`` /
``unpacked`` (the CUDA-core 4-bit GEMM1's fp16x2 products on or off), ``ahead`` / ``atuse`` (GemmConfig.scales_ahead
of the tensor-core 4-bit GEMMs), ``split`` (ExpertsConfig.split_slots:
GEMM2 per pair, then the combine, in the "gemv" and "per_pair" modes), e.g. ``table+half+stages3``; ``g1.OPT`` / ``g2.OPT`` sets an
option in one GEMM only, e.g. ``table+g2.stages3``. ``table@N`` is the table's config for N tokens (its bucket's
entry, or the heuristic where the bucket has none), timed at the run's T: e.g. a neighbouring bucket's entry
where T's own bucket has none; options follow as above (``table@16+half``). ``FILE.json@N`` is the entry for
bucket N of a tuner output (``moekit tune --out``), for this preset's shape and weight format: how a retune's
picks, decode modes included, are A/B'd against the table before they are merged. ``heuristic`` is
expert_configs.heuristic's config at the run's T (what a shape without table entries gets).

``--layouts packed pairs`` runs every config on 4-bit stacks in both byte layouts (``moekit.formats.prepare``); the
"pairs" rows are named ``CONFIG [pairs]`` and compared with the table config on the stacks as stored.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import triton

from moekit import presets
from moekit.experts import configs as expert_configs
from moekit.tools.bench.experts import routes
from moekit.tools.bench.timing import graph_time_us
from moekit.experts.configs import ExpertsConfig, GemmConfig
from moekit.experts import fused_experts
from moekit.experts.configs import config_family
from moekit.formats import prepare
from moekit.tools.tune import random_weights


_NUMBERED = {"stages": "num_stages", "bn": "block_n", "bk": "block_k", "w": "num_warps"}


def _option(word: str) -> dict:
    """One GemmConfig option: tma, half (half_tails), rows (row_scaled), stagesN / bnN / bkN / wN (num_stages,
    block_n, block_k, num_warps), packed / unpacked, ahead / atuse."""
    if word in ("tma", "half", "rows"):
        return {{"tma": "tma", "half": "half_tails", "rows": "row_scaled"}[word]: True}
    for prefix, name in _NUMBERED.items():
        if word.startswith(prefix) and word.removeprefix(prefix).isdigit():
            return {name: int(word.removeprefix(prefix))}
    if word in ("packed", "unpacked"):
        return {"packed": word == "packed"}
    if word in ("ahead", "atuse"):
        return {"scales_ahead": word == "ahead"}
    raise ValueError(f"unknown config option {word!r} (tma, half, rows, stagesN, bnN, bkN, wN, packed, unpacked, "
                     "ahead, atuse)")


def tuned_entry(path: str, bucket: int, shape: str, weight_format: str) -> ExpertsConfig:
    """Bucket ``bucket``'s entry for ``shape`` in a tuner output, under its key for ``weight_format`` (the table's
    format family: dense, mxfp4, nvfp4, fp8)."""
    tuned = json.loads(Path(path).read_text())
    keys = [k for k in tuned if k.split("|")[3:] == ([] if weight_format == "dense" else [weight_format])
            and shape in tuned[k]]
    if len(keys) != 1 or str(bucket) not in tuned[keys[0]][shape]:
        raise ValueError(f"{path}: no single entry for {shape}, {weight_format} weights, bucket {bucket}")
    return ExpertsConfig.from_dict(tuned[keys[0]][shape][str(bucket)])


def parse_config(text: str, table: ExpertsConfig, at_tokens=None, tuned=None, heuristic=None) -> ExpertsConfig | None:
    """The config a --config word names; ``at_tokens(N)`` gives the table's config for N tokens (``table@N``),
    ``tuned(FILE, N)`` a tuner output's entry (``FILE.json@N``), ``heuristic`` the heuristic's at the run's T."""
    if text == "table":
        return None
    if text == "heuristic":
        return heuristic
    if ".json@" in text:
        path, _, bucket = text.rpartition("@")
        return tuned(path, int(bucket))
    if text.startswith("table@"):
        head, _, rest = text.partition("+")
        base = at_tokens(int(head.removeprefix("table@")))
        return parse_config("table+" + rest, base) if rest else base
    if text.startswith("table+"):  # the table's config with options set in both GEMMs (g1. / g2.: in one)
        opts = {1: {}, 2: {}}
        words = text.split("+")[1:]
        for word in (w for w in words if w != "split"):
            gemms, word = ((int(word[1]),), word[3:]) if word[:3] in ("g1.", "g2.") else ((1, 2), word)
            for g in gemms:
                opts[g] |= _option(word)
        table = replace(table, split_slots=table.split_slots or "split" in words)
        return replace(table, gemm1=replace(table.gemm1, **opts[1]), gemm2=replace(table.gemm2, **opts[2]))
    block_m, g1, g2 = text.split(":")

    def gemm(spec: str) -> GemmConfig:
        words = spec.split(",")
        numbers = [int(w) for w in words if w.isdigit()]
        opts = {}
        for word in (w for w in words if not w.isdigit()):
            opts |= _option(word)
        return GemmConfig(*numbers, **opts)
    return ExpertsConfig(int(block_m), gemm(g1), gemm(g2))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--weights", default="dense", help="dense, mxfp4, nvfp4, fp8_block, fp8_channel")
    p.add_argument("--act-quant", default=None, choices=["fp8_group"],
                   help="FP8 activations (implied by FP8 weights; with mxfp4 weights: W4A8)")
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    p.add_argument("--config", nargs="+", default=["table"])
    p.add_argument("--layouts", nargs="+", default=["packed"], choices=["packed", "pairs"],
                   help="4-bit byte layouts to run each config on (pairs: moekit.formats.prepare)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "ab_configs.json")
    args = p.parse_args(argv)
    spec = presets.get(args.preset)
    act_quant = "fp8_group" if args.weights.startswith("fp8") else args.act_quant
    fmt = config_family(args.weights, act_quant)  # before the weights: a pair without kernels fails at once
    layers = random_weights(spec, layers=2, weight_format=args.weights, prepared=False)
    by_layout = {"packed": layers}
    if "pairs" in args.layouts:
        by_layout["pairs"] = [(prepare(w13), prepare(w2)) for w13, w2 in layers]

    def at_tokens(n: int) -> ExpertsConfig:  # the table's config (or the heuristic) for n tokens
        return expert_configs.choose(n, spec.num_experts, spec.top_k, 2 * spec.intermediate_size, spec.hidden_size,
                                     torch.device("cuda"), torch.bfloat16, fmt)[0]
    shape = expert_configs.shape_key(spec.num_experts, 2 * spec.intermediate_size, spec.hidden_size)

    def tuned(path: str, bucket: int) -> ExpertsConfig:
        return tuned_entry(path, bucket, shape, fmt)
    rows = []
    for T in args.tokens:
        x = torch.randn(T, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
        weights, ids = routes(spec, T)

        def call(w13, w2, config):
            return fused_experts(x, w13, w2, weights, ids, activation=spec.activation, act_quant=act_quant,
                                 backend="triton", config=config)

        ref = call(*layers[0], None).float()
        table = at_tokens(T)
        heur = expert_configs.heuristic(T, spec.num_experts, spec.top_k, 2 * spec.intermediate_size, spec.hidden_size,
                                        fmt)
        print(f"T={T} table: {table}", flush=True)
        runs = [(text, layout) for text in ["table"] + [c for c in args.config if c != "table"]
                for layout in ["packed"] + [lay for lay in args.layouts if lay != "packed"]]
        for text, layout in runs:
            config = parse_config(text, table, at_tokens, tuned, heur)
            stacks = by_layout[layout]
            name = text if layout == "packed" else f"{text} [{layout}]"
            try:
                diff = ((call(*stacks[0], config).float() - ref).norm() / ref.norm()).item()
                us = graph_time_us([lambda w=w: call(*w, config) for w in stacks], replays=10, warmup=2)  # per call
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is a result too
                us, diff = float("nan"), f"{type(exc).__name__}: {str(exc)[:80]}"
            rows.append({"T": T, "config": name, "layout": layout, "us": us, "rel_diff_vs_table": diff})
            print(f"T={T:6d} {name:40s} {us:10.1f} us   diff vs table {diff}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__, "preset": args.preset,
            "weights": args.weights + (f" + {act_quant} activations" if act_quant and fmt == "w4a8" else "")}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(meta, rows))


def markdown(meta: dict, rows: list[dict]) -> str:
    """The A/B as a table: us per call and each config's time against the table config's at that T."""
    lines = [f"# Config A/B: {meta['preset']}, {meta['weights']} weights ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}. Whole fused_experts calls, CUDA-graph replay over two "
             "layers, every config in the same run; rel diff: output against the table config's.", "",
             "| T | config | us | / table | rel diff vs table |", "|---|---|---|---|---|"]
    table_us = {r["T"]: r["us"] for r in rows if r["config"] == "table"}
    for r in rows:
        diff = r["rel_diff_vs_table"]
        lines.append(f"| {r['T']} | {r['config']} | {r['us']:.1f} | {r['us'] / table_us[r['T']]:.3f} | "
                     f"{diff if isinstance(diff, str) else f'{diff:.2e}'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
