"""Named I/O counter slots of the block-sparse kernels (``COUNT_IO``).

The slot order is defined once, by the tensor tuples of :mod:`sparse_io_attn.block_sparse.traffic`
(the launcher names the counter's tensors with the same tuples); each constant is the index of its
tensor in that tuple, as a ``tl.constexpr`` the kernels pass to :func:`~sparse_io_attn._triton.jit.io_add`.
The preprocess and decode-merge kernels are the attention kit's (:mod:`sparse_io_attn._attention.triton.slots`).
"""
from sparse_io_attn._triton.jit import slot
from sparse_io_attn.block_sparse.traffic import DECODE_TENSORS, DKDV_TENSORS, DQ_TENSORS, FWD_TENSORS

FWD_Q = slot(FWD_TENSORS, "q")
FWD_K = slot(FWD_TENSORS, "k")
FWD_V = slot(FWD_TENSORS, "v")
FWD_O = slot(FWD_TENSORS, "o")
FWD_LSE = slot(FWD_TENSORS, "lse")
FWD_STATS = slot(FWD_TENSORS, "stats")
FWD_LAYOUT = slot(FWD_TENSORS, "layout")
FWD_MASK = slot(FWD_TENSORS, "mask")

DKDV_Q = slot(DKDV_TENSORS, "q")
DKDV_K = slot(DKDV_TENSORS, "k")
DKDV_V = slot(DKDV_TENSORS, "v")
DKDV_DO = slot(DKDV_TENSORS, "do")
DKDV_STATS = slot(DKDV_TENSORS, "stats")
DKDV_DELTA = slot(DKDV_TENSORS, "delta")
DKDV_DK = slot(DKDV_TENSORS, "dk")
DKDV_DV = slot(DKDV_TENSORS, "dv")
DKDV_LAYOUT = slot(DKDV_TENSORS, "layout")
DKDV_MASK = slot(DKDV_TENSORS, "mask")

DQ_Q = slot(DQ_TENSORS, "q")
DQ_K = slot(DQ_TENSORS, "k")
DQ_V = slot(DQ_TENSORS, "v")
DQ_DO = slot(DQ_TENSORS, "do")
DQ_STATS = slot(DQ_TENSORS, "stats")
DQ_DELTA = slot(DQ_TENSORS, "delta")
DQ_DQ = slot(DQ_TENSORS, "dq")
DQ_LAYOUT = slot(DQ_TENSORS, "layout")
DQ_MASK = slot(DQ_TENSORS, "mask")

DEC_Q = slot(DECODE_TENSORS, "q")
DEC_K = slot(DECODE_TENSORS, "k")
DEC_V = slot(DECODE_TENSORS, "v")
DEC_O = slot(DECODE_TENSORS, "o")
DEC_LSE = slot(DECODE_TENSORS, "lse")
DEC_STATS = slot(DECODE_TENSORS, "stats")
DEC_PARTIAL = slot(DECODE_TENSORS, "partial")
DEC_LAYOUT = slot(DECODE_TENSORS, "layout")
DEC_MASK = slot(DECODE_TENSORS, "mask")
