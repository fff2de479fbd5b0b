"""Prototype (session 9, not in the package): GEMM2 of the aligned expert rows as a persistent,
warp-specialized Gluon kernel on sm_90. A 1-warp producer issues TMA loads of h row blocks and w2 tiles
into an S-stage ring, running ahead across tiles so the next tile's loads overlap this tile's epilogue.
Consumers: one 8-warp partition (two warpgroups on one tile), or PINGPONG two 4-warp partitions on
alternate tiles, so one's epilogue runs while the other's MMAs do.

    python benchmarks/prototypes/gluon_gemm2.py compile   # offline: sm_90 compile, registers / shared memory
    python benchmarks/prototypes/gluon_gemm2.py           # GPU: check against moekit's Triton GEMM2, time both
"""
import sys

import _harness as H_
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _producer(h_desc, w_desc, h_bufs, w_bufs, empty, ready, block_expert_ptr, num_blocks, n_tiles, H, K):
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    S: gl.constexpr = h_bufs.type.shape[0]
    it = 0
    for t in range(gl.program_id(0), num_blocks * n_tiles, gl.num_programs(0)):
        m = t // n_tiles
        n = t % n_tiles
        e = gl.load(block_expert_ptr + m)
        if e >= 0:
            for k in range(0, K, BK):
                s = it % S
                mbarrier.wait(empty.index(s), ((it // S) & 1) ^ 1)
                mbarrier.expect(ready.index(s), h_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(h_desc, [m * BM, k], ready.index(s), h_bufs.index(s))
                tma.async_copy_global_to_shared(w_desc, [e * H + n * BN, k], ready.index(s), w_bufs.index(s))
                it += 1


@gluon.jit
def _mma_tile(acc, h_bufs, w_bufs, empty, ready, it, K):
    """One tile's K loop over the ring: async wgmma, each stage released once its MMA is done."""
    BK: gl.constexpr = h_bufs.type.shape[2]
    S: gl.constexpr = h_bufs.type.shape[0]
    for k in range(0, K, BK):
        s = it % S
        mbarrier.wait(ready.index(s), (it // S) & 1)
        acc = warpgroup_mma(h_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, use_acc=k > 0, is_async=True)
        # the previous step's MMA is done once at most one is in flight: its stage is free
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((it + S - 1) % S), pred=k > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((it + S - 1) % S))
    return acc, it


@gluon.jit
def _store_tile(acc, m, n, sorted_pairs_ptr, weights_ptr, y_ptr, stride_y, num_pairs, H):
    """y[pair] = router weight * acc for the tile's rows that hold a pair."""
    BM: gl.constexpr = acc.type.shape[0]
    BN: gl.constexpr = acc.type.shape[1]
    layout: gl.constexpr = acc.type.layout
    rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    pair = gl.load(sorted_pairs_ptr + rows)
    valid = pair < num_pairs
    wgt = gl.load(weights_ptr + pair, mask=valid, other=0.0)
    cols = n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    out = (acc * gl.expand_dims(wgt, 1)).to(y_ptr.dtype.element_ty)
    offs = gl.expand_dims(pair.to(gl.int64) * stride_y, 1) + gl.expand_dims(cols, 0)
    gl.store(y_ptr + offs, out, mask=gl.expand_dims(valid, 1) & gl.expand_dims(cols < H, 0))


@gluon.jit
def _role(h_desc, w_desc, h_bufs, w_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr, weights_ptr, y_ptr,
          stride_y, num_pairs, num_blocks, n_tiles, H, K, ROLE: gl.constexpr, CONSUMERS: gl.constexpr,
          WARPS: gl.constexpr):
    """ROLE < CONSUMERS: consumer ROLE, taking every CONSUMERS-th tile of this program that has an expert;
    ROLE == CONSUMERS: the TMA producer."""
    BK: gl.constexpr = h_desc.block_type.shape[1]
    if ROLE == CONSUMERS:
        _producer(h_desc, w_desc, h_bufs, w_bufs, empty, ready, block_expert_ptr, num_blocks, n_tiles, H, K)
    else:
        BM: gl.constexpr = h_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, BN if BN <= 256 else 256, 16])
        acc = gl.zeros([BM, BN], gl.float32, layout)
        nk = gl.cdiv(K, BK)
        it = 0
        j = 0
        for t in range(gl.program_id(0), num_blocks * n_tiles, gl.num_programs(0)):
            m = t // n_tiles
            n = t % n_tiles
            e = gl.load(block_expert_ptr + m)
            if e >= 0:
                if j % CONSUMERS == ROLE:
                    acc, it = _mma_tile(acc, h_bufs, w_bufs, empty, ready, it, K)
                    _store_tile(acc, m, n, sorted_pairs_ptr, weights_ptr, y_ptr, stride_y, num_pairs, H)
                else:
                    it += nk  # another consumer's stages
                j += 1


@gluon.jit
def gemm2_kernel(h_desc, w_desc, block_expert_ptr, sorted_pairs_ptr, weights_ptr, y_ptr, stride_y,
                 num_pairs, num_blocks, H, K, STAGES: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    h_bufs = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BM, BK], h_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
    n_tiles = gl.cdiv(H, BN)
    warps: gl.constexpr = num_warps
    if PINGPONG:
        gl.warp_specialize([
            (_role, (h_desc, w_desc, h_bufs, w_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr, weights_ptr,
                     y_ptr, stride_y, num_pairs, num_blocks, n_tiles, H, K, 0, 2, warps)),
            (_role, (h_desc, w_desc, h_bufs, w_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr, weights_ptr,
                     y_ptr, stride_y, num_pairs, num_blocks, n_tiles, H, K, 1, 2, warps)),
            (_role, (h_desc, w_desc, h_bufs, w_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr, weights_ptr,
                     y_ptr, stride_y, num_pairs, num_blocks, n_tiles, H, K, 2, 2, warps)),
        ], [num_warps, 1], [232, 40])
    else:
        gl.warp_specialize([
            (_role, (h_desc, w_desc, h_bufs, w_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr, weights_ptr,
                     y_ptr, stride_y, num_pairs, num_blocks, n_tiles, H, K, 0, 1, warps)),
            (_role, (h_desc, w_desc, h_bufs, w_bufs, empty, ready, block_expert_ptr, sorted_pairs_ptr, weights_ptr,
                     y_ptr, stride_y, num_pairs, num_blocks, n_tiles, H, K, 1, 1, warps)),
        ], [1], [40])


def gemm2_gluon(h, w2, block_expert, sorted_pairs, weights, y, num_pairs, BN=128, stages=4, pingpong=False,
                BM=128, BK=64, programs=None):
    """y[pair] = weight[pair] * h[row] @ w2[e]^T over the aligned row blocks (bf16, no bias)."""
    E, H, I = w2.shape
    tiles = block_expert.shape[0] * triton.cdiv(H, BN)
    return gemm2_kernel[H_.persistent_grid(tiles, h.device, programs)](
        H_.descriptor(h, [BM, BK]), H_.descriptor(w2.reshape(E * H, I), [BN, BK]), block_expert, sorted_pairs,
        weights, y, y.stride(0), num_pairs, block_expert.shape[0], H, I, stages, pingpong,
        num_warps=4 if pingpong else 8)


VARIANTS = ((128, 4, False), (256, 3, False), (128, 5, False), (128, 4, True), (128, 6, True))  # BN, stages, pp


def _compile_offline():
    E, H, I, rows = 8, 2048, 768, 1024
    h, w2 = torch.empty(rows, I, dtype=torch.bfloat16), torch.empty(E, H, I, dtype=torch.bfloat16)
    be, sp = torch.zeros(rows // 128, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32)
    wt, y = torch.zeros(rows), torch.empty(rows, H, dtype=torch.bfloat16)
    H_.compile_offline([(f"BN={bn} stages={st} pingpong={pp}",
                         lambda bn=bn, st=st, pp=pp: gemm2_gluon(h, w2, be, sp, wt, y, rows, bn, st, pp))
                        for bn, st, pp in VARIANTS])


def _gpu_check_and_time():
    from moekit import _experts_triton as X
    for name, T in H_.CASES:
        spec, _, sorted_pairs, block_expert, config = H_.aligned_case(name, T)
        E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
        weights = torch.rand(T * k, device="cuda")
        h = torch.randn(block_expert.shape[0] * 128, I, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        y_ref = torch.empty(T * k, H, device="cuda", dtype=torch.bfloat16)
        y_new = torch.empty_like(y_ref)
        w_op = X.WeightOperand.of(w2)
        run_ref = lambda: X._gemm2(h, w_op, None, weights, y_ref, (0, y_ref.stride(0)),  # noqa: E731
                                   (block_expert, sorted_pairs, block_expert), block_expert.shape[0], config.gemm2,
                                   128, X.ROWS_ALIGNED, T * k, 0)
        for bn, st, pp in VARIANTS:
            H_.compare_and_time(f"{name} T={T} BN={bn} stages={st} pingpong={pp}", run_ref, y_ref,
                                lambda bn=bn, st=st, pp=pp: gemm2_gluon(h, w2, block_expert, sorted_pairs, weights,
                                                                        y_new, T * k, bn, st, pp),
                                y_new, slice(None), 2 * T * k * H * I)


if __name__ == "__main__":
    _compile_offline() if sys.argv[1:] == ["compile"] else _gpu_check_and_time()
