"""Backend ``"triton"``: the block-sparse kernels (``fwd.py``, ``bwd.py``; ``@triton.jit`` only) and
their host launcher (``launch.py``). Imported on first use of the backend, never at package import."""
