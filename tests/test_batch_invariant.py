"""Batch-invariant mode (issue 31): with the switch on, a token's output bits depend only on its own inputs and the
weights, whatever the batch around it. On the CPU: the torch paths at the issue's batch sizes, the Triton kernels
through the interpreter at smaller ones (fp16/fp32: its bf16 dots are wrong), the configuration rules for every
shape class of the tuned table, and a planted fault that the checks catch. On a GPU (-m gpu): every preset and
format at real sizes, in CUDA graphs and under torch.compile."""

import dataclasses
import os
import warnings

import pytest
import torch

import moekit
from moekit import _invariant, _triton, backends, fused_experts, gate, presets
from moekit.experts import ExpertsConfig, GemmConfig
from moekit.experts import configs as C
from moekit.experts import gate_case
from moekit.formats import FOUR_BIT_FORMATS
from moekit.routing import fused_router, route, router_gemm
from moekit.routing import tiers
from moekit.tools.verify import invariance_checks

SIZES = _invariant.SIZES  # 1, 2, 7, 64, 129, 1000


@pytest.fixture(autouse=True)
def _mode_restored():
    saved = _invariant._ENABLED
    yield
    _invariant.set_batch_invariant(saved)
    gate.set_verification(None)
    gate.reset()


def _on():
    moekit.set_batch_invariant(True)


def test_the_switch_follows_the_setter_then_the_environment(monkeypatch):
    monkeypatch.delenv(_invariant.ENV, raising=False)
    moekit.set_batch_invariant(None)
    assert not _invariant.enabled()
    monkeypatch.setenv(_invariant.ENV, "1")
    assert _invariant.enabled()
    moekit.set_batch_invariant(False)
    assert not _invariant.enabled()
    with moekit.batch_invariant():
        assert _invariant.enabled()
    assert not _invariant.enabled()
    with pytest.raises(TypeError, match="enabled must be"):
        moekit.set_batch_invariant("yes")
    moekit.set_batch_invariant(None)
    for off in ("0", "", "false", "False", "no", "OFF"):  # MOEKIT_BATCH_INVARIANT=false once turned the mode on
        monkeypatch.setenv(_invariant.ENV, off)
        assert not _invariant.enabled(), off


def test_rows_matmul_matches_matmul_and_keeps_a_rows_bits_at_any_count():
    b = torch.randn(256, 48)
    x = torch.randn(1000, 256)
    full = _invariant.rows_matmul(x, b)
    torch.testing.assert_close(full, x @ b)
    for n in (1, 7, 129):
        assert torch.equal(_invariant.rows_matmul(x[:n], b), full[:n])
    assert _invariant.rows_matmul(x[:0], b).shape == (0, 48)


# ---- configuration rules: what makes the GPU kernels invariant, checked for every shape class -------------------

def _shape_classes():
    """(table key, shape, E, N, K, family) of every tuned shape, plus every preset on the heuristic in every family."""
    out = []
    for key, shapes in C._table().items():
        parts = key.split("|")
        family = parts[3] if len(parts) > 3 else "dense"
        for shape in shapes:
            E, N, K = (int(p[1:]) for p in shape.split("_"))
            out.append((key, shape, E, N, K, family))
    for name in presets.names():
        s = presets.get(name)
        for family in ("dense", "mxfp4", "nvfp4", "fp8", "w4a8"):
            n1 = 2 * s.intermediate_size
            out.append((f"no-gpu|{family}", C.shape_key(s.num_experts, n1, s.hidden_size), s.num_experts, n1,
                        s.hidden_size, family))
    return out


TOKENS = sorted(set(C.TOKEN_BUCKETS) | {3, 7, 33, 129, 1000, 5000})


@pytest.mark.parametrize("key, shape, E, N, K, family", _shape_classes(), ids=lambda v: str(v))
def test_invariant_configs_fix_the_reduction_order_of_a_shape_class_at_every_token_count(key, shape, E, N, K, family):
    steps = set()
    for T in TOKENS:
        for top_k in (1, 2, 8):  # batched calls ask with k=1 at T = E * M
            cfg, why = C._invariant_choose((key,), shape, T, E, top_k, N, K, family)
            # the per-pair mode (dense weights where the default runs a decode mode) gives the aligned mode's bits
            assert cfg.mode == "aligned" or (family == "dense" and cfg.mode == "per_pair"), why
            assert not cfg.pdl and (cfg.mode == "per_pair" or not cfg.split_slots), why
            per_pair = cfg.mode == "per_pair"
            cfg, why = C._invariant_choose((key,), shape, T, E, top_k, N, K, family, False)  # adapters, batched
            assert cfg.mode == "aligned", why
            if family in FOUR_BIT_FORMATS:  # a step's K terms are one MMA chain: K steps and half tails follow T
                assert cfg.gemm1.block_k >= 64 and cfg.gemm2.block_k >= 64, why
            else:
                assert not cfg.gemm1.half_tails and not cfg.gemm2.half_tails
                steps.add((C._effective_block_k(cfg.gemm1, family, 2), C._effective_block_k(cfg.gemm2, family, 1)))
                if per_pair:  # its K steps too
                    pp = C._invariant_choose((key,), shape, T, E, top_k, N, K, family)[0]
                    steps.add((C._effective_block_k(pp.gemm1, family, 2), C._effective_block_k(pp.gemm2, family, 1)))
            if family in ("fp8", "w4a8"):  # one weight scale per GEMM2 tile at every T (W_TILE_SCALE)
                assert C.FP8_BLOCK_K % cfg.gemm2.block_n == 0
                # and one tensor-core instruction (wgmma: 64 rows on whole warpgroups), whose FP8 sums round
                # otherwise than mma.sync's
                assert cfg.block_m >= 64 and cfg.gemm1.num_warps % 4 == 0 and cfg.gemm2.num_warps % 4 == 0, why
            if family == "nvfp4":  # wgmma weight tiles (64+ rows): NVFP4 products on mma.sync round otherwise
                assert cfg.gemm1.block_n >= 64 and cfg.gemm2.block_n >= 64, why
            assert "batch-invariant" in why
    assert len(steps) <= 1, f"K steps change with T: {steps}"


def test_invariant_4_bit_tiles_keep_the_defaults_aligned_configs_but_nvfp4_is_widened_to_wgmma():
    narrow = C.GemmConfig(block_n=32, block_k=64, num_warps=4, num_stages=4, half_tails=True)
    assert C._invariant_tile(narrow, "nvfp4").block_n == 64  # a 32-row entry (mma.sync) widened
    assert C._invariant_tile(narrow, "mxfp4") == narrow  # MXFP4 kept its bits on both families, half tails too
    s = presets.get("qwen3-30b-a3b")
    E, N, K = s.num_experts, 2 * s.intermediate_size, s.hidden_size
    key, shape = "no-gpu|nvfp4", C.shape_key(E, N, K)
    for T in (64, 1024, 4096):  # where the default aligns: its own config, NVFP4 tiles widened
        default = C._choose((key,), shape, T, E, s.top_k, N, K, "nvfp4", True)[0]
        got = C._invariant_choose((key,), shape, T, E, s.top_k, N, K, "nvfp4")[0]
        assert got.block_m == default.block_m and got.gemm1 == C._invariant_tile(default.gemm1, "nvfp4"), T
    for fmt in ("nvfp4", "mxfp4"):  # the default's CUDA cores: not kept; each format's measured decode steps
        got = C._invariant_choose((f"no-gpu|{fmt}",), shape, 1, E, s.top_k, N, K, fmt)[0]
        steps = C.INVARIANT_DECODE_4BIT[fmt]
        assert got.mode == "aligned" and (got.gemm1.block_k, got.gemm2.num_stages) == (
            steps["block_k"], steps["num_stages"]), fmt


def test_the_switch_changes_the_cached_decisions_at_the_next_call():
    dev = torch.device("cpu")
    moekit.set_batch_invariant(False)
    default = C.choose(1, 128, 8, 1536, 2048, dev, torch.float16)[0]
    assert default.mode != "aligned"
    assert tiers.kernel_config(1, 2880, 128, 0, False).block_t < 16  # the fp32 GEMV
    _on()
    cfg, why = C.choose(1, 128, 8, 1536, 2048, dev, torch.float16)
    assert cfg != default and "batch-invariant" in why  # the per-pair mode on the shape class's K steps
    small, large = tiers.kernel_config(1, 2880, 128, 0, False), tiers.kernel_config(4096, 2880, 128, 0, False)
    # the same K splits at every T: split programs at one token, folded into the tiles' programs at many
    assert (small.splits, small.k_per_split, small.fold_splits) == (tiers.invariant_splits(2880)[0], 512, False)
    assert (large.splits, large.k_per_split, large.fold_splits) == (1, 512, True)
    assert small.block_k == large.block_k and small.block_t >= 16 and small.s_chunk == 1
    assert tiers.kernel_config(300, 2880, 128, 8, True).fin_t == 1
    call = backends.ExpertsCall("dense", torch.float16, dev, 4)
    assert "batch-invariant" in backends.explain(call)
    assert "batch-invariant" in tiers.explain(4, 2880, 128, dev)
    # the one-launch kernel in the mode's order up to INVARIANT_FUSED_MAX_TOKENS (the same bits as the two launches)
    cuda = torch.device("cuda")
    small_t = tiers.INVARIANT_FUSED_MAX_TOKENS
    assert tiers.fused_applies(small_t, cuda, 2880, 128) == _triton.triton_importable()
    assert not tiers.fused_applies(small_t + 1, cuda, 2880, 128)


def test_what_cannot_be_invariant_is_refused_naming_the_switch():
    _on()
    E, H, I = 4, 64, 32
    x = torch.randn(3, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="act_quant='nvfp4' is not batch-invariant.*MOEKIT_BATCH_INVARIANT"):
        fused_experts(x, w13, w2, torch.ones(3, 1), ids, act_quant="nvfp4")
    with pytest.raises(ValueError, match="act_quant='nvfp4' is not batch-invariant"):
        moekit.batched_experts(x[None].expand(E, 3, H).contiguous(), torch.ones(E, dtype=torch.int32), w13, w2,
                               act_quant="nvfp4")
    with pytest.raises(ValueError, match="tier='cublas' is not batch-invariant"):
        router_gemm(x, torch.randn(E, H), tier="cublas")


# ---- the torch paths at the issue's batch sizes --------------------------------------------------------------

def _spec(name):
    return presets.get(name).scaled()


@pytest.mark.parametrize("name", ["gpt-oss-120b", "deepseek-v3", "qwen3-30b-a3b"])
def test_router_ops_on_the_torch_paths_are_batch_invariant(name):
    _on()
    impls = {"router_gemm": ["torch"], "route": ["torch"], "fused_router": ["unfused", "auto"]}
    rows = invariance_checks.router_checks(_spec(name), torch.float32, torch.device("cpu"), impls, SIZES)
    assert len(rows) == 4 and all(r.ok for r in rows), [r.detail for r in rows if not r.ok]


@pytest.mark.parametrize("weights, act_quant", invariance_checks.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_on_the_torch_backend_are_batch_invariant(weights, act_quant, dtype):
    _on()
    rows = invariance_checks.experts_checks(_spec("gpt-oss-120b"), dtype, torch.device("cpu"), "torch", SIZES,
                                            formats=[(weights, act_quant)])
    assert all(r.ok for r in rows), [r.detail for r in rows if not r.ok]


@pytest.mark.parametrize("activation", ["silu_and_mul", "swiglu_oai"])
def test_the_torch_backends_activations_keep_a_rows_bits(activation):
    # a CPU kernel's vector loop and its scalar tail (past a multiple of its step, or past a thread's share of the
    # flattened tensor) round sigmoid differently: I = 40 leaves a tail in every row alone, and two threads split
    # 901 x 40 elements mid-row (before: token 450 of silu_and_mul, 40 tokens of swiglu_oai changed bits)
    _on()
    torch.manual_seed(0)
    E, H, I, T = 1, 16, 40, 901
    w13, w2 = torch.randn(E, 2 * I, H) * H ** -0.5, torch.randn(E, H, I) * I ** -0.5
    x, ids, tw = torch.randn(T, H) * 4, torch.zeros(T, 1, dtype=torch.int32), torch.ones(T, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        full = fused_experts(x, w13, w2, tw, ids, activation=activation, backend="torch")
        alone = torch.cat([fused_experts(x[t:t + 1], w13, w2, tw[t:t + 1], ids[t:t + 1], activation=activation,
                                         backend="torch") for t in range(T)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, alone), f"tokens {(full != alone).any(1).nonzero().flatten().tolist()[:8]}"


@pytest.mark.parametrize("name", ["deepseek-v3", "gpt-oss-20b"])  # a shared expert; biases
def test_the_whole_layer_is_batch_invariant_on_the_cpu(name):
    _on()
    rows = invariance_checks.layer_checks(_spec(name), torch.bfloat16, torch.device("cpu"), SIZES)
    assert rows[0].ok, rows[0].detail


def test_the_checks_see_the_default_modes_batch_dependence():
    """The probe has teeth: without the switch the CPU's BLAS sums a row in another order once the batch grows."""
    moekit.set_batch_invariant(False)
    impls = {"router_gemm": ["torch"]}
    rows = invariance_checks.router_checks(presets.get("qwen3-30b-a3b"), torch.float32, torch.device("cpu"), impls,
                                           SIZES)
    assert not rows[0].ok and "not batch-invariant: T=" in rows[0].detail


# ---- the Triton kernels through the interpreter ----------------------------------------------------------------

TINY = presets.MoESpec("tiny", 64, 32, 4, 2, "softmax_topk", "silu_and_mul")
TINY_OAI = dataclasses.replace(TINY, name="tiny-oai", activation="swiglu_oai", expert_bias=True)
# E=4, k=2: row blocks of 16 rows up to T=24, 32 to 48, 64 to 192 and 128 above (the heuristic's regimes)
KERNEL_SIZES = (1, 2, 7, 64, 129, 300)
LOW_BIT_SIZES = (1, 7, 64, 200)


@pytest.mark.parametrize("spec", [TINY, TINY_OAI], ids=lambda s: s.name)
def test_dense_expert_kernels_are_batch_invariant(spec):
    _on()
    rows = invariance_checks.experts_checks(spec, torch.float16, torch.device("cpu"), "triton", KERNEL_SIZES,
                                            formats=[("dense", None)])
    assert all(r.ok for r in rows), [r.detail for r in rows if not r.ok]


@pytest.mark.parametrize("split", [True, False])  # GEMM2 per pair + the combine, or per token rounding each slot
@pytest.mark.parametrize("T", [1, 2, 5])
def test_the_per_pair_mode_gives_the_aligned_modes_bits_for_dense_weights(T, split):
    # configs.INVARIANT_PER_PAIR: the mode serves dense decode sizes without alignment; a pair's GEMM rows are the
    # aligned row block's and its slot is rounded as the combine's input. Biases, an expert map (a pair of another
    # rank) and invalid ids: the pairs that add nothing.
    E, H, I, k = 5, 48, 40, 3
    w13, w2 = (torch.randn(E, 2 * I, H) * H ** -0.5).half(), (torch.randn(E, H, I) * I ** -0.5).half()
    b13, b2 = torch.randn(E, 2 * I).half(), torch.randn(E, H).half()
    x, tw = torch.randn(T, H).half(), torch.rand(T, k)
    ids = torch.stack([torch.randperm(E + 2)[:k] for _ in range(T)]).int()
    ids[0, 0], ids[-1, -1] = -1, E + 2  # ids out of range on both sides
    emap = torch.tensor([0, 1, -1, 2, 3, 4, -1], dtype=torch.int32)  # 7 global experts, 5 here
    tile1, tile2 = GemmConfig(32, 16, 4, 2), GemmConfig(16, 16, 4, 2)
    runs = {mode: fused_experts(x, w13, w2, tw, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2,
                                expert_map=emap, config=cfg, backend="triton")
            for mode, cfg in (("aligned", ExpertsConfig(16, tile1, tile2)),
                              ("per_pair", ExpertsConfig(16, tile1, tile2, mode="per_pair", split_slots=split)))}
    assert torch.equal(runs["aligned"].view(torch.int16), runs["per_pair"].view(torch.int16))


@pytest.fixture
def per_pair_4bit(monkeypatch):
    """configs.INVARIANT_PER_PAIR_4BIT on for the test (the lru-cached choice cleared before and after)."""
    monkeypatch.setattr(C, "INVARIANT_PER_PAIR_4BIT", True)
    C._invariant_choose.cache_clear()
    yield
    monkeypatch.undo()
    C._invariant_choose.cache_clear()


@pytest.mark.parametrize("fmt", FOUR_BIT_FORMATS)
def test_four_bit_decode_on_the_per_pair_mode_is_batch_invariant(per_pair_4bit, fmt):
    # (off by default until a GPU times it) the aligned GEMMs' 4-bit tiles on one pair each, GEMM2 per pair and the
    # combine: T = 1 on the per-pair mode, T = 64 and 200 aligned
    _on()
    s = presets.get("qwen3-30b-a3b")
    got = C._invariant_choose((f"no-gpu|{fmt}",), C.shape_key(s.num_experts, 2 * s.intermediate_size, s.hidden_size),
                              1, s.num_experts, s.top_k, 2 * s.intermediate_size, s.hidden_size, fmt)[0]
    assert got.mode == "per_pair" and got.split_slots
    rows = invariance_checks.experts_checks(TINY, torch.float16, torch.device("cpu"), "triton", LOW_BIT_SIZES,
                                            formats=[(fmt, None)])
    assert all(r.ok for r in rows), [r.detail for r in rows if not r.ok]


@pytest.mark.parametrize("weights, act_quant", invariance_checks.FORMATS[1:])
def test_low_bit_expert_kernels_are_batch_invariant(weights, act_quant):
    _on()
    rows = invariance_checks.experts_checks(TINY, torch.float16, torch.device("cpu"), "triton", LOW_BIT_SIZES,
                                            formats=[(weights, act_quant)])
    assert all(r.ok for r in rows), [r.detail for r in rows if not r.ok]


@pytest.mark.parametrize("backend,dt", [
    ("triton", torch.float16),  # LoRA terms over the GEMMs' own rows with a fixed K step, in the aligned mode
    ("torch", torch.float32),  # the terms' products in fixed-shape pieces of rows, as the base GEMMs'
])
def test_expert_lora_is_batch_invariant(backend, dt):
    _on()
    E, H, I, k, n, r = 4, 64, 32, 2, 3, 5
    w13, w2 = (torch.randn(E, 2 * I, H) * H ** -0.5).to(dt), (torch.randn(E, H, I) * I ** -0.5).to(dt)
    lora = moekit.ExpertsLoRA((torch.randn(n, E, r, H) * H ** -0.5).to(dt), (torch.randn(n, E, 2 * I, r) * 0.3).to(dt),
                              (torch.randn(n, E, r, I) * I ** -0.5).to(dt), (torch.randn(n, E, H, r) * 0.3).to(dt),
                              [0.5, 1.0, 2.0])

    def tokens(m):
        return {"x": torch.randn(m, H).to(dt), "tw": torch.rand(m, k), "lid": torch.randint(-1, n, (m,)).int(),
                "ids": torch.stack([torch.randperm(E)[:k] for _ in range(m)]).int()}

    def run(t):
        return fused_experts(t["x"], w13, w2, t["tw"], t["ids"], backend=backend, lora=lora, lora_ids=t["lid"])

    assert _invariant.token_mismatch(run, tokens(1), tokens(300), (1, 2, 7, 64, 129, 300)) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_router_kernels_are_batch_invariant(dtype, monkeypatch):
    """Tiles that grow with T; bias and LoRA; routing; the one-launch kernel when asked for."""
    if dtype == torch.float32:
        # The interpreter's fp32 dots are numpy's BLAS, whose sums follow the tile's shape (the GPU's fp32 dots are
        # FMA chains along K, and 16-bit ones tensor-core steps: neither does): fp32 keeps one tile at every T
        monkeypatch.setattr(tiers, "INVARIANT_TILES", ((16, 16),))
    _replan()
    _on()
    H, E = 96, 16
    w = torch.randn(E, H).to(dtype)
    b = torch.randn(E)
    lora = moekit.RouterLoRA(torch.randn(4, H).to(dtype) * 0.1, torch.randn(E, 4) * 0.1)

    def rows(n):
        return {"x": torch.randn(n, H).to(dtype)}

    sizes = (1, 2, 7, 64, 129, 300)
    try:
        for run in (lambda t: router_gemm(t["x"], w, b, tier="triton"),
                    lambda t: router_gemm(t["x"], w, b, lora=lora, tier="triton"),
                    lambda t: route(t["x"].float()[:, :E].contiguous(), 4, "softmax_topk", impl="triton"),
                    lambda t: fused_router(t["x"], w, b, top_k=4, method="topk_softmax", impl="unfused")):
            assert _invariant.token_mismatch(run, rows(1), rows(max(sizes)), sizes) is None
        fused = lambda t: fused_router(t["x"], w, b, top_k=4, method="topk_softmax", impl="fused")  # noqa: E731
        assert _invariant.token_mismatch(fused, rows(1), rows(128), (1, 2, 7, 64, 128)) is None
    finally:
        _replan()  # shapes planned under the patched tiles


def _replan():
    """Forget the router's launch shapes (planned once per shape, and kept with each checked call's decision) after a
    test changed the constants they follow."""
    from moekit._calls import CheckedCalls
    from moekit.routing import triton_backend as router_backend

    tiers.invariant_kernel_config.cache_clear()
    router_backend._router_plan.cache_clear()
    CheckedCalls.forget_all()


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_router_split_programs_and_folded_splits_give_the_same_bits(monkeypatch, lora_rank):
    """Few tokens: one program per K split and a finishing step that adds their partial sums; many tokens: one
    program per tile folding each split into its total. 256-deep splits (two K steps) over H=600 (the last one 88
    deep), the switch between the two forms moved to T x splits = 100 so that both run at interpreter sizes."""
    monkeypatch.setattr(tiers, "INVARIANT_SPLIT_K", 256)
    monkeypatch.setattr(tiers, "INVARIANT_SPLIT_WORK", 100)
    _replan()  # shapes planned under the shipped constants
    _on()
    H, E = 600, 16
    w, b = torch.randn(E, H).half(), torch.randn(E)
    lora = moekit.RouterLoRA(torch.randn(lora_rank, H).half() * 0.1, torch.randn(E, lora_rank) * 0.1) \
        if lora_rank else None
    forms = {tiers.invariant_kernel_config(t, H, E, lora_rank, False, 4).fold_splits for t in (1, 300)}
    assert forms == {False, True}, "both forms must run"

    def rows(n):
        return {"x": torch.randn(n, H).half()}

    run = lambda t: router_gemm(t["x"], w, b, lora=lora, tier="triton")  # noqa: E731
    try:
        assert _invariant.token_mismatch(run, rows(1), rows(300), (1, 2, 7, 64, 129, 300)) is None
        routed = lambda t: fused_router(t["x"], w, b, top_k=4, method="topk_softmax", lora=lora)  # noqa: E731
        assert _invariant.token_mismatch(routed, rows(1), rows(129), (1, 7, 64, 129)) is None
    finally:
        _replan()


def test_an_explicit_config_the_mode_cannot_keep_invariant_is_refused():
    # an explicit config is the caller's order of sums: the CUDA-core mode sums a token's K terms across lanes, the
    # per-pair mode keeps the aligned mode's sums only for dense weights without adapters, and FP8 products in a
    # half block run on mma.sync
    from moekit.formats import quantize_experts

    _on()
    E, H, I, T, k, r = 4, 128, 128, 3, 2, 4
    w13, w2 = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    x, tw, ids = torch.randn(T, H), torch.rand(T, k), torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    tile = GemmConfig(block_n=32, block_k=64)
    per_pair = ExpertsConfig(16, tile, tile, mode="per_pair")
    with pytest.raises(ValueError, match="config with mode 'gemv' is not batch-invariant"):
        fused_experts(x, w13, w2, tw, ids, config=ExpertsConfig(16, tile, tile, mode="gemv"))
    fused_experts(x, w13, w2, tw, ids, config=per_pair)  # dense, no adapters: the aligned mode's bits
    lora = moekit.ExpertsLoRA(torch.randn(1, E, r, H) * 0.1, torch.randn(1, E, 2 * I, r) * 0.1, None, None, [1.0])
    with pytest.raises(ValueError, match="config with mode 'per_pair' is not batch-invariant"):
        fused_experts(x, w13, w2, tw, ids, config=per_pair, lora=lora, lora_ids=torch.zeros(T, dtype=torch.int32))
    m13, m2 = quantize_experts(w13, "mxfp4"), quantize_experts(w2, "mxfp4")
    with pytest.raises(ValueError, match="config with mode 'per_pair' is not batch-invariant"):
        fused_experts(x.bfloat16(), m13, m2, tw, ids, config=per_pair)  # 4-bit GEMM2 per token: another product
    fused_experts(x.half(), m13, m2, tw, ids, config=dataclasses.replace(per_pair, split_slots=True))  # the aligned
    # GEMMs' code on per-pair rows
    half = dataclasses.replace(tile, half_tails=True)
    q13, q2 = quantize_experts(w13, "fp8_block"), quantize_experts(w2, "fp8_block")
    with pytest.raises(ValueError, match="half_tails on FP8 products is not batch-invariant"):
        fused_experts(x, q13, q2, tw, ids, act_quant="fp8_group", config=ExpertsConfig(64, half, half))
    fused_experts(x, w13, w2, tw, ids, config=ExpertsConfig(32, half, half))  # 16-bit products: served
    moekit.set_batch_invariant(False)
    fused_experts(x, w13, w2, tw, ids, config=ExpertsConfig(16, tile, tile, mode="gemv"))


# ---- a planted fault: a configuration that changes with T ------------------------------------------------------

_INVARIANT_CHOOSE = C._invariant_choose


def _mode_changes_with_t(key, shape, num_tokens, *args):
    """The default mode's fault: decode sizes served on the CUDA cores (each K chunk's products summed across
    lanes, not as the tensor-core tiles' chain)."""
    cfg, why = _INVARIANT_CHOOSE(key, shape, num_tokens, *args)
    return (dataclasses.replace(cfg, mode="gemv") if num_tokens <= 8 else cfg), why


def test_a_config_that_changes_with_t_is_caught_by_the_invariance_check(monkeypatch):
    _on()
    monkeypatch.setattr(C, "_invariant_choose", _mode_changes_with_t)
    rows = invariance_checks.experts_checks(TINY, torch.float16, torch.device("cpu"), "triton", (1, 7, 64),
                                            formats=[("dense", None)])
    fused = rows[0]
    assert not fused.ok and "not batch-invariant: T=64" in fused.detail


def test_the_gate_disables_a_backend_that_is_not_batch_invariant():
    """With the gate and the mode on, a backend whose mode changes with T passes the accuracy check and fails the
    invariance check: it is disabled and the next candidate serves."""
    from moekit.experts import triton_backend

    def planted(out, x, w13, w2, tw, ids, activation, b13, b2, emap, config=None, act_quant=None, **lora):
        tile = GemmConfig(block_n=32, block_k=64)
        cfg = ExpertsConfig(16, tile, tile, mode="gemv" if x.shape[0] <= 8 else "aligned")
        triton_backend.fused_experts_into(out, x, w13, w2, tw, ids, activation, b13, b2, emap, cfg, act_quant)

    def rejects(call, explicit):
        return None if call.op == "fused" and call.act_dtype == torch.float16 else "planted: fused fp16 only"

    backends.register(backends.Backend("planted", rejects, "mode by T", planted))
    try:
        gate.set_verification(True)
        _on()
        call = backends.ExpertsCall("dense", torch.float16, torch.device("cpu"), 5)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert backends.select_backend(call).name == "torch"
        assert any("planted" in str(w.message) and "not batch-invariant" in str(w.message) for w in seen)
        moekit.set_batch_invariant(False)  # the same backend passes the gate's accuracy check alone
        assert backends.select_backend(call).name == "planted"
    finally:
        backends.unregister("planted")


def test_the_gate_checks_invariance_of_a_good_backend_when_the_mode_is_on():
    _on()
    gate.set_verification(True)
    call = backends.ExpertsCall("dense", torch.float32, torch.device("cpu"), 3)
    torch_backend = [b for b in backends.BACKENDS if b.name == "torch"][0]
    ok, detail = gate_case.check(torch_backend, call)
    assert ok and "batch-invariant at T in" in detail, detail
    batched_call = dataclasses.replace(call, op="batched")
    ok, detail = gate_case.check(torch_backend, batched_call)
    assert ok and "batch-invariant" in detail, detail


# ---- integrations and the command ------------------------------------------------------------------------------

def test_patch_turns_the_mode_on():
    from moekit.integrations.transformers import patch

    moekit.set_batch_invariant(False)
    report = patch(torch.nn.Linear(4, 4), batch_invariant=True)
    assert _invariant.enabled() and report.batch_invariant and "batch-invariant mode on" in str(report)
    with pytest.raises(TypeError, match="batch_invariant must be"):
        patch(torch.nn.Linear(4, 4), batch_invariant=1)


def test_explain_says_whether_the_mode_is_on(capsys):
    from moekit.tools import cli

    moekit.set_batch_invariant(False)
    assert cli.main(["explain", "--preset", "qwen3-30b-a3b", "--tokens", "1", "--batch-invariant"]) == 0
    out = capsys.readouterr().out
    assert "batch-invariant mode: on" in out and "matmuls of 16 rows at every T" in out
    assert not _invariant.enabled()                              # the command's mode ends with the command
    cfg, why = C.invariant_choice(1, 128, 8, 1536, 2048, torch.device("cpu"), torch.bfloat16)
    assert cfg.mode == "per_pair" and "K steps 64 (GEMM1) and 64 (GEMM2)" in why  # dense decode: two launches
    for other in ({"lora": True}, {"batched": True}):  # their terms / format: the aligned mode
        assert C.invariant_choice(1, 128, 8, 1536, 2048, torch.device("cpu"), torch.bfloat16, **other)[0].mode == \
            "aligned", other


def test_verify_runs_the_invariance_checks_in_the_mode(tmp_path, monkeypatch):
    from moekit.tools import cli

    monkeypatch.delenv(_invariant.ENV, raising=False)
    report = tmp_path / "rows.json"
    code = cli.main(["verify", "--batch-invariant", "--preset", "qwen3-30b-a3b", "--tokens", "3", "--backend", "torch",
                     "--no-isolate", "--json", str(report)])
    import json

    rows = [r for r in json.loads(report.read_text()) if r["op"].endswith("[invariant]")]
    stacks = sum(2 if w in FOUR_BIT_FORMATS else 1 for w, _ in invariance_checks.FORMATS)  # 4-bit: both layouts
    assert code == 0 and len(rows) == 3 + 2 * stacks, rows
    assert any(r["op"] == "fused_experts[nvfp4,pairs][invariant]" for r in rows)
    assert all(r["ok"] for r in rows)
    assert not _invariant.enabled() and _invariant.ENV not in os.environ   # mode and variable restored after


# ---- GPU: real sizes, every preset and format, graphs and compile ----------------------------------------------

GPU_SIZES = SIZES + (4096, 16384)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])  # the tiles change with T for each
@pytest.mark.parametrize("name", presets.names())
def test_gpu_router_and_routing_are_batch_invariant(name, dtype):
    _on()
    impls = {"router_gemm": ["auto", "triton"], "route": ["auto", "triton"], "fused_router": ["auto", "unfused"]}
    rows = invariance_checks.router_checks(presets.get(name), dtype, torch.device("cuda"), impls, GPU_SIZES)
    assert all(r.ok for r in rows), [(r.op, r.impl, r.detail) for r in rows if not r.ok]


@pytest.mark.parametrize("method,renormalize,lora,served", [
    ("softmax_topk", True, False, True),    # sums over the k chosen weights: the same bits shown on every preset
    ("topk_softmax", False, False, True),
    ("sigmoid_grouped", True, False, True),
    ("softmax_topk", False, False, False),  # a softmax over all E: its sum's order follows each tile's layout
    ("softmax_topk", True, True, False),    # the router LoRA's sum, likewise
])
def test_the_mode_takes_the_one_launch_router_only_where_its_bits_were_shown_equal(monkeypatch, method, renormalize,
                                                                                   lora, served):
    from moekit.routing import router as router_module
    from moekit.routing import tiers as router_tiers

    monkeypatch.setattr(router_tiers, "fused_applies", lambda *a: True)     # as on a GPU, below the switch
    E, H, k = 8, 32, 2
    x, w = torch.randn(3, H), torch.randn(E, H)
    adapter = router_module.RouterLoRA(torch.randn(4, H), torch.randn(E, 4), 0.5) if lora else None
    args = router_module._validate_gemm(x, w, None, adapter)
    kwargs = {"renormalize": renormalize} if method != "topk_softmax" else {}
    if method == "sigmoid_grouped":
        kwargs |= {"num_groups": 2, "topk_groups": 1}
    opts = router_module.validate_routing(E, x.device, k, method, **kwargs)
    assert router_module._fused_router_choice(args, opts, None, "auto")                # the default mode: fused
    _on()
    assert router_module._fused_router_choice(args, opts, None, "auto") == served
    assert router_module._fused_router_choice(args, opts, None, "fused")                # asked for by name: served


@pytest.mark.gpu
@pytest.mark.parametrize("renormalize,lora", [(False, False), (True, True)])
def test_gpu_fused_router_stays_invariant_without_renormalize_and_with_router_lora(renormalize, lora):
    """The routings the mode keeps on two launches at every T (invariant_fused_serves) give a token the same bits
    in batches of 1 to 1000 (each side of the one-launch kernel's switch at T=64)."""
    from moekit.routing.router import RouterLoRA

    _on()
    E, H = 128, 2048
    w = (torch.randn(E, H, device="cuda") * H ** -0.5).bfloat16()
    adapter = RouterLoRA(torch.randn(16, H, device="cuda").bfloat16(), torch.randn(E, 16, device="cuda"), 0.5) \
        if lora else None

    def run(t):
        return moekit.fused_router(t["x"], w, top_k=8, method="softmax_topk", renormalize=renormalize, lora=adapter)

    probe = {"x": torch.randn(1, H, device="cuda").bfloat16()}
    others = {"x": torch.randn(1000, H, device="cuda").bfloat16()}
    assert _invariant.token_mismatch(run, probe, others) is None


@pytest.mark.gpu
@pytest.mark.parametrize("weights, act_quant", invariance_checks.FORMATS)
@pytest.mark.parametrize("name", presets.names())
def test_gpu_experts_are_batch_invariant(name, weights, act_quant):
    _on()
    rows = invariance_checks.experts_checks(presets.get(name), torch.bfloat16, torch.device("cuda"), "auto",
                                            GPU_SIZES, formats=[(weights, act_quant)])
    assert all(r.ok for r in rows), [(r.op, r.detail) for r in rows if not r.ok]
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt-oss-120b", "deepseek-v3", "qwen3-30b-a3b"])
def test_gpu_layer_is_batch_invariant_eager_in_graphs_and_compiled(name):
    _on()
    spec = presets.get(name)
    layer = moekit.FusedMoE(spec, dtype=torch.bfloat16, device="cuda")
    probe = torch.randn(1, spec.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        alone = layer(probe)[0]
        compiled = torch.compile(layer, fullgraph=False, dynamic=False)
        for T in (1, 7, 129, 1000):
            x = torch.randn(T, spec.hidden_size, device="cuda").bfloat16()
            pos = T // 2
            x[pos] = probe[0]
            layer(x)  # the eager call before the capture
            graph, static = torch.cuda.CUDAGraph(), x.clone()
            with torch.cuda.graph(graph):
                captured = layer(static)
            graph.replay()
            assert torch.equal(captured[pos], alone), f"graph T={T}"
            assert torch.equal(compiled(x)[pos], alone), f"compile T={T}"
            assert torch.equal(layer(x)[pos], alone), f"eager T={T}"


@pytest.mark.gpu
def test_gpu_the_issues_case_is_batch_invariant():
    """The issue's measurement on gpt-oss-120b (bf16, swiglu_oai with biases): token 0 alone (decode kernels in
    the default mode) differed from the same token inside a call of 512 by up to 0.0156."""
    spec = presets.get("gpt-oss-120b")
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    w13 = torch.randn(E, 2 * I, H, device="cuda").bfloat16().mul_(H ** -0.5)
    w2 = torch.randn(E, H, I, device="cuda").bfloat16().mul_(I ** -0.5)
    b13, b2 = torch.randn(E, 2 * I, device="cuda") * 0.05, torch.randn(E, H, device="cuda") * 0.05
    x = torch.randn(512, H, device="cuda").bfloat16()
    tw, ids = route(torch.randn(512, E, device="cuda"), k, "topk_softmax")
    _on()
    alone = fused_experts(x[:1], w13, w2, tw[:1], ids[:1], activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    for n in (7, 512):
        y = fused_experts(x[:n], w13, w2, tw[:n], ids[:n], activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
        assert torch.equal(y[0], alone[0]), f"T={n}"


def test_the_benchmarks_probe_and_table_on_the_cpu():
    """The GPU benchmark's pieces that need no GPU: its bitwise probe of every op and its table."""
    import types

    from moekit.tools.bench import invariant as bench

    layer = types.SimpleNamespace(moe=moekit.FusedMoE(TINY_OAI, dtype=torch.float32), q13=None, q2=None, act_quant=None)
    x = torch.randn(9, TINY_OAI.hidden_size)
    tw, ids = route(torch.randn(9, TINY_OAI.num_experts), TINY_OAI.top_k, "softmax_topk")
    _on()
    assert all(bench.bitwise_invariant(bench._op_fn(op, "bf16", TINY_OAI), layer, x, tw, ids) for op in bench.OPS)
    rows = [dict(op="fused_experts", preset="p", format="bf16", T=T, default_us=10.0, invariant_us=us,
                 bitwise_invariant=True, ratio=us / 10.0) for T, us in ((1, 12.0), (16, 13.0), (32, 20.0), (64, 11.5))]
    rows.append(dict(op="FusedMoE", preset="p", format="bf16", T=1, default_us=None, invariant_us=None,
                     bitwise_invariant=None, ratio=None, error="RuntimeError: boom"))
    md = bench.markdown({"gpu": "cpu"}, rows)
    assert md.count("| met |") == 1 and md.count("**missed**") == 2 and "error: RuntimeError: boom" in md
    assert "4 rows measured, 1 errors; bitwise invariant in 4 of 4; speed target missed in 2." in md


@pytest.mark.gpu
def test_a_router_gemm_the_gate_refuses_falls_back_to_the_torch_tier_in_the_mode(monkeypatch):
    # cuBLAS picks its kernel by T and the gate's verdict is kept per token-count class: a refused Triton GEMM on
    # cuBLAS changed a token's logits with T
    from moekit.routing import router as router_mod

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(router_mod.router_tiers, "choose_tier",
                        lambda *a, **k: tiers.TierChoice("triton", "forced"))
    monkeypatch.setattr(router_mod.gate_case, "gemm_refusal", lambda *a, **k: "refused for the test")
    x, w = torch.randn(5, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    out = torch.empty(5, 8, device="cuda")
    assert router_mod._gemm(router_mod._GemmArgs(x, w, None, None), out)[0] == "cublas"
    _on()
    assert router_mod._gemm(router_mod._GemmArgs(x, w, None, None), out)[0] == "torch"
    torch.testing.assert_close(out, x @ w.T)


@pytest.mark.parametrize("lora", [False, True])
def test_the_gates_invariance_check_covers_calls_with_adapters(lora):
    # the check was skipped for LoRA calls, whose verdict was still stored as batch-invariant
    from moekit.experts import backends as experts_backends
    from moekit.experts import batched_torch, fused_torch
    from moekit.experts import gate_case as experts_gate

    def noisy(out, n):  # bits that depend on the batch: a perturbation of 1e-6 x (n mod 7)
        out.add_(out * (1e-6 * (n % 7)))

    def fused(out, x, *args, **kw):
        fused_torch(out, x, *args, **kw)
        noisy(out, x.shape[0])

    def batched(out, x, counts, *args, **kw):
        batched_torch(out, x, counts, *args, **kw)
        noisy(out, int(counts.sum()))

    varies = experts_backends.Backend("varies_with_T", lambda c, e: None, "planted", fused, batched, lora=True)
    _on()
    for op in ("fused", "batched"):
        call = experts_backends.ExpertsCall("dense", torch.float32, torch.device("cpu"), 9, op=op, lora=lora)
        passed, detail = experts_gate.check(varies, call)
        assert not passed and "not batch-invariant" in detail, detail
        torch_backend = next(b for b in experts_backends.BACKENDS if b.name == "torch")
        passed, detail = experts_gate.check(torch_backend, call)
        assert passed and "batch-invariant at T" in detail, detail


def test_the_gates_invariance_check_runs_the_calls_own_case():
    # it ran a small case of its own (two slots per token, its own sizes): a backend whose bits follow T only at the
    # call's k (or H, or I) passed
    from moekit.experts import backends as experts_backends
    from moekit.experts import fused_torch
    from moekit.experts import gate_case as experts_gate

    def fused(out, x, w13, w2, tw, ids, *args, **kw):
        fused_torch(out, x, w13, w2, tw, ids, *args, **kw)
        if ids.shape[1] == 6:  # k = 6 only: bits that depend on the batch
            out.add_(out * (1e-6 * (x.shape[0] % 7)))

    varies = experts_backends.Backend("varies_at_k6", lambda c, e: None, "planted", fused, None)
    _on()
    call = experts_backends.ExpertsCall("dense", torch.float32, torch.device("cpu"), 9, top_k=6)
    passed, detail = experts_gate.check(varies, call)
    assert not passed and "not batch-invariant" in detail, detail
    passed, detail = experts_gate.check(varies, dataclasses.replace(call, top_k=2))
    assert passed, detail
