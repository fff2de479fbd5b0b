"""The router's case for the verification gate (:mod:`moekit.gate`): the router's fast paths: the
small-batch Triton router GEMM, the one-launch fused router and the Triton routing kernel. Each
is checked once per shape class against the float64 reference before it serves an automatic
call; one that fails is disabled for the process and the call goes to cuBLAS (plain torch off
CUDA), the unfused router, or torch routing.

A shape class is what selects kernel code: H, E, dtypes (bias, correction bias, adapter), LoRA rank, the routing
options, the device, and the router kernel's launch config for the call's token count (tiers.kernel_config: the
token tile, K step and splits, the finishing step); the check runs the call's own token count (and one fewer where
that leaves a partial token tile in the same config) on fresh random data with a strided, offset input and a
NaN-poisoned ``out``.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _invariant, _triton, gate, reference
from ..metrics import LOGITS_TOL, WEIGHT_TOL, CheckResult, Tolerance, score_routes, score_values, separable_tokens
from . import tiers as router_tiers


def _kernel_case(num_tokens: int, weight, rank: int, fuse: bool) -> tuple:
    """(the router kernel's launch config for this call, the token counts its check runs): the call's own count (a
    router check is cheap at any T: [T, H] x [H, E]), and one token fewer where that count fills its last token
    tile and one fewer keeps the config (a partial tile). The config, not T, keys the verdict: every call that
    compiles and launches the same kernel shares it."""
    E, H = weight.shape
    num_sms, ieee = _triton.num_sms(weight.device), weight.dtype == torch.float32

    def config_of(n):  # (as routing/triton_backend.py _router_plan)
        return router_tiers.kernel_config(n, H, E, rank, fuse, num_sms, ieee)

    config = config_of(num_tokens)
    sizes = (num_tokens,)
    if num_tokens > 1 and num_tokens % config.block_t == 0 and config_of(num_tokens - 1) == config:
        sizes = (num_tokens, num_tokens - 1)
    return config, sizes


def _dtype_of(t):
    """A key's entry for an optional tensor: its dtype (kernels specialize on it), or None."""
    return None if t is None else t.dtype


def _rand(gen, *shape, device, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _inputs(gen, num_tokens, weight, bias, lora):
    """Random stand-ins shaped like the call's: x strided and offset, bias and LoRA if it has them."""
    E, H = weight.shape
    dev, dt = weight.device, weight.dtype
    x = _rand(gen, num_tokens, H + 8, device=dev, dtype=dt)[:, 8:]
    w = _rand(gen, E, H, device=dev, dtype=dt, scale=H ** -0.5)
    b = None if bias is None else _rand(gen, E, device=dev, dtype=bias.dtype)
    lr = None if lora is None else dataclasses.replace(
        lora, a=_rand(gen, *lora.a.shape, device=dev, dtype=lora.a.dtype, scale=0.1),
        b=_rand(gen, *lora.b.shape, device=dev, dtype=lora.b.dtype, scale=0.1))
    return x, w, b, lr


def _logits64(x, w, b, lora):
    return reference.router_logits(x, w, b, *(() if lora is None else (lora.a, lora.b, lora.scale)))


def gemm_refusal(num_tokens: int, weight, bias, lora, out_dtype, router_gemm) -> str | None:
    """None when the Triton router GEMM may serve this auto call, else why not (``router_gemm``: the op,
    which the check calls with tier="triton")."""
    if not gate.active():
        return None
    E, H = weight.shape
    rank = 0 if lora is None else lora.a.shape[0]
    config, sizes = _kernel_case(num_tokens, weight, rank, False)
    invariant = _invariant.enabled()
    key = ("router_gemm:triton", H, E, weight.dtype, _dtype_of(bias), rank, lora is not None and lora.b.dtype,
           out_dtype, weight.device,
           *(("batch-invariant",) if invariant else ()), config)  # the mode adds the invariance check
    describe = f"router GEMM H={H} E={E} {weight.dtype}, T={num_tokens}, bias={bias is not None}, LoRA rank {rank}"

    def run():
        gen = torch.Generator().manual_seed(4321)
        for T in sizes:
            x, w, b, lr = _inputs(gen, T, weight, bias, lora)
            out = torch.full((T, E), float("nan"), dtype=out_dtype, device=weight.device)
            got = router_gemm(x, w, b, out_dtype=out_dtype, out=out, lora=lr, tier="triton")
            verdict = _values_verdict(got, _logits64(x, w, b, lr), got is out, out_dtype)
            if not verdict[0]:
                return verdict
        if not invariant:
            return verdict
        return _with_invariance(verdict, lambda t: router_gemm(t["x"], w, b, out_dtype=out_dtype, lora=lr,
                                                                tier="triton"),
                                lambda n: {"x": _rand(gen, n, H, device=weight.device, dtype=weight.dtype)})

    return gate.verdict(key, "triton router GEMM", describe, run)


INVARIANCE_SIZES = _invariant.SIZES  # the router's checks run at the call's real H and E: every size is cheap


def _with_invariance(verdict: tuple[bool, str], run, tokens) -> tuple[bool, str]:
    """``verdict`` with batch invariance (moekit._invariant.token_mismatch) of ``run`` on ``tokens(n)`` added."""
    mismatch = _invariant.token_mismatch(run, tokens(1), tokens(max(INVARIANCE_SIZES)), INVARIANCE_SIZES)
    if mismatch:
        return False, f"{verdict[1]}; not batch-invariant: {mismatch}"
    return verdict[0], f"{verdict[1]}; batch-invariant at T in {INVARIANCE_SIZES}"


def _values_verdict(got, ref, in_place: bool, out_dtype=torch.float32) -> tuple[bool, str]:
    """fp32 logits against float64 at LOGITS_TOL; logits rounded to a narrower ``out_dtype`` against the reference
    rounded alike, with one step of that dtype more (the fp32 sum and the float64 one may round to neighbours)."""
    tol = LOGITS_TOL
    if out_dtype != torch.float32:
        ref = ref.to(out_dtype).double()
        eps = torch.finfo(out_dtype).eps
        tol = Tolerance(LOGITS_TOL.max_rel + eps, LOGITS_TOL.rms_rel + eps / 4)
    r = score_values(CheckResult("router_gemm", "triton", "gate", got.shape[0]), got, ref, tol, in_place)
    detail = f"max_rel={r.max_rel:.2e} rms_rel={r.rms_rel:.2e} (budget {tol.max_rel:.0e}/{tol.rms_rel:.0e})"
    return r.ok, (r.detail + "; " if r.detail else "") + detail


def _routes_verdict(tw, tid, logits64, opts, corr) -> tuple[bool, str]:
    kwargs = dict(renormalize=opts.renormalize, correction_bias=corr, num_groups=opts.num_groups,
                  topk_groups=opts.topk_groups, scaling=opts.scaling)
    ref_w, ref_ids = reference.route(logits64, opts.top_k, opts.method, **kwargs)
    separable = separable_tokens(logits64, opts.top_k, opts.method, **kwargs)
    r = score_routes(CheckResult("route", "gate", "gate", tid.shape[0]), tw, tid, ref_w, ref_ids, separable,
                     logits64.shape[1])
    return r.ok, f"top-k agreement {r.agree:.3f} on separable tokens, max weight error {r.max_rel:.2e} " \
                 f"(budget {WEIGHT_TOL:.0e})"


def fused_refusal(num_tokens: int, weight, bias, corr_bias, lora, opts, fused_router) -> str | None:
    """None when the one-launch fused router may serve this auto call, else why not (``fused_router``: the op,
    which the check calls with impl="fused")."""
    if not gate.active():
        return None
    E, H = weight.shape
    rank = 0 if lora is None else lora.a.shape[0]
    config, sizes = _kernel_case(num_tokens, weight, rank, True)
    invariant = _invariant.enabled()
    key = ("fused_router:fused", H, E, weight.dtype, _dtype_of(bias), _dtype_of(corr_bias), rank,
           lora is not None and lora.b.dtype, opts, weight.device, *(("batch-invariant",) if invariant else ()),
           config)  # the mode adds the invariance check
    describe = f"fused router H={H} E={E} {weight.dtype} {opts.method} k={opts.top_k}, T={num_tokens}"

    def run():
        gen = torch.Generator().manual_seed(8765)
        corr = None if corr_bias is None else _rand(gen, E, device=weight.device, scale=0.1,
                                                    dtype=corr_bias.dtype).abs()
        for T in sizes:
            x, w, b, lr = _inputs(gen, T, weight, bias, lora)
            kwargs = dict(top_k=opts.top_k, method=opts.method, renormalize=opts.renormalize, correction_bias=corr,
                          num_groups=opts.num_groups, topk_groups=opts.topk_groups, scaling=opts.scaling, lora=lr)
            tw, tid = fused_router(x, w, b, impl="fused", **kwargs)
            verdict = _routes_verdict(tw, tid, _logits64(x, w, b, lr), opts, corr)
            if not verdict[0]:
                return verdict
        if not invariant:
            return verdict

        def mode_routes(t):  # the mode's choice by T, named (auto would ask this gate again): a token's bits
            n = t["x"].shape[0]  # must not change where the one-launch kernel hands over to two launches
            impl = "fused" if n <= router_tiers.INVARIANT_FUSED_MAX_TOKENS else "unfused"
            return fused_router(t["x"], w, b, impl=impl, **kwargs)

        return _with_invariance(verdict, mode_routes,
                                lambda n: {"x": _rand(gen, n, H, device=weight.device, dtype=weight.dtype)})

    return gate.verdict(key, "fused router", describe, run)


def _near_ties(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Near ties every rounding below fp32 breaks: the (k+1)-th logit of every other token moved to 2e-3 x
    max|logit| below its k-th (inside one bf16 step), of every fourth of the others 2e-4 x max below (inside one fp16
    step); both separable for the reference (a gap over 1e-4 of the max), so bf16- or fp16-rounded scores pick
    wrong."""
    if top_k >= logits.shape[1]:
        return logits
    lg = logits.clone()
    order = lg.argsort(dim=1, descending=True)
    for first, step, gap in ((0, 2, 2e-3), (1, 4, 2e-4)):
        rows = torch.arange(first, lg.shape[0], step, device=lg.device)
        kth = lg[rows, order[rows, top_k - 1]]
        lg[rows, order[rows, top_k]] = kth - gap * lg[rows].abs().amax(dim=1)
    return lg


def route_refusal(logits: torch.Tensor, corr_bias, opts, route_with) -> str | None:
    """None when the Triton routing kernel may serve this auto call, else why not (``route_with``: the op on
    validated arguments, which the check calls with impl="triton")."""
    if not gate.active():
        return None
    E = logits.shape[-1]
    invariant = _invariant.enabled()
    key = ("route:triton", E, logits.dtype, _dtype_of(corr_bias), opts, logits.device,
           *(("batch-invariant",) if invariant else ()))
    describe = f"routing E={E} {opts.method} k={opts.top_k}"

    def run():
        gen = torch.Generator().manual_seed(2468)
        lg = _near_ties(_rand(gen, 33, E, device=logits.device, dtype=logits.dtype), opts.top_k)
        corr = None if corr_bias is None else _rand(gen, E, device=logits.device, scale=0.1,
                                                    dtype=corr_bias.dtype).abs()
        tw, tid = route_with(lg, opts, corr, impl="triton")
        verdict = _routes_verdict(tw, tid, lg.to(torch.float64), opts, corr)
        if not verdict[0] or not invariant:
            return verdict
        return _with_invariance(verdict, lambda t: route_with(t["logits"], opts, corr, impl="triton"),
                                lambda n: {"logits": _rand(gen, n, E, device=logits.device, dtype=logits.dtype)})

    return gate.verdict(key, "triton routing", describe, run)
