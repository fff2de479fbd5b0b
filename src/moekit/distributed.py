"""Expert parallelism over torch.distributed: each rank of a process group holds E / world experts
(``expert_map`` marks the rest remote) and the tokens of its own batch.

Two dispatch/combine schemes:

* ``"allgather"`` (default; what the large serving engines run): all-gather every rank's tokens
  and routes, run the local experts on all of them (remote experts contribute zero through
  ``expert_map``), reduce-scatter the partial outputs. Static shapes, no host sync: CUDA-graph
  safe. Every rank must pass the same number of tokens: the collectives cannot check it without a host sync, so
  it is checked (a ValueError naming each rank's count) only while the verification gate is on
  (``MOEKIT_VERIFY=1``); otherwise uneven counts fail inside the collective (gloo aborts, NCCL may hang).
* ``"all_to_all"``: send each (token, slot) pair only to the rank that owns its expert
  (all_to_all_single with exchanged counts), compute, send results back, sum each token's slots
  in slot order. Moves k rows per token instead of world rows, but the counts are a host sync.

NCCL on GPU, gloo on CPU; tests run gloo in 2 and 4 processes.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from . import gate
from ._checks import may_sync, warned_if_detached
from .experts import fused_experts
from .layer import FusedMoE
from .routing import fused_router

MODES = ("allgather", "all_to_all")


def shard_layer(layer: FusedMoE, rank: int, world_size: int) -> FusedMoE:
    """A copy of ``layer`` holding only rank ``rank``'s contiguous block of E / world experts, with
    its ``expert_map`` (global id -> local index, -1 elsewhere). Router and shared expert are kept."""
    if not isinstance(layer, FusedMoE):
        raise TypeError(f"layer must be a FusedMoE, got {type(layer).__name__}")
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, world_size={world_size}")
    E = layer.spec.num_experts
    if E % world_size:
        raise ValueError(f"num_experts={E} must be divisible by world_size={world_size}")
    if layer.weight_format != "dense":
        raise ValueError("shard_layer takes dense expert weights (quantize after sharding: "
                         "load_quantized_experts on the shard takes its E / world_size experts)")
    if layer.expert_map is not None or layer.w13.shape[0] != E:  # (its experts are not the router's E any more)
        raise ValueError(f"layer must hold all {E} experts (shard_layer takes the full layer, not a shard: it has "
                         f"{layer.w13.shape[0]} experts{' and an expert_map' if layer.expert_map is not None else ''})")
    if layer.expert_lora() is not None:
        raise ValueError("shard_layer takes a layer without expert LoRA adapters (ExpertParallelMoE serves none)")
    per = E // world_size
    lo = rank * per
    local = copy.deepcopy(layer)
    local._expert_shapes = {name: (per, *shape[1:]) for name, shape in layer._expert_shapes.items()}
    with torch.no_grad():
        local.w13 = nn.Parameter(layer.w13[lo:lo + per].clone())
        local.w2 = nn.Parameter(layer.w2[lo:lo + per].clone())
        if layer.w13_bias is not None:
            local.w13_bias = nn.Parameter(layer.w13_bias[lo:lo + per].clone())
            local.w2_bias = nn.Parameter(layer.w2_bias[lo:lo + per].clone())
    emap = torch.full((E,), -1, dtype=torch.int32, device=layer.w13.device)
    emap[lo:lo + per] = torch.arange(per, dtype=torch.int32, device=layer.w13.device)
    local.expert_map = emap
    return local


class ExpertParallelMoE(nn.Module):
    """``forward(x [T, H]) -> [T, H]`` for this rank's tokens, experts split over ``group``.

    Args:
        local: this rank's layer (see :func:`shard_layer`): replicated router and shared expert,
            its own experts and ``expert_map``.
        group: the process group (default: the world).
        mode: ``"allgather"`` or ``"all_to_all"`` (see the module doc).

    The first call reads every rank's ``expert_map`` (one all-gather and a host sync: make it eagerly, before any
    CUDA-graph capture): each expert must belong to exactly one rank (a ValueError names those that do not), and
    ``"all_to_all"`` sends each pair to its expert's owner by those maps, whatever the placement. A placement
    changed after that first call is not seen.
    """

    def __init__(self, local: FusedMoE, group: dist.ProcessGroup | None = None, mode: str = "allgather") -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if local.expert_map is None:
            raise ValueError("local must hold a shard of the experts with its expert_map (see shard_layer)")
        self.local, self.group, self.mode = local, group, mode
        self._owner: torch.Tensor | None = None  # int64 [E]: each expert's rank, from the first call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The collectives have no gradients (and refuse to write, in grad mode, into the views they gather into):
        # inference only, said once where gradients were asked
        with torch.no_grad():
            out = self._forward(x)
        if not torch.is_grad_enabled():  # (inference: no parameter list to build)
            return out
        return warned_if_detached("ExpertParallelMoE", "one process's FusedMoE", out, x, *self.local.parameters())

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, spec = self.local, self.local.spec
        layer._check_input(x, layer.expert_map)
        if layer.expert_lora() is not None:  # (each token's adapter would have to travel with it)
            raise ValueError("ExpertParallelMoE serves no expert LoRA adapters; the shard has some loaded")
        if self._owner is None:
            self._owner = self._placement()
        x2 = x.reshape(-1, spec.hidden_size)
        kwargs = spec.routing_kwargs()
        if layer.correction_bias is not None:
            kwargs["correction_bias"] = layer.correction_bias
        weights, ids = fused_router(x2, layer.gate.weight, layer.gate.bias, top_k=spec.top_k, method=spec.routing,
                                    lora=layer.gate.lora, **kwargs)
        run = self._allgather if self.mode == "allgather" else self._all_to_all
        out = run(x2, weights, ids)
        if layer.shared_w13 is not None:  # (FusedMoE's own: batch-invariant where the mode is on)
            out = out + FusedMoE._shared_expert(x2, layer.shared_w13, layer.shared_w2)
        return out.view(x.shape)

    def _placement(self) -> torch.Tensor:
        """Each expert's rank (int64 [E]) from every rank's expert_map, after checking that each expert belongs to
        exactly one and that no rank maps two experts to one local stack: shards of other splits, a shard run in a
        group of another size or one rank's shard twice would otherwise drop experts or add them twice, silently."""
        world = dist.get_world_size(self.group)
        maps = _all_gather(self.local.expert_map.to(torch.int32)[None], world, self.group)  # [world, E]
        holders = (maps >= 0).sum(dim=0)
        if not bool((holders == 1).all()):  # (a host sync, on the first call only)
            wrong = [(e, int(n)) for e, n in enumerate(holders.tolist()) if n != 1]
            shown = ", ".join(f"expert {e} on {n} ranks" for e, n in wrong[:8])
            raise ValueError(f"the {world} ranks' expert_maps must give each expert to exactly one rank, got "
                             f"{shown}{' ...' if len(wrong) > 8 else ''} (shard_layer(full, rank, world_size) with "
                             "this group's rank and size makes such shards)")
        for rank, row in enumerate(maps.tolist()):  # two global experts on one local stack: one served twice
            local = [v for v in row if v >= 0]
            if len(set(local)) != len(local):
                twice = sorted({v for v in local if local.count(v) > 1})
                raise ValueError(f"rank {rank}'s expert_map must send each of its experts' global ids to a local "
                                 f"expert of its own, got local experts {twice[:8]} for several global ids")
        return (maps >= 0).to(torch.int64).argmax(dim=0)

    def _experts(self, x, weights, ids):
        layer = self.local
        w13, w2 = layer.expert_weights()
        return fused_experts(x, w13, w2, weights, ids, activation=layer.spec.activation, w13_bias=layer.w13_bias,
                             w2_bias=layer.w2_bias, expert_map=layer.expert_map, act_quant=layer.act_quant)

    def _allgather(self, x, weights, ids):
        world = dist.get_world_size(self.group)
        if gate.enabled() and may_sync(x):
            counts = _all_gather(torch.tensor([x.shape[0]], device=x.device), world, self.group).tolist()
            if len(set(counts)) > 1:
                raise ValueError(f"x must hold as many tokens on every rank in mode='allgather' (use "
                                 f"mode='all_to_all' for uneven batches), got {counts} on ranks 0..{world - 1}")
        gather = lambda t: _all_gather(t, world, self.group)  # noqa: E731
        partial = self._experts(gather(x), gather(weights), gather(ids))
        # the ranks' partials (in x's dtype, as fused_experts gives them) summed in fp32, then this rank's rows
        partial = partial.float()
        mine = torch.empty(x.shape[0], partial.shape[1], dtype=torch.float32, device=x.device)
        dist.reduce_scatter_tensor(mine, partial, group=self.group)
        return mine.to(x.dtype)

    def _all_to_all(self, x, weights, ids):
        world = dist.get_world_size(self.group)
        T, k = ids.shape
        flat_ids = ids.reshape(-1).long()
        owner = self._owner.to(flat_ids.device)[flat_ids]  # (routing gives ids in [0, E))
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()     # the host sync of this scheme

        def exchange(t, splits_out, splits_in):
            out = t.new_empty((sum(splits_in),) + tuple(t.shape[1:]))
            dist.all_to_all_single(out, t.contiguous(), splits_in, splits_out, group=self.group)
            return out

        pair_x = x[order // k]
        got_x = exchange(pair_x, send, recv)
        got_ids = exchange(flat_ids[order].to(torch.int32), send, recv)
        got_w = exchange(weights.reshape(-1)[order], send, recv)
        y = self._experts(got_x, got_w[:, None], got_ids[:, None])        # each received pair is a k=1 token
        back = exchange(y.float(), recv, send)
        slots = torch.empty(T * k, back.shape[1], dtype=torch.float32, device=x.device)
        slots[order] = back
        return slots.view(T, k, back.shape[1]).sum(dim=1).to(x.dtype)  # slots in slot order (T may be 0)


def _all_gather(t: torch.Tensor, world: int, group) -> torch.Tensor:
    out = t.new_empty((world * t.shape[0],) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out
