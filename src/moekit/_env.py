"""Switches read from the environment on every eager call (MOEKIT_BATCH_INVARIANT, MOEKIT_VERIFY, TRITON_INTERPRET).

They are read at call time, not once at import, so that a process (or a test) may set them while it runs. Each is
read from ``os.environ``'s own dict where it keeps one (POSIX: bytes keys): ``os.environ.get`` encodes the key and
decodes the value, a microsecond or more per read, and an eager call reads several."""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None)
_BYTES_KEYS = os.name == "posix" and isinstance(_DATA, dict)
# the usual spellings of "off" too: MOEKIT_BATCH_INVARIANT=false once turned the mode on
_OFF_WORDS = ("", "0", "false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF")
_OFF = frozenset((None, *_OFF_WORDS, *(w.encode() for w in _OFF_WORDS)))  # (a set: one hash per read)


def flag(name: str):
    """``flag(NAME)() -> bool``: whether the variable is set to anything but "", "0", "false", "no" or "off" (in
    lower, upper or title case), at the time of the call."""
    if _BYTES_KEYS:
        key = os.fsencode(name)
        return lambda: os.environ._data.get(key) not in _OFF  # (os.environ read each time: it may be replaced)
    return lambda: os.environ.get(name) not in _OFF
