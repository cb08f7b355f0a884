"""Backend ``"triton"`` of :func:`~sparse_io_attn.selection.api.selection_attention`: the kernels
(``fwd.py``, ``bwd.py``; ``@triton.jit`` only), their host launcher (``launch.py``), the counter slots
(``slots.py``) and the sm_90 compile report (``report.py``). Imported on first use of the backend,
never at package import."""
