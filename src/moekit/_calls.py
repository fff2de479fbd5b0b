"""Checked call signatures: the host work of a repeated eager call.

An op's checks (types, shapes, strides, dtypes, devices, options) and its choice of implementation read only the
call's *signature*: each tensor argument's shape, strides, dtype and device, a quantized weight's format and
parts, the options, and the process state those decisions depend on (the verification gate's verdicts, the
batch-invariant switch, the interpreter switch). :class:`CheckedCalls` remembers, per signature that passed, what
the op decided, so that the next call of that signature goes straight to its launches. A new signature is checked
in full; what depends on addresses or values (``out=`` overlapping an input, an expert map changed in place) is
checked on every call by the ops themselves.
"""

from __future__ import annotations

import weakref

import torch

from . import _invariant, _triton, gate
from .formats import TYPES, to_parts


def _meta(a):
    """A tensor by its shape, strides, dtype and device; a quantized weight by its format and parts; None as itself;
    anything else (which the checks refuse) by its type and value."""
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided:  # (the checks refuse it; a sparse tensor has no strides to key on)
            return (type(a), a.layout, a.shape)
        return (a.shape, a.stride(), a.dtype, a.device, a.is_neg())  # (the checks refuse a negation view)
    if isinstance(a, _QUANTIZED):
        fmt, data, scales, global_scale, tag, shape = to_parts(a)
        return (fmt, tag, tuple(shape), _meta(data), _meta(scales), _meta(global_scale))
    return (type(a), a)


_QUANTIZED = tuple(TYPES.values())
_PLAIN = (str, int, bool, torch.dtype)


def _option(v):
    if v is None:
        return None
    t = type(v)
    if t in _PLAIN:
        return (t, v)
    if t is float:
        return (t, v.hex())
    if getattr(t, "__dataclass_params__", None) is not None and t.__dataclass_params__.frozen:
        return (t, v)  # a frozen config: compared field by field
    raise TypeError(f"no signature for an option of type {t.__name__}")


class CheckedCalls:
    """``signature -> decision`` of one op's eager calls (bounded: forgotten all at once past ``limit``)."""

    _ALL: "weakref.WeakSet[CheckedCalls]" = weakref.WeakSet()

    def __init__(self, limit: int = 4096):
        self._entries: dict = {}
        self._limit = limit
        CheckedCalls._ALL.add(self)

    @classmethod
    def forget_all(cls) -> None:
        """Forget every op's decisions (tests that change what a decision reads, e.g. a module constant, start
        from here)."""
        for calls in list(cls._ALL):
            calls.clear()

    @staticmethod
    def signature(tensors: tuple, options: tuple = ()) -> tuple | None:
        """The signature of a call: its tensor arguments (tensors, quantized weights or None) by shape, strides,
        dtype and device; its options by type and value (a float by its bits: -0.0 is not 0.0). None where it has
        none: while torch.compile traces, an option that is no plain value (a tensor where a number goes: its value
        would need a read), or an argument the checks would refuse (they then say why)."""
        if torch.compiler.is_compiling():
            return None
        try:
            return (*map(_meta, tensors), *map(_option, options), gate.generation(), _invariant.enabled(),
                    _triton.interpreting())
        except TypeError:
            return None

    # A signature is hashed by the lookups alone (a nested tuple does not keep its hash): one holding an unhashable
    # argument (which the checks then refuse) is never kept
    def get(self, key):
        if key is None:
            return None
        try:
            return self._entries.get(key)
        except TypeError:
            return None

    def put(self, key, decision) -> None:
        if key is None:
            return
        if len(self._entries) >= self._limit:
            self._entries.clear()
        try:
            self._entries[key] = decision
        except TypeError:
            pass

    def clear(self) -> None:
        self._entries.clear()
