"""Argument validation shared by every public op.

All checks run on the host, before any launch, and raise errors that name the argument and
give the expected and actual value (the engines' reverted kernels failed on inputs nobody
checked: wrong strides, a rebound ``out``).
"""

from __future__ import annotations

import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | tuple[int, ...] | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # the kernels and the torch path index dense memory
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout} ({name}.to_dense() makes one)")
    # the kernels read memory as stored: a view's lazy sign flip would be lost (dynamo cannot trace the bits' query)
    if not torch.compiler.is_compiling() and (t.is_neg() or t.is_conj()):
        raise ValueError(f"{name} is a view with torch's lazy negation or conjugation bit (as .conj().imag gives): "
                         f"pass a tensor without it ({name}.resolve_neg() or .resolve_conj() makes one)")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {_names(dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of the input), got {t.device}")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_out(name: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              inputs: dict[str, torch.Tensor]) -> None:
    """``out=`` contract: exact shape, dtype and device; unit stride in the last dim; no aliasing."""
    check_tensor(name, out, device=device)
    check_shape(name, out, shape)
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if out.numel() and out.dim() and out.stride(-1) != 1 and out.shape[-1] != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {out.stride()}")
    if not torch.compiler.is_compiling():  # traced tensors have no memory: the ops check it when they run
        check_written_memory(name, out, inputs)


def check_written_memory(name: str, out: torch.Tensor, inputs: dict[str, torch.Tensor | None]) -> None:
    """What a kernel writes: each element's memory its own, none of it the inputs'."""
    check_own_memory(name, out)
    check_disjoint(name, out, inputs)


def check_own_memory(name: str, t: torch.Tensor) -> None:
    """Every element of ``t`` has memory of its own: parallel writes into shared memory leave one writer's value,
    silently. Refused where the strides do not prove it (dims by increasing stride, each stride past the span of
    the smaller ones): every layout torch makes passes."""
    span = 0
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= span:
            raise ValueError(f"{name} must give each element memory of its own, got shape {tuple(t.shape)} and "
                             f"strides {t.stride()}")
        span += stride * (size - 1)


def check_disjoint(name: str, out: torch.Tensor, inputs: dict[str, torch.Tensor | None]) -> None:
    """``out`` shares no memory with any of ``inputs`` (what a kernel writes must not be what it reads), by byte
    spans: two storages can wrap one buffer (from_numpy, frombuffer, DLPack of one allocation at two offsets), and
    strided views whose spans interleave are refused though their elements may not meet. Tensors without memory
    (meta, fake) share none. On every repeated eager call with ``out=``: an input whose whole allocation misses
    out's bytes is passed after one comparison."""
    if not out.numel() or not _has_memory(out):
        return
    o0, o1 = _byte_span(out)
    for other_name, other in inputs.items():
        if other is None or not other.numel() or other.device != out.device or not _has_memory(other):
            continue
        storage = other.untyped_storage()
        s0 = storage.data_ptr()
        if s0 >= o1 or s0 + storage.nbytes() <= o0:
            continue
        b0, b1 = _byte_span(other)
        if b0 < o1 and o0 < b1:
            raise ValueError(f"{name} must not overlap the memory of {other_name}")


def check_top_k(top_k, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def int32_ids(ids: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """Expert ids as int32 (no host sync): an int64 id past int32's range is no expert, where a cast would wrap it
    into a real expert's id. ``exact``: such ids become -1 (five ops); otherwise every id is clamped into [-1,
    int32 max] (two ops, for a hot path that only needs them to stay past every expert)."""
    if ids.dtype == torch.int64:
        int32 = torch.iinfo(torch.int32)
        if not exact:
            return ids.clamp(-1, int32.max).to(torch.int32)
        ids = torch.where((ids >= int32.min) & (ids <= int32.max), ids, -1)
    return ids.to(torch.int32)


_WARNED_DETACHED: set[str] = set()


def warn_gradients_dropped(op: str, advice: str, *inputs) -> None:
    """A RuntimeWarning, once per op, where gradients are asked of ``inputs`` (grad mode on, one of them requires
    grad) and ``op`` runs kernels that compute none: an output that silently does not require grad would leave a
    trainer's parameters frozen."""
    if (op not in _WARNED_DETACHED and torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
            and not torch.compiler.is_compiling()):
        _WARNED_DETACHED.add(op)
        warnings.warn(f"moekit's {op} ran kernels that compute no gradients: its output does not require grad; "
                      f"run under torch.no_grad(), or {advice} to differentiate", RuntimeWarning, stacklevel=4)


def warned_if_detached(op: str, advice: str, result, *inputs):
    """``result`` (a tensor, or a tuple whose first one decides), after :func:`warn_gradients_dropped` where it does
    not require grad: a Triton path computes no gradients."""
    first = result[0] if isinstance(result, tuple) else result
    if not first.requires_grad:
        warn_gradients_dropped(op, advice, *inputs)
    return result


def may_sync(t: torch.Tensor) -> bool:
    """A check may read ``t``'s values on the host now: not while torch.compile traces or a CUDA graph is captured,
    nor from a meta or fake tensor, which has none."""
    return not (torch.compiler.is_compiling() or not _has_memory(t)
                or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def tensor_version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write torch sees), or None for a tensor made under
    torch.inference_mode, which keeps none: caches keyed on it must treat None as "unknown"."""
    try:
        return t._version
    except RuntimeError:
        return None


def _has_memory(t: torch.Tensor) -> bool:
    """Not a meta or fake tensor (FakeTensorMode outside torch.compile: every one reports address 0)."""
    return not (t.is_meta or isinstance(t, FakeTensor))


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    if t.is_contiguous():  # (the common case, without a loop over the dims)
        return start, start + t.numel() * t.element_size()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return start, start + (extent + 1) * t.element_size()


def _names(dtypes) -> str:
    return "(" + ", ".join(str(d).replace("torch.", "") for d in dtypes) + ")"
