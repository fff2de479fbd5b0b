"""The router and top-k routing: the router GEMM with fp32 logits (:mod:`.router`: ``router_gemm``,
``GateLinear``, the one-launch ``fused_router``), top-k routing (:mod:`.topk`: ``route``), which tier
serves a call (:mod:`.tiers`, measured data in ``tiers.json``), the Triton host code
(:mod:`.triton_backend`, kernels in :mod:`.kernels`) and the gate's check case (:mod:`.gate_case`)."""

from .router import GateLinear, RouterLoRA, fused_router, router_gemm
from .topk import RoutingOptions, route

__all__ = ["GateLinear", "RouterLoRA", "RoutingOptions", "fused_router", "route", "router_gemm"]
