"""The in-library accuracy gate: with ``MOEKIT_VERIFY=1`` (or :func:`set_verification`), the first
time a backend would serve a new (op, shape class, dtype, format, device) it is checked against
the float64 reference on a small random case; a backend that fails is disabled for the process
with a warning naming it and the measured error, and the next candidate serves the call.

The check exercises what broke engines' kernels: biases, a strided input, a token count that
leaves a partial tile, an expert with no tokens, NaN padding rows (batched), and ``out`` poisoned
with NaN so that an unwritten or rebound output shows. The router's fast paths use the same
verdicts through :mod:`moekit.verify.router_gate`. A check cannot run inside a CUDA-graph capture:
the first call of each shape must be eager.
"""

from __future__ import annotations

import os
import warnings

import torch

from .. import backends, reference
from .metrics import Tolerance, rel_errors

TOL = {torch.float32: Tolerance(1e-4, 1e-5), torch.float16: Tolerance(2e-2, 5e-3), torch.bfloat16: Tolerance(2e-2, 5e-3)}
W8A8_TOL = Tolerance(3e-2, 3e-2)  # the W8A8 budget: fp32 sums of the same E4M3 products, rare rounding flips
_ENABLED: bool | None = None
_RESULTS: dict = {}


def set_verification(enabled: bool | None) -> None:
    """Turn the gate on or off for this process (None: follow MOEKIT_VERIFY again)."""
    global _ENABLED
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _ENABLED = enabled


def enabled() -> bool:
    if _ENABLED is not None:
        return _ENABLED
    return os.environ.get("MOEKIT_VERIFY", "0") not in ("", "0")


def reset() -> None:
    """Forget every verdict (the next call checks again)."""
    _RESULTS.clear()


def results() -> dict:
    """{(backend name, shape class): (passed, detail)} of this process."""
    return dict(_RESULTS)


def active() -> bool:
    """The gate checks calls now: enabled, and not while torch.compile traces."""
    return enabled() and not torch.compiler.is_compiling()


def verdict(key: tuple, name: str, describe: str, run_check) -> str | None:
    """None when the fast path ``key`` passed its check (run now, the first time), else why not.
    A failure warns once, naming ``name`` and the measured error; the verdict is kept for the process."""
    if key not in _RESULTS:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"moekit's verification gate has not checked {name} for {describe} yet and cannot "
                               "while a CUDA graph is being captured: run one eager call of this shape first")
        _RESULTS[key] = run_check()
        if not _RESULTS[key][0]:
            warnings.warn(f"moekit: backend {name!r} failed its accuracy check for {describe}: "
                          f"{_RESULTS[key][1]}; it is disabled for this process", RuntimeWarning, stacklevel=5)
    passed, detail = _RESULTS[key]
    return None if passed else f"failed the verification gate ({detail})"


def refusal(backend, call) -> str | None:
    """None when ``backend`` may serve ``call`` (gate off, or its check passed), else why not."""
    if not active():
        return None
    return verdict((backend.name, call.shape_class()), backend.name, _describe(call), lambda: check(backend, call))


def known_failure(backend, call) -> str | None:
    """The gate's refusal if this backend already failed for the call's shape class (no new check)."""
    result = _RESULTS.get((backend.name, call.shape_class()))
    return None if result is None or result[0] else f"failed the verification gate ({result[1]})"


def _describe(call) -> str:
    dtype = str(call.act_dtype).removeprefix("torch.")
    return f"{call.op} experts, {call.weight_format} weights, {dtype}, {call.activation}, {call.device}"


def _case(call, gen):
    """Small random weights and inputs in the call's format, plus their float reference weights."""
    from ..formats import dequantize, quantize_experts

    E, H, I, dev, dt = 6, 64, 32, call.device, call.act_dtype
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dev)  # noqa: E731
    w13, w2 = rnd(E, 2 * I, H) * H ** -0.5, rnd(E, H, I) * I ** -0.5
    if call.weight_format == "dense":
        w13, w2 = w13.to(dt), w2.to(dt)
        ref13, ref2 = w13, w2
    else:
        fmt = "fp8_block" if call.weight_format == "fp8" else call.weight_format
        w13, w2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
        ref13, ref2 = dequantize(w13), dequantize(w2)
    biases = (rnd(E, 2 * I).mul(0.1).to(dt), rnd(E, H).mul(0.1).to(dt))
    return E, H, w13, w2, ref13, ref2, biases


def check(backend, call) -> tuple[bool, str]:
    """(passed, detail) of ``backend`` on a small random case shaped like ``call``. FP8 W8A8 and
    MXFP4 W4A8 calls are checked against the W8A8 float64 reference (activations rounded to E4M3
    1x128 groups)."""
    w8a8 = call.act_quant == "fp8_group" and call.weight_format in backends.FP8_ACTIVATION_FORMATS
    if call.act_quant is not None and not w8a8:
        return True, "activation emulation: the torch reference is the definition"
    gen = torch.Generator().manual_seed(1234)
    dt, dev = call.act_dtype, call.device
    E, H, w13, w2, ref13, ref2, (b13, b2) = _case(call, gen)
    try:
        if call.op == "batched":
            M = 9
            x = torch.randn(E, M, H, generator=gen).to(dev, dt)
            counts = torch.tensor([9, 0, 3, 1, 8, 5], dtype=torch.int32, device=dev)   # full, empty, partial
            valid = torch.arange(M, device=dev)[None, :] < counts[:, None].long()
            x[~valid] = float("nan")                                                      # padding must not leak
            out = torch.full_like(x, float("nan"))
            backend.batched(out, x, counts, w13, w2, call.activation, b13, b2, None, call.act_quant)
            if w8a8:
                ref = torch.stack([_w8a8_one_expert(x[e], w13, w2, e, call.activation, b13, b2) for e in range(E)])
            else:
                ref = reference.batched_experts(x, counts, ref13, ref2, activation=call.activation, w13_bias=b13,
                                                w2_bias=b2)
            got, ref = out[valid], ref[valid]
        else:
            T, k = 9, 2                                                                   # a partial row block
            x = torch.randn(T, H + 3, generator=gen).to(dev, dt)[:, 3:]                    # row stride H + 3, offset
            first = torch.arange(T) % (E - 1)                                             # expert E-1 gets no token
            second = (first + 1 + torch.randint(0, E - 2, (T,), generator=gen)) % (E - 1)  # distinct from first
            ids = torch.stack([first, second], dim=1).to(dev, torch.int32)
            tw = torch.rand(T, k, generator=gen).to(dev)
            out = torch.full((T, H), float("nan"), dtype=dt, device=dev)
            backend.fused(out, x, w13, w2, tw, ids, call.activation, b13, b2, None, None, call.act_quant)
            got = out
            ref_fn = reference.fused_experts_w8a8 if w8a8 else reference.fused_experts
            ref = ref_fn(x, w13 if w8a8 else ref13, w2 if w8a8 else ref2, tw, ids, activation=call.activation,
                         w13_bias=b13, w2_bias=b2)
    except Exception as exc:  # noqa: BLE001 - a backend that raises fails its check
        return False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    max_rel, rms_rel = rel_errors(got, ref)
    tol = W8A8_TOL if w8a8 else TOL[dt]
    detail = f"max_rel={max_rel:.2e} rms_rel={rms_rel:.2e} (budget {tol.max_rel:.0e}/{tol.rms_rel:.0e})"
    return max_rel <= tol.max_rel and rms_rel <= tol.rms_rel, detail


def _w8a8_one_expert(rows, w13, w2, e, activation, b13, b2) -> torch.Tensor:
    """Expert ``e`` of FP8 stacks on every row (float64 W8A8): the batched format's reference."""
    n = rows.shape[0]
    ones = torch.ones(n, 1, device=rows.device)
    ids = torch.full((n, 1), e, dtype=torch.int32, device=rows.device)
    return reference.fused_experts_w8a8(rows, w13, w2, ones, ids, activation=activation, w13_bias=b13, w2_bias=b2)
