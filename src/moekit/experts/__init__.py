"""The fused MoE experts: public API (:mod:`.api`), the backend oracle (:mod:`.backends`), the torch
implementation (:mod:`.torch_backend`), the Triton host code (:mod:`.triton_backend`, kernels in
:mod:`.kernels`), block configurations (:mod:`.configs`), LoRA adapters on the experts (:mod:`.lora`) and the
gate's check case (:mod:`.gate_case`)."""

from .api import batched_experts, check_act_quant, fused_experts, weight_format
from .configs import ExpertsConfig, GemmConfig
from .lora import ExpertsLoRA
from .torch_backend import batched_torch, fused_torch

__all__ = ["ExpertsConfig", "ExpertsLoRA", "GemmConfig", "batched_experts", "batched_torch", "check_act_quant",
           "fused_experts", "fused_torch", "weight_format"]
