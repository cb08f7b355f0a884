"""Named I/O counter slots of the shared kernels and tallies (``COUNT_IO``), built from the tensor
tuples of :mod:`sparse_io_attn._attention.traffic` (the launchers name the counters' tensors with the
same tuples; each op's tuples start with the ``*_BASE`` ones, so these slots are every op's)."""
from sparse_io_attn._attention.traffic import (DECODE_BASE, DECODE_MERGE_TENSORS, DKDV_BASE, DQ_BASE, FWD_BASE,
                                               PREPROCESS_TENSORS)
from sparse_io_attn._triton.jit import slot

PRE_O = slot(PREPROCESS_TENSORS, "o")
PRE_DO = slot(PREPROCESS_TENSORS, "do")
PRE_DELTA = slot(PREPROCESS_TENSORS, "delta")

MERGE_PARTIAL = slot(DECODE_MERGE_TENSORS, "partial")
MERGE_O = slot(DECODE_MERGE_TENSORS, "o")
MERGE_LSE = slot(DECODE_MERGE_TENSORS, "lse")
MERGE_STATS = slot(DECODE_MERGE_TENSORS, "stats")

# forward and decode: the same slots for q .. stats (DECODE_BASE extends FWD_BASE)
OUT_Q, OUT_K, OUT_V, OUT_O, OUT_LSE, OUT_STATS = (slot(FWD_BASE, n) for n in FWD_BASE)
OUT_PARTIAL = slot(DECODE_BASE, "partial")
DQ_Q, DQ_K, DQ_V, DQ_DO, DQ_STATS, DQ_DELTA, DQ_DQ = (slot(DQ_BASE, n) for n in DQ_BASE)
DKDV_Q, DKDV_K, DKDV_V, DKDV_DO, DKDV_STATS, DKDV_DELTA, DKDV_DK, DKDV_DV = (slot(DKDV_BASE, n) for n in DKDV_BASE)
