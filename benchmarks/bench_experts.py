"""Experts benchmark (GPU): see moekit.tools.bench.experts (also `moekit bench`).

  python benchmarks/bench_experts.py --out benchmarks/results
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moekit.tools.bench.experts import main  # noqa: E402

if __name__ == "__main__":
    main()
