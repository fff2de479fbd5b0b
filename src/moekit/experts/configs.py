"""Block configurations of the expert GEMMs: a tuned table shipped as data, and a heuristic.

The table (``experts/tuned_configs.json``) is written by ``moekit tune`` on a GPU and
keyed by GPU name, Triton version, dtype, (E, N, K) of GEMM1 and a token bucket; shapes it lacks
fall back to :func:`heuristic`. :func:`explain` says which one served a call.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from importlib import resources

import torch

from .. import _invariant, _triton
from ..formats import FOUR_BIT_FORMATS, WEIGHT_FORMATS, recipe_format
from ..formats import fp8 as fp8_format

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TABLE_FILE = "tuned_configs.json"
PER_PAIR_MAX_TOKENS = 2  # heuristic: the per-pair decode mode up to this many tokens
FOUR_BIT_GEMV_MAX_TOKENS = 16  # heuristic: 4-bit weights on the CUDA-core decode kernels up to here
FOUR_BIT_MIN_BLOCK_K = 32  # a K tile must hold whole scale groups (32 for MXFP4, 16 for NVFP4)
FOUR_BIT_TILE_BUDGET = 16384  # dequantized weight elements per K step for 4 warps (16-bit, in MMA registers)
ALIGN_ONE_PROGRAM_MAX = 256  # the alignment's pairs in one program: above, its serial chunk steps cost more than
# the three-launch version's 2 extra launches
FP8_BLOCK_K = fp8_format.BLOCK  # FP8 activations: one 1x128 group per K step, each step promoted with its scale


def _check_pow2(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two, got {value!r}")


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of one grouped GEMM (kernels/moe_gemm.py). GEMM1 computes BLOCK_N gate and
    BLOCK_N up columns per program. Each switch below belongs to the kernels of some ExpertsConfig modes, which
    refuses it under the others; within its modes, weights it cannot apply to run without it."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1
    tma: bool = False
    """Weight tiles by Hopper TMA copies (modes "aligned" and "per_pair"; dense and FP8 weights where the stack
    allows it, other weights keep the per-thread copies)."""
    half_tails: bool = False
    """Mode "aligned": row blocks (BLOCK_M >= 32) whose second half is padding compute BLOCK_M // 2 rows:
    each expert's last block is one about half the time at prefill sizes. Both row counts compile
    into the kernel (twice its code); the block picks at run time."""
    slots: int | None = None
    """On the CUDA cores (ExpertsConfig mode "gemv"), a token's slots (pairs) handled together, a power of
    two. GEMM1: pairs per program, their experts' rows loaded together and the token's activation
    chunk shared (None: 1). GEMM2: slots read per step of one loop over (group of slots, K chunk),
    or 0 for a loop per slot (None: the weight format's default, dense 1, 4-bit 0)."""
    packed: bool | None = None
    """On the CUDA cores (mode "gemv") with 4-bit weights and 16-bit activations: the products as fp16x2 FMAs, a group's
    sum widened to fp32 once, on activations prepared as fp16 with an exponent per 32 (one more launch).
    GEMM1: None is on; GEMM2 (its loop per slot, on GEMM1's output): only True. fp32 activations keep fp32
    products; dense weights ignore it."""
    scales_ahead: bool | None = None
    """Tensor-core GEMMs (modes "aligned" and "per_pair") with 4-bit weights: each K step's block-scale codes loaded one step ahead (single
    bytes, which the software pipeline does not copy asynchronously). None: on for MXFP4, off for NVFP4, as
    measured on the H200 (benchmarks/results/archive/ab_scales_ahead_2026-12-03.md, 2026-12-03: gpt-oss MXFP4 T=256..4096 7-14% faster; qwen3 NVFP4 T=256/1024 16-24%
    slower, T=4096 4% faster); other weights ignore it."""
    row_scaled: bool = False
    """On the CUDA cores (mode "gemv") with 4-bit weights and 16-bit activations: fp16x2 products on activation
    rows scaled to fp16 by one power of two each, inside the kernel (no preparation launch; 2^(14 - e) with e the
    row's largest exponent keeps every bf16 value down to 2^-28 of the largest exact). GEMM1: on
    kernels/gemv1_rows.py, 2 * block_n rows of w13 per program in their stored order (slots and packed do not
    apply). GEMM2: its loop per slot, each slot's h row scaled (slots and packed do not apply). Dense weights and
    fp32 activations ignore it."""
    maxnreg: int | None = None
    """On the CUDA cores (mode "gemv"): the kernels' registers per thread at most (Triton's ``maxnreg``; None: the
    compiler's choice). A decode GEMV of 4 warps at 169-255 registers fits 2 programs per SM, at 168 or fewer 3:
    more bytes in flight, a tighter schedule. gpt-oss-120b's bf16 GEMV1 builds in 211 for sm_90; capped at 168, its
    T=1 call took 72.3 us against 74.8 on an H100
    (benchmarks/results/archive/ab_decode_maxnreg_h100_2026-12-07.md). A cap below a kernel's need spills, and one
    above it is no ceiling only: ptxas spends up to it, so the kernel may fit fewer programs per SM than uncapped. With
    expert LoRA's terms inside GEMV1 the cap is dropped (experts/lora.py DECODE_TERMS_MAXNREG decides there)."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):  # tl.arange and warp counts take powers of two
            _check_pow2(f"GemmConfig.{name}", getattr(self, name))
        for name in ("num_stages", "group_m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GemmConfig.{name}: expected an int >= 1, got {value!r}")
        if self.maxnreg is not None and (isinstance(self.maxnreg, bool) or not isinstance(self.maxnreg, int)
                                         or not 24 <= self.maxnreg <= 255):
            raise ValueError(f"GemmConfig.maxnreg: expected None or an int in [24, 255], got {self.maxnreg!r}")
        if self.slots is not None and (self.slots < 0 or self.slots & (self.slots - 1)):
            raise ValueError(f"GemmConfig.slots: expected None, 0 or a power of two, got {self.slots}")


def four_bit_block_k(cfg: GemmConfig, tiles: int = 1) -> int:
    """The K step a tensor-core GEMM on 4-bit weights runs for ``cfg``: whole scale groups, and the dequantized
    16-bit values of ``tiles`` weight tiles per step within the registers of its warps (tests/sm90_compile.py shows
    spills past this)."""
    block_k = max(cfg.block_k, FOUR_BIT_MIN_BLOCK_K)
    while block_k > FOUR_BIT_MIN_BLOCK_K and tiles * cfg.block_n * block_k > FOUR_BIT_TILE_BUDGET * cfg.num_warps // 4:
        block_k //= 2
    return block_k


MODES = ("aligned", "per_pair", "gemv")
# GemmConfig switches and the modes whose kernels read them
_SWITCH_MODES = {"tma": ("aligned", "per_pair"), "half_tails": ("aligned",), "scales_ahead": ("aligned", "per_pair"),
                 "slots": ("gemv",), "packed": ("gemv",), "row_scaled": ("gemv",),
                 "maxnreg": ("gemv",)}


@dataclass(frozen=True)
class ExpertsConfig:
    """Both GEMMs of one fused_experts call; they share the row block (the alignment's BLOCK_M)."""

    block_m: int
    gemm1: GemmConfig
    gemm2: GemmConfig
    mode: str = "aligned"
    """How the pairs reach the GEMMs:
    - "aligned": pairs sorted by expert into BLOCK_M-row blocks (the alignment kernel), tensor-core GEMMs, the
      k slots summed by the combine kernel (four launches);
    - "per_pair": the decode mode without alignment: GEMM1 per (token, slot) pair on 16-row tensor-core tiles,
      GEMM2 per token over its slots, each slot's output rounded to the output dtype and the slots added in order
      as the combine kernel adds them (block_m unused); two launches, an expert picked by several tokens is read
      once per pick (``split_slots``: GEMM2 per pair and the combine, three);
    - "gemv": "per_pair" on the CUDA cores (kernels/moe_gemv.py): one activation row per program instead of a
      16-row tile; block_k is then the K chunk per step."""
    pdl: bool = False
    """"gemv" only: GEMM2 is launched as GEMM1's programmatic dependent (Hopper and later; ignored elsewhere): its
    programs start while GEMM1's last ones run, load their first weights, and wait for GEMM1's grid before
    reading its output."""
    split_slots: bool = False
    """"gemv" and "per_pair": GEMM2 runs one program per (pair, BLOCK_N columns) instead of per token, each slot's
    weighted output into a [T*k, H] buffer (fp32 for "gemv", the output dtype for "per_pair": the aligned mode's
    GEMM2 and buffer) that the combine kernel sums in slot order: k times GEMM2's programs and a serial loop over
    one slot's K instead of all k, for one more launch."""

    def __post_init__(self) -> None:
        _check_pow2("ExpertsConfig.block_m", self.block_m)
        if self.block_m < 16:
            raise ValueError(f"ExpertsConfig.block_m: expected a power of two >= 16 (the MMA's rows), got {self.block_m}")
        for name in ("gemm1", "gemm2"):
            if not isinstance(getattr(self, name), GemmConfig):
                raise TypeError(f"ExpertsConfig.{name} must be a GemmConfig, got {type(getattr(self, name)).__name__}")
        if self.mode not in MODES:
            raise ValueError(f"ExpertsConfig.mode: expected one of {MODES}, got {self.mode!r}")
        if self.pdl and self.mode != "gemv":
            raise ValueError(f"ExpertsConfig.pdl applies to mode 'gemv' only, got mode {self.mode!r}")
        if self.split_slots and self.mode == "aligned":
            raise ValueError("ExpertsConfig.split_slots applies to modes 'gemv' and 'per_pair' only, got mode "
                             "'aligned'")
        # each GemmConfig switch belongs to the kernels of some modes: set under another, it is refused, not ignored
        for gemm in ("gemm1", "gemm2"):
            g = getattr(self, gemm)
            for name, modes in _SWITCH_MODES.items():
                if getattr(g, name) not in (None, False) and self.mode not in modes:
                    raise ValueError(f"ExpertsConfig.{gemm}.{name} applies to mode "
                                     f"{' or '.join(repr(m) for m in modes)} only, got mode {self.mode!r}")

    @property
    def per_pair(self) -> bool:
        """No alignment: the "per_pair" and "gemv" modes."""
        return self.mode != "aligned"

    @property
    def gemv(self) -> bool:
        """The CUDA-core decode kernels."""
        return self.mode == "gemv"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertsConfig":
        """From :meth:`to_dict`'s form (tables written before modes had a name spell them with the booleans
        ``per_pair`` and ``gemv``)."""
        mode = d.get("mode") or ("gemv" if d.get("gemv") else "per_pair" if d.get("per_pair") else "aligned")
        return cls(d["block_m"], GemmConfig(**d["gemm1"]), GemmConfig(**d["gemm2"]), mode, d.get("pdl", False),
                   d.get("split_slots", False))


def token_bucket(num_tokens: int) -> int:
    """The smallest bucket >= num_tokens (the largest bucket beyond it)."""
    for b in TOKEN_BUCKETS:
        if num_tokens <= b:
            return b
    return TOKEN_BUCKETS[-1]


def heuristic(num_tokens: int, num_experts: int, top_k: int, n1: int, k1: int,
              weight_format: str = "dense", gemv_rows: bool = True) -> ExpertsConfig:
    """Rows per expert decide the regime: about one row per expert streams weights (small row
    block, narrow columns so many programs share the bytes), many rows reuse each weight tile
    (128-row blocks, wide tiles, L2-grouped ordering). 4-bit weights at decode sizes go to the
    CUDA-core kernels; above, tensor-core tiles hold 64 or 128 weight rows as the MMA's M side.
    ``gemv_rows``: 4-bit decode's GEMV1 on the rows kernel (:func:`choose` says where it applies)."""
    rows = num_tokens * top_k / max(num_experts, 1)
    if weight_format in FOUR_BIT_FORMATS and num_tokens <= FOUR_BIT_GEMV_MAX_TOKENS:
        chunk = lambda k, most: min(most, max(32, 1 << (k - 1).bit_length()))  # noqa: E731 - none wider than K
        gemm1 = GemmConfig(block_n=16, block_k=chunk(k1, 256), num_warps=4, num_stages=1)
        if gemv_rows:
            # GEMM1 on the rows kernel (16 rows of one expert per program, 1024-code chunks, three in flight: the
            # stream-and-decode design). Whole calls against the GEMV1 above, the same bits, on an H100
            # (benchmarks/results/archive/ab_rows_heuristic_{gptoss,qwen3}_h100_2026-12-06.md): gpt-oss-120b MXFP4
            # T=1..16 0.95-0.86x, qwen3-30b-a3b NVFP4 0.72-0.89x.
            gemm1 = GemmConfig(block_n=8, block_k=chunk(k1, 1024), num_warps=4, num_stages=3, row_scaled=True)
        return ExpertsConfig(16, gemm1, GemmConfig(block_n=16, block_k=chunk(n1 // 2, 256), num_warps=4, num_stages=1),
                             mode="gemv")
    if weight_format in FOUR_BIT_FORMATS:
        # The weight tile is the MMA's A operand: 64 or 128 weight rows per tile, the tokens on the
        # MMA's N side. Past these sizes GEMM1's two accumulators spill (tests/sm90_compile.py).
        if rows <= 24:
            return ExpertsConfig(16 if rows <= 12 else 32, GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4),
                                 GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4))
        if rows <= 96:
            tile = GemmConfig(block_n=128, block_k=128, num_warps=8, num_stages=3, group_m=4)
            return ExpertsConfig(64, tile, tile)
        tile = GemmConfig(block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=8)
        return ExpertsConfig(128, tile, tile)
    if weight_format == "w4a8":
        # MXFP4 recoded for FP8 tensor cores (K steps of one 128-group, GEMM1 tiles of 128 columns), gpt-oss-120b on
        # the H200 (benchmarks/results/archive/w4a8_configs_2026-12-04.md, 2026-12-04): 16-row blocks up to 64 tokens (the per-pair mode and 32-row blocks slower;
        # GEMM1 on 8 warps, where 4 spill inside the K loop: T=1 96.3 against 118.8 us, T=16 679.1 against 663.3),
        # 64 rows to T = 1024, then 128 rows, GEMM1 on 16 warps (its two 128 x 128 accumulators spill 792 bytes at
        # 8 warps, 236 at 16: 3769 against 4421 us at T = 4096; 64-row blocks without spills 5194) and GEMM2 on 8
        if rows <= 4:
            return ExpertsConfig(16, GemmConfig(block_n=128, block_k=128, num_warps=8, num_stages=3, group_m=8),
                                 GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, group_m=8))
        if rows > 96:
            return ExpertsConfig(128, GemmConfig(block_n=128, block_k=128, num_warps=16, num_stages=3, group_m=8),
                                 GemmConfig(block_n=128, block_k=128, num_warps=8, num_stages=3, group_m=8))
    if num_tokens <= PER_PAIR_MAX_TOKENS:
        return ExpertsConfig(16, GemmConfig(block_n=32, block_k=128, num_warps=4, num_stages=4),
                             GemmConfig(block_n=32, block_k=128, num_warps=4, num_stages=4), mode="per_pair")
    if rows <= 4:
        tile = GemmConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
        return ExpertsConfig(16, tile, tile)
    if rows <= 24:
        tile = GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
        return ExpertsConfig(32 if rows > 12 else 16, tile, tile)
    if weight_format in ("fp8", "w4a8"):
        # GEMM1's two 128-column FP8 accumulators spill at 128 rows (H200: 2.8x slower) and with
        # 4 warps or 4 stages at 64 rows (tests/sm90_compile.py)
        return ExpertsConfig(64, GemmConfig(block_n=128, block_k=128, num_warps=8, num_stages=3, group_m=8),
                             GemmConfig(block_n=128, block_k=128, num_warps=4, num_stages=4, group_m=8))
    if rows <= 96:
        tile = GemmConfig(block_n=64, block_k=64, num_warps=4, num_stages=4, group_m=4)
        return ExpertsConfig(64, tile, GemmConfig(block_n=128, block_k=64, num_warps=4, num_stages=4, group_m=4))
    return ExpertsConfig(128, GemmConfig(block_n=64, block_k=64, num_warps=8, num_stages=4, group_m=8),
                         GemmConfig(block_n=128, block_k=64, num_warps=8, num_stages=4, group_m=8))


@functools.cache
def _table() -> dict:
    try:
        return json.loads(resources.files("moekit.experts").joinpath(TABLE_FILE).read_text())
    except FileNotFoundError:
        return {}


def config_family(weights: str, act_quant: str | None = None) -> str:
    """The table's and the heuristic's name for a call's kernels: the weight format (a quantize recipe such as
    fp8_block names its format: one kernel, the scales' granularity a runtime choice), or "w4a8" for MXFP4 weights
    with FP8 activation groups."""
    family = weights if weights in WEIGHT_FORMATS else recipe_format(weights)
    if act_quant is None or family == "fp8":  # FP8 weights run W8A8 whether or not it is spelled out
        return family
    if act_quant != "fp8_group" or family != "mxfp4":
        raise ValueError(f"act_quant={act_quant!r} runs on the kernels only as 'fp8_group' with FP8 or MXFP4 weights "
                         f"(W8A8, W4A8), got weights {weights!r}")
    return "w4a8"


def table_key(device: torch.device, dtype: torch.dtype, weight_format: str = "dense") -> str:
    import triton

    fmt = "" if weight_format == "dense" else f"|{weight_format}"
    return f"{_triton.gpu_name(device)}|triton-{triton.__version__}|{str(dtype).removeprefix('torch.')}{fmt}"


# A GPU's own table entries serve it first; a bucket it has none for takes those tuned on the GPU named here for
# its compute capability: the same SMs, instructions and shared memory, so every entry compiles and fits; bandwidth
# and clocks differ (an H100 on the H200's entries against its heuristic: 0.68-0.84x the time at T=1, 0.79-0.94x at
# T=4096, benchmarks/results/archive/ab_sibling_table_h100_2026-12-06.md).
TUNED_FOR_CAPABILITY = {(9, 0): "NVIDIA H200"}


def serving_keys(device: torch.device, dtype: torch.dtype, weight_format: str = "dense") -> tuple[str, ...]:
    """The table keys whose entries serve calls on ``device``, first the one that wins a bucket: its own GPU's, then
    that of the GPU tuned for its compute capability (:data:`TUNED_FOR_CAPABILITY`) where that is another GPU."""
    key = table_key(device, dtype, weight_format)
    if device.type != "cuda":
        return (key,)
    tuned = TUNED_FOR_CAPABILITY.get(_triton.capability(device))
    if tuned is None or key.startswith(tuned + "|"):
        return (key,)
    return key, tuned + key[key.index("|"):]


@functools.lru_cache(maxsize=256)
def served_entries(keys: tuple[str, ...], shape: str) -> dict[str, tuple[dict, str]]:
    """{bucket: (entry, its table key)} for ``shape`` under :func:`serving_keys`'s keys: an earlier key's entry wins
    its bucket, so a GPU tuned for some buckets keeps the borrowed ones for the rest."""
    merged: dict = {}
    for key in reversed(keys):
        merged.update({bucket: (entry, key) for bucket, entry in shipped_entries(key, shape).items()})
    return merged


def shape_key(num_experts: int, n1: int, k1: int) -> str:
    return f"E{num_experts}_N{n1}_K{k1}"


def shipped_entries(key: str, shape: str) -> dict:
    """The package table's entries for one table key and shape: {bucket as str: entry dict} (empty if none)."""
    return _table().get(key, {}).get(shape, {})


@functools.lru_cache(maxsize=4096)
def _choose(keys: tuple[str, ...], shape: str, num_tokens: int, num_experts: int, top_k: int, n1: int, k1: int,
            weight_format: str, gemv_rows: bool):
    # gemv_rows has no default: lru_cache keys an omitted argument apart from the same value passed
    entries = served_entries(keys, shape)
    bucket = token_bucket(num_tokens)
    near = bucket if str(bucket) in entries else nearest_tuned_bucket(bucket, [int(b) for b in entries])
    if near is None:
        return (heuristic(num_tokens, num_experts, top_k, n1, k1, weight_format, gemv_rows),
                f"heuristic (no tuned entry for {shape} at or below T<={bucket} in {' or '.join(map(repr, keys))})")
    entry, key = entries[str(near)]
    where = f"T<={bucket}" if near == bucket else f"T<={near}, the nearest tuned bucket to T<={bucket}"
    borrowed = "" if key == keys[0] else (f"; {keys[0].split('|')[0]} has no entry for this bucket: "
                                          f"{key.split('|')[0]}'s, the same compute capability")
    return ExpertsConfig.from_dict(entry), f"tuned for {shape} at {where} ({key}){borrowed}"


def nearest_tuned_bucket(bucket: int, tuned: list[int]) -> int | None:
    """The tuned bucket that serves a bucket without an entry: between two tuned buckets the one above, past the
    largest the largest; below the smallest none (the heuristic: no entry was measured in that regime, e.g. the
    decode sizes of a table tuned from T=256 up). Between entries a neighbour beat the heuristic in most of the
    gaps measured on the H200 (by up to 40% at gpt-oss MXFP4 T=2048), the one above more often than the one
    below: its row blocks and tiles suit more rows, which a bucket's upper end has (benchmarks/results/archive/ab_bucket_gaps_2026-12-03.md, 2026-12-03)."""
    above = [b for b in tuned if b > bucket]
    below = [b for b in tuned if b < bucket]
    if not below:
        return None
    return min(above) if above else max(below)


def choose(num_tokens: int, num_experts: int, top_k: int, n1: int, k1: int, device: torch.device,
           dtype: torch.dtype, weight_format: str = "dense", lora: bool = False,
           batched: bool = False) -> tuple[ExpertsConfig, str]:
    """(config, where it comes from) for GEMM1 = [E, n1=2I, k1=H] at ``num_tokens`` tokens, with
    activations of ``dtype`` and weights in ``weight_format`` ("dense", "mxfp4", "nvfp4"); ``lora`` (the call has
    expert adapters) and ``batched`` (the batched format's tensor-core GEMMs) keep the heuristic's 4-bit decode off
    the rows GEMV1: the batched format has no CUDA-core form, fp32 activations no rows kernel, and with adapters the
    rows GEMV1 (its decode terms one pair per program: gpt-oss-120b's 360 column blocks per pair overflow their sum's
    tile and take the separate kernels) has not been timed against the other; in batch-invariant mode
    (:mod:`moekit._invariant`) :func:`invariant_choice`'s."""
    keys, shape = serving_keys(device, dtype, weight_format), shape_key(num_experts, n1, k1)
    if _invariant.enabled():
        return _invariant_choose(keys, shape, num_tokens, num_experts, top_k, n1, k1, weight_format,
                                 not (lora or batched))
    rows = not (lora or batched) and dtype in (torch.bfloat16, torch.float16)
    return _choose(keys, shape, num_tokens, num_experts, top_k, n1, k1, weight_format, rows)


# Batch-invariant configurations. A token's bits depend on the order in which each GEMM adds its K terms and on
# how the k slots are combined. The aligned mode fixes the second (each slot's weighted output rounded to x's
# dtype, then the slots summed in order) at every T, and so does "per_pair" (INVARIANT_PER_PAIR below), while
# "gemv" sums each K chunk across the CUDA cores' lanes: so "aligned" serves, "per_pair" where it keeps the aligned
# mode's products. Inside the aligned mode, with 16-bit
# activations, a GEMM adds its K terms as one chain of MMA instructions on one accumulator (tl.dot(a, w, acc)),
# whatever the K step, the tile's rows or columns: so for 4-bit weights the default mode's aligned configs serve as
# they are, half tails included (on an H100, 2026-12-07: 128- against 64-deep steps, half tails and the default's
# own configs kept every bit of MXFP4 and NVFP4 calls at T = 1-1024,
# benchmarks/results/archive/ab_invariant_tiling_h100_2026-12-07.md; 16- against 64-row tiles earlier,
# ab_invariant_rows_2026-12-05.md), but for NVFP4 weight tiles of fewer than 64 rows (mma.sync rounds those
# products otherwise). Dense weights keep one K step per shape class and no half tails (not measured otherwise).
# FP8 x FP8 products (W8A8, W4A8) multiply a scale in after each 128-deep step, and fix the tensor-core
# instruction: Triton builds tiles of fewer than 64 rows from mma.sync and larger ones from wgmma, whose FP8
# accumulation rounds differently (measured on the H200, benchmarks/results/invariant.md 2026-12-05: deepseek-v3
# W8A8 lost invariance where T reached 64-row tiles), so those formats run 64-row tiles on whole warpgroups at
# every T, without half tails, one K step per shape class, and GEMM2 columns within one 128-row weight block (one
# scale per tile, which the kernel multiplies in another order than per-column scales).
INVARIANT_MAX_STAGES = 6  # a dense K step shorter than the tuned one gets more stages (same bytes in flight)
# Dense weights at the sizes where the default runs a decode mode (T <= 2 in the heuristic): the per-pair mode, three
# or two launches where the aligned mode takes four (alignment, GEMM1, GEMM2, combine). A pair's GEMM1 row and GEMM2
# slot are the same 16-row tensor-core products with the same K steps as in an aligned row block, and its GEMM2
# rounds each slot's weighted output to the output dtype before the slots are added in order in fp32, as the aligned
# mode's per-pair buffer and combine kernel do: the same bits (per_pair_keeps_aligned_bits says where). Not for
# adapters (their terms run other kernels in that mode), the batched format or FP8 products (64-row wgmma tiles at
# every T); 4-bit weights below (INVARIANT_PER_PAIR_4BIT).
INVARIANT_PER_PAIR = True
# Its GEMM2: per pair into the aligned mode's buffer, then the combine kernel (True: three launches, one program per
# pair and column tile, as the aligned GEMM2 runs at these sizes), or per token over its slots (False: two launches,
# T x H / BLOCK_N programs, each streaming its k experts' tiles one after another). Not yet timed against each
# other or against the aligned mode's four launches (benchmarks/experiments/ab_invariant_per_pair.py).
INVARIANT_PER_PAIR_SPLIT_SLOTS = True  # (both read by the lru-cached _invariant_choose: cache_clear() after a change)
# 4-bit weights where the default runs the CUDA-core decode kernels: the per-pair mode with GEMM2 per pair too (the
# aligned GEMMs' own code on per-pair rows, so the same bits; checked under the interpreter). Off until a GPU times it
# against the aligned mode (ab_invariant_per_pair.py --formats mxfp4 nvfp4): the 4-bit decode misses are in the GEMMs'
# time, which this leaves as it is, and only the alignment's launch would go.
INVARIANT_PER_PAIR_4BIT = False
FP8_DOT_FORMATS = ("fp8", "w4a8")
WGMMA_MIN_ROWS = 64


def per_pair_keeps_aligned_bits(weight_format: str, split_slots: bool) -> bool:
    """Whether the per-pair mode gives the aligned mode's bits, for 16-bit activations without adapters: dense
    weights in either GEMM2 form; 4-bit weights with GEMM2 per pair (``split_slots``: the aligned GEMMs' own code on
    per-pair rows; per token, their GEMM2 takes the weights as the MMA's B operand, the aligned one as A)."""
    return weight_format == "dense" or (weight_format in FOUR_BIT_FORMATS and split_slots)


def _first_aligned_tokens(weight_format: str) -> int:
    """The smallest T at which the heuristic takes the aligned mode: its tiles for a few rows per expert."""
    return FOUR_BIT_GEMV_MAX_TOKENS + 1 if weight_format in FOUR_BIT_FORMATS else PER_PAIR_MAX_TOKENS + 1


def _effective_block_k(cfg: GemmConfig, weight_format: str, tiles: int) -> int:
    """The K step the kernels run for ``cfg`` (experts/triton_backend.py WeightOperand.config)."""
    if weight_format in ("fp8", "w4a8"):
        return FP8_BLOCK_K
    if weight_format in FOUR_BIT_FORMATS:
        return four_bit_block_k(cfg, tiles)
    return cfg.block_k


def _reduction_steps(keys: tuple[str, ...], shape: str, num_experts: int, n1: int, k1: int,
                     weight_format: str) -> tuple[int, int, str]:
    """(GEMM1's K step, GEMM2's K step, where they come from) of a shape class: those of its prefill configuration
    (the largest tuned bucket, else the heuristic at many rows per expert), where the GEMMs are compute-bound and
    their tiles matter most; decode sizes are bandwidth-bound and keep their bytes in flight with more stages."""
    cfg, source = _choose(keys, shape, TOKEN_BUCKETS[-1], num_experts, num_experts, n1, k1, weight_format, True)
    if cfg.mode != "aligned":
        cfg = heuristic(TOKEN_BUCKETS[-1], num_experts, num_experts, n1, k1, weight_format)
        source = "heuristic at many rows per expert"
    return _effective_block_k(cfg.gemm1, weight_format, 2), _effective_block_k(cfg.gemm2, weight_format, 1), source


def _with_block_k(g: GemmConfig, block_k: int, weight_format: str) -> GemmConfig:
    """``g`` running K steps of ``block_k``, without half tails: dense tiles with stages scaled so that the bytes in
    flight stay those of ``g`` (up to INVARIANT_MAX_STAGES); FP8 tiles (the kernels' own 128-deep steps) with GEMM2
    columns within one 128-row weight block."""
    if weight_format in FP8_DOT_FORMATS:
        stages, block_n = (g.num_stages if g.block_k == block_k else min(g.num_stages, 4)), min(g.block_n, FP8_BLOCK_K)
    else:
        stages, block_n = max(2, min(INVARIANT_MAX_STAGES, g.num_stages * g.block_k // block_k)), g.block_n
    return replace(g, block_k=block_k, num_stages=stages, block_n=block_n, half_tails=False, slots=None, packed=None)


INVARIANT_DECODE_4BIT = {"nvfp4": dict(block_k=128, num_stages=3), "mxfp4": dict(block_k=64, num_stages=6)}
"""4-bit tiles at decode sizes (where the default runs the CUDA-core kernels), per format. NVFP4: 128-deep K steps
on 3 stages; on an H100 at T=1, against 64-deep steps on 6 stages, the same bits and 46.2 -> 35.1 us
(qwen3-30b-a3b, benchmarks/results/archive/ab_invariant_tiling_h100_2026-12-07.md), and in the bench after it
T=4 / 16 at 1.21x / 0.99x the default against 1.47x / 1.27x (archive/invariant_4bit_h100_2026-12-07.md). MXFP4:
64-deep steps on 6 stages; 128-deep ones were even at T=1 (72.5 -> 72.4 us, gpt-oss-120b) and slower at T=4 / 16
in the bench (166.0 / 477.2 us against 159.6 / 447.1; two H100s, the default's times within 2%)."""


@functools.lru_cache(maxsize=4096)
def _invariant_choose(keys: tuple[str, ...], shape: str, num_tokens: int, num_experts: int, top_k: int, n1: int,
                      k1: int, weight_format: str, per_pair: bool = True):
    """``per_pair``: the call may take the per-pair mode (a standard-format call without adapters)."""
    if weight_format not in FOUR_BIT_FORMATS:
        return _invariant_pinned_choose(keys, shape, num_tokens, num_experts, top_k, n1, k1, weight_format,
                                        per_pair)
    cfg, source = _choose(keys, shape, num_tokens, num_experts, top_k, n1, k1, weight_format, True)
    if cfg.mode != "aligned":
        cfg, source = _invariant_decode_tiles(num_tokens, num_experts, top_k, n1, k1, weight_format, cfg.mode)
        if per_pair and INVARIANT_PER_PAIR_4BIT and per_pair_keeps_aligned_bits(weight_format, True):
            g1, g2 = (replace(_invariant_tile(g, weight_format), half_tails=False) for g in (cfg.gemm1, cfg.gemm2))
            return ExpertsConfig(16, g1, g2, mode="per_pair", split_slots=True), (
                f"batch-invariant: per-pair mode (no alignment: the aligned GEMMs' 16-row tiles on one pair each, "
                f"GEMM2 per pair and the combine kernel, as the aligned mode's); tiles from {source}")
    g1, g2 = _invariant_tile(cfg.gemm1, weight_format), _invariant_tile(cfg.gemm2, weight_format)
    return ExpertsConfig(cfg.block_m, g1, g2), (
        f"batch-invariant: aligned mode (K steps, row blocks and tiles follow T: a step's K terms are one chain of "
        f"MMA instructions on one accumulator); tiles from {source}")


def _invariant_decode_tiles(num_tokens: int, num_experts: int, top_k: int, n1: int, k1: int, weight_format: str,
                            default_mode: str, block_k: int | None = None) -> tuple[ExpertsConfig, str]:
    """The aligned tiles that serve where the default runs a decode mode: the heuristic's at the first T it aligns,
    else 16-row tiles of ``block_k``-deep steps; 4-bit ones with INVARIANT_DECODE_4BIT."""
    tokens = max(num_tokens, _first_aligned_tokens(weight_format))
    cfg = heuristic(tokens, num_experts, top_k, n1, k1, weight_format)
    source = f"the heuristic's aligned tiles at T={tokens} (the default's {default_mode!r} mode sums in another order)"
    if cfg.mode != "aligned":  # no aligned regime of the heuristic at this few rows per expert
        bk = block_k or 64
        cfg = ExpertsConfig(16, GemmConfig(block_n=64, block_k=bk, num_warps=4, num_stages=4),
                            GemmConfig(block_n=64, block_k=bk, num_warps=4, num_stages=4))
        source = "16-row aligned tiles"
    if weight_format in FOUR_BIT_FORMATS:
        steps = INVARIANT_DECODE_4BIT[weight_format]
        cfg = replace(cfg, gemm1=replace(cfg.gemm1, **steps), gemm2=replace(cfg.gemm2, **steps))
    return cfg, source


def _invariant_tile(g: GemmConfig, weight_format: str) -> GemmConfig:
    """``g`` as the mode runs it (16-bit activations): NVFP4 weight tiles of 64 rows or more."""
    if weight_format == "nvfp4":
        # NVFP4 weight tiles (the MMA's M side) of fewer than 64 rows run on mma.sync, whose products round
        # otherwise than wgmma's (H100: 32-row tiles changed bits, 64 and 128 did not:
        # benchmarks/results/archive/ab_invariant_nvfp4_tile_bits_h100_2026-12-06.md); MXFP4 kept its bits at 16-64
        g = replace(g, block_n=max(g.block_n, WGMMA_MIN_ROWS))
    return replace(g, slots=None, packed=None)


def _invariant_pinned_choose(keys: tuple[str, ...], shape: str, num_tokens: int, num_experts: int, top_k: int,
                             n1: int, k1: int, weight_format: str, per_pair: bool = True):
    """Dense and FP8 weights: one K step per GEMM for the shape class (its prefill configuration's), no half tails;
    FP8 products on 64-row wgmma tiles. (Dense tiles would keep their bits as 4-bit ones do by the MMA chain's
    order; they were not measured with other K steps or half tails, and meet the mode's targets from T = 4.)
    Dense weights where the default runs a decode mode: the per-pair mode (``per_pair``, INVARIANT_PER_PAIR)."""
    bk1, bk2, steps_source = _reduction_steps(keys, shape, num_experts, n1, k1, weight_format)
    cfg, source = _choose(keys, shape, num_tokens, num_experts, top_k, n1, k1, weight_format, True)
    split = INVARIANT_PER_PAIR_SPLIT_SLOTS
    if (cfg.mode != "aligned" and per_pair and INVARIANT_PER_PAIR
            and per_pair_keeps_aligned_bits(weight_format, split)):
        if cfg.mode != "per_pair":  # the CUDA-core GEMVs (which sum in another order): the heuristic's tiles
            source = f"the heuristic's per-pair tiles (the default runs mode {cfg.mode!r})"
            cfg = heuristic(min(num_tokens, PER_PAIR_MAX_TOKENS), num_experts, top_k, n1, k1, weight_format)
        g1, g2 = _with_block_k(cfg.gemm1, bk1, weight_format), _with_block_k(cfg.gemm2, bk2, weight_format)
        gemm2 = ("GEMM2 per pair and the combine kernel, as the aligned mode's" if split else
                 "GEMM2 per token rounding each slot as the aligned mode's combine adds it")
        return ExpertsConfig(16, g1, g2, mode="per_pair", split_slots=split), (
            f"batch-invariant: per-pair mode (no alignment: GEMM1 per pair on 16-row tensor-core tiles, {gemm2}), "
            f"K steps {bk1} (GEMM1) and {bk2} (GEMM2) at every T for {shape} (from {steps_source}); tiles from "
            f"{source}")
    if cfg.mode != "aligned":
        cfg, source = _invariant_decode_tiles(num_tokens, num_experts, top_k, n1, k1, weight_format, cfg.mode, bk1)
    g1, g2 = _with_block_k(cfg.gemm1, bk1, weight_format), _with_block_k(cfg.gemm2, bk2, weight_format)
    block_m, why = cfg.block_m, ""
    if weight_format in FP8_DOT_FORMATS:
        block_m = max(block_m, WGMMA_MIN_ROWS)
        # GEMM1's FP8 tile on one warpgroup spills in its K loop at every width (ptxas, sm_90): two warpgroups
        g1, g2 = replace(g1, num_warps=max(8, _whole_warpgroups(g1))), replace(g2, num_warps=_whole_warpgroups(g2))
        why = f"; {WGMMA_MIN_ROWS}-row wgmma tiles at every T (FP8 products)"
    return ExpertsConfig(block_m, g1, g2), (
        f"batch-invariant: aligned mode, K steps {bk1} (GEMM1) and {bk2} (GEMM2) at every T for {shape} "
        f"(from {steps_source}); tiles from {source}{why}")


def _whole_warpgroups(g: GemmConfig) -> int:
    """``g``'s warps rounded up to whole warpgroups of 4 (wgmma's unit)."""
    return max(4, -(-g.num_warps // 4) * 4)


def invariant_choice(num_tokens: int, num_experts: int, top_k: int, n1: int, k1: int, device: torch.device,
                     dtype: torch.dtype, weight_format: str = "dense", lora: bool = False,
                     batched: bool = False) -> tuple[ExpertsConfig, str]:
    """(config, why) that batch-invariant mode runs, whether or not the mode is on (for explain and tests)."""
    return _invariant_choose(serving_keys(device, dtype, weight_format), shape_key(num_experts, n1, k1), num_tokens,
                             num_experts, top_k, n1, k1, weight_format, not (lora or batched))
