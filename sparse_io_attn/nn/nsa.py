"""`NativeSparseAttention`: fla's NSA layer (fla-org/flash-linear-attention ``fla/layers/nsa.py``,
commit ``a1a6bb1f``) with each of its three branches run by this library's ops."""
from __future__ import annotations


import torch
from torch import nn

from sparse_io_attn._triton.shapes import next_pow2
from sparse_io_attn.block_sparse.api import BACKENDS, block_sparse_attention
from sparse_io_attn.block_sparse.plan import plan
from sparse_io_attn.layout._args import positive_int
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.patterns.builders import document, sliding_window
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.nn.selectors import Packed, block_means, nsa, whole_block_means
from sparse_io_attn.selection.api import selection_attention


def rotary(x: torch.Tensor, base: float, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """fla's ``RotaryEmbedding(dim=head_dim, base)`` on ``x [B, H, T, D]`` (NeoX halves: pair
    ``(x_i, x_{i + D/2})`` rotated by ``(offset + t) * base ** (-2i / D)``; the whole head dim), or
    by ``positions [T]`` when given (packed sequences: each token's place in its own sequence).
    As fla: inverse frequencies and positions in float32, the cos/sin tables cast to x's dtype, the
    rotation computed in float32 (float64 stays float64) and stored in x's dtype."""
    D, T = x.shape[-1], x.shape[-2]
    if D % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {D}")
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    pos = torch.arange(offset, offset + T, device=x.device) if positions is None else positions + offset
    freqs = torch.outer(pos.to(torch.float32), inv_freq)
    acc = torch.promote_types(x.dtype, torch.float32)
    cos, sin = torch.cos(freqs).to(x.dtype).to(acc), torch.sin(freqs).to(x.dtype).to(acc)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)                   # [T, D]
    xf = x.to(acc)
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class NativeSparseAttention(nn.Module):
    r"""Native Sparse Attention (Yuan et al. 2025) as fla's layer computes it
    (``fla/layers/nsa.py::NativeSparseAttention``; semantics in ``docs/notes/reference_semantics.md``),
    over ``x [B, T, E]`` (batch first, no KV cache, no padding mask):

    .. code-block:: text

        q, k, v = q_proj(x), k_proj(x), v_proj(x)            # [B, T, Hq|Hkv, head_dim]
        q, k = RoPE(q, k)                                     # fla RotaryEmbedding: NeoX halves, base rope_theta
        g_cmp, g_slc, g_swa = sigmoid(g_proj(x)).view(B, T, Hq, 3).unbind(-1)
        o = g_slc * o_slc + g_cmp * o_cmp + g_swa * o_swa    # three independent sigmoid gates
        out = o_proj(o)

    * ``o_cmp``: attention over the mean-pooled keys and values of the **complete** blocks
      (``(c + 1) * block_size - 1 <= t``), :func:`block_sparse_attention` with an element-exact
      layout of that mask; a query with no complete block gets 0 (fla's convention);
    * ``o_slc``: :func:`selection_attention` over the blocks of :func:`~sparse_io_attn.nn.selectors.nsa`
      (per token and KV head, causal inside); as fla's layer (which calls ``parallel_nsa``), the
      number of selected blocks is ``next_pow2(num_blocks)`` (``num_blocks=12`` selects up to
      16 blocks), see :attr:`selected_blocks`;
    * ``o_swa``: keys ``t - window + 1 .. t``, :func:`block_sparse_attention` with
      ``patterns.sliding_window(T, layout_block_size, window - 1, causal=True)`` (element-exact);
      ``window = 0`` leaves the branch out, as fla.

    Every branch uses the scale ``head_dim ** -0.5`` (fla's layer passes none). Parameter names are
    fla's (``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``, ``o_proj``; biases on q/k/v only with
    ``qkv_bias``; fla's rotary table is not a persistent buffer), so a fla state_dict loads with
    ``load_state_dict``. ``g_proj``'s output row ``3h + j`` is head ``h``'s gate ``j`` (cmp, slc, swa).

    Args:
        embed_dim: ``hidden_size``.
        num_heads, num_kv_heads: ``Hq`` and ``Hkv`` (``Hq % Hkv == 0``). fla's kernels require
            ``Hq / Hkv`` to be a power of two and at least 16; any group size works here.
        head_dim: default ``embed_dim // num_heads`` (fla's default is 64 whatever ``hidden_size``).
        qkv_bias: biases on the q/k/v projections (fla's default False).
        block_size, num_blocks, window, rope_theta: fla's ``block_size``, ``block_counts`` (an int),
            ``window_size`` and ``rope_theta``.
        backend: ``"auto"``, ``"cpu"``, ``"torch"`` or ``"triton"``, for all three branches.
        layout_block_size: block size of the sliding-window and compressed-branch layouts (any value
            computes the same result; it only changes the kernels' tiles).

    Packed sequences: ``forward(x, cu_seqlens=)`` with ``x [1, total, E]`` (fla's ``cu_seqlens``):
    rotary positions, blocks and compressed keys restart at each sequence's start, and no branch
    crosses a sequence (the selected and compressed branches through ``selection_attention``'s
    ``cu_seqlens`` and global compressed blocks, the window through the window layout intersected with
    ``patterns.document``, built per ``cu_seqlens``: one host read).

    Not covered: fla's KV cache and its 2-D ``attention_mask`` (padding).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, head_dim: int | None = None,
                 qkv_bias: bool = False, block_size: int = 64, num_blocks: int = 16, window: int = 512,
                 rope_theta: float = 10000.0, backend: str = "auto", layout_block_size: int = 64, device=None,
                 dtype=None):
        super().__init__()
        embed_dim = positive_int(embed_dim, "embed_dim")
        num_heads = positive_int(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA)")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim {embed_dim} is not a multiple of num_heads {num_heads}; pass head_dim=")
            head_dim = embed_dim // num_heads
        head_dim = positive_int(head_dim, "head_dim")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary embedding over the whole head), got {head_dim}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be a non-negative int (0: no sliding-window branch), got {window!r}")
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0:
            raise ValueError(f"rope_theta must be a positive number, got {rope_theta!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.block_size = positive_int(block_size, "block_size")
        self.num_blocks = positive_int(num_blocks, "num_blocks")
        self.window, self.rope_theta, self.backend = window, float(rope_theta), backend
        self.layout_block_size = positive_int(layout_block_size, "layout_block_size")
        self.selector = nsa(self.block_size, self.selected_blocks)
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.g_proj = nn.Linear(embed_dim, num_heads * 3, bias=False, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=False, **factory)
        self._layouts: dict = {}    # (T, device) -> (window, compressed); "packed" -> (cu_seqlens key, window)

    @property
    def selected_blocks(self) -> int:
        """Blocks the selected branch keeps per token: ``next_pow2(num_blocks)``, as fla's layer
        (``parallel_nsa`` rounds ``block_counts`` up and its kernel attends every slot)."""
        return next_pow2(self.num_blocks)

    def layouts(self, seqlen: int, device=None) -> tuple[BlockSparseLayout | None, BlockSparseLayout | None]:
        """``(sliding window [T, T] or None, compressed [T, T // block_size] or None)``: the two
        static layouts for sequences of ``seqlen`` tokens (built once per length and device, planned,
        outside any ``torch.compile`` trace; run one eager forward per length before compiling with
        ``fullgraph=True``)."""
        device = torch.device("cpu" if device is None else device)
        hit = self._layouts.get((int(seqlen), str(device)))
        return hit if hit is not None else self._build_layouts(int(seqlen), device)

    @torch.compiler.disable(reason="sparse_io_attn: NativeSparseAttention builds its window and compression "
                            "layouts per sequence length (data-dependent); run one eager forward per length "
                            "before torch.compile(..., fullgraph=True)")
    def _build_layouts(self, T: int, device: torch.device):
        lb = self.layout_block_size
        swa = None
        if self.window > 0:
            swa = sliding_window(T, lb, self.window - 1, causal=True).to(device)
            plan(swa, causal=True)
        cmp = None
        nf = T // self.block_size
        if nf > 0:
            t, c = torch.arange(T)[:, None], torch.arange(nf)[None, :]
            cmp = BlockSparseLayout.from_dense_mask((c + 1) * self.block_size - 1 <= t, lb,
                                                    name=f"nsa_complete_blocks(block_size={self.block_size})")
            cmp = cmp.to(device)
            plan(cmp, causal=False)
        self._layouts[(T, str(device))] = (swa, cmp)
        return swa, cmp

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None):
        """``x [B, T, E]`` -> ``(q [B, Hq, T, d], k, v [B, Hkv, T, d], gates [B, T, Hq, 3])``: projections,
        RoPE on q and k (at ``positions [T]`` when given), sigmoid gates (cmp, slc, swa)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        g = self.g_proj(x).view(B, T, self.num_heads, 3).sigmoid()
        return rotary(q, self.rope_theta, positions=positions), rotary(k, self.rope_theta, positions=positions), v, g

    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None, return_selection: bool = False):
        """``x [B, T, E]`` -> ``[B, T, E]`` (with ``return_selection``, also the selected branch's
        :class:`~sparse_io_attn.Selection`). ``cu_seqlens``: packed sequences, ``x [1, total, E]``
        (flash-attention's offsets, int32/int64 ``[S + 1]``); each sequence computes what it computes
        alone."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"expected x of shape [batch, seqlen, {self.embed_dim}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        if B == 0 or T == 0:
            raise ValueError(f"NativeSparseAttention needs at least one batch element and token, got x "
                             f"{tuple(x.shape)}")
        if cu_seqlens is not None:
            return self._packed(x, cu_seqlens, return_selection)
        q, k, v, g = self.project(x)
        swa, cmp = self.layouts(T, x.device)
        selection = self.selector(q, k)
        o_slc = selection_attention(q, k, v, selection, causal=True, backend=self.backend, check=False)
        o_cmp = o_swa = None
        if cmp is not None:
            o_cmp = block_sparse_attention(q, whole_block_means(k, self.block_size),
                                           whole_block_means(v, self.block_size), cmp, backend=self.backend)
        if swa is not None:
            o_swa = block_sparse_attention(q, k, v, swa, causal=True, backend=self.backend)
        out = self._combine(o_slc, o_cmp, o_swa, g)
        return (out, selection) if return_selection else out

    def _combine(self, o_slc, o_cmp, o_swa, g):
        """``o_proj(g_slc o_slc + g_cmp o_cmp + g_swa o_swa)`` (fla's addcmul order; absent branches left out)."""
        B, T = g.shape[:2]
        o = o_slc.transpose(1, 2) * g[..., 1:2]
        if o_cmp is not None:
            o = torch.addcmul(o, o_cmp.transpose(1, 2), g[..., 0:1])
        if o_swa is not None:
            o = torch.addcmul(o, o_swa.transpose(1, 2), g[..., 2:3])
        return self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))

    def _packed(self, x: torch.Tensor, cu_seqlens, return_selection: bool):
        """The layer on packed sequences (see the class docstring)."""
        if x.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along the tokens: x [1, total, E], got "
                             f"{tuple(x.shape)}")
        T, bs = x.shape[1], self.block_size
        pk = Packed.of(cu_seqlens, x.new_empty(1, 1, T, 1), x.new_empty(1, 1, T, 1), True, "NativeSparseAttention")
        q, k, v, g = self.project(x, positions=pk.pos)
        selection = self.selector(q, k, cu_seqlens=cu_seqlens)
        o_slc = selection_attention(q, k, v, selection, causal=True, cu_seqlens=cu_seqlens, backend=self.backend,
                                    check=False)
        o_cmp = o_swa = None
        if T // bs > 0:       # each token's complete blocks of its own sequence, as compressed tokens
            off, _, start, _ = pk.blocks(bs)
            k_cmp, v_cmp = (block_means(pk.gather(t, start, bs), bs).to(t.dtype) for t in (k, v))
            j = torch.arange(T // bs, device=x.device)
            complete = torch.where(j < torch.div(pk.pos + 1, bs, rounding_mode="floor")[:, None],
                                   off[pk.seq][:, None] + j, -1)
            o_cmp = selection_attention(q, k_cmp, v_cmp, Selection(complete[None], 1), backend=self.backend,
                                        check=False)
        if self.window > 0:
            o_swa = block_sparse_attention(q, k, v, self._packed_window(pk.vl.cu_q, T, x.device), causal=True,
                                           backend=self.backend)
        out = self._combine(o_slc, o_cmp, o_swa, g)
        return (out, selection) if return_selection else out

    @torch.compiler.disable(reason="sparse_io_attn: NativeSparseAttention builds the window layout of packed "
                            "sequences from cu_seqlens (a host read)")
    def _packed_window(self, cu: torch.Tensor, T: int, device: torch.device) -> BlockSparseLayout:
        """The sliding window within each packed sequence: ``sliding_window & document`` (the last one kept)."""
        key = ("packed", tuple(int(c) for c in cu.tolist()), str(device))
        hit = self._layouts.get("packed")
        if hit is not None and hit[0] == key:
            return hit[1]
        lb = self.layout_block_size
        swa = (sliding_window(T, lb, self.window - 1, causal=True) & document(cu.cpu(), lb, causal=True)).to(device)
        plan(swa, causal=True)
        self._layouts["packed"] = (key, swa)
        return swa

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, num_blocks={self.num_blocks} "
                f"(selects {self.selected_blocks}), window={self.window}, rope_theta={self.rope_theta}, "
                f"backend={self.backend!r}")


__all__ = ["NativeSparseAttention", "rotary"]
