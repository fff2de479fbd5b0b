"""The router: logits = x @ W^T + b (+ LoRA) in fp32, and the fused router (GEMM + top-k).

Logits are produced in fp32 with fp32 accumulation and the bias added in fp32: rounding logits
to bf16 flips expert choices on near-ties (the accuracy loss that got a serving engine's router
kernel reverted). Tiers: a small-batch Triton kernel at decode sizes, cuBLAS above the measured
crossover, plain torch on other devices (see :mod:`moekit.routing.tiers`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .. import _invariant, _triton
from .._calls import CheckedCalls
from .._checks import (check_disjoint, check_out, check_shape, check_tensor, check_written_memory, tensor_version,
                       warned_if_detached)
from . import gate_case
from . import tiers as router_tiers
from .options import RoutingOptions, empty_routes
from .topk import (FLOAT_DTYPES, check_replay, record, replay, route_decided, route_deciding, route_with,
                   validate_routing)

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_LORA_RANK = 64


@dataclass(frozen=True)
class RouterLoRA:
    """Low-rank adapter on the router: logits += scale * (x @ a^T) @ b^T.

    a: [r, H] in the router weight's dtype; b: [E, r] any float dtype; r <= 64.
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float = 1.0

    def __post_init__(self) -> None:
        check_tensor("lora.a", self.a, ndim=2, dtypes=INPUT_DTYPES)
        check_tensor("lora.b", self.b, ndim=2, dtypes=FLOAT_DTYPES, device=self.a.device)
        rank = self.a.shape[0]
        if not 1 <= rank <= MAX_LORA_RANK:
            raise ValueError(f"lora rank must be in [1, {MAX_LORA_RANK}], got {rank} (lora.a is [r, H])")
        if self.b.shape[1] != rank:
            raise ValueError(f"lora.b must be [E, r={rank}] (r from lora.a [r, H]), got {tuple(self.b.shape)}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
            raise TypeError(f"lora.scale must be a float, got {type(self.scale).__name__}")
        if not math.isfinite(self.scale):  # every logit would be NaN: routing on nothing, silently
            raise ValueError(f"lora.scale must be finite, got {self.scale}")


class _GemmArgs(NamedTuple):  # a tuple: made on every call, cheaper than a frozen dataclass
    x: torch.Tensor  # [T, H], any strides
    weight: torch.Tensor
    bias: torch.Tensor | None
    lora: RouterLoRA | None


def _validate_gemm(x, weight, bias, lora) -> _GemmArgs:
    check_tensor("weight", weight, ndim=2, dtypes=INPUT_DTYPES)
    num_experts, hidden = weight.shape
    if num_experts == 0 or hidden == 0:
        raise ValueError(f"weight must be a non-empty [E, H] matrix, got shape {tuple(weight.shape)}")
    check_tensor("x", x, dtypes=INPUT_DTYPES, device=weight.device)
    if x.dim() < 1 or x.shape[-1] != hidden:
        raise ValueError(f"x must have shape [..., H={hidden}] (H from weight [E, H]), got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"x must have the weight's dtype {weight.dtype}, got {x.dtype}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES, device=weight.device)
        check_shape("bias", bias, (num_experts,))
    if lora is not None:
        if not isinstance(lora, RouterLoRA):
            raise TypeError(f"lora must be a RouterLoRA, got {type(lora).__name__}")
        check_tensor("lora.a", lora.a, ndim=2, dtypes=(weight.dtype,), device=weight.device)
        rank = lora.a.shape[0]
        if not 1 <= rank <= MAX_LORA_RANK:
            raise ValueError(f"lora rank must be in [1, {MAX_LORA_RANK}], got {rank}")
        check_shape("lora.a", lora.a, (rank, hidden))
        check_tensor("lora.b", lora.b, ndim=2, dtypes=FLOAT_DTYPES, device=weight.device)
        check_shape("lora.b", lora.b, (num_experts, rank))
    # [T, H] as it is (the repeated call's path passes the same tensor); else a view when possible, a copy otherwise
    x2 = x if x.dim() == 2 else x.reshape(-1, hidden)
    # Kernels index [E] vectors with unit stride; a strided one is copied (no-op when contiguous).
    return _GemmArgs(x2, weight, None if bias is None else bias.contiguous(), lora)


def router_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    lora: RouterLoRA | None = None,
    tier: str = "auto",
) -> torch.Tensor:
    """Router logits ``x @ weight^T + bias (+ lora)`` with fp32 accumulation.

    Args:
        x: [..., H] bf16/fp16/fp32, any strides and storage offset.
        weight: [E, H], same dtype as ``x``.
        bias: [E], any float dtype; added in fp32.
        out_dtype: fp32 (default, recommended), bf16 or fp16.
        out: optional [..., E] tensor of ``out_dtype`` (unit stride in the last dim); written in
            place and returned.
        lora: optional :class:`RouterLoRA`.
        tier: ``"auto"`` or one of ``"triton"``, ``"cublas"``, ``"torch"``
            (:func:`moekit.routing.tiers.explain` says which one auto picks and why).

    Returns:
        logits [..., E] in ``out_dtype``.
    """
    key = None
    if lora is None:
        key = CheckedCalls.signature((x, weight, bias, out), (out_dtype, tier))
        decided = _CHECKED_GEMMS.get(key)
        if decided is not None:  # this signature's checks passed and its tier was chosen: only addresses are new
            x2 = x if x.dim() == 2 else x.reshape(-1, weight.shape[1])  # [T, H] as it is (a reshape is a new view)
            if out is not None:
                check_disjoint("out", out, {"x": x, "weight": weight, "bias": bias})
                out2 = out if out.dim() == 2 else out.view(-1, weight.shape[0])
            else:
                out2 = torch.empty(x2.shape[0], weight.shape[0], dtype=out_dtype, device=weight.device)
            if x2.shape[0]:
                _gemm_decided(decided, x2, weight, None if bias is None else bias.contiguous(), out2)
            return warned_if_detached("router_gemm", "tier='torch'", out if out is not None else (
                out2 if x.dim() == 2 else out2.view(*x.shape[:-1], weight.shape[0])), x, weight, bias)
    args = _validate_gemm(x, weight, bias, lora)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    num_experts = weight.shape[0]
    out_shape = tuple(x.shape[:-1]) + (num_experts,)
    if out is not None:
        check_out("out", out, out_shape, out_dtype, weight.device, {"x": x, "weight": weight, "bias": bias,
                                                                    **_lora_memory(lora)})
        try:
            out2 = out if out.dim() == 2 else out.view(-1, num_experts)
        except RuntimeError:
            raise ValueError(f"out must be viewable as [T, E]; its strides {out.stride()} are not") from None
    else:
        out2 = torch.empty(args.x.shape[0], num_experts, dtype=out_dtype, device=weight.device)
    if torch.compiler.is_compiling():
        if _gradients_traced(args, tier):
            _run_torch(args, out2)
        else:
            torch.ops.moekit.router_gemm_into(out2, args.x, weight, args.bias, *_lora_parts(lora), tier)
    else:  # eager: straight to the launch (the op is for torch.compile, and its dispatch costs host time)
        _CHECKED_GEMMS.put(key, _gemm(args, out2, tier, prepare=key is not None))
    return warned_if_detached("router_gemm", "tier='torch'", out if out is not None else out2.view(out_shape), x,
                              weight, bias, *_lora_parts(lora)[:2])


def _gradients_traced(args: _GemmArgs, tier: str) -> bool:
    """Under torch.compile: gradients are asked where the eager call would compute them (the torch tier: asked for,
    or off CUDA), so the torch ops are traced instead of the opaque op, which has no autograd formula."""
    return (torch.is_grad_enabled() and (tier == "torch" or not args.weight.is_cuda)
            and any(isinstance(t, torch.Tensor) and t.requires_grad
                    for t in (args.x, args.weight, args.bias, *_lora_parts(args.lora)[:2])))


# A repeated eager call without LoRA skips the checks and the tier choice (moekit._calls): signature -> (tier, the
# Triton launch made ready to repeat or None). Tests that change a constant the launch shape follows forget both
# (CheckedCalls.forget_all) with triton_backend's cache of shapes.
_CHECKED_GEMMS = CheckedCalls()


def _lora_memory(lora: RouterLoRA | None) -> dict:
    """The adapter's tensors, which the Triton finisher reads after other programs stored logits."""
    return {} if lora is None else {"lora.a": lora.a, "lora.b": lora.b}


def _lora_parts(lora: RouterLoRA | None):
    return (None, None, 0.0) if lora is None else (lora.a, lora.b, float(lora.scale))


# The launches are opaque ops for torch.compile: the tier decision and launch code (device names,
# packaged tables) run at call time, never traced; fake kernels give the shapes.
@torch.library.custom_op("moekit::router_gemm_into", mutates_args=("out",))
def _router_gemm_op(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    lora_a: torch.Tensor | None, lora_b: torch.Tensor | None, lora_scale: float, tier: str) -> None:
    check_written_memory("out", out, {"x": x, "weight": weight, "bias": bias, "lora.a": lora_a, "lora.b": lora_b})
    lora = None if lora_a is None else RouterLoRA(lora_a, lora_b, lora_scale)
    _gemm(_GemmArgs(x, weight, bias, lora), out, tier)


@_router_gemm_op.register_fake
def _(out, x, weight, bias, lora_a, lora_b, lora_scale, tier) -> None:
    return None


def _gemm(args: _GemmArgs, out2: torch.Tensor, tier: str = "auto", prepare: bool = False) -> tuple:
    """Logits of validated arguments into ``out2`` [T, E], by the tier the decision picks. Returns (that tier, and
    with ``prepare`` its Triton launch made ready to repeat, else None)."""
    num_experts, hidden = args.weight.shape
    choice = router_tiers.choose_tier(args.x.shape[0], hidden, num_experts, args.weight.device, tier)
    run = choice.tier
    if tier == "auto" and run == "triton" and args.x.shape[0] > 0:
        if gate_case.gemm_refusal(args.x.shape[0], args.weight, args.bias, args.lora, out2.dtype, router_gemm):
            # batch-invariant mode: the torch tier's fixed-shape matmuls (cuBLAS picks its kernel by T, and the
            # gate's verdict is kept per token-count class: one class could run Triton, another cuBLAS)
            run = "cublas" if args.weight.is_cuda and not _invariant.enabled() else "torch"
    prepared = _RUNNERS[run](args, out2, prepare) if args.x.shape[0] > 0 else None
    return run, prepared


def _gemm_decided(decided: tuple, x2, weight, bias, out2) -> None:
    """Logits into ``out2`` for a call of a signature :func:`_gemm` decided before ((tier, prepared launch or
    None)): the prepared launch where its binding holds, else the tier's runner. ``bias``: contiguous or None."""
    run, prepared = decided
    if prepared is None or not prepared(x2, weight, bias, out2=out2):
        _RUNNERS[run](_GemmArgs(x2, weight, bias, None), out2)


def _run_torch(args: _GemmArgs, out2: torch.Tensor, prepare: bool = False) -> None:
    # Batch-invariant mode: matmuls of a fixed row count (a CPU BLAS changes a row's order of terms with the call's
    # shape).
    mm = _invariant.matmul
    x32 = args.x.float()
    logits = mm(x32, args.weight.float().T)
    if args.bias is not None:
        logits += args.bias.float()
    if args.lora is not None:
        logits += args.lora.scale * mm(mm(x32, args.lora.a.float().T), args.lora.b.float().T)
    out2.copy_(logits)


def _run_cublas(args: _GemmArgs, out2: torch.Tensor, prepare: bool = False) -> None:
    # bf16/fp16 inputs with an fp32 result straight from cuBLAS (fp32 accumulation, no copy).
    wt = args.weight.T
    kwargs = {"out_dtype": out2.dtype} if out2.dtype != args.x.dtype else {}
    if args.bias is not None:
        torch.addmm(args.bias.to(out2.dtype), args.x, wt, out=out2, **kwargs)
    else:
        torch.mm(args.x, wt, out=out2, **kwargs)
    if args.lora is not None:
        xa = torch.mm(args.x, args.lora.a.T, out_dtype=torch.float32) if args.x.dtype != torch.float32 \
            else torch.mm(args.x, args.lora.a.T)
        out2.addmm_(xa.to(out2.dtype), args.lora.b.to(out2.dtype).T, alpha=args.lora.scale)


def _run_triton(args: _GemmArgs, out2: torch.Tensor, prepare: bool = False):
    from . import triton_backend  # the kernels are built on first use (TRITON_INTERPRET is read then)

    return triton_backend.launch_router(args.x, args.weight, args.bias, args.lora, out2=out2, prepare=prepare)


_RUNNERS = {"torch": _run_torch, "cublas": _run_cublas, "triton": _run_triton}


def fused_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    top_k: int,
    method: str,
    lora: RouterLoRA | None = None,
    impl: str = "auto",
    replay_ids: torch.Tensor | None = None,
    record_ids: torch.Tensor | None = None,
    **routing_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router GEMM + bias + top-k routing; one Triton launch at decode sizes.

    Args:
        x: [T, H] (or [..., H]) in the weight's dtype, any strides.
        weight: [E, H]; bias: [E] (added in fp32).
        top_k, method, routing_kwargs: as :func:`moekit.route` (``renormalize``,
            ``correction_bias``, ``num_groups``, ``topk_groups``, ``scaling``).
        lora: optional :class:`RouterLoRA`.
        impl: ``"auto"`` (on CUDA the fused kernel up to the measured crossover of
            :func:`moekit.routing.tiers.fused_limit`, else router_gemm + route), ``"fused"`` (the
            one-launch kernel, T <= 128; CUDA or TRITON_INTERPRET=1) or ``"unfused"``.
        replay_ids, record_ids: routing replay and recording, as :func:`moekit.route` (a replay computes
            the fp32 logits with :func:`router_gemm` and the weights of the given ids from them).

    Returns:
        (topk_weights float32 [T, k], topk_ids int32 [T, k]) with T = x.numel() // H.
    """
    key = None
    if lora is None and replay_ids is None and record_ids is None:
        corr = routing_kwargs.get("correction_bias")
        key = CheckedCalls.signature((x, weight, bias, corr), (top_k, method, impl, *[
            part for k, v in routing_kwargs.items() if k != "correction_bias" for part in (k, v)]))
        decided = _CHECKED_ROUTERS.get(key)
        if decided is not None:  # checked and decided before (see router_gemm)
            opts, fused, prepared = decided
            x2 = x if x.dim() == 2 else x.reshape(-1, weight.shape[1])
            b, c = None if bias is None else bias.contiguous(), None if corr is None else corr.contiguous()
            routes = None
            if not fused:  # router_gemm + route as decided: logits, then their routes
                gemm, route = prepared
                logits = torch.empty(x2.shape[0], weight.shape[0], dtype=torch.float32, device=weight.device)
                if x2.shape[0]:
                    _gemm_decided(gemm, x2, weight, b, logits)
                routes = route_decided(logits, c, route)
            elif prepared is not None:
                routes = empty_routes(x2.shape[0], top_k, weight.device)
                if not prepared(x2, weight, b, corr_bias=c, topk_weights=routes[0], topk_ids=routes[1]):
                    routes = None
            if routes is None:
                routes = _fused_router_run(_GemmArgs(x2, weight, b, None), opts, c, fused)[0]
            return warned_if_detached("fused_router", _NO_GRAD_ADVICE, routes, x, weight, bias)
    args = _validate_gemm(x, weight, bias, lora)
    num_tokens = args.x.shape[0]
    opts = validate_routing(weight.shape[0], weight.device, top_k, method, **routing_kwargs)
    if impl not in ("auto", "fused", "unfused"):
        raise ValueError(f"impl must be 'auto', 'fused' or 'unfused', got {impl!r}")
    if impl == "fused" and not _triton.can_launch(weight.device):
        raise ValueError(f"impl='fused' needs a CUDA device or TRITON_INTERPRET=1, got {weight.device}")
    if impl == "fused" and num_tokens > router_tiers.FUSED_MAX_TOKENS:
        raise ValueError(f"impl='fused' serves at most {router_tiers.FUSED_MAX_TOKENS} tokens, got T={num_tokens}")
    check_replay(replay_ids, record_ids, num_tokens, top_k, weight.device,
                 {"x": x, "weight": weight, "bias": bias, "correction_bias": routing_kwargs.get("correction_bias")})
    if replay_ids is not None:
        logits = router_gemm(args.x, weight, bias, lora=lora)
        return record(replay(logits, replay_ids, opts), record_ids)
    corr_bias = routing_kwargs.get("correction_bias")
    corr_bias = None if corr_bias is None else corr_bias.contiguous()
    if torch.compiler.is_compiling():
        if _gradients_traced(args, "auto"):  # router_gemm then route, traced
            routes = route_with(router_gemm(args.x, weight, bias, lora=lora), opts, corr_bias)
        else:
            routes = torch.ops.moekit.fused_router(args.x, weight, args.bias, corr_bias, *_lora_parts(lora),
                                                   opts.top_k, opts.method, opts.renormalize, opts.num_groups,
                                                   opts.topk_groups, opts.scaling, impl)
    else:  # eager: straight to the implementation (the op is for torch.compile)
        fused = _fused_router_choice(args, opts, corr_bias, impl)
        routes, prepared = _fused_router_run(args, opts, corr_bias, fused, prepare=key is not None)
        _CHECKED_ROUTERS.put(key, (opts, fused, prepared))
    return warned_if_detached("fused_router", _NO_GRAD_ADVICE, record(routes, record_ids), x, weight, bias,
                              *_lora_parts(lora)[:2])  # (the correction bias only selects: no gradient reaches it)


_NO_GRAD_ADVICE = "router_gemm(tier='torch') then route(impl='torch')"

# fused_router: signature -> (routing options, whether the fused kernel serves, its launch made ready to repeat; or
# where it does not serve, router_gemm's decision (_gemm) and route's (topk.route_deciding))
_CHECKED_ROUTERS = CheckedCalls()


@torch.library.custom_op("moekit::fused_router", mutates_args=())
def _fused_router_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     corr_bias: torch.Tensor | None, lora_a: torch.Tensor | None, lora_b: torch.Tensor | None,
                     lora_scale: float, top_k: int, method: str, renormalize: bool, num_groups: int,
                     topk_groups: int, scaling: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    args = _GemmArgs(x, weight, bias, None if lora_a is None else RouterLoRA(lora_a, lora_b, lora_scale))
    opts = RoutingOptions(top_k, method, renormalize, num_groups, topk_groups, scaling)
    return _fused_router_impl(args, opts, corr_bias, impl)


def _fused_router_impl(args: _GemmArgs, opts: RoutingOptions, corr_bias, impl: str):
    return _fused_router_run(args, opts, corr_bias, _fused_router_choice(args, opts, corr_bias, impl))[0]


def _fused_router_choice(args: _GemmArgs, opts: RoutingOptions, corr_bias, impl: str) -> bool:
    """Whether the one-launch fused kernel serves the call (else router_gemm + route)."""
    weight, num_tokens = args.weight, args.x.shape[0]
    if corr_bias is not None and corr_bias.dtype == torch.float64:
        # the fused kernel selects in float32: a float64 correction bias routes as route() does, in float64
        if impl == "fused":
            raise TypeError("impl='fused' selects experts in float32: a float64 correction_bias would be rounded "
                            "(impl='auto' or 'unfused' routes in float64)")
        return False
    fused = impl == "fused" or (impl == "auto" and router_tiers.fused_applies(
        num_tokens, weight.device, weight.shape[1], weight.shape[0]))
    if fused and impl == "auto" and _invariant.enabled():
        fused = router_tiers.invariant_fused_serves(opts.method, opts.renormalize, args.lora is not None)
    if fused and impl == "auto" and num_tokens:
        fused = gate_case.fused_refusal(num_tokens, weight, args.bias, corr_bias, args.lora, opts, fused_router) is None
    return fused


def _fused_router_run(args: _GemmArgs, opts: RoutingOptions, corr_bias, fused: bool, prepare: bool = False):
    """((topk_weights, topk_ids), with ``prepare`` the fused launch made ready to repeat or None; or where the fused
    kernel does not serve, (router_gemm's decision, route's decision))."""
    weight, top_k = args.weight, opts.top_k
    num_tokens = args.x.shape[0]
    if not fused:
        logits = torch.empty(num_tokens, weight.shape[0], dtype=torch.float32, device=weight.device)
        gemm = _gemm(args, logits, prepare=prepare)
        routes, route = route_deciding(logits, opts, corr_bias, prepare=prepare)
        return routes, (gemm, route)
    topk_weights, topk_ids = empty_routes(num_tokens, top_k, weight.device)
    prepared = None
    if num_tokens:
        from . import triton_backend

        prepared = triton_backend.launch_router(args.x, args.weight, args.bias, args.lora, routing=opts,
                                                corr_bias=corr_bias, topk_weights=topk_weights, topk_ids=topk_ids,
                                                prepare=prepare)
    return (topk_weights, topk_ids), prepared


@_fused_router_op.register_fake
def _(x, weight, bias, corr_bias, lora_a, lora_b, lora_scale, top_k, method, renormalize, num_groups, topk_groups,
      scaling, impl):
    return empty_routes(x.shape[0], top_k, x.device)


def keep_dtypes_through(module: nn.Module, names, apply) -> None:
    """Run ``apply`` (the module's ``nn.Module._apply``: ``.to()``, ``.half()``, ``.cuda()``) with the parameters
    and buffers ``names`` keeping their dtypes: a cast of the module only moves them to its device. Kept so: fp32
    biases (a router bias of 0.1001 would become 0.10009765625 in bf16, and near-tied correction biases pick other
    experts) and quantized stacks (a cast would destroy FP8 codes and block scales)."""
    saved = {n: t.data for n in names
             if (t := module._parameters.get(n, module._buffers.get(n))) is not None}
    apply()
    for n, before in saved.items():
        if (p := module._parameters.get(n)) is not None:
            if p.dtype != before.dtype:
                p.data = before.to(p.device)
        elif (b := module._buffers.get(n)) is not None and b.dtype != before.dtype:
            module._buffers[n] = before.to(b.device)


class GateLinear(nn.Module):
    """The MoE router as a module: ``forward(x [..., H]) -> logits [..., E]`` in ``out_dtype``.

    fp32 accumulation, bias added in fp32, fp32 logits by default. ``weight`` is [E, H] in
    ``params_dtype``; ``bias`` is [E] fp32 (``None`` unless ``bias=True``; a bf16 checkpoint bias
    loads into it exactly). An optional LoRA adapter (:meth:`set_lora`) is applied in every tier.
    """

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False,
                 params_dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        sizes = []
        for name, n in (("hidden_size", hidden_size), ("num_experts", num_experts)):
            try:  # ints of numpy and 0-d integer tensors too (sizes read from checkpoint metadata)
                sizes.append(operator.index(n) if not isinstance(n, bool) else None)
            except TypeError:
                sizes.append(None)
            if sizes[-1] is None:
                raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        hidden_size, num_experts = sizes
        if hidden_size < 1 or num_experts < 1:
            raise ValueError(f"hidden_size and num_experts must be >= 1, got {hidden_size}, {num_experts}")
        if params_dtype not in INPUT_DTYPES:
            raise TypeError(f"params_dtype must be one of {INPUT_DTYPES}, got {params_dtype}")
        if out_dtype not in OUT_DTYPES:
            raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
        self.hidden_size, self.num_experts, self.out_dtype = hidden_size, num_experts, out_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=params_dtype, device=device))
        # The bias is kept in fp32: it is added in fp32, and a stored copy costs no conversion per call.
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32, device=device)) if bias else None
        self._lora_cache = None  # (the buffers, the scale's version, their RouterLoRA)
        self.tier = "auto"
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.hidden_size ** -0.5)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _apply(self, fn, recurse=True):
        """``.to()`` and the like: the weight and the adapter's ``a`` follow ``fn`` (``a`` keeps the weight's dtype),
        the fp32 bias, the adapter's fp32 ``b`` and scale only move (:func:`keep_dtypes_through`)."""
        keep_dtypes_through(self, ("bias", "lora_b", "lora_scale"), lambda: super(GateLinear, self)._apply(fn, recurse))
        return self

    def set_lora(self, a: torch.Tensor | None, b: torch.Tensor | None = None, scale: float = 1.0) -> None:
        """Attach (or with ``a=None`` remove) a LoRA adapter: logits += scale * (x a^T) b^T, with
        a [r, H] in the weight's dtype and b [E, r] (checked now, against this module's H and E). They become
        buffers (``lora_a``, ``lora_b`` fp32, ``lora_scale`` fp32 []), so that ``state_dict()``, ``.to()`` and
        copies carry them (a module loading such a state dict takes an adapter of the same rank first)."""
        for name in ("lora_a", "lora_b", "lora_scale"):
            self._buffers.pop(name, None)
        self._lora_cache = None
        if a is None:
            return
        check_tensor("b", b)
        lora = RouterLoRA(a, b.float(), float(scale) if isinstance(scale, (int, float, torch.Tensor)) else scale)
        _validate_gemm(self.weight.new_empty(0, self.hidden_size), self.weight, None, lora)
        self.register_buffer("lora_a", lora.a)
        self.register_buffer("lora_b", lora.b)
        with torch.inference_mode(False):  # a tensor with a version counter, even in a module built under inference_mode
            self.register_buffer("lora_scale", torch.tensor(lora.scale, dtype=torch.float32, device=lora.b.device))

    @property
    def lora(self) -> RouterLoRA | None:
        """The adapter of :meth:`set_lora` (its buffers as they are now), or None. Write ``lora_scale`` with torch's
        in-place ops (``fill_``/``copy_`` under ``no_grad``) or ``load_state_dict``: a write through ``.data`` bumps
        no version counter, and one in place (``.data.fill_``) is not seen."""
        buffers = self._buffers
        a = buffers.get("lora_a")
        if a is None:
            return None
        b, scale = buffers["lora_b"], buffers["lora_scale"]
        if tensor_version(scale) is None:
            # An inference tensor (.to() or a load under inference_mode) keeps no version, so every call would read
            # it again (a sync; it fails CUDA-graph capture): swap in a device copy that keeps one.
            with torch.inference_mode(False):
                scale = buffers["lora_scale"] = scale.clone()
        version = (tensor_version(scale), scale.data_ptr())  # (a new .data has a new address)
        cached = self._lora_cache
        if cached is None or cached[0] is not a or cached[1] is not b or cached[2] is not scale or cached[3] != version:
            # the scale as a float once per value (on a GPU, reading it is a sync)
            cached = self._lora_cache = (a, b, scale, version, RouterLoRA(a, b, float(scale)))
        return cached[4]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # the dict, not nn.Module.__getattr__ (about a microsecond a name, per call)
        return router_gemm(x, params["weight"], params.get("bias"), out_dtype=self.out_dtype, lora=self.lora,
                           tier=self.tier)

    def explain(self, num_tokens: int) -> str:
        """Which tier serves ``num_tokens`` tokens on this module's device (and its ``tier``), and why."""
        return router_tiers.explain(num_tokens, self.hidden_size, self.num_experts, self.weight.device, self.tier)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, "
                f"bias={self.bias is not None}, out_dtype={self.out_dtype}, lora={self.lora is not None}")
