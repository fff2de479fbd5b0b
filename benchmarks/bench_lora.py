"""Expert LoRA benchmark (GPU): see moekit.tools.bench.lora."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moekit.tools.bench.lora import main  # noqa: E402

if __name__ == "__main__":
    main()
