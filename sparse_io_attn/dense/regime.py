"""Which kernel to run: the paper's regime (``M`` vs ``d^2``) and the kernel the exact traffic model
says moves the fewest bytes.

Two questions, two answers:

* :func:`choose_regime` answers the paper's question: Theorem 1.1's dividing point, small-cache
  algorithm iff ``M < d^2`` (the asymptotic split; :func:`sparse_io_attn.bounds.regime_for` answers
  it per device).
* :func:`choose_backward` / :func:`choose_forward` answer the library's question, which is what
  ``regime="auto"`` runs: among the kernels that are *feasible* -- their tiles fit ``M`` words
  (every kernel's declared working set, :mod:`.tiles`) and, for the small-cache kernels, their
  ``n x n`` fp32 buffers fit the free device memory -- the one with the least predicted traffic
  (:mod:`.traffic`, equal to the kernels' counters) for the actual ``(n, d, M, dtype)``. The
  returned :class:`KernelChoice` carries the paper's regime, every candidate's predicted bytes and
  a one-line summary such as ``"paper regime: small; kernel chosen: large-cache FA2 order, 1.7x
  fewer bytes than small-cache"``.

At realistic sizes the two disagree: with an H100's 227 KiB in fp32 at d = 256 (M = 0.89 d^2, the
paper's small-cache regime) the FA2-order large-cache backward moves 1.7x fewer bytes than the
small-cache one over all five gradients (2.0x on the dX path), whose ``n x n`` intermediates
dominate (see ``docs/THEORY.md``).

``M`` is the fast memory per program in words of the input dtype. By default it is the current
GPU's shared memory per block (:func:`sparse_io_attn.bounds.device_fast_memory_words`); without a
GPU, :data:`sparse_io_attn.bounds.DEFAULT_CPU_FAST_MEMORY_BYTES` (an H100's 227 KiB) divided by the
element size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from sparse_io_attn.bounds import DEFAULT_CPU_FAST_MEMORY_BYTES, device_fast_memory_words
from sparse_io_attn.bounds.units import dtype_name, itemsize
from sparse_io_attn.tally.report import TrafficReport
from sparse_io_attn.dense import traffic
from sparse_io_attn.dense.buffers import nn_buffer_bytes, small_forward_buffer_bytes
from sparse_io_attn.dense.tiles import min_large_cache_M

REGIMES = ("auto", "small", "large")

#: Candidate kernels of each pass (keys of :attr:`KernelChoice.candidates`).
BACKWARD_KERNELS = ("small", "large-faithful", "large-fa2")
FORWARD_KERNELS = ("small", "large")

LABELS = {
    ("backward", "small"): "small-cache (Algorithm 6)",
    ("backward", "large-faithful"): "large-cache as written (Algorithm 9)",
    ("backward", "large-fa2"): "large-cache FA2 order",
    ("forward", "small"): "small-cache forward (Saha & Ye)",
    ("forward", "large"): "large-cache forward (FlashAttention order)",
}
_SHORT = {"small": "small-cache", "large-faithful": "large-cache as written", "large-fa2": "large-cache FA2 order",
          "large": "large-cache"}


def default_M(dtype: torch.dtype, device=None) -> int:
    """Fast memory ``M`` in words of ``dtype`` for ``device`` (see the module docstring)."""
    if device is not None and torch.device(device).type == "cuda":
        words = device_fast_memory_words(dtype, torch.device(device))
    else:
        words = None
    if words is None:
        words = DEFAULT_CPU_FAST_MEMORY_BYTES // itemsize(dtype)
    return int(words)


@functools.lru_cache(maxsize=None)
def _min_large(d: int, variant: str) -> int:
    return min_large_cache_M(d, variant)


def choose_regime(d: int, M: int, regime: str = "auto", variant: str = "faithful") -> str:
    """The paper's answer, ``"small"`` or ``"large"`` (not what ``regime="auto"`` runs: that is
    :func:`choose_backward`, by predicted bytes).

    ``"auto"``: small-cache kernel when ``M < d^2`` (Theorem 1.1's dividing point), large-cache
    kernel otherwise -- except when the large-cache ``variant`` cannot fit its tiles (and, for
    ``"faithful"``, the resident ``d x d`` gradient) in ``M`` (``M < min_large_cache_M(d,
    variant)``), where the small-cache kernel is the only one that runs.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    if regime != "auto":
        return regime
    if M < d * d:
        return "small"
    return "large" if M >= _min_large(d, variant) else "small"


@dataclass(frozen=True)
class KernelChoice:
    """What ``regime="auto"`` (or a forced regime) runs for one pass, and why.

    ``kernel``: a key of ``candidates`` (backward: ``"small"``, ``"large-faithful"``,
    ``"large-fa2"``; forward: ``"small"``, ``"large"``). ``candidates[key]``: ``{"bytes": predicted
    bytes or None, "feasible": bool, "why": reason when not feasible}``. ``paper_regime``:
    ``"small"`` iff ``M < d^2``. ``forced``: the regime was given, not chosen.
    """
    pass_: str
    n: int
    d: int
    M: int
    dtype: str
    batch: int
    kernel: str
    predicted_bytes: int | None
    paper_regime: str
    candidates: dict = field(default_factory=dict)
    forced: bool = False
    includes_forward: bool = False

    @property
    def regime(self) -> str:
        """``"small"`` or ``"large"``: the family of the chosen kernel."""
        return "small" if self.kernel == "small" else "large"

    @property
    def variant(self) -> str | None:
        """The large-cache backward variant (``"faithful"``/``"fa2"``), else ``None``."""
        return self.kernel.split("-", 1)[1] if self.kernel.startswith("large-") else None

    @property
    def label(self) -> str:
        return LABELS[(self.pass_, self.kernel)]

    def bytes_of(self, key: str) -> int | None:
        return self.candidates[key]["bytes"] if self.candidates[key]["feasible"] else None

    def compared_with(self) -> str | None:
        """The candidate the summary compares with: the best feasible kernel of the paper's regime
        when the choice left it, else the best feasible kernel of the other family."""
        feasible = {k: c["bytes"] for k, c in self.candidates.items() if c["feasible"] and k != self.kernel}
        if not feasible:
            return None
        fam = lambda k: "small" if k == "small" else "large"  # noqa: E731
        target = self.paper_regime if fam(self.kernel) != self.paper_regime else \
            ("large" if fam(self.kernel) == "small" else "small")
        pool = {k: b for k, b in feasible.items() if fam(k) == target} or feasible
        return min(pool, key=pool.get)

    def summary(self) -> str:
        """E.g. ``"paper regime: small; kernel chosen: large-cache FA2 order, 1.7x fewer bytes than
        small-cache"`` (H100 fp32, d = 256, n = 8192)."""
        head = f"paper regime: {self.paper_regime}; kernel {'forced' if self.forced else 'chosen'}: {self.label}"
        other = self.compared_with()
        if self.predicted_bytes is None:
            return head + " (its tiles or buffers do not fit: it will refuse or exceed M)"
        if other is None:
            return head + " (the only kernel that fits)"
        ob = self.candidates[other]["bytes"]
        r = ob / self.predicted_bytes
        f = lambda x: f"{x:.1f}" if x < 10 else f"{x:.3g}"  # noqa: E731
        rel = f"{f(r)}x fewer bytes than" if r >= 1 else f"{f(1 / r)}x more bytes than"
        return f"{head}, {rel} {_SHORT[other]}"

    def to_dict(self) -> dict:
        return {"pass": self.pass_, "n": self.n, "d": self.d, "M": self.M, "dtype": self.dtype,
                "batch": self.batch, "paper_regime": self.paper_regime, "kernel": self.kernel,
                "label": self.label, "predicted_bytes": self.predicted_bytes, "forced": self.forced,
                "includes_forward": self.includes_forward,
                "candidates": {k: dict(v) for k, v in self.candidates.items()}, "summary": self.summary()}

    def __str__(self) -> str:
        return self.summary()


def _check_regime(regime):
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")


def _fits(need: int, memory_bytes) -> bool:
    return memory_bytes is None or need <= memory_bytes


def _infeasible(e: ValueError) -> dict:
    """A candidate whose model refused the size: the reason, its first clause."""
    return {"bytes": None, "feasible": False, "why": str(e).split(";")[0]}


def _small_candidate(model, buffer_bytes, buffers: str, memory_bytes) -> dict:
    """A small-cache candidate: ``model()``'s predicted bytes, feasible when its ``n x n`` buffers
    (``buffer_bytes()``, named ``buffers`` in the reason) fit ``memory_bytes`` (:func:`_fits`)."""
    try:
        b = model().total_bytes
        need = buffer_bytes()
        ok = _fits(need, memory_bytes)
        return {"bytes": b, "feasible": ok, "why": "" if ok else f"{buffers} need {need:,} B > {memory_bytes:,} B free"}
    except ValueError as e:
        return _infeasible(e)


def _pick(pass_, n, d, M, dtype, batch, cands, regime, forced_key, includes_forward=False) -> KernelChoice:
    common = dict(pass_=pass_, n=n, d=d, M=M, dtype=dtype_name(dtype), batch=batch, paper_regime="small" if
                  M < d * d else "large", candidates=cands, includes_forward=includes_forward)
    if regime != "auto":
        c = cands[forced_key]
        return KernelChoice(kernel=forced_key, predicted_bytes=c["bytes"] if c["feasible"] else None,
                            forced=True, **common)
    feasible = {k: c["bytes"] for k, c in cands.items() if c["feasible"]}
    if not feasible:
        why = "; ".join(f"{LABELS[(pass_, k)]}: {c['why']}" for k, c in cands.items())
        raise ValueError(f"no {pass_} kernel fits M = {M:,} words at n = {n:,}, d = {d}: {why}")
    best = min(feasible, key=lambda k: (feasible[k], list(cands).index(k)))
    return KernelChoice(kernel=best, predicted_bytes=feasible[best], **common)


def choose_forward(n: int, d: int, M: int, *, dtype=torch.float32, batch: int = 1, regime: str = "auto",
                   memory_bytes: int | None = None) -> KernelChoice:
    """The forward kernel ``dense.forward(regime=...)`` runs.

    Candidates: ``"small"`` (the small-cache forward of Saha & Ye: ``B x B`` tiles, ``f`` stored
    ``n x n``; feasible when ``M >= 1024`` and its fp32 buffers, :func:`.buffers.small_forward_buffer_bytes`,
    fit ``memory_bytes``) and ``"large"`` (FlashAttention order; feasible when its tiles fit ``M``).
    ``"auto"`` takes the feasible one with fewer predicted bytes (:func:`forward_traffic`);
    ``memory_bytes=None`` skips the memory check.
    """
    _check_regime(regime)
    cands = {"small": _small_candidate(lambda: traffic.small_forward_traffic(n, d, M, batch=batch, dtype=dtype),
                                       lambda: small_forward_buffer_bytes(n, d, batch), "its n x n buffers",
                                       memory_bytes)}
    try:
        b = traffic.large_forward_traffic(n, d, M, batch=batch, dtype=dtype, fit=True).total_bytes
        cands["large"] = {"bytes": b, "feasible": True, "why": ""}
    except ValueError as e:
        cands["large"] = _infeasible(e)
    return _pick("forward", n, d, M, dtype, batch, cands, regime, regime)


def choose_backward(n: int, d: int, M: int, *, dtype=torch.float32, batch: int = 1, regime: str = "auto",
                    variant: str | None = None, num_splits: int = 1, memory_bytes: int | None = None,
                    with_forward: bool = False) -> KernelChoice:
    """The backward kernel ``dense.backward(regime=...)`` runs (all five gradients).

    Candidates: ``"small"`` (Algorithm 6; feasible when ``M >= 1024`` and ``f, q, p, T``,
    :func:`.buffers.nn_buffer_bytes`, fit ``memory_bytes``), ``"large-faithful"`` (Algorithm 9
    as written) and ``"large-fa2"`` (FlashAttention-2 loop order), feasible when every tile and the
    resident gradient fit ``M``. ``variant`` restricts the large-cache candidates to one variant
    (``None``: both under ``"auto"``, ``"faithful"`` for ``regime="large"``). ``with_forward``: the
    forward's ``O`` and ``lse`` are not available, so the large-cache kernels also pay for
    :func:`choose_forward`'s forward (and are infeasible when no forward fits). ``"auto"`` takes the
    feasible candidate with the fewest predicted bytes (:mod:`.traffic`).
    """
    _check_regime(regime)
    if variant not in (None, "faithful", "fa2"):
        raise ValueError(f"variant must be 'faithful', 'fa2' or None, got {variant!r}")
    cands = {"small": _small_candidate(lambda: traffic.small_cache_traffic(n, d, M, batch=batch, dtype=dtype),
                                       lambda: nn_buffer_bytes(n, d, batch), "f, q, p, T", memory_bytes)}
    fwd_bytes, fwd_why = 0, ""
    if with_forward:
        try:
            fwd_bytes = choose_forward(n, d, M, dtype=dtype, batch=batch, memory_bytes=memory_bytes).predicted_bytes
        except ValueError as e:
            fwd_bytes, fwd_why = None, str(e)
    for v in ("faithful", "fa2"):
        key = f"large-{v}"
        if variant is not None and v != variant:
            cands[key] = {"bytes": None, "feasible": False, "why": f"variant={variant!r} was asked for"}
            continue
        try:
            b = traffic.large_cache_traffic(n, d, M, batch=batch, dtype=dtype, variant=v,
                                            num_splits=num_splits).total_bytes
        except ValueError as e:
            cands[key] = _infeasible(e)
            continue
        if fwd_bytes is None:
            cands[key] = {"bytes": None, "feasible": False, "why": f"needs a forward first: {fwd_why}"}
        else:
            cands[key] = {"bytes": b + fwd_bytes, "feasible": True, "why": ""}
    forced = "small" if regime == "small" else f"large-{variant or 'faithful'}"
    return _pick("backward", n, d, M, dtype, batch, cands, regime, forced, includes_forward=with_forward)


def forward_traffic(n: int, d: int, M: int, *, batch: int = 1, dtype=torch.float32, regime: str = "auto",
                    memory_bytes: int | None = None) -> TrafficReport:
    """Predicted traffic of :func:`~sparse_io_attn.dense.forward` with the same ``regime``: the
    kernel :func:`choose_forward` picks (``memory_bytes`` as there; ``None`` skips the
    memory check, which the launcher makes with the device's free memory)."""
    choice = choose_forward(n, d, M, dtype=dtype, batch=batch, regime=regime, memory_bytes=memory_bytes)
    if choice.kernel == "small":
        return traffic.small_forward_traffic(n, d, M, batch=batch, dtype=dtype)
    return traffic.large_forward_traffic(n, d, M, batch=batch, dtype=dtype, fit=regime == "auto")


def kernel_choice(n: int, d: int, M: int, dtype=torch.float32) -> dict:
    """What ``dense.backward`` / ``dense.forward`` with ``regime="auto"`` run for one (batch, head)
    problem of this size (``choose_backward`` with the forward's outputs given, as in
    training; ``choose_forward``), next to the paper's regime: the chosen kernels, each
    candidate's predicted bytes and a summary line. The small-cache kernels' ``n x n`` buffers are
    reported (bytes), not checked against a device's memory."""
    out = {"paper_regime": "small" if M < d * d else "large"}
    for pass_, fn in (("backward", choose_backward), ("forward", choose_forward)):
        try:
            c = fn(n, d, M, dtype=dtype)
            out[pass_] = c.to_dict()
        except ValueError as e:
            out[pass_] = {"kernel": None, "label": None, "summary": f"no {pass_} kernel fits: {e}"}
    g = {}
    for key in ("small", "large-faithful", "large-fa2"):
        try:
            rep = (traffic.small_cache_traffic(n, d, M, dtype=dtype, g_only=True) if key == "small" else
                   traffic.large_cache_traffic(n, d, M, dtype=dtype, variant=key.split("-")[1], g_only=True))
            g[key] = rep.total_bytes
        except ValueError:
            g[key] = None
    out["backward_dX_path_bytes"] = g
    out["small_cache_buffers_bytes"] = {"backward (f, q, p, T)": nn_buffer_bytes(n, d),
                                        "forward (f, S, h)": small_forward_buffer_bytes(n, d)}
    return out
