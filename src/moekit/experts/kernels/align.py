"""Token alignment for the grouped expert GEMMs: (token, slot) pairs sorted by expert, each
expert's run padded to a multiple of BLOCK_M, and the expert of every BLOCK_M block.

Decode sizes use one program for the whole job (one launch). Above a few hundred pairs one
program is latency-bound (a serial chain of chunk steps), so three launches split it: per-chunk
counts, prefix sums over the chunks (programs split the experts), per-chunk scatter (which also
places the runs, pads them and writes the blocks' experts, shared among the chunks). Both orders are a stable sort
(pairs keep their order within an expert), deterministic and free of atomics.
"""

import triton
import triton.language as tl


@triton.jit
def _local_ids(ids_ptr, expert_map_ptr, offs, end, num_global, num_local, HAS_MAP: tl.constexpr):
    """Local expert of each pair, -1 where the id is out of range or lives on another rank."""
    in_range = offs < end
    gid = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    ok = in_range & (gid >= 0) & (gid < num_global)
    if HAS_MAP:
        lid = tl.load(expert_map_ptr + gid, mask=ok, other=-1)
    else:
        lid = gid
    ok = ok & (lid >= 0) & (lid < num_local)
    return tl.where(ok, lid, -1), ok


@triton.jit
def _count(ids_ptr, expert_map_ptr, pair_expert_ptr, start, end, num_global, num_local,
           HAS_MAP: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Per-expert counts of pairs [start, end); stores each pair's local id (the combine reads it)."""
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for s in range(start, end, CHUNK):
        offs = s + lanes
        lid, ok = _local_ids(ids_ptr, expert_map_ptr, offs, end, num_global, num_local, HAS_MAP)
        tl.store(pair_expert_ptr + offs, lid, mask=offs < end)
        counts += tl.histogram(tl.where(ok, lid, 0), E_PAD, mask=ok)
    return counts


@triton.jit
def _scatter(ids_ptr, expert_map_ptr, sorted_pairs_ptr, cursor, start, end, num_global, num_local,
             HAS_MAP: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Pair p of [start, end) goes to cursor[its expert] + the number of earlier pairs of that expert."""
    lanes = tl.arange(0, CHUNK)
    earlier = lanes[None, :] < lanes[:, None]
    for s in range(start, end, CHUNK):
        offs = s + lanes
        lid, ok = _local_ids(ids_ptr, expert_map_ptr, offs, end, num_global, num_local, HAS_MAP)
        same = (lid[:, None] == lid[None, :]) & earlier & ok[None, :]
        rank = tl.sum(same.to(tl.int32), axis=1)
        dest = tl.gather(cursor, tl.where(ok, lid, 0), axis=0) + rank
        tl.store(sorted_pairs_ptr + dest, offs, mask=ok)
        cursor += tl.histogram(tl.where(ok, lid, 0), E_PAD, mask=ok)


@triton.jit
def _fill_padding(counts, padded_start, padded, fill, sorted_pairs_ptr, num_pairs,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, PAD_CHUNK: tl.constexpr):
    """The padding slots of the runs of experts where ``fill`` [E_PAD] holds get the sentinel
    num_pairs. They (at most BLOCK_M - 1 per expert) are disjoint from the pairs' slots."""
    pad_lane = tl.arange(0, PAD_CHUNK)
    first_pad = padded_start + counts
    num_pad = tl.where(fill, padded - counts, 0)
    for j in range(0, BLOCK_M, PAD_CHUNK):
        is_pad = (j + pad_lane)[None, :] < num_pad[:, None]
        tl.store(sorted_pairs_ptr + first_pad[:, None] + (j + pad_lane)[None, :],
                 tl.full([E_PAD, PAD_CHUNK], 0, tl.int32) + num_pairs, mask=is_pad)


@triton.jit
def _write_owners(padded_end, total, block_expert_ptr, first_block, end_block,
                  BLOCK_M: tl.constexpr, OWNER_CHUNK: tl.constexpr):
    """Blocks [first_block, end_block): block b belongs to the expert whose padded run covers
    position b * BLOCK_M (-1 past the last run)."""
    block_lanes = tl.arange(0, OWNER_CHUNK)
    for start in range(first_block, end_block, OWNER_CHUNK):
        blocks = start + block_lanes
        pos = blocks * BLOCK_M
        owner = tl.sum((pos[:, None] >= padded_end[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(pos < total, owner, -1), mask=blocks < end_block)


@triton.jit
def _padded_runs(counts, BLOCK_M: tl.constexpr):
    """(padded length, start, end) of each expert's run of slots: its pairs, padded to whole row blocks."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    return padded, padded_end - padded, padded_end


@triton.jit
def _layout_runs(counts, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_blocks,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, PAD_CHUNK: tl.constexpr, OWNER_CHUNK: tl.constexpr):
    """From the per-expert totals, in this one program: fill each run's padding with the sentinel
    num_pairs, write the expert of every block, and return each run's start."""
    padded, padded_start, padded_end = _padded_runs(counts, BLOCK_M)
    _fill_padding(counts, padded_start, padded, counts >= 0, sorted_pairs_ptr, num_pairs, BLOCK_M, E_PAD, PAD_CHUNK)
    total = tl.sum(padded, axis=0)
    _write_owners(padded_end, total, block_expert_ptr, 0, num_blocks, BLOCK_M, OWNER_CHUNK)
    return padded_start


@triton.jit
def align_kernel(
    ids_ptr,  # int32 [num_pairs]: global expert id of pair p = token * k + slot
    expert_map_ptr,  # int32 [num_global] (HAS_MAP) global -> local id, -1 = remote
    pair_expert_ptr,  # out int32 [num_pairs]: local expert of each pair, -1 = contributes nothing
    sorted_pairs_ptr,  # out int32 [num_blocks * BLOCK_M]: pair ids by expert; padding = num_pairs
    block_expert_ptr,  # out int32 [num_blocks]: expert of each block, -1 past the last used block
    num_pairs, num_global, num_local, num_blocks,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
    PAD_CHUNK: tl.constexpr, OWNER_CHUNK: tl.constexpr,
):
    """The whole alignment in one program (decode sizes)."""
    counts = _count(ids_ptr, expert_map_ptr, pair_expert_ptr, 0, num_pairs, num_global, num_local, HAS_MAP, E_PAD, CHUNK)
    start = _layout_runs(counts, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_blocks, BLOCK_M,
                         E_PAD, PAD_CHUNK, OWNER_CHUNK)
    _scatter(ids_ptr, expert_map_ptr, sorted_pairs_ptr, start, 0, num_pairs, num_global, num_local, HAS_MAP,
             E_PAD, CHUNK)


@triton.jit
def _my_chunk(num_pairs, PAIRS_PER_PROGRAM: tl.constexpr):
    """(chunk id, first pair, end) of this program's chunk of pairs."""
    c = tl.program_id(0)
    start = c * PAIRS_PER_PROGRAM
    return c, start, tl.minimum(start + PAIRS_PER_PROGRAM, num_pairs)


@triton.jit
def align_count_kernel(ids_ptr, expert_map_ptr, pair_expert_ptr, chunk_counts_ptr, num_pairs, num_global, num_local,
                       PAIRS_PER_PROGRAM: tl.constexpr, HAS_MAP: tl.constexpr, E_PAD: tl.constexpr,
                       CHUNK: tl.constexpr):
    """Step 1 of 3: chunk_counts[c, e] = pairs of chunk c on expert e."""
    c, start, end = _my_chunk(num_pairs, PAIRS_PER_PROGRAM)
    counts = _count(ids_ptr, expert_map_ptr, pair_expert_ptr, start, end, num_global, num_local, HAS_MAP, E_PAD, CHUNK)
    tl.store(chunk_counts_ptr + c * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def align_offsets_kernel(chunk_counts_ptr, num_chunks, E_PAD: tl.constexpr, EXPERTS: tl.constexpr,
                         CHUNK_ROWS: tl.constexpr):
    """Step 2 of 3, a program per EXPERTS experts: chunk_counts[c, e] becomes the pairs of expert e in
    chunks before c, and the row past the chunks each expert's count. A prefix per expert is
    independent of the others, so the programs split the experts (one program for all of them was a
    serial chain of chunks x experts / tile steps)."""
    experts = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    rows = tl.arange(0, CHUNK_ROWS)
    running = tl.zeros([EXPERTS], dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_ROWS):
        ok = (c0 + rows < num_chunks)[:, None]
        ptrs = chunk_counts_ptr + (c0 + rows)[:, None] * E_PAD + experts[None, :]
        tile = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=ok)
        running += tl.sum(tile, axis=0)
    tl.store(chunk_counts_ptr + num_chunks * E_PAD + experts, running)


@triton.jit
def align_scatter_kernel(ids_ptr, expert_map_ptr, sorted_pairs_ptr, block_expert_ptr, chunk_counts_ptr, num_pairs,
                         num_global, num_local, num_blocks,
                         PAIRS_PER_PROGRAM: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr,
                         E_PAD: tl.constexpr, CHUNK: tl.constexpr, PAD_CHUNK: tl.constexpr,
                         OWNER_CHUNK: tl.constexpr):
    """Step 3 of 3: each chunk scatters its pairs from its first slots, and the chunks share the runs'
    layout: chunk c pads the runs of experts c, c + chunks, ... and writes the owners of its share of
    the blocks (one program did all of it, a serial chain that grew with T)."""
    c, start, end = _my_chunk(num_pairs, PAIRS_PER_PROGRAM)
    experts = tl.arange(0, E_PAD)
    num_chunks = tl.num_programs(0)
    counts = tl.load(chunk_counts_ptr + num_chunks * E_PAD + experts)
    padded, padded_start, padded_end = _padded_runs(counts, BLOCK_M)  # every program: E_PAD values
    cursor = tl.load(chunk_counts_ptr + c * E_PAD + experts) + padded_start
    _scatter(ids_ptr, expert_map_ptr, sorted_pairs_ptr, cursor, start, end, num_global, num_local, HAS_MAP, E_PAD, CHUNK)
    _fill_padding(counts, padded_start, padded, experts % num_chunks == c, sorted_pairs_ptr, num_pairs,
                  BLOCK_M, E_PAD, PAD_CHUNK)
    share = tl.cdiv(num_blocks, num_chunks)
    _write_owners(padded_end, tl.sum(padded, axis=0), block_expert_ptr, c * share,
                  tl.minimum((c + 1) * share, num_blocks), BLOCK_M, OWNER_CHUNK)
