"""The public entry of the op: :func:`attention` (the paper's attention ``softmax(A1 X A2^T * scale) A3 Y``
with block-sparse operands), its autograd Function over the Triton launchers and the backend dispatch."""
from __future__ import annotations

import torch

from sparse_io_attn._attention.checks import resolve_backend
from sparse_io_attn.layout.core import BlockSparseLayout
from sparse_io_attn.layout.matrix import BlockSparseMatrix
from sparse_io_attn.sparse_operands import torch_path
from sparse_io_attn.sparse_operands.batch import is_list, matrix_shape, squeeze
from sparse_io_attn.sparse_operands.operands import check_batch, check_operands, check_scale
from sparse_io_attn.sparse_operands.problem import Problem, build_problem


def _data(t) -> torch.Tensor:
    """The tensor autograd sees for an operand: dense data (contiguous), BSR ``values``, or a list's
    ``values`` concatenated (differentiably, so each matrix of the list gets its share)."""
    if is_list(t):
        return torch.cat([m.values for m in t]).contiguous()
    if isinstance(t, BlockSparseMatrix):
        return t.values.contiguous()
    return t.contiguous()


class _PaperAttention(torch.autograd.Function):
    """Backend ``"triton"``: forward and backward through the launchers of :mod:`.triton.launch`;
    inputs are the operands' data tensors (gradients land on them: BSR ``values`` get masked
    gradients), ``prob`` their structure (addressing those same tensors)."""

    @staticmethod
    def forward(ctx, a1, x, a2, a3, y, prob: Problem, scale: float):
        from sparse_io_attn.sparse_operands.triton import launch

        o, lse, Q, H = launch.forward(prob, scale)
        ctx.save_for_backward(a1, x, a2, a3, y, o, lse)  # the inputs too: autograd's in-place checks
        ctx.prob, ctx.scale, ctx.Q, ctx.H = prob, scale, Q, H
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        from sparse_io_attn.sparse_operands.triton import launch

        *_, o, lse = ctx.saved_tensors  # prob addresses the same input tensors
        grads = launch.backward(do, o, lse, ctx.prob, ctx.Q, ctx.H, ctx.scale, needs=ctx.needs_input_grad[:5])
        return (*grads, None, None)


def attention(A1, A2, A3, X, Y, *, qk_layout: BlockSparseLayout | None = None, scale: float = 1.0,
              backend: str = "auto", return_lse: bool = False):
    """The paper's attention (Definition 3.1 / B.7): ``O = softmax(A1 X A2^T * scale) A3 Y``, for one
    head or batched over ``B`` batch elements and ``H`` heads.

    Args:
        A1: queries' inputs, ``[nq, d1]`` or ``[B, nq, d1]``; A2: keys' inputs, ``[nk, d2]`` or
            ``[B, nk, d2]``; A3: ``[nk, d3]`` or ``[B, nk, d3]`` (``h = A3 Y``, Definition B.6). Each
            may be a :class:`BlockSparseMatrix` (shared by every batch element) or a list/tuple of
            ``B`` of them (same shape, block size, dtype, device: a block pattern per batch element,
            e.g. sparse input activations per sequence).
        X: ``[d1, d2]`` (e.g. a pruned ``W_Q W_K^T``) or ``[H, d1, d2]``; Y: ``[d3, dv]`` or
            ``[H, d3, dv]``. Each may be a :class:`BlockSparseMatrix` (shared by every head) or a
            list/tuple of ``H`` of them (a block pattern per head). Block sizes must agree along
            shared axes.
        qk_layout: optional :class:`BlockSparseLayout` (``seqlen == (nq, nk)``, block ``(A1 row
            block, A2 row block)``, ``layout_batch`` 1 or ``B``, ``layout_heads`` 1 or ``H``): the
            keys each query block attends to.
        scale: multiplies the scores (the paper uses 1): a finite real number (int, float, NumPy
            scalar, 0-d tensor), as ``sm_scale`` of :func:`~sparse_io_attn.block_sparse_attention`.
        backend: ``"auto"`` (triton on CUDA, torch elsewhere; this form has no C++ kernel), ``"torch"``,
            ``"triton"`` (on CPU: Triton's interpreter, slow, counts I/O).
        return_lse: also return the row log-sum-exp (fp32, natural log, not differentiable).

    Returns ``O [nq, dv]`` (and ``lse [nq]``) when every operand is a single 2-D matrix and the
    layout holds one mask (the paper's single-head form); otherwise ``O [B, H, nq, dv]`` (and
    ``lse [B, H, nq]``), ``B``/``H`` being 1 along an axis nothing varies on
    (:mod:`sparse_io_attn.sparse_operands.batch`).

    Semantics: softmax over the keys of the QK pattern (all keys if None). Inside it, a score whose
    product is structurally zero is exactly 0 and enters the softmax as ``exp(0 - m)`` (it is not
    masked); the Triton path computes score blocks only where the structural block product of
    ``A1 X`` and ``A2^T`` is nonzero and folds the zero blocks in through block sums of ``h``.
    A query row with no key gets output 0 and lse ``-inf``; no query rows (``nq = 0``), no keys, or
    ``B`` or ``H`` of 0 give that empty (or zero) result and zero gradients on every backend, with
    no kernel launched. Gradients: dense operands get dense gradients (summed over the axis they are
    shared along); block-sparse ones get gradients on their own block pattern (``values.grad``; for a
    list, each matrix's own ``values.grad``).
    """
    blocks, dtype, device = check_operands(A1, A2, A3, X, Y, qk_layout, scale, backend)
    batch = check_batch(A1, A2, A3, X, Y, qk_layout)
    scale = check_scale(scale)
    name = resolve_backend(backend, device, supported=("torch", "triton"))
    empty = 0 in (matrix_shape(A1)[0], matrix_shape(A2)[0], batch.B, batch.H)
    if name == "torch" or empty:                # an empty problem: its empty (or zero) result, no kernel
        o, lse = torch_path.attention(A1, A2, A3, X, Y, qk_layout, scale, batch)
        o, lse = squeeze(o, batch), squeeze(lse, batch)
    else:
        if qk_layout is not None and qk_layout.num_partial_blocks:
            raise ValueError(f"backend='triton' keeps whole QK blocks, but qk_layout has "
                             f"{qk_layout.num_partial_blocks} partial blocks (element masks, e.g. causal "
                             f"diagonals); use backend='torch' or a layout of full blocks")
        data = [_data(t) for t in (A1, X, A2, A3, Y)]
        prob = build_problem(A1, A2, A3, X, Y, None if qk_layout is None else qk_layout.to(device), blocks, batch,
                             data)
        o, lse = _PaperAttention.apply(*data, prob, scale)
        o, lse = squeeze(o, batch), squeeze(lse, batch)
    return (o, lse) if return_lse else o
