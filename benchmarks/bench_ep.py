"""Expert-parallel benchmark (several GPUs, NCCL): ExpertParallelMoE per rank, both dispatch schemes,
against the whole layer on one GPU (rank 0, all tokens), same run.

  torchrun --nproc-per-node 4 benchmarks/bench_ep.py --preset deepseek-v3 --tokens 1 16 256 --out results/

Timing: allgather mode under CUDA-graph replay (static shapes); all_to_all eagerly (its counts are a
host sync). Each rank times its own tokens (T per rank); rank 0 writes JSON + markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moekit import FusedMoE  # noqa: E402
from moekit.tools.bench.timing import eager_time_us, environment, graph_time_us  # noqa: E402
from moekit.distributed import ExpertParallelMoE, shard_layer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256, 4096])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(0)
    full = FusedMoE.from_preset(args.preset, dtype=torch.bfloat16, device="cuda")
    local = shard_layer(full, rank, world)
    if rank != 0:
        del full                                                   # only rank 0 keeps the whole layer (baseline)
    torch.cuda.empty_cache()
    records = []
    with torch.no_grad():
        for T in args.tokens:
            x = torch.randn(T, local.spec.hidden_size, device="cuda", dtype=torch.bfloat16)
            row = {"preset": args.preset, "world": world, "T_per_rank": T}
            for mode in ("allgather", "all_to_all"):
                ep = ExpertParallelMoE(local, mode=mode)
                dist.barrier()
                timer = graph_time_us if mode == "allgather" else eager_time_us
                row[mode] = timer([lambda: ep(x)])
            if rank == 0:
                xs = torch.randn(world * T, local.spec.hidden_size, device="cuda", dtype=torch.bfloat16)
                row["one_gpu_all_tokens"] = graph_time_us([lambda: full(xs)])
                records.append(row)
                print(row, flush=True)
            dist.barrier()
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ep.json").write_text(json.dumps({"env": environment(), "records": records}, indent=1))
        lines = ["| preset | world | T per rank | allgather us | all_to_all us | 1 GPU, all tokens us |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['preset']} | {r['world']} | {r['T_per_rank']} | {r['allgather']:.1f} | {r['all_to_all']:.1f} | "
                  f"{r['one_gpu_all_tokens']:.1f} |" for r in records]
        (args.out / "ep.md").write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
