"""FP4 E2M1: sign bit 3, two exponent bits (bias 1), one mantissa bit, no Inf/NaN.

Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 their negatives (8 is -0). Encoding rounds
to nearest with ties to the even code and saturates at +-6. Packing puts element 2i in the LOW
nibble and element 2i+1 in the high nibble of byte i, along the last axis.
"""

from __future__ import annotations

import torch

from .._checks import check_tensor

MAX = 6.0
VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Magnitude m gets at least code c (c = 1..7) when m passes threshold c. At a tie (midpoint) the
# even code wins, so the comparison is strict where the lower code is even and inclusive where it is odd.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def code_values(device=None) -> torch.Tensor:
    """float32 [16]: the value of every code."""
    v = torch.tensor(VALUES, dtype=torch.float32, device=device)
    return torch.cat([v, -v])


def encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8 in 0..15) of each element; ties to the even code, |x| > 5 -> 6.

    The sign bit is set for x < 0 (also when the magnitude rounds to 0: -0). NaN encodes as 0; the
    quantizers refuse NaN/Inf before they get here.
    """
    check_tensor("x", x)
    mag = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, inclusive in _THRESHOLDS:
        code += (mag >= threshold if inclusive else mag > threshold).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 codes (only the low 4 bits are read)."""
    check_tensor("codes", codes, dtypes=(torch.uint8,))
    return code_values(codes.device)[(codes & 0xF).long()]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (K even) -> bytes [..., K/2]: element 2i low nibble, 2i+1 high nibble."""
    check_tensor("codes", codes, dtypes=(torch.uint8,))
    if codes.dim() < 1 or codes.shape[-1] % 2:
        raise ValueError(f"codes must have an even last dimension, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2) & 0xF
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] -> uint8 codes [..., K] (inverse of :func:`pack`)."""
    check_tensor("packed", packed, dtypes=(torch.uint8,))
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
