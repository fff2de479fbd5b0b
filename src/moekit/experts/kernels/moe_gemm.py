"""Grouped expert GEMMs: GEMM1 with the activation fused, GEMM2 with bias and router weight
fused, and the fixed-order sum over the k slots.

Rows come either from the aligned pair list (standard format: a block of BLOCK_M pairs of one
expert, gathered from x) or straight from an expert's slab (batched format: rows below that
expert's token count). Memory offsets that scale with experts or rows are 64-bit: one expert
stack of DeepSeek-V3 alone holds 7.5e9 elements.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ...formats import fp8 as fp8_format
from ...reference import SWIGLU_ALPHA as _SWIGLU_ALPHA, SWIGLU_LIMIT as _SWIGLU_LIMIT

# The host code passes these by name (experts/triton_backend.py reads their values): one definition each.
ALIGNED = tl.constexpr(0)  # row blocks of the aligned pair list (standard format)
BATCHED = tl.constexpr(1)  # row blocks of each expert's slab (batched format)
PER_PAIR = tl.constexpr(2)  # one pair per block, no alignment (decode: a launch saved, nothing to pad)
DENSE = tl.constexpr(0)  # weight formats: bf16/fp16/fp32 as stored
MXFP4 = tl.constexpr(1)  # packed E2M1 + E8M0 scale per 32 along K
NVFP4 = tl.constexpr(2)  # packed E2M1 + E4M3 scale (read as its bytes) per 16 along K + fp32 global scale per expert
FP8 = tl.constexpr(3)  # E4M3 weights and activations on FP8 tensor cores; activations in 1x128 groups
FP8_EMULATED = tl.constexpr(4)  # the same numbers from E4M3 bytes decoded to fp32 (interpreter, no FP8 tensor cores)
W4A8 = tl.constexpr(5)  # MXFP4 weights recoded to E4M3 in the kernel, FP8 activations, FP8 tensor cores
W4A8_EMULATED = tl.constexpr(6)  # the same numbers in fp32 (interpreter)
FP8_GROUP = tl.constexpr(fp8_format.BLOCK)  # activation groups along K; weight blocks are FP8_GROUP x FP8_GROUP
E4M3_MAX = tl.constexpr(fp8_format.E4M3_MAX)
TWO_POW_126 = tl.constexpr(8.507059173023462e37)
TWO_POW_120 = tl.constexpr(1.329227995784916e36)
TWO_POW_118 = tl.constexpr(2.0 ** 118)
W4_WORDS_NVFP4_SHIFT = tl.constexpr(256.0)  # _w4_words_bf16's NVFP4 tiles are the weights times 2^-8
SILU_AND_MUL = tl.constexpr(0)
SWIGLU_OAI = tl.constexpr(1)
SWIGLU_ALPHA = tl.constexpr(_SWIGLU_ALPHA)  # gpt-oss's activation, as moekit.reference defines it
SWIGLU_LIMIT = tl.constexpr(_SWIGLU_LIMIT)


@triton.jit
def _tile_ids(num_m_blocks, num_n, GROUP_M: tl.constexpr):
    """Program -> (row block, column tile), GROUP_M row blocks side by side so that a weight tile
    read from memory serves them from L2."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _e2m1_values(codes):
    """fp32 value of each E2M1 code (int32 0..15), built from its bits: no table, exact."""
    mag = codes & 7
    e = mag >> 1
    m = mag & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), tl.where(m == 1, 0x3F000000, 0))
    return (bits | ((codes >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_values(s):
    """2^(s - 127) of uint8 exponents, exactly (s = 0 is the subnormal 2^-127; 255 is NaN)."""
    s = s.to(tl.int32)
    v = (s << 23).to(tl.float32, bitcast=True)
    return tl.where(s == 255, float("nan"), tl.where(s == 0, 5.877471754111438e-39, v))


@triton.jit
def _e4m3_values(b):
    """fp32 value of E4M3FN bytes (uint8 bits), exactly: subnormals, and 0x7F / 0xFF as NaN."""
    b = b.to(tl.int32)
    exp = (b >> 3) & 15
    mant = b & 7
    normal = (((exp + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, mant.to(tl.float32) * 0.001953125, normal)  # subnormal: mant * 2^-9
    mag = tl.where((exp == 15) & (mant == 7), float("nan"), mag)
    return tl.where((b >> 7) == 1, -mag, mag)


@triton.jit
def _e8m0_bf16(s):
    """bf16 2^(s - 127) of uint8 exponents, exactly: the byte is bf16's exponent field (0 is the
    subnormal 2^-127, 0x0040; 255 is NaN)."""
    s = s.to(tl.int32)
    bits = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7))
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_bf16(b):
    """bf16 value of E4M3FN bytes, exactly. Exponent and mantissa bits moved under bf16's read
    2^-120 of the value (E4M3 subnormals become bf16 subnormals: no special case), and one exact
    multiply by 2^120 follows; 0x7F / 0xFF become NaN. A handful of integer ops per scale where the
    fp32 decode took about fifteen (convert, select, convert back)."""
    b = b.to(tl.int32)
    bits = ((b & 0x7F) << 4) | ((b & 0x80) << 8) | tl.where((b & 0x7F) == 0x7F, 0x7FC0, 0)
    two_120 = tl.full(b.shape, TWO_POW_120, tl.float32).to(tl.bfloat16)  # the interpreter has no bf16 constants
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True) * two_120


@triton.jit
def _and_k(mask, offs_k, K, K_AXIS: tl.constexpr, EVEN_K: tl.constexpr):
    """mask & (offs_k < K) along axis K_AXIS of a 2-D tile. EVEN_K (K a multiple of BLOCK_K) drops
    the K test: the mask stays loop-invariant and its per-step compares and selects go."""
    if EVEN_K:
        out = mask
    elif K_AXIS == 0:
        out = mask & (offs_k < K)[:, None]
    else:
        out = mask & (offs_k < K)[None, :]
    return out


@triton.jit
def _w4_scales(s_e, rows, n_ok, k0, K, stride_sn, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr = False):
    """Block-scale codes [BLOCK_N, BLOCK_K / group] of a 4-bit weight tile (the N rows ``rows``, K chunk at k0),
    zeros past N and K (EVEN_K: the chunk is inside K). Single bytes are not copied asynchronously by the
    software pipeline, so loaded at use they make every K step wait for memory (a quarter of the MXFP4 prefill
    GEMM1's stall samples, benchmarks/results/archive/ncu_4bit_2026-12-03/, 2026-12-03); with SCALES_AHEAD (GemmConfig.scales_ahead) the K loops load
    the next step's a step ahead."""
    GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
    sk = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    return tl.load(s_e + rows[:, None] * stride_sn + sk[None, :], mask=_and_k(n_ok[:, None], sk, K // GROUP, 1, EVEN_K),
                   other=0)


@triton.jit
def _w4_first_scales(s_e, rows, n_ok, K, stride_sn, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALES_AHEAD: tl.constexpr):
    """What a K loop carries into its first _w4_step_scales: the first step's codes with SCALES_AHEAD, else
    zeros nothing reads (the compiler drops them)."""
    if SCALES_AHEAD:
        s = _w4_scales(s_e, rows, n_ok, 0, K, stride_sn, FORMAT, BLOCK_K)
    else:
        GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
        s = tl.zeros([rows.shape[0], BLOCK_K // GROUP], dtype=tl.uint8)
    return s


@triton.jit
def _w4_step_scales(carried, s_e, rows, n_ok, k0, K, stride_sn, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                    SCALES_AHEAD: tl.constexpr):
    """(the scale codes of the K step at k0, what the loop carries to the next step): with SCALES_AHEAD the
    codes loaded one step earlier and the next step's, loaded now (the next chunk may be past K: masked);
    else the unread zeros twice, as _w4_tile then loads the codes at use, after the weight bytes. (Loaded here
    instead, ahead of both tiles' bytes, they cost qwen3 NVFP4 T=256 22%: benchmarks/results/archive/lowbit_nvfp4_regression_2026-12-03.md, 2026-12-03.)"""
    if SCALES_AHEAD:
        now = carried
        nxt = _w4_scales(s_e, rows, n_ok, k0 + BLOCK_K, K, stride_sn, FORMAT, BLOCK_K)
    else:
        now = carried
        nxt = carried
    return now, nxt


@triton.jit
def _w4_words(w_e, rows, n_ok, k0, K, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """int32 [BLOCK_N, BLOCK_K / 8]: the words of 8 codes of a 4-bit tile (the N rows ``rows``, K chunk at k0; rows and
    experts start on whole words), zeros past N and K."""
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return tl.load(w_e.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_wn // 4) + kw[None, :],
                   mask=_and_k(n_ok[:, None], kw, K // 8, 1, EVEN_K), other=0)


@triton.jit
def _per_word(v, GROUP: tl.constexpr):
    """[N, G * GROUP / 8]: each value of v [N, G] (one per GROUP codes along K) once per word of 8 codes."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], [v.shape[0], v.shape[1], GROUP // 8]),
                      [v.shape[0], v.shape[1] * (GROUP // 8)])


@triton.jit
def _w4_words_bf16(q, s, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] bf16 tile of int32 words of 8 codes, q [BLOCK_N, BLOCK_K / 8], with scale codes s, in the
    word order of _paired_columns (within each 8 columns, K runs 0, 4, 1, 5, 2, 6, 3, 7). Codes i and i + 4 of a
    word sit 16 bits apart, so one mask and one multiply place both as _w4_tile's byte decode places a byte's two
    (13 integer ops per 8 codes instead of 22), and the pair is one 32-bit register: in that order it is already
    two adjacent K positions of the MMA operand (natural order cost a PRMT per register: gpt-oss GEMM1 36 of a
    390-instruction K step, offline sm_90), so the other operand comes in the same order (paired_k, H_PAIRED).
    NVFP4 folds 2^126 into the scale: every E4M3 scale times 2^118 is a finite bf16 and every product is exact,
    so one multiply per pair remains, and the tile is the weight times 2^-8 (W4_WORDS_NVFP4_SHIFT, undone in the
    epilogues). MXFP4 keeps both multiplies: 2^126 times E8M0 scales above 2 overflows bf16."""
    BLOCK_N: tl.constexpr = q.shape[0]
    GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
    if FORMAT == MXFP4:
        scale = _e8m0_bf16(s)
        first = tl.full([BLOCK_N, BLOCK_K // 8], TWO_POW_126, tl.float32).to(tl.bfloat16)
    else:
        scale = _e4m3_bf16(s) * tl.full(s.shape, TWO_POW_118, tl.float32).to(tl.bfloat16)
        first = None
    per_word = _per_word(scale, GROUP)
    q8 = q >> 8
    x0 = _bf16_halves(_w4_word_bits(q, q8, 0), first, per_word)
    x1 = _bf16_halves(_w4_word_bits(q, q8, 1), first, per_word)
    x2 = _bf16_halves(_w4_word_bits(q, q8, 2), first, per_word)
    x3 = _bf16_halves(_w4_word_bits(q, q8, 3), first, per_word)
    z = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [N, K/8, half, i % 2, i // 2] for code 4 * half + i
    return tl.reshape(tl.permute(z, (0, 1, 4, 3, 2)), [BLOCK_N, BLOCK_K])  # column 2 i + half: _paired_columns


@triton.jit
def _paired_columns(p):
    """K index of column p of a word-decoded tile (_w4_words_bf16): within each 8, 0, 4, 1, 5, 2, 6, 3, 7."""
    return (p & -8) + ((p & 7) >> 1) + ((p & 1) << 2)


@triton.jit
def _w4_word_bits(q, q8, I: tl.constexpr):
    """bf16 bit pairs from int32 words of 8 codes q (q8 = q >> 8): code I in the low half and code I + 4 in the
    high half, each as code * 2^-126 (sign to bit 15, magnitude to bits 8..6, as _w4_tile's byte decode)."""
    src = q if I < 2 else q8
    if I % 2 == 0:
        t = ((src & 0x000F000F) * 0x1040) & -0x7E3F7E40  # mask 0x81C081C0
    else:
        t = ((src & 0x00F000F0) * 0x104) & -0x7E3F7E40
    return t


@triton.jit
def _nvfp4_divisor(gs_ptr, e, W4_WORDS: tl.constexpr):
    """What an NVFP4 GEMM's accumulator is divided by: expert e's global scale, over W4_WORDS_NVFP4_SHIFT where
    _w4_words_bf16 built the tiles (exact: a power of two)."""
    gs = tl.load(gs_ptr + e)
    if W4_WORDS:
        gs = gs / W4_WORDS_NVFP4_SHIFT
    return gs


@triton.jit
def _bf16_pair(t, HALVES_ASM: tl.constexpr = True):
    """[..., 2] bf16: the two 16-bit halves of int32 bits t as they are (the MMA operand wants exactly this pair)."""
    if HALVES_ASM:
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [t],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:  # the interpreter runs no PTX
        lo = (t & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = ((t >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _bf16_halves(t, first, then):
    """[..., 2] bf16: the halves of int32 bits t (each a code * 2^-126), times ``first`` (unless None), times
    ``then``; both per word [N, K/8]."""
    v = _bf16_pair(t)
    if first is not None:
        v = v * first[:, :, None]
    return v * then[:, :, None]


@triton.jit
def _w4_tile(w_e, s_e, s, rows, n_ok, k0, K, stride_wn, stride_sn, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
             DTYPE: tl.constexpr, HALVES_ASM: tl.constexpr = False, EVEN_K: tl.constexpr = False,
             SCALES_GIVEN: tl.constexpr = False, WORDS: tl.constexpr = False, PAIRS: tl.constexpr = False):
    """[BLOCK_N, BLOCK_K] tile (the N rows ``rows``, K along columns) of a 4-bit expert weight in DTYPE:
    codes times their block scale (codes ``s`` from _w4_scales with SCALES_GIVEN, else loaded here; the NVFP4
    global scale is divided out in the epilogue). The bytes are K-contiguous. WORDS (bf16 on the GPU, rows and
    experts starting on whole int32 words): _w4_words_bf16's decode, its columns in _paired_columns order, or in
    natural K order when PAIRS (codes in the "pairs" byte layout). The byte decodes give natural K order in
    either layout (PAIRS: _element_order)."""
    BLOCK_N: tl.constexpr = rows.shape[0]
    GROUP: tl.constexpr = 32 if FORMAT == MXFP4 else 16
    if WORDS:
        words = _w4_words(w_e, rows, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K)
    else:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_e + rows[:, None] * stride_wn + kb[None, :],
                         mask=_and_k(n_ok[:, None], kb, K // 2, 1, EVEN_K), other=0)
    if not SCALES_GIVEN:
        s = _w4_scales(s_e, rows, n_ok, k0, K, stride_sn, FORMAT, BLOCK_K, EVEN_K)
    if WORDS:
        tile = _w4_words_bf16(words, s, FORMAT, BLOCK_K)
    elif DTYPE == tl.bfloat16:
        # Straight to bf16 bits: sign to bit 15, the three magnitude bits to bits 8:6 make the bf16
        # number code * 2^-126 (zero and 0.5 included, no select); times 2^126, then the scale (E4M3
        # and E8M0 are exact in bf16), both products exact, two codes per 32-bit multiply.
        # Both codes of a byte in one 32-bit word: low nibble * (2^6 + 2^12) and high nibble * (2^18 + 2^24)
        # land on disjoint bits; the mask keeps each code's sign (bit 15 / 31) and magnitude (8..6 / 24..22).
        b = packed.to(tl.int32)
        t = ((b & 0xF) * 0x1040 + (b & 0xF0) * 0x01040000) & -0x7E3F7E40  # mask 0x81C081C0
        v = tl.reshape(_bf16_pair(t, HALVES_ASM), [BLOCK_N, BLOCK_K // GROUP, GROUP])
        # The scales go straight to bf16 bits too (each thread decodes one per 16 or 32 of its weights).
        scale = _e8m0_bf16(s) if FORMAT == MXFP4 else _e4m3_bf16(s)
        two_126 = tl.full(scale.shape, TWO_POW_126, tl.float32).to(tl.bfloat16)  # the interpreter has no bf16 constants
        tile = tl.reshape(v * two_126[:, :, None] * scale[:, :, None], [BLOCK_N, BLOCK_K])
    else:
        scale = _e8m0_values(s) if FORMAT == MXFP4 else _e4m3_values(s)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_N, BLOCK_K]).to(tl.int32)
        vals = tl.reshape(_e2m1_values(codes), [BLOCK_N, BLOCK_K // GROUP, GROUP]) * scale[:, :, None]
        tile = tl.reshape(vals, [BLOCK_N, BLOCK_K]).to(DTYPE)
    if PAIRS and not WORDS:
        tile = _element_order(tile)
    return tile


@triton.jit
def _element_order(t):
    """[N, K]: the columns of t [N, K], decoded in nibble order from codes in the "pairs" byte layout (nibble
    4a + i of a word holds element 2i + a), in element order."""
    N: tl.constexpr = t.shape[0]
    K: tl.constexpr = t.shape[1]
    return tl.reshape(tl.permute(tl.reshape(t, [N, K // 8, 2, 4]), (0, 1, 3, 2)), [N, K])


@triton.jit
def _w4_dot(acc_t, a, w_e, s_e, s, rows, n_ok, k0, K, stride_wn, stride_sn, FORMAT: tl.constexpr,
            BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HALVES_ASM: tl.constexpr, EVEN_K: tl.constexpr,
            SCALES_GIVEN: tl.constexpr, WORDS: tl.constexpr, PAIRS: tl.constexpr):
    """acc_t [BLOCK_N, BLOCK_M] + W [BLOCK_N, BLOCK_K] @ a^T for a 4-bit weight: the weight is the
    tensor cores' register operand (Hopper reads only that one from registers), so its codes are
    decoded in registers; at the tuned configs the compiler then moves the decoded tile into the MMA's
    register layout through shared memory (STS.128 + LDSM per step, offline sm_90 SASS).
    (tl.dot_scaled's own E2M1 upcast, tried for MXFP4, was 1.1-1.5x slower on the H200.)"""
    w = _w4_tile(w_e, s_e, s, rows, n_ok, k0, K, stride_wn, stride_sn, FORMAT, BLOCK_K, a.dtype, HALVES_ASM, EVEN_K,
                 SCALES_GIVEN, WORDS, PAIRS)
    return tl.dot(w, tl.trans(a), acc_t, input_precision=DOT_PRECISION)


@triton.jit
def _w4a8_row_exponents(s_e, rows, n_ok, K, stride_sn, FORMAT: tl.constexpr, CHUNK: tl.constexpr = 32):
    """int32 [BLOCK_N]: each MXFP4 weight row's largest scale byte r (0 past N), read once before the K loop:
    the recoded tiles hold the row's weights over 2^(r - 133) (_w4a8_tile). Zeros nothing reads for other
    formats (the compiler drops them)."""
    r = tl.zeros([rows.shape[0]], dtype=tl.int32)
    if FORMAT >= W4A8:
        for g0 in range(0, K // 32, CHUNK):
            g = g0 + tl.arange(0, CHUNK)
            s = tl.load(s_e + rows[:, None] * stride_sn + g[None, :], mask=n_ok[:, None] & (g < K // 32)[None, :],
                        other=0)
            r = tl.maximum(r, tl.max(s.to(tl.int32), axis=1))
    return r


@triton.jit
def _w4a8_row_scale(r):
    """fp32 2^(r - 133) of row exponents r (subnormal below r = 7; NaN for the NaN scale 255)."""
    bits = tl.where(r >= 7, (r - 6) << 23, 1 << (r + 16))
    return tl.where(r == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _w4a8_steps(s, r):
    """(lo, hi) int32: row d = r - s of the step table (formats.mxfp4.e4m3_steps; bytes of magnitudes 0..3, 4..7)
    by integer ops on the group's scale byte s and its row's largest r, where loads from a table in memory made
    the K loop wait on them (the GEMMs' top stall, ncu). d <= 12: the bytes of 0.5 * 2^(6 - d) .. 6 * 2^(6 - d)
    are the exponent field 12 - d at bits 3.. plus constant offsets (0.5 of d = 12 is the subnormal 0x04); 13 and
    14: constants; from 15 zeros; a NaN scale: E4M3 NaNs."""
    d = r - s
    b = (12 - d) * 8
    lo = tl.where(d <= 11, 0x0C080000 + b * 0x01010100,
                  tl.where(d == 12, 0x0C080400, tl.where(d == 13, 0x06040200, tl.where(d == 14, 0x03020100, 0))))
    hi = tl.where(d <= 12, 0x1C181410 + b * 0x01010101,
                  tl.where(d == 13, 0x14100C08, tl.where(d == 14, 0x0C080604, 0)))
    nan = s == 255
    return tl.where(nan, 0x7F7F7F7F, lo), tl.where(nan, 0x7F7F7F7F, hi)


@triton.jit
def _quad(t):
    """[N, W, 4]: four copies of t [N, W] side by side in one thread (what an inline asm with pack=4 reads as one)."""
    pair = tl.join(t, t)
    return tl.reshape(tl.join(pair, pair), [t.shape[0], t.shape[1], 4])


@triton.jit
def _w4a8_tile(w_e, s_e, r, rows, n_ok, k0, K, stride_wn, stride_sn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               EMULATED: tl.constexpr, PAIRS: tl.constexpr = False):
    """[BLOCK_N, BLOCK_K] E4M3 tile of an MXFP4 weight (EMULATED: its fp32 values), natural K order whatever the
    byte layout (PAIRS: codes in the "pairs" layout): code c of a
    32-group with scale byte s in row n (largest byte r) becomes E4M3(e2m1(c) * 2^(6 - d)), d = r - s, so the
    weight is the tile times 2^(r - 133) (_w4a8_row_scale, in the epilogue). Row d of the step table
    (formats.mxfp4.e4m3_steps: 8 bytes, one per magnitude; exact for d <= 14, zeros past it) is made per group
    (_w4a8_steps), and each code's byte is picked from it by PRMT, four codes per instruction: the sign comes from a
    second PRMT whose sign-replicate mode (the code's sign bit is that mode's bit) zeroes negative codes' bytes,
    so (plain ^ zeroed) + 0x7F per byte carries into bit 7 exactly where a code is negative and nonzero."""
    BLOCK_N: tl.constexpr = rows.shape[0]
    q = _w4_words(w_e, rows, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K)
    s = _w4_scales(s_e, rows, n_ok, k0, K, stride_sn, MXFP4, BLOCK_K, EVEN_K).to(tl.int32)
    lo, hi = _w4a8_steps(s, r[:, None])
    lo, hi = _per_word(lo, 32), _per_word(hi, 32)
    if EMULATED:  # the same bytes by shifts (the interpreter runs no PTX), then their fp32 values
        codes = (q[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 15
        mag = codes & 7
        byte = tl.where(mag < 4, lo[:, :, None] >> (8 * mag), hi[:, :, None] >> (8 * (mag - 4))) & 0xFF
        byte = tl.where((codes >= 8) & (byte != 0), byte | 0x80, byte)
        tile = tl.reshape(_e4m3_values(byte), [BLOCK_N, BLOCK_K])
        if PAIRS:
            tile = _element_order(tile)
    else:
        first, then = tl.inline_asm_elementwise(
            """{
            .reg .b32 sel, mag, z, v;
            prmt.b32 z, $6, $10, $2;
            and.b32 mag, $2, 0x7777;
            prmt.b32 v, $6, $10, mag;
            xor.b32 z, z, v;
            add.u32 z, z, 0x7F7F7F7F;
            and.b32 z, z, 0x80808080;
            or.b32 $0, v, z;
            shr.u32 sel, $2, 16;
            prmt.b32 z, $6, $10, sel;
            and.b32 mag, sel, 0x7777;
            prmt.b32 v, $6, $10, mag;
            xor.b32 z, z, v;
            add.u32 z, z, 0x7F7F7F7F;
            and.b32 z, z, 0x80808080;
            or.b32 $1, v, z;
            }""",
            "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [_quad(q), _quad(lo), _quad(hi)],
            dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)
        # [N, K/8, 4 codes, 2 halves]: nibble 4 * half + i of each word, element 4 * half + i ("packed", moved to
        # column 8 w + 4 half + i) or element 2 i + half ("pairs", in place)
        if PAIRS:
            tile = tl.reshape(tl.join(first, then), [BLOCK_N, BLOCK_K])
        else:
            tile = tl.reshape(tl.permute(tl.join(first, then), (0, 1, 3, 2)), [BLOCK_N, BLOCK_K])
    return tile


@triton.jit
def _weight_tile(w_e, s_e, rows, n_ok, k0, K, stride_wn, stride_wk, stride_sn,
                 FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, HALVES_ASM: tl.constexpr = False,
                 EVEN_K: tl.constexpr = False, w_desc=None, desc_row=0, W_TMA: tl.constexpr = False, r=None,
                 PAIRS: tl.constexpr = False):
    """[BLOCK_K, BLOCK_N] tile (K rows, the N columns ``rows``) of one expert's weight in DTYPE (W4A8: E4M3
    recoded from MXFP4 under row exponents ``r``, _w4a8_tile).

    W_TMA (dense and FP8 weights in rows of whole 16-byte units): one tensor-memory-accelerator
    copy of the [BLOCK_N, BLOCK_K] box at row ``desc_row`` of the stack seen as [E*N, K] rows, no
    per-thread addresses or copies. Rows past the expert's last belong to the next expert (or
    read as zeros past the stack): their columns are never stored; K past its end reads zeros."""
    # One return at the end: the JIT compiles code after an early return even when the branch is constexpr.
    if W_TMA:
        tile = tl.trans(w_desc.load([desc_row, k0]))
    elif FORMAT == DENSE or FORMAT == FP8:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_e + rows[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                       mask=_and_k(n_ok[None, :], offs_k, K, 0, EVEN_K), other=0.0)
    elif FORMAT == FP8_EMULATED:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = _e4m3_values(tl.load(w_e + rows[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                                    mask=_and_k(n_ok[None, :], offs_k, K, 0, EVEN_K), other=0)).to(DTYPE)
    elif FORMAT >= W4A8:
        tile = tl.trans(_w4a8_tile(w_e, s_e, r, rows, n_ok, k0, K, stride_wn, stride_sn, BLOCK_K, EVEN_K,
                                   FORMAT == W4A8_EMULATED, PAIRS))
    else:
        tile = tl.trans(_w4_tile(w_e, s_e, None, rows, n_ok, k0, K, stride_wn, stride_sn, FORMAT, BLOCK_K, DTYPE,
                                 HALVES_ASM, EVEN_K, PAIRS=PAIRS))
    return tile


@triton.jit
def _round_e4m3(v):
    """fp32 value of v (|v| <= 448) rounded to E4M3 to nearest even, as the FP8 conversion does."""
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)  # below 2^-6 the spacing stays 2^-9
    ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    r = ((a / ulp + 8388608.0) - 8388608.0) * ulp  # adding 2^23 rounds a/ulp (< 16) to an integer, ties to even
    return tl.where(v < 0, -r, r)


@triton.jit
def _fp8_step(acc, a, w, a_scale, s_e, rows, first_row, n_ok, k0, stride_sn, W_BLOCKED: tl.constexpr,
              W_TILE_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + one 128-deep FP8 product, scaled by its activation group scales (and, for 128x128
    weight blocks, the block scale of each column) in fp32: promoted every K step.

    W_TILE_SCALE: the tile's rows (``first_row`` onwards) lie in one 128-row block, so one weight
    scale serves the tile: the promotion is one FFMA per accumulator element (the CUDA cores run
    it between tensor-core steps, so it is on the loop's critical path)."""
    if W_TILE_SCALE:
        w_scale = tl.load(s_e + (first_row // FP8_GROUP) * stride_sn + k0 // FP8_GROUP)
        out = tl.dot(a, w, input_precision=DOT_PRECISION) * (a_scale * w_scale)[:, None] + acc
    else:
        part = tl.dot(a, w, input_precision=DOT_PRECISION) * a_scale[:, None]
        if W_BLOCKED:
            part *= tl.load(s_e + (rows // FP8_GROUP) * stride_sn + k0 // FP8_GROUP, mask=n_ok, other=0.0)[None, :]
        out = acc + part
    return out


@triton.jit
def _fp8_quantize_store(act, h_ptr, h_rows, stride_hm, offs_n, hs_ptr, stride_hs, pid_n, row_ok, n_ok,
                        EMULATED: tl.constexpr):
    """GEMM1 epilogue for FP8 GEMM2 inputs: each row's BLOCK_N (= 128) columns are one 1x128 group:
    scale = amax / 448, codes = act / scale rounded to E4M3 (formats.fp8.quantize_groups)."""
    scale = tl.max(tl.abs(act), axis=1) / E4M3_MAX  # masked columns hold 0
    q = act / tl.where(scale > 0, scale, 1.0)[:, None]
    q = tl.minimum(tl.maximum(q, -E4M3_MAX), E4M3_MAX)
    if EMULATED:
        q = _round_e4m3(q)
    tl.store(h_ptr + h_rows[:, None] * stride_hm + offs_n[None, :], q.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])
    tl.store(hs_ptr + h_rows * stride_hs + pid_n, scale, mask=row_ok)


@triton.jit
def _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP: tl.constexpr):
    """Local expert of one pair (scalar), -1 when out of range or on another rank."""
    gid = tl.load(ids_ptr + pair)
    ok = (gid >= 0) & (gid < num_global)
    if HAS_MAP:
        lid = tl.load(expert_map_ptr + gid, mask=ok, other=-1)
    else:
        lid = gid
    return tl.where(ok & (lid >= 0) & (lid < num_local), lid, -1)


@triton.jit
def _activate(gate, up, ACTIVATION: tl.constexpr):
    """act(gate, up) in fp32: SiLU(gate) * up, or gpt-oss's clamped SwiGLU with its +1 on up."""
    if ACTIVATION == SILU_AND_MUL:
        act = gate * tl.sigmoid(gate) * up
    else:
        g = tl.minimum(gate, SWIGLU_LIMIT)
        u = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        act = (u + 1.0) * g * tl.sigmoid(SWIGLU_ALPHA * g)
    return act


@triton.jit
def _slot_operands(pair, ids_ptr, expert_map_ptr, num_global, num_local, w_ptr, stride_we, s_ptr, stride_se,
                   h_ptr, stride_hm, HAS_MAP: tl.constexpr):
    """One (token, slot) pair of a per-token GEMM2: (local expert or -1, its weights, its scales,
    the pair's activation row)."""
    e = _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP)
    return (e, w_ptr + e.to(tl.int64) * stride_we, s_ptr + e.to(tl.int64) * stride_se,
            h_ptr + pair.to(tl.int64) * stride_hm)


@triton.jit
def _block_rows(pid_m, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, ids_ptr, expert_map_ptr, num_pairs,
                rows_per_expert, num_global, num_local, ROWS: tl.constexpr, HAS_MAP: tl.constexpr,
                BLOCK_M: tl.constexpr, ROWS_M: tl.constexpr):
    """(expert, slot of each row in the compact row space, pair id of each row, row valid) for the
    first ROWS_M rows of row block pid_m (BLOCK_M rows). Each mode reads its own pointers:

    ALIGNED (block_expert, sorted_pairs): row slot = position in the aligned pair list, pair = sorted pair id.
    BATCHED (expert_tokens): row slot = e * M + m, pair = m.
    PER_PAIR (ids, expert_map): block = pair, row 0 only.
    Expert -1 means nothing to do.
    """
    lanes = tl.arange(0, ROWS_M)
    if ROWS == BATCHED:
        blocks_per_expert = tl.cdiv(rows_per_expert, BLOCK_M)
        e = pid_m // blocks_per_expert
        m = (pid_m % blocks_per_expert) * BLOCK_M + lanes
        count = tl.minimum(tl.load(expert_tokens_ptr + e), rows_per_expert)
        row_ok = m < count
        e = tl.where(tl.max(row_ok.to(tl.int32), axis=0) > 0, e, -1)
        return e, e.to(tl.int64) * rows_per_expert + m, m, row_ok
    if ROWS == PER_PAIR:
        e = _pair_expert(ids_ptr, expert_map_ptr, pid_m, num_global, num_local, HAS_MAP)
        return e, pid_m.to(tl.int64) + lanes, pid_m + lanes, lanes == 0
    e = tl.load(block_expert_ptr + pid_m)
    pos = pid_m * BLOCK_M + lanes
    pair = tl.load(sorted_pairs_ptr + pos)
    return e, pos.to(tl.int64), pair, pair < num_pairs


@triton.jit
def _tail_block(pid_m, sorted_pairs_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """Aligned row block pid_m holds at most BLOCK_M // 2 pairs: its second half is padding (the
    sentinel num_pairs), since an expert's pairs fill its blocks from the first row."""
    return tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_pairs


# _gemm1_rows and _gemm2_rows take their kernel's parameters again (Triton's JIT functions take no
# **kwargs): each kernel runs one of them at BLOCK_M or BLOCK_M // 2 rows.
@triton.jit
def _gemm1_rows(
    ROWS_M: tl.constexpr,  # rows this program computes: BLOCK_M, or the first half of a tail block
    pid_m, pid_n,
    x_ptr, stride_xe, stride_xm, stride_xk,  # standard: x [T, H] (stride_xe unused); batched: x [E, M, H]
    w_ptr, stride_we, stride_wn, stride_wk,  # w13 [E, 2I, H] (4-bit formats: bytes [E, 2I, H/2])
    w_desc,  # W_TMA: TMA descriptor of w13 as [E*2I, H] rows, box [BLOCK_N, BLOCK_K]
    s_ptr, stride_se, stride_sn, gs_ptr,  # 4-bit block scales [E, 2I, H/group]; NVFP4 global scales [E]
    bias_ptr, stride_be, stride_bn,  # w13_bias [E, 2I] (HAS_BIAS)
    h_ptr, stride_hm,  # out: activations [rows, I], row = compact row slot (FP8: E4M3 codes)
    delta_ptr, stride_dm,  # HAS_DELTA: added before the activation, [rows, 2I] in w13's row order (h's rows)
    xs_ptr, stride_xs, hs_ptr, stride_hs,  # FP8: x group scales [x rows, H/128]; out: h group scales [rows, I/128]
    block_expert_ptr, sorted_pairs_ptr,  # ALIGNED: int32 expert per row block [blocks], pair per row [blocks * BM]
    expert_tokens_ptr,  # BATCHED: int32 valid rows per expert [E]
    ids_ptr, expert_map_ptr,  # PER_PAIR: int32 expert per pair [num_pairs]; global -> local [num_global] (HAS_MAP)
    num_pairs, top_k, rows_per_expert, num_m_blocks, num_global, num_local,
    I, K,
    gate_step, up_offset,  # gate of column n is w13 row n * gate_step, up is that + up_offset
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, HAS_MAP: tl.constexpr, ACTIVATION: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_BLOCKED: tl.constexpr = False,  # FP8 weights: 128x128 block scales (else one scale per column)
    HALVES_ASM: tl.constexpr = False,  # 4-bit: inline PTX for the bf16 pair of a byte (not in the interpreter)
    W_TILE_SCALE: tl.constexpr = False,  # FP8 blocks: each tile's gate rows and up rows in one 128-row block
    EVEN_K: tl.constexpr = False,  # K % BLOCK_K == 0
    W_TMA: tl.constexpr = False,  # weight tiles by TMA copies (w_desc)
    PAIRED: tl.constexpr = False,  # interleaved gate/up rows (dense): one tile of 2 * BLOCK_N rows, one product
    SCALES_AHEAD: tl.constexpr = False,  # 4-bit: each step's scale codes loaded a step ahead (_w4_scales)
    W4_WORDS: tl.constexpr = False,  # 4-bit, bf16: codes decoded a word at a time (_w4_words_bf16)
    H_PAIRED: tl.constexpr = False,  # h's columns in _paired_columns order (for a word-decoded GEMM2)
    HAS_DELTA: tl.constexpr = False,  # LoRA on w13 (kernels/lora.py): its term per row, added like the bias
    DELTA_WAIT: tl.constexpr = False,  # launched as the delta kernel's programmatic dependent: wait before reading it
    W4_PAIRS: tl.constexpr = False,  # 4-bit codes in the "pairs" byte layout (formats/fp4.py)
):
    """gemm1_act_kernel's work on the first ROWS_M rows of row block pid_m."""
    e, h_rows, pair, row_ok = _block_rows(pid_m, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, ids_ptr,
                                          expert_map_ptr, num_pairs, rows_per_expert, num_global, num_local, ROWS,
                                          HAS_MAP, BLOCK_M, ROWS_M)
    if e >= 0:
        if ROWS == BATCHED:
            x_rows = e.to(tl.int64) * stride_xe + pair.to(tl.int64) * stride_xm
            xs_rows = (e.to(tl.int64) * rows_per_expert + pair) * stride_xs
        else:
            x_rows = (pair // top_k).to(tl.int64) * stride_xm
            xs_rows = (pair // top_k).to(tl.int64) * stride_xs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        # H_PAIRED: h's column p holds intermediate column _paired_columns(p), a permutation inside each 8
        # columns (I % 8 == 0), so the tile's columns and their mask stay the same
        cols = _paired_columns(offs_n) if H_PAIRED else offs_n
        gate_rows = cols.to(tl.int64) * gate_step
        up_rows = gate_rows + up_offset
        gate_first = pid_n * BLOCK_N  # W_TILE_SCALE: gate_step is 1
        # W_TMA: the expert's first row in the [E*2I, H] view (experts back to back)
        w_row0 = e * (stride_we // stride_wn)
        desc_gate = (w_row0 + gate_first).to(tl.int32)  # gate_step 1
        # PAIRED: rows 2n (gate) and 2n + 1 (up) side by side, as the product's adjacent columns
        pair_rows = (2 * pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N)).to(tl.int64)
        acc_pair = tl.zeros([ROWS_M, 2 * BLOCK_N], dtype=tl.float32)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        if FORMAT == MXFP4 or FORMAT == NVFP4:  # transposed accumulators: the weight is the MMA's A operand
            acc_gate = tl.zeros([BLOCK_N, ROWS_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, ROWS_M], dtype=tl.float32)
        else:
            acc_gate = tl.zeros([ROWS_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([ROWS_M, BLOCK_N], dtype=tl.float32)
        if FORMAT == MXFP4 or FORMAT == NVFP4:
            s_gate = _w4_first_scales(s_e, gate_rows, n_ok, K, stride_sn, FORMAT, BLOCK_K, SCALES_AHEAD)
            s_up = _w4_first_scales(s_e, up_rows, n_ok, K, stride_sn, FORMAT, BLOCK_K, SCALES_AHEAD)
        r_gate = _w4a8_row_exponents(s_e, gate_rows, n_ok, K, stride_sn, FORMAT)
        r_up = _w4a8_row_exponents(s_e, up_rows, n_ok, K, stride_sn, FORMAT)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            # Masked rows read zeros: padding (NaN or garbage) never enters the sums.
            a = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :] * stride_xk,
                        mask=_and_k(row_ok[:, None], offs_k, K, 1, EVEN_K), other=0.0)
            if FORMAT == MXFP4 or FORMAT == NVFP4:
                sg, s_gate = _w4_step_scales(s_gate, s_e, gate_rows, n_ok, k0, K, stride_sn, FORMAT, BLOCK_K,
                                             SCALES_AHEAD)
                su, s_up = _w4_step_scales(s_up, s_e, up_rows, n_ok, k0, K, stride_sn, FORMAT, BLOCK_K, SCALES_AHEAD)
                acc_gate = _w4_dot(acc_gate, a, w_e, s_e, sg, gate_rows, n_ok, k0, K, stride_wn, stride_sn, FORMAT,
                                   BLOCK_K, DOT_PRECISION, HALVES_ASM, EVEN_K, SCALES_AHEAD, W4_WORDS, W4_PAIRS)
                acc_up = _w4_dot(acc_up, a, w_e, s_e, su, up_rows, n_ok, k0, K, stride_wn, stride_sn, FORMAT,
                                 BLOCK_K, DOT_PRECISION, HALVES_ASM, EVEN_K, SCALES_AHEAD, W4_WORDS, W4_PAIRS)
            elif PAIRED:
                w_pair = _weight_tile(w_e, s_e, pair_rows, pair_rows < 2 * I, k0, K, stride_wn, stride_wk, stride_sn,
                                      FORMAT, BLOCK_K, a.dtype, EVEN_K=EVEN_K, w_desc=w_desc,
                                      desc_row=(w_row0 + 2 * gate_first).to(tl.int32), W_TMA=W_TMA)
                acc_pair = tl.dot(a, w_pair, acc_pair, input_precision=DOT_PRECISION)
            else:
                w_gate = _weight_tile(w_e, s_e, gate_rows, n_ok, k0, K, stride_wn, stride_wk, stride_sn, FORMAT,
                                      BLOCK_K, a.dtype, EVEN_K=EVEN_K, w_desc=w_desc, desc_row=desc_gate, W_TMA=W_TMA,
                                      r=r_gate, PAIRS=W4_PAIRS)
                w_up = _weight_tile(w_e, s_e, up_rows, n_ok, k0, K, stride_wn, stride_wk, stride_sn, FORMAT, BLOCK_K,
                                    a.dtype, EVEN_K=EVEN_K, w_desc=w_desc, desc_row=desc_gate + up_offset, W_TMA=W_TMA,
                                    r=r_up, PAIRS=W4_PAIRS)
                if FORMAT >= FP8:
                    a_scale = tl.load(xs_ptr + xs_rows + k0 // FP8_GROUP, mask=row_ok, other=0.0)
                    acc_gate = _fp8_step(acc_gate, a, w_gate, a_scale, s_e, gate_rows, gate_first, n_ok, k0, stride_sn,
                                         W_BLOCKED, W_TILE_SCALE, DOT_PRECISION)
                    acc_up = _fp8_step(acc_up, a, w_up, a_scale, s_e, up_rows, gate_first + up_offset, n_ok, k0,
                                       stride_sn, W_BLOCKED, W_TILE_SCALE, DOT_PRECISION)
                else:
                    acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
                    acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        if FORMAT == MXFP4 or FORMAT == NVFP4:
            acc_gate = tl.trans(acc_gate)
            acc_up = tl.trans(acc_up)
        if PAIRED:
            acc_gate, acc_up = tl.split(tl.reshape(acc_pair, [ROWS_M, BLOCK_N, 2]))
        if FORMAT == NVFP4:
            gs = _nvfp4_divisor(gs_ptr, e, W4_WORDS)
            acc_gate = acc_gate / gs
            acc_up = acc_up / gs
        if (FORMAT == FP8 or FORMAT == FP8_EMULATED) and not W_BLOCKED:  # one scale per output column (per-channel,
            # or per-tensor with stride 0)
            acc_gate *= tl.load(s_e + gate_rows * stride_sn, mask=n_ok, other=0.0)[None, :]
            acc_up *= tl.load(s_e + up_rows * stride_sn, mask=n_ok, other=0.0)[None, :]
        if FORMAT >= W4A8:
            acc_gate *= _w4a8_row_scale(r_gate)[None, :]
            acc_up *= _w4a8_row_scale(r_up)[None, :]
        if HAS_BIAS:
            b_e = bias_ptr + e.to(tl.int64) * stride_be
            acc_gate += tl.load(b_e + gate_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(b_e + up_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_DELTA:
            if DELTA_WAIT:  # the K loop ran beside the delta kernel; its rows are read after its grid ends
                gdc_wait()
            d_rows = delta_ptr + h_rows[:, None] * stride_dm
            d_ok = row_ok[:, None] & n_ok[None, :]
            acc_gate += tl.load(d_rows + gate_rows[None, :], mask=d_ok, other=0.0).to(tl.float32)
            acc_up += tl.load(d_rows + up_rows[None, :], mask=d_ok, other=0.0).to(tl.float32)
        act = _activate(acc_gate, acc_up, ACTIVATION)
        if FORMAT >= FP8:
            _fp8_quantize_store(act, h_ptr, h_rows, stride_hm, offs_n, hs_ptr, stride_hs, pid_n, row_ok, n_ok,
                                FORMAT == FP8_EMULATED or FORMAT == W4A8_EMULATED)
        else:
            tl.store(h_ptr + h_rows[:, None] * stride_hm + offs_n[None, :], act.to(h_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def gemm1_act_kernel(
    x_ptr, stride_xe, stride_xm, stride_xk,  # standard: x [T, H] (stride_xe unused); batched: x [E, M, H]
    w_ptr, stride_we, stride_wn, stride_wk,  # w13 [E, 2I, H] (4-bit formats: bytes [E, 2I, H/2])
    w_desc,  # W_TMA: TMA descriptor of w13 as [E*2I, H] rows, box [BLOCK_N, BLOCK_K]
    s_ptr, stride_se, stride_sn, gs_ptr,  # 4-bit block scales [E, 2I, H/group]; NVFP4 global scales [E]
    bias_ptr, stride_be, stride_bn,  # w13_bias [E, 2I] (HAS_BIAS)
    h_ptr, stride_hm,  # out: activations [rows, I], row = compact row slot (FP8: E4M3 codes)
    delta_ptr, stride_dm,  # HAS_DELTA: added before the activation, [rows, 2I] in w13's row order (h's rows)
    xs_ptr, stride_xs, hs_ptr, stride_hs,  # FP8: x group scales [x rows, H/128]; out: h group scales [rows, I/128]
    block_expert_ptr, sorted_pairs_ptr,  # ALIGNED: int32 expert per row block [blocks], pair per row [blocks * BM]
    expert_tokens_ptr,  # BATCHED: int32 valid rows per expert [E]
    ids_ptr, expert_map_ptr,  # PER_PAIR: int32 expert per pair [num_pairs]; global -> local [num_global] (HAS_MAP)
    num_pairs, top_k, rows_per_expert, num_m_blocks, num_global, num_local,
    I, K,
    gate_step, up_offset,  # gate of column n is w13 row n * gate_step, up is that + up_offset
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, HAS_MAP: tl.constexpr, ACTIVATION: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_BLOCKED: tl.constexpr = False,  # FP8 weights: 128x128 block scales (else one scale per column)
    HALVES_ASM: tl.constexpr = False,  # 4-bit: inline PTX for the bf16 pair of a byte (not in the interpreter)
    W_TILE_SCALE: tl.constexpr = False,  # FP8 blocks: each tile's gate rows and up rows in one 128-row block
    EVEN_K: tl.constexpr = False,  # K % BLOCK_K == 0
    W_TMA: tl.constexpr = False,  # weight tiles by TMA copies (w_desc)
    PAIRED: tl.constexpr = False,  # interleaved gate/up rows (dense): one tile of 2 * BLOCK_N rows, one product
    HALF_TAILS: tl.constexpr = False,  # aligned rows: blocks half padding or more compute half the rows
    SCALES_AHEAD: tl.constexpr = False,  # 4-bit: scale codes a step ahead
    W4_WORDS: tl.constexpr = False,  # 4-bit, bf16: codes decoded a word at a time
    H_PAIRED: tl.constexpr = False,  # h's columns in _paired_columns order
    HAS_DELTA: tl.constexpr = False,  # LoRA on w13: delta rows added before the activation
    DELTA_WAIT: tl.constexpr = False,  # launched as the delta kernel's programmatic dependent
    W4_PAIRS: tl.constexpr = False,  # 4-bit codes in the "pairs" byte layout (formats/fp4.py)
):
    pid_m, pid_n = _tile_ids(num_m_blocks, tl.cdiv(I, BLOCK_N), GROUP_M)
    # Each expert's last block of the aligned list is half padding or more about half the time at
    # prefill sizes (its rows are what is left of the expert's count): the tensor cores then run
    # half the rows. Both row counts compile into this kernel; the block picks at run time.
    half = _tail_block(pid_m, sorted_pairs_ptr, num_pairs, BLOCK_M) if HALF_TAILS else False
    if half:
        _gemm1_rows(BLOCK_M // 2, pid_m, pid_n,
                    x_ptr, stride_xe, stride_xm, stride_xk, w_ptr, stride_we, stride_wn, stride_wk, w_desc, s_ptr,
                    stride_se, stride_sn, gs_ptr, bias_ptr, stride_be, stride_bn, h_ptr, stride_hm, delta_ptr, stride_dm,
                    xs_ptr, stride_xs, hs_ptr, stride_hs, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr,
                    ids_ptr, expert_map_ptr, num_pairs, top_k, rows_per_expert, num_m_blocks, num_global, num_local,
                    I, K, gate_step, up_offset, HAS_BIAS, ROWS, HAS_MAP, ACTIVATION, DOT_PRECISION, FORMAT, BLOCK_M,
                    BLOCK_N, BLOCK_K, GROUP_M, W_BLOCKED, HALVES_ASM, W_TILE_SCALE, EVEN_K, W_TMA, PAIRED,
                    SCALES_AHEAD, W4_WORDS, H_PAIRED, HAS_DELTA, DELTA_WAIT, W4_PAIRS)
    else:
        _gemm1_rows(BLOCK_M, pid_m, pid_n,
                    x_ptr, stride_xe, stride_xm, stride_xk, w_ptr, stride_we, stride_wn, stride_wk, w_desc, s_ptr,
                    stride_se, stride_sn, gs_ptr, bias_ptr, stride_be, stride_bn, h_ptr, stride_hm, delta_ptr, stride_dm,
                    xs_ptr, stride_xs, hs_ptr, stride_hs, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr,
                    ids_ptr, expert_map_ptr, num_pairs, top_k, rows_per_expert, num_m_blocks, num_global, num_local,
                    I, K, gate_step, up_offset, HAS_BIAS, ROWS, HAS_MAP, ACTIVATION, DOT_PRECISION, FORMAT, BLOCK_M,
                    BLOCK_N, BLOCK_K, GROUP_M, W_BLOCKED, HALVES_ASM, W_TILE_SCALE, EVEN_K, W_TMA, PAIRED,
                    SCALES_AHEAD, W4_WORDS, H_PAIRED, HAS_DELTA, DELTA_WAIT, W4_PAIRS)
    # Every program waits, those without rows too: this grid then ends after the delta kernel's, whose buffers the
    # launches after it may reuse (a second wait returns at once)
    if DELTA_WAIT:
        gdc_wait()


@triton.jit
def _gemm2_rows(
    ROWS_M: tl.constexpr,  # rows this program computes: BLOCK_M, or the first half of a tail block
    pid_m, pid_n,
    h_ptr, stride_hm,  # activations [rows, I] from gemm1_act_kernel
    hs_ptr, stride_hs,  # FP8: their group scales [rows, I/128]
    w_ptr, stride_we, stride_wn, stride_wk,  # w2 [E, H, I] (4-bit formats: bytes [E, H, I/2])
    w_desc,  # W_TMA: TMA descriptor of w2 as [E*H, I] rows, box [BLOCK_N, BLOCK_K]
    s_ptr, stride_se, stride_sn, gs_ptr,  # 4-bit block scales [E, H, I/group]; NVFP4 global scales [E]
    bias_ptr, stride_be, stride_bn,  # w2_bias [E, H] (HAS_BIAS)
    weights_ptr,  # float32 [num_pairs] router weights (standard format)
    y_ptr, stride_ye, stride_ym,  # standard: per-pair outputs [num_pairs, H]; batched: out [E, M, H]
    delta_ptr,  # HAS_DELTA: LoRA on w2 (kernels/lora.py), y's layout: added to the sums before the router weight
    block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr,
    ids_ptr, expert_map_ptr,  # PER_PAIR: int32 expert per pair [num_pairs]; global -> local [num_global] (HAS_MAP)
    num_pairs, rows_per_expert, num_m_blocks, num_global, num_local,
    N, K,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_BLOCKED: tl.constexpr = False, HALVES_ASM: tl.constexpr = False, W_TILE_SCALE: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, W_TMA: tl.constexpr = False,
    SCALES_AHEAD: tl.constexpr = False,  # 4-bit: each step's scale codes loaded a step ahead (_w4_scales)
    W4_WORDS: tl.constexpr = False,  # 4-bit, bf16: codes decoded a word at a time (_w4_words_bf16)
    HAS_DELTA: tl.constexpr = False,
    DELTA_WAIT: tl.constexpr = False,  # launched as the delta kernel's programmatic dependent: wait before reading it
    W4_PAIRS: tl.constexpr = False,  # 4-bit codes in the "pairs" byte layout (formats/fp4.py)
    HAS_MAP: tl.constexpr = False,
):
    """gemm2_kernel's work on the first ROWS_M rows of row block pid_m."""
    e, h_rows, pair, row_ok = _block_rows(pid_m, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, ids_ptr,
                                          expert_map_ptr, num_pairs, rows_per_expert, num_global, num_local,
                                          ROWS, HAS_MAP, BLOCK_M, ROWS_M)
    if ROWS == PER_PAIR and e < 0:  # a pair of no local expert adds zeros: its row is written all the same
        offs_z = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + offs_z, tl.zeros([BLOCK_N], y_ptr.dtype.element_ty),
                 mask=offs_z < N)
    if e >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = offs_n.to(tl.int64)
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        if FORMAT == MXFP4 or FORMAT == NVFP4:  # transposed accumulator: the weight is the MMA's A operand
            acc = tl.zeros([BLOCK_N, ROWS_M], dtype=tl.float32)
        else:
            acc = tl.zeros([ROWS_M, BLOCK_N], dtype=tl.float32)
        if FORMAT == MXFP4 or FORMAT == NVFP4:
            s_w = _w4_first_scales(s_e, rows, n_ok, K, stride_sn, FORMAT, BLOCK_K, SCALES_AHEAD)
        r_w = _w4a8_row_exponents(s_e, rows, n_ok, K, stride_sn, FORMAT)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(h_ptr + h_rows[:, None] * stride_hm + offs_k[None, :],
                        mask=_and_k(row_ok[:, None], offs_k, K, 1, EVEN_K), other=0.0)
            if FORMAT == MXFP4 or FORMAT == NVFP4:
                s_now, s_w = _w4_step_scales(s_w, s_e, rows, n_ok, k0, K, stride_sn, FORMAT, BLOCK_K, SCALES_AHEAD)
                acc = _w4_dot(acc, a, w_e, s_e, s_now, rows, n_ok, k0, K, stride_wn, stride_sn, FORMAT, BLOCK_K,
                              DOT_PRECISION, HALVES_ASM, EVEN_K, SCALES_AHEAD, W4_WORDS, W4_PAIRS)
            else:
                w = _weight_tile(w_e, s_e, rows, n_ok, k0, K, stride_wn, stride_wk, stride_sn, FORMAT, BLOCK_K, a.dtype,
                                 EVEN_K=EVEN_K, w_desc=w_desc,
                                 desc_row=(e * (stride_we // stride_wn) + pid_n * BLOCK_N).to(tl.int32), W_TMA=W_TMA,
                                 r=r_w, PAIRS=W4_PAIRS)
                if FORMAT >= FP8:
                    a_scale = tl.load(hs_ptr + h_rows * stride_hs + k0 // FP8_GROUP, mask=row_ok, other=0.0)
                    acc = _fp8_step(acc, a, w, a_scale, s_e, rows, pid_n * BLOCK_N, n_ok, k0, stride_sn, W_BLOCKED,
                                    W_TILE_SCALE, DOT_PRECISION)
                else:
                    acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if FORMAT == MXFP4 or FORMAT == NVFP4:
            acc = tl.trans(acc)
        if FORMAT == NVFP4:
            acc = acc / _nvfp4_divisor(gs_ptr, e, W4_WORDS)
        if (FORMAT == FP8 or FORMAT == FP8_EMULATED) and not W_BLOCKED:
            acc *= tl.load(s_e + rows * stride_sn, mask=n_ok, other=0.0)[None, :]
        if FORMAT >= W4A8:
            acc *= _w4a8_row_scale(r_w)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=n_ok,
                           other=0.0).to(tl.float32)[None, :]
        if ROWS == BATCHED:
            y_rows = e.to(tl.int64) * stride_ye + pair.to(tl.int64) * stride_ym
        else:
            y_rows = pair.to(tl.int64) * stride_ym
        if HAS_DELTA:
            if DELTA_WAIT:  # the K loop ran beside the delta kernel; its rows are read after its grid ends
                gdc_wait()
            acc += tl.load(delta_ptr + y_rows[:, None] + offs_n[None, :], mask=row_ok[:, None] & n_ok[None, :],
                           other=0.0).to(tl.float32)
        if ROWS != BATCHED:
            acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        tl.store(y_ptr + y_rows[:, None] + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def gemm2_kernel(
    h_ptr, stride_hm,  # activations [rows, I] from gemm1_act_kernel
    hs_ptr, stride_hs,  # FP8: their group scales [rows, I/128]
    w_ptr, stride_we, stride_wn, stride_wk,  # w2 [E, H, I] (4-bit formats: bytes [E, H, I/2])
    w_desc,  # W_TMA: TMA descriptor of w2 as [E*H, I] rows, box [BLOCK_N, BLOCK_K]
    s_ptr, stride_se, stride_sn, gs_ptr,  # 4-bit block scales [E, H, I/group]; NVFP4 global scales [E]
    bias_ptr, stride_be, stride_bn,  # w2_bias [E, H] (HAS_BIAS)
    weights_ptr,  # float32 [num_pairs] router weights (standard format)
    y_ptr, stride_ye, stride_ym,  # standard: per-pair outputs [num_pairs, H]; batched: out [E, M, H]
    delta_ptr,  # HAS_DELTA: LoRA on w2, y's layout: added to the sums before the router weight
    block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr,
    ids_ptr, expert_map_ptr,  # PER_PAIR: int32 expert per pair [num_pairs]; global -> local [num_global] (HAS_MAP)
    num_pairs, rows_per_expert, num_m_blocks, num_global, num_local,
    N, K,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_BLOCKED: tl.constexpr = False, HALVES_ASM: tl.constexpr = False, W_TILE_SCALE: tl.constexpr = False,
    EVEN_K: tl.constexpr = False, W_TMA: tl.constexpr = False,
    HALF_TAILS: tl.constexpr = False,  # aligned rows: blocks half padding or more compute half the rows
    SCALES_AHEAD: tl.constexpr = False,  # 4-bit: scale codes a step ahead
    W4_WORDS: tl.constexpr = False,  # 4-bit, bf16: codes decoded a word at a time
    HAS_DELTA: tl.constexpr = False,  # LoRA on w2: delta rows added before the router weight
    DELTA_WAIT: tl.constexpr = False,  # launched as the delta kernel's programmatic dependent
    W4_PAIRS: tl.constexpr = False,  # 4-bit codes in the "pairs" byte layout (formats/fp4.py)
    HAS_MAP: tl.constexpr = False,  # PER_PAIR rows: expert_map given
):
    pid_m, pid_n = _tile_ids(num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    # half tail blocks: as in gemm1_act_kernel
    half = _tail_block(pid_m, sorted_pairs_ptr, num_pairs, BLOCK_M) if HALF_TAILS else False
    if half:
        _gemm2_rows(BLOCK_M // 2, pid_m, pid_n,
                    h_ptr, stride_hm, hs_ptr, stride_hs, w_ptr, stride_we, stride_wn, stride_wk, w_desc, s_ptr,
                    stride_se, stride_sn, gs_ptr, bias_ptr, stride_be, stride_bn, weights_ptr, y_ptr, stride_ye,
                    stride_ym, delta_ptr, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, ids_ptr,
                    expert_map_ptr, num_pairs, rows_per_expert, num_m_blocks, num_global, num_local, N, K, HAS_BIAS,
                    ROWS, DOT_PRECISION, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, W_BLOCKED, HALVES_ASM,
                    W_TILE_SCALE, EVEN_K, W_TMA, SCALES_AHEAD, W4_WORDS, HAS_DELTA, DELTA_WAIT, W4_PAIRS, HAS_MAP)
    else:
        _gemm2_rows(BLOCK_M, pid_m, pid_n,
                    h_ptr, stride_hm, hs_ptr, stride_hs, w_ptr, stride_we, stride_wn, stride_wk, w_desc, s_ptr,
                    stride_se, stride_sn, gs_ptr, bias_ptr, stride_be, stride_bn, weights_ptr, y_ptr, stride_ye,
                    stride_ym, delta_ptr, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, ids_ptr,
                    expert_map_ptr, num_pairs, rows_per_expert, num_m_blocks, num_global, num_local, N, K, HAS_BIAS,
                    ROWS, DOT_PRECISION, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, W_BLOCKED, HALVES_ASM,
                    W_TILE_SCALE, EVEN_K, W_TMA, SCALES_AHEAD, W4_WORDS, HAS_DELTA, DELTA_WAIT, W4_PAIRS, HAS_MAP)
    if DELTA_WAIT:  # every program (see gemm1_act_kernel)
        gdc_wait()


@triton.jit
def gemm2_tokens_kernel(
    h_ptr, stride_hm,  # activations [num_pairs, I] (PER_PAIR gemm1)
    hs_ptr, stride_hs,  # FP8: their group scales [num_pairs, I/128]
    w_ptr, stride_we, stride_wn, stride_wk,  # w2 [E, H, I] (4-bit formats: bytes [E, H, I/2])
    s_ptr, stride_se, stride_sn, gs_ptr,  # 4-bit block scales; NVFP4 global scales [E]
    bias_ptr, stride_be, stride_bn,  # w2_bias [E, H] (HAS_BIAS)
    weights_ptr, ids_ptr, expert_map_ptr,  # float32 / int32 [num_pairs], int32 [num_global] (HAS_MAP)
    out_ptr, stride_ot,  # out [T, H]
    top_k, num_global, num_local, N, K,
    HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, DOT_PRECISION: tl.constexpr, FORMAT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_BLOCKED: tl.constexpr = False, HALVES_ASM: tl.constexpr = False, W_TILE_SCALE: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,
    W4_PAIRS: tl.constexpr = False,  # 4-bit codes in the "pairs" byte layout (formats/fp4.py)
):
    """Decode GEMM2 per token: its k slots in order, each a weighted expert product, summed in
    registers and written once (no per-slot buffer, no combine launch). Row 0 of each tile is the
    pair; the other rows pad the tensor-core shape. Each slot's weighted product is rounded to out's
    dtype before the fp32 sum, as the aligned mode's per-pair buffer is before combine_kernel adds it:
    with dense weights the two modes give the same bits (batch-invariant mode may serve this one at
    decode sizes: configs.INVARIANT_PER_PAIR_SPLIT_SLOTS)."""
    num_n = tl.cdiv(N, BLOCK_N)
    t = tl.program_id(0) // num_n
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    row0 = (tl.arange(0, BLOCK_M) == 0)[:, None]
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, top_k):
        pair = t * top_k + j
        e, w_e, s_e, h_row = _slot_operands(pair, ids_ptr, expert_map_ptr, num_global, num_local, w_ptr, stride_we,
                                            s_ptr, stride_se, h_ptr, stride_hm, HAS_MAP)
        if e >= 0:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            r_w = _w4a8_row_exponents(s_e, offs_n.to(tl.int64), n_ok, K, stride_sn, FORMAT)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(h_row + tl.zeros([BLOCK_M, 1], tl.int64) + offs_k[None, :],
                            mask=_and_k(row0, offs_k, K, 1, EVEN_K), other=0.0)
                w = _weight_tile(w_e, s_e, offs_n.to(tl.int64), n_ok, k0, K, stride_wn, stride_wk, stride_sn, FORMAT,
                                 BLOCK_K, a.dtype, HALVES_ASM, EVEN_K, r=r_w, PAIRS=W4_PAIRS)
                if FORMAT >= FP8:
                    a_scale = tl.load(hs_ptr + pair.to(tl.int64) * stride_hs + k0 // FP8_GROUP + tl.zeros([BLOCK_M], tl.int64))
                    acc = _fp8_step(acc, a, w, a_scale, s_e, offs_n.to(tl.int64), (tl.program_id(0) % num_n) * BLOCK_N,
                                    n_ok, k0, stride_sn, W_BLOCKED, W_TILE_SCALE, DOT_PRECISION)
                else:
                    acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            # row 0 alone: the padding rows are 0 * w, NaN where w2 holds an Inf (the pair's own row is Inf there,
            # as the reference's and the aligned mode's are)
            y = tl.sum(tl.where(row0, acc, 0.0), axis=0)
            if FORMAT == NVFP4:
                y = y / tl.load(gs_ptr + e)
            if (FORMAT == FP8 or FORMAT == FP8_EMULATED) and not W_BLOCKED:
                y *= tl.load(s_e + offs_n.to(tl.int64) * stride_sn, mask=n_ok, other=0.0)
            if FORMAT >= W4A8:
                y *= _w4a8_row_scale(r_w)
            if HAS_BIAS:
                y += tl.load(bias_ptr + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
            total += (y * tl.load(weights_ptr + pair)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def combine_kernel(
    y_ptr,  # per-pair outputs [T * k, H]
    pair_expert_ptr,  # int32 [T * k]: -1 = the pair contributes nothing (its row was never written)
    out_ptr, stride_ot,  # out [T, H]
    H, top_k,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, top_k):  # slots in order: the sum is the same bits on every run
        pair = t.to(tl.int64) * top_k + j
        live = tl.load(pair_expert_ptr + pair) >= 0
        acc += tl.load(y_ptr + pair * H + offs, mask=h_ok & live, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)
