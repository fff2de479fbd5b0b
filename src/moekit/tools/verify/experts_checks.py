"""Experts and whole-layer checks of `moekit verify`: every experts backend of this machine
(Triton: CUDA, or the interpreter on CPUs; torch), at the preset's sizes as given (the runner
passes real presets on a GPU, scaled-down ones on a CPU)."""

from __future__ import annotations

import torch

from ... import presets, reference
from ...presets import ACTIVATIONS
from ...experts import ExpertsLoRA, backends, batched_experts, fused_experts
from ...formats import FOUR_BIT_FORMATS, prepare, quantize_experts
from ...layer import FusedMoE
from ...metrics import EXPERTS_TOL, W8A8_TOL, CheckResult, Tolerance, score_values, separable_tokens
from ...routing import route



def experts_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Every backend that can serve some dense experts call of ``dtype`` on ``device`` when asked by name (either
    activation, with biases or without): each check then takes those that serve its own call (:func:`_serving`)."""
    calls = [backends.ExpertsCall("dense", dtype, device, activation=act, biases=biases)
             for act in ACTIVATIONS for biases in ((True, True), (False, False))]
    return [b.name for b in backends.BACKENDS if any(b.rejects(call, True) is None for call in calls)]


def _serving(names: list[str], x: torch.Tensor, weights, act_quant=None, op="fused", lora=False,
             activation="silu_and_mul", biases=(None, None)) -> list[str]:
    """The backends of ``names`` that take such a call when asked by name (a dense-only backend is not checked on
    4-bit weights or adapters, nor one without biases on calls with them: a refusal is no failure of its own)."""
    call = backends.ExpertsCall.of(x, weights, act_quant, op=op, lora=lora, activation=activation, biases=biases)
    by_name = {b.name: b for b in backends.BACKENDS}
    return [n for n in names if (not lora or by_name[n].lora) and by_name[n].rejects(call, True) is None]


def check_experts(spec: presets.MoESpec, num_tokens: int, dtype: torch.dtype, device: torch.device,
                  only: list[str] | None = None, with_layer: bool = True, low_bit: bool = True) -> list[CheckResult]:
    """Experts checks for the backends in ``only`` (default: every one here): dense weights, and
    with ``low_bit`` MXFP4, NVFP4 and FP8 W8A8; plus the whole layer."""
    H, tol = spec.hidden_size, EXPERTS_TOL[dtype]
    backends = [b for b in experts_backends(device, dtype) if only is None or b in only]
    results = _backend_checks(spec, num_tokens, dtype, device, backends, tol, low_bit) if backends else []
    if not with_layer:
        return results
    layer = FusedMoE(spec, dtype=dtype, device=device)
    xl = torch.randn(num_tokens, H, device=device).to(dtype)
    with torch.no_grad():
        got = layer(xl)
    ref = reference.moe_layer(xl, layer.gate.weight, layer.w13, layer.w2, spec, router_bias=layer.gate.bias,
                              correction_bias=layer.correction_bias, w13_bias=layer.w13_bias,
                              w2_bias=layer.w2_bias, shared_w13=layer.shared_w13, shared_w2=layer.shared_w2)
    # A near-tied token may take other experts in fp32 than in float64 (a whole expert's output apart): the layer is
    # held to the experts' budget on the others, widened for what the layer rounds besides (its routing weights, the
    # shared expert, the sum of both: deepseek-v3 bf16 at 4.2e-3 RMS against the experts' 5e-3 on the CPU).
    logits64 = reference.router_logits(xl, layer.gate.weight, layer.gate.bias)
    corr = layer.correction_bias
    separable = separable_tokens(logits64, spec.top_k, spec.routing, **spec.routing_kwargs(),
                                 correction_bias=None if corr is None else corr.double())
    row = score_values(CheckResult("FusedMoE", "auto", spec.name, num_tokens), got[separable], ref[separable],
                       Tolerance(tol.max_rel * 2, tol.rms_rel * 1.5) if dtype != torch.float32 else tol)
    if not row.ok:
        row.detail = (row.detail + "; " if row.detail else "") + f"on the {int(separable.sum())} of {num_tokens} " \
            "tokens that are no near ties"
    results.append(row)
    return results


def _backend_checks(spec, num_tokens, dtype, device, backends, tol, low_bit) -> list[CheckResult]:
    """fused_experts (dense and, with ``low_bit``, every low-bit format) and batched_experts of each backend."""
    E, H = spec.num_experts, spec.hidden_size
    w13, w2, b13, b2 = _weights(spec, dtype, device)
    x = torch.randn(num_tokens, H + 3, device=device).to(dtype)[:, 3:]          # strided
    tw, tid = route(torch.randn(num_tokens, E, device=device), spec.top_k, spec.routing,
                    **spec.routing_kwargs())
    results = []
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation=spec.activation, w13_bias=b13, w2_bias=b2)
    call = dict(activation=spec.activation, biases=(b13, b2))  # what each backend must serve to be checked here
    for backend in _serving(backends, x, w13, **call):
        out = torch.full((num_tokens, H), float("nan"), dtype=dtype, device=device)
        got = fused_experts(x, w13, w2, tw, tid, activation=spec.activation, w13_bias=b13, w2_bias=b2, out=out,
                            backend=backend)
        results.append(score_values(CheckResult("fused_experts", backend, spec.name, num_tokens), got, ref, tol,
                                    got is out))
    lora = _lora(spec, dtype, device)
    lora_ids = _lora_ids(num_tokens, lora.num_adapters, device)
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation=spec.activation, w13_bias=b13, w2_bias=b2,
                                  lora=lora, lora_ids=lora_ids)
    for backend in _serving(backends, x, w13, lora=True, **call):
        out = torch.full((num_tokens, H), float("nan"), dtype=dtype, device=device)
        got = fused_experts(x, w13, w2, tw, tid, activation=spec.activation, w13_bias=b13, w2_bias=b2, out=out,
                            backend=backend, lora=lora, lora_ids=lora_ids)
        results.append(score_values(CheckResult("fused_experts[lora]", backend, spec.name, num_tokens), got, ref, tol,
                                    got is out))

    if low_bit:
        results += _low_bit_checks(spec, x, w13, w2, tw, tid, b13, b2, backends, tol)

    # Rows per expert: padding isolation shows at any M; past 129 a real-size slab (and its float64
    # reference, [E, M, H]) only costs memory.
    M = max(1, min(num_tokens, 129))
    xb = torch.randn(E, M, H, device=device).to(dtype)
    counts = torch.randint(0, M + 1, (E,), device=device, dtype=torch.int32)
    counts[0] = 0                                                                  # an empty expert
    valid = torch.arange(M, device=device)[None, :] < counts[:, None]
    xb[~valid] = float("nan")                                                      # garbage padding
    ref = reference.batched_experts(xb, counts, w13, w2, activation=spec.activation, w13_bias=b13, w2_bias=b2)
    for backend in _serving(backends, xb, w13, op="batched", **call):
        out = torch.full_like(xb, float("nan"))
        got = batched_experts(xb, counts, w13, w2, activation=spec.activation, w13_bias=b13, w2_bias=b2, out=out,
                              backend=backend)
        results.append(score_values(CheckResult("batched_experts", backend, spec.name, num_tokens), got[valid],
                                    ref[valid], tol, got is out))
    lora_ids = torch.randint(-1, lora.num_adapters, (E, M), dtype=torch.int32, device=device)
    ref = reference.batched_experts(xb, counts, w13, w2, activation=spec.activation, w13_bias=b13, w2_bias=b2,
                                    lora=lora, lora_ids=lora_ids)
    for backend in _serving(backends, xb, w13, op="batched", lora=True, **call):
        out = torch.full_like(xb, float("nan"))
        got = batched_experts(xb, counts, w13, w2, activation=spec.activation, w13_bias=b13, w2_bias=b2, out=out,
                              backend=backend, lora=lora, lora_ids=lora_ids)
        results.append(score_values(CheckResult("batched_experts[lora]", backend, spec.name, num_tokens), got[valid],
                                    ref[valid], tol, got is out))

    return results


LORA_ADAPTERS, LORA_RANK = 4, 16  # the benchmark: rank 16, four adapters mixed over the tokens


def _lora(spec, dtype, device) -> ExpertsLoRA:
    """Four rank-16 adapters on w13 and w2 whose terms are about as large as the base GEMMs' outputs."""
    def make():
        n, r, E, H, I = LORA_ADAPTERS, LORA_RANK, spec.num_experts, spec.hidden_size, spec.intermediate_size
        rnd = lambda *shape, std: torch.randn(*shape, device=device, dtype=dtype).mul_(std)  # noqa: E731
        return ExpertsLoRA(rnd(n, E, r, H, std=H ** -0.5), rnd(n, E, 2 * I, r, std=r ** -0.5),
                           rnd(n, E, r, I, std=I ** -0.5), rnd(n, E, H, r, std=r ** -0.5), [0.5, 1.0, 1.5, 2.0])

    return _cached((spec.name, dtype, device, "lora"), make)


def _lora_ids(num_tokens, num_adapters, device) -> torch.Tensor:
    """Each token's adapter: every adapter and -1 (none), mixed."""
    return torch.randint(-1, num_adapters, (num_tokens,), dtype=torch.int32, device=device)


_CACHE: dict = {}


def _cached(key, make):
    """One preset's weights (and their quantized copies) serve all its token counts: at real sizes
    drawing and quantizing them is most of a case's time. Only the latest preset is kept."""
    if _CACHE.get("owner") != key[:3]:
        _CACHE.clear()
        _CACHE["owner"] = key[:3]
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]


def _weights(spec, dtype, device):
    def make():
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        # Drawn in their dtype: a float32 copy of Kimi-K2's experts alone would be 68 GB.
        w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype).mul_(H ** -0.5)
        w2 = torch.randn(E, H, I, device=device, dtype=dtype).mul_(I ** -0.5)
        b13, b2 = ((torch.randn(E, 2 * I, device=device) * 0.05, torch.randn(E, H, device=device) * 0.05)
                   if spec.expert_bias else (None, None))
        return w13, w2, b13, b2

    return _cached((spec.name, dtype, device, "dense"), make)


def _low_bit_checks(spec, x, w13, w2, tw, tid, b13, b2, backends, tol) -> list[CheckResult]:
    """fused_experts with MXFP4 and NVFP4 weights (against float64 on the dequantized weights), FP8
    W8A8 in 128x128 blocks and MXFP4 W4A8 (against float64 on dequantized weights and E4M3-rounded
    activations)."""
    results = []
    # 16-bit adapters on a 4-bit and an FP8 base (the adapters read the inputs the base weights read)
    with_lora = {("mxfp4", None), ("fp8_block", "fp8_group")}
    lora = _lora(spec, x.dtype, x.device)
    lora_ids = _lora_ids(x.shape[0], lora.num_adapters, x.device)
    for fmt, act_quant in (("mxfp4", None), ("mxfp4", "fp8_group"), ("nvfp4", None), ("fp8_block", "fp8_group")):
        q13, q2 = _cached((spec.name, x.dtype, x.device, fmt),  # quantized one expert at a time
                          lambda fmt=fmt: (quantize_experts(w13, fmt), quantize_experts(w2, fmt)))
        for adapters in ((None, None), (lora, lora_ids)) if (fmt, act_quant) in with_lora else ((None, None),):
            # the W8A8 reference, or float64 on weights dequantized per expert
            ref_fn = reference.fused_experts_w8a8 if act_quant else reference.fused_experts
            ref = ref_fn(x, q13, q2, tw, tid, activation=spec.activation, w13_bias=b13, w2_bias=b2, lora=adapters[0],
                         lora_ids=adapters[1])
            # 4-bit also on the stacks as moekit prepares them at load time (formats.prepare): other kernel variants
            layouts = ("packed", "pairs") if fmt in FOUR_BIT_FORMATS else ("packed",)
            for layout in layouts:
                # the prepared copies live for this check only (a preset's cache already holds its stacks in every
                # format: at kimi-k2's size two more 4-bit copies would not fit beside them on an 80 GB GPU)
                s13, s2 = (q13, q2) if layout == "packed" else (prepare(q13), prepare(q2))
                for backend in _serving(backends, x, s13, act_quant, lora=adapters[0] is not None,
                                        activation=spec.activation, biases=(b13, b2)):
                    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
                    got = fused_experts(x, s13, s2, tw, tid, activation=spec.activation, w13_bias=b13, w2_bias=b2,
                                        out=out, backend=backend, act_quant=act_quant, lora=adapters[0],
                                        lora_ids=adapters[1])
                    tags = (fmt + ("+" + act_quant if act_quant and fmt == "mxfp4" else "")
                            + ("+lora" if adapters[0] else "") + ("" if layout == "packed" else f", {layout} codes"))
                    results.append(score_values(CheckResult(f"fused_experts[{tags}]", backend, spec.name, x.shape[0]),
                                                got, ref, W8A8_TOL if act_quant else tol, got is out))
                del s13, s2
    return results
