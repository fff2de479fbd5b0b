"""Gluon kernel of gluon_w4.py: C[M, N] = A[M, K] (bf16) @ dequant(W[N, K] MXFP4)^T on Hopper (sm_90),
fp32 accumulation, bf16 out, with the 4-bit decode in warps of its own (issue 28, part 3).

Why a producer/consumer shape: moekit's Triton 4-bit GEMMs decode each weight tile inside the MMA warps, so the
decode's integer work and the tensor-core work share one instruction stream (and 255 registers). Here three
partitions of one CTA run concurrently and meet only in shared memory:

  loader   (1 warp, few registers)  TMA copies of the activation tile A [BM, BK], the packed codes [BN, BK/32, 16]
           and the scales [BK/32, BN] of each K step into a ring of STAGES slots. It never touches the data; the
           copies complete on the slot's mbarriers (expect-tx byte counts).
  decode   (DECODE_WARPS warps)  waits for a slot's codes and scales, reads them into registers, hands the code
           slot back to the loader, turns the codes into bf16 weights (shifts, masks and one bf16 multiply per
           element, or Triton's fp4 conversion: DECODE below) and writes the [BN, BK] bf16 tile, in the swizzled
           layout wgmma reads, into a second ring of STAGES slots.
  MMA      (the default partition, num_warps = 4 or 8: one or two warpgroups)  waits for A and the decoded W of a
           step, issues one asynchronous wgmma (A and W both from shared memory), keeps one in flight, and hands the
           previous step's A and W slots back once that wgmma has retired; stores C from the fp32 accumulator.

Barriers (all count 1: Gluon's mbarrier.arrive is one arrival per partition, made by one thread after Triton has
synchronized the partition's warps, so every warp's shared loads and stores come before it; TMA completions are
expect-tx):
  q_ready[s]  loader -> decode   codes + scales of slot s landed (TMA)
  q_empty[s]  decode -> loader   codes + scales of slot s are in the decode warps' registers
  a_ready[s]  loader -> MMA      A of slot s landed (TMA)
  a_empty[s]  MMA -> loader      the wgmma that read A of slot s has retired
  w_ready[s]  decode -> MMA      decoded W of slot s written (and fenced for the async proxy that wgmma reads)
  w_empty[s]  MMA -> decode      the wgmma that read W of slot s has retired
Step i uses slot i % STAGES at phase (i // STAGES) & 1; a fresh mbarrier reads as having completed the phase
before 0, so producers wait their "empty" barriers at the flipped phase and the first pass does not block.

The decode (DECODE):
  BITS  the brief's identity: an E2M1 nibble n placed as bf16 bits ((n & 7) << 6) | ((n & 8) << 12) reads
        e2m1(n) * 2^-126 (code 1 is the bf16 subnormal 2^-127), so one multiply by 2^(s - 1) gives
        e2m1(n) * 2^(s - 127), the MXFP4 value. 2^(s - 1) is a bf16 for scale bytes s <= 128 only; FULL_RANGE
        adds a second multiply (2^min(s-1, 127) then 2^max(s-128, 0), NaN for s = 255) so that every byte is exact.
        The host picks FULL_RANGE from the weights' largest scale byte, once, when it prepares them (gpt-oss's
        scales are near 2^-9..2^-3, bytes 118..125: one multiply).
  WORDS the same identity on int32 words of 8 codes prepared at load time (gluon_w4.prepare_codes) so that codes
        2j and 2j + 1 sit in nibbles j and 4 + j, 16 bits apart like the two halves of the bf16 pair they become:
        one shift places both magnitudes, one both signs, two masks, then one mul.rn.bf16x2 by the factor in both
        halves (FULL_RANGE: two). The pairs are stored as int32 words through an int32 view of the wgmma tile
        (the same bytes under the same 128-byte swizzle). About 3 SASS instructions per weight against 6.7 for
        BITS on bytes as stored (gluon_w4.py --compile-only counts them).
  CVT   Triton's own fp4 -> bf16 conversion (gl.fp4_to_fp: e2m1 values, all normal) times 2^(s - 127) built from
        the byte's bits (s = 0: the subnormal 2^-127; s = 255: NaN): one multiply, exact for every byte.
All three are exact (every product is representable, or overflows to inf exactly where the float64 value does);
tests/test_gluon_w4.py checks all three on the CPU, emulated with the same integer operations
(gluon_w4.emulate_decode), against moekit.formats.mxfp4.dequantize bit for bit, every code under every scale byte.

Layouts. A is [M, K] bf16 as it is (TMA box [BM, BK], 128-byte swizzle). The codes are moekit's MXFP4Tensor data
[N, K/2] (BITS, CVT; WORDS: the same bytes with nibbles permuted, as int32) read through a 3-D view
[N, K/32, 16 bytes] (box [BN, BK/32, 16 bytes]: one scale group per innermost row, no swizzle) so that a decode
thread loads whole groups with one 128-bit load. The scales are prepared once, at load time, as
[K/32, N] (gluon_w4.prepare_scales, exact round trip): moekit's [N, K/32] rows are K/32 = 90 bytes apart, not the
16-byte multiple TMA needs, and a tile's BN bytes of one group are then one contiguous box row.

Constraints of this prototype: K % BK == 0 (gpt-oss: K = 2880 = 45 x 64), N and M may have partial tiles (TMA
fills out-of-range boxes with zeros; C's stores are masked), one output tile per CTA (no persistent schedule).

What should limit it (H200, per SM per clock: ~4096 dense bf16 FLOP, 128 bytes of shared memory): an SS wgmma
m64nN reads its B operand (the decoded W) once per 64 rows of A and A once per N columns, so the rings cost
(1/64 + 1/BN) bytes per FLOP of reads plus 1/BN (A's TMA), 1/BM (the decoded W's stores) and 1/(2 BM) (codes in
and out) of writes: 168 B/clk at BM = BN = 128 (the MMA can run at most at ~76% of peak), 148 at BM = 256,
BN = 128 (~86%), 136 at BM = 128, BN = 256 (~94%). The decode warps issue about 3 SASS instructions per weight
(WORDS), once per BM rows: 2 decode warps feeding BN = 256 issue ~700 instructions per K step each against
~1000 clocks of wgmma. Both bounds are what the GPU run should confirm or refute.

API fit (triton 3.6.0): gl.warp_specialize takes [(default_fn, args), (worker_fn, args), ...], then the workers'
warp counts and register budgets; workers take no tensors (descriptors, shared-memory views and scalars only),
which is what the rings are. Nothing had to be adapted.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

BITS = gl.constexpr(0)
CVT = gl.constexpr(1)
WORDS = gl.constexpr(2)
MAG2 = gl.constexpr(0x01C001C0)  # bits 6..8 of both bf16 halves: an E2M1 magnitude under the exponent's lowest bit
SIGN2 = gl.constexpr(-0x7FFF8000)  # 0x80008000 as int32: both bf16 sign bits


@gluon.jit
def _loader(a_desc, q_desc, s_desc, a_bufs, q_bufs, s_bufs, a_ready, a_empty, q_ready, q_empty, off_m, off_n,
            k_steps):
    STAGES: gl.constexpr = a_bufs.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    G: gl.constexpr = q_desc.block_type.shape[1]
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + s_desc.block_type.nbytes
    for i in range(k_steps):
        s = i % STAGES
        phase = (i // STAGES) & 1
        # The codes first: the decode stands between them and the MMA, A is only needed by the MMA.
        mbarrier.wait(q_empty.index(s), phase ^ 1)
        mbarrier.expect(q_ready.index(s), q_bytes)
        tma.async_copy_global_to_shared(q_desc, [off_n, i * G, 0], q_ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(s_desc, [i * G, off_n], q_ready.index(s), s_bufs.index(s))
        mbarrier.wait(a_empty.index(s), phase ^ 1)
        mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], a_ready.index(s), a_bufs.index(s))


@gluon.jit
def _factor_bits(sc, FULL_RANGE: gl.constexpr, DECODE: gl.constexpr):
    """bf16 bit patterns (in ``sc``'s integer type) of the factors for scale bytes ``sc``: (f1, f2), f2 only used
    with FULL_RANGE. Built from the byte's bits: no exp2, no table."""
    if DECODE == CVT:
        # 2^(s - 127) is the bf16 with exponent field s; s = 0 is the subnormal 2^-127 (mantissa bit 6); s = 255
        # would read as inf where MXFP4 means NaN.
        bits = gl.where(sc == 0, 0x40, sc << 7)
        bits = gl.where(sc == 255, 0x7FC0, bits)
        return bits, bits
    elif FULL_RANGE:
        f1 = (gl.minimum(sc, 128) + 126) << 7  # 2^(min(s, 128) - 1)
        f2 = gl.where(sc == 255, 0x7FC0, (gl.maximum(sc, 128) - 1) << 7)  # 2^(max(s, 128) - 128), NaN for 255
        return f1, f2
    else:
        f = (sc + 126) << 7  # 2^(s - 1): the host guarantees s <= 128
        return f, f


@gluon.jit
def _e2m1_bits(n):
    """bf16 reading e2m1(n) * 2^-126 for int16 nibbles n in [0, 16): magnitude bits under the exponent field's
    lowest bit, sign on bit 15."""
    return (((n & 7) << 6) | ((n & 8) << 12)).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _bf16x2_mul(x, f):
    """Two bf16 products per int32 word (mul.rn.bf16x2: subnormal inputs kept, unlike fp32 math under ftz)."""
    return gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [x, f], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _pair_word(w, J: gl.constexpr):
    """bf16x2 bits of codes 2J (low half) and 2J + 1 (high half) of a prepared word (gluon_w4.prepare_codes: the
    even codes of 8 in nibbles 0..3, the odd ones in nibbles 4..7). Both codes sit 16 bits apart, as their bf16 halves
    do, so one shift places both magnitudes and another both signs: two shifts and two masks per pair."""
    if J == 0:
        mag = w << 6
    elif J == 1:
        mag = w << 2
    elif J == 2:
        mag = w >> 2  # arithmetic shifts copy the sign into bits MAG2 drops
    else:
        mag = w >> 6
    if J == 3:
        sign = w
    else:
        sign = w << (12 - 4 * J)
    return (mag & MAG2) | (sign & SIGN2)


@gluon.jit
def _scales(s_slot, r0, SUB: gl.constexpr, L3: gl.constexpr):
    """Scale bytes [SUB, G] of rows r0 .. r0 + SUB of a [G, BN] slot, in the decode layout's (row, group) slice.
    Read as [G, SUB] and transposed in registers: a permuted view of the slot read the bytes as if they were
    stored [BN, G] (H100 and H200, triton 3.6.0; the GPU tests caught it)."""
    G: gl.constexpr = s_slot.shape[0]
    rows: gl.constexpr = gl.BlockedLayout([1, 1], [G, 32 // G], [1, L3.warps_per_cta[0]], [0, 1])
    sc = s_slot.slice(r0, SUB, dim=1).load(rows)  # [G, SUB]
    return gl.convert_layout(gl.permute(sc, (1, 0)), gl.SliceLayout(2, L3))


@gluon.jit
def _decode_words(q_slot, s_slot, w_slot, r0, SUB: gl.constexpr, L3: gl.constexpr, FULL_RANGE: gl.constexpr):
    """WORDS: rows r0 .. r0 + SUB of one slot from prepared int32 code words [SUB, G, 4] (8 codes each) to bf16
    pairs, written as int32 words into the (reinterpreted) wgmma tile."""
    G: gl.constexpr = q_slot.shape[1]
    BK: gl.constexpr = G * 32
    BN: gl.constexpr = w_slot.shape[0]
    w = q_slot.slice(r0, SUB, dim=0).load(L3)  # int32 [SUB, G, 4]: a thread owns whole groups (one 128-bit load)
    sc = _scales(s_slot, r0, SUB, L3).to(gl.int32)
    f1, f2 = _factor_bits(sc, FULL_RANGE, BITS)
    f1 = gl.expand_dims(f1 | (f1 << 16), 2)  # the factor in both halves
    o0 = _bf16x2_mul(_pair_word(w, 0), f1)
    o1 = _bf16x2_mul(_pair_word(w, 1), f1)
    o2 = _bf16x2_mul(_pair_word(w, 2), f1)
    o3 = _bf16x2_mul(_pair_word(w, 3), f1)
    if FULL_RANGE:
        f2 = gl.expand_dims(f2 | (f2 << 16), 2)
        o0 = _bf16x2_mul(o0, f2)
        o1 = _bf16x2_mul(o1, f2)
        o2 = _bf16x2_mul(o2, f2)
        o3 = _bf16x2_mul(o3, f2)
    # [SUB, G, 4 words, 2, 2] -> word m, pair j = 2 x + y at int32 index 4 m + j, i.e. k = 8 m + 2 j (+1 high half)
    pairs = gl.reshape(gl.join(gl.join(o0, o2), gl.join(o1, o3)), [SUB, BK // 2])
    # The wgmma tile seen as int32 words: the same bytes under the same 128-byte swizzle (16-byte units; BK = 64
    # makes the bf16 rows 128 bytes, the host checks it).
    w_words = w_slot._reinterpret(gl.int32, [BN, BK // 2], gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                                                element_bitwidth=32, rank=2))
    w_words.slice(r0, SUB, dim=0).store(pairs)


@gluon.jit
def _decode_rows(q_slot, s_slot, w_slot, r0, SUB: gl.constexpr, L3: gl.constexpr, FULL_RANGE: gl.constexpr,
                 DECODE: gl.constexpr):
    """Rows r0 .. r0 + SUB of one slot: codes [SUB, G, 16] and scales [SUB, G] from shared memory into registers,
    as bf16 [SUB, BK] into the wgmma ring. Returns nothing; the caller fences and signals."""
    G: gl.constexpr = q_slot.shape[1]
    BK: gl.constexpr = G * 32
    q = q_slot.slice(r0, SUB, dim=0).load(L3)  # uint8 [SUB, G, 16]: a thread owns whole 16-byte groups
    sc = _scales(s_slot, r0, SUB, L3).to(gl.int16)
    f1, f2 = _factor_bits(sc, FULL_RANGE, DECODE)
    # (gl.where with a constant widens int16 to int32: back to 16 bits before the bf16 reinterpretation)
    f1 = gl.expand_dims(f1.to(gl.int16).to(gl.bfloat16, bitcast=True), 2)
    f2 = gl.expand_dims(f2.to(gl.int16).to(gl.bfloat16, bitcast=True), 2)
    if DECODE == CVT:
        w = gl.fp4_to_fp(q, gl.bfloat16, 2)  # [SUB, G, 32] in k order (low nibble first)
        w = w * gl.convert_layout(f1, w.type.layout)
        w = gl.reshape(w, [SUB, BK])
    else:
        q16 = q.to(gl.int16)
        lo = _e2m1_bits(q16 & 15) * f1  # even k
        hi = _e2m1_bits(q16 >> 4) * f1  # odd k
        if FULL_RANGE:
            lo = lo * f2
            hi = hi * f2
        w = gl.reshape(gl.join(lo, hi), [SUB, BK])  # [SUB, G, 16, 2] -> k = 32 g + 2 j + (0: low, 1: high)
    w_slot.slice(r0, SUB, dim=0).store(w)


@gluon.jit
def _decoder(q_bufs, s_bufs, w_bufs, q_ready, q_empty, w_ready, w_empty, k_steps, SUB: gl.constexpr,
             FULL_RANGE: gl.constexpr, DECODE: gl.constexpr, DECODE_WARPS: gl.constexpr):
    STAGES: gl.constexpr = q_bufs.shape[0]
    BN: gl.constexpr = q_bufs.shape[1]
    G: gl.constexpr = q_bufs.shape[2]
    # One thread per (row, group): its 16 code bytes are one 128-bit shared load and its 32 weights one 64-byte
    # run of the bf16 row (four 16-byte vectors, each kept whole by the 128-byte swizzle).
    L3: gl.constexpr = gl.BlockedLayout([1, 1, q_bufs.shape[3]], [32 // G, G, 1], [DECODE_WARPS, 1, 1], [2, 1, 0])
    for i in range(k_steps):
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(q_ready.index(s), phase)
        mbarrier.wait(w_empty.index(s), phase ^ 1)
        for r in gl.static_range(BN // SUB):
            if DECODE == WORDS:
                _decode_words(q_bufs.index(s), s_bufs.index(s), w_bufs.index(s), r * SUB, SUB, L3, FULL_RANGE)
            else:
                _decode_rows(q_bufs.index(s), s_bufs.index(s), w_bufs.index(s), r * SUB, SUB, L3, FULL_RANGE,
                             DECODE)
        # The code slot was read by generic loads and the next TMA write to it goes through the async proxy; the
        # decoded tile was written by generic stores and wgmma reads it through the async proxy: one fence orders
        # both before the arrivals that let the other side go.
        fence_async_shared()
        mbarrier.arrive(q_empty.index(s))
        mbarrier.arrive(w_ready.index(s))


@gluon.jit
def _mma_k_loop(a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, k_steps, num_warps: gl.constexpr):
    """The MMA partition's K loop: the fp32 [BM, BN] wgmma accumulator, every wgmma retired on return (its layout,
    for the epilogue's indices: ``acc.type.layout``)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BM: gl.constexpr = a_bufs.shape[1]
    BN: gl.constexpr = w_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, BN, 16])
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    for i in range(k_steps):
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(a_ready.index(s), phase)
        mbarrier.wait(w_ready.index(s), phase)
        acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, use_acc=i > 0, is_async=True)
        # One wgmma in flight: the one of step i - 1 has retired, its slots go back to the loader and the decode.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        prev = (i + STAGES - 1) % STAGES
        mbarrier.arrive(a_empty.index(prev), pred=i > 0)
        mbarrier.arrive(w_empty.index(prev), pred=i > 0)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))


@gluon.jit
def _mma(a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, c_ptr, stride_cm, M, N, off_m, off_n, k_steps,
         num_warps: gl.constexpr):
    BM: gl.constexpr = a_bufs.shape[1]
    BN: gl.constexpr = w_bufs.shape[1]
    acc = _mma_k_loop(a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, k_steps, num_warps)
    acc_layout: gl.constexpr = acc.type.layout
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    offs = gl.expand_dims(rows.to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    gl.store(c_ptr + offs, acc.to(gl.bfloat16), mask=mask)


@gluon.jit
def _rings(a_desc, q_desc, s_desc, STAGES: gl.constexpr):
    """The shared-memory rings (A, codes, scales, decoded W) and their barriers, initialized."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = q_desc.block_type.shape[0]
    G: gl.constexpr = q_desc.block_type.shape[1]
    gl.static_assert(G * 32 == BK, "the codes' box must hold BK / 32 groups")
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, G, BN], s_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], w_layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(s), count=1)
        mbarrier.init(a_empty.index(s), count=1)
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=1)
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=1)
    return a_bufs, q_bufs, s_bufs, w_bufs, a_ready, a_empty, q_ready, q_empty, w_ready, w_empty


@gluon.jit
def w4_gemm_kernel(a_desc, q_desc, s_desc, c_ptr, stride_cm, M, N, K, STAGES: gl.constexpr, SUB: gl.constexpr,
                   FULL_RANGE: gl.constexpr, DECODE: gl.constexpr, DECODE_WARPS: gl.constexpr,
                   LOAD_REGS: gl.constexpr, DECODE_REGS: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = q_desc.block_type.shape[0]
    # M blocks vary fastest: neighbouring CTAs decode the same weight tile, so its codes come from L2.
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BM)
    off_m = (pid % num_m) * BM
    off_n = (pid // num_m) * BN
    k_steps = K // BK

    a_bufs, q_bufs, s_bufs, w_bufs, a_ready, a_empty, q_ready, q_empty, w_ready, w_empty = _rings(
        a_desc, q_desc, s_desc, STAGES)

    gl.warp_specialize([
        (_mma, (a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, c_ptr, stride_cm, M, N, off_m, off_n, k_steps,
                num_warps)),
        (_loader, (a_desc, q_desc, s_desc, a_bufs, q_bufs, s_bufs, a_ready, a_empty, q_ready, q_empty, off_m, off_n,
                   k_steps)),
        (_decoder, (q_bufs, s_bufs, w_bufs, q_ready, q_empty, w_ready, w_empty, k_steps, SUB, FULL_RANGE, DECODE,
                    DECODE_WARPS)),
    ], [1, DECODE_WARPS], [LOAD_REGS, DECODE_REGS])
