"""The experts benchmarks' floors (experts.py, lowbit.py): the least time a call can take, from the bytes the
timed calls read and write at timing.COPY_BW and from their FLOPs at a measured matmul rate.

Bytes: the weights of the distinct experts each timed call hits, as stored (codes, scales, global scales and
biases: :func:`expert_bytes`), plus the call's activations in and out. A decode graph replays 8 calls, each
with its own routing, so the experts hit are the mean over those calls (:func:`experts_hit`): the first call's
count alone is one draw of eight, not what the graph reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...formats import to_parts
from .timing import COPY_BW


def experts_hit(ids_per_call: Sequence[torch.Tensor]) -> tuple[float, list[int]]:
    """(mean over the calls of each call's distinct experts, each call's count). ``ids_per_call``: the timed
    calls' topk_ids [T, k], in the order the graph runs them."""
    counts = [int(torch.unique(ids).numel()) for ids in ids_per_call]
    return sum(counts) / len(counts), counts


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def expert_bytes(num_experts: int, *stacks) -> float:
    """Bytes one expert's weights take as stored: ``stacks`` are [E, ...] stacks of any moekit weight format (a
    tensor; a quantized stack counts its codes, scales and global scales: formats.to_parts) or per-expert biases
    [E, N]; None is skipped. Per-channel FP8 scales, NVFP4's global scales and biases are read with the expert's
    codes, so they count."""
    total = 0
    for w in stacks:
        if w is None:
            continue
        _, data, scales, global_scale, _, _ = to_parts(w)
        total += _nbytes(data) + _nbytes(scales) + _nbytes(global_scale)
    return total / num_experts


def activation_bytes(num_tokens: int, hidden: int, itemsize: int = 2) -> int:
    """x [T, H] read and out [T, H] written, in the activations' dtype (bf16)."""
    return 2 * num_tokens * hidden * itemsize


def bytes_floor_us(hit: float, per_expert: float, num_tokens: int, hidden: int) -> float:
    """Microseconds to read ``hit`` experts of ``per_expert`` bytes and the activations at COPY_BW."""
    return (hit * per_expert + activation_bytes(num_tokens, hidden)) / COPY_BW * 1e6


def flops_floor_us(spec, num_tokens: int, rate: float) -> float:
    """Microseconds of the call's 2*T*k*3*H*I FLOPs at ``rate`` FLOP/s."""
    return 2 * num_tokens * spec.top_k * 3 * spec.hidden_size * spec.intermediate_size / rate * 1e6


def floor_us(spec, num_tokens: int, hit: float, per_expert: float, rate: float) -> tuple[float, str]:
    """(floor in us, "bytes" or "flops": which bound it is) of a call hitting ``hit`` experts on average."""
    bw, mm = bytes_floor_us(hit, per_expert, num_tokens, spec.hidden_size), flops_floor_us(spec, num_tokens, rate)
    return (bw, "bytes") if bw >= mm else (mm, "flops")
