"""The routing function's options and the shapes of its output: the leaf of the routing package (the Python
routing code and the Triton host code both import it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _triton


@dataclass(frozen=True)
class RoutingOptions:
    """Everything that defines a routing function besides the logits (host-side, hashable)."""

    top_k: int
    method: str
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0


def empty_routes(num_tokens: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (topk_weights float32 [T, k], topk_ids int32 [T, k])."""
    return (torch.empty(num_tokens, top_k, dtype=torch.float32, device=device),
            torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))


def routing_block_tokens(num_experts: int) -> int:
    """Tokens per program: keep about 2048 scores in registers per program."""
    return max(1, min(16, 2048 // _triton.next_pow2(num_experts)))
