"""The FP8 pipeline microbenchmark's kernel (benchmarks/experiments) against float64, through Triton's
interpreter at tiny sizes: pointer loads and TMA descriptors (warp specialization changes only the schedule)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"))

import fp8_pipeline as fp  # noqa: E402

from moekit import _triton  # noqa: E402

# The bf16 output's rounding: the interpreter rounds fp32 to bf16 toward zero, up to one bf16 step (2^-7 of a
# value) where the GPU rounds to nearest
TOL = 2.0 ** -7 * 1.05


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("block_expert", [
    [0, 1, 1, 0],  # 3 experts, expert 1 twice, expert 2 none: a block's expert is read, not its position
    [2, 0, 1, 1, 2, 0, 0, 1, 2, 2],  # 10 blocks: a whole group of 8 row blocks and a partial one in the tile order
], ids=["4-blocks", "10-blocks"])
def test_fp8_grouped_gemm_matches_float64(tma, block_n, block_expert):
    if not _triton.can_launch(torch.device("cpu")):
        pytest.skip("no Triton launch here")
    block_expert = torch.tensor(block_expert, dtype=torch.int32)
    # K = 256: two promoted 128-deep steps; N = 256: two or four column tiles
    c = fp.gemm_case(3, block_expert.numel(), 256, 256, torch.device("cpu"))
    c["out"].fill_(float("nan"))  # an unwritten element makes the error infinite
    v = dict(BLOCK_M=128, BLOCK_N=block_n, num_warps=4, STAGES=2, TMA=tma, WARP_SPECIALIZE=False)
    fp.launch(v, c, block_expert)
    assert fp.reference_error(c, block_expert, blocks=range(block_expert.numel())) < TOL


def test_the_check_sees_unwritten_output():
    block_expert = torch.tensor([0, 1], dtype=torch.int32)
    c = fp.gemm_case(2, 2, 128, 128, torch.device("cpu"))
    c["out"].fill_(float("nan"))
    assert fp.reference_error(c, block_expert) == float("inf")


@pytest.mark.parametrize("product,block_m,block_n", [
    ("scaled", 128, 128),  # moekit's loop
    ("accumulated", 128, 256),  # the loop's ceiling, wide tile
    ("scaled", 64, 128),  # 64-row blocks: less padding multiplied
])
def test_fp8_loop_probe_kernel(product, block_m, block_n):
    # the probe's scaled loop is moekit's promotion; accumulating without scales is the same product on unit scales
    if not _triton.can_launch(torch.device("cpu")):
        pytest.skip("no Triton launch here")
    from _fp8_pipeline_kernels import fp8_loop_probe_kernel
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_expert = torch.tensor([1, 0, 1], dtype=torch.int32)
    c = fp.gemm_case(2, 3, 256, 256, torch.device("cpu"), block_m=block_m)
    if product == "accumulated":
        c["a_scale"].fill_(1.0)
        c["w_scale"].fill_(1.0)
    c["out"].fill_(float("nan"))
    a_desc = TensorDescriptor.from_tensor(c["a"], [block_m, 128])
    w_desc = TensorDescriptor.from_tensor(c["w"].view(-1, 256), [block_n, 128])
    fp8_loop_probe_kernel[(3 * (256 // block_n),)](
        c["a"], c["a_scale"], c["w"], c["w_scale"], block_expert, c["out"], a_desc, w_desc, 3, 2, 3 * block_m, 256, 256,
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8, STAGES=2, WARP_SPECIALIZE=False, DEVICE_DESC=False, PRODUCT=product,
        num_warps=4)
    assert fp.reference_error(c, block_expert, blocks=range(3), block_m=block_m) < TOL
