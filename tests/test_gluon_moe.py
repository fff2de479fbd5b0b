"""The grouped Gluon MXFP4 experts prototype (gluon_moe.py and _gluon_moe_kernels.py in benchmarks/experiments).

CPU: the load-time stacks' exact round trips, the whole pipeline emulated (moekit's align and combine under the
interpreter, each GEMM block by block on the decode warps' emulated weights) against float64, and that every candidate
builds for sm_90 without spills. GPU: the kernels against float64 at shapes with partial tiles and at gpt-oss-120b's
H and I."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))

import gluon_moe as gm  # noqa: E402
import gluon_w4 as gw  # noqa: E402
from test_gluon_w4 import compile_only_builds  # noqa: E402

from moekit import reference  # noqa: E402
from moekit.formats import mxfp4  # noqa: E402

# (max, RMS) error relative to the reference's largest / RMS value: the W4A16 budget (1e-2) and the library's bf16
# relative Frobenius budget (tests/test_experts.py's TOL): h, y and out each rounded to bf16
TOL = (1e-2, 5e-3)


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    assert torch.isfinite(got).all(), "non-finite outputs (unwritten rows?)"
    d = got.double() - ref
    return ((d.abs().max() / ref.abs().max().clamp_min(1e-300)).item(),
            (d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300)).item())


class Case:
    """Random MXFP4 stacks with biases, routes and activations for one shape."""

    def __init__(self, num_tokens, experts, hidden, inter, top_k, activation, device, routing="random", seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        self.activation = activation
        self.w13 = gm.random_stack(experts, 2 * inter, hidden, device)
        self.w2 = gm.random_stack(experts, hidden, inter, device)
        self.b13 = torch.randn(experts, 2 * inter, device=device, generator=g) * 0.1
        self.b2 = torch.randn(experts, hidden, device=device, generator=g) * 0.1
        self.x = (torch.randn(num_tokens, hidden, device=device, generator=g) * 0.5).to(torch.bfloat16)
        self.tw = torch.softmax(torch.randn(num_tokens, top_k, device=device, generator=g), -1)
        if routing == "one expert":  # every token's first slot on expert 0, the other slots on distinct others
            ids = torch.arange(top_k, device=device).repeat(num_tokens, 1)
        elif routing == "skip expert 1":
            ids = torch.rand(num_tokens, experts - 1, device=device, generator=g).argsort(1)[:, :top_k]
            ids = ids + (ids >= 1).long()
        else:
            ids = torch.rand(num_tokens, experts, device=device, generator=g).argsort(1)[:, :top_k]
        self.ti = ids.int().contiguous()
        self.p13 = gm.prepare_stack(self.w13, self.b13, interleave=activation == "silu_and_mul")
        self.p2 = gm.prepare_stack(self.w2, self.b2)

    def reference(self):
        return reference.fused_experts(self.x.double(), mxfp4.dequantize(self.w13, torch.float64),
                                       mxfp4.dequantize(self.w2, torch.float64), self.tw.double(), self.ti,
                                       activation=self.activation, w13_bias=self.b13.double(),
                                       w2_bias=self.b2.double())


def test_prepared_stacks_round_trip():
    for interleave in (False, True):
        w = gm.random_stack(3, 256, 128, "cpu")
        bias = torch.randn(3, 256)
        p = gm.prepare_stack(w, bias, interleave=interleave)
        back, b = gm.unprepare_stack(p, interleaved=interleave)
        assert torch.equal(back.data, w.data) and torch.equal(back.scales, w.scales) and torch.equal(b, bias)


def test_configs_fit_gpt_oss():
    for cfg in gm.candidates():
        p13 = gm.PreparedStack(None, None, None, 128, 2 * gm.INTER, gm.HIDDEN, False)
        p2 = gm.PreparedStack(None, None, None, 128, gm.HIDDEN, gm.INTER, False)
        gm.check_shapes(cfg, p13, p2)
    with pytest.raises(ValueError, match="same row blocks"):
        gm.Config(gw.Config(bm=128), gw.Config(bm=64, stages=6))


def test_bad_input_is_refused_before_any_launch():
    case = Case(4, 5, 192, 128, 2, "swiglu_oai", "cpu")
    cfg = gm.candidates()[0]
    bad = {
        "x must be bf16": dict(x=case.x.half()),
        "x must be bf16 \\[T, 192\\]": dict(x=case.x[:, :128]),
        "topk_ids must be int32": dict(ti=case.ti.long()),
        "topk_ids must be int32 \\[T=4": dict(ti=case.ti[:3], tw=case.tw[:3]),
        "with topk_weights of its shape": dict(tw=case.tw[:, :1]),
    }
    for match, args in bad.items():
        a = dict(x=case.x, tw=case.tw, ti=case.ti) | args
        with pytest.raises(ValueError, match=match):
            gm.fused_experts(cfg, a["x"], case.p13, case.p2, a["tw"], a["ti"], "swiglu_oai")
    with pytest.raises(ValueError, match="not one MLP's stacks"):
        gm.fused_experts(cfg, case.x, case.p13, case.p13, case.tw, case.ti, "swiglu_oai")


# (T, E, H, I, k, activation, routing, why)
EMULATED = [
    (0, 5, 192, 128, 2, "swiglu_oai", "random", "no tokens: nothing launched, zeros"),
    (1, 5, 192, 128, 2, "swiglu_oai", "random", "decode: most experts have no tokens"),
    (7, 7, 192, 128, 6, "silu_and_mul", "random", "k = 6 (not a power of two), E prime, [gate; up] interleaved"),
    (9, 5, 192, 128, 3, "swiglu_oai", "skip expert 1", "an expert with no tokens between two with some"),
    (129, 5, 192, 128, 2, "silu_and_mul", "one expert", "every token on expert 0: its run spans 2-3 row blocks"),
    (129, 7, 64, 192, 3, "swiglu_oai", "random", "H = 64 (one K step in GEMM1), I = 192 (3 K steps in GEMM2)"),
]


@pytest.mark.parametrize("T,E,H,I,k,act,routing,why", EMULATED, ids=[c[-1] for c in EMULATED])
@pytest.mark.parametrize("bm", (64, 128))
def test_emulated_pipeline_matches_float64(T, E, H, I, k, act, routing, why, bm):
    case = Case(T, E, H, I, k, act, "cpu", routing)
    cfg = gm.Config(gw.Config(bm=bm, stages=6 if bm == 64 else 4), gw.Config(bm=bm, stages=6 if bm == 64 else 4))
    got = gm.emulate(cfg, case.x, case.p13, case.p2, case.tw, case.ti, act)
    assert got.shape == (T, H)
    if T == 0:
        return
    max_err, rms_err = _errors(got, case.reference())
    assert max_err <= TOL[0] and rms_err <= TOL[1], (max_err, rms_err)


@pytest.mark.parametrize("T,E,H,I,k,act,routing,why", EMULATED + [
    (300, 3, 192, 128, 2, "swiglu_oai", "random", "runs of about 200 rows: the 128 + 64 and 256-row tiles"),
    (64, 3, 192, 128, 2, "silu_and_mul", "one expert", "64 rows on expert 0: the class edge (64 is the small tile's)"),
], ids=[c[-1] for c in EMULATED] + ["200-row runs", "64-row run"])
def test_emulated_row_classes_match_float64(T, E, H, I, k, act, routing, why):
    case = Case(T, E, H, I, k, act, "cpu", routing)
    got = gm.emulate(gm.row_classes(), case.x, case.p13, case.p2, case.tw, case.ti, act)
    if T == 0:
        return
    max_err, rms_err = _errors(got, case.reference())
    assert max_err <= TOL[0] and rms_err <= TOL[1], (max_err, rms_err)


def test_gather_kernel_writes_every_routed_row_and_no_padding_row():
    # (the interpreter) rows that hold a pair get their token's x; padding rows keep what the buffer held
    case = Case(37, 5, 2112, 128, 3, "swiglu_oai", "cpu")  # H past two 1024-column blocks of the gather
    x = case.x[:, :2100]  # strided rows, H not a multiple of the block
    for cfg in (gm.candidates()[0], gm.row_classes()):
        _, pairs, block_expert, got = gm._row_blocks(cfg, x, case.ti, 5, kernel=True)
        in_runs = (block_expert >= 0).repeat_interleave(cfg.bm)  # blocks past the last run: align leaves them as is
        routed = in_runs & (pairs < case.ti.numel())
        assert routed.sum() == case.ti.numel()
        assert torch.equal(got[routed], x[pairs[routed].long() // 3])


def test_row_classes_must_cover_every_row_once():
    c64, c128 = gm.row_classes().tiles[0].cfg, gm.row_classes().tiles[1].cfg
    with pytest.raises(ValueError, match="cover a block of 129 rows"):  # nothing for 129..192
        gm.RowClasses((gm.Tile(c64, 0, 0, 64), gm.Tile(c128, 0, 64, 128)), stride=192)
    with pytest.raises(ValueError, match="cover a block of 1 rows"):    # rows 0..63 twice
        gm.RowClasses((gm.Tile(c64, 0, 0, 64), gm.Tile(c64, 0, 0, 64)), stride=64)


def test_compile_only_builds_sm90_without_spills():
    compile_only_builds("gluon_moe.py", 2 * len(gm.launches()))


# ----------------------------------------------------------------------------------------------------------------
# GPU


def _gpu_check(case: Case, cfg: gm.Config):
    gm.check_shapes(cfg, case.p13, case.p2)
    out = torch.full((case.x.shape[0], case.w2.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    gm.fused_experts(cfg, case.x, case.p13, case.p2, case.tw, case.ti, case.activation, out=out)
    torch.cuda.synchronize()
    if case.x.shape[0] == 0:
        return
    max_err, rms_err = _errors(out, case.reference())
    assert max_err <= TOL[0] and rms_err <= TOL[1], f"{cfg.label()}: {max_err:.3e} / {rms_err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gm.candidates(), ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("T,E,H,I,k,act,routing,why", EMULATED, ids=[c[-1] for c in EMULATED])
def test_gpu_small_shapes(T, E, H, I, k, act, routing, why, cfg):
    """H = 192: w2's last 128-column tile runs into the next expert's rows (or TMA's zeros after the last)."""
    _gpu_check(Case(T, E, H, I, k, act, "cuda", routing), cfg)


@pytest.mark.gpu
def test_gpu_full_range_scales():
    """Scale bytes past 128: the decode's second multiply (FULL_RANGE) in both GEMMs."""
    case = Case(65, 5, 192, 128, 2, "swiglu_oai", "cuda")
    for w in (case.w13, case.w2):
        w.scales.random_(100, 140)
    case.p13, case.p2 = gm.prepare_stack(case.w13, case.b13), gm.prepare_stack(case.w2, case.b2)
    assert case.p13.full_range and case.p2.full_range
    _gpu_check(case, gm.candidates()[0])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", gm.candidates(), ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("act", ("swiglu_oai", "silu_and_mul"))
def test_gpu_gpt_oss_sizes(cfg, act):
    """gpt-oss-120b's H and I, 5 experts, top-4, 300 tokens (2-3 row blocks per expert, a partial last one)."""
    _gpu_check(Case(300, 5, gm.HIDDEN, gm.INTER, 4, act, "cuda"), cfg)
