"""FusedMoE against the float64 whole-layer reference."""

import pytest
import torch

import moekit
from moekit import presets, reference
from moekit.verify.metrics import Tolerance, check_close


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
    layer.load_quantized_experts(q13, q2)
    assert layer.weight_format == fmt and "w13" not in dict(layer.named_parameters())
    x = torch.randn(7, layer.spec.hidden_size)
    ref = reference.moe_layer(x, layer.gate.weight, d13, d2, layer.spec)
    with torch.no_grad():
        check_close(fmt, layer(x), ref, Tolerance(1e-4, 1e-5))
    twin = moekit.FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.float32, scaled=True)
    twin.load_quantized_experts(q13, q2)                  # same buffers' shapes, then the saved values
    twin.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert torch.equal(twin(x), layer(x))
    with pytest.raises(TypeError, match="must both be MXFP4Tensor or NVFP4Tensor"):
        layer.load_quantized_experts(torch.zeros(1), q2)
    with pytest.raises(ValueError, match="w13 must have shape"):
        twin.load_quantized_experts(quantize_experts(torch.randn(3, 64, 64), fmt), q2)
