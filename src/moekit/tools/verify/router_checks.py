"""Router and routing checks of `moekit verify`: every implementation this machine can run,
on fresh random data, against the float64 reference."""

from __future__ import annotations

import torch

from ... import _triton, presets, reference
from ...metrics import LOGITS_TOL, CheckResult, score_routes, score_values, separable_tokens
from ...routing import tiers
from ...routing.router import fused_router, router_gemm
from ...routing.topk import route


def implementations(device: torch.device) -> dict[str, list[str]]:
    """What can serve each op here: the CPU has torch paths, plus kernels when Triton can run."""
    kernels = _triton.can_launch(device)
    gemm = ["torch"] + (["triton"] if kernels else []) + (["cublas"] if device.type == "cuda" else [])
    return {
        "route": ["torch"] + (["triton"] if kernels else []),
        "router_gemm": gemm,
        "fused_router": ["unfused"] + (["fused"] if kernels else []),
    }


def _inputs(spec: presets.MoESpec, num_tokens: int, dtype: torch.dtype, device: torch.device):
    H, E = spec.hidden_size, spec.num_experts
    # A strided, offset view: kernels must honour strides or copy, never misread.
    x = torch.randn(num_tokens, H + 8, dtype=dtype, device=device)[:, 8:]
    w = (torch.randn(E, H, device=device) * H ** -0.5).to(dtype)
    b = torch.randn(E, device=device) if spec.router_bias else None
    kwargs = spec.routing_kwargs()
    if spec.correction_bias:
        kwargs["correction_bias"] = torch.rand(E, device=device) * 0.1
    return x, w, b, kwargs


def check_router(spec: presets.MoESpec, num_tokens: int, dtype: torch.dtype, device: torch.device,
                 impls: dict[str, list[str]] | None = None) -> list[CheckResult]:
    impls = impls or implementations(device)
    x, w, b, kwargs = _inputs(spec, num_tokens, dtype, device)
    logits64 = reference.router_logits(x, w, b)
    ref_w, ref_ids = reference.route(logits64, spec.top_k, spec.routing, **kwargs)
    separable = separable_tokens(logits64, spec.top_k, spec.routing, **kwargs)
    results = []

    def row(op, impl, check):
        """check() -> its row; a raising implementation fails its own row, and the other ops still run."""
        try:
            results.append(check(CheckResult(op, impl, spec.name, num_tokens)))
        except Exception as exc:  # noqa: BLE001
            results.append(CheckResult(op, impl, spec.name, num_tokens, float("inf"), float("inf"), 0.0, False,
                                       f"raised {type(exc).__name__}: {exc}"[:300]))

    def gemm(r):
        out = torch.full((num_tokens, spec.num_experts), float("nan"), device=device)
        got = router_gemm(x, w, b, out=out, tier=r.impl)
        return score_values(r, got, logits64, LOGITS_TOL, got is out)

    for tier in impls["router_gemm"]:
        row("router_gemm", tier, gemm)
    # route() sees the fp32 logits a router produces; its reference routes those same values.
    logits32 = logits64.float()
    ref32_w, ref32_ids = reference.route(logits32, spec.top_k, spec.routing, **kwargs)
    for impl in impls["route"]:
        row("route", impl, lambda r: score_routes(r, *route(logits32, spec.top_k, spec.routing, impl=r.impl, **kwargs),
                                                  ref32_w, ref32_ids, separable, spec.num_experts))
    for impl in impls["fused_router"]:
        if impl == "fused" and num_tokens > tiers.FUSED_MAX_TOKENS:
            continue  # the one-launch kernel refuses these by design; auto serves them unfused
        row("fused_router", impl, lambda r: score_routes(
            r, *fused_router(x, w, b, top_k=spec.top_k, method=spec.routing, impl=r.impl, **kwargs),
            ref_w, ref_ids, separable, spec.num_experts))
    return results
