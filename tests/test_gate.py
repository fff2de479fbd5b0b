"""The accuracy gate catches deliberately broken backends: each one below would serve the call
(it claims support and sits first in priority) and each one is wrong in a way that got real MoE
kernels reverted. With the gate on, every one is disabled with a warning naming it and the
reference-correct backend serves instead; with the gate off, the broken one serves (so the test
can see the difference)."""

import dataclasses

import pytest
import torch

from moekit import backends, presets, reference
from moekit.experts import backends as backends_module
from moekit.experts.backends import Backend
from moekit.experts import batched_experts, batched_torch, fused_experts, fused_torch
from moekit import gate
from moekit.experts import gate_case
from moekit.metrics import Tolerance, check_close


def _fused_only(call, explicit):
    return None if call.op == "fused" else "fused only"


def _batched_only(call, explicit):
    return None if call.op == "batched" else "batched only"


def _drops_bias(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw, ids, act, None, None, emap)


def _skips_last_tile(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    full = torch.empty_like(out)
    fused_torch(full, x, w13, w2, tw, ids, act, b13, b2, emap)
    out[:-1] = full[:-1]                                         # the last partial row block never written


def _rebinds_out(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    out = torch.empty_like(out)                                  # the reverted NVFP4 backend's bug
    fused_torch(out, x, w13, w2, tw, ids, act, b13, b2, emap)
    return out


def _ignores_row_stride(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    dense = x.as_strided(x.shape, (x.shape[1], 1))              # reads the storage as if contiguous
    fused_torch(out, dense, w13, w2, tw, ids, act, b13, b2, emap)


def _bf16_rounding(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw, ids, act, b13, b2, emap)
    out.copy_(out.bfloat16())                                    # fp32 results through bf16


def _reads_padding(out, x, counts, w13, w2, act, b13, b2, cfg, aq):
    batched_torch(out, x.roll(1, dims=1), counts.clamp(min=1), w13, w2, act, b13, b2)   # neighbours' rows


BROKEN = [
    (Backend("drops_bias", _fused_only, "broken", _drops_bias), "fused"),
    (Backend("skips_last_tile", _fused_only, "broken", _skips_last_tile), "fused"),
    (Backend("rebinds_out", _fused_only, "broken", _rebinds_out), "fused"),
    (Backend("ignores_row_stride", _fused_only, "broken", _ignores_row_stride), "fused"),
    (Backend("bf16_rounding", _fused_only, "broken", _bf16_rounding), "fused"),
    (Backend("reads_padding", _batched_only, "broken", batched=_reads_padding), "batched"),
]


# the gate's warning for a backend broken on purpose, where a later lookup (explain) checks another call kind
_BROKEN_ON_PURPOSE = pytest.mark.filterwarnings("ignore:moekit. backend '.*' failed its accuracy check:RuntimeWarning")


@pytest.fixture
def registered(request):
    backend, _ = request.param
    backends.register(backend)
    gate.reset()
    yield request.param
    backends.unregister(backend.name)
    gate.set_verification(False)
    gate.reset()


def _call(op):
    E, H, I, T = 5, 32, 16, 7
    w13, w2 = torch.randn(E, 2 * I, H) * 0.2, torch.randn(E, H, I) * 0.2
    b13, b2 = torch.randn(E, 2 * I) * 0.1, torch.randn(E, H) * 0.1
    if op == "fused":
        x = torch.randn(T, H + 4)[:, 4:]
        tw, ids = torch.rand(T, 2), torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1).int()
        run = lambda: fused_experts(x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2)  # noqa: E731
        ref = reference.fused_experts(x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2)
        return run, ref, lambda out: out
    x = torch.randn(E, 6, H)
    counts = torch.tensor([6, 0, 2, 5, 1], dtype=torch.int32)
    valid = torch.arange(6)[None, :] < counts[:, None].long()
    x[~valid] = float("nan")
    run = lambda: batched_experts(x, counts, w13, w2, w13_bias=b13, w2_bias=b2)  # noqa: E731
    ref = reference.batched_experts(x, counts, w13, w2, w13_bias=b13, w2_bias=b2)
    return run, ref, lambda out: out[valid]


@pytest.mark.parametrize("registered", BROKEN, ids=[b.name for b, _ in BROKEN], indirect=True)
@_BROKEN_ON_PURPOSE
def test_the_gate_catches_each_broken_backend(registered):
    backend, op = registered
    run, ref, pick = _call(op)
    gate.set_verification(False)
    with pytest.raises(AssertionError):                          # without the gate the broken one serves
        check_close("ungated", pick(run()), pick(ref), Tolerance(1e-5, 1e-5))
    gate.set_verification(True)
    with pytest.warns(RuntimeWarning, match=f"backend '{backend.name}' failed its accuracy check"):
        got = run()
    check_close("gated", pick(got), pick(ref), Tolerance(1e-5, 1e-5))   # the torch reference served
    passed, detail = gate.results()[(backend.name, next(k for n, k in gate.results() if n == backend.name))]
    assert not passed and detail
    call = backends.ExpertsCall("dense", torch.float32, torch.device("cpu"), 7, op=op)
    assert f"{backend.name}" in backends.explain(call) and "failed the verification gate" in backends.explain(call)


def test_correct_backends_pass_and_are_checked_once():
    gate.reset()
    gate.set_verification(True)
    try:
        run, ref, pick = _call("fused")
        run()
        run()
        verdicts = gate.results()
        assert [v[0] for v in verdicts.values()] == [True] and len(verdicts) == 1
    finally:
        gate.set_verification(False)
        gate.reset()


def test_a_process_default_device_does_not_fail_the_checks():
    # the cases draw on the CPU and move to the call's device; under "meta" (or "cuda" with CPU calls) a case drawn
    # on the default device raised, and the gate disabled every backend, the reference's own included
    gate.reset()
    gate.set_verification(True)
    run, ref, pick = _call("fused")
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        got = run()
    finally:
        torch.set_default_device(previous)
        gate.set_verification(False)
        verdicts = gate.results()
        gate.reset()
    assert all(v[0] for v in verdicts.values()) and verdicts
    check_close("under a default device", pick(got), pick(ref), Tolerance(1e-5, 1e-5))


def test_environment_switch(monkeypatch):
    gate.set_verification(None)
    monkeypatch.setenv("MOEKIT_VERIFY", "1")
    assert gate.enabled()
    monkeypatch.setenv("MOEKIT_VERIFY", "0")
    assert not gate.enabled()
    gate.set_verification(False)


def _w8a8_forgets_block_scales(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    from moekit.formats import fp8

    unscaled = [fp8.FP8Tensor(w.data, torch.ones_like(w.scale), w.granularity) for w in (w13, w2)]
    fused_torch(out, x, *unscaled, tw, ids, act, b13, b2, emap, None, aq)   # codes read as values


def _w4a8_scale_off_by_one(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    from moekit.formats import mxfp4

    scales = w2.scales - 1                                            # each E8M0 exponent one low: w2 halved
    fused_torch(out, x, w13, mxfp4.MXFP4Tensor(w2.data, scales, w2.shape), tw, ids, act, b13, b2, emap, None, aq)


@pytest.mark.parametrize("op", ["fused", "batched"])
@pytest.mark.parametrize("weights,broken", [
    ("fp8", _w8a8_forgets_block_scales),  # W8A8; the broken backend drops the 128x128 weight scales
    ("mxfp4", _w4a8_scale_off_by_one),  # W4A8: checked, not waved through as an emulation; every E8M0 scale one low
])
def test_the_gate_checks_fp8_activations_against_their_own_reference(op, weights, broken):
    # The Triton kernels (emulated bit for bit on the CPU) pass the check against the W8A8 float64 reference (the
    # dequantized weights, activations rounded to E4M3 1x128 groups); a broken backend does not.
    call = backends.ExpertsCall(weights, torch.float32, torch.device("cpu"), 9, "fp8_group", op=op,
                                activation="swiglu_oai")
    triton = next(b for b in backends.BACKENDS if b.name == "triton")
    passed, detail = gate_case.check(triton, call)
    assert passed and "rms_rel" in detail, detail
    if op == "fused":
        passed, detail = gate_case.check(Backend(broken.__name__, _fused_only, "broken", broken), call)
        assert not passed and "rms_rel" in detail


def _reads_codes_as_packed(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    import dataclasses

    as_stored = [dataclasses.replace(w, layout="packed") for w in (w13, w2)]   # prepared bytes read as stored
    fused_torch(out, x, *as_stored, tw, ids, act, b13, b2, emap)


@_BROKEN_ON_PURPOSE
def test_the_gate_checks_each_byte_layout_of_4_bit_codes():
    # a backend right on the checkpoints' byte layout and wrong on moekit's prepared one ("pairs") passes the check
    # of the first and is refused for the second: the layout is part of the shape class
    from moekit.formats import prepare, quantize_experts

    broken = Backend("reads_codes_as_packed", _fused_only, "broken", _reads_codes_as_packed)
    backends.register(broken)
    gate.reset()
    gate.set_verification(True)
    try:
        E, H, I, T = 5, 64, 32, 7
        q13 = quantize_experts(torch.randn(E, 2 * I, H) * 0.2, "mxfp4")
        q2 = quantize_experts(torch.randn(E, H, I) * 0.2, "mxfp4")
        x, tw = torch.randn(T, H), torch.rand(T, 2)
        ids = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1).int()
        ref = reference.fused_experts(x, q13, q2, tw, ids)
        check_close("packed codes", fused_experts(x, q13, q2, tw, ids), ref, Tolerance(1e-5, 1e-5))
        with pytest.warns(RuntimeWarning, match="backend 'reads_codes_as_packed' failed its accuracy check"):
            got = fused_experts(x, prepare(q13), prepare(q2), tw, ids)
        check_close("prepared codes, the reference served", got, ref, Tolerance(1e-5, 1e-5))
        verdicts = {detail: passed for (name, key), (passed, detail) in gate.results().items()
                    if name == broken.name}
        assert sorted(verdicts.values()) == [False, True]
        call = backends.ExpertsCall.of(x, prepare(q13), w2=prepare(q2))
        assert call.layout == "pairs" and "'pairs' byte layout" in backends.explain(call)
        assert backends.ExpertsCall.of(x, q13, w2=prepare(q2)).layout == "packed/pairs"
    finally:
        backends.unregister(broken.name)
        gate.set_verification(False)
        gate.reset()


def test_verify_checks_a_dense_only_backend_on_what_it_serves():
    # verify asked every dense backend for adapters and 4-bit weights: a correct backend that refuses them failed
    # the whole case, its dense results thrown away
    from moekit.experts import backends as experts_backends
    from moekit.experts import batched_torch, fused_torch
    from moekit.tools.verify.experts_checks import check_experts

    def dense_only(call, explicit):
        return None if call.weight_format == "dense" and call.act_quant is None and not call.lora else "dense only"

    experts_backends.register(experts_backends.Backend(
        "dense_only", dense_only, "dense only", lambda out, *a, **k: fused_torch(out, *a[:9]),
        lambda out, *a, **k: batched_torch(out, *a[:7])))
    try:
        results = check_experts(presets.get("mixtral-8x7b").scaled(), 7, torch.float32, torch.device("cpu"),
                                only=["dense_only"], with_layer=False)
    finally:
        experts_backends.unregister("dense_only")
    assert [r.op for r in results] == ["fused_experts", "batched_experts"] and all(r.ok for r in results)


# The gate checks what the call will run: the kernel variant a backend names for it (its config at the call's token
# count and sizes), and the call's slots per token, biases and expert map. Each broken backend below is right on the
# small case the gate used to check (k = 2, both biases, no map, the backend's own choice of kernels) and wrong on
# the call.

def _wrong_in_per_pair_mode(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw, ids, act, b13, b2, emap)
    if cfg is not None and cfg.mode == "per_pair":
        out.mul_(1.01)                                           # the decode kernel's epilogue scales wrongly


def _wrong_without_biases(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw, ids, act, b13, b2, emap)
    if b2 is None:
        out.add_(0.01)                                           # the variant compiled without a bias reads junk


def _ignores_expert_map(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw, ids.remainder(w13.shape[0]), act, b13, b2, None)   # global ids as local


def _sums_four_slots(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw[:, :4].contiguous(), ids[:, :4].contiguous(), act, b13, b2, emap)  # k <= 4 only


def _stale_plan(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq, plan=False):
    fused_torch(out, x, w13, w2, tw, ids, act, b13, b2, emap)
    first = out.clone()

    def replay(out, *args):                                      # replays the first call's result: stale inputs
        out.copy_(first)
        return True
    return replay if plan else None


def _gated(backend):
    backends.register(backend)
    gate.reset()
    gate.set_verification(True)


def _ungate(backend):
    backends.unregister(backend.name)
    gate.set_verification(False)
    gate.reset()


def _case(T, k, E=7, H=32, I=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    x, tw = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    return x, w13, w2, tw, ids


@_BROKEN_ON_PURPOSE
def test_the_gate_checks_the_kernel_variant_each_call_runs():
    # dense calls of 1 token run the per-pair decode kernels, of 40 the aligned ones (the heuristic): the gate used to
    # check one small case in whichever mode it fell, so a decode-only fault served every decode call
    broken = Backend("wrong_in_per_pair_mode", _fused_only, "broken", _wrong_in_per_pair_mode,
                     variant=backends_module._triton_variant)
    _gated(broken)
    try:
        for T, faulty in ((40, False), (1, True)):
            x, w13, w2, tw, ids = _case(T, 2)
            ref = reference.fused_experts(x, w13, w2, tw, ids)
            if faulty:
                with pytest.warns(RuntimeWarning, match="wrong_in_per_pair_mode' failed .* mode 'per_pair'"):
                    got = fused_experts(x, w13, w2, tw, ids)
            else:
                got = fused_experts(x, w13, w2, tw, ids)
            check_close(f"T={T}", got, ref, Tolerance(1e-5, 1e-5))
        verdicts = {key.config.mode: passed for (name, key), (passed, _) in gate.results().items()
                    if name == broken.name}
        assert verdicts == {"aligned": True, "per_pair": False}
        assert "failed the verification gate" in backends.explain(backends.ExpertsCall.of(x, w13, w2=w2, top_k=2))
    finally:
        _ungate(broken)


@pytest.mark.parametrize("broken,call", [
    (_wrong_without_biases, dict(biases=False)),  # a kernel compiled without biases
    (_ignores_expert_map, dict(expert_map=True)),  # expert parallelism: global ids read as local
    (_sums_four_slots, dict(k=6)),  # k not a power of two, more slots than the check's 2
])
def test_the_gate_checks_the_calls_slots_biases_and_expert_map(broken, call):
    backend = Backend(broken.__name__, _fused_only, "broken", broken)
    _gated(backend)
    try:
        k = call.get("k", 2)
        x, w13, w2, tw, ids = _case(9, k)
        b13, b2 = (None, None) if call.get("biases") is False else (torch.randn(7, 32) * 0.1, torch.randn(7, 32) * 0.1)
        emap = None
        if call.get("expert_map"):                               # 7 local experts of 10, at shuffled global places
            where = torch.randperm(10)[:7]
            emap = torch.full((10,), -1, dtype=torch.int32)
            emap[where] = torch.arange(7, dtype=torch.int32)
            ids = where[ids.long()].int()
        ref = reference.fused_experts(x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2, expert_map=emap)
        with pytest.warns(RuntimeWarning, match=f"'{broken.__name__}' failed its accuracy check"):
            got = fused_experts(x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2, expert_map=emap)
        check_close("the reference served", got, ref, Tolerance(1e-5, 1e-5))
    finally:
        _ungate(backend)


def test_the_gate_checks_a_plan_on_the_next_call():
    # a planned call replays launches prepared on its first call: the gate serves a second case through the plan
    backend = Backend("stale_plan", _fused_only, "broken", _stale_plan, plans=True)
    _gated(backend)
    try:
        x, w13, w2, tw, ids = _case(9, 2)
        with pytest.warns(RuntimeWarning, match="'stale_plan' failed .*a call and its plan's"):
            fused_experts(x, w13, w2, tw, ids)
    finally:
        _ungate(backend)


def test_a_failure_is_honoured_while_torch_compile_traces(monkeypatch):
    # no check can run inside a trace; a backend that failed a check of the call's kind is refused there
    broken = Backend("wrong_in_per_pair_mode", _fused_only, "broken", _wrong_in_per_pair_mode,
                     variant=backends_module._triton_variant)
    _gated(broken)
    try:
        x, w13, w2, tw, ids = _case(1, 2)
        with pytest.warns(RuntimeWarning):
            fused_experts(x, w13, w2, tw, ids)
        call = backends.ExpertsCall.of(x[:0], w13, w2=w2, top_k=2)          # a token count not checked yet
        gate._RESULTS[("route:triton", 8, torch.float32, "cpu")] = (False, "a router verdict")  # other keys: skipped
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert "failed the verification gate" in gate_case.refusal(broken, call)
        assert gate_case.refusal(broken, dataclasses.replace(call, act_dtype=torch.float16)) is None  # another kind
    finally:
        monkeypatch.undo()
        _ungate(broken)


@pytest.mark.parametrize("fmt,T,mode", [
    ("dense", 1, "per_pair"),  # the decode kernels on 16-row tensor-core tiles
    ("dense", 40, "aligned"),  # row blocks: alignment, GEMMs, combine
    ("dense", 200, "aligned"),  # over 256 pairs (k=6): the three-launch alignment
    ("mxfp4", 3, "gemv"),  # 4-bit decode on the CUDA cores (rows GEMV1)
    ("mxfp4", 40, "aligned"),  # 4-bit codes decoded in the tensor-core GEMMs
])
def test_the_triton_kernels_pass_the_check_of_each_variant(fmt, T, mode):
    # the Triton backend (the interpreter, fp16) in the config each call runs, with k = 6, no w13 bias and an
    # expert map: the case the gate builds for it is right
    from moekit.formats import quantize_experts

    if not _interpreting():
        pytest.skip("the Triton interpreter (TRITON_INTERPRET=1) runs the kernels on the CPU")
    x, w13, w2, _, _ = _case(T, 6, E=9, H=64, I=32)
    if fmt != "dense":
        w13, w2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
    else:
        w13, w2 = w13.half(), w2.half()
    call = backends.ExpertsCall.of(x.half(), w13, w2=w2, top_k=6, biases=(False, True), expert_map=True)
    triton = next(b for b in backends.BACKENDS if b.name == "triton")
    cls = gate_case.gate_class(triton, call)
    assert cls.config.mode == mode and cls.top_k == 6 and cls.expert_map
    passed, detail = gate_case.check(triton, call)
    assert passed, detail


def _interpreting():
    from moekit import _triton

    return _triton.triton_importable() and _triton.interpreting()


def _wrong_on_channel_scaled_w2(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw, ids, act, b13, b2, emap)
    if w2.granularity == "channel":
        out.mul_(0.5)                                            # GEMM2's per-column scales applied twice


def _wrong_on_fp32_biases(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq):
    fused_torch(out, x, w13, w2, tw, ids, act, b13, b2, emap)
    if b13 is not None and b13.dtype != x.dtype:
        out.add_(0.05)                                           # the fp32-bias specialization reads them as fp16


def _ignores_rank_above_8(out, x, w13, w2, tw, ids, act, b13, b2, emap, cfg, aq, lora=None, lora_ids=None):
    if lora is not None and lora.w13_a.shape[2] > 8:
        lora = lora_ids = None                                   # a tile that holds rank 8 drops larger adapters
    fused_torch(out, x, w13, w2, tw, ids, act, b13, b2, emap, lora=lora, lora_ids=lora_ids)


def test_the_gate_checks_each_stacks_scales_bias_dtypes_and_adapter_ranks():
    # FP8 stacks of different granularities, fp32 biases beside fp16 activations and adapters of a larger rank take
    # other kernels: the case was all-block, biases in the activations' dtype and rank 5
    from moekit.experts import ExpertsLoRA
    from moekit.formats import quantize_experts

    for fn, extra in ((_wrong_on_channel_scaled_w2, {}), (_wrong_on_fp32_biases, {}),
                      (_ignores_rank_above_8, {"lora": True})):
        backend = Backend(fn.__name__, _fused_only, "broken", fn, lora="lora" in extra)
        _gated(backend)
        try:
            x, w13, w2, tw, ids = _case(9, 2)
            kw = {}
            if fn is _wrong_on_channel_scaled_w2:
                w13, w2 = quantize_experts(w13, "fp8_block"), quantize_experts(w2, "fp8_channel")
                ref = reference.fused_experts(x, w13, w2, tw, ids)
            elif fn is _wrong_on_fp32_biases:
                x, w13, w2 = x.half(), w13.half(), w2.half()
                kw = dict(w13_bias=torch.randn(7, 32) * 0.1, w2_bias=torch.randn(7, 32) * 0.1)
                ref = reference.fused_experts(x, w13, w2, tw, ids, **kw)
            else:
                r = 16
                kw = dict(lora=ExpertsLoRA(torch.randn(1, 7, r, 32) * 0.1, torch.randn(1, 7, 32, r) * 0.1,
                                           torch.randn(1, 7, r, 16) * 0.1, torch.randn(1, 7, 32, r) * 0.1, [1.0]),
                          lora_ids=torch.zeros(9, dtype=torch.int32))
                ref = reference.fused_experts(x, w13, w2, tw, ids, **kw)
            with pytest.warns(RuntimeWarning, match=f"'{fn.__name__}' failed its accuracy check"):
                got = fused_experts(x, w13, w2, tw, ids, **kw)
            tol = Tolerance(2e-3, 5e-4) if x.dtype == torch.float16 else Tolerance(1e-5, 1e-5)
            check_close(f"{fn.__name__}: the reference served", got, ref, tol)
        finally:
            _ungate(backend)


def test_case_sizes_keep_the_alignment_kernels_of_the_call():
    # the aligned mode's alignment is compiled for the expert count rounded up to a power of two: the case keeps it
    from moekit.experts.configs import heuristic

    aligned, per_pair = heuristic(4096, 256, 8, 4096, 7168), heuristic(1, 256, 8, 4096, 7168)
    call = backends.ExpertsCall("dense", torch.bfloat16, torch.device("cpu"), 4096, dims=(256, 4096, 7168), top_k=8)
    E, H, I = gate_case.case_sizes(call, aligned)
    assert E == 129 and H < 7168 and I < 2048 and H % 128 == 7168 % 128
    assert gate_case.case_sizes(dataclasses.replace(call, dims=(8, 4096, 7168)), aligned)[0] == 10  # E=8 < k+2
    assert gate_case.case_sizes(call, per_pair)[0] == 11                                            # no alignment
    # a call that does not say its slots per token: the class and its case count the same pairs
    small = backends.ExpertsCall("dense", torch.bfloat16, torch.device("cpu"), 100, dims=(64, 512, 256))
    triton = next(b for b in backends.BACKENDS if b.name == "triton")
    cls = gate_case.gate_class(triton, small)
    assert cls.num_tokens * gate_case.DEFAULT_TOP_K <= 256


def test_a_lora_case_takes_the_adapter_kernels_of_its_call():
    # the adapters' kernels are chosen by sizes the case cuts: gpt-oss-120b's rank-16 decode runs the separate
    # kernels (its I/8 column blocks overflow the terms' tile inside the GEMVs), the cut case would have taken the
    # terms; the class names the call's path and the check forces it
    from moekit.experts import ExpertsLoRA, lora as expert_lora
    from moekit.experts.configs import heuristic

    triton = next(b for b in backends.BACKENDS if b.name == "triton")
    config = heuristic(1, 128, 4, 5760, 2880, "mxfp4")
    call = backends.ExpertsCall("mxfp4", torch.float16, torch.device("cpu"), 1, dims=(128, 5760, 2880), top_k=4,
                                lora=True, lora_ranks=(16, 16), config=config)
    cls = gate_case.gate_class(triton, call)
    assert cls.lora_paths == (("decode_terms", False),) and gate_case.gate_class(triton, cls) == cls
    E, H, I = gate_case.case_sizes(cls, config)
    assert expert_lora.decode_terms_fit(16, 16, I, config.gemm1.block_n, 1, config.gemm2.block_n, 4, 9)
    prefill = dataclasses.replace(call, num_tokens=4096, config=heuristic(4096, 128, 4, 5760, 2880, "mxfp4"))
    assert gate_case.gate_class(triton, prefill).lora_paths == (("w2_delta", False),)
    lora = ExpertsLoRA(None, None, torch.zeros(1, 2, 4, 32), torch.zeros(1, 2, 64, 4), [1.0])
    with expert_lora.forced_paths(w2_delta=True):
        assert expert_lora.w2_term_as_delta(lora, 10 ** 9, 1)            # forced, whatever the sizes say
    assert not expert_lora.w2_term_as_delta(lora, 10 ** 9, 1)
