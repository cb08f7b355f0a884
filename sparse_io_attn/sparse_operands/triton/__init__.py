"""Backend ``"triton"`` of :func:`sparse_io_attn.sparse_operands.attention`: the ``@triton.jit`` kernels
by family (``product.py``: the row-panel products; ``fwd.py``: the attention forward; ``bwd.py``: the
attention backward; ``common.py``: the helpers they share), their named counter slots (``slots.py``),
the host launchers (``launch.py``) and the compile report (``report.py``). Imported on first use of the
backend, never at package import."""
