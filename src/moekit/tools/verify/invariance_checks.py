"""Batch-invariance checks of `moekit verify --batch-invariant` (and of tests and the GPU benchmark): with the mode on,
a token's outputs must have the same bits alone and in batches of other tokens, first, in the middle and last.

Each check draws one probe token and a pool of others, runs the op on the probe alone and inside batches of every
size, and compares bytes (:func:`moekit._invariant.token_mismatch`); a row of the report is ok only when every
batch reproduced the probe's bits. ``max_rel`` holds 0 or, on a mismatch, the largest relative difference seen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ... import _invariant, presets
from ...experts import batched_experts, fused_experts
from ...experts.gate_case import batched_mismatch
from ...formats import FOUR_BIT_FORMATS, from_parts, prepare, quantize_experts, to_parts
from ...layer import FusedMoE
from ...metrics import CheckResult
from ...routing import fused_router, route, router_gemm, tiers

BATCHED_MAX_ROWS = 129
"""Slab heights of the batched checks stop here: an [E, M, H] slab grows with E (kimi-k2 at M=16384 would be 90 GB),
and at M * E rows the configuration is already the prefill one."""
FORMATS = (("dense", None), ("mxfp4", None), ("nvfp4", None), ("fp8_block", "fp8_group"), ("mxfp4", "fp8_group"))
"""(weights, act_quant) of the experts checks: bf16/fp16, W4A16 MXFP4 and NVFP4, W8A8 FP8 blocks, W4A8 MXFP4."""


def format_tag(weights: str, act_quant: str | None) -> str:
    return weights + (f"+{act_quant}" if act_quant and weights != "fp8_block" else "")


def result(op: str, impl: str, preset: str, sizes: Sequence[int], mismatch: str | None) -> CheckResult:
    """A report row: ``tokens`` is the largest batch; ``detail`` says where bits differed."""
    return CheckResult(f"{op}[invariant]", impl, preset, max(sizes), 0.0, 0.0, 1.0, mismatch is None,
                       "" if mismatch is None else f"not batch-invariant: {mismatch}", max_budget=0.0)


def _checked(op, impl, preset, sizes, check: Callable[[], str | None]) -> CheckResult:
    try:
        return result(op, impl, preset, sizes, check())
    except Exception as exc:  # noqa: BLE001 - a raising op fails its row; the others still run
        return CheckResult(f"{op}[invariant]", impl, preset, max(sizes), float("inf"), float("inf"), 0.0, False,
                           f"raised {type(exc).__name__}: {exc}"[:300])


def router_checks(spec: presets.MoESpec, dtype, device, impls: dict[str, list[str]], sizes) -> list[CheckResult]:
    """router_gemm per tier, route per implementation and fused_router per impl of ``impls`` (verify's)."""
    H, E = spec.hidden_size, spec.num_experts
    w = (torch.randn(E, H, device=device) * H ** -0.5).to(dtype)
    b = torch.randn(E, device=device) if spec.router_bias else None
    kwargs = spec.routing_kwargs()
    if spec.correction_bias:
        kwargs["correction_bias"] = torch.rand(E, device=device) * 0.1

    def x_rows(n):
        return {"x": torch.randn(n, H, device=device).to(dtype)}

    def logit_rows(n):
        return {"logits": torch.randn(n, E, device=device)}

    rows = []
    for tier in impls.get("router_gemm", []):
        rows.append(_checked("router_gemm", tier, spec.name, sizes, lambda tier=tier: _invariant.token_mismatch(
            lambda t: router_gemm(t["x"], w, b, tier=tier), x_rows(1), x_rows(max(sizes)), sizes)))
    for impl in impls.get("route", []):
        rows.append(_checked("route", impl, spec.name, sizes, lambda impl=impl: _invariant.token_mismatch(
            lambda t: route(t["logits"], spec.top_k, spec.routing, impl=impl, **kwargs), logit_rows(1),
            logit_rows(max(sizes)), sizes)))
    for impl in impls.get("fused_router", []):
        own = sizes
        if impl == "fused":  # the one-launch kernel itself (auto takes it on a GPU only), in the batches it serves
            if not tiers.invariant_fused_serves(spec.routing, spec.renormalize, False):
                continue  # the mode refuses it for this routing: auto runs two launches
            own = tuple(n for n in sizes if n <= tiers.FUSED_MAX_TOKENS)
        rows.append(_checked("fused_router", impl, spec.name, own, lambda impl=impl, own=own: _invariant.token_mismatch(
            lambda t: fused_router(t["x"], w, b, top_k=spec.top_k, method=spec.routing, impl=impl, **kwargs),
            x_rows(1), x_rows(max(own)), own)))
    return rows


QUANTIZE_EXPERTS = 16  # quantized stacks are drawn this many experts at a time


def _stack(E: int, N: int, K: int, dtype, device, weights: str):
    """A random expert stack [E, N, K] (values ~ K^-1/2) in ``weights``' format. A quantized one is drawn and
    quantized QUANTIZE_EXPERTS experts at a time: its 16-bit stack never exists whole (kimi-k2's w13 alone is 22.5 GB
    in bf16, and both 16-bit stacks beside their quantized copies did not fit an 80 GB GPU)."""
    if weights == "dense":
        return torch.randn(E, N, K, device=device, dtype=dtype).mul_(K ** -0.5)
    pieces = [to_parts(quantize_experts(
        torch.randn(min(QUANTIZE_EXPERTS, E - e0), N, K, device=device, dtype=dtype).mul_(K ** -0.5), weights))
        for e0 in range(0, E, QUANTIZE_EXPERTS)]
    fmt, tag, shape = pieces[0][0], pieces[0][4], pieces[0][5]

    def joined(i):
        return None if pieces[0][i] is None else torch.cat([p[i] for p in pieces])

    return from_parts(fmt, joined(1), joined(2), joined(3), tag, [E, *shape[1:]])


def _weights(spec, dtype, device, weights: str):
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    w13, w2 = _stack(E, 2 * I, H, dtype, device, weights), _stack(E, H, I, dtype, device, weights)
    b13, b2 = ((torch.randn(E, 2 * I, device=device) * 0.05, torch.randn(E, H, device=device) * 0.05)
               if spec.expert_bias else (None, None))
    return w13, w2, b13, b2


def experts_checks(spec: presets.MoESpec, dtype, device, backend: str, sizes,
                   formats=FORMATS) -> list[CheckResult]:
    """fused_experts and batched_experts (against itself and the standard format) on ``backend`` in each of
    ``formats``, 4-bit stacks in both byte layouts."""
    E, H, k = spec.num_experts, spec.hidden_size, spec.top_k
    rows = []
    for weights, act_quant in formats:
        q13, q2, b13, b2 = _weights(spec, dtype, device, weights)
        common = dict(activation=spec.activation, w13_bias=b13, w2_bias=b2, backend=backend, act_quant=act_quant)
        # 4-bit stacks also as moekit keeps them once loaded (formats.prepare): their kernels decode otherwise
        for layout in ("packed", "pairs") if weights in FOUR_BIT_FORMATS else ("packed",):
            w13, w2 = (q13, q2) if layout == "packed" else (prepare(q13), prepare(q2))
            tag = format_tag(weights, act_quant) + ("" if layout == "packed" else f",{layout}")
            rows += _format_checks(E, H, k, dtype, device, backend, sizes, spec.name, tag, w13, w2, common)
        q13 = q2 = w13 = w2 = None  # (kimi-k2's stacks in both layouts: 17 GB the next format's draw needs)
    return rows


def _format_checks(E, H, k, dtype, device, backend, sizes, preset, tag, w13, w2, common) -> list[CheckResult]:
    """fused_experts against itself in every batch, and batched_experts against fused_experts, on one stack pair."""
    rows = []

    def tokens(n):
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(n)]).to(device, torch.int32)
        return {"x": torch.randn(n, H, device=device).to(dtype), "tw": torch.rand(n, k, device=device), "ids": ids}

    def fused(x, tw, ids):
        return fused_experts(x, w13, w2, tw, ids, **common)

    def batched(x, counts):
        return batched_experts(x, counts, w13, w2, **common)

    rows.append(_checked(f"fused_experts[{tag}]", backend, preset, sizes,
                         lambda: _invariant.token_mismatch(
                             lambda t: fused(t["x"], t["tw"], t["ids"]), tokens(1), tokens(max(sizes)), sizes)))
    heights = tuple(m for m in sizes if m <= BATCHED_MAX_ROWS)
    rows.append(_checked(f"batched_experts[{tag}]", backend, preset, heights,
                         lambda: batched_mismatch(batched, fused, E, H, dtype, device, None, heights)))
    return rows


def layer_checks(spec: presets.MoESpec, dtype, device, sizes) -> list[CheckResult]:
    """The whole FusedMoE (router, routing, experts and any shared expert), as auto serves it."""
    layer = FusedMoE(spec, dtype=dtype, device=device)

    def rows(n):
        return {"x": torch.randn(n, spec.hidden_size, device=device).to(dtype)}

    def run(t):
        with torch.no_grad():
            return layer(t["x"])

    return [_checked("FusedMoE", "auto", spec.name, sizes,
                     lambda: _invariant.token_mismatch(run, rows(1), rows(max(sizes)), sizes))]
