"""Pattern builders: each returns an element-exact :class:`~sparse_io_attn.BlockSparseLayout` with a
readable name.

Signature shape: ``NAME(seqlen, block_size, <pattern parameters>, *, causal=False, [num_heads=1,
seed=0])``. ``seqlen`` is an int or a ``(seqlen_q, seqlen_k)`` pair, ``block_size`` an int or a
``(BLOCK_SIZE_Q, BLOCK_SIZE_KV)`` pair (only :func:`document` takes ``cu_seqlens`` first).

Every pattern is defined on *elements* ``(q, k)`` (query position ``q``, key position ``k``,
top-left aligned, ``d = q - k``) and the layout computes exactly that mask: blocks whose every
in-range element is allowed are full, blocks with some allowed elements are partial (they carry
the element mask), other blocks are not kept. ``causal=True`` intersects the definition with
``k <= q``, and the layout carries it (no ``causal`` flag is needed at the call).

==================  ==========================================================================
pattern             element ``(q, k)`` allowed iff
==================  ==========================================================================
dense               always
causal              ``k <= q``
sliding_window      ``|q - k| <= window`` (``window`` in elements)
strided             ``|q - k| < stride`` or ``(q - k) % stride == 0`` (Child et al. 2019)
fixed               ``q // stride == k // stride`` or ``k % stride >= stride - summary`` (Child et al.)
longformer          ``|q - k| <= window`` or ``q`` or ``k`` is a global token
bigbird             ``|q - k| <= window`` or query block ``< num_global`` or key block ``< num_global``
                    or ``(q, k)`` in one of ``num_random`` random key blocks of its query-block row
                    (seeded, per head)
random              ``(q, k)`` in one of ``round(density * n)`` blocks of the ``n`` allowed ones,
                    drawn uniformly (seeded, per head)
document            ``q`` and ``k`` in the same document of ``cu_seqlens`` (packed sequences)
prefix_lm           ``k < prefix`` or ``k <= q`` (bidirectional prefix, causal continuation)
==================  ==========================================================================

Cost: builders enumerate the candidate blocks of each row from the pattern's structure (bands,
diagonals, global rows and columns, documents), never the ``seqlen_q x seqlen_k`` element mask or
the full block grid (``dense`` and ``random`` excepted, whose kept blocks are the grid), and
evaluate the element definition only on blocks that may be partial, once per distinct mask shape:
time and memory O(kept blocks). Before listing any block a builder counts the blocks its parts keep
and refuses with a ``ValueError`` (the count and the memory available) when they cannot fit.

Rows: every builder (and :func:`from_spec`, :func:`get`) takes ``rows=(start, stop)`` and returns the
layout of query positions ``[start, stop)`` against every key (``seqlen (stop - start, seqlen_k)``),
equal to ``whole.rows(start, stop)`` but built from those rows alone, in O(the blocks they keep): what
a decode step with a KV cache needs. ``bigbird`` and ``random`` still draw their random blocks over the
whole grid (their definition is one sequence of draws), then keep the rows asked for.

Parameters past the sequence (a window or stride longer than ``seqlen_q + seqlen_k``, a prefix
longer than ``seqlen_k``) give the layout the definition gives (dense or causal, ...), and the
layout's name states the value asked for; ``document`` refuses more documents than positions.

Data-dependent: :func:`topk` keeps the ``k`` highest-scoring key blocks of each query-block row of a
score tensor computed from the activations (with the diagonal, sink blocks and causality), on the
scores' device and without host synchronisation, for a layout chosen at every step.

Specs (``from_spec``, used by the CLI's ``--pattern``)::

    spec  := NAME [":" arg ("," arg)*]
    arg   := value | KEY "=" value | FLAG          # FLAG: a bare boolean name, e.g. causal
    value := int | float | true | false | int ("/" int)+      # "/" separates a list

Positional values fill the pattern's main parameters in order (see ``SPEC_PARAMS``), e.g.
``sliding_window:512``, ``bigbird:window=256,global=1,random=2``, ``random:0.1,seed=3,heads=8``,
``document:4`` (4 equal documents), ``document:lengths=1000/3096,causal`` or ``prefix_lm:100``.
Keys accept the full parameter names and the short aliases in ``ALIASES`` (``w``, ``g``/``global``,
``r``/``random``, ``d``, ``c``, ``heads``). Parameters left out get defaults scaled to ``seqlen`` and
``block_size``.
"""
from sparse_io_attn.layout.patterns._grid import MAX_SEQLEN
from sparse_io_attn.layout.patterns.builders import (bigbird, block_diagonal, causal, dense, document, fixed,
                                                     longformer, prefix_lm, random, sliding_window, strided)
from sparse_io_attn.layout.patterns.selection import ranked_topk, topk
from sparse_io_attn.layout.patterns.spec import ALIASES, SPEC_PARAMS, available, from_spec, get, parse_spec

__all__ = ["dense", "causal", "sliding_window", "strided", "fixed", "longformer", "bigbird", "random",
           "document", "block_diagonal", "prefix_lm", "topk", "ranked_topk", "from_spec", "parse_spec", "get", "available",
           "SPEC_PARAMS", "ALIASES", "MAX_SEQLEN"]
