"""LoRA on the experts: each (token, expert) pair's adapter term scaling[a] * B[a, e] (A[a, e] v), over the same
rows the expert GEMMs run (experts/lora.py launches them and documents the layouts).

The shrink (v [rows, K] times A^T: [rows, r] in fp32) and the expand (times B^T: [rows, N]):
- lora_blocks_kernel: rows in blocks of one expert (the aligned pair list, or a batched slab), both products on the
  tensor cores in one program (the rank-r intermediate never leaves registers). A block's rows may belong to
  different adapters: several adapters of small rank run as one product of their columns side by side, each row
  keeping its own (_all_adapters); otherwise the program runs the products once per adapter present in the block
  (an absent adapter costs one compare), each on that adapter's rows only;
- lora_shrink_kernel + lora_expand_kernel: the decode modes, which have no alignment and so no block of one expert,
  on the CUDA cores: the shrink per (pair, K split) into fp32 partial sums, then per (row, column tile) the splits
  summed, the expand, and a token's slots summed (W2).
STAGE W13 writes the term as GEMM1's ``delta`` rows, which GEMM1 adds before its activation (zero rows where a pair
has no adapter: GEMM1 reads every live row). STAGE W2 adds the router-weighted term into GEMM2's output, before the
slots are combined; or lora_blocks_kernel writes it (W2_DELTA), unweighted, in fp32, as GEMM2's ``delta`` rows in
its output's layout, which GEMM2 adds to its sums before the router weight. Written as deltas, the terms let each
GEMM start as the LoRA kernel's programmatic dependent (LAUNCH_DEPENDENTS): its K loop runs beside the LoRA kernel
and waits for it only before the epilogue. Adapter ids outside [0, adapters) contribute nothing, like -1.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ...routing.kernels.router import _gpu_release_fence
from .align import _local_ids
from .moe_gemm import ALIGNED, BATCHED, FP8_GROUP, _pair_expert, _paired_columns

W13 = tl.constexpr(1)  # input x, output GEMM1's delta rows (stored)
W2 = tl.constexpr(2)  # input GEMM1's output h, output GEMM2's (added to, router-weighted) or its delta rows (stored)


@triton.jit
def _block_rows(pid, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, num_pairs, rows_per_expert,
                ROWS: tl.constexpr, BLOCK_M: tl.constexpr, LORA_M: tl.constexpr):
    """(expert, h row of each lane, pair (aligned) or slab row (batched) of each lane, lane valid) of LoRA block
    pid: LORA_M rows inside one BLOCK_M row block of the aligned list (one expert), or of one expert's slab."""
    lanes = tl.arange(0, LORA_M)
    if ROWS == BATCHED:
        per_expert = tl.cdiv(rows_per_expert, LORA_M)
        e = pid // per_expert
        m = (pid % per_expert) * LORA_M + lanes
        valid = m < tl.minimum(tl.load(expert_tokens_ptr + e), rows_per_expert)
        return e, e.to(tl.int64) * rows_per_expert + m, m, valid
    pos = pid * LORA_M + lanes
    e = tl.load(block_expert_ptr + (pid * LORA_M) // BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + pos)
    return e, pos.to(tl.int64), pair, pair < num_pairs


@triton.jit
def _adapter_base(ptr, a, e64, stride_a, stride_e):
    """Adapter a's matrix of expert e: 64-bit offsets (a is a loop counter; e64 makes the product 64-bit)."""
    return ptr + (e64 * 0 + a) * stride_a + e64 * stride_e


@triton.jit
def _all_adapters(v_ptr, stride_vk, vs_ptr, a_ptr, stride_aa, stride_ae, stride_ar, stride_ak,
                  b_ptr, stride_ba, stride_be, stride_bn, stride_br, scaling_ptr, out_ptr,
                  e64, adapter, live, valid, v_rows, vs_rows, out_rows, coeff, num_adapters, N, K, R,
                  HAS_SCALES: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  LORA_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr,
                  V_PAIRED: tl.constexpr, ADAPTERS_PAD: tl.constexpr, STORE: tl.constexpr):
    """lora_blocks_kernel with every adapter at once: A's rows of all adapters side by side as one [K, adapters * r]
    operand, so the block's rows are read once (not once per adapter present) and the output tile is written once;
    each row then keeps its own adapter's columns (the others are exact zeros in the expand's sums, and the columns of
    adapters absent from the block are not read; a tile whose product is not finite is redone an adapter at a time,
    so that one adapter's NaN or Inf stays in its own rows)."""
    C: tl.constexpr = ADAPTERS_PAD * R_PAD
    offs_c = tl.arange(0, C)
    c_ad = offs_c // R_PAD
    c_r = offs_c % R_PAD
    c_ok = (c_ad < num_adapters) & (c_r < R)
    a_cols_base = a_ptr + c_ad.to(tl.int64) * stride_aa + e64 * stride_ae + c_r * stride_ar
    s = tl.zeros([LORA_M, C], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        v = tl.load(v_ptr + v_rows[:, None] + offs_k[None, :] * stride_vk, mask=live[:, None] & k_ok[None, :],
                    other=0.0)
        a_k = _paired_columns(offs_k) if V_PAIRED else offs_k
        w = tl.load(a_cols_base[None, :] + a_k[:, None] * stride_ak, mask=c_ok[None, :] & k_ok[:, None], other=0.0)
        part = tl.dot(v.to(w.dtype), w, input_precision=DOT_PRECISION)
        if HAS_SCALES:
            part *= tl.load(vs_ptr + vs_rows + k0 // FP8_GROUP, mask=live, other=0.0)[:, None]
        s += part
    own = live[:, None] & (adapter[:, None] == c_ad[None, :]) & c_ok[None, :]
    scale = tl.load(scaling_ptr + c_ad, mask=c_ad < num_adapters, other=0.0)
    s = tl.where(own, s * scale[None, :], 0.0).to(b_ptr.dtype.element_ty)
    # B's columns of adapters no row here uses stay unread (zeros): their zero coefficients would not cancel a NaN or
    # Inf there (an adapter slot allocated but never written), and 0 * NaN poisons every row of the product
    present = tl.max(own.to(tl.int32), axis=0) > 0
    b_cols_base = b_ptr + c_ad.to(tl.int64) * stride_ba + e64 * stride_be + c_r * stride_br
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w = tl.load(b_cols_base[:, None] + offs_n[None, :] * stride_bn,
                    mask=(c_ok & present)[:, None] & n_ok[None, :], other=0.0)
        d = tl.dot(s, w, input_precision=DOT_PRECISION)
        if tl.max(tl.where(tl.abs(d) < float("inf"), 0, 1)) > 0:
            # A NaN or Inf in the tile: one adapter's non-finite B would reach the other adapters' rows through the
            # one product (their zero coefficients times NaN), so each adapter's rows take a product of its own
            # columns only. Finite tiles (all but bad adapters) never come here.
            d = tl.zeros([LORA_M, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(ADAPTERS_PAD):
                w_j = tl.where((c_ad == j)[:, None], w, 0.0)
                d += tl.where((adapter == j)[:, None], tl.dot(s, w_j, input_precision=DOT_PRECISION), 0.0)
        ptrs = out_ptr + out_rows[:, None] + offs_n[None, :]
        if STORE:  # every valid row: zeros without an adapter
            tl.store(ptrs, d.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
        else:
            ok = live[:, None] & n_ok[None, :]
            y = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
            tl.store(ptrs, (y + d * coeff[:, None]).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def lora_blocks_kernel(
    v_ptr, stride_ve, stride_vm, stride_vk,  # W13: x [T, H] (stride_ve unused) or batched x [E, M, H]; W2: h [rows, I]
    vs_ptr, stride_vs,  # HAS_SCALES: v's FP8 group scales [v rows, K/128] (v holds E4M3 codes)
    a_ptr, stride_aa, stride_ae, stride_ar, stride_ak,  # A [adapters, E, r, K]
    b_ptr, stride_ba, stride_be, stride_bn, stride_br,  # B [adapters, E, N, r]
    scaling_ptr,  # fp32 [adapters]
    adapter_ptr,  # int32 adapter ids: aligned, per token [T]; batched, per slab row [E * M]
    out_ptr, stride_oe, stride_om,  # W13: delta [rows, N] (stride_oe unused); W2: y [pairs, H] or batched out [E, M, H]
    # (W2_DELTA: GEMM2's fp32 delta in that layout)
    weights_ptr,  # W2, aligned, added: fp32 router weights [pairs]
    block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr,
    num_pairs, top_k, rows_per_expert, num_adapters, N, K, R,
    STAGE: tl.constexpr, ROWS: tl.constexpr, HAS_SCALES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, LORA_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr,
    V_PAIRED: tl.constexpr = False,  # W2: h's columns in _paired_columns order (GEMM1 wrote them for a 4-bit GEMM2)
    ADAPTERS_PAD: tl.constexpr = 0,  # > 0: every adapter's rank-r columns side by side in one product (_all_adapters)
    W2_DELTA: tl.constexpr = False,  # W2: store the unweighted term as GEMM2's delta, not add the weighted one to y
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # the GEMM that adds this term starts as this grid's dependent
):
    STORE: tl.constexpr = STAGE == W13 or W2_DELTA
    if LAUNCH_DEPENDENTS:  # its K loop runs meanwhile; it waits for this grid before reading the term
        gdc_launch_dependents()
    e, h_rows, pair, valid = _block_rows(tl.program_id(0), block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr,
                                         num_pairs, rows_per_expert, ROWS, BLOCK_M, LORA_M)
    if e >= 0:
        e64 = e.to(tl.int64)
        if ROWS == BATCHED:
            adapter = tl.load(adapter_ptr + h_rows, mask=valid, other=-1)
            x_rows = e64 * stride_ve + pair.to(tl.int64) * stride_vm
            x_scale_rows = h_rows
            y_rows = e64 * stride_oe + pair.to(tl.int64) * stride_om
        else:
            token = (pair // top_k).to(tl.int64)
            adapter = tl.load(adapter_ptr + token, mask=valid, other=-1)
            x_rows = token * stride_vm
            x_scale_rows = token
            y_rows = pair.to(tl.int64) * stride_om
        if STAGE == W13:
            v_rows, vs_rows, out_rows = x_rows, x_scale_rows * stride_vs, h_rows * stride_om
        else:
            v_rows, vs_rows, out_rows = h_rows * stride_vm, h_rows * stride_vs, y_rows
        live = valid & (adapter >= 0) & (adapter < num_adapters)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < R
        if STAGE == W2 and ROWS == ALIGNED and not W2_DELTA:  # GEMM2 weighted its rows by the router: so is the term
            coeff = tl.load(weights_ptr + pair, mask=live, other=0.0)
        else:
            coeff = tl.full([LORA_M], 1.0, tl.float32)
        if ADAPTERS_PAD > 0:
            _all_adapters(v_ptr, stride_vk, vs_ptr, a_ptr, stride_aa, stride_ae, stride_ar, stride_ak,
                          b_ptr, stride_ba, stride_be, stride_bn, stride_br, scaling_ptr, out_ptr,
                          e64, adapter, live, valid, v_rows, vs_rows, out_rows, coeff, num_adapters, N, K, R,
                          HAS_SCALES, DOT_PRECISION, LORA_M, BLOCK_N, BLOCK_K, R_PAD, V_PAIRED, ADAPTERS_PAD, STORE)
        else:
            for a in range(0, num_adapters):
                mine = live & (adapter == a)
                if tl.max(mine.to(tl.int32), axis=0) > 0:
                    a_e = _adapter_base(a_ptr, a, e64, stride_aa, stride_ae)
                    s = tl.zeros([LORA_M, R_PAD], dtype=tl.float32)
                    for k0 in range(0, K, BLOCK_K):
                        offs_k = k0 + tl.arange(0, BLOCK_K)
                        k_ok = offs_k < K
                        # rows of other adapters (and padding) read zeros: their values never enter the sums
                        v = tl.load(v_ptr + v_rows[:, None] + offs_k[None, :] * stride_vk,
                                    mask=mine[:, None] & k_ok[None, :], other=0.0)
                        # V_PAIRED: v's column p is A's column _paired_columns(p), a permutation inside each 8
                        # (K % 8 == 0)
                        a_cols = _paired_columns(offs_k) if V_PAIRED else offs_k
                        w = tl.load(a_e + offs_r[None, :] * stride_ar + a_cols[:, None] * stride_ak,
                                    mask=r_ok[None, :] & k_ok[:, None], other=0.0)
                        part = tl.dot(v.to(w.dtype), w, input_precision=DOT_PRECISION)
                        if HAS_SCALES:  # E4M3 codes are exact in 16 bits; one group scale per row and step (BLOCK_K | 128)
                            part *= tl.load(vs_ptr + vs_rows + k0 // FP8_GROUP, mask=mine, other=0.0)[:, None]
                        s += part
                    b_e = _adapter_base(b_ptr, a, e64, stride_ba, stride_be)
                    # the expand runs on the tensor cores in B's dtype, as the GEMMs run theirs in the weights'
                    s = (s * tl.load(scaling_ptr + a)).to(b_ptr.dtype.element_ty)
                    for n0 in range(0, N, BLOCK_N):
                        offs_n = n0 + tl.arange(0, BLOCK_N)
                        n_ok = offs_n < N
                        w = tl.load(b_e + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                                    mask=n_ok[None, :] & r_ok[:, None], other=0.0)
                        d = tl.dot(s, w, input_precision=DOT_PRECISION)
                        ptrs = out_ptr + out_rows[:, None] + offs_n[None, :]
                        ok = mine[:, None] & n_ok[None, :]
                        if STORE:
                            tl.store(ptrs, d.to(out_ptr.dtype.element_ty), mask=ok)
                        else:
                            y = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
                            tl.store(ptrs, (y + d * coeff[:, None]).to(out_ptr.dtype.element_ty), mask=ok)
            none = valid & (live == 0)
            if STORE and tl.max(none.to(tl.int32), axis=0) > 0:
                for n0 in range(0, N, BLOCK_N):
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    tl.store(out_ptr + out_rows[:, None] + offs_n[None, :],
                             tl.zeros([LORA_M, BLOCK_N], dtype=out_ptr.dtype.element_ty),
                             mask=none[:, None] & (offs_n < N)[None, :])


@triton.jit
def lora_shrink_kernel(
    v_ptr, stride_vm, stride_vk,  # W13: x [T, H]; W2: h [pairs, I]
    vs_ptr, stride_vs,  # HAS_SCALES: v's FP8 group scales [v rows, K/128] (v holds E4M3 codes)
    a_ptr, stride_aa, stride_ae, stride_ar, stride_ak,  # A [adapters, E, r, K]
    adapter_ptr, ids_ptr, expert_map_ptr,  # int32 [T], int32 [pairs], int32 [num_global] (HAS_MAP)
    part_ptr,  # fp32 [pairs, splits, R_PAD]: this split's share of A[a, e] v (zeros without an adapter)
    top_k, num_global, num_local, num_adapters, K, R, k_per_split,
    STAGE: tl.constexpr, HAS_MAP: tl.constexpr, HAS_SCALES: tl.constexpr,
    BLOCK_K: tl.constexpr, R_PAD: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # GEMV1 with decode terms starts as this grid's programmatic dependent
    V_PAIRED: tl.constexpr = False,  # W2: h's columns in _paired_columns order (GEMM1 wrote them for a 4-bit GEMM2)
):
    """Program (pair, K split): the shrink of one pair over k_per_split of K, on the CUDA cores. Splitting K keeps
    each program's chain of dependent loads short: at one token the pairs alone are a handful of programs."""
    if LAUNCH_DEPENDENTS:  # GEMV1 streams its weights meanwhile; it waits for this grid before reading the sums
        gdc_launch_dependents()
    pair = tl.program_id(0)
    split = tl.program_id(1)
    token = pair // top_k
    e = _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP)
    a = tl.load(adapter_ptr + token)
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    s = tl.zeros([R_PAD], dtype=tl.float32)
    if (e >= 0) & (a >= 0) & (a < num_adapters):
        e64 = e.to(tl.int64)
        v_row = (token if STAGE == W13 else pair).to(tl.int64)
        a_e = _adapter_base(a_ptr, a, e64, stride_aa, stride_ae)
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_hi
            v = tl.load(v_ptr + v_row * stride_vm + offs_k * stride_vk, mask=k_ok, other=0.0).to(tl.float32)
            if HAS_SCALES:  # BLOCK_K divides 128: one group scale per step
                v *= tl.load(vs_ptr + v_row * stride_vs + k0 // FP8_GROUP)
            a_cols = _paired_columns(offs_k) if V_PAIRED else offs_k  # (a permutation inside each 8 columns)
            w = tl.load(a_e + offs_r[:, None] * stride_ar + a_cols[None, :] * stride_ak,
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            s += tl.sum(w * v[None, :], axis=1)
    tl.store(part_ptr + (pair.to(tl.int64) * tl.num_programs(1) + split) * R_PAD + offs_r, s)


@triton.jit
def lora_expand_kernel(
    part_ptr,  # fp32 [pairs, splits, R_PAD] (lora_shrink_kernel)
    b_ptr, stride_ba, stride_be, stride_bn, stride_br,  # B [adapters, E, N, r]
    scaling_ptr,  # fp32 [adapters]
    adapter_ptr,  # int32 adapter id per token [T]
    out_ptr, stride_om,  # W13: delta [pairs, N]; W2: out [T, H] (slots = top_k) or y [pairs, H] (slots = 1)
    weights_ptr, ids_ptr, expert_map_ptr,  # fp32 [pairs], int32 [pairs], int32 [num_global] (HAS_MAP)
    top_k, slots, num_global, num_local, num_adapters, N, R,
    STAGE: tl.constexpr, HAS_MAP: tl.constexpr,
    BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, SLOTS_PAD: tl.constexpr, SLOT_CHUNK: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (row g, BLOCK_N columns): the terms of pairs g * slots .. g * slots + slots - 1, their splits summed
    in split order and the slots in a fixed order, into output row g. W13 runs one pair per row; W2 a token's slots
    (the per-token GEMM2 wrote out[t]) or one pair (the split GEMM2 wrote y[pair]). SLOT_CHUNK slots' partial sums and
    B rows are loaded at once (all of them at small ranks): one round of loads per chunk."""
    num_n = tl.cdiv(N, BLOCK_N)
    g = tl.program_id(0) // num_n
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    any_live = 0
    for c in tl.static_range(0, SLOTS_PAD, SLOT_CHUNK):  # chunks of slots: the [chunk, BLOCK_N, r] tile's registers
        pair = g * slots + c + tl.arange(0, SLOT_CHUNK)
        token = pair // top_k
        e, ok = _local_ids(ids_ptr, expert_map_ptr, pair, g * slots + slots, num_global, num_local, HAS_MAP)
        a = tl.load(adapter_ptr + token, mask=ok, other=-1)
        live = ok & (a >= 0) & (a < num_adapters)
        e64 = tl.where(live, e, 0).to(tl.int64)
        a64 = tl.where(live, a, 0).to(tl.int64)
        rows = (pair.to(tl.int64) * SPLITS)[:, None] * R_PAD + offs_r[None, :]
        s = tl.zeros([SLOT_CHUNK, R_PAD], dtype=tl.float32)
        for i in tl.static_range(SPLITS):  # in split order (unrolled: the loads issue together)
            s += tl.load(part_ptr + rows + i * R_PAD, mask=live[:, None], other=0.0)
        s *= tl.load(scaling_ptr + a64, mask=live, other=0.0)[:, None]
        w = tl.load(b_ptr + (a64 * stride_ba + e64 * stride_be)[:, None, None] + offs_n[None, :, None] * stride_bn
                    + offs_r[None, None, :] * stride_br,
                    mask=live[:, None, None] & n_ok[None, :, None] & r_ok[None, None, :], other=0.0).to(tl.float32)
        d = tl.sum(w * s[:, None, :], axis=2)  # [chunk, BLOCK_N]
        if STAGE == W2:
            d *= tl.load(weights_ptr + pair, mask=live, other=0.0)[:, None]
        total += tl.sum(d, axis=0)
        any_live += tl.sum(live.to(tl.int32), axis=0)
    ptrs = out_ptr + g.to(tl.int64) * stride_om + offs_n
    if STAGE == W13:  # every pair's row: GEMM1 reads it (zeros without an adapter)
        tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=n_ok)
    elif any_live > 0:
        y = tl.load(ptrs, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + total).to(out_ptr.dtype.element_ty), mask=n_ok)


# ------------------------------------------------------------------- the decode modes' terms inside the GEMVs
# At a few tokens each extra launch costs as much as the adapters' arithmetic: with the decode terms
# (experts/lora.py, decode_terms) only W13's shrink runs as a kernel of its own, launched right before GEMV1, which
# starts as its programmatic dependent and waits for it after its own K loop (or GEMV1's first programs of each
# group compute it: w13_decode_shrink, experts/lora.py DECODE_W13_SHRINK_BY_GEMV1). GEMV1 adds W13's term to its
# sums (w13_decode_terms), then writes each pair's shrink of W2 over its block of h columns, and the last program
# of the pair's group adds the blocks in block order (w2_decode_parts; GEMV2 adding them after its K loop instead
# measured slower: benchmarks/results/archive/ab_decode_w2_sums_h100_2026-12-07.md); GEMV2 adds W2's term to its
# slots' weighted sum (w2_decode_term). The adapter stacks are contiguous there: their strides follow from the
# shapes.


@triton.jit
def w13_decode_rows(b_ptr, adapter, live, e64, gate_rows, up_rows, ok, num_local, two_i, R, R_PAD: tl.constexpr):
    """B13's rows of the pairs' gate and up columns ``gate_rows`` / ``up_rows`` [BLOCK_N], as loaded ([SLOTS,
    BLOCK_N, R_PAD] each): issued before GEMV1's K loop, so that its epilogue waits only for the shrink. B13:
    contiguous [adapters, E, 2I, R]."""
    offs_r = tl.arange(0, R_PAD)
    a64 = tl.where(live, adapter, 0).to(tl.int64)
    base = b_ptr + ((a64 * num_local + e64) * two_i) * R  # [SLOTS]: B13[a, e]
    m = (ok & live[:, None])[:, :, None] & (offs_r < R)[None, None, :]
    cols = offs_r[None, None, :]
    bg = tl.load(base[:, None, None] + gate_rows[None, :, None] * R + cols, mask=m, other=0.0)
    bu = tl.load(base[:, None, None] + up_rows[None, :, None] * R + cols, mask=m, other=0.0)
    return bg, bu


@triton.jit
def w13_decode_terms(parts_ptr, scaling_ptr, adapter, live, pair, bg, bu, SPLITS: tl.constexpr,
                     R_PAD: tl.constexpr):
    """(gate, up) terms [SLOTS, BLOCK_N] in fp32 of the pairs ``pair`` [SLOTS] (``live``: expert and adapter
    valid): lora_shrink_kernel's split partial sums [pairs, SPLITS, R_PAD] summed in split order and scaled (as
    lora_expand_kernel does), times B13's rows ``bg`` / ``bu`` (w13_decode_rows)."""
    offs_r = tl.arange(0, R_PAD)
    rows = pair.to(tl.int64)[:, None] * (SPLITS * R_PAD) + offs_r[None, :]
    s = tl.zeros([pair.shape[0], R_PAD], dtype=tl.float32)
    for i in tl.static_range(SPLITS):
        s += tl.load(parts_ptr + rows + i * R_PAD, mask=live[:, None], other=0.0)
    s *= tl.load(scaling_ptr + tl.where(live, adapter, 0), mask=live, other=0.0)[:, None]
    return (tl.sum(bg.to(tl.float32) * s[:, None, :], axis=2), tl.sum(bu.to(tl.float32) * s[:, None, :], axis=2))


# W13's shrink computed by GEMV1's own programs (experts/lora.py DECODE_W13_SHRINK_BY_GEMV1): its K splits are work
# items that the programs of a group (the same pairs, every block of h's columns) claim from a counter, each computed
# by the program that claimed it before that program waits for anything. A program claims one item as it starts
# (the group's first SPLITS column blocks only), and before waiting for the rest it claims and computes every item
# still unclaimed; so a waiter waits only for items that a running program holds, whatever order the GPU starts
# programs in and however few of them run at once (Triton's interpreter runs them one after another). Three
# counters per group from ``idx``: claims, splits written, programs done.
@triton.jit
def _w13_shrink_split(x_row, stride_xk, a_ptr, adapter, live, e64, pair, parts_ptr, cnt_ptr, idx, split, num_local, K,
                      R, k_per_split, like, SPLITS: tl.constexpr, R_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                      FENCE: tl.constexpr):
    """Split ``split`` of the pairs' shrinks [SLOTS, R_PAD] (A13[a, e] x over its K terms) into parts [pairs,
    SPLITS, R_PAD] (the layout lora_shrink_kernel writes), then counted as written (release). A13: contiguous
    [adapters, E, R, K]."""
    offs_r = tl.arange(0, R_PAD)
    base = a_ptr + ((tl.where(live, adapter, 0).to(tl.int64) * num_local + e64) * R) * K  # [SLOTS]: A13[a, e]
    m = live[:, None, None] & (offs_r < R)[None, :, None]
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    s = tl.zeros([pair.shape[0], R_PAD], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        v = tl.load(x_row + offs_k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(base[:, None, None] + offs_r[None, :, None] * K + offs_k[None, None, :],
                    mask=m & k_ok[None, None, :], other=0.0).to(tl.float32)
        s += tl.sum(w * v[None, None, :], axis=2)
    tl.store(parts_ptr + (pair.to(tl.int64)[:, None] * SPLITS + split) * R_PAD + offs_r[None, :], s,
             mask=live[:, None])
    if FENCE:
        _gpu_release_fence(like)
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + idx + 1, 1, sem="release", scope="gpu")


@triton.jit
def w13_decode_shrink(x_row, stride_xk, a_ptr, adapter, live, e64, pair, parts_ptr, cnt_ptr, idx, block, num_local,
                      K, R, k_per_split, like, SPLITS: tl.constexpr, R_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                      FENCE: tl.constexpr):
    """At a GEMV1 program's start (column block ``block`` of its group): one split claimed and computed, by the
    group's first SPLITS blocks (the others' claims would find none left once those start)."""
    if block < SPLITS:
        split = tl.atomic_add(cnt_ptr + idx, 1, sem="relaxed", scope="gpu")
        if split < SPLITS:
            _w13_shrink_split(x_row, stride_xk, a_ptr, adapter, live, e64, pair, parts_ptr, cnt_ptr, idx, split,
                              num_local, K, R, k_per_split, like, SPLITS, R_PAD, BLOCK_K, FENCE)


@triton.jit
def w13_decode_wait(x_row, stride_xk, a_ptr, adapter, live, e64, pair, parts_ptr, cnt_ptr, idx, num_local, K, R,
                    k_per_split, like, SPLITS: tl.constexpr, R_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                    FENCE: tl.constexpr):
    """Until every split of the group's shrink is written (acquire): the splits still unclaimed are claimed and
    computed here first, so the wait is only for splits that running programs hold."""
    written = tl.atomic_add(cnt_ptr + idx + 1, 0, sem="acquire", scope="gpu")
    claiming = written < SPLITS
    while written < SPLITS:
        if claiming:
            split = tl.atomic_add(cnt_ptr + idx, 1, sem="relaxed", scope="gpu")
            claiming = split < SPLITS
            if claiming:
                _w13_shrink_split(x_row, stride_xk, a_ptr, adapter, live, e64, pair, parts_ptr, cnt_ptr, idx, split,
                                  num_local, K, R, k_per_split, like, SPLITS, R_PAD, BLOCK_K, FENCE)
        written = tl.atomic_add(cnt_ptr + idx + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def w13_decode_leave(cnt_ptr, idx, num_n):
    """The group's last program to pass its wait zeroes the three counters for the next launch: every program of
    the group has made its claims and read the splits by then."""
    if tl.atomic_add(cnt_ptr + idx + 2, 1, sem="acq_rel", scope="gpu") == num_n - 1:
        tl.atomic_xchg(cnt_ptr + idx, 0)
        tl.atomic_xchg(cnt_ptr + idx + 1, 0)
        tl.atomic_xchg(cnt_ptr + idx + 2, 0)


@triton.jit
def w2_decode_cols(a_ptr, adapter, live, e64, offs_n, ok, num_local, inter, R, R_PAD: tl.constexpr):
    """A2's columns ``offs_n`` [BLOCK_N] of the pairs, as loaded ([SLOTS, R_PAD, BLOCK_N]): issued before GEMV1's K
    loop. A2: contiguous [adapters, E, R, I]."""
    offs_r = tl.arange(0, R_PAD)
    a64 = tl.where(live, adapter, 0).to(tl.int64)
    base = a_ptr + ((a64 * num_local + e64) * R) * inter  # [SLOTS]: A2[a, e]
    m = (ok & live[:, None])[:, None, :] & (offs_r < R)[None, :, None]
    return tl.load(base[:, None, None] + offs_r[None, :, None] * inter + offs_n[None, None, :], mask=m, other=0.0)


@triton.jit
def w2_decode_parts(a_cols, parts_ptr, cnt_ptr, scaling_ptr, adapter, live, pair, h, offs_n, group, block,
                    num_blocks, R_PAD: tl.constexpr, BLOCKS_PAD: tl.constexpr, FENCE: tl.constexpr):
    """W2's shrink of the pairs ``pair`` [SLOTS] (of one GEMV1 program group: the same pairs, every block of h's
    columns) on ``h`` [SLOTS, BLOCK_N] (fp32 of the values as stored) with A2's columns ``a_cols``
    (w2_decode_cols): each program writes its block's sums into parts [pairs, num_blocks + 1, R_PAD]; the group's
    last program to arrive (counter ``group``) adds the blocks in block order, scales them, and writes the pair's
    shrink at block index num_blocks, for GEMV2. Live pairs only (GEMV2 reads only those)."""
    offs_r = tl.arange(0, R_PAD)
    part = tl.sum(a_cols.to(tl.float32) * h[:, None, :], axis=2)
    rows = pair.to(tl.int64)[:, None] * (num_blocks + 1)
    tl.store(parts_ptr + (rows + block) * R_PAD + offs_r[None, :], part, mask=live[:, None])
    if tl.max(live.to(tl.int32), axis=0) > 0:  # the same for every program of the group
        if FENCE:
            _gpu_release_fence(offs_n)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu")
        if arrived == num_blocks - 1:
            offs_b = tl.arange(0, BLOCKS_PAD)
            sums = tl.load(parts_ptr + ((rows[:, :, None] + offs_b[None, :, None]) * R_PAD + offs_r[None, None, :]),
                           mask=live[:, None, None] & (offs_b < num_blocks)[None, :, None], other=0.0)
            a64 = tl.where(live, adapter, 0).to(tl.int64)
            shrink = tl.sum(sums, axis=1) * tl.load(scaling_ptr + a64, mask=live, other=0.0)[:, None]
            tl.store(parts_ptr + (rows + num_blocks) * R_PAD + offs_r[None, :], shrink, mask=live[:, None])
            tl.atomic_xchg(cnt_ptr + group, 0)  # zero again for the next launch on this stream


@triton.jit
def w2_decode_rows(b_ptr, adapter_ptr, ids_ptr, expert_map_ptr, t, top_k, num_global, num_local, num_adapters,
                   offs_n, n_ok, N, R, HAS_MAP: tl.constexpr, R_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """(B2's rows ``offs_n`` of token t's slots as loaded [K_PAD, BLOCK_N, R_PAD], the slots' pairs [K_PAD], which
    are live). B2: contiguous [adapters, E, H, R]."""
    a = tl.load(adapter_ptr + t)
    pair = t * top_k + tl.arange(0, K_PAD)
    e, ok = _local_ids(ids_ptr, expert_map_ptr, pair, t * top_k + top_k, num_global, num_local, HAS_MAP)
    ok = ok & (a >= 0) & (a < num_adapters)
    offs_r = tl.arange(0, R_PAD)
    base = b_ptr + ((tl.where(ok, a, 0).to(tl.int64) * num_local + tl.where(ok, e, 0)) * N) * R  # [K_PAD]
    b = tl.load(base[:, None, None] + offs_n[None, :, None] * R + offs_r[None, None, :],
                mask=ok[:, None, None] & n_ok[None, :, None] & (offs_r < R)[None, None, :], other=0.0)
    return b, pair, ok, a


@triton.jit
def w2_decode_stored(parts_ptr, pair, ok, num_blocks, R_PAD: tl.constexpr):
    """The slots' scaled shrinks [K_PAD, R_PAD] as GEMV1's last programs wrote them (at block index num_blocks)."""
    offs_r = tl.arange(0, R_PAD)
    return tl.load(parts_ptr + (pair.to(tl.int64)[:, None] * (num_blocks + 1) + num_blocks) * R_PAD
                   + offs_r[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def w2_decode_term(s, b_rows, pair, ok, weights_ptr):
    """A token's W2 term [BLOCK_N] in fp32: its slots' scaled shrinks ``s`` [K_PAD, R_PAD] (w2_decode_stored) times B2's rows ``b_rows`` (w2_decode_rows), times the router weights, summed over the
    slots."""
    per_slot = tl.sum(b_rows.to(tl.float32) * s[:, None, :], axis=2) * tl.load(weights_ptr + pair, mask=ok,
                                                                               other=0.0)[:, None]
    return tl.sum(per_slot, axis=0)
