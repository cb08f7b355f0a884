# Transcribed (CPU, plain PyTorch) from two DeepSeek repositories, both under the MIT License:
#   deepseek-ai/DeepSeek-V3.2-Exp, https://github.com/deepseek-ai/DeepSeek-V3.2-Exp, HEAD
#     3b99a5350d260b7c2a357e82362305509e2d0724: inference/model.py and inference/kernel.py (both last
#     changed in 2305c7ec3bf4b357dc0aee8dd97e0a1cbc0ea0e1); the indexer-RoPE fix of upstream commit
#     8631a813356d39b09a5c1ee1cde8ed6015559eb3 (2025-11, not in the stored snapshot) is reproduced
#     by ``apply_rotary_emb(..., interleaved=False)``, see docs/notes/reference_semantics.md.
#   deepseek-ai/FlashMLA, https://github.com/deepseek-ai/FlashMLA, HEAD
#     9241ae3ef9bac614dd25e45e507e089f888280e0: tests/ref.py and tests/lib.py (last changed in
#     082094b793fcc7452977d0a71a00e266a2e3061e), flash_mla/flash_mla_interface.py (48c6dc42).
#
# MIT License
# Copyright (c) 2025 DeepSeek
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
"""DSA (DeepSeek Sparse Attention) reference transcriptions (test-only; see
docs/notes/reference_semantics.md, section DSA).

What is dropped from the V3.2 ``Indexer`` (math kept, in ``compute_dtype``, default float32):
- ``act_quant`` (block-128 FP8 e4m3 quantisation of q and k, scale = amax/448, rounded up to a
  power of two with ``scale_fmt="ue8m0"``) and the FP8 k-cache: q_fp8*q_scale and k_fp8*k_scale
  are replaced by q and k. ``fp8_index`` multiplies ReLU(q_fp8 . k_fp8) by q_scale (folded into
  ``weights``) and by k_scale; both scales are > 0, so with exact values the result is
  ReLU(q . k) * weights, which is what ``fp8_index_math`` computes;
- ``rotate_activation`` (a Sylvester Hadamard transform scaled by d^-0.5, i.e. an orthogonal map
  applied to both q and k): it leaves every q . k unchanged in exact arithmetic and only serves
  the FP8 quantisation. Available here (plain torch) with ``hadamard=True``;
- bf16 storage of activations/weights, tensor parallelism and the ``dist.broadcast`` check.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3.2-Exp inference/model.py: precompute_freqs_cis, apply_rotary_emb, rotate_activation,
# LayerNorm, Indexer.forward, MLA.forward (prefill branch)
# ----------------------------------------------------------------------------------------------
def precompute_freqs_cis(qk_rope_head_dim=64, max_seq_len=16384, rope_theta=10000.0, rope_factor=40,
                         original_seq_len=4096, beta_fast=32, beta_slow=1) -> torch.Tensor:
    """inference/model.py::precompute_freqs_cis (lines 325-403) with the ModelArgs fields as
    arguments (defaults: ModelArgs's). YaRN frequency correction when ``max_seq_len >
    original_seq_len``. Returns complex64 ``[max_seq_len, qk_rope_head_dim // 2]``."""
    dim = qk_rope_head_dim
    seqlen = max_seq_len
    base = rope_theta
    factor = rope_factor

    def find_correction_dim(num_rotations, dim, base, max_seq_len):
        return dim * math.log(max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_seq_len):
        low = math.floor(find_correction_dim(low_rot, dim, base, max_seq_len))
        high = math.ceil(find_correction_dim(high_rot, dim, base, max_seq_len))
        return max(low, 0), min(high, dim-1)

    def linear_ramp_factor(min, max, dim):
        if min == max:
            max += 0.001
        linear_func = (torch.arange(dim, dtype=torch.float32) - min) / (max - min)
        ramp_func = torch.clamp(linear_func, 0, 1)
        return ramp_func

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if seqlen > original_seq_len:
        low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_seq_len)
        smooth = 1 - linear_ramp_factor(low, high, dim // 2)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth

    t = torch.arange(seqlen)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return freqs_cis


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, interleaved: bool = True,
                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """inference/model.py::apply_rotary_emb. ``interleaved=True`` is the function at 3b99a535
    (lines 406-421; pairs (x0,x1),(x2,x3),... rotate, GPT-J layout): MLA's q_pe/k_pe always use it.
    ``interleaved=False`` is the flag added by upstream fix 8631a813 for the Indexer (pairs
    (x_i, x_{i+d/2}), NeoX layout): permute to interleaved, rotate, permute back.
    x ``[b, s, h, d]``, freqs_cis ``[s, d/2]`` complex. ``.float()`` -> ``.to(compute_dtype)``."""
    dtype = x.dtype
    shape = x.shape
    if not interleaved:
        x = x.view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()
    x = torch.view_as_complex(x.to(compute_dtype).reshape(*shape[:-1], -1, 2))
    freqs_cis = freqs_cis.to(x.dtype).view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    if not interleaved:
        y = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)
    return y.to(dtype)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """inference/model.py::rotate_activation = ``fast_hadamard_transform.hadamard_transform(x,
    scale=d ** -0.5)``, written in torch as that package's reference does: ``F.linear(x, H) *
    scale`` with H the Sylvester Hadamard matrix (``scipy.linalg.hadamard`` order), x zero-padded
    to a power of two and the output truncated back. (The original asserts bf16 input.)"""
    hidden_size = x.size(-1)
    dim_padded = 1 << (hidden_size - 1).bit_length()
    H = torch.ones(1, 1, dtype=x.dtype, device=x.device)
    while H.shape[0] < dim_padded:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    out = F.linear(F.pad(x, (0, dim_padded - hidden_size)), H) * hidden_size ** -0.5
    return out[..., :hidden_size]


def layer_norm(x, weight, bias, eps=1e-6, compute_dtype=torch.float32):
    """inference/model.py::LayerNorm.forward (lines 310-322: eps 1e-6, affine, ``x.float()``;
    ``.float()`` -> ``.to(compute_dtype)``)."""
    return F.layer_norm(x.to(compute_dtype), (x.shape[-1],), weight.to(compute_dtype), bias.to(compute_dtype),
                        eps).type_as(x)


def fp8_index_math(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The arithmetic of inference/kernel.py::fp8_index_kernel without the FP8 scales:
    ``o[b, m, n] = sum_h ReLU(q[b, m, h] . k[b, n]) * weights[b, m, h]``.
    q ``[b, m, h, d]``, weights ``[b, m, h, 1]`` (or ``[b, m, h]``), k ``[b, n, d]``."""
    logits = torch.einsum("bmhd,bnd->bmhn", q, k).clamp_min(0)  # T.max(logits, 0)
    return (logits * weights.reshape(*q.shape[:3], 1)).sum(dim=2)  # * q_s, reduce_sum over h


def indexer_forward(x, qr, wq_b, wk, k_norm_weight, k_norm_bias, weights_proj, freqs_cis, mask, *,
                    n_heads, head_dim, rope_head_dim, index_topk, start_pos=0, k_cache=None,
                    rope_interleaved=False, hadamard=False, compute_dtype=torch.float32,
                    return_index_score=False):
    """inference/model.py::Indexer.forward (lines 452-480) in ``compute_dtype`` without FP8.

    x ``[b, s, dim]`` (layer input), qr ``[b, s, q_lora_rank]`` (= MLA's ``q_norm(wq_a(x))``),
    wq_b ``[n_heads*head_dim, q_lora_rank]``, wk ``[head_dim, dim]``, k_norm_{weight,bias}
    ``[head_dim]``, weights_proj ``[n_heads, dim]``, freqs_cis ``[s, rope_head_dim/2]`` (rows
    start_pos..end_pos-1), mask ``[s, s]`` additive causal (``-inf`` above the diagonal) or None
    (decode). Prefill needs ``start_pos == 0`` unless a ``k_cache [b, max_len, head_dim]`` (already
    holding the earlier keys) is given. Returns ``topk_indices [b, s, min(index_topk, end_pos)]``
    (``torch.topk``, largest, sorted), plus the index score if asked.

    ``rope_interleaved=False`` (default) is the upstream-fixed (8631a813) indexer; ``True``
    reproduces the snapshot 3b99a535 exactly. ``hadamard=True`` applies ``rotate_activation``.
    """
    bsz, seqlen, _ = x.size()
    end_pos = start_pos + seqlen
    x, qr = x.to(compute_dtype), qr.to(compute_dtype)
    softmax_scale = head_dim ** -0.5
    q = F.linear(qr, wq_b.to(compute_dtype))  # self.wq_b(qr)
    q = q.view(bsz, seqlen, n_heads, head_dim)  # rearrange 'b s (h d) -> b s h d'
    q_pe, q_nope = torch.split(q, [rope_head_dim, head_dim - rope_head_dim], dim=-1)
    q_pe = apply_rotary_emb(q_pe, freqs_cis, rope_interleaved, compute_dtype)
    q = torch.cat([q_pe, q_nope], dim=-1)
    k = F.linear(x, wk.to(compute_dtype))  # self.wk(x)
    k = layer_norm(k, k_norm_weight, k_norm_bias, compute_dtype=compute_dtype)  # self.k_norm(k)
    k_pe, k_nope = torch.split(k, [rope_head_dim, head_dim - rope_head_dim], dim=-1)
    k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis, rope_interleaved, compute_dtype).squeeze(2)
    k = torch.cat([k_pe, k_nope], dim=-1)
    if hadamard:
        q = rotate_activation(q)
        k = rotate_activation(k)
    # DROPPED: q_fp8, q_scale = act_quant(q, ...); k_fp8, k_scale = act_quant(k, ...)
    if k_cache is None:
        assert start_pos == 0, "without a k_cache only a start_pos == 0 prefill can be computed"
        k_all = k
    else:
        k_cache[:bsz, start_pos:end_pos] = k  # self.k_cache[:bsz, start_pos:end_pos] = k_fp8
        k_all = k_cache[:bsz, :end_pos].to(compute_dtype)
    weights = F.linear(x, weights_proj.to(compute_dtype)) * n_heads ** -0.5
    weights = weights.unsqueeze(-1) * softmax_scale  # original: * q_scale * self.softmax_scale
    index_score = fp8_index_math(q, weights, k_all)  # fp8_index(q_fp8, weights, k_cache, k_scale_cache)
    if mask is not None:
        index_score += mask
    topk_indices = index_score.topk(min(index_topk, end_pos), dim=-1)[1]
    return (topk_indices, index_score) if return_index_score else topk_indices


def mla_softmax_scale(qk_head_dim=192, max_seq_len=16384, original_seq_len=4096, mscale=1.0, rope_factor=40):
    """inference/model.py::MLA.__init__ lines 526-529: ``qk_head_dim ** -0.5``, times ``mscale**2``
    with ``mscale = 0.1 * mscale * ln(rope_factor) + 1`` when ``max_seq_len > original_seq_len``."""
    softmax_scale = qk_head_dim ** -0.5
    if max_seq_len > original_seq_len:
        mscale = 0.1 * mscale * math.log(rope_factor) + 1.0
        softmax_scale = softmax_scale * mscale * mscale
    return softmax_scale


def mla_prefill_sparse_attention(q, k, v, topk_indices, mask, softmax_scale):
    """inference/model.py::MLA.forward prefill branch, lines 569-578: dense scores in float32, an
    index mask that is 0 on the indexer's top-k keys and -inf elsewhere, PLUS the causal mask (so
    top-k slots that point into the future -- possible when t + 1 < index_topk -- stay excluded),
    one softmax over the kept keys, shared by every head. q/k ``[b, s, h, d_qk]``, v ``[b, s, h,
    d_v]``, topk_indices ``[b, s, k]``, mask ``[s, s]``. Returns ``[b, s, h, d_v]`` in v's dtype."""
    bsz, seqlen = q.shape[:2]
    scores = torch.einsum("bshd,bthd->bsht", q.float(), k.float()) * softmax_scale
    index_mask = torch.full((bsz, seqlen, seqlen), float("-inf"), device=q.device).scatter_(-1, topk_indices, 0)
    index_mask += mask
    scores += index_mask.unsqueeze(2)
    scores = scores.softmax(dim=-1, dtype=torch.float32)
    return torch.einsum("bsht,bthd->bshd", scores.type_as(v), v)  # original: scores.type_as(x)


# ----------------------------------------------------------------------------------------------
# FlashMLA tests/ref.py: _merge_two_lse, ref_sparse_attn_fwd
# ----------------------------------------------------------------------------------------------
def _merge_two_lse(lse0, lse1, s_q, h_q):
    """tests/ref.py::_merge_two_lse (lines 7-17)."""
    if lse1 is None:
        return lse0
    else:
        return torch.logsumexp(
            torch.stack([
                lse0.view(s_q, h_q),
                lse1.to(lse0.dtype).broadcast_to(s_q, h_q)  # (transcriber) .to: float64 tests
            ], dim=0),
            dim=0
        )


def ref_sparse_attn_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                        compute_dtype=torch.float32):
    """FlashMLA tests/ref.py::ref_sparse_attn_fwd (lines 19-52), with ``TestParam p`` / ``Testcase t``
    unpacked into arguments (s_q, h_q, d_qk from q; s_kv from kv; topk from indices) and
    ``.float()`` -> ``.to(compute_dtype)``. The reference of ``flash_mla_sparse_fwd``:

    q ``[s_q, h_q, d_qk]``, kv ``[s_kv, h_kv=1, d_qk]`` (V = kv[..., :d_v]), indices
    ``[s_q, h_kv=1, topk]`` (an entry is invalid iff < 0 or >= s_kv), topk_length ``[s_q]``
    (slots ``>= topk_length[i]`` invalid), attn_sink ``[h_q]``. No causal mask: validity only.
    Returns ``(out bf16 [s_q, h_q, d_v], out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])``;
    max_logits and lse are of the SCALED logits (natural log); a query with no valid index gets
    out 0, max_logits -inf, lse +inf. The sink multiplies out by exp(lse)/(exp(lse)+exp(sink)) and
    does not enter lse / max_logits. A repeated valid index counts twice (gather)."""
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[-1]
    assert kv.shape[1] == 1 and indices.shape[1] == 1, "tests/ref.py handles h_kv == 1 only (squeeze(1))"
    indices = indices.clone().squeeze(1)
    if topk_length is not None:
        mask = torch.arange(topk, device=topk_length.device).unsqueeze(0).broadcast_to(s_q, topk) >= topk_length.unsqueeze(1)   # [s_q, topk]
        indices[mask] = -1
    invalid_mask = (indices < 0) | (indices >= s_kv)    # [s_q, topk]
    indices[invalid_mask] = 0

    q = q.to(compute_dtype)
    gathered_kv = kv.index_select(dim=0, index=indices.flatten()).reshape(s_q, topk, d_qk).to(compute_dtype)   # [s_q, topk, d_qk]
    P = (q @ gathered_kv.transpose(1, 2))   # [s_q, h_q, topk]
    P *= sm_scale
    P[invalid_mask.unsqueeze(1).broadcast_to(P.shape)] = float("-inf")

    orig_lse = torch.logsumexp(P, dim=-1)   # [s_q, h_q]
    max_logits = P.max(dim=-1).values   # [s_q, h_q]

    lse_for_o = _merge_two_lse(orig_lse, attn_sink, s_q, h_q)
    if not torch.is_inference_mode_enabled():
        lse_for_o = lse_for_o.clone()
    lse_for_o[lse_for_o == float("-inf")] = float("+inf")   # So that corresponding O will be 0
    s_for_o = torch.exp(P - lse_for_o.unsqueeze(-1))
    out = s_for_o @ gathered_kv[..., :d_v]   # [s_q, h_q, dv]

    lonely_q_mask = orig_lse == float("-inf")   # [s_q, h_q]
    orig_lse[lonely_q_mask] = float("+inf")
    return (out.to(torch.bfloat16), out, max_logits, orig_lse)


def indexer_topk_to_flashmla_indices(topk_indices: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """Glue (not from either repo): V3.2's ``topk_indices [b, s, k]`` -> FlashMLA's
    ``indices [s_q, h_kv=1, k]`` for one sequence (b == 1), with the future slots MLA removes via
    its causal mask (``index > start_pos + t``) set to -1, the invalid marker FlashMLA expects."""
    assert topk_indices.shape[0] == 1
    t = torch.arange(topk_indices.shape[1], device=topk_indices.device)[:, None] + start_pos
    idx = topk_indices[0].to(torch.int32).masked_fill(topk_indices[0] > t, -1)
    return idx.unsqueeze(1)


__all__ = ["apply_rotary_emb", "fp8_index_math", "indexer_forward", "indexer_topk_to_flashmla_indices",
           "layer_norm", "mla_prefill_sparse_attention", "mla_softmax_scale", "precompute_freqs_cis",
           "ref_sparse_attn_fwd", "rotate_activation"]
