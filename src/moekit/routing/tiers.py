"""Which implementation serves a router GEMM call, and why.

The decision is data plus one function: the token count above which cuBLAS beats moekit's
small-batch Triton kernel was measured on each GPU by ``benchmarks/bench_router.py`` and is kept
in ``routing/tiers.json``; GPUs without a measurement use the default entry.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from importlib import resources

import torch

from .. import _invariant, _triton

TIERS = ("triton", "cublas", "torch")
FUSED_MAX_TOKENS = 128
"""The one-launch fused router kernel serves up to this many tokens."""

# Batch-invariant mode: the one-launch kernel takes the mode's GEMM (its K splits and steps, one token per finishing
# step), so it gives the bits router_gemm + the routing kernel give. It is the faster of the two up to 64 tokens and
# slower at 128 (H100, 2026-12-06: benchmarks/results/archive/ab_invariant_router_h100_2026-12-06.md).
INVARIANT_FUSED_MAX_TOKENS = 64

GEMV_MAX_TOKENS = 2
"""Up to this many tokens the router GEMM runs as a GEMV (fp32 FMAs), above it on tensor cores."""

FINISH_TOKENS = {True: 1, False: 4}
"""Tokens per finishing program of a tensor-core token block, where several programs share the
finishing step (key: routing fused or not). The routing of one token is a chain of dependent
reductions, so one token per program is fastest (H200, benchmarks/results/archive/ab_router_finish_2026-12-03.txt, 2026-12-03: qwen3 T=16
22.2 -> 7.0 us); summing partial logits alone does best at 4."""
_REGISTER_BUDGET = 4096  # fp32 elements one program may hold in the finishing step (no routing)


@dataclass(frozen=True)
class TierChoice:
    tier: str
    reason: str


@dataclass(frozen=True)
class RouterKernelConfig:
    """Launch shape of the small-batch router kernel (see kernels/router.py)."""

    block_t: int
    block_r: int
    block_k: int
    splits: int
    k_per_split: int
    fin_t: int
    s_chunk: int
    r_pad: int
    num_warps: int = 4
    fin_programs: int = 1
    """Programs that share the finishing step of one token block (each takes fin_t tokens at a time)."""
    num_stages: int = 3
    """Software-pipeline depth of the K loop (Triton's default 3)."""
    fold_splits: bool = False
    """One program per tile runs every K split of ``k_per_split`` (cdiv(H, k_per_split) of them) and sums them as
    the finishing step would (batch-invariant mode at many tokens: the same bits as split programs, without their
    partial sums). ``splits`` is then 1, the launch grid's K dimension, and ``k_per_split`` less than H."""


@functools.cache
def _crossover_table() -> dict:
    text = resources.files("moekit.routing").joinpath("tiers.json").read_text()
    return json.loads(text)


def _measured(device: torch.device, hidden: int, num_experts: int, table: str) -> tuple[int, str]:
    """(token limit, where it comes from) from routing/tiers.json for this GPU and shape."""
    data = _crossover_table()
    gpu = _triton.gpu_name(device)
    entry = data["gpus"].get(gpu)
    if entry is None or table not in entry:
        return data["default"][table], f"default (no measurement for {gpu!r})"
    shape_key = f"H{hidden}_E{num_experts}"
    if shape_key in entry[table]["shapes"]:
        return entry[table]["shapes"][shape_key], f"measured on {gpu} for {shape_key} ({entry['source']})"
    return entry[table]["max_tokens"], f"measured on {gpu}, smallest over shapes ({entry['source']})"


def crossover_tokens(device: torch.device, hidden: int, num_experts: int) -> tuple[int, str]:
    """(largest T the Triton GEMM tier serves, where that number comes from) for this GPU and shape."""
    return _measured(device, hidden, num_experts, "gemm_triton")


def choose_tier(num_tokens: int, hidden: int, num_experts: int, device: torch.device,
                tier: str = "auto") -> TierChoice:
    """The tier that serves a router GEMM of ``num_tokens`` x [E=num_experts, H=hidden]."""
    if tier not in ("auto",) + TIERS:
        raise ValueError(f"tier must be 'auto' or one of {TIERS}, got {tier!r}")
    if tier == "cublas" and _invariant.enabled():
        raise ValueError(_invariant.refusal("tier='cublas'", "cuBLAS picks its kernel and K split by the token count"))
    if tier != "auto":
        if tier == "cublas" and device.type != "cuda":
            raise ValueError(f"tier='cublas' needs a CUDA device, got {device}")
        if tier == "triton" and not _triton.can_launch(device):
            raise ValueError(f"tier='triton' needs a CUDA device or TRITON_INTERPRET=1, got {device}")
        return TierChoice(tier, "requested explicitly")
    if device.type != "cuda":
        if _invariant.enabled():
            return TierChoice("torch", f"device {device.type}: torch in fp32, batch-invariant: matmuls of "
                                       f"{_invariant.ROWS_PER_MATMUL} rows at every T")
        return TierChoice("torch", f"device {device.type}: plain torch in fp32")
    if _invariant.enabled():
        if not _triton.triton_importable():
            raise ValueError(_invariant.refusal("the router GEMM without Triton", "cuBLAS, the only other GPU tier, "
                                                "picks its kernel by the token count"))
        return TierChoice("triton", f"batch-invariant: the Triton kernel at every T ({INVARIANT_BLOCK_K}-deep K "
                                    f"steps on tensor cores, the same {INVARIANT_SPLIT_K}-deep K splits)")
    if not _triton.triton_importable():
        return TierChoice("cublas", "triton is not installed")
    limit, source = crossover_tokens(device, hidden, num_experts)
    if num_tokens <= limit:
        return TierChoice("triton", f"T={num_tokens} <= {limit}: small-batch kernel ({source})")
    return TierChoice("cublas", f"T={num_tokens} > {limit}: cuBLAS with fp32 output ({source})")


def kernel_config(num_tokens: int, hidden: int, num_experts: int, rank: int, fuse_topk: bool,
                  num_sms: int = 132, ieee: bool = False) -> RouterKernelConfig:
    """Heuristic launch shape: about two programs per SM, bounded registers and partial sums; in batch-invariant
    mode :func:`invariant_kernel_config`'s. ``ieee``: fp32 inputs (IEEE fp32 products on the CUDA cores)."""
    if _invariant.enabled():
        return invariant_kernel_config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms, ieee)
    return _kernel_config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms)


# Batch-invariant router GEMM: a logit's bits depend on the order of its K terms. The default shape changes it with
# T (fp32 FMAs over one or two tokens, tensor-core tiles above; K splits sized for about two programs per SM, summed
# by the last program; cuBLAS past the measured crossover): under the switch every T takes tensor-core tiles, each K
# step one product of INVARIANT_BLOCK_K terms in the MMA's fixed order, and the same K splits of INVARIANT_SPLIT_K
# terms, each summed from zero and then added in split order. Few tokens run one program per split and the finishing
# step adds the splits' partial sums one at a time; many tokens run one program per tile that folds each split into
# its total where the split ends: the same additions, so the choice between the two, like the tile's rows and
# columns (which never change a term's order), follows T. The finishing step, where LoRA or routing needs it, takes
# one token at a time: its LoRA sum and routing reductions then run on the same tile shape at every T.
INVARIANT_BLOCK_K = 128
INVARIANT_SPLIT_K = 512  # K terms per split: enough programs at T=1 (deepseek-v3: 16 row blocks x 14 splits)
INVARIANT_TILES = ((128, 64), (64, 64), (64, 32), (32, 32), (16, 32), (16, 16))  # (tokens, rows), largest first
INVARIANT_SPLIT_WORK = 8192  # split programs (not folded) while T x splits is at most this
INVARIANT_FILL = 0.75  # a launch "fills" the GPU from this many programs per SM
INVARIANT_IEEE_TILE = 32 * 32  # fp32 inputs: the largest tile (tokens x rows) whose fp32 products fit the registers


def invariant_splits(hidden: int) -> tuple[int, int]:
    """(splits, K terms per split) of batch-invariant mode for ``hidden``: a function of H alone."""
    per_split = _triton.cdiv(min(INVARIANT_SPLIT_K, hidden), INVARIANT_BLOCK_K) * INVARIANT_BLOCK_K
    return _triton.cdiv(hidden, per_split), per_split


def _invariant_tile(num_tokens: int, num_experts: int, rank: int, splits: int, fold: bool,
                    num_sms: int, ieee: bool = False) -> tuple[int, int]:
    """The largest tile of INVARIANT_TILES (no taller than T needs) whose programs fill the SMs, one per tile when
    folded, one per tile and split otherwise; among tiles of as many programs, the one with the fewest rows (E=8
    wastes no lanes on 16 rows); the most programs where none fills them."""
    need = max(1, int(INVARIANT_FILL * num_sms))
    tall = max(16, _triton.next_pow2(num_tokens))
    # fp32 inputs: larger tiles of IEEE products spill in the K loop (tests/sm90_compile.py)
    shapes = [s for s in INVARIANT_TILES if s[0] <= tall and (not ieee or s[0] * s[1] <= INVARIANT_IEEE_TILE)]

    def programs(shape):
        block_t, block_r = shape
        tiles = (_triton.cdiv(num_experts, block_r) + _triton.cdiv(rank, block_r)) * _triton.cdiv(num_tokens, block_t)
        return tiles * (1 if fold else splits)

    for shape in shapes:
        if programs(shape) >= need:
            same = [s for s in shapes if s[0] == shape[0] and programs(s) == programs(shape)]
            return min(same, key=lambda s: s[1])
    return max(shapes, key=lambda s: (programs(s), -s[1]))


@functools.lru_cache(maxsize=4096)
def invariant_kernel_config(num_tokens: int, hidden: int, num_experts: int, rank: int, fuse_topk: bool,
                            num_sms: int = 132, ieee: bool = False) -> RouterKernelConfig:
    """The launch shape of batch-invariant mode: invariant_splits' K splits, run as programs of their own with a
    finishing step while T x splits <= INVARIANT_SPLIT_WORK, folded into each tile's program above;
    INVARIANT_BLOCK_K-deep K steps; the tile that fills the SMs (:func:`_invariant_tile`); one token per finishing
    step. Neither the tile nor the folding changes a logit's additions, so both follow T and the shape."""
    splits, per_split = invariant_splits(hidden)
    # Split programs write and read T x E x splits partial sums, and a token block's finishing step takes its tokens
    # one at a time, so at many tokens the folded form's longer programs cost less; with few tokens its programs are
    # too few, or too long where H is (deepseek-v3's 7168). The tile: the largest that still fills the SMs (it reads
    # x and the weights fewest times). H100 sweep of every tile, folded and not, T = 64-16384, four presets
    # (benchmarks/results/archive/ab_invariant_router_tile_sweep_h100_2026-12-06.md): within 1.19x of the best
    # variant everywhere; the fixed tiles before took up to 2.2x (deepseek-v3 T=64 19.0 us against 8.6).
    fold = splits > 1 and num_tokens * splits > INVARIANT_SPLIT_WORK
    if num_tokens <= 16:  # decode: the 16 x 16 tile, as measured in bench_invariant (not part of the sweep)
        block_t, block_r = 16, 16
    else:
        block_t, block_r = _invariant_tile(num_tokens, num_experts, rank, splits, fold, num_sms, ieee)
    # Four warps at every T: the finishing step's reductions (LoRA, routing) are laid out over the warps
    cfg = launch_config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms, block_t, block_r,
                        INVARIANT_BLOCK_K, splits=1 if fold else splits, fin_t=1)
    # The finishing step adds one split's partial sums at a time (S_CHUNK 1): the order the folding program keeps.
    return replace(cfg, splits=1 if fold else splits, k_per_split=per_split, s_chunk=1, fold_splits=fold)


@functools.lru_cache(maxsize=4096)
def _kernel_config(num_tokens: int, hidden: int, num_experts: int, rank: int, fuse_topk: bool,
                   num_sms: int = 132) -> RouterKernelConfig:
    if num_tokens <= GEMV_MAX_TOKENS:
        block_t, block_r = _triton.next_pow2(num_tokens), 16
        block_k = 8192 // (block_t * block_r)  # the GEMV path's fp32 product tile: 8192 elements
    else:
        # Taller token blocks only past T=128: below it the finishing step is shared anyway and more
        # row blocks keep the SMs busy (H200 tile sweep, benchmarks/results/archive/router_tiles_2026-12-03.txt, 2026-12-03).
        small = num_tokens <= 16
        block_t = 16 if small or fuse_topk or num_tokens <= 128 else (32 if num_tokens <= 256 else 64)
        block_r = 16 if small else 32
        block_k = 256 if small else 128
    return launch_config(num_tokens, hidden, num_experts, rank, fuse_topk, num_sms, block_t, block_r, block_k)


def launch_config(num_tokens: int, hidden: int, num_experts: int, rank: int, fuse_topk: bool, num_sms: int,
                  block_t: int, block_r: int, block_k: int, num_warps: int = 4,
                  programs_per_sm: int = 2, splits: int | None = None, num_stages: int = 3,
                  fin_t: int | None = None) -> RouterKernelConfig:
    """The launch shape for one GEMM tile: K splits for about ``programs_per_sm`` programs per SM
    (or ``splits``, for measuring), the finishing step's token groups (``fin_t`` tokens each, when given) and
    finishers within their register budgets."""
    e_pad = _triton.next_pow2(num_experts)
    r_pad = _triton.next_pow2(rank) if rank else 1
    # The finishing program holds a [fin_t, E_PAD] logits tile (routing: several siblings of it),
    # the LoRA product [fin_t, R_PAD, E_PAD] and one [s_chunk, fin_t, E_PAD] load of partial sums;
    # tests/sm90_compile.py shows spills past these budgets (fp32 elements, 4 warps).
    tile_budget, parts_budget = (2048, 4096) if fuse_topk else (_REGISTER_BUDGET, _REGISTER_BUDGET)
    lora_budget = 2048 if fuse_topk else 4096
    fin_t_max = min(tile_budget // e_pad, lora_budget // (r_pad * e_pad))
    shared_finish = block_t >= 16  # the GEMV blocks hold one or two tokens: one finisher is enough
    fixed_fin_t = fin_t
    if fin_t is None:
        fin_t = _prev_pow2(max(1, min(block_t, _triton.next_pow2(num_tokens), fin_t_max,
                                      FINISH_TOKENS[fuse_topk] if shared_finish else block_t)))
    # It also reads every split's partial sums alone, so keep them to ~64 KB per token block.
    max_splits = max(2, 16384 // (min(num_tokens, block_t) * e_pad))
    row_blocks = _triton.cdiv(num_experts, block_r) + _triton.cdiv(rank, block_r)
    t_blocks = _triton.cdiv(num_tokens, block_t)
    base = row_blocks * t_blocks
    if splits is None:
        splits = min(_triton.cdiv(programs_per_sm * num_sms, base), max_splits)
    splits = max(1, min(splits, _triton.cdiv(hidden, block_k)))
    k_per_split = _triton.cdiv(_triton.cdiv(hidden, splits), block_k) * block_k
    splits = _triton.cdiv(hidden, k_per_split)
    # Finishers wait for their block's last partial sums. A launch has at most one waiting program
    # per SM, so the programs they wait for always find room to run (an SM holds several).
    fin_programs = 1
    if shared_finish:
        block_tokens = min(block_t, num_tokens)
        cap = max(1, min(row_blocks * splits, num_sms // t_blocks))
        if _triton.cdiv(block_tokens, fin_t) > cap and fixed_fin_t is None:
            # Fewer finishers than token groups: take larger groups (within the register budgets)
            # rather than loop, since each group's step waits on L2 (H200 tile sweep: T=4096 with
            # 64-token blocks had 2 finishers looping 8 times; benchmarks/results/archive/router_tiles_2026-12-03.txt, 2026-12-03).
            fin_t = _prev_pow2(max(fin_t, min(_triton.next_pow2(_triton.cdiv(block_tokens, cap)), fin_t_max)))
        fin_programs = max(1, min(_triton.cdiv(block_tokens, fin_t), cap))
    s_chunk = _prev_pow2(max(1, min(_triton.next_pow2(splits), parts_budget // (fin_t * e_pad))))
    return RouterKernelConfig(block_t, block_r, block_k, splits, k_per_split, fin_t, s_chunk, r_pad,
                              num_warps=num_warps, fin_programs=fin_programs, num_stages=num_stages)


def fused_limit(device: torch.device, hidden: int, num_experts: int) -> tuple[int, str]:
    """Largest T for which fused_router's auto choice is the one-launch kernel, and why.

    The kernel serves any T <= FUSED_MAX_TOKENS on request (impl="fused"); auto takes it only up to
    the measured point where router_gemm + the routing kernel (which spreads the top-k over many
    programs) becomes faster.
    """
    limit, source = _measured(device, hidden, num_experts, "fused")
    return min(limit, FUSED_MAX_TOKENS), source


def fused_applies(num_tokens: int, device: torch.device, hidden: int, num_experts: int) -> bool:
    """fused_router(impl="auto") uses its single-launch kernel (else it runs router_gemm + route)."""
    if device.type != "cuda" or not _triton.triton_importable():
        return False
    if _invariant.enabled():  # the same bits either way: the faster one by T alone
        return num_tokens <= INVARIANT_FUSED_MAX_TOKENS
    return num_tokens <= fused_limit(device, hidden, num_experts)[0]


def invariant_fused_serves(method: str, renormalize: bool, has_lora: bool) -> bool:
    """Whether batch-invariant mode may take the one-launch kernel for this routing at all (then up to
    INVARIANT_FUSED_MAX_TOKENS). Its finishing step routes a one-token tile, the routing kernel a tile of several
    tokens, and Triton orders a reduction by its tile's layout: the bits were shown equal (every preset, batches of
    1 to 1000 on both sides of the switch) where the routing sums run over the k chosen weights; a softmax over
    all E (softmax_topk without renormalize) and the router LoRA's sum were not shown equal, so those keep the two
    launches at every T."""
    return not has_lora and not (method == "softmax_topk" and not renormalize)


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def explain(num_tokens: int, hidden: int, num_experts: int, device: torch.device | str | None = None,
            tier: str = "auto") -> str:
    """One line per op: which tier serves a router call of this shape and why (``device``: default the current CUDA
    device where there is one, else the CPU; ``tier``: the GEMM tier asked for, as router_gemm's argument)."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    gemm = choose_tier(num_tokens, hidden, num_experts, device, tier)
    if device.type == "cuda" and not _triton.triton_importable():
        fused = f"router_gemm ({gemm.tier}) + route in torch: triton is not installed"
    elif _invariant.enabled():
        if device.type != "cuda":
            fused = f"router_gemm ({gemm.tier}) + route on {device.type}"
        elif fused_applies(num_tokens, device, hidden, num_experts):
            fused = (f"one Triton launch in the batch-invariant GEMM's order: T={num_tokens} <= "
                     f"{INVARIANT_FUSED_MAX_TOKENS} (the same bits as router_gemm + the routing kernel, above it; "
                     f"softmax_topk without renormalize and router LoRA take the two launches at every T)")
        else:
            fused = (f"router_gemm ({gemm.tier}) + routing kernel: batch-invariant mode, T={num_tokens} > "
                     f"{INVARIANT_FUSED_MAX_TOKENS} (the one-launch kernel gives the same bits below it)")
    elif fused_applies(num_tokens, device, hidden, num_experts):
        limit, source = fused_limit(device, hidden, num_experts)
        fused = f"one Triton launch (GEMM + bias + top-k): T={num_tokens} <= {limit} ({source})"
    elif device.type == "cuda":
        limit, source = fused_limit(device, hidden, num_experts)
        fused = f"router_gemm ({gemm.tier}) + routing kernel: T={num_tokens} > {limit} ({source})"
    else:
        fused = f"router_gemm ({gemm.tier}) + route on {device.type}"
    return (f"router_gemm T={num_tokens} H={hidden} E={num_experts}: {gemm.tier} -- {gemm.reason}\n"
            f"fused_router: {fused}")
