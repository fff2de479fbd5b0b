"""Triton's CPU interpreter, made cheaper for the kernels' many small ``@triton.jit`` helpers.

Triton 3.6's interpreter re-patches ``triton.language`` (an ``inspect.getmembers`` walk over three
modules) on every device-function call, although the kernel that makes the call has already patched
it for the whole launch. moekit's kernels call helpers in their inner loops, so about half of an
interpreted launch went to that walk (cProfile of the 4-bit decode kernels, 2026-12-04). The
shortcut below skips the walk when every language module the helper sees is already patched, and
defers to Triton otherwise; results are unchanged (the helper runs the same patched functions).

Opt-in, by the test suite and ``moekit verify`` on CPUs; nothing else in moekit changes Triton.
"""

from __future__ import annotations

import functools

SUPPORTED_TRITON = ("3.6.",)  # the private function it wraps, as that release has it


@functools.cache
def speed_up() -> bool:
    """Install the shortcut once per process; False (and nothing changed) on another Triton."""
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
    return True
