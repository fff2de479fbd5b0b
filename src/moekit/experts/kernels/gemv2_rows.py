"""Decode GEMM2 per (token, slot) pair on the CUDA cores for 4-bit weights and 16-bit h: GEMV1's rows design
(kernels/gemv1_rows.py) on w2.

One program owns BLOCK_N rows of one pair's expert in w2 (BLOCK_N output columns), walks K = I in chunks of
BLOCK_K codes with fp32 sums per (row, scale group), each chunk's loads kept in flight by the loop's stages, and
writes the pair's router-weighted row y[pair] in fp32; the slots are summed afterwards in order
(triton_backend._combine), so a token's output does not depend on which program finished first. moe_gemv's
gemv2_tokens_kernel instead gives a program every slot of a token: at T=1 a few hundred programs for a hidden size
in the thousands, too few bytes in flight per SM.

h's row is scaled to fp16 by one power of two inside the kernel, as gemv1_rows does with x.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .gemv1_rows import _load_rows_words, _stream_rows
from .moe_gemm import MXFP4, _pair_expert
from .moe_gemv import _load_row_chunk, _row_exponent, _row_scaled_sums


@triton.jit
def gemv2_rows_kernel(
    h_ptr, stride_hm,  # h [T*k, I] bf16 or fp16, unit K stride (GEMV1's output)
    w_ptr, stride_we, stride_wn,  # w2 as int32 words of 8 codes [E, H, I/8] (rows on whole groups), no K stride
    s_ptr, stride_se, stride_sn, gs_ptr,  # scale bytes [E, H, I/group]; NVFP4: fp32 global scale per expert [E]
    bias_ptr, stride_be, stride_bn,  # w2_bias [E, H] (HAS_BIAS)
    weights_ptr, ids_ptr, expert_map_ptr,  # float32 / int32 [T*k], int32 [num_global] (HAS_MAP)
    y_ptr, stride_ym,  # y [T*k, H] fp32: each pair's weighted row; zeros for pairs of other ranks
    num_global, num_local, N, K,
    HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rows of w2 (columns of y) per program
    BLOCK_K: tl.constexpr,  # codes per chunk, whole scale groups
    XBLOCK: tl.constexpr,  # h values per step of the row's largest-|h| scan
    HALVES_ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,  # launched as GEMV1's programmatic dependent: wait for its grid before reading h
    W4_PAIRS: tl.constexpr = False,  # codes in the "pairs" byte layout (formats/fp4.py)
):
    num_n = tl.cdiv(N, BLOCK_N)
    pair = tl.program_id(0) // num_n
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    if e >= 0:  # pairs of another rank: GEMV1 never wrote their h; their row of y is zeros
        e64 = e.to(tl.int64)
        rows = offs_n.to(tl.int64)
        w_rows, s_rows = e64 * stride_we + rows * stride_wn, e64 * stride_se + rows * stride_sn
        h_row = h_ptr + pair.to(tl.int64) * stride_hm
        if PDL:  # the first chunk's weights (GEMV1 does not write them) load before the wait, while GEMV1's last
            # programs run; its sums join the loop's (0 + a: the same bits)
            w, s = _load_rows_words(w_ptr, s_ptr, w_rows, s_rows, n_ok, 0, K, FORMAT, BLOCK_K)
            gdc_wait()
            h_scale, h_factor = _row_exponent(h_row, 1, K, XBLOCK)
            acc = _row_scaled_sums(w, s, _load_row_chunk(h_row, 1, 0, K, FORMAT, BLOCK_K), h_scale, h_factor, FORMAT,
                                   HALVES_ASM, W4_PAIRS)
            first = 1
        else:
            h_scale, h_factor = _row_exponent(h_row, 1, K, XBLOCK)
            GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
            acc = tl.zeros([BLOCK_N, BLOCK_K // GROUP], dtype=tl.float32)
            first = 0
        y = tl.load(weights_ptr + pair) * _stream_rows(
            w_ptr, s_ptr, gs_ptr, bias_ptr + e64 * stride_be, stride_bn, e64, w_rows, s_rows, rows, n_ok, h_row, 1, K,
            h_scale, h_factor, acc, first, HAS_BIAS, FORMAT, BLOCK_K, HALVES_ASM, W4_PAIRS)
    elif PDL:  # these programs only write zeros, but y may lie where GEMV1's buffers were freed: they wait too
        gdc_wait()
    tl.store(y_ptr + pair.to(tl.int64) * stride_ym + offs_n, y, mask=n_ok)
