"""moekit._launch: a bound launch must never reuse a kernel where Triton would have specialized another."""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from moekit import _launch  # noqa: E402

try:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
except ImportError:  # another Triton: the signature's own rules are still checked below
    native_specialize_impl = None


def _args():
    base = torch.empty(64, dtype=torch.float32)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -(2**31), -(2**31) - 1]
    tensors = [base, base[1:], base[4:], base[2:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
               base.to(torch.int32), torch.nn.Parameter(base.clone())]
    from triton.tools.tensor_descriptor import TensorDescriptor

    stack = torch.empty(8, 64, 128, dtype=torch.bfloat16)
    descriptors = [TensorDescriptor.from_tensor(stack, [1, 32, 64]), TensorDescriptor.from_tensor(stack[1:], [1, 32, 64]),
                   TensorDescriptor.from_tensor(stack, [1, 16, 64]), TensorDescriptor.from_tensor(stack.half(), [1, 32, 64])]
    return ints + tensors + descriptors + [None, True, False, 0.5, 1.0]


@pytest.mark.skipif(native_specialize_impl is None, reason="this Triton has no native_specialize_impl")
@pytest.mark.parametrize("specialize,align", [(True, True), (False, True), (True, False)])
def test_equal_signatures_mean_equal_triton_specializations(specialize, align):
    # the signature may split finer than Triton (a wasted bind), never coarser (a wrong kernel)
    args = _args()
    for a, b in itertools.product(args, args):
        if _launch.signature((a,), {}) == _launch.signature((b,), {}):
            spec_a = native_specialize_impl(BaseBackend, a, False, specialize, align)
            spec_b = native_specialize_impl(BaseBackend, b, False, specialize, align)
            assert spec_a == spec_b, (a, b)


def test_keywords_are_keyed_by_value_and_other_types_go_to_triton():
    assert _launch.signature((), {"BLOCK": 16}) != _launch.signature((), {"BLOCK": 32})
    assert _launch.signature((), {"FLAG": True}) != _launch.signature((), {"FLAG": 1.5})
    with pytest.raises(_launch._Unkeyed):
        _launch.signature((object(),), {})
    with pytest.raises(_launch._Unkeyed):
        _launch.signature((), {"X": torch.empty(1)})  # a runtime tensor by keyword: not a constexpr


class _FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, *args):
        self.log.append(("bound", args))


class _Param:
    def __init__(self, name, default=None, has_default=False):
        self.name, self.default, self.has_default = name, default, has_default


class _FakeJit:
    """A stand-in for a JITFunction(x_ptr, n, BLOCK: constexpr, EXTRA: constexpr = 7)."""

    params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK"), _Param("EXTRA", 7, True)]
    device_caches = {}

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", args, kwargs))
            return _FakeCompiled(self.log)
        return run


@pytest.fixture
def fake_launcher(monkeypatch):
    """A Launcher over _FakeJit on a pretend CUDA device 0, stream 1234."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    fn = _FakeJit()
    return fn, _launch.Launcher(fn)


def test_a_signature_binds_once_then_launches_through_the_compiled_kernel(fake_launcher):
    fn, launcher = fake_launcher
    x = torch.empty(64)
    launcher[(3,)](x, 9, BLOCK=16)
    launcher[(4, 2)](x, 9, BLOCK=16)             # the same key: the compiled kernel, the keyword tail in order
    launcher[(4,)](x[1:], 9, BLOCK=16)           # unaligned: Triton's path (another specialization)
    launcher[(4,)](x, 16, BLOCK=16)              # a multiple of 16: Triton's path
    launcher[(4,)](x, 9, BLOCK=32)               # another constexpr: Triton's path
    launcher[(4,)](x, 25, BLOCK=16)              # ints are keyed by value: bound once more, then reused
    launcher[(4,)](x, 25, BLOCK=16)
    launcher[(4,)](x[4:], 9, BLOCK=16)           # another aligned tensor: the first binding
    kinds = [entry[0] for entry in fn.log]
    assert kinds == ["triton", "bound", "triton", "triton", "triton", "triton", "bound", "bound"]
    # the tensor as its address: Triton's launcher takes an int as it is (no data_ptr() call, no driver query)
    assert fn.log[1][1] == (4, 2, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), 9, 16, 7)
    assert fn.log[-1][1][9] == x[4:].data_ptr()


def test_constants_made_once_key_like_keywords(fake_launcher):
    fn, launcher = fake_launcher
    x = torch.empty(64)
    c16, c32 = _launch.Constants(BLOCK=16), _launch.Constants(BLOCK=32)
    assert c16 == {"BLOCK": 16} and hash(c16) == hash(_launch.Constants(BLOCK=16))
    launcher.launch((1,), (x, 9), c16)
    launcher.launch((1,), (x, 9), _launch.Constants(BLOCK=16))   # equal constants: the binding
    launcher.launch((1,), (x, 9), c32)                           # other values: Triton's path
    assert [entry[0] for entry in fn.log] == ["triton", "bound", "triton"]
    assert fn.log[1][1][-2:] == (16, 7)                           # the keyword tail, defaults filled


def test_a_prepared_launch_repeats_the_binding_and_refuses_what_it_does_not_hold(fake_launcher, monkeypatch):
    fn, launcher = fake_launcher
    base = torch.empty(64)
    x, c = base[4:], _launch.Constants(BLOCK=16)
    assert launcher.prepare((x, 9), c) is None                 # not launched yet: nothing bound to repeat
    launcher.launch((1,), (x, 9), c)
    prepared = launcher.prepare((x, 9), c)
    assert prepared((5, 2), (base, 9))                         # another address, the same alignment: the kernel
    assert fn.log[-1] == ("bound", (5, 2, 1, 1234, "fn", "meta", None, None, None, base.data_ptr(), 9, 16, 7))
    assert not prepared((5,), (base[1:], 9))                   # unaligned: refused, the caller goes to launch()
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    assert not prepared((5,), (base, 9))                       # another current device: refused
    assert [entry[0] for entry in fn.log] == ["triton", "bound"]
    # a binding of unaligned tensors holds for unaligned tensors only
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    launcher.launch((1,), (base[1:], 9), c)
    odd = launcher.prepare((base[1:], 9), c)
    assert odd((1,), (base[2:], 9)) and not odd((1,), (base, 9))


class _OnGpu1(torch.Tensor):
    """A CPU tensor that reports CUDA device 1 (what the launcher's device check reads)."""

    def get_device(self):
        return 1


def test_tensors_of_another_gpu_than_the_current_launch_on_theirs(fake_launcher, monkeypatch):
    # the op's checks put a call's tensors on one GPU, not on the current one: a bound launch must not run them on
    # the current GPU (their addresses are another device's), so the launcher switches to theirs, as torch does
    fn, launcher = fake_launcher
    current = [0]
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)

    class Switch:  # torch.cuda.device without a GPU
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.before

    monkeypatch.setattr(torch.cuda, "device", Switch)
    seen, real = [], _launch.Launcher.launch
    monkeypatch.setattr(_launch.Launcher, "launch",
                        lambda self, grid, args, kwargs: seen.append(current[0]) or real(self, grid, args, kwargs))
    c = _launch.Constants(BLOCK=16)
    launcher.launch((1,), (torch.empty(64), 9), c)
    launcher.launch((1,), (torch.empty(64), 9), c)                  # bound on device 0
    launcher.launch((1,), (torch.empty(64).as_subclass(_OnGpu1), 9), c)
    assert seen == [0, 0, 0, 1] and current[0] == 0                   # launched again under device 1, then back
    assert [entry[0] for entry in fn.log] == ["triton", "bound", "triton"]  # device 1's own binding, by Triton


def test_a_prepared_launch_refuses_tensors_of_another_gpu(fake_launcher):
    fn, launcher = fake_launcher
    x, c = torch.empty(64), _launch.Constants(BLOCK=16)
    launcher.launch((1,), (x, 9), c)
    prepared = launcher.prepare((x, 9), c)
    assert prepared((1,), (x, 9))
    assert not prepared((1,), (torch.empty(64).as_subclass(_OnGpu1), 9))  # the caller then goes to launch()


def test_an_argument_builder_puts_another_calls_tensors_where_the_sources_were():
    a, b, c = torch.zeros(2), torch.ones(3), torch.full((4,), 2.0)
    build = _launch.arg_builder((a, 3, None, 0.5, b, True, a), (b, None, a))
    new_b, new_a = torch.zeros(5), torch.zeros(6)
    got = build((new_b, None, new_a))
    assert got[0] is new_a and got[4] is new_b and got[6] is new_a and got[1:4] + got[5:6] == (3, None, 0.5, True)
    assert _launch.arg_builder((a, b), (a, b)) is _launch.arg_builder((b, a), (b, a))  # one function per layout
    assert _launch.arg_builder((c,), (a, b)) is None      # a tensor made by the call itself: not rebuilt
    assert _launch.arg_builder((a,), (a, None, a)) is None  # two sources as one tensor: which one is a guess
    assert _launch.arg_builder((a, object()), (a,)) is None  # an object made per call (a TMA descriptor)
    assert _launch.arg_builder((1.5,), ())(()) == (1.5,) and _launch.arg_builder((-0.0,), ())(())[0].hex() == "-0x0.0p+0"


def test_a_key_tells_each_tensors_alignment_apart():
    base = torch.empty(64)
    a, b = base[4:], base[1:]  # 16-byte aligned, then not
    key = lambda args: _launch._key_function((torch.Tensor, torch.Tensor, int))(args)[0]  # noqa: E731
    assert key((a, a, 3)) == key((base, base, 3))
    assert len({key((a, b, 3)), key((b, a, 3)), key((b, b, 3)), key((a, a, 3))}) == 4
    assert key((a, a, 3)) != key((a, a.double()[:8], 3))  # dtypes
    assert key((a, a, 3)) != key((a, a, 4))
    # beside the key, the launch's arguments: each tensor as its address, the rest as given
    assert _launch._key_function((torch.Tensor, int, torch.Tensor))((a, 3, b))[1] == (a.data_ptr(), 3, b.data_ptr())


def test_under_the_interpreter_every_launch_is_tritons(monkeypatch):
    class Interpreted:  # InterpretedFunction has no device caches
        def __init__(self):
            self.calls = 0

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                self.calls += 1
            return run

    fn = Interpreted()
    launcher = _launch.Launcher(fn)
    for _ in range(3):
        launcher[(1,)](torch.empty(4), 3, BLOCK=4)
    assert fn.calls == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_repeated_calls_launch_without_jitfunction_run_and_give_the_same_bits(monkeypatch):
    # after the first call of a signature no launch goes through JITFunction.run, and the bound launches give
    # Triton's bits: decode (gemv), small and aligned batches, an unaligned view (its own signature), the router
    from triton.runtime.jit import JITFunction

    from moekit import batched_experts, fused_experts, fused_router

    torch.manual_seed(0)
    E, H, I, k = 8, 264, 136, 2
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    gate = torch.randn(E, H, device="cuda", dtype=torch.bfloat16)
    calls = []
    original = JITFunction.run

    def counted(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    for T in (1, 16, 300):
        base = torch.randn(T * H + 1, device="cuda", dtype=torch.bfloat16)
        for x in (base[:T * H].view(T, H), base[1:].view(T, H)):  # 16-byte aligned, then not
            ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32)
            tw = torch.rand(T, k, device="cuda")
            xb = torch.randn(E, -(-T // E), H, device="cuda", dtype=torch.bfloat16)  # the batched format
            counts = torch.randint(0, xb.shape[1] + 1, (E,), device="cuda", dtype=torch.int32)

            def calls_of():
                out = batched_experts(xb, counts, w13, w2)
                valid = torch.arange(xb.shape[1], device="cuda")[None, :] < counts[:, None]
                return (fused_experts(x, w13, w2, tw, ids), *fused_router(x, gate, top_k=k, method="softmax_topk"),
                        torch.where(valid[..., None], out, 0))
            first = calls_of()
            monkeypatch.setattr(JITFunction, "run", counted)
            again = calls_of()
            torch.cuda.synchronize()
            monkeypatch.setattr(JITFunction, "run", original)
            assert calls == [], f"T={T}: {[c.__name__ for c in calls]}"
            for a, b in zip(first, again):
                assert torch.equal(a, b)
