"""Tune the expert GEMMs' block configurations on this GPU and write them as a table.

    moekit tune --preset gpt-oss-120b qwen3-30b-a3b --tokens 1 16 256 4096 --out tuned.json
    moekit tune ... --merge   (into the package's table, moekit/experts/tuned_configs.json)
    moekit tune --preset gpt-oss-120b --format mxfp4 --act-quant fp8_group   (W4A8: the "w4a8" entries)

For each shape and token bucket, every row-block size that suits the bucket is tried; for each,
GEMM1 and GEMM2 candidates are timed separately and the pair with the least total time is kept.
Up to DECODE_CALLS_MAX tokens a timing is one CUDA graph of DECODE_CALLS calls, each routed to experts
of its own over the layers' weights, as consecutive decode layers run: the experts one call touches
fit in L2 (qwen3's eight GEMM2 experts are 25 MB), and a graph that replayed them alone would time L2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from .. import _triton, presets
from ..experts import configs as expert_configs
from ..experts import fused_experts
from ..experts import triton_backend as ext
from ..experts.configs import ExpertsConfig, GemmConfig, config_family
from ..formats import FOUR_BIT_FORMATS, prepare, quantize_experts
from . import _argtypes, _sass
from .bench.experts import routes
from .bench.timing import graph_time_us


def row_blocks(num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    rows = num_tokens * top_k / num_experts
    if rows <= 4:
        return [16]
    if rows <= 24:
        return [16, 32]
    if rows <= 96:
        return [32, 64]
    return [64, 128]


SMEM_BYTES = 227 * 1024  # per block on sm_90


def candidates(block_m: int, weight_tiles: int) -> list[GemmConfig]:
    """Configs worth compiling: the pipelined operand tiles (x rows + ``weight_tiles`` weight
    tiles per stage, 2 bytes each) must fit in shared memory."""
    if block_m <= 32:  # weight streaming: narrow tiles, deep K, many stages in flight
        space = itertools.product((32, 64), (128, 256), (4,), (3, 4, 5), (1,))
    else:  # tensor-core bound: wide tiles, L2-grouped order
        space = itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4), (8,))
    # GEMM1 holds two accumulators: past 128 columns each they no longer fit in registers.
    fits = lambda bn, bk, s: (s * (block_m * bk + weight_tiles * bn * bk) * 2 <= SMEM_BYTES  # noqa: E731
                              and bn * weight_tiles <= 256)
    return [GemmConfig(bn, bk, w, s, g) for bn, bk, w, s, g in space if fits(bn, bk, s)]


def gemv_candidates(which: int = 1, top_k: int = 1, weight_format: str = "dense") -> list[GemmConfig]:
    """CUDA-core decode kernels (kernels/moe_gemv.py): no shared-memory operands, so only the
    column tile, the K chunk per step, the warps and the slots handled together matter; a step's
    weights (and the next step's, in flight) of more than 64 elements per thread spill registers."""
    space = itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8))
    base = [GemmConfig(bn, bk, w, 1) for bn, bk, w in space if bn * bk <= 64 * 32 * w]
    several = [s for s in (2, 4, 8) if s <= _triton.next_pow2(top_k)]
    if which == 1:
        if weight_format == "dense":  # two bf16 tiles per slot: several slots spill (offline sm_90 SASS)
            return base
        # 4-bit: the pairs of a program share the activation chunk, fp32 in registers; the rows kernel
        # (kernels/gemv1_rows.py) with its words per thread within 32 (sm_90 builds: 80-166 registers, no spills)
        rows = [GemmConfig(bn, bk, w, stages, row_scaled=True)
                for bn, bk, w, stages in itertools.product((4, 8, 16), (512, 1024), (2, 4, 8), (2, 3))
                if bn * bk <= 32 * 128 * w]
        return base + [replace(c, slots=s) for s in several for c in base
                       if c.block_n <= 8 and s * c.block_n * c.block_k <= 32 * 32 * c.num_warps] + rows
    out = [replace(c, slots=0) for c in base] + [replace(c, slots=1) for c in base]
    if weight_format in FOUR_BIT_FORMATS:  # each slot's h row scaled in the kernel (a loop per slot)
        out += [replace(c, row_scaled=True) for c in base]
    for slots in several:  # several experts per step: narrow column tiles, or the step spills
        out += [replace(c, slots=slots) for c in base
                if c.block_n <= 8 and slots * c.block_n * c.block_k <= 64 * 32 * c.num_warps]
    return out


TMA_TUNE_MIN_BLOCK_M = 64  # tensor-core bound row blocks also try TMA weight boxes ...
TMA_TUNE_TOP = 3  # ... on their fastest few configs
HALF_TAILS_TUNE_MIN_BLOCK_M = 64  # row blocks that pad each expert by tens of rows also try half tail blocks ...
HALF_TAILS_TUNE_TOP = 2  # ... on their fastest configs (TMA ones included)
SCALES_AHEAD_TUNE_TOP = 3  # 4-bit tensor-core GEMMs: their fastest few again with scales_ahead the other way
MAX_SPILL_BYTES = 16  # as tests/sm90_compile.py: past this, a config is kept only if no spill is inside a loop


def _time(fns, reps: int = 10) -> float:
    """Microseconds per call of a CUDA graph of ``fns``."""
    return graph_time_us(fns, replays=reps, warmup=2)


DECODE_CALLS = 8  # calls per timed graph up to DECODE_CALLS_MAX tokens (as bench.experts.make_cases)
DECODE_CALLS_MAX = 64


class _Problem:
    """Inputs of one (shape, T) case: one route set per call of a timed graph, aligned once per row block."""

    def __init__(self, spec, num_tokens, weights, dtype=torch.bfloat16, act_quant: str | None = None):
        H = spec.hidden_size
        self.spec, self.T, self.weights = spec, num_tokens, weights
        self.x_in = torch.randn(num_tokens, H, device="cuda", dtype=dtype)
        self.fp8 = ext.fp8_activations(weights[0][0], act_quant)  # W8A8, or W4A8 when asked for
        self.act_quant = "fp8_group" if self.fp8 else None
        self.operands = [(ext.WeightOperand.of(w13, self.fp8), ext.WeightOperand.of(w2, self.fp8))
                         for w13, w2 in weights]
        # W8A8/W4A8: the GEMMs read E4M3 codes with their 1x128 group scales
        self.x, self.xs = ext.fp8_groups(self.x_in) if self.fp8 else (self.x_in, None)
        calls = DECODE_CALLS if num_tokens <= DECODE_CALLS_MAX else 1
        self.routes = [routes(spec, num_tokens) for _ in range(calls)]  # (topk weights [T, k], ids [T, k])

    def best(self, block_m: int, which: int, mode: str = "aligned") -> tuple[GemmConfig, float]:
        """Fastest candidate for GEMM ``which`` (1 or 2) in ``mode`` (an ExpertsConfig mode: "aligned" with
        this row block, "per_pair" on the tensor cores, "gemv" on the CUDA cores)."""
        if mode not in ("aligned", "per_pair", "gemv"):
            raise ValueError(f"mode must be 'aligned', 'per_pair' or 'gemv', got {mode!r}")
        per_pair, gemv = mode == "per_pair", mode == "gemv"
        spec, T = self.spec, self.T
        num_pairs = T * spec.top_k
        if per_pair:
            blocks, block_m = num_pairs, ext.PER_PAIR_BLOCK_M
            rows = [ext.RowMap.per_pair(ids.reshape(-1)) for _, ids in self.routes]
            y = torch.empty(T, spec.hidden_size, device="cuda", dtype=self.x_in.dtype)
        else:
            rows = []
            for _, ids in self.routes:
                _, sorted_pairs, block_expert = ext.align(ids, None, spec.num_experts, block_m)
                rows.append(ext.RowMap.aligned(block_expert, sorted_pairs))
            blocks = rows[0].block_expert.shape[0]  # the bound for T pairs: the same for every route set
            y = torch.empty(num_pairs, spec.hidden_size, device="cuda", dtype=self.x_in.dtype)
        h, hs = ext.activation_buffers(blocks * (1 if per_pair else block_m), spec.intermediate_size,
                                        self.x_in.dtype, self.x.device, self.fp8)
        if self.fp8:
            h.copy_(torch.randn(h.shape, device="cuda").clamp(-400, 400))
            hs.uniform_(1e-3, 1e-2)
        else:
            h.normal_()
        results = []
        operands = self.operands
        fmt = operands[0][which - 1].config_format
        space = gemv_candidates(which, spec.top_k, fmt) if gemv else candidates(block_m, 2 if which == 1 else 1)
        if self.fp8 and not gemv:  # 128-column FP8 tiles (GEMM1's two accumulators): twice the warps as well
            space += [replace(c, num_warps=2 * c.num_warps) for c in space]
        # FP8 fixes BLOCK_K (and GEMM1's BLOCK_N) at 128: time each effective config once
        space = list(dict.fromkeys(operands[0][which - 1].config(c, tiles=2 if which == 1 else 1) for c in space))

        def call(i, cfg):  # call i of the graph; returns the launched kernel (its register and spill counts)
            w13, w2 = operands[i % len(operands)]
            r = i % len(self.routes)
            tw, ids = self.routes[r]
            flat_ids, flat_tw = ids.reshape(-1), tw.reshape(-1)
            if gemv and which == 1:
                return ext.gemv1(self.x, w13, None, h, flat_ids, None, spec.num_experts,
                                  self.spec.activation, spec.top_k, cfg)
            elif gemv:
                return ext.gemv2_tokens(h, w2, None, flat_tw, flat_ids, None, spec.num_experts,
                                         y, spec.top_k, cfg)
            elif which == 1:
                return ext.gemm1(self.x, w13, None, h, rows[r], self.spec.activation, blocks, cfg, block_m, num_pairs,
                                  spec.top_k, 0, spec.num_experts, self.xs, hs)
            elif per_pair:
                return ext.gemm2_tokens(h, w2, None, flat_tw, ids, None, spec.num_experts, y, spec.top_k,
                                         cfg, hs)
            else:
                return ext.gemm2(h, w2, None, flat_tw, y, (0, y.stride(0)), rows[r], blocks, cfg, block_m,
                                  num_pairs, 0, hs)

        def measure(cfg):
            try:
                kernel = call(0, cfg)  # compiled here, before any graph capture
                spills = getattr(kernel, "n_spills", 0) or 0  # ptxas's count, filled in by the launch
                in_loops = _sass.spills_in_loops(kernel) if spills > MAX_SPILL_BYTES else 0
                if in_loops is None or in_loops > 0:  # unknown counts as inside
                    where = f", {in_loops} LDL/STL in loops" if in_loops else ""
                    print(f"    skip {cfg}: spills {spills} bytes{where}")
                    return
                results.append((_time([lambda i=i: call(i, cfg) for i in range(self.calls)]), cfg))
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                print(f"    skip {cfg}: {type(exc).__name__}")
                torch.cuda.synchronize()

        for cfg in space:
            measure(cfg)
        tma_format = operands[0][which - 1].format in ("dense", "fp8")
        if not (gemv or per_pair) and block_m >= TMA_TUNE_MIN_BLOCK_M and tma_format:
            for _, cfg in sorted(results, key=lambda r: r[0])[:TMA_TUNE_TOP]:  # the best few again, TMA boxes
                measure(replace(cfg, tma=True))
        if not (gemv or per_pair) and block_m >= HALF_TAILS_TUNE_MIN_BLOCK_M:
            for _, cfg in sorted(results, key=lambda r: r[0])[:HALF_TAILS_TUNE_TOP]:  # ... and half tail blocks
                measure(replace(cfg, half_tails=True))
        if not (gemv or per_pair) and fmt in FOUR_BIT_FORMATS:  # the format's default measured per bucket
            for _, cfg in sorted(results, key=lambda r: r[0])[:SCALES_AHEAD_TUNE_TOP]:
                measure(replace(cfg, scales_ahead=fmt != "mxfp4"))
        if not results:  # e.g. every candidate spills in its K loop: the mode is not a choice at this block
            print(f"    no candidate for GEMM{which} at BLOCK_M={block_m}{' (per pair)' if per_pair else ''}")
            return None, float("inf")
        us, cfg = min(results, key=lambda r: r[0])
        return cfg, us

    @property
    def calls(self) -> int:
        return max(len(self.routes), len(self.weights))

    def whole_call_us(self, config: ExpertsConfig) -> float:
        """A complete fused_experts call (alignment and combine included) with ``config``."""
        def call(i):
            w13, w2 = self.weights[i % len(self.weights)]
            tw, ids = self.routes[i % len(self.routes)]
            return fused_experts(self.x_in, w13, w2, tw, ids, activation=self.spec.activation, config=config,
                                 act_quant=self.act_quant)

        return _time([lambda i=i: call(i) for i in range(self.calls)])


def random_weights(spec, layers: int = 2, dtype=torch.bfloat16, weight_format: str = "dense",
                   prepared: bool = True) -> list[tuple]:
    """``layers`` random (w13, w2) stacks, quantized to ``weight_format`` ("dense" or one of
    formats.EXPERT_FORMATS); 4-bit codes in moekit's prepared layout (formats.prepare, what FusedMoE serves) unless
    ``prepared`` is False."""
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    out = []
    for _ in range(layers):
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=dtype).mul_(H ** -0.5)
        w2 = torch.randn(E, H, I, device="cuda", dtype=dtype).mul_(I ** -0.5)
        if weight_format != "dense":
            w13, w2 = quantize_experts(w13, weight_format), quantize_experts(w2, weight_format)
            if prepared:
                w13, w2 = prepare(w13), prepare(w2)
            torch.cuda.empty_cache()
        out.append((w13, w2))
    return out


PER_PAIR_TUNE_MAX = 4  # buckets up to this many tokens also try the per-pair decode mode
GEMV_TUNE_MAX = 16  # ... and up to this many, the CUDA-core decode kernels


MODES = expert_configs.MODES  # the kernel modes a sweep can try
INCUMBENT_PER_PAIR_MAX = 64  # tokens up to which the table's per-pair entries are incumbents (benchmarks/results/archive/ab_bucket_gaps_2026-12-03.md)


def tune(spec, num_tokens: int, weights, weight_format: str = "dense", modes=MODES,
         shipped: dict | None = None, act_quant: str | None = None) -> tuple[ExpertsConfig, dict]:
    """The fastest config for ``num_tokens``: the sweep's pick, unless ``shipped`` (the table's entries for the
    shape, as JSON) is given and a whole call with one of them or with the heuristic is faster (:func:`incumbents`).
    ``act_quant="fp8_group"`` with MXFP4 weights tunes W4A8."""
    family = config_family(weight_format, act_quant)
    problem = _Problem(spec, num_tokens, weights, act_quant=act_quant)
    if problem.fp8:  # FP8 activations have no CUDA-core kernels: their decode is the per-pair tensor-core mode
        modes = [m for m in modes if m != "gemv"]
    best = None
    info = {}
    for bm in row_blocks(num_tokens, spec.num_experts, spec.top_k) if "aligned" in modes else ():
        g1, t1 = problem.best(bm, 1)
        g2, t2 = problem.best(bm, 2)
        print(f"  T={num_tokens} BLOCK_M={bm}: gemm1 {t1:.1f} us {g1}, gemm2 {t2:.1f} us {g2}", flush=True)
        if g1 is not None and g2 is not None and (best is None or t1 + t2 < best[0]):
            best = (t1 + t2, ExpertsConfig(bm, g1, g2))
            info = {"gemm_us": best[0]}
    if num_tokens <= PER_PAIR_TUNE_MAX and "per_pair" in modes:
        # The modes differ in launches (alignment, combine): compare whole calls.
        g1, _ = problem.best(16, 1, mode="per_pair")
        g2, _ = problem.best(16, 2, mode="per_pair")
        if g1 is not None and g2 is not None:  # else no candidate ran: the mode is out
            pair_cfg = ExpertsConfig(16, g1, g2, mode="per_pair")
            aligned_us = problem.whole_call_us(best[1]) if best else float("inf")
            pair_us = problem.whole_call_us(pair_cfg)
            print(f"  T={num_tokens} whole call: aligned {aligned_us:.1f} us, per-pair {pair_us:.1f} us {g1} {g2}",
                  flush=True)
            info |= {"aligned_call_us": aligned_us, "per_pair_call_us": pair_us}
            if pair_us < aligned_us:
                best = (pair_us, pair_cfg)
    if num_tokens <= GEMV_TUNE_MAX and "gemv" in modes:
        g1, _ = problem.best(16, 1, mode="gemv")
        g2, _ = problem.best(16, 2, mode="gemv")
        if g1 is not None and g2 is not None:  # else no candidate ran: the mode is out
            gemv_cfg = ExpertsConfig(16, g1, g2, mode="gemv")
            best_us = problem.whole_call_us(best[1]) if best else float("inf")
            gemv_us = problem.whole_call_us(gemv_cfg)
            if _triton.dependent_launches(torch.device("cuda")):  # GEMM2 launched as GEMM1's dependent
                try:
                    pdl_us = problem.whole_call_us(replace(gemv_cfg, pdl=True))
                except Exception as exc:  # noqa: BLE001 - e.g. a capture that rejects the launch attribute
                    print(f"  T={num_tokens} dependent launch failed: {type(exc).__name__}: {str(exc)[:80]}",
                          flush=True)
                    torch.cuda.synchronize()
                else:
                    print(f"  T={num_tokens} CUDA-core with dependent launch {pdl_us:.1f} us", flush=True)
                    info |= {"gemv_pdl_call_us": pdl_us}
                    if pdl_us < gemv_us:
                        gemv_cfg, gemv_us = replace(gemv_cfg, pdl=True), pdl_us
            variants = []  # (what, change of the current pick, info key): whole calls, each kept if faster
            if weight_format in FOUR_BIT_FORMATS:  # GEMM1's fp16x2 products (the default) against fp32 ones
                variants.append(("fp32 products in GEMM1", lambda c: replace(c, gemm1=replace(c.gemm1, packed=False)),
                                 "gemv_fp32_products_call_us"))
            if ext.gemv2_packed(replace(gemv_cfg.gemm2, packed=True), weight_format, problem.x_in.dtype, spec.top_k):
                variants.append(("fp16x2 products in GEMM2", lambda c: replace(c, gemm2=replace(c.gemm2, packed=True)),
                                 "gemv_packed_gemm2_call_us"))
            # GEMV1 at 3 programs of 4 warps per SM where the compiler takes more registers (gpt-oss-120b's bf16 GEMV1
            # builds in 211: benchmarks/results/archive/ab_decode_maxnreg_h100_2026-12-07.md); kept only if faster,
            # since under a cap ptxas spends up to it (a GEMV1 that builds in fewer takes more, fits fewer per SM)
            three = _triton.registers_for(programs_per_sm=3, num_warps=4)  # 168: a third program of 4 warps per SM
            if gemv_cfg.gemm1.num_warps == 4:  # (at 8 warps the same cap fits no program more)
                variants.append((f"GEMV1 at {three} registers",
                                 lambda c: replace(c, gemm1=replace(c.gemm1, maxnreg=three)),
                                 f"gemv_gemm1_maxnreg_{three}_call_us"))
            if spec.top_k > 1:  # GEMM2 per pair, then the combine
                variants.append(("GEMM2 per pair", lambda c: replace(c, split_slots=True), "gemv_split_slots_call_us"))
            if spec.top_k > 1 and weight_format in FOUR_BIT_FORMATS:
                # GEMM2 per pair on the rows kernel (kernels/gemv2_rows.py): chunks that split w2's K = I in a few
                # (the H100 A/B of 2026-12-06, benchmarks/results/archive/ab_gemv2_rows_h100_2026-12-06.md: 1024
                # for gpt-oss-120b's 2880, 256 for qwen3-30b-a3b's 768)
                bk = 1024 if spec.intermediate_size >= 2048 else 256
                for bn, stages in ((16, 3), (32, 3), (32, 2)):
                    variants.append((f"GEMM2 per pair on the rows kernel ({bn} rows, {bk}-code chunks, "
                                     f"{stages} stages)",
                                     lambda c, g=GemmConfig(bn, bk, 4, stages, row_scaled=True): replace(
                                         c, split_slots=True, gemm2=g),
                                     f"gemv_split_rows_{bn}_{stages}_call_us"))
            for what, change, key in variants:
                cfg = change(gemv_cfg)
                us = problem.whole_call_us(cfg)
                print(f"  T={num_tokens} CUDA-core with {what} {us:.1f} us", flush=True)
                info |= {key: us}
                if us < gemv_us:
                    gemv_cfg, gemv_us = cfg, us
            print(f"  T={num_tokens} whole call: best so far {best_us:.1f} us, CUDA-core {gemv_us:.1f} us {g1} {g2}",
                  flush=True)
            info |= {"gemv_call_us": gemv_us}
            if best:                                         # JSON has no infinity: omit what was not timed
                info |= {"best_tensor_core_call_us": best_us}
            if gemv_us < best_us:
                best = (gemv_us, gemv_cfg)
    if best is None:
        raise ValueError(f"no mode of {modes} gave a config at T={num_tokens} (none applies, or every candidate "
                         "was skipped: see above)")
    heur = expert_configs.heuristic(num_tokens, spec.num_experts, spec.top_k, 2 * spec.intermediate_size,
                                    spec.hidden_size, family)
    info |= {"heuristic": heur.to_dict()}
    # per-pair entries (decode sizes) past a few dozen tokens only cost sweep time: they lost everywhere there
    others = {what: c for what, c in (incumbents(shipped, heur) if shipped is not None else {}).items()
              if c != best[1] and (num_tokens <= INCUMBENT_PER_PAIR_MAX or not c.per_pair)}
    if others:
        # The sweep ranks each mode's GEMMs alone; the incumbents are what would serve the bucket otherwise,
        # so the pick must beat them in whole calls (the A/Bs of 2026-12-03, benchmarks/results/archive/ab_bucket_gaps_2026-12-03.md, found neighbouring buckets' entries up to 40%
        # faster than both the heuristic and the sweep's own space at some token counts).
        pick_us = problem.whole_call_us(best[1])
        timed = [(pick_us, best[1], "sweep")]
        for what, cfg in others.items():
            try:
                timed.append((problem.whole_call_us(cfg), cfg, what))
            except Exception as exc:  # noqa: BLE001 - e.g. an entry for another mode that does not apply here
                print(f"  T={num_tokens} incumbent {cfg} failed: {type(exc).__name__}", flush=True)
                torch.cuda.synchronize()
        us, cfg, what = min(timed, key=lambda t: t[0])
        print(f"  T={num_tokens} whole call: sweep {pick_us:.1f} us, best of {len(others)} incumbents "
              f"{min((t[0] for t in timed[1:]), default=float('nan')):.1f} us -> {what}", flush=True)
        info |= {"sweep_call_us": pick_us, "incumbents_call_us": {w: t for t, _, w in timed[1:]}, "kept": what,
                 "call_us": us}
        best = (us, cfg)
    return best[1], info


def incumbents(table_entries: dict, heuristic: ExpertsConfig) -> dict[str, ExpertsConfig]:
    """The configs a bucket's sweep must beat, each once under the first name it has: every entry the shipped
    table has for the shape ("table T<=N": a neighbouring bucket's measured winner, or the bucket's own) and
    the heuristic."""
    named = [(f"table T<={b}", ExpertsConfig.from_dict(e)) for b, e in sorted(table_entries.items(),
                                                                             key=lambda t: int(t[0]))]
    out: dict[str, ExpertsConfig] = {}
    for what, cfg in named + [("heuristic", heuristic)]:
        if cfg not in out.values():
            out[what] = cfg
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", nargs="+", type=_argtypes.preset_name,
                   default=["gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"],
                   help="presets to tune (default: gpt-oss-120b qwen3-30b-a3b mixtral-8x7b deepseek-v3)")
    p.add_argument("--tokens", nargs="+", type=_argtypes.positive_token_count,
                   default=list(expert_configs.TOKEN_BUCKETS),
                   help=f"token buckets (default: {' '.join(map(str, expert_configs.TOKEN_BUCKETS))})")
    p.add_argument("--out", type=_argtypes.new_file, default=Path("experts_tuned.json"),
                   help="the measured table (default: ./experts_tuned.json)")
    p.add_argument("--merge", action="store_true", help="also merge into the package's table")
    p.add_argument("--format", default="dense", choices=["dense", "mxfp4", "nvfp4", "fp8_block", "fp8_channel"],
                   help="expert weight format (FP8 runs as W8A8 with 1x128 activation groups)")
    p.add_argument("--act-quant", choices=["fp8_group"], default=None,
                   help="with --format mxfp4: W4A8 (activations in 1x128 E4M3 groups), tuned as the 'w4a8' entries")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="kernel modes to try (default all; the CUDA-core 'gemv' mode up to 16 tokens)")


def main(argv=None) -> int:
    p = _argtypes.Parser(prog="moekit tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p, p.parse_args(argv))


def run(p: argparse.ArgumentParser, args) -> int:
    """Tune as ``args`` say (``p``: their parser, for its one-line errors)."""
    try:
        family = config_family(args.format, args.act_quant)
    except ValueError as exc:
        p.error(str(exc))
    if not torch.cuda.is_available():
        return _argtypes.fail(p.prog, "needs a CUDA GPU (its timings are CUDA-graph replays)")
    dtype = torch.bfloat16
    key = expert_configs.table_key(torch.device("cuda"), dtype, family)
    table: dict = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name in args.preset:
        spec = presets.get(name)
        shape = expert_configs.shape_key(spec.num_experts, 2 * spec.intermediate_size, spec.hidden_size)
        weights = random_weights(spec, weight_format=args.format)
        for T in args.tokens:
            bucket = expert_configs.token_bucket(T)
            print(f"{name} {shape} T<={bucket}", flush=True)
            # what serves the shape on this GPU now: its own entries, bucket by bucket over those it borrows
            shipped = {b: e for b, (e, _) in expert_configs.served_entries(
                expert_configs.serving_keys(torch.device("cuda"), dtype, family), shape).items()}
            cfg, info = tune(spec, bucket, weights, args.format, args.modes, shipped, args.act_quant)
            entry = cfg.to_dict() | {"measured": info}
            table.setdefault(key, {}).setdefault(shape, {})[str(bucket)] = entry
            args.out.write_text(json.dumps(table, indent=1))  # keep partial results if interrupted
            if args.merge:  # likewise: a sweep cut off by a time limit keeps the buckets it finished
                _merge_entry(key, shape, str(bucket), entry)
        del weights
        torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return 0


def _merge_entry(key: str, shape: str, bucket: str, entry: dict, target: Path | None = None) -> None:
    """One tuned bucket into the package's table (moekit/experts/tuned_configs.json), other entries kept."""
    target = target or Path(expert_configs.__file__).parent / expert_configs.TABLE_FILE
    merged = json.loads(target.read_text()) if target.exists() else {}
    merged.setdefault(key, {}).setdefault(shape, {})[bucket] = entry
    target.write_text(json.dumps(merged, indent=1))


if __name__ == "__main__":
    sys.exit(main())
