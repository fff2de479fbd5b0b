"""Top-k routing: which experts each token goes to, and with what weight.

``route`` runs a Triton kernel on CUDA (one launch, any E up to 4096; it works in float32) and a float64 torch
path elsewhere and for float64 logits. Both follow the selection rules of :mod:`moekit.reference`.
"""

from __future__ import annotations

import math

import torch

from .. import _triton, reference
from .._calls import CheckedCalls
from .._checks import check_tensor, check_top_k, check_written_memory, int32_ids, warned_if_detached
from ..presets import ROUTING_METHODS
from . import gate_case
from .options import RoutingOptions, empty_routes

MAX_EXPERTS = 4096
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def validate_routing(
    num_experts: int,
    device: torch.device,
    top_k,
    method,
    *,
    renormalize=True,
    correction_bias=None,
    num_groups=1,
    topk_groups=1,
    scaling=1.0,
) -> RoutingOptions:
    """Check the routing arguments for E experts; returns the options as a frozen dataclass."""
    if method not in ROUTING_METHODS:
        raise ValueError(f"method must be one of {ROUTING_METHODS}, got {method!r}")
    if not (isinstance(renormalize, bool) or (isinstance(renormalize, torch.Tensor) and renormalize.dtype == torch.bool
                                              and renormalize.dim() == 0)):  # ("False" is truthy: it renormalized)
        raise TypeError(f"renormalize must be True or False, got {renormalize!r}")
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) scaling arrives as a SymFloat. NaN fails both.
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 <= scaling < math.inf:
        raise ValueError(f"scaling must be a finite number >= 0 (the routed scaling factor), got {scaling!r}")
    check_top_k(top_k, num_experts)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts must be <= {MAX_EXPERTS}, got {num_experts}")
    for name, value in (("num_groups", num_groups), ("topk_groups", topk_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if method == "sigmoid_grouped":
        if num_experts % num_groups:
            raise ValueError(f"num_groups must divide num_experts={num_experts}, got num_groups={num_groups}")
        if topk_groups > num_groups:
            raise ValueError(f"topk_groups must be <= num_groups={num_groups}, got {topk_groups}")
        if topk_groups * (num_experts // num_groups) < top_k:
            raise ValueError(
                f"top_k={top_k} exceeds the {topk_groups * (num_experts // num_groups)} experts "
                f"in the kept groups (topk_groups={topk_groups} x group size {num_experts // num_groups})"
            )
    elif correction_bias is not None or num_groups != 1 or topk_groups != 1 or scaling != 1.0:
        # (scaling was once accepted here and dropped: weights a routed scaling factor too small, unseen)
        raise ValueError(f"correction_bias, num_groups, topk_groups and scaling apply only to sigmoid_grouped, "
                         f"not {method}")
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, ndim=1, dtypes=FLOAT_DTYPES, device=device)
        if correction_bias.shape[0] != num_experts:
            raise ValueError(f"correction_bias must have shape ({num_experts},), got {tuple(correction_bias.shape)}")
    return RoutingOptions(top_k, method, bool(renormalize), num_groups, topk_groups, float(scaling))


def route(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    *,
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    scaling: float = 1.0,
    impl: str = "auto",
    replay_ids: torch.Tensor | None = None,
    record_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select ``top_k`` experts per token and their weights.

    Args:
        logits: [T, E] router logits, fp32 (recommended), bf16, fp16 or fp64; any strides.
        top_k: experts per token, 1 <= top_k <= E.
        method: ``softmax_topk`` | ``topk_softmax`` | ``sigmoid_grouped`` | ``sigmoid_top1``
            (definitions in :mod:`moekit.reference`).
        renormalize: rescale the k weights to sum to one (softmax_topk, sigmoid_grouped).
        correction_bias: [E] float, added to sigmoid scores for selection only (sigmoid_grouped).
        num_groups, topk_groups: group-limited selection (sigmoid_grouped).
        scaling: routed scaling factor applied to the final weights (sigmoid_grouped).
        impl: ``"auto"`` (Triton on CUDA, torch elsewhere and for float64 logits or correction bias),
            ``"triton"`` (float32 work: refuses float64) or ``"torch"``.
        replay_ids: int32/int64 [T, k]: routing replay (reinforcement learning replays the experts a
            rollout chose): these ids are returned (as int32) instead of a selection, with the weights
            ``method`` gives them from these logits (:func:`moekit.reference.route_weights`); an id
            outside [0, E) gets weight 0. Static shapes, no host sync.
        record_ids: int32/int64 [T, k], the caller's buffer: the chosen ids are copied into it
            (graph-safe: a captured call records on every replay).

    Returns:
        (topk_weights float32 [T, k], topk_ids int32 [T, k]), contiguous. Ids are always in [0, E)
        (replayed ids as given).
    """
    key = None
    if replay_ids is None and record_ids is None:
        key = CheckedCalls.signature((logits, correction_bias),
                                     (top_k, method, renormalize, num_groups, topk_groups, scaling, impl))
        decided = _CHECKED_ROUTES.get(key)
        if decided is not None:  # this signature's checks passed and its implementation was chosen (moekit._calls)
            # (the correction bias only selects: no gradient reaches it on any path)
            return warned_if_detached("route", "impl='torch'", route_decided(logits, correction_bias, decided), logits)
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    opts = validate_routing(
        logits.shape[1], logits.device, top_k, method, renormalize=renormalize,
        correction_bias=correction_bias, num_groups=num_groups, topk_groups=topk_groups, scaling=scaling,
    )
    check_replay(replay_ids, record_ids, logits.shape[0], top_k, logits.device,
                 {"logits": logits, "correction_bias": correction_bias})
    _check_impl(impl, logits.device, logits, correction_bias)
    if replay_ids is not None:
        return record(replay(logits, replay_ids, opts), record_ids)
    if key is None:  # routing replay, recording, or torch.compile tracing
        routes = record(_route_run(logits, opts, correction_bias, _route_choice(logits, opts, correction_bias, impl)),
                        record_ids)
    else:
        routes, decided = route_deciding(logits, opts, correction_bias, impl)
        _CHECKED_ROUTES.put(key, decided)
    return warned_if_detached("route", "impl='torch'", routes, logits)


# signature -> (routing options, whether the Triton kernel serves it, its launch made ready to repeat or None)
_CHECKED_ROUTES = CheckedCalls()


def route_deciding(logits, opts: RoutingOptions, correction_bias, impl: str = "auto", prepare: bool = True):
    """An eager call of validated arguments that decides its implementation: (routes, the decision), the decision for
    :func:`route_decided` to repeat on calls of the same checked signature (``prepare``: with the Triton launch made
    ready to repeat, for a caller that keeps the decision)."""
    use_triton = _route_choice(logits, opts, correction_bias, impl)
    prepared = None
    if use_triton and prepare and logits.shape[0]:  # the launch made ready to repeat
        from . import triton_backend

        routes, prepared = triton_backend.route_triton_prepared(
            logits, opts, None if correction_bias is None else correction_bias.contiguous())
    else:
        routes = _route_run(logits, opts, correction_bias, use_triton)
    return routes, (opts, use_triton, prepared)


def route_decided(logits, correction_bias, decided: tuple):
    """The routes of a call whose signature :func:`route_deciding` decided before (only addresses are new)."""
    opts, use_triton, prepared = decided
    if prepared is not None:
        routes = prepared(logits, None if correction_bias is None else correction_bias.contiguous())
        if routes is not None:
            return routes
    return _route_run(logits, opts, correction_bias, use_triton)


ID_DTYPES = (torch.int32, torch.int64)


def check_replay(replay_ids, record_ids, num_tokens: int, top_k: int, device, reads: dict | None = None) -> None:
    """Shapes, dtypes and devices of routing replay's and recording's tensors; ``record_ids`` shares no memory with
    the replayed ids or the call's other inputs ``reads`` (name: tensor or None), which may be read after it is
    written (the layer's experts read x after its routing)."""
    for name, t in (("replay_ids", replay_ids), ("record_ids", record_ids)):
        if t is not None:
            check_tensor(name, t, ndim=2, dtypes=ID_DTYPES, device=device)
            if tuple(t.shape) != (num_tokens, top_k):
                raise ValueError(f"{name} must have shape ({num_tokens}, {top_k}) (tokens, top_k), got {tuple(t.shape)}")
    if record_ids is not None:  # (what is written: as an out= tensor)
        check_written_memory("record_ids", record_ids, {"replay_ids": replay_ids, **(reads or {})})


def replay(logits: torch.Tensor, ids: torch.Tensor, opts: RoutingOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids int32 [T, k]) for given ids: :func:`moekit.reference.route_weights` itself (as
    the torch routing path serves :func:`moekit.reference.route`): torch ops, static shapes, no host sync."""
    weights = reference.route_weights(logits, ids, opts.method, renormalize=opts.renormalize, scaling=opts.scaling)
    # ids past int32 (no expert, weight 0) returned as -1, not wrapped into valid ones
    return weights.to(torch.float32).contiguous(), int32_ids(ids).contiguous()


def record(routes: tuple[torch.Tensor, torch.Tensor], record_ids) -> tuple[torch.Tensor, torch.Tensor]:
    if record_ids is not None:
        record_ids.copy_(routes[1])
    return routes


def _check_impl(impl: str, device: torch.device, logits=None, correction_bias=None) -> None:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "triton" and not _triton.can_launch(device):
        raise ValueError(f"impl='triton' needs a CUDA tensor or TRITON_INTERPRET=1, got device {device}")
    if impl == "triton" and _float64(logits, correction_bias):
        raise TypeError("impl='triton' ranks and weighs in float32: float64 logits or correction_bias would be "
                        "rounded (another expert in a near tie, inf past float32's range); use impl='torch' or 'auto'")


def _float64(logits, correction_bias) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in (logits, correction_bias))


def _triton_serves_auto(logits: torch.Tensor, correction_bias=None) -> bool:
    # float64 routes on the torch path, in float64 as the reference does (the kernel works in float32)
    return logits.is_cuda and _triton.can_launch(logits.device) and not _float64(logits, correction_bias)


def route_with(logits, opts: RoutingOptions, correction_bias=None, *, impl: str = "auto"):
    """:func:`route` on already validated arguments (used by the router)."""
    _check_impl(impl, logits.device, logits, correction_bias)
    return _route_run(logits, opts, correction_bias, _route_choice(logits, opts, correction_bias, impl))


def _route_choice(logits, opts: RoutingOptions, correction_bias, impl: str) -> bool:
    """Whether the Triton routing kernel serves the call (else the torch path)."""
    use_triton = impl == "triton" or (impl == "auto" and _triton_serves_auto(logits, correction_bias))
    if use_triton and impl == "auto" and logits.shape[0]:
        use_triton = gate_case.route_refusal(logits, correction_bias, opts, route_with) is None
    return use_triton


def _route_run(logits, opts: RoutingOptions, correction_bias, use_triton: bool):
    if not use_triton:
        return _route_torch(logits, opts, correction_bias)
    corr = None if correction_bias is None else correction_bias.contiguous()
    if torch.compiler.is_compiling():
        return torch.ops.moekit.route_triton(logits, corr, opts.top_k, opts.method, opts.renormalize, opts.num_groups,
                                             opts.topk_groups, opts.scaling)
    from . import triton_backend  # eager: straight to the launch (the op is for torch.compile)

    return triton_backend.route_triton(logits, opts, corr)


# One opaque op for torch.compile (the launch's host logic is not traced), with a fake kernel.
@torch.library.custom_op("moekit::route_triton", mutates_args=())
def _route_op(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, method: str,
              renormalize: bool, num_groups: int, topk_groups: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    opts = RoutingOptions(top_k, method, renormalize, num_groups, topk_groups, scaling)
    from . import triton_backend  # the kernels are built on first use (TRITON_INTERPRET is read then)

    return triton_backend.route_triton(logits, opts, correction_bias)


@_route_op.register_fake
def _(logits, correction_bias, top_k, method, renormalize, num_groups, topk_groups, scaling):
    return empty_routes(logits.shape[0], top_k, logits.device)


def _route_torch(logits, opts: RoutingOptions, correction_bias):
    weights, ids = reference.route(
        logits, opts.top_k, opts.method, renormalize=opts.renormalize, correction_bias=correction_bias,
        num_groups=opts.num_groups, topk_groups=opts.topk_groups, scaling=opts.scaling,
    )
    # (contiguous as documented: on strided logits the reference's top-k keeps their layout)
    return (weights.to(torch.float32, memory_format=torch.contiguous_format),
            ids.to(torch.int32, memory_format=torch.contiguous_format))
