"""`NativeSparseAttention`: fla's NSA layer (fla-org/flash-linear-attention ``fla/layers/nsa.py``,
commit ``a1a6bb1f``) with each of its three branches run by this library's ops, and a KV cache;
:class:`NSAAttention`: the layer's attention without weights (``parallel_nsa`` of given ``q, k, v``
and gates), what the layer and the Hugging Face ``"nsa:"`` spec run."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from sparse_io_attn._triton.shapes import next_pow2
from sparse_io_attn.block_sparse.api import BACKENDS, block_sparse_attention
from sparse_io_attn.block_sparse.plan import plan
from sparse_io_attn.layout._args import positive_int
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.patterns.builders import document, sliding_window
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.nn.nsa_cache import NSACache, NSAState
from sparse_io_attn.nn.selectors import Packed, block_means, nsa, spec_values, whole_block_means
from sparse_io_attn.selection.api import selection_attention


def rotary(x: torch.Tensor, base: float, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """fla's ``RotaryEmbedding(dim=head_dim, base)`` on ``x [B, H, T, D]`` (NeoX halves: pair
    ``(x_i, x_{i + D/2})`` rotated by ``(offset + t) * base ** (-2i / D)``; the whole head dim), or
    by ``offset + positions[t]`` when ``positions [T]`` is given (packed sequences: each token's
    place in its own sequence).
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


#: ``"nsa:..."`` spec keys -> NSAAttention's arguments
_SPEC_PARAMS = ("block_size", "num_blocks", "window")
_SPEC_ALIASES = {"block": "block_size", "b": "block_size", "k": "num_blocks", "top_k": "num_blocks",
                 "topk": "num_blocks", "block_counts": "num_blocks", "window_size": "window", "w": "window"}
#: decode layouts an NSAAttention keeps (LRU): a step's window layout is the same at every step once the
#: cache is longer than the window, its compressed layout for ``block_size`` steps
_ROWS_CACHE_SIZE = 8
#: prefill lengths whose layouts an NSAAttention keeps (the oldest dropped first)
_PREFILL_CACHE_SIZE = 64


class NSAAttention:
    r"""NSA's attention of given ``q [B, Hq, Nq, D]``, ``k, v [B, Hkv, Nk, D]`` (post-RoPE) and sigmoid
    gates ``[B, Nq, Hq, 3]`` (cmp, slc, swa), as fla's ``parallel_nsa`` computes it; no weights.
    The queries are the **last** ``Nq`` of the ``Nk`` positions (``Nq == Nk``: a prefill;
    ``Nq < Nk``: decoding with a KV cache, as fla's kernels with ``TQ < TK``). Returns ``[B, Nq, Hq,
    D]``:

    .. code-block:: text

        o = g_slc * o_slc + g_cmp * o_cmp + g_swa * o_swa

    * ``o_cmp``: attention over the mean-pooled keys and values of the **complete** blocks of the
      query's position ``p`` (``(c + 1) * block_size - 1 <= p``), :func:`block_sparse_attention` with
      an element-exact layout of that mask; a query with no complete block gets 0 (fla's convention);
    * ``o_slc``: :func:`selection_attention` over the ``num_blocks`` blocks of
      :func:`~sparse_io_attn.nn.selectors.nsa` (per token and KV head, causal inside);
    * ``o_swa``: keys ``p - window + 1 .. p``, :func:`block_sparse_attention` with a
      ``patterns.sliding_window(.., window - 1, causal=True)`` layout (element-exact) over the last
      ``window + Nq - 1`` keys; ``window = 0`` leaves the branch out, as fla.

    Every branch uses ``sm_scale`` (default ``head_dim ** -0.5``, fla's); the selection's scores use
    the selector's (``head_dim ** -0.5``).

    Decoding: with ``state=`` (an :class:`~sparse_io_attn.nn.nsa_cache.NSAState` holding the first
    ``Nk - Nq`` tokens, from :meth:`init_state`) the call appends the ``Nq`` new tokens' keys and
    values to the state and takes the compressed keys and values and the selection from it: the cached
    keys and values are read only in the selected blocks and the window (the kernels read the kept
    blocks of ``k``, ``v`` in place), so a step costs ``O(Nq x (compressed blocks + selected blocks x
    block_size + window) x D)`` whatever the cache's length. Row for row equal to the prefill's
    (``tests/nn/test_nsa_decode.py``). The state holds detached tensors: no gradient flows through
    it (the Hugging Face path computes without a state when gradients are needed).

    Packed sequences: with ``cu_seqlens=`` (flash-attention's offsets, int32/int64 ``[S + 1]``; ``B =
    1``, ``Nq == Nk``: a packed prefill) blocks and compressed keys restart at each sequence's start
    and no branch crosses a sequence: the selected and compressed branches through
    :func:`selection_attention`'s ``cu_seqlens`` and global compressed blocks, the window through the
    window layout intersected with ``patterns.document``, built per ``cu_seqlens`` (one host read).
    Each sequence computes what it computes alone. Not with ``state=`` (``NotImplementedError``).

    Args:
        block_size, num_blocks, window: fla's ``block_size``, ``block_counts`` (an int, taken as
            given: fla's *layer* rounds it up to a power of two, see
            :attr:`NativeSparseAttention.selected_blocks`) and ``window_size``.
        backend: ``"auto"``, ``"cpu"``, ``"torch"`` or ``"triton"``, for all three branches.
        layout_block_size: block size of the sliding-window and compressed-branch layouts (any value
            computes the same result; it only changes the kernels' tiles).
    """

    #: chooses per query token (the Hugging Face integration refuses it under a model's own window)
    per_token = True
    causal = "bottom_right"

    def __init__(self, block_size: int = 64, num_blocks: int = 16, window: int = 512, *, backend: str = "auto",
                 layout_block_size: int = 64):
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be a non-negative int (0: no sliding-window branch), got {window!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.selector = nsa(block_size, num_blocks)
        self.block_size, self.num_blocks, self.window, self.backend = \
            self.selector.block_size, self.selector.num_blocks, window, backend
        self.layout_block_size = positive_int(layout_block_size, "layout_block_size")
        self._layouts: dict[tuple[int, str], tuple] = {}
        self._rows: OrderedDict[tuple, object] = OrderedDict()

    @classmethod
    def from_spec(cls, spec: str, *, backend: str = "auto") -> "NSAAttention":
        """``"nsa:block=64,num_blocks=16,window=512"`` (or positionally ``"nsa:64,16,512"``; keys
        ``block``/``block_size``, ``num_blocks``/``top_k``/``k``, ``window``/``window_size``; all
        required, ``window=0`` for no window branch). ``ValueError`` naming the form otherwise."""
        if not is_nsa_spec(spec):
            raise ValueError(f"not an NSA spec: {spec!r}; expected 'nsa:block=<int>,num_blocks=<int>,window=<int>'")
        return cls(**spec_values(spec, _SPEC_PARAMS, _SPEC_ALIASES), backend=backend)

    def with_causal(self, causal) -> "NSAAttention":
        """This attention (NSA is causal, bottom-right); ``causal=False`` raises ``ValueError``."""
        self.selector.with_causal(causal)
        return self

    def init_state(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> NSAState:
        """An empty decode state, or one holding ``keys, values [B, Hkv, N, D]`` (a cache filled
        without the state: ``O(N x D)`` once)."""
        state = NSAState(self.selector)
        if (keys is None) != (values is None):
            raise ValueError("NSAAttention.init_state takes both the cached keys and values, or neither")
        if keys is not None:
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.shape != values.shape:
                raise ValueError(f"NSAAttention.init_state takes keys and values of one shape [B, Hkv, N, D], got "
                                 f"{getattr(keys, 'shape', keys)} and {getattr(values, 'shape', values)}")
            state.keys.append(keys, "NSAAttention.init_state")
            state.values.append(values, "NSAAttention.init_state")
        return state

    # ------------------------------------------------------------------------------------ layouts
    def layouts(self, seqlen: int, device=None) -> tuple[BlockSparseLayout | None, BlockSparseLayout | None]:
        """``(sliding window [T, T] or None, compressed [T, T // block_size] or None)``: the two
        static layouts of a prefill of ``seqlen`` tokens (built once per length and device, the last
        64 lengths kept, planned, outside any ``torch.compile`` trace; run one eager forward per length
        before compiling with ``fullgraph=True``)."""
        device = torch.device("cpu" if device is None else device)
        hit = self._layouts.get((int(seqlen), str(device)))
        return hit if hit is not None else self._build_layouts(int(seqlen), device)

    @torch.compiler.disable(reason="sparse_io_attn: NSA builds its window and compression layouts per sequence "
                            "length (data-dependent); run one eager forward per length before "
                            "torch.compile(..., fullgraph=True)")
    def _build_layouts(self, T: int, device: torch.device):
        swa = self._window_layout(T, T, device)
        nf = T // self.block_size
        cmp = self._compressed_layout(torch.arange(T), nf, device) if nf else None
        self._layouts[(T, str(device))] = (swa, cmp)
        while len(self._layouts) > _PREFILL_CACHE_SIZE:
            del self._layouts[next(iter(self._layouts))]
        return swa, cmp

    def _window_layout(self, seqlen_q: int, seqlen_k: int, device) -> BlockSparseLayout | None:
        """Keys ``p - window + 1 .. p`` of the last ``seqlen_q`` of ``seqlen_k`` positions (``None``
        without the branch), built from those rows alone, planned bottom-right."""
        if self.window == 0:
            return None
        layout = sliding_window(seqlen_k, self.layout_block_size, self.window - 1, causal=True,
                                rows=(seqlen_k - seqlen_q, seqlen_k)).to(device)
        plan(layout, causal="bottom_right")
        return layout

    def _compressed_layout(self, positions: torch.Tensor, nf: int, device) -> BlockSparseLayout:
        """``[len(positions), nf]``: compressed block ``c`` for the query at position ``p`` iff the block is
        complete, ``(c + 1) * block_size - 1 <= p`` (``O(rows x nf)``), planned non-causal."""
        mask = (torch.arange(nf)[None, :] + 1) * self.block_size - 1 <= positions[:, None]
        layout = BlockSparseLayout.from_dense_mask(mask, self.layout_block_size,
                                                   name=f"nsa_complete_blocks(block_size={self.block_size})")
        layout = layout.to(device)
        plan(layout, causal=False)
        return layout

    @torch.compiler.disable(reason="sparse_io_attn: NSA decode layouts depend on the cache length")
    def _decode_layouts(self, seqlen_q: int, seqlen_k: int, device: torch.device):
        """``(window layout over the last keys, first key of that window, compressed layout)`` of a call
        whose queries are the last ``seqlen_q`` of ``seqlen_k`` positions: ``O(rows x (window +
        compressed blocks))``, never the ``seqlen_k`` grid. The window branch reads keys
        ``start = max(0, seqlen_k - seqlen_q - window + 1) ..``, the same layout at every step once the
        cache is longer; the compressed layout depends only on each row's count of complete blocks."""
        start = max(0, seqlen_k - seqlen_q - self.window + 1)
        counts = tuple((p + 1) // self.block_size for p in range(seqlen_k - seqlen_q, seqlen_k))
        swa = cmp = None
        if self.window:
            swa = self._cached(("swa", seqlen_q, seqlen_k - start, str(device)),
                               lambda: self._window_layout(seqlen_q, seqlen_k - start, device))
        if counts[-1]:
            positions = torch.tensor(counts) * self.block_size - 1             # a position with those counts
            cmp = self._cached(("cmp", counts, str(device)),
                               lambda: self._compressed_layout(positions, counts[-1], device))
        return swa, start, cmp

    def _cached(self, key: tuple, build):
        hit = self._rows.get(key)
        if hit is None:
            hit = self._rows[key] = build()
            while len(self._rows) > _ROWS_CACHE_SIZE:
                self._rows.popitem(last=False)
        self._rows.move_to_end(key)
        return hit

    # ------------------------------------------------------------------------------------ forward
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor, *,
                 state: NSAState | None = None, cu_seqlens=None, sm_scale: float | None = None,
                 backend: str | None = None, return_selection: bool = False):
        """``o [B, Nq, Hq, D]`` (with ``return_selection``, also the selected branch's
        :class:`~sparse_io_attn.Selection`); see the class docstring."""
        if cu_seqlens is not None:
            if state is not None:
                raise NotImplementedError("NSAAttention: decoding packed sequences (state= with cu_seqlens=) is not "
                                          "supported; decode each sequence with its own state, or pass cu_seqlens "
                                          "without state= for a packed prefill")
            o, selection = self.packed(q, k, v, gates, cu_seqlens, sm_scale=sm_scale, backend=backend)
            return (o, selection) if return_selection else o
        self._check(q, k, v, gates, state)
        backend = self.backend if backend is None else backend
        Nq, Nk, bs = q.shape[2], k.shape[2], self.block_size
        if state is None:
            selection = self.selector(q, k)
            k_cmp, v_cmp = whole_block_means(k, bs), whole_block_means(v, bs)       # fla's mean_pooling
        else:
            selection = self.selector.step(q, k[:, :, Nk - Nq:], state.keys)
            state.values.append(v[:, :, Nk - Nq:], "NSAAttention")
            k_cmp, v_cmp = state.compressed()
        if Nq == Nk:
            (swa, cmp), start = self.layouts(Nk, q.device), 0
        else:
            swa, start, cmp = self._decode_layouts(Nq, Nk, q.device)
        o_slc = selection_attention(q, k, v, selection, causal="bottom_right", sm_scale=sm_scale, backend=backend,
                                    check=False)
        o_cmp = o_swa = None
        if cmp is not None:
            o_cmp = block_sparse_attention(q, k_cmp, v_cmp, cmp, sm_scale=sm_scale, backend=backend)
        if swa is not None:
            o_swa = block_sparse_attention(q, k[:, :, start:], v[:, :, start:], swa, causal="bottom_right",
                                           sm_scale=sm_scale, backend=backend)
        o = _combine(o_slc, o_cmp, o_swa, gates)
        return (o, selection) if return_selection else o

    def packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor, cu_seqlens, *,
               sm_scale: float | None = None, backend: str | None = None, packed: Packed | None = None):
        """``(o [1, T, Hq, D], selection)`` of packed sequences ``q [1, Hq, T, D]``, ``k, v [1, Hkv, T,
        D]`` (see the class docstring); ``packed``: the :class:`~sparse_io_attn.nn.selectors.Packed` of
        ``cu_seqlens`` when the caller already made it (the layer, for its RoPE positions)."""
        self._check(q, k, v, gates, None)
        backend = self.backend if backend is None else backend
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"NSAAttention with cu_seqlens runs a packed prefill: q and k of one length, got q "
                             f"{tuple(q.shape)} and k {tuple(k.shape)}")
        pk = Packed.of(cu_seqlens, q, k, True, "NSAAttention") if packed is None else packed
        T, bs = q.shape[2], self.block_size
        selection = self.selector(q, k, cu_seqlens=cu_seqlens)
        o_slc = selection_attention(q, k, v, selection, causal=True, cu_seqlens=cu_seqlens, sm_scale=sm_scale,
                                    backend=backend, check=False)
        o_cmp = o_swa = None
        if T // bs > 0:       # each token's complete blocks of its own sequence, as compressed tokens
            off, _, start, _ = pk.blocks(bs)
            k_cmp, v_cmp = (block_means(pk.gather(t, start, bs), bs).to(t.dtype) for t in (k, v))
            j = torch.arange(T // bs, device=q.device)
            complete = torch.where(j < torch.div(pk.pos + 1, bs, rounding_mode="floor")[:, None],
                                   off[pk.seq][:, None] + j, -1)
            o_cmp = selection_attention(q, k_cmp, v_cmp, Selection(complete[None], 1), sm_scale=sm_scale,
                                        backend=backend, check=False)
        if self.window > 0:
            o_swa = block_sparse_attention(q, k, v, self._packed_window(pk.vl.cu_q, T, q.device), causal=True,
                                           sm_scale=sm_scale, backend=backend)
        return _combine(o_slc, o_cmp, o_swa, gates), selection

    @torch.compiler.disable(reason="sparse_io_attn: NSA builds the window layout of packed sequences from "
                            "cu_seqlens (a host read)")
    def _packed_window(self, cu: torch.Tensor, T: int, device: torch.device) -> BlockSparseLayout:
        """The sliding window within each packed sequence: ``sliding_window & document`` (kept with the
        decode layouts, LRU)."""
        lb = self.layout_block_size

        def build():
            swa = (sliding_window(T, lb, self.window - 1, causal=True) & document(cu.cpu(), lb, causal=True)).to(device)
            plan(swa, causal=True)
            return swa
        return self._cached(("packed", tuple(int(c) for c in cu.tolist()), str(device)), build)

    def _check(self, q, k, v, gates, state) -> None:
        for name, t in (("q", q), ("k", k), ("v", v), ("gates", gates)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"NSAAttention takes q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D] and gates [B, Nq, Hq, 3], "
                                 f"got {name} {getattr(t, 'shape', type(t).__name__)}")
        B, Hq, Nq, _ = q.shape
        if k.shape != v.shape:
            raise ValueError(f"NSAAttention: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if not 0 < Nq <= k.shape[2]:
            raise ValueError(f"NSAAttention: the queries are the last Nq of the Nk key positions (1 <= Nq <= Nk), got "
                             f"q {tuple(q.shape)} and k {tuple(k.shape)}")
        if tuple(gates.shape) != (B, Nq, Hq, 3):
            raise ValueError(f"NSAAttention: gates must be [B, Nq, Hq, 3] = [{B}, {Nq}, {Hq}, 3] (sigmoid of "
                             f"g_proj: cmp, slc, swa), got {tuple(gates.shape)}")
        if state is not None:
            if not isinstance(state, NSAState):
                raise TypeError(f"NSAAttention: state must be an NSAState (NSAAttention.init_state()), got "
                                f"{type(state).__name__}")
            if state.length != k.shape[2] - Nq:
                raise ValueError(f"NSAAttention: the state holds {state.length} tokens but this call has {Nq} new "
                                 f"queries over {k.shape[2]} keys (the state must hold the first Nk - Nq = "
                                 f"{k.shape[2] - Nq}); a state continues only the cache it was built with")

    def __repr__(self) -> str:
        return (f"nsa_attention(block_size={self.block_size}, num_blocks={self.num_blocks}, window={self.window}, "
                f"layout_block_size={self.layout_block_size})")


def _combine(o_slc: torch.Tensor, o_cmp: torch.Tensor | None, o_swa: torch.Tensor | None,
             gates: torch.Tensor) -> torch.Tensor:
    """``g_slc o_slc + g_cmp o_cmp + g_swa o_swa`` ``[B, Nq, Hq, D]`` of the branches' ``[B, Hq, Nq, D]``
    (fla's addcmul order; absent branches left out)."""
    o = o_slc.transpose(1, 2) * gates[..., 1:2]
    if o_cmp is not None:
        o = torch.addcmul(o, o_cmp.transpose(1, 2), gates[..., 0:1])
    if o_swa is not None:
        o = torch.addcmul(o, o_swa.transpose(1, 2), gates[..., 2:3])
    return o


def is_nsa_spec(spec) -> bool:
    """Whether ``spec`` is an NSA spec string (``"nsa:..."``)."""
    return isinstance(spec, str) and spec.strip().partition(":")[0].strip() == "nsa"


class NativeSparseAttention(nn.Module):
    r"""Native Sparse Attention (Yuan et al. 2025) as fla's layer computes it
    (``fla/layers/nsa.py::NativeSparseAttention``; semantics in ``docs/notes/reference_semantics.md``),
    over ``x [B, T, E]`` (batch first, no padding mask), with an optional KV cache:

    .. code-block:: text

        q, k, v = q_proj(x), k_proj(x), v_proj(x)            # [B, T, Hq|Hkv, head_dim]
        q, k = RoPE(q, k)                                     # fla RotaryEmbedding: NeoX halves, base rope_theta
        g_cmp, g_slc, g_swa = sigmoid(g_proj(x)).view(B, T, Hq, 3).unbind(-1)
        o = g_slc * o_slc + g_cmp * o_cmp + g_swa * o_swa    # three independent sigmoid gates
        out = o_proj(o)

    The branches are :class:`NSAAttention`'s (:attr:`attention`): compressed (mean-pooled complete
    blocks), selected (:func:`~sparse_io_attn.nn.selectors.nsa`; as fla's layer, which calls
    ``parallel_nsa``, the number of selected blocks is ``next_pow2(num_blocks)``: ``num_blocks=12``
    selects up to 16 blocks, see :attr:`selected_blocks`) and sliding window (``window = 0`` leaves it
    out, as fla). Every branch uses the scale ``head_dim ** -0.5`` (fla's layer passes none).
    Parameter names are fla's (``q_proj``, ``k_proj``, ``v_proj``, ``g_proj``, ``o_proj``; biases on
    q/k/v only with ``qkv_bias``; fla's rotary table is not a persistent buffer), so a fla
    state_dict loads with ``load_state_dict``. ``g_proj``'s output row ``3h + j`` is head ``h``'s gate
    ``j`` (cmp, slc, swa).

    KV cache: ``cache = layer.init_cache()``, then ``layer(x_prompt, cache=cache)`` and
    ``layer(x_new, cache=cache)`` for the next tokens (one, up to 16 for speculative verification, or
    any number): the new tokens sit at positions ``cache.length ..`` (RoPE included), and each row
    equals the same row of one forward over the whole sequence. The cache holds the post-RoPE keys
    and the values (:class:`~sparse_io_attn.nn.nsa_cache.NSACache`) and NSA's state (compressed keys
    and values of the complete blocks, the raw tail): a step reads the compressed blocks, its selected
    blocks and the window, never the whole cache. Inference only: a cached forward that would need
    gradients raises ``NotImplementedError`` (run it under ``torch.no_grad()``). fla's layer passes
    ``window_size`` to its cache, which then keeps only the last ``window`` tokens, so fla's
    compression and selection branches lose the earlier tokens once a decode passes the window; here
    decoding equals the prefill at every length.

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
    crosses a sequence (:meth:`NSAAttention.packed`). Not with a KV cache (``NotImplementedError``).

    Not covered: fla's 2-D ``attention_mask`` (padding), decoding packed sequences.
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
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0:
            raise ValueError(f"rope_theta must be a positive number, got {rope_theta!r}")
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.block_size = positive_int(block_size, "block_size")
        self.num_blocks = positive_int(num_blocks, "num_blocks")
        self.rope_theta = float(rope_theta)
        self.attention = NSAAttention(self.block_size, self.selected_blocks, window, backend=backend,
                                      layout_block_size=layout_block_size)
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.g_proj = nn.Linear(embed_dim, num_heads * 3, bias=False, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=False, **factory)

    @property
    def selected_blocks(self) -> int:
        """Blocks the selected branch keeps per token: ``next_pow2(num_blocks)``, as fla's layer
        (``parallel_nsa`` rounds ``block_counts`` up and its kernel attends every slot)."""
        return next_pow2(self.num_blocks)

    @property
    def selector(self):
        """The selected branch's :func:`~sparse_io_attn.nn.selectors.nsa` selector."""
        return self.attention.selector

    @property
    def window(self) -> int:
        """The sliding window's keys (0: no window branch)."""
        return self.attention.window

    @property
    def layout_block_size(self) -> int:
        """Block size of the window and compressed layouts."""
        return self.attention.layout_block_size

    @property
    def backend(self) -> str:
        """The three branches' backend (settable: ``layer.backend = "cpu"``)."""
        return self.attention.backend

    @backend.setter
    def backend(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.attention.backend = backend

    def layouts(self, seqlen: int, device=None) -> tuple[BlockSparseLayout | None, BlockSparseLayout | None]:
        """The prefill's window and compressed layouts (:meth:`NSAAttention.layouts`)."""
        return self.attention.layouts(seqlen, device)

    def init_cache(self, capacity: int | None = None) -> NSACache:
        """An empty KV cache for this layer (buffers for ``capacity`` tokens at the first append, else
        grown by doubling)."""
        if capacity is not None:
            capacity = positive_int(capacity, "capacity")
        return NSACache(self.attention.init_state(), capacity)

    def project(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None):
        """``x [B, T, E]`` -> ``(q [B, Hq, T, d], k, v [B, Hkv, T, d], gates [B, T, Hq, 3])``: projections,
        RoPE on q and k at positions ``offset ..`` (``offset + positions[t]`` when ``positions [T]`` is
        given), sigmoid gates (cmp, slc, swa)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        g = self.g_proj(x).view(B, T, self.num_heads, 3).sigmoid()
        return rotary(q, self.rope_theta, offset, positions), rotary(k, self.rope_theta, offset, positions), v, g

    def forward(self, x: torch.Tensor, *, cache: NSACache | None = None, cu_seqlens: torch.Tensor | None = None,
                return_selection: bool = False):
        """``x [B, T, E]`` -> ``[B, T, E]`` (with ``return_selection``, also the selected branch's
        :class:`~sparse_io_attn.Selection`). With ``cache``, ``x`` holds the next ``T`` tokens after
        the ``cache.length`` cached ones, which the call appends. ``cu_seqlens``: packed sequences,
        ``x [1, total, E]`` (flash-attention's offsets, int32/int64 ``[S + 1]``); each sequence computes
        what it computes alone; not with ``cache``."""
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"expected x of shape [batch, seqlen, {self.embed_dim}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        if B == 0 or T == 0:
            raise ValueError(f"NativeSparseAttention needs at least one batch element and token, got x "
                             f"{tuple(x.shape)}")
        if cu_seqlens is not None:
            o, selection = self._packed(x, cache, cu_seqlens)
        else:
            if cache is not None:
                self._check_cache(cache, x)
            q, k, v, g = self.project(x, 0 if cache is None else cache.length)
            if cache is not None:
                k, v = cache.append(k, v)
            o, selection = self.attention(q, k, v, g, state=None if cache is None else cache.state,
                                          return_selection=True)
        out = self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))
        return (out, selection) if return_selection else out

    def _packed(self, x: torch.Tensor, cache, cu_seqlens):
        """``(o [1, T, Hq, d], selection)`` of packed sequences (:meth:`NSAAttention.packed`), RoPE at each
        token's place in its own sequence."""
        if cache is not None:
            raise NotImplementedError("NativeSparseAttention: a KV cache with cu_seqlens (decoding packed sequences) "
                                      "is not supported; decode each sequence with its own cache "
                                      "(layer.init_cache()), or pass cu_seqlens without cache= for a packed prefill")
        if x.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along the tokens: x [1, total, E], got "
                             f"{tuple(x.shape)}")
        T = x.shape[1]
        pk = Packed.of(cu_seqlens, x.new_empty(1, 1, T, 1), x.new_empty(1, 1, T, 1), True, "NativeSparseAttention")
        q, k, v, g = self.project(x, positions=pk.pos)
        return self.attention.packed(q, k, v, g, cu_seqlens, packed=pk)

    def _check_cache(self, cache, x: torch.Tensor) -> None:
        if not isinstance(cache, NSACache):
            raise TypeError(f"cache must be an NSACache (layer.init_cache()), got {type(cache).__name__}")
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise NotImplementedError("NativeSparseAttention with a KV cache is inference only (the cache holds "
                                      "detached keys and values): run it under torch.no_grad() or "
                                      "torch.inference_mode(), or call the layer without cache= to train")
        if cache.length != cache.state.length:
            raise ValueError(f"the cache holds {cache.length} tokens but its NSA state {cache.state.length} (an "
                             f"earlier call failed midway?); start again from layer.init_cache()")

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, num_blocks={self.num_blocks} "
                f"(selects {self.selected_blocks}), window={self.window}, rope_theta={self.rope_theta}, "
                f"backend={self.backend!r}")


__all__ = ["NSAAttention", "NativeSparseAttention", "is_nsa_spec", "rotary"]
