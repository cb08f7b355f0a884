"""Float64 reference of the paper's attention (Definitions 3.1, 3.2, B.3-B.9; arXiv 2410.09397).

The paper writes attention with the *previous-layer inputs* and fused weights::

    S = A1 X A2^T          (n x n_k; X = W_Q W_K^T, Definition 3.1)
    A = exp(scale * S)     (Definition B.3; the paper has scale = 1)
    l = A 1                (Definition B.4, softmax normalizer)
    f = diag(l)^-1 A       (Definition B.5; the text's "diag(l)" means diag(l)^-1)
    h = A3 Y               (Definition B.6, Y = W_V)
    O = f h                (Definition B.7, forward output)
    q = dO h^T             (Definition B.8)
    p = f o q - diag((f o q) 1) f = f o q - diag((O o dO) 1) f      (Definition B.9)
    g = dL/dX = A1^T p A2  (Definition 3.2)

Loss convention: Definition 3.2 leaves the loss ``L`` open; ``dO`` is the upstream gradient
``dL/dO``. So ``g`` is ``dL/dX`` for *any* loss whose gradient with respect to ``O`` is ``dO``,
e.g. the linear loss ``L = sum(O * dO)`` (dO held fixed) or ``L = 0.5 * ||O - E||_F^2`` with
``dO = O - E``. With ``scale != 1`` every gradient through ``S`` gains the factor ``scale``.

All functions accept torch tensors or NumPy arrays and compute in float64 on the CPU; they return
float64 torch tensors. ``l`` is the unnormalized row sum of Definition B.4 and overflows to
``inf`` when a score exceeds ~709; the other outputs are computed stably (row max subtracted).
"""
from __future__ import annotations

import numpy as np
import torch


def _f64(x, what: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {tuple(x.shape)}")
    return x.detach().to("cpu", torch.float64)


def _check(A1, A2, A3, X, Y, dO=None):
    n, d = A1.shape
    n_k = A2.shape[0]
    if A2.shape[1] != d or A3.shape != (n_k, d) or X.shape != (d, d) or Y.shape != (d, d):
        raise ValueError(f"expected A1 [n, d], A2/A3 [n_k, d], X/Y [d, d]; got A1 {tuple(A1.shape)}, "
                         f"A2 {tuple(A2.shape)}, A3 {tuple(A3.shape)}, X {tuple(X.shape)}, Y {tuple(Y.shape)}")
    if dO is not None and dO.shape != (n, d):
        raise ValueError(f"dO must be [n, d] = {(n, d)} like the output, got {tuple(dO.shape)}")


def paper_intermediates(A1, A2, A3, X, Y, dO=None, *, scale: float = 1.0) -> dict:
    """Every named matrix of Appendix B: ``S`` (= A1 X), ``scores`` (= scale·A1 X A2ᵀ), ``A``, ``l``,
    ``f``, ``h``, ``O`` and, with ``dO``, ``q``, ``v`` (= (O∘dO)·1) and ``p``. Float64."""
    A1, A2, A3, X, Y = (_f64(t, w) for t, w in ((A1, "A1"), (A2, "A2"), (A3, "A3"), (X, "X"), (Y, "Y")))
    dO = None if dO is None else _f64(dO, "dO")
    _check(A1, A2, A3, X, Y, dO)
    S = A1 @ X
    scores = scale * (S @ A2.T)
    rowmax = scores.max(dim=1, keepdim=True).values
    e = torch.exp(scores - rowmax)
    rowsum = e.sum(dim=1, keepdim=True)
    f = e / rowsum
    l = (torch.exp(rowmax) * rowsum).squeeze(1)
    h = A3 @ Y
    O = f @ h
    out = {"S": S, "scores": scores, "A": torch.exp(scores), "l": l, "f": f, "h": h, "O": O}
    if dO is not None:
        q = dO @ h.T
        v = (O * dO).sum(dim=1)
        out.update(q=q, v=v, p=f * q - v[:, None] * f)
    return out


def paper_forward(A1, A2, A3, X, Y, *, scale: float = 1.0):
    """``(O, l)``: O = D⁻¹ exp(scale·A1 X A2ᵀ) A3 Y (Definition 3.1/B.7) and l = exp(scale·A1 X A2ᵀ)·1
    (Definition B.4). Float64."""
    r = paper_intermediates(A1, A2, A3, X, Y, scale=scale)
    return r["O"], r["l"]


def paper_gradients(A1, A2, A3, X, Y, dO, *, scale: float = 1.0) -> dict:
    """Gradients of ``L`` with ``dL/dO = dO``, from the definitions (float64)::

        dX  = scale · A1ᵀ p A2     (= the paper's g, Definition 3.2, when scale = 1)
        dA1 = scale · p A2 Xᵀ,   dA2 = scale · pᵀ A1 X
        dY  = A3ᵀ fᵀ dO,          dA3 = fᵀ dO Yᵀ

    Returns ``dict(dX, dY, dA1, dA2, dA3)``.
    """
    r = paper_intermediates(A1, A2, A3, X, Y, dO, scale=scale)
    A1, A2, A3, X, Y, dO = (_f64(t, "operand") for t in (A1, A2, A3, X, Y, dO))
    p, f = r["p"], r["f"]
    fT_dO = f.T @ dO
    return {"dX": scale * (A1.T @ p @ A2), "dY": A3.T @ fT_dO, "dA1": scale * (p @ A2 @ X.T),
            "dA2": scale * (p.T @ r["S"]), "dA3": fT_dO @ Y.T}


def paper_gradients_autograd(A1, A2, A3, X, Y, dO, *, scale: float = 1.0) -> dict:
    """The same gradients by float64 autograd through ``softmax(scale·A1 X A2ᵀ) A3 Y`` with the
    linear loss ``sum(O * dO)`` (an independent cross-check of :func:`paper_gradients`)."""
    ts = [_f64(t, w).requires_grad_(True) for t, w in ((A1, "A1"), (A2, "A2"), (A3, "A3"), (X, "X"), (Y, "Y"))]
    dO = _f64(dO, "dO")
    _check(*[t.detach() for t in ts], dO)
    A1, A2, A3, X, Y = ts
    with torch.enable_grad():
        O = torch.softmax(scale * (A1 @ X @ A2.T), dim=1) @ (A3 @ Y)
        gA1, gA2, gA3, gX, gY = torch.autograd.grad((O * dO).sum(), (A1, A2, A3, X, Y))
    return {"dX": gX, "dY": gY, "dA1": gA1, "dA2": gA2, "dA3": gA3}
