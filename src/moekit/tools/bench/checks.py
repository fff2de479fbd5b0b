"""Output checks of the experts benchmarks (experts.py, lowbit.py): every timed call's output against its float64
reference, at every token count the bench times, each error against its budget (moekit.metrics).

A case is a list of calls ``(x [T, H], layer, topk_weights [T, k], topk_ids [T, k])`` (experts.make_cases). Up to
FULL_CHECK_MAX_T tokens every row of every call is checked; above, SAMPLE_ROWS rows drawn at random (the float64
reference of 16384 tokens through DeepSeek-V3's experts would take longer than the timing). The implementation
always runs the whole call, as timed; only its output is cut to the checked rows (rows are independent).
"""

from __future__ import annotations

import zlib

import torch

from ...metrics import Tolerance, rel_errors, within

FULL_CHECK_MAX_T = 1024  # every row checked up to this many tokens
SAMPLE_ROWS = 256  # rows checked above it, drawn at random


def checked_rows(num_tokens: int, key: str) -> torch.Tensor | None:
    """None (every row) for num_tokens <= FULL_CHECK_MAX_T; else SAMPLE_ROWS distinct row indices, sorted (int64, on
    the CPU), from a generator seeded by ``key`` (the case's name): the same rows in every run of the case."""
    if num_tokens <= FULL_CHECK_MAX_T:
        return None
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randperm(num_tokens, generator=g)[:SAMPLE_ROWS].sort().values


def rows_words(num_tokens: int, rows: torch.Tensor | None) -> str:
    """The results' words for what was checked: "all" or "256 of 4096 (random)"."""
    return "all" if rows is None else f"{len(rows)} of {num_tokens} (random)"


def _cut(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows.to(t.device)]


def references(ref_fn, calls, rows: torch.Tensor | None) -> list[torch.Tensor]:
    """float64 [n, H] per call: ``ref_fn(x, layer, topk_weights, topk_ids)`` on each call's checked rows."""
    return [ref_fn(_cut(x, rows), layer, _cut(tw, rows), _cut(tid, rows)) for x, layer, tw, tid in calls]


def outputs(fn, calls, rows: torch.Tensor | None) -> list[torch.Tensor]:
    """``fn(*call)`` of each call, whole (as timed), cut to the checked rows."""
    return [_cut(fn(*call), rows) for call in calls]


def worst(outs, refs) -> tuple[float, float]:
    """(max_rel, rms_rel) of ``outs`` against ``refs``, each the worst over the calls."""
    errors = [rel_errors(got, ref) for got, ref in zip(outs, refs)]
    return max(e[0] for e in errors), max(e[1] for e in errors)


def worst_errors(fn, calls, refs, rows: torch.Tensor | None) -> tuple[float, float]:
    """(max_rel, rms_rel) of ``fn`` on each call's checked rows against ``refs``, each the worst over the calls."""
    return worst(outputs(fn, calls, rows), refs)


def error_cell(rms_rel: float | None, max_rel: float | None, tol: Tolerance) -> str:
    """A table's cell for a checked output: its RMS error, in bold when over ``tol`` (with the max error when that
    is what is over)."""
    if rms_rel is None:
        return "-"
    if within(tol, max_rel, rms_rel):
        return f"{rms_rel:.1e}"
    return f"**{rms_rel:.1e}**" if rms_rel > tol.rms_rel else f"**{rms_rel:.1e}** (max {max_rel:.1e})"


def over_budget_words(over: list[tuple[str, str, int]]) -> str:
    """One line naming the (implementation, preset, T) whose outputs were over budget, grouped by implementation
    and preset."""
    groups: dict[str, dict[str, list[int]]] = {}
    for impl, preset, T in over:
        groups.setdefault(impl, {}).setdefault(preset, []).append(T)
    return f"Over budget ({len(over)}): " + "; ".join(
        f"{impl} at " + ", ".join(f"{preset} (T = {', '.join(map(str, ts))})" for preset, ts in by_preset.items())
        for impl, by_preset in groups.items()) + "."


def budget_words(tol: Tolerance) -> str:
    return f"RMS {tol.rms_rel:.0e}, max {tol.max_rel:.0e}"
