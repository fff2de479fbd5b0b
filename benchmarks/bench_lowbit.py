"""Low-precision experts benchmark (GPU): see moekit.tools.bench.lowbit (also `moekit bench --weights native`).

  python benchmarks/bench_lowbit.py --out benchmarks/results
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moekit.tools.bench.lowbit import main  # noqa: E402

if __name__ == "__main__":
    main()
