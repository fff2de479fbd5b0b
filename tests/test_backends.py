"""The experts backend oracle: candidates in priority order, reasons for every refusal."""

import pytest
import torch

from moekit import backends
from moekit.experts.backends import ExpertsCall, select_backend
from moekit.experts import fused_experts

CPU = torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the CPU")
def test_cpu_auto_is_the_torch_reference_and_triton_only_on_request():
    call = ExpertsCall("dense", torch.float32, CPU, 7)
    assert select_backend(call).name == "torch"
    assert select_backend(call, "triton").name == "triton"            # interpreter, explicit
    text = backends.explain(call)
    assert "triton  rejected: the Triton kernels need a CUDA GPU" in text
    assert "torch   TAKEN" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the CPU")
def test_unsupported_explicit_backend_says_why():
    with pytest.raises(ValueError, match="backend='triton' cannot serve this call: .*bf16 dots wrongly"):
        select_backend(ExpertsCall("dense", torch.bfloat16, CPU), "triton")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        select_backend(ExpertsCall("dense", torch.float32, CPU), "cutlass")
    with pytest.raises(ValueError, match="no backend supports this call"):
        select_backend(ExpertsCall("int3", torch.float32, CPU))


def test_every_format_has_the_float_reference():
    for fmt in backends.WEIGHT_FORMATS:
        assert select_backend(ExpertsCall(fmt, torch.float32, CPU), "torch").name == "torch"
    assert backends.names() == ("triton", "torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the CPU")
def test_fused_experts_routes_through_the_oracle():
    w13, w2 = torch.randn(4, 16, 32), torch.randn(4, 32, 8)
    x, tw, tid = torch.randn(3, 32).bfloat16(), torch.rand(3, 2), torch.randint(0, 4, (3, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="backend='triton' cannot serve"):
        fused_experts(x, w13.bfloat16(), w2.bfloat16(), tw, tid, backend="triton")


@pytest.mark.gpu
def test_gpu_auto_takes_triton_for_every_format():
    dev = torch.device("cuda")
    for fmt in backends.WEIGHT_FORMATS:
        act_quant = "fp8_group" if fmt == "fp8" else None
        assert select_backend(ExpertsCall(fmt, torch.bfloat16, dev, 16, act_quant)).name == "triton"
    assert "triton  TAKEN" in backends.explain(ExpertsCall("mxfp4", torch.bfloat16, dev, 1))
    assert select_backend(ExpertsCall("fp8", torch.bfloat16, dev, 16)).name == "torch"   # W8A16: dequantized
