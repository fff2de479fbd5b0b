"""moekit.formats against the definitions of formats.md, bit for bit."""

import pytest
import torch
import triton
import triton.language as tl

from moekit.formats import fp4, fp8, mxfp4, nvfp4
from moekit.experts.kernels.moe_gemm import _w4a8_steps

# ------------------------------------------------------------------------------------- fp4
def test_every_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8)
    expect = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    got = fp4.decode(codes)
    assert got.tolist() == expect
    assert torch.signbit(got[8])                                       # code 8 is -0


def test_every_value_encodes_to_its_code():
    values = fp4.code_values()
    codes = fp4.encode(values)
    assert codes[:8].tolist() == list(range(8))
    assert codes[9:].tolist() == list(range(9, 16))                   # -0.0 is not < 0: code 0, also 0


@pytest.mark.parametrize("x,code,why", [
    (0.25, 0, "tie 0 | 0.5 -> even code 0"), (0.2500001, 1, "just past the tie"),
    (0.75, 2, "tie 0.5 | 1 -> even code 2 (1.0)"), (0.7499999, 1, "just below"),
    (1.25, 2, "tie 1 | 1.5 -> 1.0"), (1.2500001, 3, "just past"),
    (1.75, 4, "tie 1.5 | 2 -> 2.0"), (1.7499999, 3, "just below"),
    (2.5, 4, "tie 2 | 3 -> 2.0"), (2.5000002, 5, "just past"),
    (3.5, 6, "tie 3 | 4 -> 4.0"), (3.4999998, 5, "just below"),
    (5.0, 6, "tie 4 | 6 -> 4.0"), (5.0000005, 7, "just past"),
    (6.0, 7, "largest"), (7.0, 7, "saturates"), (1e30, 7, "saturates far out"),
    (-0.1, 8, "negative rounding to zero keeps the sign: -0"), (-5.5, 15, "negative, rounds to -6"),
    (-100.0, 15, "saturates at -6"), (0.0, 0, "zero"),
])
def test_rounding_thresholds_ties_and_saturation(x, code, why):
    assert fp4.encode(torch.tensor([x], dtype=torch.float32)).item() == code, why


def test_pack_puts_even_elements_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = fp4.pack(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(fp4.unpack(packed), codes)
    with pytest.raises(ValueError, match="even last dimension"):
        fp4.pack(torch.zeros(3, dtype=torch.uint8))


# ------------------------------------------------------------------------------------- nvfp4
def test_nvfp4_follows_the_definition():
    x = torch.randn(3, 64) * 3
    x[1, 16:32] = 0                                                   # an all-zero block
    t = nvfp4.quantize(x)
    gs = 448 * 6 / x.abs().max()
    assert torch.equal(t.global_scale, gs)
    xb = x.reshape(3, 4, 16)
    sf = (gs * xb.abs().amax(-1) / 6).to(torch.float8_e4m3fn)
    assert torch.equal(t.scales.view(torch.uint8), sf.view(torch.uint8))
    assert (t.scales[1, 1].float() == 0).item()
    sf32 = sf.float()[..., None]
    expect_codes = fp4.encode(torch.where(sf32 > 0, xb * gs / torch.where(sf32 > 0, sf32, 1), 0.0)).reshape(3, 64)
    assert torch.equal(fp4.unpack(t.data), expect_codes)
    assert (fp4.unpack(t.data)[1, 16:32] == 0).all()
    deq = nvfp4.dequantize(t, torch.float32)
    assert torch.equal(deq, (fp4.decode(expect_codes).reshape(3, 4, 16) * sf32 / gs).reshape(3, 64))


def test_nvfp4_block_max_maps_to_six_and_the_tensor_max_to_448():
    x = torch.randn(2, 32)
    t = nvfp4.quantize(x)
    assert t.scales.float().max().item() == 448.0
    flat = x.flatten()
    assert nvfp4.dequantize(t, torch.float32).flatten()[flat.abs().argmax()].item() == pytest.approx(flat[flat.abs().argmax()].item())


def test_nvfp4_subnormal_block_scales():
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0                                                    # sets gs = 2688
    x[0, 16] = 2.0 ** -9 * 6 / 2688                                  # block scale 2^-9: e4m3's smallest subnormal
    t = nvfp4.quantize(x)
    assert t.scales.float()[0].tolist() == [448.0, 2.0 ** -9]
    assert nvfp4.dequantize(t, torch.float32)[0, 16].item() == pytest.approx(x[0, 16].item(), rel=1e-6)


def test_nvfp4_per_expert_global_scales_and_given_scale():
    w = torch.randn(3, 8, 32)
    w[2] *= 100
    t = nvfp4.quantize(w, scale_dims=1)
    assert t.global_scale.shape == (3,)
    assert torch.allclose(t.global_scale, 2688 / w.abs().amax(dim=(1, 2)))
    given = nvfp4.quantize(w, global_scale=torch.tensor([1.0, 2.0, 3.0]))
    assert given.global_scale.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="global_scale must be a scalar or have the leading shape"):
        nvfp4.quantize(w, global_scale=torch.ones(4))


def test_nvfp4_all_zero_tensor_and_bad_input():
    t = nvfp4.quantize(torch.zeros(2, 16))
    assert t.global_scale.item() == 1.0 and (t.data == 0).all() and (t.scales.float() == 0).all()
    with pytest.raises(ValueError, match="NaN or Inf"):
        nvfp4.quantize(torch.tensor([[float("nan")] + [0.0] * 15]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        nvfp4.quantize(torch.tensor([[float("inf")] + [0.0] * 15]))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.zeros(2, 24))


def test_nvfp4_empty_tensors_quantize_and_round_trip():
    # empty last dim (K = 0), empty rows, and an [E, 0, K] weight per expert: nothing to scale, global scale 1
    for shape, scale_dims in [((3, 0), 0), ((0, 32), 0), ((2, 0, 16), 1)]:
        t = nvfp4.quantize(torch.randn(shape), scale_dims=scale_dims)
        assert t.data.shape == (*shape[:-1], shape[-1] // 2) and t.scales.shape == (*shape[:-1], shape[-1] // 16)
        assert (t.global_scale == 1.0).all() and t.global_scale.shape == shape[:scale_dims]
        assert nvfp4.dequantize(t).shape == shape


def test_swizzle_matches_the_formula_and_zeroes_padding():
    rows, cols = 130, 6                                               # padded to 256 x 8
    scales = (torch.rand(rows, cols) * 100 + 1).to(torch.float8_e4m3fn)
    sw = nvfp4.swizzle(scales)
    assert sw.shape == (256 * 8,)
    padded_cols = 8
    for r in (0, 1, 31, 32, 127, 128, 129):
        for c in (0, 3, 4, 5):
            off = ((r // 128) * (padded_cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
            assert sw[off].item() == scales[r, c].view(torch.uint8).item()
    used = torch.zeros(256 * 8, dtype=torch.bool)
    used[nvfp4.swizzled_offsets(rows, cols).flatten()] = True
    assert used.sum().item() == rows * cols                           # a bijection onto the used bytes
    assert (sw[~used] == 0).all()                                    # padding zero-initialized
    assert torch.equal(nvfp4.unswizzle(sw, rows, cols).view(torch.uint8), scales.view(torch.uint8))


def test_swizzled_quantize_round_trips():
    w = torch.randn(2, 130, 96)
    lin, sw = nvfp4.quantize(w, scale_dims=1), nvfp4.quantize(w, swizzled=True, scale_dims=1)
    assert sw.scales.shape == (2, 256 * 8)
    assert torch.equal(nvfp4.dequantize(lin), nvfp4.dequantize(sw))


def test_modelopt_conversion_round_trips():
    w = torch.randn(4, 16, 64)
    t = nvfp4.quantize(w, scale_dims=1)
    ckpt = nvfp4.to_modelopt(t)
    assert torch.allclose(ckpt["weight_scale_2"], w.abs().amax(dim=(1, 2)) / 2688)
    back = nvfp4.from_modelopt(ckpt["weight"], ckpt["weight_scale"], ckpt["weight_scale_2"])
    ours = nvfp4.dequantize(t, torch.float32)
    modelopt = (fp4.decode(fp4.unpack(ckpt["weight"])).reshape(4, 16, 4, 16) * ckpt["weight_scale"].float()[..., None]
                * ckpt["weight_scale_2"][:, None, None, None]).reshape(4, 16, 64)
    assert torch.allclose(nvfp4.dequantize(back, torch.float32), modelopt, rtol=2 ** -23, atol=0)
    assert torch.allclose(ours, modelopt, rtol=2 ** -22, atol=0)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        nvfp4.from_modelopt(ckpt["weight"], ckpt["weight_scale"][..., :2], ckpt["weight_scale_2"])


# ------------------------------------------------------------------------------------- mxfp4
@pytest.mark.parametrize("amax,exponent,why", [
    (6.0, 0, "amax / 6 = 1: a power of two stays"),
    (6.5, 1, "just above rounds up to 2"),
    (3.0, -1, "0.5 exactly"),
    (3.1, 0, "above 0.5 rounds up to 1"),
    (6.0 * 2.0 ** -130, -127, "below E8M0's range clamps to 2^-127"),
    (0.0, -127, "an all-zero block"),
])
def test_mxfp4_scale_rounds_up_to_a_power_of_two(amax, exponent, why):
    x = torch.zeros(1, 32)
    x[0, 5] = -amax
    t = mxfp4.quantize(x)
    assert t.scales.item() == exponent + 127, why


def test_mxfp4_follows_the_definition_and_never_saturates_in_range():
    x = torch.randn(5, 128) * 10
    t = mxfp4.quantize(x)
    xb = x.reshape(5, 4, 32)
    e = torch.ceil(torch.log2(xb.abs().amax(-1) / 6))
    assert torch.equal(t.scales.long(), (e + 127).long())
    codes = fp4.encode(xb / torch.exp2(e)[..., None]).reshape(5, 128)
    assert torch.equal(fp4.unpack(t.data), codes)
    assert (xb.abs() / torch.exp2(e)[..., None]).max() <= 6.0
    assert torch.equal(mxfp4.dequantize(t, torch.float32),
                       (fp4.decode(codes).reshape(5, 4, 32) * torch.exp2(e)[..., None]).reshape(5, 128))
    assert torch.equal(t.scales_e8m0().view(torch.uint8), t.scales)


def test_mxfp4_nan_scale_and_bad_input():
    t = mxfp4.quantize(torch.randn(1, 64))
    broken = mxfp4.MXFP4Tensor(t.data, torch.tensor([[255, t.scales[0, 1].item()]], dtype=torch.uint8), t.shape)
    out = mxfp4.dequantize(broken, torch.float32)
    assert torch.isnan(out[0, :32]).all() and torch.isfinite(out[0, 32:]).all()
    with pytest.raises(ValueError, match="NaN or Inf"):
        mxfp4.quantize(torch.full((1, 32), float("-inf")))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.zeros(1, 48))


def _nearest_e4m3_byte(v: float) -> int:
    """An independent E4M3 rounding: the finite E4M3 value nearest to v >= 0, ties to the even byte."""
    values = [(abs(float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())), b)
              for b in range(0x7F)]                                    # every non-negative finite byte
    best = min(abs(val - v) for val, _ in values)
    ties = [b for val, b in values if abs(val - v) == best]
    return min(ties, key=lambda b: b % 2)


def test_w4a8_step_table_follows_its_definition():
    table = mxfp4.e4m3_steps()
    assert table.shape == (17, 8) and table.dtype == torch.uint8
    for d in range(mxfp4.E4M3_EXACT_STEPS + 1):
        expect = [_nearest_e4m3_byte(v * 2.0 ** (mxfp4.E4M3_SHIFT - d)) for v in fp4.VALUES]
        assert table[d].tolist() == expect, d
    values = table[:mxfp4.E4M3_EXACT_STEPS + 1].view(torch.float8_e4m3fn).double()
    exact = torch.tensor(fp4.VALUES, dtype=torch.float64) * torch.exp2(6.0 - torch.arange(15.0, dtype=torch.float64))[:, None]
    assert torch.equal(values, exact)                                   # d <= 14: every magnitude exact
    assert table[mxfp4.E4M3_ZERO_STEP].tolist() == [0] * 8             # d >= 15: zeros
    assert table[mxfp4.E4M3_NAN_STEP].tolist() == [0x7F] * 8           # E4M3's NaN


@triton.jit
def _step_rows_kernel(s_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    lo, hi = _w4a8_steps(tl.load(s_ptr + i).to(tl.int32), 200)
    tl.store(out_ptr + 2 * i, lo)
    tl.store(out_ptr + 2 * i + 1, hi)


def test_w4a8_step_rows_by_integer_ops_equal_the_table():
    # the kernels' _w4a8_steps (interpreted) against the table, at every distance and for the NaN scale
    s = torch.tensor([200 - d for d in range(32)] + [255] * 32, dtype=torch.uint8)
    out = torch.empty(64, 2, dtype=torch.int32)
    _step_rows_kernel[(1,)](s, out, N=64)
    table = mxfp4.e4m3_steps()
    step = torch.where(s.long() == 255, mxfp4.E4M3_NAN_STEP, (200 - s.long()).clamp(max=mxfp4.E4M3_ZERO_STEP))
    assert torch.equal(out.view(torch.uint8).view(64, 8), table[step])


@pytest.mark.parametrize("spread,exact,why", [
    (8, True, "scales within 2^8 of the row's largest"),
    (14, True, "the widest exact spread: 0.5 * 2^(6 - 14) = 2^-9, E4M3's smallest subnormal"),
    (15, False, "past 2^14: that group recodes as zeros"),
    (40, False, "far past"),
])
def test_w4a8_recoding_is_exact_within_2_pow_14(spread, exact, why):
    scales = torch.randint(125, 131, (3, 5, 4), dtype=torch.uint8)
    scales[..., 0] = 131                                              # the row's largest scale
    scales[..., 1] = 131 - spread                                     # the second group of every row
    t = mxfp4.MXFP4Tensor(torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8), scales, (3, 5, 128))
    codes, r = mxfp4.to_e4m3(t)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (3, 5, 128) and r.shape == (3, 5, 1)
    assert torch.equal(r, t.scales.long().amax(-1, keepdim=True))
    assert mxfp4.e4m3_exact(t).all().item() == exact, why
    got, want = mxfp4.from_e4m3(codes, r), mxfp4.dequantize(t, torch.float64)
    if exact:
        assert torch.equal(got, want), why
    else:  # the documented result: that group recodes as zeros (each weight at most 6 * 2^(r - 142))
        assert (got[..., 32:64] == 0).all(), why
        assert (want[..., 32:64].abs() <= torch.ldexp(torch.tensor(6.0, dtype=torch.float64), (r - 142).double())).all()
        assert torch.equal(got[..., :32], want[..., :32]) and torch.equal(got[..., 64:], want[..., 64:]), why


def test_w4a8_recoding_signs_zeros_and_nan_scales():
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)[None]        # every code, twice per group
    t = mxfp4.MXFP4Tensor(fp4.pack(codes), torch.tensor([[130, 255]], dtype=torch.uint8), (1, 64))
    e4m3, r = mxfp4.to_e4m3(t)
    assert r.item() == 255                                             # a NaN scale is the row's largest byte
    assert torch.isnan(mxfp4.from_e4m3(e4m3, r)[0, 32:]).all()
    ok = mxfp4.MXFP4Tensor(t.data, torch.tensor([[130, 127]], dtype=torch.uint8), (1, 64))
    e4m3, r = mxfp4.to_e4m3(ok)
    assert torch.equal(mxfp4.from_e4m3(e4m3, r), mxfp4.dequantize(ok, torch.float64))
    assert (e4m3.view(torch.uint8)[0, 8] == 0).item()                  # -0 recodes as +0 (the same products)


def test_gpt_oss_blocks_read_as_transformers_does():
    E, N, K = 2, 6, 64
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8)
    scales = torch.randint(118, 136, (E, N, K // 32), dtype=torch.uint8)
    t = mxfp4.from_gpt_oss(blocks, scales)
    got = mxfp4.dequantize(t, torch.float32)
    # The transformers recipe (integrations/mxfp4.py): low nibble -> even element, ldexp by scale - 127.
    lut = fp4.code_values()
    lo, hi = lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(E, N, K // 32, 32)
    expect = torch.ldexp(vals, (scales.long() - 127)[..., None].float()).reshape(E, N, K)
    assert torch.equal(got, expect)
    b2, s2 = mxfp4.to_gpt_oss(t)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)
    with pytest.raises(ValueError, match="scales must have shape"):
        mxfp4.from_gpt_oss(blocks, scales[..., :1])


# ------------------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("quantize,scale_shape", [
    (fp8.quantize_per_tensor, ()), (fp8.quantize_per_channel, (200, 1)),
    (fp8.quantize_blocks, (2, 3)), (fp8.quantize_groups, (200, 3)),
])
def test_fp8_granularities(quantize, scale_shape):
    w = torch.randn(200, 300) * 5
    w[:128, :128] = 0                                                 # an all-zero block / groups
    t = quantize(w)
    assert t.scale.shape == scale_shape and t.data.dtype == torch.float8_e4m3fn
    deq = fp8.dequantize(t, torch.float32)
    assert (deq[:128, :128] == 0).all() if t.granularity == "block" else True
    assert ((deq - w).norm() / w.norm()).item() < 0.04                # e4m3: 3 mantissa bits
    assert t.data.float().abs().max().item() == 448.0                 # each scale maps its max to 448


def test_fp8_block_scales_are_block_maxima():
    w = torch.randn(2, 256, 130)
    t = fp8.quantize_blocks(w)
    assert t.scale.shape == (2, 2, 2)
    assert t.scale[1, 0, 1].item() == pytest.approx(w[1, :128, 128:].abs().max().item() / 448, rel=1e-7)
    with pytest.raises(ValueError, match="NaN or Inf"):
        fp8.quantize_groups(torch.tensor([float("nan")]))


def test_nvfp4_saturates_scales_at_448_and_codes_at_6():
    x = torch.ones(1, 16)
    t = nvfp4.quantize(x, global_scale=10000.0)                     # 10000 / 6 > 448: the scale saturates
    assert t.scales.float().item() == 448.0
    assert (fp4.unpack(t.data) == 7).all()                           # 10000 / 448 = 22 > 6: codes saturate


def test_quantize_experts_equals_whole_stack_quantization():
    from moekit.formats import quantize_experts

    w = torch.randn(3, 16, 64)
    a, b = quantize_experts(w, "nvfp4"), nvfp4.quantize(w, scale_dims=1)
    assert torch.equal(a.data, b.data) and torch.equal(a.global_scale, b.global_scale)
    assert torch.equal(nvfp4.dequantize(a), nvfp4.dequantize(b))
    a, b = quantize_experts(w, "mxfp4"), mxfp4.quantize(w)
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
    w = torch.randn(3, 136, 200)                                     # partial 128-blocks both ways
    for fmt, whole in (("fp8_block", fp8.quantize_blocks), ("fp8_channel", fp8.quantize_per_channel)):
        a, b = quantize_experts(w, fmt), whole(w)
        assert a.granularity == b.granularity and torch.equal(a.scale, b.scale)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    a = quantize_experts(w, "fp8_tensor")                            # one scale per expert
    assert a.scale.shape == (3,) and all(torch.equal(a.data[e].view(torch.uint8), fp8.quantize_per_tensor(w[e]).data.view(torch.uint8))
                                         for e in range(3))
    with pytest.raises(ValueError, match="weight_format must be"):
        quantize_experts(w, "fp8")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block", "fp8_channel", "fp8_tensor"])
def test_expert_of_a_quantized_stack_is_its_slice_of_the_whole_dequantization(fmt):
    # references dequantize one expert at a time (a DeepSeek-V3 stack never exists in float)
    from moekit.formats import dequantize, expert, quantize_experts

    w = torch.randn(5, 48, 256)
    q = quantize_experts(w, fmt)
    whole = dequantize(q)
    for e in (0, 3, 4):
        assert torch.equal(expert(q, e), whole[e]), e
    assert expert(w, 2) is not None and torch.equal(expert(w, 2), w[2])
    with pytest.raises(TypeError, match="cannot take an expert"):
        expert(object(), 0)


@pytest.mark.parametrize("recipe", ["dense", "mxfp4", "nvfp4", "nvfp4_swizzled", "fp8_block", "fp8_channel",
                                    "fp8_tensor", "mxfp4_pairs", "nvfp4_swizzled_pairs"])
def test_a_weight_taken_apart_for_an_op_schema_comes_back_the_same(recipe):
    # torch.compile's ops carry weights as parts: every field must survive the trip, the layout flags included
    from moekit.formats import from_parts, prepare, quantize_experts, to_parts

    w = torch.randn(3, 64, 128)
    if recipe.startswith("nvfp4_swizzled"):
        q = nvfp4.quantize(w, swizzled=True, scale_dims=1)
    else:
        q = w if recipe == "dense" else quantize_experts(w, recipe.removesuffix("_pairs"))
    if recipe.endswith("_pairs"):
        q = prepare(q)
    back = from_parts(*to_parts(q))
    assert type(back) is type(q)
    if recipe == "dense":
        assert back is q
        return
    for field in ("data", "scales", "scale", "global_scale", "shape", "swizzled", "granularity", "layout"):
        if hasattr(q, field):
            a, b = getattr(q, field), getattr(back, field)
            assert (a is b) if isinstance(a, torch.Tensor) else a == b, field


def test_pairs_layout_puts_neighbouring_elements_in_nibbles_j_and_j_plus_4():
    # the prepared layout, bit for bit (docs/formats.md): nibble j of each little-endian int32 word holds element
    # 2j, nibble j + 4 element 2j + 1; every code in every position, rows of several words
    codes = (torch.arange(6 * 64).reshape(6, 64) * 7 + torch.arange(64) // 8) % 16
    packed = fp4.pack(codes.to(torch.uint8))
    pairs = fp4.to_pairs(packed)
    words = pairs.view(torch.int32).long() & 0xFFFFFFFF
    for j in range(4):
        assert torch.equal((words >> (4 * j)) & 15, codes.reshape(6, 8, 8)[..., 2 * j].long()), j
        assert torch.equal((words >> (4 * j + 16)) & 15, codes.reshape(6, 8, 8)[..., 2 * j + 1].long()), j
    assert torch.equal(fp4.from_pairs(pairs), packed)
    odd = torch.randint(0, 256, (3, 40), dtype=torch.uint8)[:, 3:35]      # strided, offset rows
    assert torch.equal(fp4.from_pairs(fp4.to_pairs(odd)), odd)
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        fp4.to_pairs(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(TypeError, match="packed"):
        fp4.to_pairs(torch.zeros(2, 8, dtype=torch.int32))


@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4", "nvfp4_swizzled"])
def test_prepared_stacks_hold_the_same_values_and_give_the_checkpoint_bytes_back(recipe):
    from moekit.formats import dequantize, expert, prepare, quantize_experts, unprepare

    w = torch.randn(4, 48, 256)
    q = nvfp4.quantize(w, swizzled=True, scale_dims=1) if recipe == "nvfp4_swizzled" else quantize_experts(w, recipe)
    p = prepare(q)
    assert p.layout == "pairs" and q.layout == "packed" and not torch.equal(p.data, q.data)
    assert p.scales is q.scales and prepare(p) is p and unprepare(q) is q    # one copy of the codes, made once
    assert torch.equal(unprepare(p).data, q.data) and torch.equal(p.codes(), q.codes())
    assert torch.equal(dequantize(p), dequantize(q)) and torch.equal(expert(p, 3), expert(q, 3))
    if recipe == "mxfp4":
        assert all(torch.equal(a, b) for a, b in zip(mxfp4.to_gpt_oss(p), mxfp4.to_gpt_oss(q)))
        assert torch.equal(mxfp4.to_e4m3(p)[0].view(torch.uint8), mxfp4.to_e4m3(q)[0].view(torch.uint8))
    else:
        assert torch.equal(nvfp4.to_modelopt(p)["weight"], q.data)
    dense, fp8_stack = torch.randn(2, 8, 128), quantize_experts(torch.randn(2, 8, 128), "fp8_block")
    assert prepare(dense) is dense and prepare(fp8_stack) is fp8_stack
    with pytest.raises(ValueError, match="layout must be one of"):
        mxfp4.MXFP4Tensor(q.data, q.scales, q.shape, "paired") if recipe == "mxfp4" else \
            nvfp4.NVFP4Tensor(q.data, q.scales, q.global_scale, q.shape, q.swizzled, "paired")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nvfp4_without_the_finite_check_keeps_a_bad_value_in_its_block(bad):
    # the torch backend rounds activations with check_finite=False: a NaN made the global scale 1 (every other block
    # rounded to zero) and an Inf made it 0 (every value NaN); now the other blocks quantize as without it
    x = torch.randn(4, 64)
    clean = nvfp4.quantize(x)
    x[1, 20] = bad
    q = nvfp4.quantize(x, check_finite=False)
    assert torch.equal(q.global_scale, clean.global_scale)
    got, want = nvfp4.dequantize(q, torch.float32), nvfp4.dequantize(clean, torch.float32)
    block = torch.zeros(4, 64, dtype=torch.bool)
    block[1, 16:32] = True
    assert torch.equal(got[~block], want[~block]) and got[block].isnan().all()


@pytest.mark.parametrize("bad", [0.0, -1e-3, float("inf"), float("nan")])
def test_from_modelopt_refuses_a_global_scale_that_is_not_finite_and_positive(bad):
    # 0 zeroed every weight, a negative scale flipped their signs, Inf and NaN made them NaN: all without an error
    q = nvfp4.quantize(torch.randn(2, 32))
    with pytest.raises(ValueError, match="weight_scale_2 must be finite and > 0"):
        nvfp4.from_modelopt(q.data, q.scales, torch.tensor(bad))
    with pytest.raises(ValueError, match="weight_scale_2 must be a scalar or one per expert"):
        nvfp4.from_modelopt(q.data, q.scales, torch.ones(2, 2))


def test_quantized_tensors_compare_by_identity_and_empty_stacks_prepare():
    # == compared the fields' tensors elementwise and raised ("Boolean value of Tensor ... is ambiguous"); K = 0
    # stacks, which the quantizers make, failed to prepare
    from moekit.formats import prepare

    a, b = mxfp4.quantize(torch.randn(2, 32)), mxfp4.quantize(torch.randn(2, 32))
    assert a == a and a != b and a in [a] and b not in [a]
    for q in (nvfp4.quantize(torch.randn(3, 0)), mxfp4.quantize(torch.randn(0, 32))):
        assert prepare(q).shape == q.shape and prepare(q).layout == "pairs"


def test_mxfp4_large_stacks_dequantize_an_expert_at_a_time_to_the_same_values(monkeypatch):
    # decoding a whole stack at once held about 6x its output in fp32 temporaries (gpt-oss-120b: ~28 GB per stack)
    from moekit.formats import prepare

    t = mxfp4.quantize(torch.randn(3, 8, 64))
    t.scales[1, 2, 0] = 255                                      # a NaN block in the middle expert
    whole = mxfp4.dequantize(t, torch.float32)
    monkeypatch.setattr(mxfp4, "_WHOLE_STACK_BYTES", 16)
    for w in (t, prepare(t)):
        assert torch.equal(mxfp4.dequantize(w, torch.float32).nan_to_num(7.0), whole.nan_to_num(7.0))
