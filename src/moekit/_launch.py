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
    types = tuple(map(type, args))
    for v in kwargs.values():  # constexprs and options: their values are the specialization
        if not (v is None or type(v) in _KEYWORD_TYPES):
            raise _Unkeyed(type(v).__name__)
    return (types, _key_function(types)(args)[0], tuple(kwargs.items()))


_KEYWORD_TYPES = (int, bool, float, str)
_KEY_FUNCTIONS: dict = {}


def _key_function(types: tuple):
    """``args -> key`` for positional arguments of these exact types, generated once per tuple of types: one
    expression instead of a loop that dispatches on every argument's type (a launch's largest host cost).

    The key: the tensors' 16-byte alignment flags (one OR of their addresses when all are aligned, the common
    case), the ints by value (finer than Triton's classes, ==1 / multiple of 16 / i32 / i64 range: a new value
    binds again, once, where classifying every int on every launch cost more than the launch), the tensors'
    dtypes, the descriptors' element types and boxes. None, bools and floats are keyed by their type."""
    fn = _KEY_FUNCTIONS.get(types)
    if fn is not None:
        return fn
    ptrs, parts = [], []
    for i, t in enumerate(types):
        if issubclass(t, torch.Tensor):  # nn.Parameter too
            ptrs.append(f"a{i}.data_ptr()")
            parts.append(f"a{i}.dtype")
        elif t is int:
            parts.append(f"a{i}")
        elif t in (type(None), bool, float):
            pass
        elif t.__name__ == "TensorDescriptor" and hasattr(t, "from_tensor"):
            # Triton types a host TMA descriptor by its element type and box (tensordesc<bf16[64, 128]>); the
            # launcher encodes base, shape and strides on every launch
            # (a Gluon descriptor's shared-memory layout too: another layout is another specialization)
            parts.append(f"('tensordesc', a{i}.base.dtype, tuple(a{i}.block_shape), getattr(a{i}, 'padding', None), "
                         f"getattr(a{i}, 'layout', None))")
        else:
            raise _Unkeyed(t.__name__)
    lines = ["def key(args):"]
    if types:
        lines.append(f"    {''.join(f'a{i}, ' for i in range(len(types)))}= args")
    if ptrs:
        lines += [f"    p{j} = {expr}" for j, expr in enumerate(ptrs)]
        every = " | ".join(f"p{j}" for j in range(len(ptrs)))
        each = " | ".join(f"(p{j} & 15 == 0) << {j}" for j in range(len(ptrs)))
        lines.append(f"    flags = {(1 << len(ptrs)) - 1} if not ({every}) & 15 else {each}")
    else:
        lines.append("    flags = 0")
    first = next((i for i, t in enumerate(types) if issubclass(t, torch.Tensor)), None)
    on = "-1" if first is None else f"a{first}.get_device()"
    lines.append(f"    return (flags, {''.join(part + ', ' for part in parts)}), ({_addressed(types)}), {on}")
    scope: dict = {}
    exec(compile("\n".join(lines) + "\n", f"<moekit._launch key of {len(types)} arguments>", "exec"), scope)
    if len(_KEY_FUNCTIONS) >= 4096:
        _KEY_FUNCTIONS.clear()
    fn = _KEY_FUNCTIONS[types] = scope["key"]
    return fn


_TENSORS_AS_ADDRESSES = True  # off only in tests whose recording kernels look at the launched tensors


def _addressed(types: tuple) -> str:
    """The launch arguments as generated code reads them (``a{i}``, a tensor's address ``p{j}``): a bound launch
    passes each tensor as its address, which Triton's launcher takes as it is, where for a tensor it calls
    ``data_ptr()`` and asks the driver what the address is (``cuPointerGetAttribute``, once per tensor per launch).
    The op's checks put every tensor of a call on one GPU; a bound launch runs on that GPU (Launcher.launch switches
    to it where it is not the current one, a prepared launch refuses)."""
    parts, j = [], 0
    for i, t in enumerate(types):
        if issubclass(t, torch.Tensor):
            parts.append(f"p{j}" if _TENSORS_AS_ADDRESSES else f"a{i}")
            j += 1
        else:
            parts.append(f"a{i}")
    return "".join(p + ", " for p in parts)


class _Bound:
    __slots__ = ("run", "function", "packed_metadata", "tail", "kernel")

    def __init__(self, kernel, tail: tuple):
        self.kernel = kernel
        self.run = kernel.run  # Triton's compiled launcher (loads the module on first use)
        self.function = kernel.function
        self.packed_metadata = kernel.packed_metadata
        self.tail = tail

    def launch(self, grid, device: int, args: tuple) -> None:
        """The compiled kernel on ``device``'s current stream, with ``args`` (tensors as their addresses) then the
        keywords' tail."""
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        self.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), self.function, self.packed_metadata,
                 None, None, None, *args, *self.tail)


class Constants(dict):
    """A launch's keywords (constexprs and options) made once, e.g. per shape, and passed as they are to
    :meth:`Launcher.launch`: hashed once, not on every launch. Never modified after it is made."""

    __slots__ = ("_hash",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hash = hash(tuple(self.items()))

    def __hash__(self):
        return self._hash


class Launcher:
    """``Launcher(kernel)[grid](*args, **constexprs_and_options)``: launches ``kernel`` (a ``@triton.jit``
    function) like ``kernel[grid](...)`` and returns the compiled kernel, binding each call signature once.

    Runtime arguments go positionally, constexprs and options (``num_warps``...) by keyword, as the
    signature keys them."""

    MAX_SIGNATURES = 512  # past this many (ints are keyed by value: token counts), the older half is dropped

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
        """``kwargs``: a dict, or a :class:`Constants` made once."""
        if not self._bindable or _hooks_set(self._runtime):
            return self.fn[grid](*args, **kwargs)
        types = tuple(map(type, args))
        device = torch._C._cuda_getDevice()  # what torch.cuda.current_device returns, without its Python wrapper
        try:
            key, addressed, on = _bound_key(device, types, args, kwargs)
            bound = self._bound.get(key)
        except (_Unkeyed, TypeError):  # an argument type not keyed here, an unhashable keyword
            return self.fn[grid](*args, **kwargs)
        if on != device and on >= 0:  # tensors of another GPU than the current one: launch on theirs, as torch does
            with torch.cuda.device(on):
                return self.launch(grid, args, kwargs)
        if bound is None:
            kernel = self.fn[grid](*args, **kwargs)  # compiles if needed, and launches
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            try:
                signature(args, kwargs)  # keywords of other types (a runtime tensor by keyword) are not bound
            except _Unkeyed:
                return kernel
            if len(self._bound) >= self.MAX_SIGNATURES:  # the older half goes (dicts keep insertion order)
                for old in list(self._bound)[:self.MAX_SIGNATURES // 2]:
                    del self._bound[old]
            self._bound[key] = _Bound(kernel, self._tail(len(args), kwargs))
            return kernel
        bound.launch(grid, device, addressed)
        return bound.kernel

    def prepare(self, args: tuple, kwargs: dict) -> Prepared | None:
        """The launch of this signature made ready to repeat (:class:`Prepared`), after it was launched once through
        :meth:`launch`; None where it was not bound (the interpreter, an argument type not keyed here, hooks)."""
        if not self._bindable:
            return None
        types = tuple(map(type, args))
        device = torch._C._cuda_getDevice()
        try:
            key, _, _ = _bound_key(device, types, args, kwargs)
            bound = self._bound.get(key)
        except (_Unkeyed, TypeError):
            return None
        if bound is None:
            return None
        return Prepared(bound, device, _addresses_function(types, key[2][0]), self._runtime)

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


class Prepared:
    """One call signature's launch made ready to repeat (:meth:`Launcher.prepare`): ``prepared(grid, args)``
    launches the compiled kernel with ``args`` and returns True, or returns False without launching where the
    binding does not hold (another current device or tensors on another GPU, a tensor whose 16-byte alignment differs
    from the prepared launch's, a launch hook set): the caller then launches through :meth:`Launcher.launch`.

    The caller keeps the rest of the contract: ``args`` have the types, dtypes and integer values of the prepared
    launch (what an op's checked call signature fixes: shapes, strides, dtypes, options), only addresses change."""

    __slots__ = ("_bound", "_device", "_addresses", "_runtime")

    def __init__(self, bound: _Bound, device: int, addresses, runtime):
        self._bound, self._device, self._addresses, self._runtime = bound, device, addresses, runtime

    def __call__(self, grid, args: tuple) -> bool:
        addressed = self._addresses(args, self._device)
        if addressed is None or torch._C._cuda_getDevice() != self._device or _hooks_set(self._runtime):
            return False
        self._bound.launch(grid, self._device, addressed)
        return True


def arg_builder(args: tuple, sources: tuple):
    """``sources -> args``: one launch's arguments rebuilt from another call's ``sources`` (a tuple of tensors or
    None in a fixed order, made the same way each call), for a :class:`Prepared` launch kept with a call signature:
    each tensor among ``args`` by its position among ``sources``, every other argument (ints, floats, bools, None)
    as it is now. The caller keeps what makes those constant: the call signature fixes shapes, strides, dtypes and
    options. None where an argument tensor is none of the sources or two sources are one tensor (which of them an
    argument stands for would then be a guess). Generated once per layout, like the launch keys."""
    where: dict = {}
    for i, t in enumerate(sources):
        if t is None:
            continue
        if id(t) in where:
            return None
        where[id(t)] = i
    parts, consts = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            i = where.get(id(a))
            if i is None:
                return None
            parts.append(f"s[{i}]")
        elif a is None or type(a) in (int, bool):
            parts.append(repr(a))
        elif type(a) is float:
            parts.append(f"c[{len(consts)}]")
            consts.append(a)
        else:  # a TMA descriptor or another object made per call
            return None
    code = f"lambda s: ({''.join(p + ', ' for p in parts)})"
    key = (code, *(c.hex() for c in consts))
    fn = _BUILDERS.get(key)
    if fn is None:
        if len(_BUILDERS) >= 4096:
            _BUILDERS.clear()
        fn = _BUILDERS[key] = eval(compile(code, "<moekit._launch argument builder>", "eval"), {"c": tuple(consts)})
    return fn


_BUILDERS: dict = {}


def _bound_key(device: int, types: tuple, args: tuple, kwargs: dict) -> tuple:
    """(a launch's key among a Launcher's bindings, its arguments with tensors as addresses, the first tensor's
    device index or -1). The key: (device, types, _key_function's key (its first item the tensors' alignment flags),
    the keywords)."""
    key, addressed, on = _key_function(types)(args)
    return (device, types, key, kwargs if type(kwargs) is Constants else tuple(kwargs.items())), addressed, on


def _addresses_function(types: tuple, flags: int):
    """``(args, device) -> args with tensors as addresses``, or None where the tensors among ``args`` (of these types)
    lack the 16-byte alignment ``flags`` of :func:`_key_function` or are not on ``device`` (generated once per types
    and flags, like the key)."""
    fn = _ADDRESSES_FUNCTIONS.get((types, flags))
    if fn is None:
        if len(_ADDRESSES_FUNCTIONS) >= 4096:
            _ADDRESSES_FUNCTIONS.clear()
        fn = _ADDRESSES_FUNCTIONS[(types, flags)] = _make_addresses_function(types, flags)
    return fn


_ADDRESSES_FUNCTIONS: dict = {}


def _make_addresses_function(types: tuple, flags: int):
    ptrs = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
    lines = ["def addresses(args, device):"]
    if types:
        lines.append(f"    {''.join(f'a{i}, ' for i in range(len(types)))}= args")
    if ptrs:  # (the op's checks put every tensor of a call on one device; -1: not a CUDA tensor, as in CPU tests)
        lines += [f"    on = a{ptrs[0]}.get_device()", "    if on != device and on >= 0:", "        return None"]
    lines += [f"    p{j} = a{i}.data_ptr()" for j, i in enumerate(ptrs)]
    every = (1 << len(ptrs)) - 1
    if ptrs and flags == every:  # the common case: every address a multiple of 16
        lines.append(f"    if ({' | '.join(f'p{j}' for j in range(len(ptrs)))}) & 15:")
        lines.append("        return None")
    elif ptrs:
        lines.append(f"    if ({' | '.join(f'(p{j} & 15 == 0) << {j}' for j in range(len(ptrs)))}) != {flags}:")
        lines.append("        return None")
    lines.append(f"    return ({_addressed(types)})")
    scope: dict = {}
    exec(compile("\n".join(lines) + "\n", "<moekit._launch addresses>", "exec"), scope)
    return scope["addresses"]


def _hooks_set(runtime) -> bool:
    """Whether a launch hook (a profiler's) is set: Triton 3.6 keeps chains of hooks, empty unless one was added."""
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(enter.calls if type(enter) is _HookChain else enter) or bool(
        exit_.calls if type(exit_) is _HookChain else exit_)
