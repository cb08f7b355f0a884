"""`PaperAttention`: multi-head self-attention in the paper's form, with trainable block-sparse
products of the projection weights (Section 4.3: a pruned ``W_Q W_K^T`` is the sparse ``X``)."""
from __future__ import annotations

import math
from typing import Callable, Union

import torch
from torch import nn

from sparse_io_attn.layout._csr import mask_to_csr
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands.api import attention

QKPattern = Union[BlockSparseLayout, Callable[[int], BlockSparseLayout], None]
WeightPattern = Union[float, BlockSparseMatrix, list, tuple, None]


def _head_products(embed_dim: int, num_heads: int, generator: torch.Generator | None):
    """Per-head ``W_Q W_K^T`` and ``W_V W_O`` ``[H, E, E]`` of projections initialised like
    ``nn.Linear`` (uniform, bound ``1/sqrt(E)``), head dim ``E // H``."""
    d = embed_dim // num_heads
    bound = 1 / math.sqrt(embed_dim)

    def w(*shape):
        return (torch.rand(*shape, generator=generator) * 2 - 1) * bound

    wq, wk, wv, wo = w(num_heads, embed_dim, d), w(num_heads, embed_dim, d), w(num_heads, embed_dim, d), \
        w(num_heads, d, embed_dim)
    return wq @ wk.transpose(1, 2), wv @ wo


def prune_blocks(dense: torch.Tensor, block: int, density: float) -> torch.Tensor:
    """Block patterns ``bool [H, R, C]`` keeping, per head, the ``max(1, round(density * R * C))``
    blocks of ``dense [H, rows, cols]`` with the largest Frobenius norm (magnitude pruning)."""
    if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0 < density <= 1:
        raise ValueError(f"a pruning density must be a float in (0, 1], got {density!r}")
    H, rows, cols = dense.shape
    R, C = math.ceil(rows / block), math.ceil(cols / block)
    padded = dense.new_zeros(H, R * block, C * block)
    padded[:, :rows, :cols] = dense
    norms = padded.view(H, R, block, C, block).pow(2).sum(dim=(2, 4)).view(H, R * C)
    keep = max(1, round(density * R * C))
    mask = torch.zeros(H, R * C, dtype=torch.bool)
    mask.scatter_(1, norms.topk(keep, dim=1).indices, True)
    return mask.view(H, R, C)


def _patterns(spec: WeightPattern, dense: torch.Tensor, block: int, what: str) -> torch.Tensor | None:
    """``bool [H, R, C]`` block patterns from a pruning density, one :class:`BlockSparseMatrix`
    (every head) or a list of ``H`` (one per head); None keeps the product dense."""
    H, rows, cols = dense.shape
    if spec is None:
        return None
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return prune_blocks(dense, block, float(spec))
    mats = [spec] * H if isinstance(spec, BlockSparseMatrix) else spec
    if not isinstance(mats, (list, tuple)) or len(mats) != H or not all(isinstance(m, BlockSparseMatrix) for m in mats):
        raise TypeError(f"{what} must be a density in (0, 1], a BlockSparseMatrix or a list of {H} of them (one per "
                        f"head), or None; got {type(spec).__name__}")
    for m in mats:
        if tuple(m.shape) != (rows, cols) or tuple(m.block_size) != (block, block):
            raise ValueError(f"{what} matrices must have shape {(rows, cols)} and block_size {(block, block)}, got "
                             f"{tuple(m.shape)} and {tuple(m.block_size)}")
    return torch.stack([m.to_block_mask().cpu() for m in mats])


class _BlockSparseStack(nn.Module):
    """``H`` block-sparse matrices on fixed block patterns, their stored blocks in one trainable
    ``values [sum of nnz_blocks, block, block]``; :meth:`matrices` rebuilds the per-head
    :class:`BlockSparseMatrix` views (gradients of ``values`` land on the patterns only)."""

    def __init__(self, dense: torch.Tensor, patterns: torch.Tensor, block: int):
        super().__init__()
        H, rows, cols = dense.shape
        self.shape, self.block = (rows, cols), block
        self.counts = [int(p.sum()) for p in patterns]
        values = []
        for h in range(H):
            crow, col = mask_to_csr(patterns[h][None])
            self.register_buffer(f"crow_{h}", crow[0])
            self.register_buffer(f"col_{h}", col)
            values.append(_dense_blocks(dense[h], block)[patterns[h]])  # row-major: the CSR order
        self.values = nn.Parameter(torch.cat(values))

    def matrices(self) -> list:
        out, start = [], 0
        for h, n in enumerate(self.counts):
            out.append(BlockSparseMatrix(getattr(self, f"crow_{h}"), getattr(self, f"col_{h}"),
                                         self.values[start:start + n], self.shape, self.block, validate=False))
            start += n
        return out


def _dense_blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """``[R, C, block, block]`` tiles of ``t [rows, cols]`` (zero padded)."""
    rows, cols = t.shape
    R, C = math.ceil(rows / block), math.ceil(cols / block)
    padded = t.new_zeros(R * block, C * block)
    padded[:rows, :cols] = t
    return padded.view(R, block, C, block).permute(0, 2, 1, 3)


class PaperAttention(nn.Module):
    r"""Multi-head self-attention in the paper's form over ``x [B, N, E]`` (batch first)::

        out = sum_h softmax(x X_h x^T * scale) x Y_h        # [B, N, E]

    with ``X_h = W_Q^h W_K^h^T`` and ``Y_h = W_V^h W_O^h`` (``[E, E]`` per head, head dim
    ``D = E // num_heads``, ``scale = 1 / sqrt(D)``) trained directly as the paper's operands ``X``
    and ``Y`` of :func:`sparse_io_attn.sparse_operands.attention` (``A1 = A2 = A3 = x``), one call for every
    head and batch element. Each product is dense or block-sparse on a fixed block pattern: the
    pattern never changes during training, gradients land on its stored blocks only.

    Args:
        embed_dim: ``E``, a multiple of ``num_heads``.
        num_heads: ``H``.
        x_pattern / y_pattern: the block pattern of ``X`` / ``Y``: a density in ``(0, 1]`` (the
            per-head products of a dense ``nn.Linear``-style initialisation are magnitude-pruned
            once, per head, to that fraction of their blocks, at least one), a
            :class:`BlockSparseMatrix` (its pattern, for every head), a list of ``H`` of them (a
            pattern per head; values are taken from the initialisation, not from the matrices),
            or None (dense ``[H, E, E]``).
        qk_pattern: the keys each query block attends to: a :class:`BlockSparseLayout` built for
            one length (``seqlen == (N, N)``, masks shared or one per head), a callable ``N ->
            BlockSparseLayout`` (e.g. ``functools.partial(patterns.causal, block_size=16)``),
            called once per length and device and cached, or None (all keys).
        block_size: the block of the weight patterns (rows and columns).
        backend: as for :func:`sparse_io_attn.sparse_operands.attention`.
        generator: seeds the initialisation.

    :meth:`dense_weights` returns ``(X [H, E, E], Y [H, E, E])`` as dense tensors (zeros outside
    the patterns): the reference a dense implementation of the same pruned weights computes with.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, x_pattern: WeightPattern = None,
                 y_pattern: WeightPattern = None, qk_pattern: QKPattern = None, block_size: int = 16,
                 backend: str = "auto", generator: torch.Generator | None = None):
        super().__init__()
        for name, v in (("embed_dim", embed_dim), ("num_heads", num_heads), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a multiple of num_heads ({num_heads})")
        if qk_pattern is not None and not isinstance(qk_pattern, BlockSparseLayout) and not callable(qk_pattern):
            raise TypeError(f"qk_pattern must be a BlockSparseLayout, a callable seqlen -> BlockSparseLayout or "
                            f"None, got {type(qk_pattern).__name__}")
        self.embed_dim, self.num_heads, self.block_size = embed_dim, num_heads, block_size
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.backend = backend
        self.qk_pattern = qk_pattern
        self._layouts: dict = {}
        x0, y0 = _head_products(embed_dim, num_heads, generator)
        self.x = self._weight(x0, _patterns(x_pattern, x0, block_size, "x_pattern"))
        self.y = self._weight(y0, _patterns(y_pattern, y0, block_size, "y_pattern"))

    def _weight(self, dense: torch.Tensor, patterns: torch.Tensor | None) -> nn.Module | nn.Parameter:
        if patterns is None:
            return nn.Parameter(dense)
        return _BlockSparseStack(dense, patterns, self.block_size)

    @staticmethod
    def _operand(w):
        return w.matrices() if isinstance(w, _BlockSparseStack) else w

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(X, Y)``, each ``[H, E, E]`` dense (zeros outside a block pattern), differentiable."""
        def dense(w):
            if isinstance(w, _BlockSparseStack):
                return torch.stack([m.to_dense() for m in w.matrices()])
            return w
        return dense(self.x), dense(self.y)

    def layout_for(self, seqlen: int, device) -> BlockSparseLayout | None:
        """The QK layout used for sequences of ``seqlen`` on ``device`` (built once per pair)."""
        if self.qk_pattern is None:
            return None
        key = (seqlen, str(device))
        if key not in self._layouts:
            lay = self.qk_pattern if isinstance(self.qk_pattern, BlockSparseLayout) else self.qk_pattern(seqlen)
            if not isinstance(lay, BlockSparseLayout):
                raise TypeError(f"qk_pattern({seqlen}) must return a BlockSparseLayout built for seqlen "
                                f"({seqlen}, {seqlen}), got {type(lay).__name__}")
            self._layouts[key] = lay.to(device)
        return self._layouts[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"PaperAttention expects x [B, N, E={self.embed_dim}], got {got}")
        N = x.shape[1]                              # N = 0: no keys to pattern, the empty output
        out = attention(x, x, x, self._operand(self.x), self._operand(self.y),
                        qk_layout=self.layout_for(N, x.device) if N else None, scale=self.scale, backend=self.backend)
        return out.sum(dim=1)  # [B, H, N, E] -> [B, N, E]

    def extra_repr(self) -> str:
        def kind(w):
            if isinstance(w, _BlockSparseStack):
                total = self.num_heads * math.ceil(self.embed_dim / self.block_size) ** 2
                return f"block-sparse {sum(w.counts)}/{total} blocks"
            return "dense"
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, block_size={self.block_size}, "
                f"X {kind(self.x)}, Y {kind(self.y)}")
