"""moekit: accurate, fast Mixture-of-Experts inference layers (PyTorch + Triton).

The runtime is layered, each layer importing only those below it: ``formats`` (the weight formats
and their vocabulary), ``reference`` (float64 definitions), ``metrics`` and ``gate`` (the accuracy
gate), the ops ``routing`` and ``experts``, then ``layer`` (FusedMoE), ``distributed`` and
``integrations``. ``moekit.tools`` (the `moekit` command: verify, bench, tune) sits on top and
nothing in the runtime imports it.
"""

from . import formats, layouts, presets, reference
from ._invariant import batch_invariant, set_batch_invariant
from .experts import ExpertsLoRA, backends, batched_experts, fused_experts
from .experts.backends import explain, select_backend
from .gate import set_verification
from .layer import FusedMoE
from .presets import MoESpec
from .routing import GateLinear, RouterLoRA, fused_router, route, router_gemm

__version__ = "0.1.0"

__all__ = [
    "ExpertsLoRA", "FusedMoE", "GateLinear", "MoESpec", "RouterLoRA", "backends", "batch_invariant", "batched_experts",
    "explain", "formats",
    "fused_experts", "fused_router", "layouts", "select_backend", "set_batch_invariant", "set_verification",
    "presets", "reference", "route", "router_gemm",
]
