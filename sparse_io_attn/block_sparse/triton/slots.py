"""Named I/O counter slots of the block-sparse kernels (``COUNT_IO``).

The slot order is defined once, by the tensor tuples of :mod:`sparse_io_attn.block_sparse.traffic`
(the launcher names the counter's tensors with the same tuples); each constant is the index of its
tensor in that tuple, as a ``tl.constexpr`` the kernels pass to :func:`~sparse_io_attn._triton.jit.io_add`.
The tuples start with the attention kit's tensors of each kind, whose slots (and tallies) are the
kit's (:mod:`sparse_io_attn._attention.triton.slots`, :mod:`~sparse_io_attn._attention.triton.tally`);
these are the op's own: its index tensors.
"""
from sparse_io_attn._triton.jit import slot
from sparse_io_attn.block_sparse.traffic import DECODE_TENSORS, DKDV_TENSORS, DQ_TENSORS, FWD_TENSORS

FWD_LAYOUT = slot(FWD_TENSORS, "layout")
FWD_MASK = slot(FWD_TENSORS, "mask")
DKDV_LAYOUT = slot(DKDV_TENSORS, "layout")
DKDV_MASK = slot(DKDV_TENSORS, "mask")
DQ_LAYOUT = slot(DQ_TENSORS, "layout")
DQ_MASK = slot(DQ_TENSORS, "mask")
DEC_LAYOUT = slot(DECODE_TENSORS, "layout")
DEC_MASK = slot(DECODE_TENSORS, "mask")
