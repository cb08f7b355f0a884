"""`SparseSelfAttention`: a multi-head self-attention layer whose attention is block-sparse (a layout)
or chosen per query token (a selector returning a :class:`~sparse_io_attn.layout.selection.Selection`)."""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

from sparse_io_attn.block_sparse.api import BACKENDS, block_sparse_attention
from sparse_io_attn.block_sparse.plan import AttentionPlan, plan
from sparse_io_attn.layout._args import positive_int
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.selection.api import selection_attention

LayoutOrPattern = Union[BlockSparseLayout, Callable[[int], BlockSparseLayout]]
Selector = Callable[[torch.Tensor, torch.Tensor], Union[BlockSparseLayout, Selection]]


class SparseSelfAttention(nn.Module):
    r"""Multi-head self-attention over ``x [B, N, E]`` (batch first) with a block-sparse pattern.

    ``out = out_proj(attn(q_proj(x), k_proj(x), v_proj(x)))`` where ``attn`` is
    :func:`sparse_io_attn.block_sparse_attention` for a layout, or
    :func:`sparse_io_attn.selection_attention` for a selector that returns a per-token
    :class:`~sparse_io_attn.Selection` (both ``torch.library`` custom ops, so
    ``torch.compile(model, fullgraph=True)`` works).

    Args:
        embed_dim: ``E``; must be a multiple of ``num_heads``. Head dim ``D = E // num_heads``.
        num_heads: query heads ``Hq``.
        layout_or_pattern: a :class:`~sparse_io_attn.BlockSparseLayout` built for one sequence
            length ``seqlen == (N, N)``, or a callable ``seqlen -> BlockSparseLayout`` (for example
            ``functools.partial(patterns.sliding_window, ...)``) called lazily for each length the
            layer sees and cached per (length, device). Layouts may be shared by all heads or hold
            one mask per query head (``layout_heads == num_heads``) or per KV head. ``None`` when a
            ``selector`` is given.
        selector: instead of a fixed layout, a callable ``(q, k)`` evaluated at every forward on the
            projected ``q [B, Hq, N, D]`` and ``k [B, Hkv, N, D]``, returning either a
            :class:`BlockSparseLayout` (run by ``block_sparse_attention``, e.g.
            :func:`~sparse_io_attn.nn.selectors.pooled_topk`) or a per-token
            :class:`~sparse_io_attn.Selection` with ``G`` in ``{1, Hkv, Hq}`` selections (run by
            ``selection_attention``, e.g. :func:`~sparse_io_attn.nn.selectors.moba` or
            :func:`~sparse_io_attn.nn.selectors.nsa`). The library's selectors build on the device
            without host synchronisation: the layer compiles with ``fullgraph=True`` and a new
            selection of the same shapes does not recompile. A selection is run with ``check=False``
            (the selectors' indices are valid by construction; out-of-range entries would count as
            empty slots).
        num_kv_heads: key/value heads ``Hkv`` (GQA/MQA); default ``num_heads``. Query head ``h``
            reads kv head ``h // (num_heads // num_kv_heads)``.
        causal: intersect the layout with a causal mask: ``True``/``"top_left"`` (key ``j`` allowed for
            query ``i`` iff ``j <= i``) or ``"bottom_right"`` (see :func:`~sparse_io_attn.block_sparse_attention`);
            a layout built with ``causal=True`` carries its causality already.
        dropout: attention dropout probability. Only ``0.0`` is supported: the block-sparse
            backends have no dropout, and a value > 0 raises ``NotImplementedError`` rather than
            being ignored. Put an ``nn.Dropout`` on the layer's output instead.
        bias: add biases to the four projections.
        backend: ``"auto"`` (Triton on CUDA, the C++ kernel on CPU), ``"cpu"``, ``"torch"`` or
            ``"triton"`` (see :func:`~sparse_io_attn.block_sparse_attention`).

    Under ``torch.compile`` the layout for a new length is built by data-dependent code (like
    FlexAttention's ``create_block_mask``); call :meth:`layout_for` (or run one eager forward) for
    each length before compiling with ``fullgraph=True``. A fixed layout needs nothing.
    """

    def __init__(self, embed_dim: int, num_heads: int, layout_or_pattern: LayoutOrPattern | None = None, *,
                 selector: Selector | None = None, num_kv_heads: int | None = None, causal=False, dropout: float = 0.0,
                 bias: bool = True, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        embed_dim = positive_int(embed_dim, "embed_dim")
        num_heads = positive_int(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else positive_int(num_kv_heads, "num_kv_heads")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be a multiple of num_heads {num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} "
                             f"(GQA/MQA)")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        if dropout > 0.0:
            raise NotImplementedError(
                f"attention dropout ({dropout}) is not supported: the block-sparse backends have no "
                f"dropout inside the kernel; use dropout=0.0 and put nn.Dropout on the layer output")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        causal_offset(causal, 1, 1)  # ValueError naming the accepted modes
        self.causal, self.dropout, self.backend = causal, 0.0, backend
        kv_dim = num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._layouts: dict[tuple[int, str], AttentionPlan] = {}   # (seqlen, device) -> plan
        self.selector = selector
        if selector is not None:
            if layout_or_pattern is not None:
                raise ValueError("pass either layout_or_pattern (a fixed layout or seqlen -> layout) or "
                                 "selector ((q, k) -> layout, chosen at every forward), not both")
            if not callable(selector):
                raise TypeError(f"selector must be a callable (q, k) -> BlockSparseLayout or Selection, got "
                                f"{type(selector).__name__}")
            if getattr(selector, "causal", causal) not in (False, None) and causal in (False, None):
                raise ValueError(f"the selector {selector!r} selects causally; build the layer with causal=True "
                                 f"so that the attention masks the diagonal blocks' future elements")
            self._fixed = self._pattern = None
        elif isinstance(layout_or_pattern, BlockSparseLayout):
            self._check_layout(layout_or_pattern, layout_or_pattern.seqlen_q)
            self._fixed, self._pattern = layout_or_pattern, None
            self._build_layout(layout_or_pattern.seqlen_q, layout_or_pattern.device)
        elif callable(layout_or_pattern):
            self._fixed, self._pattern = None, layout_or_pattern
        else:
            raise TypeError(f"layout_or_pattern must be a BlockSparseLayout or a callable "
                            f"seqlen -> BlockSparseLayout (or pass selector=), got {type(layout_or_pattern).__name__}")

    def _check_layout(self, layout, seqlen: int) -> None:
        if not isinstance(layout, BlockSparseLayout):
            raise TypeError(f"the pattern must return a BlockSparseLayout, got {type(layout).__name__}")
        if layout.seqlen != (seqlen, seqlen):
            raise ValueError(f"self-attention needs a square layout for seqlen {seqlen}, got a layout "
                             f"with seqlen {layout.seqlen}")
        if layout.layout_heads not in (1, self.num_heads, self.num_kv_heads):
            raise ValueError(f"layout has {layout.layout_heads} head masks but the layer has "
                             f"{self.num_heads} query heads and {self.num_kv_heads} KV heads; build it with "
                             f"1 (shared), {self.num_heads} or {self.num_kv_heads}")

    def layout_for(self, seqlen: int, device=None) -> BlockSparseLayout:
        """The layout used for sequences of length ``seqlen`` on ``device`` (built once, cached)."""
        return self.plan_for(seqlen, device).layout

    def plan_for(self, seqlen: int, device=None) -> AttentionPlan:
        """The attention plan of :meth:`layout_for` for the layer's heads and causality (built once,
        outside any ``torch.compile`` trace, and kept)."""
        if self.selector is not None:
            raise ValueError(f"this layer chooses its layout at every forward with {self.selector!r}; "
                             f"call layer.selector(q, k) for the layout of given activations")
        device = torch.device("cpu" if device is None else device)
        hit = self._layouts.get((int(seqlen), str(device)))
        if hit is None:
            hit = self._build_layout(int(seqlen), device)
        return hit

    @torch.compiler.disable(reason="sparse_io_attn: building a layout for a new sequence length is "
                            "data-dependent; call SparseSelfAttention.layout_for(seqlen, device) or run "
                            "one eager forward before torch.compile(..., fullgraph=True)")
    def _build_layout(self, seqlen: int, device: torch.device) -> AttentionPlan:
        if self._fixed is not None:
            if seqlen != self._fixed.seqlen_q:
                raise ValueError(f"the layer's layout was built for seqlen {self._fixed.seqlen_q} "
                                 f"but the input has {seqlen}; pass a callable seqlen -> layout "
                                 f"(e.g. functools.partial of a pattern builder) to handle any length")
            layout = self._fixed
        else:
            layout = self._pattern(seqlen)
            self._check_layout(layout, seqlen)
        p = plan(layout.to(device), causal=self.causal)   # validated and planned once, outside any trace
        self._layouts[(seqlen, str(device))] = p
        p.for_heads(self.num_heads, self.num_kv_heads)
        return p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, N, E]`` -> ``[B, N, E]`` (an empty batch or sequence: the empty output, whatever the
        layout or selector)."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"expected x of shape [batch, seqlen, {self.embed_dim}], got {tuple(x.shape)}")
        N = x.shape[1]
        q, k, v = self.project(x)
        if x.shape[0] == 0 or N == 0:           # nothing to attend: the empty result (no layout has 0 rows)
            return self.project_out(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        if self.selector is not None:
            layout = self.selector(q, k)
            if not isinstance(layout, Selection):
                self._check_layout(layout, N)
        else:
            layout = self.layout_for(N, x.device)     # planned when first built: the call finds its plan
        return self.project_out(self._attend(q, k, v, layout))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, N, E]`` -> ``q [B, Hq, N, D]``, ``k, v [B, Hkv, N, D]``: the input projections."""
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, Hq, N, D]`` -> ``[B, N, E]``: heads merged, the output projection."""
        B, _, N, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, N, self.embed_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layout: BlockSparseLayout | Selection) -> torch.Tensor:
        """Attention of ``q [B, Hq, N, D]``, ``k/v [B, Hkv, N, D]`` under ``layout`` (or a selection) ->
        ``[B, Hq, N, D]``."""
        if isinstance(layout, Selection):
            return selection_attention(q, k, v, layout, causal=self.causal, backend=self.backend, check=False)
        return block_sparse_attention(q, k, v, layout, causal=self.causal, backend=self.backend)

    def extra_repr(self) -> str:
        what = self._fixed.name if self._fixed is not None else repr(self.selector) if self.selector is not None \
            else getattr(self._pattern, "__name__", type(self._pattern).__name__)
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"causal={self.causal}, layout={what!r}, backend={self.backend!r}")
