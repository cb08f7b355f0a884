"""The network traffic model of context parallelism, beside the code it predicts: the model itself
lives in :mod:`sparse_io_attn.accounting.network` (floor 3, so ``accounting.traffic`` offers it too)
and reads the plan through its public methods."""
from sparse_io_attn.accounting.network import (BACKWARD, BACKWARD_INPUTS, FORWARD, PARTIALS, ContextParallelTraffic,
                                               context_parallel)

__all__ = ["BACKWARD", "BACKWARD_INPUTS", "FORWARD", "PARTIALS", "ContextParallelTraffic", "context_parallel"]
