"""Counter slots (``COUNT_IO``) of the block-sparse kernels' own tensors, the layout's lists and masks: indices in the
tensor tuples of :mod:`sparse_io_attn.block_sparse.traffic`, which start with the attention kit's ``*_BASE`` tuples
(their slots and tallies: :mod:`sparse_io_attn._attention.triton.slots`, ``.tally``)."""
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
