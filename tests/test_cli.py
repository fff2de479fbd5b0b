"""The `moekit` command: the main job passes on this machine and reports as documented."""

import json

import pytest
import torch

from moekit import presets
from moekit.tools.cli import main


def test_verify_default_job_passes_and_writes_json(tmp_path, capsys):
    # the default job's checks on two presets (grouped sigmoid routing; swiglu with biases), at a decode and a
    # small batch size, in one process (the children are test_verify_isolates_...'s subject)
    report = tmp_path / "verify.json"
    assert main(["verify", "--preset", "gpt-oss-120b", "deepseek-v3", "--tokens", "1", "3", "--no-isolate",
                 "--json", str(report)]) == 0
    rows = json.loads(report.read_text())
    assert rows and all(r["ok"] for r in rows)
    assert {r["op"] for r in rows} >= {"router_gemm", "route", "fused_router", "fused_experts", "batched_experts", "FusedMoE",
                                       "fused_experts[lora]", "batched_experts[lora]", "fused_experts[mxfp4+lora]"}
    out = capsys.readouterr().out
    assert "0 failed" in out
    # piped output: a line as each group starts and ends (the bar is for terminals)
    assert "checking triton: 4 cases (2 presets x 2 token counts)" in out and "  triton: " in out


@pytest.mark.parametrize("argv,message", [
    (["verify", "--preset", "nope"], "moekit verify: error: argument --preset: unknown preset 'nope'; known presets: "),
    (["verify", "--tokens", "-3"], "moekit verify: error: argument --tokens: token counts must be >= 0, got -3"),
    (["verify", "--tokens", "x"], "moekit verify: error: argument --tokens: token counts are whole numbers, got 'x'"),
    (["verify", "--json", "/nonexistent/dir/r.json"],
     "moekit verify: error: argument --json: cannot write /nonexistent/dir/r.json: no directory /nonexistent/dir"),
    (["verify", "--dtype", "int8"], "moekit verify: error: argument --dtype: invalid choice: 'int8'"),
    (["verify", "--backend", "nope", "--preset", "mixtral-8x7b", "--tokens", "1"],
     "moekit verify: error: --backend must be one of"),
    (["explain", "--preset", "nope"], "moekit explain: error: argument --preset: unknown preset 'nope'"),
    (["explain", "--tokens", "-5"], "moekit explain: error: argument --tokens: token counts must be >= 0, got -5"),
    (["bench", "--tokens", "0"], "moekit bench: error: argument --tokens: token counts must be >= 1 here, got 0"),
    (["bench", "--preset", "nope"], "moekit bench: error: argument --preset/--presets: unknown preset 'nope'"),
    (["nope"], "moekit: error: argument command: invalid choice: 'nope'"),
    (["bench", "--layers", "0"], "moekit bench: error: argument --layers: must be >= 1, got 0"),
    (["bench", "--accuracy-tokens", "-5"], "moekit bench: error: argument --accuracy-tokens: token counts must be"),
])
def test_user_mistakes_are_one_line_and_exit_2(argv, message, capsys):
    # checked before any check or benchmark runs: no traceback, no rows of FAILED, one line on stderr
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message), captured.err
    assert captured.err.count("\n") == 1 and "FAILED" not in captured.out


@pytest.mark.parametrize("variable", ["MOEKIT_VERIFY", "MOEKIT_BATCH_INVARIANT"])
def test_a_bad_environment_switch_is_a_usage_error_not_failed_checks(variable, monkeypatch, capsys):
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--preset", "mixtral-8x7b", "--tokens", "1"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"moekit: error: {variable}='maybe': expected 1, true"), captured.err
    assert "FAILED" not in captured.out


def test_verify_prints_its_table_before_the_json_can_fail(tmp_path, capsys, monkeypatch):
    # the report folder vanished during the run: the table is printed all the same, then one error line
    from pathlib import Path

    report = tmp_path / "gone" / "r.json"
    report.parent.mkdir()
    real_write = Path.write_text

    def write_text(self, *args, **kwargs):
        if self == report:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    code = main(["verify", "--preset", "mixtral-8x7b", "--tokens", "1", "--backend", "torch", "--json", str(report)])
    captured = capsys.readouterr()
    assert code == 2 and "accuracy against float64" in captured.out and "passed, 0 failed" in captured.out
    assert captured.err.startswith(f"moekit verify: error: could not write --json {report}")


def test_verify_table_keeps_the_bracketed_names_of_its_rows(capsys):
    # fused_experts[mxfp4] and fused_experts[lora] are different rows: rich markup must not eat the brackets
    code = main(["verify", "--preset", "gpt-oss-20b", "--tokens", "1", "--backend", "torch"])
    out = capsys.readouterr().out
    assert code == 0 and "fused_experts[mxfp4]" in out and "fused_experts[lora]" in out


def test_verify_prints_a_row_per_op_and_impl_with_budgets_and_every_check_with_full(capsys, monkeypatch):
    from moekit import metrics
    from moekit.tools.verify import runner

    args = ["verify", "--preset", "mixtral-8x7b", "gpt-oss-20b", "--tokens", "1", "7", "--backend", "torch",
            "--no-isolate"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│ router_gemm ")]
    assert len(rows) == 1 and "│ 4 " in rows[0] and f"/ {metrics.LOGITS_TOL.max_rel:.0e}" in rows[0], rows
    assert "mixtral-8x7b@scaled" not in out and "failed checks" not in out and "max |got - ref| / max |ref|" in out
    assert main(args + ["--full"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("│ router_gemm ") for line in out.splitlines()) == 1 + 4  # the summary, each case
    assert "mixtral-8x7b@scaled" in out and "gpt-oss-20b@scaled" in out

    real = runner.run_group

    def one_fails(*a, **kw):  # a check that missed its budget: the summary counts it, its case is printed in full
        done = real(*a, **kw)
        done[0] = metrics.CheckResult(done[0].op, done[0].impl, done[0].preset, done[0].tokens, 1.0, 1.0, 1.0, False,
                                      "planted", 1e-4, 1e-5)
        return done

    monkeypatch.setattr(runner, "run_group", one_fails)
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "1 FAILED" in out and "failed checks" in out and "planted" in out and "1.0e+00 / 1e-04" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the CPU interpreter")
def test_verify_says_why_bf16_on_cpu_has_no_triton_group(capsys):
    code = main(["verify", "--preset", "mixtral-8x7b", "--tokens", "1", "--dtype", "bfloat16", "--backend", "triton"])
    assert code == 2 and "got 'triton': Triton's interpreter computes bf16 dots wrongly" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the CPU interpreter")
def test_verify_bf16_on_cpu_skips_interpreted_kernels(capsys):
    assert main(["verify", "--preset", "qwen3-30b-a3b", "--tokens", "33", "--dtype", "bfloat16"]) == 0
    assert "interpreter computes bf16 dots wrongly" in capsys.readouterr().out


def test_presets_and_explain_print(capsys):
    from moekit import presets

    assert main(["presets"]) == 0
    out = capsys.readouterr().out                       # piped (captured): full names, never cut at 80 columns
    assert all(name in out for name in presets.names()) and "…" not in out
    assert main(["explain", "--preset", "mixtral-8x7b", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "router_gemm T=4 H=4096 E=8" in out
    if not torch.cuda.is_available():                   # what serves the call, in a CPU user's terms
        assert "torch   TAKEN" in out and "the Triton kernels need a CUDA GPU" in out and "bf16 dots" not in out
    assert main(["explain", "--preset", "mixtral-8x7b", "--tokens", "4", "--dtype", "float16"]) == 0
    assert "float16 activations" in capsys.readouterr().out


PLUGIN = '''
import os
from moekit import backends
from moekit.experts import fused_torch

def _cpu(call, explicit):
    return None if call.op == "fused" and call.device.type == "cpu" else "CPU fused only"

def _aborts(*args):
    os.abort()  # a device fault stand-in: the process dies mid-call

def _drops_bias(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw, ids, act, None, None, emap)

backends.register(backends.Backend("aborts", _cpu, "dies", _aborts), first=False)
backends.register(backends.Backend("drops_bias", _cpu, "wrong", _drops_bias), first=False)
'''


def test_verify_isolates_a_crashing_backend_and_catches_a_wrong_one(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "broken_plugin.py").write_text(PLUGIN)
    env = dict(os.environ, MOEKIT_PLUGINS="broken_plugin",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    report = tmp_path / "report.json"
    # gpt-oss has expert biases, which drops_bias drops (it serves dense fused calls only: since verify checks a
    # backend only on what it serves, mixtral's bias-free case would not show its fault)
    proc = subprocess.run([sys.executable, "-m", "moekit", "verify", "--preset", "gpt-oss-20b", "--tokens", "7",
                           "--json", str(report)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(report.read_text())
    by_impl = {}
    for r in rows:
        by_impl.setdefault(r["impl"], []).append(r)
    assert "killed by SIGABRT" in by_impl["aborts"][0]["detail"]              # reported, and verify went on
    assert not any(r["ok"] for r in by_impl["drops_bias"])                   # wrong results caught
    assert all(r["ok"] for impl, rs in by_impl.items() if impl not in ("aborts", "drops_bias") for r in rs)
    assert {"torch", "auto"} <= set(by_impl)


@pytest.mark.skipif(torch.cuda.is_available(), reason="about machines without a GPU")
def test_bench_needs_a_gpu_and_says_so(capsys):
    assert main(["bench", "--preset", "qwen3-30b-a3b", "--tokens", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_plot_has_one_line_per_implementation(tmp_path):
    from moekit.tools.bench.plot import plot

    records = [{"preset": "p", "T": T, "floor_us": 10.0, "moekit": 12.0 * T, "torch_grouped_mm": 20.0 * T,
                "liger": None} for T in (1, 4, 16)]
    path = plot(records, ["moekit", "torch_grouped_mm", "liger"], tmp_path / "p.png", preset="p", gpu="H200")
    assert path.stat().st_size > 1000
    plot(records, ["moekit"], tmp_path / "f.png", preset="p", gpu="H200", metric="floor")
    with pytest.raises(ValueError, match="no records for preset"):
        plot(records, ["moekit"], tmp_path / "x.png", preset="q", gpu="H200")


def test_bench_low_bit_weights_name_their_format_first(capsys):
    # a preset without a checkpoint format is refused before any GPU work, on any machine
    assert main(["bench", "--weights", "native", "--preset", "mixtral-8x7b"]) == 2
    assert "mixtral-8x7b has no low-bit checkpoint format" in capsys.readouterr().err
    from moekit.tools.bench import lowbit

    assert [lowbit.preset_recipe(p, "native") for p in lowbit.DEFAULT_PRESETS] == ["mxfp4", "nvfp4", "fp8_block"]
    assert lowbit.preset_recipe("mixtral-8x7b", "nvfp4") == "nvfp4"
    rows = [{"preset": "gpt-oss-120b", "format": "mxfp4", "T": 1, "moekit_lowbit": 50.0, "moekit_bf16": 60.0,
             "torch_grouped_mm": 170.0, "speedup_vs_bf16": 1.2, "floor_lowbit_us": 12.6, "lowbit_floor_ratio": 3.97,
             "lowbit_err_vs_dequantized": 2e-3, "lowbit_err_vs_bf16_layer": 0.19}]
    env = {"gpu": "H200", "date": "today", "torch": "t", "triton": "3.6.0"}
    md = lowbit.markdown(rows, env, 8e14)
    assert "| gpt-oss-120b | mxfp4 | 1 | 50.0 | 60.0 | 170.0 | 1.20 | 12.6 | 3.97 |" in md
    assert "W4A8" not in md  # no W4A8 rows, no W4A8 table
    rows[0] |= {"moekit_w4a8": 90.0, "w4a8_vs_lowbit": 1.8, "w4a8_err_vs_reference": 2.5e-3}
    rows.append({"preset": "qwen3-30b-a3b", "format": "nvfp4", "T": 1, "moekit_lowbit": 20.0, "moekit_w4a8": None,
                 "moekit_w4a8_mode": "-", "moekit_bf16": 23.0, "torch_grouped_mm": 88.0, "floor_lowbit_us": 5.1})
    md = lowbit.markdown(rows, env, 8e14)
    assert "| gpt-oss-120b | mxfp4 | 1 | 50.0 | 60.0 | 170.0 |" in md  # the W4A16 table keeps its columns
    assert "| gpt-oss-120b | 1 | 90.0 | 50.0 | 60.0 | 1.80 | 0.00250 |" in md
    assert "| qwen3-30b-a3b | 1 |" not in md  # NVFP4 has no W4A8 row


def test_verify_router_checks_past_the_fused_kernels_limit():
    # The GPU default token list has 129 and 1000: the one-launch fused kernel refuses them by design,
    # so verify checks only the unfused path there (it once raised and lost the whole Triton group).
    from moekit import presets
    from moekit.routing import tiers as router_tiers
    from moekit.tools.verify.router_checks import check_router

    spec = presets.get("qwen3-30b-a3b").scaled()
    impls = {"router_gemm": [], "route": [], "fused_router": ["unfused", "fused"]}
    T = router_tiers.FUSED_MAX_TOKENS + 1
    rows = check_router(spec, T, torch.float32, torch.device("cpu"), impls)
    assert [r.impl for r in rows] == ["unfused"] and rows[0].ok


def test_verify_a_raising_check_fails_its_case_and_the_group_goes_on(monkeypatch):
    from moekit.tools.verify import runner

    calls = []

    def flaky(spec, T, *args, **kwargs):
        calls.append(T)
        if T == 7:
            raise RuntimeError("boom")
        return []

    monkeypatch.setattr(runner, "check_router", flaky)
    monkeypatch.setattr(runner, "experts_backends", lambda device, dtype: [])
    rows = runner.run_group("torch", ["mixtral-8x7b"], [7, 9], torch.float32, torch.device("cpu"),
                            {"route": ["torch"]}, on_gpu=False)
    assert calls == [7, 9]
    assert len(rows) == 1 and not rows[0].ok and "RuntimeError: boom" in rows[0].detail and rows[0].tokens == 7


def test_verify_a_raising_check_hides_no_other_check_of_its_case(monkeypatch):
    # one try held the router, experts and invariance checks of a case: a raising route dropped router_gemm's rows
    # and every experts row, under one "(case)" row
    from moekit.tools.verify import router_checks, runner

    def broken(*args, **kwargs):
        raise RuntimeError("route broke")

    monkeypatch.setattr(router_checks, "route", broken)
    rows = runner.run_group("torch", ["mixtral-8x7b"], [5], torch.float32, torch.device("cpu"),
                            {"router_gemm": ["torch"], "route": ["torch"], "fused_router": []}, on_gpu=False)
    failed = [r for r in rows if not r.ok]
    assert [(r.op, r.impl) for r in failed] == [("route", "torch")] and "route broke" in failed[0].detail
    assert {"router_gemm", "fused_experts", "batched_experts"} <= {r.op for r in rows if r.ok}


def test_verify_reads_back_a_childs_non_finite_rows_as_failures():
    # a NaN output or a crashed check comes back from an isolated child as null: the parent's table raised on it
    from moekit.tools import cli
    from moekit.tools.verify import runner

    rows = [runner.CheckResult("fused_experts", "triton", "p", 3, float("nan"), float("inf"), 1.0, False, ""),
            runner.CheckResult("route", "torch", "p", 3, 0.0, 0.0, float("inf"), False, "raised")]
    back = runner.rows_from_json(cli._json_report(rows))
    assert [(r.max_rel, r.rms_rel, r.ok) for r in back] == [(float("inf"), float("inf"), False), (0.0, 0.0, False)]
    assert back[1].agree == 0.0 and f"{back[0].max_rel:.1e}" == "inf"


def test_verify_checks_a_backend_only_on_calls_it_serves(monkeypatch):
    # a correct backend that declines gpt-oss's activation was marked FAILED ("cannot serve this call"); one that
    # declines biases was never checked at all
    from moekit.experts import backends as experts_backends
    from moekit.experts import batched_torch, fused_torch
    from moekit.tools.verify import experts_checks

    def rejects(call, explicit):
        return None if call.activation == "silu_and_mul" and not any(call.biases) else "silu_and_mul, no biases"

    experts_backends.register(experts_backends.Backend("picky", rejects, "planted", fused_torch, batched_torch))
    try:
        assert "picky" in experts_checks.experts_backends(torch.device("cpu"), torch.float32)
        for name, served in (("gpt-oss-20b", False), ("qwen3-30b-a3b", True)):
            spec = presets.get(name).scaled()
            rows = experts_checks.check_experts(spec, 3, torch.float32, torch.device("cpu"), only=["picky"],
                                                with_layer=False, low_bit=False)
            assert all(r.ok for r in rows) and bool(rows) == served, (name, rows)
    finally:
        experts_backends.unregister("picky")


def test_bench_experts_merge_joins_runs_without_a_gpu(tmp_path):
    # A sweep split over time-limited device calls becomes one table: presets in the bench's order, T
    # ascending, a later run's (preset, T) replacing an earlier one's, each run's matmul rate named.
    from moekit.tools.bench import experts

    env = {"gpu": "H200", "date": "d1", "torch": "t", "triton": "3.6.0", "cuda": "13.0"}
    row = lambda p, T, us: {"preset": p, "T": T, "experts_hit": 8, "floor_us": 10.0, "floor_kind": "bytes",  # noqa: E731
                            "moekit": us, "torch_grouped_mm": 2 * us}
    runs = [{"env": env, "matmul_rate": 7.5e14, "records": [row("qwen3-30b-a3b", 16, 30.0), row("gpt-oss-120b", 4, 9.0)]},
            {"env": dict(env, date="d2"), "matmul_rate": 7.8e14, "records": [row("qwen3-30b-a3b", 16, 20.0),
                                                                             row("gpt-oss-120b", 1, 5.0)]}]
    paths = []
    for i, run in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    experts.main(["--merge", *map(str, paths), "--out", str(tmp_path), "--name", "merged"])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [(r["preset"], r["T"], r["moekit"]) for r in merged["records"]] == [
        ("gpt-oss-120b", 1, 5.0), ("gpt-oss-120b", 4, 9.0), ("qwen3-30b-a3b", 16, 20.0)]
    md = (tmp_path / "merged.md").read_text()
    assert "each run (in order): 750 / 780 TFLOP/s" in md and "d1 and d2" in md


def test_bench_cases_do_not_depend_on_what_ran_before():
    # a row of two bench runs with other --tokens lists must see the same routes and inputs (experts hit, floor)
    from moekit.tools.bench import experts

    g = experts._gen("cpu")
    experts.reseed("qwen3-30b-a3b T=16", "cpu")
    first = torch.rand(4, generator=g)
    torch.rand(100, generator=g)                      # another case drew in between
    experts.reseed("qwen3-30b-a3b T=16", "cpu")
    assert torch.equal(torch.rand(4, generator=g), first)


def test_explain_asks_the_oracle_for_each_presets_checkpoint_format(capsys):
    # the same question fused_experts asks: the preset's own format (gpt-oss MXFP4, DeepSeek FP8 blocks as W8A8)
    assert main(["explain", "--preset", "gpt-oss-120b", "deepseek-v3", "--tokens", "4", "--weights", "native"]) == 0
    out = capsys.readouterr().out
    assert "mxfp4 weights" in out and "fp8 weights, bfloat16 rounded to fp8_group activations" in out
    assert main(["explain", "--preset", "gpt-oss-120b", "mixtral-8x7b", "--weights", "native"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "mixtral-8x7b has no low-bit checkpoint format" in captured.err


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2 and "usage: moekit" in capsys.readouterr().err


def test_one_backend_in_this_process_prints_its_table(capsys):
    # --backend with --no-isolate was read as a child's call: no table, nothing printed
    assert main(["verify", "--backend", "torch", "--no-isolate", "--preset", "mixtral-8x7b", "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "accuracy against float64" in out and "0 failed" in out


def test_native_weights_default_to_the_presets_with_a_checkpoint_format(capsys):
    # the default presets held mixtral-8x7b, which has none: `--weights native` alone failed
    assert main(["explain", "--weights", "native", "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "[gpt-oss-120b]" in out and "[mixtral-8x7b]" not in out
    assert main(["bench", "--weights", "native"]) == 2                      # on to the GPU check, not the presets
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_tune_as_a_module_exits_non_zero_on_failure():
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "moekit.tools.tune", "--preset", "nope"], capture_output=True,
                          text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "moekit tune: error" in done.stderr


def test_a_plugin_that_does_not_import_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("MOEKIT_PLUGINS", "no_such_moekit_plugin")
    assert main(["verify", "--backend", "torch", "--no-isolate"]) == 2
    assert "MOEKIT_PLUGINS: cannot import 'no_such_moekit_plugin'" in capsys.readouterr().err


def test_the_json_report_is_standard_json():
    # a crashed check's errors are inf: the report held Infinity, which strict JSON readers refuse
    from moekit.metrics import CheckResult
    from moekit.tools.cli import _json_report

    crashed = CheckResult("fused_experts", "broken", "mixtral-8x7b", 1)
    crashed.max_rel = crashed.rms_rel = float("inf")
    report = json.loads(_json_report([crashed]), parse_constant=lambda c: pytest.fail(f"non-standard {c}"))
    assert report[0]["max_rel"] is None


@pytest.mark.parametrize("recipe, act_quant", [
    ("fp8_block", "fp8_group"),  # FP8 steps one activation group per K step: the table's block_k is not what runs
    ("mxfp4", None),  # 4-bit tiles hold whole scale groups
])
def test_explain_names_the_tiles_the_kernels_launch(monkeypatch, recipe, act_quant):
    import dataclasses

    from moekit import presets
    from moekit.experts import backends, fused_experts, triton_backend
    from moekit.formats import quantize_experts
    from moekit.tools import cli

    E, H, I, k, T = 4, 256, 128, 2, 8
    spec = dataclasses.replace(presets.get("deepseek-v3"), hidden_size=H, intermediate_size=I, num_experts=E, top_k=k,
                               num_groups=1, topk_groups=1, num_shared_experts=0)
    triton = next(b for b in backends.BACKENDS if b.name == "triton")
    monkeypatch.setattr(backends, "select_backend", lambda call, backend="auto": triton)  # as on a GPU
    line = cli.explain_experts(spec, T, torch.device("cpu"), dtype=torch.float16, recipe=recipe)
    from moekit._launch import Launcher

    gemm = {}  # the Launcher objects of the GEMM and GEMV kernels: which GEMM each computes
    for name in ("gemm1_act_kernel", "gemm2_kernel", "gemm2_tokens_kernel", "gemv1_act_kernel", "gemv1_rows_kernel",
                 "gemv2_rows_kernel", "gemv2_tokens_kernel"):
        launcher = getattr(triton_backend, name, None)
        if launcher is not None:
            gemm[id(launcher)] = "gemm1" if "1" in name else "gemm2"
    seen = {}
    real = Launcher.launch

    def record(self, grid, args, kwargs):  # (on the class: an instance attribute would outlive the test)
        if id(self) in gemm:
            seen[gemm[id(self)]] = (kwargs["BLOCK_N"], kwargs["BLOCK_K"])
        return real(self, grid, args, kwargs)
    monkeypatch.setattr(Launcher, "launch", record)
    w13 = quantize_experts(torch.randn(E, 2 * I, H) * 0.05, recipe)
    w2 = quantize_experts(torch.randn(E, H, I) * 0.05, recipe)
    x, tw = torch.randn(T, H, dtype=torch.float16), torch.rand(T, k)
    fused_experts(x, w13, w2, tw, torch.randint(0, E, (T, k), dtype=torch.int32), act_quant=act_quant,
                  backend="triton")
    assert set(seen) == {"gemm1", "gemm2"}, seen
    for gemm, (block_n, block_k) in seen.items():
        assert f"{gemm} GemmConfig(block_n={block_n}, block_k={block_k}," in line, (gemm, seen[gemm], line)
