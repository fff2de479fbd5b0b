"""The experts benchmarks' floors and output checks on the CPU (moekit.tools.bench.floors, .checks, and the rows
experts.run_preset and lowbit.measure build): the floor counts the bytes of what every timed call reads, and every
timed implementation's output is checked against float64 at every token count."""

import functools
import types

import pytest
import torch

from moekit import presets, reference
from moekit.formats import prepare, quantize_experts
from moekit.metrics import EXPERTS_TOL, W8A8_TOL, experts_tolerance, rel_errors
from moekit.tools.bench import checks, experts, floors, lowbit
from moekit.tools.bench.timing import COPY_BW


@pytest.fixture
def on_cpu(monkeypatch):
    """The benches' rows on the CPU: layers built there, every timing a fixed 1 us."""
    monkeypatch.setattr(experts, "make_layers", functools.partial(experts.make_layers, device="cpu"))
    monkeypatch.setattr(experts, "time_impl", lambda name, fn, cases: (1.0, "graph"))
    monkeypatch.setattr(lowbit, "time_impl", lambda name, fn, cases: (1.0, "graph"))


def _distinct(cases) -> list[int]:
    return [torch.unique(tid).numel() for _, _, _, tid in cases]


def test_experts_floor_is_the_mean_over_the_timed_calls_and_every_t_is_checked(on_cpu):
    # qwen3 scaled: 16 experts, k = 8: one token's call hits 8, four tokens' between 8 and 16, varying call to call
    spec = presets.get("qwen3-30b-a3b").scaled()
    args = types.SimpleNamespace(layers=4, peers=["torch_grouped_mm"], tokens=[1, 2, 1100], accuracy_tokens=None)
    rows = []
    experts.run_preset(args, spec, 8e14, rows.append)
    layers = experts.make_layers(spec, 4, [])  # the same seeds: the same weights and (below) routings
    per_expert = 3 * spec.hidden_size * spec.intermediate_size * 2  # bf16 w13 + w2, no biases
    assert [r["T"] for r in rows] == [1, 2, 1100]
    for r in rows:
        cases = experts.make_cases(spec, r["T"], layers)
        hits = _distinct(cases)
        assert len(cases) == (8 if r["T"] <= 64 else 1) and r["experts_hit_per_call"] == hits
        assert r["experts_hit"] == pytest.approx(sum(hits) / len(hits))
        assert r["expert_bytes"] == per_expert
        bytes_us = (r["experts_hit"] * per_expert + 2 * r["T"] * spec.hidden_size * 2) / COPY_BW * 1e6
        flops_us = 2 * r["T"] * spec.top_k * 3 * spec.hidden_size * spec.intermediate_size / 8e14 * 1e6
        assert r["floor_us"] == pytest.approx(max(bytes_us, flops_us))
        assert r["floor_kind"] == ("bytes" if bytes_us >= flops_us else "flops")
        # every timed implementation checked, at every T
        for impl in ("moekit", "torch_grouped_mm"):
            assert 0 < r[f"{impl}_err"] < 0.05 and 0 < r[f"{impl}_max_err"] < 0.05
        assert r["checked_calls"] == len(cases)
    assert rows[0]["checked_rows"] == "all" and rows[2]["checked_rows"] == "256 of 1100 (random)"
    # two tokens' eight calls do not all hit as many experts: the first call alone is not the graph's mean
    assert len(set(rows[1]["experts_hit_per_call"])) > 1


def test_the_floor_counts_scales_biases_and_activations():
    E, N, K = 4, 64, 256
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    bias = torch.randn(E, N, dtype=torch.bfloat16)
    assert floors.expert_bytes(E, w, bias) == N * K * 2 + N * 2
    # FP8 per output channel: codes and an fp32 scale per row
    assert floors.expert_bytes(E, quantize_experts(w, "fp8_channel")) == N * K + N * 4
    # MXFP4: half a byte per code, an E8M0 byte per 32; prepared (FusedMoE's byte layout): the same bytes
    assert floors.expert_bytes(E, prepare(quantize_experts(w, "mxfp4"))) == N * K // 2 + N * K // 32
    # NVFP4: an E4M3 byte per 16 codes and the expert's fp32 global scale
    assert floors.expert_bytes(E, quantize_experts(w, "nvfp4")) == N * K // 2 + N * K // 16 + 4
    assert floors.activation_bytes(3, K) == 2 * 3 * K * 2
    assert floors.experts_hit([torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 3]])]) == (2.0, [3, 1])


@pytest.mark.parametrize("name, fmt", [("gpt-oss-120b", "mxfp4"), ("qwen3-30b-a3b", "fp8_channel")])
def test_lowbit_floor_counts_what_the_timed_calls_read_and_every_column_is_checked(on_cpu, name, fmt):
    spec = presets.get(name).scaled()
    layers = lowbit.make_layers(spec, fmt, 2, device="cpu")
    impls = lowbit.implementations(spec, w4a8=fmt == "mxfp4")
    cases = experts.make_cases(spec, 2, layers)
    row = lowbit.measure(spec, fmt, 2, cases, impls, 8e14)
    hits = _distinct(cases)
    layer = layers[0]
    parts = [layer.q13, layer.q2]
    stored = sum(t.numel() * t.element_size() for q in parts for t in (q.data, getattr(q, "scales", None),
                                                                         getattr(q, "scale", None),
                                                                         getattr(q, "global_scale", None))
                 if t is not None)
    stored += sum(b.numel() * b.element_size() for b in (layer.b13, layer.b2) if b is not None)
    assert (layer.b13 is not None) == (name == "gpt-oss-120b")
    assert row["experts_hit"] == pytest.approx(sum(hits) / len(hits))
    assert row["expert_bytes_lowbit"] == stored / spec.num_experts
    act = 2 * 2 * spec.hidden_size * 2
    assert row["floor_lowbit_us"] == pytest.approx((row["experts_hit"] * stored / spec.num_experts + act) / COPY_BW
                                                   * 1e6)
    assert row["floor_lowbit_kind"] == "bytes"
    # moekit's low-bit and bf16 calls and the torch grouped_mm peer, each against its float64 reference
    for key in ("lowbit_err_vs_dequantized", "moekit_bf16_err", "torch_grouped_mm_err"):
        assert 0 < row[key] < 0.05, key
    assert (row.get("w4a8_err_vs_reference") is not None) == (fmt == "mxfp4")
    assert row["lowbit_err_vs_bf16_layer"] > row["lowbit_err_vs_dequantized"]  # the quantization's own error


def test_checks_sample_rows_above_1024_tokens_and_cut_whole_calls():
    assert checks.checked_rows(1024, "k") is None
    rows = checks.checked_rows(4096, "k")
    assert len(rows) == checks.SAMPLE_ROWS == len(set(rows.tolist())) and torch.equal(rows, rows.sort().values)
    assert torch.equal(rows, checks.checked_rows(4096, "k")) and not torch.equal(rows, checks.checked_rows(4096, "j"))
    spec = presets.get("mixtral-8x7b").scaled()
    w13 = torch.randn(spec.num_experts, 2 * spec.intermediate_size, spec.hidden_size) * 0.1
    w2 = torch.randn(spec.num_experts, spec.hidden_size, spec.intermediate_size) * 0.1
    layer = types.SimpleNamespace(w13=w13, w2=w2)
    T = 1500
    ids = torch.rand(T, spec.num_experts).argsort(1)[:, :spec.top_k].int()
    call = (torch.randn(T, spec.hidden_size), layer, torch.softmax(torch.randn(T, spec.top_k), -1), ids)
    ref_fn = lambda x, layer, tw, tid: reference.fused_experts(x, layer.w13, layer.w2, tw, tid)  # noqa: E731
    rows = checks.checked_rows(T, "case")
    refs = checks.references(ref_fn, [call], rows)
    assert refs[0].shape == (checks.SAMPLE_ROWS, spec.hidden_size)
    noisy = lambda *c: ref_fn(*c).float() + 1e-3  # noqa: E731 - runs on the whole call, is cut after
    assert checks.worst_errors(noisy, [call], refs, rows) == rel_errors(noisy(*call)[rows], refs[0])


def test_error_cells_flag_the_budget():
    tol = experts_tolerance()
    assert tol == EXPERTS_TOL[torch.bfloat16] and experts_tolerance(w8a8=True) == W8A8_TOL
    assert checks.error_cell(1e-3, 1e-2, tol) == "1.0e-03"
    assert checks.error_cell(6e-3, 1e-2, tol) == "**6.0e-03**"
    assert checks.error_cell(1e-3, 3e-2, tol) == "**1.0e-03** (max 3.0e-02)"
    assert checks.error_cell(None, None, tol) == "-"
    assert checks.over_budget_words([("liger", "p", 1), ("liger", "p", 16), ("sglang", "q", 4)]) == \
        "Over budget (3): liger at p (T = 1, 16); sglang at q (T = 4)."
