"""The probability that a deployment meets every SLA target, from draws of its metrics.

Targets are upper bounds on metrics (``{"ttft_p90_s": 2.0, "itl_p90_s": 0.05}``). The logs
of the targeted metrics over the draws are taken as jointly normal (the log-normal of
:mod:`jkernel.uncertainty.intervals`, with the correlation the draws show: one structural
draw moves TTFT and ITL together); ``P(every target met)`` is that normal's probability
of the box below the targets (:func:`scipy.stats.multivariate_normal.cdf`). Beside it,
``fraction`` is the share of draws that met every target (coarse: a multiple of 1/K), and
per target the **margin** ``target / central − 1`` (positive: headroom at the central
value; the smallest is the binding one). A metric the draws never vary is met or not with
certainty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

__all__ = ["SlaOutcome", "sla_probability"]


@dataclass(frozen=True)
class SlaOutcome:
    """``probability``: P(every target met); ``fraction``: share of draws meeting every
    target; ``margins``: target → ``target / central − 1``; ``binding``: the target with
    the smallest margin; ``central``: target → the draws' median value."""

    probability: float
    fraction: float
    margins: Mapping[str, float] = field(default_factory=dict)
    binding: str = ""
    central: Mapping[str, float] = field(default_factory=dict)

    @property
    def margin(self) -> float:
        return self.margins.get(self.binding, math.nan)


def sla_probability(draws: Mapping[str, np.ndarray], targets: Mapping[str, float]
                    ) -> SlaOutcome:
    """The :class:`SlaOutcome` of metric draws (metric → ``(K,)`` values) against
    ``targets`` (metric → upper bound; a target ≤ 0 is no target). A draw whose targeted
    metric is not a positive number (no request completed) fails every target."""
    from scipy.stats import multivariate_normal, norm

    names = [m for m, t in targets.items() if t and t > 0]
    if not names:
        return SlaOutcome(1.0, 1.0)
    missing = [m for m in names if m not in draws]
    if missing:
        raise KeyError(f"no draws of the targeted metric(s) {missing}")
    x = np.stack([np.asarray(draws[m], float) for m in names], axis=1)
    t = np.array([float(targets[m]) for m in names])
    ok = np.all(np.isfinite(x) & (x > 0), axis=1)
    fraction = float(np.mean(ok & np.all(x <= t, axis=1))) if len(x) else math.nan
    lx = np.log(np.where(ok[:, None], x, np.nan))[ok]
    if len(lx) == 0:
        return SlaOutcome(0.0, 0.0, {m: -math.inf for m in names}, names[0], {})
    mu = lx.mean(axis=0)
    central = {m: float(np.exp(v)) for m, v in zip(names, mu)}
    margins = {m: float(targets[m] / central[m] - 1.0) for m in names}
    binding = min(margins, key=margins.get)
    lt = np.log(t)
    sd = lx.std(axis=0, ddof=1) if len(lx) > 1 else np.zeros(len(names))
    fixed = sd <= 1e-12
    if np.any(fixed & (mu > lt)):
        prob = 0.0
    else:
        var = ~fixed
        if not var.any():
            prob = 1.0
        elif var.sum() == 1:
            i = int(np.flatnonzero(var)[0])
            prob = float(norm.cdf((lt[i] - mu[i]) / sd[i]))
        else:
            cov = np.cov(lx[:, var], rowvar=False)
            cov = cov + np.eye(len(cov)) * 1e-12 * np.trace(cov)
            prob = float(multivariate_normal(mean=mu[var], cov=cov,
                                             allow_singular=True).cdf(lt[var]))
    # a draw that failed to complete requests is a certain miss
    prob *= float(ok.mean())
    return SlaOutcome(float(min(max(prob, 0.0), 1.0)), fraction, margins, binding, central)
