"""LoRA on the experts (moekit.experts.ExpertsLoRA) against the float64 reference.

CPU: the torch backend and the Triton kernels through the interpreter (fp32/fp16: the interpreter's bf16 dot is
wrong) at tiny sizes, in every mode the kernels have (aligned blocks, per-pair, CUDA-core decode with and without
split slots, batched slabs), on dense and quantized base weights, with expert_map. GPU (-m gpu): bf16 at the sizes
of qwen3-30b-a3b and gpt-oss-120b, and inside a CUDA graph.
"""

import contextlib
from dataclasses import replace

import pytest
import torch

from moekit import FusedMoE, reference
from moekit._launch import Constants
from moekit.experts import ExpertsConfig, ExpertsLoRA, GemmConfig, batched_experts, fused_experts
from moekit.formats import dequantize, quantize_experts
from moekit.metrics import EXPERTS_TOL, W8A8_TOL, Tolerance, check_close

AUTO = None
ALIGNED_32 = ExpertsConfig(32, GemmConfig(32, 32), GemmConfig(32, 32))
ALIGNED_64 = ExpertsConfig(64, GemmConfig(32, 32), GemmConfig(32, 32))
PER_PAIR = ExpertsConfig(16, GemmConfig(16, 32), GemmConfig(16, 32), mode="per_pair")
PER_PAIR_SPLIT = ExpertsConfig(16, GemmConfig(16, 32), GemmConfig(16, 32), mode="per_pair", split_slots=True)
GEMV = ExpertsConfig(16, GemmConfig(16, 32), GemmConfig(16, 32), mode="gemv")
GEMV_SPLIT = ExpertsConfig(16, GemmConfig(16, 32), GemmConfig(16, 32), mode="gemv", split_slots=True)
# 4-bit weights, 16-bit activations: GEMM1 on the rows kernel, GEMM2 row-scaled (others read it as GEMV)
GEMV_ROWS = ExpertsConfig(16, GemmConfig(16, 32, row_scaled=True), GemmConfig(16, 32, row_scaled=True), mode="gemv")
MODES = {"auto": AUTO, "aligned": ALIGNED_32, "per_pair": PER_PAIR, "per_pair_split": PER_PAIR_SPLIT, "gemv": GEMV,
         "gemv_split": GEMV_SPLIT, "gemv_rows": GEMV_ROWS}
CPU_DTYPES = [torch.float32, torch.float16]
FP32_REORDERED = Tolerance(1e-5, 1e-6)  # the same fp32 products summed in another order


def _weights(E, H, I, dtype, device="cpu"):
    w13 = (torch.randn(E, 2 * I, H, device=device) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) * I ** -0.5).to(dtype)
    return w13, w2


def _lora(n, E, H, I, r, dtype, device="cpu", which=("w13", "w2"), scaling=None):
    """n adapters of rank r whose terms are about as large as the base GEMMs' outputs (a wrong term shows)."""
    parts = {}
    if "w13" in which:
        parts["w13_a"] = (torch.randn(n, E, r, H, device=device) * H ** -0.5).to(dtype)
        parts["w13_b"] = (torch.randn(n, E, 2 * I, r, device=device) * r ** -0.5).to(dtype)
    if "w2" in which:
        parts["w2_a"] = (torch.randn(n, E, r, I, device=device) * I ** -0.5).to(dtype)
        parts["w2_b"] = (torch.randn(n, E, H, r, device=device) * r ** -0.5).to(dtype)
    return ExpertsLoRA(**parts, scaling=scaling if scaling is not None else [0.5 + i for i in range(n)])


def _routes(T, E, k, device="cpu"):
    """k distinct experts per token among the first E - 1: expert E - 1 never gets a token."""
    ids = torch.rand(T, E - 1, device=device).argsort(dim=1)[:, :k].int()
    return torch.softmax(torch.randn(T, k, device=device), -1), ids


def _lora_ids(T, n, device="cpu"):
    """Every adapter and -1 (none) among T tokens, in a shuffled order."""
    ids = torch.arange(T) % (n + 1) - 1
    return ids[torch.randperm(T)].to(device, torch.int32)


def _poisoned(shape, dtype, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _tol(dtype):
    return EXPERTS_TOL[dtype]


FUSED_CASES = [
    (0, 5, 32, 16, 2, "silu_and_mul", 2, 4, "auto", "no tokens"),
    (1, 7, 33, 17, 6, "silu_and_mul", 2, 4, "per_pair", "one token, k=6, odd H and I, prime E"),
    (1, 7, 33, 17, 6, "swiglu_oai", 3, 8, "gemv", "one token on the CUDA-core kernels, gpt-oss activation"),
    (7, 7, 33, 19, 6, "silu_and_mul", 3, 5, "aligned", "prime E, k=6, odd sizes, aligned blocks"),
    (7, 5, 40, 24, 3, "swiglu_oai", 4, 16, "gemv_split", "CUDA-core decode, slots split then combined"),
    (9, 11, 48, 24, 2, "silu_and_mul", 4, 16, "aligned", "a partial row block, four adapters"),
    (9, 5, 33, 17, 3, "swiglu_oai", 2, 3, "per_pair", "per-pair tensor-core GEMMs"),
    (5, 7, 33, 17, 3, "swiglu_oai", 2, 4, "per_pair_split", "per-pair GEMM2 into the aligned mode's buffer, w2's term "
     "added there, then the combine"),
    (3, 5, 300, 24, 3, "silu_and_mul", 2, 130, "gemv", "rank past 128 at decode: slots expanded a chunk at a "
     "time, K split over ten shrink programs"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,E,H,I,k,act,n,r,mode,why", FUSED_CASES)
def test_fused_experts_with_mixed_adapters(backend, dtype, T, E, H, I, k, act, n, r, mode, why):
    if backend == "torch" and (dtype == torch.float16 or mode != "auto" and mode != "aligned"):
        pytest.skip("the torch backend computes in fp32 and has no modes")
    w13, w2 = _weights(E, H, I, dtype)
    lora = _lora(n, E, H, I, r, dtype)
    x = torch.randn(T, H + 3).to(dtype)[:, 3:]                      # strided, offset rows
    tw, tid = _routes(T, E, k)
    lids = _lora_ids(T, n)
    out = _poisoned((T, H), dtype)
    got = fused_experts(x, w13, w2, tw, tid, activation=act, out=out, backend=backend, lora=lora, lora_ids=lids,
                        config=MODES[mode] if backend == "triton" else None)
    assert got is out
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation=act, lora=lora, lora_ids=lids)
    check_close(f"{why} ({mode})", got, ref, _tol(dtype))
    if T > 1:  # the adapters changed the result: a kernel that dropped their terms would not pass
        base = reference.fused_experts(x, w13, w2, tw, tid, activation=act)
        assert (base - ref).norm() > 0.1 * ref.norm()


class _RecordingLauncher:
    """Stands in for a kernel's Launcher: records each launch's keywords and each compile-only build; a build takes
    ``regs`` registers."""

    def __init__(self, regs):
        self.regs, self.launches, self.builds = regs, [], []
        self.fn = self  # (Launcher.fn: the JIT function, whose warmup builds without running)

    def warmup(self, *args, grid, **constants):
        self.builds.append(dict(constants))
        return type("Kernel", (), {"n_regs": self.regs})()

    def launch(self, grid, args, constants):
        self.launches.append(dict(constants))


@pytest.mark.parametrize("regs,warps,cap,capped,why", [
    (204, 4, 168, True, "qwen3-30b-a3b's bf16 GEMV1 with both terms: 2 programs per SM uncapped, 3 capped"),
    (122, 4, 168, False, "a GEMV1 under the cap: a cap would make ptxas spend up to it (fewer programs per SM)"),
    (204, 8, 168, False, "8 warps: 168 registers fit no more programs per SM than 204"),
    (204, 4, None, False, "no cap for these terms (one term, or a rank past DECODE_TERMS_MAXNREG_RANK)"),
])
def test_gemv1_with_terms_is_capped_only_where_its_uncapped_build_took_more(monkeypatch, regs, warps, cap, capped,
                                                                           why):
    from moekit import _triton
    from moekit.experts import lora as expert_lora
    from moekit.experts import triton_backend

    monkeypatch.setattr(_triton, "interpreting", lambda: False)  # (the interpreter builds nothing to count)
    terms = expert_lora.DecodeTerms((), {"LORA_W13": True, "PROBE": regs * 10 + warps}, (), {}, lambda: None, cap)
    launcher = _RecordingLauncher(regs)
    cfg = GemmConfig(16, 256, warps, 1, maxnreg=144)  # the config's own cap was measured without adapters: dropped
    x = torch.empty(1, 8)
    for _ in range(3):
        triton_backend._launch_with_terms(launcher, (1,), (x,), Constants(BLOCK_N=16, maxnreg=144), terms, cfg)
    # decided on the first call, which launches under the decision: a graph captured after it builds nothing new
    assert [launch.get("maxnreg") for launch in launcher.launches] == [cap if capped else None] * 3, why
    assert len(launcher.builds) == (1 if cap and warps == 4 else 0) and all("maxnreg" not in b for b in launcher.builds)
    assert all(launch["LORA_W13"] for launch in launcher.launches)


SHRINK_BY_GEMV1 = pytest.mark.parametrize("shrink_by_gemv1", [False, True],
                                         ids=["w13_shrink_launched", "w13_shrink_by_gemv1"])


@SHRINK_BY_GEMV1
@pytest.mark.parametrize("contiguous", [True, False], ids=["terms_in_the_gemvs", "separate_kernels"])
@pytest.mark.parametrize("which", [("w13", "w2"), ("w13",), ("w2",)])
def test_decode_terms_inside_the_gemvs_and_in_kernels_of_their_own(monkeypatch, contiguous, which, shrink_by_gemv1):
    """At decode the adapters' terms run inside GEMV1 / GEMV2 (one shrink launch of their own at most, or none
    where GEMV1's programs compute W13's shrink) when the stacks are contiguous and their tiles fit; other stacks
    take the separate shrink/expand kernels."""
    from moekit.experts import lora as expert_lora

    monkeypatch.setattr(expert_lora, "DECODE_W13_SHRINK_BY_GEMV1", shrink_by_gemv1)
    fused = []
    real = expert_lora.decode_terms
    monkeypatch.setattr(expert_lora, "decode_terms", lambda *a, **kw: fused.append(real(*a, **kw)) or fused[-1])
    T, E, H, I, k, n = 5, 7, 40, 24, 3, 2
    w13, w2 = _weights(E, H, I, torch.float32)
    lora = _lora(n, E, H, I, 8, torch.float32, which=which)
    if not contiguous:  # the same values, strided: B's rank axis not innermost
        lora = ExpertsLoRA(*(None if t is None else t.transpose(2, 3).contiguous().transpose(2, 3)
                             for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b)), scaling=lora.scaling)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    lids = _lora_ids(T, n)
    got = fused_experts(x, w13, w2, tw, tid, activation="swiglu_oai", backend="triton", config=GEMV, lora=lora,
                        lora_ids=lids, out=_poisoned((T, H), torch.float32))
    assert [t is not None for t in fused] == [contiguous]
    if contiguous:
        assert fused[0].gemv1_constants["LORA_SHRINK"] == (shrink_by_gemv1 and "w13" in which)
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation="swiglu_oai", lora=lora, lora_ids=lids)
    check_close(f"{'+'.join(which)} decode terms", got, ref, _tol(torch.float32))


@pytest.mark.parametrize("slots", [1, 2])
def test_w13_shrink_by_gemv1_with_more_splits_than_programs_per_group(monkeypatch, slots):
    # H=600 with rank 32: 3 K splits of 256 (one slot) or 5 of 128 (two slots), and I=24 in 16-column blocks gives
    # each group 2 programs: more splits than programs, so one program claims several (in the interpreter, which
    # runs the programs one after another, the first claims one as it starts and the rest before its wait; the
    # second finds none left). k=3 with 2 slots leaves each token's second group one pair and a dead slot. Called
    # twice: the group's last program zeroes the counters for the next call.
    from moekit import _triton
    from moekit.experts import lora as expert_lora

    monkeypatch.setattr(expert_lora, "DECODE_W13_SHRINK_BY_GEMV1", True)
    fused = []
    real = expert_lora.decode_terms
    monkeypatch.setattr(expert_lora, "decode_terms", lambda *a, **kw: fused.append(real(*a, **kw)) or fused[-1])
    T, E, H, I, k, n, r = 3, 5, 600, 24, 3, 2, 32
    w13, w2 = _weights(E, H, I, torch.float32)
    lora = _lora(n, E, H, I, r, torch.float32)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    lids = torch.tensor([1, -1, 0], dtype=torch.int32)
    config = ExpertsConfig(16, GemmConfig(16, 64, slots=slots), GemmConfig(16, 32), mode="gemv")
    ref = reference.fused_experts(x, w13, w2, tw, tid, lora=lora, lora_ids=lids)
    for call in range(2):
        got = fused_experts(x, w13, w2, tw, tid, backend="triton", config=config, lora=lora, lora_ids=lids,
                            out=_poisoned((T, H), torch.float32))
        assert fused[-1].gemv1_constants["LORA_SHRINK"] and fused[-1].gemv1_constants["LORA_SPLITS"] == 2 * slots + 1
        check_close(f"call {call}", got, ref, _tol(torch.float32))
        assert not _triton.counters(x.device).any()


def test_w13_shrink_by_the_rows_gemv1_with_more_splits_than_programs_per_group(monkeypatch):
    # the rows GEMV1 (4-bit weights, 16-bit x, one pair per group): H=640 with rank 32 gives 3 K splits of 256 and
    # I=32 in 16-column blocks 2 programs per pair; adapter -1 on the second token; called twice (counters zeroed)
    from moekit import _triton
    from moekit.experts import lora as expert_lora
    from moekit.experts import triton_backend as tb

    monkeypatch.setattr(expert_lora, "DECODE_W13_SHRINK_BY_GEMV1", True)
    T, E, H, I, k, n, r, dtype = 3, 5, 640, 32, 3, 2, 32, torch.float16
    w13, w2 = _weights(E, H, I, torch.float32)
    q13, q2 = quantize_experts(w13, "mxfp4"), quantize_experts(w2, "mxfp4")
    lora = _lora(n, E, H, I, r, dtype)
    x = torch.randn(T, H).to(dtype)
    tw, tid = _routes(T, E, k)
    lids = torch.tensor([1, -1, 0], dtype=torch.int32)
    config = ExpertsConfig(16, GemmConfig(16, 64, 4, 3, row_scaled=True), GemmConfig(16, 32), mode="gemv")
    ref = reference.fused_experts(x, dequantize(q13), dequantize(q2), tw, tid, lora=lora, lora_ids=lids)
    for call in range(2):
        rows = []
        with _recording(tb.gemv1_rows_kernel, rows):
            got = fused_experts(x, q13, q2, tw, tid, backend="triton", config=config, lora=lora, lora_ids=lids,
                                out=_poisoned((T, H), dtype))
        assert rows and rows[-1]["LORA_SHRINK"] and rows[-1]["LORA_SPLITS"] == 3
        check_close(f"call {call}", got, ref, _tol(dtype))
        assert not _triton.counters(x.device).any()


def test_w2_decode_shrink_summed_over_many_blocks(monkeypatch):
    # k=8 slots of rank 32: each pair's last GEMV1 program adds 24 blocks (I=96 in 4-column blocks, their tile
    # padded to 32); the tests above reach a few blocks only
    from moekit.experts import lora as expert_lora

    fused = []
    real = expert_lora.decode_terms
    monkeypatch.setattr(expert_lora, "decode_terms", lambda *a, **kw: fused.append(real(*a, **kw)) or fused[-1])
    T, E, H, I, k, n, r = 3, 10, 32, 96, 8, 2, 32
    w13, w2 = _weights(E, H, I, torch.float32)
    lora = _lora(n, E, H, I, r, torch.float32, which=("w2",))
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    lids = torch.tensor([0, 1, -1], dtype=torch.int32)
    config = ExpertsConfig(16, GemmConfig(4, 32, slots=2), GemmConfig(16, 32), mode="gemv")
    got = fused_experts(x, w13, w2, tw, tid, backend="triton", config=config, lora=lora, lora_ids=lids,
                        out=_poisoned((T, H), torch.float32))
    assert fused[0] is not None and fused[0].gemv2_args[-1] == 24
    ref = reference.fused_experts(x, w13, w2, tw, tid, lora=lora, lora_ids=lids)
    check_close("W2's shrink over 24 blocks", got, ref, _tol(torch.float32))


def test_a_configs_register_cap_leaves_the_gemvs_that_run_decode_terms(monkeypatch):
    # GemmConfig.maxnreg was measured on calls without adapters: with the terms inside, GEMV1 and GEMV2 drop it (a
    # rank-128 adapter spilled under the table's cap), and the same call without adapters keeps it
    from moekit import _launch

    launches = {}
    real = _launch.Launcher.launch

    def launch(self, grid, args, constants):  # (on the class: an instance's patch outlives monkeypatch's undo)
        name = {"gemv1_act_kernel": "gemv1", "gemv2_tokens_kernel": "gemv2"}.get(getattr(self.fn, "__name__", ""))
        if name:
            launches.setdefault(name, []).append(constants.get("maxnreg"))
        return real(self, grid, args, constants)

    monkeypatch.setattr(_launch.Launcher, "launch", launch)
    T, E, H, I, k = 3, 7, 40, 24, 3
    w13, w2 = _weights(E, H, I, torch.float32)
    capped = ExpertsConfig(16, replace(GEMV.gemm1, maxnreg=128), replace(GEMV.gemm2, maxnreg=128), mode="gemv")
    x, (tw, tid), lids = torch.randn(T, H), _routes(T, E, k), _lora_ids(T, 2)
    fused_experts(x, w13, w2, tw, tid, backend="triton", config=capped)
    assert launches == {"gemv1": [128], "gemv2": [128]}
    launches.clear()
    fused_experts(x, w13, w2, tw, tid, backend="triton", config=capped, lora=_lora(2, E, H, I, 8, torch.float32),
                  lora_ids=lids)
    assert launches == {"gemv1": [None], "gemv2": [None]}


@pytest.mark.parametrize("fmt, which, mapped, T", [
    ("mxfp4", ("w13", "w2"), False, 5),
    ("mxfp4", ("w13",), False, 5),   # W13's term only
    ("mxfp4", ("w2",), False, 5),    # W2's shrink only
    ("nvfp4", ("w13", "w2"), False, 5),
    ("nvfp4", ("w13", "w2"), True, 5),  # expert parallelism: pairs of another rank store nothing, arrive nowhere
    ("mxfp4", ("w13", "w2"), False, 1),  # one token, its adapter id -1 (none): the terms must add nothing
    ("nvfp4", ("w13", "w2"), False, 9),  # past a power of two of tokens
])
@SHRINK_BY_GEMV1
def test_decode_terms_inside_the_row_scaled_gemv1(monkeypatch, fmt, which, mapped, T, shrink_by_gemv1):
    """GEMV1 on the rows kernel (4-bit weights, 16-bit x: one pair per program) takes the adapters' terms as the
    other GEMV1 does: W13's after its K loop, W2's shrink per block of h's columns, summed by the pair's last
    program. I = 96: twelve 8-column blocks (their sum's tile padded to 16)."""
    from moekit import _triton
    from moekit.experts import lora as expert_lora
    from moekit.experts import triton_backend as tb

    monkeypatch.setattr(expert_lora, "DECODE_W13_SHRINK_BY_GEMV1", shrink_by_gemv1)
    fused, rows = [], []
    real = expert_lora.decode_terms
    monkeypatch.setattr(expert_lora, "decode_terms", lambda *a, **kw: fused.append(real(*a, **kw)) or fused[-1])
    E, H, I, k, n, dtype = 7, 64, 96, 3, 2, torch.float16
    w13, w2 = _weights(E, H, I, torch.float32)
    q13, q2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
    lora = _lora(n, E, H, I, 8, dtype, which=which)
    config = ExpertsConfig(16, GemmConfig(8, 64, 4, 3, row_scaled=True), GemmConfig(16, 32), mode="gemv")
    x = torch.randn(T, H + 3).to(dtype)[:, 3:]  # strided, offset rows
    tw, tid = _routes(T, E, k)
    lids = _lora_ids(T, n)
    emap = None
    if mapped:  # this rank holds experts 2..6 of 9 global ones (local 0..4): ids 0, 1, 7, 8 are another rank's
        emap = torch.tensor([-1, -1, 0, 1, 2, 3, 4, -1, -1], dtype=torch.int32)
        tid = torch.stack([torch.randperm(9)[:k] for _ in range(T)]).int()
        q13, q2 = (quantize_experts(w[2:7].contiguous(), fmt) for w in (torch.cat([w13, w13[:2]]),
                                                                       torch.cat([w2, w2[:2]])))
        lora = _lora(n, 5, H, I, 8, dtype, which=which)
    with _recording(tb.gemv1_rows_kernel, rows):
        got = fused_experts(x, q13, q2, tw, tid, activation="swiglu_oai", backend="triton", config=config, lora=lora,
                            lora_ids=lids, out=_poisoned((T, H), dtype), expert_map=emap)
    assert [t is not None for t in fused] == [True]
    assert rows and rows[-1].get("LORA_W13", False) == ("w13" in which)  # the rows kernel, with the terms
    assert rows[-1].get("LORA_SHRINK", False) == (shrink_by_gemv1 and "w13" in which)
    ref = reference.fused_experts(x, dequantize(q13), dequantize(q2), tw, tid, activation="swiglu_oai", lora=lora,
                                  lora_ids=lids, expert_map=emap)
    check_close(f"{fmt} {'+'.join(which)} terms in the rows GEMV1", got, ref, _tol(dtype))
    assert not _triton.counters(x.device).any()  # zero again for the next call


def test_the_w13_shrink_is_the_launch_right_before_gemv1(monkeypatch):
    """GEMV1 starts as the shrink's programmatic dependent and reads its other inputs before it waits: every launch
    that prepares them (fp16 pairs of x for 4-bit weights) must come before the shrink."""
    from moekit._launch import Launcher

    order = []
    real = Launcher.launch
    monkeypatch.setattr(Launcher, "launch", lambda self, *a: order.append(self.__name__) or real(self, *a))
    E, H, I, k, T = 5, 64, 32, 2, 3
    w13, w2 = _weights(E, H, I, torch.float32)
    q13, q2 = quantize_experts(w13, "mxfp4"), quantize_experts(w2, "mxfp4")
    lora = _lora(2, E, H, I, 4, torch.float16)
    x = torch.randn(T, H).half()
    tw, tid = _routes(T, E, k)
    lids = _lora_ids(T, 2)
    got = fused_experts(x, q13, q2, tw, tid, backend="triton", config=GEMV, lora=lora, lora_ids=lids)
    assert "scaled_fp16_kernel" in order  # the packed 4-bit decode: x prepared by a launch of its own
    assert order.index("gemv1_act_kernel") == order.index("lora_shrink_kernel") + 1, order
    ref = reference.fused_experts(x, dequantize(q13).half(), dequantize(q2).half(), tw, tid, lora=lora, lora_ids=lids)
    check_close("mxfp4 decode terms", got, ref, _tol(torch.float16))


def test_rank_past_64_runs_in_sub_blocks_of_the_aligned_rows():
    """r = 70 pads to 128: the block kernel then takes 32 of each 64-row block per program."""
    T, E, H, I, k, n, r = 20, 3, 40, 24, 2, 2, 70
    w13, w2 = _weights(E, H, I, torch.float32)
    lora = _lora(n, E, H, I, r, torch.float32)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    lids = _lora_ids(T, n)
    got = fused_experts(x, w13, w2, tw, tid, backend="triton", lora=lora, lora_ids=lids, config=ALIGNED_64)
    check_close("r=70", got, reference.fused_experts(x, w13, w2, tw, tid, lora=lora, lora_ids=lids),
                _tol(torch.float32))


@pytest.mark.parametrize("mode", ["aligned", "per_pair", "per_pair_split", "gemv", "gemv_split"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_expert_map_selects_the_local_adapters(backend, mode):
    if backend == "torch" and mode != "aligned":
        pytest.skip("the torch backend has no modes")
    T, E_local, E_global, H, I, k, n = 9, 3, 7, 33, 17, 3, 2
    w13, w2 = _weights(E_local, H, I, torch.float32)
    lora = _lora(n, E_local, H, I, 4, torch.float32)            # adapters over the local experts only
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[torch.tensor([5, 1, 3])] = torch.arange(E_local, dtype=torch.int32)
    tid = torch.rand(T, E_global).argsort(dim=1)[:, :k].int()
    tw = torch.rand(T, k)
    lids = _lora_ids(T, n)
    out = _poisoned((T, H), torch.float32)
    fused_experts(x := torch.randn(T, H), w13, w2, tw, tid, expert_map=emap, out=out, backend=backend, lora=lora,
                  lora_ids=lids, config=MODES[mode] if backend == "triton" else None)
    ref = reference.fused_experts(x, w13, w2, tw, tid, expert_map=emap, lora=lora, lora_ids=lids)
    check_close(f"expert_map ({mode})", out, ref, _tol(torch.float32))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("act", ["silu_and_mul", "swiglu_oai"])
def test_batched_experts_with_adapters_per_row(backend, dtype, act):
    if backend == "torch" and dtype == torch.float16:
        pytest.skip("the torch backend computes in fp32")
    E, M, H, I, n = 5, 9, 33, 19, 3
    w13, w2 = _weights(E, H, I, dtype)
    lora = _lora(n, E, H, I, 6, dtype)
    counts = torch.tensor([9, 0, 4, 1, 7], dtype=torch.int32)      # full, empty, partial
    valid = torch.arange(M)[None, :] < counts[:, None].long()
    x = torch.randn(E, M, H).to(dtype)
    x[~valid] = float("nan")                                          # padding must not leak
    lids = torch.randint(-1, n, (E, M), dtype=torch.int32)
    out = _poisoned((E, M, H), dtype)
    got = batched_experts(x, counts, w13, w2, activation=act, out=out, backend=backend, lora=lora, lora_ids=lids)
    assert got is out
    ref = reference.batched_experts(x, counts, w13, w2, activation=act, lora=lora, lora_ids=lids)
    check_close("batched", got[valid], ref[valid], _tol(dtype))


QUANTIZED = [  # (weight format, act_quant, H, I): 4-bit K in whole 32-groups, FP8 in 1x128 groups
    ("mxfp4", None, 64, 32),
    ("nvfp4", None, 64, 32),
    ("fp8_block", "fp8_group", 256, 128),
    ("mxfp4", "fp8_group", 256, 128),
]


@pytest.mark.parametrize("fmt,act_quant,H,I", QUANTIZED)
@pytest.mark.parametrize("mode", ["aligned", "per_pair", "gemv", "gemv_rows", "batched"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("layout", ["packed", "pairs"])  # 4-bit codes as stored, and prepared (formats.prepare)
def test_quantized_base_weights_keep_16_bit_adapters(fmt, act_quant, H, I, mode, backend, layout):
    """The adapters read the GEMMs' inputs as the base weights do (under act_quant, the E4M3-rounded ones)."""
    from moekit.formats import prepare

    if backend == "torch" and mode in ("per_pair", "gemv", "gemv_rows"):
        pytest.skip("the torch backend has no modes")
    if mode in ("gemv", "gemv_rows") and act_quant:
        pytest.skip("FP8 activations have no CUDA-core decode kernels")
    if layout == "pairs" and fmt.startswith("fp8"):
        pytest.skip("FP8 codes have one layout")
    E, k, n, T, dtype = 5, 2, 2, 7, torch.float16
    w13, w2 = _weights(E, H, I, torch.float32)
    q13, q2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
    if layout == "pairs":
        q13, q2 = prepare(q13), prepare(q2)
    lora = _lora(n, E, H, I, 4, dtype)
    ref_fn = reference.fused_experts_w8a8 if act_quant else reference.fused_experts
    weights = (q13, q2) if act_quant else (dequantize(q13), dequantize(q2))
    tol = W8A8_TOL if act_quant else _tol(dtype)
    if mode == "batched":
        M = 6
        counts = torch.tensor([6, 0, 2, 5, 1], dtype=torch.int32)
        valid = torch.arange(M)[None, :] < counts[:, None].long()
        x = torch.randn(E, M, H).to(dtype)
        lids = torch.randint(-1, n, (E, M), dtype=torch.int32)
        got = batched_experts(x, counts, q13, q2, act_quant=act_quant, backend=backend, lora=lora, lora_ids=lids)
        ref = torch.stack([ref_fn(x[e], *weights, torch.ones(M, 1), torch.full((M, 1), e, dtype=torch.int32),
                                  lora=lora, lora_ids=lids[e]) for e in range(E)])
        check_close(f"{fmt} batched", got[valid], ref[valid], tol)
        return
    x = torch.randn(T, H).to(dtype)
    tw, tid = _routes(T, E, k)
    lids = _lora_ids(T, n)
    out = _poisoned((T, H), dtype)
    fused_experts(x, q13, q2, tw, tid, act_quant=act_quant, out=out, backend=backend, lora=lora, lora_ids=lids,
                  config=MODES[mode] if backend == "triton" else None)
    check_close(f"{fmt} {act_quant} ({mode})", out, ref_fn(x, *weights, tw, tid, lora=lora, lora_ids=lids), tol)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float16), pytest.param("cuda", torch.bfloat16,
                                                                               marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layouts", [("pairs", "packed"), ("packed", "pairs")])  # w13's, w2's byte layout
@pytest.mark.parametrize("mode", ["aligned", "per_pair", "gemv"])
def test_w13_and_w2_in_different_byte_layouts(device, dtype, layouts, mode):
    """GEMM1 reads x in the order w13's layout asks (a paired_k copy or x itself, on the GPU's word decode) and
    writes h in the order w2's asks, which the W2 adapter term then reads (V_PAIRED): each stack's own layout, with
    adapters on both matrices, NVFP4 (16-code groups: K = 64 in 4 groups per row)."""
    from moekit import _triton
    from moekit.formats import prepare

    if not _triton.can_launch(torch.device(device)):
        pytest.skip("no Triton launch here")
    E, H, I, k, n, T = 5, 64, 64, 2, 2, 9
    w13, w2 = _weights(E, H, I, torch.float32, device)
    q13, q2 = quantize_experts(w13, "nvfp4"), quantize_experts(w2, "nvfp4")
    s13, s2 = (prepare(q) if layout == "pairs" else q for q, layout in zip((q13, q2), layouts))
    lora = _lora(n, E, H, I, 4, dtype, device)
    x = torch.randn(T, H, device=device).to(dtype)
    tw, tid = _routes(T, E, k, device)
    lids = _lora_ids(T, n, device)
    out = fused_experts(x, s13, s2, tw, tid, backend="triton", config=MODES[mode], lora=lora, lora_ids=lids,
                        out=_poisoned((T, H), dtype, device))
    ref = reference.fused_experts(x, dequantize(q13), dequantize(q2), tw, tid, lora=lora, lora_ids=lids)
    check_close(f"w13 {layouts[0]}, w2 {layouts[1]} ({mode})", out, ref, _tol(dtype))


@pytest.mark.parametrize("which", [("w13",), ("w2",)])
@pytest.mark.parametrize("mode", ["aligned", "gemv"])
def test_adapters_on_one_matrix_only(which, mode):
    T, E, H, I, k, n = 9, 5, 33, 17, 2, 2
    w13, w2 = _weights(E, H, I, torch.float32)
    lora = _lora(n, E, H, I, 4, torch.float32, which=which)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    lids = _lora_ids(T, n)
    got = fused_experts(x, w13, w2, tw, tid, backend="triton", lora=lora, lora_ids=lids, config=MODES[mode])
    check_close(f"{which} only", got, reference.fused_experts(x, w13, w2, tw, tid, lora=lora, lora_ids=lids),
                _tol(torch.float32))


@pytest.mark.parametrize("mode", ["aligned", "per_pair", "per_pair_split", "gemv", "gemv_split"])
def test_tokens_without_an_adapter_get_the_base_result_bit_for_bit(mode):
    T, E, H, I, k = 9, 5, 33, 17, 3
    w13, w2 = _weights(E, H, I, torch.float16)
    x = torch.randn(T, H).half()
    tw, tid = _routes(T, E, k)
    cfg = MODES[mode]
    base = fused_experts(x, w13, w2, tw, tid, backend="triton", config=cfg)
    none = torch.full((T,), -1, dtype=torch.int32)
    got = fused_experts(x, w13, w2, tw, tid, backend="triton", config=cfg, lora=_lora(2, E, H, I, 4, torch.float16),
                        lora_ids=none)
    assert torch.equal(got, base)


@pytest.mark.parametrize("share", [0.0, 1e9], ids=["added_after_gemm2", "gemm2_delta"])
@pytest.mark.parametrize("fmt", ["standard", "batched"])
def test_both_forms_of_the_w2_term(monkeypatch, share, fmt):
    """The aligned and batched paths add the w2 term to GEMM2's output after it, or hand it to GEMM2 as an fp32 delta
    added before the router weight (experts/lora.py w2_term_as_delta: while the delta's traffic is small against
    GEMM2's weights); both against float64, with every adapter, none and an empty expert."""
    from moekit.experts import lora as expert_lora

    monkeypatch.setattr(expert_lora, "DELTA_TRAFFIC_SHARE", share)
    chose = []
    real = expert_lora.w2_term_as_delta
    monkeypatch.setattr(expert_lora, "w2_term_as_delta", lambda *a: chose.append(real(*a)) or chose[-1])
    E, H, I, k, n = 5, 33, 19, 3, 3
    w13, w2 = _weights(E, H, I, torch.float16)
    lora = _lora(n, E, H, I, 6, torch.float16)
    if fmt == "standard":
        T = 9
        x = torch.randn(T, H).half()
        tw, tid = _routes(T, E, k)
        lids = _lora_ids(T, n)
        got = fused_experts(x, w13, w2, tw, tid, backend="triton", config=ALIGNED_32, lora=lora, lora_ids=lids,
                            out=_poisoned((T, H), torch.float16))
        ref = reference.fused_experts(x, w13, w2, tw, tid, lora=lora, lora_ids=lids)
        valid = slice(None)
    else:
        M = 6
        x = torch.randn(E, M, H).half()
        counts = torch.tensor([6, 0, 2, 5, 1], dtype=torch.int32)
        valid = torch.arange(M)[None, :] < counts[:, None].long()
        lids = torch.randint(-1, n, (E, M), dtype=torch.int32)
        got = batched_experts(x, counts, w13, w2, backend="triton", lora=lora, lora_ids=lids,
                              out=_poisoned((E, M, H), torch.float16))
        ref = reference.batched_experts(x, counts, w13, w2, lora=lora, lora_ids=lids)
    assert chose == [share > 0]
    check_close(f"{fmt}, w2 term {'as delta' if share else 'added'}", got[valid], ref[valid], _tol(torch.float16))


@pytest.mark.parametrize("form", ["added", "delta", "added per pair"])
def test_w2_term_reads_h_in_the_word_decoded_column_order(form):
    """On the GPU, bf16 activations before a 4-bit GEMM2 leave GEMM1's output in the word-decoded tiles' column order
    (triton_backend.paired_k): the w2 term then reads A's columns in that order (here forced in the interpreter).
    "added per pair": the per-pair mode with GEMM2 per pair, whose shrink runs one pair per program."""
    from moekit.experts import lora as lora_host
    from moekit.experts.triton_backend import align, paired_k

    T, E, H, I, k, n, bm = 9, 3, 24, 32, 2, 2, 16
    lora = _lora(n, E, H, I, 4, torch.float32, which=("w2",))
    tw, tid = _routes(T, E, k)
    _, sorted_pairs, block_expert = align(tid, None, E, bm)
    rows = lora_host.Rows("aligned", block_expert.numel() * bm, k, bm, T * k, block_expert, sorted_pairs)
    if form == "added per pair":
        rows = lora_host.Rows("pairs", T * k, k, ids=tid.reshape(-1), num_global=E)
    h = torch.randn(rows.count, I)
    lids = _lora_ids(T, n)
    if form == "delta":
        like = torch.empty(T * k, H)  # GEMM2's per-pair output: the delta's layout
        natural = lora_host.w2_delta(h, None, lora, lids, rows, like)
        paired = lora_host.w2_delta(paired_k(h), None, lora, lids, rows, like, h_paired=True)
    else:
        natural, paired = torch.zeros(T * k, H), torch.zeros(T * k, H)
        lora_host.w2_add(h, None, lora, lids, rows, natural, tw.reshape(-1).contiguous())
        lora_host.w2_add(paired_k(h), None, lora, lids, rows, paired, tw.reshape(-1).contiguous(), h_paired=True)
    assert natural.abs().sum() > 0 and not natural.isnan().any()
    check_close("paired h", paired, natural, FP32_REORDERED)


@pytest.mark.parametrize("fmt", ["standard", "batched"])
def test_all_adapters_in_one_product_give_the_per_adapter_bits(monkeypatch, fmt):
    """Several small adapters run as one product of their columns side by side (each row keeping its own); the
    other columns add exact zeros, so the bits are those of one product per adapter present in the block."""
    from moekit.experts import lora as expert_lora

    T, E, H, I, k, n, r = 40, 5, 48, 32, 2, 3, 12  # three adapters: padded to four, rank 12 padded to 16
    x, (w13, w2), lora = torch.randn(T, H).half(), _weights(E, H, I, torch.float16), _lora(n, E, H, I, r, torch.float16)
    tw, ids = _routes(T, E, k)
    lids = _lora_ids(T, n)
    xb, counts = torch.randn(E, 8, H).half(), torch.tensor([8, 3, 0, 5, 1], dtype=torch.int32)
    slab_ids = torch.randint(-1, n, (E, 8), dtype=torch.int32)
    outs = []
    for columns in (expert_lora.ALL_ADAPTERS_MAX_COLUMNS, 0):
        monkeypatch.setattr(expert_lora, "ALL_ADAPTERS_MAX_COLUMNS", columns)
        if fmt == "standard":
            outs.append(fused_experts(x, w13, w2, tw, ids, backend="triton", config=ALIGNED_32, lora=lora,
                                      lora_ids=lids))
        else:
            out = batched_experts(xb, counts, w13, w2, backend="triton", lora=lora, lora_ids=slab_ids)
            outs.append(torch.cat([out[e, :c] for e, c in enumerate(counts.tolist())]))  # the valid rows
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("which", ["w13_b", "w2_b"])
@pytest.mark.parametrize("w2_delta", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_adapter_stays_in_its_own_tokens(monkeypatch, which, w2_delta, bad):
    """Two adapters in one product (their columns side by side): a NaN or Inf in adapter 1's B reached adapter 0's
    tokens and those without an adapter (their zero coefficients times NaN), on the aligned and batched rows."""
    from moekit.experts import lora as expert_lora

    monkeypatch.setattr(expert_lora, "DELTA_TRAFFIC_SHARE", 1.0 if w2_delta else 0.0)
    T, E, H, I, k, n, r = 8, 3, 32, 16, 2, 2, 4
    w13, w2 = _weights(E, H, I, torch.float32)
    lora = _lora(n, E, H, I, r, torch.float32)
    getattr(lora, which)[1, :, 0, 0] = bad  # adapter 1, every expert: a diverged or never-written slot
    x, (tw, tid) = torch.randn(T, H), _routes(T, E, k)
    lids = torch.tensor([0, 1, -1, 1] * (T // 4), dtype=torch.int32)
    clean = lids != 1
    got = fused_experts(x, w13, w2, tw, tid, backend="triton", config=ALIGNED_32, lora=lora, lora_ids=lids,
                        out=_poisoned((T, H), torch.float32))
    ref = reference.fused_experts(x, w13, w2, tw, tid, lora=lora, lora_ids=lids)
    check_close("other adapters' tokens", got[clean], ref[clean], EXPERTS_TOL[torch.float32])
    assert not torch.isfinite(got[~clean]).all()  # the bad adapter's own tokens show it, as in the reference
    xb, counts = torch.randn(E, 4, H), torch.tensor([4, 2, 3], dtype=torch.int32)
    slab_ids = torch.tensor([[0, 1, -1, 0], [1, 0, 0, 0], [-1, 1, 0, 0]], dtype=torch.int32)
    got = batched_experts(xb, counts, w13, w2, backend="triton", lora=lora, lora_ids=slab_ids,
                          out=_poisoned((E, 4, H), torch.float32))
    ref = reference.batched_experts(xb, counts, w13, w2, lora=lora, lora_ids=slab_ids)
    rows = (torch.arange(4)[None, :] < counts[:, None]) & (slab_ids != 1)
    check_close("other adapters' rows, batched", got[rows], ref[rows], EXPERTS_TOL[torch.float32])


@pytest.mark.parametrize("mode", ["aligned", "per_pair", "gemv"])
def test_out_may_not_overlap_the_adapters(mode):
    # GEMM2 writes out before the W2 term reads its stacks in the decode modes: a wrong result, now refused
    T, E, H, I, k, n, r = 4, 3, 16, 8, 2, 2, 4
    w13, w2 = _weights(E, H, I, torch.float32)
    x, (tw, tid) = torch.randn(T, H), _routes(T, E, k)
    lids = torch.tensor([0, 1, -1, 1], dtype=torch.int32)
    for name in ("w13_a", "w13_b", "w2_a", "w2_b", "scaling"):
        lora = _lora(n, E, H, I, r, torch.float32)
        held = getattr(lora, name)
        store = torch.empty(max(T * H, held.numel()) + 64)
        view = store[:held.numel()].view(held.shape)
        view.copy_(held)
        parts = {f: getattr(lora, f) for f in ("w13_a", "w13_b", "w2_a", "w2_b")}
        parts[name] = view if name != "scaling" else parts.get(name)
        lora = ExpertsLoRA(**{f: parts[f] for f in ("w13_a", "w13_b", "w2_a", "w2_b")},
                           scaling=view if name == "scaling" else lora.scaling)
        with pytest.raises(ValueError, match=f"out must not overlap the memory of lora.{name}"):
            fused_experts(x, w13, w2, tw, tid, backend="triton", config=MODES[mode], lora=lora, lora_ids=lids,
                          out=store[:T * H].view(T, H))


def test_adapters_that_ask_for_gradients_are_warned_about():
    # LoRA training (only the adapters require grad) got a detached output from the Triton kernels, silently
    T, E, H, I, k, n, r = 4, 3, 16, 8, 2, 2, 4
    w13, w2 = _weights(E, H, I, torch.float32)
    lora = _lora(n, E, H, I, r, torch.float32)
    lora.w13_a.requires_grad_(True)
    x, (tw, tid) = torch.randn(T, H), _routes(T, E, k)
    with pytest.warns(RuntimeWarning, match="compute no gradients"):
        fused_experts(x, w13, w2, tw, tid, backend="triton", lora=lora,
                      lora_ids=torch.zeros(T, dtype=torch.int32))


@pytest.mark.parametrize("mode", ["per_pair", "gemv", "gemv_split", "auto"])
def test_zero_hidden_size_with_adapters(mode):
    # the decode modes' shrink split K = 0 into zero-wide splits: a ZeroDivisionError
    T, E, H, I, k, n, r = 2, 3, 0, 8, 2, 2, 4
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    lora = ExpertsLoRA(torch.randn(n, E, r, H), torch.randn(n, E, 2 * I, r), torch.randn(n, E, r, I),
                       torch.randn(n, E, H, r))
    x, (tw, tid) = torch.randn(T, H), _routes(T, E, k)
    got = fused_experts(x, w13, w2, tw, tid, backend="triton", config=MODES[mode], lora=lora,
                        lora_ids=torch.zeros(T, dtype=torch.int32))
    assert got.shape == (T, 0)


def test_zero_padded_ranks_change_nothing():
    """Adapters of different ranks share a stack by zero padding A's rows and B's columns."""
    T, E, H, I, k = 9, 5, 33, 17, 2
    w13, w2 = _weights(E, H, I, torch.float32)
    small = _lora(1, E, H, I, 3, torch.float32, scaling=[1.5])
    pad = lambda a, b: (torch.nn.functional.pad(a, (0, 0, 0, 5)), torch.nn.functional.pad(b, (0, 5)))  # noqa: E731
    padded = ExpertsLoRA(*pad(small.w13_a, small.w13_b), *pad(small.w2_a, small.w2_b), scaling=1.5)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    lids = torch.zeros(T, dtype=torch.int32)
    a = fused_experts(x, w13, w2, tw, tid, backend="triton", lora=small, lora_ids=lids)
    b = fused_experts(x, w13, w2, tw, tid, backend="triton", lora=padded, lora_ids=lids)
    check_close("rank 3 padded to 8", b, a, EXPERTS_TOL[torch.float32])


def test_scaling_forms_and_a_scaling_tensor_written_in_place():
    E, H, I, n = 3, 16, 8, 2
    base = _lora(n, E, H, I, 2, torch.float32)
    parts = (base.w13_a, base.w13_b, base.w2_a, base.w2_b)
    assert torch.equal(ExpertsLoRA(*parts, scaling=2.0).scaling, torch.tensor([2.0, 2.0]))
    assert torch.equal(ExpertsLoRA(*parts, scaling=(1, 3.0)).scaling, torch.tensor([1.0, 3.0]))
    s = torch.tensor([1.0, 1.0])
    lora = ExpertsLoRA(*parts, scaling=s)
    assert lora.scaling is s                                          # kept: a write into it is seen by later calls
    x, (tw, tid), (w13, w2) = torch.randn(4, H), _routes(4, E, 2), _weights(E, H, I, torch.float32)
    lids = torch.tensor([0, 1, -1, 1], dtype=torch.int32)
    s.copy_(torch.tensor([0.25, 3.0]))
    got = fused_experts(x, w13, w2, tw, tid, backend="triton", lora=lora, lora_ids=lids)
    check_close("scaling written in place", got, reference.fused_experts(
        x, w13, w2, tw, tid, lora=ExpertsLoRA(*parts, scaling=[0.25, 3.0]), lora_ids=lids), EXPERTS_TOL[torch.float32])
    assert torch.equal(ExpertsLoRA(*parts, scaling=torch.tensor(0.5, dtype=torch.float64)).scaling,
                       torch.tensor([0.5, 0.5]))


def _bad(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_bad_adapters_are_refused_by_name_before_any_launch():
    T, E, H, I, k, n, r = 4, 3, 16, 8, 2, 2, 4
    w13, w2 = _weights(E, H, I, torch.float32)
    x = torch.randn(T, H)
    tw, tid = _routes(T, E, k)
    good = _lora(n, E, H, I, r, torch.float32)
    lids = torch.zeros(T, dtype=torch.int32)
    call = lambda lora=good, ids=lids, **kw: fused_experts(x, w13, w2, tw, tid, lora=lora, lora_ids=ids, **kw)  # noqa: E731
    parts = dict(w13_a=good.w13_a, w13_b=good.w13_b, w2_a=good.w2_a, w2_b=good.w2_b)
    # the adapters themselves
    _bad(lambda: ExpertsLoRA(), ValueError, "needs w13_a/w13_b or w2_a/w2_b")
    _bad(lambda: ExpertsLoRA(w13_a=good.w13_a), ValueError, "w13_a and w13_b come together")
    _bad(lambda: ExpertsLoRA(**{**parts, "w13_a": good.w13_a[0]}), ValueError, r"lora\.w13_a must have 4 dimensions")
    _bad(lambda: ExpertsLoRA(**{**parts, "w2_b": good.w2_b.half()}), TypeError, r"lora\.w2_b must have lora\.w13_a's dtype")
    _bad(lambda: ExpertsLoRA(**{**parts, "w13_a": good.w13_a.int()}), TypeError, r"lora\.w13_a must have dtype in")
    _bad(lambda: ExpertsLoRA(**{**parts, "w13_b": good.w13_b[..., :3]}), ValueError, r"lora\.w13_b must be .*r=4")
    _bad(lambda: ExpertsLoRA(**{**parts, "w2_a": good.w2_a[:1], "w2_b": good.w2_b[:1]}), ValueError,
         r"lora\.w2_a must be \[adapters=2")
    zero = torch.zeros(n, E, 0, H)
    _bad(lambda: ExpertsLoRA(**{**parts, "w13_a": zero, "w13_b": torch.zeros(n, E, 2 * I, 0)}), ValueError,
         r"rank .* must be in \[1, 256\], got 0")
    _bad(lambda: ExpertsLoRA(**parts, scaling=[1.0]), TypeError, "2 finite floats")
    _bad(lambda: ExpertsLoRA(**parts, scaling=float("nan")), TypeError, "finite float")
    _bad(lambda: ExpertsLoRA(**parts, scaling=torch.ones(3)), ValueError, r"lora\.scaling must have shape \(2,\)")
    for bad in (float("nan"), float("inf")):  # a CPU tensor's values are read without a sync: as the float forms
        _bad(lambda: ExpertsLoRA(**parts, scaling=torch.tensor([1.0, bad])), TypeError, "must hold finite values")
    _bad(lambda: ExpertsLoRA(**{**parts, "w2_a": good.w2_a[..., :5]}), ValueError, "must fit w13_a")
    # against the call
    _bad(lambda: call(lora="adapters"), TypeError, "lora must be a moekit.experts.ExpertsLoRA")
    _bad(lambda: call(ids=None), ValueError, "lora_ids is required with lora")
    _bad(lambda: fused_experts(x, w13, w2, tw, tid, lora_ids=lids), ValueError, "lora_ids was given without lora")
    _bad(lambda: call(ids=lids.long()), TypeError, r"lora_ids must have dtype in \(int32\)")
    _bad(lambda: call(ids=lids[:3]), ValueError, r"lora_ids must have shape \(4,\)")
    _bad(lambda: call(ids=torch.full((T,), 2, dtype=torch.int32)), ValueError, r"adapter index in \[0, 2\)")
    _bad(lambda: call(ids=torch.full((T,), -2, dtype=torch.int32)), ValueError, r"got values in \[-2, -2\]")
    half = ExpertsLoRA(**{k_: v.half() for k_, v in parts.items()})
    _bad(lambda: call(lora=half), TypeError, "lora tensors must have x's dtype torch.float32")
    wide = _lora(n, E + 1, H, I, r, torch.float32)
    _bad(lambda: call(lora=wide), ValueError, r"lora\.w13_a must have shape \(2, 3, 4, 16\)")
    xb = torch.randn(E, 5, H)
    counts = torch.ones(E, dtype=torch.int32)
    _bad(lambda: batched_experts(xb, counts, w13, w2, lora=good, lora_ids=torch.zeros(E * 5, dtype=torch.int32)),
         ValueError, r"lora_ids must have 2 dimensions")


def test_fused_moe_serves_loaded_adapters():
    layer = FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.float32, scaled=True)
    spec = layer.spec
    E, H, I, n = spec.num_experts, spec.hidden_size, spec.intermediate_size, 3
    lora = _lora(n, E, H, I, 4, torch.float32)
    layer.load_lora(lora)
    assert {"lora_w13_a", "lora_scaling"} <= set(layer.state_dict())
    x = torch.randn(2, 5, H)
    lids = _lora_ids(10, n).reshape(2, 5)
    with torch.no_grad():
        got = layer(x, lora_ids=lids)
        base = layer(x)
        weights, ids = layer.route(x.reshape(-1, H))
    ref = reference.fused_experts(x.reshape(-1, H), layer.w13, layer.w2, weights, ids, lora=lora,
                                  lora_ids=lids.reshape(-1))
    check_close("FusedMoE with LoRA", got.reshape(-1, H), ref, EXPERTS_TOL[torch.float32])
    assert not torch.allclose(got, base)                              # no lora_ids: the base layer
    _bad(lambda: layer(x, lora_ids=lids[:, :4]), ValueError, "lora_ids must have one entry per token")
    # as many entries in another shape: the adapters would be given to other tokens
    _bad(lambda: layer(x, lora_ids=lids.T.contiguous()), ValueError, "lora_ids must have one entry per token")
    layer.load_lora(None)
    _bad(lambda: layer(x, lora_ids=lids), ValueError, "no adapters are loaded")
    _bad(lambda: layer.load_lora(_lora(n, E, H, I, 4, torch.float16)), TypeError, "x's dtype torch.float32")


def test_fused_moe_sees_a_write_into_a_scaling_it_converted():
    # a 0-dim (or fp16, or strided) lora_scaling was converted into a copy the adapters read; a later in-place write
    # into the module's buffer went unseen
    layer = FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.float32, scaled=True)
    spec = layer.spec
    E, H, I, n = spec.num_experts, spec.hidden_size, spec.intermediate_size, 2
    layer.load_lora(_lora(n, E, H, I, 4, torch.float32))
    layer.lora_scaling = torch.tensor(2.0)
    x, lids = torch.randn(6, H), torch.tensor([0, 1, -1, 1, 0, 0], dtype=torch.int32)
    with torch.no_grad():
        layer(x, lora_ids=lids)
        layer.lora_scaling.fill_(-3.0)
        got = layer(x, lora_ids=lids)
        weights, ids = layer.route(x)
    lora = layer.expert_lora()
    want = ExpertsLoRA(lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b, scaling=-3.0)
    check_close("after the write", got, reference.fused_experts(x, layer.w13, layer.w2, weights, ids, lora=want,
                                                                lora_ids=lids), EXPERTS_TOL[torch.float32])


def test_a_converted_lora_scaling_keeps_its_buffer_and_compiles():
    # the buffer was swapped for its converted copy inside forward: a state_dict saved before no longer loaded, and
    # under inference_mode the buffer became an inference tensor; the CPU finiteness check broke torch.compile
    layer = FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.float32, scaled=True)
    spec = layer.spec
    layer.load_lora(_lora(2, spec.num_experts, spec.hidden_size, spec.intermediate_size, 4, torch.float32))
    layer.lora_scaling = torch.tensor(2.0)
    saved = layer.state_dict()
    x, lids = torch.randn(5, spec.hidden_size), torch.tensor([0, 1, -1, 1, 0], dtype=torch.int32)
    with torch.inference_mode():
        want = layer(x, lora_ids=lids)
    assert layer.lora_scaling.shape == () and not layer.lora_scaling.is_inference()
    layer.load_state_dict(saved)
    torch._dynamo.reset()
    fresh = FusedMoE.from_preset("qwen3-30b-a3b", dtype=torch.float32, scaled=True)
    fresh.load_state_dict(layer.state_dict(), strict=False)
    fresh.load_lora(layer.expert_lora())
    fresh.lora_scaling = torch.tensor(2.0)
    with torch.no_grad():  # the adapters built inside the compiled call
        got = torch.compile(fresh, fullgraph=True)(x, lora_ids=lids)
    check_close("compiled", got, want, FP32_REORDERED)


# ------------------------------------------------------------------------------------------------------------ GPU
GPU_PRESETS = ["qwen3-30b-a3b", "gpt-oss-120b"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_PRESETS)
@pytest.mark.parametrize("T", [1, 16, 256, 4096])
@pytest.mark.parametrize("n", [1, 4])
def test_gpu_real_sizes_bf16(name, T, n):
    from moekit import presets

    spec = presets.get(name)
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    w13, w2 = _weights(E, H, I, torch.bfloat16, "cuda")
    lora = _lora(n, E, H, I, 16, torch.bfloat16, "cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    tw, tid = _routes(T, E, k, "cuda")
    lids = _lora_ids(T, n, "cuda") if n > 1 else torch.zeros(T, dtype=torch.int32, device="cuda")
    out = _poisoned((T, H), torch.bfloat16, "cuda")
    fused_experts(x, w13, w2, tw, tid, activation=spec.activation, out=out, lora=lora, lora_ids=lids)
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation=spec.activation, lora=lora, lora_ids=lids)
    check_close(f"{name} T={T} adapters={n}", out, ref, EXPERTS_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act_quant,layout", [("mxfp4", None, "packed"), ("nvfp4", None, "packed"),
                                                  ("fp8_block", "fp8_group", "packed"), ("mxfp4", None, "pairs"),
                                                  ("nvfp4", None, "pairs")])
@pytest.mark.parametrize("T", [1, 256])
@pytest.mark.parametrize("config", [
    None,  # the table's or the heuristic's
    # GEMM2 per pair on the word-decoded 4-bit tiles ("packed" codes): h and w2's LoRA term in paired_k's order
    ExpertsConfig(16, GemmConfig(64, 64), GemmConfig(64, 64), mode="per_pair", split_slots=True),
], ids=["chosen", "per pair, GEMM2 per pair"])
def test_gpu_quantized_bases(fmt, act_quant, layout, T, config):
    from moekit import presets
    from moekit.formats import prepare

    spec = presets.get("gpt-oss-120b" if fmt == "mxfp4" else "qwen3-30b-a3b")
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    w13, w2 = _weights(E, H, I, torch.bfloat16, "cuda")
    q13, q2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
    if layout == "pairs":
        q13, q2 = prepare(q13), prepare(q2)
    lora = _lora(4, E, H, I, 16, torch.bfloat16, "cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    tw, tid = _routes(T, E, k, "cuda")
    lids = _lora_ids(T, 4, "cuda")
    out = fused_experts(x, q13, q2, tw, tid, activation=spec.activation, act_quant=act_quant, lora=lora, lora_ids=lids,
                        config=config)
    ref_fn = reference.fused_experts_w8a8 if act_quant else reference.fused_experts   # dequantizes expert by expert
    ref = ref_fn(x, q13, q2, tw, tid, activation=spec.activation, lora=lora, lora_ids=lids)
    check_close(f"{fmt} T={T}", out, ref, W8A8_TOL if act_quant else EXPERTS_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("name,fmt", [("qwen3-30b-a3b", None), ("gpt-oss-120b", None), ("gpt-oss-120b", "mxfp4"),
                                      ("qwen3-30b-a3b", "nvfp4")])
@pytest.mark.parametrize("T", [1, 4])
@SHRINK_BY_GEMV1
def test_gpu_decode_terms_in_the_gemvs_eager_and_replayed(monkeypatch, name, fmt, T, shrink_by_gemv1):
    """The H200 table's decode configs forced on any GPU (elsewhere T=1 may take the per-pair tensor cores): the
    adapters' terms inside GEMV1/GEMV2, W13's shrink as GEMV1's programmatic parent or computed by GEMV1's own
    programs, eager and in a CUDA graph."""
    import json
    from pathlib import Path

    import moekit.experts
    from moekit import presets
    from moekit.experts import lora as expert_lora

    monkeypatch.setattr(expert_lora, "DECODE_W13_SHRINK_BY_GEMV1", shrink_by_gemv1)
    spec = presets.get(name)
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    table = json.loads(Path(moekit.experts.__file__).with_name("tuned_configs.json").read_text())
    key = "NVIDIA H200|triton-3.6.0|bfloat16" + (f"|{fmt}" if fmt else "")
    entry = table[key][f"E{E}_N{2 * I}_K{H}"][str(T)]
    cfg = ExpertsConfig.from_dict(entry)
    if not cfg.gemv:
        pytest.skip(f"the table's {name} {fmt or 'bf16'} T={T} config is not the CUDA-core decode")
    w13, w2 = _weights(E, H, I, torch.bfloat16, "cuda")
    if fmt:
        w13, w2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
    lora = _lora(4, E, H, I, 16, torch.bfloat16, "cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    tw, tid = _routes(T, E, k, "cuda")
    lids = _lora_ids(T, 4, "cuda")
    out = _poisoned((T, H), torch.bfloat16, "cuda")
    kw = dict(activation=spec.activation, config=cfg, lora=lora, lora_ids=lids, out=out)
    fused_experts(x, w13, w2, tw, tid, **kw)
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation=spec.activation, lora=lora, lora_ids=lids)
    check_close(f"{name} {fmt or 'bf16'} T={T} eager", out, ref, EXPERTS_TOL[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w13, w2, tw, tid, **kw)
    lids.copy_(_lora_ids(T, 4, "cuda"))
    out.fill_(float("nan"))
    for _ in range(3):  # the arrival counters are zero again after every replay
        graph.replay()
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation=spec.activation, lora=lora, lora_ids=lids)
    check_close(f"{name} {fmt or 'bf16'} T={T} replayed", out, ref, EXPERTS_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 256])
def test_gpu_lora_replays_in_a_cuda_graph_with_new_adapter_ids(T):
    from moekit import presets

    spec = presets.get("qwen3-30b-a3b")
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    w13, w2 = _weights(E, H, I, torch.bfloat16, "cuda")
    lora = _lora(4, E, H, I, 16, torch.bfloat16, "cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    tw, tid = _routes(T, E, k, "cuda")
    lids = _lora_ids(T, 4, "cuda")
    out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    fused_experts(x, w13, w2, tw, tid, out=out, lora=lora, lora_ids=lids)     # eager first: configs, checks
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w13, w2, tw, tid, out=out, lora=lora, lora_ids=lids)
    lids.copy_(_lora_ids(T, 4, "cuda"))
    lora.scaling.mul_(2.0)
    out.fill_(float("nan"))
    graph.replay()
    ref = reference.fused_experts(x, w13, w2, tw, tid, lora=lora, lora_ids=lids)
    check_close(f"graph replay T={T}", out, ref, EXPERTS_TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_batched_and_expert_map():
    from moekit import presets

    spec = presets.get("gpt-oss-120b")
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    E_local = E // 4
    w13, w2 = _weights(E_local, H, I, torch.bfloat16, "cuda")
    lora = _lora(4, E_local, H, I, 16, torch.bfloat16, "cuda")
    emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    emap[E_local:2 * E_local] = torch.arange(E_local, dtype=torch.int32, device="cuda")
    T = 256
    x = torch.randn(T, H, device="cuda").bfloat16()
    tw, tid = _routes(T, E, k, "cuda")
    lids = _lora_ids(T, 4, "cuda")
    got = fused_experts(x, w13, w2, tw, tid, activation=spec.activation, expert_map=emap, lora=lora, lora_ids=lids)
    ref = reference.fused_experts(x, w13, w2, tw, tid, activation=spec.activation, expert_map=emap, lora=lora,
                                  lora_ids=lids)
    check_close("expert_map", got, ref, EXPERTS_TOL[torch.bfloat16])
    M = 64
    counts = torch.randint(0, M + 1, (E_local,), dtype=torch.int32, device="cuda")
    valid = torch.arange(M, device="cuda")[None, :] < counts[:, None]
    xb = torch.randn(E_local, M, H, device="cuda").bfloat16()
    xb[~valid] = float("nan")
    lb = torch.randint(-1, 4, (E_local, M), dtype=torch.int32, device="cuda")
    got = batched_experts(xb, counts, w13, w2, activation=spec.activation, lora=lora, lora_ids=lb)
    ref = reference.batched_experts(xb, counts, w13, w2, activation=spec.activation, lora=lora, lora_ids=lb)
    check_close("batched", got[valid], ref[valid], EXPERTS_TOL[torch.bfloat16])


# ------------------------------------------------------------------------------------------------------- benchmark
def test_lora_benchmark_table_and_its_peft_adapter_on_the_cpu():
    """The pieces of benchmarks/bench_lora.py that need no GPU: the PEFT wrapping it times (converted, it is the
    computation moekit times) and the table, with a failed peer's cells empty."""
    pytest.importorskip("peft")
    from types import SimpleNamespace

    from moekit import presets
    from moekit.integrations import peft as moekit_peft
    from moekit.tools.bench import lora as bench

    spec = presets.get("qwen3-30b-a3b").scaled()
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    w13, w2 = _weights(E, H, I, torch.float32)
    from moekit.tools.bench.experts import _hf_experts

    layer = SimpleNamespace(w13=w13, w2=w2, b13=None, b2=None)
    layer.hf = _hf_experts(spec, layer)
    holder = bench.peft_experts(layer, 4)
    lora = moekit_peft.experts_lora(holder.experts)
    x = torch.randn(5, H)
    tw, tid = _routes(5, E, spec.top_k)
    layer.hf.config._experts_implementation = "eager"
    with torch.no_grad():
        expect = holder.experts(x, tid.long(), tw)
    got = fused_experts(x, w13, w2, tw, tid, backend="torch", lora=lora, lora_ids=torch.zeros(5, dtype=torch.int32))
    check_close("PEFT adapter as the benchmark makes it", got, expect, EXPERTS_TOL[torch.float32])
    records = [{"preset": "qwen3-30b-a3b", "T": 1, "adapters": 1, "rank": 16, "moekit_us": 20.0, "moekit_lora_us": 22.0,
                "overhead": 0.1, "meets_target": True, "peft_base_us": 100.0, "peft_lora_us": None,
                "peft_lora_mode": "RuntimeError: boom", "vs_peft_rms_rel": 1e-3},
               {"preset": "gpt-oss-120b", "T": 4096, "adapters": 4, "rank": 16, "moekit_us": 900.0,
                "moekit_lora_us": 1000.0, "overhead": 1 / 9}]
    md = bench.markdown(records, {"gpu": "H200", "date": "today", "torch": "t", "triton": "3.6"})
    assert "| qwen3-30b-a3b | 1 | 1 | 20.0 | 22.0 | +10% | met | 100.0 | - | - | - | 1.0e-03 |" in md
    assert "| gpt-oss-120b | 4096 | 4 | 900.0 | 1000.0 | +11% | - |" in md
    assert "peft_lora_mode=RuntimeError: boom" in md


@contextlib.contextmanager
def _recording(kernel, constants: list):
    """``kernel``'s launches record their constexprs into ``constants``. The instance attribute is removed after
    (monkeypatch would leave the bound method there, and a later class-level stub would miss this instance)."""
    real = kernel.launch
    kernel.launch = lambda *a: constants.append(a[2]) or real(*a)
    try:
        yield
    finally:
        del kernel.launch
