"""moekit in Hugging Face transformers models, two ways.

- ``experts_implementation="moekit"``: importing this module registers moekit in transformers'
  ExpertsInterface (:func:`register`), so every MoE model built on it can run its experts on moekit,
  chosen with ``from_pretrained(..., experts_implementation="moekit")`` or
  ``model.set_experts_implementation("moekit")``; router and routing stay transformers'
  (:mod:`moekit.integrations.transformers_experts` says what is served and how).
- :func:`patch` replaces the whole MoE blocks of GptOss, Mixtral, Qwen3-MoE and DeepseekV3 models with
  :class:`MoekitBlock` modules (moekit's fp32 router and routing too) that share (or, for gpt-oss's
  transposed layout, convert) the same weights; :func:`unpatch` restores them.

    report = moekit.integrations.transformers.patch(model)
    print(report)            # what was replaced, what was left alone and why
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import _invariant, layouts
from ..layer import FusedMoE
from ..presets import MoESpec
from .transformers_experts import NAME, activation_of, experts_forward, forget, register

__all__ = ["NAME", "MoekitBlock", "PatchReport", "experts_forward", "forget", "patch", "register", "unpatch"]


@dataclass
class PatchReport:
    replaced: list[tuple[str, str]] = field(default_factory=list)      # (module path, original class)
    left_alone: list[tuple[str, str]] = field(default_factory=list)    # (module path, why)
    batch_invariant: bool = False  # patch() turned moekit's batch-invariant mode on

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} MoE block(s) with moekit layers"
                 + (", batch-invariant mode on (process-wide)" if self.batch_invariant else "")]
        lines += [f"  {path}: {cls} -> MoekitBlock" for path, cls in self.replaced]
        lines += [f"  {path}: left alone ({why})" for path, why in self.left_alone]
        return "\n".join(lines)


class MoekitBlock(nn.Module):
    """A transformers MoE block served by a :class:`moekit.FusedMoE`; same inputs and outputs."""

    def __init__(self, layer: FusedMoE, original: nn.Module, returns_router_scores: bool) -> None:
        super().__init__()
        self.moe = layer
        self.returns_router_scores = returns_router_scores
        object.__setattr__(self, "original", original)  # kept for unpatch, not a submodule (no double weights)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        collected = _router_logits_collector()
        if collected is not None:  # output_router_logits: what the replaced router module reported (its output 0)
            collected.append(self.moe.gate(hidden_states.reshape(-1, self.moe.spec.hidden_size)))
        out = self.moe(hidden_states)
        if self.returns_router_scores:  # GptOssMLP's contract: (hidden_states, router_scores)
            spec = self.moe.spec
            weights, _ = self.moe.route(hidden_states.reshape(-1, spec.hidden_size))
            return out, weights.to(hidden_states.dtype)
        return out


def _router_logits_collector() -> list | None:
    """The list transformers collects router logits into while a call asks for them (``output_router_logits``),
    else None. transformers records them with forward hooks on its router modules, which a patched block no longer
    calls (its auxiliary loss then failed on an empty tuple): the block appends its own, fp32 logits [T, E]. The
    collector is transformers' own context variable (utils/output_capturing); a version without it collects none."""
    collector = _COLLECTOR or _find_collector()
    collected = collector.get() if collector is not False else None
    return collected.get("router_logits") if isinstance(collected, dict) else None


_COLLECTOR = None  # transformers' context variable, found on the first call (False: this transformers has none)


def _find_collector():
    global _COLLECTOR
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        _active_collector = False
    _COLLECTOR = _active_collector
    return _COLLECTOR


def _spec(name, cfg, hidden, inter, experts, **kw) -> MoESpec:
    return MoESpec(name=name, hidden_size=hidden, intermediate_size=inter, num_experts=experts,
                   top_k=cfg.num_experts_per_tok, **kw)


def _share(layer: FusedMoE, name: str, tensor: torch.Tensor) -> None:
    """Make ``layer.<name>`` the very tensor (shared storage, no copy) when layouts agree."""
    setattr(layer, name, tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False))


def _from_qwen3_or_mixtral(block, cfg, name, dtype) -> FusedMoE:
    E, two_i, H = block.experts.gate_up_proj.shape
    renorm = getattr(cfg, "norm_topk_prob", True)
    spec = _spec(name, cfg, H, two_i // 2, E, routing="softmax_topk", activation="silu_and_mul", renormalize=renorm)
    return _build(spec, block.gate.weight, None, block.experts.gate_up_proj, block.experts.down_proj, dtype)


def _from_deepseek_v3(block, cfg, name, dtype) -> FusedMoE:
    E, two_i, H = block.experts.gate_up_proj.shape
    shared = block.shared_experts
    spec = _spec(name, cfg, H, two_i // 2, E, routing="sigmoid_grouped", activation="silu_and_mul",
                 renormalize=cfg.norm_topk_prob, num_groups=cfg.n_group, topk_groups=cfg.topk_group,
                 routed_scaling_factor=cfg.routed_scaling_factor, correction_bias=True,
                 num_shared_experts=shared.gate_proj.weight.shape[0] // (two_i // 2))
    layer = _build(spec, block.gate.weight, None, block.experts.gate_up_proj, block.experts.down_proj, dtype)
    with torch.no_grad():
        layer.correction_bias.copy_(block.gate.e_score_correction_bias.float())
        layer.shared_w13.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        layer.shared_w2.copy_(shared.down_proj.weight)
    return layer


def _from_gpt_oss(block, cfg, name, dtype) -> FusedMoE:
    ex = block.experts
    E, H, two_i = ex.gate_up_proj.shape
    spec = _spec(name, cfg, H, two_i // 2, E, routing="topk_softmax", activation="swiglu_oai", router_bias=True,
                 expert_bias=True)
    w13, w2 = layouts.from_hf(ex.gate_up_proj, ex.down_proj)        # transposed: converted (a copy)
    layer = _build(spec, block.router.weight, block.router.bias, w13, w2, dtype)
    with torch.no_grad():
        layer.w13_bias.copy_(ex.gate_up_proj_bias)
        layer.w2_bias.copy_(ex.down_proj_bias)
    return layer


def _build(spec, router_w, router_b, w13, w2, dtype) -> FusedMoE:
    dtype = dtype or w13.dtype
    with torch.device("meta"):
        layer = FusedMoE(spec, dtype=dtype)
    layer = layer.to_empty(device=w13.device)
    shared_ok = w13.dtype == dtype
    _share(layer, "w13", w13 if shared_ok else w13.to(dtype))
    _share(layer, "w2", w2 if shared_ok else w2.to(dtype))
    _share(layer.gate, "weight", router_w if router_w.dtype == dtype else router_w.to(dtype))
    with torch.no_grad():
        if router_b is not None:
            layer.gate.bias.copy_(router_b.float())
        for p in (layer.w13_bias, layer.w2_bias, layer.correction_bias, layer.shared_w13, layer.shared_w2):
            if p is not None:
                p.zero_()
    return layer


def _peft_wrapped(block: nn.Module) -> str | None:
    """Why a block whose experts or router PEFT wraps is left alone: moekit's layer would take the weights without
    the adapters (and the wrappers hide the stacks)."""
    if any(hasattr(m, "base_layer") and hasattr(m, "lora_A") for m in block.modules()):
        return ("PEFT adapters wrap its experts or router: experts_implementation='moekit' serves expert adapters, "
                "or merge them first (merge_and_unload)")
    return None


def _sharded_experts(block: nn.Module) -> str | None:
    """Why a block transformers runs expert-parallel (its experts' weights DTensors, swapped for each rank's local
    shard inside its own forward) is left alone: moekit's layer would hold the DTensors and fail in its first
    matmul; experts_implementation="moekit" serves such blocks."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module):
        return None
    sharded = getattr(experts, "_is_expert_parallel", False) or any(
        type(p).__name__ == "DTensor" for p in block.parameters())
    if sharded:
        return ("transformers runs its experts expert-parallel (DTensor weights): patch() takes whole stacks; "
                "experts_implementation='moekit' serves expert-parallel blocks, moekit.distributed shards moekit's "
                "own layers")
    return None


def _quantized_experts(block: nn.Module) -> str | None:
    """Why a block whose experts transformers keeps quantized (FineGrainedFP8's FP8 codes with ``*_scale_inv``,
    MXFP4 ``*_blocks`` and ``*_scales``, any one-byte stack) is left alone: the converters read plain weight
    stacks, and would take the codes as values without their scales."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module):
        return None
    for name, t in (*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)):
        if t.element_size() == 1 or name.endswith(("_scale_inv", "_scales", "_blocks")):
            return (f"its experts are quantized ({type(experts).__name__}.{name}: {str(t.dtype).removeprefix('torch.')}"
                    f" {tuple(t.shape)}): patch() takes plain weight stacks; give the codes and scales to "
                    "FusedMoE.load_quantized_experts (moekit.formats.FP8Tensor, MXFP4Tensor) or load the "
                    "checkpoint dequantized")
    return None


def _unserved_activation(block: nn.Module, cls: str) -> str | None:
    """Why moekit's layer would compute another function than ``block`` (its config's activation, gpt-oss's swiglu
    limit or alpha), or None: the experts' gate function and a shared expert's activation, each run on a probe."""
    want = "swiglu_oai" if cls == "GptOssMLP" else "silu_and_mul"
    experts = block.experts
    two_i = experts.gate_up_proj.shape[2 if cls == "GptOssMLP" else 1]
    if not hasattr(experts, "_apply_gate") or activation_of(experts, two_i) != want:
        return f"its experts' gate function is not moekit's {want} (the config's activation, limit or alpha)"
    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        probe = torch.linspace(-12, 12, 97, dtype=torch.float64)
        with torch.no_grad():
            if not torch.allclose(shared.act_fn(probe), F.silu(probe), rtol=1e-6, atol=1e-9):
                return "its shared expert's activation is not SiLU"
    return None


CONVERTERS = {  # transformers class name -> (converter, returns (hidden, router_scores))
    "Qwen3MoeSparseMoeBlock": (_from_qwen3_or_mixtral, False),
    "MixtralSparseMoeBlock": (_from_qwen3_or_mixtral, False),
    "DeepseekV3MoE": (_from_deepseek_v3, False),
    "GptOssMLP": (_from_gpt_oss, True),
}


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")


def patch(model: nn.Module, *, dtype: torch.dtype | None = None, batch_invariant: bool = False) -> PatchReport:
    """Replace every supported MoE block of ``model`` in place; returns what was done and why.

    ``batch_invariant=True`` also turns on moekit's batch-invariant mode (:func:`moekit.set_batch_invariant`, for
    the whole process): the patched blocks then give each token bits independent of its batch. The model's other
    layers (attention, norms, the LM head) are transformers' own and need their own switch."""
    _check_model(model)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    if batch_invariant:
        _invariant.set_batch_invariant(True)
    report = PatchReport(batch_invariant=batch_invariant)
    cfg = getattr(model, "config", None)
    for path, module in list(model.named_modules()):
        cls = type(module).__name__
        if cls not in CONVERTERS:
            # (a model's dense MLPs beside its MoE blocks, e.g. Qwen3MoeMLP, have no experts: not MoE blocks)
            quantized = _quantized_experts(module)
            if quantized:  # e.g. transformers' Mxfp4GptOssMLP in place of GptOssMLP
                report.left_alone.append((path, f"{cls}: {quantized}"))
            elif ("moe" in cls.lower() and not isinstance(module, MoekitBlock) and cls.endswith(("Block", "MoE", "MLP"))
                    and hasattr(module, "experts")):
                report.left_alone.append((path, f"{cls} has no moekit converter"))
            continue
        if module.training and getattr(module, "jitter_noise", 0):
            report.left_alone.append((path, "training with router jitter noise (moekit layers are for inference)"))
            continue
        why = (_peft_wrapped(module) or _sharded_experts(module) or _quantized_experts(module)
               or _unserved_activation(module, cls))
        if why:
            report.left_alone.append((path, why))
            continue
        convert, returns_scores = CONVERTERS[cls]
        layer = convert(module, getattr(module, "config", None) or cfg, f"{cls}@{path}", dtype)
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, MoekitBlock(layer, module, returns_scores))
        report.replaced.append((path, cls))
    return report


def unpatch(model: nn.Module) -> int:
    """Put the original transformers blocks back; returns how many were restored."""
    _check_model(model)
    restored = 0
    for path, module in list(model.named_modules()):
        if isinstance(module, MoekitBlock):
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, child, module.original)
            restored += 1
    return restored


register()  # experts_implementation="moekit" from the moment this module is imported
