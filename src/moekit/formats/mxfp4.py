"""MXFP4 (OCP microscaling, gpt-oss's checkpoint format): E2M1 elements, one E8M0 scale per 32
consecutive elements along K (uint8 s meaning 2^(s - 127); 255 is NaN), no global scale.

Quantizer convention: scale = amax_block / 6 rounded UP to a power of two (so no element
saturates); q = e2m1(x / scale). An all-zero block gets s = 0 (2^-127) and zero codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_tensor
from . import fp4
from ._common import blocks, check_quantize_input

BLOCK = 32
BIAS = 127
NAN_SCALE = 255


@dataclass(frozen=True)
class MXFP4Tensor:
    """data: uint8 [..., K/2] packed codes; scales: uint8 [..., K/32] E8M0 exponents."""

    data: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]

    def scales_e8m0(self) -> torch.Tensor:
        """The scales as torch.float8_e8m0fnu (same bytes)."""
        return self.scales.view(torch.float8_e8m0fnu)


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 e = ceil(log2(amax / 6)) (amax / 6 computed in fp32), clamped to E8M0's [-127, 127];
    0-amax blocks get -127."""
    ratio = amax.float() / fp4.MAX
    mant, exp = torch.frexp(ratio)                     # ratio = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)         # exact powers of two need no rounding up
    e = torch.where(ratio > 0, e, -BIAS)
    return e.clamp(-BIAS, BIAS).to(torch.int32)


def quantize(x: torch.Tensor, *, check_finite: bool = True) -> MXFP4Tensor:
    """x [..., K] (K % 32 == 0) -> MXFP4Tensor. NaN/Inf raise ValueError."""
    check_quantize_input("x", x, BLOCK, check_finite)
    xb = blocks(x.float(), BLOCK)
    e = scale_exponents(xb.abs().amax(dim=-1, keepdim=True))
    codes = fp4.encode(torch.ldexp(xb, -e)).reshape(x.shape)   # x / 2^e exactly
    return MXFP4Tensor(fp4.pack(codes), (e + BIAS).squeeze(-1).to(torch.uint8), tuple(x.shape))


def dequantize(t: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e2m1(q) * 2^(s - 127); a scale byte of 255 gives NaN for its block. Exact in fp32 up to its
    range (codes of 4 and 6 under the two largest scales leave it: inf) and exact in float64."""
    values = blocks(fp4.decode(fp4.unpack(t.data)), BLOCK)
    if dtype == torch.float64:
        values = values.double()
    s = t.scales.to(torch.int32).unsqueeze(-1)
    out = torch.ldexp(values, (s - BIAS).to(values.dtype))
    out = torch.where(s == NAN_SCALE, float("nan"), out)
    return out.reshape(t.shape).to(dtype)


def from_gpt_oss(blocks_u8: torch.Tensor, scales: torch.Tensor) -> MXFP4Tensor:
    """gpt-oss safetensors ``*_blocks`` uint8 [..., N, K/32, 16] and ``*_scales`` uint8 [..., N, K/32]
    -> MXFP4Tensor of shape [..., N, K] (same bytes, low nibble = even element)."""
    check_tensor("blocks", blocks_u8, dtypes=(torch.uint8,))
    check_tensor("scales", scales, dtypes=(torch.uint8,))
    if blocks_u8.dim() < 2 or blocks_u8.shape[-1] != BLOCK // 2:
        raise ValueError(f"blocks must be [..., K/32, 16], got shape {tuple(blocks_u8.shape)}")
    if tuple(scales.shape) != tuple(blocks_u8.shape[:-1]):
        raise ValueError(f"scales must have shape {tuple(blocks_u8.shape[:-1])} (blocks without its last dim), "
                         f"got {tuple(scales.shape)}")
    data = blocks_u8.reshape(*blocks_u8.shape[:-2], -1)
    return MXFP4Tensor(data, scales, (*data.shape[:-1], data.shape[-1] * 2))


def to_gpt_oss(t: MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`from_gpt_oss`: (blocks [..., N, K/32, 16], scales [..., N, K/32])."""
    return t.data.reshape(*t.data.shape[:-1], -1, BLOCK // 2), t.scales
