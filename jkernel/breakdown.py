"""Where a step's time goes: one estimate's terms as a table (``Kernel.breakdown``,
``jkernel price --breakdown``).

Each row is a layer kind × named term (:mod:`jkernel.terms`) with its seconds on every
resource and its part of ``expected_s``; the rows add up to the step's totals.
"""

from __future__ import annotations

from .plan import Plan
from .stages import RESOURCES
from .terms import STEP, Side, side

__all__ = ["BREAKDOWN_COLUMNS", "breakdown_table"]

#: Columns of :func:`breakdown_table` (seconds unless named otherwise).
BREAKDOWN_COLUMNS = ("kind", "layers", "term", *(f"{r}_s" for r in RESOURCES), "expected_s",
                     "share")


def breakdown_table(plan: Plan, estimate):
    """Rows of layer kind × term × resource seconds of one (unbatched) estimate.

    Returns a :class:`pandas.DataFrame` with :data:`BREAKDOWN_COLUMNS`: ``layers`` is the
    kind's layer count (1 for the step-level terms, kind :data:`jkernel.terms.STEP`); the
    resource columns are the edges' seconds of the term over all its layers, and sum over
    the rows to ``per_resource_s``; ``expected_s`` is the term's part of ``expected_s`` on
    its critical path — the GPU terms when ``gpu_s ≥ host_s``, else the host terms (the
    other side is hidden under it and shows 0), plus the host-serial ones — so the column
    sums to ``expected_s`` (exactly for the hard maximum, ``smooth_temperature = 0``);
    ``share`` is ``expected_s`` of the row over the step's. A term's side is the one
    :data:`jkernel.terms.LAYER_TERMS` / :data:`~jkernel.terms.STEP_TERMS` give it.
    """
    import numpy as np
    import pandas as pd

    if estimate.terms is None:
        raise ValueError("this estimate carries no terms (a packed fast path); price with "
                         "Kernel.breakdown or step_fn")
    counts = {k.id: k.count for k in plan.kinds}
    f = lambda x: float(np.asarray(x))  # noqa: E731
    sides = {(kid, n): side(kid, n) for kid, d in estimate.terms.items() for n in d}
    gpu = sum(f(t.expected_s) for kid, d in estimate.terms.items() for n, t in d.items()
              if sides[kid, n].gpu)
    host = sum(f(t.expected_s) for kid, d in estimate.terms.items() for n, t in d.items()
               if sides[kid, n] is Side.HOST)
    gpu_critical = gpu >= host
    total = f(estimate.expected_s)
    rows = []
    order = [k.id for k in plan.kinds] + [STEP]
    for kid in order:
        for name in sorted(estimate.terms[kid]):
            t = estimate.terms[kid][name]
            where = sides[kid, name]
            if where is Side.HOST_SERIAL:
                exp = f(t.expected_s)
            elif where is Side.HOST:
                exp = f(t.expected_s) if not gpu_critical else 0.0
            else:
                exp = f(t.expected_s) if gpu_critical else 0.0
            rows.append((kid, counts.get(kid, 1), name, *(f(x) for x in t.per_resource_s),
                         exp, exp / total if total > 0 else 0.0))
    return pd.DataFrame(rows, columns=list(BREAKDOWN_COLUMNS))
