import os

import pytest
import torch

# Without a GPU, Triton kernels run through its interpreter (must be set before kernels import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh but reproducible random data per test: seeded from the test's own id.
    torch.manual_seed(hash(request.node.nodeid) % (2**31))
