"""Errors of a kernel's step price against a measured step trace, by step kind and batch size.

:func:`step_errors` prices every step of a :class:`~jkernel.calibration.data.traces.StepTrace`
with given :class:`~jkernel.Params` (:func:`jkernel.calibration.fit.traces.price_steps`, the
one log-price program) and returns a table (pandas) of ``|log(pred/measured)|`` medians per
step kind (``decode``: every request runs one token; ``prefill``: at least one request runs
more) and per batch size (requests in the step), with the median signed log ratio (the bias).
:func:`decode_slope` is the least-squares cost of one more running request in decode steps,
measured and predicted (seconds per request), the figure a replay's throughput rests on.
Steps flagged ``idle_before`` (their start is an arrival, so they include HTTP and admission)
are left out of both.
"""

from __future__ import annotations

import numpy as np

from ..data.traces import StepTrace
from .traces import price_steps

__all__ = ["step_kinds", "step_errors", "decode_slope", "summary"]


def step_kinds(trace: StepTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kind, batch size, usable)`` per step: kind ``"decode"`` or ``"prefill"``; usable is
    False for steps flagged ``idle_before``."""
    kind = np.array(["prefill" if (s > t).any() else "decode"
                     for s, t in zip(trace.scheduled, trace.decode_threshold)])
    size = np.array([int((s > 0).sum()) for s in trace.scheduled])
    usable = np.array(["idle_before" not in f for f in trace.flags])
    return kind, size, usable


def step_errors(kernel, params, trace: StepTrace, *, part: str = "",
                target: str = "expected_s", pred: np.ndarray | None = None):
    """A DataFrame with columns ``part, kind, batch, steps, median_abs_log, median_log``:
    one row per kind over all batch sizes (``batch = "all"``) and one per (kind, batch size)."""
    import pandas as pd
    p = price_steps(kernel, params, trace, target) if pred is None else pred
    lr = np.log(p / trace.duration_s)
    kind, size, usable = step_kinds(trace)
    rows = []
    for k in ("decode", "prefill"):
        m = usable & (kind == k)
        if not m.any():
            continue
        rows.append((part, k, "all", int(m.sum()), float(np.median(np.abs(lr[m]))),
                     float(np.median(lr[m]))))
        for b in sorted(set(size[m].tolist())):
            mb = m & (size == b)
            rows.append((part, k, str(b), int(mb.sum()), float(np.median(np.abs(lr[mb]))),
                         float(np.median(lr[mb]))))
    return pd.DataFrame(rows, columns=["part", "kind", "batch", "steps", "median_abs_log",
                                       "median_log"])


def decode_slope(kernel, params, trace: StepTrace, *, target: str = "expected_s",
                 pred: np.ndarray | None = None) -> tuple[float, float]:
    """``(measured, predicted)`` seconds per extra running request: the least-squares slope
    of decode steps' duration against their batch size."""
    p = price_steps(kernel, params, trace, target) if pred is None else pred
    kind, size, usable = step_kinds(trace)
    m = usable & (kind == "decode")
    if len(set(size[m].tolist())) < 2:
        return float("nan"), float("nan")
    A = np.vstack([np.ones(int(m.sum())), size[m]]).T
    meas = np.linalg.lstsq(A, trace.duration_s[m], rcond=None)[0][1]
    prd = np.linalg.lstsq(A, p[m], rcond=None)[0][1]
    return float(meas), float(prd)


def summary(kernel, params, trace: StepTrace, *, part: str = "",
            target: str = "expected_s") -> dict:
    """``{decode, prefill: median |log ratio|, slope_measured_s, slope_predicted_s,
    slope_ratio}`` of one trace (the figures the step-constant fit is judged by)."""
    p = price_steps(kernel, params, trace, target)
    t = step_errors(kernel, params, trace, part=part, pred=p)
    allrows = t[t.batch == "all"].set_index("kind")
    sm, sp = decode_slope(kernel, params, trace, pred=p)
    out = {"part": part}
    for k in ("decode", "prefill"):
        out[k] = float(allrows.median_abs_log[k]) if k in allrows.index else float("nan")
        out[k + "_bias"] = float(allrows.median_log[k]) if k in allrows.index else float("nan")
    out.update(slope_measured_s=sm, slope_predicted_s=sp, slope_ratio=sp / sm)
    return out
