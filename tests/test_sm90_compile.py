"""Every kernel variant the host code picks compiles for the H200 (sm_90) without spills.

Runs tests/sm90_compile.py in a child process (it needs real JIT functions, while this test
session runs kernels through the interpreter). Catches GPU-only compile errors on CPU-only CI.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HAS_NVIDIA_BACKEND = importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="triton without its NVIDIA backend")
def test_kernels_compile_for_sm90_without_spills():
    script = Path(__file__).with_name("sm90_compile.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 failed" in proc.stdout
