"""The float64 references checked against independent per-token loops and hand values."""

import math

import pytest
import torch

from moekit import reference

F64 = torch.float64


def _loop_route(logits, k, method, renormalize=True, bias=None, groups=1, keep=1, scaling=1.0):
    """Per-token, plain-Python routing, written independently of reference.route."""
    weights, ids = [], []
    for row in logits.tolist():
        E = len(row)
        key = lambda v: -math.inf if math.isnan(v) else v  # noqa: E731
        if method == "sigmoid_grouped":
            s = [1 / (1 + math.exp(-v)) for v in row]
            c = [key(si + (bias[i] if bias is not None else 0.0)) for i, si in enumerate(s)]
            gs = E // groups
            gscore = [sum(sorted(c[g * gs:(g + 1) * gs], reverse=True)[:2]) for g in range(groups)]
            kept_groups = sorted(range(groups), key=lambda g: (-gscore[g], g))[:keep]
            cand = [i for i in range(E) if i // gs in kept_groups]
            chosen = sorted(cand, key=lambda i: (-c[i], i))[:k]
            w = [s[i] for i in chosen]
            if renormalize:
                w = [v / sum(w) for v in w]
            w = [v * scaling for v in w]
        else:
            chosen = sorted(range(E), key=lambda i: (-key(row[i]), i))[:k]
            if method == "sigmoid_top1":
                w = [1 / (1 + math.exp(-row[i])) for i in chosen]
            elif method == "softmax_topk" and not renormalize:
                m = max(row)
                z = sum(math.exp(v - m) for v in row)
                w = [math.exp(row[i] - m) / z for i in chosen]
            else:
                m = max(row[i] for i in chosen)
                z = sum(math.exp(row[i] - m) for i in chosen)
                w = [math.exp(row[i] - m) / z for i in chosen]
        weights.append(w)
        ids.append(chosen)
    return torch.tensor(weights, dtype=F64), torch.tensor(ids)


@pytest.mark.parametrize("method,kwargs,E,k", [
    ("softmax_topk", dict(renormalize=True), 8, 2),      # Mixtral
    ("softmax_topk", dict(renormalize=False), 13, 6),    # Qwen2-MoE style, prime E, k=6
    ("topk_softmax", {}, 32, 4),                         # gpt-oss
    ("sigmoid_top1", {}, 7, 1),                          # Llama-4
    ("sigmoid_grouped", dict(num_groups=4, topk_groups=2, scaling=2.5), 16, 6),  # DeepSeek-like
    ("sigmoid_grouped", dict(num_groups=1, topk_groups=1, scaling=2.827), 12, 8),  # Kimi-like
])
def test_route_matches_per_token_loop(method, kwargs, E, k):
    logits = torch.randn(23, E, dtype=F64)
    logits[3, :4] = logits[3, 5]           # exact ties: lower id first
    bias = torch.randn(E, dtype=F64) * 0.1 if method == "sigmoid_grouped" else None
    w, ids = reference.route(logits, k, method, correction_bias=bias, **kwargs)
    lw, lids = _loop_route(logits, k, method, kwargs.get("renormalize", True), None if bias is None else bias.tolist(),
                           kwargs.get("num_groups", 1), kwargs.get("topk_groups", 1), kwargs.get("scaling", 1.0))
    assert torch.equal(ids, lids)
    torch.testing.assert_close(w, lw, rtol=1e-12, atol=1e-14)


def test_selection_on_nan_and_inf():
    logits = torch.tensor([[0.0, float("nan"), 1.0, float("-inf")],
                           [float("nan")] * 4,
                           [float("inf"), 0.0, 1.0, 2.0]], dtype=F64)
    w, ids = reference.route(logits, 2, "topk_softmax")
    assert ids.tolist() == [[2, 0], [0, 1], [0, 3]]   # NaN ranks like -inf, ties to the lower id
    assert torch.isnan(w[1]).all() and torch.isnan(w[2]).all()  # inf - inf: IEEE NaN, never invented numbers
    assert torch.isfinite(w[0]).all()


def test_softmax_topk_renormalized_equals_topk_softmax():
    logits = torch.randn(50, 64, dtype=F64)
    a = reference.route(logits, 8, "softmax_topk", renormalize=True)
    b = reference.route(logits, 8, "topk_softmax")
    assert torch.equal(a[1], b[1])
    torch.testing.assert_close(a[0], b[0])


def test_grouped_weights_use_unbiased_scores():
    logits = torch.zeros(1, 8, dtype=F64)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 4.0], dtype=F64)  # bias picks 6, 7 ...
    w, ids = reference.route(logits, 2, "sigmoid_grouped", correction_bias=bias, renormalize=False)
    assert ids.tolist() == [[6, 7]]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5, dtype=F64))  # ... weights stay sigmoid(0)


def test_grouped_drops_groups_by_top2_sum():
    # group 0: top-2 = 0.9 + 0.1; group 1: 0.8 + 0.7 wins though group 0 holds the max.
    s = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.8, 0.7, 0.0, 0.0]], dtype=F64)
    logits = torch.log(s / (1 - s)).clamp(-50, 50)
    _, ids = reference.route(logits, 2, "sigmoid_grouped", num_groups=2, topk_groups=1)
    assert ids.tolist() == [[4, 5]]


def test_activations_by_hand():
    h = torch.tensor([[1.0, -2.0, 3.0, 0.5]], dtype=F64)  # silu: gate [1, -2], up [3, .5]
    expect = torch.tensor([[1 / (1 + math.exp(-1)) * 3, -2 / (1 + math.exp(2)) * 0.5]], dtype=F64)
    torch.testing.assert_close(reference.silu_and_mul(h), expect)
    g = torch.tensor([[9.0, 8.0, -1.0, -9.0]], dtype=F64)  # interleaved: (g, u) = (9, 8), (-1, -9)
    sw = lambda gate, up: (up + 1) * gate / (1 + math.exp(-1.702 * gate))  # noqa: E731
    torch.testing.assert_close(reference.swiglu_oai(g), torch.tensor([[sw(7.0, 7.0), sw(-1.0, -7.0)]], dtype=F64))


def test_router_logits_with_bias_and_lora():
    x, w, b = torch.randn(5, 16), torch.randn(6, 16), torch.randn(6)
    a, bb = torch.randn(2, 16), torch.randn(6, 2)
    got = reference.router_logits(x, w, b, a, bb, 0.25)
    expect = x.double() @ w.double().T + b.double() + 0.25 * (x.double() @ a.double().T) @ bb.double().T
    torch.testing.assert_close(got, expect)


def _token_loop_experts(x, w13, w2, tw, tid, act, b13=None, b2=None, expert_map=None):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=F64)
    for t in range(x.shape[0]):
        for j in range(tid.shape[1]):
            e = int(tid[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            h = w13[e].double() @ x[t].double() + (0 if b13 is None else b13[e].double())
            y = w2[e].double() @ reference.ACTIVATION_FNS[act](h) + (0 if b2 is None else b2[e].double())
            out[t] += tw[t, j].double() * y
    return out


@pytest.mark.parametrize("act,biases,use_map", [
    ("silu_and_mul", False, False),
    ("swiglu_oai", True, False),     # gpt-oss: interleaved + biases
    ("silu_and_mul", False, True),   # expert parallel: half the experts remote
])
def test_fused_experts_matches_token_loop(act, biases, use_map):
    T, H, I, E, k = 9, 12, 10, 5, 3
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H) * 0.3, torch.randn(E, H, I) * 0.3
    b13, b2 = (torch.randn(E, 2 * I), torch.randn(E, H)) if biases else (None, None)
    tid = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    tw = torch.rand(T, k)
    emap = None
    if use_map:
        emap = torch.tensor([0, -1, 1, -1, 2], dtype=torch.int32)
        w13, w2 = w13[:3], w2[:3]
    got = reference.fused_experts(x, w13, w2, tw, tid, activation=act, w13_bias=b13, w2_bias=b2, expert_map=emap)
    torch.testing.assert_close(got, _token_loop_experts(x, w13, w2, tw, tid, act, b13, b2, emap))


def test_batched_experts_ignores_padding_and_zeroes_it():
    E, M, H, I = 3, 4, 8, 6
    x = torch.randn(E, M, H)
    counts = torch.tensor([2, 0, 4], dtype=torch.int32)
    x[0, 2:] = float("nan")  # padding rows may hold garbage
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    out = reference.batched_experts(x, counts, w13, w2)
    assert torch.isfinite(out).all() and (out[0, 2:] == 0).all() and (out[1] == 0).all()
    torch.testing.assert_close(out[2, 1], reference.expert_mlp(x[2, 1:2], w13[2], w2[2], "silu_and_mul")[0])


def test_batched_counts_out_of_range_read_as_the_kernels_do():
    # a negative count is no rows (x[e, :-1] took M - 1 of them); a count past M is all M
    E, M, H, I = 2, 4, 8, 6
    x, w13, w2 = torch.randn(E, M, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    out = reference.batched_experts(x, torch.tensor([-1, 6], dtype=torch.int32), w13, w2)
    assert (out[0] == 0).all()
    torch.testing.assert_close(out[1], reference.expert_mlp(x[1], w13[1], w2[1], "silu_and_mul"))


@pytest.mark.parametrize("name", ["gpt-oss-120b", "deepseek-v3"])
def test_moe_layer_composes_router_routing_experts_and_shared(name):
    from moekit import presets

    spec = presets.get(name).scaled(hidden_size=16, intermediate_size=8)
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    x = torch.randn(6, H)
    rw, rb = torch.randn(E, H), torch.randn(E) if spec.router_bias else None
    cb = torch.randn(E) * 0.1 if spec.correction_bias else None
    w13, w2 = torch.randn(E, 2 * I, H) * 0.2, torch.randn(E, H, I) * 0.2
    sw13, sw2 = (torch.randn(2 * I, H), torch.randn(H, I)) if spec.num_shared_experts else (None, None)
    got = reference.moe_layer(x, rw, w13, w2, spec, router_bias=rb, correction_bias=cb, shared_w13=sw13, shared_w2=sw2)
    tw, tid = _loop_route(x.double() @ rw.double().T + (0 if rb is None else rb.double()), spec.top_k, spec.routing,
                          spec.renormalize, None if cb is None else cb.tolist(), spec.num_groups, spec.topk_groups,
                          spec.routed_scaling_factor)
    expect = _token_loop_experts(x, w13, w2, tw, tid, spec.activation)
    if sw13 is not None:
        expect += reference.expert_mlp(x, sw13, sw2, "silu_and_mul")
    torch.testing.assert_close(got, expect)
