"""Fused MoE experts: y = sum_j w_j * W2_e act(W13_e x + b13_e) + b2_e, in the standard and the
batched (masked) activation format.

This module holds the public API, its validation and the ``out=`` contract; the backend oracle
(:mod:`moekit.experts.backends`) picks the implementation: the Triton kernels
(:mod:`moekit.experts.triton_backend`) on CUDA, the torch implementation
(:mod:`moekit.experts.torch_backend`) elsewhere.
"""

from __future__ import annotations

import weakref

import torch

from .. import _invariant, gate
from .._calls import CheckedCalls
from .._checks import (check_disjoint, check_out, check_shape, check_tensor, may_sync, tensor_version,
                       warn_gradients_dropped)
from ..formats import format_of, to_parts
from ..presets import ACTIVATIONS
from . import backends, configs
from .backends import ExpertsCall, select_backend
from .configs import ExpertsConfig
from .lora import ExpertsLoRA, check_call as check_lora

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
weight_format = format_of  # the name this module has always exported


def _check_config(config, fp8_products: bool = False, per_pair_kept: bool = False, weight_format: str = "") -> None:
    """An explicit config is an ExpertsConfig; in batch-invariant mode, one whose order of sums the mode can keep
    (``fp8_products``: the call multiplies FP8 codes, W8A8 or W4A8; ``per_pair_kept``: a standard-format call
    without adapters or activation quantization, where a per-pair config on ``weight_format`` keeps the aligned
    mode's bits as configs.per_pair_keeps_aligned_bits says)."""
    if config is None:
        return
    if not isinstance(config, ExpertsConfig):
        raise TypeError(f"config must be a moekit.experts.ExpertsConfig or None, got {type(config).__name__}")
    if not _invariant.enabled():
        return
    if config.mode != "aligned" and not (config.mode == "per_pair" and per_pair_kept
                                         and configs.per_pair_keeps_aligned_bits(weight_format, config.split_slots)):
        # (the mode's own configs: experts/configs.py _invariant_choose)
        raise ValueError(_invariant.refusal(
            f"config with mode {config.mode!r}", "the CUDA-core mode sums a token's K terms across lanes, and the "
            "per-pair mode keeps the aligned mode's sums only without adapters, on dense weights or on 4-bit ones "
            "with split_slots"))
    if fp8_products and (config.gemm1.half_tails or config.gemm2.half_tails):
        raise ValueError(_invariant.refusal("config with half_tails on FP8 products", "a half block runs on "
                                            "mma.sync, whose FP8 sums round otherwise than wgmma's"))


def choose_backend(x: torch.Tensor, w13, backend: str = "auto", act_quant: str | None = None, *,
                   op: str = "fused", activation: str = "silu_and_mul", lora=False, w2=None, top_k: int = 0,
                   biases=(True, True), expert_map: bool = False, config=None):
    """The :class:`moekit.experts.backends.Backend` that serves this call (the oracle explains why)."""
    return select_backend(ExpertsCall.of(x, w13, act_quant, op=op, activation=activation, lora=lora, w2=w2,
                                         top_k=top_k, biases=biases, expert_map=expert_map, config=config), backend)


def check_quantized_stack(name, w, ndim, device):
    """What an expert stack adds to its type's own invariants (checked when it was built)."""
    if len(w.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(w.shape)}")
    if w.data.device != device:
        raise ValueError(f"{name} must be on {device} (the device of the input), got {w.data.device}")
    fmt = format_of(w)
    if fmt == "fp8" and w.granularity not in FP8_WEIGHT_GRANULARITIES:
        raise ValueError(f"{name}: FP8 expert weights are per tensor, per channel or in 128x128 blocks "
                         f"{FP8_WEIGHT_GRANULARITIES}, got granularity {w.granularity!r}")
    if fmt == "nvfp4":
        gs = w.global_scale
        if gs.numel() != 1 and (gs.dim() == 0 or gs.shape[0] != w.shape[0] or gs.numel() != w.shape[0]):
            raise ValueError(f"{name}: NVFP4 expert weights take one global scale, or one per expert "
                             f"({w.shape[0]},); got global_scale of shape {tuple(gs.shape)}")


FP8_WEIGHT_GRANULARITIES = ("tensor", "channel", "block")


def _check_weights(x, w13, w2, activation, w13_bias, w2_bias):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    fmt = format_of(w13)
    if format_of(w2) != fmt:
        raise TypeError(f"w13 and w2 must share one format, got {fmt} and {format_of(w2)}")
    if fmt == "dense":
        check_tensor("w13", w13, ndim=3, dtypes=WEIGHT_DTYPES, device=x.device)
        check_tensor("w2", w2, ndim=3, dtypes=(w13.dtype,), device=x.device)
        if x.dtype != w13.dtype:
            raise TypeError(f"x must have the weights' dtype {w13.dtype}, got {x.dtype}")
    else:
        check_quantized_stack("w13", w13, 3, x.device)
        check_quantized_stack("w2", w2, 3, x.device)
    E, two_i, H = w13.shape
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13 must be [E, 2I, H] with 2I even and > 0, got {tuple(w13.shape)}")
    if fmt != "dense" and H == 0:  # no scale groups to read (dense weights with H = 0 give zero rows)
        raise ValueError(f"4-bit w13 must have H > 0 (its scale groups run along H), got {tuple(w13.shape)}")
    if x.shape[-1] != H:
        raise ValueError(f"x must have hidden size H={H} (from w13 [E, 2I, H]) in its last dim, got {tuple(x.shape)}")
    if tuple(w2.shape) != (E, H, two_i // 2):
        raise ValueError(f"w2 must have shape {(E, H, two_i // 2)}, got {tuple(w2.shape)}")
    if w13_bias is not None:
        check_tensor("w13_bias", w13_bias, ndim=2, dtypes=BIAS_DTYPES, device=x.device)
        check_shape("w13_bias", w13_bias, (E, two_i))
    if w2_bias is not None:
        check_tensor("w2_bias", w2_bias, ndim=2, dtypes=BIAS_DTYPES, device=x.device)
        check_shape("w2_bias", w2_bias, (E, H))
    return E, two_i // 2, H


_CHECKED_MAPS: dict[int, tuple] = {}  # id(expert_map) -> (weakref to it, its version, local experts)


def _value_range(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of ``t``'s values: one host sync."""
    lo, hi = torch.aminmax(t)
    return int(lo), int(hi)


def check_expert_map_values(expert_map: torch.Tensor, num_local: int) -> None:
    """Every value of ``expert_map`` is -1 (not on this rank) or a local expert index in
    [0, num_local). A value past the local experts would drop its tokens silently, so it is refused;
    reading the values costs one host sync, made once per map and version (an in-place change of
    the map is checked again at the next call), never while a CUDA graph is captured or
    torch.compile traces (the eager call before them checked it). Writes that bypass the version
    counter (``.data``, numpy or DLPack views, or a map made under torch.inference_mode, which keeps
    none) are not seen: such a map is checked once."""
    if not may_sync(expert_map):
        return
    key = id(expert_map)
    seen = _CHECKED_MAPS.get(key)
    if seen is not None and seen[0]() is expert_map and seen[1:] == (tensor_version(expert_map), num_local):
        return
    if expert_map.numel():
        lo, hi = _value_range(expert_map)
        if lo < -1 or hi >= num_local:
            raise ValueError(f"expert_map values must be -1 (expert not on this rank) or a local expert index in "
                             f"[0, {num_local}) (E={num_local} from w13), got values in [{lo}, {hi}]")
    if len(_CHECKED_MAPS) >= 256:  # forget maps that are gone
        for k in [k for k, v in _CHECKED_MAPS.items() if v[0]() is None]:
            del _CHECKED_MAPS[k]
    _CHECKED_MAPS[key] = (weakref.ref(expert_map), tensor_version(expert_map), num_local)


def check_ids_within_map(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> None:
    """With the verification gate on (eager calls): every id is -1 or indexes ``expert_map`` (one entry
    per global expert). An id past a short map would contribute nothing, silently. One host sync per
    call, so only in the gate's mode."""
    if not may_sync(topk_ids):
        return
    if topk_ids.numel():
        lo, hi = _value_range(topk_ids)
        if lo < -1 or hi >= expert_map.shape[0]:
            raise ValueError(f"topk_ids must be global expert ids in [0, {expert_map.shape[0]}) (the length of "
                             f"expert_map: one entry per global expert) or -1, got ids in [{lo}, {hi}]")


def _warn_if_gradients_asked(chosen, *tensors) -> None:
    """The kernels compute no gradients (moekit's experts are for inference): say so once per backend when a call
    asks for them, rather than hand back an output that silently does not require grad."""
    if chosen.name != "torch":
        warn_gradients_dropped(f"{chosen.name} experts", "backend='torch'", *tensors)


def _weight_memory(name: str, w) -> dict[str, torch.Tensor | None]:
    """Every tensor a weight's kernels read (a quantized weight's codes and its scales), for alias checks: the
    decode modes write a token's output before later programs read the scales."""
    if isinstance(w, torch.Tensor):
        return {name: w}
    _, data, scales, global_scale, _, _ = to_parts(w)
    return {name: data, f"{name}.scales": scales, f"{name}.global_scale": global_scale}


ACT_QUANTS = (None, "nvfp4", "fp8_group")


def check_act_quant(act_quant, hidden: int | None = None, inter: int | None = None) -> None:
    """``act_quant`` is one of ACT_QUANTS (and, given the sizes, fits them)."""
    if act_quant not in ACT_QUANTS:
        raise ValueError(f"act_quant must be one of {ACT_QUANTS}, got {act_quant!r}")
    if act_quant == "nvfp4" and _invariant.enabled():
        raise ValueError(_invariant.refusal("act_quant='nvfp4'", "its global activation scale comes from the amax of "
                                            "every token routed to an expert"))
    if act_quant == "nvfp4" and hidden is not None and (hidden % 16 or inter % 16):
        raise ValueError(f"act_quant='nvfp4' needs H and I multiples of 16 (NVFP4 blocks), got H={hidden}, I={inter}")


def _options_and_out(x, w13, w2, act_quant, config, out, per_pair_kept: bool = False, **other_inputs) -> torch.Tensor:
    """The checks both formats share past the weights (act_quant against H and I, config, the ``out=`` contract),
    then the output: ``out`` itself, or a new tensor of x's shape, dtype and device. ``out`` must be contiguous
    and must not alias x, the weights or ``other_inputs``. ``per_pair_kept``: a standard-format call without
    adapters (:func:`_check_config`)."""
    check_act_quant(act_quant, x.shape[-1], w2.shape[2])
    fmt = format_of(w13)
    _check_config(config, fmt == "fp8" or (fmt == "mxfp4" and act_quant == "fp8_group"),
                  per_pair_kept and act_quant is None, fmt)
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check_out("out", out, tuple(x.shape), x.dtype, x.device,
              {"x": x, **_weight_memory("w13", w13), **_weight_memory("w2", w2), **other_inputs})
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")
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
    out: torch.Tensor | None = None,
    backend: str = "auto",
    config: ExpertsConfig | None = None,
    act_quant: str | None = None,
    lora: ExpertsLoRA | None = None,
    lora_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Standard format: out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    Args:
        x: [T, H] bf16/fp16/fp32, any strides.
        w13: [E, 2I, H] (K contiguous): rows [gate; up] for silu_and_mul, interleaved for swiglu_oai.
            Either a tensor of x's dtype, or 4-bit weights (:class:`moekit.formats.mxfp4.MXFP4Tensor`,
            :class:`moekit.formats.nvfp4.NVFP4Tensor` with a per-expert global scale), dequantized
            inside the kernels (W4A16; x bf16/fp16/fp32).
        w2: [E, H, I], same type/dtype as w13.
        topk_weights: [T, k] float32; topk_ids: [T, k] int32 (global expert ids).
        activation: ``"silu_and_mul"`` or ``"swiglu_oai"``.
        w13_bias: [E, 2I]; w2_bias: [E, H] (any float dtype; added in fp32).
        expert_map: int32 [E_global]: global id -> local weight index, -1 = not on this rank
            (contributes zero). Without it, ids index w13/w2 directly. Its values must be -1 or in
            [0, E): checked once per map (one host sync; again after an in-place change), a
            ValueError otherwise. It needs one entry per global expert: an id past its end would
            contribute zero, so with the verification gate on (``MOEKIT_VERIFY=1``) every eager call
            checks the ids against its length (a host sync per call, in that mode only).
        out: optional [T, H] tensor of x's dtype, contiguous; written in place and returned.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` or ``"torch"``.
        config: block configuration for the Triton kernels (default: the tuned table or the
            heuristic of :mod:`moekit.experts.configs`).
        act_quant: ``"nvfp4"`` emulates NVFP4 W4A4 (Blackwell): each expert's GEMM inputs are
            NVFP4-rounded with a global scale from the amax of the tokens routed to it (torch
            backend; with NVFP4 weights this reproduces a W4A4 deployment's numerics).
            ``"fp8_group"``: FP8 W8A8 as DeepSeek-V3 runs it: both GEMM inputs in E4M3 with one
            scale per row and 1x128 group (scale = amax / 448), weights a
            :class:`moekit.formats.fp8.FP8Tensor` [E, N, K] with 128x128 block, per-channel
            [E, N, 1] or per-tensor (1 or E values) scales. The Triton backend runs it on FP8
            tensor cores (compute capability >= 8.9), quantizing x in one small kernel and GEMM1's
            output in its epilogue; products are summed in fp32 per 128-deep step. FP8 weights
            without ``act_quant`` run W8A16 on the torch backend. With MXFP4 weights,
            ``"fp8_group"`` is W4A8: the same FP8 activations, and the weights recoded to E4M3 in
            the kernel under one power of two per row (exact where each row's scales lie within
            2^14 of each other; :func:`moekit.formats.mxfp4.to_e4m3` defines the result
            otherwise). On the H200 it is correct but slower than W4A16 (benchmarks/LIMITS.md,
            "W4A8"); it serves those numerics, not speed.
        lora: expert LoRA adapters (:class:`moekit.experts.ExpertsLoRA`: stacked [adapters, E, ...] in x's
            dtype, E the local experts under ``expert_map``), on dense or quantized weights; each token's
            adapter term is added to its experts' GEMM1 output before the activation and to GEMM2's output,
            on the GEMMs' inputs as the base weights see them (see :mod:`moekit.experts.lora`).
        lora_ids: int32 [T], with ``lora``: each token's adapter, -1 for none. Values outside [-1, adapters)
            are a ValueError where checking them needs no device sync (CPU tensors, or the verification gate
            on); elsewhere they contribute nothing.

    Ids outside the valid range (or mapped to -1) contribute zero; they are never read out of
    bounds. The k slots are summed in fp32 in slot order, without atomics: results are the same
    bits on every run. The Triton backend keeps the GEMM1 activations and the weighted per-slot
    outputs in x's dtype (fp32 accumulation inside each GEMM). The torch backend runs every expert
    on every token (static shapes, no host sync): it is meant for CPUs and small shapes.

    Returns:
        [T, H] in x's dtype.
    """
    key = None
    if lora is None and lora_ids is None:  # (calls with adapters are checked in full: their ids may be read)
        key = _call_key((x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, out),
                        ("fused", backend, config, act_quant, activation))
    decided = _VALIDATED.get(key)
    if decided is not None:  # the checks of this signature passed before: only those that read values remain
        chosen, plan = decided
        if expert_map is not None:
            _check_map_values(expert_map, w13.shape[0], topk_ids)
            expert_map = expert_map.contiguous()  # (the kernels index it with unit stride)
        out = _fresh_or_disjoint(out, x, w13, w2, **({} if out is None else _read_by_fused(
            topk_weights, topk_ids, w13_bias, w2_bias, expert_map, lora_ids)))
        _warn_if_gradients_asked(chosen, x, w13, w2, w13_bias, w2_bias, topk_weights)
        if plan is not None and plan(out, x, w13, w2, topk_weights, topk_ids.contiguous(), w13_bias, w2_bias,
                                     expert_map):
            return out
    else:
        check_tensor("x", x, ndim=2, dtypes=WEIGHT_DTYPES)
        E, _, H = _check_weights(x, w13, w2, activation, w13_bias, w2_bias)
        check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), device=x.device)
        check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32,), device=x.device)
        if topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"topk_weights and topk_ids must both be [T={x.shape[0]}, k], got "
                             f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
        if expert_map is not None:
            check_tensor("expert_map", expert_map, ndim=1, dtypes=(torch.int32,), device=x.device)
            _check_map_values(expert_map, E, topk_ids)
            expert_map = expert_map.contiguous()  # (the kernels index it with unit stride)
        check_lora(lora, lora_ids, x, E, w2.shape[2], H, batched=False)
        out = _options_and_out(x, w13, w2, act_quant, config, out, lora is None, **_read_by_fused(
            topk_weights, topk_ids, w13_bias, w2_bias, expert_map, lora_ids, lora))
        chosen = choose_backend(x, w13, backend, act_quant, op="fused", activation=activation, lora=lora,
                                w2=w2, top_k=topk_ids.shape[1], biases=(w13_bias, w2_bias),
                                expert_map=expert_map is not None, config=config)
        _warn_if_gradients_asked(chosen, x, w13, w2, w13_bias, w2_bias, topk_weights, *_lora_tensors(lora))
        planning = getattr(chosen, "plans", False) and key is not None  # kept with a checked signature only
        plan = chosen.fused(out, x, w13, w2, topk_weights, topk_ids.contiguous(), activation, w13_bias, w2_bias,
                            expert_map, config, act_quant, **_lora_args(lora, lora_ids),
                            **({"plan": True} if planning else {}))
        _VALIDATED.put(key, (chosen, plan if planning else None))
        return out  # the caller's tensor itself, whatever a runner returned
    chosen.fused(out, x, w13, w2, topk_weights, topk_ids.contiguous(), activation, w13_bias, w2_bias, expert_map,
                 config, act_quant, **_lora_args(lora, lora_ids))
    return out


# A repeated eager call without LoRA skips the checks and the oracle: its signature (moekit._calls), with the
# registered backends, maps to (the backend that served it, that backend's plan for the call or None).
_VALIDATED = CheckedCalls()


def _call_key(tensors: tuple, options: tuple) -> tuple | None:
    if torch.compiler.is_compiling():  # (before registry_version, which writes a global: a graph break)
        return None
    return CheckedCalls.signature(tensors, (*options, backends.registry_version()))


def _check_map_values(expert_map: torch.Tensor, num_local: int, topk_ids: torch.Tensor) -> None:
    """The checks that read an expert map's values (and, with the gate on, the ids against its length): on every
    call, checked signature or not."""
    check_expert_map_values(expert_map, num_local)
    if gate.active():
        check_ids_within_map(topk_ids, expert_map)


def _read_by_fused(topk_weights, topk_ids, w13_bias, w2_bias, expert_map, lora_ids, lora=None) -> dict:
    """The tensors a fused_experts call reads besides x and the weights: ``out`` must overlap none of them (a kernel
    may write a block of out before another program reads what lay there)."""
    return {"topk_weights": topk_weights, "topk_ids": topk_ids, "w13_bias": w13_bias, "w2_bias": w2_bias,
            "expert_map": expert_map, "lora_ids": lora_ids, **_read_by_lora(lora)}


def _read_by_batched(expert_num_tokens, w13_bias, w2_bias, lora_ids, lora=None) -> dict:
    """The tensors a batched_experts call reads besides x and the weights (see :func:`_read_by_fused`)."""
    return {"expert_num_tokens": expert_num_tokens, "w13_bias": w13_bias, "w2_bias": w2_bias, "lora_ids": lora_ids,
            **_read_by_lora(lora)}


def _read_by_lora(lora) -> dict:
    """The adapters' stacks and scaling (GEMM2 writes out before the W2 term reads them in the decode modes)."""
    if lora is None:
        return {}
    return {f"lora.{name}": getattr(lora, name) for name in ("w13_a", "w13_b", "w2_a", "w2_b", "scaling")
            if getattr(lora, name) is not None}


def _lora_tensors(lora) -> tuple:
    """The adapters' stacks, for the gradients warning (training adapters asks for gradients through them)."""
    return () if lora is None else tuple(t for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b) if t is not None)


def _fresh_or_disjoint(out, x, w13, w2, **other_inputs) -> torch.Tensor:
    """A new output, or ``out`` (its shape, dtype and layout were checked with the signature) if it overlaps none of
    the inputs: addresses change from call to call, so this check does too."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check_disjoint("out", out, {"x": x, **_weight_memory("w13", w13), **_weight_memory("w2", w2), **other_inputs})
    return out


def _lora_args(lora, lora_ids) -> dict:
    """The LoRA keywords of a backend call: none without adapters (backends without LoRA take none)."""
    return {} if lora is None else {"lora": lora, "lora_ids": lora_ids.contiguous()}


def batched_experts(
    x: torch.Tensor,
    expert_num_tokens: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "silu_and_mul",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    config: ExpertsConfig | None = None,
    act_quant: str | None = None,
    lora: ExpertsLoRA | None = None,
    lora_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched (masked) format: out[e, m] = expert_e(x[e, m]) for m < expert_num_tokens[e].

    Args:
        x: [E, M, H]; rows at or past expert_num_tokens[e] are padding and may hold anything,
            NaN included: they never influence valid rows.
        expert_num_tokens: int32 [E] (values above M are treated as M, negative ones as 0).
        w13, w2, activation, biases: as :func:`fused_experts` (no router weights here: they are
            applied when combining back to tokens, see :func:`moekit.layouts.combine_batched`).
        out: optional [E, M, H] contiguous tensor of x's dtype, written in place and returned.
        backend, config, act_quant: as :func:`fused_experts` (NVFP4 activation scales come from
            valid rows only: padding never moves them).
        lora: as :func:`fused_experts`.
        lora_ids: int32 [E, M], with ``lora``: each row's adapter (-1 for none). Padding rows' values are
            never read, but are checked like the others.

    Returns:
        [E, M, H] in x's dtype. Padding rows of the output are unspecified: the Triton backend
        never writes them (an ``out=`` keeps what it held there, a fresh output is uninitialized),
        the torch backend writes zeros.
    """
    key = None
    if lora is None and lora_ids is None:
        key = _call_key((x, expert_num_tokens, w13, w2, w13_bias, w2_bias, out),
                        ("batched", backend, config, act_quant, activation))
    decided = _VALIDATED.get(key)
    if decided is not None:  # checked before (see fused_experts)
        chosen, plan = decided
        out = _fresh_or_disjoint(out, x, w13, w2, **({} if out is None else _read_by_batched(
            expert_num_tokens, w13_bias, w2_bias, lora_ids)))
        _warn_if_gradients_asked(chosen, x, w13, w2, w13_bias, w2_bias)
        if plan is not None and plan(out, x, expert_num_tokens.contiguous(), w13, w2, w13_bias, w2_bias):
            return out
    else:
        check_tensor("x", x, ndim=3, dtypes=WEIGHT_DTYPES)
        E, _, H = _check_weights(x, w13, w2, activation, w13_bias, w2_bias)
        if x.shape[0] != E:
            raise ValueError(f"x must be [E={E}, M, H] (E from w13), got {tuple(x.shape)}")
        check_tensor("expert_num_tokens", expert_num_tokens, ndim=1, dtypes=(torch.int32,), device=x.device)
        check_shape("expert_num_tokens", expert_num_tokens, (E,))
        check_lora(lora, lora_ids, x, E, w2.shape[2], H, batched=True)
        out = _options_and_out(x, w13, w2, act_quant, config, out, **_read_by_batched(
            expert_num_tokens, w13_bias, w2_bias, lora_ids, lora))
        chosen = choose_backend(x, w13, backend, act_quant, op="batched", activation=activation, w2=w2,
                                lora=lora, biases=(w13_bias, w2_bias),
                                config=config)
        _warn_if_gradients_asked(chosen, x, w13, w2, w13_bias, w2_bias, *_lora_tensors(lora))
        planning = getattr(chosen, "plans", False) and key is not None  # (see fused_experts)
        plan = chosen.batched(out, x, expert_num_tokens.contiguous(), w13, w2, activation, w13_bias, w2_bias, config,
                              act_quant, **_lora_args(lora, lora_ids), **({"plan": True} if planning else {}))
        _VALIDATED.put(key, (chosen, plan if planning else None))
        return out
    chosen.batched(out, x, expert_num_tokens.contiguous(), w13, w2, activation, w13_bias, w2_bias, config, act_quant,
                   **_lora_args(lora, lora_ids))
    return out
