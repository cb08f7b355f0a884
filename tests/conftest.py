import os
import tempfile
import zlib

# torch.compile's on-disk caches (Inductor, AOTAutograd) outlive the process: a fresh directory per
# test session keeps a test from reusing artifacts compiled by an earlier run or another checkout.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="sparse-io-attn-inductor-"))

import torch  # noqa: E402

# Without CUDA, Triton kernels run on the CPU through the interpreter; the variable must be set
# before anything imports triton. On a CUDA machine the kernels compile normally.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run (no example database, no random seed): a
# property test cannot pass on one run and fail on the next.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.load_profile("repeatable")

# `make test` runs two xdist workers on a 2-core machine: one intra-op thread each avoids
# oversubscription (tests that need several threads set them explicitly).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different, reproducible seed per test (fresh random inputs, never zeros)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield
