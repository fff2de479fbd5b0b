"""Layout converters: exact round trips, and the formats the engines use."""

import pytest
import torch

from moekit import layouts, reference


def test_interleave_round_trip_and_meaning():
    w13 = torch.randn(3, 10, 4)
    inter = layouts.interleave(w13)
    assert torch.equal(inter[:, 0::2], w13[:, :5]) and torch.equal(inter[:, 1::2], w13[:, 5:])
    assert torch.equal(layouts.deinterleave(inter), w13)
    b = torch.randn(3, 10)
    assert torch.equal(layouts.deinterleave_bias(layouts.interleave_bias(b)), b)


def test_swap_halves_is_an_involution():
    w13 = torch.randn(2, 6, 5)
    swapped = layouts.swap_halves(w13)
    assert torch.equal(swapped[:, :3], w13[:, 3:]) and torch.equal(layouts.swap_halves(swapped), w13)
    assert torch.equal(layouts.swap_bias_halves(layouts.swap_bias_halves(w13[..., 0])), w13[..., 0])


def test_activations_agree_across_layouts():
    # The same expert, stored [gate; up] for silu and interleaved for gpt-oss's swiglu.
    h = torch.randn(7, 12, dtype=torch.float64)
    inter = layouts.interleave(h.T.unsqueeze(0)).squeeze(0).T
    g, u = h.chunk(2, dim=-1)
    torch.testing.assert_close(reference.swiglu_oai(inter), reference.swiglu_oai(torch.stack([g, u], -1).flatten(-2)))


def test_hf_round_trip():
    gate_up, down = torch.randn(4, 6, 10), torch.randn(4, 5, 6)   # [E, H, 2I], [E, I, H]
    w13, w2 = layouts.from_hf(gate_up, down)
    assert w13.shape == (4, 10, 6) and w2.shape == (4, 6, 5) and w13.is_contiguous()
    x = torch.randn(3, 6)
    torch.testing.assert_close(x @ gate_up[1], x @ w13[1].T)     # HF computes x @ W
    back = layouts.to_hf(w13, w2)
    assert torch.equal(back[0], gate_up) and torch.equal(back[1], down)
    with pytest.raises(ValueError, match=r"down_proj must have shape \(4, 5, 6\)"):
        layouts.from_hf(gate_up, down[:, :4])


@pytest.mark.parametrize("T,E,k,M,why", [
    (0, 4, 2, 3, "no tokens"),
    (9, 5, 2, 9, "capacity never reached"),
    (9, 3, 3, 4, "capacity overflows: extra pairs dropped"),
    (7, 7, 6, 7, "k=6, prime E"),
])
def test_pack_combine_matches_standard_format(T, E, k, M, why):
    x = torch.randn(T, 8)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int() if T else torch.empty(0, k, dtype=torch.int32)
    w = torch.rand(T, k)
    xb, counts, slot = layouts.pack_batched(x, ids, E, M)
    assert xb.shape == (E, M, 8) and counts.dtype == torch.int32
    kept = slot >= 0
    assert torch.equal(counts.long(), torch.bincount(ids.long()[kept], minlength=E)) if T else counts.sum() == 0
    for t, j in zip(*torch.nonzero(kept, as_tuple=True)):
        assert torch.equal(xb.view(-1, 8)[slot[t, j]], x[t])
    # With an identity "expert", combining returns the weighted sum over kept slots.
    got = layouts.combine_batched(xb, slot, w)
    expect = (x[:, None, :] * (w * kept)[..., None]).sum(1)
    torch.testing.assert_close(got, expect)


def test_pack_drops_invalid_ids():
    x = torch.randn(3, 4)
    ids = torch.tensor([[0, 7], [-1, 1], [1, 1]], dtype=torch.int32)
    _, counts, slot = layouts.pack_batched(x, ids, 2, 4)
    assert slot[0, 1] == -1 and slot[1, 0] == -1 and counts.tolist() == [1, 3]


def test_combine_ignores_padding_rows_of_dropped_pairs():
    # a dropped pair gathered row 0 (padding here, never written by the kernels) and NaN times its zero weight was NaN
    x = torch.randn(2, 4)
    ids = torch.tensor([[1, 2], [1, 2]], dtype=torch.int32)
    xb, counts, slot = layouts.pack_batched(x, ids, 3, 1)  # token 1's pairs do not fit: dropped
    assert counts.tolist() == [0, 1, 1] and (slot[1] == -1).all()
    yb = torch.full((3, 1, 4), float("nan"))
    yb[1, 0], yb[2, 0] = 1.0, 2.0
    out = layouts.combine_batched(yb, slot, torch.full((2, 2), 0.5))
    assert torch.equal(out, torch.tensor([[1.5] * 4, [0.0] * 4]))


def test_batch_invariant_mode_refuses_a_capacity_that_can_drop_a_token():
    # whether a pair fits depends on the tokens before it: a token alone is kept, the same token behind a full expert
    # is dropped (its output zero). In the mode a capacity below T is refused; at T it cannot drop (shape-only check).
    import moekit

    x = torch.randn(5, 4)
    ids = torch.tensor([[0, 1]] * 5, dtype=torch.int32)
    with moekit.batch_invariant():
        with pytest.raises(ValueError, match="max_tokens=4 below the 5 tokens is not batch-invariant.*"
                                             "set_batch_invariant"):
            layouts.pack_batched(x, ids, 3, 4)
        xb, counts, slot = layouts.pack_batched(x, ids, 3, 5)
        assert counts.tolist() == [5, 5, 0] and (slot >= 0).all()
    assert layouts.pack_batched(x, ids, 3, 4)[1].tolist() == [4, 4, 0]   # the default mode drops as documented


def test_pack_and_combine_need_no_values_on_the_host():
    # A shape that depends on values (a boolean mask, nonzero, .item) is a device-to-host sync on CUDA and breaks
    # CUDA-graph capture: on the meta device (shapes without values) both run, or the layout needs a sync.
    T, H, E, k, M = 6, 8, 4, 2, 3  # M < T: some pairs are dropped
    x, ids = torch.randn(T, H, device="meta"), torch.zeros(T, k, dtype=torch.int32, device="meta")
    xb, counts, slot = layouts.pack_batched(x, ids, E, M)
    assert (xb.shape, counts.shape, slot.shape) == ((E, M, H), (E,), (T, k))
    assert layouts.combine_batched(xb, slot, torch.rand(T, k, device="meta")).shape == (T, H)
