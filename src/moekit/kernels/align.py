"""Token alignment for the grouped expert GEMMs: (token, slot) pairs sorted by expert, each
expert's run padded to a multiple of BLOCK_M, and the expert of every BLOCK_M block.

One program does the whole job: the pairs of a decode step fit in a few chunks, and a single
program needs no cross-program prefix sum (no second launch, no atomics, deterministic order).
"""

import triton
import triton.language as tl


@triton.jit
def _local_ids(ids_ptr, expert_map_ptr, offs, num_pairs, num_global, num_local, HAS_MAP: tl.constexpr):
    """Local expert of each pair, -1 where the id is out of range or lives on another rank."""
    in_range = offs < num_pairs
    gid = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    ok = in_range & (gid >= 0) & (gid < num_global)
    if HAS_MAP:
        lid = tl.load(expert_map_ptr + gid, mask=ok, other=-1)
    else:
        lid = gid
    ok = ok & (lid >= 0) & (lid < num_local)
    return tl.where(ok, lid, -1), ok


@triton.jit
def align_kernel(
    ids_ptr,  # int32 [num_pairs]: global expert id of pair p = token * k + slot
    expert_map_ptr,  # int32 [num_global] (HAS_MAP) global -> local id, -1 = remote
    pair_expert_ptr,  # out int32 [num_pairs]: local expert of each pair, -1 = contributes nothing
    sorted_pairs_ptr,  # out int32 [num_blocks * BLOCK_M]: pair ids by expert; padding = num_pairs
    block_expert_ptr,  # out int32 [num_blocks]: expert of each block, -1 past the last used block
    num_pairs,
    num_global,
    num_local,
    num_blocks,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    PAD_CHUNK: tl.constexpr,
    OWNER_CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)

    # Pass 1: per-expert counts (and the local id of every pair, which the combine step reads).
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + lanes
        lid, ok = _local_ids(ids_ptr, expert_map_ptr, offs, num_pairs, num_global, num_local, HAS_MAP)
        tl.store(pair_expert_ptr + offs, lid, mask=offs < num_pairs)
        counts += tl.histogram(tl.where(ok, lid, 0), E_PAD, mask=ok)

    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded

    # Pass 2: each pair goes to its expert's start + the number of earlier pairs of that expert,
    # so pairs keep their order within an expert (deterministic, as a stable sort).
    cursor = padded_start
    earlier = lanes[None, :] < lanes[:, None]
    for start in range(0, num_pairs, CHUNK):
        offs = start + lanes
        lid, ok = _local_ids(ids_ptr, expert_map_ptr, offs, num_pairs, num_global, num_local, HAS_MAP)
        same = (lid[:, None] == lid[None, :]) & earlier & ok[None, :]
        rank = tl.sum(same.to(tl.int32), axis=1)
        dest = tl.gather(cursor, tl.where(ok, lid, 0), axis=0) + rank
        tl.store(sorted_pairs_ptr + dest, offs, mask=ok)
        cursor += tl.histogram(tl.where(ok, lid, 0), E_PAD, mask=ok)

    # Padding slots of each expert's run (at most BLOCK_M - 1 each) get the sentinel num_pairs.
    # They are disjoint from the slots written above, so no barrier is needed.
    pad_lane = tl.arange(0, PAD_CHUNK)
    first_pad = padded_start + counts
    num_pad = padded - counts
    for j in range(0, BLOCK_M, PAD_CHUNK):
        is_pad = (j + pad_lane)[None, :] < num_pad[:, None]
        tl.store(sorted_pairs_ptr + first_pad[:, None] + (j + pad_lane)[None, :],
                 tl.full([E_PAD, PAD_CHUNK], 0, tl.int32) + num_pairs, mask=is_pad)

    # Block b belongs to the expert whose padded run covers position b * BLOCK_M.
    total = tl.sum(padded, axis=0)
    block_lanes = tl.arange(0, OWNER_CHUNK)
    for start in range(0, num_blocks, OWNER_CHUNK):
        blocks = start + block_lanes
        pos = blocks * BLOCK_M
        owner = tl.sum((pos[:, None] >= padded_end[None, :]).to(tl.int32), axis=1)
        owner = tl.where(pos < total, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)
