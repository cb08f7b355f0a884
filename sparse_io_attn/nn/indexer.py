"""`LightningIndexer`: DeepSeek Sparse Attention's indexer (DeepSeek-V3.2-Exp ``inference/model.py``,
class ``Indexer``, commit ``3b99a535``), returning the per-token :class:`~sparse_io_attn.Selection`
that ``selection_attention`` runs (``G = 1``, ``block_size = 1``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparse_io_attn.layout._args import positive_int
from sparse_io_attn.layout.selection import Selection
from sparse_io_attn.nn.selector_state import IndexKeyState
from sparse_io_attn.nn.selectors import lightning_scores, lightning_topk


def rope_freqs(rope_dim: int, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """complex64 ``[T, rope_dim / 2]``: V3.2's ``freqs_cis`` rows for ``positions`` without YaRN
    (``precompute_freqs_cis`` with ``max_seq_len <= original_seq_len``): ``polar(1, p * theta **
    (-2i / rope_dim))``. Pass a YaRN-corrected table of the model's own to the indexer instead when it
    has one."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=positions.device) / rope_dim))
    angles = torch.outer(positions.to(torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """V3.2's ``apply_rotary_emb`` on ``x [B, T, H, r]`` with ``freqs_cis [T, r / 2]`` (complex, float32
    arithmetic, result in x's dtype). ``interleaved=True``: pairs ``(x_0, x_1), (x_2, x_3), ...``
    (GPT-J, what MLA uses and the indexer used at ``3b99a535``); ``False``: pairs ``(x_i, x_{i + r/2})``
    (NeoX, the indexer after DeepSeek's fix ``8631a813``)."""
    dtype, shape = x.dtype, x.shape
    if not interleaved:
        x = x.reshape(*shape[:-1], 2, -1).transpose(-1, -2)
    xc = torch.view_as_complex(x.float().reshape(*shape[:-1], -1, 2).contiguous())
    y = torch.view_as_real(xc * freqs_cis.view(1, xc.shape[1], 1, xc.shape[-1])).flatten(3)
    if not interleaved:
        y = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)
    return y.to(dtype)


class LightningIndexer(nn.Module):
    r"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2-Exp ``inference/model.py``,
    ``Indexer``), choosing for each query token the keys the attention reads:

    .. code-block:: text

        q_I = wq_b(qr)                      [B, T, num_heads, head_dim]   qr: MLA's query latent q_norm(wq_a(x))
        k_I = LayerNorm(wk(x))              [B, T, head_dim]              one key head; eps 1e-6, float32 arithmetic
        RoPE on the FIRST rope_head_dim dims of q_I and k_I (MLA rotates its last ones)
        w   = weights_proj(x) * num_heads ** -0.5 * head_dim ** -0.5      [B, T, num_heads], signed
        I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])                float32, no softmax over s
        keys of t: the top min(top_k, p + 1) of I[t, s] over s <= p      (p: t's position)

    returned as ``Selection(indices [B, 1, T, min(top_k, Tk)], block_size=1)`` (``-1`` in unused
    slots), shared by every attention head (:func:`~sparse_io_attn.nn.selectors.lightning_topk`; ties
    go to the higher key index, where V3.2's ``torch.topk`` order is unspecified). Run it with
    ``selection_attention(q, k, v, sel, causal="bottom_right", sm_scale=<MLA's scale>)``: V3.2's
    prefill adds the causal mask to the index mask, which is this selection with causality.

    Parameter names are V3.2's (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``; no biases but the
    LayerNorm's), so the indexer's weights of a V3.2 checkpoint load after dequantisation.

    Dropped from V3.2 (the scores are otherwise V3.2's arithmetic in float32): the FP8 e4m3
    quantisation of q and k and the FP8 key cache (``act_quant``, ``fp8_index``'s scales: positive
    factors that leave exact scores unchanged; in V3.2 they make near-ties quantisation noise), and
    ``rotate_activation``, the Hadamard transform applied to q and k before quantisation (orthogonal,
    so ``q . k`` is unchanged in exact arithmetic); tensor parallelism.

    Args:
        embed_dim: ``dim`` (input of ``wk`` and ``weights_proj``).
        num_heads, head_dim: ``index_n_heads`` (64) and ``index_head_dim`` (128).
        top_k: ``index_topk`` (2048).
        q_lora_rank: input size of ``wq_b`` (MLA's ``q_lora_rank``); default ``embed_dim`` (then pass
            ``qr=None`` and the indexer reads ``x``).
        rope_head_dim: rotated dims (``qk_rope_head_dim``, 64); default ``head_dim // 2``.
        rope_theta: base of the default RoPE table (when ``freqs_cis`` is not passed).
        rope_interleaved: ``False`` (default): NeoX halves, DeepSeek's fixed indexer (upstream
            ``8631a813``); ``True``: GPT-J pairs, the indexer at ``3b99a535``.
    """

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, top_k: int, *, q_lora_rank: int | None = None,
                 rope_head_dim: int | None = None, rope_theta: float = 10000.0, rope_interleaved: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.embed_dim = positive_int(embed_dim, "embed_dim")
        self.num_heads = positive_int(num_heads, "num_heads (index heads)")
        self.head_dim = positive_int(head_dim, "head_dim (index head dim)")
        self.top_k = positive_int(top_k, "top_k (keys per query token)")
        self.q_lora_rank = embed_dim if q_lora_rank is None else positive_int(q_lora_rank, "q_lora_rank")
        self.rope_head_dim = head_dim // 2 if rope_head_dim is None else rope_head_dim
        if isinstance(self.rope_head_dim, bool) or not isinstance(self.rope_head_dim, int) \
                or not 0 <= self.rope_head_dim <= head_dim or self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim must be an even int in [0, head_dim={head_dim}], got {rope_head_dim!r}")
        self.rope_theta, self.rope_interleaved = float(rope_theta), bool(rope_interleaved)
        factory = {"device": device, "dtype": dtype}
        self.wq_b = nn.Linear(self.q_lora_rank, num_heads * head_dim, bias=False, **factory)
        self.wk = nn.Linear(embed_dim, head_dim, bias=False, **factory)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, **factory)
        self.weights_proj = nn.Linear(embed_dim, num_heads, bias=False, **factory)

    def _freqs(self, freqs_cis, start: int, T: int, device) -> torch.Tensor:
        if freqs_cis is None:
            return rope_freqs(self.rope_head_dim, torch.arange(start, start + T, device=device), self.rope_theta)
        if tuple(freqs_cis.shape) != (T, self.rope_head_dim // 2) or not freqs_cis.is_complex():
            raise ValueError(f"freqs_cis must be complex [{T}, {self.rope_head_dim // 2}] (the rows of this call's "
                             f"positions, V3.2's format), got {freqs_cis.dtype} {tuple(freqs_cis.shape)}")
        return freqs_cis

    def _rope(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        r = self.rope_head_dim
        if r == 0:
            return x
        return torch.cat([apply_rope(x[..., :r], freqs, interleaved=self.rope_interleaved), x[..., r:]], -1)

    def keys(self, x: torch.Tensor, *, freqs_cis: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """``k_I [B, T, head_dim]`` of ``x [B, T, E]`` at positions ``start..`` (post-RoPE): what a
        decoding caller keeps to pass as ``past_keys`` later."""
        k = self.wk(x)
        k = F.layer_norm(k.float(), (self.head_dim,), self.k_norm.weight.float(), self.k_norm.bias.float(),
                         self.k_norm.eps).type_as(k)
        return self._rope(k[:, :, None], self._freqs(freqs_cis, start, x.shape[1], x.device))[:, :, 0]

    def queries(self, x: torch.Tensor, qr: torch.Tensor | None = None, *, freqs_cis: torch.Tensor | None = None,
                start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_I [B, num_heads, T, head_dim] post-RoPE, weights [B, num_heads, T])``, the weights with
        V3.2's factor ``num_heads ** -0.5 * head_dim ** -0.5``."""
        B, T, _ = x.shape
        qr = x if qr is None else qr
        if qr.shape[:2] != x.shape[:2] or qr.shape[-1] != self.q_lora_rank:
            raise ValueError(f"qr must be [B, T, q_lora_rank={self.q_lora_rank}] for x {tuple(x.shape)}, got "
                             f"{tuple(qr.shape)}")
        q = self.wq_b(qr).view(B, T, self.num_heads, self.head_dim)
        q = self._rope(q, self._freqs(freqs_cis, start, T, x.device))
        w = self.weights_proj(x) * self.num_heads ** -0.5 * self.head_dim ** -0.5
        return q.transpose(1, 2), w.transpose(1, 2)

    def _inputs(self, x, qr, freqs_cis, past_keys):
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"expected x of shape [batch, seqlen, {self.embed_dim}], got {tuple(x.shape)}")
        start = 0 if past_keys is None else past_keys.shape[1]
        if past_keys is not None and (past_keys.dim() != 3 or past_keys.shape[0] != x.shape[0]
                                      or past_keys.shape[-1] != self.head_dim):
            raise ValueError(f"past_keys must be [B={x.shape[0]}, P, head_dim={self.head_dim}] (earlier "
                             f"LightningIndexer.keys), got {tuple(past_keys.shape)}")
        q, w = self.queries(x, qr, freqs_cis=freqs_cis, start=start)
        k = self.keys(x, freqs_cis=freqs_cis, start=start)
        if past_keys is not None:
            k = torch.cat([past_keys.to(k.dtype), k], 1)
        return q, k, w

    def index_scores(self, x: torch.Tensor, qr: torch.Tensor | None = None, *, freqs_cis: torch.Tensor | None = None,
                     past_keys: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[B, T, P + T]``: ``I[t, s]`` against the ``P`` past keys and this call's, no mask."""
        return lightning_scores(*self._inputs(x, qr, freqs_cis, past_keys))

    def forward(self, x: torch.Tensor, qr: torch.Tensor | None = None, *, freqs_cis: torch.Tensor | None = None,
                past_keys: torch.Tensor | None = None) -> Selection:
        """``x [B, T, E]`` (and ``qr [B, T, q_lora_rank]``) -> the :class:`Selection` of the ``T`` query
        tokens over the ``P + T`` keys (``past_keys [B, P, head_dim]`` from earlier :meth:`keys`
        calls; this call's tokens sit at positions ``P..P+T-1``, bottom-right). ``freqs_cis``: this
        call's rows of the model's RoPE table (complex ``[T, rope_head_dim / 2]``); default a plain
        table of base ``rope_theta``. No gradient flows through the choice."""
        with torch.no_grad():
            q, k, w = self._inputs(x, qr, freqs_cis, past_keys)
            return lightning_topk(q, k, w, self.top_k, causal="bottom_right")

    def init_state(self) -> IndexKeyState:
        """An empty decode state: the index-key cache of one sequence batch
        (:class:`~sparse_io_attn.nn.selector_state.IndexKeyState`, V3.2's ``Indexer.k_cache``)."""
        return IndexKeyState()

    def step(self, x: torch.Tensor, state: IndexKeyState, qr: torch.Tensor | None = None, *,
             freqs_cis: torch.Tensor | None = None) -> Selection:
        """Decode (or prefill, on an empty state) the ``T`` tokens ``x [B, T, E]`` at positions
        ``P..P+T-1`` (``P = state.length``): append their index keys to ``state`` and return their
        :class:`Selection` over the ``P + T`` keys, the same as :meth:`forward` with ``past_keys``
        (row for row what a prefill over the whole sequence chooses at those positions). The
        indexer scores every cached index key, ``O((P + T) * head_dim)`` per query and index head:
        DSA selects tokens, there is no per-block summary to keep."""
        if not isinstance(state, IndexKeyState):
            raise TypeError(f"LightningIndexer.step takes the state of init_state(), got {type(state).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim \
                or (state.keys is not None and x.shape[0] != state.keys.shape[0]):
            raise ValueError(f"expected x of shape [batch, seqlen, {self.embed_dim}] continuing the state's batch "
                             f"({state!r}), got {tuple(x.shape)}")
        with torch.no_grad():
            start = state.length
            q, w = self.queries(x, qr, freqs_cis=freqs_cis, start=start)
            keys = state.append(self.keys(x, freqs_cis=freqs_cis, start=start))
            return lightning_topk(q, keys, w, self.top_k, causal="bottom_right")

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"top_k={self.top_k}, q_lora_rank={self.q_lora_rank}, rope_head_dim={self.rope_head_dim}, "
                f"rope_interleaved={self.rope_interleaved}")


__all__ = ["LightningIndexer", "apply_rope", "rope_freqs"]
