"""Top-k routing on a tile of logits held in registers.

``route_tile`` is shared by the standalone routing kernel and the fused router's epilogue, so
both select exactly alike: highest score first, ties to the lower expert id, NaN ranked as -inf,
masked-out experts (padding columns, dropped groups) never selected.
"""

import triton
import triton.language as tl

SOFTMAX_TOPK = tl.constexpr(0)
TOPK_SOFTMAX = tl.constexpr(1)
SIGMOID_GROUPED = tl.constexpr(2)
SIGMOID_TOP1 = tl.constexpr(3)


@triton.jit
def _pick(key, eligible, cols):
    """Per row, the lowest column holding the largest key among eligible columns."""
    masked = tl.where(eligible, key, float("-inf"))
    best = tl.max(masked, axis=1)
    hit = eligible & (masked == best[:, None])
    return tl.min(tl.where(hit, cols[None, :], 2147483647), axis=1)


@triton.jit
def _column(values, cols, idx):
    """values[row, idx[row]] for every row (sum of one non-zero term, so NaN/inf survive)."""
    return tl.sum(tl.where(cols[None, :] == idx[:, None], values, 0.0), axis=1)


@triton.jit
def route_tile(
    logits, cols, num_experts, corr_bias,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, METHOD: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_CORR_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, scaling,
):
    """Route a [rows, E_PAD] fp32 tile. Returns (weights fp32 [rows, K_PAD], ids int32 [rows, K_PAD])."""
    valid = (cols < num_experts)[None, :]
    if METHOD == SIGMOID_GROUPED:
        probs = tl.sigmoid(logits)
        choice = probs
        if HAS_CORR_BIAS:
            choice = probs + corr_bias[None, :]
        source = probs
    else:
        choice = logits
        source = logits
    key = tl.where(choice != choice, float("-inf"), choice)
    eligible = valid & (key == key)  # broadcast to the tile's shape

    if METHOD == SIGMOID_GROUPED:
        if TOPK_GROUPS < NUM_GROUPS:
            group_of = cols // GROUP_SIZE
            gcols = tl.arange(0, G_PAD)
            group_score = tl.zeros([logits.shape[0], G_PAD], tl.float32) + float("-inf")
            for g in tl.static_range(NUM_GROUPS):
                in_group = eligible & (group_of[None, :] == g)
                first = _pick(key, in_group, cols)
                score = _column(key, cols, first)
                if GROUP_SIZE > 1:
                    second = _pick(key, in_group & (cols[None, :] != first[:, None]), cols)
                    score = score + _column(key, cols, second)
                group_score = tl.where(gcols[None, :] == g, score[:, None], group_score)
            group_score = tl.where(group_score != group_score, float("-inf"), group_score)
            group_open = (gcols < NUM_GROUPS)[None, :] & (group_score == group_score)
            kept = eligible & (cols[None, :] < 0)
            for _ in tl.static_range(TOPK_GROUPS):
                g_best = _pick(group_score, group_open, gcols)
                kept = kept | (group_of[None, :] == g_best[:, None])
                group_open = group_open & (gcols[None, :] != g_best[:, None])
            eligible = eligible & kept

    kcols = tl.arange(0, K_PAD)
    ids = tl.zeros([logits.shape[0], K_PAD], tl.int32)
    vals = tl.zeros([logits.shape[0], K_PAD], tl.float32)
    for j in tl.static_range(TOP_K):
        idx = _pick(key, eligible, cols)
        ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
        vals = tl.where(kcols[None, :] == j, _column(source, cols, idx)[:, None], vals)
        eligible = eligible & (cols[None, :] != idx[:, None])
    kvalid = (kcols < TOP_K)[None, :]

    # Maxima are taken over NaN-free keys: the result must not depend on how max() treats NaN.
    if METHOD == SOFTMAX_TOPK and not RENORMALIZE:
        row_max = tl.max(tl.where(valid, key, float("-inf")), axis=1)
        weights = tl.exp(vals - row_max[:, None])
        denom = tl.sum(tl.where(valid, tl.exp(logits - row_max[:, None]), 0.0), axis=1)
        weights = weights / denom[:, None]
    elif METHOD == SOFTMAX_TOPK or METHOD == TOPK_SOFTMAX:
        top_max = tl.max(tl.where(kvalid & (vals == vals), vals, float("-inf")), axis=1)
        weights = tl.where(kvalid, tl.exp(vals - top_max[:, None]), 0.0)
        weights = weights / tl.sum(weights, axis=1)[:, None]
    elif METHOD == SIGMOID_TOP1:
        weights = tl.sigmoid(vals)
    else:
        weights = vals
        if RENORMALIZE:
            weights = weights / tl.sum(tl.where(kvalid, weights, 0.0), axis=1)[:, None]
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
    GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr,
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
        NUM_GROUPS, TOPK_GROUPS, GROUP_SIZE, G_PAD, scaling,
    )
    store_routes(weights, ids, rows, num_tokens, w_ptr, id_ptr, TOP_K, K_PAD)
