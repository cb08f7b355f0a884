"""Named I/O counter slots of the dense kernels (``COUNT_IO``).

The slot order is defined once, by the tensor tuples of :mod:`sparse_io_attn.dense.traffic` (the
launchers name the counter's tensors with the same tuples); each constant is the index of its tensor
in that tuple, as a ``tl.constexpr`` the kernels pass to :func:`~sparse_io_attn._triton.jit.io_add`.
"""
from sparse_io_attn._triton.jit import slot
from sparse_io_attn.dense.traffic import (COL_TENSORS, DELTA_TENSORS, FWD_TENSORS, PHASE3_TENSORS, PRODUCT_TENSORS,
                                          ROW_TENSORS, SOFTMAX_TENSORS)

MATMUL_A = slot(PRODUCT_TENSORS, "a")
MATMUL_B = slot(PRODUCT_TENSORS, "b")
MATMUL_C = slot(PRODUCT_TENSORS, "c")

DELTA_O = slot(DELTA_TENSORS, "O")
DELTA_DO = slot(DELTA_TENSORS, "dO")
DELTA_V = slot(DELTA_TENSORS, "v")

FWD_S = slot(FWD_TENSORS, "S")
FWD_A2 = slot(FWD_TENSORS, "A2")
FWD_H = slot(FWD_TENSORS, "h")
FWD_O = slot(FWD_TENSORS, "O")
FWD_LSE = slot(FWD_TENSORS, "lse")

SOFTMAX_S = slot(SOFTMAX_TENSORS, "S")
SOFTMAX_A2 = slot(SOFTMAX_TENSORS, "A2")
SOFTMAX_F = slot(SOFTMAX_TENSORS, "f")
SOFTMAX_LSE = slot(SOFTMAX_TENSORS, "lse")

PHASE3_F = slot(PHASE3_TENSORS, "f")
PHASE3_Q = slot(PHASE3_TENSORS, "q")
PHASE3_P = slot(PHASE3_TENSORS, "p")

ROW_S = slot(ROW_TENSORS, "S")
ROW_A2 = slot(ROW_TENSORS, "A2")
ROW_H = slot(ROW_TENSORS, "h")
ROW_DO = slot(ROW_TENSORS, "dO")
ROW_LSE = slot(ROW_TENSORS, "lse")
ROW_OV = slot(ROW_TENSORS, "O")  # DQ_TENSORS names v at this index
ROW_DS = slot(ROW_TENSORS, "dS")
ROW_A1 = slot(ROW_TENSORS, "A1")
ROW_G = slot(ROW_TENSORS, "dX")

COL_S = slot(COL_TENSORS, "S")
COL_A2 = slot(COL_TENSORS, "A2")
COL_H = slot(COL_TENSORS, "h")
COL_DO = slot(COL_TENSORS, "dO")
COL_LSE = slot(COL_TENSORS, "lse")
COL_V = slot(COL_TENSORS, "v")
COL_DA2 = slot(COL_TENSORS, "dA2")
COL_DH = slot(COL_TENSORS, "dh")
