"""The dispatch decision of the router: data lookups, explanations and launch-shape invariants."""

import pytest
import torch

from moekit import _triton
from moekit.routing import tiers as router_tiers
from moekit.routing.tiers import kernel_config


@pytest.fixture
def gpu_named(monkeypatch):
    """The tier lookup on a GPU of the given name (its cached name query forgotten before and after)."""
    def name(gpu):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
        _triton._gpu_name.cache_clear()

    yield name
    _triton._gpu_name.cache_clear()


def test_cpu_calls_use_torch_and_say_why():
    choice = router_tiers.choose_tier(16, 2880, 128, torch.device("cpu"))
    assert choice.tier == "torch" and "cpu" in choice.reason
    assert not router_tiers.fused_applies(1, torch.device("cpu"), 2880, 128)
    text = router_tiers.explain(16, 2880, 128, "cpu")
    assert "router_gemm T=16 H=2880 E=128: torch" in text and "fused_router" in text


def test_measured_table_has_the_h200_and_defaults():
    table = router_tiers._crossover_table()
    assert set(table["default"]) == {"gemm_triton", "fused"}
    h200 = table["gpus"]["NVIDIA H200"]
    assert h200["gemm_triton"]["shapes"]["H2880_E128"] >= 1
    assert "benchmarks/results/router.json" in h200["source"]


def test_unmeasured_gpu_falls_back_to_default(gpu_named):
    gpu_named("Imaginary GPU")
    limit, source = router_tiers.crossover_tokens(torch.device("cuda", 0), 2880, 128)
    assert limit == router_tiers._crossover_table()["default"]["gemm_triton"] and "no measurement" in source


def test_h200_lookup_by_shape_then_smallest(gpu_named):
    gpu_named("NVIDIA H200")
    entry = router_tiers._crossover_table()["gpus"]["NVIDIA H200"]["gemm_triton"]
    assert router_tiers.crossover_tokens(torch.device("cuda", 0), 2880, 128)[0] == entry["shapes"]["H2880_E128"]
    limit, source = router_tiers.crossover_tokens(torch.device("cuda", 0), 1000, 7)
    assert limit == entry["max_tokens"] == min(entry["shapes"].values()) and "smallest" in source


def test_explicit_tier_is_honoured_or_refused():
    assert router_tiers.choose_tier(4, 64, 8, torch.device("cpu"), "torch").reason == "requested explicitly"
    with pytest.raises(ValueError, match="tier='cublas' needs a CUDA device"):
        router_tiers.choose_tier(4, 64, 8, torch.device("cpu"), "cublas")


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("rank", [0, 16])
def test_launch_shapes_respect_their_budgets(fuse, rank):
    for T in (1, 2, 3, 7, 8, 9, 16, 17, 64, 128, 129, 1000):
        for H, E in ((64, 8), (2880, 128), (7168, 256), (7168, 384), (2048, 13)):
            c = kernel_config(T, H, E, rank, fuse)
            e_pad = 1 << (E - 1).bit_length()
            assert c.splits * c.k_per_split >= H > (c.splits - 1) * c.k_per_split   # K covered once
            assert c.k_per_split % c.block_k == 0
            assert c.block_t % c.fin_t == 0 and c.fin_t <= max(1, 1 << (T - 1).bit_length())
            assert c.fin_t * e_pad <= (2048 if fuse else router_tiers._REGISTER_BUDGET) or c.fin_t == 1
            assert c.s_chunk * c.fin_t * e_pad <= (4096 if fuse else router_tiers._REGISTER_BUDGET) or c.s_chunk == 1
            assert (c.block_t < 16) == (T <= router_tiers.GEMV_MAX_TOKENS)   # GEMV only for 1-2 tokens
            # Shared finishing: no more finishers than token groups or programs of a block, at most
            # one waiting program per SM (the default 132), and only for the tensor-core blocks.
            blocks = -(-T // c.block_t)
            row_blocks = -(-E // c.block_r) + -(-rank // c.block_r)
            assert 1 <= c.fin_programs <= min(-(-min(T, c.block_t) // c.fin_t), row_blocks * c.splits)
            assert c.fin_programs == 1 or (blocks * c.fin_programs <= 132 and c.block_t >= 16)


@pytest.mark.parametrize("T, H, E, tile, folded", [
    (1, 7168, 256, (16, 16), False),     # decode: 16 x 16 tiles, one program per K split
    (64, 7168, 256, (64, 32), False),    # deepseek-v3: few tokens and a long K, 8 tiles x 14 splits fill the SMs
    (256, 2048, 128, (32, 32), False),   # qwen3-30b-a3b: 32 tiles x 4 splits
    (256, 4096, 8, (16, 16), False),     # mixtral-8x7b, E=8: 16 rows, not 32 (the same programs, no idle lanes)
    (4096, 2048, 128, (64, 64), True),   # T x splits past INVARIANT_SPLIT_WORK: folded, 128 tiles
    (4096, 7168, 256, (128, 64), True),  # the largest tile already fills the SMs
    (40, 2048, 8, (16, 16), False),      # no tile fills them: the most programs
])
def test_invariant_tiles_fill_the_sms(monkeypatch, T, H, E, tile, folded):
    """Batch-invariant mode's tile (it never changes the bits) and K-split form, by shape: the H100 sweep's choices."""
    monkeypatch.setattr(router_tiers._invariant, "enabled", lambda: True)
    c = kernel_config(T, H, E, 0, False, 132)
    assert ((c.block_t, c.block_r), c.fold_splits) == (tile, folded)
    assert c.block_k == router_tiers.INVARIANT_BLOCK_K and c.s_chunk == 1 and c.fin_t == 1


def test_invariant_fp32_tiles_stay_within_the_registers(monkeypatch):
    # IEEE fp32 products on the CUDA cores: tiles past 32 x 32 spill in the K loop (tests/sm90_compile.py)
    monkeypatch.setattr(router_tiers._invariant, "enabled", lambda: True)
    for T in (1, 64, 257, 4096, 16384):
        c = kernel_config(T, 7168, 256, 0, False, 132, ieee=True)
        assert c.block_t * c.block_r <= router_tiers.INVARIANT_IEEE_TILE


def test_gatelinear_explain_names_the_tier_its_forward_runs():
    # explain ignored the module's tier: it said "torch" for a module whose forward ran the Triton kernel
    from moekit import GateLinear

    gate = GateLinear(32, 8, params_dtype=torch.float32)
    gate.tier = "triton"
    assert gate.explain(3).startswith("router_gemm T=3 H=32 E=8: triton -- requested explicitly")


def test_explain_without_triton_on_a_gpu_says_so(monkeypatch):
    # it said "router_gemm (cublas) + routing kernel: T=4 > 128": a false comparison, and no routing kernel runs
    monkeypatch.setattr(_triton, "triton_importable", lambda: False)
    text = router_tiers.explain(4, 7168, 256, torch.device("cuda"))
    assert "fused_router: router_gemm (cublas) + route in torch: triton is not installed" in text
