"""The torch backend of the experts: every expert on every row in fp32 (quantized weights dequantized
one expert at a time), static shapes and no host sync. It is the float reference that serves any call
on any device, and the implementation on CPUs.
"""

from __future__ import annotations

import torch

from .. import _invariant
from ..formats import expert, fp8, nvfp4
from ..reference import SWIGLU_ALPHA, SWIGLU_LIMIT
from .lora import torch_term


def _activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """fp32 [n, 2I] -> [n, I] (layouts: [gate; up] for silu_and_mul, interleaved for swiglu_oai)."""
    if activation == "silu_and_mul":
        gate, up = h.chunk(2, dim=-1)
        return _invariant.elementwise(_silu_and_mul, gate, up)
    return _invariant.elementwise(_swiglu_oai, h[..., 0::2], h[..., 1::2])


def _silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1.0) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)


def _fp8_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize of activations in 1x128 groups (DeepSeek-V3's W8A8): each
    row's scales are its own, so other rows (padding included) never move them."""
    return fp8.dequantize(fp8.quantize_groups(torch.where(rows[:, None], t, 0.0), check_finite=False), torch.float32)


def _nvfp4_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize-dequantize of activations as Blackwell's W4A4 kernels see them: e4m3 scales
    per 16 along K under ONE global scale for the expert, from the amax of its rows only
    (``rows``: bool [n]; other rows, padding included, never move it). No host sync."""
    gs = nvfp4.default_global_scale(torch.where(rows[:, None], t, 0.0))
    q = nvfp4.quantize(torch.where(rows[:, None], t, 0.0), global_scale=gs, check_finite=False)
    return nvfp4.dequantize(q, torch.float32)


_ROUND_ACTIVATIONS = {"nvfp4": _nvfp4_rows, "fp8_group": _fp8_rows}


_matmul = _invariant.matmul  # a [n, K] @ b [K, N], in fixed-shape pieces in batch-invariant mode


def _expert(e, x32, w13, w2, activation, w13_bias, w2_bias, act_quant=None, rows=None, lora=None, adapters=None):
    """Expert ``e`` of stacked weights (and optional stacked biases) on fp32 rows, in fp32; with
    ``act_quant`` both GEMM inputs are rounded as that format's kernels see them, over ``rows``. ``lora``
    (an ExpertsLoRA) adds its terms on the same GEMM inputs, ``adapters`` (int [n]) naming each row's adapter."""
    if act_quant:
        x32 = _ROUND_ACTIVATIONS[act_quant](x32, rows)
    # Quantized stacks are dequantized one expert at a time: kimi-k2's whole stack in fp32 is 68 GB.
    h = _matmul(x32, expert(w13, e).float().T)
    if w13_bias is not None:
        h = h + w13_bias[e].float()
    if lora is not None and lora.w13_a is not None:
        h = h + torch_term(lora, "w13", e, x32, adapters)
    a = _activate(h, activation)
    if act_quant:
        a = _ROUND_ACTIVATIONS[act_quant](a, rows)
    y = _matmul(a, expert(w2, e).float().T)
    if lora is not None and lora.w2_a is not None:
        y = y + torch_term(lora, "w2", e, a, adapters)
    return y if w2_bias is None else y + w2_bias[e].float()


def fused_torch(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map, config=None,
                act_quant=None, lora=None, lora_ids=None) -> None:
    """The torch backend of :func:`fused_experts` (validated arguments), written into ``out``."""
    E, H = w13.shape[0], x.shape[1]
    num_global = expert_map.shape[0] if expert_map is not None else E
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_global)
    local = ids.clamp(0, num_global - 1)
    if expert_map is not None:
        local = expert_map.long()[local]
        valid &= (local >= 0) & (local < E)
    local = torch.where(valid, local, 0)
    weights = torch.where(valid, topk_weights, 0.0)
    acc = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
    x32 = x.float()
    # A dense pass per expert keeps shapes static (no host sync, graph-capturable); the Triton path
    # replaces it with token-aligned grouped GEMMs.
    for e in range(E):
        mine = (local == e) & valid
        routed = mine.any(dim=1)
        y = _expert(e, x32, w13, w2, activation, w13_bias, w2_bias, act_quant, routed, lora, lora_ids)
        coeff = (weights * mine).sum(dim=1)
        # rows not routed here are left out, not multiplied by zero: a NaN or Inf in their x or in this expert's
        # weights must not reach them (0 * NaN is NaN). Experts in a fixed order: deterministic
        acc += torch.where(routed[:, None], coeff[:, None] * y, 0.0)
    out.copy_(acc)


def batched_torch(out, x, expert_num_tokens, w13, w2, activation, w13_bias, w2_bias, config=None,
                  act_quant=None, lora=None, lora_ids=None) -> None:
    """The torch backend of :func:`batched_experts`: valid rows computed, padding rows zero."""
    E, M = x.shape[0], x.shape[1]
    if E == 0:  # no experts (an expert-parallel rank holding none): nothing to compute, and nothing to stack
        return
    valid = torch.arange(M, device=x.device)[None, :] < expert_num_tokens.long()[:, None]  # [E, M]
    # Rows of a GEMM are independent, so computing padding rows cannot touch valid ones; zeroing
    # them first keeps NaN padding out of the arithmetic altogether.
    x32 = torch.where(valid[..., None], x.float(), 0.0)
    ys = [_expert(e, x32[e], w13, w2, activation, w13_bias, w2_bias, act_quant, valid[e], lora,
                  None if lora_ids is None else lora_ids[e]) for e in range(E)]
    out.copy_(torch.where(valid[..., None], torch.stack(ys), 0.0))
