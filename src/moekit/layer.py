"""FusedMoE: the whole MoE layer as a module (router + routing + experts [+ shared expert])."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _invariant
from . import presets as _presets
from ._checks import check_shape, check_tensor, tensor_version
from .experts import ExpertsLoRA, check_act_quant, fused_experts
from .experts.api import check_quantized_stack
from .experts.lora import check_call as check_lora
from .formats import TYPES as QUANTIZED_TYPES
from .formats import FOUR_BIT_FORMATS, format_of, fp4
from .formats import prepare as prepare_weights
from .presets import MoESpec
from .routing import GateLinear, fused_router
from .routing.router import keep_dtypes_through


# The tensors of each quantized type that become buffers (names as the types' fields).
_QUANTIZED_PARTS = {"mxfp4": ("data", "scales"), "nvfp4": ("data", "scales", "global_scale"), "fp8": ("data", "scale")}
_LORA_PARTS = ("w13_a", "w13_b", "w2_a", "w2_b", "scaling")  # ExpertsLoRA's fields, buffers lora_<field>
_LORA_SCALING = "lora_scaling"  # set whenever adapters are loaded


class FusedMoE(nn.Module):
    """One MoE layer of a :class:`moekit.presets.MoESpec`.

    Parameters (moekit layouts, see :mod:`moekit.layouts`): ``gate`` (a :class:`GateLinear`,
    weight [E, H]), ``w13`` [E, 2I, H], ``w2`` [E, H, I], optional ``w13_bias`` [E, 2I] and
    ``w2_bias`` [E, H] (gpt-oss), ``correction_bias`` [E] fp32 (sigmoid_grouped), and for a
    shared expert ``shared_w13`` [2 * I * n_shared, H], ``shared_w2`` [H, I * n_shared].
    ``expert_map`` (int32 [E_global], buffer) is None unless experts are split over ranks.

    ``forward(x [..., H]) -> [..., H]`` in the parameters' dtype.
    """

    def __init__(self, spec: MoESpec, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(spec, MoESpec):
            raise TypeError(f"spec must be a MoESpec, got {type(spec).__name__}")
        self.spec = spec
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        factory = dict(dtype=dtype, device=device)
        self.gate = GateLinear(H, E, bias=spec.router_bias, params_dtype=dtype, device=device)
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H, **factory))
        self.w2 = nn.Parameter(torch.empty(E, H, I, **factory))
        self.w13_bias = nn.Parameter(torch.empty(E, 2 * I, **factory)) if spec.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(E, H, **factory)) if spec.expert_bias else None
        self.correction_bias = (nn.Parameter(torch.empty(E, dtype=torch.float32, device=device))
                                if spec.correction_bias else None)
        shared = I * spec.num_shared_experts
        self.shared_w13 = nn.Parameter(torch.empty(2 * shared, H, **factory)) if shared else None
        self.shared_w2 = nn.Parameter(torch.empty(H, shared, **factory)) if shared else None
        self.register_buffer("expert_map", None)
        self.weight_format = "dense"  # "mxfp4" / "nvfp4" / "fp8" after load_quantized_experts
        self.act_quant = None
        self._expert_shapes = {"w13": (E, 2 * I, H), "w2": (E, H, I)}
        self._quantized_meta: dict[str, dict] = {}
        self._quantized = None  # (the buffers it was built from, (w13, w2))
        self._lora = None  # (the buffers it was built from, the ExpertsLoRA)
        self._prepare_codes: bool | None = None  # load_quantized_experts' prepare (None: once the codes are on a GPU)
        self.register_state_dict_post_hook(_stored_codes)
        self.register_load_state_dict_pre_hook(_prepared_codes)
        self.reset_parameters()

    @classmethod
    def from_preset(cls, name: str, *, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str | None = None, scaled: bool = False) -> "FusedMoE":
        """A layer with the preset's shapes (``scaled=True``: :meth:`MoESpec.scaled`), random weights."""
        spec = _presets.get(name)
        return cls(spec.scaled() if scaled else spec, dtype=dtype, device=device)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random weights with unit-scale activations (benchmarks, tests); real use loads weights."""
        H, I = self.spec.hidden_size, self.spec.intermediate_size
        self.gate.reset_parameters()
        if self.weight_format == "dense":
            nn.init.normal_(self.w13, std=H ** -0.5)
            nn.init.normal_(self.w2, std=I ** -0.5)
        for p in (self.w13_bias, self.w2_bias):
            if p is not None:
                nn.init.normal_(p, std=0.02)
        if self.correction_bias is not None:
            nn.init.uniform_(self.correction_bias, 0.0, 0.1)
        if self.shared_w13 is not None:
            nn.init.normal_(self.shared_w13, std=H ** -0.5)
            nn.init.normal_(self.shared_w2, std=self.shared_w2.shape[1] ** -0.5)

    @torch.no_grad()
    def load_weights(self, **tensors: torch.Tensor) -> None:
        """Copy tensors into parameters by name (``gate_weight``, ``gate_bias``, ``w13``, ``w2``,
        ``w13_bias``, ``w2_bias``, ``correction_bias``, ``shared_w13``, ``shared_w2``), checking
        each shape first; dtypes are converted to the parameter's."""
        targets = {"gate_weight": self.gate.weight, "gate_bias": self.gate.bias}
        targets.update({name: getattr(self, name, None) for name in
                        ("w13", "w2", "w13_bias", "w2_bias", "correction_bias", "shared_w13", "shared_w2")})
        for name, value in tensors.items():
            if name not in targets:
                raise ValueError(f"unknown weight {name!r}; expected one of {sorted(targets)}")
            target = targets[name]
            if target is None:
                raise ValueError(f"{name} is not a parameter of a {self.spec.name} layer")
            check_tensor(name, value)
            check_shape(name, value, tuple(target.shape))
        for name, value in tensors.items():
            targets[name].copy_(value)

    @torch.no_grad()
    def load_quantized_experts(self, w13, w2, *, act_quant: str | None = "auto", prepare: bool | None = None) -> None:
        """Keep the experts in a low-precision format: :class:`moekit.formats.mxfp4.MXFP4Tensor`,
        :class:`moekit.formats.nvfp4.NVFP4Tensor` or :class:`moekit.formats.fp8.FP8Tensor` (per
        tensor, per channel or DeepSeek-V3's 128x128 blocks), both of one format, shapes
        [E, 2I, H] / [E, H, I]. Their parts become buffers (``w13_data``, ``w13_scales``,
        ``w13_global_scale`` / ``w13_scale``, same for w2) and the dense ``w13`` / ``w2``
        parameters are dropped.

        act_quant: what :func:`moekit.fused_experts` gets on every forward. ``"auto"``:
        ``"fp8_group"`` for FP8 weights (W8A8 on FP8 tensor cores, as DeepSeek-V3 runs), None for
        4-bit weights (W4A16: dequantized inside the kernels). None with FP8 weights is W8A16 (the
        torch backend dequantizes them).

        prepare: keep 4-bit experts in moekit's kernel-native byte layout (:func:`moekit.formats.prepare`: a new
        tensor of codes, made here once; the tensors passed in are left as they are). None (the default): where the
        stacks are on a CUDA device (the Triton kernels read either layout; the CPU's torch backend would convert
        the prepared codes back on every call; codes moved to a GPU later, by ``.to()``, are prepared then).
        The parts become the module's buffers as they are, without a copy (the codes too, unless prepared here,
        which makes new ones): a loader that reuses one staging tensor for several layers must pass each layer
        copies (``.clone()``), or every layer keeps the last one's scales.
        ``state_dict()`` gives and ``load_state_dict()`` takes the codes as
        checkpoints store them ("packed") either way: for prepared codes, ``state_dict()`` holds a converted copy
        of each stack (memory of the stacks' size, not the buffers themselves), and bytes written into
        ``w13_data`` / ``w2_data`` other than through ``load_state_dict`` must be in the buffers' layout
        (``expert_weights()[0].layout``). A module saved or written in place often is better loaded with
        ``prepare=False``. Write the buffers with torch's in-place ops (``copy_`` under ``no_grad``) or
        ``load_state_dict``: a write through ``.data`` bumps no version counter, and swizzled NVFP4 scales keep
        serving their unswizzled copy from before it.
        """
        fmt = format_of(w13)
        if fmt == "dense" or format_of(w2) != fmt:
            raise TypeError("w13 and w2 must both be MXFP4Tensor, NVFP4Tensor or FP8Tensor, "
                            f"got {type(w13).__name__} and {type(w2).__name__}")
        if prepare is not None and not isinstance(prepare, bool):
            raise TypeError(f"prepare must be True, False or None, got {type(prepare).__name__}")
        if act_quant == "auto":
            act_quant = "fp8_group" if fmt == "fp8" else None
        check_act_quant(act_quant)
        for name, q in (("w13", w13), ("w2", w2)):
            expect = self._expert_shapes[name]
            if tuple(q.shape) != expect:
                raise ValueError(f"{name} must have shape {expect}, got {tuple(q.shape)}")
            check_quantized_stack(name, q, 3, w13.data.device)  # what fused_experts would refuse, before a buffer goes
        if prepare or (prepare is None and w13.data.is_cuda):
            w13, w2 = prepare_weights(w13), prepare_weights(w2)
        for name, q in (("w13", w13), ("w2", w2)):
            for part in _QUANTIZED_PARTS.values():  # a format loaded before may have left other parts
                for field in part:
                    self._buffers.pop(f"{name}_{field}", None)
            self._parameters.pop(name, None)
            for field in _QUANTIZED_PARTS[fmt]:
                self.register_buffer(f"{name}_{field}", getattr(q, field))
            self._quantized_meta[name] = {k: getattr(q, k) for k in ("shape", "swizzled", "granularity", "layout")
                                          if hasattr(q, k)}
        self.weight_format = fmt
        self.act_quant = act_quant
        self._prepare_codes = prepare
        self._quantized = None

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``, ``.cuda()`` and the like: quantized experts move between devices but keep their
        dtypes (a cast would destroy FP8 codes and block scales), as do the fp32 correction bias, the gate's bias
        and the adapters' fp32 scalings (a bf16 1/3 is 0.334, a half 1e5 is Inf); the rest of the module follows
        ``fn``."""
        kept = [f"{name}_{field}" for name in ("w13", "w2") for field in _QUANTIZED_PARTS.get(self.weight_format, ())]
        keep_dtypes_through(self, (*kept, "correction_bias", _LORA_SCALING),
                            lambda: super(FusedMoE, self)._apply(fn, recurse))
        self._quantized = None
        if self._prepare_codes is None and self.weight_format in FOUR_BIT_FORMATS:
            for name, meta in self._quantized_meta.items():  # codes that reached a GPU as given: prepared now
                data = self._buffers.get(f"{name}_data")
                if data is not None and data.is_cuda and meta.get("layout") == "packed":
                    self._buffers[f"{name}_data"] = fp4.to_pairs(data)
                    meta["layout"] = "pairs"
        return self

    def expert_weights(self):
        """(w13, w2) as fused_experts takes them: dense parameters, or the quantized tensors over
        this module's buffers (built once, again only after the buffers were replaced, e.g. by
        ``.to()``)."""
        if self.weight_format == "dense":
            params = self._parameters  # (see route: the dicts, not __getattr__)
            return params["w13"], params["w2"]
        parts = tuple(self._buffers[f"{name}_{field}"] for name in ("w13", "w2")
                      for field in _QUANTIZED_PARTS[self.weight_format])
        cached = self._quantized
        if cached is None or len(cached[0]) != len(parts) or any(a is not b for a, b in zip(cached[0], parts)):
            cls = QUANTIZED_TYPES[self.weight_format]
            built = tuple(cls(**{field: getattr(self, f"{name}_{field}") for field in _QUANTIZED_PARTS[self.weight_format]},
                              **{k: v for k, v in self._quantized_meta[name].items() if k in cls.__dataclass_fields__})
                          for name in ("w13", "w2"))
            cached = self._quantized = (parts, built)
        return cached[1]

    @torch.no_grad()
    def load_lora(self, lora: ExpertsLoRA | None) -> None:
        """Serve expert LoRA adapters (:class:`moekit.experts.ExpertsLoRA`, stacked over this layer's experts in its
        dtype; None removes them). Their tensors become buffers (``lora_w13_a``, ``lora_w13_b``, ``lora_w2_a``,
        ``lora_w2_b``, ``lora_scaling``), so that ``state_dict()`` and ``.to()`` carry them; ``forward(x,
        lora_ids=...)`` then picks each token's adapter."""
        if lora is not None:
            H, I = self.spec.hidden_size, self.spec.intermediate_size
            probe = torch.empty(0, H, dtype=self.gate.weight.dtype, device=self.gate.weight.device)
            check_lora(lora, torch.empty(0, dtype=torch.int32, device=probe.device), probe,
                       self._expert_shapes["w13"][0], I, H, batched=False)
        for field in _LORA_PARTS:
            self._buffers.pop(f"lora_{field}", None)
            if lora is not None and getattr(lora, field) is not None:
                self.register_buffer(f"lora_{field}", getattr(lora, field))
        self._lora = None

    def expert_lora(self) -> ExpertsLoRA | None:
        """The loaded adapters as fused_experts takes them (built once over this module's buffers, again only after
        they were replaced, e.g. by ``.to()``), or None."""
        if self._buffers.get(_LORA_SCALING) is None:  # no adapters: the common case, on every forward
            return None
        parts = tuple(self._buffers.get(f"lora_{field}") for field in _LORA_PARTS)
        scaling_version = tensor_version(parts[-1])
        cached = self._lora
        if (cached is None or any(a is not b for a, b in zip(cached[0], parts))
                or (cached[1].scaling is not parts[-1] and (scaling_version is None or cached[2] != scaling_version))):
            # A lora_scaling the adapters take as it is (fp32 [adapters], contiguous) is read by every call; one they
            # convert (0-dim, another dtype, strided) is a copy, made again after each write torch sees (or every
            # call for an inference tensor, which keeps no version).
            cached = self._lora = (parts, ExpertsLoRA(*parts), scaling_version)
        return cached[1]

    def route(self, x2: torch.Tensor, *, replay_ids: torch.Tensor | None = None,
              record_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights fp32 [T, k], topk_ids int32 [T, k]) of tokens x2 [T, H]; routing replay and
        recording as :func:`moekit.route`."""
        spec = self.spec
        kwargs = spec.routing_kwargs()
        # Parameters, buffers and the gate read from the module's own dicts on the per-call path: nn.Module's
        # __getattr__ costs about a microsecond a name, a dozen names per forward (eager host time)
        corr = self._parameters.get("correction_bias")
        if corr is not None:
            kwargs["correction_bias"] = corr
        gate = self._modules["gate"]
        return fused_router(x2, gate._parameters["weight"], gate._parameters.get("bias"), top_k=spec.top_k,
                            method=spec.routing, lora=gate.lora, replay_ids=replay_ids, record_ids=record_ids,
                            **kwargs)

    def forward(self, x: torch.Tensor, *, replay_ids: torch.Tensor | None = None,
                record_ids: torch.Tensor | None = None, lora_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]. ``record_ids`` (int32/int64 [T, k], T = x's tokens): the experts each token
        chose are copied into it; ``replay_ids`` ([T, k]): those experts serve instead of a selection, with the
        weights the routing method gives them from this call's logits (routing replay). ``lora_ids`` (int32,
        x's shape without H, or [T]): each token's adapter of :meth:`load_lora`'s, -1 for none."""
        spec = self.spec
        params = self._parameters  # (see route: the dicts, not __getattr__)
        expert_map = self._buffers.get("expert_map")
        self._check_input(x, expert_map)
        x2 = x if x.dim() == 2 else x.reshape(-1, spec.hidden_size)  # (a reshape or view costs a microsecond)
        weights, ids = self.route(x2, replay_ids=replay_ids, record_ids=record_ids)
        if replay_ids is not None and expert_map is not None:
            # a replayed id outside [0, E) has weight 0 and contributes nothing (route's contract), as -1 does here:
            # the experts' check of ids against the map (the gate's) would refuse it on a shard only
            ids = torch.where((ids >= 0) & (ids < spec.num_experts), ids, -1)
        w13, w2 = self.expert_weights()
        lora = self.expert_lora()
        if lora_ids is not None and lora is not None:
            if not isinstance(lora_ids, torch.Tensor) or tuple(lora_ids.shape) not in (tuple(x.shape[:-1]),
                                                                                     (x2.shape[0],)):
                raise ValueError(f"lora_ids must have one entry per token, shape {tuple(x.shape[:-1])} or "
                                 f"({x2.shape[0]},), got {getattr(lora_ids, 'shape', type(lora_ids).__name__)}")
            lora_ids = lora_ids.reshape(-1)
        elif lora_ids is not None:
            raise ValueError("lora_ids was given, but no adapters are loaded (load_lora)")
        elif lora is not None:  # adapters loaded, none asked for: the base layer
            lora = None
        out = fused_experts(x2, w13, w2, weights, ids, activation=spec.activation,
                            w13_bias=params.get("w13_bias"), w2_bias=params.get("w2_bias"), expert_map=expert_map,
                            act_quant=self.act_quant, lora=lora, lora_ids=lora_ids)
        shared_w13 = params.get("shared_w13")
        if shared_w13 is not None:
            out = out + self._shared_expert(x2, shared_w13, params["shared_w2"])
        return out if x.dim() == 2 else out.view(x.shape)

    @staticmethod
    def _shared_expert(x2: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """The shared expert (w13 [2 * I_shared, H], w2 [H, I_shared]) on x2 [T, H] -> [T, H] in x2's dtype. In
        batch-invariant mode it runs as a one-expert fused_experts call (cuBLAS and CPU BLAS choose their kernels by
        the token count; the experts' kernels fix their order per shape)."""
        if w13.dim() != 2 or w2.dim() != 2 or w13.shape[1] != x2.shape[1] or w2.shape != (x2.shape[1], w13.shape[0] // 2):
            raise ValueError(f"shared_w13 must be [2 * I_shared, H={x2.shape[1]}] and shared_w2 [H, I_shared], got "
                             f"{tuple(w13.shape)} and {tuple(w2.shape)}")
        if w13.dtype != x2.dtype or w2.dtype != x2.dtype:
            raise TypeError(f"shared_w13 and shared_w2 must have x's dtype {x2.dtype}, got {w13.dtype} and {w2.dtype}")
        if _invariant.enabled():
            T = x2.shape[0]
            ones = torch.ones(T, 1, dtype=torch.float32, device=x2.device)
            first = torch.zeros(T, 1, dtype=torch.int32, device=x2.device)
            return fused_experts(x2, w13.unsqueeze(0), w2.unsqueeze(0), ones, first)
        gate, up = F.linear(x2, w13).float().chunk(2, dim=-1)
        return F.linear((F.silu(gate) * up).to(x2.dtype), w2)

    def _check_input(self, x, emap) -> None:
        """x [..., H] of the layer's dtype; an expert_map of one entry per expert of the router (E)."""
        H, E = self.spec.hidden_size, self.spec.num_experts
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        shape = x.shape
        if not shape or shape[-1] != H:
            raise ValueError(f"x must have the layer's hidden size H={H} in its last dimension, got shape {tuple(shape)}")
        gate_weight = self._modules["gate"]._parameters["weight"]
        if x.dtype != gate_weight.dtype:
            raise TypeError(f"x must have the layer's dtype {gate_weight.dtype}, got {x.dtype}")
        # stacks reassigned with another expert count (no loader checked them): ids past the stack would be no
        # expert to the kernels, and their tokens' outputs zeros
        params, local = self._parameters, self._expert_shapes["w13"][0]
        w13, w2 = params.get("w13"), params.get("w2")  # (dense stacks; quantized ones are checked when loaded)
        if gate_weight.shape[0] != E or (w13 is not None and (w13.shape[0] != local or w2.shape[0] != local)):
            raise ValueError(f"the router and the expert stacks must hold the layer's experts: gate.weight "
                             f"{tuple(gate_weight.shape)} for E={E}, w13 {None if w13 is None else tuple(w13.shape)} "
                             f"and w2 {None if w2 is None else tuple(w2.shape)} for {local} experts")
        if emap is not None and (emap.dim() != 1 or emap.shape[0] != E):
            raise ValueError(f"expert_map must have one entry per expert of the router, shape ({E},), "
                             f"got {tuple(emap.shape)}")

    def extra_repr(self) -> str:
        s = self.spec
        return (f"{s.name}: H={s.hidden_size}, I={s.intermediate_size}, E={s.num_experts}, k={s.top_k}, "
                f"routing={s.routing}, activation={s.activation}, shared={s.num_shared_experts}")


def _pairs_codes(module: FusedMoE) -> list[str]:
    """The buffers of ``module`` that hold 4-bit codes in the "pairs" byte layout."""
    return [f"{name}_data" for name, meta in module._quantized_meta.items() if meta.get("layout") == "pairs"
            and module.weight_format in FOUR_BIT_FORMATS]


def _stored_codes(module: FusedMoE, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: prepared 4-bit codes leave the module as checkpoints store them."""
    for name in _pairs_codes(module):
        if prefix + name in state_dict:
            state_dict[prefix + name] = fp4.from_pairs(state_dict[prefix + name])


def _prepared_codes(module: FusedMoE, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: quantized parts arrive in the buffers' own dtypes (load_state_dict would cast them:
    int8 codes to uint8 kept their bytes in the checkpoint's layout, and uint8 scale bytes became E4M3 values), and
    checkpoint codes enter a module that keeps them prepared in its layout."""
    for name in module._quantized_meta:
        for field in _QUANTIZED_PARTS[module.weight_format]:
            key = f"{name}_{field}"
            value, buffer = state_dict.get(prefix + key), module._buffers.get(key)
            if (isinstance(value, torch.Tensor) and buffer is not None and buffer.element_size() == 1
                    and value.dtype != buffer.dtype):
                raise TypeError(f"load_state_dict: {prefix + key} must have dtype {buffer.dtype} (the layer's "
                                f"{module.weight_format} {field}: bytes a cast would change), got {value.dtype}")
    for name in _pairs_codes(module):
        value, buffer = state_dict.get(prefix + name), module._buffers.get(name)
        if (isinstance(value, torch.Tensor) and buffer is not None and value.dtype == torch.uint8
                and value.shape == buffer.shape):  # else load_state_dict names the mismatch
            state_dict[prefix + name] = fp4.to_pairs(value)
