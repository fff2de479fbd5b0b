"""Model presets: the real MoE layer shapes of the models moekit serves.

A :class:`MoESpec` is the single description of one MoE layer (router, routing and experts).
Every benchmark, test and CLI command takes its shapes from here so that "gpt-oss-120b" means
the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ROUTING_METHODS = ("softmax_topk", "topk_softmax", "sigmoid_grouped", "sigmoid_top1")
ACTIVATIONS = ("silu_and_mul", "swiglu_oai")


@dataclass(frozen=True)
class MoESpec:
    """Shape and semantics of one MoE layer.

    Attributes:
        name: preset name (``"custom"`` for hand-built specs).
        hidden_size: H, the model width (router and expert input/output size).
        intermediate_size: I, the per-expert MLP width (w13 has 2*I rows).
        num_experts: E, routed experts.
        top_k: k, experts per token.
        routing: one of :data:`ROUTING_METHODS`.
        activation: one of :data:`ACTIVATIONS`.
        router_bias: the router GEMM has a bias b_r[E] (gpt-oss).
        renormalize: the k weights are rescaled to sum to one (softmax_topk, sigmoid_grouped).
        num_groups: expert groups for ``sigmoid_grouped`` (G).
        topk_groups: groups kept for ``sigmoid_grouped``.
        routed_scaling_factor: multiplies the final weights (``sigmoid_grouped``).
        correction_bias: ``sigmoid_grouped`` selects with ``sigmoid(logits) + bias[E]``.
        expert_bias: the experts' projections carry biases b13[E, 2I], b2[E, H] (gpt-oss).
        num_shared_experts: dense experts added to every token (DeepSeek-V3: 1).
        num_moe_layers: MoE layers in the model (used by benchmarks that cycle layers).
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    routing: str
    activation: str
    router_bias: bool = False
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    expert_bias: bool = False
    num_shared_experts: int = 0
    num_moe_layers: int = 1

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_METHODS:
            raise ValueError(f"routing must be one of {ROUTING_METHODS}, got {self.routing!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        for field in ("hidden_size", "intermediate_size", "num_experts", "top_k", "num_groups", "topk_groups"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"topk_groups ({self.topk_groups}) must be <= num_groups ({self.num_groups})")
        if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
            raise ValueError("the kept groups hold fewer experts than top_k")
        # the other methods have no groups, bias or scaling (docs/semantics): kept, they would be dropped unseen
        if self.routing != "sigmoid_grouped" and (self.num_groups != 1 or self.topk_groups != 1
                                                  or self.routed_scaling_factor != 1.0 or self.correction_bias):
            raise ValueError(f"num_groups, topk_groups, routed_scaling_factor and correction_bias apply only to "
                             f"sigmoid_grouped routing, not {self.routing}")

    def routing_kwargs(self) -> dict:
        """Keyword arguments of :func:`moekit.route` for this layer (bias tensor excluded)."""
        kwargs: dict = {"renormalize": self.renormalize}
        if self.routing == "sigmoid_grouped":
            kwargs.update(
                num_groups=self.num_groups,
                topk_groups=self.topk_groups,
                scaling=self.routed_scaling_factor,
            )
        return kwargs

    def scaled(self, hidden_size: int = 64, intermediate_size: int = 32, max_experts: int = 16) -> "MoESpec":
        """A small copy with the same routing structure, for CPU and interpreter runs.

        Expert count is reduced to at most ``max_experts`` while keeping it a multiple of
        ``num_groups`` and large enough that the kept groups still hold ``top_k`` experts.
        """
        per_group_needed = -(-self.top_k // self.topk_groups)
        per_group = max(per_group_needed, max(1, min(self.num_experts, max_experts) // self.num_groups))
        experts = min(self.num_experts, per_group * self.num_groups)
        return dataclasses.replace(
            self,
            name=f"{self.name}@scaled",
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_experts=experts,
        )


_PRESETS = {
    spec.name: spec
    for spec in (
        MoESpec("gpt-oss-20b", 2880, 2880, 32, 4, "topk_softmax", "swiglu_oai",
                router_bias=True, expert_bias=True, num_moe_layers=24),
        MoESpec("gpt-oss-120b", 2880, 2880, 128, 4, "topk_softmax", "swiglu_oai",
                router_bias=True, expert_bias=True, num_moe_layers=36),
        MoESpec("deepseek-v3", 7168, 2048, 256, 8, "sigmoid_grouped", "silu_and_mul",
                num_groups=8, topk_groups=4, routed_scaling_factor=2.5, correction_bias=True,
                num_shared_experts=1, num_moe_layers=58),
        MoESpec("kimi-k2", 7168, 2048, 384, 8, "sigmoid_grouped", "silu_and_mul",
                num_groups=1, topk_groups=1, routed_scaling_factor=2.827, correction_bias=True,
                num_shared_experts=1, num_moe_layers=60),
        MoESpec("mixtral-8x7b", 4096, 14336, 8, 2, "softmax_topk", "silu_and_mul", num_moe_layers=32),
        MoESpec("qwen3-30b-a3b", 2048, 768, 128, 8, "softmax_topk", "silu_and_mul", num_moe_layers=48),
        MoESpec("qwen3-235b-a22b", 4096, 1536, 128, 8, "softmax_topk", "silu_and_mul", num_moe_layers=94),
    )
}


def names() -> list[str]:
    """Names of every preset, in a stable order."""
    return list(_PRESETS)


def get(name: str) -> MoESpec:
    """The preset called ``name`` (see :func:`names`)."""
    try:
        return _PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(_PRESETS)}") from None
