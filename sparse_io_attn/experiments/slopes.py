"""Log-log slopes: how traffic scales with the fast memory ``M`` (the exponents of the bounds)."""
from __future__ import annotations

import math
from typing import Sequence


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x`` (e.g. -0.5 for traffic ~ M^-1/2)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"loglog_slope needs two equally long sequences of >= 2 points, got "
                         f"{len(xs)} and {len(ys)}")
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
