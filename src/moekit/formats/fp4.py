"""FP4 E2M1: sign bit 3, two exponent bits (bias 1), one mantissa bit, no Inf/NaN.

Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 their negatives (8 is -0). Encoding rounds
to nearest with ties to the even code and saturates at +-6. Packing puts element 2i in the LOW
nibble and element 2i+1 in the high nibble of byte i, along the last axis.

Two byte layouts of packed codes (:data:`LAYOUTS`): "packed" as above (the interchange layout of
checkpoints), and "pairs", moekit's kernel-native layout, a permutation inside each 4-byte word: the
word's nibble j (bits 4j..4j+3 of the little-endian int32) holds element 2j and nibble j + 4 holds element
2j + 1, j = 0..3. The kernels decode a word's nibbles j and j + 4 together (one 32-bit op places both
in the two halves of a register); in "pairs" those are two neighbouring elements, the order the other
operand already has in memory. :func:`to_pairs` and :func:`from_pairs` convert bit for bit.
"""

from __future__ import annotations

import torch

from .._checks import check_tensor

MAX = 6.0
LAYOUTS = ("packed", "pairs")
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


_CHUNK_BYTES = 1 << 26  # bytes per step of a relayout: its temporaries stay a few times this, not a stack's size


def _relayout_words(data: torch.Tensor, name: str, step) -> torch.Tensor:
    """``step(b0, b1, b2, b3)`` -> four bytes, applied to every 4-byte word of ``data`` [..., K/2] in chunks of
    rows (a copy of a non-contiguous ``data`` is made first; a stride-0 expanded stack comes out whole)."""
    check_tensor(name, data, dtypes=(torch.uint8,))
    if data.dim() < 1 or data.shape[-1] % 4:
        raise ValueError(f"{name} must have a last dimension that is a multiple of 4 bytes (whole words of 8 codes), "
                         f"got shape {tuple(data.shape)}")
    out = torch.empty(data.shape, dtype=torch.uint8, device=data.device)
    if out.numel() == 0:  # (no rows or K = 0: nothing to move, and a view of -1 rows of 0 words is ambiguous)
        return out
    rows_in, rows_out = data.reshape(-1, data.shape[-1] // 4, 4), out.view(-1, data.shape[-1] // 4, 4)
    chunk = max(_CHUNK_BYTES // max(data.shape[-1], 1), 1)
    for r0 in range(0, rows_in.shape[0], chunk):
        b = rows_in[r0:r0 + chunk]
        rows_out[r0:r0 + chunk] = torch.stack(step(b[..., 0], b[..., 1], b[..., 2], b[..., 3]), dim=-1)
    return out


def to_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., K/2] (K % 8 == 0) in the "packed" layout -> the same codes in the "pairs" layout (a new tensor).
    A word's bytes hold elements (0, 2), (4, 6), (1, 3), (5, 7) (low nibble first)."""
    return _relayout_words(packed, "packed", lambda b0, b1, b2, b3: (
        (b0 & 0xF) | (b1 << 4), (b2 & 0xF) | (b3 << 4), (b0 >> 4) | (b1 & 0xF0), (b2 >> 4) | (b3 & 0xF0)))


def from_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_pairs`: bytes [..., K/2] in the "pairs" layout -> the "packed" layout (a new tensor)."""
    return _relayout_words(pairs, "pairs", lambda p0, p1, p2, p3: (
        (p0 & 0xF) | (p2 << 4), (p0 >> 4) | (p2 & 0xF0), (p1 & 0xF) | (p3 << 4), (p1 >> 4) | (p3 & 0xF0)))


def to_layout(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """Bytes in the "packed" layout as ``layout`` has them (``packed`` itself for "packed")."""
    return packed if layout == "packed" else to_pairs(packed)


def to_packed(data: torch.Tensor, layout: str) -> torch.Tensor:
    """Bytes in ``layout`` in the "packed" layout (``data`` itself for "packed")."""
    return data if layout == "packed" else from_pairs(data)
