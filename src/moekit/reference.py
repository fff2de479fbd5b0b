"""Float64 references for every moekit op.

These are the definitions (docs/semantics.md) written as plainly as possible, in
float64, on whatever device the inputs live on. Every fast path is tested against them. They are
slow by design; never call them on a hot path.

Selection rules shared by all routing methods (the fast paths follow the same rules):
  * experts are ranked by their choice score, highest first; ties go to the lower expert id;
  * a NaN or -inf score ranks like the lowest finite float32 number (so ids are always valid,
    even for NaN/Inf logits, and such experts tie with each other, broken by the lower id);
  * weights follow IEEE arithmetic, so a row with non-finite logits may get NaN weights.
"""

from __future__ import annotations

import torch

from . import _invariant
from .formats import expert, fp8

F64 = torch.float64


# ----------------------------------------------------------------------------------- router
def router_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora_a: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    lora_scale: float = 1.0,
) -> torch.Tensor:
    """logits[..., E] = x @ weight^T + bias + lora_scale * (x @ lora_a^T) @ lora_b^T, in float64."""
    x64 = x.to(F64)
    logits = x64 @ weight.to(F64).T
    if bias is not None:
        logits = logits + bias.to(F64)
    if lora_a is not None:
        logits = logits + lora_scale * ((x64 @ lora_a.to(F64).T) @ lora_b.to(F64).T)
    return logits


# ---------------------------------------------------------------------------------- routing
FLT_LOWEST = torch.finfo(torch.float32).min


def selection_key(score: torch.Tensor) -> torch.Tensor:
    """The value a score is ranked by: NaN and -inf become the lowest finite float32."""
    return torch.nan_to_num(score.to(F64), nan=FLT_LOWEST).clamp(min=FLT_LOWEST)


def _rank(key: torch.Tensor, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Column order of each row: eligible first, then by key descending, then by lower index."""
    key = selection_key(key)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    if eligible is not None:
        rank_eligible = torch.gather((~eligible).to(torch.int8), -1, order)
        order = torch.gather(order, -1, torch.sort(rank_eligible, dim=-1, stable=True).indices)
    return order


def _softmax(v: torch.Tensor) -> torch.Tensor:
    # Written out (not torch.softmax) so the IEEE behaviour on inf/NaN is explicit.
    e = _invariant.elementwise(torch.exp, v - v.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference routing. Returns (weights float64 [T, k], ids int64 [T, k]).

    Methods (docs/semantics.md): softmax_topk, topk_softmax, sigmoid_grouped, sigmoid_top1.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [T, E] tensor, got {getattr(logits, 'shape', type(logits).__name__)}")
    l64 = logits.to(F64)
    num_tokens, num_experts = l64.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")
    if method in ("softmax_topk", "topk_softmax", "sigmoid_top1"):
        ids = _rank(l64)[:, :top_k]
    elif method == "sigmoid_grouped":
        s = _invariant.elementwise(torch.sigmoid, l64)
        choice = s if correction_bias is None else s + correction_bias.to(F64)
        choice = selection_key(choice)
        group_size = num_experts // num_groups
        grouped = choice.view(num_tokens, num_groups, group_size)
        top2 = torch.sort(grouped, dim=-1, descending=True).values[..., : min(2, group_size)]
        group_score = top2.sum(dim=-1)  # ranked through selection_key like any score
        kept_groups = _rank(group_score)[:, :topk_groups]
        kept = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=l64.device)
        kept.scatter_(1, kept_groups, True)
        kept = kept.repeat_interleave(group_size, dim=1)
        ids = _rank(choice, eligible=kept)[:, :top_k]
    else:
        raise ValueError(f"unknown routing method {method!r}")
    return route_weights(l64, ids, method, renormalize=renormalize, scaling=scaling), ids


def route_weights(logits: torch.Tensor, ids: torch.Tensor, method: str, *, renormalize: bool = True,
                  scaling: float = 1.0) -> torch.Tensor:
    """The weights ``method`` gives the experts ``ids`` [T, k] from ``logits`` [T, E], float64 [T, k]: the
    second half of :func:`route`, and the definition of routing replay (ids chosen elsewhere, weights
    from these logits). An id outside [0, E) gets weight 0 and takes no part in a renormalization."""
    l64 = logits.to(F64)
    valid = (ids >= 0) & (ids < l64.shape[1])
    safe = torch.where(valid, ids, 0).long()
    if method == "softmax_topk" and not renormalize:
        w = torch.gather(_softmax(l64), 1, safe)
    elif method in ("softmax_topk", "topk_softmax"):
        # softmax over all E then renormalized over the k chosen == softmax over the k chosen;
        # written this way a NaN logit of an unchosen expert does not poison the weights.
        w = _softmax(torch.gather(l64, 1, safe).masked_fill(~valid, -torch.inf))
    elif method == "sigmoid_top1":
        w = _invariant.elementwise(torch.sigmoid, torch.gather(l64, 1, safe))
    elif method == "sigmoid_grouped":
        w = torch.where(valid, torch.gather(_invariant.elementwise(torch.sigmoid, l64), 1, safe), 0.0)
        if renormalize:
            total = w.sum(dim=-1, keepdim=True)
            # every chosen sigmoid underflowed (logits below about -745 in float64): 0 / 0 has a limit, the ratios of
            # exp(logit), which the kernels give from -88 on (float32)
            tail = _softmax(torch.gather(l64, 1, safe).masked_fill(~valid, -torch.inf))
            w = torch.where(total == 0, tail, w / total)
        w = w * scaling
    else:
        raise ValueError(f"unknown routing method {method!r}")
    return torch.where(valid, w, 0.0)


def choice_scores(
    logits: torch.Tensor, method: str, correction_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-expert score each method ranks by (float64), used to measure near-ties."""
    l64 = logits.to(F64)
    if method == "sigmoid_grouped":
        s = torch.sigmoid(l64)
        return s if correction_bias is None else s + correction_bias.to(F64)
    return l64


# ------------------------------------------------------------------------------ activations
def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """h[..., 2I] with rows [gate; up] -> silu(gate) * up, float64."""
    h = h.to(F64)
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def swiglu_oai(h: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """gpt-oss activation. h[..., 2I] interleaved (gate j at 2j, up j at 2j+1), float64."""
    h = h.to(F64)
    gate = h[..., 0::2].clamp(max=limit)
    up = h[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1.0) * gate * torch.sigmoid(alpha * gate)


ACTIVATION_FNS = {"silu_and_mul": silu_and_mul, "swiglu_oai": swiglu_oai}


# ---------------------------------------------------------------------------------- experts
def expert_mlp(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert: w2 @ act(w13 @ x + b13) + b2 on rows of x [n, H]; float64 [n, H]."""
    h = x.to(F64) @ w13.to(F64).T
    if b13 is not None:
        h = h + b13.to(F64)
    y = ACTIVATION_FNS[activation](h) @ w2.to(F64).T
    if b2 is not None:
        y = y + b2.to(F64)
    return y


def _expert(e, rows, w13, w2, activation, w13_bias, w2_bias, lora=None, adapters=None, rounded=None) -> torch.Tensor:
    """Expert ``e`` of stacked [E, ...] weights (and optional stacked biases) on ``rows``; quantized
    stacks (moekit.formats) are dequantized one expert at a time. ``lora`` (see :func:`fused_experts`) adds
    each row's adapter terms (``adapters``: int [n], -1 none); ``rounded`` rounds both GEMM inputs first."""
    keep = rounded or (lambda t: t.to(F64))
    v = keep(rows)
    h = v @ expert(w13, e, F64).to(F64).T  # (float64 from the codes: MXFP4's two largest scales leave float32)
    if w13_bias is not None:
        h = h + w13_bias[e].to(F64)
    h = h + _lora_term(lora, "w13", e, v, adapters)
    a = keep(ACTIVATION_FNS[activation](h))
    y = a @ expert(w2, e, F64).to(F64).T + _lora_term(lora, "w2", e, a, adapters)
    return y if w2_bias is None else y + w2_bias[e].to(F64)


def _lora_term(lora, which: str, e: int, v: torch.Tensor, adapters) -> torch.Tensor | float:
    """scaling[a] * B[a, e] (A[a, e] v) for each row of v (float64) with adapter a in [0, adapters); 0 elsewhere."""
    if lora is None or getattr(lora, which + "_a") is None:
        return 0.0
    a_stack, b_stack = getattr(lora, which + "_a"), getattr(lora, which + "_b")
    out = torch.zeros(v.shape[0], b_stack.shape[2], dtype=F64, device=v.device)
    for i in range(a_stack.shape[0]):
        sel = adapters.long() == i
        if sel.any():
            out[sel] = float(lora.scaling[i]) * ((v[sel] @ a_stack[i, e].to(F64).T) @ b_stack[i, e].to(F64).T)
    return out


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu_and_mul",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    lora=None,
    lora_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard format: out[t] = sum_j w[t, j] * expert_{id[t, j]}(x[t]); float64 [T, H].

    ``expert_map`` maps global ids to local weight indices (-1: not here, contributes zero).

    ``lora`` (a :class:`moekit.experts.ExpertsLoRA`, or anything with its fields ``w13_a`` [n, E, r, H],
    ``w13_b`` [n, E, 2I, r], ``w2_a`` [n, E, r, I], ``w2_b`` [n, E, H, r], ``scaling`` [n]) with ``lora_ids``
    [T] (-1: no adapter): expert e on token t of adapter a computes
    ``h = W13_e x + b13_e + scaling[a] B13[a, e] A13[a, e] x`` and
    ``y = W2_e act(h) + b2_e + scaling[a] B2[a, e] A2[a, e] act(h)``.
    """
    _check_experts(x, 2, w13, w2, topk_weights, topk_ids)
    return _combine(x, w13.shape[0], w2.shape[1], topk_weights, topk_ids, expert_map,
                    lambda e, rows, tok: _expert(e, rows, w13, w2, activation, w13_bias, w2_bias, lora,
                                                 _adapters(lora_ids, tok)))


def _adapters(lora_ids, tok):
    return None if lora_ids is None else lora_ids[tok]


def _check_experts(x, ndim, w13, w2, topk_weights=None, topk_ids=None) -> None:
    """Shapes only, so that a wrong call is a clear error rather than a matmul's."""
    if not isinstance(x, torch.Tensor) or x.dim() != ndim:
        raise ValueError(f"x must be a {ndim}-dimensional tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(f"w13 and w2 must be expert stacks [E, 2I, H] and [E, H, I], got {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}")
    E, two_i, H = w13.shape
    if tuple(w2.shape) != (E, H, two_i // 2) or x.shape[-1] != H:
        raise ValueError(f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} and x {tuple(x.shape)} do not fit "
                         f"(expected w2 {(E, H, two_i // 2)} and x [..., {H}])")
    if topk_ids is not None and (topk_ids.dim() != 2 or tuple(topk_weights.shape) != tuple(topk_ids.shape)
                                 or topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"topk_weights and topk_ids must both be [T={x.shape[0]}, k], got {tuple(topk_weights.shape)} "
                         f"and {tuple(topk_ids.shape)}")


def _combine(x, num_experts, hidden, topk_weights, topk_ids, expert_map, expert_fn) -> torch.Tensor:
    out = torch.zeros(x.shape[0], hidden, dtype=F64, device=x.device)
    ids = topk_ids.long()
    if expert_map is not None:  # ids outside the map (-1 included: no wrap-around) contribute nothing
        inside = (ids >= 0) & (ids < expert_map.shape[0])
        ids = torch.where(inside, expert_map.long()[ids.clamp(0, expert_map.shape[0] - 1)], -1)
    for e in range(num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        out.index_add_(0, tok, expert_fn(e, x[tok], tok) * topk_weights[tok, slot].to(F64)[:, None])
    return out


def fused_experts_w8a8(
    x: torch.Tensor,
    w13,
    w2,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu_and_mul",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    lora=None,
    lora_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP8 W8A8 (DeepSeek-V3's scheme): :func:`fused_experts` in float64 on FP8Tensor weights,
    with both GEMM inputs of each expert rounded to E4M3 in 1x128 groups first (scales per row
    and group: formats.fp8.quantize_groups). Weights are dequantized one expert at a time, so a
    DeepSeek-V3 stack never exists in float. Any moekit weight works: MXFP4 stacks make it the
    W4A8 reference. ``lora``, ``lora_ids``: as :func:`fused_experts`, the adapters reading the same
    rounded inputs as the weights."""
    _check_experts(x, 2, w13, w2, topk_weights, topk_ids)
    def rounded(t):
        return fp8.dequantize(fp8.quantize_groups(t.float(), check_finite=False), torch.float32).to(F64)

    return _combine(x, w13.shape[0], w2.shape[1], topk_weights, topk_ids, expert_map,
                    lambda e, rows, tok: _expert(e, rows, w13, w2, activation, w13_bias, w2_bias, lora,
                                                 _adapters(lora_ids, tok), rounded))


def batched_experts(
    x: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "silu_and_mul",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    lora=None,
    lora_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched (masked) format: x [E, M, H]; valid rows [0, n_e) per expert; float64 [E, M, H].

    Padding rows of the reference output are zero (fast paths leave them undefined). ``lora`` as
    :func:`fused_experts`, with ``lora_ids`` [E, M] (each row's adapter, -1 none).
    """
    _check_experts(x, 3, w13, w2)
    num_experts, max_tokens, _ = x.shape
    if tuple(expert_num_tokens.shape) != (num_experts,):
        raise ValueError(f"expert_num_tokens must have shape ({num_experts},), got {tuple(expert_num_tokens.shape)}")
    out = torch.zeros(num_experts, max_tokens, w2.shape[1], dtype=F64, device=x.device)
    for e in range(num_experts):
        n = min(max(int(expert_num_tokens[e]), 0), max_tokens)  # a negative count is no rows, as the kernels read it
        if n:
            out[e, :n] = _expert(e, x[e, :n], w13, w2, activation, w13_bias, w2_bias, lora,
                                 None if lora_ids is None else lora_ids[e, :n])
    return out


# ------------------------------------------------------------------------------ whole layer
def moe_layer(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    spec,
    *,
    router_bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole MoE layer of a :class:`moekit.presets.MoESpec` in float64: router, routing,
    experts, plus the shared expert (``shared_w13 [2I_s, H]``, ``shared_w2 [H, I_s]``) if given."""
    logits = router_logits(x, router_weight, router_bias)
    weights, ids = route(
        logits, spec.top_k, spec.routing, correction_bias=correction_bias, **spec.routing_kwargs()
    )
    out = fused_experts(
        x, w13, w2, weights, ids, activation=spec.activation, w13_bias=w13_bias, w2_bias=w2_bias
    )
    if shared_w13 is not None:
        out = out + expert_mlp(x, shared_w13, shared_w2, "silu_and_mul")
    return out
