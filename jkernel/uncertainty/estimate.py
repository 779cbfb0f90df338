"""Estimating the error model from held-out residuals (the statistics; the data study that
gathers the residuals is ``validation/error_model.py``).

Two kinds of residual, both ``log(measured / predicted)``, both from data the constants
were not fitted on:

* :class:`StepResiduals`: the steps of a measured step trace (a residency-vllm run rebuilt
  by :mod:`jkernel.calibration.data.residency`) priced at the shipped constants, each with
  its regime (:func:`jkernel.regimes.classify`): they give the **step jitter** per regime
  (the scatter of a step about its run's median, pooled over runs: ``1.4826 · MAD``) and
  the fitted deployment's per-regime **systematic** spread where the run medians differ;
* :class:`GroupResidual`: one compared group of a serving run (a load stage, a load
  point, a run): the step error at the group's measured operating point (the measured
  mean ITL against the price of the batch Little's law gives it, decodes plus the
  prompt work that keeps them fed) and, for client-side timings at a light load, the
  measured minus predicted mean TTFT (the **front end**, seconds).

Group residuals are pooled per extrapolation class with every deployment weighing the
same (its groups share the weight): the bias is the weighted mean, the spread the weighted
standard deviation, widened by ``sqrt(1 + 1/n)`` for ``n`` deployments (the predictive
spread of a new deployment when the mean itself is estimated). A regime or class with
fewer than :data:`MIN_STEPS` steps or :data:`MIN_UNITS` deployments is *borrowed* from the
nearest one that has them, and the document says so (``borrowed_from``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..regimes import REGIMES, Regime
from .errormodel import CLASSES, Correlation, ErrorModel, FittedRange, FrontEnd, Spread

__all__ = ["StepResiduals", "GroupResidual", "MIN_STEPS", "MIN_UNITS", "step_jitter",
           "systematic", "front_end", "estimate", "weighted_spread", "BORROW"]

#: Fewest steps of a regime for its own jitter.
MIN_STEPS = 200
#: Fewest deployments (or runs, for the fitted class) for a class's own spread.
MIN_UNITS = 3
#: Where a regime borrows from when its data is too thin, in order of preference.
BORROW = {Regime.DECODE: (Regime.MIXED,), Regime.MIXED: (Regime.DECODE,),
          Regime.PREFILL: (Regime.MIXED, Regime.DECODE),
          Regime.HOST: (Regime.DECODE, Regime.MIXED)}
_MAD = 1.482602218505602


@dataclass(frozen=True)
class StepResiduals:
    """Held-out steps of one measured run: ``regime`` (int, :class:`~jkernel.regimes.Regime`)
    and ``log_ratio`` per step, ``(n,)`` each."""

    run: str
    regime: np.ndarray
    log_ratio: np.ndarray
    source: str = ""


@dataclass(frozen=True)
class GroupResidual:
    """One compared group of a serving run.

    ``cls``: its extrapolation class; ``step_log_ratio``: log(measured mean ITL / the
    price of its operating-point step); ``ttft_residual_s``: measured − predicted mean TTFT
    (NaN where the group does not inform the front end: engine-clock timings, a load
    with queueing, an unknown cache state); ``deployment``: the bundle (groups of one
    deployment share one weight)."""

    source: str
    run: str
    group: str
    deployment: str
    chip: str
    cls: str
    step_log_ratio: float
    ttft_residual_s: float = float("nan")


def weighted_spread(values: Sequence[float], keys: Sequence[str]) -> tuple[float, float, int]:
    """``(mean, sd, units)`` of ``values`` with every distinct key weighing the same;
    ``sd`` is the weighted standard deviation (mean square about the mean times
    ``units / (units − 1)``) widened by ``sqrt(1 + 1/units)``; NaN values are left out."""
    v = np.asarray(values, float)
    k = np.asarray(keys, object)
    ok = np.isfinite(v)
    v, k = v[ok], k[ok]
    if v.size == 0:
        return float("nan"), float("nan"), 0
    uniq, inv, counts = np.unique(k.astype(str), return_inverse=True, return_counts=True)
    w = 1.0 / counts[inv]
    mean = float(np.sum(w * v) / np.sum(w))
    units = len(uniq)
    if units < 2:
        return mean, float("nan"), units
    # the weighted mean square about the mean, with n / (n − 1) for n units (a unit's
    # groups are not independent draws, so the units are what is counted)
    var = float(np.sum(w * (v - mean) ** 2) / np.sum(w)) * units / (units - 1)
    return mean, math.sqrt(max(var, 0.0) * (1.0 + 1.0 / units)), units


def step_jitter(steps: Sequence[StepResiduals]) -> tuple[Spread, ...]:
    """Per regime, the pooled robust scatter of a step about its run's regime median."""
    dev = {r: [] for r in REGIMES}
    for s in steps:
        reg = np.asarray(s.regime)
        lr = np.asarray(s.log_ratio, float)
        for r in REGIMES:
            x = lr[(reg == r) & np.isfinite(lr)]
            if x.size:
                dev[r].append(x - np.median(x))
    runs = ", ".join(sorted({s.run for s in steps}))
    out: dict[Regime, Spread] = {}
    for r in REGIMES:
        x = np.concatenate(dev[r]) if dev[r] else np.zeros(0)
        if x.size >= MIN_STEPS:
            out[r] = Spread(0.0, float(_MAD * np.median(np.abs(x))), int(x.size), "steps",
                            f"held-out steps of {runs}: 1.4826·MAD about each run's median")
    for r in REGIMES:
        if r in out:
            continue
        have = int(sum(len(x) for x in dev[r]))
        for b in BORROW[r]:
            if b in out and not out[b].borrowed_from:
                out[r] = Spread(0.0, out[b].sd, have, "steps",
                                f"{have} {r.label} steps (fewer than {MIN_STEPS})",
                                b.label)
                break
        else:
            raise ValueError(f"no regime has {MIN_STEPS} held-out steps to estimate the "
                             f"step jitter from")
    return tuple(out[r] for r in REGIMES)


def systematic(steps: Sequence[StepResiduals], groups: Sequence[GroupResidual]
               ) -> dict[str, tuple[Spread, ...]]:
    """Per class and regime, the systematic spread (module docstring). The serving groups'
    operating-point steps are decodes with the prompt work that feeds them, so they
    measure the ``decode`` and ``mixed`` regimes together; the fitted class's ``prefill``
    spread comes from the step traces' run medians where they have prefill steps."""
    by_class: dict[str, dict[Regime, Spread]] = {c: {} for c in CLASSES}
    for c in CLASSES:
        g = [x for x in groups if x.cls == c and np.isfinite(x.step_log_ratio)]
        if not g:
            continue
        # the fitted deployment's runs are its units; elsewhere a deployment is one unit
        per_run = c in ("fitted", "fitted_deployment")
        unit = "runs" if per_run else "deployments"
        key = [x.run for x in g] if per_run else [x.deployment for x in g]
        mean, sd, units = weighted_spread([x.step_log_ratio for x in g], key)
        if units >= MIN_UNITS and np.isfinite(sd):
            src = (f"{len(g)} groups of {units} {unit} ({', '.join(sorted(set(x.source for x in g)))}): "
                   "measured mean ITL against the operating-point step")
            for r in (Regime.DECODE, Regime.MIXED):
                by_class[c][r] = Spread(mean, sd, units, unit, src)
    # the fitted deployment's prefill steps: run medians of the step traces
    pre = [float(np.median(np.asarray(s.log_ratio)[np.asarray(s.regime) == Regime.PREFILL]))
           for s in steps if np.sum(np.asarray(s.regime) == Regime.PREFILL) >= MIN_STEPS]
    if len(pre) >= MIN_UNITS:
        mean, sd, units = weighted_spread(pre, [str(i) for i in range(len(pre))])
        by_class["fitted"][Regime.PREFILL] = Spread(mean, sd, units, "runs",
                                                    "prefill steps of the step traces")
    have = {c for c in CLASSES if any(not s.borrowed_from for s in by_class[c].values())}
    if not have:
        raise ValueError(f"no extrapolation class has groups of {MIN_UNITS} or more units")
    out: dict[str, tuple[Spread, ...]] = {}
    for i, c in enumerate(CLASSES):
        cur = by_class[c]
        if c not in have:
            # too little data of its own: the nearest class that has some, farther from the
            # fitted data first (the conservative side), then nearer
            farther = [d for d in CLASSES[i + 1:] if d in have]
            nearer = [d for d in CLASSES[:i][::-1] if d in have]
            d = (farther or nearer)[0]
            donor = by_class[d]
            cur = {r: Spread(donor[r].bias, donor[r].sd, 0, donor[r].unit,
                             f"fewer than {MIN_UNITS} units of {c} data", d)
                   for r in donor}
        for r in REGIMES:
            if r in cur:
                continue
            for b in BORROW[r]:
                if b in cur:
                    cur[r] = Spread(cur[b].bias, cur[b].sd, 0, cur[b].unit,
                                    f"not measured for {r.label} steps in this class",
                                    cur[b].borrowed_from or b.label)
                    break
        out[c] = tuple(cur[r] for r in REGIMES)
    # a class farther from the data is never given a narrower spread than a nearer one
    for i in range(1, len(CLASSES)):
        prev, cur = out[CLASSES[i - 1]], out[CLASSES[i]]
        out[CLASSES[i]] = tuple(s if s.sd >= p.sd else Spread(
            s.bias, p.sd, s.count, s.unit, s.source + f"; sd raised to {CLASSES[i - 1]}'s",
            s.borrowed_from) for s, p in zip(cur, prev))
    return out


def front_end(groups: Sequence[GroupResidual]) -> FrontEnd:
    """The front end from the groups with a client-side TTFT residual: mean and widened
    sd over deployments (each deployment's groups averaged first)."""
    g = [x for x in groups if np.isfinite(x.ttft_residual_s)]
    mean, sd, units = weighted_spread([x.ttft_residual_s for x in g],
                                      [x.deployment for x in g])
    if units < MIN_UNITS:
        raise ValueError(f"the front end needs client-side TTFT residuals of {MIN_UNITS} "
                         f"deployments, got {units}")
    sources = ", ".join(sorted({x.source for x in g}))
    return FrontEnd(mean, sd, units, "deployments",
                    f"{len(g)} light-load groups ({sources}): measured − predicted mean TTFT")


def estimate(steps: Sequence[StepResiduals], groups: Sequence[GroupResidual], *,
             name: str = "error-model", fitted_range: FittedRange = FittedRange(),
             correlations: Sequence[Correlation] = (), command: str = "",
             constants_sha256: str = "", notes: Sequence[str] = ()) -> ErrorModel:
    """The error model of these residuals (module docstring)."""
    return ErrorModel(name, step_jitter(steps), systematic(steps, groups), front_end(groups),
                      fitted_range, tuple(correlations), command, constants_sha256,
                      tuple(notes))
