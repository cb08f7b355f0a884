# Transcribed (CPU, plain PyTorch) from fla-org/flash-linear-attention,
# https://github.com/fla-org/flash-linear-attention, repository HEAD bc3b101dcb713ddc5bd8924b66754eb68b5ccf89:
#   fla/ops/nsa/naive.py     (last changed in 19bb765f555881430e83eaa92998f577a9069426)
#   fla/ops/nsa/parallel.py  (last changed in a1a6bb1f1cc69b770ccd5215ba347894f11d5a4b)
#   fla/ops/nsa/compression.py, fla/modules/rotary.py (31d15f7554bd5df05d3da6f75e09146279d2b1a8)
#   fla/ops/utils/pooling.py (81091cc6d71695e5a23e739f03bbd2fc627b72d4)
#   fla/ops/utils/index.py   (16405f24e9804f499d3987e6bebb30ed3bd010b5)
#   fla/layers/nsa.py        (last changed in a1a6bb1f1cc69b770ccd5215ba347894f11d5a4b)
#
# MIT License
# Copyright (c) 2023-2026 Songlin Yang, Yu Zhang, Zhiyuan Li
#
# Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
# associated documentation files (the "Software"), to deal in the Software without restriction,
# including without limitation the rights to use, copy, modify, merge, publish, distribute,
# sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all copies or
# substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
# NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
# NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES
# OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN
# CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""NSA reference transcriptions (test-only; see docs/notes/reference_semantics.md, section NSA).

Layout: fla's ``[B, T, H, D]`` (sequence before heads); varlen inputs are ``B == 1`` with
``cu_seqlens``. k/v have ``H`` KV heads, q has ``HQ = G * H`` heads; a KV head's selection is
shared by its G query heads.

Changes to the authors' code, all marked in place:
- ``einops.repeat(x, 'b t h d -> b t (h g) d', g=G)`` -> ``x.repeat_interleave(G, dim=2)``;
- fla's Triton ``mean_pooling`` and the ``flash_attn`` sliding-window calls -> plain-torch
  equivalents written here (``mean_pooling``, ``flash_attn_swa_torch``);
- ``.float()`` casts -> ``.to(compute_dtype)`` (default ``torch.float32`` = unchanged);
- ``naive_nsa``'s group-size assertion can be switched off (``check_group_size=False``).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# fla/ops/utils/index.py, fla/ops/utils/pooling.py
# ----------------------------------------------------------------------------------------------
def prepare_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """fla/ops/utils/index.py::prepare_lens."""
    return torch.diff(cu_seqlens)


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """fla/ops/utils/index.py::prepare_chunk_offsets (``triton.cdiv`` -> ceil division)."""
    return F.pad(-(-prepare_lens(cu_seqlens) // chunk_size), (1, 0), value=0).cumsum(-1)


def mean_pooling(x: torch.Tensor, chunk_size: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch equivalent of fla/ops/utils/pooling.py::mean_pooling (``mean_pooling_fwd_kernel``):
    ``ceil(T / chunk_size)`` chunks per sequence; each output is the float32 sum of the chunk's
    tokens divided by the number it has (``min(BT, T - i_t * BT)``: a ragged last chunk is averaged
    over its real tokens, not zero-padded), stored in x's dtype. Varlen: chunks of every sequence
    concatenated along dim 1 (offsets ``prepare_chunk_offsets``)."""
    acc = torch.promote_types(x.dtype, torch.float32)

    def pool(x_b):  # [T, H, D]
        T = x_b.shape[0]
        NT = -(-T // chunk_size)
        xp = F.pad(x_b.to(acc), (0, 0, 0, 0, 0, NT * chunk_size - T))
        sums = xp.view(NT, chunk_size, *x_b.shape[1:]).sum(1)
        counts = (T - torch.arange(NT, device=x.device) * chunk_size).clamp(max=chunk_size)
        return (sums / counts.to(acc)[:, None, None]).to(x.dtype)

    if cu_seqlens is None:
        return torch.stack([pool(x[b]) for b in range(x.shape[0])], 0)
    return torch.cat([pool(x[0, cu_seqlens[i]:cu_seqlens[i + 1]]) for i in range(len(cu_seqlens) - 1)], 0)[None]


# ----------------------------------------------------------------------------------------------
# fla/ops/nsa/naive.py
# ----------------------------------------------------------------------------------------------
def naive_nsa_selection(q, k, v, block_indices, block_size=64, scale=None, cu_seqlens=None,
                        compute_dtype=torch.float32, **kwargs):
    """fla/ops/nsa/naive.py::naive_nsa_selection (lines 26-122). Selected-branch attention given
    ``block_indices [B, TQ, H, S]`` (-1 = empty slot). Keys are GATHERED slot by slot, so a block
    listed twice contributes its keys twice; causal masking is per token (``i_i > i_q``).
    Returns ``[B, TQ, HQ, V]`` in q's dtype."""
    if 'head_first' in kwargs:
        raise DeprecationWarning(
            "head_first has been removed. Inputs must be in `[B, T, H, ...]` format.",
        )
    if scale is None:
        scale = k.shape[-1] ** -0.5

    dtype = q.dtype
    G = q.shape[2] // k.shape[2]
    BS = block_size
    k, v, block_indices = (x.repeat_interleave(G, dim=2) for x in (k, v, block_indices))  # einops.repeat
    q, k, v = map(lambda x: x.to(compute_dtype), (q, k, v))
    B = q.shape[0]

    o = torch.zeros_like(v)
    varlen = True
    if cu_seqlens is None:
        varlen = False
        TQ = TK = q.shape[1]
        cu_q = torch.cat([
            block_indices.new_tensor(range(0, B * TQ, TQ)), block_indices.new_tensor([B * TQ])
        ]).to(device=q.device)
        cu_k = torch.cat([
            block_indices.new_tensor(range(0, B * TK, TK)), block_indices.new_tensor([B * TK])
        ]).to(device=q.device)
    else:
        if isinstance(cu_seqlens, tuple):
            cu_q, cu_k = cu_seqlens
        else:
            cu_q = cu_k = cu_seqlens

    for i in range(len(cu_q) - 1):
        if not varlen:
            q_b, k_b, v_b, i_b = q[i], k[i], v[i], block_indices[i]
        else:
            TQ = cu_q[i+1] - cu_q[i]
            TK = cu_k[i+1] - cu_k[i]
            q_b, k_b, v_b, i_b = (q[0][cu_q[i]:cu_q[i+1]], k[0][cu_k[i]:cu_k[i+1]],
                                  v[0][cu_k[i]:cu_k[i+1]], block_indices[0][cu_q[i]:cu_q[i+1]])
        assert TQ == TK, "TQ != TK case is not supported in naive_nsa_selection"
        i_b = i_b.unsqueeze(-1) * BS + i_b.new_tensor(range(BS))
        # [T, S*BS, HQ]
        i_b = i_b.view(TQ, block_indices.shape[2], -1).transpose(1, 2)
        for i_q in range(TQ):
            # [HQ, D]
            q_i = q_b[i_q] * scale
            # [S*BS, HQ]
            i_i = i_b[i_q]
            # [S*BS, HQ, -1]
            k_i, v_i = map(lambda x: x.gather(0, i_i.clamp(0, TK-1).unsqueeze(-1).expand(*i_i.shape, x.shape[-1])),
                           (k_b, v_b))
            # [S*BS, HQ]
            attn = torch.einsum('h d, n h d -> n h', q_i, k_i).masked_fill(
                torch.logical_or(i_i > i_q, i_i < 0), float('-inf')).softmax(0)
            if not varlen:
                o[i, i_q] = torch.einsum('n h, n h v -> h v', attn, v_i)
            else:
                o[0][cu_q[i] + i_q] = torch.einsum('n h, n h v -> h v', attn, v_i)

    return o.to(dtype)


def naive_nsa_compression(q, k_cmp, v_cmp, block_size, scale, cu_seqlens=None, compute_dtype=torch.float32):
    """fla/ops/nsa/naive.py::naive_nsa_compression (lines 125-189). Query t attends to compressed
    block c iff ``(c + 1) * block_size - 1 <= t`` (complete blocks only); a query with no visible
    block gets output 0 and lse -inf (the Triton kernel ``parallel_nsa_compression`` gives output 0
    and lse 0 there). Returns ``(o [B, TQ, HQ, V] in q's dtype, lse [B, TQ, HQ])``."""
    dtype = q.dtype
    H = k_cmp.shape[2]
    G = q.shape[2] // H
    q, k_cmp, v_cmp = (x.to(compute_dtype) for x in (q, k_cmp, v_cmp))
    k_cmp, v_cmp = (x.repeat_interleave(G, dim=2) for x in (k_cmp, v_cmp))  # einops.repeat

    def attend(q_b, k_b, v_b):
        # q_b: [TQ, HQ, K], k_b/v_b: [TC, HQ, *]
        TQ, TC = q_b.shape[0], k_b.shape[0]
        attn = torch.einsum('t h d, c h d -> t h c', q_b, k_b) * scale
        i_t = torch.arange(TQ, device=q_b.device)[:, None]
        i_c = torch.arange(TC, device=q_b.device)[None, :]
        allow = ((i_c + 1) * block_size - 1) <= i_t
        attn = attn.masked_fill(~allow[:, None, :], float('-inf'))
        lse_b = torch.logsumexp(attn, dim=-1)
        # queries with no visible block softmax to nan -> 0
        attn = torch.nan_to_num(torch.softmax(attn, dim=-1), nan=0.0)
        o_b = torch.einsum('t h c, c h v -> t h v', attn, v_b)
        return o_b, lse_b

    if cu_seqlens is None:
        o, lse = zip(*(attend(q[i], k_cmp[i], v_cmp[i]) for i in range(q.shape[0])))
        o, lse = torch.stack(o, 0), torch.stack(lse, 0)
    else:
        cu_q, cu_k = cu_seqlens, prepare_chunk_offsets(cu_seqlens, block_size)
        o, lse = zip(*(
            attend(q[0, cu_q[i]:cu_q[i + 1]], k_cmp[0, cu_k[i]:cu_k[i + 1]], v_cmp[0, cu_k[i]:cu_k[i + 1]])
            for i in range(len(cu_q) - 1)
        ))
        o, lse = torch.cat(o, 0).unsqueeze(0), torch.cat(lse, 0).unsqueeze(0)
    return o.to(dtype), lse


def naive_nsa_topk(q, k_cmp, block_counts, block_size, scale, cu_seqlens=None):
    """fla/ops/nsa/naive.py::naive_nsa_topk (lines 192-304), verbatim (no dtype cast: the scores are
    computed in q's dtype). Per (token t, KV head): softmax over the complete blocks
    (``(c+1)*BS - 1 <= t``) of ``scale * q . k_cmp`` per query head, averaged over the group's G
    heads (NaN rows -> 0); blocks 0, ``t // BS`` and ``t // BS - 1`` forced to score 1.0; the top
    ``min(S, TC)`` by ``torch.topk`` (sorted, descending); a slot is kept iff its block is
    complete-or-forced and within the per-token quota, else -1. Returns ``[B, TQ, H, S]`` long."""
    B, TQ, HQ, _ = q.shape
    H = k_cmp.shape[2]
    G = HQ // H
    k_cmp = k_cmp.repeat_interleave(G, dim=2)  # einops.repeat

    device = q.device
    varlen = True
    if cu_seqlens is None:
        varlen = False
        TQ = q.shape[1]
        TC = k_cmp.shape[1]
        cu_q = torch.cat([torch.arange(0, B * TQ, TQ), torch.tensor([B * TQ])])
        cu_k = torch.cat([torch.arange(0, B * TC, TC), torch.tensor([B * TC])])
    else:
        assert B == 1
        if isinstance(cu_seqlens, tuple):
            cu_q, cu_k = cu_seqlens
        else:
            cu_q = cu_k = cu_seqlens
        cu_k = prepare_chunk_offsets(cu_k, block_size)

    if isinstance(block_counts, int):
        S = int(block_counts)
        assert S >= 0, "block_counts (int) must be >= 0"
    elif torch.is_tensor(block_counts):
        S = int(block_counts.max().item())
    block_indices = torch.full((B, TQ, H, S), -1, device=device, dtype=torch.long)

    for i in range(len(cu_q) - 1):
        if not varlen:
            q_b, k_b = q[i], k_cmp[i]
        else:
            TQ = (cu_q[i+1] - cu_q[i]).item()
            TC = (cu_k[i+1] - cu_k[i]).item()
            q_b, k_b = q[0][cu_q[i]:cu_q[i+1]], k_cmp[0][cu_k[i]:cu_k[i+1]]

        # [TQ, H, G, TC]
        attn = torch.einsum('t h d, c h d -> t h c', q_b, k_b).reshape(TQ, H, G, TC) * scale
        i_t = torch.arange(TQ, device=device).unsqueeze(1)
        i_c = torch.arange(TC, device=device).unsqueeze(0)
        # block c is causally visible once its last token (c + 1) * block_size - 1 is in the past
        allow_causal = ((i_c + 1) * block_size - 1) <= i_t  # [TQ, TC]
        # the first block and the query's own/previous block are always selected
        i_blk = i_t // block_size
        forced = (i_c == i_blk) | (i_c == 0) | (i_c == i_blk - 1)  # [TQ, TC]
        attn = attn.masked_fill(~allow_causal[:, None, None, :], float('-inf'))
        allow = allow_causal | forced

        probs = torch.nan_to_num(torch.softmax(attn, dim=-1), nan=0.0)  # [TQ, H, G, TC]
        scores = probs.mean(dim=2)  # [TQ, H, TC]
        scores = torch.where(forced[:, None, :], 1.0, scores)

        if isinstance(block_counts, int):
            n_sel = torch.full((TQ, H), S, dtype=torch.long, device=device)
        elif torch.is_tensor(block_counts):
            if varlen:
                assert block_counts.shape == (1, TQ, H)
                n_sel = block_counts[0].to(device=device, dtype=torch.long)
            else:
                assert block_counts.shape == (B, TQ, H)
                n_sel = block_counts[i].to(device=device, dtype=torch.long)
        else:
            raise TypeError("block_counts must be int or torch.Tensor")

        _, i_top = torch.topk(scores, k=min(S, TC), dim=-1)  # [TQ, H, min(S, TC)]

        # keep a selected block only if it is allowed and within the per-query quota, else pad with -1
        top_allowed = torch.gather(allow[:, None, :].expand(TQ, H, TC).long(), dim=-1, index=i_top).bool()
        i_s = torch.arange(S, device=device).view(1, 1, S)
        in_quota = (i_s < n_sel.unsqueeze(-1))[:, :, :TC]
        sel = torch.where(top_allowed & in_quota, i_top, torch.full_like(i_top, -1))

        if S > TC:
            sel = torch.cat((sel, torch.full((TQ, H, S - TC), -1, device=device, dtype=i_top.dtype)), dim=-1)
        if varlen:
            block_indices[0, cu_q[i]:cu_q[i+1]] = sel
        else:
            block_indices[i] = sel
    return block_indices


def flash_attn_swa_torch(q, k, v, window_size, cu_seqlens_q=None, cu_seqlens_k=None, softmax_scale=None):
    """Plain-torch stand-in for ``flash_attn_func(q, k, v, causal=True, window_size=(window_size-1, 0))``
    and its varlen twin, as naive_nsa / parallel_nsa call them (no ``softmax_scale`` passed, so
    flash-attn's default ``q.shape[-1] ** -0.5`` applies even when NSA got a custom ``scale``).
    Query i (bottom-right aligned, ``p = i + TK - TQ``) reads keys ``p - window_size + 1 .. p``;
    query head h reads KV head ``h // G``. Computed in float32 (float64 for float64 inputs)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)

    def attend(q_b, k_b, v_b):  # [TQ, HQ, D], [TK, H, D]
        TQ, TK, G = q_b.shape[0], k_b.shape[0], q_b.shape[1] // k_b.shape[1]
        s = torch.einsum('qhd,khd->hqk', q_b.to(acc), k_b.to(acc).repeat_interleave(G, 1)) * softmax_scale
        p = torch.arange(TQ, device=q.device)[:, None] + (TK - TQ)
        j = torch.arange(TK, device=q.device)[None, :]
        s = s.masked_fill(~((j <= p) & (j >= p - (window_size - 1))), float('-inf'))
        return torch.einsum('hqk,khd->qhd', s.softmax(-1), v_b.to(acc).repeat_interleave(G, 1)).to(q.dtype)

    if cu_seqlens_q is None:
        return torch.stack([attend(q[b], k[b], v[b]) for b in range(q.shape[0])], 0)
    return torch.cat([attend(q[0, cu_seqlens_q[i]:cu_seqlens_q[i + 1]], k[0, cu_seqlens_k[i]:cu_seqlens_k[i + 1]],
                             v[0, cu_seqlens_k[i]:cu_seqlens_k[i + 1]]) for i in range(len(cu_seqlens_q) - 1)], 0)[None]


def naive_nsa(q, k, v, g_cmp=None, g_slc=None, g_swa=None, block_indices=None, block_counts=16, block_size=64,
              window_size=0, scale=None, cu_seqlens=None, return_block_indices=False,
              compute_dtype=torch.float32, check_group_size=True):
    """fla/ops/nsa/naive.py::naive_nsa (lines 307-426): ``o = g_slc * o_slc + g_cmp * o_cmp +
    g_swa * o_swa`` (``torch.addcmul`` order kept). k_cmp/v_cmp = mean_pooling of the (post-RoPE)
    k/v; the selection is computed from the compression only when ``g_cmp`` is given and
    ``block_indices`` is None. The two ``flash_attn`` calls -> ``flash_attn_swa_torch``."""
    assert block_counts is not None, "block counts must be provided for selection"
    if scale is None:
        scale = k.shape[-1] ** -0.5
    if cu_seqlens is not None:
        assert q.shape[0] == 1, "batch size must be 1 when cu_seqlens are provided"
    G = q.shape[2] // k.shape[2]
    if check_group_size:
        assert G >= 16 and (G & (G - 1)) == 0, "Group size (HQ/H) must be a power of 2 and >= 16 in NSA"

    if cu_seqlens is not None:
        if isinstance(cu_seqlens, tuple):
            cu_seqlens_q, cu_seqlens_k = cu_seqlens
        else:
            cu_seqlens_q = cu_seqlens_k = cu_seqlens
    else:
        cu_seqlens_q = cu_seqlens_k = None

    k_cmp, v_cmp = mean_pooling(k, block_size, cu_seqlens), mean_pooling(v, block_size, cu_seqlens)
    o_cmp = None
    if g_cmp is not None:
        o_cmp, _ = naive_nsa_compression(
            q=q,
            k_cmp=k_cmp,
            v_cmp=v_cmp,
            block_size=block_size,
            scale=scale,
            cu_seqlens=cu_seqlens,
            compute_dtype=compute_dtype,
        )
        if block_indices is None:
            block_indices = naive_nsa_topk(
                q=q,
                k_cmp=k_cmp,
                block_counts=block_counts,
                block_size=block_size,
                scale=scale,
                cu_seqlens=cu_seqlens
            )
        else:
            warnings.warn("`block_indices` is provided, overriding the selection computed from compression")
    o = o_slc = naive_nsa_selection(q, k, v, block_indices, block_size, scale, cu_seqlens,
                                    compute_dtype=compute_dtype)
    if g_slc is not None:
        o = o_slc * g_slc.unsqueeze(-1)
    if o_cmp is not None:
        o = torch.addcmul(o, o_cmp, g_cmp.unsqueeze(-1))
    if window_size > 0:
        if cu_seqlens is not None:
            o_swa = flash_attn_swa_torch(q, k, v, window_size, cu_seqlens_q, cu_seqlens_k)
        else:
            o_swa = flash_attn_swa_torch(q, k, v, window_size)
        o = torch.addcmul(o, o_swa, g_swa.unsqueeze(-1))
    if return_block_indices:
        return o, block_indices
    else:
        return o


def parallel_nsa_reference(q, k, v, g_cmp=None, g_slc=None, g_swa=None, block_indices=None, block_counts=16,
                           block_size=64, window_size=0, scale=None, cu_seqlens=None, return_block_indices=False,
                           compute_dtype=torch.float32, check_group_size=True):
    """What fla/ops/nsa/parallel.py::parallel_nsa (the op the layer calls) computes, from the naive
    pieces. The one semantic difference from ``naive_nsa``: ``parallel_nsa_topk`` rounds the number
    of top-k slots up to ``triton.next_power_of_2(block_counts)`` and, for an int ``block_counts``,
    ``parallel_nsa_fwd_kernel`` attends to ALL those slots (``NS = S``), so ``block_counts=12``
    selects up to 16 blocks. (A tensor ``block_counts`` is honoured per token.) Scores are the
    kernel's per-group SUM of probabilities instead of the mean (same ranking; forced = G instead
    of 1.0) and ties may be broken differently by the kernel's bitonic sort."""
    if isinstance(block_counts, int):
        block_counts = _next_power_of_2(block_counts)
    return naive_nsa(q, k, v, g_cmp, g_slc, g_swa, block_indices, block_counts, block_size, window_size, scale,
                     cu_seqlens, return_block_indices, compute_dtype, check_group_size)


# ----------------------------------------------------------------------------------------------
# fla/modules/rotary.py :: rotate_half, rotary_embedding_ref, RotaryEmbedding
# ----------------------------------------------------------------------------------------------
def rotate_half(x, interleaved=False):
    """fla/modules/rotary.py::rotate_half (einops.rearrange -> stack/flatten)."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)  # '... d two -> ... (d two)'


def rotary_embedding_ref(x, cos, sin, interleaved=False):
    """fla/modules/rotary.py::rotary_embedding_ref (einops.repeat -> cat / repeat_interleave).
    cos/sin ``[T, R/2]`` broadcast over the heads axis (x is ``[..., T, H, D]``)."""
    ro_dim = cos.shape[-1] * 2
    assert ro_dim <= x.shape[-1]
    if not interleaved:  # '... d -> ... 1 (2 d)'
        cos, sin = torch.cat([cos, cos], -1).unsqueeze(-2), torch.cat([sin, sin], -1).unsqueeze(-2)
    else:  # '... d -> ... 1 (d 2)'
        cos, sin = cos.repeat_interleave(2, -1).unsqueeze(-2), sin.repeat_interleave(2, -1).unsqueeze(-2)
    return torch.cat([x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim], interleaved) * sin, x[..., ro_dim:]], -1)


def rotary_cos_sin(dim, seqlen, base=10000.0, dtype=torch.float32, device=None):
    """fla/modules/rotary.py::RotaryEmbedding._update_cos_sin_cache with the defaults the NSA layer
    uses (``scale_base=None``, ``pos_idx_in_fp32=True``, ``interleaved=False``): inv_freq, positions
    and their outer product in float32, cos/sin then cast to the activations' dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    t = torch.arange(seqlen, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def fla_rotary(q, k, base=10000.0, seqlen_offset=0, cu_seqlens=None, max_seqlen=None):
    """``RotaryEmbedding(dim=head_dim, base=rope_theta)(q, k, seqlen_offset, cu_seqlens, max_seqlen)``
    as fla/layers/nsa.py calls it (no cache: offset 0). NeoX layout (rotate the two halves), whole
    head_dim rotated. Position of a token = its index inside its own sequence (varlen restarts at 0)
    + seqlen_offset. The Triton kernel (``rotary_embedding_kernel``) loads x and the cos/sin table
    (already in x's dtype), computes in float32 and stores in x's dtype; this does the same (float64
    stays float64 here, where the kernel would round to float32)."""
    T = q.shape[1]
    dim = q.shape[-1]
    seqlen = max_seqlen if max_seqlen is not None else T + seqlen_offset
    cos, sin = rotary_cos_sin(dim, seqlen, base, dtype=q.dtype, device=q.device)
    acc = torch.promote_types(q.dtype, torch.float32)
    if cu_seqlens is None:
        pos = torch.arange(T, device=q.device) + seqlen_offset
    else:
        pos = torch.cat([torch.arange(int(cu_seqlens[i + 1] - cu_seqlens[i]), device=q.device)
                         for i in range(len(cu_seqlens) - 1)]) + seqlen_offset
    c, s = cos[pos].to(acc), sin[pos].to(acc)
    return tuple(rotary_embedding_ref(x.to(acc), c, s).to(x.dtype) for x in (q, k))


# ----------------------------------------------------------------------------------------------
# fla/layers/nsa.py :: NativeSparseAttention.forward (no cache, no attention_mask)
# ----------------------------------------------------------------------------------------------
def nsa_layer_reference(hidden_states, q_proj_weight, k_proj_weight, v_proj_weight, g_proj_weight, o_proj_weight, *,
                        num_heads, num_kv_heads, head_dim, block_size=64, block_counts=16, window_size=512,
                        rope_theta=10000.0, max_position_embeddings=None, q_proj_bias=None, k_proj_bias=None,
                        v_proj_bias=None, cu_seqlens=None, compute_dtype=torch.float32, check_group_size=True,
                        return_block_indices=False):
    """fla/layers/nsa.py::NativeSparseAttention.forward (lines 72-161, commit a1a6bb1f) from explicit
    weights (``nn.Linear`` layout ``[out, in]``), for ``past_key_values=None`` and
    ``attention_mask=None`` (``cu_seqlens`` packed input with B == 1 is supported):

        q = q_proj(x) -> [B, T, HQ, D];  k, v = k_proj(x), v_proj(x) -> [B, T, H, D]
        g = g_proj(x) -> [B, T, HQ, 3]   ('... (h d) -> ... h d', d=3: row h*3 + j, j = cmp, slc, swa)
        q, k = RoPE(q, k)                 (fla RotaryEmbedding, NeoX halves, base rope_theta)
        g_cmp, g_slc, g_swa = sigmoid(g).unbind(-1)
        o = parallel_nsa(q, k, v, g_cmp, g_slc, g_swa, block_size, block_counts, window_size, cu_seqlens)
        out = o_proj(o.reshape(B, T, HQ * D))   (no bias)

    ``parallel_nsa`` -> ``parallel_nsa_reference`` (see its docstring: int block_counts rounded up to
    a power of two). ``scale`` is never passed by the layer: ``head_dim ** -0.5`` everywhere."""
    batch_size, q_len, _ = hidden_states.size()
    q = F.linear(hidden_states, q_proj_weight, q_proj_bias).unflatten(-1, (-1, head_dim))
    k = F.linear(hidden_states, k_proj_weight, k_proj_bias).unflatten(-1, (-1, head_dim))
    v = F.linear(hidden_states, v_proj_weight, v_proj_bias).unflatten(-1, (-1, head_dim))
    g = F.linear(hidden_states, g_proj_weight).unflatten(-1, (-1, 3))
    assert q.shape[2] == num_heads and k.shape[2] == num_kv_heads

    seqlen_offset, max_seqlen = 0, q_len
    if max_position_embeddings is not None:
        max_seqlen = max(max_seqlen, max_position_embeddings)
    q, k = fla_rotary(q, k, base=rope_theta, seqlen_offset=seqlen_offset, cu_seqlens=cu_seqlens,
                      max_seqlen=max_seqlen)

    g_cmp, g_slc, g_swa = g.sigmoid().unbind(-1)
    o = parallel_nsa_reference(q=q, k=k, v=v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_size=block_size,
                               block_counts=block_counts, window_size=window_size, cu_seqlens=cu_seqlens,
                               return_block_indices=return_block_indices, compute_dtype=compute_dtype,
                               check_group_size=check_group_size)
    if return_block_indices:
        o, block_indices = o
    o = o.reshape(batch_size, q_len, -1)
    o = F.linear(o, o_proj_weight)
    return (o, block_indices) if return_block_indices else o


def nsa_layer_reference_from_state_dict(hidden_states, state_dict, prefix="", **config):
    """``nsa_layer_reference`` reading fla's parameter names (``q_proj.weight``, ``k_proj.weight``,
    ``v_proj.weight``, ``g_proj.weight``, ``o_proj.weight``, optional ``{q,k,v}_proj.bias``)."""
    w = {n: state_dict.get(prefix + n) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight",
                                                 "o_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias")}
    return nsa_layer_reference(hidden_states, w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"],
                               w["g_proj.weight"], w["o_proj.weight"], q_proj_bias=w["q_proj.bias"],
                               k_proj_bias=w["k_proj.bias"], v_proj_bias=w["v_proj.bias"], **config)


__all__ = ["flash_attn_swa_torch", "fla_rotary", "mean_pooling", "naive_nsa", "naive_nsa_compression",
           "naive_nsa_selection", "naive_nsa_topk", "nsa_layer_reference", "nsa_layer_reference_from_state_dict",
           "parallel_nsa_reference", "prepare_chunk_offsets", "rotary_cos_sin", "rotary_embedding_ref"]
