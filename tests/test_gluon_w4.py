"""The Gluon producer/consumer MXFP4 GEMM prototype (gluon_w4.py and _gluon_w4_kernels.py in benchmarks/experiments).

Gluon has no CPU interpreter, so the CPU tests check what can be checked without a GPU: the decode warps' bit
arithmetic (emulated with the same integer operations) against moekit.formats.mxfp4.dequantize for every code
under every scale byte, bit for bit; the load-time layouts' exact round trips; and that every candidate config builds
for sm_90 without spills (a subprocess with the fake sm_90 driver, about 10-30 s). The GPU tests run the kernel
against float64 at a small shape with partial tiles and at gpt-oss-120b's sizes."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))

import gluon_w4 as gw  # noqa: E402

from moekit.formats import mxfp4  # noqa: E402

DECODES = ("bits", "cvt", "words")


def _all_codes_all_scales(scale_bytes: torch.Tensor, k: int = 64) -> mxfp4.MXFP4Tensor:
    """One row per scale byte, each of its K/32 groups holding every code twice (in a row-dependent rotation, so
    that every code meets every position of a word)."""
    rows = scale_bytes.numel()
    codes = (torch.arange(k)[None, :] + torch.arange(rows)[:, None]) % 16
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = scale_bytes.to(torch.uint8)[:, None].expand(rows, k // 32).contiguous()
    return mxfp4.MXFP4Tensor(data, scales, (rows, k))


def _assert_same_bits(got: torch.Tensor, ref: torch.Tensor) -> None:
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan)
    same = got.view(torch.int16) == ref.view(torch.int16)
    bad = ~same & ~nan
    assert not bad.any(), (f"{int(bad.sum())} weights differ, first at {bad.nonzero()[0].tolist()}: "
                           f"{got[bad][:4].tolist()} vs {ref[bad][:4].tolist()}")


def test_e2m1_bits_read_as_value_times_2_pow_minus_126():
    """The brief's identity: ((n & 7) << 6) | ((n & 8) << 12) as bf16 bits is e2m1(n) * 2^-126, every code (code 1
    is the bf16 subnormal 2^-127; code 8 is -0)."""
    n = torch.arange(16, dtype=torch.int32)
    v = gw.bf16_of_bits(((n & 7) << 6) | ((n & 8) << 12))
    want = torch.ldexp(torch.tensor(gw.E2M1, dtype=torch.float64), torch.tensor(-126.0, dtype=torch.float64))
    assert torch.equal(v.double(), want)
    assert torch.equal(torch.signbit(v), torch.signbit(torch.tensor(gw.E2M1)))


@pytest.mark.parametrize("decode", DECODES)
def test_decode_exact_every_code_every_scale(decode):
    """Every code under every scale byte 0..255 (255: NaN), bit for bit against dequantize: the prepared weights pick
    the second multiply (FULL_RANGE) by themselves where a byte passes 128."""
    w = _all_codes_all_scales(torch.arange(256))
    p = gw.prepare(w, decode)
    assert p.full_range == (decode != "cvt")
    _assert_same_bits(gw.emulate_decode(p), mxfp4.dequantize(w, torch.bfloat16))


@pytest.mark.parametrize("decode", ("bits", "words"))
def test_decode_one_multiply_up_to_scale_128(decode):
    """The fast path (one multiply by 2^(s - 1)) is exact for every byte it is chosen for, 0..128."""
    w = _all_codes_all_scales(torch.arange(gw.FAST_SCALE_MAX + 1))
    p = gw.prepare(w, decode)
    assert not p.full_range
    _assert_same_bits(gw.emulate_decode(p), mxfp4.dequantize(w, torch.bfloat16))


@pytest.mark.parametrize("decode", DECODES)
def test_decode_random_weights(decode):
    """gpt-oss-like random weights at a real K: codes and scales in every position of the tiles."""
    w = gw.random_mxfp4(96, 2880, "cpu")
    p = gw.prepare(w, decode)
    assert not p.full_range
    _assert_same_bits(gw.emulate_decode(p), mxfp4.dequantize(w, torch.bfloat16))


def test_prepared_layouts_round_trip():
    data = torch.randint(0, 256, (64, 2880 // 2), dtype=torch.uint8)
    scales = torch.randint(0, 256, (64, 2880 // 32), dtype=torch.uint8)
    words = gw.prepare_codes(data)
    assert words.dtype == torch.int32 and tuple(words.shape) == (64, 2880 // 8)
    assert torch.equal(gw.unprepare_codes(words), data)
    assert torch.equal(gw.unprepare_scales(gw.prepare_scales(scales)), scales)
    assert gw.prepare_scales(scales).is_contiguous()


def test_prepared_words_place_pairs_16_bits_apart():
    """Codes 2j and 2j + 1 of each 8 land in nibbles j and 4 + j of their word."""
    codes = torch.arange(8, dtype=torch.uint8)  # code value = its k
    data = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 4)
    word = int(gw.prepare_codes(data)[0, 0]) & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 15 for i in range(8)]
    assert nibbles == [0, 2, 4, 6, 1, 3, 5, 7]


def test_configs_fit_and_reject():
    for cfg in gw.candidates():
        for n, k in gw.SHAPES.values():
            gw.check_config(cfg, n, k)
            assert gw.smem_bytes(cfg) < 227 * 1024
    with pytest.raises(ValueError):
        gw.check_config(gw.Config(bk=128), 5760, 2880)
    with pytest.raises(ValueError):
        gw.check_config(gw.Config(sub=48), 5760, 2880)


def _gluon_build_unavailable() -> str | None:
    import triton
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return f"no ptxas in the triton wheel ({ptxas})"
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return "this triton has no Gluon"
    return None


def compile_only_builds(script: str, builds: int) -> None:
    """``benchmarks/experiments/<script> --compile-only`` (a process: the fake sm_90 driver) built ``builds`` kernels,
    none failed or spilled."""
    why = _gluon_build_unavailable()
    if why:
        pytest.skip(why)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "experiments" / script), "--compile-only"],
                          capture_output=True, text=True, timeout=240, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok", "FAIL", "SPILL"))]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(lines) == builds
    assert all(ln.startswith("ok") and " spill    0 B" in ln for ln in lines), "\n".join(lines)


def test_compile_only_builds_sm90_without_spills():
    compile_only_builds("gluon_w4.py", len(gw.candidates()) * len(gw.SHAPES))


# ----------------------------------------------------------------------------------------------------------------
# GPU


def _gpu_case(m, n, k, decode, cfg=None, scale_bytes=gw.SCALE_BYTES):
    dev = torch.device("cuda")
    w = gw.random_mxfp4(n, k, dev, scale_bytes)
    a = (torch.randn(m, k, device=dev) * 0.5).to(torch.bfloat16)
    p = gw.prepare(w, decode)
    cfg = cfg or gw.Config(decode=decode)
    gw.check_config(cfg, n, k)
    err, c = gw.run_checked(cfg, a, p, gw.reference64(a, w))
    assert err <= gw.MAX_REL, f"{cfg.label()} M={m} N={n} K={k}: max rel error {err:.3e}"
    # the decode on the GPU writes exactly the emulated weights: C equals A @ emulated W^T up to fp32 summation
    # (the first 256 weight rows: the CPU emulation of a whole gpt-oss matrix takes seconds)
    rows = min(n, 256)
    w_cpu = mxfp4.MXFP4Tensor(w.data[:rows].cpu(), w.scales[:rows].cpu(), (rows, k))
    ref_emul = a.double() @ gw.emulate_decode(gw.prepare(w_cpu, decode)).double().t().to(dev)
    assert gw.rel_error(c[:, :rows], ref_emul) <= 4e-3
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("decode", DECODES)
def test_gpu_small_partial_tiles(decode):
    """M and N not multiples of the tile (TMA zero fill, masked stores), K of 4 steps."""
    _gpu_case(192, 320, 256, decode)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ("bits", "words"))
def test_gpu_full_range_scales(decode):
    """Scale bytes past 128: the second multiply."""
    p = _gpu_case(128, 256, 512, decode, scale_bytes=(100, 140))
    assert p.full_range


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gw.candidates(), ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("shape", list(gw.SHAPES))
def test_gpu_gpt_oss_sizes(cfg, shape):
    n, k = gw.SHAPES[shape]
    _gpu_case(256, n, k, cfg.decode, cfg)
