"""Can one token's GEMM1 stream and decode gpt-oss-120b's MXFP4 weights at the copy rate? (GPU; issue 28, part 2)

One token, its top-4 experts, w13 [5760, 2880] each (gate/up rows interleaved) in MXFP4: 4 x 5760 x (1440 code
bytes + 90 scale bytes) = 35.25 MB per call. The same run measures, inside CUDA graphs of 8 calls that rotate over
4 layers' full [128, 5760, 2880] stacks and fresh routes (so the weights come from HBM, not the 50 MB L2):

  the floor       bytes / timing.COPY_BW (4.2 TB/s, the H200's copy rate): the repository's floor convention, the
                  rate every other table's floors use, whatever GPU ran
  the copy rate   this run's own: torch copy_ of the same bytes and of a 1 GiB buffer, (read + written) / time, the
                  larger of the two; reported beside the convention (another GPU copies at another rate)
  read-only       a Triton kernel that only reads the same number of bytes (its best of a few configs)
  empty kernel    a graph of launches that do nothing: the fixed cost of any one-kernel call
  moekit gemv1    moekit's current decode GEMM1 (experts/triton_backend.gemv1 at the table's config for T=1),
                  bias + swiglu_oai + bf16 store included
  the variants    of benchmarks/_stream_decode_kernels.py (layout x products, see VARIANTS), each config checked
                  against float64 on two calls (output poisoned with NaN first) before it is timed and once after

and prints a table of the best config per variant last: us, GB/s of weight bytes, % of COPY_BW (the convention,
the headline and issue 28's 80% target), % of this run's copy rate, % of the read-only rate, errors. Writes
<out>/stream_decode.json (every record, rewritten as the run goes, so a crash keeps what was measured) and
<out>/stream_decode.md. Configs are compiled up front in a thread pool; the sweep stops
starting configs when --budget-s has passed since the start (default keeps the whole run under 4 minutes).

    python benchmarks/stream_decode.py --out benchmarks/results
    python benchmarks/stream_decode.py --compile-only        # CPU: build every config for sm_90 (fake driver)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

if "--compile-only" in sys.argv:  # real JIT functions, not the interpreter (read when the kernels are defined)
    os.environ["TRITON_INTERPRET"] = "0"

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402
import triton  # noqa: E402

import _stream_decode_kernels as kern  # noqa: E402
from moekit.tools.bench.timing import COPY_BW  # noqa: E402
from moekit.tools.bench.timing import graph_time_us as graph_us  # noqa: E402

# gpt-oss-120b
HIDDEN = 2880
ROWS13 = 5760  # w13 rows: gate n at 2n, up n at 2n + 1
EXPERTS = 128
TOP_K = 4
LAYERS = 4  # 4 x 35 MB read per 4 calls, far past L2 (50 MB): no call finds its experts there
CALLS = 8
SCALE_BYTES = (118, 125)  # E8M0 bytes drawn in [118, 125): 2^-9 .. 2^-3, gpt-oss-like weight magnitudes
MAX_REL = 1e-2  # W4A16 budget against float64
TARGET_PCT = 80.0  # issue 28's question: >= 80% of the copy rate (COPY_BW, the convention)
CONVENTION_GBPS = COPY_BW / 1e9  # the floors' copy rate in GB/s
RMS_REL = 3e-3
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclasses.dataclass(frozen=True)
class Config:
    layout: str = "rows"  # "rows" (as stored) or "tiles" (prepare_tiles)
    math: str = "f32"  # "f32" or "h2"
    tn: int = 16  # rows per program
    g: int = 32  # scale groups per chunk (a power of two)
    gc: int = 0  # tiles: groups per record (divides K/32); the chunk is its next power of two
    split: int = 1  # programs along K per row tile
    reduce: str = "last"  # split > 1: "last" (the last program of a tile sums) or "pass" (a second kernel)
    loop: str = "static"  # "static" (unrolled) or "dynamic" (scf.for, num_stages applies)
    depth: int = 1  # chunks loaded ahead by hand (static: 0..2, dynamic: 0..1)
    warps: int = 4
    stages: int = 1

    def label(self) -> str:
        parts = [f"TN{self.tn}", f"GC{self.gc}" if self.layout == "tiles" else f"G{self.g}"]
        if self.split > 1:
            parts.append(f"split{self.split}-{self.reduce}")
        parts.append(f"{self.loop}-d{self.depth}" + (f"-s{self.stages}" if self.loop == "dynamic" else ""))
        parts.append(f"w{self.warps}")
        return " ".join(parts)


def chunk_groups(cfg: Config) -> int:
    return triton.next_power_of_2(cfg.gc) if cfg.layout == "tiles" else cfg.g


def num_chunks(cfg: Config, k: int) -> int:
    groups = k // 32
    if cfg.layout == "tiles":
        return triton.cdiv(groups // cfg.gc, cfg.split)
    return triton.cdiv(triton.cdiv(groups, cfg.split), cfg.g)


def check_config(cfg: Config, n: int, k: int) -> None:
    """ValueError unless ``cfg`` fits rows ``n`` and codes ``k`` (the kernels index without row masks)."""
    groups = k // 32
    why = []
    if k % 32 or n % cfg.tn or cfg.tn & (cfg.tn - 1):
        why.append("K a multiple of 32, TN a power of two dividing N")
    if cfg.layout == "tiles":
        if cfg.gc <= 0 or groups % cfg.gc or (cfg.tn * cfg.gc) % 16:
            why.append("GC dividing K/32 with TN * GC a multiple of 16 (16-byte aligned records)")
        elif cfg.split > groups // cfg.gc:
            why.append("at most one split per record")
    elif cfg.g <= 0 or cfg.g & (cfg.g - 1) or cfg.split > groups:
        why.append("G a power of two, at most K/32 splits")
    if cfg.layout not in ("rows", "tiles") or cfg.math not in ("f32", "h2") or cfg.reduce not in ("last", "pass"):
        why.append("layout rows/tiles, math f32/h2, reduce last/pass")
    if cfg.loop not in ("static", "dynamic") or not 0 <= cfg.depth <= (2 if cfg.loop == "static" else 1):
        why.append("loop static (depth 0..2) or dynamic (depth 0..1)")
    if why:
        raise ValueError(f"config {cfg} does not fit N={n}, K={k}: " + "; ".join(why))


# ----------------------------------------------------------------------------------------------------------------
# Load-time layout


def prepare_tiles(data: torch.Tensor, scales: torch.Tensor, tn: int, gc: int) -> torch.Tensor:
    """MXFP4 codes [E, N, K/2] and scales [E, N, K/32] -> one uint8 buffer of the same size: per expert, per tile of
    ``tn`` rows, per record of ``gc`` groups, the tn x gc x 16 code bytes (row-major) then the tn x gc scale bytes."""
    e, n, half_k = data.shape
    groups = scales.shape[-1]
    if half_k != groups * 16 or n % tn or groups % gc:
        raise ValueError(f"prepare_tiles: codes {tuple(data.shape)}, scales {tuple(scales.shape)}, tn={tn}, gc={gc}")
    codes = data.reshape(e, n // tn, tn, groups // gc, gc * 16).transpose(2, 3)
    sc = scales.reshape(e, n // tn, tn, groups // gc, gc).transpose(2, 3)
    recs = torch.cat([codes.reshape(e, n // tn, groups // gc, tn * gc * 16),
                      sc.reshape(e, n // tn, groups // gc, tn * gc)], dim=-1)
    return recs.reshape(-1)


def unprepare_tiles(buf: torch.Tensor, shape: tuple[int, int, int], tn: int,
                    gc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`prepare_tiles`: (codes [E, N, K/2], scales [E, N, K/32]) from the buffer, for an [E, N, K]
    weight ``shape``."""
    e, n, k = shape
    groups = k // 32
    recs = buf.reshape(e, n // tn, groups // gc, tn * gc * 17)
    codes = recs[..., :tn * gc * 16].reshape(e, n // tn, groups // gc, tn, gc * 16).transpose(2, 3)
    sc = recs[..., tn * gc * 16:].reshape(e, n // tn, groups // gc, tn, gc).transpose(2, 3)
    return codes.reshape(e, n, k // 2).contiguous(), sc.reshape(e, n, groups).contiguous()


def operand(cfg: Config, data: torch.Tensor, scales: torch.Tensor, prepared: torch.Tensor | None = None):
    """(words, bytes) pointers as the kernel reads them: rows (codes as int32 words, scales) or tiles (the prepared
    buffer as words and as bytes)."""
    if cfg.layout == "tiles":
        buf = prepared if prepared is not None else prepare_tiles(data, scales, cfg.tn, cfg.gc)
        return buf.view(torch.int32), buf
    return data.view(torch.int32), scales


# ----------------------------------------------------------------------------------------------------------------
# Launch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def scratch(cfg: Config, slots: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parts, counters) of a split-K config (tiny placeholders otherwise); counters start at zero and the kernel
    leaves them there."""
    parts = torch.empty(max(cfg.split, 1) * slots * n if cfg.split > 1 else 1, dtype=torch.float32, device=device)
    counts = torch.zeros(slots * n // cfg.tn if cfg.split > 1 else 1, dtype=torch.int32, device=device)
    return parts, counts


def launch(cfg: Config, x: torch.Tensor, op, bias: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
           scr, k: int, warmup: bool = False):
    """out [slots, N] fp32 = x [K] @ w[ids].T + bias[ids] for weights ``op`` (:func:`operand`). ``warmup``: build
    the kernels without running them. Returns the main kernel's launch handle (compiled kernel when warming up)."""
    slots, n = out.shape
    words, bytes_ = op
    parts, counts = scr
    grid = (slots * (n // cfg.tn) * cfg.split,)
    args = (x, words, bytes_, bias, ids, out, parts, counts, k // 32)
    kwargs = dict(N=n, K=k, SLOTS=slots, LAYOUT=1 if cfg.layout == "tiles" else 0, MATH=1 if cfg.math == "h2" else 0,
                  TN=cfg.tn, G=chunk_groups(cfg), GC=cfg.gc, SPLIT=cfg.split,
                  REDUCE_LAST=cfg.split > 1 and cfg.reduce == "last", NCHUNK=num_chunks(cfg, k),
                  UNROLL=cfg.loop == "static", DEPTH=cfg.depth, XBLOCK=triton.next_power_of_2(k),
                  ASM=not interpreting(), num_warps=cfg.warps, num_stages=cfg.stages)
    if warmup:
        kernel = kern.stream_gemv_kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel = kern.stream_gemv_kernel[grid](*args, **kwargs)
    if cfg.split > 1 and cfg.reduce == "pass":
        block = 1024
        sgrid = (triton.cdiv(slots * n, block),)
        sargs = (parts, bias, ids, out)
        skw = dict(N=n, SLOTS=slots, SPLIT=cfg.split, BLOCK=block, num_warps=4)
        if warmup:
            kern.split_sum_kernel.warmup(*sargs, grid=sgrid, **skw)
        else:
            kern.split_sum_kernel[sgrid](*sargs, **skw)
    return kernel


# ----------------------------------------------------------------------------------------------------------------
# Reference


def dequantize64(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., N, K] of MXFP4 codes [..., N, K/2] and scales [..., N, K/32], exactly (255 scales: NaN)."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=data.device)
    table = torch.cat([mag, -mag])
    codes = torch.stack([data & 15, data >> 4], dim=-1).reshape(*data.shape[:-1], -1, 32)
    s = scales.to(torch.int64).unsqueeze(-1)
    vals = torch.ldexp(table[codes.long()], (s - 127).to(torch.float64))
    vals = torch.where(s == 255, float("nan"), vals)
    return vals.reshape(*data.shape[:-1], data.shape[-1] * 2)


def reference(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """float64 [slots, N]: x @ w[e].T + bias[e] for each routed expert e."""
    idx = ids.long()
    w = dequantize64(data[idx], scales[idx])
    return torch.einsum("snk,k->sn", w, x.to(torch.float64)) + bias[idx].to(torch.float64)


def rel_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |got - ref| / max |ref|, ||got - ref|| / ||ref||); inf where ``got`` is not finite (a lane never
    written keeps its NaN poison)."""
    g, r = got.to(torch.float64), ref.to(torch.float64)
    if not bool(torch.isfinite(g).all()):
        return math.inf, math.inf
    d = g - r
    return (d.abs().max() / r.abs().max().clamp_min(1e-300)).item(), (d.norm() / r.norm().clamp_min(1e-300)).item()


def swiglu_oai64(h: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's activation on interleaved [..., 2I] (gate 2j, up 2j + 1), in float64."""
    h = h.to(torch.float64)
    gate, up = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1.0) * gate * torch.sigmoid(alpha * gate)


# ----------------------------------------------------------------------------------------------------------------
# Sweep

VARIANTS = {
    "rows_f32": "moekit's layout; fp16-bit decode, fp32 FMAs; TN rows x all of K per program",
    "rows_h2": "moekit's layout; fp16x2 FMAs on activations scaled once per token",
    "tiles_f32": "prepared layout (one contiguous record of codes + scales per chunk); fp32 FMAs",
    "tiles_h2": "prepared layout; fp16x2 FMAs",
    "split_f32": "moekit's layout, K split over programs (more bytes in flight), fixed-order reduction; fp32 FMAs",
    "split_h2": "as split_f32 with fp16x2 FMAs",
}


def candidates() -> dict[str, list[Config]]:
    """Each variant's configs, most promising first (the run takes them round-robin across variants until the
    budget is spent)."""
    rows = [dict(tn=16, g=32), dict(tn=32, g=32), dict(tn=32, g=32, warps=8), dict(tn=16, g=16),
            dict(tn=64, g=32, warps=8), dict(tn=16, g=32, depth=2), dict(tn=32, g=16), dict(tn=8, g=32, warps=2),
            dict(tn=16, g=32, loop="dynamic", depth=0, stages=3),
            dict(tn=32, g=32, warps=8, loop="dynamic", depth=1, stages=2),
            # around the best of 2026-12-05 (rows_h2 TN16 G32 w4, 78.6%): longer chunks, fewer warps, one more ahead
            dict(tn=16, g=64), dict(tn=16, g=64, depth=2), dict(tn=16, g=32, warps=2), dict(tn=8, g=64, warps=2),
            dict(tn=16, g=32, loop="dynamic", depth=1, stages=3),
            # around the best of 2026-12-06 on an H100 (rows_h2 TN16 G32 dynamic-d0-s3 w4, 78.7%): deeper pipelines,
            # shorter chunks in more stages, fewer and more rows per program
            dict(tn=16, g=32, loop="dynamic", depth=0, stages=4), dict(tn=16, g=16, loop="dynamic", depth=0, stages=4),
            dict(tn=16, g=32, loop="dynamic", depth=0, stages=2), dict(tn=8, g=32, warps=2, loop="dynamic", depth=0,
                                                                        stages=3),
            dict(tn=16, g=16, loop="dynamic", depth=0, stages=6), dict(tn=32, g=32, loop="dynamic", depth=0, stages=3)]
    tiles = [dict(tn=16, gc=30), dict(tn=32, gc=30), dict(tn=32, gc=30, warps=8), dict(tn=16, gc=15),
             dict(tn=64, gc=30, warps=8), dict(tn=16, gc=30, depth=2), dict(tn=32, gc=15), dict(tn=16, gc=45, warps=8),
             dict(tn=16, gc=15, loop="dynamic", depth=0, stages=3),
             dict(tn=32, gc=30, warps=8, loop="dynamic", depth=1, stages=2)]
    split = [dict(tn=32, g=32, warps=8, split=3), dict(tn=64, g=32, warps=8, split=3), dict(tn=32, g=16, split=2),
             dict(tn=32, g=32, warps=8, split=3, reduce="pass"), dict(tn=64, g=16, warps=8, split=6),
             dict(tn=128, g=16, warps=8, split=6), dict(tn=16, g=16, split=3)]
    out = {}
    for name, base, space in (("rows_f32", dict(layout="rows", math="f32"), rows),
                              ("rows_h2", dict(layout="rows", math="h2"), rows),
                              ("tiles_f32", dict(layout="tiles", math="f32"), tiles),
                              ("tiles_h2", dict(layout="tiles", math="h2"), tiles),
                              ("split_f32", dict(layout="rows", math="f32"), split),
                              ("split_h2", dict(layout="rows", math="h2"), split)):
        out[name] = [Config(**base, **c) for c in space]
    return out


def round_robin(space: dict[str, list[Config]]) -> list[tuple[str, Config]]:
    order = []
    for i in range(max(len(v) for v in space.values())):
        order += [(name, cfgs[i]) for name, cfgs in space.items() if i < len(cfgs)]
    return order


def rate_fields(gbps: float, copy_rate: float | None, read_rate: float | None) -> dict:
    """A record's shares of the reference rates (GB/s in): ``pct_copy`` of COPY_BW (the floors' convention, the
    headline), ``pct_copy_measured`` of this run's copy rate, ``pct_read`` of its read-only kernel's."""
    out = {"pct_copy": 100.0 * gbps / CONVENTION_GBPS}
    if copy_rate:
        out["pct_copy_measured"] = 100.0 * gbps / copy_rate
    if read_rate:
        out["pct_read"] = 100.0 * gbps / read_rate
    return out


def _finite(obj):
    """``obj`` with inf and NaN floats as strings: strict JSON."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


class Run:
    """Inputs of every call, the records so far and the output files."""

    def __init__(self, out_dir: Path, budget_s: float, jobs: int, only: list[str] | None):
        self.t0 = time.monotonic()
        self.out_dir, self.budget_s, self.jobs, self.only = out_dir, budget_s, jobs, only
        self.dev = torch.device("cuda")
        self.records: list[dict] = []
        self.env = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                    "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
        self.bytes = TOP_K * ROWS13 * (HIDDEN // 2 + HIDDEN // 32)
        self.copy_rate = self.read_rate = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)

    # -- inputs
    def build(self) -> None:
        g = torch.Generator(device=self.dev)
        g.manual_seed(28)
        self.layers = []
        for _ in range(LAYERS):
            data = torch.randint(0, 256, (EXPERTS, ROWS13, HIDDEN // 2), dtype=torch.uint8, device=self.dev,
                                 generator=g)
            scales = torch.randint(*SCALE_BYTES, (EXPERTS, ROWS13, HIDDEN // 32), dtype=torch.uint8, device=self.dev,
                                   generator=g)
            bias = (torch.randn(EXPERTS, ROWS13, device=self.dev, generator=g) * 0.5).to(torch.bfloat16)
            self.layers.append((data, scales, bias))
        self.xs = [torch.randn(HIDDEN, device=self.dev, generator=g).to(torch.bfloat16) for _ in range(CALLS)]
        self.ids = [torch.randperm(EXPERTS, device=self.dev, generator=g)[:TOP_K].to(torch.int32) for _ in range(CALLS)]
        self.refs = {}
        for i in (0, 1):  # the calls every config is checked on
            data, scales, bias = self.layers[i % LAYERS]
            self.refs[i] = reference(self.xs[i], data, scales, bias, self.ids[i])
        self.prepared: dict[tuple[int, int], list[torch.Tensor]] = {}
        torch.cuda.synchronize()

    def tiles(self, tn: int, gc: int) -> list[torch.Tensor]:
        if (tn, gc) not in self.prepared:
            self.prepared[(tn, gc)] = [prepare_tiles(d, s, tn, gc) for d, s, _ in self.layers]
        return self.prepared[(tn, gc)]

    def ops(self, cfg: Config) -> list:
        preps = self.tiles(cfg.tn, cfg.gc) if cfg.layout == "tiles" else [None] * LAYERS
        return [operand(cfg, d, s, p) for (d, s, _), p in zip(self.layers, preps)]

    # -- records
    def add(self, rec: dict) -> dict:
        us = rec.get("us")
        if us and rec.get("bytes"):
            rec["GBps"] = rec["bytes"] / (us * 1e3)
            rec |= rate_fields(rec["GBps"], self.copy_rate, self.read_rate)
        self.records.append(rec)
        self.write(complete=False)
        return rec

    def write(self, complete: bool) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        doc = {"env": self.env, "complete": complete, "bytes_per_call": self.bytes,
               "floor_rate_GBps": CONVENTION_GBPS, "copy_rate_GBps": self.copy_rate, "read_rate_GBps": self.read_rate,
               "records": self.records}
        (self.out_dir / "stream_decode.json").write_text(json.dumps(_finite(doc), indent=1))

    # -- baselines
    def baselines(self) -> None:
        nbytes = self.bytes
        src = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=self.dev) for _ in range(CALLS)]
        dst = [torch.empty_like(s) for s in src]
        us = graph_us([lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)])
        same = 2 * nbytes / (us * 1e3)
        self.add({"kind": "baseline", "variant": "copy_ (same bytes)", "config": f"{nbytes / 1e6:.2f} MB read + "
                  "written, 8 buffer pairs", "us": us, "rate_GBps": same, "note": "(read + written) / time"})
        del dst
        big = 1 << 30
        a = torch.empty(big, dtype=torch.uint8, device=self.dev)
        b = torch.empty_like(a)
        a.fill_(7)
        us_big = graph_us([lambda a=a, b=b: b.copy_(a)], replays=20)
        big_rate = 2 * big / (us_big * 1e3)
        self.add({"kind": "baseline", "variant": "copy_ (1 GiB)", "config": "1 GiB read + written", "us": us_big,
                  "rate_GBps": big_rate, "note": "(read + written) / time"})
        del a, b
        self.copy_rate = max(same, big_rate)
        self.log(f"copy rate {self.copy_rate:.0f} GB/s (same bytes {same:.0f}, 1 GiB {big_rate:.0f})")

        words = [s.view(torch.int32) for s in src]
        best = None
        for block, steps, warps in ((4096, 4, 8), (2048, 8, 8), (1024, 8, 4), (4096, 8, 16)):
            progs = triton.cdiv(words[0].numel(), block * steps)
            sink = torch.empty(progs, dtype=torch.int32, device=self.dev)
            try:
                fns = [lambda w=w: kern.read_kernel[(progs,)](w, sink, w.numel(), BLOCK=block, STEPS=steps,
                                                              num_warps=warps) for w in words]
                fns[0]()
                us = graph_us(fns)
            except Exception as exc:  # noqa: BLE001 - one config failing must not end the run
                self.log(f"read kernel {block}x{steps} w{warps} failed: {exc!r}")
                continue
            if best is None or us < best[0]:
                best = (us, f"BLOCK {block} x {steps} steps, {warps} warps")
        if best is not None:
            self.read_rate = nbytes / (best[0] * 1e3)
            self.add({"kind": "baseline", "variant": "read-only kernel", "config": best[1], "us": best[0],
                      "bytes": nbytes, "rate_GBps": self.read_rate})
            self.log(f"read-only rate {self.read_rate:.0f} GB/s")
        del src, words
        self.add({"kind": "baseline", "variant": "floor", "config": f"bytes / {CONVENTION_GBPS:.0f} GB/s (COPY_BW)",
                  "us": nbytes / (CONVENTION_GBPS * 1e3), "bytes": nbytes})
        self.add({"kind": "baseline", "variant": "floor at this run's copy rate", "config": "bytes / measured copy",
                  "us": nbytes / (self.copy_rate * 1e3), "bytes": nbytes})
        sink = torch.zeros(1, dtype=torch.int32, device=self.dev)
        kern.empty_kernel[(1,)](sink)
        self.add({"kind": "baseline", "variant": "empty kernel", "config": "launch + drain inside a graph",
                  "us": graph_us([lambda: kern.empty_kernel[(1,)](sink)] * CALLS)})
        self.moekit()

    def moekit(self) -> None:
        rec = {"kind": "baseline", "variant": "moekit gemv1", "bytes": self.bytes}
        try:
            from moekit.experts import configs as expert_configs
            from moekit.experts import triton_backend as tb
            from moekit.formats.mxfp4 import MXFP4Tensor

            cfg, source = expert_configs.choose(1, EXPERTS, TOP_K, ROWS13, HIDDEN, self.dev, torch.bfloat16, "mxfp4")
            g1 = cfg.gemm1
            rec["config"] = (f"gemv BLOCK_N {g1.block_n} BLOCK_K {g1.block_k} w{g1.num_warps} slots {g1.slots} "
                             f"packed {g1.packed} ({'tuned' if source.startswith('tuned') else 'heuristic'})")
            rec["config_full"] = f"{cfg} ({source})"
            if not (cfg.per_pair and cfg.gemv):
                raise RuntimeError(f"the table's T=1 config is not the CUDA-core decode mode: {cfg}")
            ops = [tb.WeightOperand.of(MXFP4Tensor(d, s, (EXPERTS, ROWS13, HIDDEN))) for d, s, _ in self.layers]
            h = torch.empty(TOP_K, ROWS13 // 2, dtype=torch.bfloat16, device=self.dev)

            def call(i):
                tb.gemv1(self.xs[i][None], ops[i % LAYERS], self.layers[i % LAYERS][2], h, self.ids[i], None,
                         EXPERTS, "swiglu_oai", TOP_K, cfg.gemm1)

            errs = []
            for i in (0, 1):
                h.fill_(float("nan"))
                call(i)
                errs.append(rel_errors(h, swiglu_oai64(self.refs[i])))
            rec["max_rel"], rec["rms_rel"] = max(e[0] for e in errs), max(e[1] for e in errs)
            rec["ok"] = rec["max_rel"] <= MAX_REL
            rec["us"] = graph_us([lambda i=i: call(i) for i in range(CALLS)])
            rec["note"] = "bias + swiglu_oai + bf16 store (and its activation prep launch, if packed) included"
        except Exception as exc:  # noqa: BLE001 - the baseline is optional; src/ changes under this script
            rec["error"] = f"{exc!r}"
            rec.setdefault("config", "")
            self.log(f"moekit gemv1 failed: {exc!r}")
        self.add(rec)

    # -- variants
    def compile_all(self, order: list[tuple[str, Config]]) -> None:
        """Builds every config's kernels in a thread pool (Triton's AsyncCompileMode): the timed loop then finds
        them in the cache. Failures are left for the loop to report."""
        x, ids = self.xs[0], self.ids[0]
        out = torch.empty(TOP_K, ROWS13, dtype=torch.float32, device=self.dev)
        bias = self.layers[0][2]
        start = self.elapsed()
        try:
            with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
                with triton.AsyncCompileMode(pool, ignore_errors=True):
                    for _, cfg in order:
                        try:
                            check_config(cfg, ROWS13, HIDDEN)
                            launch(cfg, x, self.ops(cfg)[0], bias, ids, out, scratch(cfg, TOP_K, ROWS13, self.dev),
                                   HIDDEN, warmup=True)
                        except Exception:  # noqa: BLE001 - the sweep reports it
                            pass
        except Exception as exc:  # noqa: BLE001 - only a speed-up: the sweep compiles what is missing
            self.log(f"parallel compile failed ({exc!r}); compiling as the sweep goes")
        self.log(f"compiled {len(order)} configs in {self.elapsed() - start:.1f} s ({self.jobs} threads)")

    def variant(self, name: str, cfg: Config) -> dict:
        rec = {"kind": "variant", "variant": name, "config": cfg.label(), "params": dataclasses.asdict(cfg),
               "bytes": self.bytes}
        try:
            check_config(cfg, ROWS13, HIDDEN)
            ops = self.ops(cfg)
            out = torch.empty(TOP_K, ROWS13, dtype=torch.float32, device=self.dev)
            scr = scratch(cfg, TOP_K, ROWS13, self.dev)

            def call(i):
                launch(cfg, self.xs[i], ops[i % LAYERS], self.layers[i % LAYERS][2], self.ids[i], out, scr, HIDDEN)

            def check(i):
                out.fill_(float("nan"))
                call(i)
                return rel_errors(out, self.refs[i])

            errs = [check(0), check(1)]
            rec["max_rel"], rec["rms_rel"] = max(e[0] for e in errs), max(e[1] for e in errs)
            if not (rec["max_rel"] <= MAX_REL and rec["rms_rel"] <= RMS_REL):
                rec["ok"] = False
                rec["error"] = "outside the error budget before timing"
                return rec
            rec["us"] = graph_us([lambda i=i: call(i) for i in range(CALLS)])
            after = check(0)  # after hundreds of calls: split counters back at zero, nothing racy
            rec["max_rel_after"] = after[0]
            rec["ok"] = after[0] <= MAX_REL and after[1] <= RMS_REL
            if not rec["ok"]:
                rec["error"] = "outside the error budget after timing"
        except Exception as exc:  # noqa: BLE001 - a config that fails to build or run is a result, not the end
            rec["ok"] = False
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        return rec

    def sweep(self) -> None:
        space = candidates()
        if self.only:
            space = {k: v for k, v in space.items() if k in self.only}
        order = round_robin(space)
        if self.jobs > 1:
            self.compile_all(order)
        done = 0
        for name, cfg in order:
            if self.elapsed() > self.budget_s:
                self.log(f"budget of {self.budget_s:.0f} s spent: {len(order) - done} configs not run")
                self.skipped = [f"{n}: {c.label()}" for n, c in order[done:]]
                break
            rec = self.add(self.variant(name, cfg))
            done += 1
            if rec.get("us"):
                self.log(f"{name:10s} {cfg.label():42s} {rec['us']:7.2f} us {rec.get('pct_copy', 0):5.1f}% COPY_BW  "
                         f"max_rel {rec['max_rel']:.1e}{'' if rec['ok'] else '  FAILED ' + rec.get('error', '')}")
            else:
                self.log(f"{name:10s} {cfg.label():42s} FAILED {rec.get('error', '')[:200]}")

    # -- report
    def summary_rows(self) -> list[dict]:
        rows = [r for r in self.records if r["kind"] == "baseline"]
        best = {}
        for r in self.records:
            if r["kind"] == "variant" and r.get("ok") and r.get("us"):
                if r["variant"] not in best or r["us"] < best[r["variant"]]["us"]:
                    best[r["variant"]] = r
        for r in self.records:
            r.pop("best", None)
        for r in best.values():
            r["best"] = True
        return rows + sorted(best.values(), key=lambda r: r["us"])

    def report(self) -> None:
        rows = self.summary_rows()
        header = ["variant", "config", "us", "x floor", "GB/s", f"% of {CONVENTION_GBPS:.0f} GB/s (COPY_BW)",
                  "% of this run's copy", "% of read-only", "max rel err"]
        floor = self.bytes / (CONVENTION_GBPS * 1e3)  # the convention's, as every other table's

        def pct(r, key):
            return f"{r[key]:.1f}" if r.get(key) is not None else "-"

        def cells(r):
            rate = r.get("GBps") or r.get("rate_GBps")
            return [r["variant"], r.get("config", ""), f"{r['us']:.2f}" if r.get("us") else "-",
                    f"{r['us'] / floor:.2f}" if r.get("us") and r.get("bytes") else "-",
                    f"{rate:.0f}" if rate else "-", pct(r, "pct_copy"), pct(r, "pct_copy_measured"), pct(r, "pct_read"),
                    f"{r['max_rel']:.1e}" if r.get("max_rel") is not None else ("error" if r.get("error") else "-")]

        table = [header] + [cells(r) for r in rows]
        best = [r for r in rows if r.get("best") and r.get("pct_copy") is not None]
        if best:
            top = best[0]
            reached = "reached" if top["pct_copy"] >= TARGET_PCT else "not reached"
            measured = (f"; {top['pct_copy_measured']:.1f}% of this run's copy rate"
                        if top.get("pct_copy_measured") is not None else "")
            verdict = (f"Best: {top['variant']} {top['config']}: {top['us']:.2f} us, {top['pct_copy']:.1f}% of "
                       f"{CONVENTION_GBPS:.0f} GB/s, the floors' copy rate ({TARGET_PCT:g}% wanted: {reached})"
                       f"{measured}.")
        else:
            verdict = "No variant config passed its check: nothing to compare with the copy rate."
        failed = [r for r in self.records if r["kind"] == "variant" and not r.get("ok")]
        env = self.env
        lines = [f"# Stream-and-decode microbenchmark: gpt-oss-120b GEMM1, MXFP4, T=1, top-4 ({env['gpu']}, "
                 f"{env['date']})", "",
                 f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}. `benchmarks/stream_decode.py`: "
                 f"CUDA graphs of {CALLS} calls over {LAYERS} layers' [128, 5760, 2880] stacks with fresh routes; "
                 f"{self.bytes / 1e6:.2f} MB of codes + scales per call. floor = bytes / {CONVENTION_GBPS:.0f} GB/s "
                 "(timing.COPY_BW, the H200's copy rate: the convention of every table's floors); this run's copy "
                 f"rate = the larger copy_ rate ((read + written) / time) = {self.copy_rate or 0:.0f} GB/s, each "
                 "kernel's share of it beside; GB/s of "
                 "the kernels = weight bytes / time. Every variant config was checked against float64 (max and RMS "
                 f"relative error within {MAX_REL:g} and {RMS_REL:g}) on two calls before timing and one after.", "",
                 verdict, "", "Baselines and the best config of each variant (fastest first):", ""]
        lines += ["| " + " | ".join(row) + " |" for row in table[:1]]
        lines += ["|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
        lines += ["", "Every config measured:", "",
                  f"| variant | config | us | % of {CONVENTION_GBPS:.0f} GB/s | % of this run's copy | max rel err | "
                  "rms rel err |", "|---|---|---|---|---|---|---|"]
        for r in self.records:
            if r["kind"] == "variant":
                lines.append(f"| {r['variant']} | {r['config']} | {r['us']:.2f} | {pct(r, 'pct_copy')} | "
                             f"{pct(r, 'pct_copy_measured')} | {r['max_rel']:.1e} | {r['rms_rel']:.1e} |" if r.get("ok")
                             else f"| {r['variant']} | {r['config']} | - | - | - | failed: {r.get('error', '')[:160]} "
                                  "| - |")
        if getattr(self, "skipped", None):
            lines += ["", f"Not run (budget): {', '.join(self.skipped)}"]
        lines += ["", "Variants: " + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()) + "."]
        (self.out_dir / "stream_decode.md").write_text("\n".join(lines) + "\n")
        self.write(complete=True)

        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        print()
        print(f"{env['gpu']}  {env['date']}  torch {env['torch']}  triton {env['triton']}  "
              f"bytes/call {self.bytes / 1e6:.2f} MB  floor rate {CONVENTION_GBPS:.0f} GB/s  "
              f"this run's copy {self.copy_rate or 0:.0f} GB/s  "
              f"({len(failed)} config(s) failed; see the .md)")
        print(verdict)
        for row in table:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


# ----------------------------------------------------------------------------------------------------------------
# Compile-only (CPU): every config built for sm_90 through a fake driver, with ptxas's register and spill counts


def compile_only(only: list[str] | None, per_variant: int | None = None) -> int:
    import re

    from triton.runtime import driver

    from moekit.tools import _sass
    from moekit.tools._fake_sm90 import Sm90Driver

    driver.set_active(Sm90Driver())
    # Building needs argument types and alignments, not gigabytes: every pointer gets a small buffer.
    words, bytes_ = torch.zeros(16, dtype=torch.int32), torch.zeros(64, dtype=torch.uint8)
    bias = torch.zeros(EXPERTS, ROWS13, dtype=torch.bfloat16)
    x = torch.zeros(HIDDEN, dtype=torch.bfloat16)
    ids = torch.zeros(TOP_K, dtype=torch.int32)
    out = torch.zeros(TOP_K, ROWS13)
    failures = 0
    space = {k: v[:per_variant] for k, v in candidates().items() if not only or k in only}
    for name, cfg in round_robin(space):
        t = time.monotonic()
        try:
            check_config(cfg, ROWS13, HIDDEN)
            kernel = launch(cfg, x, (words, bytes_), bias, ids, out, scratch(cfg, TOP_K, ROWS13, "cpu"), HIDDEN,
                            warmup=True)
            usage, cubin = _sass.ptxas_usage(kernel.asm["ptx"])
            sass = _sass.sass(cubin) or ""
            spill, regs = usage["spill"], usage["regs"]
            # barriers: layout conversions through shared memory (a few belong to the prologue and epilogue)
            count = len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))
            print(f"ok   {name:10s} {cfg.label():42s} regs {regs:3d}  spill {spill:5d} B  "
                  f"smem {kernel.metadata.shared:6d} B  barriers {sass.count('BAR.SYNC'):3d}  "
                  f"instructions {count:5d}  {time.monotonic() - t:5.1f} s",
                  flush=True)
        except Exception as exc:  # noqa: BLE001
            failures += 1
            print(f"FAIL {name:10s} {cfg.label():42s} {type(exc).__name__}: {str(exc)[:600]}", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    p.add_argument("--budget-s", type=float, default=185.0,
                   help="start no config after this many seconds from the start (the run stays under 4 minutes)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="threads compiling configs up front (1: compile as the sweep reaches each)")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="only these variants")
    p.add_argument("--compile-only", action="store_true", help="CPU: build every config for sm_90 and stop")
    p.add_argument("--per-variant", type=int, help="--compile-only: the first N configs of each variant")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only(args.variants, args.per_variant)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --compile-only)")
    run = Run(args.out, args.budget_s, args.jobs, args.variants)
    try:
        run.log(f"{run.env['gpu']}, torch {run.env['torch']}, triton {run.env['triton']}; "
                f"{run.bytes / 1e6:.2f} MB per call")
        run.build()
        run.log("weights built, references computed")
        run.baselines()
        run.sweep()
    finally:
        for r in run.records:  # records written before the rates were known
            if r.get("us") and r.get("bytes"):
                r["GBps"] = r["bytes"] / (r["us"] * 1e3)
                r |= rate_fields(r["GBps"], run.copy_rate, run.read_rate)
        run.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
