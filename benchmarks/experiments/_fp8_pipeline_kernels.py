"""The kernels of fp8_pipeline.py: DeepSeek-V3's FP8 block-scaled grouped GEMM (E4M3 activations with one
fp32 scale per row and 128-deep group, E4M3 weights with one per 128x128 block) over aligned row blocks, each
block one expert's rows. Every 128-deep K step is one tensor-core product whose fp32 result is promoted into the
accumulator with its two scales, as moekit's W8A8 GEMMs do; the variants differ only in how the loads are issued
and scheduled:

  pointer loads   tl.load of both tiles, Triton's software pipeline (num_stages)
  TMA             both tiles through host-made tensor descriptors (bulk copies into shared memory)
  warp-specialized  the K loop under ``tl.range(warp_specialize=True)``: Triton splits it into a load partition
                  and an MMA + promotion partition that run in warps of their own
"""

import triton
import triton.language as tl

# Row blocks in groups of GROUP_M, all column tiles of a group before the next: moekit's own program order
from moekit.experts.kernels.moe_gemm import _tile_ids

GROUP = 128  # the quantization group: 1x128 for activations, 128x128 for weights
_GROUP = tl.constexpr(GROUP)  # (what a kernel may read: Triton 3.6 refuses a plain global on a GPU)


@triton.jit
def fp8_grouped_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, block_expert_ptr, out_ptr,
                       a_desc, w_desc, num_blocks, N, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                       TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, STAGES: tl.constexpr):
    """a [M, K] e4m3 (M = num_blocks * BLOCK_M, K contiguous), a_scale [M, K/128] fp32; w [E, N, K] e4m3,
    w_scale [E, N/128, K/128] fp32; block_expert [num_blocks] int32; out [M, N] bf16. BLOCK_N <= 128 divides 128,
    so that a tile has one weight scale per K step. N and K are multiples of 128 (DeepSeek-V3's are)."""
    pid_m, pid_n = _tile_ids(num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, 128)
    k_steps = K // 128
    a_scales = a_scale_ptr + rows.to(tl.int64) * k_steps
    w_scales = w_scale_ptr + (expert * (N // 128) + (pid_n * BLOCK_N) // 128) * k_steps
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in tl.range(0, k_steps, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        k0 = step * 128
        if TMA:
            a = a_desc.load([pid_m * BLOCK_M, k0])
            w = w_desc.load([(expert * N + pid_n * BLOCK_N).to(tl.int32), k0])
        else:
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * K + (k0 + kk)[None, :])
            w = tl.load(w_ptr + (expert * N + cols)[:, None] * K + (k0 + kk)[None, :])
        part = tl.dot(a, w.T)
        sa = tl.load(a_scales + step)
        sw = tl.load(w_scales + step)
        acc += part * (sa * sw)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(tl.bfloat16))


@triton.jit
def fp8_loop_probe_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, block_expert_ptr, out_ptr, a_desc, w_desc,
                          num_blocks, num_experts, M, N, K,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
                          WARP_SPECIALIZE: tl.constexpr, DEVICE_DESC: tl.constexpr, PRODUCT: tl.constexpr):
    """fp8_grouped_kernel's TMA loop with what each step does to the product as a switch (fp8_loop_probe.py), to
    find what limits it: PRODUCT "scaled" (the promotion with both scales, as moekit's; BLOCK_N <= 128, one
    weight scale per tile and step), "unscaled" (promoted, no scales: wrong numbers, timing only) or "accumulated"
    (tl.dot into the accumulator, no promotion: the loop's ceiling; BLOCK_N may be 256). DEVICE_DESC: descriptors made in
    the kernel (tl.make_tensor_descriptor) instead of on the host."""
    if DEVICE_DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, _GROUP])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_experts * N, K], strides=[K, 1],
                                           block_shape=[BLOCK_N, _GROUP])
    pid_m, pid_n = _tile_ids(num_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_steps = K // _GROUP
    a_scales = a_scale_ptr + rows.to(tl.int64) * k_steps
    w_scales = w_scale_ptr + (expert * (N // _GROUP) + (pid_n * BLOCK_N) // _GROUP) * k_steps
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in tl.range(0, k_steps, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        a = a_desc.load([pid_m * BLOCK_M, step * _GROUP])
        w = w_desc.load([(expert * N + pid_n * BLOCK_N).to(tl.int32), step * _GROUP])
        if PRODUCT == "accumulated":
            acc = tl.dot(a, w.T, acc)
        elif PRODUCT == "unscaled":
            acc += tl.dot(a, w.T)
        else:
            acc += tl.dot(a, w.T) * (tl.load(a_scales + step) * tl.load(w_scales + step))[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(tl.bfloat16))
