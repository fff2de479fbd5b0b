"""Host side of the Triton expert kernels: buffers sized from upper bounds, launches, and the
torch.library custom ops that make them opaque (and traceable with fake kernels) to torch.compile.

Arguments arrive validated by :mod:`moekit.experts`; nothing here synchronizes with the host, so
a call can be captured in a CUDA graph and replayed with new inputs.

A call runs in stages: :func:`align` (aligned mode), :func:`gemm1` / :func:`gemv1`, :func:`gemm2` /
:func:`gemm2_tokens` / :func:`gemv2_tokens`, and the combine. The stages are public for the tuner
(``moekit tune`` times each GEMM's candidates alone) and the decode benchmark; a caller of the stages
passes arguments as :func:`fused_experts_into` does.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch

from .. import _triton
from .._checks import check_written_memory
from ..formats import FOUR_BIT_FORMATS, format_of, from_parts, to_parts
from . import configs as expert_configs
from .configs import ALIGN_ONE_PROGRAM_MAX, ExpertsConfig, GemmConfig
from . import lora as expert_lora
from .._launch import Constants, Launcher, arg_builder
from .kernels import align as align_kernels
from .kernels import fp8_quant, gemv1_rows, gemv2_rows, moe_gemm, moe_gemv
from .kernels import scaled_fp16 as scaled_fp16_kernels

# Every launch binds its call signature once (moekit._launch): the eager host time of a call.
gemm1_act_kernel = Launcher(moe_gemm.gemm1_act_kernel)
gemm2_kernel = Launcher(moe_gemm.gemm2_kernel)
gemm2_tokens_kernel = Launcher(moe_gemm.gemm2_tokens_kernel)
combine_kernel = Launcher(moe_gemm.combine_kernel)
gemv1_act_kernel = Launcher(moe_gemv.gemv1_act_kernel)
gemv1_rows_kernel = Launcher(gemv1_rows.gemv1_rows_kernel)
gemv2_rows_kernel = Launcher(gemv2_rows.gemv2_rows_kernel)
gemv2_tokens_kernel = Launcher(moe_gemv.gemv2_tokens_kernel)
scaled_fp16_kernel = Launcher(scaled_fp16_kernels.scaled_fp16_kernel)
quantize_groups_kernel = Launcher(fp8_quant.quantize_groups_kernel)
align_kernel = Launcher(align_kernels.align_kernel)
align_count_kernel = Launcher(align_kernels.align_count_kernel)
align_offsets_kernel = Launcher(align_kernels.align_offsets_kernel)
align_scatter_kernel = Launcher(align_kernels.align_scatter_kernel)
_PTX = gemm1_act_kernel.compiled  # built for the GPU, as TRITON_INTERPRET said at import: inline PTX allowed

ACTIVATION_IDS = {"silu_and_mul": moe_gemm.SILU_AND_MUL.value, "swiglu_oai": moe_gemm.SWIGLU_OAI.value}
ALIGN_CHUNK = 64  # pairs per step of the alignment: its rank tile is CHUNK x CHUNK
ALIGN_TILE = 8192  # elements of the alignment's [blocks x experts] owner tile
ALIGN_WARPS = 8
ALIGN_PAIRS_PER_PROGRAM = 256
ALIGN_PREFIX_EXPERTS = 16  # experts per program of the alignment's prefix step (its tile: chunks x these)
COMBINE_BLOCK_H = 1024


def num_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the BLOCK_M row blocks after padding each expert's run: each of the at most
    min(E, pairs) non-empty experts wastes less than one block."""
    return _triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def _gate_up(activation: str, inter: int) -> tuple[int, int]:
    """(row step, up offset) of gate column n in w13: [gate; up] halves or interleaved rows."""
    return (1, inter) if activation == "silu_and_mul" else (2, 1)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


def _bias_args(bias: torch.Tensor | None, fallback: torch.Tensor):
    return (bias, bias.stride(0), bias.stride(1)) if bias is not None else (fallback, 0, 0)


FORMAT_IDS = {name: getattr(moe_gemm, name.upper()).value  # the kernels' weight formats
              for name in ("dense", "mxfp4", "nvfp4", "fp8", "fp8_emulated", "w4a8", "w4a8_emulated")}
FP8_GROUP = moe_gemm.FP8_GROUP.value  # activation groups and weight blocks along K
FOUR_BIT_MIN_BLOCK_K = expert_configs.FOUR_BIT_MIN_BLOCK_K


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its last dimension is strided: the kernels take a weight stack's (and its
    scales') strides of the leading dimensions and step the last by one."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


@dataclass(frozen=True)
class WeightOperand:
    """One expert stack as the kernels read it: (data, strides), (scales, strides, global scales), format."""

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    format: str
    shape: tuple[int, ...]
    blocked: bool = False  # FP8: 128x128 block scales [E, N/128, K/128] (else one scale per output column)
    fp8_act: bool = False  # MXFP4 for FP8 activations (W4A8): recoded to E4M3 in the kernels
    pairs: bool = False  # 4-bit codes in the "pairs" byte layout (formats.prepare; the kernels' W4_PAIRS)

    @property
    def format_id(self) -> int:
        """The kernels' FORMAT: FP8 without FP8 tensor cores (the interpreter) decodes its bytes."""
        name = self.config_format
        if name in ("fp8", "w4a8") and not _triton.fp8_tensor_cores(self.data.device):
            return FORMAT_IDS[name + "_emulated"]
        return FORMAT_IDS[name]

    @property
    def bytes(self) -> int:
        """Bytes of the stack's values as the GEMMs stream them (every expert's, a broadcast stack's included)."""
        return self.data.numel() * self.data.element_size()

    @property
    def config_format(self) -> str:
        """The format as the config table and heuristic name it: "w4a8" for MXFP4 with FP8 activations."""
        return expert_configs.config_family(self.format, "fp8_group" if self.fp8_act else None)

    @classmethod
    def of(cls, w, fp8_act: bool = False) -> "WeightOperand":
        """``fp8_act``: the activations are FP8 groups (act_quant="fp8_group"): MXFP4 runs as W4A8."""
        fmt = format_of(w)
        if fmt == "dense":
            return cls(w, w, w, fmt, tuple(w.shape))
        if fmt == "fp8":
            return cls._fp8(w)
        if fp8_act and fmt != "mxfp4":
            raise ValueError(f"FP8 activations run with FP8 or MXFP4 weights (W8A8, W4A8), got {fmt}")
        data = _unit_last_stride(w.data)  # nibbles are read K-contiguous
        pairs = w.layout == "pairs"
        if fmt == "mxfp4":
            scales = _unit_last_stride(w.scales)
            if fp8_act:  # read as int32 words of 8 codes: rows and experts start on whole words
                if not _on_words(data):
                    data = data.contiguous()
                return cls(data, scales, data, fmt, tuple(w.shape), fp8_act=True, pairs=pairs)
            return cls(data, scales, data, fmt, tuple(w.shape), pairs=pairs)
        # The kernels read linear [E, N, K/16] scale bytes (a swizzled stack is unswizzled once, by the tensor).
        scales = _unit_last_stride(w.linear_scales().view(torch.uint8))
        gs = w.global_scale.float().reshape(-1).expand(w.shape[0]).contiguous()
        return cls(data, scales, gs, fmt, tuple(w.shape), pairs=pairs)

    @classmethod
    def _fp8(cls, w) -> "WeightOperand":
        E, N, K = w.shape
        data = _unit_last_stride(w.data)
        if not _triton.fp8_tensor_cores(data.device):
            data = data.view(torch.uint8)  # decoded from its bytes (the interpreter has no FP8 type)
        scale = w.scale.float()
        if w.granularity == "block":
            return cls(data, scale.contiguous(), scale, "fp8", (E, N, K), blocked=True)
        if w.granularity == "channel":
            return cls(data, scale.reshape(E, N), scale, "fp8", (E, N, K))
        # Per tensor: one scale for the stack or one per expert, read as a column scale of stride 0.
        return cls(data, scale.reshape(-1, 1).expand(E, N), scale, "fp8", (E, N, K))

    def parts(self) -> tuple:
        """(data, scales, global scales), each None where it is the data or the scales again (a dense stack; MXFP4's
        global scale): the stack's distinct tensors."""
        s, g = self.scales, self.global_scale
        return self.data, None if s is self.data else s, None if g is self.data or g is s else g

    def args(self) -> tuple:
        d, s = self.data, self.scales
        if self.format == "dense":
            return (d, *d.stride(), d, 0, 0, d)  # [E, N, K]: one stride() call gives all three
        if self.format == "fp8":
            return (d, *d.stride(), s, s.stride(0), s.stride(1), s)
        return (d, d.stride(0), d.stride(1), 1, s, s.stride(0), s.stride(1), self.global_scale)

    def gemv_args(self) -> tuple:
        """args() for the CUDA-core kernels: 4-bit codes read as int32 words of 8 (K % 8 == 0 in
        both formats; a view whose offset or strides are not whole words is copied first)."""
        if self.format == "dense":
            return self.args()
        d = self.data
        per_group = (32 if self.format == "mxfp4" else 16) // 8
        try:
            words = d.view(torch.int32)
        except RuntimeError:  # an offset or stride that is not a whole word
            words = None
        if words is None or words.stride(0) % per_group or words.stride(1) % per_group:  # experts and rows start
            # on whole groups; a fresh copy (a contiguous view at an odd offset is its own .contiguous())
            words = torch.empty(d.shape, dtype=d.dtype, device=d.device).copy_(d).view(torch.int32)
        s = self.scales
        return (words, words.stride(0), words.stride(1), 1, s, s.stride(0), s.stride(1), self.global_scale)

    def gemv_block_k(self, block_k: int) -> int:
        """A 4-bit K chunk holds whole scale groups."""
        return _gemv_block_k(self.format, block_k)

    def config(self, cfg: GemmConfig, tiles: int = 1) -> GemmConfig:
        """4-bit tiles hold whole scale groups along K, and their dequantized 16-bit values (``tiles``
        of them per K step) must fit in registers (tests/sm90_compile.py shows spills past this)."""
        if self.format == "dense":
            return cfg
        return _format_config(self.format == "fp8" or self.fp8_act, cfg, tiles)


def launched_configs(cfg: ExpertsConfig, weight_format: str, fp8_act: bool = False) -> tuple[GemmConfig, GemmConfig]:
    """GEMM1's and GEMM2's configs as their kernels launch them for ``cfg`` and weights of ``weight_format``
    (``fp8_act``: W4A8): the table's, with the K step (and FP8's group columns) the format imposes. What
    ``moekit explain`` reports; the launches apply the same rules (:meth:`WeightOperand.config`, ``_gemv_block_k``)."""
    if cfg.mode == "gemv":
        return tuple(replace(g, block_k=_gemv_block_k(weight_format, g.block_k)) for g in (cfg.gemm1, cfg.gemm2))
    if weight_format == "dense":
        return cfg.gemm1, cfg.gemm2
    fp8_steps = weight_format == "fp8" or fp8_act
    return _format_config(fp8_steps, cfg.gemm1, 2), _format_config(fp8_steps, cfg.gemm2, 1)


def _gemv_block_k(weight_format: str, block_k: int) -> int:
    return block_k if weight_format == "dense" else max(block_k, FOUR_BIT_MIN_BLOCK_K)


@functools.lru_cache(maxsize=1024)  # per config and format kind: a frozen dataclass rebuilt per call costs host time
def _format_config(fp8_steps: bool, cfg: GemmConfig, tiles: int) -> GemmConfig:
    if fp8_steps:  # one activation group per K step; GEMM1 quantizes one group per row
        return replace(cfg, block_k=FP8_GROUP, block_n=FP8_GROUP if tiles == 2 else cfg.block_n)
    return replace(cfg, block_k=expert_configs.four_bit_block_k(cfg, tiles))


# CUDA-core GEMM2 formats that by default (GemmConfig.slots unset) run a token's slots as one loop
# over (slot, K chunk): on the H200 that took qwen3 bf16 T=1 from 33.5 to 30.3 us, but gpt-oss
# MXFP4 T=1 from 37.6 to 40.2 us (benchmarks/results/archive/ab_tile_scale_even_k_2026-12-03.json, 2026-12-03), so 4-bit weights keep
# the loop per slot unless a tuned config says otherwise.
FLAT_SLOT_FORMATS = ("dense",)

ROWS_ALIGNED, ROWS_BATCHED, ROWS_PER_PAIR = moe_gemm.ALIGNED.value, moe_gemm.BATCHED.value, moe_gemm.PER_PAIR.value
PER_PAIR_BLOCK_M = 16  # the smallest tensor-core tile; row 0 is the pair


class RowMap(NamedTuple):
    """What the row blocks of a tensor-core GEMM hold (kernels/moe_gemm.py _block_rows): one mode and its own
    tensors, the others None. Build with :meth:`aligned`, :meth:`batched` or :meth:`per_pair`."""

    mode: int
    block_expert: torch.Tensor | None = None  # ALIGNED: int32 [blocks], each row block's local expert (-1: none)
    sorted_pairs: torch.Tensor | None = None  # ALIGNED: int32 [blocks * BLOCK_M], each row's pair (num_pairs: pad)
    expert_tokens: torch.Tensor | None = None  # BATCHED: int32 [E], the valid rows of each expert's slab
    ids: torch.Tensor | None = None  # PER_PAIR: int32 [num_pairs], each pair's (global) expert
    expert_map: torch.Tensor | None = None  # PER_PAIR: int32 [num_global], global -> local expert, -1 elsewhere

    @classmethod
    def aligned(cls, block_expert: torch.Tensor, sorted_pairs: torch.Tensor) -> "RowMap":
        return cls(ROWS_ALIGNED, block_expert=block_expert, sorted_pairs=sorted_pairs)

    @classmethod
    def batched(cls, expert_tokens: torch.Tensor) -> "RowMap":
        return cls(ROWS_BATCHED, expert_tokens=expert_tokens)

    @classmethod
    def per_pair(cls, ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> "RowMap":
        return cls(ROWS_PER_PAIR, ids=ids, expert_map=expert_map)

    def pointers(self) -> tuple:
        """The GEMM kernels' row pointers (block_expert, sorted_pairs, expert_tokens, ids, expert_map); those this
        mode does not read are one of its own int32 tensors (the pruned branches still type their loads)."""
        first = next(t for t in self[1:] if t is not None)
        return tuple(first if t is None else t for t in self[1:])


def _scale_args(scales: torch.Tensor | None, fallback: torch.Tensor):
    return (scales, scales.stride(0)) if scales is not None else (fallback, 0)


def _tile_scale(w: WeightOperand, block_n: int, row_step: int = 1, up_offset: int = 0) -> bool:
    """FP8 128x128 blocks: every weight tile of BLOCK_N rows (gate and up alike) lies in one 128-row
    block, so the kernels promote with one scale per tile (kernels/moe_gemm.py _fp8_step)."""
    return w.blocked and row_step == 1 and FP8_GROUP % block_n == 0 and up_offset % FP8_GROUP == 0


def _paired(w: WeightOperand, cfg: GemmConfig, row_step: int) -> bool:
    """GEMM1 reads interleaved gate/up rows (dense) as one tile of 2 * BLOCK_N adjacent rows, the
    TMA box shape of that layout: with ``cfg.tma``."""
    return cfg.tma and row_step == 2 and w.format == "dense"


def _gemm1_weights(w: WeightOperand, cfg: GemmConfig, row_step: int):
    """(TMA descriptor or the weights, TMA taken, paired) for GEMM1's weight tiles."""
    paired = _paired(w, cfg, row_step)
    if row_step == 1 or paired:  # [gate; up] rows: a box per half; interleaved rows: one box of both
        return (*_weight_descriptor(w, cfg, 2 * cfg.block_n if paired else cfg.block_n), paired)
    return w.data, False, False  # interleaved rows, not paired: no box holds a gate tile alone


def _weight_descriptor(w: WeightOperand, cfg: GemmConfig, box_rows: int | None = None):
    """(TMA descriptor of the stack as [E*N, K] rows, box [box_rows (BLOCK_N), BLOCK_K], True) where
    ``cfg.tma`` asks for it and the stack allows it: dense or FP8 weights on Hopper or later (or the
    interpreter), K contiguous, rows of whole 16-byte units, experts back to back, a 16-byte
    aligned start. Otherwise (the weights, False): per-thread copies."""
    d = w.data
    E, N, K = d.shape
    ok = (cfg.tma and w.format_id in (FORMAT_IDS["dense"], FORMAT_IDS["fp8"]) and d.stride(2) == 1
          and d.stride(0) == N * d.stride(1) and (d.stride(1) * d.element_size()) % 16 == 0 and d.data_ptr() % 16 == 0
          and _triton.tma_copies(d.device))
    if not ok:
        return d, False
    from triton.tools.tensor_descriptor import TensorDescriptor  # Hopper only: imported when taken

    rows = d.as_strided((E * N, K), (d.stride(1), 1))
    box = [box_rows or cfg.block_n, cfg.block_k]
    return TensorDescriptor(rows, shape=[E * N, K], strides=[d.stride(1), 1], block_shape=box), True


def _half_tails(cfg: GemmConfig, mode: int, block_m: int) -> bool:
    """GemmConfig.half_tails where it applies: aligned rows, half blocks of at least 16 rows (the
    smallest tensor-core tile)."""
    return cfg.half_tails and mode == ROWS_ALIGNED and block_m >= 32


def _scales_ahead(cfg: GemmConfig, weight_format: str) -> bool:
    """GemmConfig.scales_ahead as launched (4-bit weights only)."""
    if weight_format not in FOUR_BIT_FORMATS:
        return False
    return weight_format == "mxfp4" if cfg.scales_ahead is None else cfg.scales_ahead


def _on_words(d: torch.Tensor) -> bool:
    """Packed 4-bit codes [E, N, K/2] whose every row and expert starts on a whole int32 word (8 codes)."""
    return d.data_ptr() % 4 == 0 and d.stride(0) % 4 == 0 and d.stride(1) % 4 == 0


def _w4_words(w: WeightOperand, dtype: torch.dtype) -> bool:
    """The tensor-core GEMMs decode 4-bit codes a word (8 codes) at a time: bf16 on the GPU (the decode's halves
    move by PTX) with the codes of every row and expert starting on whole int32 words."""
    return (w.format in FOUR_BIT_FORMATS and dtype == torch.bfloat16 and not _triton.interpreting()
            and _on_words(w.data))


def _k_paired(w: WeightOperand, dtype: torch.dtype) -> bool:
    """Whether GEMM1 reads x through a paired_k copy (``w`` is w13) or writes h in paired_k's order (``w`` is w2):
    the word decode hands the MMA each register's two codes as they sit, so its tiles' K order is the codes'
    order in the word, which "packed" bytes make _paired_columns' and "pairs" bytes make natural."""
    return _w4_words(w, dtype) and not w.pairs


def paired_k(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x [..., K] (K % 8 == 0) with each 8 columns in the order 0, 4, 1, 5, 2, 6, 3, 7: the K
    order of the word-decoded 4-bit tiles (kernels/moe_gemm.py _paired_columns), which their other operand
    follows."""
    return x.unflatten(-1, (-1, 2, 4)).transpose(-1, -2).flatten(-3)


def x_for_gemm1(x3: torch.Tensor, w: WeightOperand) -> torch.Tensor | None:
    """The paired_k copy of x that gemm1 reads for word-decoded 4-bit weights, or None (it reads x): made before a
    LoRA delta kernel, so that GEMM1, that kernel's programmatic dependent, reads before its wait only what
    launches before the delta kernel wrote."""
    return paired_k(x3) if _k_paired(w, x3.dtype) else None


def _x_strides(x3: torch.Tensor) -> tuple[int, int, int]:
    """GEMM1's (expert, row, column) strides of x: [T, H] (standard) or [E, M, H] (batched)."""
    return (0, *x3.stride()) if x3.dim() == 2 else x3.stride()


def gemm1(*args, **kwargs):
    """Launch GEMM1 (:func:`gemm1_launch`'s launch)."""
    return gemm1_act_kernel.launch(*gemm1_launch(*args, **kwargs))


def gemm1_launch(x3, w: WeightOperand, b13, h, rows: RowMap, activation, num_m_blocks, cfg: GemmConfig, block_m,
                 num_pairs, top_k, rows_per_expert, num_global=0, x_scales=None, h_scales=None, h_paired=False,
                 delta=None, delta_wait=False, x_paired=None) -> tuple:
    """GEMM1's (grid, arguments, constants). FP8 weights: x3 holds E4M3 codes with ``x_scales`` [rows, H/128]; ``h``
    receives codes and ``h_scales`` [rows, I/128]. ``h_paired``: h's columns in paired_k's order (for a
    word-decoded GEMM2). ``delta`` [rows, 2I] (h's rows, w13's row order): added before the activation (LoRA, experts/lora.py);
    ``delta_wait``: launched as the delta kernel's programmatic dependent (it waits for it before the epilogue),
    which must then be the launch right before this one: ``x_paired``, x3's paired_k copy made before the delta
    kernel, where the word-decoded 4-bit tiles read one (:func:`x_for_gemm1`)."""
    words = _w4_words(w, x3.dtype)
    if _k_paired(w, x3.dtype):  # a copy of x (T x H) costs less than a PRMT per register in every K step
        x3 = x_paired if x_paired is not None else paired_k(x3)
    elif x_paired is not None:
        raise ValueError("gemm1: x_paired is for word-decoded 4-bit weights in the \"packed\" byte layout only")
    cfg = w.config(cfg, tiles=2)  # gate and up
    inter, hidden = w.shape[1] // 2, w.shape[2]
    step, up_off = _gate_up(activation, inter)
    grid = (num_m_blocks * _triton.cdiv(inter, cfg.block_n),)
    w_desc, tma, paired = _gemm1_weights(w, cfg, step)
    tile_scale = _tile_scale(w, cfg.block_n, step, up_off)
    if h_paired and (tma or paired or tile_scale):  # those read a tile's rows as one natural run
        raise ValueError("h_paired: GEMM1's tiles must be gathered row by row (no TMA boxes, paired rows or "
                         "per-tile FP8 scales)")
    d, sd0, sd1, sd2, *scales = w.args()
    constants = _gemm1_constants(b13 is not None, rows.mode, rows.expert_map is not None, activation, x3.dtype,
                                 w.format_id, w.format, w.blocked, cfg, block_m, hidden, tile_scale, tma, paired, words,
                                 h_paired, delta is not None, delta_wait, w.pairs)
    return grid, (
        x3, *_x_strides(x3),
        d, sd0, sd1, sd2, w_desc, *scales,
        *_bias_args(b13, x3),
        h, h.stride(0), *_scale_args(delta, h),
        *_scale_args(x_scales, x3), *_scale_args(h_scales, x3),
        *rows.pointers(),
        num_pairs, top_k, rows_per_expert, num_m_blocks, num_global, w.shape[0],
        inter, hidden, step, up_off,
    ), constants


# The tensor-core GEMMs' constexprs and launch options, made once per kind of call (see _gemv1_constants)
@functools.lru_cache(maxsize=4096)
def _gemm1_constants(has_bias: bool, rows_mode: int, has_map: bool, activation: str, dtype: torch.dtype,
                     format_id: int, weight_format: str, blocked: bool, cfg: GemmConfig, block_m: int, hidden: int,
                     tile_scale: bool, tma: bool, paired: bool, words: bool, h_paired: bool, has_delta: bool,
                     delta_wait: bool, pairs: bool = False) -> Constants:
    return Constants(
        HAS_BIAS=has_bias, ROWS=rows_mode, HAS_MAP=has_map, ACTIVATION=ACTIVATION_IDS[activation],
        DOT_PRECISION=_precision(dtype), FORMAT=format_id, HAS_DELTA=has_delta, **_delta_wait(delta_wait),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, W_BLOCKED=blocked,
        HALVES_ASM=_PTX, W_TILE_SCALE=tile_scale, EVEN_K=hidden % cfg.block_k == 0, W_TMA=tma, PAIRED=paired,
        HALF_TAILS=_half_tails(cfg, rows_mode, block_m), SCALES_AHEAD=_scales_ahead(cfg, weight_format),
        W4_WORDS=words, H_PAIRED=h_paired, W4_PAIRS=pairs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gemm2(*args, **kwargs):
    """Launch GEMM2 (:func:`gemm2_launch`'s launch)."""
    return gemm2_kernel.launch(*gemm2_launch(*args, **kwargs))


def gemm2_launch(h, w: WeightOperand, b2, weights, y, y_strides, rows: RowMap, num_m_blocks, cfg: GemmConfig, block_m,
                 num_pairs, rows_per_expert, h_scales=None, delta=None, delta_wait=False, num_global=0) -> tuple:
    """GEMM2's (grid, arguments, constants). Aligned, batched or per-pair rows (``rows``; per pair: each pair's
    weighted output into y's row, zeros for a pair of no local expert, for the combine kernel; ``num_global``, the
    ids' range). ``delta`` (y's layout): added to the sums before the router weight (LoRA on w2, experts/lora.py
    w2_delta); ``delta_wait``: as :func:`gemm1`'s."""
    cfg = w.config(cfg)
    hidden, inter = w.shape[1], w.shape[2]
    grid = (num_m_blocks * _triton.cdiv(hidden, cfg.block_n),)
    w_desc, tma = _weight_descriptor(w, cfg)
    d, sd0, sd1, sd2, *scales = w.args()
    constants = _gemm2_constants(b2 is not None, rows.mode, rows.expert_map is not None, h.dtype, w.format_id,
                                 w.format, w.blocked, cfg, block_m, inter, _tile_scale(w, cfg.block_n), tma,
                                 _w4_words(w, h.dtype), delta is not None, delta_wait, w.pairs)
    return grid, (
        h, h.stride(0), *_scale_args(h_scales, h),
        d, sd0, sd1, sd2, w_desc, *scales,
        *_bias_args(b2, h),
        weights,
        y, *y_strides,
        delta if delta is not None else y,
        *rows.pointers(),
        num_pairs, rows_per_expert, num_m_blocks, num_global, w.shape[0],
        hidden, inter,
    ), constants


@functools.lru_cache(maxsize=4096)  # (see _gemm1_constants)
def _gemm2_constants(has_bias: bool, rows_mode: int, has_map: bool, dtype: torch.dtype, format_id: int,
                     weight_format: str, blocked: bool, cfg: GemmConfig, block_m: int, inter: int, tile_scale: bool,
                     tma: bool, words: bool, has_delta: bool, delta_wait: bool, pairs: bool = False) -> Constants:
    return Constants(
        HAS_BIAS=has_bias, ROWS=rows_mode, HAS_MAP=has_map, DOT_PRECISION=_precision(dtype), FORMAT=format_id,
        HAS_DELTA=has_delta,
        **_delta_wait(delta_wait), BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        W_BLOCKED=blocked, HALVES_ASM=_PTX, W_TILE_SCALE=tile_scale, EVEN_K=inter % cfg.block_k == 0, W_TMA=tma,
        HALF_TAILS=_half_tails(cfg, rows_mode, block_m), SCALES_AHEAD=_scales_ahead(cfg, weight_format),
        W4_WORDS=words, W4_PAIRS=pairs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _delta_wait(wait: bool) -> dict:
    """A GEMM's constexprs and launch option as the LoRA delta kernel's programmatic dependent (none otherwise)."""
    return {"DELTA_WAIT": True, "launch_pdl": True} if wait else {}


def gemm2_tokens(*args, **kwargs):
    """Launch the per-pair GEMM2 (:func:`gemm2_tokens_launch`'s launch)."""
    return gemm2_tokens_kernel.launch(*gemm2_tokens_launch(*args, **kwargs))


def gemm2_tokens_launch(h, w: WeightOperand, b2, weights, ids, expert_map, num_global, out, top_k, cfg: GemmConfig,
                        h_scales=None) -> tuple:
    """The per-pair GEMM2's (grid, arguments, constants): each token's k slots summed in order into ``out``."""
    cfg = w.config(cfg)
    hidden, inter = w.shape[1], w.shape[2]
    grid = (out.shape[0] * _triton.cdiv(hidden, cfg.block_n),)
    return grid, (
        h, h.stride(0), *_scale_args(h_scales, h),
        *w.args(),
        *_bias_args(b2, h),
        weights, ids, expert_map if expert_map is not None else ids,
        out, out.stride(0),
        top_k, num_global, w.shape[0], hidden, inter,
    ), _gemm2_tokens_constants(b2 is not None, expert_map is not None, h.dtype, w.format_id, w.blocked,
                               _tile_scale(w, cfg.block_n), inter % cfg.block_k == 0, cfg, w.pairs)


@functools.lru_cache(maxsize=1024)  # (see _gemm1_constants)
def _gemm2_tokens_constants(has_bias: bool, has_map: bool, dtype: torch.dtype, format_id: int, blocked: bool,
                            tile_scale: bool, even_k: bool, cfg: GemmConfig, pairs: bool = False) -> Constants:
    return Constants(
        HAS_BIAS=has_bias, HAS_MAP=has_map, DOT_PRECISION=_precision(dtype), FORMAT=format_id, W_BLOCKED=blocked,
        HALVES_ASM=_PTX, W_TILE_SCALE=tile_scale, EVEN_K=even_k, BLOCK_M=PER_PAIR_BLOCK_M, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, W4_PAIRS=pairs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gemv1(x, w: WeightOperand, b13, h, ids, expert_map, num_global, activation, top_k, cfg: GemmConfig,
           pdl: bool = False, delta=None, terms: expert_lora.DecodeTerms | None = None, prepare: bool = False):
    """``delta`` [pairs, 2I] (w13's row order): added before the activation (LoRA, experts/lora.py); or ``terms``:
    the adapters' decode terms run inside (experts/lora.py decode_terms; GEMV1 launches their shrink).
    Returns the launched kernel; with ``prepare``, (the launch made ready to repeat, its grid, x's packing made ready
    to repeat or None, the weights' int arguments, its arguments' builder) where GEMV1 has no delta or terms, else
    None."""
    inter, hidden = w.shape[1] // 2, w.shape[2]
    step, up_off = _gate_up(activation, inter)
    if _row_scaled(cfg, w, x.dtype):
        w_args = w.gemv_args()  # (may copy: before the shrink, which must be the launch right before GEMV1's)
        constants = _gemv1_rows_constants(w.format, cfg, activation, b13 is not None, expert_map is not None,
                                          delta is not None, pdl, w.pairs)
        if terms is not None:
            terms.launch_shrink()
        args = _gemv1_rows_args(_plain_x_args(x), w_args, b13, x, h, delta, ids, expert_map, top_k, num_global,
                                w.shape[0], inter, hidden, step, up_off, terms.gemv1_args if terms else None)
        grid = (ids.numel() * _triton.cdiv(inter, cfg.block_n),)
        kernel = (gemv1_rows_kernel.launch(grid, args, constants) if terms is None else
                  _launch_with_terms(gemv1_rows_kernel, grid, args, constants, terms, cfg))
        if not prepare:
            return kernel
        prepared = None if delta is not None or terms is not None else gemv1_rows_kernel.prepare(args, constants)
        return None if prepared is None else (prepared, grid, None, _ints(w_args), _gemv1_rows_args)
    slots, packed, block_k, constants = _gemv1_constants(w.format, x.dtype, cfg, top_k, activation, b13 is not None,
                                                         expert_map is not None, delta is not None, pdl, w.pairs)
    programs = ids.numel() // top_k * _triton.cdiv(top_k, slots) * _triton.cdiv(inter, cfg.block_n)
    packing = None
    if packed:  # whole chunks: the kernel's loads need no mask
        (pairs, exps), packing = scaled_fp16_prepared(x, block_k, prepare=prepare, w4_pairs=w.pairs)
        x_args = _packed_x_args(pairs, exps)
    else:
        x_args = _plain_x_args(x)
    w_args = w.gemv_args()  # (may copy: before the shrink, which must be the launch right before GEMV1's)
    if terms is not None:
        terms.launch_shrink()
    args = _gemv1_args(x_args, w_args, b13, x, h, delta, ids, expert_map, top_k, num_global, w.shape[0], inter,
                       hidden, step, up_off, terms.gemv1_args if terms else None)
    kernel = (gemv1_act_kernel.launch((programs,), args, constants) if terms is None else
              _launch_with_terms(gemv1_act_kernel, (programs,), args, constants, terms, cfg))
    if not prepare:
        return kernel
    if (packed and packing is None) or delta is not None or terms is not None:
        return None
    prepared = gemv1_act_kernel.prepare(args, constants)
    return None if prepared is None else (prepared, (programs,), packing, _ints(w_args), _gemv1_args)


def _ints(args: tuple) -> tuple:
    return tuple(a for a in args if type(a) is int)


# The GEMVs' activation arguments: the operand as it is, or packed by scaled_fp16 (pairs, exponent bytes)
def _plain_x_args(x) -> tuple:
    return (x, x.stride(0), x.stride(1), x, 0)


def _plain_h_args(h) -> tuple:
    return (h, h.stride(0), h, 0)


def _packed_x_args(pairs, exps) -> tuple:
    return (pairs.view(torch.int32), pairs.stride(0) // 2, 1, exps, exps.stride(0))


def _packed_h_args(pairs, exps) -> tuple:
    return (pairs.view(torch.int32), pairs.stride(0) // 2, exps, exps.stride(0))


def _gemv1_args(x_args, w_args, b13, x, h, delta, ids, expert_map, top_k, num_global, num_local, inter, hidden, step,
                up_off, term_args) -> tuple:
    """gemv1_act_kernel's runtime arguments (``term_args`` None: no decode terms)."""
    return (*x_args, *w_args, *_bias_args(b13, x), h, h.stride(0), *_scale_args(delta, h),
            ids, expert_map if expert_map is not None else ids, top_k, num_global, num_local, inter, hidden, step,
            up_off, *(term_args if term_args is not None else _no_gemv1_terms(x)))


# The decode kernels' constexprs and launch options, made once per kind of call and passed to Launcher.launch as
# they are (a dict of a dozen keywords built and hashed on every launch cost microseconds of eager host time)
@functools.lru_cache(maxsize=1024)
def _gemv1_constants(weight_format: str, dtype: torch.dtype, cfg: GemmConfig, top_k: int, activation: str,
                     has_bias: bool, has_map: bool, has_delta: bool, pdl: bool,
                     pairs: bool = False) -> tuple[int, bool, int, Constants]:
    """(pairs per program, packed operands, K chunk, constants) of gemv1_act_kernel."""
    slots = gemv1_slots(cfg, top_k)
    packed = cfg.packed is not False and _fp16x2_operands(weight_format, dtype)
    block_k = _gemv_block_k(weight_format, cfg.block_k)
    return slots, packed, block_k, Constants(
        HAS_BIAS=has_bias, HAS_MAP=has_map, ACTIVATION=ACTIVATION_IDS[activation], HAS_DELTA=has_delta,
        FORMAT=FORMAT_IDS[weight_format], BLOCK_N=cfg.block_n, BLOCK_K=block_k, HALVES_ASM=_PTX, PDL=pdl,
        SLOTS=slots, PACKED=packed, W4_PAIRS=pairs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_register_cap(cfg))


_TERMS_LAUNCH: dict = {}  # (kernel, its constants, the terms', cap, x's dtype and device) -> the launch keywords


def _kernel_registers(kernel) -> int | None:
    """Registers per thread of a compiled kernel, loading it where it is not yet (None where unknown)."""
    if hasattr(kernel, "result"):  # an asynchronous compile's future
        kernel = kernel.result()
    if getattr(kernel, "n_regs", None) is None and hasattr(kernel, "_init_handles"):
        kernel._init_handles()
    return getattr(kernel, "n_regs", None)


def _uncapped_registers(launcher, grid, args, constants) -> int | None:
    """Registers per thread of this launch's build without a cap: compiled and loaded, not run (None in the
    interpreter, which builds nothing)."""
    if _triton.interpreting():
        return None
    try:
        return _kernel_registers(launcher.fn.warmup(*args, grid=grid, **constants))
    except Exception:  # noqa: BLE001 - a register count only picks a launch option: without it, no cap
        return None


def _launch_with_terms(launcher, grid, args, constants, terms: expert_lora.DecodeTerms, cfg: GemmConfig):
    """GEMV1 with the adapters' terms inside: the config's register cap dropped (measured without adapters), and
    DecodeTerms.register_cap applied to a 4-warp program only where its uncapped build takes more registers (a cap
    makes ptxas spend up to it: experts/lora.py DECODE_TERMS_MAXNREG). Decided on the first call of each kind, which
    builds both (so a CUDA graph captured after one eager call builds nothing); later calls reuse the keywords.
    Returns the launched kernel."""
    cap = terms.register_cap if cfg.num_warps == 4 else None
    x = args[0]
    key = (launcher, constants, tuple(terms.gemv1_constants.items()), cap, x.dtype, x.device)
    final = _TERMS_LAUNCH.get(key)
    if final is None:
        final = Constants(_without_register_cap(constants) | terms.gemv1_constants)
        if cap is not None:
            regs = _uncapped_registers(launcher, grid, args, final)
            if regs is not None and regs > cap:
                final = Constants(final | {"maxnreg": cap})
        _TERMS_LAUNCH[key] = final
    return launcher.launch(grid, args, final)


def _register_cap(cfg: GemmConfig) -> dict:
    """A decode GEMV's ``maxnreg`` launch option where its config caps the registers (GemmConfig.maxnreg)."""
    return {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}


def _without_register_cap(constants) -> dict:
    """A GEMV's launch keywords without its config's register cap (measured on calls without adapters)."""
    return {k: v for k, v in constants.items() if k != "maxnreg"}


def gemv1_slots(cfg: GemmConfig, top_k: int) -> int:
    """Pairs per GEMV1 program."""
    return _gemv_slots(cfg, top_k, 1) or 1  # GEMM2's 0 (a loop per slot) is one pair per program here


GEMV_ROW_XBLOCK = 1024  # activations per step of a row-scaled kernel's largest-|x| scan


def _fp16x2_operands(weight_format: str, dtype: torch.dtype) -> bool:
    """The CUDA-core decode kernels can take fp16x2 products (packed or row-scaled): 4-bit weights, 16-bit
    activations (fp32 ones keep fp32 products)."""
    return weight_format in FOUR_BIT_FORMATS and dtype != torch.float32


def _row_scaled(cfg: GemmConfig, w: WeightOperand, dtype: torch.dtype) -> bool:
    """GemmConfig.row_scaled where it applies: 4-bit weights, 16-bit activations."""
    return cfg.row_scaled and _fp16x2_operands(w.format, dtype)


def _no_gemv1_terms(x) -> tuple:
    """GEMV1's decode-term arguments when it has none (the pruned loads still type their pointers)."""
    return (x, x, x, x, x, x, x, 0, 0, 0, x, 0, 0, x, 0)


def _gemv1_rows_args(x_args, w_args, b13, x, h, delta, ids, expert_map, top_k, num_global, num_local, inter, hidden,
                     step, up_off, term_args) -> tuple:
    """gemv1_rows_kernel's runtime arguments, from :func:`_gemv1_args`'s parameters (x as it is: _plain_x_args; the
    rows kernel takes no K stride of the words)."""
    words, sw0, sw1, _, *scales = w_args
    return (*x_args[:3], words, sw0, sw1, *scales, *_bias_args(b13, x), h, h.stride(0), *_scale_args(delta, h),
            ids, expert_map if expert_map is not None else ids, top_k, num_global, num_local, inter, hidden, step,
            up_off, *(term_args if term_args is not None else _no_gemv1_terms(x)))


@functools.lru_cache(maxsize=1024)  # (see _gemv1_constants)
def _gemv1_rows_constants(weight_format: str, cfg: GemmConfig, activation: str, has_bias: bool, has_map: bool,
                          has_delta: bool, pdl: bool, pairs: bool = False) -> Constants:
    """gemv1_rows_kernel's constexprs and launch options (GemmConfig.row_scaled)."""
    return Constants(
        HAS_BIAS=has_bias, HAS_MAP=has_map, ACTIVATION=ACTIVATION_IDS[activation], FORMAT=FORMAT_IDS[weight_format],
        BLOCK_N=cfg.block_n, BLOCK_K=_gemv_block_k(weight_format, cfg.block_k), XBLOCK=GEMV_ROW_XBLOCK,
        HALVES_ASM=_PTX, PDL=pdl, HAS_DELTA=has_delta, W4_PAIRS=pairs, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **_register_cap(cfg))


SCALED_FP16_BLOCK = 256  # activations per program of the fp16 preparation


def scaled_fp16(x2d: torch.Tensor, multiple: int = 32, w4_pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (fp16 [rows, Kp] pair-major per 32-block, uint8 exponents [rows, Kp / 32]) with Kp = K rounded
    up to ``multiple`` (a multiple of 32, at least one; the decode kernels pass their K chunk, so that they read
    whole chunks without masks): slot s of a row, p = (s % 32) // 2, holds x[(s & -32) + 8 (p % 4) + p // 4 +
    4 (s & 1)] * 2^(127 - u), or with ``w4_pairs`` (weights in the "pairs" byte layout) x[(s & -32) + 8 (p % 4) +
    2 (p // 4) + (s & 1)], u its group's byte (see kernels/scaled_fp16.py); zeros (and u = 1) past K. The packed
    4-bit decode's operand."""
    return scaled_fp16_prepared(x2d, multiple, prepare=False, w4_pairs=w4_pairs)[0]


def scaled_fp16_prepared(x2d: torch.Tensor, multiple: int = 32, prepare: bool = True, w4_pairs: bool = False):
    """:func:`scaled_fp16`, and (``prepare``) its launch made ready to repeat on rows of the same signature
    (:class:`PreparedScaling`; None where it cannot be, or nothing was launched)."""
    if multiple <= 0 or multiple % 32:
        raise ValueError(f"scaled_fp16: multiple must be a multiple of 32, got {multiple}")
    rows, k = x2d.shape
    kp = max(_triton.cdiv(k, multiple), 1) * multiple  # K = 0 gets a chunk too: the kernels' first read stays inside
    pairs = torch.empty(rows, kp, dtype=torch.float16, device=x2d.device)
    exps = torch.empty(rows, kp // 32, dtype=torch.uint8, device=x2d.device)
    if not rows:
        return (pairs, exps), None
    grid = (rows, _triton.cdiv(kp, SCALED_FP16_BLOCK))
    args = _scaled_fp16_args(x2d, pairs, exps)
    constants = _SCALED_FP16_CONSTANTS[w4_pairs]
    scaled_fp16_kernel.launch(grid, args, constants)
    prepared = scaled_fp16_kernel.prepare(args, constants) if prepare else None
    return (pairs, exps), None if prepared is None else PreparedScaling(prepared, grid, kp)


_SCALED_FP16_CONSTANTS = {pairs: Constants(BLOCK=SCALED_FP16_BLOCK, PAIRS=pairs, num_warps=4)
                          for pairs in (False, True)}  # by the weights' byte layout


def _scaled_fp16_args(x2d, pairs, exps) -> tuple:
    return (x2d, x2d.stride(0), x2d.stride(1), pairs, pairs.stride(0), exps, exps.stride(0), x2d.shape[1],
            pairs.shape[1])


class PreparedScaling:
    """:func:`scaled_fp16`'s launch ready to repeat on rows of one signature: ``__call__(x2d)`` returns (pairs,
    exps), or None having launched nothing where the binding does not hold."""

    __slots__ = ("_prepared", "_grid", "_kp")

    def __init__(self, prepared, grid: tuple, kp: int):
        self._prepared, self._grid, self._kp = prepared, grid, kp

    def __call__(self, x2d):
        pairs = torch.empty(x2d.shape[0], self._kp, dtype=torch.float16, device=x2d.device)
        exps = torch.empty(x2d.shape[0], self._kp // 32, dtype=torch.uint8, device=x2d.device)
        return (pairs, exps) if self._prepared(self._grid, _scaled_fp16_args(x2d, pairs, exps)) else None


def _gemv_slots(cfg: GemmConfig, top_k: int, default: int) -> int:
    """GemmConfig.slots as launched: ``default`` when unset, at most top_k's power of two."""
    return min(default if cfg.slots is None else cfg.slots, _triton.next_pow2(top_k))


def gemv2_packed(cfg: GemmConfig, weight_format: str, h_dtype: torch.dtype, top_k: int) -> bool:
    """Whether gemv2_tokens runs fp16x2 products on prepared h: only on request (GemmConfig.packed), for 4-bit
    weights and 16-bit h, and in the loop per slot."""
    slots = _gemv_slots(cfg, top_k, 1 if weight_format in FLAT_SLOT_FORMATS else 0)
    return cfg.packed is True and _fp16x2_operands(weight_format, h_dtype) and slots == 0


def gemv2_tokens(h, w: WeightOperand, b2, weights, ids, expert_map, num_global, out, top_k, cfg: GemmConfig,
                  pdl: bool = False, terms: expert_lora.DecodeTerms | None = None, prepare: bool = False,
                  w_args: tuple | None = None):
    """``pdl``: launched as the previous grid's (gemv1's) programmatic dependent. ``terms``: as :func:`gemv1`'s.
    ``prepare``: as :func:`gemv1`'s (h's packing; no terms). ``w_args``: ``w.gemv_args()`` made before GEMV1 (where
    it copies the words, the copy must not come between GEMV1 and its dependent)."""
    hidden, inter = w.shape[1], w.shape[2]
    packed, block_k, constants = _gemv2_constants(w.format, h.dtype, cfg, top_k, b2 is not None,
                                                  expert_map is not None, pdl, w.pairs)
    packing = None
    if packed:
        (pairs, exps), packing = scaled_fp16_prepared(h, block_k, prepare=prepare, w4_pairs=w.pairs)
        h_args = _packed_h_args(pairs, exps)
    else:
        h_args = _plain_h_args(h)
    if terms is not None:  # (the config's register cap, measured without adapters, dropped as in GEMV1's)
        constants = _without_register_cap(constants) | terms.gemv2_constants
    grid = (out.shape[0] * _triton.cdiv(hidden, cfg.block_n),)
    w_args = w.gemv_args() if w_args is None else w_args
    args = _gemv2_args(h_args, w_args, b2, h, weights, ids, expert_map, out, top_k, num_global, w.shape[0], hidden,
                       inter, terms.gemv2_args if terms else None)
    kernel = gemv2_tokens_kernel.launch(grid, args, constants)
    if not prepare:
        return kernel
    if (packed and packing is None) or terms is not None:
        return None
    prepared = gemv2_tokens_kernel.prepare(args, constants)
    return None if prepared is None else (prepared, grid, packing, _ints(w_args))


def gemv2_rows(h, w: WeightOperand, b2, weights, ids, expert_map, num_global, y, cfg: GemmConfig,
               pdl: bool = False, prepare: bool = False, w_args: tuple | None = None):
    """GEMM2 per pair on kernels/gemv2_rows.py (GemmConfig.row_scaled with ExpertsConfig.split_slots): y [T*k, H]
    fp32 <- each pair's router-weighted row (zeros for pairs of other ranks), for :func:`_combine`. ``prepare``,
    ``w_args``: as :func:`gemv2_tokens`'s (under PDL it reads its first weights before waiting for GEMV1)."""
    if h.stride(1) != 1 or y.stride(1) != 1:  # the kernel takes neither column stride
        raise ValueError(f"gemv2_rows: h and y need unit column strides, got {h.stride()} and {y.stride()}")
    w_args = w.gemv_args() if w_args is None else w_args
    grid = (y.shape[0] * _triton.cdiv(w.shape[1], cfg.block_n),)
    args = _gemv2_rows_args(h, w_args, b2, weights, ids, expert_map, y, num_global, w.shape[0], w.shape[1],
                            w.shape[2])
    constants = _gemv2_rows_constants(w.format, cfg, b2 is not None, expert_map is not None, pdl, w.pairs)
    kernel = gemv2_rows_kernel.launch(grid, args, constants)
    if not prepare:
        return kernel
    prepared = gemv2_rows_kernel.prepare(args, constants)
    return None if prepared is None else (prepared, grid, None, _ints(w_args))


def _gemv2_rows_args(h, w_args, b2, weights, ids, expert_map, y, num_global, num_local, hidden, inter) -> tuple:
    words, sw0, sw1, _, *scales = w_args
    return (h, h.stride(0), words, sw0, sw1, *scales, *_bias_args(b2, h), weights, ids,
            expert_map if expert_map is not None else ids, y, y.stride(0), num_global, num_local, hidden, inter)


@functools.lru_cache(maxsize=1024)  # (see _gemv1_constants)
def _gemv2_rows_constants(weight_format: str, cfg: GemmConfig, has_bias: bool, has_map: bool, pdl: bool,
                          pairs: bool = False) -> Constants:
    return Constants(
        HAS_BIAS=has_bias, HAS_MAP=has_map, FORMAT=FORMAT_IDS[weight_format], BLOCK_N=cfg.block_n,
        BLOCK_K=_gemv_block_k(weight_format, cfg.block_k), XBLOCK=GEMV_ROW_XBLOCK, HALVES_ASM=_PTX, PDL=pdl,
        W4_PAIRS=pairs, launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_register_cap(cfg))


def _gemv2_args(h_args, w_args, b2, h, weights, ids, expert_map, out, top_k, num_global, num_local, hidden, inter,
                term_args) -> tuple:
    """gemv2_tokens_kernel's runtime arguments (``term_args`` None: no decode terms)."""
    return (*h_args, *w_args, *_bias_args(b2, h), weights, ids, expert_map if expert_map is not None else ids,
            out, out.stride(0), top_k, num_global, num_local, hidden, inter,
            *(term_args if term_args is not None else (h, h, h, h, 0, 0, 0)))


@functools.lru_cache(maxsize=1024)  # (see _gemv1_constants)
def _gemv2_constants(weight_format: str, dtype: torch.dtype, cfg: GemmConfig, top_k: int, has_bias: bool,
                     has_map: bool, pdl: bool, pairs: bool = False) -> tuple[bool, int, Constants]:
    """(packed operands, K chunk, constants) of gemv2_tokens_kernel."""
    row_scaled = cfg.row_scaled and _fp16x2_operands(weight_format, dtype)
    slots = 0 if row_scaled else _gemv_slots(cfg, top_k, 1 if weight_format in FLAT_SLOT_FORMATS else 0)
    packed = not row_scaled and gemv2_packed(cfg, weight_format, dtype, top_k)
    block_k = _gemv_block_k(weight_format, cfg.block_k)
    return packed, block_k, Constants(
        HAS_BIAS=has_bias, HAS_MAP=has_map, FORMAT=FORMAT_IDS[weight_format], BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        HALVES_ASM=_PTX, SLOTS=slots, PDL=pdl, PACKED=packed, ROW_SCALED=row_scaled, XBLOCK=GEMV_ROW_XBLOCK,
        W4_PAIRS=pairs, launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_register_cap(cfg))


def align(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int, block_m: int,
          split: bool | None = None):
    """(pair_expert [T*k], sorted_pairs [blocks*block_m], block_expert [blocks]) for the GEMMs; the
    blocks in use come first.

    ``split``: the three-launch version (default: above ALIGN_ONE_PROGRAM_MAX pairs)."""
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    blocks = num_row_blocks(num_pairs, num_local, block_m)
    dev = topk_ids.device
    pair_expert, sorted_pairs, block_expert = align_buffers(num_pairs, blocks, block_m, dev)
    if not (num_pairs > ALIGN_ONE_PROGRAM_MAX if split is None else split):
        align_kernel.launch(*align_launch(ids, expert_map, pair_expert, sorted_pairs, block_expert, num_local,
                                          block_m))
        return pair_expert, sorted_pairs, block_expert
    num_global = expert_map.shape[0] if expert_map is not None else num_local
    e_pad = _triton.next_pow2(max(num_local, 2))
    emap = expert_map if expert_map is not None else ids
    layout = dict(PAD_CHUNK=min(block_m, 16), OWNER_CHUNK=max(16, ALIGN_TILE // e_pad))
    chunks = _triton.cdiv(num_pairs, ALIGN_PAIRS_PER_PROGRAM)
    chunk_counts = torch.empty(chunks + 1, e_pad, dtype=torch.int32, device=dev)  # a row per chunk, then the counts
    per_chunk = dict(PAIRS_PER_PROGRAM=ALIGN_PAIRS_PER_PROGRAM, HAS_MAP=expert_map is not None, E_PAD=e_pad,
                     CHUNK=ALIGN_CHUNK, num_warps=ALIGN_WARPS)
    align_count_kernel[(chunks,)](ids, emap, pair_expert, chunk_counts, num_pairs, num_global, num_local, **per_chunk)
    prefix_experts = min(e_pad, ALIGN_PREFIX_EXPERTS)
    align_offsets_kernel[(e_pad // prefix_experts,)](
        chunk_counts, chunks, E_PAD=e_pad, EXPERTS=prefix_experts,
        CHUNK_ROWS=min(_triton.next_pow2(chunks), ALIGN_TILE // prefix_experts), num_warps=ALIGN_WARPS)
    align_scatter_kernel[(chunks,)](ids, emap, sorted_pairs, block_expert, chunk_counts, num_pairs, num_global,
                                      num_local, blocks, BLOCK_M=block_m, **layout, **per_chunk)
    return pair_expert, sorted_pairs, block_expert


def align_buffers(num_pairs: int, blocks: int, block_m: int, device) -> tuple:
    """align's outputs, unwritten: (pair_expert [T*k], sorted_pairs [blocks*block_m], block_expert [blocks])."""
    return (torch.empty(num_pairs, dtype=torch.int32, device=device),
            torch.empty(blocks * block_m, dtype=torch.int32, device=device),
            torch.empty(blocks, dtype=torch.int32, device=device))


def align_launch(ids, expert_map, pair_expert, sorted_pairs, block_expert, num_local: int, block_m: int) -> tuple:
    """The one-program align's (grid, arguments, constants) over the pairs' expert ids ``ids`` [T*k]."""
    num_global = expert_map.shape[0] if expert_map is not None else num_local
    e_pad = _triton.next_pow2(max(num_local, 2))
    return (1,), (ids, expert_map if expert_map is not None else ids, pair_expert, sorted_pairs, block_expert,
                  ids.numel(), num_global, num_local, block_expert.shape[0]), _align_constants(
                      expert_map is not None, block_m, e_pad)


@functools.lru_cache(maxsize=256)  # (see _gemm1_constants)
def _align_constants(has_map: bool, block_m: int, e_pad: int) -> Constants:
    """The one-program align kernel's constexprs and launch options."""
    return Constants(HAS_MAP=has_map, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=ALIGN_CHUNK, PAD_CHUNK=min(block_m, 16),
                     OWNER_CHUNK=max(16, ALIGN_TILE // e_pad), num_warps=ALIGN_WARPS)


def _fp8_codes_dtype(device: torch.device) -> torch.dtype:
    # the interpreter keeps the codes' fp32 values
    return torch.float8_e4m3fn if _triton.fp8_tensor_cores(device) else torch.float32


def fp8_groups(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] -> (E4M3 codes [rows, K], fp32 scales [rows, K/128]) in 1x128 groups, on the device."""
    rows, k = x2d.shape
    groups = _triton.cdiv(k, FP8_GROUP)
    q = torch.empty(rows, k, dtype=_fp8_codes_dtype(x2d.device), device=x2d.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x2d.device)
    if rows:
        quantize_groups_kernel[(rows, groups)](x2d, x2d.stride(0), x2d.stride(1), q, q.stride(0), scales,
                                               scales.stride(0), k, EMULATED=not _triton.fp8_tensor_cores(x2d.device),
                                               num_warps=4)
    return q, scales


def activation_buffers(rows: int, inter: int, dtype: torch.dtype, device: torch.device, fp8: bool):
    """GEMM1's output: [rows, I] in the activations' dtype, or FP8 codes and their group scales."""
    if not fp8:
        return torch.empty(rows, inter, dtype=dtype, device=device), None
    return (torch.empty(rows, inter, dtype=_fp8_codes_dtype(device), device=device),
            torch.empty(rows, _triton.cdiv(inter, FP8_GROUP), dtype=torch.float32, device=device))


def fp8_activations(w13, act_quant: str | None) -> bool:
    """W8A8 (FP8 weights) or W4A8 (MXFP4 weights, act_quant="fp8_group"): the GEMMs take FP8 groups."""
    return format_of(w13) == "fp8" or act_quant == "fp8_group"


def fused_experts_into(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map,
                       config: ExpertsConfig | None = None, act_quant: str | None = None, lora=None,
                       lora_ids=None, plan: bool = False) -> "DecodePlan | CallPlan | None":
    """Standard format, written into ``out`` [T, H] (contiguous). ``lora``: an ExpertsLoRA, ``lora_ids`` int32 [T]
    (experts/lora.py: its terms run over the same rows as the GEMMs, added into GEMM1 and after GEMM2). ``plan``:
    return the call made ready to repeat for calls of the same checked signature where it can be (:class:`DecodePlan`
    for the GEMVs, :class:`CallPlan` for the tensor-core paths), else None."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        out.zero_()  # tokens with no expert slot (k = 0): nothing added to zero
        return
    fp8 = fp8_activations(w13, act_quant)
    # once per call (NVFP4: scales unswizzled here)
    w13, w2 = WeightOperand.of(w13, fp8), WeightOperand.of(w2, fp8)
    if config is None:
        config, _ = expert_configs.choose(num_tokens, num_experts, top_k, two_i, hidden, x.device, x.dtype,
                                          w13.config_format, lora=lora is not None)
    # (TMA boxes: whether a stack takes them depends on its address, which the signature does not hold)
    if plan and lora is None and not fp8 and not (config.gemm1.tma or config.gemm2.tma) and (
            not config.gemv if config.per_pair else num_pairs <= ALIGN_ONE_PROGRAM_MAX):
        return CallPlan.first_call(out, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map,
                                   activation, config)
    weights = topk_weights.reshape(-1).contiguous()
    ids = topk_ids.reshape(-1)
    num_global = expert_map.shape[0] if expert_map is not None else num_experts
    dtype = x.dtype
    xs = None
    if fp8:  # W8A8/W4A8: x in 1x128 E4M3 groups once, before GEMM1 (GEMM1 quantizes its own output)
        x, xs = fp8_groups(x)
    if config.per_pair:
        # Decode: GEMM1 per pair straight from the ids, GEMM2 per token summing its slots.
        h, hs = activation_buffers(num_pairs, two_i // 2, dtype, x.device, fp8)
        pairs = terms = delta = None
        if lora is not None:
            pairs = expert_lora.Rows("pairs", num_pairs, top_k, ids=ids, expert_map=expert_map, num_global=num_global)
        gemv = config.gemv and not fp8
        dependent = _triton.dependent_launches(x.device)
        pdl = gemv and config.pdl and dependent
        w2_args = w2.gemv_args() if gemv else None  # (before GEMV1: a copy of the words must not follow it)
        if lora is not None and gemv and not config.split_slots:
            # the adapters' terms inside the two GEMVs: one launch of their own at most (the rows GEMV1 takes one
            # pair per program)
            terms = expert_lora.decode_terms(x, lora, lora_ids, pairs, two_i // 2, config.gemm1.block_n,
                                             1 if _row_scaled(config.gemm1, w13, dtype) else
                                             gemv1_slots(config.gemm1, top_k), config.gemm2.block_n, dependent,
                                             gemv1_act_kernel.compiled)
        if terms is not None:
            gemv1(x, w13, w13_bias, h, ids, expert_map, num_global, activation, top_k, config.gemm1, pdl,
                  terms=terms)
            gemv2_tokens(h, w2, w2_bias, weights, ids, expert_map, num_global, out, top_k, config.gemm2, pdl,
                         terms=terms, w_args=w2_args)
            return
        if lora is not None:
            delta = expert_lora.w13_delta(x, xs, lora, lora_ids, pairs)
        if gemv:
            plan = plan and lora is None
            first = gemv1(x, w13, w13_bias, h, ids, expert_map, num_global, activation, top_k, config.gemm1, pdl,
                          delta, prepare=plan)
            if not config.split_slots:
                second = gemv2_tokens(h, w2, w2_bias, weights, ids, expert_map, num_global, out, top_k, config.gemm2,
                                      pdl, prepare=plan and first is not None,
                                      w_args=w2_args)  # (launched kernels where not plan)
                if lora is not None:
                    expert_lora.w2_add(h, hs, lora, lora_ids, pairs, out, weights, per_token=True)
                return DecodePlan(first, second, config, pdl, activation) if plan and first and second else None
            # each pair as a token of one slot (zeros for pairs not computed here), then the slots summed in order
            y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
            prepare, rows2 = plan and first is not None, _row_scaled(config.gemm2, w2, h.dtype)
            if rows2:
                second = gemv2_rows(h, w2, w2_bias, weights, ids, expert_map, num_global, y, config.gemm2, pdl,
                                    prepare, w_args=w2_args)
            else:
                second = gemv2_tokens(h, w2, w2_bias, weights, ids, expert_map, num_global, y, 1, config.gemm2, pdl,
                                      prepare=prepare, w_args=w2_args)
            if lora is not None:
                expert_lora.w2_add(h, hs, lora, lora_ids, pairs, y, weights)
            third = _combine(y, ids, out, top_k, prepare=plan and second is not None)
            return (DecodePlan(first, second, config, pdl, activation, third, rows2)
                    if plan and first and second and third else None)
        pair_rows = RowMap.per_pair(ids, expert_map)
        # GEMM2 per pair is the aligned mode's kernel: word-decoded 4-bit tiles read h in paired_k's order
        h_paired = config.split_slots and _k_paired(w2, h.dtype)
        gemm1(x, w13, w13_bias, h, pair_rows, activation, num_pairs, config.gemm1, PER_PAIR_BLOCK_M, num_pairs,
              top_k, 0, num_global, xs, hs, h_paired=h_paired, delta=delta)
        if config.split_slots:  # each pair's weighted output, then the slots summed in order (the aligned mode's)
            y = torch.empty(num_pairs, hidden, dtype=dtype, device=x.device)
            gemm2(h, w2, w2_bias, weights, y, (0, y.stride(0)), pair_rows, num_pairs, config.gemm2, PER_PAIR_BLOCK_M,
                  num_pairs, 0, hs, num_global=num_global)
            if lora is not None:
                expert_lora.w2_add(h, hs, lora, lora_ids, pairs, y, weights, h_paired=h_paired)
            _combine(y, ids, out, top_k)
            return
        gemm2_tokens(h, w2, w2_bias, weights, ids, expert_map, num_global, out, top_k, config.gemm2, hs)
        if lora is not None:
            expert_lora.w2_add(h, hs, lora, lora_ids, pairs, out, weights, per_token=True)
        return
    bm = config.block_m
    pair_expert, sorted_pairs, block_expert = align(topk_ids, expert_map, num_experts, bm)
    blocks = block_expert.shape[0]
    h, hs = activation_buffers(blocks * bm, two_i // 2, dtype, x.device, fp8)
    y = torch.empty(num_pairs, hidden, dtype=dtype, device=x.device)
    rows = RowMap.aligned(block_expert, sorted_pairs)
    h_paired = _k_paired(w2, h.dtype)
    terms = None if lora is None else _GemmLoRA(
        lora, lora_ids, expert_lora.Rows("aligned", blocks * bm, top_k, bm, num_pairs, block_expert, sorted_pairs),
        y, w2, x.device)
    gemm1(x, w13, w13_bias, h, rows, activation, blocks, config.gemm1, bm, num_pairs, top_k, 0,
           x_scales=xs, h_scales=hs, h_paired=h_paired, **(terms.gemm1_args(x, xs, w13) if terms else {}))
    gemm2(h, w2, w2_bias, weights, y, (0, y.stride(0)), rows, blocks, config.gemm2, bm, num_pairs, 0, hs,
          **(terms.gemm2_args(h, hs, h_paired) if terms else {}))
    if terms:
        terms.after_gemm2(h, hs, weights, h_paired)
    _combine(y, pair_expert, out, top_k)


class _GemmLoRA:
    """A call's expert LoRA on the aligned or batched rows, as its two GEMMs take it: W13's term as GEMM1's delta, W2's
    as GEMM2's fp32 delta or added to GEMM2's output ``y`` after it (experts/lora.py w2_term_as_delta). Each delta
    comes from a kernel launched right before its GEMM, which starts beside it as its programmatic dependent where the
    GPU has them (the GEMM waits before it reads the delta)."""

    __slots__ = ("lora", "lora_ids", "rows", "y", "pdl", "w2_as_delta")

    def __init__(self, lora, lora_ids, rows: expert_lora.Rows, y: torch.Tensor, w2: WeightOperand, device):
        self.lora, self.lora_ids, self.rows, self.y = lora, lora_ids, rows, y
        self.pdl = _triton.dependent_launches(device)
        self.w2_as_delta = expert_lora.w2_term_as_delta(lora, y.numel(), w2.bytes)

    def gemm1_args(self, x, xs, w13: WeightOperand) -> dict:
        """GEMM1's keywords: the delta (its kernel launched now) and x's paired copy, made before that kernel."""
        x_paired = x_for_gemm1(x, w13)
        delta = expert_lora.w13_delta(x, xs, self.lora, self.lora_ids, self.rows, dependents=self.pdl)
        return dict(delta=delta, delta_wait=self.pdl and delta is not None, x_paired=x_paired)

    def gemm2_args(self, h, hs, h_paired: bool) -> dict:
        """GEMM2's keywords: W2's delta (its kernel launched now) where the term is one."""
        if not self.w2_as_delta:
            return {}
        delta = expert_lora.w2_delta(h, hs, self.lora, self.lora_ids, self.rows, self.y, h_paired,
                                     dependents=self.pdl)
        return dict(delta=delta, delta_wait=self.pdl and delta is not None)

    def after_gemm2(self, h, hs, weights, h_paired: bool) -> None:
        """W2's term added into ``y`` (times the router weights, where given) where it is not GEMM2's delta."""
        if not self.w2_as_delta:
            expert_lora.w2_add(h, hs, self.lora, self.lora_ids, self.rows, self.y, weights, h_paired=h_paired)


class DecodePlan:
    """A decode call (GEMV1, on either of its kernels, then GEMV2, or with split slots GEMV2 per pair on either of
    its kernels and the combine; no adapters) made ready to repeat for calls of one checked signature (the op keeps it
    with its decision): every launch, and the packing of x and h where the config packs them (scaled_fp16), is
    prepared (moekit._launch.Prepared), so a repeated call builds only their arguments and buffers. ``__call__``
    returns False, having launched nothing, where the first launch's binding does not hold; the caller then runs the
    call in full. A later launch that does not hold runs in full itself."""

    __slots__ = ("_gemv1", "_grid1", "_pack1", "_ints1", "_args1", "_gemv2", "_grid2", "_pack2", "_ints2",
                 "_config", "_pdl", "_activation", "_combine", "_rows2")

    def __init__(self, first, second, config: ExpertsConfig, pdl: bool, activation: str, combine=None,
                 rows2: bool = False):
        """``combine``: split slots (ExpertsConfig.split_slots): GEMV2 per pair into fp32 rows, then this prepared
        combine launch; ``rows2``: that GEMV2 on gemv2_rows."""
        (self._gemv1, self._grid1, self._pack1, self._ints1, self._args1) = first
        (self._gemv2, self._grid2, self._pack2, self._ints2) = second
        self._config, self._pdl, self._activation = config, pdl, activation
        self._combine, self._rows2 = combine, rows2

    def __call__(self, out, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map) -> bool:
        top_k = topk_ids.shape[1]
        w13, w2 = WeightOperand.of(w13), WeightOperand.of(w2)
        num_local, two_i, hidden = w13.shape
        inter = two_i // 2
        step, up_off = _gate_up(self._activation, inter)
        weights, ids = topk_weights.reshape(-1).contiguous(), topk_ids.reshape(-1)
        num_global = expert_map.shape[0] if expert_map is not None else num_local
        # A 4-bit stack's words are a view of its bytes or, where its offset is not a whole word, a copy with other
        # strides: the signature does not say which, so the weights' strides as launched are checked here
        w13_args, w2_args = w13.gemv_args(), w2.gemv_args()
        if _ints(w13_args) != self._ints1 or _ints(w2_args) != self._ints2:
            return False
        if self._pack1 is None:
            x_args = _plain_x_args(x)
        else:
            packed = self._pack1(x)
            if packed is None:
                return False
            x_args = _packed_x_args(*packed)
        h = torch.empty(ids.numel(), inter, dtype=x.dtype, device=x.device)  # (activation_buffers' h)
        if not self._gemv1(self._grid1, self._args1(x_args, w13_args, w13_bias, x, h, None, ids, expert_map, top_k,
                                                     num_global, num_local, inter, hidden, step, up_off, None)):
            if self._pack1 is None:
                return False
            gemv1(x, w13, w13_bias, h, ids, expert_map, num_global, self._activation, top_k, self._config.gemm1,
                  self._pdl)  # (x's packing ran: the call goes on in full)
        if self._combine is None:
            target, slots = out, top_k
        else:  # each pair as a token of one slot, then the combine
            target, slots = torch.empty(ids.numel(), hidden, dtype=torch.float32, device=x.device), 1
        if self._rows2:
            if not self._gemv2(self._grid2, _gemv2_rows_args(h, w2_args, w2_bias, weights, ids, expert_map, target,
                                                             num_global, num_local, hidden, inter)):
                gemv2_rows(h, w2, w2_bias, weights, ids, expert_map, num_global, target, self._config.gemm2, self._pdl,
                           w_args=w2_args)
        else:
            packed = None if self._pack2 is None else self._pack2(h)
            if (self._pack2 is not None and packed is None) or not self._gemv2(self._grid2, _gemv2_args(
                    _plain_h_args(h) if packed is None else _packed_h_args(*packed), w2_args, w2_bias, h,
                    weights, ids, expert_map, target, slots, num_global, num_local, hidden, inter, None)):
                gemv2_tokens(h, w2, w2_bias, weights, ids, expert_map, num_global, target, slots, self._config.gemm2,
                             self._pdl, w_args=w2_args)
        if self._combine is not None:
            grid, args, constants = _combine_launch(target, ids, out, top_k)
            if not self._combine(grid, args):
                combine_kernel.launch(grid, args, constants)
        return True


class CallSources(NamedTuple):
    """The tensors a planned call's launches read, made the same way on every call of its signature (the sources of
    moekit._launch.arg_builder): the caller's, their views and the call's buffers. Per-pair calls have no aligned
    rows (None)."""

    x: torch.Tensor  # as GEMM1 reads it: a paired_k copy for word-decoded 4-bit weights
    w13: torch.Tensor
    w13_scales: torch.Tensor | None
    w13_global: torch.Tensor | None
    b13: torch.Tensor | None
    h: torch.Tensor
    ids: torch.Tensor
    expert_map: torch.Tensor | None
    pair_expert: torch.Tensor | None
    sorted_pairs: torch.Tensor | None
    block_expert: torch.Tensor | None
    y: torch.Tensor | None
    w2: torch.Tensor
    w2_scales: torch.Tensor | None
    w2_global: torch.Tensor | None
    b2: torch.Tensor | None
    weights: torch.Tensor
    out: torch.Tensor

    @classmethod
    def of(cls, out, x, w13: WeightOperand, w2: WeightOperand, b13, b2, topk_weights, topk_ids, expert_map,
           block_m: int | None, split_slots: bool = False) -> "CallSources":
        """``block_m``: the aligned path's row block, None per pair; ``split_slots``: per pair, GEMM2's output per
        pair (y) for the combine kernel."""
        ids, weights = topk_ids.reshape(-1), topk_weights.reshape(-1).contiguous()
        num_pairs, inter = ids.numel(), w13.shape[1] // 2
        aligned = (None,) * 3 + (torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
                                 if split_slots else None,)
        rows = num_pairs
        if block_m is not None:
            blocks = num_row_blocks(num_pairs, w13.shape[0], block_m)
            rows = blocks * block_m
            aligned = (*align_buffers(num_pairs, blocks, block_m, x.device),
                       torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device))
        h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)  # (activation_buffers' h)
        x3 = paired_k(x) if _k_paired(w13, x.dtype) else x
        return cls(x3, *w13.parts(), b13, h, ids, expert_map, *aligned, *w2.parts(), b2, weights, out)

    def launches(self, w13: WeightOperand, w2: WeightOperand, activation: str, config: ExpertsConfig,
                 top_k: int) -> tuple:
        """(Launcher, (grid, arguments, constants)) of each launch, in order: the per-pair GEMMs, or the one-program
        align, the aligned GEMMs and the combine; the same as fused_experts_into's full path."""
        num_pairs = self.ids.numel()
        x_paired = self.x if _k_paired(w13, self.x.dtype) else None
        if self.pair_expert is None:
            num_global = self.expert_map.shape[0] if self.expert_map is not None else w13.shape[0]
            pair_rows = RowMap.per_pair(self.ids, self.expert_map)
            h_paired = self.y is not None and _k_paired(w2, self.h.dtype)  # (as fused_experts_into)
            first = (gemm1_act_kernel, gemm1_launch(self.x, w13, self.b13, self.h, pair_rows, activation, num_pairs,
                                                    config.gemm1, PER_PAIR_BLOCK_M, num_pairs, top_k, 0, num_global,
                                                    h_paired=h_paired, x_paired=x_paired))
            if self.y is not None:  # split slots: GEMM2 per pair, then the combine
                return (first,
                        (gemm2_kernel, gemm2_launch(self.h, w2, self.b2, self.weights, self.y, (0, self.y.stride(0)),
                                                    pair_rows, num_pairs, config.gemm2, PER_PAIR_BLOCK_M, num_pairs, 0,
                                                    num_global=num_global)),
                        (combine_kernel, _combine_launch(self.y, self.ids, self.out, top_k)))
            return (first, (gemm2_tokens_kernel, gemm2_tokens_launch(self.h, w2, self.b2, self.weights, self.ids,
                                                                     self.expert_map, num_global, self.out, top_k,
                                                                     config.gemm2)))
        bm, blocks = config.block_m, self.block_expert.shape[0]
        rows = RowMap.aligned(self.block_expert, self.sorted_pairs)
        return ((align_kernel, align_launch(self.ids, self.expert_map, self.pair_expert, self.sorted_pairs,
                                            self.block_expert, w13.shape[0], bm)),
                (gemm1_act_kernel, gemm1_launch(self.x, w13, self.b13, self.h, rows, activation, blocks, config.gemm1,
                                                bm, num_pairs, top_k, 0, h_paired=_k_paired(w2, self.h.dtype),
                                                x_paired=x_paired)),
                (gemm2_kernel, gemm2_launch(self.h, w2, self.b2, self.weights, self.y, (0, self.y.stride(0)), rows,
                                            blocks, config.gemm2, bm, num_pairs, 0)),
                (combine_kernel, _combine_launch(self.y, self.pair_expert, self.out, top_k)))


class _SourcedPlan:
    """Launches made ready to repeat, their arguments rebuilt from each call's sources (moekit._launch.arg_builder):
    what :class:`CallPlan` and :class:`BatchedPlan` share. The 4-bit stacks' word layout is kept with them: a stack's
    storage offset decides it, which the call signature does not fix."""

    __slots__ = ("_steps", "_words")

    def __init__(self, steps: tuple, words: tuple):
        self._steps, self._words = steps, words

    @staticmethod
    def _launch(launches: tuple, sources: tuple, w13: WeightOperand, w2: WeightOperand, dtype) -> tuple | None:
        """Launch each (Launcher, (grid, arguments, constants)) in order; return (steps that repeat them from another
        call's sources, the words' layout), or None where a launch cannot be prepared or rebuilt (a TMA descriptor
        among its arguments, a kernel not bound)."""
        steps = []
        for launcher, (grid, args, constants) in launches:
            launcher.launch(grid, args, constants)
            steps.append((launcher, launcher.prepare(args, constants), grid, arg_builder(args, sources), constants))
        if any(prepared is None or build is None for _, prepared, _, build, _ in steps):
            return None
        return tuple(steps), (_w4_words(w13, dtype), _w4_words(w2, dtype))

    def _serve(self, w13: WeightOperand, w2: WeightOperand, dtype, sources) -> bool:
        """The steps on the sources ``sources()`` makes: False, nothing launched, where the words' layout changed or
        the first launch's binding does not hold; a later launch whose binding does not hold goes through its
        Launcher."""
        if (_w4_words(w13, dtype), _w4_words(w2, dtype)) != self._words:
            return False
        made = sources()
        (_, first, grid, build, _), *rest = self._steps
        if not first(grid, build(made)):
            return False
        for launcher, prepared, grid, build, constants in rest:
            args = build(made)
            if not prepared(grid, args):
                launcher.launch(grid, args, constants)
        return True


class CallPlan(_SourcedPlan):
    """A tensor-core call (the per-pair GEMMs, or the aligned path with its one-program align; no adapters, no FP8
    activations) made ready to repeat for calls of one checked signature, as :class:`DecodePlan` is: every launch
    prepared, its arguments rebuilt from the call's :class:`CallSources`. ``__call__`` returns False, having launched
    nothing, where the first launch's binding does not hold or the 4-bit words' layout changed."""

    __slots__ = ("_block_m", "_split_slots")

    def __init__(self, steps: tuple, words: tuple, block_m: int | None, split_slots: bool = False):
        super().__init__(steps, words)
        self._block_m, self._split_slots = block_m, split_slots

    @classmethod
    def first_call(cls, out, x, w13: WeightOperand, w2: WeightOperand, topk_weights, topk_ids, b13, b2, expert_map,
                   activation: str, config: ExpertsConfig) -> "CallPlan | None":
        """Launch the call in full; return its plan, or None where a launch cannot be prepared or rebuilt."""
        block_m = None if config.per_pair else config.block_m
        split = config.per_pair and config.split_slots
        sources = CallSources.of(out, x, w13, w2, b13, b2, topk_weights, topk_ids, expert_map, block_m, split)
        made = cls._launch(sources.launches(w13, w2, activation, config, topk_ids.shape[1]), sources, w13, w2, x.dtype)
        return None if made is None else cls(*made, block_m, split)

    def __call__(self, out, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map) -> bool:
        w13, w2 = WeightOperand.of(w13), WeightOperand.of(w2)
        return self._serve(w13, w2, x.dtype, lambda: CallSources.of(out, x, w13, w2, w13_bias, w2_bias, topk_weights,
                                                                   topk_ids, expert_map, self._block_m,
                                                                   self._split_slots))


class BatchedSources(NamedTuple):
    """The tensors a planned batched call's two GEMMs read (see :class:`CallSources`)."""

    x: torch.Tensor  # [E, M, H] as GEMM1 reads it: a paired_k copy for word-decoded 4-bit weights
    w13: torch.Tensor
    w13_scales: torch.Tensor | None
    w13_global: torch.Tensor | None
    b13: torch.Tensor | None
    h: torch.Tensor
    expert_num_tokens: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor | None
    w2_global: torch.Tensor | None
    b2: torch.Tensor | None
    out: torch.Tensor

    @classmethod
    def of(cls, out, x, expert_num_tokens, w13: WeightOperand, w2: WeightOperand, b13, b2) -> "BatchedSources":
        num_experts, rows_per_expert, _ = x.shape
        h = torch.empty(num_experts * rows_per_expert, w13.shape[1] // 2, dtype=x.dtype,
                        device=x.device)  # (activation_buffers' h)
        x3 = paired_k(x) if _k_paired(w13, x.dtype) else x
        return cls(x3, *w13.parts(), b13, h, expert_num_tokens, *w2.parts(), b2, out)

    def launches(self, w13: WeightOperand, w2: WeightOperand, activation: str, config: ExpertsConfig) -> tuple:
        """(Launcher, (grid, arguments, constants)) of GEMM1 and GEMM2: batched_experts_into's launches."""
        num_experts, rows_per_expert, _ = self.x.shape
        bm = config.block_m
        blocks = num_experts * _triton.cdiv(rows_per_expert, bm)
        rows = RowMap.batched(self.expert_num_tokens)
        x_paired = self.x if _k_paired(w13, self.x.dtype) else None
        return ((gemm1_act_kernel, gemm1_launch(self.x, w13, self.b13, self.h, rows, activation, blocks, config.gemm1,
                                                bm, 0, 1, rows_per_expert, h_paired=_k_paired(w2, self.h.dtype),
                                                x_paired=x_paired)),
                (gemm2_kernel, gemm2_launch(self.h, w2, self.b2, self.h, self.out, (self.out.stride(0),
                                                                                    self.out.stride(1)),
                                            rows, blocks, config.gemm2, bm, 0, rows_per_expert)))


class BatchedPlan(_SourcedPlan):
    """A batched call (no adapters, no FP8 activations, no TMA boxes) made ready to repeat for calls of one checked
    signature, as :class:`CallPlan` is: both GEMMs prepared, their arguments rebuilt from the call's
    :class:`BatchedSources`."""

    __slots__ = ()

    @classmethod
    def first_call(cls, out, x, expert_num_tokens, w13: WeightOperand, w2: WeightOperand, b13, b2, activation: str,
                   config: ExpertsConfig) -> "BatchedPlan | None":
        """Launch the call in full; return its plan, or None (see :meth:`CallPlan.first_call`)."""
        sources = BatchedSources.of(out, x, expert_num_tokens, w13, w2, b13, b2)
        made = cls._launch(sources.launches(w13, w2, activation, config), sources, w13, w2, x.dtype)
        return None if made is None else cls(*made)

    def __call__(self, out, x, expert_num_tokens, w13, w2, w13_bias, w2_bias) -> bool:
        w13, w2 = WeightOperand.of(w13), WeightOperand.of(w2)
        return self._serve(w13, w2, x.dtype,
                           lambda: BatchedSources.of(out, x, expert_num_tokens, w13, w2, w13_bias, w2_bias))


def _combine(y, pair_expert, out, top_k, prepare: bool = False):
    """out[t] = sum over slots j in order of y[t * k + j] (pairs whose pair_expert is -1 skipped). ``prepare``: return
    the launch made ready to repeat (moekit._launch.Prepared) or None."""
    grid, args, constants = _combine_launch(y, pair_expert, out, top_k)
    combine_kernel.launch(grid, args, constants)
    return combine_kernel.prepare(args, constants) if prepare else None


def _combine_launch(y, pair_expert, out, top_k) -> tuple:
    num_tokens, hidden = out.shape
    return ((num_tokens, _triton.cdiv(hidden, COMBINE_BLOCK_H)), (y, pair_expert, out, out.stride(0), hidden, top_k),
            _COMBINE_CONSTANTS)


_COMBINE_CONSTANTS = Constants(BLOCK_H=COMBINE_BLOCK_H, num_warps=4)


def batched_experts_into(out, x, expert_num_tokens, w13, w2, activation, w13_bias, w2_bias,
                         config: ExpertsConfig | None = None, act_quant: str | None = None, lora=None,
                         lora_ids=None, plan: bool = False) -> "BatchedPlan | None":
    """Batched format, valid rows written into ``out`` [E, M, H] (contiguous); padding rows untouched. ``lora``: as
    :func:`fused_experts_into`, ``lora_ids`` int32 [E, M]. ``plan``: return the call made ready to repeat for calls
    of the same checked signature where it can be (:class:`BatchedPlan`), else None."""
    num_experts, rows_per_expert, hidden = x.shape
    two_i = w13.shape[1]
    if rows_per_expert == 0:
        return
    fp8 = fp8_activations(w13, act_quant)
    w13, w2 = WeightOperand.of(w13, fp8), WeightOperand.of(w2, fp8)
    if config is None:
        # Each expert runs up to M rows: the regime of M rows per expert.
        config, _ = expert_configs.choose(rows_per_expert * num_experts, num_experts, 1, two_i, hidden,
                                          x.device, x.dtype, w13.config_format, batched=True)
    if plan and lora is None and not fp8 and not (config.gemm1.tma or config.gemm2.tma):  # (as fused_experts_into)
        return BatchedPlan.first_call(out, x, expert_num_tokens, w13, w2, w13_bias, w2_bias, activation, config)
    bm = config.block_m
    blocks = num_experts * _triton.cdiv(rows_per_expert, bm)
    h, hs = activation_buffers(num_experts * rows_per_expert, two_i // 2, x.dtype, x.device, fp8)
    xs = None
    if fp8:  # every row its own groups: padding rows (garbage, NaN) only ever scale themselves
        xq, xs = fp8_groups(x.reshape(num_experts * rows_per_expert, hidden))
        x = xq.view(num_experts, rows_per_expert, hidden)
    rows = RowMap.batched(expert_num_tokens)
    h_paired = _k_paired(w2, h.dtype)
    terms = None if lora is None else _GemmLoRA(  # (as in fused_experts_into)
        lora, lora_ids, expert_lora.Rows("batched", num_experts * rows_per_expert, block_m=bm,
                                         expert_num_tokens=expert_num_tokens, rows_per_expert=rows_per_expert),
        out, w2, x.device)
    gemm1(x, w13, w13_bias, h, rows, activation, blocks, config.gemm1, bm, 0, 1, rows_per_expert,
           x_scales=xs, h_scales=hs, h_paired=h_paired, **(terms.gemm1_args(x, xs, w13) if terms else {}))
    gemm2(h, w2, w2_bias, h, out, (out.stride(0), out.stride(1)), rows, blocks, config.gemm2, bm, 0, rows_per_expert,
           hs, **(terms.gemm2_args(h, hs, h_paired) if terms else {}))
    if terms:
        terms.after_gemm2(h, hs, None, h_paired)


# torch.compile sees each call as one opaque op with a fake (shape-only) implementation.

@torch.library.custom_op("moekit::fused_experts_into", mutates_args=("out",))
def _fused_experts_op(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                      w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                      expert_map: torch.Tensor | None) -> None:
    check_written_memory("out", out, {"x": x, "w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids,
                                      "w13_bias": w13_bias, "w2_bias": w2_bias, "expert_map": expert_map})
    fused_experts_into(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map)


@_fused_experts_op.register_fake
def _(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map) -> None:
    return None


@torch.library.custom_op("moekit::batched_experts_into", mutates_args=("out",))
def _batched_experts_op(out: torch.Tensor, x: torch.Tensor, expert_num_tokens: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, activation: str, w13_bias: torch.Tensor | None,
                        w2_bias: torch.Tensor | None) -> None:
    check_written_memory("out", out, {"x": x, "expert_num_tokens": expert_num_tokens, "w13": w13, "w2": w2,
                                      "w13_bias": w13_bias, "w2_bias": w2_bias})
    batched_experts_into(out, x, expert_num_tokens, w13, w2, activation, w13_bias, w2_bias)


@_batched_experts_op.register_fake
def _(out, x, expert_num_tokens, w13, w2, activation, w13_bias, w2_bias) -> None:
    return None


# Everything else under torch.compile (quantized weights, act_quant, an explicit config, expert LoRA): the same
# calls as ops whose schemas carry each weight's parts (moekit.formats.to_parts), the config as literal text and
# the adapters' tensors; the objects are rebuilt inside, at run time.
@torch.library.custom_op("moekit::fused_experts_general_into", mutates_args=("out",))
def _fused_experts_general_op(out: torch.Tensor, x: torch.Tensor, fmt: str,
                              w13_data: torch.Tensor, w13_scales: torch.Tensor | None,
                              w13_global: torch.Tensor | None, w13_tag: str, w13_shape: list[int],
                              w2_data: torch.Tensor, w2_scales: torch.Tensor | None, w2_global: torch.Tensor | None,
                              w2_tag: str, w2_shape: list[int],
                              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                              w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                              expert_map: torch.Tensor | None, act_quant: str | None, config: str | None,
                              lora_w13_a: torch.Tensor | None, lora_w13_b: torch.Tensor | None,
                              lora_w2_a: torch.Tensor | None, lora_w2_b: torch.Tensor | None,
                              lora_scaling: torch.Tensor | None, lora_ids: torch.Tensor | None) -> None:
    check_written_memory("out", out, {"x": x, "w13": w13_data, "w13.scales": w13_scales, "w13.global_scale": w13_global,
                                      "w2": w2_data, "w2.scales": w2_scales, "w2.global_scale": w2_global,
                                      "topk_weights": topk_weights, "topk_ids": topk_ids, "w13_bias": w13_bias,
                                      "w2_bias": w2_bias, "expert_map": expert_map, "lora_ids": lora_ids,
                                      **_lora_memory(lora_w13_a, lora_w13_b, lora_w2_a, lora_w2_b, lora_scaling)})
    w13 = from_parts(fmt, w13_data, w13_scales, w13_global, w13_tag, w13_shape)
    w2 = from_parts(fmt, w2_data, w2_scales, w2_global, w2_tag, w2_shape)
    fused_experts_into(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map,
                       _config_of(config), act_quant,
                       _lora_of(lora_w13_a, lora_w13_b, lora_w2_a, lora_w2_b, lora_scaling), lora_ids)


@_fused_experts_general_op.register_fake
def _(out, x, fmt, w13_data, w13_scales, w13_global, w13_tag, w13_shape, w2_data, w2_scales, w2_global, w2_tag,
      w2_shape, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map, act_quant, config, lora_w13_a,
      lora_w13_b, lora_w2_a, lora_w2_b, lora_scaling, lora_ids) -> None:
    return None


@torch.library.custom_op("moekit::batched_experts_general_into", mutates_args=("out",))
def _batched_experts_general_op(out: torch.Tensor, x: torch.Tensor, expert_num_tokens: torch.Tensor, fmt: str,
                                w13_data: torch.Tensor, w13_scales: torch.Tensor | None,
                                w13_global: torch.Tensor | None, w13_tag: str, w13_shape: list[int],
                                w2_data: torch.Tensor, w2_scales: torch.Tensor | None,
                                w2_global: torch.Tensor | None, w2_tag: str, w2_shape: list[int], activation: str,
                                w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, act_quant: str | None,
                                config: str | None, lora_w13_a: torch.Tensor | None,
                                lora_w13_b: torch.Tensor | None, lora_w2_a: torch.Tensor | None,
                                lora_w2_b: torch.Tensor | None, lora_scaling: torch.Tensor | None,
                                lora_ids: torch.Tensor | None) -> None:
    check_written_memory("out", out, {"x": x, "w13": w13_data, "w13.scales": w13_scales, "w13.global_scale": w13_global,
                                      "w2": w2_data, "w2.scales": w2_scales, "w2.global_scale": w2_global,
                                      "expert_num_tokens": expert_num_tokens, "w13_bias": w13_bias, "w2_bias": w2_bias,
                                      "lora_ids": lora_ids,
                                      **_lora_memory(lora_w13_a, lora_w13_b, lora_w2_a, lora_w2_b, lora_scaling)})
    w13 = from_parts(fmt, w13_data, w13_scales, w13_global, w13_tag, w13_shape)
    w2 = from_parts(fmt, w2_data, w2_scales, w2_global, w2_tag, w2_shape)
    batched_experts_into(out, x, expert_num_tokens, w13, w2, activation, w13_bias, w2_bias, _config_of(config),
                         act_quant, _lora_of(lora_w13_a, lora_w13_b, lora_w2_a, lora_w2_b, lora_scaling), lora_ids)


@_batched_experts_general_op.register_fake
def _(out, x, expert_num_tokens, fmt, w13_data, w13_scales, w13_global, w13_tag, w13_shape, w2_data, w2_scales,
      w2_global, w2_tag, w2_shape, activation, w13_bias, w2_bias, act_quant, config, lora_w13_a, lora_w13_b,
      lora_w2_a, lora_w2_b, lora_scaling, lora_ids) -> None:
    return None


def _general_args(w13, w2, config, lora) -> tuple:
    """(fmt, w13's parts, w2's parts) and (config text, adapters' tensors) of a general op call."""
    f13, *p13 = to_parts(w13)
    _, *p2 = to_parts(w2)
    cfg = None if config is None else _config_text(config)
    adapters = (None,) * 5 if lora is None else (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b, lora.scaling)
    return (f13, *p13, *p2), (cfg, *adapters)


_GEMM_FIELDS = tuple(f.name for f in fields(GemmConfig))
_EXPERTS_FIELDS = tuple(f.name for f in fields(ExpertsConfig) if f.name not in ("gemm1", "gemm2"))


def _config_text(config: ExpertsConfig) -> str:
    """The config as the text of a Python literal, by plain attribute reads that torch.compile traces (and guards
    by value: an equal config built anew does not recompile)."""
    parts = [repr(getattr(config, name)) for name in _EXPERTS_FIELDS]
    for gemm in (config.gemm1, config.gemm2):
        parts.append("(" + ", ".join(repr(getattr(gemm, name)) for name in _GEMM_FIELDS) + ",)")
    return "(" + ", ".join(parts) + ")"


@functools.lru_cache(maxsize=256)  # per config text: each compiled call passes the same one
def _config_of(text: str | None) -> ExpertsConfig | None:
    if text is None:
        return None
    *top, g1, g2 = ast.literal_eval(text)
    return ExpertsConfig(**dict(zip(_EXPERTS_FIELDS, top)), gemm1=GemmConfig(*g1), gemm2=GemmConfig(*g2))


def _lora_memory(w13_a, w13_b, w2_a, w2_b, scaling) -> dict:
    """The adapters' tensors, which the W2 term reads after GEMM2 has written out in the decode modes."""
    return {"lora.w13_a": w13_a, "lora.w13_b": w13_b, "lora.w2_a": w2_a, "lora.w2_b": w2_b, "lora.scaling": scaling}


def _lora_of(w13_a, w13_b, w2_a, w2_b, scaling):
    return None if scaling is None else expert_lora.ExpertsLoRA(w13_a, w13_b, w2_a, w2_b, scaling)


def _dense_weights(*ws) -> bool:
    return all(format_of(w) == "dense" for w in ws)


def run_fused(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map, config=None,
              act_quant=None, lora=None, lora_ids=None, plan: bool = False):
    """``plan``: return :func:`fused_experts_into`'s plan (eager calls; None under torch.compile)."""
    # The custom op is for torch.compile, which must not trace the launches; an eager call goes straight to
    # them (the op's dispatch alone cost about 70 us of host time per call).
    if not torch.compiler.is_compiling():
        return fused_experts_into(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map,
                                  config, act_quant, lora, lora_ids, plan)
    elif config is None and act_quant is None and lora is None and _dense_weights(w13, w2):
        torch.ops.moekit.fused_experts_into(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias,
                                            w2_bias, expert_map)
    else:
        weights, rest = _general_args(w13, w2, config, lora)
        torch.ops.moekit.fused_experts_general_into(out, x, *weights, topk_weights, topk_ids, activation, w13_bias,
                                                    w2_bias, expert_map, act_quant, *rest, lora_ids)


def run_batched(out, x, expert_num_tokens, w13, w2, activation, w13_bias, w2_bias, config=None, act_quant=None,
                lora=None, lora_ids=None, plan: bool = False):
    """``plan``: as :func:`run_fused`'s (:func:`batched_experts_into`'s plan)."""
    if not torch.compiler.is_compiling():
        return batched_experts_into(out, x, expert_num_tokens, w13, w2, activation, w13_bias, w2_bias, config,
                                    act_quant, lora, lora_ids, plan)
    elif config is None and act_quant is None and lora is None and _dense_weights(w13, w2):
        torch.ops.moekit.batched_experts_into(out, x, expert_num_tokens, w13, w2, activation, w13_bias, w2_bias)
    else:
        weights, rest = _general_args(w13, w2, config, lora)
        torch.ops.moekit.batched_experts_general_into(out, x, expert_num_tokens, *weights, activation, w13_bias,
                                                      w2_bias, act_quant, *rest, lora_ids)
