"""Write the measured Triton/cuBLAS crossovers of a router benchmark into the package's table.

    python benchmarks/update_router_tiers.py benchmarks/results/router.json
"""

import argparse
import json
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from moekit import presets  # noqa: E402

TABLE = Path(__file__).resolve().parents[1] / "src" / "moekit" / "configs" / "router_tiers.json"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    args = p.parse_args()
    data = json.loads(args.results.read_text())
    table = json.loads(TABLE.read_text())
    shapes = {}
    for name, max_tokens in data["crossover"].items():
        spec = presets.get(name)
        shapes[f"H{spec.hidden_size}_E{spec.num_experts}"] = max_tokens
    env = data["env"]
    table["gpus"][env["gpu"]] = {
        # Shapes not measured use the smallest crossover seen: cuBLAS is the safe side.
        "max_tokens": min(shapes.values()),
        "shapes": shapes,
        "source": f"benchmarks/results/{args.results.name}, {env['date']}, torch {env['torch']}, triton {env['triton']}",
    }
    TABLE.write_text(json.dumps(table, indent=2) + "\n")
    print(json.dumps(table["gpus"][env["gpu"]], indent=2))


if __name__ == "__main__":
    main()
