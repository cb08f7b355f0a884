"""Integrations with other libraries, each an optional extra imported only on request.

* :mod:`sparse_io_attn.integrations.transformers`: block-sparse attention as a Hugging Face
  Transformers ``attn_implementation`` (extra ``hf``: ``pip install "sparse-io-attn[hf]"``).

Importing :mod:`sparse_io_attn` or this package imports none of these libraries.
"""

__all__: list[str] = []
