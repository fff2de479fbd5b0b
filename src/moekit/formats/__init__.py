"""Low-precision weight formats, bit-exact to docs/formats.md (see each module): :mod:`fp4` (E2M1
codes and nibble packing), :mod:`nvfp4`, :mod:`mxfp4`, :mod:`fp8`; and the format vocabulary every
other part of moekit speaks (:data:`WEIGHT_FORMATS`, :func:`format_of`, :data:`RECIPES`).

These are host-side format routines (quantize at load time, dequantize for references and
fallbacks); they run on any device with plain torch.
"""

import dataclasses

import torch

from . import fp4, fp8, mxfp4, nvfp4
from ._common import check_finite_values, check_quantize_input

__all__ = ["FOUR_BIT_FORMATS", "FP8_ACTIVATION_FORMATS", "RECIPES", "WEIGHT_FORMATS", "dequantize", "expert", "format_of", "fp4", "fp8",
           "from_parts", "mxfp4", "nvfp4", "prepare", "quantize_experts", "recipe_format", "to_parts", "unprepare"]

WEIGHT_FORMATS = ("dense", "mxfp4", "nvfp4", "fp8")
"""What an expert stack can be: a plain tensor, or one of the quantized types below."""
FOUR_BIT_FORMATS = ("mxfp4", "nvfp4")
"""The formats of E2M1 codes packed two per byte, which have a byte layout (:func:`prepare`)."""
TYPES = {"mxfp4": mxfp4.MXFP4Tensor, "nvfp4": nvfp4.NVFP4Tensor, "fp8": fp8.FP8Tensor}
RECIPES = {"mxfp4": "mxfp4", "nvfp4": "nvfp4", "fp8_block": "fp8", "fp8_channel": "fp8", "fp8_tensor": "fp8"}
"""How :func:`quantize_experts` can quantize a stack, and the weight format each recipe makes."""
EXPERT_FORMATS = tuple(RECIPES)  # the recipes' names (the argument of quantize_experts)
FP8_ACTIVATION_FORMATS = ("fp8", "mxfp4")
"""Weights that can meet FP8 activations on FP8 tensor cores: FP8 itself (W8A8) and MXFP4, whose power-of-two
scales recode its codes to E4M3 exactly (W4A8). NVFP4's E4M3 block scales do not: a code times its scale is
in general no E4M3 value."""


def format_of(w) -> str:
    """"dense" for a torch.Tensor, "mxfp4" / "nvfp4" / "fp8" for this package's quantized tensors."""
    if isinstance(w, torch.Tensor):
        return "dense"
    for name, cls in TYPES.items():
        if isinstance(w, cls):
            return name
    raise TypeError(f"expert weights must be torch.Tensor, MXFP4Tensor, NVFP4Tensor or FP8Tensor, got {type(w).__name__}")


def to_parts(w) -> tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor | None, str, list[int]]:
    """(format, data, scales, global_scale, tag, shape): a weight as tensors and plain values, which a
    torch.library op's schema can carry (it takes no objects); :func:`from_parts` rebuilds it. ``tag``: an FP8
    weight's granularity; for 4-bit weights the comma-joined flags "pairs" (that byte layout) and "swizzled" (an
    NVFP4 weight's swizzled scales), empty without either. The rebuilt object is
    new on every call, so a swizzled NVFP4 stack is unswizzled in every compiled call (a copy kept across calls
    could live in the private memory pool of the CUDA graph that made it): compiled code should hold linear
    scales (``dataclasses.replace(w, scales=w.linear_scales(), swizzled=False)``, which keeps the byte layout)."""
    fmt = format_of(w)
    if fmt == "dense":
        return fmt, w, None, None, "", list(w.shape)
    if fmt == "fp8":
        return fmt, w.data, w.scale, None, w.granularity, list(w.data.shape)
    flags = ["pairs"] if w.layout == "pairs" else []
    if fmt == "mxfp4":
        return fmt, w.data, w.scales, None, ",".join(flags), list(w.shape)
    return fmt, w.data, w.scales, w.global_scale, ",".join(flags + ["swizzled"] * w.swizzled), list(w.shape)


def from_parts(fmt: str, data: torch.Tensor, scales: torch.Tensor | None, global_scale: torch.Tensor | None,
               tag: str, shape: list[int]):
    """The weight :func:`to_parts` took apart (its own checks run again)."""
    if fmt == "dense":
        return data
    if fmt == "fp8":
        return fp8.FP8Tensor(data, scales, tag)
    flags = tag.split(",") if fmt in FOUR_BIT_FORMATS else []
    layout = "pairs" if "pairs" in flags else "packed"
    if fmt == "mxfp4":
        return mxfp4.MXFP4Tensor(data, scales, tuple(shape), layout)
    if fmt == "nvfp4":
        return nvfp4.NVFP4Tensor(data, scales, global_scale, tuple(shape), swizzled="swizzled" in flags, layout=layout)
    raise ValueError(f"format must be one of {WEIGHT_FORMATS}, got {fmt!r}")


def recipe_format(recipe: str) -> str:
    """The weight format a :func:`quantize_experts` recipe makes ("fp8_block" -> "fp8")."""
    if recipe not in RECIPES:
        raise ValueError(f"weight_format must be one of {EXPERT_FORMATS}, got {recipe!r}")
    return RECIPES[recipe]


def dequantize(w, dtype=None):
    """Any moekit weight (MXFP4Tensor, NVFP4Tensor, FP8Tensor; a plain tensor is returned as is)
    dequantized to ``dtype`` (default float32)."""
    if isinstance(w, torch.Tensor):
        return w
    for mod, cls in ((mxfp4, mxfp4.MXFP4Tensor), (nvfp4, nvfp4.NVFP4Tensor), (fp8, fp8.FP8Tensor)):
        if isinstance(w, cls):
            return mod.dequantize(w, dtype or torch.float32)
    raise TypeError(f"cannot dequantize a {type(w).__name__}")


def expert(w, e: int, dtype=None):
    """Expert ``e`` [N, K] of a stack [E, N, K]: a plain tensor's slice as is, a quantized stack's
    expert dequantized to ``dtype`` (default float32), so a reference never holds the whole stack
    in float (DeepSeek-V3's experts are 7.5e9 weights)."""
    if not isinstance(w, (torch.Tensor, fp8.FP8Tensor, mxfp4.MXFP4Tensor, nvfp4.NVFP4Tensor)):
        raise TypeError(f"cannot take an expert of a {type(w).__name__}")
    num = w.shape[0] if len(w.shape) else 0
    if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < num:
        raise ValueError(f"e must be an expert index in [0, {num}) of the stack {tuple(w.shape)}, got {e!r}")
    if isinstance(w, torch.Tensor):
        return w[e]
    dtype = dtype or torch.float32
    if isinstance(w, fp8.FP8Tensor):
        return fp8.dequantize(fp8.expert(w, e), dtype)
    if isinstance(w, mxfp4.MXFP4Tensor):
        one = mxfp4.MXFP4Tensor(w.data[e:e + 1], w.scales[e:e + 1], (1, *w.shape[1:]), w.layout)
        return mxfp4.dequantize(one, dtype)[0]
    if isinstance(w, nvfp4.NVFP4Tensor):
        gs = w.global_scale
        # leading dims of the stack's shape, or a scalar: expert e's slice where the first dim is E's
        gs = gs[e:e + 1] if gs.dim() and gs.shape[0] == w.shape[0] and gs.shape[0] > 1 else gs
        one = nvfp4.NVFP4Tensor(w.data[e:e + 1], w.scales[e:e + 1], gs, (1, *w.shape[1:]), w.swizzled, w.layout)
        return nvfp4.dequantize(one, dtype)[0]
    raise TypeError(f"cannot take an expert of a {type(w).__name__}")


def quantize_experts(w, weight_format: str, *, check_finite: bool = True):
    """Expert stack [E, N, K] -> MXFP4Tensor, NVFP4Tensor with one global scale per expert, or
    FP8Tensor (128x128 blocks, per channel, or per tensor with one scale per expert); quantized one
    expert at a time so fp32 temporaries stay one expert large (GPU-friendly). NaN/Inf raise ValueError
    (a host sync: load-time use); with ``check_finite=False`` they propagate as each format's quantizer says."""
    recipe_format(weight_format)
    # checked here so the errors name this function's argument, not the per-expert quantizer's
    check_quantize_input("w", w, {"mxfp4": mxfp4.BLOCK, "nvfp4": nvfp4.BLOCK}.get(weight_format, 1), False)
    if w.dim() != 3 or 0 in w.shape:
        raise ValueError(f"w must be a non-empty expert stack [E, N, K], got shape {tuple(w.shape)}")
    if check_finite:  # an expert at a time, as the quantizing: a whole stack's mask would be as large as its bytes
        for e in range(w.shape[0]):
            check_finite_values(f"w[{e}]", w[e])
    if weight_format.startswith("fp8"):
        quantize = {"fp8_block": fp8.quantize_blocks, "fp8_channel": fp8.quantize_per_channel,
                    "fp8_tensor": fp8.quantize_per_tensor}[weight_format]
        parts = [quantize(w[e:e + 1], check_finite=False) for e in range(w.shape[0])]
        scale = torch.cat([p.scale.reshape(1, *p.scale.shape[1:]) if p.scale.dim() else p.scale.reshape(1)
                           for p in parts])
        return fp8.FP8Tensor(torch.cat([p.data for p in parts]), scale, parts[0].granularity)
    parts = [(mxfp4.quantize(w[e:e + 1], check_finite=False) if weight_format == "mxfp4"
              else nvfp4.quantize(w[e:e + 1], scale_dims=1, check_finite=False)) for e in range(w.shape[0])]
    data = torch.cat([p.data for p in parts])
    scales = torch.cat([p.scales for p in parts])
    if weight_format == "mxfp4":
        return mxfp4.MXFP4Tensor(data, scales, tuple(w.shape))
    return nvfp4.NVFP4Tensor(data, scales, torch.cat([p.global_scale for p in parts]), tuple(w.shape))


def _relaid(w, layout: str):
    """A 4-bit weight with its codes in byte ``layout`` (``w`` itself when it has that layout; other formats as
    they are): the same scales, new code bytes."""
    if format_of(w) not in FOUR_BIT_FORMATS or w.layout == layout:
        return w
    data = fp4.to_layout(fp4.to_packed(w.data, w.layout), layout)
    return dataclasses.replace(w, data=data, layout=layout)


def prepare(w):
    """A weight in moekit's kernel-native layout, made once when weights load: an MXFP4 or NVFP4 stack gets its
    codes in the "pairs" byte layout (:mod:`moekit.formats.fp4`), which the bf16 tensor-core GEMMs read without a
    reordered copy of their activations and the decode kernels pair with activations as they lie in memory. The
    same values, bit for bit (:func:`unprepare` gives the checkpoint's bytes back); every moekit op takes either
    layout. Dense and FP8 weights are returned as they are. A new tensor of code bytes: drop the old one to keep
    one copy."""
    return _relaid(w, "pairs")


def unprepare(w):
    """Inverse of :func:`prepare`: a 4-bit weight with its codes in the checkpoints' "packed" byte layout."""
    return _relaid(w, "packed")
