"""`moekit bench` without a GPU: peers that are not installed are skipped with one line and named in the results,
--peers is checked before any work, and the SGLang peer loads from an installed sglang (when there is one)."""

import json

import pytest
import torch

from moekit import presets, reference
from moekit.metrics import rel_errors
from moekit.tools.bench import experts, sglang_peer
from moekit.tools.cli import main

HAS_SGLANG = sglang_peer.missing() is None


def _one_line_exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_unknown_peer_is_one_line_and_exit_2(capsys):
    err = _one_line_exit_2(["bench", "--peers", "liger", "nope"], capsys)
    assert err.startswith("moekit bench: error: argument --peers: unknown peer 'nope'; known peers: hf_eager, ")
    assert "sglang" in err


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys, tmp_path):
    real = experts.module_available
    monkeypatch.setattr(experts, "module_available", lambda name: name != "matplotlib" and real(name))
    err = _one_line_exit_2(["bench", "--preset", "qwen3-30b-a3b", "--tokens", "1", "--plot", str(tmp_path / "q.png")],
                           capsys)
    assert err == 'moekit bench: error: --plot needs matplotlib (pip install "moekit[bench]")\n'


def _fake_gpu_run(monkeypatch, measured):
    """cmd_bench's path on a machine without a GPU: the timing replaced by rows of fixed numbers."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(experts, "environment", lambda: {"gpu": "H200", "torch": "t", "triton": "3.6.0", "cuda": "13.0",
                                                          "python": "3", "date": "today"})
    monkeypatch.setattr(experts, "matmul_rate", lambda: 8e14)

    def run_preset(args, spec, rate, on_row, progress):
        measured.append(list(args.peers))  # the peers that reached GPU work
        for T in args.tokens:
            progress.case(spec.name, T)
            row = {"preset": spec.name, "T": T, "layers": 4, "experts_hit": 8, "floor_us": 10.0, "floor_kind": "bytes",
                   "moekit": 12.0, "moekit_mode": "graph", "torch_grouped_mm": 30.0, "torch_grouped_mm_mode": "graph",
                   "best_peer_us": 30.0, "best_peer": "torch_grouped_mm", "speedup_vs_best_peer": 2.5,
                   "floor_ratio": 1.2}
            on_row(row)

    monkeypatch.setattr(experts, "run_preset", run_preset)


def test_missing_peer_is_skipped_with_one_line_and_the_results_say_so(monkeypatch, capsys, tmp_path):
    real = experts.module_available
    monkeypatch.setattr(experts, "module_available", lambda name: name != "liger_kernel" and real(name))
    measured = []
    _fake_gpu_run(monkeypatch, measured)
    monkeypatch.chdir(tmp_path)  # `moekit bench` writes into ./moekit-bench
    assert main(["bench", "--preset", "qwen3-30b-a3b", "--tokens", "1", "64", "--peers", "liger",
                 "torch_grouped_mm"]) == 0
    out = capsys.readouterr().out
    why = 'liger_kernel is not installed (pip install "moekit[bench]")'
    assert out.count(f"skipping peer liger: {why}\n") == 1
    assert out.index("skipping peer liger") < out.index("qwen3-30b-a3b T=1: ")  # before any case ran
    assert measured == [["torch_grouped_mm"]]
    # piped: a line per case, with moekit against the best peer
    assert "[2/2, " in out and "qwen3-30b-a3b T=64: moekit 12.0, torch_grouped_mm 30.0 us; best peer " \
                                "torch_grouped_mm / moekit = 2.50" in out
    result = json.loads((tmp_path / "moekit-bench" / "experts.json").read_text())
    assert result["skipped_peers"] == {"liger": why} and result["peers"] == ["torch_grouped_mm"]
    assert [r["T"] for r in result["records"]] == [1, 64]
    md = (tmp_path / "moekit-bench" / "experts.md").read_text()
    assert f"Peers skipped (not run): liger: {why}." in md
    assert "| qwen3-30b-a3b | 64 | 12.0 | 30.0 | 2.50 |" in md


def test_sglang_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sglang_peer, "package_dir", lambda: None)
    assert sglang_peer.missing() == "sglang is not installed (pip install --no-deps sglang apache-tvm-ffi)"
    with pytest.raises(sglang_peer.LoadError, match="sglang is not installed"):
        sglang_peer.Sglang("NVIDIA H200")
    monkeypatch.setattr(experts, "module_available", lambda name: name != "sglang")
    assert experts.unavailable_peers(["sglang", "torch_grouped_mm"]) == {
        "sglang": "sglang is not installed (pip install --no-deps sglang apache-tvm-ffi)"}


def test_definitions_are_read_from_the_file_by_name(tmp_path):
    # the loader executes only the named top-level definitions, with the file's own names and line numbers
    import inspect

    path = tmp_path / "engine.py"
    path.write_text("from __future__ import annotations\nimport not_installed_anywhere\n\n"
                    "LIMIT: int = 64\n\n\ndef twice(x: Tensor) -> Tensor:\n    return helper(x) * 2\n")
    defs = sglang_peer.definitions(path, ["LIMIT", "twice"], {"helper": lambda x: x + 1})
    assert defs.LIMIT == 64 and defs.twice(1) == 4  # the import of a missing module was never run
    assert inspect.getsource(defs.twice).startswith("def twice(x: Tensor)")  # what triton.jit reads
    with pytest.raises(sglang_peer.LoadError, match=r"engine.py defines no absent \(this peer reads sglang 0.5.23"):
        sglang_peer.definitions(path, ["twice", "absent"], {})


def test_markdown_numbers_long_notes_and_lists_the_sglang_configs():
    env = {"gpu": "H200", "date": "d", "torch": "t", "triton": "3.6.0", "cuda": "13.0"}
    long = "its CUDA moe_align_block_size needs sgl_kernel or apache-tvm-ffi"
    rows = [{"preset": "qwen3-30b-a3b", "T": T, "experts_hit": 8, "floor_us": 10.0, "floor_kind": "bytes",
             "moekit": 12.0, "liger": 20.0, "sglang": 15.0 if T == 1 else None,
             "sglang_config": "tuned triton_3_6_0/x.json", "sglang_combine": "Triton",
             "sglang_align": "Triton moe_align_small_numel" if T == 1 else "CUDA"}
            for T in (1, 16)]
    rows[1]["sglang_note"] = long
    md = experts.markdown(rows, env, 8e14, ["liger", "sglang"], skipped={"hf_eager": "transformers is not installed"},
                          versions={"liger-kernel": "0.8.5", "sglang": "0.5.23"})
    assert "Peer versions: liger-kernel 0.8.5, sglang 0.5.23." in md
    assert "Peers skipped (not run): hf_eager: transformers is not installed." in md
    assert "| qwen3-30b-a3b | 16 | 12.0 | 20.0 | n/a [1] |" in md and f"[1] sglang: {long}" in md
    assert ("- qwen3-30b-a3b: config tuned triton_3_6_0/x.json. align Triton moe_align_small_numel (T = 1); "
            "CUDA (T = 16). combine Triton.") in md


@pytest.mark.skipif(not HAS_SGLANG, reason=f"needs an installed sglang ({sglang_peer.INSTALL})")
def test_sglang_config_lookup_runs_for_a_named_device():
    # the engine's own lookup, on the CPU: its tuned file for the device where one exists, its default otherwise
    h200 = sglang_peer.Sglang("NVIDIA H200")
    qwen, mixtral = presets.get("qwen3-30b-a3b"), presets.get("mixtral-8x7b")
    assert h200.describe(qwen, 1)["config"].startswith("tuned triton_")
    assert h200.describe(qwen, 1)["config"].endswith("E=128,N=768,device_name=NVIDIA_H200.json")
    assert h200.describe(qwen, 1)["align"] == "Triton moe_align_small_numel"   # 8 pairs, 128 experts
    assert h200.uses_cuda_align(16 * 8, 128) and h200.uses_cuda_align(1 * 2, 8)  # many pairs; few experts
    assert "E=8,N=14336,device_name=NVIDIA_H200.json" in h200.describe(mixtral, 64)["config"]
    plan = h200.plan(4096, 128, 2 * 768, 2048, 8)
    assert plan["config"]["BLOCK_SIZE_M"] >= 64
    assert plan["down_config"]["BLOCK_SIZE_M"] == plan["config"]["BLOCK_SIZE_M"]  # one alignment for both GEMMs
    other = sglang_peer.Sglang("NVIDIA Nonexistent GPU")
    assert other.describe(qwen, 1)["config"] == \
        "default (no tuned file E=128,N=768,device_name=NVIDIA_Nonexistent_GPU.json)"
    assert other.plan(1, 128, 2 * 768, 2048, 8)["config"]["BLOCK_SIZE_M"] == 16


@pytest.mark.skipif(not HAS_SGLANG, reason=f"needs an installed sglang ({sglang_peer.INSTALL})")
@pytest.mark.skipif(torch.cuda.is_available(), reason="about the interpreter (the GPU run is the benchmark)")
@pytest.mark.parametrize("activation", ["silu_and_mul", "swiglu_oai"])
def test_sglang_peer_matches_float64_in_the_interpreter(activation):
    # 5 tokens x 4 slots over 64 experts: the engine's Triton alignment; fp16 (the interpreter's bf16 dots are wrong)
    peer = sglang_peer.Sglang("NVIDIA H200")
    E, H, I, k, T, dt = 64, 64, 32, 4, 5, torch.float16
    w13, w2 = (torch.randn(E, 2 * I, H) * H ** -0.5).to(dt), (torch.randn(E, H, I) * I ** -0.5).to(dt)
    b13 = b2 = None
    if activation == "swiglu_oai":
        b13, b2 = (torch.randn(E, 2 * I) * 0.02).to(dt), (torch.randn(E, H) * 0.02).to(dt)
    x = torch.randn(T, H).to(dt)
    ids = torch.rand(T, E).argsort(1)[:, :k].int().contiguous()
    weights = torch.softmax(torch.randn(T, k), -1)
    y = peer.fused_experts(x, w13, w2, weights, ids, activation=activation, w13_bias=b13, w2_bias=b2)
    ref = reference.fused_experts(x, w13, w2, weights, ids, activation=activation, w13_bias=b13, w2_bias=b2)
    assert rel_errors(y, ref)[1] < 2e-3


def test_eager_table_marks_host_budgets_met_and_missed():
    from moekit.tools.bench import eager

    env = {"gpu": "test GPU", "date": "2026-12-06", "torch": "t", "triton": "tr"}
    records = [{"op": "route", "preset": "p", "T": 1, "eager_us": 30.0, "host_us": 14.0, "graph_us": 5.0, "kernels": 1},
               {"op": "GateLinear", "preset": "p", "T": 1, "eager_us": 30.0, "host_us": 16.0, "graph_us": 5.0,
                "kernels": 1},
               {"op": "torch_chain", "preset": "p", "T": 1, "eager_us": 60.0, "host_us": 55.0, "graph_us": None,
                "kernels": 7, "note": "no graph: RuntimeError"}]
    rows = [line for line in eager.markdown(records, env, {}).splitlines()
            if line.startswith("| ") and "---" not in line]
    assert "| 15 (met) |" in rows[1]  # route's budget is 15 us of host time: 14 meets it
    assert "| 15 (**missed**) |" in rows[2]  # GateLinear's is 15 too: 16 misses it
    assert "| - | no graph: RuntimeError | - | 7 |" in rows[3]  # peers have no budget; an uncapturable call says why


@pytest.mark.parametrize("name", [
    "qwen3-30b-a3b",  # [gate; up] stacks as moekit stores them
    "gpt-oss-120b",   # transformers' transposed, interleaved stacks and biases (one copy)
])
def test_the_eager_benchs_transformers_peer_computes_the_layers_experts(name):
    from moekit import FusedMoE
    from moekit.tools.bench import eager

    spec = presets.get(name).scaled()
    layer = FusedMoE(spec, dtype=torch.float32)
    hf = eager._hf_experts(spec, layer)
    x = torch.randn(5, spec.hidden_size)
    with torch.no_grad():
        tw, tid = layer.route(x)
    bias = lambda b: None if b is None else b.detach()  # noqa: E731
    ref = reference.fused_experts(x, layer.w13.detach(), layer.w2.detach(), tw, tid, activation=spec.activation,
                                  w13_bias=bias(layer.w13_bias), w2_bias=bias(layer.w2_bias))
    assert rel_errors(hf(x, tid.long(), tw), ref)[0] < 1e-5
