import os
import zlib

import pytest
import torch

# Without a GPU, Triton kernels run through its interpreter (must be set before kernels import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from moekit.tools import _interpreter

    _interpreter.speed_up()


def pytest_xdist_auto_num_workers(config):
    # `-n auto` (pyproject's addopts): one worker per core on CPU machines, at most 8 (each holds its own torch
    # and interpreter); none beside a GPU, where workers would share its memory (the GPU suite allocates
    # model-sized stacks; pass -n N --dist loadfile there by hand).
    if torch.cuda.is_available():
        return 0
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh random data per test, reproducible from run to run (crc32, unlike hash(), is not salted
    # per process): a failure seen once can be replayed.
    # MOEKIT_TEST_SEED=N draws other data everywhere (hunting rare failures; replay with the same N).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("MOEKIT_TEST_SEED", "0")))


@pytest.fixture(autouse=True)
def _fresh_call_decisions():
    # Decisions kept per call signature (moekit._calls) would outlive a test that changes what they read (a module
    # constant, a patched chooser): every test starts without them.
    from moekit._calls import CheckedCalls

    CheckedCalls.forget_all()


@pytest.fixture(autouse=True)
def _zeroed_arrival_counters():
    # The kernels zero their arrival counters as they finish (moekit._triton.counters); a test that raised inside an
    # interpreted kernel can leave them set, and the next test's waits on them (the in-GEMV1 LoRA shrink) would
    # never end: every test starts from zeroed CPU counters.
    from moekit import _triton

    for buf in _triton._COUNTERS.values():
        if buf.device.type == "cpu":
            buf.zero_()
