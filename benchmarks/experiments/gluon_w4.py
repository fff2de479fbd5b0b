"""A Gluon producer/consumer MXFP4 x bf16 GEMM on Hopper, decode in warps of its own (issue 28, part 3; GPU).

C[M, N] = A[M, K] bf16 @ dequant(W[N, K] MXFP4)^T, fp32 accumulation, bf16 out: one expert's GEMM, as a block of
M tokens routed to it would run (gpt-oss-120b at T = 4096, top-4 of 128 experts: about 128 rows per expert). The
kernel (_gluon_w4_kernels.py) has a TMA loader warp, decode warps that write bf16 weight tiles into a
shared-memory ring, and one or two MMA warpgroups running wgmma on them.

On a GPU this script, for gpt-oss-120b's w13 (N = 5760, K = 2880) and w2 (N = 2880, K = 2880) at M = 128, 512,
2048 and 4096:
  1. checks every config against a float64 reference (A @ dequantize(W, float64)^T, output poisoned with NaN
     first): max |C - ref| / max |ref| <= 1e-2, all finite; a config that fails is reported and not timed;
  2. times, in CUDA graphs (moekit.tools.bench.timing.graph_time_us), each passing config, a bf16 torch matmul of
     the same shape (cuBLAS), moekit's MXFP4 tensor-core GEMM of the same weights (experts.triton_backend.gemm1 /
     gemm2 with the config fused_experts picks for M tokens on one expert: GEMM1 includes its SwiGLU epilogue and
     writes N/2 columns, GEMM2 its router-weight scaling) and moekit.fused_experts whole (one expert, top_k = 1:
     both GEMMs, activation, combine) beside the sum of the Gluon and bf16 GEMMs;
  3. prints a table (us, TFLOP/s, time / bf16 time) last and writes <out>/gluon_w4_<date>.json and .md with the
     GPU, date and versions at the top (out: --out, else $OUT, else benchmarks/results/archive).
The whole run stays under 3 minutes (--budget-s stops starting new timings). Run it under `timeout`: a barrier
phase bug would hang the GPU rather than fail, and this kernel has not yet run on one.

    python benchmarks/experiments/gluon_w4.py                       # GPU: check + time
    python benchmarks/experiments/gluon_w4.py --compile-only   # CPU: build the configs for sm_90 (fake driver), print
                                                        # registers, spills, shared memory; exit 1 on a failure
                                                        # or a spill
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
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
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

import _gluon_w4_kernels as kern  # noqa: E402
from moekit.formats import mxfp4  # noqa: E402

HIDDEN = 2880  # gpt-oss-120b H (K of both GEMMs)
INTER = 2880  # I
SHAPES = {"w13": (2 * INTER, HIDDEN), "w2": (HIDDEN, INTER)}  # name: (N, K)
TOKENS = (128, 512, 2048, 4096)
SCALE_BYTES = (118, 125)  # E8M0 bytes drawn in [118, 125): 2^-9 .. 2^-3, gpt-oss-like weight magnitudes
MAX_REL = 1e-2  # W4A16 budget against float64
DECODES = {"bits": kern.BITS.value, "cvt": kern.CVT.value, "words": kern.WORDS.value}
FAST_SCALE_MAX = 128  # BITS / WORDS: one multiply by 2^(s - 1) is exact for scale bytes up to this


@dataclasses.dataclass(frozen=True)
class Config:
    bm: int = 128  # rows of A per CTA
    bn: int = 128  # weight rows (output columns) per CTA
    bk: int = 64  # K per pipeline step (two scale groups)
    stages: int = 4  # slots of every ring
    warps: int = 4  # MMA partition (the default one): 4 = one warpgroup, 8 = two (rows split between them)
    decode: str = "words"  # "words" (prepared codes), "bits" (codes as stored), "cvt" (Triton's fp4 conversion)
    decode_warps: int = 4
    sub: int = 64  # weight rows decoded per chunk (bounds the decode warps' registers)
    load_regs: int = 40
    decode_regs: int = 128

    def label(self) -> str:
        return (f"BM{self.bm} BN{self.bn} BK{self.bk} s{self.stages} w{self.warps} {self.decode} "
                f"dw{self.decode_warps} sub{self.sub}")


def check_config(cfg: Config, n: int, k: int) -> None:
    """ValueError unless the kernel can run ``cfg`` on weights [n, k]."""
    why = []
    if cfg.bk != 64 or k % cfg.bk:
        why.append("BK = 64 dividing K (two scale groups per step, a 128-byte swizzled bf16 row)")
    if cfg.warps not in (4, 8) or cfg.bm % (16 * cfg.warps):
        why.append("4 or 8 MMA warps, BM a multiple of 16 x warps (wgmma's 64 rows per warpgroup)")
    if cfg.bn not in (64, 128, 256) or cfg.bm * cfg.bn > 256 * 128 or cfg.bm * cfg.bn // (32 * cfg.warps) > 128:
        why.append("BN 64/128/256 and at most 128 fp32 accumulators per MMA thread")
    rows_per_pass = 16 * cfg.decode_warps  # the decode layout's rows (16 rows x 2 groups per warp)
    if cfg.bn % cfg.sub or cfg.sub % rows_per_pass:
        why.append(f"SUB dividing BN, a multiple of 16 x decode warps ({rows_per_pass})")
    if cfg.decode not in DECODES:
        why.append(f"decode in {sorted(DECODES)}")
    if why:
        raise ValueError(f"config {cfg.label()} does not fit N={n}, K={k}: " + "; ".join(why))


def smem_bytes(cfg: Config) -> int:
    """Shared memory the rings take (the kernel's own count adds the barriers)."""
    per_stage = cfg.bm * cfg.bk * 2 + cfg.bn * cfg.bk * 2 + cfg.bn * cfg.bk // 2 + cfg.bn * cfg.bk // 32
    return cfg.stages * per_stage


# ----------------------------------------------------------------------------------------------------------------
# Load-time layouts (exact round trips; tests/test_gluon_w4.py)

WORD_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # codes of a word: evens in nibbles 0..3, odds in nibbles 4..7


def prepare_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales [N, K/32] -> [K/32, N] contiguous: a tile's bytes of one group form one box row, and rows are
    N bytes apart (a multiple of 16, as TMA needs; moekit's rows are K/32 = 90 bytes apart)."""
    return scales.t().contiguous()


def unprepare_scales(scales_t: torch.Tensor) -> torch.Tensor:
    return scales_t.t().contiguous()


def prepare_codes(data: torch.Tensor) -> torch.Tensor:
    """Packed codes [N, K/2] (low nibble = even k) -> int32 words [N, K/8], each word's 8 codes reordered so that
    codes 2j and 2j + 1 sit in nibbles j and 4 + j: 16 bits apart, like the two halves of the bf16 pair they become
    (kernels' _pair_word). Same bytes, permuted nibbles."""
    n, half_k = data.shape
    lo, hi = data & 15, data >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(n, half_k // 4, 8)[..., list(WORD_ORDER)]
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [N, K/8, 4] bytes, little-endian word
    return packed.reshape(n, half_k).contiguous().view(torch.int32)


def unprepare_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`prepare_codes`."""
    n, quarter = words.shape
    b = words.contiguous().view(torch.uint8).reshape(n, quarter, 4)
    placed = torch.stack([b & 15, b >> 4], dim=-1).reshape(n, quarter, 8)  # codes in WORD_ORDER
    codes = torch.empty_like(placed)
    codes[..., list(WORD_ORDER)] = placed
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).reshape(n, quarter * 4)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One expert's weights as the kernel reads them (made once, when weights load)."""

    codes: torch.Tensor  # uint8 [N, K/2] as stored (bits, cvt) or int32 [N, K/8] (words: prepare_codes)
    scales_t: torch.Tensor  # uint8 [K/32, N]
    n: int
    k: int
    decode: str
    full_range: bool  # some scale byte above FAST_SCALE_MAX: BITS / WORDS take the second multiply


def prepare(w: mxfp4.MXFP4Tensor, decode: str) -> Prepared:
    n, k = w.shape
    codes = prepare_codes(w.data) if decode == "words" else w.data.contiguous()
    full = decode != "cvt" and bool((w.scales > FAST_SCALE_MAX).any())
    return Prepared(codes, prepare_scales(w.scales), n, k, decode, full)


# ----------------------------------------------------------------------------------------------------------------
# The decode warps' arithmetic on the CPU, bit for bit (tests/test_gluon_w4.py checks it against
# moekit.formats.mxfp4.dequantize): the same integer operations as _gluon_w4_kernels.py, and bf16 products as
# fp32 products rounded to bf16 (exact here: e2m1 values have two significant bits and the factors are powers of
# two, so every product is a bf16 or overflows to inf, as mul.rn.bf16x2 gives).

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def factor_bits(sc: torch.Tensor, full_range: bool, decode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's _factor_bits on int32 scale bytes: bf16 bit patterns (f1, f2) as int32."""
    if decode == "cvt":
        bits = torch.where(sc == 0, 0x40, sc << 7)
        bits = torch.where(sc == 255, 0x7FC0, bits)
        return bits, bits
    if full_range:
        f1 = (sc.clamp(max=128) + 126) << 7
        f2 = torch.where(sc == 255, 0x7FC0, (sc.clamp(min=128) - 1) << 7)
        return f1, f2
    return (sc + 126) << 7, (sc + 126) << 7


def bf16_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """The bf16 whose bit pattern is the low 16 bits of integer ``bits``."""
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def bf16_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x.float() * y.float()).to(torch.bfloat16)


def pair_word(w: torch.Tensor, j: int) -> torch.Tensor:
    """The kernel's _pair_word on int32 words (arithmetic shifts, as the kernel's)."""
    mag = {0: w << 6, 1: w << 2, 2: w >> 2, 3: w >> 6}[j]
    sign = w if j == 3 else w << (12 - 4 * j)
    return (mag & kern.MAG2.value) | (sign & kern.SIGN2.value)


def emulate_decode(p: Prepared) -> torch.Tensor:
    """bf16 [N, K]: the weights the decode warps write for prepared weights ``p``."""
    n, k, groups = p.n, p.k, p.k // 32
    sc = unprepare_scales(p.scales_t).to(torch.int32)  # [N, K/32]
    f1b, f2b = factor_bits(sc, p.full_range, p.decode)
    f1, f2 = bf16_of_bits(f1b)[..., None], bf16_of_bits(f2b)[..., None]  # [N, K/32, 1]
    if p.decode == "words":
        w = p.codes.reshape(n, groups, 4)  # int32 words, 8 codes each
        pairs = torch.stack([pair_word(w, j) for j in range(4)], dim=-1).reshape(n, groups, 16)  # k = 8m + 2j
        lo, hi = bf16_of_bits(pairs & 0xFFFF), bf16_of_bits(pairs >> 16)
        halves = []
        for h in (lo, hi):
            h = bf16_mul(h, f1)
            halves.append(bf16_mul(h, f2) if p.full_range else h)
        return torch.stack(halves, dim=-1).reshape(n, k)
    codes = p.codes.reshape(n, groups, 16).to(torch.int32)
    out = []
    for nib in (codes & 15, codes >> 4):  # even k, odd k
        if p.decode == "cvt":
            v = torch.tensor(E2M1, dtype=torch.bfloat16)[nib.long()]
        else:
            v = bf16_of_bits(((nib & 7) << 6) | ((nib & 8) << 12))  # e2m1(n) * 2^-126
        v = bf16_mul(v, f1)
        out.append(bf16_mul(v, f2) if p.full_range else v)
    return torch.stack(out, dim=-1).reshape(n, k)


# ----------------------------------------------------------------------------------------------------------------
# Launch


def descriptors(cfg: Config, a: torch.Tensor, p: Prepared):
    g = cfg.bk // 32
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [cfg.bm, cfg.bk],
                              gl.NVMMASharedLayout.get_default_for([cfg.bm, cfg.bk], gl.bfloat16))
    # Codes: a 3-D view [N, K/32, 16 bytes] so that one box row is one scale group; no swizzle (the decode reads
    # whole 16-byte groups, conflict-free without it).
    if p.decode == "words":
        q_desc = TensorDescriptor(p.codes, [p.n, p.k // 32, 4], [p.k // 8, 4, 1], [cfg.bn, g, 4],
                                  gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3))
    else:
        q_desc = TensorDescriptor(p.codes, [p.n, p.k // 32, 16], [p.k // 2, 16, 1], [cfg.bn, g, 16],
                                  gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3))
    s_desc = TensorDescriptor(p.scales_t, [p.k // 32, p.n], [p.n, 1], [g, cfg.bn],
                              gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
    return a_desc, q_desc, s_desc


def launch(cfg: Config, a: torch.Tensor, p: Prepared, c: torch.Tensor, descs=None, warmup: bool = False):
    """c [M, N] bf16 = a [M, K] bf16 @ dequant(W)^T. ``descs``: descriptors made once (:func:`descriptors`).
    ``warmup``: build only (returns the compiled kernel)."""
    if cfg.decode != p.decode:
        raise ValueError(f"weights prepared for {p.decode}, config decodes {cfg.decode}")
    m = a.shape[0]
    a_desc, q_desc, s_desc = descs or descriptors(cfg, a, p)
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(p.n, cfg.bn),)
    args = (a_desc, q_desc, s_desc, c, c.stride(0), m, p.n, p.k)
    kwargs = dict(STAGES=cfg.stages, SUB=cfg.sub, FULL_RANGE=p.full_range, DECODE=DECODES[cfg.decode],
                  DECODE_WARPS=cfg.decode_warps, LOAD_REGS=cfg.load_regs, DECODE_REGS=cfg.decode_regs,
                  num_warps=cfg.warps)
    if warmup:
        return kern.w4_gemm_kernel.warmup(*args, grid=grid, **kwargs)
    return kern.w4_gemm_kernel[grid](*args, **kwargs)


def candidates() -> list[Config]:
    """The configs the GPU run checks and times (and --compile-only builds)."""
    return [
        Config(),  # one MMA warpgroup, 128 x 128
        Config(warps=8),  # two warpgroups of 64 rows: half the accumulators per thread
        Config(bm=256, warps=8, stages=3),  # one decoded tile feeds 256 rows: half the decode per FLOP
        Config(bm=64, stages=6),  # small M: more CTAs
        Config(bn=64, stages=6),
        # n256 wgmmas read the fewest shared-memory bytes per FLOP; two decode warps keep the CTA at 12 warps (168
        # registers each at launch, 240 for the MMA warpgroups): with four, the accumulators do not fit
        Config(bn=256, warps=8, stages=3, decode_warps=2),
        Config(bm=256, warps=8, stages=4, decode_warps=2),
        Config(decode="bits"),  # the brief's identity on codes as stored (no prepared words)
        Config(decode="cvt"),  # Triton's fp4 -> bf16
        Config(decode_warps=8, sub=128, decode_regs=96),
    ]


# ----------------------------------------------------------------------------------------------------------------
# Compile-only (CPU)


def decode_loop_instructions(sass: str) -> int | None:
    """SASS instructions in the decode warps' K loop (the loop around the bf16 multiplies), one pass per thread."""
    lines = sass.splitlines()
    mul = [i for i, ln in enumerate(lines) if "HMUL2" in ln]
    if not mul:
        return None
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", ln))}
    for ln in lines[mul[-1]:]:
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), len(lines)) < mul[0]:
            start, end = labels[m.group(1)], lines.index(ln)
            return sum(1 for x in lines[start:end + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x))
    return None


def ptxas_report(kernel, cfg: Config | None = None) -> dict:
    """ptxas's registers, spills and stack for the kernel's PTX, its setmaxnreg budgets, shared memory, and the
    decode loop's SASS instructions per weight (``cfg`` given)."""
    from moekit.tools import _sass

    usage, cubin = _sass.ptxas_usage(kernel.asm["ptx"])
    regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])})
    loop = decode_loop_instructions(_sass.sass(cubin) or "")
    per_weight = loop / (cfg.bn * cfg.bk / (32 * cfg.decode_warps)) if loop and cfg else None
    return {**usage, "setmaxnreg": regs, "smem": kernel.metadata.shared, "decode_loop": loop,
            "decode_per_weight": per_weight}


def compile_only(only: int | None = None) -> int:
    from triton.runtime import driver

    from moekit.tools._fake_sm90 import Sm90Driver

    driver.set_active(Sm90Driver())
    failures = 0
    m = 512  # any M: it is a runtime argument
    for name, (n, k) in SHAPES.items():
        a = torch.empty(m, k, dtype=torch.bfloat16)
        c = torch.empty(m, n, dtype=torch.bfloat16)
        w = mxfp4.MXFP4Tensor(torch.empty(n, k // 2, dtype=torch.uint8),
                              torch.full((n, k // 32), 120, dtype=torch.uint8), (n, k))
        preps = {}
        for cfg in candidates()[:only]:
            t = time.monotonic()
            try:
                check_config(cfg, n, k)
                p = preps.setdefault(cfg.decode, prepare(w, cfg.decode))
                r = ptxas_report(launch(cfg, a, p, c, warmup=True), cfg)
                bad = r["spill"] > 0
                failures += bad
                dec = f"{r['decode_per_weight']:.2f}" if r["decode_per_weight"] else "?"
                print(f"{'SPILL' if bad else 'ok':5s} {name:3s} {cfg.label():45s} regs {r['regs']:3d} "
                      f"(setmaxnreg {r['setmaxnreg']})  spill {r['spill']:4d} B  smem {r['smem']:6d} B  "
                      f"decode {dec} SASS/weight  {time.monotonic() - t:4.1f} s", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                failures += 1
                text = str(exc)  # ptxas errors carry the whole PTX first: keep the end
                print(f"FAIL  {name:3s} {cfg.label():45s} {type(exc).__name__}: {text[-600:]}", flush=True)
    print(f"{failures} failed or spilled")
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------------------------------
# GPU: check and time


def random_mxfp4(n: int, k: int, device, scale_bytes=SCALE_BYTES) -> mxfp4.MXFP4Tensor:
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(*scale_bytes, (n, k // 32), dtype=torch.uint8, device=device)
    return mxfp4.MXFP4Tensor(data, scales, (n, k))


def reference64(a: torch.Tensor, w: mxfp4.MXFP4Tensor) -> torch.Tensor:
    return a.double() @ mxfp4.dequantize(w, torch.float64).t()


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def run_checked(cfg: Config, a: torch.Tensor, p: Prepared, ref: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(relative max error, output) of one launch on a NaN-poisoned output."""
    c = torch.full((a.shape[0], p.n), float("nan"), dtype=torch.bfloat16, device=a.device)
    launch(cfg, a, p, c)
    torch.cuda.synchronize()
    return rel_error(c, ref), c


class Run:
    def __init__(self, out_dir: Path, budget_s: float, tokens: tuple[int, ...], configs: list[Config]):
        self.t0 = time.monotonic()
        self.out_dir, self.budget_s, self.tokens, self.configs = out_dir, budget_s, tokens, configs
        self.records: list[dict] = []
        self.env = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                    "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M"),
                    "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
        stamp = self.env["date"]
        self.json_path = out_dir / f"gluon_w4_{stamp}.json"
        self.md_path = out_dir / f"gluon_w4_{stamp}.md"
        self.skipped: list[str] = []

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

    def over_budget(self) -> bool:
        return time.monotonic() - self.t0 > self.budget_s

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps({"env": self.env, "records": self.records, "skipped": self.skipped},
                                             indent=1, default=str))

    def record(self, **r) -> dict:
        self.records.append(r)
        self.write()
        return r

    def time_us(self, fn) -> float:
        from moekit.tools.bench.timing import graph_time_us
        return graph_time_us([fn])

    def gemm_shape(self, name: str, n: int, k: int, dev) -> dict:
        """Every config and baseline at every M for one weight shape; returns {M: bf16 us} for the sums."""
        w = random_mxfp4(n, k, dev)
        w_bf16 = mxfp4.dequantize(w, torch.bfloat16)
        preps = {d: prepare(w, d) for d in {c.decode for c in self.configs}}
        best = {}
        for m in self.tokens:
            a = (torch.randn(m, k, device=dev) * 0.5).to(torch.bfloat16)
            ref = reference64(a, w)
            flops = 2.0 * m * n * k
            c = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            us = self.time_us(lambda: torch.matmul(a, w_bf16.t(), out=c))
            self.record(kind="bf16", shape=name, m=m, n=n, k=k, impl="torch bf16 matmul (cuBLAS)", us=us,
                        tflops=flops / us * 1e-6, max_rel=rel_error(torch.matmul(a, w_bf16.t()), ref))
            bf16_us = us
            for cfg in self.configs:
                if self.over_budget():
                    self.skipped.append(f"{name} M={m} {cfg.label()}")
                    continue
                try:
                    check_config(cfg, n, k)
                    p = preps[cfg.decode]
                    err, _ = run_checked(cfg, a, p, ref)
                    ok = err <= MAX_REL
                    if not ok:
                        self.record(kind="gluon", shape=name, m=m, n=n, k=k, impl=f"Gluon {cfg.label()}", ok=False,
                                    max_rel=err, error=f"max rel error {err:.3e} > {MAX_REL:g}")
                        self.log(f"{name} M={m} {cfg.label()}: FAILED check ({err:.3e})")
                        continue
                    descs = descriptors(cfg, a, p)
                    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                    us = self.time_us(lambda: launch(cfg, a, p, out, descs))
                    err_after = rel_error(out, ref)  # the timed launches wrote the same values
                    r = self.record(kind="gluon", shape=name, m=m, n=n, k=k, impl=f"Gluon {cfg.label()}",
                                    ok=err_after <= MAX_REL, us=us, tflops=flops / us * 1e-6, x_bf16=us / bf16_us,
                                    max_rel=max(err, err_after), config=dataclasses.asdict(cfg))
                    self.log(f"{name} M={m} {cfg.label()}: {us:.1f} us, {r['tflops']:.0f} TFLOP/s, "
                             f"{us / bf16_us:.2f}x bf16, err {r['max_rel']:.1e}")
                    if r["ok"] and (m not in best or us < best[m]["us"]):
                        best[m] = r
                except Exception as exc:  # noqa: BLE001 - one config's failure must not end the run
                    self.record(kind="gluon", shape=name, m=m, n=n, k=k, impl=f"Gluon {cfg.label()}", ok=False,
                                error=f"{type(exc).__name__}: {str(exc)[:400]}")
                    self.log(f"{name} M={m} {cfg.label()}: {type(exc).__name__}: {str(exc)[:200]}")
            if m in best:
                best[m]["best"] = True
                self.write()
            del ref
        return best

    def moekit_shape(self, dev) -> None:
        """moekit's MXFP4 GEMM1 / GEMM2 and whole fused_experts call, one expert, all M tokens on it."""
        import moekit
        from moekit.experts import configs as ecfg
        from moekit.experts import triton_backend as tb

        n13, k13 = SHAPES["w13"]
        n2, k2 = SHAPES["w2"]
        w13 = random_mxfp4(n13, k13, dev)
        w2 = random_mxfp4(n2, k2, dev)
        w13s = mxfp4.MXFP4Tensor(w13.data[None], w13.scales[None], (1, n13, k13))
        w2s = mxfp4.MXFP4Tensor(w2.data[None], w2.scales[None], (1, n2, k2))
        for m in self.tokens:
            if self.over_budget():
                self.skipped.append(f"moekit M={m}")
                continue
            x = (torch.randn(m, k13, device=dev) * 0.5).to(torch.bfloat16)
            ids = torch.zeros(m, 1, dtype=torch.int32, device=dev)
            wts = torch.ones(m, 1, device=dev)
            out = torch.empty(m, HIDDEN, dtype=torch.bfloat16, device=dev)
            try:
                fn = lambda: moekit.fused_experts(x, w13s, w2s, wts, ids, activation="swiglu_oai", out=out)  # noqa
                us = self.time_us(fn)
                self.record(kind="moekit", shape="layer", m=m, impl="moekit.fused_experts MXFP4 (E=1, top_k=1)",
                            us=us, tflops=2.0 * m * (n13 * k13 + n2 * k2) / us * 1e-6)
            except Exception as exc:  # noqa: BLE001
                self.record(kind="moekit", shape="layer", m=m, impl="moekit.fused_experts", error=str(exc)[:400])
            try:
                cfg, source = ecfg.choose(m, 1, 1, n13, k13, x.device, x.dtype, "mxfp4")
                if cfg.per_pair:
                    raise ValueError(f"config {cfg} is per-pair at M={m}: no aligned GEMMs to time")
                W13, W2 = tb.WeightOperand.of(w13s), tb.WeightOperand.of(w2s)
                bm = cfg.block_m
                _, sorted_pairs, block_expert = tb.align(ids, None, 1, bm)
                blocks = block_expert.shape[0]
                h, _ = tb.activation_buffers(blocks * bm, INTER, x.dtype, dev, False)
                y = torch.empty(m, HIDDEN, dtype=x.dtype, device=dev)
                rows = tb.RowMap.aligned(block_expert, sorted_pairs)
                h_paired = tb._w4_words(W2, h.dtype)
                g1 = lambda: tb.gemm1(x, W13, None, h, rows, "swiglu_oai", blocks, cfg.gemm1, bm,  # noqa: E731
                                      m, 1, 0, h_paired=h_paired)
                g2 = lambda: tb.gemm2(h, W2, None, wts.reshape(-1), y, (0, y.stride(0)), rows, blocks,  # noqa: E731
                                      cfg.gemm2, bm, m, 0)
                for shape, fn, (n, k) in (("w13", g1, (n13, k13)), ("w2", g2, (n2, k2))):
                    us = self.time_us(fn)
                    self.record(kind="moekit", shape=shape, m=m, n=n, k=k, us=us, tflops=2.0 * m * n * k / us * 1e-6,
                                impl=f"moekit {'gemm1 (+swiglu)' if shape == 'w13' else 'gemm2'} MXFP4",
                                config=str(cfg), config_source=source)
            except Exception as exc:  # noqa: BLE001
                self.record(kind="moekit", shape="w13+w2", m=m, impl="moekit gemm1/gemm2",
                            error=f"{type(exc).__name__}: {str(exc)[:400]}")
                self.log(f"moekit GEMMs at M={m}: {type(exc).__name__}: {str(exc)[:200]}")
            self.log(f"moekit M={m} timed")

    def report(self) -> None:
        ok = [r for r in self.records if r.get("us")]
        bf16 = {(r["shape"], r["m"]): r["us"] for r in ok if r["kind"] == "bf16"}
        rows = []
        for shape in ("w13", "w2"):
            for m in self.tokens:
                picks = [r for r in ok if r["shape"] == shape and r["m"] == m and
                         (r["kind"] in ("bf16", "moekit") or r.get("best"))]
                for r in sorted(picks, key=lambda r: r["us"]):
                    b = bf16.get((shape, m))
                    rows.append([shape, str(m), r["impl"], f"{r['us']:.1f}", f"{r['tflops']:.0f}",
                                 f"{r['us'] / b:.2f}" if b else "-",
                                 f"{r['max_rel']:.1e}" if r.get("max_rel") is not None else "-"])
        for m in self.tokens:  # one expert's two GEMMs (Gluon, bf16) beside moekit's whole call
            layer = [r for r in ok if r["shape"] == "layer" and r["m"] == m]
            gl_sum = [next((r["us"] for r in ok if r["shape"] == s and r["m"] == m and r.get("best")), None)
                      for s in ("w13", "w2")]
            bf_sum = [bf16.get((s, m)) for s in ("w13", "w2")]
            b = sum(bf_sum) if None not in bf_sum else None
            if None not in gl_sum:
                rows.append(["w13+w2", str(m), "Gluon best w13 + best w2 (GEMMs only)", f"{sum(gl_sum):.1f}", "-",
                             f"{sum(gl_sum) / b:.2f}" if b else "-", "-"])
            if b:
                rows.append(["w13+w2", str(m), "bf16 matmul w13 + w2 (GEMMs only)", f"{b:.1f}", "-", "1.00", "-"])
            for r in layer:
                rows.append(["layer", str(m), r["impl"], f"{r['us']:.1f}", f"{r['tflops']:.0f}",
                             f"{r['us'] / b:.2f}" if b else "-", "-"])
        header = ["shape", "M", "implementation", "us", "TFLOP/s", "x bf16 time", "max rel err"]
        env = self.env
        failed = [r for r in self.records if r["kind"] == "gluon" and not r.get("ok")]
        lines = [f"# Gluon producer/consumer MXFP4 GEMM, gpt-oss-120b shapes ({env['gpu']}, {env['date']} "
                 f"{env['time_utc']} UTC)", "",
                 f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}. "
                 f"`benchmarks/experiments/gluon_w4.py`: "
                 "C[M, N] = A[M, K] bf16 @ dequant(W[N, K] MXFP4)^T, w13 N=5760 K=2880, w2 N=2880 K=2880, "
                 f"scale bytes in [{SCALE_BYTES[0]}, {SCALE_BYTES[1]}). CUDA-graph timing (graph_time_us). Every Gluon "
                 f"config checked against float64 (max rel error <= {MAX_REL:g}, output poisoned with NaN) before "
                 "timing and after. Gluon rows: the best config per (shape, M); every config in the JSON. moekit "
                 "gemm1 includes its SwiGLU epilogue (writes N/2 columns); 'layer' is moekit.fused_experts whole, "
                 "one expert, top_k=1, beside the sum of the two GEMMs.", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += ["", "Every Gluon config:", "", "| shape | M | config | us | x bf16 | max rel err | note |",
                  "|---|---|---|---|---|---|---|"]
        for r in self.records:
            if r["kind"] == "gluon":
                lines.append(f"| {r['shape']} | {r['m']} | {r['impl']} | {r.get('us', 0):.1f} | "
                             f"{r.get('x_bf16', 0):.2f} | {r.get('max_rel', float('nan')):.1e} | "
                             f"{'ok' if r.get('ok') else r.get('error', 'failed')[:200]} |")
        if self.skipped:
            lines += ["", f"Not run (budget): {', '.join(self.skipped)}"]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.md_path.write_text("\n".join(lines) + "\n")
        self.write()
        widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
        print()
        print(f"{env['gpu']}  {env['date']}  torch {env['torch']}  triton {env['triton']}  CUDA {env['cuda']}  "
              f"({len(failed)} Gluon config run(s) failed; see {self.md_path})")
        for row in [header] + rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else HERE / "results" / "archive"
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--budget-s", type=float, default=150.0, help="start no timing after this many seconds")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--configs", type=int, help="only the first N candidate configs")
    p.add_argument("--compile-only", action="store_true", help="CPU: build the configs for sm_90 and stop")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only(args.configs)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --compile-only)")
    run = Run(args.out, args.budget_s, tuple(args.tokens), candidates()[:args.configs])
    dev = torch.device("cuda")
    torch.manual_seed(0)
    try:
        run.log(f"{run.env['gpu']}, torch {run.env['torch']}, triton {run.env['triton']}")
        run.moekit_shape(dev)  # first: the budget may stop the Gluon sweep, never the baseline
        for name, (n, k) in SHAPES.items():
            run.gemm_shape(name, n, k, dev)
    finally:
        run.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
