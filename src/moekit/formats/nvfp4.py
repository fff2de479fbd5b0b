"""NVFP4: E2M1 elements, one FP8 E4M3 scale per 16 consecutive elements along K, and one fp32
global scale per tensor (per expert for MoE weights).

moekit keeps the quantize-side convention: global_scale gs = 448 * 6 / amax, block scale
sf = e4m3(gs * amax_block / 6), code q = e2m1(x * gs / sf) (0 where sf == 0), and
x ~ e2m1(q) * sf / gs. ModelOpt checkpoints store weight_scale_2 = 1 / gs; convert with
:func:`from_modelopt` / :func:`to_modelopt`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_tensor, tensor_version
from . import fp4
from ._common import (F32_MAX, PackedCodes, blocks, check_block_multiple, check_field, check_format,
                      check_layout, check_quantize_input, shape_tuple)

BLOCK = 16
E4M3_MAX = 448.0
SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4


@dataclass(frozen=True, eq=False)  # (compared by identity: == of tensors is elementwise)
class NVFP4Tensor(PackedCodes):
    """data: uint8 [..., K/2] (packed codes, in the byte ``layout`` "packed" or "pairs" as MXFP4Tensor's);
    scales: float8_e4m3fn [..., K/16], or when ``swizzled`` uint8 [..., ceil(R/128)*128 * ceil(C/4)*4] in the
    128x4 layout (R = rows of the last-but-one axis, C = K/16; padding zero); global_scale: float32, shape [] or
    the leading dims it was computed over (e.g. [E]), broadcast as global_scale[..., None, None]."""

    data: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, ...]
    swizzled: bool = False
    layout: str = "packed"

    def __post_init__(self) -> None:
        # Checked when built, so that no kernel or reference ever sees parts that disagree.
        shape = shape_tuple("NVFP4Tensor", self.shape)
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.swizzled, bool):
            raise TypeError(f"NVFP4Tensor.swizzled must be a bool, got {type(self.swizzled).__name__}")
        check_block_multiple("NVFP4Tensor", shape, BLOCK)
        check_layout("NVFP4Tensor", self.layout)
        lead, k = shape[:-1], shape[-1]
        check_field("NVFP4Tensor", "data", self.data, (torch.uint8,), (*lead, k // 2))
        device = self.data.device
        if self.swizzled:
            if len(shape) < 2:
                raise ValueError(f"NVFP4Tensor with swizzled scales needs a shape [..., R, K], got {shape}")
            expected = (*shape[:-2], swizzled_size(shape[-2], k // BLOCK))
            check_field("NVFP4Tensor", "scales", self.scales, (torch.uint8,), expected, device)
        else:
            check_field("NVFP4Tensor", "scales", self.scales, (torch.float8_e4m3fn,), (*lead, k // BLOCK), device)
        gs = self.global_scale
        check_field("NVFP4Tensor", "global_scale", gs, (torch.float32,), None, device)
        # one value per leading index (e.g. per expert), broadcast along K: never a distinct value per column
        if (gs.dim() > len(shape) or any(g not in (1, d) for g, d in zip(gs.shape, shape[:-1]))
                or (gs.dim() == len(shape) and gs.shape[-1] != 1)):
            raise ValueError(f"NVFP4Tensor.global_scale must be a scalar or broadcast over the leading dims of "
                             f"shape {shape} (e.g. one per expert), got shape {tuple(gs.shape)}")

    def linear_scales(self) -> torch.Tensor:
        """float8_e4m3fn [..., K/16], whatever the stored layout (swizzled scales are unswizzled once per
        tensor: the kernels read the linear layout on every call)."""
        if not self.swizzled:
            return self.scales
        version = tensor_version(self.scales)
        if version is None:  # an inference-mode tensor keeps no version counter: unswizzled on every call
            return unswizzle(self.scales, self.shape[-2], self.shape[-1] // BLOCK)
        cached = self.__dict__.get("_linear")
        if cached is None or cached[0] != version:
            cached = (version, unswizzle(self.scales, self.shape[-2], self.shape[-1] // BLOCK))
            object.__setattr__(self, "_linear", cached)  # a cache beside the frozen fields, not one of them
        return cached[1]


def _expand(gs: torch.Tensor, ndim: int) -> torch.Tensor:
    return gs.reshape(*gs.shape, *([1] * (ndim - gs.dim())))


def default_global_scale(x: torch.Tensor, scale_dims: int = 0) -> torch.Tensor:
    """448 * 6 / amax over all but the first ``scale_dims`` dims (1 for per-expert [E, N, K]), of the finite values
    (a NaN or Inf stays in its block, see :func:`quantize`); an all-zero or empty tensor (or expert) gets 1.0 (its
    scales and codes are all zero anyway)."""
    flat = x.abs().float().reshape(*x.shape[:scale_dims], -1)
    flat = torch.where(torch.isfinite(flat), flat, 0.0)
    if flat.shape[-1] == 0:  # torch's amax refuses an empty reduction; an empty tensor holds no zeros to scale
        return torch.ones(flat.shape[:-1], dtype=torch.float32, device=x.device)
    amax = flat.amax(dim=-1)
    # below about 8e-36 the quotient leaves float32: clamped, tiny blocks keep finite scales (Inf made 0 * Inf NaN)
    return torch.where(amax > 0, (E4M3_MAX * fp4.MAX / amax).clamp(max=F32_MAX), torch.ones_like(amax))


def quantize(x: torch.Tensor, global_scale: float | torch.Tensor | None = None, swizzled: bool = False, *,
             scale_dims: int = 0, check_finite: bool = True) -> NVFP4Tensor:
    """x [..., K] (K % 16 == 0) -> NVFP4Tensor.

    global_scale: None (computed, see :func:`default_global_scale` with ``scale_dims``), a float,
    or a float32 tensor over leading dims. Block scales above 448 saturate to 448 (only with a
    caller's global scale larger than the default). NaN/Inf in x raise ValueError; with ``check_finite=False``
    a block holding one gets a NaN scale (it dequantizes to NaN) and the other blocks are quantized as without it.
    """
    check_quantize_input("x", x, BLOCK, check_finite)
    if swizzled and x.dim() < 2:
        raise ValueError(f"swizzled scales need x with at least 2 dims [..., R, K], got shape {tuple(x.shape)}")
    if global_scale is None:
        gs = default_global_scale(x, scale_dims)
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        if gs.dim() >= x.dim() or tuple(gs.shape) != tuple(x.shape[:gs.dim()]):
            raise ValueError(f"global_scale must be a scalar or have the leading shape of x {tuple(x.shape)}, "
                             f"got shape {tuple(gs.shape)}")
        # (a host sync, as the finite check's: with check_finite=False, as the torch backend's per-call rounding of
        # activations asks, neither runs)
        if check_finite and gs.numel() and not bool((torch.isfinite(gs) & (gs > 0)).all()):
            raise ValueError("global_scale must be finite and > 0: the weights are divided by it")
    xb = blocks(x.float(), BLOCK)                                   # [..., K/16, 16]
    gsb = _expand(gs, xb.dim())
    amax_b = xb.abs().amax(dim=-1, keepdim=True)
    sf = (gsb * amax_b / fp4.MAX).clamp(max=E4M3_MAX)
    sf = torch.where(torch.isfinite(amax_b), sf, float("nan")).to(torch.float8_e4m3fn)
    sf32 = sf.float()
    scaled = torch.where(sf32 > 0, xb * gsb / torch.where(sf32 > 0, sf32, 1.0), 0.0)
    codes = fp4.encode(scaled).reshape(x.shape)
    scales = sf.squeeze(-1)
    if swizzled:
        scales = swizzle(scales)
    return NVFP4Tensor(fp4.pack(codes), scales, gs, tuple(x.shape), swizzled)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e2m1(q) * sf / gs in fp32, then ``dtype``; shape t.shape."""
    check_format("t", t, NVFP4Tensor, dtype)
    values = blocks(fp4.decode(t.codes()), BLOCK)
    sf = t.linear_scales().float().unsqueeze(-1)
    out = values * sf / _expand(t.global_scale.float(), values.dim())
    return out.reshape(t.shape).to(dtype)


# ------------------------------------------------------------------------ 128x4 swizzled scales
def swizzled_offsets(rows: int, cols: int, device=None) -> torch.Tensor:
    """int64 [rows, cols]: byte offset of scale (r, c) in the 128x4 layout (docs/formats.md)."""
    padded_cols = -(-cols // SWIZZLE_COLS) * SWIZZLE_COLS
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(cols, device=device)[None, :]
    return (((r // 128) * (padded_cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4))


def swizzled_size(rows: int, cols: int) -> int:
    return -(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS * (-(-cols // SWIZZLE_COLS) * SWIZZLE_COLS)


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., R, C] -> uint8 [..., padded R * padded C] in the 128x4 layout; padding is zero."""
    check_tensor("scales", scales, dtypes=(torch.float8_e4m3fn,))
    if scales.dim() < 2:
        raise ValueError(f"scales must be [..., R, C], got shape {tuple(scales.shape)}")
    rows, cols = scales.shape[-2:]
    lead = scales.shape[:-2]
    out = torch.zeros(*lead, swizzled_size(rows, cols), dtype=torch.uint8, device=scales.device)
    offsets = swizzled_offsets(rows, cols, scales.device).reshape(-1)
    out[..., offsets] = scales.view(torch.uint8).reshape(*lead, -1)
    return out


def unswizzle(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle`: uint8 [..., padded size] -> e4m3 [..., rows, cols]."""
    check_tensor("swizzled", swizzled, dtypes=(torch.uint8,))
    if swizzled.shape[-1] != swizzled_size(rows, cols):
        raise ValueError(f"swizzled must have {swizzled_size(rows, cols)} bytes in its last dim for "
                         f"{rows}x{cols} scales, got shape {tuple(swizzled.shape)}")
    offsets = swizzled_offsets(rows, cols, swizzled.device).reshape(-1)
    return swizzled[..., offsets].reshape(*swizzled.shape[:-1], rows, cols).view(torch.float8_e4m3fn)


# ------------------------------------------------------------------------- ModelOpt edge
def to_modelopt(t: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """{"weight": uint8 [..., K/2] ("packed" bytes), "weight_scale": e4m3 [..., K/16], "weight_scale_2": 1 / gs}."""
    return {"weight": fp4.to_packed(t.data, t.layout), "weight_scale": t.linear_scales(),
            "weight_scale_2": 1.0 / t.global_scale}


def from_modelopt(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                  swizzled: bool = False) -> NVFP4Tensor:
    """ModelOpt tensors (weight_scale_2 = 1 / gs, scalar or [E]) -> NVFP4Tensor.

    gs = 1 / weight_scale_2 in fp32; dequantized values may then differ from q * sf * weight_scale_2
    by one fp32 rounding (never after rounding to bf16 for a correctly rounded pair, see tests).
    """
    check_tensor("weight", weight, dtypes=(torch.uint8,))
    check_tensor("weight_scale", weight_scale, dtypes=(torch.float8_e4m3fn,))
    shape = (*weight.shape[:-1], weight.shape[-1] * 2)
    if tuple(weight_scale.shape) != (*weight.shape[:-1], shape[-1] // BLOCK):
        raise ValueError(f"weight_scale must have shape {(*weight.shape[:-1], shape[-1] // BLOCK)} for weight "
                         f"{tuple(weight.shape)}, got {tuple(weight_scale.shape)}")
    ws2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device)
    if ws2.dim() > 1 or (ws2.dim() == 1 and ws2.shape[0] not in (1, weight.shape[0])):
        raise ValueError(f"weight_scale_2 must be a scalar or one per expert ({weight.shape[0]},), got shape "
                         f"{tuple(ws2.shape)}")
    # (a host sync: load time) a scale <= 0, Inf or NaN would zero, flip or poison every weight it scales
    if ws2.numel() and not bool((torch.isfinite(ws2) & (ws2 > 0)).all()):
        raise ValueError(f"weight_scale_2 must be finite and > 0, got values in [{ws2.min().item()}, "
                         f"{ws2.max().item()}]")
    gs = 1.0 / ws2
    scales = swizzle(weight_scale) if swizzled else weight_scale
    return NVFP4Tensor(weight, scales, gs, shape, swizzled)
