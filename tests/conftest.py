import os

# Triton kernels run on the CPU through the interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different, reproducible seed per test (fresh random inputs, never zeros)."""
    seed = abs(hash(request.node.nodeid)) % (2**31)
    torch.manual_seed(seed)
    yield
