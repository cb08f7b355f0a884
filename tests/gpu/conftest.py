"""CUDA-only tests: compile the kernels (no interpreter) with one fixed config.

Run them in their own process (``make test-gpu`` / ``pytest tests/gpu``): the root conftest turns on
Triton's interpreter for the CPU suite, and Triton reads that switch once, when it is imported.
"""
import os

import torch

if torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("SPARSE_IO_ATTN_NO_AUTOTUNE", "1")
