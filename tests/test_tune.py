"""moekit.tune's table bookkeeping (the sweep itself needs a GPU)."""

import json

import pytest
import torch

from moekit.tools import tune


def test_each_tuned_bucket_is_merged_at_once_and_keeps_the_other_entries(tmp_path):
    # a sweep cut off by a time limit must keep what it finished: buckets merge one by one
    table = tmp_path / "experts_tuned.json"
    table.write_text(json.dumps({"gpu|bf16": {"E8_N64_K32": {"1": {"block_m": 16}, "64": {"block_m": 64}}}}))
    tune._merge_entry("gpu|bf16", "E8_N64_K32", "64", {"block_m": 128}, table)
    tune._merge_entry("gpu|mxfp4", "E8_N64_K32", "1", {"block_m": 16, "gemv": True}, table)
    merged = json.loads(table.read_text())
    assert merged["gpu|bf16"]["E8_N64_K32"] == {"1": {"block_m": 16}, "64": {"block_m": 128}}
    assert merged["gpu|mxfp4"]["E8_N64_K32"]["1"] == {"block_m": 16, "gemv": True}


def test_gemv2_packed_rule_the_kernel_and_the_tuner_share():
    # GEMM2's fp16x2 products: only asked for, 4-bit weights, 16-bit h, and the loop per slot (slots 0 or unset)
    from moekit.experts.triton_backend import gemv2_packed
    from moekit.experts.configs import GemmConfig

    on = GemmConfig(16, 256, packed=True)
    assert gemv2_packed(on, "mxfp4", torch.bfloat16, 4) and gemv2_packed(on, "nvfp4", torch.float16, 8)
    assert gemv2_packed(GemmConfig(16, 256, packed=True, slots=0), "mxfp4", torch.bfloat16, 4)
    assert not gemv2_packed(GemmConfig(16, 256), "mxfp4", torch.bfloat16, 4)  # not asked for
    assert not gemv2_packed(GemmConfig(4, 256, packed=True, slots=2), "mxfp4", torch.bfloat16, 4)  # slots together
    assert not gemv2_packed(on, "mxfp4", torch.float32, 4)  # fp32 h keeps fp32 products
    assert not gemv2_packed(on, "dense", torch.bfloat16, 4)


def test_incumbents_are_the_shipped_entries_and_the_heuristic_once_each():
    # a bucket's sweep must beat, in whole calls, every config that would serve the bucket without it
    from moekit.experts.configs import ExpertsConfig, GemmConfig

    a = ExpertsConfig(64, GemmConfig(128, 64, 8, 4, 8), GemmConfig(64, 64, 4, 3, 8, half_tails=True))
    b = ExpertsConfig(16, GemmConfig(16, 256), GemmConfig(16, 512), mode="gemv")
    heur = ExpertsConfig(128, GemmConfig(128, 64, 8, 4, 8), GemmConfig(128, 64, 8, 4, 8))
    entries = {"4": b.to_dict(), "1024": a.to_dict() | {"measured": {"gemm_us": 1.0}}, "4096": a.to_dict()}
    assert tune.incumbents(entries, heur) == {"table T<=4": b, "table T<=1024": a, "heuristic": heur}
    assert tune.incumbents({"16": heur.to_dict()}, heur) == {"table T<=16": heur}
    assert tune.incumbents({}, heur) == {"heuristic": heur}


def test_w4a8_is_tuned_as_its_own_table_family_and_bad_pairs_are_refused(capsys):
    # the "w4a8" entries serve MXFP4 with FP8 activation groups; FP8 weights are W8A8 with or without the flag
    from moekit.experts.configs import config_family
    from moekit.tools.cli import main

    assert config_family("mxfp4", "fp8_group") == "w4a8"
    assert config_family("mxfp4") == "mxfp4"
    assert config_family("fp8_block", "fp8_group") == config_family("fp8_channel") == "fp8"
    for weights in ("nvfp4", "dense"):  # no FP8-activation kernel for these weights
        with pytest.raises(ValueError, match=f"act_quant='fp8_group'.*'{weights}'"):
            config_family(weights, "fp8_group")
    for run in (tune.main, lambda argv: main(["tune", *argv])):  # refused before any GPU is needed, in one line
        with pytest.raises(SystemExit) as exc:
            run(["--format", "nvfp4", "--act-quant", "fp8_group"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith("moekit tune: error: ") and "'nvfp4'" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("weight_format", ["dense", "mxfp4"])
def test_gpu_a_small_sweep_runs_every_mode(weight_format):
    # the sweep's own code paths (aligned row blocks, per-pair, gemv) at a size that takes seconds
    import dataclasses

    from moekit import presets
    from moekit.experts.configs import ExpertsConfig

    spec = dataclasses.replace(presets.get("qwen3-30b-a3b"), num_experts=8, hidden_size=256, intermediate_size=128,
                               top_k=2)
    weights = tune.random_weights(spec, weight_format=weight_format)
    cfg, info = tune.tune(spec, 4, weights, weight_format, ("aligned", "per_pair", "gemv"), {}, None)
    assert isinstance(cfg, ExpertsConfig) and cfg.mode in ("aligned", "per_pair", "gemv")
    assert info
