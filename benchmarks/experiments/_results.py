"""What the A/B scripts here share: the run's facts and a writer that keeps every row as it comes."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Callable

import torch
import triton


def run_meta() -> dict:
    """The GPU, the date and the versions a results file names."""
    return {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__}


def row_writer(out: Path, meta: dict, markdown: Callable[[dict, list], str]) -> Callable[[list], None]:
    """``write(rows)``: out.json ({"meta", "rows"}) and out.md again after every row, so that a run cut short keeps
    what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(rows: list) -> None:
        out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        out.with_suffix(".md").write_text(markdown(meta, rows))
    return write
