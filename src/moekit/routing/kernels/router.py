"""Small-batch router GEMM, optionally fused with top-k routing.

Grid: (row blocks of [W; A], K splits, token blocks). Each program reduces one H-slice of one
row block into an fp32 partial. With a single K split, no LoRA and no routing, it writes the
logits directly. Otherwise partials go to a workspace and the LAST program to arrive for a token
block (an arrival counter) sums them in fixed split order, adds bias and the LoRA term, and
writes logits or routes them: one launch, deterministic, no atomics on data. With FIN_PROGRAMS > 1
the last few programs to arrive share that finishing step, each taking its own tokens.
"""

import triton
import triton.language as tl

from .topk import route_tile, store_routes


@triton.jit
def _gpu_release_fence(like):
    # Every thread publishes its partial-sum stores before the arrival counter is bumped.
    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [like], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _partial_dot(x_ptr, stride_xt, stride_xh, rows_ptr, stride_rr, stride_rh, n_rows,
                 tok, row, k_lo, k_hi, k_per_split, num_tokens,
                 BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, FOLD_SPLITS: tl.constexpr):
    acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    total = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
    kk = tl.arange(0, BLOCK_K)
    x_base = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    r_base = rows_ptr + row.to(tl.int64)[:, None] * stride_rr
    tmask = (tok < num_tokens)[:, None]
    rmask = (row < n_rows)[:, None]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + kk
        kmask = (ks < k_hi)[None, :]
        xs = tl.load(x_base + ks.to(tl.int64)[None, :] * stride_xh, mask=tmask & kmask, other=0.0)
        ws = tl.load(r_base + ks.to(tl.int64)[None, :] * stride_rh, mask=rmask & kmask, other=0.0)
        if BLOCK_T >= 16:
            if IEEE:
                acc = tl.dot(xs, tl.trans(ws), acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, tl.trans(ws), acc)
        else:
            # One or two tokens: a GEMV in fp32 FMAs streams the weights faster than a padded
            # tensor-core tile (measured on the H200: 3.6 vs 7.5 us for gpt-oss-120b at T=1).
            acc += tl.sum(xs.to(tl.float32)[:, None, :] * ws.to(tl.float32)[None, :, :], axis=2)
        if FOLD_SPLITS:
            # The whole K range in one program, each k_per_split-deep split's sum folded into the total where it
            # ends: zero + split 0 + split 1 + ..., the finisher's order over the same splits' partial sums.
            end = ((k0 + BLOCK_K - k_lo) % k_per_split == 0) | (k0 + BLOCK_K >= k_hi)
            total = tl.where(end, total + acc, total)
            acc = tl.where(end, 0.0, acc)
    if FOLD_SPLITS:
        acc = total
    return acc


# Token counts and workspace strides change every call: don't compile a variant per value.
@triton.jit(do_not_specialize=["num_tokens", "split_stride"])
def router_kernel(
    x_ptr, stride_xt, stride_xh,
    w_ptr, stride_we, stride_wh,
    a_ptr, stride_ar, stride_ah,
    b_ptr, stride_be, stride_br,
    bias_ptr, corr_bias_ptr,
    ws_ptr, cnt_ptr,
    out_ptr, stride_ot, stride_oe,
    tw_ptr, tid_ptr,
    num_tokens, hidden, num_experts, rank, k_per_split, split_stride, lora_scale, scaling,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    FIN_T: tl.constexpr, FIN_PROGRAMS: tl.constexpr, E_PAD: tl.constexpr, S_CHUNK: tl.constexpr,
    R_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, FUSE_TOPK: tl.constexpr,
    DIRECT: tl.constexpr, IEEE: tl.constexpr, FENCE: tl.constexpr, FOLD_SPLITS: tl.constexpr,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, METHOD: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_CORR_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, GROUPS_RESHAPE: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, hidden)
    if FOLD_SPLITS:  # one program per tile sums every split (batch-invariant mode at many tokens)
        k_hi = hidden
    w_blocks = tl.cdiv(num_experts, BLOCK_R)
    total_rows = num_experts + rank

    # Program pid_r works on weight rows, or past them on LoRA A rows. Without LoRA only the weight
    # rows' loop is compiled: each loop holds its own pipeline buffers in shared memory (sm_90: 144 KB
    # for both at 64x128x64, 3 stages), which caps programs per SM.
    lora_rows = False
    if HAS_LORA:
        lora_rows = pid_r >= w_blocks
    if lora_rows:
        row = (pid_r - w_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = _partial_dot(x_ptr, stride_xt, stride_xh, a_ptr, stride_ar, stride_ah, rank,
                           tok, row, k_lo, k_hi, k_per_split, num_tokens, BLOCK_T, BLOCK_R, BLOCK_K, IEEE,
                           FOLD_SPLITS)
        ws_col = num_experts + row
        col_ok = row < rank
    else:
        row = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        acc = _partial_dot(x_ptr, stride_xt, stride_xh, w_ptr, stride_we, stride_wh, num_experts,
                           tok, row, k_lo, k_hi, k_per_split, num_tokens, BLOCK_T, BLOCK_R, BLOCK_K, IEEE,
                           FOLD_SPLITS)
        ws_col = row
        col_ok = row < num_experts

    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + row, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        offs = tok.to(tl.int64)[:, None] * stride_ot + row.to(tl.int64)[None, :] * stride_oe
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty),
                 mask=(tok < num_tokens)[:, None] & col_ok[None, :])
    else:
        offs = pid_k.to(tl.int64) * split_stride + tok.to(tl.int64)[:, None] * total_rows + ws_col[None, :]
        tl.store(ws_ptr + offs, acc, mask=(tok < num_tokens)[:, None] & col_ok[None, :])
        if FENCE:
            _gpu_release_fence(tok)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        total = tl.num_programs(0) * tl.num_programs(1)
        # The last n_fin programs to arrive each finish every n_fin-th group of FIN_T tokens, so
        # the routing of a 16-token block runs on several SMs at once instead of one after another.
        n_fin = 1
        if FIN_PROGRAMS > 1:
            n_fin = tl.minimum(tl.cdiv(tl.minimum(BLOCK_T, num_tokens - pid_t * BLOCK_T), FIN_T), FIN_PROGRAMS)
        fin = arrived - (total - n_fin)
        if fin >= 0:
            if FIN_PROGRAMS > 1:
                # Wait for the at most n_fin - 1 programs still storing partials. They hold or get a
                # place on an SM: the host allows at most one waiting program per SM per launch.
                seen = arrived + 1
                while seen < total:
                    seen = tl.atomic_add(cnt_ptr + pid_t, 0, sem="acquire", scope="gpu")
            _finish(ws_ptr, split_stride, total_rows, tl.num_programs(1),
                    b_ptr, stride_be, stride_br, bias_ptr, corr_bias_ptr,
                    out_ptr, stride_ot, stride_oe, tw_ptr, tid_ptr,
                    pid_t * BLOCK_T, fin * FIN_T, n_fin * FIN_T, num_tokens, num_experts, rank,
                    lora_scale, scaling,
                    BLOCK_T, FIN_T, E_PAD, S_CHUNK, R_PAD, HAS_BIAS, HAS_LORA, FUSE_TOPK,
                    TOP_K, K_PAD, METHOD, RENORMALIZE, HAS_CORR_BIAS,
                    NUM_GROUPS, TOPK_GROUPS, GROUP_SIZE, G_PAD, GROUPS_RESHAPE)
            if FIN_PROGRAMS > 1:
                # The counter resets once every finisher is past its wait.
                done = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
                if done == total + n_fin - 1:
                    tl.atomic_xchg(cnt_ptr + pid_t, 0)
            else:
                tl.atomic_xchg(cnt_ptr + pid_t, 0)  # ready for the next launch on this stream


@triton.jit
def _finish(ws_ptr, split_stride, total_rows, num_splits,
            b_ptr, stride_be, stride_br, bias_ptr, corr_bias_ptr,
            out_ptr, stride_ot, stride_oe, tw_ptr, tid_ptr,
            t_start, t_first, t_step, num_tokens, num_experts, rank, lora_scale, scaling,
            BLOCK_T: tl.constexpr, FIN_T: tl.constexpr, E_PAD: tl.constexpr,
            S_CHUNK: tl.constexpr, R_PAD: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, FUSE_TOPK: tl.constexpr,
            TOP_K: tl.constexpr, K_PAD: tl.constexpr, METHOD: tl.constexpr, RENORMALIZE: tl.constexpr,
            HAS_CORR_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
            GROUP_SIZE: tl.constexpr, G_PAD: tl.constexpr, GROUPS_RESHAPE: tl.constexpr):
    cols = tl.arange(0, E_PAD)
    cmask = cols < num_experts
    chunk = tl.arange(0, S_CHUNK)
    bias = None
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    corr_bias = None
    if HAS_CORR_BIAS:
        corr_bias = tl.load(corr_bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    rr = tl.arange(0, R_PAD)
    b_t = None
    if HAS_LORA:
        b_t = tl.load(b_ptr + rr[:, None] * stride_br + cols.to(tl.int64)[None, :] * stride_be,
                      mask=(rr < rank)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    # A loop, not unrolled (the routing code is large), over this finisher's share of the block's
    # real tokens: groups of FIN_T from t_first, t_step apart.
    for t0 in range(t_first, tl.minimum(BLOCK_T, num_tokens - t_start), t_step):
        tok = t_start + t0 + tl.arange(0, FIN_T)
        tmask = (tok < num_tokens)[None, :, None]
        base = ws_ptr + tok.to(tl.int64)[None, :, None] * total_rows
        logits = tl.zeros([FIN_T, E_PAD], tl.float32)
        xa = tl.zeros([FIN_T, R_PAD], tl.float32)
        # Splits are summed S_CHUNK at a time, in a fixed order: bit-identical from run to run.
        for s0 in range(0, num_splits, S_CHUNK):
            splits = s0 + chunk
            s_off = splits.to(tl.int64)[:, None, None] * split_stride
            smask = (splits < num_splits)[:, None, None] & tmask
            parts = tl.load(base + s_off + cols[None, None, :], mask=smask & cmask[None, None, :],
                            other=0.0, cache_modifier=".cg")
            logits += tl.sum(parts, axis=0)
            if HAS_LORA:
                xa_parts = tl.load(base + s_off + num_experts + rr[None, None, :],
                                   mask=smask & (rr < rank)[None, None, :], other=0.0, cache_modifier=".cg")
                xa += tl.sum(xa_parts, axis=0)
        if HAS_BIAS:
            logits += bias[None, :]
        if HAS_LORA:
            logits += tl.sum((xa * lora_scale)[:, :, None] * b_t[None, :, :], axis=1)
        rows = t_start + t0 + tl.arange(0, FIN_T)
        if FUSE_TOPK:
            weights, ids = route_tile(logits, cols, num_experts, corr_bias, TOP_K, K_PAD, METHOD,
                                      RENORMALIZE, HAS_CORR_BIAS, NUM_GROUPS, TOPK_GROUPS,
                                      GROUP_SIZE, G_PAD, GROUPS_RESHAPE, scaling)
            store_routes(weights, ids, rows, num_tokens, tw_ptr, tid_ptr, TOP_K, K_PAD)
        else:
            offs = rows.to(tl.int64)[:, None] * stride_ot + cols.to(tl.int64)[None, :] * stride_oe
            tl.store(out_ptr + offs, logits.to(out_ptr.dtype.element_ty),
                     mask=(rows < num_tokens)[:, None] & cmask[None, :])
