"""The decode-once prefill prototype's kernel (benchmarks/experiments): each weight the float32 dequantization
of moekit.formats, rounded once to the output dtype, in both byte layouts, through Triton's interpreter; rows and K
ending mid-tile."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"))

import dequant_prefill as dp  # noqa: E402

from moekit import _triton  # noqa: E402
from moekit.formats import dequantize, prepare, quantize_experts  # noqa: E402


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("layout", ["packed", "pairs"])
@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32),  # (the interpreter rounds fp32 to bf16 toward zero: bf16 is checked on the GPU)
    pytest.param("cuda", torch.float32, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
])
def test_decode_once_equals_the_format_routine(fmt, layout, device, dtype):
    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    # N = 40: a partial block of 32 rows; K = 288: a partial 256-code chunk (nine MXFP4 / eighteen NVFP4 groups)
    w = (torch.randn(3, 40, 288) * torch.logspace(-3, 3, 40)[None, :, None]).to(device)
    q = quantize_experts(w, fmt)
    if layout == "pairs":
        q = prepare(q)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    dp.dequantize_into(q, out)
    assert torch.equal(out, dequantize(q, torch.float32).to(dtype))
