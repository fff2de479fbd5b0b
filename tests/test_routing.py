"""moekit.route against the float64 reference: Triton kernel (interpreter on CPU, real on GPU) and torch."""

import pytest
import torch

import moekit
from moekit import _triton, reference
from moekit.metrics import routes_agree, separable_tokens

TOKENS = [0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129]

# (method, kwargs, E, k, why)
CASES = [
    ("softmax_topk", dict(renormalize=True), 8, 2, "Mixtral"),
    ("softmax_topk", dict(renormalize=False), 13, 6, "prime E, k=6, unnormalized (Qwen2-MoE)"),
    ("topk_softmax", {}, 32, 4, "gpt-oss-20b"),
    ("sigmoid_top1", {}, 5, 1, "Llama-4 top-1"),
    ("sigmoid_grouped", dict(num_groups=8, topk_groups=4, scaling=2.5), 32, 8, "DeepSeek-V3 structure, scaled"),
    ("sigmoid_grouped", dict(num_groups=1, topk_groups=1, scaling=2.827), 24, 8, "Kimi-K2 structure (one group, E not 2^n)"),
    ("sigmoid_grouped", dict(num_groups=3, topk_groups=2, renormalize=False), 21, 6, "group size 7, odd G"),
]
IMPLS = ["triton", "torch"]


def _corr_bias(method, E, device="cpu"):
    return torch.randn(E, device=device) * 0.05 if method == "sigmoid_grouped" else None


def _check(logits, k, method, kwargs, impl, corr_bias=None):
    w, ids = moekit.route(logits, k, method, correction_bias=corr_bias, impl=impl, **kwargs)
    rw, rids = reference.route(logits, k, method, correction_bias=corr_bias, **kwargs)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert w.shape == ids.shape == (logits.shape[0], k)
    assert torch.equal(ids.long().cpu(), rids.cpu()), "ids differ from the float64 reference"
    finite = torch.isfinite(rw)
    assert torch.equal(torch.isnan(w.cpu()), torch.isnan(rw.cpu())), "NaN weights differ"
    torch.testing.assert_close(w.double()[finite], rw[finite], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method,kwargs,E,k,why", CASES)
def test_route_matches_reference(impl, method, kwargs, E, k, why):
    for T in TOKENS:
        _check(torch.randn(T, E), k, method, kwargs, impl, _corr_bias(method, E))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # GPU max() treats NaN unlike numpy's


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method,kwargs,E,k,why", CASES)
def test_route_on_nan_inf_and_ties(device, impl, method, kwargs, E, k, why):
    logits = torch.randn(12, E, device=device)
    logits[0, 1] = float("nan")            # one NaN expert: never preferred
    logits[1] = float("nan")               # all NaN: ids still in [0, E)
    logits[2, 0] = float("inf")
    logits[3] = float("-inf")
    logits[4] = 0.5                        # all tied: lowest ids win
    logits[5, ::2] = logits[5, 1]          # partial ties
    logits[6, -1] = float("-inf")
    _check(logits, k, method, kwargs, impl, _corr_bias(method, E, device))
    w, ids = moekit.route(logits, k, method, correction_bias=_corr_bias(method, E, device), impl=impl, **kwargs)
    assert ids.min() >= 0 and ids.max() < E


@pytest.mark.parametrize("impl", IMPLS)
def test_route_strided_offset_and_low_precision_logits(impl):
    base = torch.randn(40, 50)
    strided = base[3:30:2, 5:37]           # row stride 100, offset, E=32
    _check(strided, 4, "topk_softmax", {}, impl)
    transposed = torch.randn(32, 9).T      # column-major
    _check(transposed, 4, "softmax_topk", dict(renormalize=False), impl)
    _check(torch.randn(17, 32).half(), 3, "softmax_topk", {}, impl)
    strided_bias = torch.randn(64)[::2] * 0.05
    _check(torch.randn(9, 32), 4, "sigmoid_grouped", dict(num_groups=4, topk_groups=2), impl, strided_bias)


@pytest.mark.parametrize("impl", IMPLS)
def test_route_near_ties_resolve_like_float64(impl):
    # Gaps of ~1e-6 survive fp32 but not bf16: the fast path must agree with float64.
    T, E, k = 64, 32, 4
    logits = torch.randn(T, E, dtype=torch.float64)
    logits[:, 1] = logits[:, 0] + 1e-6 * torch.sign(torch.randn(T, dtype=torch.float64))
    w, ids = moekit.route(logits.float(), k, "topk_softmax", impl=impl)
    rw, rids = reference.route(logits.float(), k, "topk_softmax")
    agree, werr = routes_agree(w, ids, rw, rids)
    assert agree == 1.0 and werr < 1e-6


def test_float64_logits_route_in_float64():
    # the kernel works in float32: a 1e-9 gap vanished (another expert), 1e39 became inf (NaN weights)
    near = torch.tensor([[3.0, 3.0 + 1e-9, 0.0]], dtype=torch.float64)
    big = torch.tensor([[1e39, 0.0, -1.0]], dtype=torch.float64)
    assert moekit.route(near, 1, "softmax_topk")[1].tolist() == [[1]]
    assert moekit.route(big, 2, "topk_softmax")[0].tolist() == [[1.0, 0.0]]
    if _triton.can_launch(near.device):
        with pytest.raises(TypeError, match="impl='triton' ranks and weighs in float32"):
            moekit.route(near, 1, "softmax_topk", impl="triton")
    if torch.cuda.is_available():  # "auto" on CUDA: the torch path
        assert moekit.route(near.cuda(), 1, "softmax_topk")[1].tolist() == [[1]]


def test_a_float64_correction_bias_routes_in_float64_in_the_fused_router_too():
    # fused_router's one-launch kernel loaded it as float32: a 1e-9 gap picked another expert than route did, and in
    # batch-invariant mode a token's experts then changed with the batch (fused alone, unfused in a large batch)
    E, H = 8, 16
    x, w = torch.zeros(1, H), torch.randn(E, H)
    corr = torch.full((E,), 0.1, dtype=torch.float64)
    corr[1] += 1e-9
    kw = dict(top_k=1, method="sigmoid_grouped", correction_bias=corr)
    for impl in ("auto", "unfused"):
        assert moekit.fused_router(x, w, impl=impl, **kw)[1].tolist() == [[1]]
    if _triton.can_launch(x.device):
        with pytest.raises(TypeError, match="impl='fused' selects experts in float32"):
            moekit.fused_router(x, w, impl="fused", **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_sigmoid_grouped_renormalizes_scores_that_underflow(impl):
    # fp32 sigmoid of a logit below about -88 is 0: the kernel's renormalized weights were 0 / 0 = NaN (the float64
    # reference resolves them: ratios of exp(logit)); below about -745 float64's sigmoids underflow too, and the
    # reference takes the same limit where it gave NaN (ids: every score ties at 0, the lowest win)
    lg = torch.tensor([[-100.0, -101.0, -102.0, -103.0], [-1000.0, -1001.0, 5.0, 3.0], [0.5, -0.3, 1.2, 2.0],
                       [-1000.0, -1000.5, -999.0, -1003.0]])
    w, ids = moekit.route(lg, 2, "sigmoid_grouped", impl=impl, scaling=2.5)
    ref_w, ref_ids = reference.route(lg.double(), 2, "sigmoid_grouped", scaling=2.5)
    assert torch.equal(ids.long(), ref_ids) and torch.allclose(w.double(), ref_w, rtol=1e-6, atol=1e-6)
    assert ref_ids[3].tolist() == [0, 1] and ref_w[3].isfinite().all()


def test_every_token_on_one_expert():
    logits = torch.randn(20, 8)
    logits[:, 3] += 100
    _, ids = moekit.route(logits, 2, "softmax_topk", impl="triton")
    assert (ids[:, 0] == 3).all()


@pytest.mark.parametrize("bad,kwargs,err,match", [
    (torch.randn(4), {}, ValueError, "logits must have 2 dimensions"),
    (torch.randn(4, 8).int(), {}, TypeError, "logits must have dtype"),
    (torch.randn(4, 8), dict(top_k=9), ValueError, r"top_k must be in \[1, num_experts=8\], got 9"),
    (torch.randn(4, 8), dict(top_k=0), ValueError, "top_k must be in"),
    (torch.randn(4, 8), dict(method="softmax"), ValueError, "method must be one of"),
    (torch.randn(4, 8), dict(method="sigmoid_grouped", num_groups=3), ValueError, "num_groups must divide num_experts=8"),
    (torch.randn(4, 8), dict(method="sigmoid_grouped", num_groups=4, topk_groups=5), ValueError, "topk_groups"),
    (torch.randn(4, 8), dict(method="sigmoid_grouped", num_groups=4, topk_groups=1, top_k=3), ValueError, "kept groups"),
    (torch.randn(4, 8), dict(method="sigmoid_grouped", correction_bias=torch.randn(7)), ValueError, r"correction_bias must have shape \(8,\)"),
    (torch.randn(4, 8), dict(num_groups=2), ValueError, "only to sigmoid_grouped"),
])
def test_bad_input_is_named(bad, kwargs, err, match):
    args = dict(top_k=2, method="softmax_topk") | kwargs
    with pytest.raises(err, match=match):
        moekit.route(bad, args.pop("top_k"), args.pop("method"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("method,kwargs,E,k", [
    ("topk_softmax", {}, 128, 4), ("topk_softmax", {}, 32, 4),
    ("sigmoid_grouped", dict(num_groups=8, topk_groups=4, scaling=2.5), 256, 8),
    ("sigmoid_grouped", dict(num_groups=1, topk_groups=1, scaling=2.827), 384, 8),
    ("softmax_topk", {}, 128, 8), ("softmax_topk", {}, 8, 2), ("sigmoid_top1", {}, 16, 1),
])
def test_route_gpu_presets(method, kwargs, E, k):
    for T in TOKENS + [1000, 4096]:
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(T, E, device="cuda") * 3).to(dtype)
            cb = _corr_bias(method, E, "cuda")
            if method != "sigmoid_grouped":
                # Selection compares the logits themselves: exact on every token, ties included
                # (bf16 logits tie often; the lower id must win exactly as in float64).
                _check(logits, k, method, kwargs, "triton")
                continue
            # sigmoid in fp32 can reorder experts whose float64 scores differ by ~1e-7 (seen at
            # T=4096, E=384): exact agreement is required on separable tokens.
            w, ids = moekit.route(logits, k, method, correction_bias=cb, impl="triton", **kwargs)
            rw, rids = reference.route(logits, k, method, correction_bias=cb, **kwargs)
            mask = separable_tokens(logits.double(), k, method, correction_bias=cb, **kwargs)
            agree, werr = routes_agree(w, ids, rw, rids, mask)
            assert agree == 1.0 and werr < 2e-6, (T, dtype, agree, werr)
            if dtype == torch.float32 and T >= 64:
                # Not vacuous; sigmoid compresses gaps: 72-88% of tokens are separable (H200 run).
                assert mask.float().mean() > 0.5
            assert T == 0 or (ids.min() >= 0 and ids.max() < E)


@pytest.mark.gpu
def test_route_gpu_past_2_31_elements():
    T, E = 2**31 // 256 + 1000, 256          # logits have more than 2^31 elements
    logits = torch.randn(T, E, device="cuda")
    w, ids = moekit.route(logits, 8, "softmax_topk", impl="triton")
    rw, rids = reference.route(logits[-50:], 8, "softmax_topk")
    assert torch.equal(ids[-50:].long().cpu(), rids.cpu())
    torch.testing.assert_close(w[-50:].double(), rw, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(renormalize="False"), TypeError, "renormalize must be True or False"),  # a truthy string renormalized
    (dict(scaling="2.5"), ValueError, "scaling must be a finite number >= 0"),  # a string was taken
    (dict(scaling=float("nan")), ValueError, "scaling must be a finite number >= 0"),  # NaN weights
    (dict(scaling=-1.0), ValueError, "scaling must be a finite number >= 0"),  # negative weights
])
def test_routing_options_are_checked_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        moekit.route(torch.randn(3, 8), 2, "sigmoid_grouped", **kwargs)
