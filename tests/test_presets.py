import dataclasses

import pytest

from moekit import presets


def test_every_semantics_preset_is_there():
    assert presets.names() == ["gpt-oss-20b", "gpt-oss-120b", "deepseek-v3", "kimi-k2",
                               "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b"]


@pytest.mark.parametrize("name,shape", [
    ("gpt-oss-20b", (2880, 2880, 32, 4)),
    ("gpt-oss-120b", (2880, 2880, 128, 4)),
    ("deepseek-v3", (7168, 2048, 256, 8)),
    ("kimi-k2", (7168, 2048, 384, 8)),
    ("mixtral-8x7b", (4096, 14336, 8, 2)),
    ("qwen3-30b-a3b", (2048, 768, 128, 8)),
    ("qwen3-235b-a22b", (4096, 1536, 128, 8)),
])
def test_preset_shapes_match_semantics(name, shape):
    s = presets.get(name)
    assert (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k) == shape


def test_routing_details():
    ds = presets.get("deepseek-v3")
    assert (ds.routing, ds.num_groups, ds.topk_groups, ds.routed_scaling_factor) == ("sigmoid_grouped", 8, 4, 2.5)
    assert ds.correction_bias and ds.num_shared_experts == 1
    assert presets.get("kimi-k2").routed_scaling_factor == 2.827
    oss = presets.get("gpt-oss-120b")
    assert (oss.routing, oss.activation, oss.router_bias, oss.expert_bias) == ("topk_softmax", "swiglu_oai", True, True)
    assert presets.get("mixtral-8x7b").renormalize


def test_routing_kwargs_only_carry_what_the_method_uses():
    assert presets.get("qwen3-30b-a3b").routing_kwargs() == {"renormalize": True}
    assert presets.get("deepseek-v3").routing_kwargs() == {
        "renormalize": True, "num_groups": 8, "topk_groups": 4, "scaling": 2.5}


@pytest.mark.parametrize("name", presets.names())
def test_scaled_keeps_routing_structure(name):
    full = presets.get(name)
    small = full.scaled()
    assert small.hidden_size == 64 and small.intermediate_size == 32
    assert small.num_experts <= max(16, full.num_groups * full.top_k)
    assert small.num_experts % small.num_groups == 0
    assert small.topk_groups * (small.num_experts // small.num_groups) >= small.top_k
    assert dataclasses.replace(small, name=full.name, hidden_size=full.hidden_size,
                               intermediate_size=full.intermediate_size, num_experts=full.num_experts) == full


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="known presets: gpt-oss-20b"):
        presets.get("gpt-5")


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=9), "top_k"),
    (dict(num_groups=3), "num_groups"),
    (dict(routing="softmax"), "routing"),
    (dict(activation="gelu"), "activation"),
])
def test_inconsistent_spec_is_rejected(kwargs, match):
    base = dict(name="x", hidden_size=8, intermediate_size=8, num_experts=8, top_k=2,
                routing="softmax_topk", activation="silu_and_mul")
    with pytest.raises(ValueError, match=match):
        presets.MoESpec(**{**base, **kwargs})
