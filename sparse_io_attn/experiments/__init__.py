"""Paper reproductions and studies built on the library's ops and bounds (above the ops, below the CLI).

Import the submodules directly (nothing is imported eagerly here): :mod:`.pebble` (the exact
two-level-memory executor and the paper's Algorithms 1-9), :mod:`.figure1` (Figure 1 from the dense
kernels' traffic model and the executor's closed forms), :mod:`.slopes` (log-log slopes),
:mod:`.sparsity_stress` (Theorem 4.5 under sparse operands).
"""
