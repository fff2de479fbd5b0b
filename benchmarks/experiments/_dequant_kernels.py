"""The kernel of dequant_prefill.py: a 4-bit expert stack decoded once into bf16 rows (a scratch stack the
bf16 GEMMs then read), with moekit's own tile decode (experts/kernels/moe_gemm.py _w4_tile) in fp32, so that each
weight is the float32 dequantization of formats.dequantize rounded once to the output dtype."""

import triton
import triton.language as tl

from moekit.experts.kernels.moe_gemm import NVFP4, _w4_tile


@triton.jit
def dequantize_kernel(
    w_ptr, stride_we, stride_wn,  # codes [E, N, K/2] (K contiguous)
    s_ptr, stride_se, stride_sn,  # scale bytes [E, N, K/group]
    gs_ptr,  # NVFP4: float32 global scales [E]
    out_ptr, stride_oe, stride_on,  # out [E, N, K] (K contiguous)
    N, K,
    FORMAT: tl.constexpr, PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < N
    k0 = tl.program_id(1) * BLOCK_K
    tile = _w4_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, None, rows.to(tl.int64), n_ok, k0, K, stride_wn,
                    stride_sn, FORMAT, BLOCK_K, tl.float32, PAIRS=PAIRS)
    if FORMAT == NVFP4:
        tile = tl.div_rn(tile, tl.load(gs_ptr + e))  # IEEE division, as formats.dequantize (`/` is approximate)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + e * stride_oe + rows.to(tl.int64)[:, None] * stride_on + offs_k[None, :],
             tile.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_k < K)[None, :])
