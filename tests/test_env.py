"""The environment switches: read at call time, as their readers read them, whatever os.environ is."""

from unittest import mock

import pytest

from moekit import _env


@pytest.mark.parametrize("value, on", [
    ("1", True), ("true", True), ("TRUE", True), ("on", True), ("yes", True), ("Y", True),
    ("0", False), ("", False), ("false", False), ("off", False),
    ("2", False), (" 1", False), ("enabled", False),  # Triton builds compiled kernels for these: so must moekit think
])
def test_triton_switches_read_as_triton_reads_them(monkeypatch, value, on):
    from triton._C.libtriton import getenv_bool

    monkeypatch.setenv("TRITON_INTERPRET_PROBE", value)
    assert _env.triton_flag("TRITON_INTERPRET_PROBE")() is on
    assert getenv_bool("TRITON_INTERPRET_PROBE", False) is on  # the rule is Triton's own


def test_switches_follow_the_environment_at_call_time_even_a_replaced_one(monkeypatch):
    monkeypatch.delenv("MOEKIT_PROBE", raising=False)
    flag, triton_flag = _env.flag("MOEKIT_PROBE"), _env.triton_flag("MOEKIT_PROBE")
    assert not flag() and not triton_flag()
    monkeypatch.setenv("MOEKIT_PROBE", "1")
    assert flag() and triton_flag()
    with mock.patch("os.environ", {"MOEKIT_PROBE": "1"}):  # a plain dict: it crashed every op
        assert flag() and triton_flag()
    with mock.patch("os.environ", {}):
        assert not flag() and not triton_flag()


@pytest.mark.parametrize("value, on", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True),
    ("0", False), ("", False), ("false", False), ("No", False), ("OFF", False),
])
def test_moekit_switches_read_the_usual_words(monkeypatch, value, on):
    monkeypatch.setenv("MOEKIT_PROBE", value)
    assert _env.flag("MOEKIT_PROBE")() is on


@pytest.mark.parametrize("value", ["2", "ture", "o", " 1", "enabled", "y"])
def test_a_moekit_switch_with_another_value_is_an_error_naming_it(monkeypatch, value):
    # "ture" once meant on and "o" too: a typo picked the batch-invariant mode or the verification gate silently
    monkeypatch.setenv("MOEKIT_PROBE", value)
    with pytest.raises(ValueError, match=f"MOEKIT_PROBE={value!r}: expected 1, true"):
        _env.flag("MOEKIT_PROBE")()


def test_a_bad_batch_invariant_switch_fails_the_call_before_any_kernel(monkeypatch):
    import torch

    from moekit import router_gemm

    monkeypatch.setenv("MOEKIT_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="MOEKIT_BATCH_INVARIANT='maybe'"):
        router_gemm(torch.randn(3, 16), torch.randn(4, 16))
