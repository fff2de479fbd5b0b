"""Plots of benchmark records: time (or % of the physical floor) against tokens, one line per
implementation, log-scaled tokens."""

from __future__ import annotations

from pathlib import Path


def plot(records: list[dict], impls: list[str], path: str | Path, *, preset: str, gpu: str,
         metric: str = "us") -> Path:
    """Save a PNG for one preset. metric: "us" (time per call) or "floor" (% of the floor reached)."""
    if metric not in ("us", "floor"):
        raise ValueError(f"metric must be 'us' or 'floor', got {metric!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # an optional dependency: say how to get it
        raise RuntimeError("plots need matplotlib: pip install 'moekit[bench]'") from exc
    rows = sorted((r for r in records if r["preset"] == preset), key=lambda r: r["T"])
    if not rows:
        raise ValueError(f"no records for preset {preset!r}")
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for impl in impls:
        pts = [(r["T"], r[impl] if metric == "us" else 100 * r["floor_us"] / r[impl])
               for r in rows if r.get(impl) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log", base=2)
    if metric == "us":
        ax.set_yscale("log")
        ax.set_ylabel("time per call (us)")
    else:
        ax.set_ylabel("% of the physical floor")
    ax.set_xlabel("tokens T")
    ax.set_title(f"{preset} experts on {gpu}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
