"""The attention kit: what the attention ops (:mod:`sparse_io_attn.block_sparse`,
:mod:`sparse_io_attn.selection`, and :mod:`sparse_io_attn.sparse_operands` for its checks) share,
one floor below them. It is the Python/Triton counterpart of :mod:`sparse_io_attn._cpu` (the one
C++ build layer); the ops import it and never each other's private names.

* :mod:`.checks`: the call's checks and choices, once: :func:`~.checks.check_tensors`,
  :data:`~.checks.SUPPORTED_DTYPES`, :func:`~.checks.resolve_sm_scale`, and
  :func:`~.checks.resolve_backend`, the one place ``"auto"`` is decided.
* :mod:`.op`: the op wiring, :class:`~.op.AttentionOp` (a ``torch.library`` forward op whose
  ``Autograd`` kernel is one ``autograd.Function``, the backward op, fake kernels, the backends as
  plain functions of ``(q, k, v, plan, sm_scale)``).
* :mod:`.tiles`: head-dim padding, element sizes, the decode thresholds every backend uses.
* :mod:`.traffic`: byte constants and the traffic terms of the shared kernels (preprocess, decode merge).
* :mod:`.reference`: the float64 masked-softmax reference both ops' references build on (sinks included).
* :mod:`.sinks`: per-head attention sinks (the torch paths' fold, the sink's gradient).
* :mod:`.delta`: the backward's row deltas from the forward's fp32 output (the rounding residual).
* :mod:`.triton`: the shared ``@triton.jit`` helpers (score tile, row statistics, row stores), the
  shared kernels (backward preprocess, decode merge), their counter slots, and the launch
  description (:class:`~.triton.launch.Call`, :func:`~.triton.launch.run`).
* :mod:`.cpu`: the host side both ops' C++ kernels share (the decode work-buffer probe).

Modules here load Triton or the C++ build only where their names say so (:mod:`.triton`, :mod:`.cpu`);
the rest is plain torch.
"""
