"""Exact traffic model of the dense kernels: ``TrafficReport(source="predicted")`` with the same
kernel and tensor names, launch counts and byte counts as the counted kernels (tests compare with
``==``), for any ``n, d, M`` -- so it reaches sizes the interpreter cannot.

Conventions (see :mod:`.launch`): inputs, ``O`` and the ``dA*`` gradients have the input dtype's
size ``I``; intermediates, ``lse``, ``v`` and the ``d x d`` partials are fp32 (4 bytes). ``Z`` is the
batch (product of leading dims). A tile re-read counts again; masked-off lanes do not count.

Per kernel (elements, before the byte size; ``cdiv(a, b)`` = ceil(a / b)):

* tiled matmul ``C[m, n'] = A[m, k] B[k, n']`` on ``B x B`` tiles: reads ``A`` ``cdiv(n', B)*m*k``,
  ``B`` ``cdiv(m, B)*k*n'``, writes ``C`` ``m*n'``.
* ``small.phase1.f``: reads ``S`` and ``A2`` ``cdiv(n, B)*n*d`` each; ``f`` written ``2n^2`` (scores,
  then probabilities) and read ``n^2``.
* ``small.phase3.p``: reads ``f`` and ``q`` ``2n^2`` each, writes ``p`` ``n^2``.
* projection ``C = A W`` (Algorithm 7, rows ``B_r``): reads ``A`` ``n*d_in``, ``W``
  ``cdiv(n, B_r)*d_in*d_out``, writes ``C`` ``n*d_out``.
* ``A^T B`` into ``d_a x d_b``: ``cdiv(d_b, BC)`` programs each read all of ``A``: reads ``A``
  ``cdiv(d_b, BC)*n*d_a``, ``B`` ``n*d_b``, writes ``d_a*d_b`` (fp32).
* rows-outer kernel (``large.phase2``, ``large.dq``), row block ``BM``: row operands once
  (``S, dO, dS``, ``lse``, and ``O, A1`` or ``v``); ``h`` and ``A2`` ``cdiv(n, BM)*n*d``;
  ``large.phase2`` writes ``num_splits`` partial ``g`` (``d^2`` each, fp32).
* keys-outer kernel ``large.dkdh``, key block ``BN``: ``A2, h`` once; ``S, dO`` ``cdiv(n, BN)*n*d``;
  ``lse, v`` ``cdiv(n, BN)*n``; writes ``dA2, dh`` ``n*d``.
* ``fwd.attn``, row block ``BM``: ``S`` once, ``A2, h`` ``cdiv(n, BM)*n*d``; writes ``O``, ``lse``.
* small-cache forward (``fwd.small.*``, ``B x B`` tiles): ``S = A1 X`` and ``h = A3 Y`` tiled
  products; ``fwd.small.f`` as ``small.phase1.f`` plus ``lse`` written (``n``, fp32);
  ``O = f h``: reads ``f`` ``cdiv(d, B)*n^2``, ``h`` ``cdiv(n, B)*n*d``, writes ``O`` ``n*d``.
"""
from __future__ import annotations

import torch

from sparse_io_attn.tally.report import TrafficReport
from sparse_io_attn.bounds.units import itemsize
from sparse_io_attn.dense.tiles import MIN_BLOCK, forward_blocks, small_cache_block
from sparse_io_attn.dense.tiles import large_cache_blocks as _blocks

#: Counter tensors of each kernel, in slot order (:mod:`.triton.slots` builds the kernels' slots from
#: them; the launchers name the counter's tensors with them). ``PRODUCT_TENSORS`` are positions: a
#: product's launch names its own ``(A, B, C)`` for ``C = A B``.
PRODUCT_TENSORS = ("a", "b", "c")
#: FlashAttention-2's preprocessing ``v = (O o dO) 1``: ``O``, ``dO`` read; ``v`` written.
DELTA_TENSORS = ("O", "dO", "v")
#: The large-cache forward: ``S``, ``A2``, ``h`` read; ``O``, ``lse`` written.
FWD_TENSORS = ("S", "A2", "h", "O", "lse")
#: The small-cache softmax: ``S``, ``A2`` read; ``f`` written (twice) and read; ``lse`` written by the
#: forward only (the backward names the first three).
SOFTMAX_TENSORS = ("S", "A2", "f", "lse")
#: Algorithm 4 (phase 3): ``f``, ``q`` read twice; ``p`` written.
PHASE3_TENSORS = ("f", "q", "p")
#: Algorithm 8 (the row kernel as written): ``S, A2, h, dO, lse, O`` read; ``dS`` written; ``A1`` read;
#: the ``dX`` partials written.
ROW_TENSORS = ("S", "A2", "h", "dO", "lse", "O", "dS", "A1", "dX")
#: The row kernel in FlashAttention-2's dQ order: ``v`` read where Algorithm 8 reads ``O``; no ``dX``.
DQ_TENSORS = ROW_TENSORS[:5] + ("v", "dS")
#: The column kernel (dK/dV loop): ``S, A2, h, dO, lse, v`` read; ``dA2``, ``dh`` written.
COL_TENSORS = ("S", "A2", "h", "dO", "lse", "v", "dA2", "dh")

#: Kernels of the small-cache backward that lie on the paper's ``dX`` path (Algorithm 6).
SMALL_G_PATH = ("small.phase1.S", "small.phase1.f", "small.phase2.h", "small.phase2.q", "small.phase3.p",
                "small.phase4.T", "small.phase4.g")

#: The large-cache backward's loop orders: Algorithm 9 as written, FlashAttention-2's.
VARIANTS = ("faithful", "fa2")

#: Kernels of each variant that lie on the paper's ``dX`` path.
LARGE_G_PATH = {"faithful": ("large.phase1", "large.phase2"),
                "fa2": ("large.phase1", "large.delta", "large.dq", "large.g")}


F32 = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Model:
    def __init__(self, Z: int):
        self.Z = Z
        self.report = TrafficReport(source="predicted")

    def add(self, kernel: str, reads: dict, writes: dict, launches: int = 1) -> None:
        self.report.add(kernel, {k: self.Z * v for k, v in reads.items()},
                        {k: self.Z * v for k, v in writes.items()}, launches)

    def tile_mm(self, kernel, names, m, n, k, B, sizes):
        a, b, c = names
        sa, sb, sc = sizes
        self.add(kernel, {a: _cdiv(n, B) * m * k * sa, b: _cdiv(m, B) * k * n * sb}, {c: m * n * sc})

    def proj(self, kernel, names, n, d_in, d_out, block_m, sizes):
        a, w, c = names
        sa, sw, sc = sizes
        self.add(kernel, {a: n * d_in * sa, w: _cdiv(n, block_m) * d_in * d_out * sw}, {c: n * d_out * sc})

    def atb(self, kernel, names, n, d_a, d_b, block_c, sizes):
        a, b, c = names
        sa, sb = sizes
        self.add(kernel, {a: _cdiv(d_b, block_c) * n * d_a * sa, b: n * d_b * sb}, {c: d_a * d_b * F32})



def large_forward_traffic(n: int, d: int, M: int, *, batch: int = 1, dtype=torch.float32,
                          fit: bool = False) -> TrafficReport:
    """Predicted traffic of the large-cache (FlashAttention-order) forward, ``regime="large"``.
    ``fit``: raise ``ValueError`` when its tiles do not fit ``M`` (what ``"auto"`` requires) instead
    of the ``16 x 16`` fallback of :func:`~.tiles.forward_blocks`."""
    I = itemsize(dtype)
    m = _Model(batch)
    _forward(m, n, d, M, I, fit)
    return m.report


def _forward(m: _Model, n, d, M, I, fit=False):
    blocks = _blocks if fit else forward_blocks
    pc_long, pc_short = blocks("large.phase1", M, d)
    m.proj("fwd.proj", ("A1", "X", "S"), n, d, d, pc_short, (I, I, F32))
    m.proj("fwd.proj", ("A3", "Y", "h"), n, d, d, pc_short, (I, I, F32))
    _, short = blocks("fwd.attn", M, d)
    m.add("fwd.attn", {"S": n * d * F32, "A2": _cdiv(n, short) * n * d * I, "h": _cdiv(n, short) * n * d * F32},
          {"O": n * d * I, "lse": n * F32})


def small_forward_traffic(n: int, d: int, M: int, *, batch: int = 1, dtype=torch.float32) -> TrafficReport:
    """Predicted traffic of the small-cache forward (``regime="small"``): ``B x B`` tiles with
    ``B = pow2 <= sqrt(M/4)`` (``ValueError`` below ``M = 1024``)."""
    I = itemsize(dtype)
    B = small_cache_block(M)
    m = _Model(batch)
    m.tile_mm("fwd.small.S", ("A1", "X", "S"), n, d, d, B, (I, I, F32))
    m.add("fwd.small.f", {"S": _cdiv(n, B) * n * d * F32, "A2": _cdiv(n, B) * n * d * I, "f": n * n * F32},
          {"f": 2 * n * n * F32, "lse": n * F32})
    m.tile_mm("fwd.small.h", ("A3", "Y", "h"), n, d, d, B, (I, I, F32))
    m.tile_mm("fwd.small.O", ("f", "h", "O"), n, d, n, B, (F32, F32, I))
    return m.report


def small_cache_traffic(n: int, d: int, M: int, *, batch: int = 1, dtype=torch.float32,
                        g_only: bool = False) -> TrafficReport:
    """Predicted traffic of :func:`~sparse_io_attn.dense.backward_small_cache`; ``g_only`` keeps the
    kernels of the paper's Algorithm 6 (the ``dX`` path, :data:`SMALL_G_PATH`)."""
    I = itemsize(dtype)
    B = small_cache_block(M)
    m = _Model(batch)
    m.tile_mm("small.phase1.S", ("A1", "X", "S"), n, d, d, B, (I, I, F32))
    m.add("small.phase1.f", {"S": _cdiv(n, B) * n * d * F32, "A2": _cdiv(n, B) * n * d * I, "f": n * n * F32},
          {"f": 2 * n * n * F32})
    m.tile_mm("small.phase2.h", ("A3", "Y", "h"), n, d, d, B, (I, I, F32))
    m.tile_mm("small.phase2.q", ("dO", "h", "q"), n, n, d, B, (I, F32, F32))
    m.add("small.phase3.p", {"f": 2 * n * n * F32, "q": 2 * n * n * F32}, {"p": n * n * F32})
    m.tile_mm("small.phase4.T", ("A1", "p", "T"), d, n, n, B, (I, F32, F32))
    m.tile_mm("small.phase4.g", ("T", "A2", "dX"), d, d, n, B, (F32, I, F32))
    m.tile_mm("small.dh", ("f", "dO", "dh"), n, d, n, B, (F32, I, F32))
    m.tile_mm("small.dY", ("A3", "dh", "dY"), d, d, n, B, (I, F32, F32))
    m.tile_mm("small.dA3", ("dh", "Y", "dA3"), n, d, d, B, (F32, I, I))
    m.tile_mm("small.dS", ("p", "A2", "dS"), n, d, n, B, (F32, I, F32))
    m.tile_mm("small.dA1", ("dS", "X", "dA1"), n, d, d, B, (F32, I, I))
    m.tile_mm("small.dA2", ("p", "S", "dA2"), n, d, n, B, (F32, F32, I))
    return _only(m.report, SMALL_G_PATH) if g_only else m.report


def large_cache_traffic(n: int, d: int, M: int, *, batch: int = 1, dtype=torch.float32,
                        variant: str = "faithful", num_splits: int = 1, g_only: bool = False,
                        min_block: int = MIN_BLOCK) -> TrafficReport:
    """Predicted traffic of :func:`~sparse_io_attn.dense.backward_large_cache`; ``g_only`` keeps the
    kernels on the ``dX`` path (:data:`LARGE_G_PATH`). ``min_block < 16`` extends the
    schedule to tiles the kernels cannot run (``tl.dot`` needs 16): a model-only comparison."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    I = itemsize(dtype)
    m = _Model(batch)
    blocks = lambda kernel, M, d: _blocks(kernel, M, d, min_block=min_block)  # noqa: E731
    pc_long, pc_short = blocks("large.phase1", M, d)
    m.proj("large.phase1", ("A1", "X", "S"), n, d, d, pc_short, (I, I, F32))
    m.proj("large.phase1", ("A3", "Y", "h"), n, d, d, pc_short, (I, I, F32))
    _, dl_short = blocks("large.delta", M, d)
    m.add("large.delta", {"O": n * d * I, "dO": n * d * I}, {"v": n * F32})
    at_long, at_short = blocks("large.atb", M, d)
    if variant == "faithful":
        _, short = blocks("large.phase2", M, d)
        rb = _cdiv(n, short)
        m.add("large.phase2", {"S": n * d * F32, "A2": rb * n * d * I, "h": rb * n * d * F32, "dO": n * d * I,
                               "lse": n * F32, "O": n * d * I, "A1": n * d * I},
              {"dS": n * d * F32, "dX": num_splits * d * d * F32})
    else:
        long, _ = blocks("large.dq", M, d)
        rb = _cdiv(n, long)
        m.add("large.dq", {"S": n * d * F32, "A2": rb * n * d * I, "h": rb * n * d * F32, "dO": n * d * I,
                           "lse": n * F32, "v": n * F32}, {"dS": n * d * F32})
        m.atb("large.g", ("A1", "dS", "dX"), n, d, d, at_long, (I, F32))
    long, _ = blocks("large.dkdh", M, d)
    cb = _cdiv(n, long)
    m.add("large.dkdh", {"S": cb * n * d * F32, "A2": n * d * I, "h": n * d * F32, "dO": cb * n * d * I,
                         "lse": cb * n * F32, "v": cb * n * F32}, {"dA2": n * d * I, "dh": n * d * F32})
    m.proj("large.dA1", ("dS", "X", "dA1"), n, d, d, pc_short, (F32, I, I))
    m.proj("large.dA3", ("dh", "Y", "dA3"), n, d, d, pc_short, (F32, I, I))
    m.atb("large.dY", ("A3", "dh", "dY"), n, d, d, at_long, (I, F32))
    return _only(m.report, LARGE_G_PATH[variant]) if g_only else m.report


def _only(report: TrafficReport, kernels) -> TrafficReport:
    out = TrafficReport(source=report.source)
    for k in kernels:
        kt = report.kernels[k]
        out.add(kt.name, kt.reads, kt.writes, kt.launches)
    return out
