"""Top-k routing on a tile of logits held in registers.

``route_tile`` is shared by the standalone routing kernel and the fused router's epilogue, so
both select exactly alike: highest score first, ties to the lower expert id, NaN and -inf ranked
as the lowest finite fp32 number, masked-out experts (padding, dropped groups) never selected.
Each pick is a single arg-max reduction: the epilogue's latency is a chain of them.
"""

import triton
import triton.language as tl

SOFTMAX_TOPK = tl.constexpr(0)
TOPK_SOFTMAX = tl.constexpr(1)
SIGMOID_GROUPED = tl.constexpr(2)
SIGMOID_TOP1 = tl.constexpr(3)


FLT_LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _selection_key(score):
    """NaN and -inf rank as the lowest finite fp32 number; -inf is reserved for 'not eligible'."""
    return tl.where((score != score) | (score < FLT_LOWEST), FLT_LOWEST, score)


@triton.jit
def _pick(key, eligible, axis: tl.constexpr):
    """(best key, lowest index holding it) among eligible entries, in ONE reduction.

    Eligible keys are finite or +inf and ineligible ones -inf, so a tie at -inf never picks an
    ineligible entry; the left tie-break gives the lower expert id.
    """
    return tl.max(tl.where(eligible, key, float("-inf")), axis=axis, return_indices=True,
                  return_indices_tie_break_left=True)


@triton.jit
def _kept_groups(key, eligible, cols, FIN_T: tl.constexpr, E_PAD: tl.constexpr,
                 NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                 G_PAD: tl.constexpr, GROUPS_RESHAPE: tl.constexpr):
    """bool [rows, E_PAD]: experts of the TOPK_GROUPS groups with the best top-2 sum."""
    gcols = tl.arange(0, G_PAD)
    if GROUPS_RESHAPE:
        # E == G * group size, both powers of two: all groups reduce at once along a third axis.
        grouped = tl.reshape(tl.where(eligible, key, float("-inf")), [FIN_T, G_PAD, GROUP_SIZE])
        first, first_idx = tl.max(grouped, axis=2, return_indices=True, return_indices_tie_break_left=True)
        score = first
        if GROUP_SIZE > 1:
            inner = tl.arange(0, GROUP_SIZE)
            score += tl.max(tl.where(inner[None, None, :] == first_idx[:, :, None], float("-inf"), grouped), axis=2)
    else:
        group_of = cols // GROUP_SIZE
        score = tl.zeros([FIN_T, G_PAD], tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_group = eligible & (group_of[None, :] == g)
            first, first_idx = _pick(key, in_group, 1)
            total = first
            if GROUP_SIZE > 1:
                second, _ = _pick(key, in_group & (cols[None, :] != first_idx[:, None]), 1)
                total += second
            score = tl.where(gcols[None, :] == g, total[:, None], score)
    score = _selection_key(score)
    group_open = (gcols < NUM_GROUPS)[None, :] & (score == score)
    kept_group = group_open & (gcols < 0)[None, :]
    # Without the reshape, experts are marked per kept group directly: a gather from the [rows, G]
    # tile to [rows, E] crashes Triton 3.6's sm_90 compiler (OptimizeThreadLocality assertion).
    group_of = cols // GROUP_SIZE
    kept_experts = (key != key) & (key == key)  # all False, the tile's shape
    for _ in tl.static_range(TOPK_GROUPS):
        _, g_best = _pick(score, group_open, 1)
        hit = gcols[None, :] == g_best[:, None]
        kept_group = kept_group | hit
        group_open = group_open & ~hit
        if not GROUPS_RESHAPE:
            kept_experts = kept_experts | (group_of[None, :] == g_best[:, None])
    if GROUPS_RESHAPE:
        inner = tl.arange(0, GROUP_SIZE)
        kept3 = kept_group[:, :, None] & (inner >= 0)[None, None, :]
        return tl.reshape(kept3, [FIN_T, E_PAD])
    else:
        return kept_experts


@triton.jit
def route_tile(
    logits, cols, num_experts, corr_bias,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, METHOD: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_CORR_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, GROUPS_RESHAPE: tl.constexpr, scaling,
):
    """Route a [rows, E_PAD] fp32 tile. Returns (weights fp32 [rows, K_PAD], ids int32 [rows, K_PAD])."""
    FIN_T: tl.constexpr = logits.shape[0]
    E_PAD: tl.constexpr = logits.shape[1]
    valid = (cols < num_experts)[None, :]
    if METHOD == SIGMOID_GROUPED:
        source = tl.sigmoid(logits)
        choice = source
        if HAS_CORR_BIAS:
            choice = source + corr_bias[None, :]
    else:
        source = logits
        choice = logits
    key = _selection_key(choice)
    eligible = valid & (key == key)  # broadcast to the tile's shape
    if METHOD == SIGMOID_GROUPED:
        if TOPK_GROUPS < NUM_GROUPS:
            eligible = eligible & _kept_groups(key, eligible, cols, FIN_T, E_PAD, NUM_GROUPS, TOPK_GROUPS,
                                               GROUP_SIZE, G_PAD, GROUPS_RESHAPE)

    kcols = tl.arange(0, K_PAD)
    ids = tl.zeros([FIN_T, K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        _, idx = _pick(key, eligible, 1)
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        eligible = eligible & (cols[None, :] != idx[:, None])
    vals = tl.gather(source, ids, axis=1)
    kvalid = (kcols < TOP_K)[None, :]

    # Maxima are taken over NaN-free keys: the result must not depend on how max() treats NaN.
    if METHOD == SOFTMAX_TOPK and not RENORMALIZE:
        row_max = tl.max(tl.where(valid, key, float("-inf")), axis=1)
        weights = tl.exp(vals - row_max[:, None])
        denom = tl.sum(tl.where(valid, tl.exp(logits - row_max[:, None]), 0.0), axis=1)
        weights = weights / denom[:, None]
    elif METHOD == SOFTMAX_TOPK or METHOD == TOPK_SOFTMAX:
        top_max = tl.max(tl.where(kvalid, _selection_key(vals), float("-inf")), axis=1)
        weights = tl.where(kvalid, tl.exp(vals - top_max[:, None]), 0.0)
        weights = weights / tl.sum(weights, axis=1)[:, None]
    elif METHOD == SIGMOID_TOP1:
        weights = tl.sigmoid(vals)
    else:
        weights = vals
        if RENORMALIZE:
            total = tl.sum(tl.where(kvalid, weights, 0.0), axis=1)
            # every chosen sigmoid underflowed to 0 (logits below about -88: 0 / 0): their ratios are those of
            # exp(logit), the limit the float64 reference still resolves
            chosen = tl.gather(logits, ids, axis=1)
            top = tl.max(tl.where(kvalid, chosen, float("-inf")), axis=1)
            tail = tl.where(kvalid, tl.exp(chosen - top[:, None]), 0.0)
            tail = tail / tl.sum(tail, axis=1)[:, None]
            weights = tl.where((total == 0.0)[:, None], tail, weights / total[:, None])
        weights = weights * scaling
    return weights, ids


@triton.jit
def store_routes(weights, ids, rows, num_rows, w_ptr, id_ptr, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    kcols = tl.arange(0, K_PAD)
    offs = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    mask = (rows < num_rows)[:, None] & (kcols < TOP_K)[None, :]
    tl.store(w_ptr + offs, weights, mask=mask)
    tl.store(id_ptr + offs, ids, mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def routing_kernel(
    logits_ptr, stride_lt, stride_le, corr_bias_ptr, w_ptr, id_ptr,
    num_tokens, num_experts, scaling,
    BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, METHOD: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_CORR_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, GROUPS_RESHAPE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    mask = (rows < num_tokens)[:, None] & (cols < num_experts)[None, :]
    offs = rows.to(tl.int64)[:, None] * stride_lt + cols.to(tl.int64)[None, :] * stride_le
    logits = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    corr_bias = None
    if HAS_CORR_BIAS:
        corr_bias = tl.load(corr_bias_ptr + cols, mask=cols < num_experts, other=0.0).to(tl.float32)
    weights, ids = route_tile(
        logits, cols, num_experts, corr_bias, TOP_K, K_PAD, METHOD, RENORMALIZE, HAS_CORR_BIAS,
        NUM_GROUPS, TOPK_GROUPS, GROUP_SIZE, G_PAD, GROUPS_RESHAPE, scaling,
    )
    store_routes(weights, ids, rows, num_tokens, w_ptr, id_ptr, TOP_K, K_PAD)
