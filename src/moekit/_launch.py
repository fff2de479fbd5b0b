"""Triton launches whose per-call binding is done once per call signature.

``JITFunction.run`` re-derives on every launch what only changes with the call's signature: the
specialization of each argument (through a C++ call per argument), the cache key, a check that the
kernel's global constants did not change (a Python ``constexpr.__ne__`` per global, per launch), the
device, the launch options. On an H200 host that is most of an eager ``fused_experts`` call (cProfile of
``python benchmarks/bench_eager.py --profile``, 2026-12-04: ``JITFunction.run`` 64% of a T=16 call).

:class:`Launcher` keeps, per kernel, the compiled kernel of each *signature* it has seen and launches it
through Triton's own compiled launcher (``CompiledKernel.run``), the last step of ``JITFunction.run``.
A signature holds everything Triton specializes on, so a cached kernel is never used where Triton would
have picked another: per positional argument its type, a tensor's dtype and whether its address is a
multiple of 16, an int's value classes (1, a multiple of 16, the 32/64-bit range), a TMA descriptor's
element type and box; every keyword (the constexprs and the launch options) by value. The first call of a
signature, calls with an argument of another type, launch hooks (profilers) and the interpreter go through
``JITFunction.run`` unchanged.
"""

from __future__ import annotations

import torch

_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1

try:
    from triton.knobs import HookChain as _HookChain
except ImportError:  # a Triton whose hooks are plain callables or None

    class _HookChain:
        pass


class _Unkeyed(Exception):
    """An argument whose specialization this module does not derive: Triton's own path serves the call."""


def signature(args: tuple, kwargs: dict) -> tuple:
    """The part of a launch's arguments that Triton's specialization depends on (hashable). Ints: Triton makes
    1 a constexpr, gives multiples of 16 the divisibility attribute and picks i32/i64/u64 by range."""
    Tensor = torch.Tensor
    key = tuple([(a.dtype, a.data_ptr() & 15 == 0) if type(a) is Tensor
                 else (a == 1, a & 15 == 0, _I32_MIN <= a <= _I32_MAX, a <= _I64_MAX) if type(a) is int
                 else type(a) if a is None or type(a) is bool or type(a) is float
                 else _other(a) for a in args])
    for v in kwargs.values():  # constexprs and options: their values are the specialization
        if not (v is None or type(v) in _KEYWORD_TYPES):
            raise _Unkeyed(type(v).__name__)
    return (key, tuple(kwargs.items()))


_KEYWORD_TYPES = (int, bool, float, str)


def _other(a):
    if isinstance(a, torch.Tensor):  # a subclass (nn.Parameter)
        return (a.dtype, a.data_ptr() & 15 == 0)
    if type(a).__name__ == "TensorDescriptor" and hasattr(a, "block_shape"):
        # Triton types a host TMA descriptor by its element type and box (tensordesc<bf16[64, 128]>); the
        # launcher encodes base, shape and strides on every launch
        return ("tensordesc", a.base.dtype, tuple(a.block_shape), getattr(a, "padding", None))
    raise _Unkeyed(type(a).__name__)


class _Bound:
    __slots__ = ("run", "function", "packed_metadata", "tail", "kernel")

    def __init__(self, kernel, tail: tuple):
        self.kernel = kernel
        self.run = kernel.run  # Triton's compiled launcher (loads the module on first use)
        self.function = kernel.function
        self.packed_metadata = kernel.packed_metadata
        self.tail = tail


class Launcher:
    """``Launcher(kernel)[grid](*args, **constexprs_and_options)``: launches ``kernel`` (a ``@triton.jit``
    function) like ``kernel[grid](...)`` and returns the compiled kernel, binding each call signature once.

    Runtime arguments go positionally, constexprs and options (``num_warps``...) by keyword, as the
    signature keys them."""

    MAX_SIGNATURES = 512  # a process that cycles through more (odd strides, say) pays Triton's path again

    def __init__(self, fn):
        self.fn = fn
        self._bound: dict = {}
        self._params = getattr(fn, "params", None)
        self._bindable = self._params is not None and hasattr(fn, "device_caches")  # not under the interpreter
        self.compiled = self._bindable
        """The kernel was built for the GPU (not wrapped by Triton's interpreter): inline PTX may be used."""
        if self._bindable:
            from triton import knobs

            self._runtime = knobs.runtime
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        if not self._bindable or _hooks_set(self._runtime):
            return self.fn[grid](*args, **kwargs)
        try:
            key = signature(args, kwargs)
        except _Unkeyed:
            return self.fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        bound = self._bound.get((device, key))
        if bound is None:
            kernel = self.fn[grid](*args, **kwargs)  # compiles if needed, and launches
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            if len(self._bound) >= self.MAX_SIGNATURES:
                self._bound.clear()
            self._bound[(device, key)] = _Bound(kernel, self._tail(len(args), kwargs))
            return kernel
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        bound.run(g0, g1, g2, stream, bound.function, bound.packed_metadata, None, None, None, *args, *bound.tail)
        return bound.kernel

    def _tail(self, given: int, kwargs: dict) -> tuple:
        """The values of the parameters after the positional ones, in signature order (keywords or defaults):
        fixed for a signature, since every keyword is part of its key."""
        tail = []
        for p in self._params[given:]:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                raise TypeError(f"{self.__name__}: missing argument {p.name!r}")
        return tuple(tail)


def _hooks_set(runtime) -> bool:
    """Whether a launch hook (a profiler's) is set: Triton 3.6 keeps chains of hooks, empty unless one was added."""
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(enter.calls if type(enter) is _HookChain else enter) or bool(
        exit_.calls if type(exit_) is _HookChain else exit_)
