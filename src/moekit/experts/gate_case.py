"""The experts' case for the verification gate (:mod:`moekit.gate`): a backend is checked once per
shape class (op, weight format, dtype, activation, device) on a small random case against the
float64 reference before it serves an automatic call.

The case exercises what broke engines' kernels: biases, a strided input, a token count that leaves
a partial tile, an expert with no tokens, NaN padding rows (batched), and ``out`` poisoned with NaN
so that an unwritten or rebound output shows. A call with expert LoRA is its own shape class: its case adds
three adapters of rank 5 (both matrices), mixed over the tokens with some of none (-1).
"""

from __future__ import annotations

import torch

from .. import _invariant, gate, reference
from ..formats import FP8_ACTIVATION_FORMATS, dequantize, prepare, quantize_experts
from ..metrics import EXPERTS_TOL, W8A8_TOL, rel_errors
from .lora import ExpertsLoRA


def refusal(backend, call) -> str | None:
    """None when ``backend`` may serve ``call`` (gate off, or its check passed), else why not."""
    if not gate.active():
        return None
    return gate.verdict(_key(backend, call), backend.name, _describe(call), lambda: check(backend, call))


def known_failure(backend, call) -> str | None:
    """The gate's refusal if this backend already failed for the call's shape class (no new check)."""
    return gate.known_failure(_key(backend, call))


def _key(backend, call) -> tuple:
    # batch-invariant mode adds the invariance check: its verdicts are kept apart
    return (backend.name, (call.shape_class(), "batch-invariant") if _invariant.enabled() else call.shape_class())


def _describe(call) -> str:
    dtype = str(call.act_dtype).removeprefix("torch.")
    lora = ", LoRA" if call.lora else ""
    codes = "" if call.layout == "packed" else f" ({call.layout} codes)"
    return f"{call.op} experts, {call.weight_format} weights{codes}{lora}, {dtype}, {call.activation}, {call.device}"


def _lora_case(call, gen, E, H, I, rows):
    """(ExpertsLoRA of three rank-5 adapters on w13 and w2, int32 adapter ids of ``rows`` shape: each adapter and
    -1 appear), or (None, None) for a call without LoRA."""
    if not call.lora:
        return None, None
    n, r, dev, dt = 3, 5, call.device, call.act_dtype
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    lora = ExpertsLoRA((rnd(n, E, r, H) * H ** -0.5).to(dev, dt), (rnd(n, E, 2 * I, r) * 0.3).to(dev, dt),
                       (rnd(n, E, r, I) * I ** -0.5).to(dev, dt), (rnd(n, E, H, r) * 0.3).to(dev, dt), [0.5, 1.0, 2.0])
    ids = (torch.arange(rows[0] * (rows[1] if len(rows) > 1 else 1)) % (n + 1) - 1).reshape(rows)
    return lora, ids.to(dev, torch.int32)


def _case(call, gen):
    """Small random weights and inputs in the call's format, plus their float reference weights."""
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
        l13, l2 = (call.layout.split("/") * 2)[:2]  # the call's byte layouts of w13 and w2
        w13, w2 = (prepare(w13) if l13 == "pairs" else w13), (prepare(w2) if l2 == "pairs" else w2)
    biases = (rnd(E, 2 * I).mul(0.1).to(dt), rnd(E, H).mul(0.1).to(dt))
    return E, H, w13, w2, ref13, ref2, biases


def check(backend, call) -> tuple[bool, str]:
    """(passed, detail) of ``backend`` on a small random case shaped like ``call``. FP8 W8A8 and
    MXFP4 W4A8 calls are checked against the W8A8 float64 reference (activations rounded to E4M3
    1x128 groups)."""
    w8a8 = call.act_quant == "fp8_group" and call.weight_format in FP8_ACTIVATION_FORMATS
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
            lora, lora_ids = _lora_case(call, gen, E, H, w2.shape[2], (E, M))
            backend.batched(out, x, counts, w13, w2, call.activation, b13, b2, None, call.act_quant,
                            **_lora_args(lora, lora_ids))
            if w8a8:
                ref = torch.stack([_w8a8_one_expert(x[e], w13, w2, e, call.activation, b13, b2, lora,
                                                    None if lora is None else lora_ids[e]) for e in range(E)])
            else:
                ref = reference.batched_experts(x, counts, ref13, ref2, activation=call.activation, w13_bias=b13,
                                                w2_bias=b2, lora=lora, lora_ids=lora_ids)
            got, ref = out[valid], ref[valid]
        else:
            T, k = 9, 2                                                                   # a partial row block
            x = torch.randn(T, H + 3, generator=gen).to(dev, dt)[:, 3:]                    # row stride H + 3, offset
            first = torch.arange(T) % (E - 1)                                             # expert E-1 gets no token
            second = (first + 1 + torch.randint(0, E - 2, (T,), generator=gen)) % (E - 1)  # distinct from first
            ids = torch.stack([first, second], dim=1).to(dev, torch.int32)
            tw = torch.rand(T, k, generator=gen).to(dev)
            out = torch.full((T, H), float("nan"), dtype=dt, device=dev)
            lora, lora_ids = _lora_case(call, gen, E, H, w2.shape[2], (T,))
            backend.fused(out, x, w13, w2, tw, ids, call.activation, b13, b2, None, None, call.act_quant,
                          **_lora_args(lora, lora_ids))
            got = out
            ref_fn = reference.fused_experts_w8a8 if w8a8 else reference.fused_experts
            ref = ref_fn(x, w13 if w8a8 else ref13, w2 if w8a8 else ref2, tw, ids, activation=call.activation,
                         w13_bias=b13, w2_bias=b2, lora=lora, lora_ids=lora_ids)
    except Exception as exc:  # noqa: BLE001 - a backend that raises fails its check
        return False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    max_rel, rms_rel = rel_errors(got, ref)
    tol = W8A8_TOL if w8a8 else EXPERTS_TOL[dt]
    detail = f"max_rel={max_rel:.2e} rms_rel={rms_rel:.2e} (budget {tol.max_rel:.0e}/{tol.rms_rel:.0e})"
    accurate = max_rel <= tol.max_rel and rms_rel <= tol.rms_rel
    if not accurate or not _invariant.enabled():
        return accurate, detail
    try:
        mismatch = invariance(backend, call, w13, w2, b13, b2, gen, lora=lora)
    except Exception as exc:  # noqa: BLE001 - a backend that raises fails its check
        return False, f"invariance check raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if mismatch:
        return False, f"{detail}; not batch-invariant: {mismatch}"
    return True, f"{detail}; batch-invariant at T in {GATE_SIZES}"


GATE_SIZES = (1, 7, 64, 129)  # the check case's row blocks change height at 37 and 109 tokens (k=2 of 6 experts)


def invariance(backend, call, w13, w2, b13, b2, gen, sizes=GATE_SIZES, lora=None) -> str | None:
    """None when ``backend`` gives a token the same bits alone and among others (:mod:`moekit._invariant`), else
    where it did not: the standard format in batches of ``sizes`` at three positions; the batched format in slabs
    of those heights, and its rows against the standard format's (one slot of weight 1). With ``lora`` (the case's
    adapters) every token or row takes one of them, the probe the first."""
    E, H = w13.shape[0], w13.shape[2]
    dev, dt = call.device, call.act_dtype
    act, aq = call.activation, call.act_quant

    def adapters(n, probe=False):
        if lora is None:
            return None
        if probe:
            return torch.zeros(n, dtype=torch.int32, device=dev)
        return torch.randint(-1, lora.num_adapters, (n,), generator=gen).to(dev, torch.int32)

    def fused(x, tw, ids, lora_ids=None):
        out = torch.empty(x.shape, dtype=dt, device=dev)
        if lora_ids is None and lora is not None:  # the batched format's row as a token: its adapter, the first
            lora_ids = adapters(x.shape[0], probe=True)
        backend.fused(out, x, w13, w2, tw, ids, act, b13, b2, None, None, aq, **_lora_args(lora, lora_ids))
        return out

    def batched(x, counts):
        out = torch.zeros(x.shape, dtype=dt, device=dev)
        lora_ids = None
        if lora is not None:  # every row of expert E - 1 (the probe's) takes the first adapter, the others any
            lora_ids = adapters(x.shape[0] * x.shape[1]).reshape(x.shape[0], x.shape[1])
            lora_ids[E - 1] = 0
        backend.batched(out, x, counts, w13, w2, act, b13, b2, None, aq, **_lora_args(lora, lora_ids))
        return out

    if call.op == "fused":
        def tokens(n, probe=False):
            ids = torch.stack([torch.randperm(E - 1, generator=gen)[:2] for _ in range(n)]).to(dev, torch.int32)
            case = dict(x=torch.randn(n, H, generator=gen).to(dev, dt), tw=torch.rand(n, 2, generator=gen).to(dev),
                        ids=ids)
            if lora is not None:
                case["lora_ids"] = adapters(n, probe)
            return case

        return _invariant.token_mismatch(lambda b: fused(b["x"], b["tw"], b["ids"], b.get("lora_ids")),
                                         tokens(1, probe=True), tokens(max(sizes)), sizes)
    return batched_mismatch(batched, fused, E, H, dt, dev, gen, sizes)


def batched_mismatch(batched, fused, E: int, H: int, dtype, device, gen, sizes) -> str | None:
    """The batched format's invariance: a row x [H] of expert E - 1 alone (a slab of one row, the other experts
    empty) against the same row first, in the middle and last of slabs of each height in ``sizes`` beside full and
    partly filled slabs of the other experts, and against ``fused`` with the row as a token of one slot (expert
    E - 1, weight 1). ``batched(x [E, M, H], counts int32 [E]) -> [E, M, H]``, ``fused(x [T, H], weights fp32
    [T, 1], ids int32 [T, 1]) -> [T, H]``."""
    e = E - 1
    row = torch.randn(1, H, generator=gen).to(device, dtype)
    alone_x = torch.zeros(E, 1, H, dtype=dtype, device=device)
    alone_x[e] = row
    alone = batched(alone_x, torch.tensor([0] * e + [1], dtype=torch.int32, device=device))[e, 0]

    def cases():
        one = torch.ones(1, 1, device=device)
        yield "the standard format", fused(row, one, torch.full((1, 1), e, dtype=torch.int32, device=device))[0]
        for m in sizes:
            x = torch.randn(E, m, H, generator=gen).to(device, dtype)
            counts = torch.randint(0, m + 1, (E,), generator=gen).to(device, torch.int32)
            counts[e] = m
            for pos in sorted({0, m // 2, m - 1}):
                xp = x.clone()
                xp[e, pos] = row[0]
                yield f"slabs of M={m}, row {pos}", batched(xp, counts)[e, pos]

    return _invariant.first_mismatch(alone, cases())


def _w8a8_one_expert(rows, w13, w2, e, activation, b13, b2, lora=None, lora_ids=None) -> torch.Tensor:
    """Expert ``e`` of FP8 stacks on every row (float64 W8A8): the batched format's reference."""
    n = rows.shape[0]
    ones = torch.ones(n, 1, device=rows.device)
    ids = torch.full((n, 1), e, dtype=torch.int32, device=rows.device)
    return reference.fused_experts_w8a8(rows, w13, w2, ones, ids, activation=activation, w13_bias=b13, w2_bias=b2,
                                        lora=lora, lora_ids=lora_ids)


def _lora_args(lora, lora_ids) -> dict:
    return {} if lora is None else {"lora": lora, "lora_ids": lora_ids}
