"""Host side of the router and routing kernels (kernels/router.py, kernels/topk.py): launch shapes
and arguments. Imported on the first Triton call, so that the kernels are built (compiled, or for
the interpreter wrapped) as TRITON_INTERPRET says then."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import _invariant, _triton
from . import tiers
from .kernels import topk as topk_kernels
from .._launch import Constants, Launcher
from .kernels import router as router_kernels

# Every launch binds its call signature once (moekit._launch): the eager host time of a call.
router_kernel = Launcher(router_kernels.router_kernel)
routing_kernel = Launcher(topk_kernels.routing_kernel)
from .options import RoutingOptions, empty_routes, routing_block_tokens

_NO_ROUTING = RoutingOptions(top_k=1, method="softmax_topk")  # fills the routing constexprs of a GEMM-only launch
METHOD_CODES = {"softmax_topk": topk_kernels.SOFTMAX_TOPK.value, "topk_softmax": topk_kernels.TOPK_SOFTMAX.value,
                "sigmoid_grouped": topk_kernels.SIGMOID_GROUPED.value, "sigmoid_top1": topk_kernels.SIGMOID_TOP1.value}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kernel_constants(opts: RoutingOptions, num_experts: int, has_corr_bias: bool) -> dict:
    """The routing constexprs of both kernels (routing and the fused router's epilogue)."""
    return dict(
        TOP_K=opts.top_k,
        K_PAD=_triton.next_pow2(opts.top_k),
        METHOD=METHOD_CODES[opts.method],
        RENORMALIZE=opts.renormalize,
        HAS_CORR_BIAS=has_corr_bias,
        NUM_GROUPS=opts.num_groups,
        TOPK_GROUPS=opts.topk_groups,
        GROUP_SIZE=num_experts // opts.num_groups,
        G_PAD=_triton.next_pow2(opts.num_groups),
        GROUPS_RESHAPE=_pow2(opts.num_groups) and _pow2(num_experts // opts.num_groups),
    )


@dataclass(frozen=True)
class _RouterPlan:
    """What a router launch derives from its shape alone (made once per shape: eager host time)."""

    grid: tuple
    workspace: int  # fp32 partial sums (0: the direct form writes logits itself)
    constants: dict
    k_per_split: int
    rows: int  # num_tokens * (E + rank)


@functools.lru_cache(maxsize=4096)
def _router_plan(num_tokens: int, hidden: int, num_experts: int, rank: int, routing: RoutingOptions | None,
                 has_bias: bool, has_corr_bias: bool, ieee: bool, num_sms: int, invariant: bool) -> _RouterPlan:
    fuse = routing is not None
    cfg = tiers.kernel_config(num_tokens, hidden, num_experts, rank, fuse, num_sms, ieee)
    t_blocks = _triton.cdiv(num_tokens, cfg.block_t)
    direct = cfg.splits == 1 and rank == 0 and not fuse
    if not direct and t_blocks > _triton.NUM_COUNTERS:
        raise ValueError(f"T={num_tokens} needs {t_blocks} token blocks; the small-batch router kernel "
                         f"has {_triton.NUM_COUNTERS} (use tier='cublas' or fewer tokens)")
    total_rows = num_experts + rank
    constants = Constants(
        BLOCK_T=cfg.block_t, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, FIN_T=cfg.fin_t,
        # The interpreter runs programs one by one: a finisher waiting for a later one would hang.
        FIN_PROGRAMS=cfg.fin_programs if router_kernel.compiled else 1,
        E_PAD=_triton.next_pow2(num_experts), S_CHUNK=cfg.s_chunk, R_PAD=cfg.r_pad,
        HAS_BIAS=has_bias, HAS_LORA=rank > 0, FUSE_TOPK=fuse, DIRECT=direct,
        IEEE=ieee, FENCE=router_kernel.compiled, FOLD_SPLITS=cfg.fold_splits,
        **kernel_constants(routing or _NO_ROUTING, num_experts, has_corr_bias),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    grid = (_triton.cdiv(num_experts, cfg.block_r) + _triton.cdiv(rank, cfg.block_r), cfg.splits, t_blocks)
    return _RouterPlan(grid, 0 if direct else cfg.splits * num_tokens * total_rows, constants, cfg.k_per_split,
                       num_tokens * total_rows)


def launch_router(x, weight, bias, lora, *, out2=None, routing: RoutingOptions | None = None, corr_bias=None,
                  topk_weights=None, topk_ids=None, prepare: bool = False) -> "PreparedRouter | None":
    """Launch kernels/router.py: logits into ``out2``, or routes into ``topk_*`` when ``routing``. ``prepare``: return
    the launch made ready to repeat for calls of the same checked signature (:class:`PreparedRouter`; None where it
    cannot be), for a caller that keeps it."""
    num_tokens, hidden = x.shape
    rank = lora.a.shape[0] if lora is not None else 0
    plan = _router_plan(num_tokens, hidden, weight.shape[0], rank, routing, bias is not None, corr_bias is not None,
                        x.dtype == torch.float32, _triton.num_sms(x.device), _invariant.enabled())
    args = _router_args(plan, x, weight, bias, lora, out2, routing, corr_bias, topk_weights, topk_ids)
    router_kernel.launch(plan.grid, args, plan.constants)
    if not prepare or lora is not None:
        return None
    prepared = router_kernel.prepare(args, plan.constants)
    return None if prepared is None else PreparedRouter(plan, routing, prepared)


def _router_args(plan: _RouterPlan, x, weight, bias, lora, out2, routing, corr_bias, topk_weights, topk_ids) -> tuple:
    if plan.workspace:
        ws, counters = torch.empty(plan.workspace, dtype=torch.float32, device=x.device), _triton.counters(x.device)
    else:
        ws = counters = x
    a = lora.a if lora is not None else weight
    b = lora.b if lora is not None else weight
    if routing is None:
        scaling = 1.0
        topk_weights = topk_ids = x
    else:
        scaling = routing.scaling
        out2 = x
    return (  # every tensor here is 2-D: one stride() call gives both strides
        x, *x.stride(),
        weight, *weight.stride(),
        a, *a.stride(),
        b, *b.stride(),
        bias if bias is not None else x, corr_bias if corr_bias is not None else x,
        ws, counters,
        out2, *out2.stride(),
        topk_weights, topk_ids,
        x.shape[0], x.shape[1], weight.shape[0], 0 if lora is None else lora.a.shape[0], plan.k_per_split, plan.rows,
        float(lora.scale) if lora is not None else 0.0, scaling,
    )


class PreparedRouter:
    """A router launch without LoRA, ready to repeat for calls of one checked signature (the op keeps it with its
    decision): the launch shape and the bound kernel are the first call's, so a repeated call builds only its
    arguments. ``__call__`` returns False where the binding does not hold (moekit._launch.Prepared): the caller
    then goes through :func:`launch_router`."""

    __slots__ = ("_plan", "_routing", "_prepared")

    def __init__(self, plan: _RouterPlan, routing: RoutingOptions | None, prepared):
        self._plan, self._routing, self._prepared = plan, routing, prepared

    def __call__(self, x, weight, bias, *, out2=None, corr_bias=None, topk_weights=None, topk_ids=None) -> bool:
        plan = self._plan
        return self._prepared(plan.grid, _router_args(plan, x, weight, bias, None, out2, self._routing, corr_bias,
                                                      topk_weights, topk_ids))


def route_triton(logits, opts: RoutingOptions, correction_bias):
    """The routing kernel on validated arguments: (weights fp32 [T, k], ids int32 [T, k])."""
    return route_triton_prepared(logits, opts, correction_bias, prepare=False)[0]


def route_triton_prepared(logits, opts: RoutingOptions, correction_bias, prepare: bool = True):
    """:func:`route_triton`, and (``prepare``) its launch made ready to repeat for calls of the same checked
    signature (:class:`PreparedRoute`, or None)."""
    num_tokens, num_experts = logits.shape
    weights, ids = empty_routes(num_tokens, opts.top_k, logits.device)
    if num_tokens == 0:
        return (weights, ids), None
    block_t, constants = _routing_constants(num_experts, opts, correction_bias is not None)
    grid = (_triton.cdiv(num_tokens, block_t),)
    args = _routing_args(logits, correction_bias, weights, ids, opts.scaling)
    routing_kernel.launch(grid, args, constants)
    prepared = routing_kernel.prepare(args, constants) if prepare else None
    return (weights, ids), None if prepared is None else PreparedRoute(grid, opts, prepared)


def _routing_args(logits, correction_bias, weights, ids, scaling: float) -> tuple:
    return (logits, logits.stride(0), logits.stride(1), correction_bias if correction_bias is not None else logits,
            weights, ids, logits.shape[0], logits.shape[1], scaling)


class PreparedRoute:
    """A routing launch ready to repeat for calls of one checked signature (see :class:`PreparedRouter`):
    ``__call__`` returns the routes, or None where the binding does not hold (nothing launched)."""

    __slots__ = ("_grid", "_opts", "_prepared")

    def __init__(self, grid: tuple, opts: RoutingOptions, prepared):
        self._grid, self._opts, self._prepared = grid, opts, prepared

    def __call__(self, logits, correction_bias):
        weights, ids = empty_routes(logits.shape[0], self._opts.top_k, logits.device)
        if self._prepared(self._grid, _routing_args(logits, correction_bias, weights, ids, self._opts.scaling)):
            return weights, ids
        return None


@functools.lru_cache(maxsize=1024)
def _routing_constants(num_experts: int, opts: RoutingOptions, has_corr_bias: bool) -> tuple[int, Constants]:
    """(tokens per program, the routing kernel's constexprs and options): once per kind of call."""
    block_t = routing_block_tokens(num_experts)
    return block_t, Constants(BLOCK_T=block_t, E_PAD=_triton.next_pow2(num_experts),
                              **kernel_constants(opts, num_experts, has_corr_bias), num_warps=4)
