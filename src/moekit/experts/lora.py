"""LoRA adapters on the experts' weights: :class:`ExpertsLoRA` (several adapters, stacked), its checks against a
call, the torch backend's terms, and the Triton launches (kernels in :mod:`moekit.experts.kernels.lora`).

For a token t with adapter a = lora_ids[t] (-1: none) and one of its experts e, with v the GEMM's input as the
base weights see it (x; under ``act_quant`` the rounded x and activations):

    h = W13_e x + b13_e + scaling[a] * B13[a, e] (A13[a, e] x)
    y = W2_e act(h) + b2_e + scaling[a] * B2[a, e] (A2[a, e] act(h))

(:func:`moekit.reference.fused_experts` with ``lora=``). The adapters are never merged into the weights: on the
Triton backend the terms run over the rows the expert GEMMs run (the aligned pair list, the pairs of the decode
modes, the batched slabs), GEMM1's term added to its accumulators before the activation and GEMM2's to its output
before the slots are combined, so quantized base weights keep their format and every adapter of a batch is served
in the same call.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .. import _invariant, _triton, gate
from .._checks import check_tensor, may_sync
from .._launch import Launcher

MAX_RANK = 256  # the kernels keep a block's rank-r products in registers
LORA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PARTS = ("w13_a", "w13_b", "w2_a", "w2_b")


@dataclass(frozen=True)
class ExpertsLoRA:
    """LoRA adapters on the experts' w13 and w2, stacked over adapters and experts.

    Args:
        w13_a: ``[num_adapters, E, r13, H]``, bf16/fp16/fp32 (the call's activation dtype), any strides. The
            down projection of the adapter on w13: expert e's adapter a computes ``A = w13_a[a, e]`` on x.
        w13_b: ``[num_adapters, E, 2I, r13]``, w13_a's dtype. The up projection, its rows in w13's row order
            ([gate; up] halves for ``silu_and_mul``, interleaved gate/up rows for ``swiglu_oai``).
        w2_a: ``[num_adapters, E, r2, I]``, the same dtype: down projection of the adapter on w2.
        w2_b: ``[num_adapters, E, H, r2]``, the same dtype: its up projection.
        scaling: per adapter, ``lora_alpha / r`` for a PEFT adapter: a float, a sequence of ``num_adapters``
            floats or a float tensor ``[num_adapters]`` (or ``[]``); kept as a contiguous float32 tensor
            ``[num_adapters]`` on the adapters' device (a given fp32 tensor of that shape is kept as it is, so
            writing into it changes the scaling of later calls, CUDA-graph replays included).

    Either pair may be None (an adapter on w13 only, or on w2 only), not both, and not one half of a pair. E is
    the experts the call's weights hold (with ``expert_map``, this rank's local experts). Ranks are at most
    256; adapters of different ranks share a stack by zero padding A's rows and B's columns (exact: the padded
    products are zero). An adapter that targets no expert of a stack has zero B there.
    """

    w13_a: torch.Tensor | None = None
    w13_b: torch.Tensor | None = None
    w2_a: torch.Tensor | None = None
    w2_b: torch.Tensor | None = None
    scaling: torch.Tensor | float | Sequence[float] = 1.0

    def __post_init__(self) -> None:
        present = [name for name in _PARTS if getattr(self, name) is not None]
        if not present:
            raise ValueError("ExpertsLoRA needs w13_a/w13_b or w2_a/w2_b (or both pairs), got neither")
        for a, b in (("w13_a", "w13_b"), ("w2_a", "w2_b")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"ExpertsLoRA: {a} and {b} come together, got only {a if getattr(self, a) is not None else b}")
        first = getattr(self, present[0])
        for name in present:
            check_tensor(f"lora.{name}", getattr(self, name), ndim=4, dtypes=LORA_DTYPES, device=first.device)
            if getattr(self, name).dtype != first.dtype:
                raise TypeError(f"lora.{name} must have lora.{present[0]}'s dtype {first.dtype}, "
                                f"got {getattr(self, name).dtype}")
        n, E = first.shape[0], first.shape[1]
        if n < 1 or E < 1:
            raise ValueError(f"lora.{present[0]} must hold at least one adapter and one expert, got {tuple(first.shape)}")
        for a_name, b_name in (("w13_a", "w13_b"), ("w2_a", "w2_b")):
            a, b = getattr(self, a_name), getattr(self, b_name)
            if a is None:
                continue
            r = a.shape[2]
            if not 1 <= r <= MAX_RANK:
                raise ValueError(f"lora.{a_name} rank (dim 2 of [adapters, E, r, in]) must be in [1, {MAX_RANK}], "
                                 f"got {r}")
            if a.shape[:2] != (n, E):
                raise ValueError(f"lora.{a_name} must be [adapters={n}, E={E}, r, in] (from lora.{present[0]}), "
                                 f"got {tuple(a.shape)}")
            if b.shape[:2] != (n, E) or b.shape[3] != r:
                raise ValueError(f"lora.{b_name} must be [adapters={n}, E={E}, out, r={r}] (from lora.{a_name}), "
                                 f"got {tuple(b.shape)}")
        if self.w13_a is not None and self.w2_a is not None:
            hidden, two_i = self.w13_a.shape[3], self.w13_b.shape[2]
            if self.w2_a.shape[3] * 2 != two_i or self.w2_b.shape[2] != hidden:
                raise ValueError(f"lora: w2_a [.., r, I] and w2_b [.., H, r] must fit w13_a [.., r, H={hidden}] and "
                                 f"w13_b [.., 2I={two_i}, r], got {tuple(self.w2_a.shape)} and {tuple(self.w2_b.shape)}")
        object.__setattr__(self, "scaling", _scaling(self.scaling, n, first.device))

    @property
    def num_adapters(self) -> int:
        return self._first.shape[0]

    @property
    def num_experts(self) -> int:
        return self._first.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self._first.dtype

    @property
    def device(self) -> torch.device:
        return self._first.device

    @property
    def _first(self) -> torch.Tensor:
        return self.w13_a if self.w13_a is not None else self.w2_a


def _scaling(value, n: int, device: torch.device) -> torch.Tensor:
    """``scaling`` as a contiguous fp32 tensor [n] on ``device`` (a tensor of that kind is kept, not copied)."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise ValueError(f"lora.scaling must be a dense (strided) tensor, got layout {value.layout}")
        if not value.is_floating_point():
            raise TypeError(f"lora.scaling must be a float tensor, got dtype {value.dtype}")
        if value.device != device:
            raise ValueError(f"lora.scaling must be on the adapters' device {device}, got {value.device}")
        if value.shape not in ((), (n,)):
            raise ValueError(f"lora.scaling must have shape ({n},) (one per adapter) or (), got {tuple(value.shape)}")
        # (a GPU tensor's values: a sync; under torch.compile a branch on values breaks the graph)
        if value.device.type == "cpu" and not torch.compiler.is_compiling() and not torch.isfinite(value).all():
            raise TypeError(f"lora.scaling must hold finite values, got {value.tolist()}")
        if value.dtype == torch.float32 and value.shape == (n,) and value.is_contiguous():
            return value
        return value.float().expand(n).contiguous()
    values = [value] * n if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(values, Sequence) or len(values) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise TypeError(f"lora.scaling must be a finite float, {n} finite floats (one per adapter) or a float tensor, "
                        f"got {value!r}")
    return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)


def check_call(lora, lora_ids, x: torch.Tensor, num_experts: int, inter: int, hidden: int, batched: bool) -> None:
    """``lora`` and ``lora_ids`` fit the call (validated x and weights: E experts, sizes I and H). The ids' values
    are read where that costs no device sync (CPU tensors) and with the verification gate on: elsewhere an id
    outside [-1, adapters) contributes nothing (the kernels never read past the stacks)."""
    if lora is None:
        if lora_ids is not None:
            raise ValueError("lora_ids was given without lora (an ExpertsLoRA)")
        return
    if not isinstance(lora, ExpertsLoRA):
        raise TypeError(f"lora must be a moekit.experts.ExpertsLoRA, got {type(lora).__name__}")
    what = "[E, M] (one adapter per slab row)" if batched else "[T] (one adapter per token)"
    if lora_ids is None:
        raise ValueError(f"lora_ids is required with lora: int32 {what}, -1 for no adapter")
    rows = tuple(x.shape[:2]) if batched else (x.shape[0],)
    check_tensor("lora_ids", lora_ids, ndim=len(rows), dtypes=(torch.int32,), device=x.device)
    if tuple(lora_ids.shape) != rows:
        raise ValueError(f"lora_ids must have shape {rows} ({what}), got {tuple(lora_ids.shape)}")
    if lora.dtype != x.dtype:
        raise TypeError(f"lora tensors must have x's dtype {x.dtype} (adapters run in the activations' dtype), "
                        f"got {lora.dtype}")
    if lora.device != x.device:
        raise ValueError(f"lora tensors must be on {x.device} (the device of the input), got {lora.device}")
    n = lora.num_adapters
    expect = {"w13_a": (num_experts, hidden), "w13_b": (num_experts, 2 * inter), "w2_a": (num_experts, inter),
              "w2_b": (num_experts, hidden)}
    for name in _PARTS:
        t = getattr(lora, name)
        if t is None:
            continue
        e, size = expect[name]
        r = t.shape[3] if name.endswith("_b") else t.shape[2]
        want = (n, e, r, size) if name.endswith("_a") else (n, e, size, r)
        if tuple(t.shape) != want:
            layout = "[adapters, E, r, in]" if name.endswith("_a") else "[adapters, E, out, r]"
            raise ValueError(f"lora.{name} must have shape {want} ({layout} for E={num_experts}, H={hidden}, "
                             f"I={inter}), got {tuple(t.shape)}")
    if lora_ids.numel() and (not lora_ids.is_cuda or gate.active()) and may_sync(lora_ids):
        lo, hi = torch.aminmax(lora_ids)
        lo, hi = int(lo), int(hi)
        if lo < -1 or hi >= n:
            raise ValueError(f"lora_ids values must be -1 (no adapter) or an adapter index in [0, {n}), "
                             f"got values in [{lo}, {hi}]")


# ------------------------------------------------------------------------------------------------ torch backend
def torch_term(lora: ExpertsLoRA, which: str, e: int, v32: torch.Tensor, adapters: torch.Tensor) -> torch.Tensor:
    """fp32 [n, out]: the adapter terms of expert ``e`` on rows ``v32`` (fp32 [n, in]) whose adapters are
    ``adapters`` (int [n]; rows of no adapter get zero). ``which``: "w13" or "w2". Every adapter runs on every row
    and is selected after (static shapes, no host sync)."""
    a_stack, b_stack = getattr(lora, which + "_a"), getattr(lora, which + "_b")
    out = v32.new_zeros(v32.shape[0], b_stack.shape[2])
    for i in range(a_stack.shape[0]):
        # (row by row in fixed-shape pieces in batch-invariant mode, as the base GEMMs beside it)
        term = _invariant.matmul(_invariant.matmul(v32, a_stack[i, e].float().T), b_stack[i, e].float().T)
        term = term * lora.scaling[i]
        out = torch.where((adapters == i)[:, None], term, out)
    return out


# ---------------------------------------------------------------------------------------------- Triton launches
@dataclass(frozen=True)
class Rows:
    """The rows a call's expert GEMMs run, as the LoRA launches take them (see experts/triton_backend.py): the
    aligned pair list (``block_expert``, ``sorted_pairs``), the pairs of the decode modes (``ids``, ``expert_map``)
    or the batched slabs (``expert_num_tokens``)."""

    mode: str  # "aligned", "pairs" or "batched"
    count: int  # GEMM1's output rows (h)
    top_k: int = 1
    block_m: int = 16
    num_pairs: int = 0
    block_expert: torch.Tensor | None = None
    sorted_pairs: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    expert_map: torch.Tensor | None = None
    num_global: int = 0
    expert_num_tokens: torch.Tensor | None = None
    rows_per_expert: int = 0


@functools.cache
def _kernels() -> SimpleNamespace:
    # Built on first use, as triton_backend's (TRITON_INTERPRET is read then); launches bind once per signature.
    from .kernels import lora as kernels

    return SimpleNamespace(shrink=Launcher(kernels.lora_shrink_kernel), expand=Launcher(kernels.lora_expand_kernel),
                           blocks=Launcher(kernels.lora_blocks_kernel),
                           ALIGNED=kernels.ALIGNED, BATCHED=kernels.BATCHED)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


def _r_pad(r: int) -> int:
    return max(16, _triton.next_pow2(r))


PAIR_SPLIT_STEPS = 2  # K steps per shrink program of the decode modes: short chains of dependent loads
PAIR_MAX_SPLITS = 32  # the expand sums every split's partials, unrolled
EXPAND_TILE = 4096  # fp32 elements of the expand's [slots, BLOCK_N, r] product tile (4 warps)
ALL_ADAPTERS_MAX_COLUMNS = 64  # adapters x padded rank that the aligned and batched kernels take in one product


def _pair_splits(k: int, block_k: int) -> tuple[int, int]:
    """(K per split, splits) of the decode modes' shrink over K = ``k``: whole K steps of ``block_k``."""
    splits = max(1, min(PAIR_MAX_SPLITS, _triton.cdiv(k, PAIR_SPLIT_STEPS * block_k)))
    per_split = max(block_k, _triton.cdiv(_triton.cdiv(k, splits), block_k) * block_k)  # (K = 0: one empty split)
    return per_split, max(1, _triton.cdiv(k, per_split))


def w13_delta(x: torch.Tensor, x_scales: torch.Tensor | None, lora: ExpertsLoRA, lora_ids: torch.Tensor,
              rows: Rows, dependents: bool = False) -> torch.Tensor | None:
    """GEMM1's delta rows [rows.count, 2I] in x's dtype (the LoRA term on w13 of each of h's rows, zero without an
    adapter; padding rows unwritten), or None when the adapters leave w13 alone or no row has an expert here (then
    no kernel ran: a GEMM must neither read the delta nor wait for its kernel). ``x``: the GEMM input ([T, H],
    or [E, M, H] batched; E4M3 codes with ``x_scales`` [rows of x, H/128] under FP8 activations). ``dependents``
    (aligned and batched rows): the next launch (GEMM1, waiting before it reads the delta) may start as this one
    starts."""
    if lora.w13_a is None:
        return None
    dtype = lora.dtype if x_scales is not None else x.dtype
    delta = torch.empty(rows.count, lora.w13_b.shape[2], dtype=dtype, device=x.device)
    launched = _launch(1, x, x_scales, lora.w13_a, lora.w13_b, lora, lora_ids, delta, None, rows,
                       dependents=dependents)
    return delta if launched else None


def w2_delta(h: torch.Tensor, h_scales: torch.Tensor | None, lora: ExpertsLoRA, lora_ids: torch.Tensor, rows: Rows,
             like: torch.Tensor, h_paired: bool = False, dependents: bool = False) -> torch.Tensor | None:
    """GEMM2's delta (aligned or batched rows): the LoRA term on w2 of each of GEMM2's output rows, unweighted, zero
    without an adapter, in a new fp32 tensor of ``like``'s shape and strides (GEMM2's output: [pairs, H] aligned,
    [E, M, H] batched); GEMM2 adds it to its sums before the router weight and rounds once. (In the activations'
    dtype the term would be rounded twice, the second time at the output's magnitude: rank-16 terms as large as the
    base output then missed the bf16 experts' RMS budget, 5.2e-3 against 5e-3.) None when the adapters leave w2
    alone or no kernel ran (as :func:`w13_delta`). ``h`` [rows.count, I] (E4M3 codes with ``h_scales`` under FP8
    activations; ``h_paired``: columns in the word-decoded 4-bit GEMM2's order, as GEMM1 wrote them);
    ``dependents``: as :func:`w13_delta`."""
    if lora.w2_a is None:
        return None
    # GEMM2 indexes its delta with its output's strides
    delta = torch.empty_strided(like.shape, like.stride(), dtype=torch.float32, device=h.device)
    launched = _launch(2, h, h_scales, lora.w2_a, lora.w2_b, lora, lora_ids, delta, None, rows, v_paired=h_paired,
                       store=True, dependents=dependents)
    return delta if launched else None


def w2_add(h: torch.Tensor, h_scales: torch.Tensor | None, lora: ExpertsLoRA, lora_ids: torch.Tensor, rows: Rows,
           y: torch.Tensor, weights: torch.Tensor | None, per_token: bool = False, h_paired: bool = False) -> None:
    """Add the LoRA term on w2 of GEMM2's input rows ``h`` [rows.count, I] (E4M3 codes with ``h_scales`` under FP8
    activations; ``h_paired``: columns in the word-decoded 4-bit GEMM2's order, as GEMM1 wrote them) into GEMM2's
    output ``y``: per pair [pairs, H] (aligned; pairs with ``per_token=False``), times the router weight ``weights``
    [pairs]; per token [T, H], its slots summed in a fixed order (pairs, ``per_token``); or the batched output
    [E, M, H]."""
    if lora.w2_a is not None:
        _launch(2, h, h_scales, lora.w2_a, lora.w2_b, lora, lora_ids, y, weights, rows, per_token, h_paired)


DELTA_TRAFFIC_SHARE = 0.1  # GEMM2's fp32 delta: its round trip within this share of GEMM2's weight bytes


def w2_term_as_delta(lora: ExpertsLoRA, out_elements: int, w2_bytes: int) -> bool:
    """Whether the aligned and batched paths run the LoRA term on w2 as GEMM2's fp32 delta (:func:`w2_delta`: its
    kernel beside GEMM2's K loop) rather than add it to GEMM2's output after GEMM2 (:func:`w2_add`). The delta
    writes and reads 8 bytes per output element (``out_elements``): worth it while that stays a small share of the
    weight bytes GEMM2 streams (``w2_bytes``), i.e. at decode and small batches, where the LoRA kernel's latency
    is what it hides. The two forms round differently: batch-invariant mode takes the added form at every T."""
    if lora.w2_a is None or _invariant.enabled():
        return False
    forced = _FORCED.get("w2_delta")
    return forced if forced is not None else w2_delta_pays(out_elements, w2_bytes)


def w2_delta_pays(out_elements: int, w2_bytes: float) -> bool:
    """:func:`w2_term_as_delta`'s size rule: the delta's 8 bytes per output element within DELTA_TRAFFIC_SHARE of
    GEMM2's weight bytes."""
    return 8 * out_elements <= DELTA_TRAFFIC_SHARE * w2_bytes


def _launch(stage, v, v_scales, a, b, lora, lora_ids, out, weights, rows: Rows, per_token: bool = False,
            v_paired: bool = False, store: bool = False, dependents: bool = False) -> bool:
    """Launch the terms of one stage over ``rows``; False where there was nothing to launch (no rows)."""
    kernels = _kernels()
    n_out, r = b.shape[2], a.shape[2]
    k = a.shape[3]
    r_pad = _r_pad(r)
    scales = (v_scales, v_scales.stride(0)) if v_scales is not None else (v, 0)
    adapters = (a, *a.stride(), b, *b.stride(), lora.scaling, lora_ids)
    precision = _precision(a.dtype)
    if rows.mode == "pairs":  # GEMM1's per-pair outputs (in paired_k's order for the per-pair word-decoded GEMM2)
        slots = rows.top_k if per_token else 1
        pairs = rows.ids.numel()
        groups = pairs // slots
        if groups == 0:
            return False
        emap = rows.expert_map if rows.expert_map is not None else rows.ids
        has_map = rows.expert_map is not None
        parts, splits, shrink = _pair_shrink(stage, v, v_scales, a, lora, lora_ids, rows, v_paired=v_paired)
        shrink()
        slots_pad = _triton.next_pow2(slots)
        chunk = max(1, min(slots_pad, EXPAND_TILE // (16 * r_pad)))  # at least 16 columns per program
        block_n = max(16, min(256, EXPAND_TILE // (chunk * r_pad)))
        kernels.expand[(groups * _triton.cdiv(n_out, block_n),)](
            parts, b, *b.stride(), lora.scaling, lora_ids, out, out.stride(0),
            weights if weights is not None else lora.scaling, rows.ids, emap,
            rows.top_k, slots, rows.num_global, a.shape[1], lora.num_adapters, n_out, r,
            STAGE=stage, HAS_MAP=has_map, BLOCK_N=block_n, R_PAD=r_pad, SLOTS_PAD=slots_pad, SLOT_CHUNK=chunk,
            SPLITS=splits,
            num_warps=4)
        return True
    lora_m = max(16, min(rows.block_m, 64 if r_pad <= 64 else 8192 // r_pad // 2))
    if rows.mode == "batched":
        lora_m = max(16, min(lora_m, _triton.next_pow2(rows.rows_per_expert)))
        programs = a.shape[1] * _triton.cdiv(rows.rows_per_expert, lora_m)
        v_strides = (v.stride(0), v.stride(1), v.stride(2)) if stage == 1 else (0, v.stride(0), v.stride(1))
        out_strides = (out.stride(0), out.stride(1)) if stage == 2 else (0, out.stride(0))
        ent = rows.expert_num_tokens
        row_args = (ent, ent, ent, 0)
        mode = kernels.BATCHED.value
    else:
        programs = rows.count // lora_m
        v_strides = (0, v.stride(0), v.stride(1))
        out_strides = (0, out.stride(0))
        row_args = (rows.block_expert, rows.sorted_pairs, rows.block_expert, rows.num_pairs)
        mode = kernels.ALIGNED.value
    if programs == 0:
        return False
    # Several adapters of small rank: their columns side by side in one product (the block's rows read once)
    adapters_pad = _triton.next_pow2(lora.num_adapters)
    if lora.num_adapters == 1 or adapters_pad * r_pad > ALL_ADAPTERS_MAX_COLUMNS:
        adapters_pad = 0  # one product per adapter present in the block
    columns = max(1, adapters_pad) * r_pad  # of the expand's [columns, BLOCK_N] operand
    kernels.blocks[(programs,)](
        v, *v_strides, *scales, *adapters,
        out, *out_strides,
        weights if weights is not None else lora.scaling,
        *row_args, rows.top_k, rows.rows_per_expert, lora.num_adapters, n_out, k, r,
        STAGE=stage, ROWS=mode, HAS_SCALES=v_scales is not None, DOT_PRECISION=precision,
        BLOCK_M=rows.block_m, LORA_M=lora_m, BLOCK_N=max(16, min(128, 4096 // lora_m, 8192 // columns)), BLOCK_K=64,
        R_PAD=r_pad, V_PAIRED=v_paired, ADAPTERS_PAD=adapters_pad, W2_DELTA=stage == 2 and store,
        LAUNCH_DEPENDENTS=dependents, num_warps=4)
    return True


def _pair_shrink(stage, v, v_scales, a, lora, lora_ids, rows: Rows, launch_dependents: bool = False,
                 v_paired: bool = False):
    """The decode modes' shrink: (its output, fp32 partial sums [pairs, splits, R_PAD] of A[a, e] v per K split,
    splits, its launch, for the caller to make). ``launch_dependents``: the next grid (GEMV1 with decode terms) may
    start as this one starts; ``v_paired``: v's columns in paired_k's order (h for a word-decoded GEMM2)."""
    kernels = _kernels()
    r, k = a.shape[2], a.shape[3]
    r_pad = _r_pad(r)
    pairs = rows.ids.numel()
    block_k = max(16, min(128, 4096 // r_pad))
    split_k, splits = _pair_splits(k, block_k)
    parts = torch.empty(pairs, splits, r_pad, dtype=torch.float32, device=v.device)
    scales = (v_scales, v_scales.stride(0)) if v_scales is not None else (v, 0)
    emap = rows.expert_map if rows.expert_map is not None else rows.ids

    def launch() -> None:
        kernels.shrink[(pairs, splits)](
            v, v.stride(-2), v.stride(-1), *scales, a, *a.stride(), lora_ids, rows.ids, emap, parts,
            rows.top_k, rows.num_global, a.shape[1], lora.num_adapters, k, r, split_k,
            STAGE=stage, HAS_MAP=rows.expert_map is not None, HAS_SCALES=v_scales is not None, BLOCK_K=block_k,
            R_PAD=r_pad, LAUNCH_DEPENDENTS=launch_dependents, V_PAIRED=v_paired, num_warps=4)

    return parts, splits, launch


# ------------------------------------------------------------------------------ decode terms inside the GEMVs
DECODE_TILE = 4096  # fp32 elements of a decode term's largest tile per program (4 warps); past it, the kernels above
# GEMV1's register cap with both terms inside. Both terms take qwen3-30b-a3b's bf16 GEMV1 from 168 to 204 registers at
# T=1 (sm_90 compile, 2026-12-07): 2 programs of 4 warps per SM instead of 3, so its 384 programs run in two waves
# where either term alone keeps one. Capped, it builds in 159 without spills, and the call with one rank-16 adapter on
# an H100 went from +36% to +21% over the call without (qwen3-30b-a3b T=1), and from +13% to +7% for gpt-oss-120b
# (its GEMV1 at 227 with the terms; +10% where the call without adapters is capped too, as the H100 table's entry
# does): benchmarks/results/archive/ab_decode_maxnreg_h100_2026-12-07.md. A cap is no
# ceiling only: ptxas spends up to it, so a kernel that builds in fewer registers takes more under it and fits fewer
# programs (the rows GEMV1 93 -> 135, 4-bit GEMV1s 48-55 -> 85-123). So the backend caps a 4-warp GEMV1 with both
# terms only where its first, uncapped build took more (triton_backend.py _launch_with_terms), and past
# DECODE_TERMS_MAXNREG_RANK (padded) the terms' tiles need registers of their own: no cap.
DECODE_TERMS_MAXNREG: int | None = _triton.registers_for(programs_per_sm=3, num_warps=4)  # 168
DECODE_TERMS_MAXNREG_RANK = 32
# W13's shrink at decode: False, a kernel of its own launched right before GEMV1 (GEMV1 its programmatic dependent,
# waiting for it after its K loop); True, computed by GEMV1's own programs, its K splits claimed by the programs of
# each pair's group (kernels/lora.py w13_decode_shrink: no launch, three counters per group; where they do not fit,
# the launch). Not yet measured on a GPU (benchmarks/experiments/ab_decode_maxnreg.py, its "shrink by GEMV1"
# variant): off until it is.
DECODE_W13_SHRINK_BY_GEMV1 = False


@dataclass(frozen=True)
class DecodeTerms:
    """The adapters' part of a GEMV1 / GEMV2 launch (kernels/moe_gemv.py) when the decode modes' terms run inside
    them (:func:`decode_terms`): positional arguments and constexprs (launch options included) of each."""

    gemv1_args: tuple
    gemv1_constants: dict
    gemv2_args: tuple
    gemv2_constants: dict
    launch_shrink: Callable[[], None]  # W13's shrink: GEMV1 launches it right before itself (after its preparation)
    register_cap: int | None = None  # GEMV1's cap where its build takes more (DECODE_TERMS_MAXNREG; None: none)


def decode_terms_fit(r1: int, r2: int, inter: int, gemv1_block_n: int, gemv1_slots: int, gemv2_block_n: int,
                     top_k: int, num_tokens: int) -> bool:
    """Whether :func:`decode_terms` can run adapters of ranks ``r1`` (w13) and ``r2`` (w2, 0: none) inside the GEMVs
    of a call: their tiles fit a program's registers and, with W2's shrink (added by the last GEMV1 program of
    each pair's group), GEMV1's program groups its arrival counters."""
    r1_pad, r2_pad = _r_pad(max(r1, 1)), _r_pad(max(r2, 1))
    blocks_pad = _triton.next_pow2(_triton.cdiv(inter, gemv1_block_n))
    groups = _gemv1_groups(num_tokens, top_k, gemv1_slots)
    tiles = [gemv1_slots * gemv1_block_n * r1_pad if r1 else 0,
             gemv1_slots * max(gemv1_block_n, blocks_pad) * r2_pad if r2 else 0,
             _triton.next_pow2(top_k) * gemv2_block_n * r2_pad if r2 else 0]
    return max(tiles) <= DECODE_TILE and not (r2 and groups > _triton.NUM_COUNTERS)


def _gemv1_groups(num_tokens: int, top_k: int, gemv1_slots: int) -> int:
    """GEMV1's program groups: one per token and run of ``gemv1_slots`` of its pairs (each group's arrival
    counters)."""
    return num_tokens * _triton.cdiv(top_k, gemv1_slots)


def _w13_shrink_in_gemv1(r1: int, groups: int) -> bool:
    """Whether GEMV1's programs compute W13's shrink (DECODE_W13_SHRINK_BY_GEMV1): three counters per program group
    after W2's one."""
    return bool(r1) and DECODE_W13_SHRINK_BY_GEMV1 and 4 * groups <= _triton.NUM_COUNTERS


_FORCED: dict = {}  # paths the verification gate's case takes as its call does (forced_paths)


@contextlib.contextmanager
def forced_paths(**paths):
    """Within: the adapters' terms take the paths a call of other sizes takes, for the verification gate's case
    (cut from the call's sizes): ``decode_terms`` (False: the separate kernels, not the terms inside the GEMVs) and
    ``w2_delta`` (:func:`w2_term_as_delta`'s answer). None leaves a path to the sizes."""
    saved = dict(_FORCED)
    _FORCED.update({k: v for k, v in paths.items() if v is not None})
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)


def decode_terms(x, lora: ExpertsLoRA, lora_ids, rows: Rows, inter: int, gemv1_block_n: int, gemv1_slots: int,
                 gemv2_block_n: int, pdl: bool, fence: bool) -> DecodeTerms | None:
    """Run the adapters of a decode call (GEMV1 + GEMV2 on x [T, H] in its dtype) inside the two GEMVs: what the
    GEMV launches add, W13's shrink (when the adapters touch w13) among it, for GEMV1 to launch right before itself
    (as the shrink's programmatic dependent GEMV1 reads, until it waits, only what earlier launches wrote), or
    computed by GEMV1's own programs (DECODE_W13_SHRINK_BY_GEMV1: no launch). None where the terms' tiles would not
    fit a program's registers, a stack is not contiguous or GEMV1's program groups outnumber the arrival counters
    (decode_terms_fit): the separate kernels serve that call. ``pdl``: GEMV1 may start as the shrink's programmatic
    dependent (its K loop overlaps the shrink; a link of its own, whatever the config says of GEMV2's); ``fence``:
    the kernels are built for the GPU (the counters' memory fence is PTX)."""
    stacks = [t for t in (lora.w13_a, lora.w13_b, lora.w2_a, lora.w2_b) if t is not None]
    if not all(t.is_contiguous() for t in stacks):
        return None
    r1 = lora.w13_a.shape[2] if lora.w13_a is not None else 0
    r2 = lora.w2_a.shape[2] if lora.w2_a is not None else 0
    r1_pad, r2_pad = _r_pad(max(r1, 1)), _r_pad(max(r2, 1))
    blocks = _triton.cdiv(inter, gemv1_block_n)
    blocks_pad = _triton.next_pow2(blocks)
    top_k = rows.top_k
    k_pad = _triton.next_pow2(top_k)
    if _FORCED.get("decode_terms") is False or not decode_terms_fit(
            r1, r2, inter, gemv1_block_n, gemv1_slots, gemv2_block_n, top_k, rows.ids.numel() // top_k):
        return None
    parts1 = parts2 = counters = x
    splits, launch_shrink, shrink_args, shrink_block_k = 1, _nothing, (x, 0, 0, x, 0), 128
    in_gemv1 = _w13_shrink_in_gemv1(r1, _gemv1_groups(rows.ids.numel() // top_k, top_k, gemv1_slots))
    if in_gemv1:  # GEMV1's programs compute it: [slots, R_PAD, block_k] products per step
        shrink_block_k = max(16, min(128, DECODE_TILE // (gemv1_slots * r1_pad)))
        per_split, splits = _pair_splits(x.shape[1], shrink_block_k)
        parts1 = torch.empty(rows.ids.numel(), splits, r1_pad, dtype=torch.float32, device=x.device)
        shrink_args = (x, x.stride(0), x.stride(1), lora.w13_a, per_split)
        counters = _triton.counters(x.device)
    elif r1:
        parts1, splits, launch_shrink = _pair_shrink(1, x, None, lora.w13_a, lora, lora_ids, rows,
                                                     launch_dependents=pdl)
    if r2:  # each pair's blocks, then its whole shrink (written by its group's last GEMV1 program)
        parts2 = torch.empty(rows.ids.numel(), blocks + 1, r2_pad, dtype=torch.float32, device=x.device)
        counters = _triton.counters(x.device)
    b13 = lora.w13_b if r1 else x
    a2, b2 = (lora.w2_a, lora.w2_b) if r2 else (x, x)
    n = lora.num_adapters
    wait = pdl and r1 > 0 and not in_gemv1
    return DecodeTerms(
        (parts1, b13, a2, parts2, counters, lora.scaling, lora_ids, n, r1, r2, *shrink_args),
        dict(LORA_W13=r1 > 0, LORA_W2=r2 > 0, LORA_WAIT=wait, LORA_SPLITS=splits, LORA_R1_PAD=r1_pad,
             LORA_R2_PAD=r2_pad, LORA_BLOCKS_PAD=blocks_pad, LORA_FENCE=fence, LORA_SHRINK=in_gemv1,
             LORA_SHRINK_BLOCK_K=shrink_block_k, **({"launch_pdl": True} if wait else {})),
        (parts2, b2, lora_ids, lora.scaling, n, r2, blocks),
        dict(LORA_W2=r2 > 0, LORA_R2_PAD=r2_pad, LORA_K_PAD=k_pad),
        launch_shrink,
        DECODE_TERMS_MAXNREG if r1 and r2 and max(r1_pad, r2_pad) <= DECODE_TERMS_MAXNREG_RANK else None,
    )


def _nothing() -> None:
    pass
