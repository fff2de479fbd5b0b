"""Prototype (session 9, not in the package): GEMM1 + SiLU-and-mul of the aligned expert rows as a
warp-specialized, persistent Gluon kernel on sm_90. x rows are gathered by token (Hopper has no TMA
gather): a 4-warp partition copies them with cp.async into the stage's buffer and arrives on its ready
barrier when they land; a 1-warp partition brings the gate and up boxes of w13 by TMA to the same
stage; the default partition (8 warps) runs two async wgmmas per step and the epilogue into h.

    python benchmarks/prototypes/gluon_gemm1.py compile        # offline: sm_90 compile
    python benchmarks/prototypes/gluon_gemm1.py                # GPU: check against moekit's Triton GEMM1, time both
"""
import sys

import _harness as H_
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.language.nvidia.ampere import async_copy

X_WARPS = 4  # warps of the partition that gathers x rows


@gluon.jit
def _role(w_desc, x_ptr, stride_x, x_bufs, g_bufs, u_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr,
          h_ptr, stride_h, num_pairs, top_k, num_blocks, n_tiles, I, K, ROLE: gl.constexpr, WARPS: gl.constexpr):
    """ROLE 0: consumer (MMAs, epilogue); 1: x gather by cp.async; 2: w13 gate/up boxes by TMA."""
    S: gl.constexpr = x_bufs.type.shape[0]
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[1]
    it = 0
    if ROLE == 0:
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, BN if BN <= 256 else 256, 16])
        acc_g = gl.zeros([BM, BN], gl.float32, layout)
        acc_u = gl.zeros([BM, BN], gl.float32, layout)
    for t in range(gl.program_id(0), num_blocks * n_tiles, gl.num_programs(0)):
        m = t // n_tiles
        n = t % n_tiles
        e = gl.load(block_expert_ptr + m)
        if e >= 0:
            if ROLE == 1:
                xl: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [WARPS, 1], [1, 0])
                rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, xl))
                pair = gl.load(sorted_pairs_ptr + rows)
                row_ok = gl.expand_dims(pair < num_pairs, 1)
                x_rows = gl.expand_dims((pair // top_k).to(gl.int64) * stride_x, 1)
                cols = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, xl)), 0)
                for k in range(0, K, BK):
                    s = it % S
                    mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)
                    # padding rows and K past its end land as zeros (the MMA reads the whole box)
                    async_copy.async_copy_global_to_shared(x_bufs.index(s), x_ptr + x_rows + (k + cols),
                                                           mask=row_ok & (k + cols < K))
                    async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                    it += 1
            elif ROLE == 2:
                for k in range(0, K, BK):
                    s = it % S
                    mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(w_desc, [e * 2 * I + n * BN, k], ready.index(s), g_bufs.index(s))
                    tma.async_copy_global_to_shared(w_desc, [e * 2 * I + I + n * BN, k], ready.index(s),
                                                    u_bufs.index(s))
                    it += 1
            else:
                for k in range(0, K, BK):
                    s = it % S
                    mbarrier.wait(ready.index(s), (it // S) & 1)
                    # x arrived by cp.async, a generic-proxy write; the wgmma reads through the async proxy
                    fence_async_shared()
                    acc_g = warpgroup_mma(x_bufs.index(s), g_bufs.index(s).permute((1, 0)), acc_g, use_acc=k > 0,
                                          is_async=True)
                    acc_u = warpgroup_mma(x_bufs.index(s), u_bufs.index(s).permute((1, 0)), acc_u, use_acc=k > 0,
                                          is_async=True)
                    # the previous step's two MMAs are done once at most two are in flight
                    acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                    mbarrier.arrive(empty.index((it + S - 1) % S), pred=k > 0)
                    it += 1
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
                mbarrier.arrive(empty.index((it + S - 1) % S))
                act = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
                rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
                cols = n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
                offs = gl.expand_dims(rows.to(gl.int64) * stride_h, 1) + gl.expand_dims(cols, 0)
                ok = gl.expand_dims(gl.load(sorted_pairs_ptr + rows) < num_pairs, 1) & gl.expand_dims(cols < I, 0)
                gl.store(h_ptr + offs, act.to(h_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def gemm1_ws_kernel(w_desc, x_ptr, stride_x, block_expert_ptr, sorted_pairs_ptr, h_ptr, stride_h, num_pairs, top_k,
                    num_blocks, I, K, BM: gl.constexpr, STAGES: gl.constexpr, XW: gl.constexpr,
                    num_warps: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_layout)
    g_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1 + XW * 32)  # the TMA expect, and each x thread's copies
    n_tiles = gl.cdiv(I, BN)
    warps: gl.constexpr = num_warps
    gl.warp_specialize([
        (_role, (w_desc, x_ptr, stride_x, x_bufs, g_bufs, u_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr,
                 h_ptr, stride_h, num_pairs, top_k, num_blocks, n_tiles, I, K, 0, warps)),
        (_role, (w_desc, x_ptr, stride_x, x_bufs, g_bufs, u_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr,
                 h_ptr, stride_h, num_pairs, top_k, num_blocks, n_tiles, I, K, 1, XW)),
        (_role, (w_desc, x_ptr, stride_x, x_bufs, g_bufs, u_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr,
                 h_ptr, stride_h, num_pairs, top_k, num_blocks, n_tiles, I, K, 2, 1)),
    ], [XW, 1], [64, 40])


def gemm1_gluon(x, w13, block_expert, sorted_pairs, h, num_pairs, top_k, BN=128, stages=4, BM=128, BK=64,
                programs=None):
    """h[row] = SiLU(x[token] @ gate^T) * (x[token] @ up^T) over the aligned row blocks (bf16, no bias)."""
    E, two_i, H = w13.shape
    tiles = block_expert.shape[0] * triton.cdiv(two_i // 2, BN)
    return gemm1_ws_kernel[H_.persistent_grid(tiles, x.device, programs)](
        H_.descriptor(w13.reshape(E * two_i, H), [BN, BK]), x, x.stride(0), block_expert, sorted_pairs, h,
        h.stride(0), num_pairs, top_k, block_expert.shape[0], two_i // 2, H, BM, stages, X_WARPS, num_warps=8)


VARIANTS = ((128, 4), (128, 3), (64, 6))  # (BN, stages): BN=128 holds 2 x 64 fp32 accumulators per thread


def _compile_offline():
    E, H, I, T, k, rows = 8, 2048, 768, 256, 8, 1024
    x, w13 = torch.empty(T, H, dtype=torch.bfloat16), torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
    be, sp = torch.zeros(rows // 128, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
    h = torch.empty(rows, I, dtype=torch.bfloat16)
    H_.compile_offline([(f"BN={bn} stages={st}", lambda bn=bn, st=st: gemm1_gluon(x, w13, be, sp, h, T * k, k, bn, st))
                        for bn, st in VARIANTS])


def _gpu_check_and_time():
    from moekit import _experts_triton as X
    for name, T in H_.CASES:
        spec, _, sorted_pairs, block_expert, config = H_.aligned_case(name, T)
        E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
        blocks = block_expert.shape[0]
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        h_ref = torch.empty(blocks * 128, I, device="cuda", dtype=torch.bfloat16)
        h_new = torch.empty_like(h_ref)
        w_op = X.WeightOperand.of(w13)
        run_ref = lambda: X._gemm1(x, w_op, None, h_ref,  # noqa: E731
                                   (block_expert, sorted_pairs, block_expert), "silu_and_mul", blocks, config.gemm1,
                                   128, X.ROWS_ALIGNED, T * k, k, 0)
        valid = (sorted_pairs < T * k).nonzero().flatten()
        for bn, st in VARIANTS:
            H_.compare_and_time(f"{name} T={T} BN={bn} stages={st}", run_ref, h_ref,
                                lambda bn=bn, st=st: gemm1_gluon(x, w13, block_expert, sorted_pairs, h_new, T * k, k,
                                                                 bn, st),
                                h_new, valid, 2 * T * k * 2 * I * H)


if __name__ == "__main__":
    _compile_offline() if sys.argv[1:] == ["compile"] else _gpu_check_and_time()
