"""Decode GEMM1 on the CUDA cores for 4-bit weights and 16-bit activations, streaming w13's rows as stored.

One program owns 2 * BLOCK_N rows of one (token, slot) pair's expert: the gate and up rows of BLOCK_N columns of
h, in h's (gate, up) order, so that with gpt-oss's interleaved rows a program reads one contiguous run of rows.
It walks K in chunks of BLOCK_K codes, each chunk as [rows, groups, words] int32 words of 8 codes and [rows,
groups] scale bytes, keeps fp32 sums per (row, group) and reduces them once after the loop.

The products are fp16x2 FMAs (moe_gemv._fp16x2_group_sums). Instead of the preparation launch of
moe_gemv's packed path (kernels/scaled_fp16.py: an exponent per 32 activations), the kernel scales its token's
activations itself by one power of two, the token's largest |x| to [2^14, 2^15): fp16 then holds every bf16
value down to 2^-28 of that largest exactly, and the few below (whose products are under 2^-28 of the largest)
lose bits, not range. The activation chunk is loaded once per program as stored and rearranged in registers.

The stream-and-decode microbenchmark (benchmarks/results/stream_decode.md, H200 2026-12-05) measured this design
at 78.6% of the copy rate on gpt-oss-120b's GEMM1 at T=1, against 65.4% for moe_gemv's gemv1_act_kernel.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .lora import (w2_decode_cols, w2_decode_parts, w13_decode_leave, w13_decode_rows, w13_decode_shrink,
                   w13_decode_terms, w13_decode_wait)
from .moe_gemm import MXFP4, NVFP4, _activate, _pair_expert
from .moe_gemv import _load_row_chunk, _opaque, _row_exponent, _row_scaled_sums


@triton.jit
def _load_rows_chunk(w_ptr, s_ptr, w_rows, s_rows, row_ok, x_row, stride_xk, c, K,
                     FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Chunk ``c`` of a program: (words [rows, groups, words per group], scale bytes [rows, groups], activations
    [groups, group size] as stored). Groups past K are masked (zeros): their loads move no bytes."""
    w, s = _load_rows_words(w_ptr, s_ptr, w_rows, s_rows, row_ok, c, K, FORMAT, BLOCK_K)
    return w, s, _load_row_chunk(x_row, stride_xk, c * BLOCK_K, K, FORMAT, BLOCK_K)


@triton.jit
def _load_rows_words(w_ptr, s_ptr, w_rows, s_rows, row_ok, c, K, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights of :func:`_load_rows_chunk`'s chunk ``c``: (words, scale bytes)."""
    GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
    WORDS: tl.constexpr = GROUP // 8
    G: tl.constexpr = BLOCK_K // GROUP
    ROWS: tl.constexpr = w_rows.shape[0]
    g = c * G + tl.arange(0, G)
    g_ok = g < K // GROUP
    # Words addressed as [rows, G * WORDS] (contiguous along a row's chunk) and only then viewed as [rows, G,
    # WORDS]: seen contiguous along the chunk, the compiler lays lanes along it, a vector of a group's words each,
    # so that a lane keeps the same groups of several rows and the activations it converts serve all of them.
    j = tl.arange(0, G * WORDS)
    w_ok = row_ok[:, None] & ((c * G + j // WORDS) < K // GROUP)[None, :]
    w_off = tl.multiple_of(w_rows + c * (G * WORDS), WORDS)[:, None] + j[None, :]
    w = tl.reshape(tl.load(w_ptr + w_off, mask=w_ok, other=0), [ROWS, G, WORDS])
    # Loaded as [G, rows] and transposed: that load's layout is, transposed, the one of the words' group sums
    # (lanes along the groups); loaded as [rows, G], each chunk's sums would cross to it through shared memory.
    s = tl.trans(tl.load(s_ptr + s_rows[None, :] + _opaque(g, K)[:, None], mask=g_ok[:, None] & row_ok[None, :],
                         other=0))
    return w, s


@triton.jit
def _stream_rows(w_ptr, s_ptr, gs_ptr, bias_ptr, stride_bn, e64, w_rows, s_rows, bias_rows, row_ok, x_row, stride_xk,
                 K, x_scale, x_factor, acc, first, HAS_BIAS: tl.constexpr, FORMAT: tl.constexpr,
                 BLOCK_K: tl.constexpr, HALVES_ASM: tl.constexpr, PAIRS: tl.constexpr = False):
    """The rows' dot products with one activation row (scaled by x_scale, x_factor: moe_gemv._row_exponent), their
    expert's NVFP4 global scale divided out and the bias added: fp32 [rows]. ``acc`` [rows, groups per chunk]: the
    sums of the chunks before ``first``."""
    for c in range(first, tl.cdiv(K, BLOCK_K)):  # num_stages keeps the next chunks' loads in flight
        w, s, xr = _load_rows_chunk(w_ptr, s_ptr, w_rows, s_rows, row_ok, x_row, stride_xk, c, K, FORMAT, BLOCK_K)
        acc += _row_scaled_sums(w, s, xr, x_scale, x_factor, FORMAT, HALVES_ASM, PAIRS)
    y = tl.sum(acc, axis=1)
    if FORMAT == NVFP4:  # the per-expert global scale divides out once
        y = y / tl.load(gs_ptr + e64)
    if HAS_BIAS:
        y += tl.load(bias_ptr + bias_rows * stride_bn, mask=row_ok, other=0.0).to(tl.float32)
    return y


@triton.jit
def gemv1_rows_kernel(
    # as moe_gemv.gemv1_act_kernel's, less its prepared activations: x [T, H] bf16 or fp16 as stored, w13 as int32
    # words of 8 codes [E, 2I, H/8] (rows on whole groups), no K stride
    x_ptr, stride_xm, stride_xk, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, gs_ptr,
    bias_ptr, stride_be, stride_bn, h_ptr, stride_hm, delta_ptr, stride_dm, ids_ptr, expert_map_ptr,
    top_k, num_global, num_local, I, K, gate_step, up_offset,
    # decode LoRA: as moe_gemv.gemv1_act_kernel's (one pair per program: its program groups are its pairs)
    lora_parts_ptr, lora_b_ptr, lora_a2_ptr, lora_parts2_ptr, lora_cnt_ptr, lora_scaling_ptr, lora_ids_ptr,
    lora_adapters, lora_r1, lora_r2, lora_x_ptr, lora_stride_xm, lora_stride_xk, lora_a13_ptr, lora_k_per_split,
    HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, ACTIVATION: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns of h per program: 2 * BLOCK_N rows of w13
    BLOCK_K: tl.constexpr,  # codes per chunk, whole scale groups
    XBLOCK: tl.constexpr,  # activations per step of the token's largest-|x| scan
    HALVES_ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,  # GEMM2 is launched as this grid's programmatic dependent
    HAS_DELTA: tl.constexpr = False,
    LORA_W13: tl.constexpr = False, LORA_W2: tl.constexpr = False, LORA_WAIT: tl.constexpr = False,
    LORA_SPLITS: tl.constexpr = 1, LORA_R1_PAD: tl.constexpr = 16, LORA_R2_PAD: tl.constexpr = 16,
    LORA_BLOCKS_PAD: tl.constexpr = 1, LORA_FENCE: tl.constexpr = False,
    LORA_SHRINK: tl.constexpr = False, LORA_SHRINK_BLOCK_K: tl.constexpr = 128,
    W4_PAIRS: tl.constexpr = False,  # codes in the "pairs" byte layout (formats/fp4.py)
):
    tl.static_assert(LORA_W13 or not LORA_SHRINK)
    if PDL:  # every program has started: GEMM2's may start too (they wait for this grid before reading h)
        gdc_launch_dependents()
    num_n = tl.cdiv(I, BLOCK_N)
    pair = tl.program_id(0) // num_n
    e = _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP)
    if e >= 0:  # pairs of another rank: their rows are never read (GEMM2 skips them too)
        e64 = e.to(tl.int64)
        # row r of the program: column n0 + r // 2 of h, its gate (r even) or up (r odd) row of w13
        r = tl.arange(0, 2 * BLOCK_N)
        cols = (tl.program_id(0) % num_n) * BLOCK_N + r // 2
        row_ok = cols < I
        rows = cols.to(tl.int64) * gate_step + (r % 2) * up_offset
        w_rows = e64 * stride_we + rows * stride_wn
        s_rows = e64 * stride_se + rows * stride_sn
        x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
        offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        if LORA_W13 or LORA_W2:  # the adapters' weights load now: the epilogue then waits only for the shrink
            # (the helpers take a slot axis: this program's one pair; pair1 >= 0 holds, it gives the mask that axis)
            pair1 = pair + tl.zeros([1], dtype=tl.int32)
            adapter = tl.load(lora_ids_ptr + pair // top_k)
            lora_live = (pair1 >= 0) & (adapter >= 0) & (adapter < lora_adapters)
            ok1 = (offs_n < I)[None, :]
            gate_cols = offs_n.to(tl.int64) * gate_step
        if LORA_W13:
            lora_bg, lora_bu = w13_decode_rows(lora_b_ptr, adapter, lora_live, e64, gate_cols, gate_cols + up_offset,
                                               ok1, num_local, 2 * I, lora_r1, LORA_R1_PAD)
        if LORA_W2:
            lora_a2 = w2_decode_cols(lora_a2_ptr, adapter, lora_live, e64, offs_n, ok1, num_local, I, lora_r2,
                                     LORA_R2_PAD)
        if LORA_SHRINK:
            lora_shrinks = tl.max(lora_live.to(tl.int32), axis=0) > 0
            lora_x_row = lora_x_ptr + (pair // top_k).to(tl.int64) * lora_stride_xm
            shrink_idx = tl.num_programs(0) // num_n + 3 * pair  # after W2's counters
            if lora_shrinks:
                w13_decode_shrink(lora_x_row, lora_stride_xk, lora_a13_ptr, adapter, lora_live, e64, pair1,
                                  lora_parts_ptr, lora_cnt_ptr, shrink_idx, tl.program_id(0) % num_n, num_local, K,
                                  lora_r1, lora_k_per_split, offs_n, LORA_SPLITS, LORA_R1_PAD, LORA_SHRINK_BLOCK_K,
                                  LORA_FENCE)
        x_scale, x_factor = _row_exponent(x_row, stride_xk, K, XBLOCK)
        GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
        y = _stream_rows(w_ptr, s_ptr, gs_ptr, bias_ptr + e64 * stride_be, stride_bn, e64, w_rows, s_rows, rows,
                         row_ok, x_row, stride_xk, K, x_scale, x_factor,
                         tl.zeros([2 * BLOCK_N, BLOCK_K // GROUP], dtype=tl.float32), 0, HAS_BIAS, FORMAT, BLOCK_K,
                         HALVES_ASM, W4_PAIRS)
        if HAS_DELTA:
            y += tl.load(delta_ptr + pair.to(tl.int64) * stride_dm + rows, mask=row_ok, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(y, [BLOCK_N, 2]))
        if LORA_W13:
            if LORA_WAIT:  # the shrink's partials: written by the grid this one was launched after
                gdc_wait()
            if LORA_SHRINK:
                if lora_shrinks:
                    w13_decode_wait(lora_x_row, lora_stride_xk, lora_a13_ptr, adapter, lora_live, e64, pair1,
                                    lora_parts_ptr, lora_cnt_ptr, shrink_idx, num_local, K, lora_r1, lora_k_per_split,
                                    offs_n, LORA_SPLITS, LORA_R1_PAD, LORA_SHRINK_BLOCK_K, LORA_FENCE)
            gate_term, up_term = w13_decode_terms(lora_parts_ptr, lora_scaling_ptr, adapter, lora_live, pair1,
                                                  lora_bg, lora_bu, LORA_SPLITS, LORA_R1_PAD)
            if LORA_SHRINK:
                if lora_shrinks:
                    w13_decode_leave(lora_cnt_ptr, shrink_idx, num_n)
            gate += tl.sum(gate_term, axis=0)
            up += tl.sum(up_term, axis=0)
        act = _activate(gate, up, ACTIVATION).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + pair.to(tl.int64) * stride_hm + offs_n, act, mask=offs_n < I)
        if LORA_W2:  # on h as stored, as GEMV2 reads it
            w2_decode_parts(lora_a2, lora_parts2_ptr, lora_cnt_ptr, lora_scaling_ptr, adapter, lora_live, pair1,
                            act.to(tl.float32)[None, :], offs_n, pair, tl.program_id(0) % num_n, num_n,
                            LORA_R2_PAD, LORA_BLOCKS_PAD, LORA_FENCE)
    # Every program waits, those of other ranks' pairs too: this grid then ends after the shrink's (whose buffers
    # the launches after it may reuse)
    if LORA_WAIT:
        gdc_wait()
