"""How `moekit verify` runs: the checks grouped by backend, each group in a child process, so a
device fault (illegal address, abort, segfault) in one backend is reported as that backend
FAILED with the tail of its stderr while the other groups go on.

Plugins (modules that register backends, e.g. a vendor kernel) load from MOEKIT_PLUGINS
(comma-separated module names) in the parent and in every child.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ... import _invariant, presets
from ...metrics import CheckResult
from . import invariance_checks
from .experts_checks import check_experts, experts_backends
from .router_checks import check_router

ROUTER_GROUP = {"torch": "torch", "unfused": "torch", "triton": "triton", "fused": "triton", "cublas": "cublas"}
LAYER_GROUP = "layer"  # the whole FusedMoE, served by whatever auto picks
CPU_INVARIANCE_SIZES = (1, 2, 7, 33)  # the interpreter's batches (a GPU runs moekit._invariant.SIZES)
PROGRESS = "moekit-verify-case"  # a child's line per finished case


def load_plugins() -> None:
    """Import the modules MOEKIT_PLUGINS names (comma-separated): they register backends. One that does not import
    is a ValueError naming it."""
    for name in filter(None, os.environ.get("MOEKIT_PLUGINS", "").split(",")):
        try:
            importlib.import_module(name.strip())
        except ImportError as exc:
            raise ValueError(f"MOEKIT_PLUGINS: cannot import {name.strip()!r} ({exc})") from exc


def groups(device: torch.device, dtype: torch.dtype, router_impls: dict[str, list[str]]) -> list[str]:
    """Every backend group with something to check here, in a stable order."""
    found = {ROUTER_GROUP[i] for impls in router_impls.values() for i in impls}
    found |= set(experts_backends(device, dtype))
    order = ["torch", "triton", "cublas"]
    return sorted(found, key=lambda g: (order.index(g) if g in order else len(order), g)) + [LAYER_GROUP]


def run_group(group: str, names: list[str], tokens: list[int], dtype: torch.dtype, device: torch.device,
              router_impls: dict[str, list[str]], on_gpu: bool, on_case=None) -> list[CheckResult]:
    """The checks of one group, in this process; ``on_case(preset, T)`` after each (preset, T) case."""
    mine = {op: [i for i in v if ROUTER_GROUP.get(i) == group] for op, v in router_impls.items()}
    results = []
    for n, (name, T) in enumerate((n, T) for n in names for T in tokens):
        spec = presets.get(name) if on_gpu else presets.get(name).scaled()
        torch.manual_seed(n + 1)
        # The interpreter is slow: on the CPU the low-bit formats run at the smallest and the largest token count
        # only (the decode and the aligned kernels both).
        low_bit = on_gpu or T in (0, min([t for t in tokens if t] or [0]), max(tokens))
        checks = []
        if any(mine.values()):
            checks.append(("(router)", lambda: check_router(spec, T, dtype, device, mine)))
        if group == LAYER_GROUP:
            checks.append(("(FusedMoE)", lambda: check_experts(spec, T, dtype, device, only=[], with_layer=True)))
        elif group in experts_backends(device, dtype):
            checks.append(("(experts)", lambda: check_experts(spec, T, dtype, device, only=[group], with_layer=False,
                                                              low_bit=low_bit)))
        if _invariant.enabled() and T == tokens[0]:  # batches of their own sizes: once per preset
            checks.append(("(invariance)", lambda: invariance(group, spec, dtype, device, mine, on_gpu)))
        for what, check in checks:
            try:
                results += check()
            except Exception as exc:  # a raising check fails its own rows; the case's other checks still run
                results.append(CheckResult(what, group, spec.name, T, float("inf"), float("inf"), 0.0, False,
                                           f"raised {type(exc).__name__}: {exc}"[:300]))
        if on_case is not None:
            on_case(name, T)
    return results


def invariance(group: str, spec, dtype, device, router_impls: dict[str, list[str]], on_gpu: bool) -> list[CheckResult]:
    """Batch-invariance rows of one group for one preset: its router implementations, its experts backend in every
    format, or (the layer group) the whole FusedMoE."""
    sizes = _invariant.SIZES if on_gpu else CPU_INVARIANCE_SIZES
    if group == LAYER_GROUP:
        return invariance_checks.layer_checks(spec, dtype, device, sizes)
    rows = invariance_checks.router_checks(spec, dtype, device, router_impls, sizes)
    if group in experts_backends(device, dtype):
        rows += invariance_checks.experts_checks(spec, dtype, device, group, sizes)
    return rows


def rows_from_json(text: str) -> list[CheckResult]:
    """The rows of `moekit verify --json` (standard JSON: a non-finite error, NaN output or a crash, is null; it comes
    back as inf, which no budget passes)."""
    rows = []
    for row in json.loads(text):
        errors = {k: float("inf") for k in ("max_rel", "rms_rel") if row.get(k) is None}
        rows.append(CheckResult(**{**row, **errors, "agree": 0.0 if row.get("agree") is None else row["agree"]}))
    return rows


def report_case(name: str, tokens: int) -> None:
    """A child's progress line for its parent (see :func:`run_isolated`)."""
    print(f"{PROGRESS} {name} {tokens}", file=sys.stderr, flush=True)


def run_isolated(group: str, argv: list[str], on_case=None) -> tuple[list[CheckResult], str]:
    """Run one group in a child process (`moekit verify --backend group --no-isolate ...`); a child
    that dies yields one FAILED row with its exit status and output tail. The child reports each
    finished case on its output, and ``on_case(preset, T)`` hears of it as it happens."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "moekit", "verify", "--backend", group, "--no-isolate", "--progress-lines",
               "--json", str(report)] + argv
        output = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                if line.startswith(PROGRESS):
                    _, name, tokens = line.split()
                    if on_case is not None:
                        on_case(name, int(tokens))
                else:
                    output.append(line)
        text = "".join(output)
        if report.exists():
            return rows_from_json(report.read_text()), text
    how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
           else f"exit status {proc.returncode}")
    tail = " | ".join(text.strip().splitlines()[-3:])[-300:]
    return [CheckResult("(every op)", group, "-", 0, float("inf"), float("inf"), 0.0, False,
                        f"child process died ({how}): {tail}")], text
