"""Counter slots (``COUNT_IO``) of the selection kernels' own tensors, the plan's rows: indices in the
tensor tuples of :mod:`sparse_io_attn.selection.traffic`, which start with the attention kit's ``*_BASE`` tuples
(their slots and tallies: :mod:`sparse_io_attn._attention.triton.slots`, ``.tally``)."""
from sparse_io_attn._triton.jit import slot
from sparse_io_attn.selection.traffic import DECODE_TENSORS, DKDV_TENSORS, DQ_TENSORS, FWD_TENSORS

FWD_PLAN = slot(FWD_TENSORS, "plan")
DKDV_PLAN = slot(DKDV_TENSORS, "plan")
DQ_PLAN = slot(DQ_TENSORS, "plan")
DEC_PLAN = slot(DECODE_TENSORS, "plan")
