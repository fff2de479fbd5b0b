"""FP8 E4M3 activation groups (1x128, DeepSeek-V3's W8A8) quantized on the GPU before GEMM1:
the same numbers as moekit.formats.fp8.quantize_groups, without a host round trip."""

import triton
import triton.language as tl

from .moe_gemm import E4M3_MAX, FP8_GROUP, _round_e4m3


@triton.jit
def quantize_groups_kernel(
    x_ptr, stride_xm, stride_xk,  # x [rows, K]
    q_ptr, stride_qm,  # out: E4M3 codes [rows, K] (EMULATED: their fp32 values)
    s_ptr, stride_sm,  # out: fp32 scales [rows, K / 128]
    K,
    EMULATED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * FP8_GROUP + tl.arange(0, FP8_GROUP)
    ok = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs * stride_xk, mask=ok, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=0) / E4M3_MAX
    q = tl.minimum(tl.maximum(x / tl.where(scale > 0, scale, 1.0), -E4M3_MAX), E4M3_MAX)
    if EMULATED:
        q = _round_e4m3(q)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + g, scale)
