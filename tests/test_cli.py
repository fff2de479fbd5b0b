"""The `moekit` command: the main job passes on this machine and reports as documented."""

import json

import pytest
import torch

from moekit.cli import main


def test_verify_default_job_passes_and_writes_json(tmp_path, capsys):
    report = tmp_path / "verify.json"
    assert main(["verify", "--preset", "gpt-oss-120b", "deepseek-v3", "--tokens", "1", "9", "--json", str(report)]) == 0
    rows = json.loads(report.read_text())
    assert rows and all(r["ok"] for r in rows)
    assert {r["op"] for r in rows} >= {"router_gemm", "route", "fused_router", "fused_experts", "batched_experts", "FusedMoE"}
    assert "0 failed" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="about the CPU interpreter")
def test_verify_bf16_on_cpu_skips_interpreted_kernels(capsys):
    assert main(["verify", "--preset", "qwen3-30b-a3b", "--tokens", "33", "--dtype", "bfloat16"]) == 0
    assert "interpreter computes bf16 dots wrongly" in capsys.readouterr().out


def test_presets_and_explain_print(capsys):
    assert main(["presets"]) == 0 and "kimi-k2" in capsys.readouterr().out
    assert main(["explain", "--preset", "mixtral-8x7b", "--tokens", "4"]) == 0
    assert "router_gemm T=4 H=4096 E=8" in capsys.readouterr().out
