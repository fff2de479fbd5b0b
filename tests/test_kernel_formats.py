"""The in-kernel decoders of 4-bit weights (kernels/moe_gemm.py) against torch's own conversions,
for every byte: E2M1 codes, E8M0 exponents (MXFP4), E4M3 scales (NVFP4)."""

import pytest
import torch
import triton
import triton.language as tl

from moekit import _triton
from moekit.formats import fp4
from moekit.kernels import moe_gemm

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@triton.jit
def _decode_all(b_ptr, out_ptr, WHICH: tl.constexpr):
    offs = tl.arange(0, 256)
    b = tl.load(b_ptr + offs)
    if WHICH == 0:
        v = moe_gemm._e2m1_values((b & 15).to(tl.int32))
    elif WHICH == 1:
        v = moe_gemm._e8m0_values(b)
    else:
        v = moe_gemm._e4m3_values(b)
    tl.store(out_ptr + offs, v)


def _run(which, device):
    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    out = torch.empty(256, dtype=torch.float32, device=device)
    _decode_all[(1,)](b, out, WHICH=which)
    return b, out.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_decoder(device):
    b, got = _run(0, device)
    assert torch.equal(got, fp4.decode(b.cpu() & 15))


@pytest.mark.parametrize("device", DEVICES)
def test_e8m0_decoder(device):
    b, got = _run(1, device)
    expect = b.cpu().view(torch.float8_e8m0fnu).float()     # 0 -> 2^-127 (subnormal), 255 -> NaN
    assert torch.equal(got[:255], expect[:255]) and torch.isnan(got[255]) and got[0].item() == 2.0 ** -127


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_decoder(device):
    b, got = _run(2, device)
    expect = b.cpu().view(torch.float8_e4m3fn).float()
    nan = torch.isnan(expect)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], expect[~nan])
