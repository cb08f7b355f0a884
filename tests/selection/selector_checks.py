"""Shared checks of the selector tests: tie-aware comparison of a chosen set with a reference's scores,
and runs of ``selection_attention`` against a reference on the backend's device."""
from __future__ import annotations

import pytest
import torch

from sparse_io_attn.block_sparse.reference import rel_err


def with_backends(cases: list, backends, *, triton_cases: int = 1) -> list:
    """``pytest.param(backend, *case)`` for every case and backend, but only the first
    ``triton_cases`` cases on ``"triton"`` (Triton's interpreter on CPU: a few tiny fp32 cases)."""
    return [pytest.param(b, *c.values, id=f"{c.id}-{b}") for i, c in enumerate(cases) for b in backends
            if b != "triton" or i < triton_cases]


def chosen_mask(indices: torch.Tensor, width: int) -> torch.Tensor:
    """int ``[..., K]`` (``-1`` empty) -> bool ``[..., width]``; raises on a repeated entry."""
    idx = indices.to(torch.int64).cpu()
    valid = idx >= 0
    mask = torch.zeros(*idx.shape[:-1], width + 1, dtype=torch.int64)
    mask.scatter_add_(-1, torch.where(valid, idx, width), valid.to(torch.int64))
    assert mask[..., :width].max() <= 1, "a selection row lists an entry twice"
    return mask[..., :width].bool()


def assert_valid_topk(chosen: torch.Tensor, scores: torch.Tensor, eligible: torch.Tensor, k: int, *,
                      tol: float = 1e-5, what: str = "") -> torch.Tensor:
    """Tie-aware: ``chosen`` bool ``[..., M]`` is a valid top-``k`` of the reference ``scores [..., M]``
    among ``eligible [..., M]`` iff it lies inside ``eligible``, holds ``min(k, #eligible)`` entries and
    no eligible entry left out scores above a chosen one by more than ``tol`` (relative to the row's
    largest finite magnitude). Where the k-th and (k+1)-th eligible scores differ by more than that
    this is the reference's own set; within it, any tie-break the reference may make. Returns bool
    ``[...]``: the rows whose boundary was a (near-)tie (elsewhere the set is unique)."""
    chosen, scores, eligible = chosen.cpu(), scores.detach().double().cpu(), eligible.cpu().expand_as(chosen)
    assert not (chosen & ~eligible).any(), f"{what}: an ineligible entry was chosen"
    want = torch.clamp(eligible.sum(-1), max=k)
    assert torch.equal(chosen.sum(-1), want), f"{what}: chosen counts differ from min(k, #eligible)"
    finite = torch.where(torch.isfinite(scores), scores.abs(), 0.0).amax(-1, keepdim=True).clamp_min(1.0)
    s = scores / finite
    low = torch.where(chosen, s, torch.inf).amin(-1)
    high = torch.where(eligible & ~chosen, s, -torch.inf).amax(-1)
    assert (low >= high - tol).all(), f"{what}: an eligible entry left out scores above a chosen one " \
                                      f"(worst gap {float((high - low).max()):.3g})"
    return (high - low).abs() <= tol


def close(got, ref, tol: float = 1e-5) -> dict:
    """``{name: rel_err}`` above ``tol`` (empty when all pass) for matching sequences of tensors."""
    names = ("out", "dq", "dk", "dv")
    errs = {n: rel_err(g.detach().double().cpu(), r.detach().double().cpu()) for n, g, r in zip(names, got, ref)}
    return {n: e for n, e in errs.items() if not e <= tol}
