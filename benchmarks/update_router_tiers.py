"""Write the measured Triton/cuBLAS crossovers of a router benchmark into the package's table.

    python benchmarks/update_router_tiers.py benchmarks/results/router.json
"""

import argparse
import json
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from moekit import presets  # noqa: E402

TABLE = Path(__file__).resolve().parents[1] / "src" / "moekit" / "routing" / "tiers.json"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    args = p.parse_args()
    data = json.loads(args.results.read_text())
    table = json.loads(TABLE.read_text())
    env = data["env"]
    entry = table["gpus"].setdefault(env["gpu"], {})
    for name, per_preset in data["crossover"].items():
        shapes = entry.get(name, {}).get("shapes", {})
        for preset, max_tokens in per_preset.items():
            spec = presets.get(preset)
            shapes[f"H{spec.hidden_size}_E{spec.num_experts}"] = max_tokens
        # Shapes not measured use the smallest limit seen: the other path is the safe side.
        entry[name] = {"max_tokens": min(shapes.values()), "shapes": shapes}
    sources = {s for s in entry.get("source", "").split("; ") if s}
    sources.add(f"benchmarks/results/{args.results.name}, {env['date']}, torch {env['torch']}, triton {env['triton']}")
    entry["source"] = "; ".join(sorted(sources))
    TABLE.write_text(json.dumps(table, indent=2) + "\n")
    print(json.dumps(entry, indent=2))


if __name__ == "__main__":
    main()
