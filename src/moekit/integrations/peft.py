"""PEFT LoRA adapters on MoE experts, as moekit's :class:`moekit.experts.ExpertsLoRA`.

PEFT adapts transformers' fused expert stacks through ``LoraConfig(target_parameters=[...])`` (e.g. Qwen3-MoE's
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]; gpt-oss's transposed [E, H, 2I] and
[E, I, H]). Each targeted parameter gets a ``peft.tuners.lora.ParamWrapper``, the wrappers of one experts module
nested: its ``lora_A[name].weight`` is [E * r, in] (expert-major rows: expert e's A is rows e*r .. e*r + r - 1) and
its ``lora_B[name].weight`` is [out, r * E] (expert-minor columns: expert e's B is columns e, e + E, ...), its delta
``scaling[name] * B_e A_e`` (lora_alpha / r, or / sqrt(r) with rslora), with ``in``/``out`` the parameter's input and
output sizes whatever its storage order. That is moekit's layout once the rows and columns are regrouped per expert:
A [r, in], B [out, r], B's rows in the stored weight's row order (so moekit's w13 as the transformers backend takes
it: [gate; up] halves, or gpt-oss's interleaved rows).

:func:`convert` turns every adapted experts module of a PEFT model into one ExpertsLoRA (its adapters stacked, ranks
zero-padded to the largest), keyed by the module's name; :func:`experts_lora` does one module. Nothing here imports
PEFT: the wrappers are recognized by their attributes (``parameter_name``, ``lora_A``, ``lora_B``, ``scaling``,
``base_layer``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..experts import ExpertsLoRA

# the experts module's parameter -> moekit's matrix
PARAMETERS = {"gate_up_proj": "w13", "down_proj": "w2"}


def _is_param_wrapper(module: nn.Module) -> bool:
    return all(hasattr(module, a) for a in ("parameter_name", "lora_A", "lora_B", "scaling", "base_layer"))


def unwrap(module: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """(the experts module under a chain of PEFT ParamWrappers, the wrappers from the outermost in)."""
    wrappers = []
    while _is_param_wrapper(module):
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def experts_lora(wrapper: nn.Module, adapters: list[str] | None = None,
                 dtype: torch.dtype | None = None) -> ExpertsLoRA:
    """The adapters of the outermost PEFT ParamWrapper around one experts module, as one ExpertsLoRA over its experts.

    Args:
        wrapper: the ParamWrapper that PEFT put in place of the experts module (``model.layers[i].mlp.experts`` of a
            PEFT model).
        adapters: which of PEFT's adapters, in the order of moekit's adapter indices (default: every adapter of the
            wrappers, in their order). An adapter absent from one of the parameters gets zeros there.
        dtype: the adapters' dtype (default: the experts' stored weights' dtype, which moekit's activations have).

    Returns:
        ExpertsLoRA with ``w13_a`` [n, E, r, H], ``w13_b`` [n, E, 2I, r] (if gate_up_proj is adapted), ``w2_a``
        [n, E, r, I], ``w2_b`` [n, E, H, r] (if down_proj is), r the largest rank, scaling [n] PEFT's (where PEFT
        scales the two parameters differently, the larger, and the other parameter's B carries the ratio).
    """
    experts, wrappers = unwrap(wrapper)
    if not wrappers:
        raise ValueError(f"{type(wrapper).__name__} is not a PEFT ParamWrapper (no LoRA on expert parameters)")
    by_param = {}
    for w in wrappers:
        if w.parameter_name not in PARAMETERS:
            raise ValueError(f"PEFT adapts {type(experts).__name__}.{w.parameter_name}; moekit takes LoRA on "
                             f"{sorted(PARAMETERS)} only")
        by_param[PARAMETERS[w.parameter_name]] = w
    names = list(adapters) if adapters is not None else list(dict.fromkeys(
        a for w in wrappers for a in w.lora_A.keys()))
    if not names:
        raise ValueError("the PEFT wrappers hold no adapter")
    missing = [a for a in names if not any(a in w.lora_A for w in wrappers)]
    if missing:
        raise ValueError(f"adapters {missing} are on none of {type(experts).__name__}'s parameters "
                         f"(its adapters: {sorted({a for w in wrappers for a in w.lora_A.keys()})})")
    dtype = dtype or getattr(experts, next(iter(by_param.values())).parameter_name).dtype
    rank = max(w.r[a] for w in wrappers for a in names if a in w.lora_A)
    # moekit takes one scaling per adapter. Where PEFT scales gate_up_proj and down_proj differently (rank_pattern,
    # alpha_pattern), the adapter takes the larger and the other parameter's B carries the ratio (at most 1).
    scaling = [max((float(w.scaling[name]) for w in by_param.values() if name in w.lora_A), key=abs, default=1.0)
               for name in names]
    parts = {}
    for which, w in by_param.items():
        a_stack, b_stack = [], []
        for i, name in enumerate(names):
            a, b = _factors(w, name, rank)
            if name in w.lora_A and float(w.scaling[name]) != scaling[i]:
                b = b.float() * (float(w.scaling[name]) / scaling[i])
            a_stack.append(a.to(dtype))
            b_stack.append(b.to(dtype))
        parts[which + "_a"], parts[which + "_b"] = torch.stack(a_stack), torch.stack(b_stack)
    return ExpertsLoRA(**parts, scaling=scaling)


def _factors(wrapper: nn.Module, name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [E, rank, in], B [E, out, rank]) of adapter ``name`` on one wrapped parameter, zero-padded to ``rank``
    (zeros altogether when the adapter does not adapt it)."""
    E, fan_in, fan_out = wrapper.num_experts, wrapper.in_features, wrapper.out_features
    if name not in wrapper.lora_A:
        ref = next(iter(wrapper.lora_A.values())).weight
        return ref.new_zeros(E, rank, fan_in), ref.new_zeros(E, fan_out, rank)
    a = wrapper.lora_A[name].weight.detach()
    b = wrapper.lora_B[name].weight.detach()
    r = wrapper.r[name]
    if tuple(a.shape) != (E * r, fan_in) or tuple(b.shape) != (fan_out, r * E):
        raise ValueError(f"PEFT adapter {name!r} on {wrapper.parameter_name}: expected lora_A [{E * r}, {fan_in}] and "
                         f"lora_B [{fan_out}, {r * E}] (E={E}, r={r}), got {tuple(a.shape)} and {tuple(b.shape)}")
    a = a.reshape(E, r, fan_in)
    b = b.reshape(fan_out, r, E).permute(2, 0, 1)
    if r < rank:
        a = torch.nn.functional.pad(a, (0, 0, 0, rank - r))
        b = torch.nn.functional.pad(b, (0, rank - r))
    return a, b


def convert(model: nn.Module, adapters: list[str] | None = None,
            dtype: torch.dtype | None = None) -> dict[str, ExpertsLoRA]:
    """{name of each PEFT-wrapped experts module in ``model``: its ExpertsLoRA} (see :func:`experts_lora`).

    ``model``: a PEFT model (``peft.get_peft_model`` or ``PeftModel.from_pretrained``) whose LoraConfig targets expert
    parameters. The names are ``model.named_modules()``'s of the outermost wrappers (where the experts module was).
    """
    found = {}
    inner = set()
    for name, module in model.named_modules():
        if id(module) in inner or not _is_param_wrapper(module):
            continue
        _, wrappers = unwrap(module)
        inner.update(id(w) for w in wrappers[1:])
        found[name] = experts_lora(module, adapters, dtype)
    return found


def active_factors(experts: nn.Module, parameter: str):
    """(the stored weight, (A [1, E, r, in], B [1, E, out, r], scaling)) of ``experts.parameter`` while PEFT
    applies one adapter to it through its low-rank factors (PEFT's ``_LoraFactorsProxy`` parametrization, which
    folds them into the weight when the parameter is read: never read here); (the parameter as read, None)
    otherwise: no parametrization, or another one (several adapters, or a delta PEFT merged itself); (None, None)
    without such a parameter."""
    parametrizations = getattr(experts, "parametrizations", None)
    if parametrizations is None or parameter not in parametrizations:
        return getattr(experts, parameter, None), None
    chain = parametrizations[parameter]
    proxy = chain[0] if len(chain) == 1 else None
    if proxy is None or not all(hasattr(proxy, a) for a in ("lhs", "rhs", "scaling")):
        return getattr(experts, parameter), None
    if getattr(experts, "is_transposed", False):  # PEFT's factors of a [E, in, out] stack: A^T [E, in, r], B^T
        a, b = proxy.lhs.transpose(1, 2), proxy.rhs.transpose(1, 2)
    else:  # of a [E, out, in] stack: B [E, out, r], A [E, r, in]
        a, b = proxy.rhs, proxy.lhs
    return chain.original, (a.unsqueeze(0), b.unsqueeze(0), float(proxy.scaling))
