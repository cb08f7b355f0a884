"""The Triton pieces both attention ops share: ``@triton.jit`` helpers (:mod:`.softmax`: the score
tile, the row statistics, the row stores; :mod:`.tile_io`: the paired tile loads, the dK/dV store), the
shared kernels (:mod:`.kernels`: the backward preprocess, the decode merge) and their counter slots
(:mod:`.slots`), and the launch description (:mod:`.launch`: :class:`~.launch.Call`,
:func:`~.launch.run`). Importing any of them imports Triton."""
