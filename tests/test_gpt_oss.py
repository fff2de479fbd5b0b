"""load_gpt_oss_layer on a tiny synthetic checkpoint written in gpt-oss's exact safetensors layout."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moekit import reference
from moekit.formats import fp4, mxfp4
from moekit.integrations.gpt_oss import load_gpt_oss_layer
from moekit.metrics import Tolerance, check_close

E, H, I = 4, 64, 64  # 2I != H: orientation mistakes cannot hide


def _layer_tensors(i, g):
    p = f"model.layers.{i}.mlp."
    return {
        p + "router.weight": torch.randn(E, H, generator=g).bfloat16(),
        p + "router.bias": torch.randn(E, generator=g).bfloat16(),
        p + "experts.gate_up_proj_blocks": torch.randint(0, 256, (E, 2 * I, H // 32, 16), generator=g, dtype=torch.uint8),
        p + "experts.gate_up_proj_scales": torch.randint(120, 130, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8),
        p + "experts.gate_up_proj_bias": (torch.randn(E, 2 * I, generator=g) * 0.1).bfloat16(),
        p + "experts.down_proj_blocks": torch.randint(0, 256, (E, H, I // 32, 16), generator=g, dtype=torch.uint8),
        p + "experts.down_proj_scales": torch.randint(120, 130, (E, H, I // 32), generator=g, dtype=torch.uint8),
        p + "experts.down_proj_bias": (torch.randn(E, H, generator=g) * 0.1).bfloat16(),
    }


@pytest.fixture
def checkpoint(tmp_path):
    """Two layers in two shards, with the index and a config (top-2)."""
    g = torch.Generator().manual_seed(0)
    shards = {"model-00001-of-00002.safetensors": _layer_tensors(0, g),
              "model-00002-of-00002.safetensors": _layer_tensors(1, g)}
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(tmp_path / fname))
        weight_map.update({name: fname for name in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 2}))
    return tmp_path, shards["model-00002-of-00002.safetensors"]


def _decode(blocks, scales):
    """formats.md by hand: low nibble = even element, times 2^(scale - 127)."""
    lut = fp4.code_values()
    vals = torch.stack([lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    return (vals * torch.exp2(scales.float() - 127)[..., None]).flatten(-2)


def test_loads_one_layer_in_mxfp4(checkpoint):
    path, t = checkpoint
    layer = load_gpt_oss_layer(path, 1, dtype=torch.float32)
    p = "model.layers.1.mlp.experts."
    assert layer.weight_format == "mxfp4" and layer.spec.top_k == 2 and layer.spec.num_experts == E
    q13, q2 = layer.expert_weights()
    expect13 = _decode(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"])
    assert torch.equal(mxfp4.dequantize(q13, torch.float32), expect13)
    assert torch.equal(mxfp4.dequantize(q2, torch.float32), _decode(t[p + "down_proj_blocks"], t[p + "down_proj_scales"]))
    assert torch.equal(layer.gate.weight, t["model.layers.1.mlp.router.weight"].float())
    assert torch.equal(layer.w13_bias, t[p + "gate_up_proj_bias"].float())


def test_dequantized_weights_agree_with_transformers(checkpoint):
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    path, t = checkpoint
    p = "model.layers.1.mlp.experts."
    theirs = convert(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"], dtype=torch.float32)
    layer = load_gpt_oss_layer(path, 1, keep_mxfp4=False, dtype=torch.float32)
    ours = layer.w13                                                 # [E, 2I, H]; transformers keeps [E, H, 2I]
    assert theirs.shape == (E, H, 2 * I) and torch.equal(ours, theirs.transpose(1, 2))


def test_layer_forward_matches_the_float64_layer(checkpoint):
    path, _ = checkpoint
    layer = load_gpt_oss_layer(path, 0, dtype=torch.float32)
    x = torch.randn(9, H)
    with torch.no_grad():
        got = layer(x)
    w13, w2 = (mxfp4.dequantize(w, torch.float32) for w in layer.expert_weights())
    ref = reference.moe_layer(x, layer.gate.weight, w13, w2, layer.spec, router_bias=layer.gate.bias,
                              w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
    check_close("gpt-oss layer", got, ref, Tolerance(1e-4, 1e-5))
    dense = load_gpt_oss_layer(path, 0, keep_mxfp4=False, dtype=torch.float32)
    with torch.no_grad():
        check_close("dequantized once", dense(x), ref, Tolerance(1e-4, 1e-5))


def test_missing_layer_is_named(checkpoint):
    path, _ = checkpoint
    with pytest.raises(KeyError, match="model.layers.7.mlp.router.weight"):
        load_gpt_oss_layer(path, 7)


def _write_layer(path, **changes):
    g = torch.Generator().manual_seed(1)
    tensors = _layer_tensors(0, g)
    tensors.update(changes)
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("which", ["gate_up_proj_scales", "down_proj_scales"])
def test_nan_scales_are_refused_by_default(tmp_path, which):
    # a scale byte of 255 is E8M0's NaN: its 32 weights are NaN, and so is every token routed to that expert
    name = f"model.layers.0.mlp.experts.{which}"
    shape = (E, 2 * I, H // 32) if which.startswith("gate") else (E, H, I // 32)
    scales = torch.full(shape, 127, dtype=torch.uint8)
    scales[2, 5, 0] = mxfp4.NAN_SCALE
    path = _write_layer(tmp_path / "m.safetensors", **{name: scales})
    with pytest.raises(ValueError, match=rf"{name} holds 1 NaN scales \(E8M0 byte 255\)"):
        load_gpt_oss_layer(path, 0)
    with pytest.warns(RuntimeWarning, match=f"{name} holds 1 NaN scales"):
        layer = load_gpt_oss_layer(path, 0, nan_scales="warn", dtype=torch.float32)
    weights = layer.expert_weights()[0 if which.startswith("gate") else 1]
    assert torch.isnan(mxfp4.dequantize(weights, torch.float32)[2, 5, :32]).all()  # loaded as the format defines
    load_gpt_oss_layer(path, 0, nan_scales="allow")
    with pytest.raises(ValueError, match="nan_scales must be one of"):
        load_gpt_oss_layer(path, 0, nan_scales="ignore")


P = "model.layers.0.mlp."


@pytest.mark.parametrize("name,value,error,match", [
    ("router.weight", torch.zeros(E * H), ValueError, r"router.weight must be \[E, H\]"),  # was an unpacking error
    ("router.weight", torch.zeros(E, H, dtype=torch.int32), TypeError, "router.weight must have a floating dtype"),
    ("experts.gate_up_proj_blocks", torch.zeros(E, 2 * I + 1, H // 32, 16, dtype=torch.uint8), ValueError,
     "gate_up_proj_blocks must be .* with 2I even"),  # was reported as w13's shape
    ("experts.gate_up_proj_scales", torch.zeros(E, 2 * I, H // 32, dtype=torch.int8), TypeError,
     "gate_up_proj_scales must have uint8"),  # the format's message named only "scales"
    ("experts.down_proj_blocks", torch.zeros(E, H, I // 64, 16, dtype=torch.uint8), ValueError,
     r"down_proj_blocks must have shape"),  # I from gate_up's blocks
    ("experts.gate_up_proj_bias", torch.zeros(E, 2 * I, dtype=torch.int64), TypeError,
     "gate_up_proj_bias must have a floating dtype"),  # loaded silently
])
def test_each_checkpoint_tensor_is_checked_by_its_name(tmp_path, name, value, error, match):
    path = _write_layer(tmp_path / "m.safetensors", **{P + name: value})
    with pytest.raises(error, match=f"model.layers.0.mlp.(experts.)?{match}"):
        load_gpt_oss_layer(path, 0)


@pytest.mark.parametrize("content,why", [
    (b"", "an empty file"),
    (b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1", "a header cut short"),
    (bytes(range(256)) * 4, "random bytes"),
])
def test_unreadable_files_are_named(tmp_path, content, why):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"broken.safetensors: not a readable safetensors file"):
        load_gpt_oss_layer(path, 0)


def test_truncated_data_and_missing_shards_are_named(tmp_path):
    path = _write_layer(tmp_path / "m.safetensors")
    path.write_bytes(path.read_bytes()[:-1000])                       # the header is whole, the data is not
    with pytest.raises(ValueError, match=r"m.safetensors: not a readable safetensors file"):
        load_gpt_oss_layer(path, 0)
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "model-00001.safetensors" for name in _layer_tensors(0, None)}}))
    with pytest.raises(FileNotFoundError, match="model-00001.safetensors: no such checkpoint file"):
        load_gpt_oss_layer(tmp_path / "index", 0)
    (tmp_path / "index" / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json: not a safetensors index"):
        load_gpt_oss_layer(tmp_path / "index", 0)
    with pytest.raises(FileNotFoundError, match="nowhere: no such checkpoint file or directory"):
        load_gpt_oss_layer(tmp_path / "nowhere", 0)


@pytest.mark.parametrize("config,why", [
    ('{"num_experts_per_tok": 2.7}', "a float: int() truncated it to 2"),
    ('{"num_experts_per_tok": "2"}', "a string: int() read it"),
    ('{"num_experts_per_tok": null}', "null"),
    ('{"num_experts_per_tok": 0}', "no expert per token"),
    ('[2]', "not an object"),
    ('{"num_experts_per_tok": 2', "not JSON"),
])
def test_a_config_with_a_bad_top_k_is_refused_naming_the_file(checkpoint, config, why):
    path, _ = checkpoint
    (path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="config.json"):
        load_gpt_oss_layer(path, 0, dtype=torch.float32)
