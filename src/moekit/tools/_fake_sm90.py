"""A Triton driver that reports an H200's target (sm_90) on a machine without a GPU.

Triton's NVIDIA backend, ptxas included, ships in its wheel: with this driver active, kernels build to real
cubins on a CPU, so that their registers, spills, shared memory and instructions can be inspected
(tests/sm90_compile.py, benchmarks/stream_decode.py --compile-only). Nothing can be launched.
"""

from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget


class Sm90Driver:
    target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")
