"""Named I/O counter slots of the shared kernels and tallies (``COUNT_IO``), built from the tensor
tuples of :mod:`sparse_io_attn._attention.traffic` (the launchers name the counters' tensors with the
same tuples; each op's tuples start with the ``*_BASE`` ones, so these slots are every op's)."""
from sparse_io_attn._attention.traffic import (DECODE_BASE, DECODE_MERGE_TENSORS, DKDV_BASE, DQ_BASE, FWD_BASE,
                                               PREPROCESS_TENSORS)
from sparse_io_attn._triton.jit import slot

PRE_O, PRE_DO, PRE_DELTA, PRE_RESIDUAL = (slot(PREPROCESS_TENSORS, n) for n in PREPROCESS_TENSORS)
MERGE_PARTIAL, MERGE_O, MERGE_LSE, MERGE_STATS, MERGE_RESIDUAL = (slot(DECODE_MERGE_TENSORS, n)
                                                                  for n in DECODE_MERGE_TENSORS)
# forward and decode: the same slots for q .. stats (DECODE_BASE extends FWD_BASE)
OUT_Q, OUT_K, OUT_V, OUT_O, OUT_LSE, OUT_STATS, OUT_RESIDUAL, OUT_PARTIAL = (slot(DECODE_BASE, n) for n in DECODE_BASE)
# dQ and dK/dV: the same slots for q .. delta (both tuples start q, k, v, do, stats, delta)
BWD_Q, BWD_K, BWD_V, BWD_DO, BWD_STATS, BWD_DELTA = (slot(DQ_BASE, n) for n in DQ_BASE[:6])
DQ_DQ = slot(DQ_BASE, "dq")
DKDV_DK, DKDV_DV = slot(DKDV_BASE, "dk"), slot(DKDV_BASE, "dv")
assert DQ_BASE[:6] == DKDV_BASE[:6] and DECODE_BASE[:len(FWD_BASE)] == FWD_BASE
