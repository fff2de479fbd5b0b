"""router_gemm / GateLinear / fused_router against the float64 reference."""

import pytest
import torch

from moekit import presets, reference
from moekit.routing import tiers as router_tiers
from moekit.routing.router import GateLinear, RouterLoRA, fused_router, router_gemm
from moekit.metrics import Tolerance, check_close, routes_agree, separable_tokens

TOKENS = [0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129]
# fp32 accumulation of exact bf16/fp16 products: errors are fp32 summation noise (cuBLAS at
# H=2880 measured rms 2.3e-6), far below the 4e-3 of rounding logits to bf16.
LOGITS_TOL = Tolerance(max_rel=1e-4, rms_rel=1e-5)
CPU_TIERS = ["triton", "torch"]  # triton = the real kernel through the interpreter


def _inputs(T, H, E, dtype, device="cpu", bias=True, rank=0):
    x = torch.randn(T, H, dtype=dtype, device=device)
    w = (torch.randn(E, H, device=device) * H ** -0.5).to(dtype)
    b = torch.randn(E, device=device).to(dtype) if bias else None
    lora = None
    if rank:
        lora = RouterLoRA((torch.randn(rank, H, device=device) * H ** -0.5).to(dtype),
                          torch.randn(E, rank, device=device), 0.5)
    return x, w, b, lora


def _ref(x, w, b, lora):
    return reference.router_logits(x, w, b, *((lora.a, lora.b, lora.scale) if lora else ()))


def _poisoned(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("tier", CPU_TIERS)
@pytest.mark.parametrize("H,E,bias,rank,why", [
    (64, 8, True, 0, "small H, bias"),
    (40, 13, False, 0, "odd H, prime E, no bias"),
    (96, 32, True, 3, "LoRA rank 3"),
    (300, 7, True, 0, "H spans several K blocks and splits"),
])
def test_router_gemm_matches_reference(tier, H, E, bias, rank, why):
    for T in TOKENS:
        x, w, b, lora = _inputs(T, H, E, torch.float16, bias=bias, rank=rank)
        out = _poisoned((T, E), torch.float32, "cpu")
        got = router_gemm(x, w, b, lora=lora, tier=tier, out=out)
        assert got is out
        check_close(f"T={T}", got, _ref(x, w, b, lora), LOGITS_TOL)


@pytest.mark.parametrize("tier", CPU_TIERS)
def test_router_gemm_fp32_inputs_are_not_tf32(tier):
    x, w, b, _ = _inputs(33, 64, 16, torch.float32)
    check_close("fp32", router_gemm(x, w, b, tier=tier), _ref(x, w, b, None), Tolerance(1e-5, 1e-6))


@pytest.mark.parametrize("tier", CPU_TIERS)
def test_router_gemm_strided_and_offset_inputs(tier):
    big = torch.randn(50, 200, dtype=torch.float16)
    x = big[5:40:3, 7:71]                      # row stride 600, storage offset, H=64
    w = torch.randn(3 * 16, 64, dtype=torch.float16)[::3] * 0.1   # weight with row stride 192
    b = torch.randn(32)[::2]                   # strided bias
    check_close("strided", router_gemm(x, w, b, tier=tier), _ref(x, w, b, None), LOGITS_TOL)
    x3 = torch.randn(2, 5, 64, dtype=torch.float16).transpose(0, 1)   # [..., H] non-contiguous 3-D
    got = router_gemm(x3, w, b, tier=tier)
    assert got.shape == (5, 2, 16)
    check_close("3-D", got, _ref(x3, w, b, None), LOGITS_TOL)


# Rounding fp32 logits to bf16 to nearest costs at most 2^-8 relative. Triton 3.6's interpreter
# truncates instead (1 + 2^-8 + 2^-10 -> 1.0; up to 2^-7): a 4e-3 budget there failed ~1 run in 30.
BF16_OUT_TOL = {"rne": Tolerance(2**-8 + 1e-5, 2**-8 + 1e-5), "interpreter": Tolerance(2**-7 + 1e-5, 2**-7 + 1e-5)}


@pytest.mark.parametrize("tier", CPU_TIERS)
def test_router_gemm_low_precision_out(tier):
    x, w, b, _ = _inputs(9, 64, 8, torch.float16)
    got = router_gemm(x, w, b, out_dtype=torch.bfloat16, tier=tier)
    assert got.dtype == torch.bfloat16
    check_close("bf16 out", got, _ref(x, w, b, None), BF16_OUT_TOL["interpreter" if tier == "triton" else "rne"])


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["triton", "cublas"])
def test_router_gemm_gpu_low_precision_out(tier):
    for T in (1, 9, 129):
        x, w, b, _ = _inputs(T, 2880, 128, torch.bfloat16, "cuda")
        got = router_gemm(x, w, b, out_dtype=torch.bfloat16, tier=tier)
        check_close(f"T={T}", got, _ref(x, w, b, None), BF16_OUT_TOL["rne"])


def test_gate_linear_module():
    gate = GateLinear(64, 12, bias=True, params_dtype=torch.float16)
    with torch.no_grad():
        gate.bias.normal_()
    x = torch.randn(3, 7, 64, dtype=torch.float16)
    for tier in ("torch", "triton"):
        gate.tier = tier
        out = gate(x)
        assert out.shape == (3, 7, 12) and out.dtype == torch.float32
        check_close(tier, out, _ref(x, gate.weight, gate.bias, None), LOGITS_TOL)
    a, b = torch.randn(4, 64, dtype=torch.float16) * 0.1, torch.randn(12, 4)
    gate.set_lora(a, b, scale=2.0)
    check_close("lora", gate(x), reference.router_logits(x, gate.weight, gate.bias, a, b, 2.0), LOGITS_TOL)
    gate.tier = "auto"
    assert "torch" in gate.explain(5) and "GateLinear" not in repr(gate.lora)
    assert "lora=True" in repr(gate)


# ------------------------------------------------------------------------------ fused router
FUSED_CASES = [  # (preset, why)
    ("gpt-oss-120b", "topk_softmax with router bias"),
    ("deepseek-v3", "grouped sigmoid with correction bias and scaling"),
    ("kimi-k2", "one group, k=8"),
    ("qwen3-30b-a3b", "softmax_topk renormalized, k=8"),
    ("mixtral-8x7b", "E=8, k=2"),
]


def _preset_inputs(spec, T, dtype, device="cpu", H=None):
    H = H or spec.hidden_size
    x, w, b, _ = _inputs(T, H, spec.num_experts, dtype, device, bias=spec.router_bias)
    kwargs = spec.routing_kwargs()
    if spec.correction_bias:
        kwargs["correction_bias"] = torch.rand(spec.num_experts, device=device) * 0.1
    return x, w, b, kwargs


def _check_fused(spec, x, w, b, kwargs, impl, lora=None):
    tw, tid = fused_router(x, w, b, top_k=spec.top_k, method=spec.routing, impl=impl, lora=lora, **kwargs)
    logits64 = _ref(x, w, b, lora)
    rw, rid = reference.route(logits64, spec.top_k, spec.routing, **kwargs)
    mask = separable_tokens(logits64, spec.top_k, spec.routing, **kwargs)
    agree, werr = routes_agree(tw, tid, rw, rid, mask)
    assert tid.dtype == torch.int32 and tw.dtype == torch.float32
    assert agree == 1.0, f"top-k agreement {agree:.4f} on separable tokens"
    assert werr < 1e-4, f"weight error {werr:.2e}"
    if tid.numel():
        assert tid.min() >= 0 and tid.max() < spec.num_experts
    return mask


@pytest.mark.parametrize("name,why", FUSED_CASES)
def test_fused_router_interpreted(name, why):
    spec = presets.get(name).scaled(hidden_size=64)
    for T in [0, 1, 7, 9, 33]:
        x, w, b, kwargs = _preset_inputs(spec, T, torch.float16)
        _check_fused(spec, x, w, b, kwargs, "fused")
        _check_fused(spec, x, w, b, kwargs, "unfused")


def test_fused_router_with_lora_and_strided_input():
    spec = presets.get("gpt-oss-120b").scaled(hidden_size=64)
    big = torch.randn(30, 150, dtype=torch.float16)
    x = big[1:20:2, 3:67]
    _, w, b, kwargs = _preset_inputs(spec, 1, torch.float16)
    _, _, _, lora = _inputs(1, 64, spec.num_experts, torch.float16, rank=5)
    _check_fused(spec, x, w, b, kwargs, "fused", lora)


def test_fused_router_cpu_auto_falls_back():
    spec = presets.get("mixtral-8x7b").scaled()
    x, w, b, kwargs = _preset_inputs(spec, 5, torch.float32)
    _check_fused(spec, x, w, b, kwargs, "auto")


# ------------------------------------------------------------------------------- bad input
def _bad(fn, err, match):
    with pytest.raises(err, match=match):
        fn()


def test_bad_input_is_named():
    x, w, b, _ = _inputs(4, 64, 8, torch.float16)
    _bad(lambda: router_gemm(x[:, :32], w), ValueError, r"x must have shape \[\.\.\., H=64\].*got \(4, 32\)")
    _bad(lambda: router_gemm(x.float(), w), TypeError, "x must have the weight's dtype torch.float16, got torch.float32")
    _bad(lambda: router_gemm(x, w[0]), ValueError, "weight must have 2 dimensions")
    _bad(lambda: router_gemm(x, w[:0]), ValueError, "weight must be a non-empty")
    _bad(lambda: router_gemm(x, w.int()), TypeError, "weight must have dtype")
    _bad(lambda: router_gemm(x, w, b[:7]), ValueError, r"bias must have shape \(8,\), got \(7,\)")
    _bad(lambda: router_gemm(x, w, out=torch.empty(4, 8, dtype=torch.float16)), TypeError, "out must have dtype torch.float32")
    _bad(lambda: router_gemm(x, w, out=torch.empty(4, 9)), ValueError, r"out must have shape \(4, 8\)")
    _bad(lambda: router_gemm(x, w, out=torch.empty(8, 4).T), ValueError, "unit stride")
    _bad(lambda: router_gemm(x, w, out_dtype=torch.int32), TypeError, "out_dtype")
    _bad(lambda: router_gemm(x, w, tier="cublas"), ValueError, "tier='cublas' needs a CUDA device")
    _bad(lambda: router_gemm(x, w, tier="fast"), ValueError, "tier must be")
    _bad(lambda: router_gemm(x, w, lora=RouterLoRA(torch.randn(2, 64, dtype=torch.float16), torch.randn(7, 2))),
         ValueError, r"lora.b must have shape \(8, 2\)")
    _bad(lambda: fused_router(x, w, top_k=9, method="softmax_topk"), ValueError, "top_k must be in")
    _bad(lambda: fused_router(x, w, top_k=2, method="sigmoid_grouped", num_groups=3), ValueError, "num_groups must divide")
    _bad(lambda: fused_router(x, w, top_k=2, method="softmax_topk", impl="magic"), ValueError, "impl must be")
    _bad(lambda: GateLinear(64, 0), ValueError, "num_experts")
    big = torch.randn(129, 64, dtype=torch.float16)
    _bad(lambda: fused_router(big, w, top_k=2, method="softmax_topk", impl="fused"), ValueError,
         "impl='fused' serves at most 128 tokens, got T=129")


def test_out_aliasing_an_input_is_refused():
    w = torch.randn(8, 8)
    x = torch.randn(4, 8)
    _bad(lambda: router_gemm(x, w, out=x[:, :8]), ValueError, "out must not overlap the memory of x")


def test_zero_tokens():
    x, w, b, _ = _inputs(0, 64, 8, torch.float16)
    assert router_gemm(x, w, b, tier="triton").shape == (0, 8)
    tw, tid = fused_router(x, w, b, top_k=2, method="softmax_topk", impl="fused")
    assert tw.shape == tid.shape == (0, 2)


# ------------------------------------------------------------------------------------- GPU
GPU_SHAPES = [  # (H, E, why)
    (64, 8, "tiny"), (2880, 32, "gpt-oss-20b"), (2880, 128, "gpt-oss-120b"), (7168, 256, "deepseek-v3"),
    (7168, 384, "kimi-k2"), (2048, 128, "qwen3-30b-a3b"), (4096, 8, "mixtral"), (2880, 384, "odd mix"),
]
GPU_TOKENS = TOKENS + [1000]


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["triton", "cublas", "auto"])
@pytest.mark.parametrize("H,E,why", GPU_SHAPES)
def test_router_gemm_gpu(tier, H, E, why):
    for T in GPU_TOKENS:
        for bias in (True, False):
            x, w, b, _ = _inputs(T, H, E, torch.bfloat16, "cuda", bias=bias)
            out = _poisoned((T, E), torch.float32, "cuda")
            check_close(f"T={T} bias={bias}", router_gemm(x, w, b, tier=tier, out=out), _ref(x, w, b, None), LOGITS_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["triton", "cublas"])
def test_router_gemm_gpu_lora_strided(tier):
    big = torch.randn(300, 3000, dtype=torch.bfloat16, device="cuda")
    for T in (1, 9, 65, 129):
        x = big[3:3 + 2 * T:2, 17:17 + 2880]
        _, w, b, lora = _inputs(T, 2880, 128, torch.bfloat16, "cuda", rank=16)
        check_close(f"T={T}", router_gemm(x, w, b, lora=lora, tier=tier), _ref(x, w, b, lora), LOGITS_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name,why", FUSED_CASES)
def test_fused_router_gpu(name, why):
    spec = presets.get(name)
    for T in GPU_TOKENS:
        x, w, b, kwargs = _preset_inputs(spec, T, torch.bfloat16, "cuda")
        mask = _check_fused(spec, x, w, b, kwargs, "auto")
        if T <= router_tiers.FUSED_MAX_TOKENS:  # the one-launch kernel also where auto does not take it
            _check_fused(spec, x, w, b, kwargs, "fused")
        if T >= 64:
            # The check is not vacuous. Sigmoid compresses score gaps, so under the criterion
            # (gap > 1e-4 max|logit|) only 72-88% of grouped-sigmoid tokens are separable (H200 run).
            assert mask.float().mean() > (0.5 if spec.routing == "sigmoid_grouped" else 0.9)


@pytest.mark.gpu
def test_fused_router_gpu_is_deterministic_and_graph_capturable():
    spec = presets.get("deepseek-v3")
    x, w, b, kwargs = _preset_inputs(spec, 16, torch.bfloat16, "cuda")
    first = fused_router(x, w, b, top_k=8, method=spec.routing, **kwargs)
    for _ in range(20):
        again = fused_router(x, w, b, top_k=8, method=spec.routing, **kwargs)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_router(x, w, b, top_k=8, method=spec.routing, **kwargs)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        expect = fused_router(x, w, b, top_k=8, method=spec.routing, **kwargs)
        assert torch.equal(captured[1], expect[1]) and torch.equal(captured[0], expect[0])


@pytest.mark.gpu
@pytest.mark.parametrize("T,why", [
    (3, "three finishers of one token in a 16-token block"),
    (16, "a full block: sixteen finishers"),
    (17, "a second block holding one token: one finisher there"),
    (128, "eight blocks of sixteen finishers: about one waiting program per SM"),
])
def test_fused_router_gpu_shared_finishing(T, why):
    # The last programs of a token block share its routing: each waits on the arrival counter, and the
    # counter must be back at zero after every launch, also inside a graph replayed many times.
    spec = presets.get("qwen3-30b-a3b")
    x, w, b, kwargs = _preset_inputs(spec, T, torch.bfloat16, "cuda")
    cfg = router_tiers.kernel_config(T, spec.hidden_size, spec.num_experts, 0, True,
                                     torch.cuda.get_device_properties(0).multi_processor_count)
    assert cfg.fin_programs > 1
    call = lambda: fused_router(x, w, b, top_k=spec.top_k, method=spec.routing, impl="fused", **kwargs)  # noqa: E731
    first = call()
    _check_fused(spec, x, w, b, kwargs, "fused")
    wide = torch.zeros(T, spec.hidden_size + 40, dtype=x.dtype, device="cuda")  # offset view, row stride > H
    wide[:, 24:24 + spec.hidden_size] = x
    _check_fused(spec, wide[:, 24:24 + spec.hidden_size], w, b, kwargs, "fused")
    for _ in range(50):
        again = call()
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        for _ in range(20):
            graph.replay()
        expect = call()
        assert torch.equal(captured[1], expect[1]) and torch.equal(captured[0], expect[0])


@pytest.mark.gpu
def test_bf16_logits_flip_choices_but_ours_do_not():
    # The regression that got a serving engine's router reverted: bf16 logits on 128 experts.
    spec = presets.get("gpt-oss-120b")
    x, w, b, kwargs = _preset_inputs(spec, 1000, torch.bfloat16, "cuda")
    logits64 = _ref(x, w, b, None)
    rw, rid = reference.route(logits64, 4, spec.routing)
    bf16_logits = torch.nn.functional.linear(x, w, b)
    w16, id16 = reference.route(bf16_logits, 4, spec.routing)
    assert routes_agree(w16, id16, rw, rid)[0] < 1.0
    tw, tid = fused_router(x, w, b, top_k=4, method=spec.routing)
    assert routes_agree(tw, tid, rw, rid, separable_tokens(logits64, 4, spec.routing))[0] == 1.0


@pytest.mark.gpu
def test_router_gemm_gpu_past_2_31_elements():
    # x has 300000 * 7168 > 2^31 elements: 32-bit offsets would wrap on the last rows.
    T, H, E = 300_000, 7168, 256
    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(E, H, device="cuda") * H ** -0.5).bfloat16()
    b = torch.randn(E, device="cuda")
    assert x.numel() > 2**31
    for tier in ("triton", "cublas"):
        out = router_gemm(x, w, b, tier=tier)
        check_close(tier, out[-64:], _ref(x[-64:], w, b, None), LOGITS_TOL)
    del x


def test_a_router_adapter_travels_with_the_state_dict():
    # the adapter was a plain attribute: state_dict() had no trace of it, and a twin loaded "all keys matched"
    # then routed without it
    H, E = 32, 8
    gate = GateLinear(H, E, params_dtype=torch.float32)
    gate.set_lora(torch.randn(4, H), torch.randn(E, 4), scale=2.0)
    state = gate.state_dict()
    assert {"lora_a", "lora_b", "lora_scale"} <= set(state)
    twin = GateLinear(H, E, params_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        twin.load_state_dict(state)  # an adapter it does not have: said, not dropped
    twin.set_lora(torch.zeros(4, H), torch.zeros(E, 4))
    twin.load_state_dict(state)
    x = torch.randn(5, H)
    assert twin.lora.scale == 2.0 and torch.equal(twin(x), gate(x))
    with torch.no_grad():
        twin.lora_scale.fill_(0.5)  # a write torch sees: the next call reads the new scale
    assert twin.lora.scale == 0.5
    twin.set_lora(None)
    assert twin.lora is None and "lora_a" not in twin.state_dict()


def test_gatelinear_reads_its_lora_scale_once_under_inference_mode():
    # inference tensors keep no version counter: the scale was read again (a sync) on every forward of a module
    # built or moved under inference_mode, which also failed CUDA-graph capture
    H, E = 16, 4
    with torch.inference_mode():
        gate = GateLinear(H, E, params_dtype=torch.float32)
        gate.set_lora(torch.randn(2, H), torch.randn(E, 2), scale=0.5)
        gate.lora_scale = torch.tensor(0.5)  # a scale assigned (or loaded) under inference_mode: no version counter
        assert gate.lora_scale.is_inference()
        first = gate.lora
        assert first.scale == 0.5 and gate.lora is first  # cached: no second read
        gate.lora_scale.fill_(2.0)  # a write inside inference_mode is still seen
        assert gate.lora.scale == 2.0
        x = torch.randn(3, H)
        check_close("under inference_mode", gate(x), _ref(x, gate.weight, None, gate.lora), LOGITS_TOL)


def test_gatelinear_sees_a_new_lora_scale_tensor():
    # a new tensor assigned through .data kept the cached float of the old one
    from moekit.routing import GateLinear

    g = GateLinear(16, 4, params_dtype=torch.float32, device="cpu")
    g.set_lora(torch.randn(2, 16), torch.randn(4, 2), 0.5)
    assert g.lora.scale == 0.5
    g.lora_scale.data = torch.tensor(3.0)
    assert g.lora.scale == 3.0
