"""FusedMoE against the float64 whole-layer reference."""

import pytest
import torch

import moekit
from moekit import presets, reference
from moekit.metrics import Tolerance, check_close


def _reference(layer, x):
    return reference.moe_layer(
        x, layer.gate.weight, layer.w13, layer.w2, layer.spec, router_bias=layer.gate.bias,
        correction_bias=layer.correction_bias, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        shared_w13=layer.shared_w13, shared_w2=layer.shared_w2)


@pytest.mark.parametrize("name", presets.names())
def test_fused_moe_matches_reference_on_scaled_presets(name):
    layer = moekit.FusedMoE.from_preset(name, dtype=torch.float32, scaled=True)
    if layer.gate.bias is not None:
        with torch.no_grad():
            layer.gate.bias.normal_()
    x = torch.randn(2, 9, layer.spec.hidden_size)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == x.shape
    check_close(name, out.reshape(-1, x.shape[-1]), _reference(layer, x.reshape(-1, x.shape[-1])), Tolerance(1e-4, 1e-5))


def test_load_weights_checks_names_and_shapes():
    layer = moekit.FusedMoE.from_preset("gpt-oss-20b", dtype=torch.float32, scaled=True)
    E, H, I = layer.spec.num_experts, layer.spec.hidden_size, layer.spec.intermediate_size
    w13 = torch.randn(E, 2 * I, H)
    layer.load_weights(w13=w13, gate_bias=torch.ones(E))
    assert torch.equal(layer.w13, w13) and torch.equal(layer.gate.bias, torch.ones(E))
    with pytest.raises(ValueError, match=r"w2 must have shape"):
        layer.load_weights(w2=torch.randn(E, H, I + 1))
    with pytest.raises(ValueError, match="unknown weight 'w3'"):
        layer.load_weights(w3=w13)
    with pytest.raises(ValueError, match="correction_bias is not a parameter"):
        layer.load_weights(correction_bias=torch.zeros(E))


def test_expert_map_drops_remote_experts():
    layer = moekit.FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
    x = torch.randn(5, layer.spec.hidden_size)
    full = layer(x)
    layer.expert_map = torch.arange(layer.spec.num_experts, dtype=torch.int32)  # all local: same result
    check_close("identity map", layer(x), full, Tolerance(1e-6, 1e-6))


def test_extra_repr_names_the_preset():
    assert "deepseek-v3@scaled" in repr(moekit.FusedMoE.from_preset("deepseek-v3", scaled=True))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantized_experts_serve_the_layer_and_survive_a_state_dict_round_trip(fmt):
    from moekit.formats import mxfp4, nvfp4, quantize_experts

    layer = moekit.FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.float32, scaled=True)
    q13, q2 = quantize_experts(layer.w13.detach(), fmt), quantize_experts(layer.w2.detach(), fmt)
    mod = mxfp4 if fmt == "mxfp4" else nvfp4
    d13, d2 = mod.dequantize(q13, torch.float32), mod.dequantize(q2, torch.float32)
    layer.load_quantized_experts(q13, q2, prepare=True)  # (by default only stacks on a CUDA device are prepared)
    assert layer.weight_format == fmt and "w13" not in dict(layer.named_parameters())
    x = torch.randn(7, layer.spec.hidden_size)
    ref = reference.moe_layer(x, layer.gate.weight, d13, d2, layer.spec)
    with torch.no_grad():
        check_close(fmt, layer(x), ref, Tolerance(1e-4, 1e-5))
    assert layer.expert_weights()[0].layout == "pairs"    # prepared once, at load
    saved = layer.state_dict()
    assert torch.equal(saved["w13_data"], q13.data) and torch.equal(saved["w2_data"], q2.data)  # checkpoint bytes
    for prepare in (True, False):  # a layer keeping prepared codes, and one keeping them as given
        twin = moekit.FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.float32, scaled=True)
        twin.load_quantized_experts(q13, q2, prepare=prepare)  # same buffers' shapes, then the saved values
        twin.w13_data.zero_()
        twin.load_state_dict(saved)
        assert twin.expert_weights()[0].layout == ("pairs" if prepare else "packed")
        with torch.no_grad():
            assert torch.equal(twin(x), layer(x)), prepare
        assert torch.equal(twin.state_dict()["w13_data"], q13.data)
    with pytest.raises(TypeError, match="must both be MXFP4Tensor, NVFP4Tensor or FP8Tensor"):
        layer.load_quantized_experts(torch.zeros(1), q2)
    with pytest.raises(ValueError, match="w13 must have shape"):
        twin.load_quantized_experts(quantize_experts(torch.randn(3, 64, 64), fmt), q2)
    with pytest.raises(TypeError, match="prepare must be True, False or None, got str"):
        twin.load_quantized_experts(q13, q2, prepare="pairs")


@pytest.mark.parametrize("granularity", ["fp8_block", "fp8_channel", "fp8_tensor"])
def test_fp8_experts_serve_the_layer_as_w8a8(granularity):
    # DeepSeek-V3's checkpoints hold FP8 blocks: the layer keeps them and runs W8A8 (FP8 activation groups)
    from moekit.formats import fp8, quantize_experts

    layer = moekit.FusedMoE.from_preset("deepseek-v3", dtype=torch.float32, scaled=True)
    with torch.no_grad():
        layer.shared_w13.zero_()                          # the routed experts alone are compared below
    q13, q2 = quantize_experts(layer.w13.detach(), granularity), quantize_experts(layer.w2.detach(), granularity)
    layer.load_quantized_experts(q13, q2)
    assert layer.weight_format == "fp8" and layer.act_quant == "fp8_group"
    assert {"w13_data", "w13_scale", "w2_data", "w2_scale"} <= dict(layer.named_buffers()).keys()
    x = torch.randn(9, layer.spec.hidden_size)
    with torch.no_grad():
        got = layer(x)
        tw, tid = layer.route(x)
    ref = reference.fused_experts_w8a8(x, q13, q2, tw, tid, activation=layer.spec.activation)
    check_close(f"FP8 {granularity} W8A8 layer", got, ref, Tolerance(3e-2, 3e-2))
    w13, w2 = layer.expert_weights()
    assert isinstance(w13, fp8.FP8Tensor) and w13.granularity == q13.granularity
    assert layer.expert_weights()[0] is w13               # built once, not per call
    layer.load_quantized_experts(q13, q2, act_quant=None)  # W8A16: the weights dequantized, x as it is
    with torch.no_grad():
        plain = layer(x)
    d13, d2 = fp8.dequantize(q13, torch.float32), fp8.dequantize(q2, torch.float32)
    check_close("FP8 W8A16 layer", plain, reference.fused_experts(x, d13, d2, tw, tid), Tolerance(1e-4, 1e-5))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block", "mxfp4"])
def test_quantized_experts_survive_to_and_half(fmt):
    # .to(dtype) / .half() cast the dense parameters only: FP8 codes and every scale keep their dtypes (a cast
    # would destroy them), and the quantized tensors are rebuilt over the buffers that .to() replaced
    from moekit.formats import quantize_experts

    layer = moekit.FusedMoE.from_preset("deepseek-v3", dtype=torch.float32, scaled=True)
    q13, q2 = quantize_experts(layer.w13.detach(), fmt), quantize_experts(layer.w2.detach(), fmt)
    layer.load_quantized_experts(q13, q2, act_quant=None)
    dtypes = {n: b.dtype for n, b in layer.named_buffers() if n.startswith(("w13_", "w2_"))}
    before = layer.expert_weights()[0]
    x = torch.randn(6, layer.spec.hidden_size)
    with torch.no_grad():
        ref = layer(x)
        for moved in (layer.to(torch.bfloat16), layer.half(), layer.float()):
            assert {n: b.dtype for n, b in moved.named_buffers() if n.startswith(("w13_", "w2_"))} == dtypes
    assert layer.expert_weights()[0] is not before
    with torch.no_grad():
        check_close(f"{fmt} after .to()/.half()/.float()", layer(x), ref, Tolerance(1e-2, 5e-3))
    layer.w13_data = layer.w13_data.clone()                              # a replaced buffer: rebuilt over it
    assert layer.expert_weights()[0].data is layer.w13_data


def test_expert_map_values_are_checked_once_per_version():
    layer = moekit.FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
    x = torch.randn(5, layer.spec.hidden_size)
    E = layer.spec.num_experts
    layer.expert_map = torch.arange(E, dtype=torch.int32)
    layer(x)
    layer.expert_map[3] = E                               # an in-place change is seen at the next call
    with pytest.raises(ValueError, match=rf"local expert index in \[0, {E}\) \(E={E} from w13\), got values in \[0, {E}\]"):
        layer(x)
    layer.expert_map[3] = -1                              # -1: not on this rank, contributes zero
    layer(x)


def test_ids_past_a_short_expert_map_are_caught_by_the_gate():
    # fused_experts cannot know the global expert count; with the gate on, every eager call checks the ids
    from moekit.experts import fused_experts
    from moekit import gate

    E, H, I = 4, 32, 16
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    x, tw = torch.randn(3, H), torch.rand(3, 2)
    ids = torch.tensor([[0, 5], [1, 2], [3, 4]], dtype=torch.int32)  # 6 global experts, a map of 4
    short = torch.arange(E, dtype=torch.int32)
    fused_experts(x, w13, w2, tw, ids, expert_map=short)  # gate off: ids past the map contribute zero (documented)
    gate.set_verification(True)
    try:
        with pytest.raises(ValueError, match=r"topk_ids must be global expert ids in \[0, 4\) \(the length of "
                                             r"expert_map"):
            fused_experts(x, w13, w2, tw, ids, expert_map=short)
        fused_experts(x, w13, w2, tw, ids, expert_map=torch.tensor([0, 1, 2, 3, -1, -1], dtype=torch.int32))
    finally:
        gate.set_verification(None)
        gate.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_codes_loaded_on_the_cpu_are_prepared_when_they_reach_the_gpu(fmt):
    # the common flow: quantized experts loaded on the CPU, the module moved with .cuda(); the codes are prepared
    # then (prepare=None), the layer gives what the stacks as given give, and state_dict still holds their bytes
    from moekit.formats import quantize_experts

    layer = moekit.FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.bfloat16, scaled=True)
    q13, q2 = quantize_experts(layer.w13.detach().float(), fmt), quantize_experts(layer.w2.detach().float(), fmt)
    layer.load_quantized_experts(q13, q2)
    assert layer.expert_weights()[0].layout == "packed"
    layer.cuda()
    w13, w2 = layer.expert_weights()
    assert w13.layout == w2.layout == "pairs" and w13.data.is_cuda
    assert torch.equal(layer.state_dict()["w13_data"].cpu(), q13.data)
    x = torch.randn(9, layer.spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        tw, tid = layer.route(x)
        ref = reference.fused_experts(x, moekit.formats.dequantize(q13).cuda(), moekit.formats.dequantize(q2).cuda(),
                                      tw, tid, activation=layer.spec.activation)
        check_close(f"{fmt} prepared on .cuda()", layer(x), ref, Tolerance(2e-2, 5e-3))


def _mxfp4_layer(prepare, fmt="mxfp4"):
    from moekit import formats

    layer = moekit.FusedMoE.from_preset("mixtral-8x7b", scaled=True, dtype=torch.float32)
    layer.load_quantized_experts(formats.quantize_experts(torch.randn_like(layer.w13), fmt),
                                 formats.quantize_experts(torch.randn_like(layer.w2), fmt), prepare=prepare)
    return layer


@pytest.mark.parametrize("prepare", [False, True])
@pytest.mark.parametrize("fmt,key,dtype", [
    ("mxfp4", "w13_data", torch.int8),  # the same bytes as int8: a prepared module kept them in the stored layout
    ("nvfp4", "w2_scales", torch.uint8),  # E4M3 scale bytes as uint8: load_state_dict cast their values
])
def test_load_state_dict_refuses_quantized_parts_of_another_dtype(prepare, fmt, key, dtype):
    layer = _mxfp4_layer(prepare, fmt)
    state = layer.state_dict()
    state[key] = state[key].view(dtype)
    with pytest.raises(TypeError, match=f"{key} must have dtype .*got {dtype}"):
        _mxfp4_layer(prepare, fmt).load_state_dict(state)


def test_load_quantized_experts_refuses_what_the_experts_refuse_before_dropping_the_weights():
    # an FP8 stack of 1x128 groups (activations' granularity) and NVFP4 per-row global scales were accepted, the
    # dense stacks dropped, and the first forward raised
    from moekit import formats

    layer = moekit.FusedMoE.from_preset("mixtral-8x7b", scaled=True, dtype=torch.float32)
    w13, w2 = layer.w13.detach().clone(), layer.w2.detach().clone()
    grouped = formats.fp8.quantize_groups(w13)
    with pytest.raises(ValueError, match="w13: FP8 expert weights are per tensor, per channel or in 128x128 blocks"):
        layer.load_quantized_experts(grouped, formats.fp8.quantize_groups(w2))
    assert layer.weight_format == "dense" and torch.equal(layer.w13, w13)
