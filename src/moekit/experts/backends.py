"""Which implementation serves an experts call, and why: the backend oracle.

Each backend declares what it supports (weight format, activation dtype, device); candidates are
tried in a fixed priority order and the first that supports the call serves it. An explicit
``backend="name"`` that cannot serve the call raises a ValueError that says why. The torch backend
(dequantize + fp32 torch) supports every call on every device: it is the float reference.

    >>> print(moekit.explain(moekit.backends.ExpertsCall.of(x, w13)))
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _invariant, _triton, gate
from ..formats import FOUR_BIT_FORMATS, FP8_ACTIVATION_FORMATS, WEIGHT_FORMATS, format_of, fp4
from . import configs, gate_case, torch_backend

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class ExpertsCall:
    """What a call asks of a backend (hashable; no tensors)."""

    weight_format: str
    act_dtype: torch.dtype
    device: torch.device
    num_tokens: int = 0
    act_quant: str | None = None
    op: str = "fused"  # "fused" (standard format) or "batched"
    activation: str = "silu_and_mul"
    lora: bool = False  # expert LoRA adapters (moekit.experts.ExpertsLoRA) ride along
    layout: str = "packed"  # 4-bit codes' byte layout (formats.fp4): "packed", "pairs", or "w13's/w2's" if they
    # differ: a class of its own for the gate (other kernel variants read each layout)
    # What else picks a kernel variant, for the gate's check (defaults: unknown, the gate's small case decides):
    dims: tuple = ()  # (E, 2I, H) of w13
    top_k: int = 0  # the standard format's slots per token
    biases: tuple = (True, True)  # (w13_bias, w2_bias): False absent, True in the activations' dtype, or its dtype
    expert_map: bool = False  # an expert map (expert parallelism)
    granularity: str = ""  # FP8 weights' scales: "block", "channel" or "tensor", or "w13's/w2's" if they differ
    config: object = None  # an ExpertsConfig the caller forces
    lora_ranks: tuple = ()  # with lora: the adapters' ranks on (w13, w2), 0 where a stack has none
    lora_paths: tuple = ()  # the adapters' kernel paths a check case takes as the call (the gate sets them)

    @classmethod
    def of(cls, x: torch.Tensor, w13, act_quant: str | None = None, *, op: str = "fused",
           activation: str = "silu_and_mul", lora=False, w2=None, top_k: int = 0, biases=(True, True),
           expert_map: bool = False, config=None) -> "ExpertsCall":
        """``biases``: (w13_bias, w2_bias) as tensors or None, or as the field's values; ``lora``: whether adapters
        ride along, or the ExpertsLoRA itself (None: none)."""
        tokens = x.shape[0] if x.dim() == 2 else x.shape[0] * x.shape[1]
        fmt = format_of(w13)
        w2 = w13 if w2 is None else w2
        granularity = ""
        if fmt == "fp8":
            g13, g2 = w13.granularity, getattr(w2, "granularity", w13.granularity)
            granularity = g13 if g13 == g2 else f"{g13}/{g2}"
        ranks = ()
        if lora is not None and not isinstance(lora, bool):  # an ExpertsLoRA
            ranks = tuple(0 if a is None else a.shape[2] for a in (lora.w13_a, lora.w2_a))
        return cls(fmt, x.dtype, x.device, tokens, act_quant, op, activation, bool(lora) if isinstance(lora, bool)
                   else lora is not None, call_layout(w13, w2), tuple(w13.shape), top_k,
                   tuple(_bias_kind(b, x.dtype) for b in biases), expert_map, granularity, config, ranks)

    def shape_class(self) -> "ExpertsCall":
        """What the verification gate checks once when it knows no kernel variant: the call without its token
        count and sizes."""
        return dataclasses.replace(self, num_tokens=0, dims=())


def _bias_kind(bias, act_dtype):
    """ExpertsCall.biases' entry for a bias tensor, None, or an entry already."""
    if isinstance(bias, torch.Tensor):
        return True if bias.dtype == act_dtype else bias.dtype
    return False if bias is None else bias


@dataclass(frozen=True)
class Backend:
    """A candidate: ``rejects(call, explicit)`` returns None when it can serve the call, else why
    not. ``fused(out, x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias,
    expert_map, config, act_quant)`` and ``batched(out, x, expert_num_tokens, w13, w2, activation,
    w13_bias, w2_bias, config, act_quant)`` compute validated calls INTO ``out``. A backend with ``lora``
    also takes expert LoRA (keywords ``lora``, an ExpertsLoRA, and ``lora_ids``, passed only when given);
    one without it is not asked to serve such calls. A backend with ``plans`` takes ``plan=True`` on a checked eager
    call and may return a plan that serves later calls of the same signature, returning False where it did not (then
    run the call): ``plan(out, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map) -> bool`` from
    ``fused``, ``plan(out, x, expert_num_tokens, w13, w2, w13_bias, w2_bias) -> bool`` from ``batched``.
    A backend with ``variant`` names the kernel variant it would run for a call, as the ``config`` its ``fused`` and
    ``batched`` take (None: its own choice): the verification gate checks each variant once, forcing it on a case
    cut from the call's sizes."""

    name: str
    rejects: Callable[[ExpertsCall, bool], str | None]
    summary: str
    fused: Callable = None
    batched: Callable = None
    lora: bool = False
    plans: bool = False
    variant: Callable[[ExpertsCall], object] | None = None

    def refuses(self, call: ExpertsCall, explicit: bool) -> str | None:
        """``rejects`` plus what every backend declares: expert LoRA."""
        if call.lora and not self.lora:
            return "takes no expert LoRA adapters"
        return self.rejects(call, explicit)


def _triton_rejects(call: ExpertsCall, explicit: bool) -> str | None:
    if not _triton.triton_importable():
        return "triton is not installed"
    if call.weight_format not in WEIGHT_FORMATS:
        return f"no kernel for {call.weight_format} weights yet (the torch backend dequantizes them)"
    if call.act_dtype not in ACTIVATION_DTYPES:
        return f"activations must be one of bf16/fp16/fp32, got {call.act_dtype}"
    if call.weight_format == "fp8" and call.act_quant != "fp8_group":
        return ("FP8 weights run as W8A8 with act_quant='fp8_group' (1x128 activation groups); "
                f"got act_quant={call.act_quant!r} (the torch backend dequantizes them)")
    fp8_act = call.act_quant == "fp8_group"
    if fp8_act and call.weight_format == "nvfp4":
        return ("no W4A8 kernel for NVFP4 weights: an E2M1 code times its E4M3 block scale is in general not an E4M3 "
                "value, so recoding would round the weights (MXFP4's power-of-two scales recode exactly; the torch "
                "backend computes NVFP4 with FP8 activations)")
    if call.act_quant is not None and not (fp8_act and call.weight_format in FP8_ACTIVATION_FORMATS):
        return f"no kernel emulates {call.act_quant} activations on {call.weight_format} weights (the torch backend does)"
    if call.device.type == "cuda":
        if torch.compiler.is_compiling():
            return None  # the eager call before tracing asked the device; dynamo need not
        major, minor = _triton.capability(call.device)
        if fp8_act and (major, minor) < (8, 9):
            kind = "W8A8" if call.weight_format == "fp8" else "W4A8"
            return f"FP8 {kind} needs FP8 tensor cores (compute capability >= 8.9), got {major}.{minor}"
        return None if major >= 8 else f"needs compute capability >= 8.0 (bf16 tensor cores), got {major}.x"
    if not explicit or not _triton.can_launch(call.device):
        # The interpreter (TRITON_INTERPRET=1) is correct but numpy-slow: only on request (tests, `moekit verify`).
        return (f"the Triton kernels need a CUDA GPU, this call is on {call.device.type} (on a CPU they run only "
                "through Triton's interpreter, when asked for: backend='triton' with TRITON_INTERPRET=1, for tests)")
    if _triton.interpreting() and call.act_dtype == torch.bfloat16:
        return "Triton 3.6's interpreter computes bf16 dots wrongly (use fp16/fp32 on the CPU)"
    return None



def _torch_rejects(call: ExpertsCall, explicit: bool) -> str | None:
    if call.weight_format not in WEIGHT_FORMATS:
        return f"cannot dequantize {call.weight_format} weights"
    return None


def _triton_variant(call: ExpertsCall):
    """(the ExpertsConfig the Triton backend runs ``call`` with, the check case's tokens that reach its kernels: the
    same alignment launches, the adapters' paths that the call's sizes pick: :func:`_lora_paths`), or None where the
    call's sizes are unknown."""
    if call.config is None and not call.dims:
        return None
    E, n1, k1 = call.dims if call.dims else (0, 0, 0)
    k = call.top_k or gate_case.DEFAULT_TOP_K
    config = call.config
    if config is None:
        fmt = configs.config_family(call.weight_format, call.act_quant)
        if call.op == "batched":  # (as triton_backend.batched_experts_into: the regime of M rows per expert)
            config = configs.choose(call.num_tokens, E, 1, n1, k1, call.device, call.act_dtype, fmt, batched=True)[0]
        else:
            config = configs.choose(call.num_tokens, E, k, n1, k1, call.device, call.act_dtype, fmt, lora=call.lora)[0]
    paths = call.lora_paths or (_lora_paths(call, config, k) if call.lora and call.dims else ())
    if call.op == "batched":
        return config, config.block_m + 9, paths  # rows per expert: a full row block and a partial one
    if config.per_pair:
        return config, 9, paths
    # aligned: one alignment program up to ALIGN_ONE_PROGRAM_MAX pairs, three launches above
    most = configs.ALIGN_ONE_PROGRAM_MAX
    tokens = max(config.block_m + 9, most // k + 9) if call.num_tokens * k > most else max(most // k, 1)
    return config, tokens, paths


_CODE_BYTES = {"mxfp4": 0.5, "nvfp4": 0.5, "fp8": 1}  # bytes per weight of a stack as the GEMMs stream it


def _lora_paths(call: ExpertsCall, config, k: int) -> tuple:
    """The adapters' paths (moekit.experts.lora.forced_paths) that the Triton backend takes for ``call``'s sizes,
    which its check case cuts: the decode terms inside the GEMVs or the separate kernels, and w2's term as GEMM2's
    fp32 delta or added after it."""
    from . import lora as expert_lora
    from . import triton_backend

    E, n1, H = call.dims
    r1, r2 = call.lora_ranks or (5, 5)
    if call.op == "fused" and config.gemv:
        if config.split_slots:
            return ()
        row_scaled = config.gemm1.row_scaled and triton_backend._fp16x2_operands(call.weight_format, call.act_dtype)
        slots = 1 if row_scaled else triton_backend.gemv1_slots(config.gemm1, k)
        fit = expert_lora.decode_terms_fit(r1, r2, n1 // 2, config.gemm1.block_n, slots, config.gemm2.block_n, k,
                                           call.num_tokens)
        return (("decode_terms", fit),)
    if config.per_pair or not r2:
        return ()
    out_elements = (call.num_tokens * k if call.op == "fused" else call.num_tokens) * H
    w2_bytes = E * H * (n1 // 2) * _CODE_BYTES.get(call.weight_format, call.act_dtype.itemsize)
    return (("w2_delta", expert_lora.w2_delta_pays(out_elements, w2_bytes)),)


def _triton_fused(*args, **kwargs):
    from . import triton_backend  # the kernels are built on first use (TRITON_INTERPRET is read then)

    return triton_backend.run_fused(*args, **kwargs)


def _triton_batched(*args, **kwargs):
    from . import triton_backend

    return triton_backend.run_batched(*args, **kwargs)


BUILTIN = (
    Backend("triton", _triton_rejects, "Triton grouped GEMMs: alignment, GEMM1 + activation, GEMM2 + router "
                                       "weight, fixed-order combine; 4-bit weights dequantized in the kernel, "
                                       "FP8 W8A8 and MXFP4 W4A8 on FP8 tensor cores",
            _triton_fused, _triton_batched, lora=True, plans=True, variant=_triton_variant),
    Backend("torch", _torch_rejects, "float reference: every expert in fp32, quantized weights dequantized first "
                                     "(any device)",
            torch_backend.fused_torch, torch_backend.batched_torch, lora=True),
)
BACKENDS: tuple[Backend, ...] = BUILTIN
"""Priority order: the first candidate that supports a call serves it."""


_REGISTRY = [0, None]  # [version, the candidates it numbers (held: its id is never reused while it is current)]


def registry_version() -> int:
    """Changes whenever the candidates do (register, unregister, or BACKENDS assigned): decisions cached per call
    depend on them."""
    if _REGISTRY[1] is not BACKENDS:
        _REGISTRY[:] = [_REGISTRY[0] + 1, BACKENDS]
    return _REGISTRY[0]


def register(backend: Backend, *, first: bool = True) -> None:
    """Add a backend (e.g. a vendor kernel, or in tests a deliberately broken one): ahead of the
    built-ins (``first``) or after them. Its name must be new."""
    global BACKENDS
    if backend.name in names():
        raise ValueError(f"a backend named {backend.name!r} exists already")
    BACKENDS = (backend,) + BACKENDS if first else BACKENDS + (backend,)


def unregister(name: str) -> None:
    global BACKENDS
    BACKENDS = tuple(b for b in BACKENDS if b.name != name)


def names() -> tuple[str, ...]:
    return tuple(b.name for b in BACKENDS)


def _check_call(call) -> None:
    if not isinstance(call, ExpertsCall):
        raise TypeError(f"call must be a moekit.backends.ExpertsCall (ExpertsCall.of(x, w13)), got {type(call).__name__}")
    if call.layout not in _CALL_LAYOUTS:
        raise ValueError(f"ExpertsCall.layout must be one of {sorted(_CALL_LAYOUTS)}, got {call.layout!r}")


def select_backend(call: ExpertsCall, backend: str = "auto") -> Backend:
    """The backend that serves ``call``: ``backend="auto"`` takes the first supporting candidate;
    a named backend is checked and refused with its reason (ValueError)."""
    _check_call(call)
    if backend != "auto":
        match = [b for b in BACKENDS if b.name == backend]
        if not match:
            raise ValueError(f"backend must be 'auto' or one of {names()}, got {backend!r}")
        why = match[0].refuses(call, True)
        if why:
            raise ValueError(f"backend={backend!r} cannot serve this call: {why}")
        return match[0]
    if torch.compiler.is_compiling():
        return _select_auto(call)
    # The answer depends only on the call's kind, the candidates, the gate and the interpreter switch: once per
    # kind, not per call (eager host time). Batch-invariant mode changes what the gate checks.
    key = (call, BACKENDS, gate.generation(), _triton.interpreting(), _invariant.enabled())
    chosen = _SELECTED.get(key)
    if chosen is None:
        chosen = _select_auto(call)
        if len(_SELECTED) > 4096:
            _SELECTED.clear()
        _SELECTED[key] = chosen
    return chosen


_SELECTED: dict = {}


def _select_auto(call: ExpertsCall) -> Backend:
    reasons = []
    for b in BACKENDS:
        why = b.refuses(call, False) or gate_case.refusal(b, call)
        if why is None:
            return b
        reasons.append(f"{b.name}: {why}")
    raise ValueError("no backend supports this call: " + "; ".join(reasons))


def call_layout(w13, w2) -> str:
    """ExpertsCall.layout of a call on these stacks ("packed" for dense and FP8 ones)."""
    l13, l2 = (w.layout if format_of(w) in FOUR_BIT_FORMATS else "packed" for w in (w13, w2))
    return l13 if l13 == l2 else f"{l13}/{l2}"


_CALL_LAYOUTS = {"/".join(p) if p[0] != p[1] else p[0] for p in itertools.product(fp4.LAYOUTS, repeat=2)}


def explain(call: ExpertsCall, backend: str = "auto") -> str:
    """One line per candidate, in priority order: taken, rejected (why), or not reached."""
    _check_call(call)
    chosen = select_backend(call, backend).name
    act = str(call.act_dtype).removeprefix("torch.") + (f" rounded to {call.act_quant}" if call.act_quant else "")
    codes = "" if call.layout == "packed" else f" (codes in the {call.layout!r} byte layout)"
    lines = [f"experts call: {call.weight_format} weights{codes}, {act} activations{', LoRA' if call.lora else ''}, "
             f"{call.device}, T={call.num_tokens}, backend={backend!r}"
             + (", batch-invariant mode (triton: one tile and K step per shape at every T, aligned or per pair; "
                f"torch: matmuls of {_invariant.ROWS_PER_MATMUL} rows)" if _invariant.enabled() else "")]
    taken = False
    for b in BACKENDS:
        if taken:
            lines.append(f"  {b.name:7s} not reached")
            continue
        why = b.refuses(call, backend == b.name) or gate_case.known_failure(b, call)
        if b.name == chosen:
            lines.append(f"  {b.name:7s} TAKEN: {b.summary}")
            taken = True
        elif backend not in ("auto", b.name):
            lines.append(f"  {b.name:7s} skipped: backend={backend!r} was asked for")
        else:
            lines.append(f"  {b.name:7s} rejected: {why}")
    return "\n".join(lines)
