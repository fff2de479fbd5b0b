"""The FP8 pipeline microbenchmark's kernel (benchmarks/_fp8_pipeline_kernels.py) against float64, through Triton's
interpreter at tiny sizes: pointer loads and TMA descriptors (warp specialization changes only the schedule)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fp8_pipeline as fp  # noqa: E402

from moekit import _triton  # noqa: E402


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("block_n", [64, 128])
def test_fp8_grouped_gemm_matches_float64(tma, block_n):
    if not _triton.can_launch(torch.device("cpu")):
        pytest.skip("no Triton launch here")
    # 3 experts, 4 row blocks (expert 1 twice, expert 2 none: a block's expert is read, not its position); K = 256:
    # two promoted 128-deep steps; N = 256: two or four column tiles
    block_expert = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    c = fp.gemm_case(3, block_expert.numel(), 256, 256, torch.device("cpu"))
    c["out"].fill_(float("nan"))
    v = dict(BLOCK_M=128, BLOCK_N=block_n, num_warps=4, STAGES=2, TMA=tma, WARP_SPECIALIZE=False)
    fp.launch(v, c, block_expert)
    assert fp.reference_error(c, block_expert, blocks=range(4)) < 8e-3  # bf16 output: 2^-8 relative
