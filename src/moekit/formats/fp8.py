"""FP8 E4M3 (max 448) weights and activations, with fp32 scales: x ~ q * scale.

Granularities: per tensor; per channel (one scale per row of a [..., N, K] weight) with per token
activations (one per row of [T, K]); DeepSeek-V3 blocks: 128x128 weight blocks and 1x128
activation groups. scale = amax / 448 (an all-zero group gets scale 0 and zero codes);
q = e4m3(x / scale) rounded to nearest even, saturating at +-448.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import check_field, check_format, check_quantize_input

E4M3_MAX = 448.0
BLOCK = 128
GRANULARITIES = ("tensor", "channel", "block", "group")


@dataclass(frozen=True, eq=False)  # (compared by identity: == of tensors is elementwise)
class FP8Tensor:
    """data: float8_e4m3fn, x's shape; scale: float32 (see each quantizer for its shape);
    granularity: "tensor" | "channel" | "block" (128x128) | "group" (1x128)."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str

    def __post_init__(self) -> None:
        # Checked when built, so that no kernel or reference ever sees parts that disagree.
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"FP8Tensor.granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        check_field("FP8Tensor", "data", self.data, (torch.float8_e4m3fn,), None)
        check_field("FP8Tensor", "scale", self.scale, (torch.float32,), None, self.data.device)
        shape, scale = tuple(self.data.shape), tuple(self.scale.shape)
        if self.granularity == "tensor":
            # one scale, or one per expert of a stack [E, ...] (as [E] or [E, 1, ...])
            per_expert = len(shape) >= 1 and len(scale) >= 1 and scale[0] == shape[0] and all(d == 1 for d in scale[1:])
            # (more dims than the data would broadcast the data up to them)
            if len(scale) > len(shape) or (self.scale.numel() != 1 and not per_expert):
                raise ValueError(f"FP8Tensor.scale of granularity 'tensor' must hold one value, or one per expert "
                                 f"({shape[0] if shape else 1},) for data {shape}, got shape {scale}")
            return
        if len(shape) < (2 if self.granularity == "block" else 1):
            raise ValueError(f"FP8Tensor of granularity {self.granularity!r} needs data [..., N, K], got shape {shape}")
        n, k = (shape[-2] if len(shape) >= 2 else 1), shape[-1]
        expected = {"channel": (*shape[:-1], 1), "group": (*shape[:-1], -(-k // BLOCK)),
                    "block": (*shape[:-2], -(-n // BLOCK), -(-k // BLOCK))}[self.granularity]
        if scale != expected:
            raise ValueError(f"FP8Tensor.scale of granularity {self.granularity!r} must have shape {expected} for "
                             f"data {shape}, got {scale}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


def _codes(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    safe = torch.where(scale > 0, scale, 1.0)
    return (x32 / safe).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_per_tensor(x: torch.Tensor, *, check_finite: bool = True) -> FP8Tensor:
    """One scale [] for the whole tensor."""
    check_quantize_input("x", x, 1, check_finite)
    x32 = x.float()
    scale = x32.abs().amax() / E4M3_MAX if x.numel() else torch.zeros((), device=x.device)
    return FP8Tensor(_codes(x32, scale), scale, "tensor")


def quantize_per_channel(x: torch.Tensor, *, check_finite: bool = True) -> FP8Tensor:
    """One scale per row: scale [..., N, 1] for x [..., N, K] (weights per output channel,
    activations per token)."""
    check_quantize_input("x", x, 1, check_finite)
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    return FP8Tensor(_codes(x32, scale), scale, "channel")


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def quantize_blocks(w: torch.Tensor, *, check_finite: bool = True) -> FP8Tensor:
    """DeepSeek-V3 weights: w [..., N, K] -> scales [..., ceil(N/128), ceil(K/128)] (partial
    edge blocks take the amax of the elements they hold)."""
    check_quantize_input("w", w, 1, check_finite)
    if w.dim() < 2:
        raise ValueError(f"w must be [..., N, K], got shape {tuple(w.shape)}")
    n, k = w.shape[-2:]
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    w32 = w.float()
    tiles = _pad_to(w32.abs(), nb * BLOCK, kb * BLOCK).reshape(*w.shape[:-2], nb, BLOCK, kb, BLOCK)
    scale = tiles.amax(dim=(-3, -1)) / E4M3_MAX                       # [..., nb, kb]
    full = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :n, :k]
    return FP8Tensor(_codes(w32, full), scale, "block")


def quantize_groups(x: torch.Tensor, *, check_finite: bool = True) -> FP8Tensor:
    """DeepSeek-V3 activations: x [..., K] -> scales [..., ceil(K/128)], one per 1x128 group."""
    check_quantize_input("x", x, 1, check_finite)
    k = x.shape[-1]
    kb = -(-k // BLOCK)
    x32 = x.float()
    padded = torch.nn.functional.pad(x32.abs(), (0, kb * BLOCK - k)).reshape(*x.shape[:-1], kb, BLOCK)
    scale = padded.amax(dim=-1) / E4M3_MAX
    full = scale.repeat_interleave(BLOCK, -1)[..., :k]
    return FP8Tensor(_codes(x32, full), scale, "group")


def expert(t: FP8Tensor, e: int) -> FP8Tensor:
    """Expert ``e`` of a quantized stack [E, N, K] (a per-tensor scale may be shared or per expert)."""
    shared = t.granularity == "tensor" and t.scale.numel() == 1
    return FP8Tensor(t.data[e], t.scale if shared else t.scale.reshape(t.data.shape[0], *t.scale.shape[1:])[e],
                     t.granularity)


def dequantize(t: FP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q * scale in fp32 (scales broadcast over their block), then ``dtype``."""
    check_format("t", t, FP8Tensor, dtype)
    q = t.data.float()
    scale = t.scale
    if t.granularity == "block":
        n, k = q.shape[-2:]
        scale = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :n, :k]
    elif t.granularity == "group":
        scale = scale.repeat_interleave(BLOCK, -1)[..., :q.shape[-1]]
    elif t.granularity == "tensor" and scale.numel() > 1:  # one scale per expert of a stack [E, N, K]
        scale = scale.reshape(-1, *([1] * (q.dim() - 1)))
    return (q * scale).to(dtype)
