"""From draws of a metric to its prediction interval and the share of each source.

A metric's draws (one value per draw of the constants, the structural error and the
workload) are taken as log-normal: with ``m`` and ``s`` the mean and standard deviation of
their logs over ``K`` draws, the interval at level ``L`` is the prediction interval of one
more draw, ``exp(m ± t · s · sqrt(1 + 1/K))`` with ``t`` the Student-t quantile of
``(1 + L) / 2`` on ``K − 1`` degrees of freedom; the central value is ``exp(m)`` (the
median of the log-normal). ``method="empirical"`` takes the draws' own quantiles instead
(no shape assumed; coarse for small ``K``).

Shares (:func:`shares`): the log metric is regressed on one summary per source and draw
(the constants' draw as its effect on the replay's step price, the systematic structural
draw, the front-end draw, the workload seed as a factor); each source's share is the
variance of its fitted part over the total variance of the log metric, and what no single
source explains (per-step jitter, interactions, the queue's non-linearity) is ``other``.
The shares sum to one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

__all__ = ["SOURCES", "MetricInterval", "interval", "shares", "METRICS", "metric_values"]

#: The sources of a draw, in report order; ``other`` is what none of them explains alone.
SOURCES = ("constants", "structural", "front_end", "workload", "other")
#: The metrics an interval replay reports (keys of the replay summary, seconds or per s).
METRICS = tuple(f"{m}_{s}_s" for m in ("ttft", "itl", "e2e") for s in ("mean", "p50", "p90",
                                                                         "p99")) + (
    "throughput_tokens_per_s", "output_tokens_per_s")


@dataclass(frozen=True)
class MetricInterval:
    """One metric's prediction interval.

    ``point``: the replay at the point constants, without any error; ``central``: the
    draws' median (``exp`` of their mean log); ``low``/``high``: the interval at ``level``;
    ``shares``: source → share of the log variance (:data:`SOURCES`); ``draws``: the
    values drawn."""

    metric: str
    point: float
    central: float
    low: float
    high: float
    level: float
    shares: Mapping[str, float] = field(default_factory=dict)
    draws: tuple[float, ...] = ()

    def contains(self, value: float) -> bool:
        return bool(self.low <= value <= self.high)

    @property
    def log_sd(self) -> float:
        """Standard deviation of the draws' logs."""
        x = np.log(np.asarray(self.draws, float))
        x = x[np.isfinite(x)]
        return float(np.std(x, ddof=1)) if x.size > 1 else float("nan")


def _t_quantile(p: float, dof: int) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(p, dof))


def interval(values, level: float, *, method: str = "normal") -> tuple[float, float, float]:
    """``(central, low, high)`` of positive draws ``values`` at ``level`` (module
    docstring); NaN where fewer than two draws are finite and positive."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = np.asarray(values, float)
    x = x[np.isfinite(x) & (x > 0)]
    if x.size < 2:
        return (float(x[0]),) * 3 if x.size == 1 else (math.nan,) * 3
    lx = np.log(x)
    m = float(lx.mean())
    if method == "empirical":
        lo, hi = np.quantile(lx, [(1 - level) / 2, (1 + level) / 2])
        return math.exp(float(np.median(lx))), math.exp(float(lo)), math.exp(float(hi))
    if method != "normal":
        raise ValueError(f"method must be 'normal' or 'empirical', not {method!r}")
    s = float(lx.std(ddof=1))
    half = _t_quantile((1 + level) / 2, x.size - 1) * s * math.sqrt(1 + 1 / x.size)
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def shares(values, features: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Each source's share of the variance of ``log(values)`` (module docstring).
    ``features``: source → ``(K,)`` or ``(K, f)`` summaries of the draws (constant columns
    are dropped). Returns every name of :data:`SOURCES` (0 for a source not given); NaN
    shares when there are too few draws for the regression or no variance at all."""
    y = np.log(np.asarray(values, float))
    out = {s: 0.0 for s in SOURCES}
    ok = np.isfinite(y)
    total = float(np.var(y[ok])) if ok.sum() > 1 else 0.0
    blocks, names = [], []
    for name, f in features.items():
        f = np.asarray(f, float)
        f = f.reshape(len(y), -1)[ok]
        keep = np.std(f, axis=0) > 0
        if keep.any():
            blocks.append(f[:, keep] - f[:, keep].mean(axis=0))
            names.append(name)
    if total <= 0:
        return out if not blocks else {s: math.nan for s in SOURCES} | {
            n: 0.0 for n in SOURCES if n not in names}
    cols = sum(b.shape[1] for b in blocks)
    if not blocks or ok.sum() < cols + 2:
        out.update({s: math.nan for s in names})
        out["other"] = math.nan
        return out
    yc = y[ok] - y[ok].mean()
    X = np.concatenate(blocks, axis=1)
    beta = np.linalg.lstsq(X, yc, rcond=None)[0]
    at = 0
    explained = 0.0
    for name, b in zip(names, blocks):
        part = b @ beta[at:at + b.shape[1]]
        at += b.shape[1]
        v = float(np.var(part))
        out[name] = v / total
        explained += v
    out["other"] = max(0.0, 1.0 - explained / total)
    norm = sum(out.values())
    return {k: v / norm for k, v in out.items()} if norm > 0 else out


def metric_values(summaries) -> dict[str, np.ndarray]:
    """Metric → ``(K,)`` values from K replay summaries (dicts with :data:`METRICS` keys)."""
    return {m: np.array([float(s.get(m, math.nan)) for s in summaries]) for m in METRICS}
