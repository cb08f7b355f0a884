# Transcribed (CPU, plain PyTorch) from MoonshotAI/MoBA, https://github.com/MoonshotAI/MoBA,
# repository HEAD 61e456bc956c5a25fd9c84e5496b661329cb1b72:
#   moba/moba_naive.py      (last changed in 28458cc7909e1f15f4a66e7112b9123a63002e7d)
#   moba/moba_efficient.py  (last changed in 61e456bc956c5a25fd9c84e5496b661329cb1b72)
#   moba/wrapper.py         (last changed in 28458cc7909e1f15f4a66e7112b9123a63002e7d)
#
# The MIT License (MIT)
# Copyright (c) 2025 Moonshot AI
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
"""MoBA reference transcriptions (test-only; see docs/notes/reference_semantics.md, section MoBA).

Layout: MoBA's packed varlen layout, q/k/v ``[total_tokens, heads, head_dim]`` with ``cu_seqlens``
``[batch + 1]`` (flash-attn convention). MoBA is MHA at this level: k/v must have as many heads as
q. GQA is handled one level up, in ``moba/wrapper.py::moba_layer``: in prefill (``q_len ==
kv_len``) it ``repeat_interleave``s K and V to the query heads (``kv_replicas = q_heads //
kv_heads``) *before* calling the kernel, so every query head computes its own gate against the
(shared) K of its group and chooses its own chunks. In decode (``q_len != kv_len``) the wrapper
does NOT use MoBA at all: it calls ``flash_attn_func(q, k, v, dropout, scaling, True)``, dense
causal attention over the whole cache (a "TODO release paged attn implementation"). The wrapper
also ignores HF's ``scaling`` in prefill (the kernels always use ``head_dim ** -0.5``).

The only change to the authors' arithmetic is the optional ``compute_dtype`` keyword, which
replaces the hard-coded ``torch.float32`` casts; its default reproduces the original exactly.
"""
from __future__ import annotations

import math

import torch


# ----------------------------------------------------------------------------------------------
# moba/moba_naive.py :: moba_attn_varlen_naive (lines 7-96)
# ----------------------------------------------------------------------------------------------
def moba_attn_varlen_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    moba_chunk_size: int,
    moba_topk: int,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Transcription of MoonshotAI/MoBA ``moba/moba_naive.py::moba_attn_varlen_naive`` (commit
    28458cc7909e1f15f4a66e7112b9123a63002e7d). The original is already plain torch; copied
    statement by statement, with ``torch.float32`` -> ``compute_dtype`` (default unchanged).

    q, k, v: ``[seqlen, head, head_dim]`` (same head count), packed with ``cu_seqlens``.
    Returns ``[seqlen, head, head_dim]`` in q's dtype.
    """
    # qkv shape = [ S, H, D ]
    batch = cu_seqlens.numel() - 1
    softmax_scale = q.shape[-1] ** (-0.5)

    o = torch.zeros_like(q)
    for batch_idx in range(batch):
        batch_start = cu_seqlens[batch_idx].item()
        batch_end = cu_seqlens[batch_idx + 1].item()
        # get qkv of this batch
        q_ = q[batch_start:batch_end]
        k_ = k[batch_start:batch_end]
        v_ = v[batch_start:batch_end]
        o_ = o[batch_start:batch_end]
        # calc key gate weight
        key_gate_weight = []
        batch_size = batch_end - batch_start
        num_block = math.ceil(batch_size / moba_chunk_size)
        for block_idx in range(0, num_block):
            block_start = block_idx * moba_chunk_size
            block_end = min(batch_size, block_start + moba_chunk_size)
            key_gate_weight.append(k_[block_start:block_end].mean(dim=0, keepdim=True))
        key_gate_weight = torch.cat(key_gate_weight, dim=0)  # [ N, H, D ]
        # calc & mask gate
        # use fp32 to avoid precision issue in bf16
        q_ = q_.type(compute_dtype)
        key_gate_weight = key_gate_weight.type(compute_dtype)
        gate = torch.einsum("shd,nhd->hsn", q_, key_gate_weight)  # [ H, S, N ]
        key_gate_weight = key_gate_weight.type_as(k)
        q_ = q_.type_as(k)
        for i in range(num_block):
            # select the future Qs that can attend to KV chunk i
            gate[:, : (i + 1) * moba_chunk_size, i] = float("-inf")
            gate[:, i * moba_chunk_size : (i + 1) * moba_chunk_size, i] = float("inf")
        # gate_top_k_idx = gate_top_k_val = [ H S K ]
        gate_top_k_val, gate_top_k_idx = torch.topk(
            gate, k=min(moba_topk, num_block), dim=-1, largest=True, sorted=False
        )
        gate_top_k_val, _ = gate_top_k_val.min(dim=-1)  # [ H, S ]
        need_attend = gate >= gate_top_k_val.unsqueeze(-1)
        # add gate_idx_mask in case of there is cornercases of same topk val been selected
        gate_idx_mask = torch.zeros(
            need_attend.shape, dtype=torch.bool, device=q.device
        )
        gate_idx_mask = gate_idx_mask.scatter_(dim=-1, index=gate_top_k_idx, value=True)
        need_attend = torch.logical_and(need_attend, gate_idx_mask)
        gate[need_attend] = 0
        gate[~need_attend] = -float("inf")
        gate = gate.repeat_interleave(moba_chunk_size, dim=-1)[
            :, :, :batch_size
        ]  # [ H, S, S ]
        gate.masked_fill_(
            torch.ones_like(gate, dtype=torch.bool).tril().logical_not(), -float("inf")
        )

        # calc qk = qk^t
        q_ = q_.type(compute_dtype)
        k_ = k_.type(compute_dtype)
        v_ = v_.type(compute_dtype)
        qk = torch.einsum("xhd,yhd->hxy", q_, k_)
        # mask
        qk += gate
        qk *= softmax_scale
        # calc o
        p = qk.softmax(dim=-1)
        o_ += torch.einsum("hxy,yhd->xhd", p, v_)
        o = o.type_as(q)

    return o


def moba_naive_selection(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    moba_chunk_size: int,
    moba_topk: int,
    compute_dtype: torch.dtype = torch.float32,
) -> list[dict[str, torch.Tensor]]:
    """The chunk selection exactly as ``moba_attn_varlen_naive`` makes it (its lines 42-73, same
    statements, same ``torch.topk`` call, so the same tie-breaking), one dict per sequence:

    - ``gate``  ``[H, S, N]`` (compute_dtype): the masked gate that enters ``torch.topk``:
      ``q . mean(k of chunk n)`` (unscaled) where chunk n ends before token s (``(n+1)*chunk <= s``),
      ``+inf`` on the token's own chunk, ``-inf`` elsewhere (own chunk's future, later chunks).
    - ``topk_idx`` ``[H, S, min(topk, N)]``: the indices ``torch.topk(..., sorted=False)`` returned.
    - ``need_attend`` ``[H, S, N]`` bool: MoBA's own mask (== the top-k index set). When fewer than
      ``topk`` chunks are finite candidates it also holds some ``-inf`` (future) chunks, which the
      token-level ``tril`` later removes.
    - ``attended`` ``[H, S, N]`` bool: ``need_attend`` restricted to chunks that hold at least one
      key <= s (what actually contributes to the output).

    For a tie-aware comparison use ``gate``: a selection is MoBA-valid iff it holds the own chunk,
    ``min(topk, N) - 1`` other chunks with finite gate when that many exist (all of them otherwise),
    and no unselected finite chunk scores strictly above a selected one.
    """
    batch = cu_seqlens.numel() - 1
    out = []
    for batch_idx in range(batch):
        batch_start = cu_seqlens[batch_idx].item()
        batch_end = cu_seqlens[batch_idx + 1].item()
        q_ = q[batch_start:batch_end]
        k_ = k[batch_start:batch_end]
        key_gate_weight = []
        batch_size = batch_end - batch_start
        num_block = math.ceil(batch_size / moba_chunk_size)
        for block_idx in range(0, num_block):
            block_start = block_idx * moba_chunk_size
            block_end = min(batch_size, block_start + moba_chunk_size)
            key_gate_weight.append(k_[block_start:block_end].mean(dim=0, keepdim=True))
        key_gate_weight = torch.cat(key_gate_weight, dim=0)  # [ N, H, D ]
        q_ = q_.type(compute_dtype)
        key_gate_weight = key_gate_weight.type(compute_dtype)
        gate = torch.einsum("shd,nhd->hsn", q_, key_gate_weight)  # [ H, S, N ]
        for i in range(num_block):
            gate[:, : (i + 1) * moba_chunk_size, i] = float("-inf")
            gate[:, i * moba_chunk_size : (i + 1) * moba_chunk_size, i] = float("inf")
        gate_top_k_val, gate_top_k_idx = torch.topk(
            gate, k=min(moba_topk, num_block), dim=-1, largest=True, sorted=False
        )
        gate_top_k_val, _ = gate_top_k_val.min(dim=-1)  # [ H, S ]
        need_attend = gate >= gate_top_k_val.unsqueeze(-1)
        gate_idx_mask = torch.zeros(need_attend.shape, dtype=torch.bool, device=q.device)
        gate_idx_mask = gate_idx_mask.scatter_(dim=-1, index=gate_top_k_idx, value=True)
        need_attend = torch.logical_and(need_attend, gate_idx_mask)
        chunk_start = torch.arange(num_block, device=q.device) * moba_chunk_size  # [ N ]
        s_idx = torch.arange(batch_size, device=q.device)
        attended = need_attend & (chunk_start[None, None, :] <= s_idx[None, :, None])
        out.append(dict(gate=gate, topk_idx=gate_top_k_idx, need_attend=need_attend, attended=attended))
    return out


# ----------------------------------------------------------------------------------------------
# moba/moba_efficient.py :: calc_chunks, MixedAttention.forward, moba_attn_varlen
# ----------------------------------------------------------------------------------------------
def _flash_attn_varlen_forward_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal):
    """Plain-torch stand-in for ``flash_attn.flash_attn_interface._flash_attn_varlen_forward``
    (dropout 0, no window, no softcap): returns ``(out [total_q, H, D] in q's dtype, softmax_lse
    [H, total_q] float32)`` as flash-attn does. Causal masking is bottom-right aligned (key j visible
    to query i iff ``j <= i + Lk - Lq``), flash-attn >= 2.1's convention. Scores and softmax run in
    float32 (float64 for float64 inputs). Query head h reads K/V head ``h // (Hq // Hk)``."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    total_q, Hq, D = q.shape
    out = torch.zeros(total_q, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((Hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    G = Hq // k.shape[1]
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        if qe == qs:
            continue
        q_i = q[qs:qe].to(acc)
        k_i = k[ks:ke].to(acc).repeat_interleave(G, dim=1)
        v_i = v[ks:ke].to(acc).repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q_i, k_i) * softmax_scale
        if causal:
            Lq, Lk = qe - qs, ke - ks
            allow = torch.arange(Lk, device=q.device)[None, :] <= torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq)
            s = s.masked_fill(~allow, float("-inf"))
        lse[:, qs:qe] = torch.logsumexp(s, dim=-1).float()
        out[qs:qe] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v_i).to(q.dtype)
    return out, lse


def flash_attn_varlen_func_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                                 softmax_scale=None):
    """Plain-torch stand-in for ``flash_attn.flash_attn_varlen_func`` (default scale D^-0.5)."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    return _flash_attn_varlen_forward_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)[0]


def calc_chunks(cu_seqlen, moba_chunk_size):
    """``moba/moba_efficient.py::calc_chunks`` (lines 14-64), verbatim minus the ``lru_cache``."""

    # batch_sizes[batch_idx] = batch size ( seqlen ) of batch idx
    batch_sizes = cu_seqlen[1:] - cu_seqlen[:-1]
    # batch_num_chunk[batch_idx] = how many chunk in batch idx
    batch_num_chunk = (batch_sizes + (moba_chunk_size - 1)) // moba_chunk_size
    # cu_num_chunk[batch_idx] = first chunk id of this batch
    cu_num_chunk = torch.ones(
        batch_num_chunk.numel() + 1,
        device=cu_seqlen.device,
        dtype=batch_num_chunk.dtype,
    )
    cu_num_chunk[1:] = batch_num_chunk.cumsum(dim=0)
    # total chunk ( for all batch )
    num_chunk = cu_num_chunk[-1]
    # chunk_sizes[chunk_idx] = chunk_size of chunk idx
    chunk_sizes = torch.full(
        (num_chunk + 1,), moba_chunk_size, dtype=torch.int32, device=cu_seqlen.device
    )
    chunk_sizes[0] = 0  # for calc cu chunk
    batch_last_chunk_size = batch_sizes - (batch_num_chunk - 1) * moba_chunk_size
    chunk_sizes[cu_num_chunk[1:]] = batch_last_chunk_size
    # cu_chunk[chunk_idx] = the start chunk offset of chunk idx
    cu_chunk = chunk_sizes.cumsum(dim=-1, dtype=torch.int32)
    # chunk_to_batch[chunk_idx] = batch idx of the chunk idx
    chunk_to_batch = torch.zeros(
        (num_chunk,), dtype=torch.int32, device=cu_seqlen.device
    )
    chunk_to_batch[cu_num_chunk[1:-1]] = 1
    chunk_to_batch = chunk_to_batch.cumsum(dim=0, dtype=torch.int32)

    """ filter chunks that need moba attn """

    # filter chunks ( remove last chunk of each batch )
    # filtered_chunk_indices: chunk index list that excludes the last chunk of each batch
    chunk_to_remove = cu_num_chunk[1:] - 1
    chunk_to_remain = torch.ones(
        (num_chunk,), dtype=torch.bool, device=cu_seqlen.device
    )
    chunk_to_remain[chunk_to_remove] = False
    filtered_chunk_indices = chunk_to_remain.nonzero(as_tuple=True)[0]
    num_filtered_chunk = len(filtered_chunk_indices)

    return (
        cu_chunk,
        filtered_chunk_indices,
        num_filtered_chunk,
        chunk_to_batch,
    )


def mixed_attention_forward(q, k, v, self_attn_cu_seqlen, moba_q, moba_kv, moba_cu_seqlen_q, moba_cu_seqlen_kv,
                            max_seqlen, moba_chunk_size, moba_q_sh_indices):
    """``MixedAttention.forward`` (lines 69-183) as a plain function: the two
    ``_flash_attn_varlen_forward`` calls are replaced by ``_flash_attn_varlen_forward_torch`` (it
    returns only ``(out, lse)``, the two tensors the original unpacks); ``ctx`` bookkeeping and the
    lines that only prepare ``save_for_backward`` (167-181) are left out. Autograd through these
    torch ops gives the gradient the original's custom backward computes (same single softmax)."""
    softmax_scale = q.shape[-1] ** (-0.5)

    # self attn
    self_attn_out_sh, self_attn_lse_hs = _flash_attn_varlen_forward_torch(
        q, k, v, self_attn_cu_seqlen, self_attn_cu_seqlen, softmax_scale, causal=True)

    # moba attn
    moba_attn_out, moba_attn_lse_hs = _flash_attn_varlen_forward_torch(
        moba_q, moba_kv[:, 0], moba_kv[:, 1], moba_cu_seqlen_q, moba_cu_seqlen_kv, softmax_scale, causal=False)

    # convert lse shape hs -> sh ( follow the legacy mix attn logic )
    self_attn_lse_sh = self_attn_lse_hs.t().contiguous()
    moba_attn_lse = moba_attn_lse_hs.t().contiguous()

    # output buffer [S, H, D], same shape as q
    output = torch.zeros(
        (q.shape[0], q.shape[1], q.shape[2]), device=q.device, dtype=torch.float32
    )

    # flatten vS & H for index ops
    output_2d = output.view(-1, q.shape[2])

    # calc mixed_lse
    # minus max lse to avoid exp explosion
    max_lse_1d = self_attn_lse_sh.view(-1)
    max_lse_1d = max_lse_1d.index_reduce(
        0, moba_q_sh_indices, moba_attn_lse.view(-1), "amax"
    )
    self_attn_lse_sh = self_attn_lse_sh - max_lse_1d.view_as(self_attn_lse_sh)
    moba_attn_lse = (
        moba_attn_lse.view(-1)
        .sub(max_lse_1d.index_select(0, moba_q_sh_indices))
        .reshape_as(moba_attn_lse)
    )

    mixed_attn_se_sh = self_attn_lse_sh.exp()
    moba_attn_se = moba_attn_lse.exp()

    mixed_attn_se_sh.view(-1).index_add_(
        0, moba_q_sh_indices, moba_attn_se.view(-1)
    )
    mixed_attn_lse_sh = mixed_attn_se_sh.log()

    # add attn output
    factor = (self_attn_lse_sh - mixed_attn_lse_sh).exp()  # [ vS, H ]
    self_attn_out_sh = self_attn_out_sh * factor.unsqueeze(-1)
    output_2d += self_attn_out_sh.reshape_as(output_2d)

    # add moba output
    mixed_attn_lse = (
        mixed_attn_lse_sh.view(-1)
        .index_select(0, moba_q_sh_indices)
        .view_as(moba_attn_lse)
    )
    factor = (moba_attn_lse - mixed_attn_lse).exp()  # [ vS, H ]
    moba_attn_out = moba_attn_out * factor.unsqueeze(-1)
    raw_attn_out = moba_attn_out.view(-1, moba_attn_out.shape[-1])
    # (transcriber) ``.to``: a no-op for bf16/fp16/fp32 inputs (``* factor`` already promoted to fp32),
    # needed only so that float64 test inputs can be added into the float32 buffer
    output_2d.index_add_(0, moba_q_sh_indices, raw_attn_out.to(output_2d.dtype))
    output = output.to(q.dtype)
    return output


def moba_attn_varlen(q, k, v, cu_seqlens, max_seqlen, moba_chunk_size, moba_topk, return_gate_mask=False):
    """Transcription of ``moba/moba_efficient.py::moba_attn_varlen`` (lines 270-443, commit
    61e456bc956c5a25fd9c84e5496b661329cb1b72), MoBA's production path. flash-attn calls ->
    ``_flash_attn_varlen_forward_torch`` / ``flash_attn_varlen_func_torch``; ``einops.rearrange``
    -> the equivalent ``permute``/``reshape``. ``return_gate_mask=True`` also returns the
    ``gate_mask [F_N_CHUNK, HEAD, SEQ]`` (past chunks chosen per token; the own chunk is implicit)
    together with ``filtered_chunk_indices`` (or ``None`` on the corner-case path)."""

    kv = torch.stack((k, v), dim=1)

    """ some basic variables """
    # qkv shape = [ S, H, D ]
    seqlen, num_head, head_dim = q.shape

    """ prepare chunk meta """
    (
        cu_chunk,
        filtered_chunk_indices,
        num_filtered_chunk,
        chunk_to_batch,
    ) = calc_chunks(cu_seqlens, moba_chunk_size)

    # we will adjust selective topk to moba_topk - 1, as the last chunk is always chosen
    moba_topk = min(moba_topk - 1, num_filtered_chunk)
    need_moba_attn = moba_topk > 0

    # corner case: if no moba attn needed, just return self attn
    if not need_moba_attn:
        # NOTE (transcriber): this is FULL causal attention over each whole sequence (cu_seqlens),
        # not own-chunk attention: for moba_topk == 1 the efficient path therefore differs from
        # moba_attn_varlen_naive (which attends to the own chunk only).
        o = flash_attn_varlen_func_torch(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True
        )
        return (o, None, None) if return_gate_mask else o

    self_attn_cu_seqlen = cu_chunk

    # filtered_kv is a dense matrix that only contains filtered chunk of kv
    filtered_kv_indices = torch.arange(
        0, moba_chunk_size, dtype=torch.int32, device=q.device
    )[None, :].repeat(num_filtered_chunk, 1)
    filtered_kv_indices += cu_chunk[filtered_chunk_indices][:, None]
    filtered_kv = kv.index_select(0, filtered_kv_indices.view(-1))

    """ calc key_gate_weight and gate """

    # key_gate_weight [ F_N_CHUNK, HEAD, HEAD_DIM ]
    key_gate_weight = (
        filtered_kv[:, 0]
        .view(num_filtered_chunk, moba_chunk_size, num_head, head_dim)
        .mean(dim=1)
        .float()
    )
    q = q.type(torch.float32)  # float logit on the fly for better gate logit perception
    key_gate_weight = key_gate_weight.type(
        torch.float32
    )  # float logit for better gate logit perception
    gate = torch.einsum(
        "nhd,shd->nhs", key_gate_weight, q
    )  # gate [ F_N_CHUNK, HEAD, SEQ ]
    key_gate_weight = key_gate_weight.type_as(k)
    q = q.type_as(k)

    # pose process gate, masking unchosen batch and apply causal mask to current chunk
    gate_seq_idx = torch.arange(0, seqlen, device=q.device, dtype=torch.int32)[
        None, :
    ].repeat(num_filtered_chunk, 1)
    chunk_end = cu_chunk[filtered_chunk_indices + 1]
    batch_end = cu_seqlens[chunk_to_batch[filtered_chunk_indices] + 1]
    gate_chunk_end_mask = gate_seq_idx < chunk_end[:, None]
    gate_batch_end_mask = gate_seq_idx >= batch_end[:, None]
    gate_inf_mask = gate_chunk_end_mask | gate_batch_end_mask
    gate.masked_fill_(gate_inf_mask.unsqueeze(1), -float("inf"))

    """ find moba q that needs moba attn """
    # find topk chunks
    # gate_mask [ N_CHUNK, HEAD, SEQ ], true indicates that needs attention
    _, gate_top_k_idx = torch.topk(gate, k=moba_topk, dim=0, largest=True, sorted=False)
    # apply causal mask
    gate_mask = torch.logical_not(gate.isinf())
    # select topk chunks
    gate_idx_mask = torch.zeros(gate_mask.shape, dtype=torch.bool, device=q.device)
    gate_idx_mask = gate_idx_mask.scatter_(dim=0, index=gate_top_k_idx, value=True)
    gate_mask = torch.logical_and(gate_mask, gate_idx_mask)

    # varlen trick: combining all q index that needs moba attn
    # the result will be like [ C0H0 ][ C0H1 ][ C0H2 ][ ... ][ CnHm ]
    moba_q_indices = gate_mask.reshape(gate_mask.shape[0], -1).nonzero(as_tuple=True)[
        -1
    ]  # [ HS indices ] * N
    # moba_seqlen_q indicates that how many q chunks are selected for each kv chunk - head
    moba_seqlen_q = gate_mask.sum(dim=-1).flatten()
    # select all q that needs moba attn based on the moba_q_indices
    moba_q = q.permute(1, 0, 2).reshape(-1, head_dim).index_select(  # rearrange "s h d -> ( h s ) d"
        0, moba_q_indices
    )  # [ selected_S, D ]
    moba_q = moba_q.unsqueeze(1)
    # moba_q_sh_indices represents the position in the origin q tensor of each q token inside moba_q
    moba_q_sh_indices = moba_q_indices % seqlen * num_head + moba_q_indices // seqlen

    """ prepare moba kv """
    # Since moba_q is organized as HS * N, we need to reorganize kv to adapt to q

    # cut off zero experts
    q_zero_mask = moba_seqlen_q == 0
    valid_expert_mask = ~q_zero_mask
    zero_expert_count = q_zero_mask.sum()
    # only keep the kv that has q select > 0
    if zero_expert_count > 0:
        moba_seqlen_q = moba_seqlen_q[valid_expert_mask]
    # moba cu_seqlen for flash attn
    moba_cu_seqlen_q = torch.cat(
        (
            torch.tensor([0], device=q.device, dtype=moba_seqlen_q.dtype),
            moba_seqlen_q.cumsum(dim=0),
        ),
        dim=0,
    ).to(torch.int32)
    moba_kv = filtered_kv.permute(2, 0, 1, 3)  # rearrange "s x h d -> h s x d"
    moba_kv = moba_kv.split(moba_chunk_size, dim=1)
    moba_kv = torch.cat(moba_kv, dim=0)
    if zero_expert_count > 0:
        assert valid_expert_mask.sum() == moba_kv.shape[0] - zero_expert_count
        moba_kv = moba_kv[
            valid_expert_mask
        ]  # cut off zero Q expert from kv , or the grad may be nan
    moba_kv = moba_kv.flatten(start_dim=0, end_dim=1).unsqueeze(2)
    moba_cu_seqlen_kv = (
        torch.arange(
            0,
            num_filtered_chunk * num_head + 1 - zero_expert_count,
            dtype=torch.int32,
            device=q.device,
        )
        * moba_chunk_size
    )

    # Shape check
    assert (
        moba_cu_seqlen_kv.shape == moba_cu_seqlen_q.shape
    ), f"moba_cu_seqlen_kv.shape != moba_cu_seqlen_q.shape {moba_cu_seqlen_kv.shape} != {moba_cu_seqlen_q.shape}"

    o = mixed_attention_forward(
        q,
        k,
        v,
        self_attn_cu_seqlen,
        moba_q,
        moba_kv,
        moba_cu_seqlen_q,
        moba_cu_seqlen_kv,
        max_seqlen,
        moba_chunk_size,
        moba_q_sh_indices,
    )
    return (o, gate_mask, filtered_chunk_indices) if return_gate_mask else o


__all__ = ["calc_chunks", "flash_attn_varlen_func_torch", "mixed_attention_forward", "moba_attn_varlen",
           "moba_attn_varlen_naive", "moba_naive_selection"]
