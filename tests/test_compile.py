"""GateLinear and FusedMoE under torch.compile(fullgraph=True): no graph breaks, eager results."""

import pytest
import torch

import moekit
from moekit.metrics import Tolerance, check_close

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _experts_call(device, dtype, H, I, E=6, T=9, k=2):
    """(w13, w2, x, topk_weights, topk_ids) of a small experts call; weights in float32 for quantizing."""
    w13, w2 = torch.randn(E, 2 * I, H, device=device) * 0.2, torch.randn(E, H, I, device=device) * 0.2
    x, tw = torch.randn(T, H, device=device, dtype=dtype), torch.rand(T, k, device=device)
    return w13, w2, x, tw, torch.randint(0, E, (T, k), device=device, dtype=torch.int32)


def _tolerance(device) -> Tolerance:
    return Tolerance(1e-6, 1e-6) if device == "cpu" else Tolerance(1e-2, 1e-3)


def _check_batched(name, run, xb, counts, *args):
    """Compiled against eager on the valid rows (padding rows are unspecified)."""
    valid = torch.arange(xb.shape[1], device=xb.device)[None, :] < counts[:, None]
    check_close(name, torch.compile(run, fullgraph=True)(xb, counts, *args)[valid], run(xb, counts, *args)[valid],
                _tolerance(xb.device.type))


@pytest.mark.parametrize("device", DEVICES)
def test_gate_linear_compiles_fullgraph(device):
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gate = moekit.GateLinear(64, 8, bias=True, params_dtype=dtype, device=device)
    x = torch.randn(5, 64, device=device, dtype=dtype)
    check_close("compiled GateLinear", torch.compile(gate, fullgraph=True)(x), gate(x), Tolerance(1e-6, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_compiles_fullgraph(device):
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    layer = moekit.FusedMoE.from_preset("deepseek-v3", dtype=dtype, device=device, scaled=True)
    x = torch.randn(7, layer.spec.hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        check_close("compiled FusedMoE", torch.compile(layer, fullgraph=True)(x), layer(x), Tolerance(1e-5, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_routing_and_the_layer_compile_fullgraph_with_dynamic_shapes(device):
    # dynamic=True hands Python floats (scaling's default) to the argument checks as SymFloats.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    layer = moekit.FusedMoE.from_preset("qwen3-30b-a3b", dtype=dtype, device=device, scaled=True)
    w = torch.randn(8, 32, device=device, dtype=dtype)
    cases = {"route": (lambda lg: moekit.route(lg, 2, "softmax_topk"), torch.randn(5, 8, device=device)),
             "fused_router": (lambda x: moekit.fused_router(x, w, top_k=2, method="softmax_topk"),
                              torch.randn(5, 32, device=device, dtype=dtype)),
             "FusedMoE": (layer, torch.randn(5, layer.spec.hidden_size, device=device, dtype=dtype))}
    with torch.no_grad():
        for name, (fn, x) in cases.items():
            torch._dynamo.reset()
            got, want = torch.compile(fn, fullgraph=True, dynamic=True)(x), fn(x)
            for g, e in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want))):
                check_close(f"{name} compiled with dynamic=True", g.double(), e.double(), Tolerance(1e-5, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_experts_triton_op_compiles_fullgraph(device):
    torch._dynamo.reset()
    from moekit.experts import fused_experts

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    w13, w2, x, tw, tid = _experts_call(device, dtype, 32, 16)
    w13, w2 = w13.to(dtype), w2.to(dtype)
    run = lambda x, tw, tid: fused_experts(x, w13, w2, tw, tid, backend="triton")  # noqa: E731
    check_close("compiled fused_experts", torch.compile(run, fullgraph=True)(x, tw, tid), run(x, tw, tid),
                Tolerance(1e-6, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_with_an_expert_map_compiles_after_an_eager_call(device):
    # the eager call checks the map's values (a host sync); the trace must not look at them again
    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    layer = moekit.FusedMoE.from_preset("mixtral-8x7b", dtype=dtype, device=device, scaled=True)
    E = layer.spec.num_experts
    layer.expert_map = torch.where(torch.arange(E, device=device) % 2 == 0, torch.arange(E, device=device), -1).int()
    x = torch.randn(7, layer.spec.hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        eager = layer(x)
        check_close("compiled with expert_map", torch.compile(layer, fullgraph=True)(x), eager, Tolerance(1e-5, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_expert_lora_compiles_fullgraph_in_both_formats(device):
    # LoRA rides its own custom ops (the adapters' tensors in the schema): no trace into the launches
    torch._dynamo.reset()
    from moekit import ExpertsLoRA, batched_experts, fused_experts

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    E, H, I, r, n = 6, 32, 16, 4, 2
    g = lambda *shape: (torch.randn(*shape, device=device) * 0.2).to(dtype)  # noqa: E731
    w13, w2, x, tw, tid = _experts_call(device, dtype, H, I, E)
    w13, w2 = w13.to(dtype), w2.to(dtype)
    lora = ExpertsLoRA(g(n, E, r, H), g(n, E, 2 * I, r), g(n, E, r, I), g(n, E, H, r), scaling=[1.0, 0.5])
    lid = torch.tensor([0, 1, -1, 0, 1, 1, 0, -1, 0], device=device, dtype=torch.int32)
    run = lambda x, tw, tid, lid: fused_experts(x, w13, w2, tw, tid, backend="triton", lora=lora,  # noqa: E731
                                                lora_ids=lid)
    check_close("compiled fused_experts with LoRA", torch.compile(run, fullgraph=True)(x, tw, tid, lid),
                run(x, tw, tid, lid), _tolerance(device))
    xb, counts = g(E, 3, H), torch.tensor([3, 0, 1, 2, 3, 1], device=device, dtype=torch.int32)
    lid_b = torch.randint(-1, n, (E, 3), device=device, dtype=torch.int32)
    run_b = lambda xb, counts, lid_b: batched_experts(xb, counts, w13, w2, backend="triton", lora=lora,  # noqa: E731
                                                      lora_ids=lid_b)
    _check_batched("compiled batched_experts with LoRA", run_b, xb, counts, lid_b)


def _quantized(recipe, w):
    from moekit.formats import nvfp4, prepare, quantize_experts

    if recipe.startswith("nvfp4_swizzled"):  # scales in the 128x4 layout, unswizzled inside the op
        q = nvfp4.quantize(w, swizzled=True, scale_dims=1)
    else:
        q = quantize_experts(w, recipe.removesuffix("_pairs"))
    return prepare(q) if recipe.endswith("_pairs") else q


@pytest.mark.parametrize("case", [
    ("mxfp4", None, False),           # 4-bit weights: parts of the weight objects in the op's schema
    ("nvfp4_swizzled", None, False),  # a swizzled NVFP4 stack (its layout flag travels too)
    ("fp8_block", "fp8_group", False),  # W8A8: act_quant in the schema
    ("fp8_channel", "fp8_group", False),  # another FP8 granularity (its tag)
    ("nvfp4", None, False),           # linear NVFP4 scales and a per-expert global scale
    ("nvfp4_swizzled_pairs", None, False),  # prepared codes: the byte layout travels in the tag with the scales'
    ("dense", None, True),            # an explicit block configuration, as literal text
])
@pytest.mark.parametrize("device", DEVICES)
def test_every_experts_call_kind_compiles_fullgraph(device, case):
    torch._dynamo.reset()
    from moekit import batched_experts, fused_experts
    from moekit.experts import ExpertsConfig, GemmConfig

    recipe, act_quant, explicit = case
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    w13, w2, x, tw, tid = _experts_call(device, dtype, 128, 128)
    if recipe == "dense":
        w13, w2 = w13.to(dtype), w2.to(dtype)
    else:
        w13, w2 = _quantized(recipe, w13), _quantized(recipe, w2)
    config = ExpertsConfig(16, GemmConfig(32, 64, num_stages=1), GemmConfig(32, 64, num_stages=1)) if explicit else None
    run = lambda x, tw, tid: fused_experts(x, w13, w2, tw, tid, backend="triton", act_quant=act_quant,  # noqa: E731
                                           config=config)
    check_close(f"compiled fused_experts {case}", torch.compile(run, fullgraph=True)(x, tw, tid), run(x, tw, tid),
                _tolerance(device))
    xb = torch.randn(6, 3, 128, device=device, dtype=dtype)
    counts = torch.tensor([3, 0, 1, 2, 3, 1], device=device, dtype=torch.int32)
    run_b = lambda xb, counts: batched_experts(xb, counts, w13, w2, backend="triton", act_quant=act_quant,  # noqa: E731
                                               config=config)
    _check_batched(f"compiled batched_experts {case}", run_b, xb, counts)


def test_an_explicit_config_is_guarded_by_value_not_by_object():
    # a config rebuilt per call (equal values) must not recompile, and one built inside the compiled code traces
    import torch._dynamo.testing

    from moekit import fused_experts
    from moekit.experts import ExpertsConfig, GemmConfig

    torch._dynamo.reset()
    w13, w2, x, tw, tid = _experts_call("cpu", torch.float32, 64, 32)
    make = lambda: ExpertsConfig(16, GemmConfig(32, 64, num_stages=1), GemmConfig(32, 64, num_stages=1))  # noqa: E731
    eager = fused_experts(x, w13, w2, tw, tid, backend="triton", config=make())
    frames = torch._dynamo.testing.CompileCounter()
    run = torch.compile(lambda x, cfg: fused_experts(x, w13, w2, tw, tid, backend="triton", config=cfg),
                        backend=frames, fullgraph=True)
    for _ in range(3):
        check_close("compiled with a config argument", run(x, make()), eager, Tolerance(1e-6, 1e-6))
    assert frames.frame_count == 1
    inside = torch.compile(lambda x: fused_experts(x, w13, w2, tw, tid, backend="triton", config=make()),
                           fullgraph=True)
    check_close("compiled with a config made inside", inside(x), eager, Tolerance(1e-6, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_out_under_compile_is_written_in_full_and_checked_for_overlap_when_it_runs(device):
    # traced tensors have no memory to compare: the ops check out= against their inputs when the graph runs
    torch._dynamo.reset()
    from moekit import fused_experts, router_gemm
    from moekit.formats import quantize_experts

    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    E, H, T = 6, 64, 9
    w32, w2_32, x, tw, tid = _experts_call(device, dtype, H, 32, E, T)
    w13, w2 = w32.to(dtype), w2_32.to(dtype)
    q13, q2 = quantize_experts(w32, "mxfp4"), quantize_experts(w2_32, "mxfp4")
    tol = _tolerance(device)
    for a, b in ((w13, w2), (q13, q2)):  # the dense op and the general one
        run = torch.compile(lambda x, out, a=a, b=b: fused_experts(x, a, b, tw, tid, backend="triton", out=out),
                            fullgraph=True)
        out = torch.full((T, H), float("nan"), device=device, dtype=dtype)
        assert run(x, out).data_ptr() == out.data_ptr()
        check_close("compiled fused_experts into out=", out, fused_experts(x, a, b, tw, tid, backend="triton"), tol)
        with pytest.raises(ValueError, match="out must not overlap the memory of x"):
            run(x, x)
    w = torch.randn(E, H, device=device, dtype=dtype)
    gemm = torch.compile(lambda x, out: router_gemm(x, w, out=out, out_dtype=dtype, tier="triton"), fullgraph=True)
    logits = torch.full((T, E), float("nan"), device=device, dtype=dtype)
    gemm(x, logits)
    check_close("compiled router_gemm into out=", logits, router_gemm(x, w, out_dtype=dtype, tier="triton"), tol)
    with pytest.raises(ValueError, match="out must not overlap the memory of x"):
        gemm(x, x[:, :E])


def test_compiled_router_and_layer_give_gradients_where_eager_does():
    # on the CPU the eager calls differentiate (the torch tiers); compiled, fused_router crashed (its op has no
    # autograd formula) and router_gemm's logits silently required no grad
    torch._dynamo.reset()
    layer = moekit.FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
    x = torch.randn(4, layer.spec.hidden_size)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True)(x)
    assert compiled.requires_grad and torch.equal(compiled, eager)
    compiled.sum().backward()
    assert layer.gate.weight.grad is not None and layer.w13.grad is not None
    gate = moekit.GateLinear(64, 8, params_dtype=torch.float32)
    logits = torch.compile(gate, fullgraph=True)(x[:, :64])
    assert logits.requires_grad and torch.equal(logits, gate(x[:, :64]))
