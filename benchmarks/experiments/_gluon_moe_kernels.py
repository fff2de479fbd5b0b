"""Gluon kernel of gluon_moe.py: the grouped form of _gluon_w4_kernels.py's producer/consumer
MXFP4 GEMM, one launch per GEMM of an MoE layer (issue 28, part 3).

Each CTA owns one BLOCK_M row block of moekit's aligned routing (``experts.triton_backend.align``: pairs sorted by
expert, each expert's run padded to BLOCK_M, ``block_expert[b]`` the expert of block b, -1 past the last run) and
one BN-column tile of that expert's weights. The loader warp and the decode warps are _gluon_w4_kernels' own: the
stacked expert weights are one [E * N, ...] operand, so the tile of expert e starts at row e * N (a tile that runs
past N reads the next expert's rows, or TMA's zeros after the last one; those columns are never stored). The MMA
partition differs only in its epilogue:

  ACT      GEMM1: A is x gathered into row-block order (the host's index_select), W is w13 with gate and up rows
           interleaved (gate j at row 2j, up j at 2j + 1: gpt-oss's layout as stored, [gate; up] halves
           interleaved once at load time), so a thread's accumulator pair (2j, 2j + 1) is one (gate, up) pair:
           bias, activation (SiLU * up or gpt-oss's clamped SwiGLU) and the bf16 store of h [rows, I] happen in
           registers, without a layout conversion through shared memory.
  SCATTER  GEMM2: A is h (TMA, row-block order), the epilogue adds b2, scales each row by its pair's router
           weight and stores it at y[pair] (padding rows, whose pair is the sentinel num_pairs, are not stored);
           moekit's combine kernel then sums each token's slots in order.

A block past the last run (expert -1) returns before any barrier or copy.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from _gluon_w4_kernels import _decoder, _loader, _mma_k_loop, _rings

ACT = gl.constexpr(0)
SCATTER = gl.constexpr(1)
SILU_AND_MUL = gl.constexpr(0)  # moekit's activation ids (experts/kernels/moe_gemm.py)
SWIGLU_OAI = gl.constexpr(1)
SWIGLU_ALPHA = gl.constexpr(1.702)  # moekit.reference.SWIGLU_ALPHA / SWIGLU_LIMIT (gluon_moe.py checks they agree)
SWIGLU_LIMIT = gl.constexpr(7.0)


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _activate(gate, up, ACTIVATION: gl.constexpr):
    if ACTIVATION == SILU_AND_MUL:
        return gate * _sigmoid(gate) * up
    else:
        g = gl.minimum(gate, SWIGLU_LIMIT)
        u = gl.minimum(gl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        return (u + 1.0) * g * _sigmoid(SWIGLU_ALPHA * g)


@gluon.jit
def grouped_tile(num_blocks, N, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """(row block, first column) of this program. Groups of GROUP_M row blocks, all the column tiles of a group
    before the next, row blocks fastest inside a group: the CTAs in flight share a few blocks of A (read from L2 by
    every column tile) and an expert's weight tile serves its neighbouring blocks from L2. Row blocks fastest over
    the whole grid re-read every block of A from HBM once per column tile (45 times x's gathered rows for gpt-oss's
    GEMM1). moekit's own order (experts/kernels/moe_gemm.py _tile_ids)."""
    pid = gl.program_id(0)
    per_group = GROUP_M * gl.cdiv(N, BN)
    first = (pid // per_group) * GROUP_M
    group_m = gl.minimum(num_blocks - first, GROUP_M)
    return first + (pid % per_group) % group_m, ((pid % per_group) // group_m) * BN


@gluon.jit
def _mma_moe(a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, out_ptr, stride_out, bias_ptr, pairs_ptr,
             weights_ptr, num_pairs, N, expert, off_m, n0, k_steps, EPILOGUE: gl.constexpr,
             ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_bufs.shape[1]
    BN: gl.constexpr = w_bufs.shape[1]
    acc = _mma_k_loop(a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, k_steps, num_warps)
    acc_layout: gl.constexpr = acc.type.layout

    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    if HAS_BIAS:
        b = gl.load(bias_ptr + expert.to(gl.int64) * N + cols, mask=cols < N, other=0.0).to(gl.float32)
        acc = acc + gl.expand_dims(b, 0)
    if EPILOGUE == ACT:
        gate, up = gl.split(gl.reshape(acc, [BM, BN // 2, 2]))
        h = _activate(gate, up, ACTIVATION).to(gl.bfloat16)
        h_layout: gl.constexpr = h.type.layout
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, h_layout))
        hcols = n0 // 2 + gl.arange(0, BN // 2, layout=gl.SliceLayout(0, h_layout))
        offs = gl.expand_dims(rows.to(gl.int64) * stride_out, 1) + gl.expand_dims(hcols, 0)
        gl.store(out_ptr + offs, h, mask=gl.expand_dims(hcols < N // 2, 0) & gl.expand_dims(rows >= 0, 1))
    else:
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        pair = gl.load(pairs_ptr + rows)
        valid = pair < num_pairs
        wt = gl.load(weights_ptr + pair, mask=valid, other=0.0)
        y = (acc * gl.expand_dims(wt, 1)).to(out_ptr.dtype.element_ty)
        offs = gl.expand_dims(pair.to(gl.int64) * stride_out, 1) + gl.expand_dims(cols, 0)
        gl.store(out_ptr + offs, y, mask=gl.expand_dims(valid, 1) & gl.expand_dims(cols < N, 0))


@gluon.jit
def moe_w4_kernel(a_desc, q_desc, s_desc, out_ptr, stride_out, bias_ptr, block_expert_ptr, pairs_ptr, weights_ptr,
                  block_rows_ptr, min_rows, max_rows, row_offset, num_pairs, num_blocks, N, K,
                  EPILOGUE: gl.constexpr,
                  ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, SUB: gl.constexpr,
                  FULL_RANGE: gl.constexpr, DECODE: gl.constexpr, DECODE_WARPS: gl.constexpr,
                  LOAD_REGS: gl.constexpr, DECODE_REGS: gl.constexpr, GROUP_M: gl.constexpr,
                  ROW_STRIDE: gl.constexpr, ROW_CLASSES: gl.constexpr, num_warps: gl.constexpr):
    """ROW_STRIDE: the rows of an aligned block (BM, or with ROW_CLASSES a multiple of 64 above it). ROW_CLASSES:
    this launch serves only the blocks whose rows (``block_rows``: the run's rows in the block, a prefix) are in
    (min_rows, max_rows], their BM rows from ``row_offset`` on; the host launches one tile per class and part, so
    that a block computes about the rows it holds."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = q_desc.block_type.shape[0]
    block, n0 = grouped_tile(num_blocks, N, BN, GROUP_M)
    expert = gl.load(block_expert_ptr + block)
    serve = expert >= 0
    if ROW_CLASSES:
        rows = gl.load(block_rows_ptr + block)
        serve = serve & (rows > min_rows) & (rows <= max_rows)
    if serve:
        off_m = block * ROW_STRIDE + row_offset
        k_steps = K // BK
        a_bufs, q_bufs, s_bufs, w_bufs, a_ready, a_empty, q_ready, q_empty, w_ready, w_empty = _rings(
            a_desc, q_desc, s_desc, STAGES)
        off_w = expert * N + n0  # the tile's first row in the stacked [E * N] weights

        gl.warp_specialize([
            (_mma_moe, (a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, out_ptr, stride_out, bias_ptr, pairs_ptr,
                        weights_ptr, num_pairs, N, expert, off_m, n0, k_steps, EPILOGUE, ACTIVATION, HAS_BIAS,
                        num_warps)),
            (_loader, (a_desc, q_desc, s_desc, a_bufs, q_bufs, s_bufs, a_ready, a_empty, q_ready, q_empty, off_m,
                       off_w, k_steps)),
            (_decoder, (q_bufs, s_bufs, w_bufs, q_ready, q_empty, w_ready, w_empty, k_steps, SUB, FULL_RANGE, DECODE,
                        DECODE_WARPS)),
        ], [1, DECODE_WARPS], [LOAD_REGS, DECODE_REGS])


@triton.jit
def gather_rows_kernel(x_ptr, stride_x, pairs_ptr, out_ptr, num_pairs, top_k, H, BLOCK_H: tl.constexpr):
    """out[r] = x[pairs[r] // top_k] for the rows that hold a pair; padding rows (the sentinel num_pairs) are left
    as they are: the GEMMs' rows are independent, and the epilogues never store a padding row's result. A gather
    of every row (index_select) moved a whole block's rows per expert, up to twice x's routed rows at 256-row
    blocks."""
    row = tl.program_id(0)
    pair = tl.load(pairs_ptr + row)
    if (pair >= 0) & (pair < num_pairs):  # align leaves the blocks past the last run unwritten: any value
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        v = tl.load(x_ptr + (pair // top_k).to(tl.int64) * stride_x + cols, mask=mask)
        tl.store(out_ptr + row.to(tl.int64) * H + cols, v, mask=mask)
