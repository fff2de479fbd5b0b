"""The experts' case for the verification gate (:mod:`moekit.gate`): a backend is checked once per gate class
(:func:`gate_class`: the call's kind, and the kernel variant the backend names for it) on a random case against the
float64 reference before it serves an automatic call.

The case exercises what broke engines' kernels: biases (or none, as the call), a strided input, row blocks that
end partly filled and one expert's rows filling a whole block, an expert with no tokens, the call's slots per token
and expert map (ids of another rank), NaN padding rows (batched), and ``out`` poisoned with NaN so that an
unwritten or rebound output shows. The Triton backend's config for the call is forced on sizes cut from the
call's (K loops of several steps, the call's tile tails); a backend that plans calls serves a second case through
its plan. A call with expert LoRA is its own class: its case adds three adapters of the call's ranks on the stacks it
adapts, mixed over the tokens with some of none (-1), and takes the adapter kernels the call's sizes pick.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from .. import _invariant, _triton, gate, reference
from ..formats import FP8_ACTIVATION_FORMATS, prepare, quantize_experts
from ..metrics import EXPERTS_TOL, W8A8_TOL, rel_errors
from .lora import ExpertsLoRA, forced_paths

DEFAULT_TOP_K = 2  # slots per token of a call that does not say (backends' Triton variant reads it too)


def refusal(backend, call) -> str | None:
    """None when ``backend`` may serve ``call`` (gate off, or its check passed), else why not. While torch.compile
    traces, no check runs: a backend that failed any check of the call's kind is refused."""
    if not gate.enabled() or call.device.type == "meta":  # (meta tensors: shapes only, nothing to check)
        return None
    if torch.compiler.is_compiling():
        return _failure_of_kind(backend, call)
    cls = gate_class(backend, call)
    return gate.verdict(_key(backend, cls), backend.name, _describe(cls), lambda: check(backend, cls))


def known_failure(backend, call) -> str | None:
    """The gate's refusal if this backend already failed for the call's gate class (no new check)."""
    return gate.known_failure(_key(backend, gate_class(backend, call)))


def gate_class(backend, call):
    """What the gate checks once for ``backend`` on ``call``: the call's kind (format, dtypes, op, activation,
    adapters, slots per token, biases, expert map, scales) with, for a backend that names its kernel variant
    (``Backend.variant``: a config, the case's tokens, or rows per expert in the batched format, that reach the same
    kernels, and optionally the adapters' paths (:func:`moekit.experts.lora.forced_paths`) the case is to take), that
    config and the sizes of :func:`case_sizes`; without one, the small case's."""
    variant = backend.variant(call) if backend.variant is not None else None
    if variant is None or variant[0] is None:
        return dataclasses.replace(call, num_tokens=0, dims=(), config=None, lora_paths=())
    config, tokens, *paths = variant
    E, H, I = case_sizes(call, config)
    return dataclasses.replace(call, num_tokens=tokens * (E if call.op == "batched" else 1), dims=(E, 2 * I, H),
                               config=config, lora_paths=paths[0] if paths else ())


def case_sizes(call, config=None) -> tuple[int, int, int]:
    """(E, H, I) of the check case: k distinct experts of E - 1 per token and one expert without tokens. With a
    config, H and I are cut from the call's (:func:`_cut`) so that both GEMMs loop over K in more than one step and
    end their K and column tiles as the call does; the aligned mode's alignment kernels are built for the expert
    count rounded up to a power of two, so the case keeps that (the call's own count up to 32 experts, else the
    least one that rounds up alike)."""
    k = call.top_k or DEFAULT_TOP_K
    E = max(6, k + 3)
    if config is None or not call.dims:
        return E, 64, 32
    num_experts, n1, H = call.dims
    if not config.per_pair and call.op == "fused":
        E = max(num_experts if num_experts <= 32 else _triton.next_pow2(num_experts) // 2 + 1, k + 2)
    g1, g2 = config.gemm1, config.gemm2
    return E, _cut(H, g1.block_k, g2.block_n), _cut(n1 // 2, g2.block_k, g1.block_n)


def _cut(n: int, *tiles: int) -> int:
    """``n``, or a smaller size of whole tiles and then ``n``'s own tail (the same residue modulo the largest tile:
    powers of two, taken at least 128 so that every format's scale groups and blocks stay whole): two whole tiles
    up to 256 wide, one past that (the decode kernels' 1024-wide K chunks), so that the case stays small."""
    t = max(128, *tiles)
    whole = 2 if t <= 256 else 1
    return min(n, whole * t + (n % t or t))


def _key(backend, cls) -> tuple:
    # batch-invariant mode adds the invariance check: its verdicts are kept apart
    return (backend.name, (cls, "batch-invariant") if _invariant.enabled() else cls)


_KIND = ("weight_format", "act_dtype", "device", "act_quant", "op", "activation", "lora", "layout", "granularity")


def _failure_of_kind(backend, call) -> str | None:
    """The refusal of a backend that failed a check of any class of the call's kind (formats, dtypes, op) in this
    mode (the gate also holds the router's and routing's verdicts, under other keys)."""
    kind = tuple(getattr(call, f) for f in _KIND)
    invariant = _invariant.enabled()
    for key, (passed, detail) in gate.results().items():
        if passed or len(key) != 2 or key[0] != backend.name:
            continue
        cls = key[1]
        if isinstance(cls, tuple):  # (class, "batch-invariant")
            if not invariant:
                continue
            cls = cls[0]
        elif invariant:
            continue
        if hasattr(cls, "weight_format") and tuple(getattr(cls, f) for f in _KIND) == kind:
            return f"failed the verification gate ({detail})"
    return None


def _describe(cls) -> str:
    dtype = str(cls.act_dtype).removeprefix("torch.")
    lora = ", LoRA" if cls.lora else ""
    codes = "" if cls.layout == "packed" else f" ({cls.layout} codes)"
    scales = f" ({cls.granularity} scales)" if cls.granularity else ""
    text = (f"{cls.op} experts, {cls.weight_format} weights{scales}{codes}{lora}, {dtype}, {cls.activation}, "
            f"{cls.device}")
    if cls.config is not None:
        text += f", mode {cls.config.mode!r} (block_m {cls.config.block_m})"
    return text


def _lora_case(call, gen, E, H, I, rows):
    """(ExpertsLoRA of three adapters of the call's ranks (5 where unknown) on the stacks it adapts, int32 adapter
    ids of ``rows`` shape: each adapter and -1 appear), or (None, None) for a call without LoRA."""
    if not call.lora:
        return None, None
    n, dev, dt = 3, call.device, call.act_dtype
    r13, r2 = call.lora_ranks or (5, 5)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    a13, b13 = ((rnd(n, E, r13, H) * H ** -0.5).to(dev, dt), (rnd(n, E, 2 * I, r13) * 0.3).to(dev, dt)) if r13 else \
        (None, None)
    a2, b2 = ((rnd(n, E, r2, I) * I ** -0.5).to(dev, dt), (rnd(n, E, H, r2) * 0.3).to(dev, dt)) if r2 else (None, None)
    lora = ExpertsLoRA(a13, b13, a2, b2, [0.5, 1.0, 2.0])
    ids = (torch.arange(rows[0] * (rows[1] if len(rows) > 1 else 1)) % (n + 1) - 1).reshape(rows)
    return lora, ids.to(dev, torch.int32)


def _case(call, gen):
    """Random weights in the call's format (and scales, per stack), the biases the call has (in their dtypes), and
    the reference's weights (the quantized stacks themselves: the reference dequantizes an expert at a time), at
    :func:`case_sizes`. Drawn on the call's device."""
    E, H, I = case_sizes(call, call.config)
    dev, dt = call.device, call.act_dtype
    dgen = gen if dev.type == "cpu" else torch.Generator(device=dev).manual_seed(int(torch.randint(
        0, 2 ** 31, (1,), generator=gen)))
    rnd = lambda *shape: torch.randn(*shape, generator=dgen, device=dev)  # noqa: E731
    w13, w2 = rnd(E, 2 * I, H) * H ** -0.5, rnd(E, H, I) * I ** -0.5
    if call.weight_format == "dense":
        w13, w2 = w13.to(dt), w2.to(dt)
        ref13, ref2 = w13, w2
    else:
        if call.weight_format == "fp8":
            g13, g2 = ((call.granularity or "block").split("/") * 2)[:2]
            fmts = (f"fp8_{g13}", f"fp8_{g2}")
        else:
            fmts = (call.weight_format,) * 2
        w13, w2 = quantize_experts(w13, fmts[0]), quantize_experts(w2, fmts[1])
        ref13, ref2 = w13, w2
        l13, l2 = (call.layout.split("/") * 2)[:2]  # the call's byte layouts of w13 and w2
        w13, w2 = (prepare(w13) if l13 == "pairs" else w13), (prepare(w2) if l2 == "pairs" else w2)
    dtypes = [dt if kind is True else kind for kind in call.biases]
    biases = (rnd(E, 2 * I).mul(0.1).to(dtypes[0]) if dtypes[0] else None,
              rnd(E, H).mul(0.1).to(dtypes[1]) if dtypes[1] else None)
    return E, H, w13, w2, ref13, ref2, biases


def _routing(T: int, k: int, E: int, gen, expert_map: bool, device):
    """(float32 weights [T, k], int32 ids [T, k], expert map or None): each token's first slot on expert 0 but for
    the last 8 tokens (a full row block and a partial one when T exceeds the block by 9), the other slots distinct
    random experts of the E - 1 first; expert E - 1 gets none. With ``expert_map``, ids are global among E + 3
    experts, 3 of them another rank's (-1 in the map), which some slots pick."""
    first = torch.where(torch.arange(T) < T - 8, 0, torch.arange(T) % (E - 1))
    scores = torch.rand(T, E - 1, generator=gen)
    scores[torch.arange(T), first] = 2.0
    ids = scores.topk(k, dim=1).indices
    emap = None
    if expert_map:
        where = torch.randperm(E + 3, generator=gen)  # global position of local expert e (the first E), others away
        emap = torch.full((E + 3,), -1, dtype=torch.int32)
        emap[where[:E]] = torch.arange(E, dtype=torch.int32)
        ids = where[ids]
        away = torch.rand(T, k, generator=gen) < 0.2
        ids[away] = where[E:][torch.randint(0, 3, (int(away.sum()),), generator=gen)]
        emap = emap.to(device)
    return torch.rand(T, k, generator=gen).to(device), ids.to(device, torch.int32), emap


def check(backend, call) -> tuple[bool, str]:
    """(passed, detail) of ``backend`` on a random case of ``call``'s gate class (:func:`gate_class`), in the
    class's config when it has one; a backend that plans a call also serves a second case through its plan. FP8
    W8A8 and MXFP4 W4A8 calls are checked against the W8A8 float64 reference (activations rounded to E4M3 1x128
    groups)."""
    call = gate_class(backend, call)
    w8a8 = call.act_quant == "fp8_group" and call.weight_format in FP8_ACTIVATION_FORMATS
    if call.act_quant is not None and not w8a8:
        return True, "activation emulation: the torch reference is the definition"
    gen = torch.Generator().manual_seed(1234)
    dt = call.act_dtype
    try:
        E, H, w13, w2, ref13, ref2, (b13, b2) = _case(call, gen)
    except torch.OutOfMemoryError as exc:
        raise _no_memory(call) from exc
    case = SimpleNamespace(E=E, H=H, I=w2.shape[2], w13=w13, w2=w2, ref13=ref13, ref2=ref2, b13=b13, b2=b2, w8a8=w8a8,
                           planning=backend.plans and not call.lora, gen=gen)
    try:
        with forced_paths(**dict(call.lora_paths)):  # (adapter kernels picked by sizes the case cut: as the call)
            errors = (_batched_errors if call.op == "batched" else _fused_errors)(backend, call, case)
    except torch.OutOfMemoryError as exc:  # the check's fault, not the backend's: no verdict
        raise _no_memory(call) from exc
    except Exception as exc:  # noqa: BLE001 - a backend that raises fails its check
        return False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    max_rel, rms_rel = (max(e[0] for e in errors), max(e[1] for e in errors))
    tol = W8A8_TOL if w8a8 else EXPERTS_TOL[dt]
    detail = f"max_rel={max_rel:.2e} rms_rel={rms_rel:.2e} (budget {tol.max_rel:.0e}/{tol.rms_rel:.0e})"
    if len(errors) > 1:
        detail += ", a call and its plan's"
    accurate = max_rel <= tol.max_rel and rms_rel <= tol.rms_rel
    if not accurate or not _invariant.enabled():
        return accurate, detail
    # On the call's own case (its sizes cut as above, biases, slots per token, adapters' ranks), in the configs the
    # mode picks by T: which tiles serve a batch may follow the sizes, so a small case of its own proves less.
    try:
        mismatch = invariance(backend, call, case.w13, case.w2, case.b13, case.b2, gen,
                              top_k=min(call.top_k or DEFAULT_TOP_K, case.E - 1),
                              lora=_lora_case(call, gen, case.E, case.H, case.I, (1,))[0])
    except torch.OutOfMemoryError as exc:
        raise _no_memory(call) from exc
    except Exception as exc:  # noqa: BLE001 - a backend that raises fails its check
        return False, f"invariance check raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if mismatch:
        return False, f"{detail}; not batch-invariant: {mismatch}"
    return True, f"{detail}; batch-invariant at T in {GATE_SIZES}"


def _batched_errors(backend, call, c) -> list[tuple[float, float]]:
    """(max_rel, rms_rel) of the batched format on the case ``c``, then of its plan on a second case."""
    E, H, dev, dt, gen = c.E, c.H, call.device, call.act_dtype, c.gen
    M = call.num_tokens // E if call.num_tokens else 9
    sizes = [M, 0, min(3, M), 1, max(M - 1, 0), min(5, M)]

    def inputs():
        x = torch.randn(E, M, H, generator=gen).to(dev, dt)
        counts = torch.tensor((sizes * E)[:E], dtype=torch.int32, device=dev)   # full, empty, partial
        valid = torch.arange(M, device=dev)[None, :] < counts[:, None].long()
        x[~valid] = float("nan")                                                   # padding must not leak
        return x, counts, valid

    def expected(x, counts, valid, lora, lora_ids):
        if c.w8a8:
            ref = torch.stack([_w8a8_one_expert(x[e], c.w13, c.w2, e, call.activation, c.b13, c.b2, lora,
                                                None if lora is None else lora_ids[e]) for e in range(E)])
        else:
            ref = reference.batched_experts(x, counts, c.ref13, c.ref2, activation=call.activation, w13_bias=c.b13,
                                            w2_bias=c.b2, lora=lora, lora_ids=lora_ids)
        return ref[valid]

    x, counts, valid = inputs()
    out = torch.full_like(x, float("nan"))
    lora, lora_ids = _lora_case(call, gen, E, H, c.I, (E, M))
    plan = backend.batched(out, x, counts, c.w13, c.w2, call.activation, c.b13, c.b2, call.config, call.act_quant,
                           **_lora_args(lora, lora_ids), **({"plan": True} if c.planning else {}))
    errors = [rel_errors(out[valid], expected(x, counts, valid, lora, lora_ids))]
    if c.planning and plan:  # the plan serves the next call of this signature: new values, same layout
        x, counts, valid = inputs()
        out = torch.full_like(x, float("nan"))
        if plan(out, x, counts, c.w13, c.w2, c.b13, c.b2):
            errors.append(rel_errors(out[valid], expected(x, counts, valid, None, None)))
    return errors


def _fused_errors(backend, call, c) -> list[tuple[float, float]]:
    """(max_rel, rms_rel) of the standard format on the case ``c``, then of its plan on a second case."""
    E, H, dev, dt, gen = c.E, c.H, call.device, call.act_dtype, c.gen
    T, k = call.num_tokens or 9, call.top_k or DEFAULT_TOP_K
    tw, ids, emap = _routing(T, k, E, gen, call.expert_map, dev)

    def inputs():
        return torch.randn(T, H + 3, generator=gen).to(dev, dt)[:, 3:]               # row stride H + 3

    def expected(x, tw, ids, emap, lora, lora_ids):
        ref_fn = reference.fused_experts_w8a8 if c.w8a8 else reference.fused_experts
        return ref_fn(x, c.w13 if c.w8a8 else c.ref13, c.w2 if c.w8a8 else c.ref2, tw, ids,
                      activation=call.activation, w13_bias=c.b13, w2_bias=c.b2, expert_map=emap, lora=lora,
                      lora_ids=lora_ids)

    x = inputs()
    out = torch.full((T, H), float("nan"), dtype=dt, device=dev)
    lora, lora_ids = _lora_case(call, gen, E, H, c.I, (T,))
    plan = backend.fused(out, x, c.w13, c.w2, tw, ids, call.activation, c.b13, c.b2, emap, call.config,
                         call.act_quant, **_lora_args(lora, lora_ids), **({"plan": True} if c.planning else {}))
    errors = [rel_errors(out, expected(x, tw, ids, emap, lora, lora_ids))]
    if c.planning and plan:
        x = inputs()
        tw, ids, emap = _routing(T, k, E, gen, call.expert_map, dev)
        out = torch.full((T, H), float("nan"), dtype=dt, device=dev)
        if plan(out, x, c.w13, c.w2, tw, ids, c.b13, c.b2, emap):
            errors.append(rel_errors(out, expected(x, tw, ids, emap, None, None)))
    return errors


def _no_memory(call) -> RuntimeError:
    """The error of a check that ran out of memory (no verdict is kept: the next call checks again)."""
    case = f"[E, 2I, H] = {list(call.dims)}" if call.dims else "the small case"
    return RuntimeError(f"moekit's verification gate ran out of device memory checking {_describe(call)} (its case: "
                        f"{case}); free memory before the first call of this kind or turn the gate off "
                        "(MOEKIT_VERIFY=0)")


GATE_SIZES = (1, 7, 64, 129)  # the check case's row blocks change height at 37 and 109 tokens (k=2 of 6 experts)


def invariance(backend, call, w13, w2, b13, b2, gen, sizes=GATE_SIZES, lora=None, top_k=2) -> str | None:
    """None when ``backend`` gives a token the same bits alone and among others (:mod:`moekit._invariant`), else
    where it did not: the standard format in batches of ``sizes`` at three positions (``top_k`` distinct experts per
    token, expert E - 1 left empty); the batched format in slabs of those heights, and its rows against the standard
    format's (one slot of weight 1). With ``lora`` (the case's adapters) every token or row takes one of them, the
    probe the first."""
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
            ids = torch.stack([torch.randperm(E - 1, generator=gen)[:top_k] for _ in range(n)]).to(dev, torch.int32)
            case = dict(x=torch.randn(n, H, generator=gen).to(dev, dt), tw=torch.rand(n, top_k, generator=gen).to(dev),
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
