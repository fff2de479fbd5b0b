"""Batch-invariant mode against the default mode (GPU): see moekit.tools.bench.invariant.

  python benchmarks/bench_invariant.py --out benchmarks/results     # writes invariant.json and invariant.md
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moekit.tools.bench.invariant import main  # noqa: E402

if __name__ == "__main__":
    main()
