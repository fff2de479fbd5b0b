"""fused_experts / batched_experts against the float64 reference."""

import pytest
import torch

from moekit import layouts, reference
from moekit.experts import batched_experts, fused_experts
from moekit.verify.metrics import Tolerance, check_close

TOL = {torch.float32: Tolerance(1e-5, 1e-5), torch.bfloat16: Tolerance(2e-2, 5e-3)}


def _weights(E, H, I, dtype, biases):
    w13 = (torch.randn(E, 2 * I, H) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I) * I ** -0.5).to(dtype)
    b = (torch.randn(E, 2 * I) * 0.1, torch.randn(E, H) * 0.1) if biases else (None, None)
    return w13, w2, *b


def _routes(T, E, k):
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int() if T else torch.empty(0, k, dtype=torch.int32)
    return torch.softmax(torch.randn(T, k), -1), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,H,I,k,act,biases,why", [
    (0, 8, 32, 16, 2, "silu_and_mul", False, "no tokens"),
    (1, 8, 32, 16, 2, "silu_and_mul", False, "one token"),
    (7, 7, 96, 40, 6, "silu_and_mul", True, "prime E, k=6, odd I"),
    (33, 8, 96, 40, 4, "swiglu_oai", True, "gpt-oss activation with biases"),
    (33, 64, 64, 24, 8, "silu_and_mul", False, "many experts: several get no token"),
])
def test_fused_experts_matches_reference(dtype, T, E, H, I, k, act, biases, why):
    w13, w2, b13, b2 = _weights(E, H, I, dtype, biases)
    x = torch.randn(T, H + 5).to(dtype)[:, 5:]        # strided input
    tw, tid = _routes(T, E, k)
    out = torch.full((T, H), float("nan"), dtype=dtype)
    got = fused_experts(x, w13, w2, tw, tid, activation=act, w13_bias=b13, w2_bias=b2, out=out)
    assert got is out
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation=act, w13_bias=b13, w2_bias=b2)
    check_close(why, got, ref, TOL[dtype])


def test_every_token_on_one_expert_and_expert_map_half_remote():
    E, H, I, T = 8, 32, 16, 20
    w13, w2, _, _ = _weights(E, H, I, torch.float32, False)
    x = torch.randn(T, H)
    tw = torch.rand(T, 2)
    tid = torch.stack([torch.full((T,), 3), torch.randint(0, E, (T,))], 1).int()
    check_close("one expert", fused_experts(x, w13, w2, tw, tid), reference.fused_experts(x, w13, w2, tw, tid), TOL[torch.float32])
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)   # odd experts live elsewhere
    local13, local2 = w13[::2].contiguous(), w2[::2].contiguous()
    got = fused_experts(x, local13, local2, tw, tid, expert_map=emap)
    check_close("expert_map", got, reference.fused_experts(x, local13, local2, tw, tid, expert_map=emap), TOL[torch.float32])


def test_invalid_ids_contribute_zero():
    w13, w2, _, _ = _weights(4, 16, 8, torch.float32, False)
    x = torch.randn(3, 16)
    tid = torch.tensor([[0, 9], [-1, 1], [2, 3]], dtype=torch.int32)
    tw = torch.rand(3, 2)
    clean = torch.where((tid >= 0) & (tid < 4), tw, 0.0)
    expect = reference.fused_experts(x, w13, w2, clean, tid.clamp(0, 3))
    check_close("bad ids", fused_experts(x, w13, w2, tw, tid), expect, TOL[torch.float32])


@pytest.mark.parametrize("act,biases", [("silu_and_mul", False), ("swiglu_oai", True)])
def test_batched_experts_padding_never_leaks(act, biases):
    E, M, H, I = 5, 6, 32, 12
    w13, w2, b13, b2 = _weights(E, H, I, torch.float32, biases)
    x = torch.randn(E, M, H)
    counts = torch.tensor([6, 0, 3, 1, 2], dtype=torch.int32)         # a full and an empty expert
    valid = torch.arange(M)[None, :] < counts[:, None].long()
    x[~valid] = float("nan")                                            # garbage padding
    out = torch.full_like(x, float("nan"))
    got = batched_experts(x, counts, w13, w2, activation=act, w13_bias=b13, w2_bias=b2, out=out)
    assert got is out and torch.isfinite(got[valid]).all()
    ref = reference.batched_experts(x, counts, w13, w2, activation=act, w13_bias=b13, w2_bias=b2)
    check_close("valid rows", got[valid], ref[valid], TOL[torch.float32])


def test_batched_round_trip_equals_standard():
    E, H, I, T, k = 6, 32, 16, 11, 2
    w13, w2, _, _ = _weights(E, H, I, torch.float32, False)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    xb, counts, slot = layouts.pack_batched(x, tid, E, T)
    yb = batched_experts(xb, counts, w13, w2)
    check_close("round trip", layouts.combine_batched(yb, slot, tw), reference.fused_experts(x, w13, w2, tw, tid), TOL[torch.float32])


def _bad(fn, err, match):
    with pytest.raises(err, match=match):
        fn()


def test_bad_input_is_named():
    w13, w2, _, _ = _weights(4, 16, 8, torch.float32, False)
    x = torch.randn(3, 16)
    tw, tid = _routes(3, 4, 2)
    _bad(lambda: fused_experts(x[:, :8], w13, w2, tw, tid), ValueError, "x must have hidden size H=16")
    _bad(lambda: fused_experts(x.half(), w13, w2, tw, tid), TypeError, "x must have the weights' dtype")
    _bad(lambda: fused_experts(x, w13, w2[:, :, :4], tw, tid), ValueError, r"w2 must have shape \(4, 16, 8\)")
    _bad(lambda: fused_experts(x, w13, w2, tw.double(), tid), TypeError, "topk_weights must have dtype")
    _bad(lambda: fused_experts(x, w13, w2, tw, tid.long()), TypeError, "topk_ids must have dtype")
    _bad(lambda: fused_experts(x, w13, w2, tw, tid[:2]), ValueError, r"topk_ids must have shape \(3, 2\)")
    _bad(lambda: fused_experts(x, w13, w2, tw, tid, activation="gelu"), ValueError, "activation must be one of")
    _bad(lambda: fused_experts(x, w13, w2, tw, tid, w13_bias=torch.zeros(4, 15)), ValueError, r"w13_bias must have shape \(4, 16\)")
    _bad(lambda: fused_experts(x, w13, w2, tw, tid, out=torch.empty(3, 16).T.contiguous().T), ValueError, "unit stride")
    _bad(lambda: fused_experts(x, w13, w2, tw, tid, out=x), ValueError, "out must not overlap the memory of x")
    _bad(lambda: fused_experts(x, w13, w2, tw, tid, expert_map=torch.zeros(4)), TypeError, "expert_map must have dtype")
    _bad(lambda: batched_experts(torch.randn(3, 2, 16), torch.zeros(3, dtype=torch.int32), w13, w2), ValueError, "x must be \\[E=4")
