"""Grouped expert GEMMs: GEMM1 with the activation fused, GEMM2 with bias and router weight
fused, and the fixed-order sum over the k slots.

Rows come either from the aligned pair list (standard format: a block of BLOCK_M pairs of one
expert, gathered from x) or straight from an expert's slab (batched format: rows below that
expert's token count). Memory offsets that scale with experts or rows are 64-bit: one expert
stack of DeepSeek-V3 alone holds 7.5e9 elements.
"""

import triton
import triton.language as tl

ALIGNED = tl.constexpr(0)  # row blocks of the aligned pair list (standard format)
BATCHED = tl.constexpr(1)  # row blocks of each expert's slab (batched format)
PER_PAIR = tl.constexpr(2)  # one pair per block, no alignment (decode: a launch saved, nothing to pad)
SILU_AND_MUL = tl.constexpr(0)
SWIGLU_OAI = tl.constexpr(1)
SWIGLU_ALPHA = tl.constexpr(1.702)
SWIGLU_LIMIT = tl.constexpr(7.0)


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
def _block_rows(pid_m, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, num_pairs, rows_per_expert,
                num_global, num_local, ROWS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, slot of each row in the compact row space, pair id of each row, row valid).

    ALIGNED: row slot = position in the aligned pair list, pair = sorted pair id.
    BATCHED: row slot = e * M + m, pair = m. PER_PAIR: block = pair (row 0 only; the pointers are
    topk_ids and expert_map). Expert -1 means nothing to do.
    """
    lanes = tl.arange(0, BLOCK_M)
    if ROWS == BATCHED:
        blocks_per_expert = tl.cdiv(rows_per_expert, BLOCK_M)
        e = pid_m // blocks_per_expert
        m = (pid_m % blocks_per_expert) * BLOCK_M + lanes
        count = tl.minimum(tl.load(expert_tokens_ptr + e), rows_per_expert)
        row_ok = m < count
        e = tl.where(tl.max(row_ok.to(tl.int32), axis=0) > 0, e, -1)
        return e, e.to(tl.int64) * rows_per_expert + m, m, row_ok
    if ROWS == PER_PAIR:
        e = _pair_expert(sorted_pairs_ptr, block_expert_ptr, pid_m, num_global, num_local, HAS_MAP)
        return e, pid_m.to(tl.int64) + lanes, pid_m + lanes, lanes == 0
    e = tl.load(block_expert_ptr + pid_m)
    pos = pid_m * BLOCK_M + lanes
    pair = tl.load(sorted_pairs_ptr + pos)
    return e, pos.to(tl.int64), pair, pair < num_pairs


@triton.jit
def gemm1_act_kernel(
    x_ptr, stride_xe, stride_xm, stride_xk,  # standard: x [T, H] (stride_xe unused); batched: x [E, M, H]
    w_ptr, stride_we, stride_wn, stride_wk,  # w13 [E, 2I, H]
    bias_ptr, stride_be, stride_bn,  # w13_bias [E, 2I] (HAS_BIAS)
    h_ptr, stride_hm,  # out: activations [rows, I], row = compact row slot
    block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr,
    num_pairs, top_k, rows_per_expert, num_m_blocks, num_global, num_local,
    I, K,
    gate_step, up_offset,  # gate of column n is w13 row n * gate_step, up is that + up_offset
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, HAS_MAP: tl.constexpr, ACTIVATION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, tl.cdiv(I, BLOCK_N), GROUP_M)
    e, h_rows, pair, row_ok = _block_rows(pid_m, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, num_pairs,
                                          rows_per_expert, num_global, num_local, ROWS, HAS_MAP, BLOCK_M)
    if e < 0:
        return
    if ROWS == BATCHED:
        x_rows = e.to(tl.int64) * stride_xe + pair.to(tl.int64) * stride_xm
    else:
        x_rows = (pair // top_k).to(tl.int64) * stride_xm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    gate_rows = offs_n.to(tl.int64) * gate_step
    up_rows = gate_rows + up_offset
    w_e = w_ptr + e.to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        # Masked rows read zeros: padding (NaN or garbage) never enters the sums.
        a = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[None, :] & k_ok[:, None]
        w_k = offs_k[:, None] * stride_wk
        w_gate = tl.load(w_e + gate_rows[None, :] * stride_wn + w_k, mask=w_mask, other=0.0)
        w_up = tl.load(w_e + up_rows[None, :] * stride_wn + w_k, mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        b_e = bias_ptr + e.to(tl.int64) * stride_be
        acc_gate += tl.load(b_e + gate_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_e + up_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == SILU_AND_MUL:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:
        gate = tl.minimum(acc_gate, SWIGLU_LIMIT)
        up = tl.minimum(tl.maximum(acc_up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        act = (up + 1.0) * gate * tl.sigmoid(SWIGLU_ALPHA * gate)
    tl.store(h_ptr + h_rows[:, None] * stride_hm + offs_n[None, :], act.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def gemm2_kernel(
    h_ptr, stride_hm,  # activations [rows, I] from gemm1_act_kernel
    w_ptr, stride_we, stride_wn, stride_wk,  # w2 [E, H, I]
    bias_ptr, stride_be, stride_bn,  # w2_bias [E, H] (HAS_BIAS)
    weights_ptr,  # float32 [num_pairs] router weights (standard format)
    y_ptr, stride_ye, stride_ym,  # standard: per-pair outputs [num_pairs, H]; batched: out [E, M, H]
    block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr,
    num_pairs, rows_per_expert, num_m_blocks,
    N, K,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    e, h_rows, pair, row_ok = _block_rows(pid_m, block_expert_ptr, sorted_pairs_ptr, expert_tokens_ptr, num_pairs,
                                          rows_per_expert, 0, 0, ROWS, False, BLOCK_M)
    if e < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_e = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(h_ptr + h_rows[:, None] * stride_hm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_e + offs_k[:, None] * stride_wk, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROWS == BATCHED:
        y_rows = e.to(tl.int64) * stride_ye + pair.to(tl.int64) * stride_ym
    else:
        acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        y_rows = pair.to(tl.int64) * stride_ym
    tl.store(y_ptr + y_rows[:, None] + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def gemm2_tokens_kernel(
    h_ptr, stride_hm,  # activations [num_pairs, I] (PER_PAIR gemm1)
    w_ptr, stride_we, stride_wn, stride_wk,  # w2 [E, H, I]
    bias_ptr, stride_be, stride_bn,  # w2_bias [E, H] (HAS_BIAS)
    weights_ptr, ids_ptr, expert_map_ptr,  # float32 / int32 [num_pairs], int32 [num_global] (HAS_MAP)
    out_ptr, stride_ot,  # out [T, H]
    top_k, num_global, num_local, N, K,
    HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Decode GEMM2 per token: its k slots in order, each a weighted expert product, summed in
    registers and written once (no per-slot buffer, no combine launch). Row 0 of each tile is the
    pair; the other rows pad the tensor-core shape."""
    num_n = tl.cdiv(N, BLOCK_N)
    t = tl.program_id(0) // num_n
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    row0 = (tl.arange(0, BLOCK_M) == 0)[:, None]
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, top_k):
        pair = t * top_k + j
        e = _pair_expert(ids_ptr, expert_map_ptr, pair, num_global, num_local, HAS_MAP)
        if e >= 0:
            w_e = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
            h_row = h_ptr + pair.to(tl.int64) * stride_hm
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                a = tl.load(h_row + tl.zeros([BLOCK_M, 1], tl.int64) + offs_k[None, :], mask=row0 & k_ok[None, :], other=0.0)
                w = tl.load(w_e + offs_k[:, None] * stride_wk, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            y = tl.sum(acc, axis=0)  # rows other than 0 are zero
            if HAS_BIAS:
                y += tl.load(bias_ptr + e.to(tl.int64) * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
            total += tl.load(weights_ptr + pair) * y
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
