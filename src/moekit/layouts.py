"""Explicit, tested conversions between the expert weight layouts engines use, and between the
standard ([T, H] + top-k) and batched ([E, M, H] per expert) activation formats.

moekit's layout: w13 [E, 2I, H] and w2 [E, H, I], K (the reduction axis) contiguous.
  * silu_and_mul: w13 rows are [gate; up] (first I rows gate).
  * swiglu_oai (gpt-oss): w13 rows are interleaved (row 2j gate j, row 2j+1 up j).
Other layouts: [up; gate] (FlashInfer CUTLASS), and Hugging Face transformers' transposed
gate_up_proj [E, H, 2I] / down_proj [E, I, H].
"""

from __future__ import annotations

import torch

from . import _invariant
from ._checks import check_tensor


def _check_w13(w13: torch.Tensor) -> None:
    check_tensor("w13", w13, ndim=3)
    if w13.shape[1] % 2:
        raise ValueError(f"w13 must have an even number of rows (2I), got shape {tuple(w13.shape)}")


def swap_halves(w13: torch.Tensor) -> torch.Tensor:
    """[gate; up] <-> [up; gate] along dim 1 (also for biases [E, 2I] via ``swap_bias_halves``)."""
    _check_w13(w13)
    first, second = w13.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def interleave(w13: torch.Tensor) -> torch.Tensor:
    """[gate; up] (concatenated) -> interleaved (row 2j gate j, row 2j+1 up j), along dim 1."""
    _check_w13(w13)
    gate, up = w13.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def deinterleave(w13: torch.Tensor) -> torch.Tensor:
    """Interleaved -> [gate; up] (concatenated), along dim 1."""
    _check_w13(w13)
    return torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)


def swap_bias_halves(b13: torch.Tensor) -> torch.Tensor:
    return swap_halves(b13.unsqueeze(-1)).squeeze(-1)


def interleave_bias(b13: torch.Tensor) -> torch.Tensor:
    return interleave(b13.unsqueeze(-1)).squeeze(-1)


def deinterleave_bias(b13: torch.Tensor) -> torch.Tensor:
    return deinterleave(b13.unsqueeze(-1)).squeeze(-1)


def from_hf(gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face transformers' [E, H, 2I] / [E, I, H] (x @ W) -> moekit's [E, 2I, H] / [E, H, I].

    The column order of gate_up_proj is kept (interleaved stays interleaved); contiguous copies.
    """
    check_tensor("gate_up_proj", gate_up_proj, ndim=3)
    check_tensor("down_proj", down_proj, ndim=3)
    E, H, two_i = gate_up_proj.shape
    if down_proj.shape != (E, two_i // 2, H):
        raise ValueError(f"down_proj must have shape ({E}, {two_i // 2}, {H}) for gate_up_proj "
                         f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}")
    return gate_up_proj.transpose(1, 2).contiguous(), down_proj.transpose(1, 2).contiguous()


def to_hf(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moekit's [E, 2I, H] / [E, H, I] -> Hugging Face transformers' [E, H, 2I] / [E, I, H]."""
    _check_w13(w13)
    check_tensor("w2", w2, ndim=3)
    return w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()


# ------------------------------------------------------------------- activation formats
def pack_batched(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, max_tokens: int):
    """Standard -> batched format, without host synchronization.

    Args:
        x: [T, H]; topk_ids: [T, k] int (ids outside [0, E) are dropped).
        num_experts: E; max_tokens: M, the per-expert capacity.

    Returns:
        (xb [E, M, H] with x's dtype, expert_num_tokens int32 [E], slot [T, k] int64): ``slot`` is the
        flat row ``e * M + m`` each (token, choice) went to, or -1 if dropped (bad id or expert full).
        Pairs keep token order within an expert. Padding rows of ``xb`` are zero.

    In batch-invariant mode (:mod:`moekit._invariant`) a capacity below the token count is a ValueError: whether a
    token is dropped would depend on the tokens before it. A capacity of T keeps every pair of tokens whose k ids are
    distinct, as routing gives them; a token that repeats an expert takes a row per repeat, and may still lose one.
    """
    check_tensor("x", x, ndim=2)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64), device=x.device)
    for name, value in (("num_experts", num_experts), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "num_experts" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'num_experts' else 0}, got {value!r}")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must have {x.shape[0]} rows (x's tokens), got {topk_ids.shape[0]}")
    T, k = topk_ids.shape
    if max_tokens < T and _invariant.enabled():
        raise ValueError(_invariant.refusal(
            f"pack_batched with max_tokens={max_tokens} below the {T} tokens",
            "a token is dropped when an expert is full of the tokens before it; pass max_tokens >= T"))
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    key = torch.where(valid, ids, num_experts)               # invalid ids sort last, into a spare bin
    order = torch.sort(key, stable=True).indices             # stable: token order within an expert
    per_bin = torch.zeros(num_experts + 1, dtype=torch.long, device=x.device).scatter_add_(
        0, key, torch.ones_like(key))                        # scatter_add, not bincount: no host sync
    starts = torch.cumsum(per_bin, 0) - per_bin
    rank = torch.empty_like(key).scatter_(0, order, torch.arange(key.numel(), device=x.device) - starts[key[order]])
    keep = valid & (rank < max_tokens)
    slot = torch.where(keep, key * max_tokens + rank, -1)
    counts = per_bin[:num_experts].clamp(max=max_tokens).to(torch.int32)
    # Dropped pairs go to a spare last row, cut off after: a boolean mask (slot[keep]) would be a nonzero, a host sync.
    spare = num_experts * max_tokens
    xb = torch.zeros(spare + 1, x.shape[1], dtype=x.dtype, device=x.device)
    rows = torch.arange(T, device=x.device).repeat_interleave(k)
    xb.index_copy_(0, torch.where(keep, slot, spare), x[rows])
    return xb[:spare].view(num_experts, max_tokens, x.shape[1]), counts, slot.view(T, k)  # (-1 is ambiguous at M = 0)


def combine_batched(yb: torch.Tensor, slot: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Batched outputs -> [T, H]: out[t] = sum_j w[t, j] * yb[slot[t, j]], in a fixed order, fp32 sum.

    Dropped pairs (slot -1) contribute zero. Output dtype is yb's.
    """
    check_tensor("yb", yb, ndim=3)
    check_tensor("slot", slot, ndim=2, dtypes=(torch.int32, torch.int64), device=yb.device)
    check_tensor("topk_weights", topk_weights, device=yb.device)
    if topk_weights.shape != slot.shape:
        raise ValueError(f"topk_weights must have shape {tuple(slot.shape)}, got {tuple(topk_weights.shape)}")
    flat = yb.reshape(-1, yb.shape[-1])
    if flat.shape[0] == 0:  # no capacity (M = 0): every pair was dropped, and there is no row to gather
        flat = torch.zeros(1, yb.shape[-1], dtype=yb.dtype, device=yb.device)
    kept = slot >= 0
    # a dropped pair gathers row 0, which may be padding (never written: NaN times a zero weight is NaN)
    gathered = torch.where(kept[..., None], flat[slot.clamp(min=0)].float(), 0.0)  # [T, k, H]
    w = torch.where(kept, topk_weights.float(), 0.0)
    return (gathered * w[..., None]).sum(dim=1).to(yb.dtype)
