"""MXFP4 (OCP microscaling, gpt-oss's checkpoint format): E2M1 elements, one E8M0 scale per 32
consecutive elements along K (uint8 s meaning 2^(s - 127); 255 is NaN), no global scale.

Quantizer convention: scale = amax_block / 6 rounded UP to a power of two (so no element
saturates); q = e2m1(x / scale). An all-zero block gets s = 0 (2^-127) and zero codes.

W4A8 (FP8 tensor cores) recodes the weights to E4M3 under one power of two per row: see :func:`to_e4m3`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_tensor
from . import fp4
from ._common import (PackedCodes, blocks, check_block_multiple, check_field, check_format, check_layout,
                      check_quantize_input, shape_tuple)

BLOCK = 32
BIAS = 127
NAN_SCALE = 255
E4M3_SHIFT = 6  # recoded magnitudes e2m1 * 2^(6 - d): the largest, 6 * 2^6 = 384, is below E4M3's 448
E4M3_EXACT_STEPS = 14  # e2m1 * 2^(6 - d) is an E4M3 value for every code up to this d (0.5 * 2^-8 = 2^-9)
E4M3_ZERO_STEP = 15  # the table row of every d past that: zeros
E4M3_NAN_STEP = 16  # the table row of a NaN scale


@dataclass(frozen=True, eq=False)  # (compared by identity: == of tensors is elementwise)
class MXFP4Tensor(PackedCodes):
    """data: uint8 [..., K/2] packed codes, in the byte ``layout`` "packed" (checkpoints') or "pairs" (moekit's
    kernel-native layout, see :mod:`moekit.formats.fp4`; :func:`moekit.formats.prepare` makes it); scales: uint8
    [..., K/32] E8M0 exponents."""

    data: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    layout: str = "packed"

    def __post_init__(self) -> None:
        # Checked when built, so that no kernel or reference ever sees parts that disagree.
        shape = shape_tuple("MXFP4Tensor", self.shape)
        object.__setattr__(self, "shape", shape)
        check_block_multiple("MXFP4Tensor", shape, BLOCK)
        check_layout("MXFP4Tensor", self.layout)
        lead, k = shape[:-1], shape[-1]
        check_field("MXFP4Tensor", "data", self.data, (torch.uint8,), (*lead, k // 2))
        check_field("MXFP4Tensor", "scales", self.scales, (torch.uint8,), (*lead, k // BLOCK), self.data.device)

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
    """x [..., K] (K % 32 == 0) -> MXFP4Tensor. NaN/Inf raise ValueError (with ``check_finite=False``, a block
    holding one gets the NaN scale byte)."""
    check_quantize_input("x", x, BLOCK, check_finite)
    xb = blocks(x.float(), BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    e = scale_exponents(amax)
    codes = fp4.encode(torch.ldexp(xb, -e)).reshape(x.shape)   # x / 2^e exactly
    # (check_finite=False) a block holding NaN or Inf has no power-of-two scale: E8M0's NaN byte keeps it NaN,
    # where any finite byte would turn it into finite weights
    scales = torch.where(torch.isfinite(amax), e + BIAS, NAN_SCALE).squeeze(-1).to(torch.uint8)
    return MXFP4Tensor(fp4.pack(codes), scales, tuple(x.shape))


_WHOLE_STACK_BYTES = 1 << 23  # code bytes decoded in one piece; larger stacks go an expert at a time


def dequantize(t: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e2m1(q) * 2^(s - 127); a scale byte of 255 gives NaN for its block. Exact in fp32 up to its
    range (codes of 4 and 6 under the two largest scales leave it: inf) and exact in float64. A large stack
    [E, N, K] is decoded an expert at a time (fp32 temporaries one expert large, not about 6x the output)."""
    check_format("t", t, MXFP4Tensor, dtype)
    if len(t.shape) >= 3 and t.shape[0] > 1 and t.data.numel() > _WHOLE_STACK_BYTES:
        out = torch.empty(t.shape, dtype=dtype, device=t.data.device)
        for e in range(t.shape[0]):
            out[e] = dequantize(MXFP4Tensor(t.data[e:e + 1], t.scales[e:e + 1], (1, *t.shape[1:]), t.layout), dtype)[0]
        return out
    values = blocks(fp4.decode(t.codes()), BLOCK)
    if dtype == torch.float64:
        values = values.double()
    s = t.scales.to(torch.int32).unsqueeze(-1)
    out = torch.ldexp(values, (s - BIAS).to(values.dtype))
    out = torch.where(s == NAN_SCALE, float("nan"), out)
    return out.reshape(t.shape).to(dtype)


def e4m3_steps(device=None) -> torch.Tensor:
    """uint8 [17, 8], the W4A8 step table: row d (0..14) holds the E4M3 bytes of e2m1 magnitude m times
    2^(6 - d), m = 0..7, all exact; row 15 (every d >= 15) zeros; row 16 (a NaN scale) E4M3's NaN 0x7F. The
    kernels make each row by integer ops (kernels/moe_gemm.py _w4a8_steps)."""
    m = torch.arange(8, device=device)
    e, half = m >> 1, (m & 1).float() * 0.5
    magnitudes = torch.where(e > 0, torch.ldexp(1.0 + half, e - 1), half)
    d = torch.arange(E4M3_EXACT_STEPS + 1, device=device)
    rows = (magnitudes[None, :] * torch.exp2((E4M3_SHIFT - d)[:, None].float())).to(torch.float8_e4m3fn).view(torch.uint8)
    zeros = torch.zeros(1, 8, dtype=torch.uint8, device=device)
    return torch.cat([rows, zeros, torch.full((1, 8), 0x7F, dtype=torch.uint8, device=device)])


def e4m3_step(t: MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, step): r int64 [..., 1] each row's largest scale byte, step int64 [..., K/32] the table row of each
    group, min(r - s, 15), or 16 where s is the NaN scale."""
    s = t.scales.long()
    r = s.amax(dim=-1, keepdim=True)
    return r, torch.where(s == NAN_SCALE, E4M3_NAN_STEP, (r - s).clamp(max=E4M3_ZERO_STEP))


def to_e4m3(t: MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W4A8 recoding, as the kernels compute it: (codes float8_e4m3fn [..., K], r int64 [..., 1]) with
    weight = codes * 2^(r - 133), r the row's largest scale byte.

    A code c in a group of scale byte s becomes the E4M3 value e2m1(c) * 2^(6 - d), d = r - s
    (:func:`e4m3_steps`): exact wherever d <= 14, i.e. every group's scale within 2^14 of its row's largest
    (:func:`e4m3_exact`). A group past that recodes as zeros: its weights are at most 6 * 2^(r - 142), below
    2^-15 of the row's largest possible weight 6 * 2^(r - 127). A NaN scale gives NaN codes (its row's r is 255).
    Negative codes of magnitude 0 give +0."""
    r, step = e4m3_step(t)
    codes = blocks(t.codes(), BLOCK).long()  # [..., K/32, 32]
    table = e4m3_steps(t.data.device)[step]  # [..., K/32, 8]
    byte = torch.gather(table, -1, codes & 7)
    byte = torch.where((codes >= 8) & (byte != 0), byte | 0x80, byte)
    return byte.reshape(t.shape).view(torch.float8_e4m3fn), r


def e4m3_exact(t: MXFP4Tensor) -> torch.Tensor:
    """bool [...] per row: :func:`to_e4m3` reproduces the row exactly (every scale within 2^14 of the row's
    largest, no NaN scale)."""
    _, step = e4m3_step(t)
    return (step <= E4M3_EXACT_STEPS).all(dim=-1)


def from_e4m3(codes: torch.Tensor, r: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """codes * 2^(r - 133) in ``dtype``: the weights the W4A8 kernels compute with."""
    return torch.ldexp(codes.to(dtype), (r - BIAS - E4M3_SHIFT).to(dtype))


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
    """Inverse of :func:`from_gpt_oss`: (blocks [..., N, K/32, 16], scales [..., N, K/32]), the checkpoint's
    "packed" bytes whatever ``t``'s layout."""
    data = fp4.to_packed(t.data, t.layout)
    return data.reshape(*data.shape[:-1], -1, BLOCK // 2), t.scales
