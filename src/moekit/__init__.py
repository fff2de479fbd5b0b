"""moekit: accurate, fast Mixture-of-Experts inference layers (PyTorch + Triton)."""

from . import backends, formats, layouts, presets, reference
from .backends import explain, select_backend
from .verify.gate import set_verification
from .experts import batched_experts, fused_experts
from .layer import FusedMoE
from .presets import MoESpec
from .router import GateLinear, RouterLoRA, fused_router, router_gemm
from .routing import route

__version__ = "0.1.0"

__all__ = [
    "FusedMoE", "GateLinear", "MoESpec", "RouterLoRA", "backends", "batched_experts", "explain", "formats",
    "fused_experts", "fused_router", "layouts", "select_backend", "set_verification",
    "presets", "reference", "route", "router_gemm",
]
