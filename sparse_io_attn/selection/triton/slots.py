"""Named I/O counter slots of the selection kernels (``COUNT_IO``).

The slot order is defined once, by the tensor tuples of :mod:`sparse_io_attn.selection.traffic_terms`
(the launcher names the counter's tensors with the same tuples); each constant is the index of its
tensor in that tuple, as a ``tl.constexpr`` the kernels pass to :func:`~sparse_io_attn._triton.jit.io_add`.
The tuples start with the attention kit's tensors of each kind, whose slots (and tallies) are the
kit's (:mod:`sparse_io_attn._attention.triton.slots`, :mod:`~sparse_io_attn._attention.triton.tally`);
these are the op's own: its index tensors.
"""
from sparse_io_attn._triton.jit import slot
from sparse_io_attn.selection.traffic_terms import (DECODE_TENSORS, DKDV_TENSORS, DQ_MERGE_TENSORS, DQ_TENSORS,
                                                    FWD_TENSORS, MERGE_TENSORS)

FWD_PLAN = slot(FWD_TENSORS, "plan")
DKDV_PLAN = slot(DKDV_TENSORS, "plan")
DQ_PLAN = slot(DQ_TENSORS, "plan")
DEC_PLAN = slot(DECODE_TENSORS, "plan")      # (and the key-major forward's)
DKDV_PARTIAL = slot(DKDV_TENSORS, "partial")  # the key-major backward's dQ partials
MERGE_PLAN = slot(MERGE_TENSORS, "plan")
DQM_PARTIAL = slot(DQ_MERGE_TENSORS, "partial")
DQM_DQ = slot(DQ_MERGE_TENSORS, "dq")
DQM_PLAN = slot(DQ_MERGE_TENSORS, "plan")
