"""The stream-and-decode microbenchmark's kernels (benchmarks/_stream_decode_kernels.py) against float64, through
Triton's interpreter at tiny shapes, and its load-time layout's exact round trip (benchmarks/stream_decode.py).

The interpreter runs the pure-tl branches (no inline PTX); the GPU run checks every timed config at real size."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _stream_decode_kernels as kern  # noqa: E402
import stream_decode as sd  # noqa: E402

from moekit.formats import mxfp4  # noqa: E402

E, N, K, SLOTS = 6, 32, 320, 3  # K/32 = 10 groups: chunks of 4 and 8 leave a masked tail, records of 2, 5, 10
IDS = (4, 1, 3)
# fp32 products of exact weights and activations: only summation order separates them from float64
F32_TOL = (2e-6, 5e-7)
# fp16x2 products: each group's 32 products summed in fp16 (activations scaled to [2^14, 2^15) per token)
H2_TOL = (4e-3, 1.5e-3)


def _weights(e=E, n=N, k=K, scale_lo=116, scale_hi=126):
    data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8)
    scales = torch.randint(scale_lo, scale_hi, (e, n, k // 32), dtype=torch.uint8)
    bias = torch.randn(e, n).to(torch.bfloat16)
    return data, scales, bias


def _run(cfg, x, data, scales, bias, ids, k=K):
    sd.check_config(cfg, data.shape[1], k)
    out = torch.full((len(ids), data.shape[1]), float("nan"))  # poisoned: every lane must be written
    op = sd.operand(cfg, data, scales)
    scr = sd.scratch(cfg, len(ids), data.shape[1], "cpu")
    if cfg.split > 1:
        scr[0].fill_(float("nan"))
    sd.launch(cfg, x, op, bias, ids, out, scr, k)
    return out, scr


CONFIGS = [
    # moekit's layout: a masked tail chunk (10 = 4 + 4 + 2 groups), whole K per program
    sd.Config("rows", "f32", tn=8, g=4),
    sd.Config("rows", "h2", tn=8, g=4),
    sd.Config("rows", "f32", tn=16, g=8, depth=0),
    sd.Config("rows", "h2", tn=16, g=4, depth=2),
    sd.Config("rows", "f32", tn=8, g=4, loop="dynamic", depth=0, stages=3),
    sd.Config("rows", "h2", tn=8, g=4, loop="dynamic", depth=1, stages=2),
    sd.Config("rows", "f32", tn=32, g=16),  # one chunk, six lanes of groups masked
    # prepared layout: records of 5 (a masked lane of 8), 2 and 10 groups
    sd.Config("tiles", "f32", tn=16, gc=5),
    sd.Config("tiles", "h2", tn=16, gc=5),
    sd.Config("tiles", "f32", tn=8, gc=2, depth=2),
    sd.Config("tiles", "h2", tn=8, gc=2, depth=0),
    sd.Config("tiles", "h2", tn=16, gc=10),
    sd.Config("tiles", "f32", tn=16, gc=5, loop="dynamic", depth=1),
    # split K: uneven parts (10 groups in 3 parts of 4, 4, 2; 5 records in 2 parts of 3, 2); both reductions
    sd.Config("rows", "f32", tn=8, g=4, split=3),
    sd.Config("rows", "h2", tn=8, g=2, split=3, reduce="pass"),
    sd.Config("rows", "h2", tn=16, g=4, split=2, depth=2),
    sd.Config("rows", "f32", tn=8, g=4, split=10, reduce="pass", loop="dynamic", depth=1),
    sd.Config("tiles", "f32", tn=16, gc=2, split=2),
    sd.Config("tiles", "h2", tn=16, gc=5, split=2, reduce="pass"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.layout}-{c.math}-{c.label().replace(' ', '_')}")
def test_kernel_matches_float64(cfg):
    data, scales, bias = _weights()
    ids = torch.tensor(IDS, dtype=torch.int32)
    x = torch.randn(K).to(torch.bfloat16)
    out, scr = _run(cfg, x, data, scales, bias, ids)
    ref = sd.reference(x, data, scales, bias, ids)
    assert torch.isfinite(out).all(), "a lane of the output was never written"
    max_rel, rms_rel = sd.rel_errors(out, ref)
    tol = H2_TOL if cfg.math == "h2" else F32_TOL
    assert max_rel <= tol[0] and rms_rel <= tol[1], (max_rel, rms_rel)
    if cfg.split > 1 and cfg.reduce == "last":
        assert int(scr[1].abs().sum()) == 0, "the split counters must be back at zero for the next call"
        out2, _ = _run(cfg, x, data, scales, bias, ids)  # fresh counters: the same bits (fixed summation order)
        assert torch.equal(out, out2)


@pytest.mark.parametrize("math", ["f32", "h2"])
def test_activation_dtypes_and_magnitudes(math):
    """fp32 and fp16 activations, and bf16 ones far from 1 (the fp16x2 path rescales per token)."""
    data, scales, bias = _weights()
    ids = torch.tensor((0, 5), dtype=torch.int32)
    cfg = sd.Config("rows", math, tn=8, g=4)
    tol = H2_TOL if math == "h2" else F32_TOL
    for x in (torch.randn(K), torch.randn(K).half(), (torch.randn(K) * 3e4).bfloat16(),
              (torch.randn(K) * 1e-30).bfloat16(), torch.randn(K).bfloat16() * (torch.rand(K) < 0.1)):
        out, _ = _run(cfg, x, data, scales, bias, ids)
        ref = sd.reference(x, data, scales, torch.zeros_like(bias), ids) + bias[ids.long()].double()
        max_rel, rms_rel = sd.rel_errors(out, ref)
        assert max_rel <= tol[0] and rms_rel <= tol[1], (x.dtype, float(x.abs().max()), max_rel, rms_rel)


def test_scale_extremes_decode_exactly():
    """Every scale byte 0 (2^-127, an fp32 subnormal) or 254 (2^127): the fp32 path keeps them exact."""
    data, _, _ = _weights(e=2, n=16, k=128)
    ids = torch.tensor((0, 1), dtype=torch.int32)
    bias = torch.zeros(2, 16)
    for byte in (0, 254):
        s = torch.full((2, 16, 4), byte, dtype=torch.uint8)
        # 2^127 stays finite in fp32 only with small products: codes 0 and 0.5, |x| <= 1e-3
        d = data & 0x11 if byte == 254 else data
        x = torch.randn(128).clamp(-1, 1) * (1e-3 if byte == 254 else 1.0)
        out, _ = _run(sd.Config("rows", "f32", tn=8, g=4), x, d, s, bias, ids, k=128)
        max_rel, rms_rel = sd.rel_errors(out, sd.reference(x, d, s, bias, ids))
        assert max_rel <= F32_TOL[0] and rms_rel <= F32_TOL[1], (byte, max_rel, rms_rel)


@pytest.mark.parametrize("tn,gc", [(16, 5), (8, 2), (16, 10), (32, 1), (16, 2)])
def test_prepared_layout_round_trip(tn, gc):
    data, scales, _ = _weights()
    buf = sd.prepare_tiles(data, scales, tn, gc)
    assert buf.dtype == torch.uint8 and buf.numel() == data.numel() + scales.numel()
    back_data, back_scales = sd.unprepare_tiles(buf, (E, N, K), tn, gc)
    assert torch.equal(back_data, data) and torch.equal(back_scales, scales)
    # the documented order: expert, row tile, record; in a record the codes (row-major) then the scales
    rec = tn * gc * 17
    first = buf[:rec]
    assert torch.equal(first[:gc * 16], data[0, 0, :gc * 16])
    assert torch.equal(first[tn * gc * 16:tn * gc * 16 + gc], scales[0, 0, :gc])
    if K // 32 > gc:  # the next record of the same row tile: the next groups of the same rows
        assert torch.equal(buf[rec:rec + gc * 16], data[0, 0, gc * 16:2 * gc * 16])
    else:  # one record per tile: the next one is the next row tile's
        assert torch.equal(buf[rec:rec + gc * 16], data[0, tn, :gc * 16])


def test_prepared_layout_refuses_misfit_shapes():
    data, scales, _ = _weights()
    with pytest.raises(ValueError):
        sd.prepare_tiles(data, scales, 12, 5)  # 12 does not divide 32 rows
    with pytest.raises(ValueError):
        sd.prepare_tiles(data, scales, 16, 3)  # 3 does not divide 10 groups
    with pytest.raises(ValueError):
        sd.check_config(sd.Config("tiles", "f32", tn=8, gc=5), N, K)  # 8 x 5 code rows: records not 16-byte aligned


def test_dequantize64_matches_moekit():
    data, scales, _ = _weights(scale_lo=0, scale_hi=256)  # every scale byte, NaN (255) included
    ours = sd.dequantize64(data, scales)
    theirs = mxfp4.dequantize(mxfp4.MXFP4Tensor(data, scales, (E, N, K)), torch.float64)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


def test_read_kernel_reads_every_word():
    words = torch.randint(-2**31, 2**31 - 1, (5000,), dtype=torch.int32)
    block, steps = 256, 4
    progs = -(-words.numel() // (block * steps))
    sink = torch.zeros(progs, dtype=torch.int32)
    kern.read_kernel[(progs,)](words, sink, words.numel(), BLOCK=block, STEPS=steps)
    expect = 0
    for w in words.tolist():
        expect ^= w
    got = 0
    for v in sink.tolist():
        got ^= v
    assert got == expect


def test_sweep_configs_are_valid():
    """Every config the GPU run will try fits gpt-oss-120b's shape (it would otherwise fail there, not here)."""
    space = sd.candidates()
    assert set(space) == set(sd.VARIANTS)
    for cfgs in space.values():
        for cfg in cfgs:
            sd.check_config(cfg, sd.ROWS13, sd.HIDDEN)


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton without its NVIDIA backend")
def test_first_configs_compile_for_sm90():
    """Each variant's first config (and the inline PTX) builds for the H200 through a fake driver, in a child process
    (this session runs kernels through the interpreter): GPU-only compile errors show up on CPU-only machines."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "stream_decode.py"
    proc = subprocess.run([sys.executable, str(script), "--compile-only", "--per-variant", "1"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "0 failed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
