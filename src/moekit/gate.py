"""The in-library accuracy gate: with ``MOEKIT_VERIFY=1`` (or :func:`set_verification`), the first
time a fast path would serve a new kind of call it is checked against the float64 reference on a
small random case; one that fails is disabled for the process with a warning naming it and the
measured error, and the next candidate serves the call.

This module keeps the switch and the verdicts; each op brings its own check case
(:mod:`moekit.experts.gate_case`, :mod:`moekit.routing.gate_case`). A check cannot run inside a
CUDA-graph capture: the first call of each shape must be eager.
"""

from __future__ import annotations

import warnings

import torch

from . import _env

_ENABLED: bool | None = None
_FROM_ENV = _env.flag("MOEKIT_VERIFY")
_RESULTS: dict = {}
_GENERATION = [0]  # bumped whenever a verdict or the switch changes: callers may cache what depended on them


def set_verification(enabled: bool | None) -> None:
    """Turn the gate on or off for this process (None: follow MOEKIT_VERIFY again)."""
    global _ENABLED
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _ENABLED = enabled
    _GENERATION[0] += 1


def enabled() -> bool:
    if _ENABLED is not None:
        return _ENABLED
    return _FROM_ENV()


def reset() -> None:
    """Forget every verdict (the next call checks again)."""
    _RESULTS.clear()
    _GENERATION[0] += 1


def generation() -> tuple:
    """A number that changes whenever the gate's switch or a verdict does (and MOEKIT_VERIFY is read again)."""
    return (_GENERATION[0], enabled())


def results() -> dict:
    """{(backend name, shape class): (passed, detail)} of this process."""
    return dict(_RESULTS)


def active() -> bool:
    """The gate checks calls now: enabled, and not while torch.compile traces."""
    return enabled() and not torch.compiler.is_compiling()


def verdict(key: tuple, name: str, describe: str, run_check) -> str | None:
    """None when the fast path ``key`` passed its check (run now, the first time), else why not.
    A failure warns once, naming ``name`` and the measured error; the verdict is kept for the process."""
    if key not in _RESULTS:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"moekit's verification gate has not checked {name} for {describe} yet and cannot "
                               "while a CUDA graph is being captured: run one eager call of this shape first")
        # the cases draw on the CPU and move to the call's device: a process-wide default device (set_default_device)
        # must not make a case fail, which would disable a backend that serves the call correctly
        with torch.device("cpu"):
            _RESULTS[key] = run_check()
        _GENERATION[0] += 1
        if not _RESULTS[key][0]:
            warnings.warn(f"moekit: backend {name!r} failed its accuracy check for {describe}: "
                          f"{_RESULTS[key][1]}; it is disabled for this process", RuntimeWarning, stacklevel=5)
    passed, detail = _RESULTS[key]
    return None if passed else f"failed the verification gate ({detail})"


def known_failure(key: tuple) -> str | None:
    """The refusal of a fast path that already failed its check (no new check runs)."""
    result = _RESULTS.get(key)
    return None if result is None or result[0] else f"failed the verification gate ({result[1]})"


