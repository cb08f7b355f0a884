"""Named I/O counter slots of the sparse-operand kernels (``COUNT_IO``).

The slot order is defined once, by the tensor tuples of :mod:`sparse_io_attn.sparse_operands.traffic`
(the launcher names the counter's tensors with the same tuples); each constant is the index of its
tensor in that tuple, as a ``tl.constexpr`` the kernels pass to :func:`~sparse_io_attn._triton.jit.io_add`.
"""
from sparse_io_attn._triton.jit import slot
from sparse_io_attn.sparse_operands.traffic import (DKV_TENSORS, DQ_TENSORS, FWD_TENSORS, MATMUL_TENSORS,
                                                    PREPROCESS_TENSORS)

MATMUL_A = slot(MATMUL_TENSORS, "a")
MATMUL_B = slot(MATMUL_TENSORS, "b")
MATMUL_C = slot(MATMUL_TENSORS, "c")
MATMUL_COLSUM = slot(MATMUL_TENSORS, "colsum")
MATMUL_PLAN = slot(MATMUL_TENSORS, "plan")

FWD_Q = slot(FWD_TENSORS, "q")
FWD_A2 = slot(FWD_TENSORS, "a2")
FWD_H = slot(FWD_TENSORS, "h")
FWD_HSUM = slot(FWD_TENSORS, "hsum")
FWD_O = slot(FWD_TENSORS, "o")
FWD_LSE = slot(FWD_TENSORS, "lse")
FWD_Q_MAP = slot(FWD_TENSORS, "q_map")
FWD_A2_MAP = slot(FWD_TENSORS, "a2_map")
FWD_LAYOUT = slot(FWD_TENSORS, "layout")

PRE_O = slot(PREPROCESS_TENSORS, "o")
PRE_DO = slot(PREPROCESS_TENSORS, "do")
PRE_LSE = slot(PREPROCESS_TENSORS, "lse")
PRE_DELTA = slot(PREPROCESS_TENSORS, "delta")
PRE_W = slot(PREPROCESS_TENSORS, "w")

DKV_Q = slot(DKV_TENSORS, "q")
DKV_A2 = slot(DKV_TENSORS, "a2")
DKV_H = slot(DKV_TENSORS, "h")
DKV_DO = slot(DKV_TENSORS, "do")
DKV_LSE = slot(DKV_TENSORS, "lse")
DKV_DELTA = slot(DKV_TENSORS, "delta")
DKV_W = slot(DKV_TENSORS, "w")
DKV_DA2 = slot(DKV_TENSORS, "da2")
DKV_DH = slot(DKV_TENSORS, "dh")
DKV_Q_MAP = slot(DKV_TENSORS, "q_map")
DKV_A2_MAP = slot(DKV_TENSORS, "a2_map")
DKV_LAYOUT = slot(DKV_TENSORS, "layout")

DQ_Q = slot(DQ_TENSORS, "q")
DQ_A2 = slot(DQ_TENSORS, "a2")
DQ_H = slot(DQ_TENSORS, "h")
DQ_DO = slot(DQ_TENSORS, "do")
DQ_LSE = slot(DQ_TENSORS, "lse")
DQ_DELTA = slot(DQ_TENSORS, "delta")
DQ_DQ = slot(DQ_TENSORS, "dq")
DQ_Q_MAP = slot(DQ_TENSORS, "q_map")
DQ_A2_MAP = slot(DQ_TENSORS, "a2_map")
DQ_LAYOUT = slot(DQ_TENSORS, "layout")
