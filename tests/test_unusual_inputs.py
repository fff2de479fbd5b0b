"""Legal inputs laid out or filled in ways the common path does not see, each once a silent wrong result: strided
expert maps and scale stacks, out= sharing memory with what the kernels read, NaN where no token should see it,
casts of a layer that must keep its fp32 biases, and the reference's own reading of ids outside an expert map. CPU:
the torch backend and the Triton kernels through the interpreter (fp16/fp32), against float64."""

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import moekit
from moekit import FusedMoE, formats, presets, reference
from moekit.experts import ExpertsLoRA, batched_experts, fused_experts
from moekit.experts.configs import ExpertsConfig, GemmConfig
from moekit.formats import quantize_experts
from moekit.metrics import Tolerance, check_close

_G = GemmConfig(block_n=16, block_k=16, num_warps=4, num_stages=1)
MODES = [
    (ExpertsConfig(16, _G, _G), "aligned row blocks"),
    (ExpertsConfig(16, _G, _G, mode="per_pair"), "tensor-core GEMMs per pair"),
    (ExpertsConfig(16, _G, _G, mode="gemv"), "CUDA-core GEMVs"),
]
BACKENDS = [("torch", None, "torch backend")] + [("triton", cfg, why) for cfg, why in MODES]
FP16 = Tolerance(2e-2, 5e-3)
# the kernels' cases on the CPU (through the interpreter) and on a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _stacks(E, H, I, dtype=torch.float16, device="cpu"):
    return ((torch.randn(E, 2 * I, H, device=device) * H ** -0.5).to(dtype),
            (torch.randn(E, H, I, device=device) * I ** -0.5).to(dtype))


def _routes(T, E, k, device="cpu"):
    return (torch.softmax(torch.randn(T, k, device=device), -1),
            torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int().to(device))


def _launchable(device):
    if not moekit._triton.can_launch(torch.device(device)):
        pytest.skip("the Triton kernels need a GPU, or TRITON_INTERPRET=1 on the CPU")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend,config,why", BACKENDS, ids=[b[2] for b in BACKENDS])
def test_a_strided_expert_map_is_read_by_its_values(backend, config, why, device):
    if backend == "triton":
        _launchable(device)
    elif device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    E, H, I, T, k = 5, 40, 24, 13, 3
    w13, w2 = _stacks(E, H, I, device=device)
    x = torch.randn(T, H, device=device).half()
    tw, tid = _routes(T, 8, k, device)  # 8 global experts, 5 here
    storage = torch.zeros(16, dtype=torch.int32, device=device)
    storage[::2] = torch.tensor([-1, 0, 1, -1, 2, 3, 4, -1], dtype=torch.int32, device=device)
    emap = storage[::2]  # every other element: stride 2
    got = fused_experts(x, w13, w2, tw, tid, expert_map=emap, backend=backend, config=config)
    check_close(why, got, reference.fused_experts(x, w13, w2, tw, tid, expert_map=emap.contiguous()), FP16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("config,why", MODES[::2], ids=["aligned", "gemv"])
def test_4bit_scales_strided_in_their_last_dimension(fmt, config, why, device):
    _launchable(device)
    E, H, I, T, k = 4, 64, 32, 6, 2
    w13, w2 = _stacks(E, H, I, torch.float32, device)
    q13, q2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)

    def column_major(q):  # the same scale values, the groups of a row E x N apart
        s = q.scales.transpose(-1, -2).contiguous().transpose(-1, -2)
        return type(q)(**{**{f: getattr(q, f) for f in q.__dataclass_fields__}, "scales": s})

    s13, s2 = column_major(q13), column_major(q2)
    assert s13.scales.stride(-1) != 1
    x = torch.randn(T, H, device=device).half()
    tw, tid = _routes(T, E, k, device)
    got = fused_experts(x, s13, s2, tw, tid, backend="triton", config=config)
    check_close(why, got, reference.fused_experts(x, q13, q2, tw, tid), FP16)


@pytest.mark.parametrize("shared", ["w2_bias", "w13_bias", "expert_map", "topk_ids"])
def test_out_may_not_share_memory_with_what_the_kernels_read(shared):
    E, H, I, T, k = 5, 32, 16, 5, 2
    w13, w2 = _stacks(E, H, I, torch.float32)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    out = torch.zeros(T, H)
    kwargs = {"w13_bias": torch.randn(E, 2 * I), "w2_bias": torch.randn(E, H)}
    if shared == "w2_bias":
        kwargs["w2_bias"] = out  # [E=T, H]: the same shape as out
    elif shared == "w13_bias":
        kwargs["w13_bias"] = out.view(-1)[:E * 2 * I].view(E, 2 * I)
    elif shared == "expert_map":
        kwargs["expert_map"] = out.view(torch.int32)[0, :E]
        kwargs["expert_map"].copy_(torch.arange(E, dtype=torch.int32))
    else:
        tid = out.view(torch.int32)[:, :k]
        tid.copy_(_routes(T, E, k)[1])
    with pytest.raises(ValueError, match=f"out must not overlap the memory of {shared}"):
        fused_experts(x, w13, w2, tw, tid, out=out, **kwargs)


def test_batched_out_may_not_share_memory_with_its_bias():
    E, M, H, I = 4, 3, 32, 16
    w13, w2 = _stacks(E, H, I, torch.float32)
    out = torch.zeros(E, M, H)
    with pytest.raises(ValueError, match="out must not overlap the memory of w2_bias"):
        batched_experts(torch.randn(E, M, H), torch.tensor([3, 0, 2, 1], dtype=torch.int32), w13, w2,
                        w2_bias=out[:, 0], out=out)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block"])
def test_out_may_not_share_memory_with_a_quantized_weights_scales(fmt):
    # the decode modes write a token's output before later programs read w2's scales
    E, H, I, T, k = 4, 32, 128, 5, 2
    w13, w2 = _stacks(E, H, I, torch.float32)
    q13, q2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
    scales = q2.scale if fmt == "fp8_block" else q2.scales
    buf = torch.zeros(scales.nbytes + T * H * 4, dtype=torch.uint8)
    shared = buf[:scales.nbytes].view(scales.dtype).view(scales.shape)
    shared.copy_(scales)
    q2 = dataclasses.replace(q2, **{"scale" if fmt == "fp8_block" else "scales": shared})
    out = buf[:T * H * 4].view(torch.float32).view(T, H)  # out's first rows are the scales' bytes
    tw, tid = _routes(T, E, k)
    with pytest.raises(ValueError, match="out must not overlap the memory of w2.scales"):
        fused_experts(torch.randn(T, H), q13, q2, tw, tid, out=out)


def test_out_may_not_share_a_buffer_wrapped_by_two_storages():
    # two storage objects over one allocation (from_numpy of two views): the byte spans overlap, the storages differ
    T, H, E = 8, 32, 16
    buf = np.random.default_rng(0).standard_normal(T * H + T * E).astype(np.float32)
    x = torch.from_numpy(buf[:T * H]).view(T, H)
    out = torch.from_numpy(buf[4 * H:4 * H + T * E]).view(T, E)  # from x's row 4 on
    assert x.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="out must not overlap the memory of x"):
        moekit.router_gemm(x, torch.randn(E, H), out=out)


def test_router_out_may_not_share_memory_with_its_lora():
    # the Triton finisher reads the adapter's B after other programs stored logits
    T, H, E, r = 8, 32, 16, 4
    out = torch.zeros(T, E)
    b = out.view(-1)[:E * r].view(E, r)
    b.copy_(torch.randn(E, r))
    lora = moekit.routing.RouterLoRA(torch.randn(r, H), b, 0.5)
    with pytest.raises(ValueError, match="out must not overlap the memory of lora.b"):
        moekit.router_gemm(torch.randn(T, H), torch.randn(E, H), out=out, lora=lora)


@pytest.mark.parametrize("where", ["an unrouted row of x", "an expert no token uses"])
def test_nan_reaches_no_token_that_does_not_use_it(where):
    E, H, I, T, k = 5, 32, 16, 6, 2
    w13, w2 = _stacks(E, H, I, torch.float32)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E - 1, k)  # expert E - 1 gets no token
    if where == "an unrouted row of x":
        x[0] = float("nan")
        tid[0] = -1
    else:
        w13[E - 1] = float("nan")
    ref = reference.fused_experts(x, w13, w2, tw, tid)
    for backend in ["torch"] + (["triton"] if moekit._triton.can_launch(torch.device("cpu")) else []):
        got = fused_experts(x, w13, w2, tw, tid, backend=backend)
        assert torch.isfinite(got).all(), backend
        check_close(f"{backend}: NaN in {where}", got, ref, Tolerance(1e-4, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("part", ["w13_b", "w2_b"])
def test_an_adapter_no_token_uses_may_hold_nan(part, device):
    """Serving code allocates adapter slots before it fills them: an unwritten slot must not reach any token."""
    _launchable(device)
    E, H, I, T, k, r = 4, 32, 16, 9, 2, 4
    w13, w2 = _stacks(E, H, I, device=device)
    parts = {"w13_a": torch.randn(3, E, r, H), "w13_b": torch.randn(3, E, 2 * I, r) * 0.1,
             "w2_a": torch.randn(3, E, r, I), "w2_b": torch.randn(3, E, H, r) * 0.1}
    parts = {n: v.half().to(device) for n, v in parts.items()}
    clean = ExpertsLoRA(parts["w13_a"], parts["w13_b"], parts["w2_a"], parts["w2_b"], [2.0, 0.5, -1.0])
    parts[part] = parts[part].clone()
    parts[part][2] = float("nan")  # adapter 2: used by no token
    slot_nan = ExpertsLoRA(parts["w13_a"], parts["w13_b"], parts["w2_a"], parts["w2_b"], [2.0, 0.5, -1.0])
    x = torch.randn(T, H, device=device).half()
    tw, tid = _routes(T, E, k, device)
    lora_ids = torch.tensor([0, 1, 0, -1, 0, 1, 1, -1, 0], dtype=torch.int32, device=device)
    for config, why in MODES:
        want = fused_experts(x, w13, w2, tw, tid, lora=clean, lora_ids=lora_ids, backend="triton", config=config)
        got = fused_experts(x, w13, w2, tw, tid, lora=slot_nan, lora_ids=lora_ids, backend="triton", config=config)
        assert torch.equal(got, want), why


def test_casting_a_layer_keeps_its_fp32_biases():
    spec = presets.get("deepseek-v3").scaled()
    layer = FusedMoE(spec, dtype=torch.float32)
    gate = moekit.GateLinear(16, 4, bias=True)
    with torch.no_grad():
        gate.bias.fill_(0.1001)  # not a bf16 value
    corr, bias, param = layer.correction_bias.detach().clone(), gate.bias.detach().clone(), gate.bias
    layer.to(torch.bfloat16)
    gate.half()
    assert layer.gate.weight.dtype == torch.bfloat16 and gate.weight.dtype == torch.float16
    assert layer.correction_bias.dtype == torch.float32 and torch.equal(layer.correction_bias, corr)
    assert gate.bias.dtype == torch.float32 and torch.equal(gate.bias, bias) and gate.bias is param


@pytest.mark.parametrize("device", DEVICES)
def test_moving_a_gate_carries_its_lora(device):
    # The adapter is no parameter: .to() once left it behind, and the next call refused a's dtype or device.
    gate = moekit.GateLinear(64, 5, params_dtype=torch.bfloat16)
    a, b = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(5, 4)
    gate.set_lora(a, b, scale=0.5)
    gate.to(device=device, dtype=torch.float16)
    assert gate.lora.a.dtype == torch.float16 and gate.lora.a.device.type == device
    assert gate.lora.b.dtype == torch.float32 and gate.lora.b.device.type == device and gate.lora.scale == 0.5
    x = torch.randn(9, 64, device=device).half()
    want = reference.router_logits(x, gate.weight, None, a.half().to(device), b.to(device), 0.5)
    check_close("moved gate with LoRA", gate(x), want, Tolerance(2e-3, 1e-3))


def test_the_reference_reads_ids_outside_the_map_as_no_expert():
    E, H, I = 4, 16, 8
    w13, w2 = _stacks(E, H, I, torch.float64)
    x = torch.randn(3, H, dtype=torch.float64)
    tw = torch.ones(3, 1)
    tid = torch.tensor([[-1], [4], [2]], dtype=torch.int32)  # before the map, past it, inside it
    got = reference.fused_experts(x, w13, w2, tw, tid, expert_map=torch.arange(E, dtype=torch.int32))
    assert torch.equal(got[:2], torch.zeros(2, H, dtype=torch.float64))
    assert torch.equal(got[2], reference.fused_experts(x[2:], w13, w2, tw[2:], tid[2:])[0])


def test_torch_routing_returns_contiguous_routes_for_strided_logits():
    logits = torch.randn(16, 7).t()[:, 3:11]  # [7, 8], strides (1, 7)
    weights, ids = moekit.route(logits, 2, "softmax_topk", impl="torch")
    assert weights.is_contiguous() and ids.is_contiguous()
    ref_w, ref_ids = reference.route(logits.double(), 2, "softmax_topk")
    assert torch.equal(ids.long(), ref_ids)


# ------------------------------------------------------------------ formats at their edges (host routines)
def test_mxfp4_keeps_a_non_finite_block_nan_when_asked_to_let_it_through():
    # check_finite=False promises NaN/Inf propagate: MXFP4 once gave a NaN block scale byte 0 (tiny finite weights)
    # and an Inf block 2^0 (its raw codes); E8M0's NaN byte is the only scale that keeps them non-finite
    x = torch.randn(3, 64)
    x[0, 5], x[1, 40] = float("nan"), float("inf")
    got = formats.dequantize(formats.mxfp4.quantize(x, check_finite=False), torch.float32)
    assert got[0, :32].isnan().all() and got[1, 32:].isnan().all()
    clean = formats.dequantize(formats.mxfp4.quantize(x[2:]), torch.float32)
    assert torch.equal(got[0, 32:], formats.dequantize(formats.mxfp4.quantize(x[:1, 32:]), torch.float32)[0])
    assert torch.equal(got[2:], clean)


def test_an_nvfp4_expert_reads_its_own_row_of_global_scales():
    # a per-row global scale [E, N]: expert() read flat element e of it, and so did the float64 reference
    w = torch.randn(3, 4, 32)
    q = formats.nvfp4.quantize(w, scale_dims=2)
    whole = formats.dequantize(q, torch.float64)
    for e in range(3):
        assert torch.equal(formats.expert(q, e, torch.float64), whole[e])


def test_nvfp4_of_tiny_values_stays_finite():
    # below about 8e-36 the default global scale 2688 / amax was Inf: zeros, and NaN for all-zero blocks
    x = torch.zeros(2, 32)
    x[0, :16] = 1e-37
    got = formats.dequantize(formats.nvfp4.quantize(x), torch.float32)
    assert got.isfinite().all() and torch.equal(got[:, 16:], torch.zeros(2, 16)) and (got[0, :16] > 0).all()


def test_the_reference_dequantizes_in_float64():
    # MXFP4's two largest scale bytes put code 6 past float32's range: the float64 reference must not see Inf
    H = I = 32
    big = formats.mxfp4.MXFP4Tensor(torch.full((1, 2 * I, H // 2), 0x77, dtype=torch.uint8),  # codes 6.0
                                    torch.full((1, 2 * I, 1), 254, dtype=torch.uint8), (1, 2 * I, H))  # x 2^127
    w2 = formats.quantize_experts(torch.randn(1, H, I), "mxfp4")
    x = torch.full((2, H), 2.0 ** -131, dtype=torch.float64)  # h = 32 * 6 * 2^127 * 2^-131 = 12: finite
    got = reference.fused_experts(x, big, w2, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32))
    assert got.isfinite().all() and got.abs().max() > 0


def test_batched_layout_with_no_capacity():
    # M = 0 is a legal capacity (every pair dropped): pack_batched's view and combine_batched's gather failed
    x, ids = torch.randn(5, 8), torch.randint(0, 3, (5, 2))
    xb, counts, slot = moekit.layouts.pack_batched(x, ids, 3, 0)
    assert xb.shape == (3, 0, 8) and torch.equal(counts, torch.zeros(3, dtype=torch.int32)) and (slot == -1).all()
    out = moekit.layouts.combine_batched(xb, slot, torch.rand(5, 2))
    assert torch.equal(out, torch.zeros(5, 8))


@pytest.mark.parametrize("call", [
    lambda x, w: moekit.route(x @ w.T, 2, "softmax_topk", impl="triton"),
    lambda x, w: moekit.router_gemm(x, w, tier="triton"),
    lambda x, w: moekit.fused_router(x, w, top_k=2, method="softmax_topk", impl="fused"),
    lambda x, w: fused_experts(x[:, :8].contiguous(), w.view(1, 14, 8).expand(2, 14, 8).contiguous(), torch.randn(2, 8, 7),
                               torch.rand(5, 1), torch.randint(0, 2, (5, 1), dtype=torch.int32), backend="triton"),
], ids=["route", "router_gemm", "fused_router", "fused_experts"])
def test_kernels_say_when_they_drop_gradients(monkeypatch, call):
    # the Triton paths compute no gradients: a trainable router (or expert stack) silently got none
    _launchable("cpu")
    from moekit import _checks

    monkeypatch.setattr(_checks, "_WARNED_DETACHED", set())
    x, w = torch.randn(5, 16), torch.randn(7, 16, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="compute no gradients"):
        call(x, w)
    with torch.no_grad(), warnings.catch_warnings():
        monkeypatch.setattr(_checks, "_WARNED_DETACHED", set())
        warnings.simplefilter("error", RuntimeWarning)
        call(x, w)  # none asked: nothing to say


def test_batched_experts_of_no_experts():
    # a rank holding no experts: the torch backend failed to stack an empty list (the Triton one returned)
    out = batched_experts(torch.randn(0, 4, 16), torch.zeros(0, dtype=torch.int32), torch.randn(0, 16, 16),
                          torch.randn(0, 16, 8), backend="torch")
    assert out.shape == (0, 4, 16)


def test_casting_a_layer_keeps_its_adapters_scalings():
    # lora_scaling is a buffer: .to(bfloat16) made 1/3 into 0.334 (and .half() of 1e5 Inf), for good
    spec = presets.get("mixtral-8x7b").scaled()
    layer = FusedMoE(spec, dtype=torch.float32)
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    layer.load_lora(ExpertsLoRA(torch.randn(1, E, 2, H), torch.randn(1, E, 2 * I, 2), torch.randn(1, E, 2, I),
                                torch.randn(1, E, H, 2), [1 / 3]))
    layer.to(torch.bfloat16)
    assert layer.lora_scaling.dtype == torch.float32 and layer.lora_scaling.item() == torch.tensor(1 / 3).item()
    assert layer.lora_w13_a.dtype == torch.bfloat16


def test_a_layer_refuses_stacks_reassigned_with_another_expert_count():
    # ids past a shorter stack are no expert to the kernels: their tokens' outputs were zeros, silently
    layer = FusedMoE(presets.get("mixtral-8x7b").scaled(), dtype=torch.float32)
    x = torch.randn(5, layer.spec.hidden_size)
    layer.w13 = torch.nn.Parameter(layer.w13[:4].detach().clone())
    layer.w2 = torch.nn.Parameter(layer.w2[:4].detach().clone())
    with pytest.raises(ValueError, match="the router and the expert stacks must hold the layer's experts"):
        layer(x)
    shared = FusedMoE(presets.get("deepseek-v3").scaled(), dtype=torch.float32)
    shared.shared_w13 = torch.nn.Parameter(torch.randn(6, shared.spec.hidden_size))
    with pytest.raises(ValueError, match="shared_w13 must be"):
        shared(torch.randn(3, shared.spec.hidden_size))


def test_tokens_with_no_expert_slot_get_zeros():
    # top_k = 0 on the Triton backend returned at once and left out as it was (NaN here, or torch.empty's memory)
    _launchable("cpu")
    E, H, I, T = 5, 16, 16, 4
    w13, w2, x = torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(T, H)
    tw, tid = torch.zeros(T, 0), torch.zeros(T, 0, dtype=torch.int32)
    for backend in ("triton", "torch"):
        out = torch.full((T, H), float("nan"))
        fused_experts(x, w13, w2, tw, tid, out=out, backend=backend)
        assert torch.equal(out, torch.zeros(T, H)), backend
