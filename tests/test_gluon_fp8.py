"""The Gluon producer/consumer FP8 block-scaled GEMM prototype (gluon_fp8.py and _gluon_fp8_kernels.py in
benchmarks/experiments). Gluon has no CPU interpreter: on the CPU every config must build for sm_90 without spills
(the fake driver, in a subprocess); on a GPU each config runs against float64 over row blocks of several experts."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))

import fp8_pipeline as fp  # noqa: E402
import gluon_fp8 as gf  # noqa: E402
from test_gluon_w4 import compile_only_builds  # noqa: E402


def test_configs_fit_shared_memory():
    assert all(gf.smem_bytes(cfg) < 227 * 1024 for cfg in gf.candidates())


def test_compile_only_builds_sm90_without_spills():
    compile_only_builds("gluon_fp8.py", len(gf.candidates()))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gf.candidates(), ids=lambda c: c.label())
@pytest.mark.parametrize("block_expert", [
    [0, 1, 1, 0],  # experts revisited, expert 2 never: a block's expert is read, not its position
    [2, 0, 1, 1, 2, 0, 0, 1, 2, 2],  # a whole group of 8 row blocks and a partial one in the tile order
], ids=["4-blocks", "10-blocks"])
@pytest.mark.parametrize("k", [128, 640])  # one K step (the pipelined loop's prologue and epilogue only); five
def test_gluon_fp8_matches_float64(cfg, block_expert, k):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    torch.manual_seed(0)
    block_expert = torch.tensor(block_expert, dtype=torch.int32, device="cuda")
    c = fp.gemm_case(3, block_expert.numel(), 384, k, "cuda", block_m=cfg.bm)
    c["out"].fill_(float("nan"))
    gf.launch(cfg, c, block_expert)
    torch.cuda.synchronize()
    err = fp.reference_error(c, block_expert, blocks=range(block_expert.numel()), block_m=cfg.bm)
    assert err <= 2.0 ** -7 * 1.05, f"{cfg.label()}: {err}"
