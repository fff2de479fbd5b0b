"""moekit as an experts backend of Hugging Face transformers: ``experts_implementation="moekit"``.

transformers 5 keeps a registry of experts forwards (``transformers.integrations.moe.ExpertsInterface``)
that every MoE model built with its ``@use_experts_implementation`` experts modules dispatches to, chosen
with ``from_pretrained(..., experts_implementation=NAME)`` or ``model.set_experts_implementation(NAME)``.
:func:`register` adds moekit there (importing :mod:`moekit.integrations.transformers` does it). The router,
the routing and the rest of the block stay transformers'; :func:`moekit.integrations.transformers.patch`
replaces whole blocks instead (moekit's fp32 router and routing too).

What the experts module says of its weights decides what runs:
- ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (``is_transposed=False``) are used as they are
  stored, without a copy; ``is_transposed=True`` stacks ([E, H, 2I], [E, I, H]) are laid out as moekit's
  once per module and cached (one copy of the stack, prepared again when a weight is replaced, moved, cast
  or changed in place; :func:`forget` after writes no version counter sees, such as ``.data`` writes);
- the module's gate function decides the activation: run once on a probe that crosses gpt-oss's clamp
  limits, it must equal ``silu_and_mul`` ([gate; up] halves) or ``swiglu_oai`` (gpt-oss: interleaved
  gate/up columns, alpha 1.702, limit 7) to be served;
- biases (``has_bias``) are added in fp32 like every moekit bias;
- with expert parallelism (``_is_expert_parallel``) ids at or past ``num_experts`` contribute nothing, as
  transformers' sentinel convention wants (moekit's rule for out-of-range ids);
- under a PEFT LoRA adapter on ``gate_up_proj`` / ``down_proj`` (``LoraConfig(target_parameters=...)``), while
  PEFT applies one adapter through its low-rank factors, the stored weights serve as they are (their prepared
  plan cached) and the factors run as moekit's expert LoRA (:mod:`moekit.integrations.peft`); moekit never reads
  the adapted weight. PEFT itself still folds it once per forward: torch's ``register_parametrization``, which
  PEFT calls on every forward, evaluates the parametrization once to check it. Serving without any fold takes
  :func:`moekit.integrations.peft.convert` and moekit's own layer or ``fused_experts``. Several active adapters
  (PEFT sums their deltas into one weight) are served on the weight PEFT adapted.
A module moekit cannot serve (no gate, a post-expert norm, another activation or gate function) is served
by transformers' own ``grouped_mm`` forward, with one warning per class saying why.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch
from torch import nn

from .._checks import int32_ids, tensor_version
from ..experts import ExpertsLoRA, fused_experts
from ..reference import ACTIVATION_FNS
from .peft import active_factors

NAME = "moekit"
_WARNED: set[str] = set()


def register(name: str = NAME) -> bool:
    """Add moekit to transformers' ExpertsInterface under ``name``; False (and nothing done) when this
    transformers has no such registry (before 5.0)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(name, experts_forward)
    return True


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ExpertsInterface signature: ``self`` the experts module, hidden_states [T, H], top_k_index [T, k]
    (any int dtype), top_k_weights [T, k] (any float dtype); returns [T, H] in hidden_states' dtype."""
    plan = _plan(self)
    if isinstance(plan, str):
        return _fallback(self, plan)(self, hidden_states, top_k_index, top_k_weights)
    w13, w2, activation = plan
    lora = _peft_lora(self)
    ids = int32_ids(top_k_index, exact=False)  # (on every layer's call: the two-op form)
    return fused_experts(hidden_states, w13, w2, top_k_weights.float(), ids, activation=activation,
                         w13_bias=self.gate_up_proj_bias if self.has_bias else None,
                         w2_bias=self.down_proj_bias if self.has_bias else None, lora=lora,
                         lora_ids=None if lora is None else hidden_states.new_zeros(hidden_states.shape[0],
                                                                                      dtype=torch.int32))


def _peft_lora(module: nn.Module) -> ExpertsLoRA | None:
    """The PEFT adapter applied through its factors to the module's parameters now, as one moekit adapter (None
    without one). Its two matrices' scalings differ only with a per-parameter rank pattern: then each B is scaled."""
    found = {which: active_factors(module, name)[1] for which, name in (("w13", "gate_up_proj"), ("w2", "down_proj"))}
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        return None
    scalings = {s for _, _, s in found.values()}
    scaling = scalings.pop() if len(scalings) == 1 else 1.0
    parts = {}
    for which, (a, b, s) in found.items():
        parts[which + "_a"], parts[which + "_b"] = a, (b if s == scaling else b * s)
    return ExpertsLoRA(**parts, scaling=scaling)


def activation_of(module: nn.Module, two_i: int) -> str | None:
    """moekit's name for the module's gate function, or None: the function itself, run on a probe that
    crosses gpt-oss's clamp limits and goes far past them, must equal one of moekit's activations (a family's own spelling of
    silu_and_mul or gpt-oss's swiglu is served; another limit, alpha or activation is not)."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.rand(64, two_i, generator=gen, device="cpu") * 24 - 12
    probe[-8:] *= 100  # far past any clamp: a limit moekit does not have shows here
    try:
        with torch.no_grad():
            got = module._apply_gate(probe.clone()).double()
    except Exception:  # noqa: BLE001 - a gate function that needs more than its input is not one of ours
        return None
    for name, fn in ACTIVATION_FNS.items():
        want = fn(probe)
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            return name
    return None


def _plan(module: nn.Module):
    """(w13 [E, 2I, H], w2 [E, H, I], activation) for moekit, or why moekit cannot serve the module.
    Built once per module and weights: a weight replaced, moved, cast or changed in place (its version
    counter) builds it again; a transposed stack's copy is the only one made. Under torch.compile the plan
    built by the eager call before serves as it is (tracing reads no version counters)."""
    if not _PEFT_MERGES_SEEN:
        _see_peft_merges()
    cache = module.__dict__.get("_moekit_plan")
    if torch.compiler.is_compiling():
        return cache.plan if cache is not None else _build_plan(module, module.gate_up_proj, module.down_proj)
    # stored weights: a PEFT adapter's factors, if any, run beside them (never folded in)
    gate_up, down = active_factors(module, "gate_up_proj")[0], active_factors(module, "down_proj")[0]
    if (getattr(module, "is_transposed", False) and torch.is_grad_enabled()
            and any(isinstance(w, torch.Tensor) and w.requires_grad and w.device.type == "cpu" for w in (gate_up, down))):
        # gradients asked on the CPU, where moekit's torch backend computes them: the prepared copy is detached, so
        # views of the parameters serve instead. (On a GPU the kernels compute none and the experts op says so: a
        # view there would cost a copy of the stack per call.)
        return _build_plan(module, gate_up, down, keep_graph=True)
    key = (_identity(gate_up), _identity(down))
    # a freed weight's address may hold its replacement, of the same shape and version: the tensors themselves
    # (by weak reference, so that the cache keeps no replaced weight alive) must be the ones the plan was made of
    # (transformers' expert parallelism hands each forward a new view of the same local shard, DTensor.to_local():
    # the tensor a view was taken of is compared; a view shares its version counter)
    owners = tuple(w._base if isinstance(w, torch.Tensor) and w._base is not None else w for w in (gate_up, down))
    if (cache is not None and cache.key == key and None not in key
            and cache.sources[0]() is owners[0] and cache.sources[1]() is owners[1]):
        return cache.plan
    plan = _build_plan(module, gate_up, down)
    sources = None if None in key else tuple(weakref.ref(w) for w in owners)  # (a key with None never serves)
    module.__dict__["_moekit_plan"] = _PlanCache(key, plan, sources)
    return plan


_PEFT_MERGES_SEEN: list[bool] = []  # (non-empty once PEFT's ParamWrapper tells moekit of its merges)


def _see_peft_merges() -> None:
    """PEFT merges an adapter into the stored weight (and unmerges it) through ``param.data``, which bumps no version
    counter: a transposed stack's prepared copy would go on serving the weights before it. Once PEFT is imported, its
    ParamWrapper's merge and unmerge (merge_adapter, merge_and_unload, disable_adapter on a merged model) are made to
    drop the experts module's prepared weights after they run."""
    import sys

    layer = sys.modules.get("peft.tuners.lora.layer")
    wrapper = getattr(layer, "ParamWrapper", None)
    if wrapper is None:
        return
    for name in ("merge", "unmerge"):
        original = getattr(wrapper, name)

        @functools.wraps(original)
        def then_forget(self, *args, _original=original, **kwargs):
            try:
                return _original(self, *args, **kwargs)
            finally:
                forget(self.get_base_layer())
        setattr(wrapper, name, then_forget)
    _PEFT_MERGES_SEEN.append(True)


def forget(module: nn.Module) -> None:
    """Drop the module's prepared weights: after writes that no version counter sees (``param.data[...] = ...``,
    numpy or DLPack views of the weights), so that the next call prepares them again. PEFT's adapter merges call it
    themselves (see _see_peft_merges)."""
    module.__dict__.pop("_moekit_plan", None)


class _PlanCache:
    """A module's plan, beside its state: not a buffer, not copied with the module, never saved (a transposed
    stack's copy is prepared again where the module lands)."""

    def __init__(self, key, plan, sources=None):
        self.key, self.plan, self.sources = key, plan, sources

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return type(None), ()


def _identity(t):
    """What a prepared weight depends on; None where it cannot be known (no version counter: never cached)."""
    version = tensor_version(t) if isinstance(t, torch.Tensor) else None
    if version is None:  # not a tensor, or an inference-mode one, which keeps no version counter
        return None
    return t.data_ptr(), t.dtype, t.device, tuple(t.shape), tuple(t.stride()), version


def _build_plan(module, gate_up, down, keep_graph: bool = False):
    if not getattr(module, "has_gate", False) or gate_up is None:
        return "its experts have no gate (moekit's are gated: silu_and_mul, swiglu_oai)"
    if getattr(module, "has_post_expert_norm", False):
        return "it normalizes each expert's output (has_post_expert_norm)"
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3 or not isinstance(down, torch.Tensor):
        return f"its weights are not dense expert stacks ({type(gate_up).__name__})"
    two_i = gate_up.shape[2] if getattr(module, "is_transposed", False) else gate_up.shape[1]
    # the probe, once per module: a call in grad mode builds its plan every time (views of the parameters)
    known = module.__dict__.get("_moekit_activation")
    activation = known[1] if known is not None and known[0] == two_i else activation_of(module, two_i)
    module.__dict__["_moekit_activation"] = (two_i, activation)
    if activation is None:
        return f"its gate function ({type(module).__name__}._apply_gate) is neither silu_and_mul nor gpt-oss's swiglu"
    if getattr(module, "is_transposed", False):
        if keep_graph:
            return gate_up.transpose(1, 2), down.transpose(1, 2), activation
        with torch.no_grad():  # moekit's layout, once: the copy is the prepared weight, not a parameter
            return gate_up.detach().transpose(1, 2).contiguous(), down.detach().transpose(1, 2).contiguous(), activation
    return gate_up, down, activation


def _fallback(module: nn.Module, why: str):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    cls = type(module).__name__
    if cls not in _WARNED:
        _WARNED.add(cls)
        warnings.warn(f"moekit cannot serve {cls}: {why}; transformers' grouped_mm serves it", RuntimeWarning,
                      stacklevel=3)
    return ALL_EXPERTS_FUNCTIONS["grouped_mm"]
