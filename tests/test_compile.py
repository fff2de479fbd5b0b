"""GateLinear and FusedMoE under torch.compile(fullgraph=True): no graph breaks, eager results."""

import pytest
import torch

import moekit
from moekit.metrics import Tolerance, check_close

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


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
def test_fused_experts_triton_op_compiles_fullgraph(device):
    torch._dynamo.reset()
    from moekit.experts import fused_experts

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    E, H, I, T, k = 6, 32, 16, 9, 2
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype) * 0.2
    w2 = torch.randn(E, H, I, device=device, dtype=dtype) * 0.2
    x = torch.randn(T, H, device=device, dtype=dtype)
    tw = torch.rand(T, k, device=device)
    tid = torch.randint(0, E, (T, k), device=device, dtype=torch.int32)
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
