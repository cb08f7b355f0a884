"""Named I/O counter slots of the shared kernels (``COUNT_IO``), built from the tensor tuples of
:mod:`sparse_io_attn._attention.traffic` (the launchers name the counters' tensors with the same tuples)."""
from sparse_io_attn._attention.traffic import DECODE_MERGE_TENSORS, PREPROCESS_TENSORS
from sparse_io_attn._triton.jit import slot

PRE_O = slot(PREPROCESS_TENSORS, "o")
PRE_DO = slot(PREPROCESS_TENSORS, "do")
PRE_DELTA = slot(PREPROCESS_TENSORS, "delta")

MERGE_PARTIAL = slot(DECODE_MERGE_TENSORS, "partial")
MERGE_O = slot(DECODE_MERGE_TENSORS, "o")
MERGE_LSE = slot(DECODE_MERGE_TENSORS, "lse")
MERGE_STATS = slot(DECODE_MERGE_TENSORS, "stats")
