"""The in-kernel decoders of 4-bit weights (kernels/moe_gemm.py) against torch's own conversions,
for every byte: E2M1 codes, E8M0 exponents (MXFP4), E4M3 scales (NVFP4)."""

import pytest
import torch
import triton
import triton.language as tl

from moekit import _triton
from moekit.experts.triton_backend import paired_k
from moekit.formats import fp4
from moekit.experts.kernels import moe_gemm, moe_gemv

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@triton.jit
def _decode_all(b_ptr, out_ptr, WHICH: tl.constexpr):
    offs = tl.arange(0, 256)
    b = tl.load(b_ptr + offs)
    if WHICH == 0:
        v = moe_gemm._e2m1_values((b & 15).to(tl.int32))
    elif WHICH == 1:
        v = moe_gemm._e8m0_values(b)
    elif WHICH == 2:
        v = moe_gemm._e4m3_values(b)
    elif WHICH == 3:
        v = moe_gemm._e8m0_bf16(b).to(tl.float32)
    else:
        v = moe_gemm._e4m3_bf16(b).to(tl.float32)
    tl.store(out_ptr + offs, v)


def _run(which, device):
    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    out = torch.empty(256, dtype=torch.float32, device=device)
    _decode_all[(1,)](b, out, WHICH=which)
    return b, out.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_decoder(device):
    b, got = _run(0, device)
    assert torch.equal(got, fp4.decode(b.cpu() & 15))


@pytest.mark.parametrize("device", DEVICES)
def test_e8m0_decoder(device):
    b, got = _run(1, device)
    expect = b.cpu().view(torch.float8_e8m0fnu).float()     # 0 -> 2^-127 (subnormal), 255 -> NaN
    assert torch.equal(got[:255], expect[:255]) and torch.isnan(got[255]) and got[0].item() == 2.0 ** -127


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_decoder(device):
    b, got = _run(2, device)
    expect = b.cpu().view(torch.float8_e4m3fn).float()
    nan = torch.isnan(expect)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], expect[~nan])


@pytest.mark.gpu
def test_bf16_scale_decoders_are_exact_for_every_byte():
    """The tensor-core 4-bit tiles decode their scales straight to bf16 bits (GPU only: the
    interpreter's bf16 arithmetic on bit-built values is not faithful)."""
    b, e8m0 = _run(3, "cuda")
    expect = b.cpu().view(torch.float8_e8m0fnu).float()
    assert torch.equal(e8m0[:255], expect[:255]) and torch.isnan(e8m0[255]) and e8m0[0].item() == 2.0 ** -127
    b, e4m3 = _run(4, "cuda")
    expect = b.cpu().view(torch.float8_e4m3fn).float()
    nan = torch.isnan(expect)
    assert torch.equal(torch.isnan(e4m3), nan) and torch.equal(e4m3[~nan], expect[~nan])


@triton.jit
def _w4_tile_all(w_ptr, s_ptr, out_ptr, FORMAT: tl.constexpr, DTYPE: tl.constexpr, HALVES_ASM: tl.constexpr,
                 WORDS: tl.constexpr = False, PAIRS: tl.constexpr = False):
    rows = tl.arange(0, 16).to(tl.int64)
    tile = moe_gemm._w4_tile(w_ptr, s_ptr, None, rows, rows < 16, 0, 128, 64, 128 // (32 if FORMAT == 1 else 16),
                             FORMAT, 128, DTYPE, HALVES_ASM, WORDS=WORDS, PAIRS=PAIRS)
    tl.store(out_ptr + rows[:, None] * 128 + tl.arange(0, 128)[None, :], tile)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", fp4.LAYOUTS)  # the byte layouts: the byte decodes reorder "pairs", words do not
@pytest.mark.parametrize("fmt,dtype,why", [
    ("nvfp4", torch.bfloat16, "the bf16-bits decode (code * 2^-126, times 2^126, times the scale) the GPU kernels run"),
    ("mxfp4", torch.bfloat16, "the bf16-bits decode with E8M0 scales (exact for every exponent)"),
    ("nvfp4", torch.float32, "the fp32 decode (interpreter, fp32 activations)"),
    ("mxfp4", torch.float16, "the fp32 decode rounded to fp16"),
    ("nvfp4", "words", "the bf16 decode a word of 8 codes at a time, one multiply (tile = weight * 2^-8)"),
    ("mxfp4", "words", "the bf16 decode a word of 8 codes at a time, two multiplies"),
])
def test_four_bit_weight_tile_is_exact_for_every_code_and_scale(device, layout, fmt, dtype, why):
    from moekit.formats import mxfp4, nvfp4

    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    words = dtype == "words"
    dtype = torch.bfloat16 if words else dtype
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter's bf16 arithmetic on bit-built values is not faithful (subnormals flushed, "
                    "products wrong); the kernels never take this path there")
    # 16 rows x 64 bytes: every byte value 4 times; scales: every finite positive E4M3 (NVFP4) or a
    # spread of exponents that stays in range of the output dtype (MXFP4)
    packed = torch.arange(1024, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(16, 64)
    if fmt == "nvfp4":
        scales = torch.arange(128, dtype=torch.int32).remainder(127).to(torch.uint8).reshape(16, 8)  # 0x7F is NaN
        t = nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.ones(()), (16, 128))
        expect = nvfp4.dequantize(t, torch.float64)
    else:
        scales = (torch.arange(64, dtype=torch.int32).remainder(20) + 117).to(torch.uint8).reshape(16, 4)
        expect = mxfp4.dequantize(mxfp4.MXFP4Tensor(packed, scales, (16, 128)), torch.float64)
    out = torch.full((16, 128), float("nan"), dtype=dtype, device=device)
    tl_dtype = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float16: tl.float16}[dtype]
    _w4_tile_all[(1,)](fp4.to_layout(packed, layout).to(device), scales.to(device), out,
                       FORMAT=1 if fmt == "mxfp4" else 2, DTYPE=tl_dtype, HALVES_ASM=device == "cuda", WORDS=words,
                       PAIRS=layout == "pairs")
    if words:  # (NVFP4's words carry 2^-8)
        expect = expect / (moe_gemm.W4_WORDS_NVFP4_SHIFT.value if fmt == "nvfp4" else 1)
    if words and layout == "packed":  # the word decode's column order, which paired_k gives the other operand
        expect = paired_k(expect)
    assert torch.equal(out.cpu().double(), expect.to(dtype).double()), why


@triton.jit
def _paired_columns_all(out_ptr):
    p = tl.arange(0, 64)
    tl.store(out_ptr + p, moe_gemm._paired_columns(p))


@pytest.mark.parametrize("device", DEVICES)
def test_paired_k_is_the_word_decoded_tiles_column_order(device):
    # the host copies x into the word-decoded tiles' K order (paired_k) and GEMM1 writes h in it (H_PAIRED, through
    # _paired_columns): both must be the one order, a permutation inside each 8 columns
    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    cols = torch.full((64,), -1, dtype=torch.int32, device=device)
    _paired_columns_all[(1,)](cols)
    cols = cols.cpu().long()
    assert cols[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal((cols // 8), torch.arange(64) // 8) and torch.equal(cols.sort().values, torch.arange(64))
    x = torch.randn(3, 5, 64 + 3)[:, 1:, 3:]  # batched [E, M, K], rows strided and offset
    got = paired_k(x)
    assert got.is_contiguous() and torch.equal(got, x[..., cols])


@triton.jit
def _word_bits_all(q_ptr, out_ptr):
    offs = tl.arange(0, 256)
    q = tl.load(q_ptr + offs)
    q8 = q >> 8
    for i in tl.static_range(4):
        tl.store(out_ptr + i * 256 + offs, moe_gemm._w4_word_bits(q, q8, i))


@pytest.mark.parametrize("device", DEVICES)
def test_four_bit_word_bits_place_codes_as_the_byte_decode(device):
    # the word decode's integer part (runs in the interpreter too): code i of a word in the low half of t_i and
    # code i + 4 in its high half, with the bits the byte decode gives each code; every code in every slot
    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    w, j = torch.arange(256)[:, None], torch.arange(8)[None, :]
    codes = (w + 3 * j + (w // 16) * j) % 16               # code j of word w (bits 4j..4j+3): all 16 in each slot
    int32 = lambda u: torch.where(u >= 2 ** 31, u - 2 ** 32, u).to(torch.int32)  # noqa: E731 - 32-bit patterns
    words = int32((codes << (4 * torch.arange(8))).sum(dim=1))
    out = torch.full((4, 256), -1, dtype=torch.int32, device=device)
    _word_bits_all[(1,)](words.to(device), out)
    one = lambda c: ((c & 8) << 12) | ((c & 7) << 6)  # noqa: E731 - the byte decode's bits of one code
    expect = int32(torch.stack([one(codes[:, i]) | (one(codes[:, i + 4]) << 16) for i in range(4)]))
    assert torch.equal(out.cpu(), expect)


@triton.jit
def _gemv_group_sums(w_ptr, s_ptr, x_ptr, out_ptr, FORMAT: tl.constexpr, HALVES_ASM: tl.constexpr,
                     PAIRS: tl.constexpr):
    # 32 rows x one 256-wide K chunk: the CUDA-core decode kernels' per-group sums, before their K loop adds them
    rows = tl.arange(0, 32)
    GROUPS: tl.constexpr = 256 // (32 if FORMAT == 1 else 16)
    w, s = moe_gemv._load_chunk(w_ptr, s_ptr, rows, rows < 32, 0, 256, 32, 1, GROUPS, FORMAT, 256)
    xv = moe_gemv._load_x(x_ptr, 0, 256, 1, True, FORMAT, 256, PAIRS)
    part = moe_gemv._chunk_sums(w, s, xv, FORMAT, HALVES_ASM)
    tl.store(out_ptr + rows[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :], part)


def _every_scale(fmt, packed):
    """32 rows x 256 codes of ``packed`` bytes under every scale byte (MXFP4 0..255 once, NVFP4's E4M3 bytes twice):
    (scale bytes, the float64 weights, the group size)."""
    from moekit.formats import mxfp4, nvfp4

    if fmt == "mxfp4":
        scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(32, 8)
        return scales, mxfp4.dequantize(mxfp4.MXFP4Tensor(packed, scales, (32, 256)), torch.float64), 32
    scales = torch.arange(512, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(32, 16)
    t = nvfp4.NVFP4Tensor(packed, scales.view(torch.float8_e4m3fn), torch.ones(()), (32, 256))
    return scales, nvfp4.dequantize(t, torch.float64), 16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", fp4.LAYOUTS)  # the activations arranged for either byte layout (_load_x)
@pytest.mark.parametrize("fmt,why", [
    ("mxfp4", "every E8M0 scale 0..255 once: 2^-127 (subnormal), 2^114..2^127 (whose product with the fp16 "
              "codes' 2^14 leaves fp32), NaN"),
    ("nvfp4", "every E4M3 scale byte twice, NaN codes included"),
])
def test_gemv_group_sums_for_every_scale(device, layout, fmt, why):
    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    g = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (32, 128), generator=g, dtype=torch.int32).to(torch.uint8)
    # activations small enough that a group sum times 2^127 stays inside fp32
    x = (torch.rand(256, generator=g) * 2 - 1) * 2.0 ** -8
    scales, w, group = _every_scale(fmt, packed)
    expect = (w * x.double()).reshape(32, 256 // group, group).sum(-1)
    out = torch.full((32, 256 // group), float("nan"), device=device)
    _gemv_group_sums[(1,)](fp4.to_layout(packed, layout).view(torch.int32).to(device), scales.to(device), x.to(device),
                           out, FORMAT=1 if fmt == "mxfp4" else 2, HALVES_ASM=device == "cuda",
                           PAIRS=layout == "pairs")
    got = out.cpu().double()
    nan = torch.isnan(expect)
    assert torch.equal(torch.isnan(got), nan), why
    # fp32 products and sums of 16 or 32 terms: within a few ulps of the group's largest term, or of
    # fp32's subnormal spacing (2^-149) under the smallest scales
    bound = (w.abs() * x.double().abs()).reshape(32, 256 // group, group).amax(-1) * 2.0 ** -20 + 2.0 ** -144
    assert torch.all((got - expect).abs()[~nan] <= bound[~nan]), why


@triton.jit
def _gemv_group_sums_fp16x2(w_ptr, s_ptr, x_ptr, e_ptr, out_ptr, FORMAT: tl.constexpr, HALVES_ASM: tl.constexpr):
    # the same group sums from the packed decode: fp16x2 products on activations prepared by scaled_fp16
    rows = tl.arange(0, 32)
    GROUPS: tl.constexpr = 256 // (32 if FORMAT == 1 else 16)
    w, s = moe_gemv._load_chunk(w_ptr, s_ptr, rows, rows < 32, 0, 256, 32, 1, GROUPS, FORMAT, 256)
    pairs, factor = moe_gemv._load_x_fp16(x_ptr, e_ptr, 0, 256, w, FORMAT, 256)
    part = moe_gemv._chunk_sums_fp16x2(w, s, pairs, factor, FORMAT, HALVES_ASM)
    tl.store(out_ptr + rows[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :], part)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", fp4.LAYOUTS)  # scaled_fp16 pairs the activations for either byte layout
@pytest.mark.parametrize("fmt,why", [
    ("mxfp4", "every E8M0 scale 0..255 once (2^-127 .. 2^127, NaN), activation groups 2^-100 .. 2^-20"),
    ("nvfp4", "every E4M3 scale byte twice, NaN codes included, activation groups 2^-100 .. 2^-20"),
])
def test_packed_group_sums_for_every_scale(device, layout, fmt, why):
    """fp16x2 products and fp16 sums inside a group: within 2^-9 of the group's sum of |terms| (32 roundings of
    2^-11 at most), whatever the scale and the activations' magnitude; sums below fp32's normal range (2^-126)
    may flush to zero (a scale and an activation exponent both near 2^-127 multiply out of fp32)."""
    from moekit.experts.triton_backend import scaled_fp16

    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    g = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (32, 128), generator=g, dtype=torch.int32).to(torch.uint8)
    # each 32-group of activations at its own magnitude: the exponent bytes carry it, not the fp16 values (groups
    # below 2^-112 are held with fewer bits: test_scaled_fp16_activations)
    x = ((torch.rand(256, generator=g) * 2 - 1) * 2.0 ** torch.linspace(-40, 40, 8).repeat_interleave(32)
         * 2.0 ** -60).to(torch.bfloat16)
    scales, w, group = _every_scale(fmt, packed)
    if fmt == "nvfp4":
        w = w * 2.0 ** 60  # the activations' 2^-60 back: NVFP4's scales are too small to keep the sums inside fp32
    pairs, exps = scaled_fp16(x.reshape(1, 256).to(device), w4_pairs=layout == "pairs")
    terms = (w * x.double()).reshape(32, 256 // group, group)
    expect = terms.sum(-1)
    out = torch.full((32, 256 // group), float("nan"), device=device)
    _gemv_group_sums_fp16x2[(1,)](fp4.to_layout(packed, layout).view(torch.int32).to(device), scales.to(device),
                                  pairs.view(torch.int32), exps, out, FORMAT=1 if fmt == "mxfp4" else 2,
                                  HALVES_ASM=device == "cuda")
    got = out.cpu().double()
    if fmt == "nvfp4":
        got = got * 2.0 ** 60
    nan = torch.isnan(expect)
    assert torch.equal(torch.isnan(got), nan), why
    finite = ~nan & torch.isfinite(expect) & (terms.abs().sum(-1) < 2.0 ** 127)
    bound = terms.abs().sum(-1) * 2.0 ** -9 + 2.0 ** -126
    assert torch.all((got - expect).abs()[finite] <= bound[finite]), why


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", fp4.LAYOUTS)
@pytest.mark.parametrize("K,multiple,dtype,why", [
    (256, 32, torch.bfloat16, "whole groups; bf16 values held exactly"),
    (80, 32, torch.float16, "K ends mid-program: 96 slots, the last 16 zeros"),
    (40, 32, torch.float32, "fp32 rounds to fp16's 11 bits under its group's exponent"),
    (80, 512, torch.bfloat16, "padded to a decode chunk: 432 zeros past K, every padding group's byte written"),
])
def test_scaled_fp16_activations(device, layout, K, multiple, dtype, why):
    from moekit.experts.triton_backend import scaled_fp16

    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, K + 1, generator=g)[:, 1:] * 2.0 ** torch.randint(-60, 60, (5, K), generator=g)
    x[1] = 0.0  # all-zero rows: every group's exponent is the smallest
    x[2, :8] = float("inf")
    x[3, 3] = float("nan")
    x = x.to(dtype)
    pairs, exps = scaled_fp16(x.to(device), multiple, w4_pairs=layout == "pairs")
    kp = -(-K // multiple) * multiple
    assert pairs.shape == (5, kp) and exps.shape == (5, kp // 32), why
    assert torch.all(exps.cpu()[:, -(-K // 32):] == 1), why  # padding groups: finite factors for unmasked readers
    slot = torch.arange(kp)
    # pair-major per 32-block: int32 pair 4j + w holds the activations of nibbles j and j + 4 of word w, elements
    # 8w + j and 8w + j + 4 ("packed" bytes) or 8w + 2j and 8w + 2j + 1 ("pairs")
    pair = (slot % 32) // 2
    if layout == "pairs":
        k = (slot & -32) + 8 * (pair % 4) + 2 * (pair // 4) + (slot & 1)
    else:
        k = (slot & -32) + 8 * (pair % 4) + pair // 4 + 4 * (slot & 1)
    wide = torch.zeros(5, kp + 8, dtype=torch.float64)
    wide[:, :K] = x.double()
    values = wide[:, k]  # x in the pair order, zeros past K
    amax = values.reshape(5, -1, 32).abs().nan_to_num(0.0).amax(-1)
    back = pairs.cpu().double() * torch.pow(2.0, exps.cpu().double() - 127).repeat_interleave(32, 1)
    assert torch.equal(torch.isnan(back), torch.isnan(values)), why
    ok = ~torch.isnan(values)
    group_max = amax.repeat_interleave(32, 1)
    tol = 0.0 if dtype == torch.bfloat16 else 2.0 ** -11  # fp16's rounding of anything finer than bf16
    # exact (or rounded at fp16's 11 bits) down to 2^-24 of the group's largest, fp16's subnormal floor below
    err = (back - values).abs()[ok]
    bound = (values.abs() * tol + group_max * 2.0 ** -38)[ok]
    assert torch.all((err <= bound) | torch.isinf(values[ok])), why
    assert torch.equal(back[1], torch.zeros(kp, dtype=torch.float64)), why
