"""Checks and behaviour shared by the format routines."""

from __future__ import annotations

import torch

from .._checks import check_tensor
from . import fp4
from .fp4 import LAYOUTS

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
F32_MAX = torch.finfo(torch.float32).max


def check_quantize_input(name: str, x: torch.Tensor, block: int, check_finite: bool) -> None:
    """x [..., K] float with K a multiple of ``block``; NaN/Inf refused (a host sync: load-time use)."""
    check_tensor(name, x, dtypes=FLOAT_INPUTS)
    if x.dim() < 1 or x.shape[-1] % block:
        raise ValueError(f"{name} must have a last dimension that is a multiple of {block}, got shape {tuple(x.shape)}")
    if check_finite:
        check_finite_values(name, x)


def check_finite_values(name: str, x: torch.Tensor) -> None:
    """NaN/Inf, and float64 values past float32's range, refused (a host sync: load-time use)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or Inf: these have no 4/8-bit code with a block scale "
                         "(pass check_finite=False to let them propagate into the scales)")
    # the quantizers work in float32: a float64 value past its range would become Inf there
    if x.numel() and x.dtype == torch.float64 and bool(x.abs().amax() > F32_MAX):
        raise ValueError(f"{name} holds values beyond float32's range (|x| > {F32_MAX:.4g}), which the "
                         "quantizers compute in")


def blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> [..., K / block, block] (a view when x is contiguous)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def shape_tuple(owner: str, shape) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (a torch.Size or a list is accepted)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{owner}.shape must be a tuple of ints, got {type(shape).__name__}") from None
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"{owner}.shape must be a non-empty tuple of non-negative ints, got {shape!r}")
    return dims


def check_field(owner: str, field: str, t, dtypes: tuple[torch.dtype, ...], expected_shape, device=None) -> None:
    """A quantized tensor's part: a tensor of one of ``dtypes``, ``expected_shape`` and on ``device``
    (the device of its codes)."""
    name = f"{owner}.{field}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                        f"got {str(t.dtype).removeprefix('torch.')}")
    if expected_shape is not None and tuple(t.shape) != tuple(expected_shape):
        raise ValueError(f"{name} must have shape {tuple(expected_shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of the codes, data), got {t.device}")


def check_block_multiple(owner: str, shape: tuple[int, ...], block: int) -> None:
    if shape[-1] % block:
        raise ValueError(f"{owner}.shape must end in a multiple of {block} (its scale blocks run along the last "
                         f"axis), got {shape}")


def check_format(name: str, t, cls, dtype) -> None:
    """A dequantize call's arguments: ``t`` of the format's type, ``dtype`` a floating dtype."""
    if not isinstance(t, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {type(t).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")


def check_layout(owner: str, layout) -> None:
    """A 4-bit tensor's byte layout: one of fp4.LAYOUTS."""
    if layout not in LAYOUTS:
        raise ValueError(f"{owner}.layout must be one of {LAYOUTS}, got {layout!r}")


class PackedCodes:
    """What the two 4-bit tensor types share: ``data`` (packed codes in byte ``layout``) read in element order."""

    def codes(self) -> torch.Tensor:
        """uint8 [..., K]: every element's code, in element order (whatever the layout)."""
        return fp4.unpack(fp4.to_packed(self.data, self.layout))
