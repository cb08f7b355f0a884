"""The one Triton runtime layer every kernel family uses.

* :mod:`.runtime`: the interpreter switch (set before triton is imported), the device check and
  the one counted launch helper.
* :mod:`.jit`: ``@triton.jit`` helpers shared by the kernel families (dot with one precision flag,
  byte tallies, named counter slots, ``LOG2E``/``LN2``).
* :mod:`.aot`: ahead-of-time compilation for CUDA without a GPU (the compile report).
"""
