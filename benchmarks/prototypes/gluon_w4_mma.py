"""Prototype (session 10, not in the package): a 4-bit weight GEMV for a few tokens whose products run on
the tensor cores (mma m16n8k16, fp16 operands, fp32 accumulators) while the CUDA cores only build the
weights' fp16 pairs -- the decode design NOTES (session 10) names as the way to the bytes floor.

The weights are the A operand (16 rows of N per warp, swap A/B), the tokens the B operand (8 columns).
A thread of a quad (lane c) holds word c (8 codes) of each of its two rows (g, g + 8) per 32-wide scale
group; the word's nibbles j and j + 4 become one fp16 pair (code * 2^-14, exact) with the shifts the
CUDA-core kernels use. Those pairs ARE the thread's A-fragment registers when the MMA's K order is
permuted: logical k = 16 (j // 2) + 8 (j % 2) + 2 c + h stands for physical K 8 c + j + 4 h of the group
(h: the half of the pair), and x comes permuted the same way. A group's two MMAs give its partial sums,
which its E8M0 scale adds into the fp32 accumulator; the codes' 2^14 multiplies once at the end.

Layouts prepared on the host (a weight loader would do it once): ``prepack`` pads K to whole 128-wide
chunks and puts each lane's four words of a chunk next to each other (one 16-byte load per row and
chunk); ``permute_x`` orders each 8-element block of x as [0, 4, 1, 5, 2, 6, 3, 7] in fp16, so a lane's
B fragment of a group is one 16-byte load too.

    python benchmarks/prototypes/gluon_w4_mma.py compile   # offline: sm_90 compile, shared memory, SASS loop
    python benchmarks/prototypes/gluon_w4_mma.py emulate   # CPU: the kernel's index math in torch vs float64
    python benchmarks/prototypes/gluon_w4_mma.py dryrun    # CPU: the GPU script with the kernels emulated
    python benchmarks/prototypes/gluon_w4_mma.py           # GPU: check against float64, time vs moekit's gemv
"""
import re
import sys
from collections import Counter

import _harness  # noqa: F401 - puts src/ and tests/ on the path
import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from moekit.kernels.moe_gemm import SWIGLU_ALPHA, SWIGLU_LIMIT

CHUNK = 128  # K per loop step: 4 scale groups, 16 words per row
VARIANTS = ((1, 0), (1, 1), (2, 1), (4, 0), (4, 1), (4, 2))  # (warps, prefetch depth)
DEVICE = "cuda"  # `dryrun` runs the GPU script's sections on the CPU with the kernels emulated in torch


@gluon.jit
def _take4(t):
    """The four slices of ``t`` along its last dimension (size 4), in order."""
    a, b = gl.split(gl.reshape(t, t.shape[:-1] + [2, 2]))  # last index 2 a + b: split takes b
    t0, t2 = gl.split(a)
    t1, t3 = gl.split(b)
    return t0, t1, t2, t3


@gluon.jit
def _halves(bits):
    """The two 16-bit halves of int32 ``bits`` as fp16 (register renaming, no instruction)."""
    return gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [bits], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=1)


@gluon.jit
def _pair_bits(w, j: gl.constexpr):
    """int32 fp16 pair (code * 2^-14) of nibbles j and j + 4 of each word: sign to bit 15, magnitude to 9..11."""
    if j == 3:
        bits = ((w >> 3) & 0x0E000E00) | (w & -0x7FFF8000)
    else:
        bits = ((w << (9 - 4 * j)) & 0x0E000E00) | ((w << (12 - 4 * j)) & -0x7FFF8000)
    return bits


@gluon.jit
def _pair(w, j: gl.constexpr):
    """[.., 2]: the fp16 codes * 2^-14 of nibbles j and j + 4 of each word."""
    lo, hi = _halves(_pair_bits(w, j))
    return gl.join(lo, hi)


@gluon.jit
def _a_operand(w, BN: gl.constexpr, a_layout: gl.constexpr):
    """[BN, 32] fp16 A fragment of one group from its words [BN, 4 (c)], K in the permuted order."""
    a = gl.join(gl.join(_pair(w, 0), _pair(w, 1)), gl.join(_pair(w, 2), _pair(w, 3)))  # [BN, c, h, j % 2, j // 2]
    a = gl.reshape(gl.permute(a, (0, 4, 3, 1, 2)), [BN, 32])
    return gl.convert_layout(a, a_layout)  # no instruction: the pairs already sit where the fragment wants them


@gluon.jit
def _b_operand(xw, b_layout: gl.constexpr):
    """[32, 8] fp16 B fragment of one group from the permuted x words [8 tokens, 4 (c), 4 (j)]."""
    x = gl.join(*_halves(xw))  # [tok, c, j, h]
    x = gl.reshape(x, [8, 4, 2, 2, 2])  # [tok, c, j // 2, j % 2, h]
    x = gl.reshape(gl.permute(x, (2, 3, 1, 4, 0)), [32, 8])
    return gl.convert_layout(x, b_layout)


@gluon.jit
def _e8m0(s):
    """2^(s - 127) of the scale bytes (int32 0..255), exactly (0: the subnormal 2^-127; 255: NaN)."""
    v = (s << 23).to(gl.float32, bitcast=True)
    return gl.where(s == 255, float("nan"), gl.where(s == 0, 5.877471754111438e-39, v))


@gluon.jit
def _chunk(acc, zero, w, s, xw, factor, BN: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr):
    """acc + one 128-wide K chunk: words [BN, 4 c, 4 q], scale words [BN] (a byte per group q), x words
    [8, q, c, j] as loaded; each group's MMA partial times its scale and ``factor``."""
    w0, w1, w2, w3 = _take4(w)
    x0, x1, x2, x3 = _take4(gl.permute(xw, (0, 2, 3, 1)))  # [tok, c, j, q]
    acc += mma_v2(_a_operand(w0, BN, a_layout), _b_operand(x0, b_layout), zero) * (_e8m0(s & 255) * factor)[:, None]
    acc += mma_v2(_a_operand(w1, BN, a_layout), _b_operand(x1, b_layout), zero) * (
        _e8m0((s >> 8) & 255) * factor)[:, None]
    acc += mma_v2(_a_operand(w2, BN, a_layout), _b_operand(x2, b_layout), zero) * (
        _e8m0((s >> 16) & 255) * factor)[:, None]
    acc += mma_v2(_a_operand(w3, BN, a_layout), _b_operand(x3, b_layout), zero) * (
        _e8m0((s >> 24) & 255) * factor)[:, None]
    return acc


@gluon.jit
def _word_offsets(n0, rows_max, row_step, BN: gl.constexpr, words_layout: gl.constexpr):
    """Element offsets [BN, 4 c, 4 q] of the first chunk's words of rows n0.. (times row_step; clamped to
    rows_max - 1), before the row stride: (row index [BN, 1, 1] as int64, offset inside the row)."""
    r = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, words_layout)))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, words_layout)))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, words_layout)))
    rows = gl.minimum(r, rows_max - 1).to(gl.int64) * row_step
    return rows[:, None, None], c[None, :, None] * 4 + q[None, None, :]


@gluon.jit
def _x_offsets(x_layout: gl.constexpr, ONE_ROW: gl.constexpr):
    """Offsets [8 tokens, 4 q, 4 c, 4 j] of the first chunk's permuted x words (row stride applied by the
    caller: pass the token index back), and which to load: every token, or ONE_ROW (only column 0)."""
    t = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, x_layout))))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, x_layout))))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, x_layout))))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, x_layout))))
    inner = q[None, :, None, None] * 16 + c[None, None, :, None] * 4 + j[None, None, None, :]
    tok = t[:, None, None, None] + inner * 0
    ok = (tok == 0) if ONE_ROW else (tok >= 0)
    return tok, inner, ok


@gluon.jit
def w4_gemv_mma_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_wn, stride_sn, stride_xt, stride_yt, T,
                       WARPS: gl.constexpr, DEPTH: gl.constexpr, mma: gl.constexpr, a_layout: gl.constexpr,
                       b_layout: gl.constexpr, words_layout: gl.constexpr, x_layout: gl.constexpr):
    """y[t, n] = sum_k W[n, k] x[t, k]: W MXFP4 prepacked (int32 words [N, K/8], E8M0 scales [N, K/32], K a
    multiple of 128; scales as int32 [N, K/128], four groups each), x permuted fp16 as int32 pairs [8, K/2]
    (rows >= T zero), y fp32 [T, N]."""
    BN: gl.constexpr = 16 * WARPS
    n0 = gl.program_id(0) * BN
    # words [BN, 4 (c), 4 (group q)]: a lane's four words of a row are one 16-byte load
    rows, inner = _word_offsets(n0, N, 1, BN, words_layout)
    w_ptrs = w_ptr + rows * stride_wn + inner
    # scales: the chunk's four bytes of a row as one int32, shared by the quad
    r2 = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    s_ptrs = s_ptr + gl.minimum(r2, N - 1).to(gl.int64) * stride_sn
    # x words [8 tokens, 4 (q), 4 (c), 4 (j)]: per group a lane's B fragment is one 16-byte load
    tok, x_inner, _ = _x_offsets(x_layout, False)
    x_ptrs = x_ptr + tok * stride_xt + x_inner
    acc = gl.zeros([BN, 8], gl.float32, mma)
    zero = gl.zeros([BN, 8], gl.float32, mma)
    # Gluon does not pipeline a loop: with DEPTH 1 or 2 the loads of the chunk that far ahead are issued before
    # this chunk's math (past the end they re-read the last chunk, never out of bounds)
    if DEPTH == 0:
        for k0 in range(0, K, 128):
            acc = _chunk(acc, zero, gl.load(w_ptrs + k0 // 8), gl.load(s_ptrs + k0 // 128), gl.load(x_ptrs + k0 // 2),
                         1.0, BN, a_layout, b_layout)
    elif DEPTH == 1:
        wa, sa, xa = gl.load(w_ptrs), gl.load(s_ptrs), gl.load(x_ptrs)
        for k0 in range(0, K, 128):
            kn = gl.minimum(k0 + 128, K - 128)
            wb, sb, xb = gl.load(w_ptrs + kn // 8), gl.load(s_ptrs + kn // 128), gl.load(x_ptrs + kn // 2)
            acc = _chunk(acc, zero, wa, sa, xa, 1.0, BN, a_layout, b_layout)
            wa, sa, xa = wb, sb, xb
    else:
        k1 = gl.minimum(128, K - 128)
        wa, sa, xa = gl.load(w_ptrs), gl.load(s_ptrs), gl.load(x_ptrs)
        wb, sb, xb = gl.load(w_ptrs + k1 // 8), gl.load(s_ptrs + k1 // 128), gl.load(x_ptrs + k1 // 2)
        for k0 in range(0, K, 128):
            kn = gl.minimum(k0 + 256, K - 128)
            wc, sc, xc = gl.load(w_ptrs + kn // 8), gl.load(s_ptrs + kn // 128), gl.load(x_ptrs + kn // 2)
            acc = _chunk(acc, zero, wa, sa, xa, 1.0, BN, a_layout, b_layout)
            wa, sa, xa, wb, sb, xb = wb, sb, xb, wc, sc, xc
    out_rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    out_tok = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    gl.store(y_ptr + out_tok[None, :] * stride_yt + out_rows[:, None], acc * 16384.0,
             mask=(out_rows < N)[:, None] & (out_tok < T)[None, :])


@gluon.jit
def _gemm1_loads(k0, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, x_ptrs, x_ok):
    """GEMM1's loads of the chunk at k0: gate words and scale words, up words and scale words, x words."""
    return (gl.load(wg_ptrs + k0 // 8), gl.load(sg_ptrs + k0 // 128), gl.load(wu_ptrs + k0 // 8),
            gl.load(su_ptrs + k0 // 128), gl.load(x_ptrs + k0 // 2, mask=x_ok, other=0))


@gluon.jit
def w4_gemm1_mma_kernel(x_ptr, stride_xt, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn,
                        b_ptr, stride_be, h_ptr, stride_hm, ids_ptr, top_k, I, K, gate_step, up_offset,
                        HAS_BIAS: gl.constexpr, SWIGLU: gl.constexpr, H_PERMUTED: gl.constexpr, WARPS: gl.constexpr,
                        DEPTH: gl.constexpr, mma: gl.constexpr,
                        a_layout: gl.constexpr, b_layout: gl.constexpr, words_layout: gl.constexpr,
                        x_layout: gl.constexpr):
    """Decode GEMM1 of one (token, slot) pair and 16 * WARPS columns of h: act(x W_gate^T + b, x W_up^T + b)
    with W MXFP4 prepacked per expert (words [E, 2I, K/8], scale words [E, 2I, K/128]), x permuted fp16 as
    int32 pairs [T, K/2], h bf16 [T * top_k, I]. The token is the B operand's column 0."""
    BN: gl.constexpr = 16 * WARPS
    n_blocks = gl.cdiv(I, BN)
    pair = gl.program_id(0) // n_blocks
    n0 = (gl.program_id(0) % n_blocks) * BN
    e = gl.load(ids_ptr + pair).to(gl.int64)
    gate_rows, inner = _word_offsets(n0, I, gate_step, BN, words_layout)
    wg_ptrs = w_ptr + e * stride_we + gate_rows * stride_wn + inner
    wu_ptrs = wg_ptrs + up_offset * stride_wn
    r2 = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    gate2 = gl.minimum(r2, I - 1).to(gl.int64) * gate_step
    sg_ptrs = s_ptr + e * stride_se + gate2 * stride_sn
    su_ptrs = sg_ptrs + up_offset * stride_sn
    _, x_inner, x_ok = _x_offsets(x_layout, True)  # the pair's token: column 0
    x_ptrs = x_ptr + (pair // top_k).to(gl.int64) * stride_xt + x_inner
    acc_g = gl.zeros([BN, 8], gl.float32, mma)
    acc_u = gl.zeros([BN, 8], gl.float32, mma)
    zero = gl.zeros([BN, 8], gl.float32, mma)
    # loads DEPTH chunks ahead of the math (see w4_gemv_mma_kernel)
    if DEPTH == 0:
        for k0 in range(0, K, 128):
            ga, gsa, ua, usa, xa = _gemm1_loads(k0, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, x_ptrs, x_ok)
            acc_g = _chunk(acc_g, zero, ga, gsa, xa, 1.0, BN, a_layout, b_layout)
            acc_u = _chunk(acc_u, zero, ua, usa, xa, 1.0, BN, a_layout, b_layout)
    elif DEPTH == 1:
        ga, gsa, ua, usa, xa = _gemm1_loads(0, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, x_ptrs, x_ok)
        for k0 in range(0, K, 128):
            gb, gsb, ub, usb, xb = _gemm1_loads(gl.minimum(k0 + 128, K - 128), wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs,
                                                x_ptrs, x_ok)
            acc_g = _chunk(acc_g, zero, ga, gsa, xa, 1.0, BN, a_layout, b_layout)
            acc_u = _chunk(acc_u, zero, ua, usa, xa, 1.0, BN, a_layout, b_layout)
            ga, gsa, ua, usa, xa = gb, gsb, ub, usb, xb
    else:
        ga, gsa, ua, usa, xa = _gemm1_loads(0, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, x_ptrs, x_ok)
        gb, gsb, ub, usb, xb = _gemm1_loads(gl.minimum(128, K - 128), wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, x_ptrs,
                                            x_ok)
        for k0 in range(0, K, 128):
            gc, gsc, uc, usc, xc = _gemm1_loads(gl.minimum(k0 + 256, K - 128), wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs,
                                                x_ptrs, x_ok)
            acc_g = _chunk(acc_g, zero, ga, gsa, xa, 1.0, BN, a_layout, b_layout)
            acc_u = _chunk(acc_u, zero, ua, usa, xa, 1.0, BN, a_layout, b_layout)
            ga, gsa, ua, usa, xa, gb, gsb, ub, usb, xb = gb, gsb, ub, usb, xb, gc, gsc, uc, usc, xc
    gate = gl.sum(acc_g, axis=1) * 16384.0  # columns 1..7 are exact zeros (their x is zero)
    up = gl.sum(acc_u, axis=1) * 16384.0
    if HAS_BIAS:
        gate += gl.load(b_ptr + e * stride_be + gate2).to(gl.float32)
        up += gl.load(b_ptr + e * stride_be + gate2 + up_offset).to(gl.float32)
    if SWIGLU:
        g = gl.minimum(gate, SWIGLU_LIMIT)
        u = gl.minimum(gl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        act = (u + 1.0) * g / (1.0 + gl.exp(-SWIGLU_ALPHA * g))
    else:
        act = gate / (1.0 + gl.exp(-gate)) * up
    if H_PERMUTED:  # GEMM2's B operand as it loads it: fp16, each 8-block in permute_x's order
        gl.store(h_ptr + pair.to(gl.int64) * stride_hm + (r2 & -8) + ((r2 & 3) << 1) + ((r2 >> 2) & 1),
                 act.to(gl.float16), mask=r2 < I)
    else:
        gl.store(h_ptr + pair.to(gl.int64) * stride_hm + r2, act.to(gl.bfloat16), mask=r2 < I)


@gluon.jit
def _gemm2_step(it, t, top_k, chunks, steps, ids_ptr, weights_ptr, w_ptr, stride_we, w_rows, s_ptr, stride_se, s_rows,
                h_ptr, stride_hm, h_cols, h_ok):
    """Loads of step ``it`` (clamped to the last) of a token's GEMM2: (words, scale words, h words, router
    weight) of slot it // chunks, chunk it % chunks."""
    it = gl.minimum(it, steps - 1)
    pair = t * top_k + it // chunks
    k0 = (it % chunks) * 128
    e = gl.load(ids_ptr + pair).to(gl.int64)
    return (gl.load(w_ptr + e * stride_we + w_rows + k0 // 8), gl.load(s_ptr + e * stride_se + s_rows + k0 // 128),
            gl.load(h_ptr + pair.to(gl.int64) * stride_hm + h_cols + k0 // 2, mask=h_ok, other=0),
            gl.load(weights_ptr + pair))


@gluon.jit
def w4_gemm2_mma_kernel(h_ptr, stride_hm, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, b_ptr,
                        stride_be, weights_ptr, ids_ptr, out_ptr, stride_ot, top_k, H, K,
                        HAS_BIAS: gl.constexpr, WARPS: gl.constexpr, DEPTH: gl.constexpr, mma: gl.constexpr,
                        a_layout: gl.constexpr,
                        b_layout: gl.constexpr, words_layout: gl.constexpr, x_layout: gl.constexpr):
    """Decode GEMM2 of one token and 16 * WARPS columns of out: sum over its k slots, in order, of
    weight * (h_pair W2_e^T + b2_e). W2 MXFP4 prepacked per expert (words [E, H, K/8], scale words
    [E, H, K/128]); h permuted fp16 as int32 pairs [T * k, K/2] (permute_x of GEMM1's output)."""
    BN: gl.constexpr = 16 * WARPS
    n_blocks = gl.cdiv(H, BN)
    t = gl.program_id(0) // n_blocks
    n0 = (gl.program_id(0) % n_blocks) * BN
    rows, w_inner = _word_offsets(n0, H, 1, BN, words_layout)
    w_rows = rows * stride_wn + w_inner
    r2 = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    s_rows = gl.minimum(r2, H - 1).to(gl.int64) * stride_sn
    _, h_cols, h_ok = _x_offsets(x_layout, True)  # the pair's row: column 0
    zero = gl.zeros([BN, 8], gl.float32, mma)
    acc = gl.zeros([BN, 8], gl.float32, mma)
    # One loop over (slot, chunk), the same order on every run, with the loads DEPTH steps ahead crossing the
    # slots' ends (a slot's router weight rides on its groups' scales); past the last step they re-read it.
    chunks = K // 128
    steps = top_k * chunks
    if DEPTH == 0:
        for it in range(0, steps):
            wa, sa, ha, fa = _gemm2_step(it, t, top_k, chunks, steps, ids_ptr, weights_ptr, w_ptr, stride_we, w_rows,
                                         s_ptr, stride_se, s_rows, h_ptr, stride_hm, h_cols, h_ok)
            acc = _chunk(acc, zero, wa, sa, ha, fa, BN, a_layout, b_layout)
    elif DEPTH == 1:
        wa, sa, ha, fa = _gemm2_step(0, t, top_k, chunks, steps, ids_ptr, weights_ptr, w_ptr, stride_we, w_rows,
                                     s_ptr, stride_se, s_rows, h_ptr, stride_hm, h_cols, h_ok)
        for it in range(0, steps):
            wb, sb, hb, fb = _gemm2_step(it + 1, t, top_k, chunks, steps, ids_ptr, weights_ptr, w_ptr, stride_we,
                                         w_rows, s_ptr, stride_se, s_rows, h_ptr, stride_hm, h_cols, h_ok)
            acc = _chunk(acc, zero, wa, sa, ha, fa, BN, a_layout, b_layout)
            wa, sa, ha, fa = wb, sb, hb, fb
    else:
        wa, sa, ha, fa = _gemm2_step(0, t, top_k, chunks, steps, ids_ptr, weights_ptr, w_ptr, stride_we, w_rows,
                                     s_ptr, stride_se, s_rows, h_ptr, stride_hm, h_cols, h_ok)
        wb, sb, hb, fb = _gemm2_step(1, t, top_k, chunks, steps, ids_ptr, weights_ptr, w_ptr, stride_we, w_rows,
                                     s_ptr, stride_se, s_rows, h_ptr, stride_hm, h_cols, h_ok)
        for it in range(0, steps):
            wc, sc, hc, fc = _gemm2_step(it + 2, t, top_k, chunks, steps, ids_ptr, weights_ptr, w_ptr, stride_we,
                                         w_rows, s_ptr, stride_se, s_rows, h_ptr, stride_hm, h_cols, h_ok)
            acc = _chunk(acc, zero, wa, sa, ha, fa, BN, a_layout, b_layout)
            wa, sa, ha, fa, wb, sb, hb, fb = wb, sb, hb, fb, wc, sc, hc, fc
    total = gl.sum(acc, axis=1) * 16384.0  # columns 1..7 are exact zeros
    if HAS_BIAS:
        for j in range(0, top_k):
            pair = t * top_k + j
            e = gl.load(ids_ptr + pair).to(gl.int64)
            total += gl.load(weights_ptr + pair) * gl.load(b_ptr + e * stride_be + gl.minimum(r2, H - 1)).to(gl.float32)
    gl.store(out_ptr + t.to(gl.int64) * stride_ot + r2, total.to(gl.bfloat16), mask=r2 < H)


# ------------------------------------------------------------------------------------------------ NVFP4
# A 16-wide scale group must fill one k16 MMA, so the prepack moves nibbles, not only words: lane c's word of
# 32-chunk q holds, at nibble j + 4h, the code at physical 16 (j // 2) + 8 (j % 2) + 2c + h of the chunk (the
# logical order itself), and x is permuted to match. The E4M3 scales multiply the fp16 pairs before the MMA
# (code * 2^-14 * scale is exact in fp16, subnormals included), so the MMA accumulates straight into acc.


@gluon.jit
def _scaled_pair(w, j: gl.constexpr, scale2):
    """fp16 pair of nibbles j, j + 4 times its group's scale (``scale2``: int32, (scale, scale) as fp16)."""
    bits = gl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [_pair_bits(w, j), scale2],
                                     dtype=gl.int32, is_pure=True, pack=1)
    lo, hi = _halves(bits)
    return gl.join(lo, hi)


@gluon.jit
def _e4m3_pairs(sw):
    """Two E4M3 scale bytes (the low 16 bits of ``sw``) -> ((s0, s0), (s1, s1)) as int32 fp16 pairs."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 f; .reg .b16 a, b, lo, hi; mov.b32 {a, b}, $2; cvt.rn.f16x2.e4m3x2 f, a; "
        "mov.b32 {lo, hi}, f; mov.b32 $0, {lo, lo}; mov.b32 $1, {hi, hi}; }",
        "=r,=r,r", [sw], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _nvfp4_group(acc, wq, xq, scale_bits, BN: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr):
    """acc + one 32-chunk: words [BN, 4 c], x words [8, c, j], its two E4M3 scales (low 16 bits, [BN])."""
    g0, g1 = _e4m3_pairs(scale_bits & 0xFFFF)
    rows_layout: gl.constexpr = gl.SliceLayout(1, wq.type.layout)
    g0 = gl.convert_layout(g0, rows_layout)[:, None]  # the rows' own registers: no data moves
    g1 = gl.convert_layout(g1, rows_layout)[:, None]
    a = gl.join(gl.join(_scaled_pair(wq, 0, g0), _scaled_pair(wq, 1, g0)),
                gl.join(_scaled_pair(wq, 2, g1), _scaled_pair(wq, 3, g1)))
    a = gl.convert_layout(gl.reshape(gl.permute(a, (0, 4, 3, 1, 2)), [BN, 32]), a_layout)
    return mma_v2(a, _b_operand(xq, b_layout), acc)


@gluon.jit
def _chunk_nvfp4(acc, w, s01, s23, xw, BN: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr):
    """acc + one 128-wide K chunk of NVFP4: words [BN, 4 c, 4 q], the chunk's eight E4M3 scale bytes as two
    int32 [BN], x words [8, q, c, j]."""
    w0, w1, w2, w3 = _take4(w)
    x0, x1, x2, x3 = _take4(gl.permute(xw, (0, 2, 3, 1)))
    acc = _nvfp4_group(acc, w0, x0, s01, BN, a_layout, b_layout)
    acc = _nvfp4_group(acc, w1, x1, s01 >> 16, BN, a_layout, b_layout)
    acc = _nvfp4_group(acc, w2, x2, s23, BN, a_layout, b_layout)
    return _nvfp4_group(acc, w3, x3, s23 >> 16, BN, a_layout, b_layout)


@gluon.jit
def w4_gemv_nvfp4_kernel(w_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_wn, stride_sn, stride_xt, stride_yt, T,
                         WARPS: gl.constexpr, DEPTH: gl.constexpr, mma: gl.constexpr, a_layout: gl.constexpr,
                         b_layout: gl.constexpr, words_layout: gl.constexpr, x_layout: gl.constexpr):
    """y[t, n] = sum_k W[n, k] x[t, k] * global_scale: W NVFP4 prepacked (prepack_nvfp4: int32 words [N, K/8],
    scale words [N, K/64]), x permuted (permute_x_nvfp4), y fp32 [T, N] before the global scale."""
    BN: gl.constexpr = 16 * WARPS
    n0 = gl.program_id(0) * BN
    rows, inner = _word_offsets(n0, N, 1, BN, words_layout)
    w_ptrs = w_ptr + rows * stride_wn + inner
    r2 = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(1, words_layout)))
    s_ptrs = s_ptr + gl.minimum(r2, N - 1).to(gl.int64) * stride_sn
    tok, x_inner, _ = _x_offsets(x_layout, False)
    x_ptrs = x_ptr + tok * stride_xt + x_inner
    acc = gl.zeros([BN, 8], gl.float32, mma)
    if DEPTH == 0:
        for k0 in range(0, K, 128):
            acc = _chunk_nvfp4(acc, gl.load(w_ptrs + k0 // 8), gl.load(s_ptrs + k0 // 64), gl.load(s_ptrs + k0 // 64 + 1),
                               gl.load(x_ptrs + k0 // 2), BN, a_layout, b_layout)
    else:
        wa, sa, sb, xa = gl.load(w_ptrs), gl.load(s_ptrs), gl.load(s_ptrs + 1), gl.load(x_ptrs)
        for k0 in range(0, K, 128):
            kn = gl.minimum(k0 + 128, K - 128)
            wn, sn, sm, xn = (gl.load(w_ptrs + kn // 8), gl.load(s_ptrs + kn // 64), gl.load(s_ptrs + kn // 64 + 1),
                              gl.load(x_ptrs + kn // 2))
            acc = _chunk_nvfp4(acc, wa, sa, sb, xa, BN, a_layout, b_layout)
            wa, sa, sb, xa = wn, sn, sm, xn
    out_rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    out_tok = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    gl.store(y_ptr + out_tok[None, :] * stride_yt + out_rows[:, None], acc * 16384.0,
             mask=(out_rows < N)[:, None] & (out_tok < T)[None, :])


def _nvfp4_physical(chunk, q, c, j, h):
    """Physical K of the code (and x) the kernel takes for pair j, half h, lane c, 32-chunk q of a 128-chunk:
    the fragment's logical order 16 (j // 2) + 8 (j % 2) + 2c + h inside its 32-chunk."""
    return (CHUNK * chunk + 32 * q + 16 * (j // 2) + 8 * (j % 2) + 2 * c + h).reshape(-1)


def _nvfp4_order(k_padded: int, device=None) -> torch.Tensor:
    """Physical code index of each (chunk, word 4c + q, nibble n) slot: [Kp] (codes in prepacked order)."""
    chunk, c, q, n = torch.meshgrid(torch.arange(k_padded // CHUNK), torch.arange(4), torch.arange(4), torch.arange(8),
                                    indexing="ij")
    return _nvfp4_physical(chunk, q, c, n % 4, n // 4).to(device)


def prepack_nvfp4(data: torch.Tensor, scales: torch.Tensor):
    """NVFP4 bytes [N, K/2] and E4M3 scale bytes [N, K/16] -> (int32 words [N, Kp/8], int32 scale words
    [N, Kp/64]), K padded to 128 with zero codes and unit scales (0x38)."""
    from moekit.formats import fp4
    N, half_k = data.shape
    pad = -half_k % (CHUNK // 2)
    codes = fp4.unpack(F.pad(data, (0, pad)))  # [N, Kp] uint8 codes, element 2i in the low nibble
    codes = codes[:, _nvfp4_order(codes.shape[1], codes.device)].reshape(N, -1, 2)  # [.., byte, nibble]
    packed = codes[..., 0] | (codes[..., 1] << 4)  # nibble 2b low, 2b + 1 high: nibble n at bits 4n of the word
    s = F.pad(scales.view(torch.uint8), (0, pad // 8), value=0x38)
    return packed.contiguous().view(torch.int32), s.contiguous().view(torch.int32)


def permute_x_nvfp4(x: torch.Tensor, k_padded: int) -> torch.Tensor:
    """x [T, K] -> fp16 int32 pairs [max(T, 8), Kp/2]: int32 (chunk, q, c, j) holds x at the physical
    positions of the codes the kernel pairs with it (h = 0, 1)."""
    T, K = x.shape
    xp = torch.zeros(max(T, 8), k_padded, dtype=torch.float16, device=x.device)
    xp[:T, :K] = x.to(torch.float16)
    return xp[:, _nvfp4_x_order(k_padded, x.device)].contiguous().view(torch.int32)


def _nvfp4_x_order(k_padded: int, device=None) -> torch.Tensor:
    """Physical K of each fp16 slot (chunk, q, c, j, h) of permute_x_nvfp4's rows: [Kp]."""
    chunk, q, c, j, h = torch.meshgrid(torch.arange(k_padded // CHUNK), torch.arange(4), torch.arange(4),
                                       torch.arange(4), torch.arange(2), indexing="ij")
    return _nvfp4_physical(chunk, q, c, j, h).to(device)


def w4_gemv_nvfp4(words, scale_words, xw, y, T, warps=4, depth=1):
    N, K = words.shape[0], words.shape[1] * 8
    grid = (-(-N // (16 * warps)),)
    return w4_gemv_nvfp4_kernel[grid](words, scale_words, xw, y, N, K, words.stride(0), scale_words.stride(0),
                                      xw.stride(0), y.stride(0), T, warps, depth, *layouts(warps), num_warps=warps)


def _linear(reg, lane, warp, shape):
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[], shape=shape)


def layouts(warps):
    """(mma, its A and B operands, words [BN, 4 c, 4 q], x words [8, 4 q, 4 c, 4 j]) layouts: lanes 0-1 are c (the
    quad), lanes 2-4 the fragment row g (or token), the register bit of the rows the row g + 8, the warps
    16-row slabs -- the mma fragment's own placement."""
    slabs = [16 << i for i in range(warps.bit_length() - 1)]
    words = _linear([[0, 0, 1], [0, 0, 2], [8, 0, 0]], [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                    [[s, 0, 0] for s in slabs], [16 * warps, 4, 4])
    x = _linear([[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 2, 0, 0]],
                [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
                [[0, 0, 0, 0] for _ in slabs], [8, 4, 4, 4])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    return (mma, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
            gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2), words, x)


def prepack(data: torch.Tensor, scales: torch.Tensor):
    """MXFP4 bytes [N, K/2] and scale bytes [N, K/32] -> (int32 words [N, Kp/8], int32 scale words
    [N, Kp/128]) with K padded to a multiple of 128 (zero codes, scale 1) and each chunk's words ordered lane
    by lane (4c + q <- 4q + c)."""
    N, half_k = data.shape
    pad = -half_k % (CHUNK // 2)
    words = F.pad(data, (0, pad)).view(torch.int32).reshape(N, -1, 4, 4).transpose(-1, -2).reshape(N, -1)
    return words.contiguous(), F.pad(scales, (0, pad // 16), value=127).contiguous().view(torch.int32)


def permute_x(x: torch.Tensor, k_padded: int) -> torch.Tensor:
    """x [T, K] -> fp16 [max(T, 8), Kp] (zero rows and columns past x's) as int32 pairs, each 8-block ordered
    [0, 4, 1, 5, 2, 6, 3, 7]."""
    T, K = x.shape
    xp = torch.zeros(max(T, 8), k_padded, dtype=torch.float16, device=x.device)
    xp[:T, :K] = x.to(torch.float16)
    return xp.reshape(xp.shape[0], -1, 2, 4).transpose(-1, -2).reshape(xp.shape[0], -1).contiguous().view(torch.int32)


def w4_gemv_mma(words, scales, xw, y, T, warps=4, depth=1):
    N, K = words.shape[0], words.shape[1] * 8
    grid = (-(-N // (16 * warps)),)
    return w4_gemv_mma_kernel[grid](words, scales, xw, y, N, K, words.stride(0), scales.stride(0), xw.stride(0),
                                    y.stride(0), T, warps, depth, *layouts(warps), num_warps=warps)


def w4_gemm1_mma(xw, words, scale_words, bias, h, ids, top_k, swiglu, warps=4, depth=1):
    """words [E, 2I, Kp/8], scale_words [E, 2I, Kp/128] (prepack per expert), xw = permute_x int32 [T, Kp/2];
    h bf16 [T * k, I], or fp16 [T * k, Ip] (zeroed past I) written in permute_x's order for w4_gemm2_mma."""
    E, two_i, kw = words.shape
    inter = two_i // 2
    step, up = (2, 1) if swiglu else (1, inter)
    grid = (ids.numel() * -(-inter // (16 * warps)),)
    b = bias if bias is not None else h
    return w4_gemm1_mma_kernel[grid](
        xw, xw.stride(0), words, words.stride(0), words.stride(1), scale_words, scale_words.stride(0),
        scale_words.stride(1), b, b.stride(0), h, h.stride(0), ids, top_k, inter, kw * 8, step, up,
        bias is not None, swiglu, h.dtype == torch.float16, warps, depth, *layouts(warps), num_warps=warps)


def w4_gemm2_mma(hw, words, scale_words, bias, weights, ids, out, top_k, warps=4, depth=1):
    """words [E, H, Kp/8], scale_words [E, H, Kp/128] (prepack per expert), hw = permute_x(h) [T*k, Kp/2]."""
    E, hidden, kw = words.shape
    grid = (out.shape[0] * -(-hidden // (16 * warps)),)
    b = bias if bias is not None else out
    return w4_gemm2_mma_kernel[grid](
        hw, hw.stride(0), words, words.stride(0), words.stride(1), scale_words, scale_words.stride(0),
        scale_words.stride(1), b, b.stride(0), weights, ids, out, out.stride(0), top_k, hidden, kw * 8,
        bias is not None, warps, depth, *layouts(warps), num_warps=warps)


def _loop_ops(listing: str) -> list[Counter]:
    label, branch = re.compile(r"^\s*(\.L_x_\d+):"), re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
    instruction = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*)")
    starts, body, loops = {}, [], []
    for line in listing.splitlines():
        if m := label.match(line):
            starts[m.group(1)] = len(body)
        elif m := instruction.match(line):
            body.append(m.group(1))
            if (b := branch.search(m.group(1))) and b.group(1) in starts:
                loops.append(Counter((i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0]
                                     for i in body[starts[b.group(1)]:]))
    return loops


def _compile_offline():
    import sm90_compile as S
    from moekit import _sass
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction
    driver.set_active(S._Sm90Driver())
    JITFunction.run = S._compile_only
    N, K = 5760, 2944
    words, scales = torch.zeros(N, K // 8, dtype=torch.int32), torch.zeros(N, K // 128, dtype=torch.int32)
    xw, y = torch.zeros(8, K // 2, dtype=torch.int32), torch.zeros(1, N)
    E, I = 4, N // 2
    words1, scales1 = words.reshape(1, N, -1).expand(E, N, -1), scales.reshape(1, N, -1).expand(E, N, -1)
    bias, h, ids = torch.zeros(E, N, dtype=torch.bfloat16), torch.zeros(4, I, dtype=torch.bfloat16), torch.zeros(
        4, dtype=torch.int32)
    swords = torch.zeros(N, K // 64, dtype=torch.int32)
    runs = [(f"gemv nvfp4 warps={w} depth={d}", lambda w=w, d=d: w4_gemv_nvfp4(words, swords, xw, y, 1, w, d))
            for w, d in ((4, 0), (4, 1))]
    for w, d in VARIANTS:
        runs += [(f"gemv warps={w} depth={d}", lambda w=w, d=d: w4_gemv_mma(words, scales, xw, y, 1, w, d)),
                 (f"gemm1 swiglu+bias warps={w} depth={d}",
                  lambda w=w, d=d: w4_gemm1_mma(xw[:1], words1, scales1, bias, h, ids, 4, True, w, d)),
                 (f"gemm1 swiglu+bias, h for GEMM2, warps={w} depth={d}",
                  lambda w=w, d=d: w4_gemm1_mma(xw[:1], words1, scales1, bias, h.half(), ids, 4, True, w, d)),
                 (f"gemm2 bias warps={w} depth={d}",
                  lambda w=w, d=d: w4_gemm2_mma(xw, words1, scales1, bias, torch.zeros(4), ids, h[:1], 4, w, d))]
    for warps, run in runs:
        S.BUILT.clear()
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - report and go on
            while exc.__cause__ is not None:
                exc = exc.__cause__
            print(f"{warps}: {type(exc).__name__}: {str(exc)[-2500:]}")
            continue
        for name, k in S.BUILT:
            ttgir, listing = k.asm.get("ttgir", ""), _sass.sass(k.asm["cubin"]) or ""
            for ops in sorted(_loop_ops(listing), key=lambda o: -sum(o.values()))[:1]:
                if sum(ops.values()) > 8:
                    print(f"{warps} {name}: {S.resource_usage(k)} smem={k.metadata.shared} "
                          f"local_alloc={ttgir.count('local_alloc')} loop {sum(ops.values())} instructions per 128 K "
                          f"(x 2 rows per thread = 64 codes): {ops.most_common(16)}")
            open(f"/tmp/w4_mma_{warps}.sass", "w").write(listing)
            open(f"/tmp/w4_mma_{warps}.ttgir", "w").write(ttgir)


def _gpu_check_and_time():
    """gpt-oss-120b MXFP4 (4 layers of random weights): each section checks a prototype kernel against float64
    or moekit and times both in graphs of 8 calls over the 4 layers; a failing section does not stop the rest."""
    from moekit import _experts_triton as X, presets
    from moekit.formats import quantize_experts
    spec = presets.get("gpt-oss-120b") if DEVICE == "cuda" else presets.get("gpt-oss-120b").scaled(256, 256, 16)
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    stacks = [(quantize_experts(torch.randn(E, 2 * I, H, device=DEVICE, dtype=torch.bfloat16) * H ** -0.5, "mxfp4"),
               quantize_experts(torch.randn(E, H, I, device=DEVICE, dtype=torch.bfloat16) * I ** -0.5, "mxfp4"))
              for _ in range(4)]
    layers = [(X.WeightOperand.of(a), X.WeightOperand.of(b)) for a, b in stacks]
    for section in (_gpu_gemv, _gpu_gemm1, _gpu_gemm2, _gpu_chain):
        try:
            section(spec, stacks, layers)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{section.__name__}: {type(exc).__name__}: {str(exc)[-800:]}", flush=True)
    del stacks, layers
    torch.cuda.empty_cache()
    try:
        _gpu_gemv_nvfp4()
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"_gpu_gemv_nvfp4: {type(exc).__name__}: {str(exc)[-800:]}", flush=True)


def _gemv_section(label, packed, permute, gemv, dequantize, x, variants):
    """Accuracy of a GEMV prototype vs float64 (T = 1, 3, 8) and its time per variant on 4 layers' ``packed``
    (words, scale words, the 4-bit tensor) at T=1; returns the bytes it streams per call."""
    from moekit.bench.timing import graph_time_us
    kp = packed[0][0].shape[1] * 8
    rows = packed[0][0].shape[0]
    for T in (1, 3, 8):
        xt = torch.randn(T, x.shape[1], device=DEVICE) * 2
        ref = xt.half().double() @ dequantize(packed[0][2], torch.float64).T
        y = torch.full((T, rows), float("nan"), device=DEVICE)
        gemv(packed[0][0], packed[0][1], permute(xt, kp), y, T)
        torch.cuda.synchronize()
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        print(f"{label} GEMV T={T}: max |y - ref| / max |ref| = {err:.2e}  nan={torch.isnan(y).any().item()}",
              flush=True)
    xw, y = permute(x, kp), torch.empty(1, rows, device=DEVICE)
    nbytes = packed[0][0].numel() * 4 + packed[0][1].numel() * 4
    for warps, depth in variants:
        us = graph_time_us([lambda p=packed[i % 4]: gemv(p[0], p[1], xw, y, 1, warps, depth) for i in range(8)])
        print(f"{label} GEMV prototype warps={warps} depth={depth}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s",
              flush=True)
    return nbytes


def _gpu_gemv(spec, stacks, layers):
    """T=1's four experts' w13 rows (GEMM1's bytes) as one GEMV: accuracy vs float64 at T = 1, 3, 8, and time
    against moekit's CUDA-core GEMM1 on the same bytes."""
    from moekit import _experts_triton as X
    from moekit.bench.experts import routes
    from moekit.bench.timing import graph_time_us
    from moekit.expert_configs import choose
    from moekit.formats import mxfp4
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    x = torch.randn(1, H, device=DEVICE, dtype=torch.bfloat16)
    _, ids = routes(spec, 1, DEVICE)
    flat = ids.reshape(-1)
    packed = []
    for w13, _ in stacks:
        data = w13.data[flat.long()].reshape(k * 2 * I, H // 2)
        sc = w13.scales[flat.long()].reshape(k * 2 * I, H // 32)
        packed.append((*prepack(data, sc), mxfp4.MXFP4Tensor(data, sc, (k * 2 * I, H))))
    nbytes = _gemv_section("MXFP4", packed, permute_x, lambda *a: w4_gemv_mma(*a), mxfp4.dequantize, x, VARIANTS)
    cfg, _ = choose(1, E, k, 2 * I, H, x.device, x.dtype, layers[0][0].format)
    h = torch.empty(k, I, device=DEVICE, dtype=torch.bfloat16)
    us = graph_time_us([lambda w=layers[i % 4]: X._gemv1(x, w[0], None, h, flat, None, E, spec.activation, k,
                                                          cfg.gemm1) for i in range(8)])
    print(f"moekit GEMM1 (CUDA cores, {cfg.gemm1}): {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s (same bytes)", flush=True)


def _gpu_gemm1(spec, stacks, layers):
    """The MoE GEMM1 prototype (per pair, SwiGLU + biases) against moekit's on the same routes: h vs float64,
    and time, T = 1, 4, 16."""
    from moekit import _experts_triton as X
    from moekit.bench.experts import routes
    from moekit.bench.timing import graph_time_us
    from moekit.expert_configs import choose
    from moekit.formats import mxfp4
    from moekit.reference import swiglu_oai
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    biases = [torch.randn(E, 2 * I, device=DEVICE, dtype=torch.bfloat16) * 0.1 for _ in stacks]
    packs = []
    for w13, _ in stacks:
        words, scale_words = prepack(w13.data.reshape(E * 2 * I, H // 2), w13.scales.reshape(E * 2 * I, H // 32))
        packs.append((words.reshape(E, 2 * I, -1), scale_words.reshape(E, 2 * I, -1)))
    kp = packs[0][0].shape[2] * 8
    for T in (1, 4, 16):
        x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
        _, ids = routes(spec, T, DEVICE)
        flat = ids.reshape(-1).contiguous()
        xw = permute_x(x, kp)
        h_new = torch.full((T * k, I), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        h_old = torch.full_like(h_new, float("nan"))
        cfg, _ = choose(T, E, k, 2 * I, H, x.device, x.dtype, layers[0][0].format)
        run_new = lambda i=0, w=4, d=1: w4_gemm1_mma(xw, packs[i][0], packs[i][1], biases[i], h_new, flat, k,  # noqa: E731
                                                     True, w, d)
        run_old = lambda i=0: X._gemv1(x, layers[i][0], biases[i], h_old, flat, None, E, "swiglu_oai", k,  # noqa: E731
                                       cfg.gemm1)
        run_new()
        run_old()
        torch.cuda.synchronize()
        ref = torch.empty(T * k, I, dtype=torch.float64, device=DEVICE)
        for p in range(T * k):
            e = int(flat[p])
            w = mxfp4.dequantize(mxfp4.MXFP4Tensor(stacks[0][0].data[e], stacks[0][0].scales[e], (2 * I, H)),
                                 torch.float64)
            ref[p] = swiglu_oai(x[p // k].double() @ w.T + biases[0][e].double())
        e_new, e_old = (((h.double() - ref).norm() / ref.norm()).item() for h in (h_new, h_old))  # before the
        t_new = {v: graph_time_us([lambda i=i, v=v: run_new(i % 4, *v) for i in range(8)]) for v in VARIANTS}  # timed
        t_old = graph_time_us([lambda i=i: run_old(i % 4) for i in range(8)])  # calls overwrite h with other layers'
        print(f"GEMM1 T={T}: moekit {t_old:.1f} us (rel err {e_old:.1e}) [{cfg.gemm1}]; prototype rel err "
              f"{e_new:.1e}, (warps, depth): " + ", ".join(f"{v} {us:.1f}" for v, us in t_new.items()), flush=True)


def _gpu_gemm2(spec, stacks, layers):
    """The MoE GEMM2 prototype (per token, slots in order, biases) against moekit's on the same routes and h:
    out vs float64, and time, T = 1, 4, 16."""
    from moekit import _experts_triton as X
    from moekit.bench.experts import routes
    from moekit.bench.timing import graph_time_us
    from moekit.expert_configs import choose
    from moekit.formats import mxfp4
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    biases = [torch.randn(E, H, device=DEVICE, dtype=torch.bfloat16) * 0.1 for _ in stacks]
    packs = []
    for _, w2 in stacks:
        words, scale_words = prepack(w2.data.reshape(E * H, I // 2), w2.scales.reshape(E * H, I // 32))
        packs.append((words.reshape(E, H, -1), scale_words.reshape(E, H, -1)))
    kp = packs[0][0].shape[2] * 8
    for T in (1, 4, 16):
        tw, ids = routes(spec, T, DEVICE)
        flat, wflat = ids.reshape(-1).contiguous(), tw.reshape(-1).contiguous()
        h = torch.randn(T * k, I, device=DEVICE, dtype=torch.bfloat16)
        hw = permute_x(h, kp)
        out_new = torch.full((T, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        out_old = torch.full_like(out_new, float("nan"))
        cfg, _ = choose(T, E, k, 2 * I, H, h.device, h.dtype, layers[0][0].format)
        run_new = lambda i=0, w=4, d=1: w4_gemm2_mma(hw, packs[i][0], packs[i][1], biases[i], wflat, flat,  # noqa: E731
                                                     out_new, k, w, d)
        run_old = lambda i=0: X._gemv2_tokens(h, layers[i][1], biases[i], wflat, flat, None, E, out_old, k,  # noqa: E731
                                              cfg.gemm2)
        run_new()
        run_old()
        torch.cuda.synchronize()
        ref = torch.zeros(T, H, dtype=torch.float64, device=DEVICE)
        for p in range(T * k):
            e = int(flat[p])
            w = mxfp4.dequantize(mxfp4.MXFP4Tensor(stacks[0][1].data[e], stacks[0][1].scales[e], (H, I)),
                                 torch.float64)
            ref[p // k] += wflat[p].double() * (h[p].double() @ w.T + biases[0][e].double())
        e_new, e_old = (((o.double() - ref).norm() / ref.norm()).item() for o in (out_new, out_old))
        t_new = {v: graph_time_us([lambda i=i, v=v: run_new(i % 4, *v) for i in range(8)]) for v in VARIANTS}
        t_old = graph_time_us([lambda i=i: run_old(i % 4) for i in range(8)])
        print(f"GEMM2 T={T}: moekit {t_old:.1f} us (rel err {e_old:.1e}) [{cfg.gemm2}]; prototype rel err "
              f"{e_new:.1e}, (warps, depth): " + ", ".join(f"{v} {us:.1f}" for v, us in t_new.items()), flush=True)


def _gpu_chain(spec, stacks, layers, variant=(4, 1)):
    """The whole decode call: x prepared (permute_x, torch ops here), GEMM1 writing h for GEMM2 in its order,
    GEMM2 -- against moekit.fused_experts on the same MXFP4 weights, routes and biases (T = 1, 4, 16)."""
    from moekit import fused_experts
    from moekit.bench.experts import routes
    from moekit.bench.timing import graph_time_us
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    b13 = [torch.randn(E, 2 * I, device=DEVICE, dtype=torch.bfloat16) * 0.1 for _ in stacks]
    b2 = [torch.randn(E, H, device=DEVICE, dtype=torch.bfloat16) * 0.1 for _ in stacks]
    p13, p2 = [], []
    for w13, w2 in stacks:
        words, sw = prepack(w13.data.reshape(E * 2 * I, H // 2), w13.scales.reshape(E * 2 * I, H // 32))
        p13.append((words.reshape(E, 2 * I, -1), sw.reshape(E, 2 * I, -1)))
        words, sw = prepack(w2.data.reshape(E * H, I // 2), w2.scales.reshape(E * H, I // 32))
        p2.append((words.reshape(E, H, -1), sw.reshape(E, H, -1)))
    kp1, kp2 = p13[0][0].shape[2] * 8, p2[0][0].shape[2] * 8
    for T in (1, 4, 16):
        x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
        tw, ids = routes(spec, T, DEVICE)
        flat, wflat = ids.reshape(-1).contiguous(), tw.reshape(-1).contiguous()
        hp = torch.zeros(max(T * k, 8), kp2, device=DEVICE, dtype=torch.float16)
        out = torch.empty(T, H, device=DEVICE, dtype=torch.bfloat16)
        xw_fixed = permute_x(x, kp1)

        def chain(i, xw=None):
            xw = permute_x(x, kp1) if xw is None else xw
            w4_gemm1_mma(xw, *p13[i], b13[i], hp, flat, k, True, *variant)
            w4_gemm2_mma(hp.view(torch.int32), *p2[i], b2[i], wflat, flat, out, k, *variant)
            return out

        def moekit(i):
            return fused_experts(x, stacks[i][0], stacks[i][1], tw, ids, activation="swiglu_oai", w13_bias=b13[i],
                                 w2_bias=b2[i])

        ref = moekit(0).double()
        got = chain(0).double()
        diff = ((got - ref).norm() / ref.norm()).item()
        t_chain = graph_time_us([lambda i=i: chain(i % 4) for i in range(8)])
        t_kernels = graph_time_us([lambda i=i: chain(i % 4, xw_fixed) for i in range(8)])
        t_moekit = graph_time_us([lambda i=i: moekit(i % 4) for i in range(8)])
        print(f"decode call T={T}: moekit {t_moekit:.1f} us; prototype {t_chain:.1f} us with x prepared by torch ops, "
              f"{t_kernels:.1f} us the two kernels alone; rel diff vs moekit {diff:.1e}", flush=True)


def _gpu_gemv_nvfp4():
    """qwen3-30b-a3b NVFP4 at T=1: the eight experts' w13 rows as one GEMV through the NVFP4 prototype,
    accuracy vs float64 (T = 1, 3, 8) and time against moekit's CUDA-core GEMM1 on the same bytes."""
    from moekit import _experts_triton as X, presets
    from moekit.bench.experts import routes
    from moekit.bench.timing import graph_time_us
    from moekit.expert_configs import choose
    from moekit.formats import nvfp4, quantize_experts
    spec = presets.get("qwen3-30b-a3b") if DEVICE == "cuda" else presets.get("qwen3-30b-a3b").scaled(256, 128, 16)
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    stacks = [quantize_experts(torch.randn(E, 2 * I, H, device=DEVICE, dtype=torch.bfloat16) * H ** -0.5, "nvfp4")
              for _ in range(4)]
    x = torch.randn(1, H, device=DEVICE, dtype=torch.bfloat16)
    _, ids = routes(spec, 1, DEVICE)
    flat = ids.reshape(-1)
    packed = []
    for w13 in stacks:
        data = w13.data[flat.long()].reshape(k * 2 * I, H // 2)
        sc = w13.linear_scales()[flat.long()].reshape(k * 2 * I, H // 16)
        packed.append((*prepack_nvfp4(data, sc), nvfp4.NVFP4Tensor(data, sc, torch.ones((), device=DEVICE),
                                                                   (k * 2 * I, H))))
    nbytes = _gemv_section("NVFP4", packed, permute_x_nvfp4, lambda *a: w4_gemv_nvfp4(*a), nvfp4.dequantize, x,
                           ((1, 0), (1, 1), (2, 1), (4, 0), (4, 1)))
    ops = [X.WeightOperand.of(w) for w in stacks]
    cfg, _ = choose(1, E, k, 2 * I, H, x.device, x.dtype, ops[0].format)
    h = torch.empty(k, I, device=DEVICE, dtype=torch.bfloat16)
    us = graph_time_us([lambda w=ops[i % 4]: X._gemv1(x, w, None, h, flat, None, E, spec.activation, k, cfg.gemm1)
                        for i in range(8)])
    print(f"moekit NVFP4 GEMM1 (CUDA cores, {cfg.gemm1}): {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s (same bytes)",
          flush=True)


def _unpack(words, scale_words, k_true):
    """Inverse of prepack: the MXFP4 tensor [N, k_true] of prepacked words and scale words."""
    from moekit.formats import mxfp4
    N = words.shape[0]
    data = words.reshape(N, -1, 4, 4).transpose(-1, -2).reshape(N, -1).contiguous().view(torch.uint8)
    scales = scale_words.contiguous().view(torch.uint8)
    return mxfp4.MXFP4Tensor(data[:, :k_true // 2].contiguous(), scales[:, :k_true // 32].contiguous(), (N, k_true))


def _unpermute(xw):
    """Inverse of permute_x: fp32 [rows, Kp]."""
    x = xw.view(torch.float16).float()
    return x.reshape(x.shape[0], -1, 4, 2).transpose(-1, -2).reshape(x.shape[0], -1)


def _dryrun():
    """CPU: the GPU script's sections on a scaled-down gpt-oss with the three kernels replaced by their torch
    semantics (through the inverse layouts) and the timer by one call: catches a broken script before it
    costs device time, and pins what each kernel computes."""
    import moekit.bench.timing as timing
    from moekit.formats import mxfp4
    global DEVICE, w4_gemv_mma, w4_gemm1_mma, w4_gemm2_mma
    DEVICE = "cpu"
    torch.cuda.synchronize = lambda *a: None
    timing.graph_time_us = lambda fns, **kw: [fn() for fn in fns] and 1.0

    def gemv(words, scales, xw, y, T, warps=4, depth=1):
        w = mxfp4.dequantize(_unpack(words, scales, words.shape[1] * 8), torch.float32)
        y.copy_((_unpermute(xw)[:T] @ w.T).to(y.dtype))

    def gemm1(xw, words, scale_words, bias, h, ids, top_k, swiglu, warps=4, depth=1):
        from moekit.reference import silu_and_mul, swiglu_oai
        x = _unpermute(xw)
        for p, e in enumerate(ids.tolist()):
            w = mxfp4.dequantize(_unpack(words[e], scale_words[e], words.shape[2] * 8), torch.float32)
            g = x[p // top_k] @ w.T + (bias[e].float() if bias is not None else 0)
            act = (swiglu_oai if swiglu else silu_and_mul)(g).float()
            if h.dtype == torch.float16:
                row = torch.zeros(h.shape[1])
                row[:act.numel()] = act
                h[p] = row.reshape(-1, 2, 4).transpose(-1, -2).reshape(-1).half()  # permute_x's order
            else:
                h[p] = act.to(h.dtype)

    def gemm2(hw, words, scale_words, bias, weights, ids, out, top_k, warps=4, depth=1):
        h = _unpermute(hw)
        total = torch.zeros(out.shape, dtype=torch.float64)
        for p, e in enumerate(ids.tolist()):
            w = mxfp4.dequantize(_unpack(words[e], scale_words[e], words.shape[2] * 8), torch.float64)
            total[p // top_k] += float(weights[p]) * (h[p].double() @ w.T + (bias[e].double() if bias is not None else 0))
        out.copy_(total.to(out.dtype))

    def gemv_nvfp4(words, scale_words, xw, y, T, warps=4, depth=1):
        from moekit.formats import fp4
        kp = words.shape[1] * 8
        codes = torch.stack([(words.view(torch.uint8) & 15), words.view(torch.uint8) >> 4], -1).reshape(len(words), -1)
        phys = torch.empty_like(codes)
        phys[:, _nvfp4_order(kp)] = codes
        scales = scale_words.view(torch.uint8).view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
        w = fp4.decode(phys).float() * scales
        x = torch.empty(xw.shape[0], kp)
        x[:, _nvfp4_x_order(kp)] = xw.view(torch.float16).float()
        y.copy_(x[:T] @ w.T)

    w4_gemv_mma, w4_gemm1_mma, w4_gemm2_mma = gemv, gemm1, gemm2
    global w4_gemv_nvfp4
    w4_gemv_nvfp4 = gemv_nvfp4
    _gpu_check_and_time()


def _emulated_gemv(words, xf, pair_scale, group_scale):
    """What a GEMV prototype computes, from its prepacked words and permuted x (fp16 values, float64 [8, Kp]),
    group by group in the fragment's K order: pair_scale(chunk, group, j) scales the codes (NVFP4),
    group_scale(chunk, group) the group's partial (MXFP4); float64 [8, N]."""
    from moekit.formats import fp4
    N, kp = words.shape[0], words.shape[1] * 8
    values = fp4.decode(torch.arange(16, dtype=torch.uint8)).double()
    y = torch.zeros(8, N, dtype=torch.float64)
    for ch in range(kp // CHUNK):
        for grp in range(4):
            a, b = torch.zeros(N, 32, dtype=torch.float64), torch.zeros(32, 8, dtype=torch.float64)
            for c in range(4):
                wd = words[:, ch * 16 + 4 * c + grp].long() & 0xFFFFFFFF
                for j in range(4):
                    for h in range(2):
                        kl = 16 * (j // 2) + 8 * (j % 2) + 2 * c + h
                        a[:, kl] = values[(wd >> (4 * (j + 4 * h))) & 15] * pair_scale(ch, grp, j)
                        b[kl] = xf[:, ch * CHUNK + 2 * (grp * 16 + c * 4 + j) + h]
            y += (a @ b).T * group_scale(ch, grp)
    return y


def _emulate():
    """CPU: the prototypes' index math (prepacked words, permuted x, the fragment's K order, the scale bytes)
    in torch against float64 -- the layouts only move work between threads, so this is what the GPU computes."""
    from moekit.formats import mxfp4, nvfp4
    torch.manual_seed(0)
    T = 3
    x = torch.randn(T, 2880)
    q = mxfp4.quantize(torch.randn(16, 2880))
    words, scale_words = prepack(q.data, q.scales)
    exps = scale_words.view(torch.uint8).double()
    y = _emulated_gemv(words, permute_x(x, words.shape[1] * 8).view(torch.float16).double(), lambda *a: 1.0,
                       lambda ch, grp: torch.pow(2.0, exps[:, 4 * ch + grp] - 127))
    ref = x.half().double() @ mxfp4.dequantize(q, torch.float64).T
    print(f"MXFP4: emulated kernel vs float64: max rel err {((y[:T] - ref).abs().max() / ref.abs().max()).item():.1e}")
    x = torch.randn(T, 2048)
    q = nvfp4.quantize(torch.randn(16, 2048))
    words, scale_words = prepack_nvfp4(q.data, q.linear_scales())
    sf = scale_words.view(torch.uint8).view(torch.float8_e4m3fn).double()
    y = _emulated_gemv(words, permute_x_nvfp4(x, words.shape[1] * 8).view(torch.float16).double(),
                       lambda ch, grp, j: sf[:, ch * 8 + 2 * grp + j // 2], lambda *a: 1.0)
    ref = x.half().double() @ (nvfp4.dequantize(q, torch.float64) * q.global_scale.double()).T
    print(f"NVFP4: emulated kernel vs float64: max rel err {((y[:T] - ref).abs().max() / ref.abs().max()).item():.1e}")


if __name__ == "__main__":
    {"compile": _compile_offline, "emulate": _emulate, "dryrun": _dryrun}.get(sys.argv[1] if sys.argv[1:] else "",
                                                                          _gpu_check_and_time)()
