"""The dense form's Triton kernels (``fwd``, ``bwd_small_cache``, ``bwd_large_cache``, ``common``:
``@triton.jit`` only) and their launchers (``launch`` shared helpers, one ``launch_*`` module per
algorithm). Nothing is imported eagerly here."""
