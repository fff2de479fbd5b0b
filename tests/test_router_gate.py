"""The verification gate on the router's fast paths: a broken Triton router GEMM, fused router or
routing kernel that would serve an automatic call is caught by its first-call check, disabled
with a warning, and the call is served by the fallback (here on the CPU: plain torch). The real
kernels (through the interpreter) pass. The auto decisions are forced to the fast paths, as they
would be on a GPU."""

import pytest
import torch

import moekit

from moekit import reference
from moekit.routing import router, topk as routing, triton_backend
from moekit.routing import tiers as router_tiers
from moekit.routing.router import fused_router, router_gemm
from moekit import gate
from moekit.metrics import Tolerance, check_close


@pytest.fixture
def fast_paths(monkeypatch):
    """auto picks the Triton GEMM, the fused router and the Triton routing kernel, as on a GPU."""
    choose = router_tiers.choose_tier

    def choose_triton(num_tokens, hidden, num_experts, device, tier="auto"):
        return router_tiers.TierChoice("triton", "forced") if tier == "auto" else choose(
            num_tokens, hidden, num_experts, device, tier)

    monkeypatch.setattr(router_tiers, "choose_tier", choose_triton)
    monkeypatch.setattr(router_tiers, "fused_applies", lambda *a: True)
    monkeypatch.setattr(routing, "_triton_serves_auto", lambda logits, correction_bias=None: True)
    gate.reset()
    gate.set_verification(True)
    yield monkeypatch
    gate.set_verification(False)
    gate.reset()


def _gemm_case(T=5, H=48, E=12):
    x = torch.randn(T, H + 3)[:, 3:]
    w = torch.randn(E, H) * H ** -0.5
    b = torch.randn(E)
    return x, w, b, reference.router_logits(x, w, b)


def _bf16_logits(args, out2, prepare=False):      # the reverted gpt-oss small-batch kernel
    out2.copy_((args.x.float() @ args.weight.float().T + args.bias.float()).bfloat16())


def _ignores_row_stride(args, out2, prepare=False):
    x = args.x.as_strided(args.x.shape, (args.x.shape[1], 1))
    out2.copy_(x.float() @ args.weight.float().T + args.bias.float())


def _drops_bias(args, out2, prepare=False):
    out2.copy_(args.x.float() @ args.weight.float().T)


@pytest.mark.parametrize("broken", [_bf16_logits, _ignores_row_stride, _drops_bias])
def test_a_broken_router_gemm_is_disabled(fast_paths, broken):
    fast_paths.setitem(router._RUNNERS, "triton", broken)
    x, w, b, ref = _gemm_case()
    with pytest.warns(RuntimeWarning, match="'triton router GEMM' failed its accuracy check"):
        got = router_gemm(x, w, b)
    check_close("served by torch", got, ref, Tolerance(1e-5, 1e-6))
    gate.set_verification(False)                       # without the gate the broken kernel serves
    with pytest.raises(AssertionError):
        check_close("ungated", router_gemm(x, w, b), ref, Tolerance(1e-5, 1e-6))


def test_the_real_router_kernels_pass_and_are_checked_once_per_kernel_config(fast_paths):
    x, w, b, ref = _gemm_case(T=5)
    for T in (1, 5, 7):                                # the same kernel config as 5 except T=1 (one token a tile)
        router_gemm(x[:T], w, b)
    tiles = sorted(k[-1].block_t for k in gate.results())
    assert tiles == [1, 16] and all(v[0] for v in gate.results().values())
    tw, tid = fused_router(x, w, b, top_k=3, method="softmax_topk")
    ref_w, ref_ids = reference.route(ref, 3, "softmax_topk")
    assert torch.equal(tid.long().sort(1).values, ref_ids.sort(1).values)
    routing.route(torch.randn(9, 12), 3, "sigmoid_grouped", num_groups=4, topk_groups=2)
    assert len(gate.results()) == 4 and all(v[0] for v in gate.results().values())


def test_a_broken_fused_router_is_disabled(fast_paths):
    launch = triton_backend.launch_router

    def drops_bias(x, weight, bias, lora, *, routing=None, **kw):   # routes from the logits without the router bias
        return launch(x, weight, bias if routing is None else None, lora, routing=routing, **kw)

    fast_paths.setattr(triton_backend, "launch_router", drops_bias)
    x, w, b, ref = _gemm_case(T=9, E=16)
    b = b * 3
    with pytest.warns(RuntimeWarning, match="'fused router' failed its accuracy check"):
        tw, tid = fused_router(x, w, b, top_k=4, method="topk_softmax")
    ref_w, ref_ids = reference.route(reference.router_logits(x, w, b), 4, "topk_softmax")
    assert torch.equal(tid.long().sort(1).values, ref_ids.sort(1).values)   # the unfused path served


def test_a_routing_kernel_on_bf16_scores_is_disabled(fast_paths):
    real = triton_backend.route_triton

    def bf16_scores(logits, opts, corr):               # near-tied choices flip in bf16
        return real(logits.bfloat16().float(), opts, corr)

    fast_paths.setattr(triton_backend, "route_triton", bf16_scores)
    logits = torch.randn(20, 32)
    with pytest.warns(RuntimeWarning, match="'triton routing' failed its accuracy check"):
        tw, tid = routing.route(logits, 4, "softmax_topk")
    ref_w, ref_ids = reference.route(logits.double(), 4, "softmax_topk")
    assert torch.equal(tid.long().sort(1).values, ref_ids.sort(1).values)


@pytest.mark.gpu
def test_gpu_gate_checks_the_real_router_paths_and_falls_back_to_cublas(monkeypatch):
    gate.reset()
    gate.set_verification(True)
    try:
        E, H = 128, 2880                                            # gpt-oss-120b's router
        w = (torch.randn(E, H, device="cuda") * H ** -0.5).bfloat16()
        b = torch.randn(E, device="cuda")
        for T in (1, 9, 33):
            x = torch.randn(T, H, device="cuda").bfloat16()
            router_gemm(x, w, b)
            fused_router(x, w, b, top_k=4, method="topk_softmax")
        assert gate.results() and all(v[0] for v in gate.results().values()), gate.results()
        gate.reset()
        monkeypatch.setitem(router._RUNNERS, "triton", _bf16_logits)
        x = torch.randn(2, H, device="cuda").bfloat16()
        with pytest.warns(RuntimeWarning, match="'triton router GEMM' failed"):
            got = router_gemm(x, w, b)
        check_close("cuBLAS served", got, reference.router_logits(x, w, b), Tolerance(1e-4, 1e-5))
    finally:
        gate.set_verification(False)
        gate.reset()


@pytest.mark.gpu
def test_gpu_gate_refuses_to_check_inside_a_graph_capture():
    gate.reset()
    gate.set_verification(True)
    try:
        E, H = 128, 2880                        # a shape the Triton tier serves (a tiny one goes to cuBLAS, unchecked)
        w = (torch.randn(E, H, device="cuda") * H ** -0.5).bfloat16()
        x = torch.randn(3, H, device="cuda").bfloat16()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="run one eager call of this shape first"):
            with torch.cuda.graph(graph):
                router_gemm(x, w)
        torch.cuda.synchronize()
        gate.reset()
        ref = router_gemm(x, w)                                     # eager: checked here
        out = torch.empty_like(ref)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(router_gemm(x, w))
        graph.replay()
        assert torch.equal(out, ref)
    finally:
        gate.set_verification(False)
        gate.reset()


def test_the_gemm_check_runs_the_kernel_config_of_the_call():
    # the check ran one token count per regime (T=2 for every decode call, whose T=1 compiles another token tile and K
    # step; T=289 for every large call, whose batch-invariant configs fold their K splits): now the call's own config,
    # at the call's own T (and a partial tile of it)
    from moekit.routing import gate_case

    weight = torch.randn(16, 512)
    for invariant in (False, True):
        with moekit.batch_invariant(invariant):
            for T in (1, 2, 3, 9, 16, 17, 128, 129, 256, 4096):
                config, sizes = gate_case._kernel_case(T, weight, 0, False)
                assert sizes[0] == T and config == router_tiers.kernel_config(T, 512, 16, 0, False, 4, True)
                assert all(router_tiers.kernel_config(n, 512, 16, 0, False, 4, True) == config for n in sizes)
                assert any(n % config.block_t for n in sizes) or len(sizes) == 1


@pytest.mark.filterwarnings("ignore:moekit. backend 'triton routing' failed its accuracy check:RuntimeWarning")
def test_a_routing_kernel_ranking_fp16_scores_is_refused(fast_paths):
    # the planted near ties sat a bf16 step apart only: a kernel ranking fp16-rounded scores passed
    from moekit.routing import gate_case
    from moekit.routing.options import RoutingOptions

    def route_fp16(logits, opts, corr, impl="auto"):
        _, ids = reference.route(logits.half().double(), opts.top_k, opts.method, renormalize=opts.renormalize)
        return torch.softmax(logits.double().gather(1, ids), 1).float(), ids.int()

    opts = RoutingOptions(8, "softmax_topk", True, 1, 1, 1.0)
    assert "failed the verification gate" in gate_case.route_refusal(torch.randn(4, 128), None, opts, route_fp16)


def test_a_correct_router_gemm_with_narrow_logits_passes_and_bias_dtypes_are_their_own_class(fast_paths):
    # fp16 logits were compared with float64 at the fp32 budget: a correct kernel failed and was disabled; a kernel
    # right for fp32 biases and wrong for fp16 ones shared their verdict
    from moekit import gate
    from moekit.routing import GateLinear

    gate.reset()
    gate.set_verification(True)
    try:
        g = GateLinear(64, 8, bias=True, params_dtype=torch.float16, out_dtype=torch.float16)
        with torch.no_grad():
            g(torch.randn(5, 64, dtype=torch.float16))
        verdicts = {k: v for k, v in gate.results().items() if k[0] == "router_gemm:triton"}
        assert verdicts and all(passed for passed, _ in verdicts.values()), verdicts
        x, w = torch.randn(5, 32), torch.randn(8, 32)
        for bias in (torch.randn(8), torch.randn(8).half()):
            fused_router(x, w, bias, top_k=2, method="topk_softmax")
        fused = [k for k in gate.results() if k[0] == "fused_router:fused"]
        assert len(fused) == 2 and {k[4] for k in fused} == {torch.float32, torch.float16}
    finally:
        gate.set_verification(False)
        gate.reset()
