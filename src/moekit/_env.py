"""Switches read from the environment on every eager call (MOEKIT_BATCH_INVARIANT, MOEKIT_VERIFY, TRITON_INTERPRET).

They are read at call time, not once at import, so that a process (or a test) may set them while it runs (Triton
reads TRITON_INTERPRET when it builds a kernel, so that one must be set before moekit is imported). Each is read
from ``os.environ``'s own dict where it keeps one (POSIX: bytes keys): ``os.environ.get`` encodes the key and
decodes the value, a microsecond or more per read, and an eager call reads several."""

from __future__ import annotations

import itertools
import os

_BYTES_KEYS = os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict)
# the usual spellings of "off" too: MOEKIT_BATCH_INVARIANT=false once turned the mode on
_OFF_WORDS = ("", "0", "false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF")
_OFF = frozenset((None, *_OFF_WORDS, *(w.encode() for w in _OFF_WORDS)))  # (a set: one hash per read)
_ON_WORDS = ("1", "true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON")
_ON = frozenset((*_ON_WORDS, *(w.encode() for w in _ON_WORDS)))
# Triton's own reading of its switches (triton.knobs, getenv_bool): these words in any case are on, all else off. Every
# spelling is in the set (not value.lower(): torch.compile cannot trace bytes.lower).
_TRITON_ON = frozenset(w for word in ("1", "true", "on", "yes", "y")
                       for spelling in itertools.product(*({c.lower(), c.upper()} for c in word))
                       for w in ("".join(spelling), "".join(spelling).encode()))


def _reader(name: str):
    """``read() -> bytes | str | None``: the variable's value at the time of the call."""
    if not _BYTES_KEYS:
        return lambda: os.environ.get(name)
    key = os.fsencode(name)

    def read():
        env = os.environ  # (looked up each time: a test may replace it, with a plain dict too)
        data = getattr(env, "_data", None)
        return data.get(key) if isinstance(data, dict) else env.get(name)
    return read


def flag(name: str):
    """``flag(NAME)() -> bool``: the variable at the time of the call: on for "1", "true", "yes" or "on", off for
    unset, "", "0", "false", "no" or "off" (the words in lower, upper or title case); any other value raises a
    ValueError naming the variable (a typo such as "ture" or "o" must not pick a mode silently)."""
    read = _reader(name)

    def on() -> bool:
        value = read()
        if value in _OFF:
            return False
        if value in _ON:
            return True
        if isinstance(value, bytes):
            value = os.fsdecode(value)
        raise ValueError(f"{name}={value!r}: expected 1, true, yes or on (on) or 0, false, no, off or empty (off)")
    return on


def triton_flag(name: str):
    """``triton_flag(NAME)() -> bool``: a Triton switch as Triton reads it: on for "1", "true", "on", "yes" or "y"
    in any case, off for anything else (" 1" and "2" too)."""
    read = _reader(name)

    def on() -> bool:
        return read() in _TRITON_ON
    return on
