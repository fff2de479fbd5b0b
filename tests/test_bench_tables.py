"""What the benchmarks' tables say, on the CPU: the layers the decode graphs cycled over, data that may sit in L2
(router, invariant, decode_kernels), the peers' library versions, eager's batched_experts workload and generation
implementation, and stream_decode's floor convention beside its measured copy rate."""

import importlib.metadata
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from moekit import FusedMoE, presets
from moekit.tools.bench import eager, experts, invariant
from moekit.tools.bench.timing import COPY_BW, MIN_REPLAY_BYTES, calls_past_l2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_router  # noqa: E402
import decode_kernels  # noqa: E402
import stream_decode  # noqa: E402

ENV = {"gpu": "H200", "date": "d", "torch": "t", "triton": "3.6.0", "cuda": "13.0"}


def _row(preset, T, layers):
    return {"preset": preset, "T": T, "layers": layers, "experts_hit": 8, "floor_us": 10.0, "floor_kind": "bytes",
            "moekit": 12.0}


def test_experts_header_gives_each_layer_count_with_its_presets():
    rows = [_row("gpt-oss-120b", T, 4 if T <= 16 else 2) for T in (1, 4, 16, 64, 256)]
    rows += [_row("qwen3-30b-a3b", T, 2) for T in (1, 4, 16, 64, 1024)]
    md = experts.markdown(rows, ENV, 8e14, [])
    assert "over 2 layers' weights (4 for gpt-oss-120b T = 1, 4, 16): us = replay / 8" in md
    assert "over 4 layers' weights:" in experts.markdown(rows[:3], ENV, 8e14, [])
    rows.append(_row("deepseek-v3", 1, 1))
    assert "(4 for gpt-oss-120b T = 1, 4, 16; 1 for deepseek-v3)" in experts.markdown(rows, ENV, 8e14, [])


def test_experts_results_record_every_peer_librarys_version(monkeypatch, tmp_path):
    installed = {"transformers": "5.25.0", "liger-kernel": "0.8.5", "sglang": "0.5.23", "apache-tvm-ffi": "0.1.5"}

    def version(dist):
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    # sglang's alignment may come from sgl_kernel (not installed here) or a tvm-ffi build: what is installed counts
    assert experts.peer_versions(["hf_eager", "hf_grouped_mm", "sglang", "torch_grouped_mm"]) == {
        "transformers": "5.25.0", "sglang": "0.5.23", "apache-tvm-ffi": "0.1.5"}
    monkeypatch.setattr(experts, "environment", lambda: dict(ENV))
    args = types.SimpleNamespace(out=tmp_path, name="experts", peers=["hf_eager", "liger"], skipped_peers={})
    md = experts.save(args, [_row("qwen3-30b-a3b", 1, 4)], 8e14)
    result = json.loads((tmp_path / "experts.json").read_text())
    assert result["env"]["peer_versions"] == result["peer_versions"] == {"transformers": "5.25.0",
                                                                         "liger-kernel": "0.8.5"}
    assert "Peer versions: transformers 5.25.0, liger-kernel 0.8.5." in md
    assert "Peer versions: transformers 5.25.0, liger-kernel 0.8.5." in experts.markdown(
        result["records"], result["env"], 8e14, [])  # a re-render from the JSON alone


def test_router_bench_cycles_past_l2_and_flags_rows_that_did_not():
    small, large = presets.get("gpt-oss-20b"), presets.get("deepseek-v3")
    n = bench_router.layer_count(small, 1, 20)
    assert n > 20 and n * bench_router.call_bytes(small, 1) >= MIN_REPLAY_BYTES
    assert (n - 1) * bench_router.call_bytes(small, 1) < MIN_REPLAY_BYTES  # no more than needed
    assert bench_router.layer_count(large, 4096, 20) == 20  # inputs alone exceed L2: at least --layers
    old = [{"preset": "gpt-oss-20b", "T": T, "floor_us": 1.0} for T in (1, 4096)]  # 20 layers, before this rule
    md = bench_router.markdown(old, ENV, {})
    assert "over 20 layers" in md and "May be L2-resident: " in md and "gpt-oss-20b T = 1." in md
    new = [dict(r, layers=bench_router.layer_count(small, r["T"], 20)) for r in old]
    md = bench_router.markdown(new, ENV, {})
    assert "L2-resident" not in md and f"{new[1]['layers']} to {new[0]['layers']} layers" in md


def test_decode_kernels_give_each_timed_call_its_own_routing():
    spec = presets.get("qwen3-30b-a3b")
    per_expert = spec.hidden_size * spec.intermediate_size * 0.5625  # NVFP4 GEMM2 weights of one expert
    calls, pairs = decode_kernels.draw_calls(spec, 1, per_expert, device="cpu")
    ids = [tuple(c[2].tolist()) for c in calls]
    assert len(calls) >= decode_kernels.CALLS and len(set(ids)) == len(ids)  # no routing reused
    assert pairs * per_expert >= MIN_REPLAY_BYTES  # one replay of GEMM2 alone reads past L2
    assert len({(i % decode_kernels.LAYERS, e) for i, c in enumerate(calls) for e in c[2].tolist()}) == pairs


def test_invariant_router_ops_cycle_over_router_copies_past_l2():
    spec = presets.get("qwen3-30b-a3b").scaled()
    moe = FusedMoE(spec, dtype=torch.float32)
    copy = invariant._Router(moe)
    assert copy.moe.gate.weight.data_ptr() != moe.gate.weight.data_ptr()
    x = torch.randn(5, spec.hidden_size)
    tw, ids = moe.route(x)
    fn = invariant._op_fn("fused_router", "bf16", spec)
    got_w, got_ids = fn(copy, x, tw, ids)
    assert torch.equal(got_ids, ids) and torch.equal(got_w, tw)  # the call FusedMoE.route makes
    full = presets.get("deepseek-v3")
    n = invariant.router_calls(full, 1)
    assert n == calls_past_l2(invariant.router_bytes(full, 1), 8) and n * invariant.router_bytes(full, 1) >= 1e8
    assert invariant.router_calls(full, 16384) == 1  # the input alone is past L2
    cases = [(object(), torch.zeros(1, full.hidden_size), None, None) for _ in range(n)]
    assert invariant.replay_bytes("router_gemm", "bf16", full, cases) == n * invariant.router_bytes(full, 1)
    old = {"op": "fused_router", "preset": "p", "format": "bf16", "T": 1, "default_us": 5.0, "invariant_us": 5.0,
           "bitwise_invariant": True, "ratio": 1.0}
    small = dict(old, op="router_gemm", replay_bytes=7.3e6)
    md = invariant.markdown({"gpu": "cpu"}, [old, small])
    assert "rows without replay_bytes in the JSON (earlier runs) cycled over 2 layers' router weights" in md
    assert "May be L2-resident (one replay touched under 100 MB): p bf16 router_gemm T=1 (7.3 MB)." in md


def test_eager_table_names_the_batched_workload_and_the_generation_implementations():
    records = [{"op": "batched_experts", "preset": "qwen3-30b-a3b", "T": T, "eager_us": 30.0, "host_us": 14.0,
                "graph_us": 5.0, "kernels": 2} for T in (1, 256)]
    env = dict(ENV, transformers="5.25.0")
    md = eager.markdown(records, env, {"transformers": 15.0}, None, {"transformers": "transformers experts_"
                                                                     "implementation='grouped_mm'"})
    # 128 experts x max(1, T*8/128) rows: T=1 runs all 128 experts, not fused_experts' 8
    assert "| batched_experts (128 x 1 rows) | qwen3-30b-a3b | 1 |" in md
    assert "| batched_experts (128 x 16 rows) | qwen3-30b-a3b | 256 |" in md
    assert "transformers 5.25.0" in md and "| transformers | 15.0 | transformers experts_implementation=" \
                                            "'grouped_mm' |" in md


def test_eager_generation_says_which_experts_implementation_ran():
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moekit.integrations.transformers import patch

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                         num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(cfg)
    impl = getattr(model.config, "_experts_implementation", None)
    text = eager.experts_implementation(model)
    assert text == (f"transformers experts_implementation={impl!r}" if impl else
                    "transformers' experts module (no experts_implementation in this transformers)")
    assert eager.experts_implementation(model, patch(model)).startswith(
        "moekit patch(): 1 MoE blocks replaced by MoekitBlock")


def test_stream_decode_headline_is_the_floor_convention_with_the_measured_copy_beside():
    fields = stream_decode.rate_fields(3360.0, 2800.0, 3000.0)
    assert fields["pct_copy"] == pytest.approx(100 * 3360e9 / COPY_BW)  # 80% of 4.2 TB/s
    assert fields["pct_copy_measured"] == pytest.approx(120.0) and fields["pct_read"] == pytest.approx(112.0)
    assert set(stream_decode.rate_fields(3360.0, None, None)) == {"pct_copy"}  # before the run measured its copy
