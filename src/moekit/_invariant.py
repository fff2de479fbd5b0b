"""The batch-invariant switch: with ``MOEKIT_BATCH_INVARIANT=1`` (or :func:`set_batch_invariant`), every op gives
each token bits that depend only on that token's inputs and the weights, never on how many other tokens share its
call, which they are, or where it sits among them.

What changes a token's bits with the batch is the order in which a reduction adds its terms: a kernel chosen by
token count (CUDA-core GEMVs at decode, tensor-core tiles above), a K step or a K split that a tuned table changes
with T, or a scale shared by the whole batch. Under the switch each op fixes one reduction order per shape class
(routing/tiers.py, experts/configs.py) and refuses what cannot be made invariant, naming the switch.

This module is low in the runtime (layer 0) so that every op can read the switch; it holds no policy of its own
beyond the switch and the one matmul and elementwise form the torch paths share.
"""

from __future__ import annotations

import contextlib

import torch

from . import _env

ENV = "MOEKIT_BATCH_INVARIANT"
_ENABLED: bool | None = None
_FROM_ENV = _env.flag(ENV)

ROWS_PER_MATMUL = 16
"""Rows of every matmul the torch paths issue under the switch. A CPU BLAS picks its kernel, blocking and threads
from the whole call's shape, so a row's dot products may be summed in another order when the row count changes; a
fixed shape pins that choice for every row."""


def set_batch_invariant(enabled: bool | None) -> None:
    """Turn batch-invariant mode on or off for this process (None: follow MOEKIT_BATCH_INVARIANT again).

    Decisions cached per call kind (the experts' backend, block configurations, the router's tier) key on the
    mode, so a toggle takes effect at the next call. Run one eager call of each shape after a toggle before
    capturing a CUDA graph: a graph keeps the kernels it captured."""
    global _ENABLED
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _ENABLED = enabled


def enabled() -> bool:
    """Whether batch-invariant mode is on (set_batch_invariant, else MOEKIT_BATCH_INVARIANT)."""
    if _ENABLED is not None:
        return _ENABLED
    return _FROM_ENV()


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """``with batch_invariant():`` the mode for the block, then back to what it was (set or from the environment)."""
    saved = _ENABLED
    set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(saved)


def refusal(what: str, why: str) -> str:
    """The message of an error raised because batch-invariant mode is on."""
    return (f"{what} is not batch-invariant ({why}), and batch-invariant mode is on "
            f"(moekit.set_batch_invariant(True) or {ENV}=1): turn it off to use it")


def rows_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, K] @ b [K, N] in fixed-shape pieces of ROWS_PER_MATMUL rows (the last zero-padded): row i of the
    result has the same bits whatever n is and wherever the row sits. Same dtype and device as ``a``."""
    n = a.shape[0]
    if n == 0:
        return a.new_empty(0, b.shape[1])
    pad = -n % ROWS_PER_MATMUL
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    pieces = a.reshape(-1, ROWS_PER_MATMUL, a.shape[1]).unbind(0)
    return torch.cat([piece @ b for piece in pieces])[:n]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, K] @ b [K, N]: in batch-invariant mode by :func:`rows_matmul`, else one matmul. The torch paths' row
    products (experts, their LoRA terms, the router) go through here, so none of them is left out of the mode."""
    return rows_matmul(a, b) if enabled() else a @ b


ELEMENTWISE_PIECE = 32767
"""Elements of one piece of an elementwise op under the switch: under torch's parallel grain (32768), so one thread
runs it."""
ELEMENTWISE_ROW_ALIGN = 64
"""Row padding under the switch: a multiple of every CPU vector loop's step, so that no element takes the scalar
tail."""


def elementwise(fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)``, an elementwise function of [n, C] tensors, with each row's bits independent of n and of the
    row's place under the switch. A CPU kernel runs most elements in a vector loop and the last few (past a multiple
    of its step, or past a thread's share of the flattened tensor) in scalar code, and the two round transcendental
    functions differently (sigmoid, exp: 1 ulp): under the switch every row is padded to ELEMENTWISE_ROW_ALIGN
    elements and the rows go in pieces that one thread runs, so every element takes the vector loop."""
    n, cols = xs[0].shape
    if not enabled() or n == 0:
        return fn(*xs)
    padded = -(-cols // ELEMENTWISE_ROW_ALIGN) * ELEMENTWISE_ROW_ALIGN
    rows = max(1, ELEMENTWISE_PIECE // padded)
    pieces = [fn(*(torch.nn.functional.pad(x[i:i + rows], (0, padded - cols)) for x in xs))[:, :cols]
              for i in range(0, n, rows)]
    return torch.cat(pieces)


SIZES = (1, 2, 7, 64, 129, 1000)
"""Batch sizes at which an invariance check places a token (the issue's; checks on the CPU pass fewer)."""


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bytes, not values: NaN equals itself here and -0.0 differs from 0.0
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def first_mismatch(alone, cases) -> str | None:
    """None when every case reproduced ``alone``'s bits, else where the first did not. ``alone``: a token's outputs
    when served alone (a tensor or a tuple of them); ``cases``: (description, the same token's outputs in a batch)."""
    alone = _outputs(alone)
    for where, got in cases:
        for n, (a, g) in enumerate(zip(alone, _outputs(got))):
            if not _same_bits(a, g):
                diff = (a.double() - g.double()).abs() if a.shape == g.shape else None
                what = ("shape or dtype differs" if diff is None else
                        f"{int((a != g).sum())} of {a.numel()} elements differ, max |diff| {diff.nan_to_num().max():.3g}")
                return f"{where}: output {n} {what}"
    return None


def token_cases(run, probe: dict, others: dict, sizes=SIZES):
    """The cases of :func:`first_mismatch` for an op whose inputs and outputs are per token along dim 0: ``probe``
    (name -> [1, ...]) placed first, in the middle and last among rows of ``others`` (name -> [>= max(sizes) - 1,
    ...]) in a batch of each size; ``run(inputs) -> outputs`` (each [T, ...]). Yields (description, outputs of the
    probe's row)."""
    for size in sizes:
        for pos in sorted({0, size // 2, size - 1}):
            batch = {k: torch.cat([v[:pos], probe[k], v[pos:size - 1]]) for k, v in others.items()}
            yield f"T={size}, position {pos}", tuple(o[pos] for o in _outputs(run(batch)))


def token_mismatch(run, probe: dict, others: dict, sizes=SIZES) -> str | None:
    """None when ``run`` gives the probe token the bits it gets alone in every batch of :func:`token_cases`."""
    alone = tuple(o[0] for o in _outputs(run(probe)))
    return first_mismatch(alone, token_cases(run, probe, others, sizes))
