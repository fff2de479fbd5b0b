"""The host work of an eager call: decisions that depend only on the call's kind are made once, not per call,
and an eager call goes straight to the launches (the torch.library ops are for torch.compile). Speed itself
is shown by the eager benchmark, not here; these tests keep the work from coming back unnoticed."""

import inspect

import pytest
import torch

import moekit
from moekit import ExpertsLoRA, batched_experts, fused_experts, fused_router, route, router_gemm
from moekit._calls import CheckedCalls
from moekit.experts import api, backends, configs
from moekit.experts import triton_backend  # noqa: F401 - registers the torch.library ops this file replaces

E, H, I, K, T = 6, 32, 16, 2, 5


def _call():
    w13, w2 = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    x, tw = torch.randn(T, H), torch.rand(T, K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    return x, w13, w2, tw, ids


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_repeated_call_decides_nothing_again(monkeypatch, backend):
    selections = []
    monkeypatch.setattr(backends, "_SELECTED", {})                   # what earlier tests asked is forgotten
    monkeypatch.setattr(api, "_VALIDATED", CheckedCalls())
    real = backends._select_auto
    monkeypatch.setattr(backends, "_select_auto", lambda call: selections.append(call) or real(call))
    configs._choose.cache_clear()
    args = _call()
    first = fused_experts(*args, backend=backend)
    for _ in range(3):
        assert torch.equal(fused_experts(*args, backend=backend), first)
    assert len(selections) == (1 if backend == "auto" else 0)          # the oracle asked once for the call's kind
    if backend == "triton":
        assert configs._choose.cache_info().misses == 1                  # the block configuration chosen once
    fused_experts(args[0][:3], *args[1:3], args[3][:3], args[4][:3], backend=backend)   # another kind: asked again
    assert len(selections) == (2 if backend == "auto" else 0)


def test_a_repeated_router_launch_derives_its_shape_once(monkeypatch):
    from moekit.routing import tiers
    from moekit.routing import triton_backend as router_triton

    derived = []
    real = tiers.kernel_config
    monkeypatch.setattr(tiers, "kernel_config", lambda *a: derived.append(a) or real(*a))
    router_triton._router_plan.cache_clear()
    x, w = torch.randn(T, H), torch.randn(E, H)
    first = router_gemm(x, w, tier="triton")
    for _ in range(3):
        assert torch.equal(router_gemm(x, w, tier="triton"), first)
    routes = fused_router(x, w, top_k=K, method="softmax_topk", impl="fused")
    assert torch.equal(fused_router(x, w, top_k=K, method="softmax_topk", impl="fused")[1], routes[1])
    assert len(derived) == 2                                                # the GEMM once, the fused router once
    router_gemm(x[:3], w, tier="triton")                                    # another token count: derived again
    assert len(derived) == 3
    with moekit.batch_invariant():                                          # the mode picks other launch shapes
        router_gemm(x, w, tier="triton")
    assert len(derived) == 4


@pytest.mark.parametrize("impl", ["unfused", "fused"])
def test_a_repeated_fused_router_call_decides_nothing_again(monkeypatch, impl):
    # router_gemm + route (the unfused form) or the fused kernel: the tier, the gate's verdicts and the routing
    # implementation are decided on the first call of a signature only, in either form
    from moekit.routing import router, tiers, topk

    asked = []
    for module, name in ((tiers, "choose_tier"), (topk, "_route_choice"), (router, "_fused_router_choice")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: asked.append(name) or real(*a, **k))
    x, w = torch.randn(T, H), torch.randn(E, H)
    first = fused_router(x, w, top_k=K, method="softmax_topk", impl=impl)
    decided = len(asked)
    assert decided >= 1
    for _ in range(3):
        again = fused_router(x, w, top_k=K, method="softmax_topk", impl=impl)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    assert len(asked) == decided


def test_eager_calls_do_not_go_through_the_custom_ops(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through a torch.library op")

    for op in ("fused_experts_into", "batched_experts_into", "fused_experts_general_into", "batched_experts_general_into",
               "router_gemm_into", "fused_router", "route_triton"):
        monkeypatch.setattr(torch.ops.moekit, op, refuse)
    x, w13, w2, tw, ids = _call()
    fused_experts(x, w13, w2, tw, ids, backend="triton")
    batched_experts(torch.randn(E, 3, H), torch.full((E,), 2, dtype=torch.int32), w13, w2, backend="triton")
    lora = ExpertsLoRA(torch.randn(1, E, 4, H), torch.randn(1, E, 2 * I, 4), torch.randn(1, E, 4, I),
                       torch.randn(1, E, H, 4))
    fused_experts(x, w13, w2, tw, ids, backend="triton", lora=lora, lora_ids=torch.zeros(T, dtype=torch.int32))
    w = torch.randn(E, H)
    router_gemm(x, w, tier="triton")
    fused_router(x, w, top_k=K, method="softmax_topk", impl="fused")
    route(torch.randn(T, E), K, "softmax_topk", impl="triton")


def test_the_oracle_follows_the_gate_and_the_candidates():
    # a cached answer must not outlive what it depended on: a registered backend is seen at once
    from moekit.experts.torch_backend import fused_torch

    args = _call()
    assert backends.select_backend(backends.ExpertsCall.of(args[0], args[1])).name == "torch"
    backends.register(backends.Backend("first", lambda call, explicit: None, "takes everything", fused_torch))
    try:
        assert backends.select_backend(backends.ExpertsCall.of(args[0], args[1])).name == "first"
    finally:
        backends.unregister("first")
    assert backends.select_backend(backends.ExpertsCall.of(args[0], args[1])).name == "torch"


@pytest.mark.parametrize("op", ["fused", "batched"])
def test_a_repeated_experts_call_is_checked_once_per_signature(monkeypatch, op):
    checked = []
    real = api._check_weights
    monkeypatch.setattr(api, "_check_weights", lambda *a: checked.append(1) or real(*a))
    monkeypatch.setattr(api, "_VALIDATED", CheckedCalls())
    x, w13, w2, tw, ids = _call()
    xb, counts = torch.randn(E, 3, H), torch.full((E,), 2, dtype=torch.int32)

    def call(**kw):
        if op == "fused":
            return fused_experts(x, w13, w2, tw, ids, backend="triton", **kw)
        return batched_experts(xb, counts, w13, w2, backend="triton", **kw)

    valid = slice(None) if op == "fused" else (slice(None), slice(0, 2))  # batched: padding rows unspecified
    first = call()[valid]
    for _ in range(3):
        assert torch.equal(call()[valid], first)
    assert len(checked) == 1
    call(activation="swiglu_oai")                                       # another option: checked again
    assert len(checked) == 2
    src = x if op == "fused" else xb
    call(out=torch.empty_like(src))
    with pytest.raises(ValueError, match="overlap"):                    # the same signature, but out is the input:
        call(out=src)                                                   # addresses are checked on every call
    assert len(checked) == 3


def test_a_checked_signature_still_checks_values_and_new_kinds(monkeypatch):
    monkeypatch.setattr(api, "_VALIDATED", CheckedCalls())
    x, w13, w2, tw, ids = _call()
    emap = torch.arange(E, dtype=torch.int32)
    fused_experts(x, w13, w2, tw, ids, expert_map=emap, backend="triton")
    emap[0] = E                                                          # changed in place: read again
    with pytest.raises(ValueError, match="expert_map values"):
        fused_experts(x, w13, w2, tw, ids, expert_map=emap, backend="triton")
    with pytest.raises(TypeError, match="topk_ids"):                    # another dtype: another signature
        fused_experts(x, w13, w2, tw, ids.long(), backend="triton")
    with pytest.raises(TypeError, match="config"):                      # a bad option has no signature
        fused_experts(x, w13, w2, tw, ids, backend="triton", config={"block_m": 16})


def test_a_signature_keys_options_by_type_and_value_and_skips_tensor_options(monkeypatch):
    # a review's cases: an option given as a tensor is read on every call (no signature); True is not 1; -0.0 is
    # not 0.0 (the same bits as a call checked in full)
    from moekit.routing import topk
    logits = torch.randn(T, E)
    renormalized = route(logits, K, "softmax_topk", renormalize=torch.tensor(True), impl="triton")[0]
    plain = route(logits, K, "softmax_topk", renormalize=torch.tensor(False), impl="triton")[0]
    assert torch.allclose(renormalized.sum(-1), torch.ones(T)) and not torch.allclose(plain.sum(-1), torch.ones(T))
    w = torch.randn(E, H)
    fused_router(torch.randn(T, H), w, top_k=K, method="softmax_topk", impl="fused")
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        fused_router(torch.randn(T, H), w, top_k=K, method="softmax_topk", impl="fused", num_groups=True)
    scores = torch.randn(T, E)
    for impl in ("triton", "torch"):
        monkeypatch.setattr(topk, "_CHECKED_ROUTES", CheckedCalls())
        fresh = route(scores, K, "sigmoid_grouped", scaling=-0.0, impl=impl)[0]       # checked in full
        route(scores, K, "sigmoid_grouped", scaling=0.0, impl=impl)
        again = route(scores, K, "sigmoid_grouped", scaling=-0.0, impl=impl)[0]       # after 0.0's signature
        assert torch.equal(again.signbit(), fresh.signbit())


def test_backends_assigned_directly_change_the_registry_version(monkeypatch):
    before = backends.registry_version()
    monkeypatch.setattr(backends, "BACKENDS", tuple(reversed(backends.BACKENDS)))
    assert backends.registry_version() != before


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3"])
def test_the_layers_read_their_tensors_without_module_getattr(monkeypatch, preset):
    """FusedMoE.forward and GateLinear.forward read parameters, buffers and the gate from the module's dicts: a
    lookup through nn.Module.__getattr__ costs about a microsecond of host time per name, per call (biases,
    correction bias, expert map and shared expert included: gpt-oss and deepseek-v3 have them)."""
    from torch import nn

    layer = moekit.FusedMoE.from_preset(preset, dtype=torch.float32, scaled=True)
    x, gate = torch.randn(3, layer.spec.hidden_size), layer.gate
    expected = layer(x)
    looked_up = []
    real = nn.Module.__getattr__
    monkeypatch.setattr(nn.Module, "__getattr__", lambda self, name: looked_up.append(name) or real(self, name))
    with torch.no_grad():
        assert torch.equal(layer(x), expected)
        gate(x)
    assert looked_up == []


@pytest.mark.parametrize("mode", ["gemv", "aligned"])
def test_the_expert_kernels_get_their_constants_made_once(monkeypatch, mode):
    """GEMV1/GEMV2 (decode) and GEMM1/GEMM2 (aligned) take their constexprs and launch options as one Constants per
    kind of call (hashed once), made on the first call of that kind: the launcher keys a repeated launch without
    rebuilding a dozen keywords."""
    from moekit._launch import Constants, Launcher
    from moekit.experts import ExpertsConfig, GemmConfig
    from moekit.experts import triton_backend as tb

    config = ExpertsConfig(16, GemmConfig(16, 32, 4, 1), GemmConfig(8, 32, 4, 1), mode=mode)
    makers = {"gemv": {"gemv1_act_kernel": tb._gemv1_constants, "gemv2_tokens_kernel": tb._gemv2_constants},
              "aligned": {"gemm1_act_kernel": tb._gemm1_constants, "gemm2_kernel": tb._gemm2_constants}}[mode]
    kinds = {}
    real = Launcher.launch
    monkeypatch.setattr(Launcher, "launch", lambda self, grid, args, kwargs: kinds.setdefault(
        self.__name__, []).append(type(kwargs)) or real(self, grid, args, kwargs))
    for make in makers.values():
        make.cache_clear()
    x, w13, w2, tw, ids = _call()
    first = fused_experts(x, w13, w2, tw, ids, backend="triton", config=config)
    for _ in range(2):
        assert torch.equal(fused_experts(x, w13, w2, tw, ids, backend="triton", config=config), first)
    for kernel, make in makers.items():
        assert kinds[kernel] == [Constants] * 3 and make.cache_info().misses == 1


@pytest.mark.parametrize("extra", [[], ["--gpu-path"]])  # --gpu-path: the ops' GPU path, in a process of its own
def test_the_host_path_benchmark_runs_and_puts_the_layers_back(tmp_path, monkeypatch, extra):
    """benchmarks/host_path.py (the host work with kernels taken out) on a few calls: it writes its table and JSON
    and leaves the stubbed functions as they were."""
    import runpy
    import sys
    from pathlib import Path

    from moekit import _launch, layer

    before = (layer.fused_router, layer.fused_experts, _launch.Launcher.launch)
    script = Path(__file__).resolve().parents[1] / "benchmarks/host_path.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--calls", "5", "--label", "test", "--out", str(tmp_path), *extra])
    runpy.run_path(str(script), run_name="__main__")
    assert (layer.fused_router, layer.fused_experts, _launch.Launcher.launch) == before
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".md"]


class _Param:
    def __init__(self, p):
        self.name, self.default = p.name, p.default
        self.has_default = p.default is not inspect.Parameter.empty


class _RecordingKernel:
    """A kernel the Launcher takes for a compiled one (params, device_caches) that records its launches instead of
    running: Triton's path as ("triton", args), the bound compiled kernel's as ("bound", args)."""

    device_caches: dict = {}

    def __init__(self, kernel, log):
        self.params = [_Param(p) for p in inspect.signature(kernel.fn).parameters.values()]
        self.log, self.name = log, kernel.fn.__name__
        self.function, self.packed_metadata = "fn", "meta"

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, "triton", (tuple(grid), *args)))
            return self
        return launch

    def run(self, g0, g1, g2, stream, function, meta, *rest):
        self.log.append((self.name, "bound", ((g0, g1, g2), *rest[3:][:len(self.params)])))


@pytest.fixture
def recording_decode(monkeypatch):
    """The decode kernels as recording fakes the Launcher binds (on a pretend device 0, stream 7), fused_experts'
    decisions forgotten, and DecodePlan's verdicts kept: (launch log, verdicts)."""
    from moekit import _launch
    from moekit.experts import triton_backend as tb

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    # the bound launches pass the tensors themselves, not their addresses, so the log shows which tensor went where
    monkeypatch.setattr(_launch, "_TENSORS_AS_ADDRESSES", False)
    monkeypatch.setattr(_launch, "_KEY_FUNCTIONS", {})
    monkeypatch.setattr(_launch, "_ADDRESSES_FUNCTIONS", {})
    log = []
    for name in ("gemv1_act_kernel", "gemv1_rows_kernel", "gemv2_tokens_kernel", "gemv2_rows_kernel",
                 "scaled_fp16_kernel", "gemm1_act_kernel", "gemm2_tokens_kernel", "align_kernel", "gemm2_kernel",
                 "combine_kernel"):
        monkeypatch.setattr(tb, name, _launch.Launcher(_RecordingKernel(getattr(tb, name).fn, log)))
    monkeypatch.setattr(api, "_VALIDATED", CheckedCalls())
    served = []
    for kind in (tb.DecodePlan, tb.CallPlan, tb.BatchedPlan):
        monkeypatch.setattr(kind, "__call__", lambda self, *a, real=kind.__call__: served.append(real(self, *a))
                            or served[-1])
    return log, served


def _same_launches(planned: list, full: list, given: tuple) -> None:
    """A plan's recorded launches against the full path's on the same inputs (``given``: the caller's tensors, or
    None): the same grids and scalars; the caller's tensors themselves; the call's buffers alike (shape, strides,
    dtype), one of the plan's for each of the full path's (what a launch writes, the next reads)."""
    given = {t.data_ptr() for t in given if isinstance(t, torch.Tensor)}
    fwd, bwd = {}, {}
    for (_, _, got), (_, _, want) in zip(planned, full, strict=True):
        assert len(got) == len(want) and got[0] == want[0]  # the grid, then the arguments
        for g, w in zip(got[1:], want[1:]):
            if isinstance(w, torch.Tensor):
                assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
                assert (g.data_ptr() == w.data_ptr()) == (w.data_ptr() in given)
                assert fwd.setdefault(g.data_ptr(), w.data_ptr()) == w.data_ptr()
                assert bwd.setdefault(w.data_ptr(), g.data_ptr()) == g.data_ptr()
            else:
                assert g == w


@pytest.mark.parametrize("mode, weights, gemm2_packed", [
    ("gemv", "dense", None),      # x and h as they are
    ("gemv", "mxfp4", None),      # 4-bit: x packed by scaled_fp16 before GEMV1 (a launch of its own)
    ("gemv", "mxfp4", True),      # and h before GEMV2 (its loop per slot)
    ("rows", "nvfp4", None),      # GEMV1 on the row-scaled kernel (GemmConfig.row_scaled: x scaled inside it)
    ("per_pair", "dense", None),  # the tensor-core GEMMs per pair (CallPlan)
    ("per_pair-split", "dense", None),  # GEMM2 per pair into the aligned mode's buffer, then the combine
    ("per_pair-split-words", "mxfp4", None),  # and GEMM1 writing h in paired order for the word-decoded GEMM2
    ("per_pair", "nvfp4", None),  # 4-bit: scales and global scales among the arguments
    ("aligned", "dense", None),   # align, GEMM1, GEMM2, combine (CallPlan): four launches, five buffers
    ("aligned", "mxfp4", None),   # 4-bit, no global scale
    ("aligned-words", "mxfp4", None),   # the GPU's word-decoded 4-bit tiles: x's paired copy, h in paired order
    ("per_pair-words", "nvfp4", None),
    ("gemv-split", "mxfp4", None),      # GEMV2 per pair into fp32 rows (split_slots), then the combine
    ("rows-split", "nvfp4", None),      # both GEMVs on the rows kernels: GEMV2 per pair on gemv2_rows
])
def test_a_repeated_decode_call_runs_its_plan_with_the_full_paths_launch_arguments(recording_decode, monkeypatch,
                                                                                  mode, weights, gemm2_packed):
    # GEMV1 + GEMV2 or the per-pair GEMMs (the decode paths): the first call of a signature launches through the full
    # path and keeps a plan of its launches; the next calls run the plan, which must launch what the full path would,
    # argument for argument. On the CPU the kernels are interpreted (never bound), so recording fakes stand in for
    # compiled ones.
    from moekit.experts import ExpertsConfig, GemmConfig
    from moekit.experts import triton_backend as tb
    from moekit.formats import quantize_experts, to_parts

    log, served = recording_decode
    words, split = "-words" in mode, "-split" in mode
    if words:  # bf16 on a GPU only: the decision as the GPU makes it, the kernels recorded
        monkeypatch.setattr(tb, "_w4_words", lambda w, dtype: w.format in ("mxfp4", "nvfp4") and tb._on_words(w.data))
    mode = mode.removesuffix("-words").removesuffix("-split")
    gemm1 = GemmConfig(8, 64, 4, 3, row_scaled=True) if mode == "rows" else GemmConfig(16, 64, 4, 1)
    gemm2 = (GemmConfig(16, 64, 4, 2, row_scaled=True) if mode == "rows" and split else
             GemmConfig(16, 64, 4, 1, slots=0 if gemm2_packed else None, packed=gemm2_packed))
    config = ExpertsConfig(16, gemm1, gemm2, mode="gemv" if mode == "rows" else mode, split_slots=split)
    hid, inter = 64, 64  # 4-bit K a multiple of 32
    w13, w2 = torch.randn(E, 2 * inter, hid).half(), torch.randn(E, hid, inter).half()
    if weights != "dense":
        w13, w2 = quantize_experts(w13.float(), weights), quantize_experts(w2.float(), weights)
    b13, b2 = torch.randn(E, 2 * inter), torch.randn(E, hid)
    kernels = {"gemv": ["gemv1_act_kernel", "gemv2_tokens_kernel"],
               "rows": ["gemv1_rows_kernel", "gemv2_tokens_kernel"],
               "per_pair": ["gemm1_act_kernel", "gemm2_tokens_kernel"],
               "aligned": ["align_kernel", "gemm1_act_kernel", "gemm2_kernel", "combine_kernel"]}[mode]
    if split:
        kernels = [kernels[0], {"rows": "gemv2_rows_kernel", "per_pair": "gemm2_kernel"}.get(mode, kernels[1]),
                   "combine_kernel"]
    if weights != "dense" and mode == "gemv":
        kernels.insert(0, "scaled_fp16_kernel")
    if gemm2_packed:
        kernels.insert(2, "scaled_fp16_kernel")

    def call(x, tw, ids, emap):
        return fused_experts(x, w13, w2, tw, ids, w13_bias=b13, w2_bias=b2, expert_map=emap, backend="triton",
                             config=config)

    for emap in (None, torch.arange(E, dtype=torch.int32)):   # an expert map adds a launch argument
        for t in (1, 3):
            x, tw = torch.randn(t, hid).half(), torch.rand(t, K)
            ids = torch.stack([torch.randperm(E)[:K] for _ in range(t)]).int()
            call(x, tw, ids, emap)                                # the full path; its launches bound and planned
            del log[:]
            x2, tw2, ids2 = torch.randn_like(x), torch.rand_like(tw), ids.flip(0).contiguous()
            out = call(x2, tw2, ids2, emap)                       # the plan
            assert served == [True]
            served.clear()
            planned = list(log)
            del log[:]
            tb.fused_experts_into(out, x2, w13, w2, tw2, ids2, "silu_and_mul", b13, b2, emap,
                                  config)                         # the full path on the same inputs, bound
            assert [(n, k) for n, k, _ in planned] == [(n, "bound") for n in kernels]
            assert [(n, k) for n, k, _ in log] == [(n, "bound") for n in kernels]
            _same_launches(planned, log, (x2, out, tw2, ids2, b13, b2, emap, *to_parts(w13)[1:4],
                                          *to_parts(w2)[1:4]))
            del log[:]
            odd = torch.randn(t * hid + 1).half()[1:].view(t, hid)   # the same signature, 2 bytes off alignment
            call(odd, tw2, ids2, emap)
            # refused before anything launched, then the full path; the aligned path's first launch (align) does not
            # read x: the plan runs it, and GEMM1 goes through its Launcher (a binding of its own); word-decoded
            # tiles read x's paired copy (a fresh buffer): the plan holds
            assert served == [mode == "aligned" or words] and [n for n, _, _ in log] == kernels
            served.clear()
            del log[:]
            if weights != "dense" and mode == "gemv":  # x packed by the plan, then GEMV1 refuses (its bias off
                odd_b13 = torch.randn(E * 2 * inter + 1)[1:].view(E, 2 * inter)  # alignment): in full from there
                fused_experts(x2, w13, w2, tw2, ids2, w13_bias=odd_b13, w2_bias=b2, expert_map=emap, backend="triton",
                              config=config)
                assert served == [True] and [n for n, _, _ in log] == ["scaled_fp16_kernel", *kernels]
                served.clear()
                del log[:]


@pytest.mark.parametrize("weights, words", [
    ("dense", False),   # two GEMMs over [E, M] rows
    ("nvfp4", False),   # 4-bit: scales and global scales among the arguments
    ("mxfp4", True),    # word-decoded tiles: GEMM1 reads x's paired copy (a buffer of the call), h paired for GEMM2
])
def test_a_repeated_batched_call_runs_its_plan_with_the_full_paths_launch_arguments(recording_decode, monkeypatch,
                                                                                    weights, words):
    # batched_experts (no adapters): the first call of a signature launches in full and keeps a BatchedPlan; the next
    # calls run it, which must launch what the full path would, argument for argument (as the decode plans above)
    from moekit.experts import ExpertsConfig, GemmConfig
    from moekit.experts import triton_backend as tb
    from moekit.formats import quantize_experts, to_parts

    log, served = recording_decode
    if words:
        monkeypatch.setattr(tb, "_w4_words", lambda w, dtype: w.format in ("mxfp4", "nvfp4") and tb._on_words(w.data))
    config = ExpertsConfig(16, GemmConfig(32, 64, 4, 2), GemmConfig(32, 64, 4, 2))
    hid, inter, M = 64, 64, 5
    w13, w2 = torch.randn(E, 2 * inter, hid).half(), torch.randn(E, hid, inter).half()
    if weights != "dense":
        w13, w2 = quantize_experts(w13.float(), weights), quantize_experts(w2.float(), weights)
    b13, b2 = torch.randn(E, 2 * inter), torch.randn(E, hid)

    def call(xb, counts):
        return batched_experts(xb, counts, w13, w2, w13_bias=b13, w2_bias=b2, backend="triton", config=config)

    xb, counts = torch.randn(E, M, hid).half(), torch.randint(0, M + 1, (E,), dtype=torch.int32)
    call(xb, counts)                                          # the full path; its launches bound and planned
    del log[:]
    x2, counts2 = torch.randn_like(xb), counts.flip(0).contiguous()
    out = call(x2, counts2)                                   # the plan
    assert served == [True]
    served.clear()
    planned = list(log)
    del log[:]
    tb.batched_experts_into(out, x2, counts2, w13, w2, "silu_and_mul", b13, b2, config)  # the full path, bound
    assert [(n, k) for n, k, _ in planned] == [(n, k) for n, k, _ in log] == [
        ("gemm1_act_kernel", "bound"), ("gemm2_kernel", "bound")]
    _same_launches(planned, log, (x2, out, counts2, b13, b2, *to_parts(w13)[1:4], *to_parts(w2)[1:4]))
    del log[:]
    odd = torch.randn(E * M * hid + 1).half()[1:].view(E, M, hid)  # the same signature, 2 bytes off alignment
    call(odd, counts2)
    # GEMM1 reads x itself: refused before anything launched, then the full path; word-decoded tiles read x's paired
    # copy (a fresh buffer): the plan holds
    assert served == [words] and [n for n, _, _ in log] == ["gemm1_act_kernel", "gemm2_kernel"]


def test_a_decode_plan_refuses_a_4bit_stack_whose_words_are_laid_out_otherwise(recording_decode):
    # A 4-bit stack's codes go to the GEMVs as int32 words: a view of its bytes, or a copy with other strides where
    # its offset is not a whole word. Two stacks of one signature (shapes, strides) may take either: the plan made
    # for one must not launch the other with the first one's strides.
    from moekit.experts import ExpertsConfig, GemmConfig
    from moekit.formats import nvfp4, quantize_experts

    log, served = recording_decode
    hid, inter = 128, 64
    q13 = quantize_experts(torch.randn(E, 2 * inter, hid), "nvfp4")
    w2 = quantize_experts(torch.randn(E, hid, inter), "nvfp4")
    base = torch.zeros(E * 2 * inter * 72 + 32, dtype=torch.uint8)

    def stack(offset):  # rows padded to 72 bytes, at ``offset``: a whole word (16) or not (1)
        data = base[offset:offset + E * 2 * inter * 72].view(E, 2 * inter, 72)[:, :, :hid // 2]
        data.copy_(q13.data)
        return nvfp4.NVFP4Tensor(data, q13.scales, q13.global_scale, (E, 2 * inter, hid))

    config = ExpertsConfig(16, GemmConfig(16, 64, 4, 1), GemmConfig(16, 64, 4, 1), mode="gemv")
    x, tw = torch.randn(1, hid).half(), torch.rand(1, K)
    ids = torch.randperm(E)[:K].int()[None]
    for w13 in (stack(16), stack(16)):                                  # words as a view: planned, then served
        fused_experts(x, w13, w2, tw, ids, backend="triton", config=config)
    assert served == [True]
    fused_experts(x, stack(1), w2, tw, ids, backend="triton", config=config)  # words copied: other strides
    assert served == [True, False]


def test_a_call_whose_config_asks_for_tma_boxes_keeps_no_plan(recording_decode):
    # Whether a stack's tiles load as TMA boxes depends on its address, which the call signature does not hold: a
    # plan made on a stack that could not take them would replay without them where the full path takes them.
    from moekit.experts import ExpertsConfig, GemmConfig

    log, served = recording_decode
    hid, inter = 64, 64
    w13, w2 = torch.randn(E, 2 * inter, hid).half(), torch.randn(E, hid, inter).half()
    for mode in ("per_pair", "aligned"):
        config = ExpertsConfig(16, GemmConfig(16, 64, 4, 1, tma=True), GemmConfig(16, 64, 4, 1), mode=mode)
        x, tw = torch.randn(3, hid).half(), torch.rand(3, K)
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(3)]).int()
        for _ in range(3):
            fused_experts(x, w13, w2, tw, ids, backend="triton", config=config)
        assert served == [] and log  # launched in full every time
    del log[:]
    config = ExpertsConfig(16, GemmConfig(16, 64, 4, 1), GemmConfig(16, 64, 4, 1, tma=True))  # the batched format
    xb, counts = torch.randn(E, 4, hid).half(), torch.full((E,), 3, dtype=torch.int32)
    for _ in range(3):
        batched_experts(xb, counts, w13, w2, backend="triton", config=config)
    assert served == [] and len(log) == 6


def test_a_contiguous_4bit_stack_at_an_odd_byte_offset_runs_on_the_decode_kernels():
    # Its codes cannot be viewed as int32 words, and .contiguous() is the stack itself: the GEMVs take a fresh copy
    from moekit import reference
    from moekit.experts import ExpertsConfig, GemmConfig
    from moekit.formats import from_parts, quantize_experts, to_parts

    hid, inter = 64, 32
    q13, w2 = quantize_experts(torch.randn(E, 2 * inter, hid), "mxfp4"), quantize_experts(torch.randn(E, hid, inter),
                                                                                         "mxfp4")
    fmt, data, scales, gs, tag, shape = to_parts(q13)
    odd = torch.zeros(data.numel() + 1, dtype=torch.uint8)[1:].view(data.shape)
    odd.copy_(data)
    w13 = from_parts(fmt, odd, scales, gs, tag, shape)
    x, tw = torch.randn(2, hid).half(), torch.rand(2, K)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(2)]).int()
    config = ExpertsConfig(16, GemmConfig(16, 64, 4, 1), GemmConfig(16, 32, 4, 1), mode="gemv")
    got = fused_experts(x, w13, w2, tw, ids, backend="triton", config=config)
    want = reference.fused_experts(x, w13, w2, tw, ids)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


def test_a_signature_with_an_unhashable_part_is_never_kept():
    # signatures are hashed by the lookups alone; one holding an unhashable argument (which the checks then refuse)
    # is neither found nor kept
    calls = CheckedCalls()
    key = CheckedCalls.signature((torch.empty(2),), ())
    calls.put(key, "decision")
    assert calls.get(key) == "decision"
    unhashable = (*key, ["a list"])
    calls.put(unhashable, "other")
    assert calls.get(unhashable) is None
