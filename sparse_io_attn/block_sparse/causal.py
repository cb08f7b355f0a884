"""The causal alignments of block-sparse attention: ``causal=`` -> the offset ``delta`` of the mask
``j <= i + delta`` that every backend, the references and the traffic model apply."""
from __future__ import annotations

CAUSAL_MODES = (False, True, "top_left", "bottom_right")


def causal_offset(causal, seqlen_q: int, seqlen_k: int) -> int | None:
    """``causal`` -> the offset ``delta`` of the causal mask ``j <= i + delta``, or ``None``.

    ``False``: no causal mask. ``True`` or ``"top_left"``: ``delta = 0`` (query ``i`` sees keys
    ``0..i``, like ``scaled_dot_product_attention(is_causal=True)``). ``"bottom_right"``:
    ``delta = seqlen_k - seqlen_q`` (the last query sees every key; FlashAttention-2's convention
    for ``seqlen_q != seqlen_k``, what decoding with a KV cache and chunked prefill need).
    """
    if causal is False or causal is None:
        return None
    if causal is True or causal == "top_left":
        return 0
    if causal == "bottom_right":
        return int(seqlen_k) - int(seqlen_q)
    raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
