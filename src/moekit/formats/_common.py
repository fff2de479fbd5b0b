"""Checks shared by the format routines."""

from __future__ import annotations

import torch

from .._checks import check_tensor

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_quantize_input(name: str, x: torch.Tensor, block: int, check_finite: bool) -> None:
    """x [..., K] float with K a multiple of ``block``; NaN/Inf refused (a host sync: load-time use)."""
    check_tensor(name, x, dtypes=FLOAT_INPUTS)
    if x.dim() < 1 or x.shape[-1] % block:
        raise ValueError(f"{name} must have a last dimension that is a multiple of {block}, got shape {tuple(x.shape)}")
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} holds NaN or Inf: these have no 4/8-bit code with a block scale "
                         "(pass check_finite=False to let them propagate into the scales)")


def blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> [..., K / block, block] (a view when x is contiguous)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
