"""Triton's CPU interpreter, made cheaper for the kernels' many small ``@triton.jit`` helpers.

Triton 3.6's interpreter re-patches ``triton.language`` (an ``inspect.getmembers`` walk over three
modules) on every device-function call, although the kernel that makes the call has already patched
it for the whole launch. moekit's kernels call helpers in their inner loops, so about half of an
interpreted launch went to that walk (cProfile of the 4-bit decode kernels, 2026-12-04). The
shortcut below skips the walk when every language module the helper sees is already patched, and
defers to Triton otherwise; results are unchanged (the helper runs the same patched functions).

Its dots of 16- and 32-bit floats go to numpy's matmul, which hands them to the CPU's BLAS, and OpenBLAS
picks its kernel per CPU: the AVX2/FMA ones round a row of a tile otherwise than the same row computed
alone (measured on an AMD EPYC, 2026-12-07: the router's token 6 of 7 differed from the token alone by
an ulp), so a test of batch invariance passed or failed with the machine. The second patch sums every
dot along K in order (numpy's own loop, taken when an operand's rows are not contiguous): each output
element is the same chain of fp32 multiply-adds on every CPU and at every row, as on the GPU, where a
token's sum never depends on its row either.

Opt-in, by the test suite and ``moekit verify`` on CPUs; nothing else in moekit changes Triton.
"""

from __future__ import annotations

import functools

import numpy as np

SUPPORTED_TRITON = ("3.6.",)  # the private function it wraps, as that release has it


@functools.cache
def speed_up() -> bool:
    """Install the shortcut and the in-order dots once per process; False (and nothing changed) on another
    Triton."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # no Triton, or one without the interpreter: nothing to speed up
        return False
    if not triton.__version__.startswith(SUPPORTED_TRITON) or not hasattr(interpreter, "_patch_lang"):
        return False
    original = interpreter._patch_lang

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        # A patched module's builtins are plain lambdas: `is_builtin` is False for them.
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return interpreter._LangPatchScope()  # nothing to undo: the launch's own scope restores
        return original(fn)

    interpreter._patch_lang = patch_lang
    _sum_dots_in_order(interpreter)
    return True


def _in_order(x: np.ndarray, dtype) -> np.ndarray:
    """``x`` as ``dtype``, in a view whose last axis steps two elements: numpy's matmul then takes its own loop (an
    output element's terms summed one after another along K) instead of BLAS."""
    spread = np.empty(x.shape[:-1] + (2 * x.shape[-1],), dtype)
    view = spread[..., ::2]
    view[...] = x
    return view


def _sum_dots_in_order(interpreter) -> None:
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    exact = (np.float16, np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        if acc != np.float32 or a.data.dtype not in exact or b.data.dtype not in exact:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)  # FP8, integers, fp64
        product = np.matmul(_in_order(a.data, acc), _in_order(b.data, acc))
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
