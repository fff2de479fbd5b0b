"""Decode expert GEMMs on the CUDA cores: one (token, slot) pair per GEMM1 program, one token per
GEMM2 program (its k slots summed in order, written once).

At a few tokens the layer streams weights. A tensor-core tile wastes 15 of its 16 rows there, and a
4-bit weight tile must be rearranged into the MMA operand layout after its dequantization; here
each weight byte is decoded in the layout it was loaded in and meets one activation value, so the
work per byte is a handful of integer ops and two FMAs. Partial sums are kept per scale group
([BLOCK_N, groups in BLOCK_K]) and scaled once per group, then reduced once after the K loop.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .lora import (w2_decode_cols, w2_decode_parts, w2_decode_rows, w2_decode_stored, w2_decode_term,
                   w13_decode_leave, w13_decode_rows, w13_decode_shrink, w13_decode_terms, w13_decode_wait)
from .moe_gemm import DENSE, MXFP4, NVFP4, _activate, _e4m3_values, _e8m0_values, _pair_expert, _slot_operands

FP16_E2M1_UNIT = tl.constexpr(16384.0)  # E2M1 bits placed in an fp16 read 2^-14 of their value


@triton.jit
def _groups(k0, K, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The 4-bit scale groups of the K chunk at k0: (group indices [groups], which lie inside K, their int32
    words' indices [groups, words per group])."""
    GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
    WORDS: tl.constexpr = GROUP // 8  # int32 words (8 nibbles each) per scale group
    g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    return g, g < K // GROUP, g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]


@triton.jit
def _load_chunk(w_e, s_e, rows, n_ok, k0, K, stride_wn, stride_wk, stride_sn, FORMAT: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """(weights, scales) of one K chunk as loaded: dense [BLOCK_N, BLOCK_K] (scales unused); 4-bit
    int32 words of 8 packed codes [BLOCK_N, groups, words per group] and their scale codes
    [BLOCK_N, groups]. The group is its own axis so that its sum stays inside a thread."""
    if FORMAT == DENSE:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_e + rows[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                    mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        s = n_ok
    else:
        g, g_ok, kw = _groups(k0, K, FORMAT, BLOCK_K)
        # Rows start on whole groups (the host guarantees stride_wn % words == 0): one vector load each.
        off = tl.multiple_of(rows[:, None, None] * stride_wn, [1, 1, kw.shape[1]]) + kw[None, :, :]
        w = tl.load(w_e + off, mask=n_ok[:, None, None] & g_ok[None, :, None], other=0)
        s = tl.load(s_e + rows[:, None] * stride_sn + _opaque(g, K)[None, :], mask=n_ok[:, None] & g_ok[None, :],
                    other=0)
    return w, s


@triton.jit
def _opaque(g, K):
    """``g`` behind a run-time select (K > 0; K = 0 masks every load): a scale pointer the compiler cannot see as
    contiguous along the groups. Seen as contiguous, the scale bytes got a layout of their own (lanes along
    the groups) and crossed into the group sums' layout through shared memory, four barriers every step; seen
    as scattered, they are loaded in the layout of the weight words they scale."""
    return tl.where(K > 0, g, 0)


@triton.jit
def _load_x(x_row, k0, K, stride_xk, ok, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS: tl.constexpr = False):
    """One activation chunk (zeros unless ``ok``), read contiguously: dense [BLOCK_K]; 4-bit
    [groups, words, 2 (a), 2 (b), 2 (h)] holding the activation of nibble 2a + b + 4h of each word (h: the half of
    the word): element 8w + 4h + 2a + b, or with PAIRS (codes in the "pairs" byte layout) element 8w + 4a + 2b + h,
    the chunk as it lies in memory."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    xv = tl.load(x_row + offs_k * stride_xk, mask=(offs_k < K) & ok, other=0.0)
    if FORMAT != DENSE:
        GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
        # converted before the rearrangement: once per element, not once per thread that uses it
        xv = tl.reshape(xv.to(tl.float32), [BLOCK_K // GROUP, GROUP // 8, 2, 2, 2])
        if not PAIRS:
            xv = tl.permute(xv, (0, 1, 3, 4, 2))
    return xv


@triton.jit
def _load_slots_x(x_rows, k0, K, ok, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS: tl.constexpr = False):
    """_load_x for several rows [SLOTS] (pointers; contiguous rows): [SLOTS, ...] with each row laid
    out as _load_x lays out one."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    xv = tl.load(x_rows[:, None] + offs_k[None, :], mask=ok[:, None] & (offs_k < K)[None, :], other=0.0)
    if FORMAT != DENSE:
        GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
        SLOTS: tl.constexpr = x_rows.shape[0]
        xv = tl.reshape(xv.to(tl.float32), [SLOTS, BLOCK_K // GROUP, GROUP // 8, 2, 2, 2])
        if not PAIRS:
            xv = tl.permute(xv, (0, 1, 2, 4, 5, 3))
    return xv


@triton.jit
def _pair_bits(mag, sign):
    """int32 fp16 pair of two E2M1 codes whose magnitude bits sit at 9..11 of each 16-bit half of
    ``mag`` and whose sign bits sit at bit 15 of each half of ``sign``: each half an fp16 of 2^-14 of
    its code's value (code 1 is the fp16 subnormal 2^-15, exactly)."""
    return (mag & 0x0E000E00) | (sign & -0x7FFF8000)  # masks 0x0E000E00, 0x80008000


@triton.jit
def _halves(mag, sign, HALVES_ASM: tl.constexpr):
    """fp32 values of the two halves of _pair_bits(mag, sign): 2^-14 of each code's value."""
    bits = _pair_bits(mag, sign)
    if HALVES_ASM:  # ptxas reads each half in place (HADD2.F32 .H0 / .H1): no extraction
        low, high = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [bits], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:  # the interpreter runs no PTX
        low, high = _half(bits, 0), _half(bits, 16)
    return low, high


@triton.jit
def _chunk_sums(w, s, xv, FORMAT: tl.constexpr, HALVES_ASM: tl.constexpr):
    """Products of a loaded chunk with its activations: [BLOCK_N, BLOCK_K] for dense weights,
    [BLOCK_N, groups] (summed and scaled per scale group) for 4-bit; with a leading slot axis on
    weights, scales and activations alike, [SLOTS, BLOCK_N, ..].

    A word's nibbles j and j + 4 sit at bit 4j of its two 16-bit halves: the word shifted by 9 - 4j
    and by 12 - 4j holds both codes' magnitude and sign bits where an fp16 wants them (see _halves),
    two codes per 32-bit op; the scales carry the 2^14. Each word's eight products are one FFMA
    chain, and the activations are converted to fp32 once, before their rearrangement."""
    if FORMAT == DENSE:
        part = w.to(tl.float32) * tl.expand_dims(xv.to(tl.float32), -2)
    else:
        # x [.., groups, words, 2 (a), 2 (b), 2 (half)] -> eight [.., groups, words] slices, the activations of
        # nibbles j and j + 4 with j = 2a + b (_load_x); a leading slot axis (GEMM2's slot tiles) rides along.
        x_lo, x_hi = tl.split(xv.to(tl.float32))
        even, odd = tl.split(x_lo)  # b = 0 -> j 0, 2; b = 1 -> j 1, 3
        x0l, x2l = tl.split(even)
        x1l, x3l = tl.split(odd)
        even, odd = tl.split(x_hi)
        x0h, x2h = tl.split(even)
        x1h, x3h = tl.split(odd)
        # nibble j's magnitude bits to 9..11 (w shifted by 9 - 4j), its sign to 15 (by 12 - 4j), in both halves
        lo, hi = _halves(w << 9, w << 12, HALVES_ASM)
        acc = lo * tl.expand_dims(x0l, -3)
        acc = hi * tl.expand_dims(x0h, -3) + acc
        lo, hi = _halves(w << 5, w << 8, HALVES_ASM)
        acc = lo * tl.expand_dims(x1l, -3) + acc
        acc = hi * tl.expand_dims(x1h, -3) + acc
        lo, hi = _halves(w << 1, w << 4, HALVES_ASM)
        acc = lo * tl.expand_dims(x2l, -3) + acc
        acc = hi * tl.expand_dims(x2h, -3) + acc
        lo, hi = _halves(w >> 3, w, HALVES_ASM)
        acc = lo * tl.expand_dims(x3l, -3) + acc
        acc = hi * tl.expand_dims(x3h, -3) + acc
        part = _scaled_group_sums(tl.sum(acc, axis=-1), s, 1.0, FORMAT)
    return part


@triton.jit
def _scaled_group_sums(sums, s, factor, FORMAT: tl.constexpr):
    """Group sums of codes * 2^-14 (times activations) brought to their values: times 2^14, the group's
    scale (MXFP4 E8M0 / NVFP4 E4M3 bytes ``s``) and ``factor``. MXFP4 multiplies the 2^14 first, then
    2^(s - 127): one factor 2^(s - 113) would overflow fp32 for s > 240 (codes up to 254 are valid scales)."""
    if FORMAT == MXFP4:
        part = (sums * FP16_E2M1_UNIT) * (_e8m0_values(s) * factor)
    else:
        part = sums * (_e4m3_values(s.to(tl.int32)) * (FP16_E2M1_UNIT * factor))
    return part


@triton.jit
def _load_x_fp16(x_row, e_row, k0, K, like, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """One chunk of activations prepared by scaled_fp16.py, in the layout of the weight words ``like`` ([..,
    groups, words]) they meet: the four int32 fp16 pairs (p0, p1, p2, p3) (pair j of a word: its nibbles j and
    j + 4), each of like's shape, and each group's factor 2^(u - 127), of like's shape less its last axis. Pair j
    of a group's words is one contiguous vector (scaled_fp16's pair-major 32-blocks), loaded broadcast over like's
    leading axes straight into the words' layout: a rearrangement through shared memory (stores, barriers, loads
    every step) would cost more than these L1-resident loads. The prepared rows hold whole chunks (zeros and
    finite factors past K), so nothing is masked: the weights past K, masked, meet zeros. The K loops prefetch one
    chunk past the last; that read stays on the last chunk (its values go unused), inside the rows."""
    GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
    WORDS: tl.constexpr = GROUP // 8
    k0 = tl.minimum(k0, tl.maximum(K - 1, 0) // BLOCK_K * BLOCK_K)
    g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    # pair 0 of word w of group g: the group's 32-block holds 16 pairs as [j][word]
    first = (g // (32 // GROUP)) * 16 + (g % (32 // GROUP)) * WORDS
    off = _lead_like(tl.multiple_of(first[:, None], [1, WORDS]) + tl.arange(0, WORDS)[None, :], like)
    p0 = tl.load(x_row + off)
    p1 = tl.load(x_row + off + 4)
    p2 = tl.load(x_row + off + 8)
    p3 = tl.load(x_row + off + 12)
    u = tl.load(e_row + _lead_like(g * GROUP // 32, like, 1)).to(tl.int32)
    return (p0, p1, p2, p3), (u << 23).to(tl.float32, bitcast=True)


@triton.jit
def _lead_like(t, like, DROP: tl.constexpr = 0):
    """``t`` broadcast to the shape of ``like`` less its last DROP axes, by leading axes of size 1."""
    RANK: tl.constexpr = len(like.shape) - DROP
    if RANK - len(t.shape) == 2:
        t = t[None, None]
    elif RANK - len(t.shape) == 1:
        t = t[None]
    return tl.broadcast_to(t, like.shape[:RANK])


@triton.jit
def _hfma2(a, b, c, HALVES_ASM: tl.constexpr):
    """a * b + c on int32 fp16 pairs (one rounding per half)."""
    if HALVES_ASM:
        r = tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:  # the interpreter runs no PTX: the same halves through fp32 (exact products, one final rounding)
        r = _pack2(_half(a, 0) * _half(b, 0) + _half(c, 0), _half(a, 16) * _half(b, 16) + _half(c, 16))
    return r


@triton.jit
def _pack2(lo, hi):
    """int32 fp16 pair of two fp32 values, each rounded to fp16."""
    return (lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (
        hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _half(bits, shift: tl.constexpr):
    """fp32 value of the fp16 at bit ``shift`` (0 or 16) of int32 ``bits``."""
    return (bits >> shift).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _hadd2(a, b, HALVES_ASM: tl.constexpr):
    """a + b on int32 fp16 pairs."""
    if HALVES_ASM:
        r = tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                      pack=1)
    else:
        r = _pack2(_half(a, 0) + _half(b, 0), _half(a, 16) + _half(b, 16))
    return r


@triton.jit
def _pair_sum(bits, HALVES_ASM: tl.constexpr):
    """fp32 sum of the two halves of int32 fp16 pairs."""
    if HALVES_ASM:
        s = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .f32 a, b; mov.b32 {l, h}, $1; cvt.f32.f16 a, l; cvt.f32.f16 b, h; "
            "add.f32 $0, a, b; }", "=r,r", [bits], dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = _half(bits, 0) + _half(bits, 16)
    return s


@triton.jit
def _chunk_sums_fp16x2(w, s, pairs, factor, FORMAT: tl.constexpr, HALVES_ASM: tl.constexpr):
    """_chunk_sums on packed operands: [.., groups] group sums of a loaded 4-bit chunk (words [.., groups, words])
    with the prepared activations (_load_x_fp16: four pair tensors of w's shape, factors of s's), scaled."""
    return _scaled_group_sums(_fp16x2_group_sums(w, pairs, HALVES_ASM), s, factor, FORMAT)


@triton.jit
def _fp16x2_group_sums(w, pairs, HALVES_ASM: tl.constexpr):
    """fp32 [.., groups] sums of code * 2^-14 times activation over each group of 4-bit words [.., groups, words],
    the activations given as four int32 fp16-pair tensors of w's shape (pair j of a word: its nibbles j and
    j + 4). Each nibble pair of a word is one fp16x2 (code * 2^-14, exact) multiplied into an fp16x2 accumulator
    with its activation pair: a word's eight products in four fp16x2 FMAs, a group's words added in fp16x2, and
    only the group's sum widened to fp32. With activations below 2^15 and codes * 2^-14 below 6 * 2^-14, a
    group's partial sums stay below 2^10."""
    p0, p1, p2, p3 = pairs
    acc = _hfma2(_pair_bits(w << 9, w << 12), p0, tl.zeros_like(w), HALVES_ASM)  # the shifts of _chunk_sums
    acc = _hfma2(_pair_bits(w << 5, w << 8), p1, acc, HALVES_ASM)
    acc = _hfma2(_pair_bits(w << 1, w << 4), p2, acc, HALVES_ASM)
    acc = _hfma2(_pair_bits(w >> 3, w), p3, acc, HALVES_ASM)
    if acc.shape[-1] == 4:  # MXFP4: a group's four words
        a0, a1, a2, a3 = _take4(acc)
        acc = _hadd2(_hadd2(a0, a1, HALVES_ASM), _hadd2(a2, a3, HALVES_ASM), HALVES_ASM)
    else:  # NVFP4: two
        a0, a1 = tl.split(acc)
        acc = _hadd2(a0, a1, HALVES_ASM)
    return _pair_sum(acc, HALVES_ASM)


@triton.jit
def _row_exponent(x_row, stride_xk, K, XBLOCK: tl.constexpr):
    """The exponent e of the largest |x| of an activation row (clamped to [-113, 127]: 2^(14 - e) and 2^e stay
    normal fp32 numbers): (2^(14 - e), 2^e)."""
    m = tl.zeros([XBLOCK], dtype=tl.float32)
    for k0 in range(0, K, XBLOCK):
        offs = k0 + tl.arange(0, XBLOCK)
        m = tl.maximum(m, tl.abs(tl.load(x_row + offs * stride_xk, mask=offs < K, other=0.0).to(tl.float32)))
    ex = ((tl.max(m, axis=0).to(tl.int32, bitcast=True) >> 23) & 255) - 127
    ex = tl.minimum(tl.maximum(ex, -113), 127)
    return ((141 - ex) << 23).to(tl.float32, bitcast=True), ((127 + ex) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_row_chunk(x_row, stride_xk, k0, K, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """The chunk of one activation row at k0 as stored, [groups, group size] (zeros past K, a whole number of
    4-bit groups)."""
    GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
    g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    return tl.load(x_row + (g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]) * stride_xk,
                   mask=(g < K // GROUP)[:, None], other=0.0)


@triton.jit
def _pair_like(x, w):
    """int32 fp16 pairs of x [groups, words, 2] (the last axis: low, high half), broadcast to w's [rows, groups,
    words]."""
    lo, hi = tl.split(x)
    return tl.broadcast_to(_pack2(lo, hi)[None, :, :], w.shape)


@triton.jit
def _word_pairs(x, w, PAIRS: tl.constexpr):
    """The four int32 fp16-pair tensors of w's shape [rows, groups, words] (pair j: the activations of nibbles j
    and j + 4 of each word) from fp32 activations x [groups, words * 8] as stored: element 8 * word + 4 * half +
    2a + b is the activation of nibble j = 2a + b in half ``half`` ("packed" bytes), or with PAIRS element
    8 * word + 4a + 2b + half ("pairs" bytes: each pair's two halves neighbours, converted as they lie)."""
    G: tl.constexpr = x.shape[0]
    WORDS: tl.constexpr = x.shape[1] // 8
    x = tl.reshape(x, [G, WORDS, 2, 2, 2])
    if PAIRS:
        lo, hi = tl.split(x)
        b0, b1 = tl.split(_pack2(lo, hi))  # [G, WORDS, a, b] -> [G, WORDS, a]
        q0, q2 = tl.split(b0)
        q1, q3 = tl.split(b1)
        p0 = tl.broadcast_to(q0[None, :, :], w.shape)
        p1 = tl.broadcast_to(q1[None, :, :], w.shape)
        p2 = tl.broadcast_to(q2[None, :, :], w.shape)
        p3 = tl.broadcast_to(q3[None, :, :], w.shape)
    else:
        xb0, xb1 = tl.split(x)
        x_a0b0, x_a1b0 = tl.split(xb0)
        x_a0b1, x_a1b1 = tl.split(xb1)
        p0 = _pair_like(x_a0b0, w)
        p1 = _pair_like(x_a0b1, w)
        p2 = _pair_like(x_a1b0, w)
        p3 = _pair_like(x_a1b1, w)
    return p0, p1, p2, p3


@triton.jit
def _row_scaled_sums(w, s, xr, x_scale, x_factor, FORMAT: tl.constexpr, HALVES_ASM: tl.constexpr,
                     PAIRS: tl.constexpr = False):
    """[rows, groups] fp32 products of a 4-bit chunk (words [rows, groups, words], scale bytes [rows, groups]; PAIRS:
    codes in the "pairs" byte layout) with one activation row's chunk as stored (xr [groups, group size]) scaled by
    x_scale = 2^(14 - e) (_row_exponent), summed per scale group and brought to their values: fp16x2 products
    (_fp16x2_group_sums), x_factor = 2^e."""
    sums = _fp16x2_group_sums(w, _word_pairs(xr.to(tl.float32) * x_scale, w, PAIRS), HALVES_ASM)
    # codes * 2^-14 times x * 2^(14 - e): the sums are codes times x over 2^e. Multiplied in this order, every
    # intermediate is finite wherever the result is (2^e times a scale alone may not be).
    if FORMAT == MXFP4:
        part = (sums * x_factor) * _e8m0_values(s)
    else:
        part = (sums * x_factor) * _e4m3_values(s)
    return part


@triton.jit
def _take4(t):
    """The four slices of ``t`` along its last dimension (size 4), in order."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))  # last index 2a + b: split takes b
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _load_act(x_row, e_row, k0, K, stride_xk, like, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
              PACKED: tl.constexpr, PAIRS: tl.constexpr = False):
    """(activations, per-group factors) of one chunk: _load_x_fp16 (in the layout of the weight words ``like``; the
    pairs were made for the weights' byte layout) when PACKED, else (_load_x, unused 1.0)."""
    if PACKED:
        xv, xf = _load_x_fp16(x_row, e_row, k0, K, like, FORMAT, BLOCK_K)
    else:
        xv = _load_x(x_row, k0, K, stride_xk, True, FORMAT, BLOCK_K, PAIRS)
        xf = 1.0
    return xv, xf


@triton.jit
def _act_sums(w, s, xv, xf, FORMAT: tl.constexpr, HALVES_ASM: tl.constexpr, PACKED: tl.constexpr):
    if PACKED:
        part = _chunk_sums_fp16x2(w, s, xv, xf, FORMAT, HALVES_ASM)
    else:
        part = _chunk_sums(w, s, xv, FORMAT, HALVES_ASM)
    return part


@triton.jit
def gemv1_act_kernel(
    x_ptr, stride_xm, stride_xk,  # x [T, H]; PACKED: int32 fp16 pairs [T, Hp/2] (scaled_fp16.py)
    xe_ptr, stride_xem,  # PACKED: the pairs' exponent bytes [T, Hp/32]
    w_ptr, stride_we, stride_wn, stride_wk,  # w13 [E, 2I, H] (4-bit: int32 words [E, 2I, H/8])
    s_ptr, stride_se, stride_sn, gs_ptr,  # 4-bit block scales [E, 2I, H/group]; NVFP4 global scales [E]
    bias_ptr, stride_be, stride_bn,  # w13_bias [E, 2I] (HAS_BIAS)
    h_ptr, stride_hm,  # out: activations [T*k, I], one row per pair
    delta_ptr, stride_dm,  # HAS_DELTA: added before the activation, [T*k, 2I] in w13's row order
    ids_ptr, expert_map_ptr,  # int32 [T*k]; int32 [num_global] (HAS_MAP)
    top_k, num_global, num_local, I, K,
    gate_step, up_offset,  # gate of column n is w13 row n * gate_step, up is that + up_offset
    # decode LoRA (kernels/lora.py): W13's shrink partials [T*k, LORA_SPLITS, R1_PAD] fp32, B13 [adapters, E, 2I,
    # r1], A2 [adapters, E, r2, I] (contiguous), W2's shrinks out [T*k, I blocks + 1, R2_PAD] fp32, arrival
    # counters (W2: one per program group; LORA_SHRINK: three per group after those), scaling fp32 [adapters],
    # adapter ids int32 [T]; LORA_SHRINK: x [T, H] as given, A13 [adapters, E, r1, H] (contiguous), K per split
    lora_parts_ptr, lora_b_ptr, lora_a2_ptr, lora_parts2_ptr, lora_cnt_ptr, lora_scaling_ptr, lora_ids_ptr,
    lora_adapters, lora_r1, lora_r2, lora_x_ptr, lora_stride_xm, lora_stride_xk, lora_a13_ptr, lora_k_per_split,
    HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, ACTIVATION: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALVES_ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,  # GEMM2 is launched as this grid's programmatic dependent
    SLOTS: tl.constexpr = 1,  # pairs per program: slots [g * SLOTS, (g + 1) * SLOTS) of one token
    PACKED: tl.constexpr = False,  # 4-bit: products as fp16x2 FMAs on the prepared activations
    HAS_DELTA: tl.constexpr = False,  # LoRA on w13 (kernels/lora.py): its term per pair, added like the bias
    LORA_W13: tl.constexpr = False,  # W13's term from the shrink's partials (kernels/lora.py, decode terms)
    LORA_W2: tl.constexpr = False,  # W2's shrink over this program's h columns, for GEMV2
    LORA_WAIT: tl.constexpr = False,  # launched as the W13 shrink's programmatic dependent: wait before its partials
    LORA_SPLITS: tl.constexpr = 1, LORA_R1_PAD: tl.constexpr = 16, LORA_R2_PAD: tl.constexpr = 16,
    LORA_BLOCKS_PAD: tl.constexpr = 1, LORA_FENCE: tl.constexpr = False,
    LORA_SHRINK: tl.constexpr = False,  # W13's shrink computed by this grid's programs (kernels/lora.py)
    LORA_SHRINK_BLOCK_K: tl.constexpr = 128,
    W4_PAIRS: tl.constexpr = False,  # 4-bit codes in the "pairs" byte layout (formats/fp4.py)
):
    tl.static_assert(LORA_W13 or not LORA_SHRINK)
    if PDL:  # every program has started: GEMM2's may start too (they wait for this grid before reading h)
        gdc_launch_dependents()
    num_n = tl.cdiv(I, BLOCK_N)
    groups = tl.cdiv(top_k, SLOTS)
    t = tl.program_id(0) // num_n // groups
    j = (tl.program_id(0) // num_n % groups) * SLOTS + tl.arange(0, SLOTS)
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    pair = t * top_k + tl.minimum(j, top_k - 1)
    e = _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP)
    live = (j < top_k) & (e >= 0)  # pairs of another rank: their rows are never read (GEMM2 skips them too)
    if tl.max(live.to(tl.int32), axis=0) > 0:
        e64 = tl.maximum(e, 0).to(tl.int64)
        ok = live[:, None] & n_ok[None, :]
        gate_rows = offs_n.to(tl.int64) * gate_step
        up_rows = gate_rows + up_offset
        # weight and scale rows of each (slot, column): element offsets from the stacks' starts
        wg_rows = e64[:, None] * stride_we + gate_rows[None, :] * stride_wn
        wu_rows = e64[:, None] * stride_we + up_rows[None, :] * stride_wn
        sg_rows = e64[:, None] * stride_se + gate_rows[None, :] * stride_sn
        su_rows = e64[:, None] * stride_se + up_rows[None, :] * stride_sn
        x_row = x_ptr + t.to(tl.int64) * stride_xm
        if LORA_W13 or LORA_W2:  # the adapters' weights load now: the epilogue then waits only for the shrink
            adapter = tl.load(lora_ids_ptr + t)
            lora_live = live & (adapter >= 0) & (adapter < lora_adapters)
        if LORA_W13:
            lora_bg, lora_bu = w13_decode_rows(lora_b_ptr, adapter, lora_live, e64, gate_rows, up_rows, ok, num_local,
                                               2 * I, lora_r1, LORA_R1_PAD)
        if LORA_W2:
            lora_a2 = w2_decode_cols(lora_a2_ptr, adapter, lora_live, e64, offs_n, ok, num_local, I, lora_r2,
                                     LORA_R2_PAD)
        if LORA_SHRINK:  # the same for every program of the group
            lora_shrinks = tl.max(lora_live.to(tl.int32), axis=0) > 0
            lora_x_row = lora_x_ptr + t.to(tl.int64) * lora_stride_xm
            shrink_idx = tl.num_programs(0) // num_n + 3 * (tl.program_id(0) // num_n)  # after W2's counters
            if lora_shrinks:
                w13_decode_shrink(lora_x_row, lora_stride_xk, lora_a13_ptr, adapter, lora_live, e64, pair,
                                  lora_parts_ptr, lora_cnt_ptr, shrink_idx, tl.program_id(0) % num_n, num_local, K,
                                  lora_r1, lora_k_per_split, offs_n, LORA_SPLITS, LORA_R1_PAD, LORA_SHRINK_BLOCK_K,
                                  LORA_FENCE)
        ACC_K: tl.constexpr = BLOCK_K if FORMAT == DENSE else BLOCK_K // (32 if FORMAT == MXFP4 else 16)
        acc_gate = tl.zeros([SLOTS, BLOCK_N, ACC_K], dtype=tl.float32)
        acc_up = tl.zeros([SLOTS, BLOCK_N, ACC_K], dtype=tl.float32)
        # The next chunk's loads are issued before this chunk's math: one program keeps two chunks in
        # flight. The SLOTS experts share the token's activation chunk (loaded and converted once).
        wg, sg = _load_slots_chunk(w_ptr, s_ptr, wg_rows, sg_rows, ok, 0, K, stride_wk, FORMAT, BLOCK_K)
        wu, su = _load_slots_chunk(w_ptr, s_ptr, wu_rows, su_rows, ok, 0, K, stride_wk, FORMAT, BLOCK_K)
        e_row = xe_ptr + t.to(tl.int64) * stride_xem
        xv, xf = _load_act(x_row, e_row, 0, K, stride_xk, wg, FORMAT, BLOCK_K, PACKED, W4_PAIRS)
        for k0 in range(0, K, BLOCK_K):
            k1 = k0 + BLOCK_K
            wg_next, sg_next = _load_slots_chunk(w_ptr, s_ptr, wg_rows, sg_rows, ok, k1, K, stride_wk, FORMAT,
                                                 BLOCK_K)
            wu_next, su_next = _load_slots_chunk(w_ptr, s_ptr, wu_rows, su_rows, ok, k1, K, stride_wk, FORMAT,
                                                 BLOCK_K)
            xv_next, xf_next = _load_act(x_row, e_row, k1, K, stride_xk, wg, FORMAT, BLOCK_K, PACKED, W4_PAIRS)
            acc_gate += _act_sums(wg, sg, xv, xf, FORMAT, HALVES_ASM, PACKED)
            acc_up += _act_sums(wu, su, xv, xf, FORMAT, HALVES_ASM, PACKED)
            wg, sg, wu, su, xv, xf = wg_next, sg_next, wu_next, su_next, xv_next, xf_next
        gate = tl.sum(acc_gate, axis=2)
        up = tl.sum(acc_up, axis=2)
        if FORMAT == NVFP4:  # the per-expert global scale divides out once
            gs = tl.load(gs_ptr + e64)[:, None]
            gate = gate / gs
            up = up / gs
        if HAS_BIAS:
            b_e = bias_ptr + e64[:, None] * stride_be
            gate += tl.load(b_e + gate_rows[None, :] * stride_bn, mask=ok, other=0.0).to(tl.float32)
            up += tl.load(b_e + up_rows[None, :] * stride_bn, mask=ok, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d_rows = delta_ptr + pair.to(tl.int64)[:, None] * stride_dm
            gate += tl.load(d_rows + gate_rows[None, :], mask=ok, other=0.0).to(tl.float32)
            up += tl.load(d_rows + up_rows[None, :], mask=ok, other=0.0).to(tl.float32)
        if LORA_W13:
            if LORA_WAIT:  # the shrink's partials: written by the grid this one was launched after
                gdc_wait()
            if LORA_SHRINK:
                if lora_shrinks:
                    w13_decode_wait(lora_x_row, lora_stride_xk, lora_a13_ptr, adapter, lora_live, e64, pair,
                                    lora_parts_ptr, lora_cnt_ptr, shrink_idx, num_local, K, lora_r1, lora_k_per_split,
                                    offs_n, LORA_SPLITS, LORA_R1_PAD, LORA_SHRINK_BLOCK_K, LORA_FENCE)
            gate_term, up_term = w13_decode_terms(lora_parts_ptr, lora_scaling_ptr, adapter, lora_live, pair,
                                                  lora_bg, lora_bu, LORA_SPLITS, LORA_R1_PAD)
            if LORA_SHRINK:
                if lora_shrinks:
                    w13_decode_leave(lora_cnt_ptr, shrink_idx, num_n)
            gate += gate_term
            up += up_term
        act = _activate(gate, up, ACTIVATION).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + pair.to(tl.int64)[:, None] * stride_hm + offs_n[None, :], act, mask=ok)
        if LORA_W2:  # on h as stored, as GEMV2 reads it
            w2_decode_parts(lora_a2, lora_parts2_ptr, lora_cnt_ptr, lora_scaling_ptr, adapter, lora_live, pair,
                            act.to(tl.float32), offs_n, tl.program_id(0) // num_n, tl.program_id(0) % num_n, num_n,
                            LORA_R2_PAD, LORA_BLOCKS_PAD, LORA_FENCE)
    # Every program waits, those without a live pair too: this grid then ends after the shrink's, whose buffers the
    # launches after it may reuse (a second wait returns at once)
    if LORA_WAIT:
        gdc_wait()


@triton.jit
def _load_slots_chunk(w_ptr, s_ptr, w_rows, s_rows, ok, k0, K, stride_wk, FORMAT: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """_load_chunk for [SLOTS, BLOCK_N] rows of several experts, given by the element offsets of
    their weight rows and scale rows: the same per-row layout behind a slot axis."""
    if FORMAT == DENSE:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + w_rows[:, :, None] + offs_k[None, None, :] * stride_wk,
                    mask=ok[:, :, None] & (offs_k < K)[None, None, :], other=0.0)
        s = ok
    else:
        g, g_ok, kw = _groups(k0, K, FORMAT, BLOCK_K)
        # expert and row strides are whole groups (WeightOperand.gemv_args): one vector load per group
        off = tl.multiple_of(w_rows[:, :, None, None], [1, 1, 1, kw.shape[1]]) + kw[None, None, :, :]
        w = tl.load(w_ptr + off, mask=ok[:, :, None, None] & g_ok[None, None, :, None], other=0)
        s = tl.load(s_ptr + s_rows[:, :, None] + _opaque(g, K)[None, None, :],
                    mask=ok[:, :, None] & g_ok[None, None, :], other=0)
    return w, s


@triton.jit
def _slots_step(it, t, top_k, steps_per_group, steps, offs_n, n_ok, ids_ptr, expert_map_ptr, num_global, num_local,
                w_ptr, stride_we, stride_wn, stride_wk, s_ptr, stride_se, stride_sn, gs_ptr, h_ptr, stride_hm,
                weights_ptr, K, HAS_MAP: tl.constexpr, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                SLOTS: tl.constexpr):
    """Step ``it`` of a token's GEMM2: slots [g * SLOTS, (g + 1) * SLOTS) with g = it // steps_per_group,
    their K chunk it % steps_per_group. Returns (weights, scales, each slot's factor: router weight /
    NVFP4 global scale, the slots' h rows, the chunk's start, which slots are live). Nothing here
    reads GEMM1's output. Steps past the last, slots past top_k and slots of other ranks load
    nothing and have factor 0."""
    g = tl.minimum(it // steps_per_group, tl.cdiv(top_k, SLOTS) - 1)  # the prefetch past the end stays on this token
    j = g * SLOTS + tl.arange(0, SLOTS)
    j_ok = j < top_k
    pair = t * top_k + tl.minimum(j, top_k - 1)
    e = _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP)
    ok = j_ok & (e >= 0) & (it < steps)  # rows of other ranks' pairs were never written by GEMM1
    e = tl.maximum(e, 0).to(tl.int64)
    rows = offs_n.to(tl.int64)
    k0 = (it % steps_per_group) * BLOCK_K
    w, s = _load_slots_chunk(w_ptr, s_ptr, e[:, None] * stride_we + rows[None, :] * stride_wn,
                             e[:, None] * stride_se + rows[None, :] * stride_sn, ok[:, None] & n_ok[None, :], k0, K,
                             stride_wk, FORMAT, BLOCK_K)
    factor = tl.load(weights_ptr + pair)
    if FORMAT == NVFP4:
        factor = factor / tl.load(gs_ptr + e)
    return w, s, tl.where(ok, factor, 0.0), h_ptr + pair.to(tl.int64) * stride_hm, k0, ok


@triton.jit
def _flat_slots(t, top_k, offs_n, n_ok, h_ptr, stride_hm, w_ptr, stride_we, stride_wn, stride_wk, s_ptr,
                stride_se, stride_sn, gs_ptr, bias_ptr, stride_be, stride_bn, weights_ptr, ids_ptr, expert_map_ptr,
                num_global, num_local, K, HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, FORMAT: tl.constexpr,
                BLOCK_K: tl.constexpr, ACC_K: tl.constexpr, HALVES_ASM: tl.constexpr, PDL: tl.constexpr,
                SLOTS: tl.constexpr, PAIRS: tl.constexpr):
    """A token's weighted sum over its slots [BLOCK_N] as one loop over (group of SLOTS slots, K
    chunk). PDL: the first step's weights load before the wait for GEMM1's grid."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    # The next step's loads are issued before this step's math, so the stream of weight loads does
    # not drain at each slot's end (at T = 1 a program runs all k slots); SLOTS experts per step
    # put SLOTS times the bytes in flight, where few programs per SM (small N) leave HBM idle.
    # Each slot's factor scales its activations (dense) or group sums (4-bit).
    steps_per_group = tl.cdiv(K, BLOCK_K)
    steps = tl.cdiv(top_k, SLOTS) * steps_per_group
    acc = tl.zeros([SLOTS, BLOCK_N, ACC_K], dtype=tl.float32)
    w, s, factor, h_rows, k0, ok = _slots_step(0, t, top_k, steps_per_group, steps, offs_n, n_ok, ids_ptr,
                                               expert_map_ptr, num_global, num_local, w_ptr, stride_we, stride_wn,
                                               stride_wk, s_ptr, stride_se, stride_sn, gs_ptr, h_ptr, stride_hm,
                                               weights_ptr, K, HAS_MAP, FORMAT, BLOCK_K, SLOTS)
    if PDL:
        gdc_wait()
    hv = _load_slots_x(h_rows, k0, K, ok, FORMAT, BLOCK_K, PAIRS)
    for it in range(0, steps):  # the same order on every run: the same bits
        w_next, s_next, factor_next, h_rows, k0, ok = _slots_step(
            it + 1, t, top_k, steps_per_group, steps, offs_n, n_ok, ids_ptr, expert_map_ptr, num_global, num_local,
            w_ptr, stride_we, stride_wn, stride_wk, s_ptr, stride_se, stride_sn, gs_ptr, h_ptr, stride_hm,
            weights_ptr, K, HAS_MAP, FORMAT, BLOCK_K, SLOTS)
        hv_next = _load_slots_x(h_rows, k0, K, ok, FORMAT, BLOCK_K, PAIRS)
        if FORMAT == DENSE:  # the factor on the BLOCK_K activations, not on BLOCK_N x BLOCK_K products
            acc += _chunk_sums(w, s, hv.to(tl.float32) * factor[:, None], FORMAT, HALVES_ASM)
        else:  # 4-bit sums come per scale group: fewer of them than activations
            acc += _chunk_sums(w, s, hv, FORMAT, HALVES_ASM) * factor[:, None, None]
        w, s, hv, factor = w_next, s_next, hv_next, factor_next
    # the slots are summed once, after the loop: a sum per step over the slot axis crosses warps
    # (Triton spreads it over them) and went through shared memory on sm_90
    total = tl.sum(tl.sum(acc, axis=2), axis=0)
    if HAS_BIAS:
        for j in range(0, top_k):
            pair = t * top_k + j
            e = _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP)
            if e >= 0:
                total += tl.load(weights_ptr + pair) * tl.load(
                    bias_ptr + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
    return total


@triton.jit
def gemv2_tokens_kernel(
    h_ptr, stride_hm,  # activations [T*k, I] from gemv1_act_kernel; PACKED: int32 fp16 pairs [T*k, Ip/2]
    he_ptr, stride_hem,  # PACKED: the pairs' exponent bytes [T*k, Ip/32] (scaled_fp16.py)
    w_ptr, stride_we, stride_wn, stride_wk,  # w2 [E, H, I] (4-bit: int32 words [E, H, I/8])
    s_ptr, stride_se, stride_sn, gs_ptr,
    bias_ptr, stride_be, stride_bn,  # w2_bias [E, H] (HAS_BIAS)
    weights_ptr, ids_ptr, expert_map_ptr,  # float32 / int32 [T*k], int32 [num_global] (HAS_MAP)
    out_ptr, stride_ot,  # out [T, H]
    top_k, num_global, num_local, N, K,
    # decode LoRA (kernels/lora.py): W2's shrinks [T*k, lora_blocks + 1, R2_PAD] fp32 from GEMV1, B2 [adapters, E,
    # H, r2] (contiguous), adapter ids int32 [T], scaling fp32 [adapters]
    lora_parts2_ptr, lora_b2_ptr, lora_ids_ptr, lora_scaling_ptr, lora_adapters, lora_r2, lora_blocks,
    HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALVES_ASM: tl.constexpr = False,
    SLOTS: tl.constexpr = 1,  # one loop over (group of SLOTS slots, K chunk); 0: a loop per slot
    PDL: tl.constexpr = False,  # launched as GEMM1's programmatic dependent: wait for its grid before reading h
    PACKED: tl.constexpr = False,  # 4-bit, a loop per slot: fp16x2 products on h prepared by scaled_fp16.py
    ROW_SCALED: tl.constexpr = False,  # 4-bit, a loop per slot: fp16x2 products, each h row scaled here
    XBLOCK: tl.constexpr = 1024,  # ROW_SCALED: h values per step of a row's largest-|h| scan
    LORA_W2: tl.constexpr = False,  # W2's term added to the token's weighted sum (kernels/lora.py, decode terms)
    LORA_R2_PAD: tl.constexpr = 16, LORA_K_PAD: tl.constexpr = 1,
    W4_PAIRS: tl.constexpr = False,  # 4-bit codes in the "pairs" byte layout (formats/fp4.py)
):
    num_n = tl.cdiv(N, BLOCK_N)
    t = tl.program_id(0) // num_n
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    ACC_K: tl.constexpr = BLOCK_K if FORMAT == DENSE else BLOCK_K // (32 if FORMAT == MXFP4 else 16)
    if SLOTS > 0:
        total = _flat_slots(t, top_k, offs_n, n_ok, h_ptr, stride_hm, w_ptr, stride_we, stride_wn, stride_wk,
                            s_ptr, stride_se, stride_sn, gs_ptr, bias_ptr, stride_be, stride_bn, weights_ptr, ids_ptr,
                            expert_map_ptr, num_global, num_local, K, HAS_BIAS, HAS_MAP, FORMAT, BLOCK_K, ACC_K,
                            HALVES_ASM, PDL, SLOTS, W4_PAIRS)
    else:
        if PDL:  # the launch overlaps GEMM1's tail; the slots' first loads wait for it
            gdc_wait()
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(0, top_k):  # slots in order: the same bits on every run
            pair = t * top_k + j
            e, w_e, s_e, h_row = _slot_operands(pair, ids_ptr, expert_map_ptr, num_global, num_local, w_ptr,
                                                stride_we, s_ptr, stride_se, h_ptr, stride_hm, HAS_MAP)
            if e >= 0:
                acc = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
                w, s = _load_chunk(w_e, s_e, rows, n_ok, 0, K, stride_wn, stride_wk, stride_sn, FORMAT, BLOCK_K)
                if ROW_SCALED:  # the slot's h row to fp16 by one power of two (as kernels/gemv1_rows.py's x)
                    h_scale, h_factor = _row_exponent(h_row, 1, K, XBLOCK)
                    hv = _load_row_chunk(h_row, 1, 0, K, FORMAT, BLOCK_K)
                    for k0 in range(0, K, BLOCK_K):
                        w_next, s_next = _load_chunk(w_e, s_e, rows, n_ok, k0 + BLOCK_K, K, stride_wn, stride_wk,
                                                     stride_sn, FORMAT, BLOCK_K)
                        hv_next = _load_row_chunk(h_row, 1, k0 + BLOCK_K, K, FORMAT, BLOCK_K)
                        acc += _row_scaled_sums(w, s, hv, h_scale, h_factor, FORMAT, HALVES_ASM, W4_PAIRS)
                        w, s, hv = w_next, s_next, hv_next
                else:
                    he_row = he_ptr + pair.to(tl.int64) * stride_hem
                    hv, hf = _load_act(h_row, he_row, 0, K, 1, w, FORMAT, BLOCK_K, PACKED, W4_PAIRS)
                    for k0 in range(0, K, BLOCK_K):
                        w_next, s_next = _load_chunk(w_e, s_e, rows, n_ok, k0 + BLOCK_K, K, stride_wn, stride_wk,
                                                     stride_sn, FORMAT, BLOCK_K)
                        hv_next, hf_next = _load_act(h_row, he_row, k0 + BLOCK_K, K, 1, w, FORMAT, BLOCK_K, PACKED,
                                                     W4_PAIRS)
                        acc += _act_sums(w, s, hv, hf, FORMAT, HALVES_ASM, PACKED)
                        w, s, hv, hf = w_next, s_next, hv_next, hf_next
                y = tl.sum(acc, axis=1)
                if FORMAT == NVFP4:
                    y = y / tl.load(gs_ptr + e)
                if HAS_BIAS:
                    y += tl.load(bias_ptr + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=n_ok,
                                 other=0.0).to(tl.float32)
                total += tl.load(weights_ptr + pair) * y
    if LORA_W2:  # GEMV1's partials: read after the wait for its grid (PDL) or its end
        # every slot's B2 rows and shrink in one round of loads (held through the K loop they cost occupancy)
        lora_b2, lora_pair, lora_ok, lora_adapter = w2_decode_rows(
            lora_b2_ptr, lora_ids_ptr, ids_ptr, expert_map_ptr, t, top_k, num_global, num_local, lora_adapters,
            offs_n, n_ok, N, lora_r2, HAS_MAP, LORA_R2_PAD, LORA_K_PAD)
        lora_s = w2_decode_stored(lora_parts2_ptr, lora_pair, lora_ok, lora_blocks, LORA_R2_PAD)
        total += w2_decode_term(lora_s, lora_b2, lora_pair, lora_ok, weights_ptr)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
