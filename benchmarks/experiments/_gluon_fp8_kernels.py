"""Gluon kernel of gluon_fp8.py: DeepSeek-V3's FP8 block-scaled grouped GEMM (issue 28, item 4) with a TMA loader
warp and the scale promotion taken off the tensor cores' critical path.

The operands are fp8_pipeline.py's: a [M, K] e4m3 (each aligned row block one expert's rows), a_scale [M, K/128]
fp32 (1x128 groups), w [E * N, K] e4m3, w_scale [E, N/128, K/128] fp32 (128x128 blocks); out [M, N] bf16. Every
128-deep K step is one wgmma into a fresh fp32 accumulator, then promoted: acc += part * a_scale[row] * w_scale,
as moekit's W8A8 GEMMs do (the products of one step are exact in fp32; the promotion is what rounds).

Two partitions meet in a ring of STAGES shared-memory slots:
  loader  (1 warp)  TMA copies of A [BM, 128] and W [BN, 128] per step; waits a slot's "empty" barrier first.
  MMA     (the default partition: 4 warps for BM = 64, 8 for BM = 128; one warpgroup per 64 rows)
          PIPELINED = False: issue step i's wgmma, wait for it, hand the slot back, promote. The tensor cores idle
          while the CUDA cores promote (the Triton loop's order: fp8_loop_probe.py measured what it costs).
          PIPELINED = True: step i + 1's wgmma is issued (into a second fresh accumulator) before step i's product is
          promoted, so the promotion's FMAs run while the tensor cores work: two products live at once (2 x BN/2
          registers per thread beside the accumulator's BN/2 at 64 rows per warpgroup).
The scales of a step are loaded before its product is waited for (their latency hides behind the wgmma).

Barriers (count 1; the loader's arrivals are TMA expect-tx, the MMA partition's one arrive per step once the wgmma
that read the slot has retired): ready[s] loader -> MMA, empty[s] MMA -> loader. Step i uses slot i % STAGES at
phase (i // STAGES) & 1; producers wait "empty" at the flipped phase, so the first pass does not block.

Program order: _gluon_moe_kernels.grouped_tile (moekit's): GROUP_M row blocks, all column tiles of a group before the
next, so a block's A and an expert's weight tile are shared through L2 by the CTAs in flight.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from _gluon_moe_kernels import grouped_tile

GROUP = gl.constexpr(128)  # the quantization group: 1x128 activations, 128x128 weights; one K step


@gluon.jit
def _fp8_loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, off_m, off_w, k_steps):
    STAGES: gl.constexpr = a_bufs.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    for i in range(k_steps):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, i * GROUP], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [off_w, i * GROUP], ready.index(s), w_bufs.index(s))


@gluon.jit
def _issue(a_bufs, w_bufs, ready, i, zeros):
    """Wait for step i's slot, start its wgmma into a fresh accumulator (asynchronous)."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), zeros, use_acc=False, is_async=True)


@gluon.jit
def _step_scale(a_scales, w_scales, i):
    """Step i's promotion factor per row: a_scale[row, i] * w_scale[i] ([BM], the accumulator's row layout)."""
    return gl.load(a_scales + i) * gl.load(w_scales + i)


@gluon.jit
def _fp8_mma(a_bufs, w_bufs, ready, empty, a_scale_ptr, w_scale_ptr, out_ptr, N, expert, off_m, off_n, k_steps,
             PIPELINED: gl.constexpr, num_warps: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.shape[0]
    BM: gl.constexpr = a_bufs.shape[1]
    BN: gl.constexpr = w_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, BN, 32])
    zeros = gl.zeros([BM, BN], gl.float32, acc_layout)
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    a_scales = a_scale_ptr + rows.to(gl.int64) * k_steps
    w_scales = w_scale_ptr + (expert.to(gl.int64) * (N // GROUP) + off_n // GROUP) * k_steps
    if PIPELINED:
        part = _issue(a_bufs, w_bufs, ready, 0, zeros)
        for i in range(k_steps - 1):
            scale = _step_scale(a_scales, w_scales, i)
            nxt = _issue(a_bufs, w_bufs, ready, i + 1, zeros)
            part = warpgroup_mma_wait(num_outstanding=1, deps=(part, ))  # step i's product; i + 1's runs on
            mbarrier.arrive(empty.index(i % STAGES), count=1)
            acc += part * gl.expand_dims(scale, 1)
            part = nxt
        last = k_steps - 1
        scale = _step_scale(a_scales, w_scales, last)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
        mbarrier.arrive(empty.index(last % STAGES), count=1)
        acc += part * gl.expand_dims(scale, 1)
    else:
        for i in range(k_steps):
            scale = _step_scale(a_scales, w_scales, i)
            part = _issue(a_bufs, w_bufs, ready, i, zeros)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            mbarrier.arrive(empty.index(i % STAGES), count=1)
            acc += part * gl.expand_dims(scale, 1)
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
    offs = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
    gl.store(out_ptr + offs, acc.to(gl.bfloat16), mask=gl.expand_dims(cols < N, 0))


@gluon.jit
def fp8_grouped_ws_kernel(a_desc, w_desc, a_scale_ptr, w_scale_ptr, block_expert_ptr, out_ptr, num_blocks, N, K,
                          STAGES: gl.constexpr, GROUP_M: gl.constexpr, PIPELINED: gl.constexpr,
                          LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    """out[block rows] = (a * a_scale) @ (w[expert] * w_scale[expert])^T per aligned row block (see the module's
    docstring). N and K are multiples of 128; BN divides 128."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(GROUP % BN == 0, "a tile takes one weight scale per step")
    block, off_n = grouped_tile(num_blocks, N, BN, GROUP_M)
    expert = gl.load(block_expert_ptr + block)
    off_m = block * BM
    k_steps = K // GROUP
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_fp8_mma, (a_bufs, w_bufs, ready, empty, a_scale_ptr, w_scale_ptr, out_ptr, N, expert, off_m, off_n,
                    k_steps, PIPELINED, num_warps)),
        (_fp8_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, off_m, expert * N + off_n, k_steps)),
    ], [1], [LOAD_REGS])
