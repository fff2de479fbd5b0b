"""Routing replay and recording: the experts a call chose are written into the caller's buffer, and given ids
are served instead of a selection with the weights the routing method gives them (reinforcement learning
replays a rollout's experts at training time). Against moekit.reference.route_weights, the float64 definition."""

import pytest
import torch

import moekit
from moekit import reference
from moekit.routing import fused_router, route

METHODS = [
    ("softmax_topk", dict(renormalize=True), "Mixtral/Qwen: softmax over all, top-k renormalized"),
    ("softmax_topk", dict(renormalize=False), "Qwen2-MoE: softmax over all E, no renormalization"),
    ("topk_softmax", dict(), "gpt-oss: softmax over the chosen logits"),
    ("sigmoid_grouped", dict(num_groups=4, topk_groups=2, scaling=2.5), "DeepSeek-V3: groups, bias for selection only"),
    ("sigmoid_top1", dict(), "Llama-4: sigmoid of the top logit"),
]
E, T = 16, 9


def _kwargs(method, kw):
    out = dict(kw)
    if method == "sigmoid_grouped":
        out["correction_bias"] = torch.rand(E) * 0.3
    return out


def _reference_weights(logits, ids, method, kw):
    return reference.route_weights(logits, ids.long(), method, renormalize=kw.get("renormalize", True),
                                   scaling=kw.get("scaling", 1.0))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("method,kw,why", METHODS)
def test_record_then_replay_gives_the_same_routes(method, kw, why, impl):
    k = 1 if method == "sigmoid_top1" else 3
    kw = _kwargs(method, kw)
    logits = torch.randn(T, E)
    recorded = torch.full((T, k), -7, dtype=torch.int32)                # poisoned: every row must be written
    weights, ids = route(logits, k, method, impl=impl, record_ids=recorded, **kw)
    assert torch.equal(recorded, ids), why
    again_w, again_ids = route(logits, k, method, replay_ids=recorded, **kw)
    assert torch.equal(again_ids, ids), why
    torch.testing.assert_close(again_w, weights, rtol=1e-6, atol=1e-6, msg=why)
    torch.testing.assert_close(again_w.double(), _reference_weights(logits, ids, method, kw), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method,kw,why", METHODS)
def test_replayed_ids_get_the_methods_weights_from_these_logits(method, kw, why):
    # ids from another call (a rollout): not what these logits would choose, one out of range per row
    k = 1 if method == "sigmoid_top1" else 3
    kw = _kwargs(method, kw)
    logits = torch.randn(T, E)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).long()
    if k > 1:
        ids[::3, 0] = E                                                 # out of range: weight 0
        ids[1::3, -1] = -1
    w, got_ids = route(logits, k, method, replay_ids=ids, **kw)
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids.long(), ids)
    ref = _reference_weights(logits, ids, method, kw)
    torch.testing.assert_close(w.double(), ref, rtol=1e-6, atol=1e-7, msg=why)
    assert (w[(ids < 0) | (ids >= E)] == 0).all()
    if method in ("topk_softmax", "sigmoid_grouped") or kw.get("renormalize") and method == "softmax_topk":
        scale = kw.get("scaling", 1.0)
        torch.testing.assert_close(w.sum(-1), torch.full((T,), scale), rtol=1e-6, atol=1e-6)  # over the valid ids


@pytest.mark.parametrize("impl", ["unfused", "fused"])
def test_fused_router_records_and_replays(impl):
    H = 32
    x, w, b = torch.randn(T, H), torch.randn(E, H) * H ** -0.5, torch.randn(E)
    recorded = torch.empty(T, 4, dtype=torch.int64)
    weights, ids = fused_router(x, w, b, top_k=4, method="topk_softmax", impl=impl, record_ids=recorded)
    assert torch.equal(recorded, ids.long())
    other = torch.stack([torch.randperm(E)[:4] for _ in range(T)]).int()
    rw, rids = fused_router(x, w, b, top_k=4, method="topk_softmax", replay_ids=other)
    assert torch.equal(rids, other)
    logits = reference.router_logits(x, w, b)
    torch.testing.assert_close(rw.double(), reference.route_weights(logits, other.long(), "topk_softmax"),
                               rtol=1e-5, atol=1e-6)


def test_the_layer_records_and_replays():
    layer = moekit.FusedMoE.from_preset("deepseek-v3", dtype=torch.float32, scaled=True)
    spec = layer.spec
    x = torch.randn(2, 5, spec.hidden_size)
    recorded = torch.empty(10, spec.top_k, dtype=torch.int32)
    with torch.no_grad():
        first = layer(x, record_ids=recorded)
        replayed = layer(x, replay_ids=recorded)
        torch.testing.assert_close(replayed, first, rtol=1e-6, atol=1e-6)
        other = torch.stack([torch.randperm(spec.num_experts)[:spec.top_k] for _ in range(10)]).int()
        got = layer(x, replay_ids=other).reshape(10, -1)
    x2 = x.reshape(10, -1)
    logits = reference.router_logits(x2, layer.gate.weight)
    weights = reference.route_weights(logits, other.long(), spec.routing, renormalize=spec.renormalize,
                                      scaling=spec.routed_scaling_factor)
    ref = reference.fused_experts(x2, layer.w13, layer.w2, weights, other.long()) + \
        reference.expert_mlp(x2, layer.shared_w13, layer.shared_w2, "silu_and_mul")
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,kwargs,error,match", [
    ("replay ids for fewer tokens", dict(replay_ids=torch.zeros(T - 1, 3, dtype=torch.int32)), ValueError,
     r"replay_ids must have shape \(9, 3\) \(tokens, top_k\), got \(8, 3\)"),
    ("replay ids as floats", dict(replay_ids=torch.zeros(T, 3)), TypeError, "replay_ids must have dtype in"),
    ("a record buffer of another k", dict(record_ids=torch.zeros(T, 2, dtype=torch.int32)), ValueError,
     r"record_ids must have shape \(9, 3\)"),
    ("a record buffer of one dimension", dict(record_ids=torch.zeros(T * 3, dtype=torch.int32)), ValueError,
     "record_ids must have 2 dimensions"),
    ("a record buffer broadcast over its tokens", dict(record_ids=torch.zeros(1, 3, dtype=torch.int32).expand(T, 3)),
     ValueError, r"record_ids must give each element memory of its own, got shape \(9, 3\) and strides \(0, 1\)"),
    ("a record buffer whose rows overlap", dict(record_ids=torch.zeros(40, dtype=torch.int32).as_strided((T, 3), (2, 1))),
     ValueError, "record_ids must give each element memory of its own"),  # copy_ left a mix of two rows' ids
    ("a record buffer over the replayed ids", dict(replay_ids=torch.zeros(T + 1, 3, dtype=torch.int32)[:T],
                                                   record_ids=torch.zeros(T + 1, 3, dtype=torch.int32)[1:]),
     None, None),  # (separate storages: allowed; the overlapping case is below)
])
def test_bad_replay_arguments_are_named(name, kwargs, error, match):
    if error is None:
        route(torch.randn(T, E), 3, "softmax_topk", **kwargs)
        return
    with pytest.raises(error, match=match):
        route(torch.randn(T, E), 3, "softmax_topk", **kwargs)


def test_a_record_buffer_may_not_overlap_the_replayed_ids():
    buf = torch.zeros(T + 1, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="record_ids must not overlap the memory of replay_ids"):
        route(torch.randn(T, E), 3, "softmax_topk", replay_ids=buf[:T], record_ids=buf[1:])


def test_a_record_buffer_may_not_overlap_the_inputs():
    # the layer's experts read x after its routing wrote the ids: a record buffer over x's memory changed x first
    layer = moekit.FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
    x = torch.randn(T, layer.spec.hidden_size)
    with pytest.raises(ValueError, match="record_ids must not overlap the memory of x"):
        layer(x, record_ids=x.view(torch.int32)[:, :layer.spec.top_k])
    logits = torch.randn(T, E)
    with pytest.raises(ValueError, match="record_ids must not overlap the memory of logits"):
        route(logits, 3, "softmax_topk", record_ids=logits.view(torch.int32)[:, :3])


def test_int64_replay_ids_past_int32_are_no_expert_not_wrapped_ones():
    """2**32 + 1 cast to int32 is 1, a real expert: it is returned and recorded as -1 (weight 0, as the method
    gives an id outside the experts)."""
    replayed = torch.tensor([[2 ** 32 + 1, 3, 0], [-2 ** 32 + 2, 5, 1]])
    recorded = torch.zeros(2, 3, dtype=torch.int64)
    weights, ids = route(torch.randn(2, E), 3, "softmax_topk", replay_ids=replayed, record_ids=recorded)
    assert ids.tolist() == [[-1, 3, 0], [-1, 5, 1]] and torch.equal(recorded, ids.long())
    assert weights[:, 0].tolist() == [0.0, 0.0]


@pytest.mark.gpu
def test_gpu_recording_inside_a_cuda_graph():
    # the buffer is written on every replay: a graph-captured decode step records its routes
    logits = torch.randn(16, 128, device="cuda")
    recorded = torch.empty(16, 8, dtype=torch.int32, device="cuda")
    route(logits, 8, "softmax_topk")                                    # compiled (and gated) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route(logits, 8, "softmax_topk", record_ids=recorded)
    for _ in range(2):
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        _, ids = route(logits, 8, "softmax_topk")
        assert torch.equal(recorded, ids)


def test_a_shard_replays_ids_outside_the_experts_as_no_expert_with_the_gate_on():
    # route gives an id outside [0, E) weight 0; on a shard (an expert map) the gate's check of ids against the map
    # refused them, so turning verification on changed what a replay accepted
    from moekit.distributed import shard_layer

    torch.manual_seed(0)
    full = moekit.FusedMoE.from_preset("mixtral-8x7b", dtype=torch.float32, scaled=True)
    shard = shard_layer(full, 0, 2)
    E, k = full.spec.num_experts, full.spec.top_k
    x = torch.randn(5, full.spec.hidden_size)
    ids = torch.randint(0, E, (5, k), dtype=torch.int32)
    ids[0, 0], ids[1, 1], ids[2, 0] = E + 3, -7, E
    with torch.no_grad():
        ungated = shard(x, replay_ids=ids)
        moekit.set_verification(True)
        try:
            gated = shard(x, replay_ids=ids)
        finally:
            moekit.set_verification(None)
    assert torch.equal(gated, ungated)
