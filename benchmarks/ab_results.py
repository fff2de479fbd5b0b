"""A same-run A/B's log as results: JSON, markdown and the log itself under benchmarks/results/archive/.

The log is what a device call prints when it runs ab_configs.py for two source trees in turn
(benchmarks/ab_trees.sh), each line prefixed with ``ROUND TREE PRESET`` (TREE OLD or NEW, PRESET gpt-oss / qwen3 /
deepseek, in its checkpoint format, or PRESET/WEIGHTS for another, e.g. gpt-oss/dense), e.g.

    1 OLD gpt-oss T=  4096 table      3210.5 us   diff vs table 0.0

    python benchmarks/ab_results.py ab.log ab_w4_words_2026-12-03 --change "..." --old b039009 --new 54acb20 --date 2026-12-03

Rows timed in both trees give NEW / OLD per round; rows timed in one tree only (configs compared within it)
are listed apart. GPU, date and versions are written as given (defaults: the H200 runs of this project).
Name a result by what it tried and the date it was measured, and add its line to results/archive/INDEX.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

PRESETS = {"gpt-oss": ("gpt-oss-120b", "mxfp4"), "qwen3": ("qwen3-30b-a3b", "nvfp4"),
           "deepseek": ("deepseek-v3", "fp8_block")}
LINE = re.compile(r"(\d+) (OLD|NEW) (\S+) T=\s*(\d+) (\S+)\s+([\d.]+) us")
KEY = ("round", "preset", "weights", "T", "config")


def parse(log: Path) -> list[dict]:
    rows = []
    for line in log.read_text().splitlines():
        if m := LINE.match(line):
            label, _, weights = m.group(3).partition("/")  # gpt-oss/dense: another format than the preset's own
            preset, weights = PRESETS[label][0], weights or PRESETS[label][1]
            rows.append(dict(tree=m.group(2), round=int(m.group(1)), preset=preset, weights=weights,
                             T=int(m.group(4)), config=m.group(5), us=float(m.group(6))))
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    same = lambda a, b: all(a[k] == b[k] for k in KEY)  # noqa: E731
    two_trees = any(r["tree"] == "OLD" for r in rows)
    lines = [f"# Same-run A/B: {meta['change']} ({meta['gpu']}, {meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}. {meta['method']}" + (
                 f"; OLD and NEW trees alternating in one device call (same machine, same process order). OLD = "
                 f"{meta['old']}, NEW = {meta['new']}. us per call; the ratio is NEW / OLD in the same round." if two_trees
                 else f". One tree: {meta['new']}. us per call."), ""]
    if two_trees:
        lines += ["| round | preset | weights | T | config | OLD us | NEW us | NEW / OLD |", "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["tree"] == "OLD"):
        n = next((x for x in rows if x["tree"] == "NEW" and same(x, r)), None)
        if n:
            lines.append(f"| {r['round']} | {r['preset']} | {r['weights']} | {r['T']} | {r['config']} | "
                         f"{r['us']:.1f} | {n['us']:.1f} | {n['us'] / r['us']:.3f} |")
    alone = [r for r in rows if not any(x is not r and same(x, r) for x in rows)]
    if alone:
        lines += [""] * two_trees + ["Timed in one tree only (configs compared within that tree's same run):", "",
                  "| round | tree | preset | weights | T | config | us |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['round']} | {r['tree']} | {r['preset']} | {r['weights']} | {r['T']} | {r['config']} | "
                  f"{r['us']:.1f} |" for r in alone]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path)
    p.add_argument("name", help="results/archive/<name>.{json,md,txt}: what was tried and the date, e.g. ab_w4_words_2026-12-03")
    p.add_argument("--change", required=True)
    p.add_argument("--old", default="-", help="the OLD tree (commit and what it is); none where the log has one tree")
    p.add_argument("--new", required=True)
    p.add_argument("--gpu", default="NVIDIA H200")
    p.add_argument("--date", required=True)
    p.add_argument("--torch", default="2.11.0+cu130")
    p.add_argument("--triton", default="3.6.0")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "archive")
    args = p.parse_args(argv)
    meta = dict(gpu=args.gpu, date=args.date, torch=args.torch, triton=args.triton,
                method="benchmarks/ab_configs.py, whole fused_experts calls, CUDA-graph replay over two layers",
                change=args.change, old=args.old, new=args.new, source=f"results/archive/{args.name}.txt (the run's log)")
    rows = parse(args.log)
    (args.out / f"{args.name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    shutil.copy(args.log, args.out / f"{args.name}.txt")
    md = markdown(rows, meta)
    (args.out / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
