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
