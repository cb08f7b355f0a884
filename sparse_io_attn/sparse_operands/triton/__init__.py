"""Backend ``"triton"`` of :func:`sparse_io_attn.sparse_operands.attention`: the ``@triton.jit`` kernels
(``kernels.py``), their named counter slots (``slots.py``), the host launchers (``launch.py``) and the
compile report (``report.py``). Imported on first use of the backend, never at package import."""
