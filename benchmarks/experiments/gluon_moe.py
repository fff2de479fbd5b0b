"""The Gluon producer/consumer MXFP4 GEMM (gluon_w4.py) in its grouped form: a whole MoE experts call
(issue 28, part 3; GPU).

    align (moekit's)  ->  x gathered into row-block order  ->  GEMM1 (Gluon: decode warps, bias, activation)
      ->  GEMM2 (Gluon: bias, router weight, rows scattered to their pairs)  ->  moekit's combine

Launch order: groups of row blocks, all column tiles of a group before the next (x's blocks stay in L2). Row
classes (:class:`RowClasses`): blocks of 256 rows, each covered by the tiles of its class of rows (64; 128; 128 + 64;
256), one launch per tile and GEMM, so that a block computes about the rows it holds and decodes its expert's weights
once or twice. The gather (a Triton kernel) writes only the rows that hold a pair.

The kernels are _gluon_moe_kernels.py. The weights are prepared once, at load time (:func:`prepare_stack`):
codes as int32 words in the decode's order, scales transposed to [K/32, E * N], w13's [gate; up] halves
interleaved for silu_and_mul (gpt-oss's swiglu_oai stacks already are), so that GEMM1's epilogue finds each
(gate, up) pair in one thread's registers.

On a GPU this script:
  1. checks every config against float64 (moekit.reference.fused_experts on the dequantized weights) with E = 8
     experts at gpt-oss-120b's H and I, at T = 1, 7, 129 and 600 (an expert with no tokens at T = 1), output poisoned
     with NaN first: max |out - ref| / max |ref| <= 1e-2 and all finite; a config that fails is not timed;
  2. at gpt-oss-120b's full shape (E = 128, top-4, swiglu_oai, biases) and T = 128, 1024, 4096 (16384 with
     --tokens), compares each passing config's output with moekit.fused_experts on the same MXFP4 weights and
     times, in CUDA graphs, the Gluon pipeline, moekit.fused_experts on the MXFP4 weights and on bf16 weights
     (dequantized), all in the same run;
  3. prints a table last and writes <out>/gluon_moe_<date>.json and .md (out: --out, else $OUT, else
     benchmarks/results/archive).

    python benchmarks/experiments/gluon_moe.py                  # GPU: check + time (run under `timeout`)
    python benchmarks/experiments/gluon_moe.py --compile-only  # CPU: build both GEMMs' configs for sm_90, print regs,
                                                    # spills, shared memory; exit 1 on a failure or a spill
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

if "--compile-only" in sys.argv:  # real JIT functions, not the interpreter (read when the kernels are defined)
    os.environ["TRITON_INTERPRET"] = "0"

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402

import _gluon_moe_kernels as kern  # noqa: E402
import gluon_w4 as w4  # noqa: E402
from moekit import layouts, reference  # noqa: E402
from moekit.experts import torch_backend  # noqa: E402
from moekit.formats import mxfp4  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 128, 4  # gpt-oss-120b
ACTIVATIONS = {"silu_and_mul": kern.SILU_AND_MUL.value, "swiglu_oai": kern.SWIGLU_OAI.value}
MAX_REL = 1e-2  # W4A16 budget against float64
CHECK_EXPERTS = 8
CHECK_TOKENS = (1, 7, 129, 600)
TOKENS = (128, 1024, 4096)


@dataclasses.dataclass(frozen=True)
class Config:
    """One config per GEMM (gluon_w4.Config: tile, stages, warps, decode); both GEMMs share BM (the row blocks)."""

    gemm1: w4.Config = w4.Config()
    gemm2: w4.Config = w4.Config()
    group_m: int = 4  # row blocks per group of the launch order (the kernel's GROUP_M)

    def __post_init__(self) -> None:
        if self.gemm1.bm != self.gemm2.bm:
            raise ValueError(f"both GEMMs run on the same row blocks: BM {self.gemm1.bm} != {self.gemm2.bm}")
        if self.gemm1.decode != "words" or self.gemm2.decode != "words":
            raise ValueError("the stacks are prepared as words: decode='words' only")

    @property
    def bm(self) -> int:
        return self.gemm1.bm

    def label(self) -> str:
        return f"g1 [{self.gemm1.label()}] g2 [{self.gemm2.label()}] group {self.group_m}"


@dataclasses.dataclass(frozen=True)
class Tile:
    """One launch per GEMM of :class:`RowClasses`: BM = ``cfg.bm`` rows from ``offset`` of each block whose rows are
    in (``lo``, ``hi``]."""

    cfg: Config
    offset: int
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class RowClasses:
    """Blocks of ``stride`` rows (moekit's alignment at that size), each covered by the tiles of its class of rows:
    at T = 4096, gpt-oss-120b's experts hold 128 +- 11 rows, which fixed blocks of 128 rows cover with about 1.5
    blocks (the weights decoded 1.5 times) and blocks of 256 with twice the rows. Tensor shapes are powers of two,
    so 129..192 rows take a 128-row and a 64-row tile: about 1.25x the rows overall."""

    tiles: tuple[Tile, ...]
    stride: int = 256
    group_m: int = 4

    def __post_init__(self) -> None:
        for rows in range(1, self.stride + 1):  # every row count covered, each of its rows exactly once
            covered = sorted(r for t in self.tiles if t.lo < rows <= t.hi for r in range(t.offset, t.offset + t.cfg.bm))
            if covered[:rows] != list(range(rows)) or len(set(covered)) != len(covered):
                raise ValueError(f"the tiles do not cover a block of {rows} rows once: rows {covered[:8]}...")
            if any(t.offset + t.cfg.bm > self.stride for t in self.tiles):
                raise ValueError(f"a tile runs past the {self.stride}-row block")

    @property
    def bm(self) -> int:
        """The alignment's block rows."""
        return self.stride

    def label(self) -> str:
        return "classes " + " | ".join(f"({t.lo},{t.hi}] +{t.offset} BM{t.cfg.bm}" for t in self.tiles) + \
            f" [{self.tiles[0].cfg.gemm1.label()} ...] group {self.group_m}"


def tiles_of(cfg: Config | RowClasses) -> tuple[Tile, ...]:
    """The launches per GEMM of a config: its row classes' tiles, or one tile of BM rows serving every block."""
    return cfg.tiles if isinstance(cfg, RowClasses) else (Tile(cfg, 0, 0, cfg.bm),)


def row_classes() -> RowClasses:
    """256-row blocks: up to 64 rows one 64-row tile, up to 128 one 128-row tile, up to 192 a 128-row and a 64-row
    tile, up to 256 one 256-row tile (two warpgroups of 128)."""
    c64 = Config(w4.Config(bm=64, stages=6), w4.Config(bm=64, stages=6))
    c128 = Config(w4.Config(), w4.Config())
    c256 = Config(w4.Config(bm=256, warps=8, stages=4, decode_warps=2), w4.Config(bm=256, warps=8, stages=4,
                                                                                  decode_warps=2))
    return RowClasses((Tile(c64, 0, 0, 64), Tile(c128, 0, 64, 192), Tile(c64, 128, 128, 192),
                       Tile(c256, 0, 192, 256)))


def candidates() -> list[Config | RowClasses]:
    """The configs the GPU run checks and times (and --compile-only builds): the single-GEMM winners of
    archive/gluon_w4_h100_2026-12-05.md at M = 128 (an expert's rows at T = 4096) and at M >= 2048, in launch groups
    of row blocks (archive/gluon_moe_h100_2026-12-06.md: row blocks fastest over the whole grid lost 1.35-1.46x to
    moekit's MXFP4 kernels at 128-row blocks)."""
    c128, c64 = w4.Config(), w4.Config(bm=64, stages=6)
    # 256 rows (two warpgroups of 128): two decode warps leave the MMA warps 240 registers (with four, the epilogue
    # spills)
    c256 = w4.Config(bm=256, warps=8, stages=4, decode_warps=2)
    return [
        Config(c128, c128, group_m=4),
        Config(c128, c128, group_m=8),
        Config(w4.Config(warps=8), w4.Config(warps=8), group_m=4),
        Config(c64, c64, group_m=4),
        Config(c64, c64, group_m=8),
        Config(c256, c256, group_m=2),
        row_classes(),
    ]


# ----------------------------------------------------------------------------------------------------------------
# Load-time layouts


@dataclasses.dataclass(frozen=True)
class PreparedStack:
    """An expert stack [E, N, K] as moe_w4_kernel reads it (made once, when weights load)."""

    codes: torch.Tensor  # int32 [E * N, K/8] (gluon_w4.prepare_codes on the stacked rows)
    scales_t: torch.Tensor  # uint8 [K/32, E * N]
    bias: torch.Tensor | None  # float32 [E, N], rows in the codes' order
    experts: int
    n: int
    k: int
    full_range: bool

    def as_w4(self) -> w4.Prepared:
        """The stacked rows as one [E * N, K] operand of gluon_w4 (its descriptors and compile checks)."""
        return w4.Prepared(self.codes, self.scales_t, self.experts * self.n, self.k, "words", self.full_range)


def prepare_stack(w: mxfp4.MXFP4Tensor, bias: torch.Tensor | None = None, interleave: bool = False) -> PreparedStack:
    """MXFP4 stack [E, N, K] (+ bias [E, N]) -> :class:`PreparedStack`. ``interleave``: w13 of silu_and_mul, whose
    [gate; up] halves become interleaved rows."""
    e, n, k = w.shape
    data, scales = w.data, w.scales
    if interleave:
        data, scales = layouts.interleave(data), layouts.interleave(scales)
        bias = None if bias is None else layouts.interleave_bias(bias)
    codes = w4.prepare_codes(data.reshape(e * n, k // 2))
    full = bool((scales > w4.FAST_SCALE_MAX).any())
    return PreparedStack(codes, w4.prepare_scales(scales.reshape(e * n, k // 32)),
                         None if bias is None else bias.float().contiguous(), e, n, k, full)


def unprepare_stack(p: PreparedStack, interleaved: bool = False) -> tuple[mxfp4.MXFP4Tensor, torch.Tensor | None]:
    """Inverse of :func:`prepare_stack` (exact)."""
    data = w4.unprepare_codes(p.codes).reshape(p.experts, p.n, p.k // 2)
    scales = w4.unprepare_scales(p.scales_t).reshape(p.experts, p.n, p.k // 32)
    bias = p.bias
    if interleaved:
        data, scales = layouts.deinterleave(data), layouts.deinterleave(scales)
        bias = None if bias is None else layouts.deinterleave_bias(bias)
    return mxfp4.MXFP4Tensor(data.contiguous(), scales.contiguous(), (p.experts, p.n, p.k)), bias


# ----------------------------------------------------------------------------------------------------------------
# Launch


def check_shapes(cfg: Config | RowClasses, w13: PreparedStack, w2: PreparedStack) -> None:
    """ValueError unless the kernels can run ``cfg`` on these stacks."""
    for t in tiles_of(cfg):
        w4.check_config(t.cfg.gemm1, w13.n, w13.k)
        w4.check_config(t.cfg.gemm2, w2.n, w2.k)
    if w13.experts != w2.experts or w13.n != 2 * w2.k or w13.k != w2.n:
        raise ValueError(f"w13 [{w13.experts}, {w13.n}, {w13.k}] and w2 [{w2.experts}, {w2.n}, {w2.k}] are not one "
                         "MLP's stacks")
    # TMA: the scales' rows (E * N bytes) and h's rows (I bf16) 16-byte multiples
    for name, p in (("w13", w13), ("w2", w2)):
        if (p.experts * p.n) % 16:
            raise ValueError(f"{name}: E * N = {p.experts * p.n} must be a multiple of 16 (TMA row stride)")
    if (w2.k * 2) % 16:
        raise ValueError(f"I = {w2.k}: h's rows must be a multiple of 16 bytes (TMA)")


def gemm(cfg: w4.Config, a: torch.Tensor, p: PreparedStack, out: torch.Tensor, block_expert: torch.Tensor,
         sorted_pairs: torch.Tensor, weights: torch.Tensor, num_pairs: int, epilogue: int, activation: str,
         group_m: int, warmup: bool = False, row_stride: int | None = None, block_rows: torch.Tensor | None = None,
         rows_class: tuple[int, int, int] = (0, 0, 0)):
    """One grouped GEMM: a [blocks * row_stride, K] bf16 in row-block order (row_stride: BM unless row classes).
    ACT: out = h [blocks * row_stride, N/2]; SCATTER: out = y [pairs, N] (rows of padding slots untouched).
    ``block_rows`` (int32 [blocks]): with row classes, this launch serves the blocks whose rows are in (lo, hi],
    BM rows from ``offset`` (``rows_class`` = (lo, hi, offset))."""
    a_desc, q_desc, s_desc = w4.descriptors(cfg, a, p.as_w4())
    blocks = block_expert.shape[0]
    grid = (blocks * triton.cdiv(p.n, cfg.bn),)
    bias = p.bias if p.bias is not None else weights  # never read without HAS_BIAS
    args = (a_desc, q_desc, s_desc, out, out.stride(0), bias, block_expert, sorted_pairs, weights,
            block_rows if block_rows is not None else block_expert, *rows_class, num_pairs, blocks, p.n, p.k)
    kwargs = dict(EPILOGUE=epilogue, ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=p.bias is not None,
                  STAGES=cfg.stages, SUB=cfg.sub, FULL_RANGE=p.full_range, DECODE=w4.DECODES["words"],
                  DECODE_WARPS=cfg.decode_warps, LOAD_REGS=cfg.load_regs, DECODE_REGS=cfg.decode_regs,
                  GROUP_M=group_m, ROW_STRIDE=row_stride or cfg.bm, ROW_CLASSES=block_rows is not None,
                  num_warps=cfg.warps)
    if warmup:
        return kern.moe_w4_kernel.warmup(*args, grid=grid, **kwargs)
    return kern.moe_w4_kernel[grid](*args, **kwargs)


GATHER_BLOCK_H = 1024


def _row_blocks(cfg: Config | RowClasses, x: torch.Tensor, topk_ids: torch.Tensor, experts: int,
                kernel: bool = False) -> tuple:
    """moekit's alignment into BM-row blocks (pair_expert, sorted_pairs, block_expert) and x gathered into their
    order [blocks * BM, H]: by gather_rows_kernel (``kernel``: padding rows left unwritten) or, for the emulation,
    index_select (padding rows and the rows of blocks past the last run, never written by align: any real token)."""
    from moekit.experts import triton_backend as tb

    pair_expert, sorted_pairs, block_expert = tb.align(topk_ids, None, experts, cfg.bm)
    num_tokens, top_k = topk_ids.shape
    if not kernel:
        return pair_expert, sorted_pairs, block_expert, x.index_select(
            0, (sorted_pairs // top_k).clamp_(0, num_tokens - 1))
    xg = torch.empty(sorted_pairs.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    kern.gather_rows_kernel[(sorted_pairs.shape[0], triton.cdiv(x.shape[1], GATHER_BLOCK_H))](
        x, x.stride(0), sorted_pairs, xg, num_tokens * top_k, top_k, x.shape[1], BLOCK_H=GATHER_BLOCK_H,
        num_warps=4)
    return pair_expert, sorted_pairs, block_expert, xg


def _block_rows(sorted_pairs: torch.Tensor, num_pairs: int, stride: int) -> torch.Tensor:
    """int32 [blocks]: the rows of each block that hold a pair (a prefix of the block: align pads each run's end)."""
    return (sorted_pairs.view(-1, stride) < num_pairs).sum(1, dtype=torch.int32)


def fused_experts(cfg: Config | RowClasses, x: torch.Tensor, w13: PreparedStack, w2: PreparedStack, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """moekit.fused_experts's standard format on prepared stacks (no expert map): out [T, H] in x's dtype (bf16)."""
    from moekit.experts import triton_backend as tb

    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w13.k:
        raise ValueError(f"x must be bf16 [T, {w13.k}] (the TMA boxes' layout), got {x.dtype} {tuple(x.shape)}")
    if (topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]
            or topk_weights.shape != topk_ids.shape or topk_ids.device != x.device):
        raise ValueError(f"topk_ids must be int32 [T={x.shape[0]}, k] on {x.device} with topk_weights of its shape, "
                         f"got {topk_ids.dtype} {tuple(topk_ids.shape)} on {topk_ids.device}, weights "
                         f"{tuple(topk_weights.shape)}")
    check_shapes(cfg, w13, w2)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    out = torch.empty(num_tokens, w2.n, dtype=x.dtype, device=x.device) if out is None else out
    if num_pairs == 0:
        return out.zero_()
    pair_expert, sorted_pairs, block_expert, xg = _row_blocks(cfg, x, topk_ids, w13.experts, kernel=True)
    h = torch.empty(xg.shape[0], w13.n // 2, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, w2.n, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    blocks = (block_expert, sorted_pairs, weights, num_pairs)
    rows = _block_rows(sorted_pairs, num_pairs, cfg.bm) if isinstance(cfg, RowClasses) else None
    for t in tiles_of(cfg):  # GEMM1 for every tile, then GEMM2 (h complete)
        gemm(t.cfg.gemm1, xg, w13, h, *blocks, kern.ACT.value, activation, cfg.group_m, row_stride=cfg.bm,
             block_rows=rows, rows_class=(t.lo, t.hi, t.offset))
    for t in tiles_of(cfg):
        gemm(t.cfg.gemm2, h, w2, y, *blocks, kern.SCATTER.value, activation, cfg.group_m, row_stride=cfg.bm,
             block_rows=rows, rows_class=(t.lo, t.hi, t.offset))
    tb._combine(y, pair_expert, out, top_k)
    return out


def _activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The kernels' activation on fp32 [rows, 2I] with interleaved (gate, up) columns: moekit's torch backend's, whose
    silu_and_mul reads [gate; up] halves."""
    if activation == "silu_and_mul":
        h = layouts.deinterleave_bias(h)  # [rows, 2I] along dim 1, as a bias stack is
    return torch_backend._activate(h, activation)


def emulate(cfg: Config | RowClasses, x: torch.Tensor, w13: PreparedStack, w2: PreparedStack, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, activation: str) -> torch.Tensor:
    """:func:`fused_experts` with each GEMM done block by block in torch on the decode warps' emulated weights
    (gluon_w4.emulate_decode), fp32 sums, the epilogues' roundings to bf16: the host steps (align, gather, buffers,
    combine) and the epilogues' arithmetic on the CPU (tests/test_gluon_moe.py; under TRITON_INTERPRET=1 for moekit's
    align and combine). Each block takes its expert's whole rows at once: the kernel's column tiles, and tiles that
    run into the next expert's rows, are the GPU tests' to check."""
    from moekit.experts import triton_backend as tb

    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    out = torch.zeros(num_tokens, w2.n, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out
    pair_expert, sorted_pairs, block_expert, xg = _row_blocks(cfg, x, topk_ids, w13.experts)
    w13_rows = w4.emulate_decode(w13.as_w4()).float()
    w2_rows = w4.emulate_decode(w2.as_w4()).float()
    h = torch.full((xg.shape[0], w13.n // 2), float("nan"), dtype=x.dtype)
    y = torch.full((num_pairs, w2.n), float("nan"), dtype=x.dtype)
    weights = topk_weights.reshape(-1).float()
    stride = cfg.bm
    tiles = tiles_of(cfg)
    rows = _block_rows(sorted_pairs, num_pairs, stride).tolist()
    for b, e in enumerate(block_expert.tolist()):
        for t in tiles:  # the kernels' tiles of the block's class of rows (one tile of BM rows without classes)
            if e < 0 or not t.lo < rows[b] <= t.hi:
                continue
            blk = slice(b * stride + t.offset, b * stride + t.offset + t.cfg.bm)
            acc = xg[blk].float() @ w13_rows[e * w13.n:(e + 1) * w13.n].t()
            if w13.bias is not None:
                acc += w13.bias[e]
            h[blk] = _activate(acc, activation).to(x.dtype)
            acc = h[blk].float() @ w2_rows[e * w2.n:(e + 1) * w2.n].t()
            if w2.bias is not None:
                acc += w2.bias[e]
            pairs = sorted_pairs[blk].long()
            valid = pairs < num_pairs
            y[pairs[valid]] = (acc[valid] * weights[pairs[valid], None]).to(x.dtype)
    tb._combine(y, pair_expert, out, top_k)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Compile-only (CPU)


def launches() -> list[tuple[Config | RowClasses, Config, bool]]:
    """(candidate, the Config of one launch per GEMM, row classes) of every kernel build the candidates make (a
    config two tiles share builds once)."""
    return [(cfg, v, isinstance(cfg, RowClasses)) for cfg in candidates()
            for v in dict.fromkeys(t.cfg for t in tiles_of(cfg))]


def compile_only() -> int:
    from triton.runtime import driver

    from moekit.tools._fake_sm90 import Sm90Driver

    driver.set_active(Sm90Driver())
    e, blocks, pairs = 2, 4, 256
    w13 = mxfp4.MXFP4Tensor(torch.zeros(e, 2 * INTER, HIDDEN // 2, dtype=torch.uint8),
                            torch.full((e, 2 * INTER, HIDDEN // 32), 120, dtype=torch.uint8), (e, 2 * INTER, HIDDEN))
    w2 = mxfp4.MXFP4Tensor(torch.zeros(e, HIDDEN, INTER // 2, dtype=torch.uint8),
                           torch.full((e, HIDDEN, INTER // 32), 120, dtype=torch.uint8), (e, HIDDEN, INTER))
    p13 = prepare_stack(w13, torch.zeros(e, 2 * INTER))
    p2 = prepare_stack(w2, torch.zeros(e, HIDDEN))
    failures = 0
    for cfg, v, classes in launches():
        for name, c, p, epi in (("w13", v.gemm1, p13, kern.ACT.value), ("w2", v.gemm2, p2, kern.SCATTER.value)):
            t = time.monotonic()
            rows = blocks * cfg.bm
            a = torch.empty(rows, p.k, dtype=torch.bfloat16)
            out = torch.empty(rows if epi == kern.ACT.value else pairs, p.n // 2 if epi == kern.ACT.value else p.n,
                              dtype=torch.bfloat16)
            ints = torch.zeros(rows, dtype=torch.int32)
            try:
                check_shapes(cfg, p13, p2)
                k = gemm(c, a, p, out, ints[:blocks], ints, torch.zeros(pairs), pairs, epi, "swiglu_oai",
                         cfg.group_m, warmup=True, row_stride=cfg.bm, block_rows=ints[:blocks] if classes else None)
                r = w4.ptxas_report(k, c)
                bad = r["spill"] > 0
                failures += bad
                print(f"{'SPILL' if bad else 'ok':5s} {name:3s} {c.label():45s} regs {r['regs']:3d} "
                      f"(setmaxnreg {r['setmaxnreg']})  spill {r['spill']:4d} B  smem {r['smem']:6d} B  "
                      f"{time.monotonic() - t:4.1f} s", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                failures += 1
                print(f"FAIL  {name:3s} {c.label():45s} {type(exc).__name__}: {str(exc)[-800:]}", flush=True)
    print(f"{failures} failed or spilled")
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------------------------------
# GPU: check and time


def random_stack(e: int, n: int, k: int, device) -> mxfp4.MXFP4Tensor:
    data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(*w4.SCALE_BYTES, (e, n, k // 32), dtype=torch.uint8, device=device)
    return mxfp4.MXFP4Tensor(data, scales, (e, n, k))


def random_routes(num_tokens: int, num_experts: int, top_k: int, device, generator) -> tuple:
    ids = torch.rand(num_tokens, num_experts, device=device, generator=generator).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(num_tokens, top_k, device=device, generator=generator), -1)
    return weights, ids.int().contiguous()


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)).item()


class Layer:
    """One MoE layer's MXFP4 weights, biases and their prepared stacks."""

    def __init__(self, experts: int, activation: str, device, generator):
        self.activation = activation
        self.w13 = random_stack(experts, 2 * INTER, HIDDEN, device)
        self.w2 = random_stack(experts, HIDDEN, INTER, device)
        self.b13 = torch.randn(experts, 2 * INTER, device=device, generator=generator) * 0.1
        self.b2 = torch.randn(experts, HIDDEN, device=device, generator=generator) * 0.1
        self.p13 = prepare_stack(self.w13, self.b13, interleave=activation == "silu_and_mul")
        self.p2 = prepare_stack(self.w2, self.b2)

    def moekit(self, x, tw, ti, weights=None):
        import moekit

        w13, w2 = weights or (self.w13, self.w2)
        return moekit.fused_experts(x, w13, w2, tw, ti, activation=self.activation, w13_bias=self.b13,
                                    w2_bias=self.b2)

    def reference64(self, x, tw, ti):
        return reference.fused_experts(x.double(), mxfp4.dequantize(self.w13, torch.float64),
                                       mxfp4.dequantize(self.w2, torch.float64), tw.double(), ti,
                                       activation=self.activation, w13_bias=self.b13.double(),
                                       w2_bias=self.b2.double())


def check(configs: list[Config], dev, gen, log) -> tuple[list[Config], list[dict]]:
    """float64 checks at E = CHECK_EXPERTS; returns the configs that passed every case, and the records."""
    records, passed = [], []
    layers = {act: Layer(CHECK_EXPERTS, act, dev, gen) for act in ACTIVATIONS}
    for cfg in configs:
        ok = True
        for act, layer in layers.items():
            for t in CHECK_TOKENS:
                x = (torch.randn(t, HIDDEN, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
                tw, ti = random_routes(t, CHECK_EXPERTS, TOP_K, dev, gen)
                out = torch.full((t, HIDDEN), float("nan"), dtype=torch.bfloat16, device=dev)
                try:
                    check_shapes(cfg, layer.p13, layer.p2)
                    fused_experts(cfg, x, layer.p13, layer.p2, tw, ti, act, out=out)
                    torch.cuda.synchronize()
                    err = rel_error(out, layer.reference64(x, tw, ti))
                except Exception as exc:  # noqa: BLE001 - report and go on
                    err, note = float("inf"), f"{type(exc).__name__}: {str(exc)[-300:]}"
                else:
                    note = "ok" if err <= MAX_REL else "over budget"
                ok &= err <= MAX_REL
                records.append({"kind": "check", "config": cfg.label(), "activation": act, "T": t,
                                "experts": CHECK_EXPERTS, "max_rel_err": err, "note": note})
                log(f"check {cfg.label()} {act} T={t}: {err:.2e} {note}")
        if ok:
            passed.append(cfg)
    return passed, records


def time_full(configs: list[Config], tokens, dev, gen, log, budget) -> list[dict]:
    from moekit.tools.bench.timing import graph_time_us

    layer = Layer(EXPERTS, "swiglu_oai", dev, gen)
    bf16 = (mxfp4.dequantize(layer.w13, torch.bfloat16), mxfp4.dequantize(layer.w2, torch.bfloat16))
    records = []
    for t in tokens:
        x = (torch.randn(t, HIDDEN, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        tw, ti = random_routes(t, EXPERTS, TOP_K, dev, gen)
        want = layer.moekit(x, tw, ti)
        rows = [("moekit MXFP4", lambda: layer.moekit(x, tw, ti), 0.0),
                ("moekit bf16", lambda: layer.moekit(x, tw, ti, bf16), None)]
        for cfg in configs:
            out = torch.full_like(want, float("nan"))
            fused_experts(cfg, x, layer.p13, layer.p2, tw, ti, "swiglu_oai", out=out)
            torch.cuda.synchronize()
            rows.append((f"Gluon {cfg.label()}",
                         lambda cfg=cfg: fused_experts(cfg, x, layer.p13, layer.p2, tw, ti, "swiglu_oai"),
                         rel_error(out, want)))
        for name, fn, diff in rows:
            if budget():
                log("time budget spent: the remaining rows are not timed")
                return records
            us = graph_time_us([fn])
            records.append({"kind": "time", "T": t, "implementation": name, "us": us, "rel_diff_vs_moekit": diff})
            log(f"T={t} {name}: {us:.1f} us (rel diff vs moekit MXFP4 {diff})")
    return records


def profile(configs: list[Config], tokens, dev, gen, log) -> list[dict]:
    """Device time per kernel (torch.profiler, mean of 5 calls after warm-up) of each config's pipeline and of
    moekit.fused_experts on the same MXFP4 weights: which step the time goes to."""
    from moekit.tools.bench.timing import kernel_times_us

    layer = Layer(EXPERTS, "swiglu_oai", dev, gen)
    records, calls = [], 5
    for t in tokens:
        x = (torch.randn(t, HIDDEN, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        tw, ti = random_routes(t, EXPERTS, TOP_K, dev, gen)
        rows = [("moekit MXFP4", lambda: layer.moekit(x, tw, ti))]
        rows += [(f"Gluon {c.label()}", lambda c=c: fused_experts(c, x, layer.p13, layer.p2, tw, ti, "swiglu_oai"))
                 for c in configs]
        for name, fn in rows:
            records += [{"kind": "profile", "T": t, "implementation": name, "kernel": kernel[:90], "us": us}
                        for kernel, us, _ in kernel_times_us(fn, calls)]
            log(f"profiled T={t} {name}")
    return records


def markdown(env: dict, records: list[dict]) -> str:
    lines = [f"# Gluon grouped MXFP4 experts, gpt-oss-120b shapes ({env['gpu']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}. `benchmarks/experiments/gluon_moe.py`: "
             "whole experts calls "
             f"(align, gather, two Gluon GEMMs, combine) against moekit.fused_experts on the same MXFP4 weights and on "
             f"bf16 weights, CUDA-graph replay, E={EXPERTS}, top-{TOP_K}, swiglu_oai with biases. Every Gluon config "
             f"checked first against float64 at E={CHECK_EXPERTS} (T={list(CHECK_TOKENS)}, both activations).", "",
             "| T | implementation | us | / moekit MXFP4 | / moekit bf16 | rel diff vs moekit MXFP4 |",
             "|---|---|---|---|---|---|"]
    times = [r for r in records if r["kind"] == "time"]
    for r in times:
        base = {x["implementation"]: x["us"] for x in times if x["T"] == r["T"]}
        mx, bf = base.get("moekit MXFP4"), base.get("moekit bf16")
        diff = "-" if r["rel_diff_vs_moekit"] is None else f"{r['rel_diff_vs_moekit']:.1e}"
        lines.append(f"| {r['T']} | {r['implementation']} | {r['us']:.1f} | "
                     f"{r['us'] / mx if mx else float('nan'):.3f} | {r['us'] / bf if bf else float('nan'):.3f} | {diff} |")
    lines += ["", "Checks against float64:", "", "| config | activation | T | max rel err | note |", "|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['activation']} | {r['T']} | {r['max_rel_err']:.2e} | {r['note']} |"
              for r in records if r["kind"] == "check"]
    prof = [r for r in records if r["kind"] == "profile"]
    if prof:
        lines += ["", "Device time per kernel (torch.profiler, us per call):", "", "| T | implementation | kernel | us |",
                  "|---|---|---|---|"]
        lines += [f"| {r['T']} | {r['implementation']} | `{r['kernel']}` | {r['us']:.1f} |" for r in prof]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-only", action="store_true", help="CPU: build the configs for sm_90 and stop")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--configs", type=int, default=None, help="only the first N candidates")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new timings after this long")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile", action="store_true", help="also the device time per kernel of each pipeline")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --compile-only)")
    if (kern.SWIGLU_ALPHA.value, kern.SWIGLU_LIMIT.value) != (reference.SWIGLU_ALPHA, reference.SWIGLU_LIMIT):
        raise SystemExit("the kernels' SwiGLU constants differ from moekit.reference's")
    out_dir = args.out or Path(os.environ.get("OUT") or HERE / "results" / "archive")
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f} s] {msg}", flush=True)

    env = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "triton": triton.__version__}
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    passed, records = check(candidates()[:args.configs], dev, gen, log)
    records += time_full(passed, args.tokens, dev, gen, log, lambda: time.monotonic() - t0 > args.budget_s)
    if args.profile:
        records += profile(passed, args.tokens, dev, gen, log)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"gluon_moe_{env['date']}"
    stem.with_suffix(".json").write_text(json.dumps({"env": env, "records": records}, indent=1))
    md = markdown(env, records)
    stem.with_suffix(".md").write_text(md)
    print(md.split("Checks against float64")[0])
    if args.profile:
        print(md.split("Device time per kernel")[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
