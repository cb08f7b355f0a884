"""Selectors: callables ``(q, k)`` that choose, from the activations at every forward, which keys each
query attends (:class:`~sparse_io_attn.nn.SparseSelfAttention`'s ``selector=``, the Hugging Face
integration's ``"moba:..."`` and ``"pooled_topk:..."`` specs). They sit above the ops and below the
layers: a selector returns what an op runs.

Per query token (a :class:`~sparse_io_attn.layout.selection.Selection`, run by
:func:`~sparse_io_attn.selection_attention`), reproducing published selectors from their authors'
reference code (``docs/notes/reference_semantics.md``; the tests compare with transcriptions of it):

* :func:`moba`: MoBA (MoonshotAI/MoBA ``moba_naive.py``), per query token and query head (``G = Hq``).
* :func:`nsa`: Native Sparse Attention's block top-k (fla-org/flash-linear-attention
  ``fla/ops/nsa/naive.py::naive_nsa_topk``), per query token and KV head (``G = Hkv``).
* :func:`lightning_topk`: DeepSeek Sparse Attention's token top-k from lightning-indexer scores
  (DeepSeek-V3.2-Exp ``inference/model.py::Indexer``), per query token, shared by all heads
  (``G = 1``, ``block_size = 1``); :class:`~sparse_io_attn.nn.LightningIndexer` computes the scores.

Per query block (a :class:`~sparse_io_attn.layout.core.BlockSparseLayout`, run by
:func:`~sparse_io_attn.block_sparse_attention`):

* :func:`pooled_topk`: this library's own pooled selection (mean-pooled query block times mean-pooled
  key blocks, one choice per query block and KV head). It is *not* MoBA's or NSA's rule.

Every selector runs on the activations' device with tensor operations of shapes fixed by the inputs'
shapes (no host synchronisation), so it traces under ``torch.compile(fullgraph=True)`` and a new
selection of the same shapes does not recompile. Selections carry no gradient (the references' gates
are hard top-k choices): the selectors read ``q.detach()`` and ``k.detach()``. Among equal scores
the per-token selectors keep the **higher** block (or token) index, the more recent keys, on every
device (:func:`~sparse_io_attn.layout.patterns.ranked_topk` with ``ties="higher"``); the references
call ``torch.topk``, whose order among equal values is unspecified (it differs between CPU and CUDA
and with the row length), so any tie-break is one the reference may produce.

Decoding: the block selectors keep a per-(layer, cache) state of per-block key summaries
(``state = sel.init_state()``, ``sel.step(q_new, k_new, state)``;
:class:`~sparse_io_attn.nn.selector_state.BlockKeyState`), so a step of ``n`` new tokens costs
``O(n x key blocks x D)`` and reads no cached key; MoBA's and NSA's steps choose what their prefill
chooses at the same positions (``docs/notes/selector_decode_state.md``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sparse_io_attn.layout._args import positive_int
from sparse_io_attn.layout.causal import causal_offset
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.patterns.selection import ranked_topk, topk
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.nn.selector_state import BlockKeyState
from sparse_io_attn.selection.varlen import Varlen, block_offsets, sequence_of, varlen_of


def _check_qk(q: torch.Tensor, k: torch.Tensor, who: str) -> None:
    """``q [B, Hq, Nq, D]`` and ``k [B, Hkv, Nk, D]`` with ``Hq`` a multiple of ``Hkv``, nothing empty."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError(f"{who} takes tensors q and k, got {type(q).__name__} and {type(k).__name__}")
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] \
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{who} takes q [B, Hq, Nq, D] and k [B, Hkv, Nk, D] with Hq a multiple of Hkv, "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.device != k.device:
        raise ValueError(f"{who} takes q and k on one device, got q on {q.device} and k on {k.device}; move them "
                         f"together (.to(device))")
    if 0 in (q.shape[0], q.shape[2], k.shape[2]):
        raise ValueError(f"{who} chooses for at least one query and key position and batch element, got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}; an empty batch or sequence has nothing to "
                         f"select (SparseSelfAttention returns its empty output)")


def _positions(causal, seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """int64 ``[Nq]``: the key position of each query row (``t + delta`` of the causal offset)."""
    return torch.arange(seqlen_q, device=device) + causal_offset(causal, seqlen_q, seqlen_k)


def _causal_only(causal, who: str):
    causal_offset(causal, 1, 1)   # ValueError naming the accepted modes
    if causal is False or causal is None:
        raise ValueError(f"{who} is causal by definition (its reference has no non-causal form): pass causal=True "
                         f"('top_left') or 'bottom_right', or use pooled_topk(..., causal=False)")
    return causal


# ------------------------------------------------------------------------------- packed sequences
class Packed:
    """A selector call on packed sequences (``cu_seqlens``, :mod:`sparse_io_attn.selection.varlen`):
    ``q [1, Hq, Tq, D]``, ``k [1, Hkv, Tk, D]``. Each query token's sequence and its **local** key
    position ``pos`` (``t - cu_q[s]``, plus ``len_k - len_q`` bottom-right); per key-block size, the
    sequences' blocks numbered globally (``offsets``: each sequence's first block; ``nkb`` slots,
    :func:`~sparse_io_attn.selection.varlen.capacity`) with their first keys and key counts. A
    selector scores against every global block and keeps the ones of the token's own sequence
    (:meth:`same`), then returns local block numbers (:meth:`local`); all tensor operations."""

    def __init__(self, vl: Varlen, seqlen_q: int, seqlen_k: int, device):
        self.vl, self.seqlen_k = vl, seqlen_k
        t = torch.arange(seqlen_q, device=device)
        self.seq = sequence_of(vl.cu_q, t)
        self.pos = t - vl.cu_q[self.seq]
        if vl.causal == "bottom_right":
            self.pos = self.pos + (vl.cu_k.diff() - vl.cu_q.diff())[self.seq]

    @classmethod
    def of(cls, cu_seqlens, q: torch.Tensor, k: torch.Tensor, causal, who: str) -> "Packed":
        if q.shape[0] != 1:
            raise ValueError(f"{who} with cu_seqlens takes the packed sequences as q [1, Hq, total, D], got batch "
                             f"{q.shape[0]}")
        return cls(varlen_of(cu_seqlens, q.shape[2], k.shape[2], causal, q.device), q.shape[2], k.shape[2], q.device)

    def blocks(self, bs: int):
        """``(offsets [S + 1], block's sequence [nkb], first key [nkb], keys [nkb])`` of blocks of ``bs``."""
        cu = self.vl.cu_k.clamp(0, self.seqlen_k)
        off = block_offsets(cu, bs)
        nkb = self.seqlen_k // bs + self.vl.num_sequences
        g = torch.arange(nkb, device=cu.device)
        s = sequence_of(off, g)
        start = cu[s] + (g - off[s]) * bs
        count = torch.where(g < off[-1], torch.minimum(cu[s + 1] - start, torch.tensor(bs, device=cu.device)), 0)
        return off, s, start, count

    def gather(self, x: torch.Tensor, start: torch.Tensor, bs: int) -> torch.Tensor:
        """``x [B, H, Tk, D]`` -> ``[B, H, nkb * bs, D]``: each block's ``bs`` keys from its start (past
        the block's keys: any key; callers use whole blocks only)."""
        key = (start[:, None] + torch.arange(bs, device=start.device)).clamp(0, max(self.seqlen_k - 1, 0))
        return x.index_select(2, key.reshape(-1))

    def same(self, block_seq: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """bool ``[Tq, nkb]``: the blocks (holding keys) of each query token's sequence."""
        return (block_seq[None, :] == self.seq[:, None]) & (count > 0)

    def local(self, chosen: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """Global block numbers ``[..., Tq, K]`` (``-1`` empty) -> local ones of each token's sequence."""
        return torch.where(chosen >= 0, chosen - off[self.seq][:, None], -1)


def _check_step(q: torch.Tensor, k: torch.Tensor, state, kind: str, params: tuple) -> None:
    """A decode step's ``q [B, Hq, n, D]`` and ``k [B, Hkv, n, D]``: the ``n`` new tokens' queries and
    keys (as many of each), and a state made by this selector (its kind and parameters; the keys'
    batch, heads, dtype and device are checked as they are appended)."""
    _check_qk(q, k, kind)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{kind}.step takes the new tokens' queries and keys, as many of each (the cached keys "
                         f"live in the state), got q {tuple(q.shape)} and k {tuple(k.shape)}")
    BlockKeyState.check(state, kind, params, f"{kind}.step")


def _new_state(kind: str, params: tuple, block_size: int, summarise, keys) -> BlockKeyState:
    """A selector's empty state, or one holding ``keys [B, Hkv, N, D]`` (``O(N * D)`` once)."""
    state = BlockKeyState(kind, block_size, summarise, params)
    return state if keys is None else state.append(keys, f"{kind}.init_state")


def _summaries(state: BlockKeyState, like: torch.Tensor, dtype) -> torch.Tensor:
    """The state's complete-block summaries, or an empty ``[B, Hkv, 0, D]`` before the first block."""
    if state.summaries is not None:
        return state.summaries
    return like.new_zeros(*like.shape[:2], 0, like.shape[3], dtype=dtype)


# ------------------------------------------------------------------------------------ pooled top-k
def block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [B, H, N, D]`` -> the mean of each block of ``block`` positions, ``[B, H, ceil(N / block), D]``
    (the last, ragged block averages the positions it has), in float32.

    One average pool over the positions (``ceil_mode``: the ragged window divides by what it has),
    which on CPU runs about twice as fast as a mean over a block axis of the same tensor."""
    B, H, N, D = x.shape
    if N == 0:
        return x.new_zeros(B, H, 0, D, dtype=torch.float32)
    means = F.avg_pool1d(x.float().reshape(B * H, N, D).transpose(1, 2), block, ceil_mode=True)
    return means.transpose(1, 2).unflatten(0, (B, H))


def whole_block_means(x: torch.Tensor, block: int) -> torch.Tensor:
    """fla's ``mean_pooling`` over the whole blocks of ``x [B, H, N, D]``: ``[B, H, N // block, D]``,
    each a float32 mean of its ``block`` positions stored in x's dtype (differentiable). The ragged
    last block, which fla also pools, is never attended or scored (it is never complete)."""
    nf = x.shape[2] // block
    return block_means(x[:, :, :nf * block], block).to(x.dtype)


class PooledTopKSelector:
    """This library's pooled block top-k (not a published method's rule): each query *block* reads its
    own key block and the ``top_k - 1`` other key blocks whose mean-pooled keys score highest against
    the block's mean-pooled queries, never a block wholly in the causal future.

    One choice per query block and **KV head**: the query heads of a GQA group pool their queries
    together (the mean over the group), so the layout holds ``Hkv`` head masks and every backend
    applies each to its group. Scores are float32, unscaled; ties go to the lower block index
    (:func:`~sparse_io_attn.layout.patterns.topk`). Returns a :class:`BlockSparseLayout`; use it with
    ``causal=True`` on the attention (the diagonal block is then masked element-wise); ``causal=False``
    selects over every key block.

    How it differs from MoBA (:func:`moba`), which it was once named after: MoBA chooses per query
    *token* and per query *head*, with unpooled queries, and its own chunk is never scored.
    """

    #: returns a per-query-block BlockSparseLayout (not a per-token Selection)
    per_token = False

    def __init__(self, block_size: int, top_k: int, *, causal=True):
        self.block_size, self.top_k = positive_int(block_size, "block_size"), positive_int(top_k, "top_k")
        causal_offset(causal, 1, 1)   # ValueError naming the accepted modes
        self.causal = causal

    def with_causal(self, causal) -> "PooledTopKSelector":
        """The same selector under another causal alignment."""
        return PooledTopKSelector(self.block_size, self.top_k, causal=causal)

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Block scores ``[B, Hkv, Mq, Mk]``: pooled queries (averaged over each GQA group) times
        pooled keys."""
        return self._scores(q, block_means(k.detach(), self.block_size))

    def _scores(self, q: torch.Tensor, key_means: torch.Tensor) -> torch.Tensor:
        B, Hq, _, D = q.shape
        Hkv = key_means.shape[1]
        qb = block_means(q.detach(), self.block_size)
        qb = qb.view(B, Hkv, Hq // Hkv, qb.shape[2], D).mean(2)
        return qb @ key_means.transpose(-1, -2)

    def init_state(self, keys: torch.Tensor | None = None) -> BlockKeyState:
        """A decode state for one layer's KV cache: the float32 mean of every complete key block and
        the keys of the incomplete last one (:class:`~sparse_io_attn.nn.selector_state.BlockKeyState`);
        empty, or holding ``keys [B, Hkv, N, D]`` (a cache filled without the state: ``O(N * D)``
        once)."""
        bs = self.block_size
        return _new_state("pooled_topk", self._state_params, bs, lambda x: block_means(x, bs), keys)

    @property
    def _state_params(self) -> tuple:
        return (("block_size", self.block_size), ("top_k", self.top_k))

    def step(self, q: torch.Tensor, k: torch.Tensor, state: BlockKeyState) -> BlockSparseLayout:
        """Decode (or prefill, on an empty state) ``n`` new tokens: append their keys ``k [B, Hkv, n, D]``
        to ``state`` and return the layout of their queries ``q [B, Hq, n, D]`` over all ``Nk =
        state.length`` keys, bottom-right (the queries are the last ``n`` keys), reading the cached
        keys only through the state: ``O(n * Nk / block_size * D)``. Equal to
        ``self.with_causal("bottom_right")(q, <all Nk keys>)``: the query blocks are this call's (rows
        ``0..block_size-1`` of ``q``, ...), so a decode step's choice is the full selector's on the
        same rows, not the prefill's, whose query blocks pool queries of later tokens."""
        _check_step(q, k, state, "pooled_topk", self._state_params)
        if self.causal is False:
            raise ValueError("pooled_topk.step decodes causally (the new queries are the last keys); this "
                             "selector has causal=False")
        with torch.no_grad():
            bs = self.block_size
            state.append(k, "pooled_topk.step")
            means = [_summaries(state, k, torch.float32)]
            if state.tail.shape[2]:
                means.append(block_means(state.tail, bs))
            return topk(self._scores(q, torch.cat(means, 2)), self.top_k, bs, (q.shape[2], state.length),
                        causal="bottom_right", include_diagonal=True)

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> BlockSparseLayout:
        _check_qk(q, k, "the pooled_topk selector")
        with torch.no_grad():
            return topk(self.scores(q, k), self.top_k, self.block_size, (q.shape[2], k.shape[2]),
                        causal=self.causal, include_diagonal=True)

    def __repr__(self) -> str:
        return f"pooled_topk(block_size={self.block_size}, top_k={self.top_k}, causal={self.causal!r})"


def pooled_topk(block_size: int, top_k: int, *, causal=True) -> PooledTopKSelector:
    """The pooled block top-k selector: key blocks of ``block_size`` tokens, ``top_k`` kept per query
    block and KV head (the own block included), from mean-pooled queries and keys. See
    :class:`PooledTopKSelector`; for MoBA's own rule use :func:`moba`."""
    return PooledTopKSelector(block_size, top_k, causal=causal)


# ------------------------------------------------------------------------------------------- MoBA
class MoBASelector:
    """MoBA's chunk selection (Lu et al. 2025), as MoonshotAI/MoBA computes it
    (``moba/moba_naive.py::moba_attn_varlen_naive``, ``moba_efficient.py::moba_attn_varlen``,
    repository HEAD ``61e456bc``). Returns a :class:`Selection` with one selection per query token
    **and per query head** (``indices [B, Hq, Nq, K]``, ``G = Hq``, ``block_size = chunk_size``,
    ``K = min(top_k, Nk // chunk_size + 1)``, ``-1`` in unused slots):

    * key chunk ``n`` holds keys ``n * chunk_size .. (n + 1) * chunk_size - 1``;
    * gate ``q[t, h] . mean(k of chunk n)``, float32, unscaled, no softmax: the chunk mean is taken in
      k's dtype (a bfloat16 mean for a bfloat16 model) and then cast to float32, as MoBA does; query
      head ``h`` reads KV head ``h // (Hq // Hkv)`` (MoBA's wrapper repeats K per query head, so
      each query head chooses on its own);
    * candidates: the chunks that **end before** the query's position ``p`` (``(n + 1) * chunk_size
      <= p``); the query's own chunk ``p // chunk_size`` is always selected (MoBA forces it with
      ``+inf``) and counts toward ``top_k``, so a token reads its own chunk and the
      ``min(top_k - 1, p // chunk_size)`` best past chunks;
    * ties: among equal gates the **higher chunk index** (the more recent chunk) wins (MoBA's
      ``torch.topk`` breaks them in an unspecified, device-dependent order; this is one of the
      orders it may produce).

    Run the selection with ``selection_attention(q, k, v, sel, causal=<the same alignment>)`` and the
    default scale ``D ** -0.5``: one softmax over every kept key, causal inside the own chunk, which is
    MoBA's attention. The gate carries no gradient (MoBA's does not either).

    ``causal``: ``True``/``"top_left"`` (query row ``t`` at position ``t``) or ``"bottom_right"``
    (position ``t + Nk - Nq``: the queries are the last ``Nq`` of the keys, as in decoding with a KV
    cache). MoBA has no non-causal form; ``causal=False`` is refused.

    Where this goes beyond the reference: MoBA's wrapper (``wrapper.py``) does not run MoBA for decode
    steps (``q_len != kv_len``) but dense causal attention over the whole cache; here a decode row
    selects exactly as the same row does in prefill (the selection of a row depends only on the keys
    before it). MoBA's ``moba_topk == 1`` is the own chunk only, as in ``moba_naive.py`` (the
    efficient path returns full causal attention for it instead).
    """

    #: returns a per-token Selection
    per_token = True

    def __init__(self, chunk_size: int, top_k: int, *, causal=True):
        self.chunk_size = positive_int(chunk_size, "chunk_size (keys per MoBA chunk)")
        self.top_k = positive_int(top_k, "top_k (chunks per query, the own chunk included)")
        self.causal = _causal_only(causal, "moba")

    @property
    def block_size(self) -> int:
        """The selection's key-block size: MoBA's chunk size."""
        return self.chunk_size

    def with_causal(self, causal) -> "MoBASelector":
        """The same selector under another causal alignment."""
        return MoBASelector(self.chunk_size, self.top_k, causal=causal)

    def gate(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """MoBA's gate, float32 ``[B, Hq, Nq, Nk // chunk_size]``: ``q . mean(k of chunk n)`` over the
        whole chunks, ``-inf`` where chunk ``n`` does not end before the query (not a candidate)."""
        gate, candidate, _ = self._gate(q, k)
        return gate.masked_fill(~candidate, -math.inf)

    def _gate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(gate [B, Hq, Nq, nf] float32, candidate bool [Nq, nf], own chunk int64 [Nq])``; the own
        chunk is ``-1`` for a row without one (a position before the keys, or past them)."""
        _check_qk(q, k, "the moba selector")
        Nq, Nk = q.shape[2], k.shape[2]
        means = self._chunk_means(k.detach()[:, :, :Nk // self.chunk_size * self.chunk_size])
        pos = _positions(self.causal, Nq, Nk, q.device)
        return self._gate_from_means(q, means, pos, Nk)

    def _chunk_means(self, k: torch.Tensor) -> torch.Tensor:
        """``k [B, Hkv, m * chunk_size, D]`` -> MoBA's chunk means ``[B, Hkv, m, D]``: the mean taken in
        k's dtype (as MoBA), then cast to float32 (exact), the gate's dtype."""
        return k.unflatten(2, (k.shape[2] // self.chunk_size, self.chunk_size)).mean(3).float()

    def _gate_from_means(self, q: torch.Tensor, means: torch.Tensor, pos: torch.Tensor, seqlen_k: int):
        B, Hq, Nq, D = q.shape
        Hkv, nf, c = means.shape[1], means.shape[2], self.chunk_size
        gate = q.detach().float().view(B, Hkv, Hq // Hkv, Nq, D) @ means[:, :, None].transpose(-1, -2)
        own = torch.div(pos, c, rounding_mode="floor")
        candidate = torch.arange(nf, device=q.device) < own[:, None]                  # ends before the query
        own = torch.where((pos >= 0) & (own < math.ceil(seqlen_k / c)), own, -1)
        return gate.view(B, Hq, Nq, nf), candidate, own

    def _select(self, gate: torch.Tensor, candidate: torch.Tensor, own: torch.Tensor) -> Selection:
        B, Hq, Nq, nf = gate.shape
        own = own.expand(B, Hq, Nq)[..., None]
        past = min(self.top_k - 1, nf)
        if past == 0:
            return Selection(own.contiguous(), self.chunk_size)
        chosen = ranked_topk(gate, past, eligible=candidate, ties="higher")
        return Selection(torch.cat([own, chosen], -1), self.chunk_size)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, *, cu_seqlens=None) -> Selection:
        """The selection of ``q [B, Hq, Nq, D]`` over ``k [B, Hkv, Nk, D]``; ``cu_seqlens`` (a tensor or a
        pair): packed sequences (``B = 1``), chunks restarting at each sequence's start as in MoBA's
        ``moba_attn_varlen``, the indices local chunk numbers (run it with ``selection_attention(...,
        cu_seqlens=)``)."""
        with torch.no_grad():
            if cu_seqlens is not None:
                return self._packed(q, k, cu_seqlens)
            return self._select(*self._gate(q, k))

    def _packed(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens) -> Selection:
        """MoBA over packed sequences: the gate against every sequence's chunks, candidates and the own
        chunk in the token's sequence only (:class:`Packed`)."""
        _check_qk(q, k, "the moba selector")
        pk = Packed.of(cu_seqlens, q, k, self.causal, "the moba selector")
        cs = self.chunk_size
        off, chunk_seq, start, count = pk.blocks(cs)
        means = self._chunk_means(pk.gather(k.detach(), start, cs))             # whole chunks' means, [1, Hkv, n, D]
        B, Hq, Nq, D = q.shape
        Hkv, n = means.shape[1], means.shape[2]
        gate = (q.detach().float().view(B, Hkv, Hq // Hkv, Nq, D) @ means[:, :, None].transpose(-1, -2)).view(B, Hq, Nq, n)
        local = torch.arange(n, device=q.device) - off[chunk_seq]
        candidate = pk.same(chunk_seq, count) & ((local + 1) * cs <= pk.pos[:, None])   # ends before the query
        own = torch.div(pk.pos, cs, rounding_mode="floor")
        own = torch.where((pk.pos >= 0) & (own < (off[1:] - off[:-1])[pk.seq]), off[pk.seq] + own, -1)
        return Selection(pk.local(self._select(gate, candidate, own).indices, off), cs)

    def init_state(self, keys: torch.Tensor | None = None) -> BlockKeyState:
        """A decode state for one layer's KV cache: MoBA's mean of every complete chunk and the keys of
        the incomplete last chunk (:class:`~sparse_io_attn.nn.selector_state.BlockKeyState`); empty,
        or holding ``keys [B, Hkv, N, D]`` (a cache filled without the state: ``O(N * D)`` once).
        MoBA never scores the incomplete chunk (it is the own chunk of the rows in it, forced, and in
        the future of every earlier row), so its mean is never needed: it is taken, with the same
        operation as the prefill's, when the chunk completes."""
        return _new_state("moba", self._state_params, self.chunk_size, self._chunk_means, keys)

    @property
    def _state_params(self) -> tuple:
        return (("chunk_size", self.chunk_size), ("top_k", self.top_k))

    def step(self, q: torch.Tensor, k: torch.Tensor, state: BlockKeyState) -> Selection:
        """Decode (or prefill, on an empty state) ``n`` new tokens: append their keys ``k [B, Hkv, n, D]``
        to ``state`` and return the selection of their queries ``q [B, Hq, n, D]`` at positions
        ``Nk - n .. Nk - 1`` (``Nk = state.length`` after appending; bottom-right, whatever this
        selector's ``causal``) over the ``Nk`` keys, reading the cached keys only through the state:
        ``O(n * Nk / chunk_size * D)``. Row for row the chunks ``self(q_all, k_all)`` chooses at those
        positions (the gate of a position depends only on the complete chunks before it; its width
        ``K = min(top_k, Nk // chunk_size + 1)`` is the one of a call over ``Nk`` keys)."""
        _check_step(q, k, state, "moba", self._state_params)
        with torch.no_grad():
            state.append(k, "moba.step")
            Nk = state.length
            pos = torch.arange(Nk - q.shape[2], Nk, device=q.device)
            return self._select(*self._gate_from_means(q, _summaries(state, k, torch.float32), pos, Nk))

    def __repr__(self) -> str:
        return f"moba(chunk_size={self.chunk_size}, top_k={self.top_k}, causal={self.causal!r})"


def moba(chunk_size: int, top_k: int, *, causal=True) -> MoBASelector:
    """Exact MoBA (MoonshotAI/MoBA ``moba_naive.py``): per query token and query head, the own chunk
    plus the ``top_k - 1`` past chunks of highest ``q . mean(k)``; returns a :class:`Selection`
    (``block_size = chunk_size``). See :class:`MoBASelector`."""
    return MoBASelector(chunk_size, top_k, causal=causal)


# -------------------------------------------------------------------------------------------- NSA
class NSASelector:
    """Native Sparse Attention's block selection (Yuan et al. 2025) as fla computes it
    (fla-org/flash-linear-attention ``fla/ops/nsa/naive.py::naive_nsa_topk``, commit ``19bb765f``).
    Returns a :class:`Selection` with one selection per query token **and per KV head**, shared by
    the query heads of its group (``indices [B, Hkv, Nq, num_blocks]``, ``G = Hkv``,
    ``block_size``-key blocks), listed by decreasing score, ``-1`` padding after:

    * compressed keys: the mean of each whole block of ``block_size`` keys (fla's ``mean_pooling``: a
      float32 sum divided by the block's length, stored in k's dtype). Pass post-RoPE ``q`` and ``k``,
      as fla's layer does;
    * scores: per query head, ``softmax(sm_scale * q . k_cmp)`` over the **complete** blocks of the
      query's position ``p`` (``(c + 1) * block_size - 1 <= p``, the own block included when ``p`` is
      its last token), computed in q's dtype like fla's naive code (a row without a complete block
      scores 0), then **averaged** over the group's query heads; ``sm_scale`` defaults to
      ``head_dim ** -0.5``;
    * forced blocks: block 0, the own block ``p // block_size`` and the one before it score 1.0 and
      count toward ``num_blocks``;
    * the top ``min(num_blocks, ceil(Nk / block_size))`` blocks by score; a slot is kept iff its
      block is complete or forced (blocks in the future are never kept); ties go to the **higher
      block index** (fla's ``torch.topk`` order among equal scores is unspecified; its Triton kernel
      uses a bitonic sort). So when ``num_blocks < 3`` and three blocks are forced (all score 1.0)
      the own block is kept first, then the previous one, then block 0.

    Query row ``t`` sits at position ``t + Nk - Nq`` (bottom-right: prefill when ``Nq == Nk``, the
    last rows of a longer key sequence in decoding); run the selection with
    ``selection_attention(..., causal="bottom_right")`` (``True`` when ``Nq == Nk``) and the same
    ``sm_scale``. A repeated block would count twice in fla's gathering references; this selection
    never repeats one, so the two agree.

    fla's layer calls ``parallel_nsa``, which rounds ``block_counts`` up to a power of two; this
    selector takes ``num_blocks`` as given (as ``naive_nsa_topk``);
    :class:`~sparse_io_attn.nn.NativeSparseAttention` applies the layer's rounding. A per-token
    tensor ``block_counts`` is not supported.
    """

    causal = "bottom_right"
    #: returns a per-token Selection
    per_token = True

    def __init__(self, block_size: int = 64, num_blocks: int = 16, *, sm_scale: float | None = None):
        self.block_size = positive_int(block_size, "block_size (keys per selected and compressed block)")
        self.num_blocks = positive_int(num_blocks, "num_blocks (blocks selected per token, forced ones included)")
        if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))
                                     or not math.isfinite(sm_scale)):
            raise ValueError(f"sm_scale must be a finite number or None (head_dim ** -0.5), got {sm_scale!r}")
        self.sm_scale = sm_scale

    def with_causal(self, causal) -> "NSASelector":
        """This selector (NSA is bottom-right by definition, which a prefill's ``True`` equals);
        ``causal=False`` raises ``ValueError`` (NSA has no non-causal form)."""
        _causal_only(causal, "nsa")
        return self

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, Nq, ceil(Nk / block_size)]`` in q's dtype: the group-mean block probabilities over
        complete blocks (0 elsewhere), 1.0 on forced blocks."""
        _check_qk(q, k, "the nsa selector")
        return self._scores(q, whole_block_means(k.detach(), self.block_size), k.shape[2])   # fla's mean_pooling

    def _scores(self, q: torch.Tensor, k_cmp: torch.Tensor, seqlen_k: int) -> torch.Tensor:
        """:meth:`scores` from the compressed keys ``k_cmp [B, Hkv, Nk // block_size, D]``."""
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k_cmp.shape[1], seqlen_k
        bs = self.block_size
        nf, nc = Nk // bs, math.ceil(Nk / bs)
        q = q.detach()
        scale = D ** -0.5 if self.sm_scale is None else self.sm_scale
        attn = (q.view(B, Hkv, Hq // Hkv, Nq, D) @ k_cmp[:, :, None].transpose(-1, -2)) * scale
        complete, forced = self._blocks(Nq, Nk, q.device)
        probs = torch.softmax(attn.masked_fill(~complete[:, :nf], -math.inf), dim=-1)
        scores = F.pad(torch.nan_to_num(probs, nan=0.0).mean(2), (0, nc - nf))      # [B, Hkv, Nq, nc]
        return torch.where(forced, 1.0, scores)

    def _blocks(self, seqlen_q: int, seqlen_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """bool ``[Nq, ceil(Nk / block_size)]`` each: ``(complete, forced)`` (block 0, own - 1, own)."""
        bs = self.block_size
        pos = _positions("bottom_right", seqlen_q, seqlen_k, device)[:, None]
        col = torch.arange(math.ceil(seqlen_k / bs), device=device)
        own = torch.div(pos, bs, rounding_mode="floor")
        forced = ((col == own) | (col == 0) | (col == own - 1)) & (pos >= 0)
        return (col + 1) * bs - 1 <= pos, forced

    def allowed(self, seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
        """bool ``[Nq, ceil(Nk / block_size)]``: the blocks a row may keep (complete or forced)."""
        complete, forced = self._blocks(seqlen_q, seqlen_k, device)
        return complete | forced

    def __call__(self, q: torch.Tensor, k: torch.Tensor, *, cu_seqlens=None) -> Selection:
        """The selection of ``q [B, Hq, Nq, D]`` over ``k [B, Hkv, Nk, D]``; ``cu_seqlens`` (a tensor or a
        pair): packed sequences (``B = 1``), blocks and compressed keys restarting at each sequence's
        start as in fla's ``naive_nsa_topk(..., cu_seqlens=)``, the indices local block numbers (run
        it with ``selection_attention(..., cu_seqlens=)``)."""
        with torch.no_grad():
            if cu_seqlens is not None:
                return self._packed(q, k, cu_seqlens)
            return self._choose(self.scores(q, k), q.shape[2], k.shape[2], q.device)

    def _packed(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens) -> Selection:
        """NSA over packed sequences: scores against every sequence's compressed blocks, softmax over the
        complete ones of the token's sequence, forced and chosen blocks there only (:class:`Packed`)."""
        _check_qk(q, k, "the nsa selector")
        pk = Packed.of(cu_seqlens, q, k, "bottom_right", "the nsa selector")
        bs = self.block_size
        off, block_seq, start, count = pk.blocks(bs)
        k_cmp = block_means(pk.gather(k.detach(), start, bs), bs).to(k.dtype)   # fla's mean_pooling, whole blocks
        B, Hq, Nq, D = q.shape
        Hkv, n = k_cmp.shape[1], k_cmp.shape[2]
        scale = D ** -0.5 if self.sm_scale is None else self.sm_scale
        attn = (q.detach().view(B, Hkv, Hq // Hkv, Nq, D) @ k_cmp[:, :, None].transpose(-1, -2)) * scale
        local, pos = torch.arange(n, device=q.device) - off[block_seq], pk.pos[:, None]
        same = pk.same(block_seq, count)
        own = torch.div(pos, bs, rounding_mode="floor")
        complete = same & ((local + 1) * bs - 1 <= pos)
        forced = same & ((local == own) | (local == 0) | (local == own - 1)) & (pos >= 0)
        probs = torch.softmax(attn.masked_fill(~complete, -math.inf), dim=-1)
        scores = torch.where(forced, 1.0, torch.nan_to_num(probs, nan=0.0).mean(2))
        chosen = ranked_topk(scores, min(self.num_blocks, n), eligible=complete | forced, ties="higher")
        if self.num_blocks > n:
            chosen = F.pad(chosen, (0, self.num_blocks - n), value=-1)
        return Selection(pk.local(chosen, off), bs)

    def init_state(self, keys: torch.Tensor | None = None) -> BlockKeyState:
        """A decode state for one layer's KV cache: fla's compressed key (``mean_pooling``) of every
        complete block and the keys of the incomplete last block
        (:class:`~sparse_io_attn.nn.selector_state.BlockKeyState`); empty, or holding ``keys [B, Hkv,
        N, D]``. NSA compresses and scores complete blocks only (an incomplete block is only ever
        kept as a forced one, unscored), so the state never pools a partial block."""
        bs = self.block_size
        return _new_state("nsa", self._state_params, bs, lambda x: whole_block_means(x, bs), keys)

    @property
    def _state_params(self) -> tuple:
        return (("block_size", self.block_size), ("num_blocks", self.num_blocks), ("sm_scale", self.sm_scale))

    def step(self, q: torch.Tensor, k: torch.Tensor, state: BlockKeyState) -> Selection:
        """Decode (or prefill, on an empty state) ``n`` new tokens: append their keys ``k [B, Hkv, n, D]``
        to ``state`` and return the selection of their queries ``q [B, Hq, n, D]`` (the last ``n``
        of the ``Nk = state.length`` keys, bottom-right as always for NSA), reading the cached keys
        only through the state: ``O(n * Nk / block_size * D)``. Row for row the blocks
        ``self(q_all, k_all)`` chooses at those positions; indices ``[B, Hkv, n, num_blocks]``."""
        _check_step(q, k, state, "nsa", self._state_params)
        with torch.no_grad():
            state.append(k, "nsa.step")
            Nk = state.length
            return self._choose(self._scores(q, _summaries(state, k, k.dtype), Nk), q.shape[2], Nk, q.device)

    def _choose(self, scores: torch.Tensor, seqlen_q: int, seqlen_k: int, device) -> Selection:
        nc = scores.shape[-1]
        chosen = ranked_topk(scores, min(self.num_blocks, nc), eligible=self.allowed(seqlen_q, seqlen_k, device),
                             ties="higher")
        if self.num_blocks > nc:
            chosen = F.pad(chosen, (0, self.num_blocks - nc), value=-1)
        return Selection(chosen, self.block_size)

    def __repr__(self) -> str:
        return f"nsa(block_size={self.block_size}, num_blocks={self.num_blocks}, sm_scale={self.sm_scale!r})"


def nsa(block_size: int = 64, num_blocks: int = 16, *, sm_scale: float | None = None) -> NSASelector:
    """NSA's block top-k exactly as fla's ``naive_nsa_topk``: ``sel(q, k) -> Selection`` with
    ``indices [B, Hkv, Nq, num_blocks]`` (``-1`` padding; bottom-right when ``Nq < Nk``). See
    :class:`NSASelector`."""
    return NSASelector(block_size, num_blocks, sm_scale=sm_scale)


# -------------------------------------------------------------------------------- DSA (lightning)
def lightning_scores(index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor, *,
                     head_chunk: int = 8) -> torch.Tensor:
    """DeepSeek-V3.2's lightning-indexer score, float32 ``[B, Tq, Tk]``:
    ``I[t, s] = sum_j weights[t, j] * ReLU(index_q[t, j] . index_k[s])`` (``fp8_index`` without the
    FP8 scales, which are positive and would leave exact arithmetic unchanged).

    ``index_q [B, H_I, Tq, d]`` (post-RoPE), ``index_k [B, Tk, d]`` (one key head shared by every
    index head, post-RoPE), ``weights [B, H_I, Tq]`` (V3.2's ``weights_proj(x) * H_I ** -0.5 *
    d ** -0.5``). No causal mask here. Summed over heads ``head_chunk`` at a time (memory
    ``O(B * head_chunk * Tq * Tk)``)."""
    if index_q.dim() != 4 or index_k.dim() != 3 or weights.dim() != 3 or index_q.shape[0] != index_k.shape[0] \
            or index_q.shape[-1] != index_k.shape[-1] or tuple(weights.shape) != tuple(index_q.shape[:3]):
        raise ValueError(f"lightning scores take index_q [B, H_I, Tq, d], index_k [B, Tk, d] and weights "
                         f"[B, H_I, Tq], got {tuple(index_q.shape)}, {tuple(index_k.shape)} and "
                         f"{tuple(weights.shape)}")
    q, kt, w = index_q.detach().float(), index_k.detach().float().transpose(-1, -2)[:, None], weights.detach().float()
    H = q.shape[1]
    total = None
    for h0 in range(0, H, head_chunk):
        part = ((q[:, h0:h0 + head_chunk] @ kt).clamp_min_(0) * w[:, h0:h0 + head_chunk, :, None]).sum(1)
        total = part if total is None else total + part
    return total


def lightning_topk(index_q: torch.Tensor, index_k: torch.Tensor, weights: torch.Tensor, top_k: int, *,
                   causal="bottom_right", cu_seqlens=None) -> Selection:
    """DeepSeek Sparse Attention's selection (DeepSeek-V3.2-Exp ``inference/model.py``, ``Indexer`` and
    ``MLA``'s index mask, commit ``3b99a535``): per query token the ``min(top_k, p + 1)`` keys of
    highest :func:`lightning_scores` among the keys ``s <= p`` (``p`` the query's position), shared by
    every attention head. Returns ``Selection(indices [B, 1, Tq, min(top_k, Tk)], block_size=1)``,
    best first, ``-1`` in unused slots.

    V3.2 takes ``topk(min(index_topk, end_pos))`` over all keys and removes future ones with MLA's
    causal mask; the effective set is this one. Ties go to the **higher key index** (V3.2's
    ``torch.topk`` order among equal scores is unspecified, and its FP8 inputs make near-ties
    quantisation noise). ``causal``: ``"bottom_right"`` (default: query row ``t`` at position
    ``t + Tk - Tq``, prefill and decode alike) or ``True``/``"top_left"``. ``cu_seqlens`` (a tensor or
    a pair): packed sequences (``B = 1``), each query choosing among its own sequence's keys, the
    indices local key positions (run it with ``selection_attention(..., cu_seqlens=)``)."""
    causal = _causal_only(causal, "lightning_topk")
    top_k = positive_int(top_k, "top_k (keys per query token)")
    scores = lightning_scores(index_q, index_k, weights)
    Tq, Tk = scores.shape[1], scores.shape[2]
    if cu_seqlens is None:
        pos = _positions(causal, Tq, Tk, scores.device)
        eligible = torch.arange(Tk, device=scores.device) <= pos[:, None]
        return Selection(ranked_topk(scores, min(top_k, Tk), eligible=eligible, ties="higher")[:, None], 1)
    pk = Packed.of(cu_seqlens, index_q, index_k[:, None], causal, "lightning_topk")
    keys = torch.arange(Tk, device=scores.device)
    key_seq = sequence_of(pk.vl.cu_k, keys)
    eligible = (key_seq[None, :] == pk.seq[:, None]) & (keys - pk.vl.cu_k[key_seq] <= pk.pos[:, None])
    chosen = ranked_topk(scores, min(top_k, Tk), eligible=eligible, ties="higher")
    return Selection(pk.local(chosen, pk.vl.cu_k)[:, None], 1)


# ------------------------------------------------------------------------------------------ specs
def _nsa_selection(block_size: int, num_blocks: int, *, causal=True) -> NSASelector:
    """The ``"nsa_selection:..."`` spec: :func:`nsa` (causal by definition)."""
    return nsa(block_size, num_blocks).with_causal(causal)


#: the selector classes a spec string names (what ``config.sparse_attention`` of the Hugging Face
#: integration accepts as an object, too)
SPEC_TYPES = (MoBASelector, PooledTopKSelector, NSASelector)

#: selector spec names -> (factory, parameter names in positional order, aliases)
SPECS = {
    "moba": (moba, ("chunk_size", "top_k"), {"block": "chunk_size", "block_size": "chunk_size", "chunk": "chunk_size",
                                             "b": "chunk_size", "k": "top_k", "topk": "top_k"}),
    "pooled_topk": (pooled_topk, ("block_size", "top_k"), {"block": "block_size", "b": "block_size", "k": "top_k",
                                                           "topk": "top_k"}),
    "nsa_selection": (_nsa_selection, ("block_size", "num_blocks"),
                      {"block": "block_size", "b": "block_size", "k": "num_blocks", "top_k": "num_blocks",
                       "topk": "num_blocks", "block_counts": "num_blocks"}),
}


def is_spec(spec) -> bool:
    """Whether ``spec`` is a selector spec string (``"moba:..."``, ``"pooled_topk:..."``,
    ``"nsa_selection:..."``) rather than a static pattern's."""
    return isinstance(spec, str) and spec.strip().split(":", 1)[0].strip() in SPECS


def spec_values(spec: str, params: tuple, aliases: dict) -> dict:
    """``{parameter: int}`` of a spec string ``"name:key=value,..."`` (or positional values in the
    order of ``params``; keys through ``aliases``); every parameter required. ``ValueError`` naming the
    accepted form otherwise."""
    name, _, args = spec.strip().partition(":")
    form = f"{name.strip()}:" + ",".join(f"{p}=<int>" for p in params)
    values: dict = {}
    for i, arg in enumerate(a.strip() for a in args.split(",") if a.strip()):
        key, eq, value = arg.partition("=")
        key = aliases.get(key.strip(), key.strip()) if eq else (params[i] if i < len(params) else None)
        value = value if eq else arg
        if key not in params or key in values:
            raise ValueError(f"spec {spec!r}: unexpected argument {arg!r}; expected {form}")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"spec {spec!r}: {key} must be an int, got {value!r}") from None
    missing = [p for p in params if p not in values]
    if missing:
        raise ValueError(f"spec {spec!r} misses {missing}; expected {form}")
    return values


def from_spec(spec: str, *, causal=True):
    """A selector from a spec string: ``"moba:block=64,top_k=8"`` (exact MoBA, :func:`moba`),
    ``"pooled_topk:block=64,top_k=8"`` (:func:`pooled_topk`) or ``"nsa_selection:block=64,num_blocks=16"``
    (NSA's block top-k, :func:`nsa`), or positionally ``"moba:64,8"``; keys ``block``/``block_size``
    (``chunk`` for moba), ``top_k``/``k`` (``num_blocks`` for nsa_selection). ``ValueError`` naming
    the accepted form otherwise."""
    name = spec.strip().partition(":")[0].strip()
    if name not in SPECS:
        raise ValueError(f"unknown selector {name!r} in {spec!r}; available: {sorted(SPECS)}")
    factory, params, aliases = SPECS[name]
    return factory(**spec_values(spec, params, aliases), causal=causal)


__all__ = ["MoBASelector", "NSASelector", "Packed", "PooledTopKSelector", "SPEC_TYPES", "block_means", "from_spec",
           "is_spec", "lightning_scores", "lightning_topk", "moba", "nsa", "pooled_topk", "spec_values",
           "whole_block_means"]
