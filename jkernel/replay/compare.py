"""Predicted against measured: a replay of a benchmark client's run, compared with what
the client measured, metric by metric in the client's own definitions
(:mod:`jkernel.replay.metrics`), per request and in aggregate.

Both sides are :class:`~jkernel.replay.metrics.Timings` of the same requests and every
figure of both comes from the same :class:`~jkernel.replay.metrics.Metric`: a comparison
never sets one definition against another. A :class:`~jkernel.replay.Window` (warm-up,
cool-down) is decided on the measured run and the same requests are left out of both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .clients import Window
from .formats import BenchmarkRun
from .metrics import (GOODPUT_NAMES, SLO, Quantity, Timings, goodput, metrics_of,
                      stats_of, summarize_metric, values)

__all__ = ["Comparison", "compare", "predicted_timings", "format_comparison", "objectives"]


@dataclass(frozen=True)
class Comparison:
    """A comparison of one run.

    Attributes:
      run: the benchmark run read back.
      aggregate: one row per metric and statistic: ``metric`` (the tool's name), ``stat``,
        ``unit``, ``measured``, ``predicted``, ``error`` (predicted / measured − 1) and
        ``reported`` (the file's own figure, NaN where it has none).
      per_request: one row per request: ``request_id``, then ``measured_<metric>`` and
        ``predicted_<metric>`` for every per-request metric (the tool's unit).
      counted: the requests both sides count (the window).
      slo: the objectives of the ``goodput`` rows (None: no goodput).
    """

    run: BenchmarkRun
    aggregate: pd.DataFrame
    per_request: pd.DataFrame
    counted: np.ndarray
    slo: SLO | None = None


def predicted_timings(result) -> Timings:
    """A :class:`~jkernel.replay.ReplayResult` as timings: sent at ``arrival_s``, the
    first token at ``first_token_s``, the last after the request's token gaps, the end at
    ``finish_s`` (after the completion overhead)."""
    r = result.requests
    first = r["first_token_s"].to_numpy(float)
    # the send on the replay's clock (whole microseconds), so that first − start is ttft_s
    sent = np.where(np.isfinite(first), first - r["ttft_s"].to_numpy(float),
                    r["arrival_s"].to_numpy(float))
    gaps = tuple(result.token_gaps_s) if result.token_gaps_s else tuple(
        np.zeros(0) for _ in range(len(r)))
    last = first + np.array([float(np.sum(g)) for g in gaps])
    ok = ~r["rejected"].to_numpy(bool) & np.isfinite(r["finish_s"].to_numpy(float))
    return Timings(sent, first, last, r["finish_s"].to_numpy(float),
                   r["input_tokens"].to_numpy(), r["output_tokens"].to_numpy(), ok, gaps)


def compare(run: BenchmarkRun, result, *, slo: SLO | None = None,
            window: Window | None = None) -> Comparison:
    """Compare ``result`` (a replay of ``run.requests``) with ``run.measured``."""
    r = result.requests
    if len(r) != len(run.requests) or not np.array_equal(
            r["request_id"].to_numpy(), run.requests["request_id"].to_numpy()):
        raise ValueError("the replay is not of this run's requests (request ids differ)")
    pred = predicted_timings(result)
    meas = run.measured
    if window is not None and not window.empty:
        counted = window.measured(meas.start_s - np.nanmin(meas.start_s), meas.end_s
                                  - np.nanmin(meas.start_s))
    else:
        counted = np.ones(len(r), bool)
    m_t, p_t = meas.subset(counted), pred.subset(counted)
    reported = {(x.metric.name, x.stat): x.value for x in run.reported}
    rows, per = [], {"request_id": r["request_id"].to_numpy()}
    for m in metrics_of(run.tool):
        if m.quantity is Quantity.ITL_GAPS and m_t.gaps_s is None:
            continue
        a, b = summarize_metric(m, m_t), summarize_metric(m, p_t)
        for stat in stats_of(m):
            x, y = getattr(a, stat), getattr(b, stat)
            rows.append({"metric": m.name, "stat": stat, "unit": m.unit,
                         "measured": x, "predicted": y, "error": y / x - 1 if x else np.nan,
                         "reported": reported.get((m.name, stat), np.nan)})
        if not m.is_throughput and m.quantity is not Quantity.ITL_GAPS:
            per[f"measured_{m.name}"] = values(m.quantity, meas) * m.scale
            per[f"predicted_{m.name}"] = values(m.quantity, pred) * m.scale
    if slo is not None and slo.stated():
        (gm, xm), (gp, xp) = goodput(run.tool, m_t, slo), goodput(run.tool, p_t, slo)
        rows.append({"metric": "goodput", "stat": "value", "unit": "req/s", "measured": xm,
                     "predicted": xp, "error": xp / xm - 1 if xm else np.nan,
                     "reported": np.nan})
        rows.append({"metric": "good requests", "stat": "count", "unit": "", "measured": gm,
                     "predicted": gp, "error": gp / gm - 1 if gm else np.nan,
                     "reported": np.nan})
    per_df = pd.DataFrame(per)
    per_df["counted"] = counted
    return Comparison(run, pd.DataFrame(rows), per_df, counted, slo)


def objectives(tool, slo: SLO) -> str:
    """The objectives in the tool's names, e.g. ``ttft ≤ 200 ms, e2el ≤ 3000 ms``."""
    names = GOODPUT_NAMES.get(tool, {})
    return ", ".join(f"{names.get(o.key, o.key)} ≤ {o.limit_s * 1e3:g} ms"
                     for o in slo.stated())


def format_comparison(c: Comparison, *, per_request: int = 0) -> str:
    """The comparison as text: the run, each metric's statistics measured against
    predicted (and the file's own figure where it reports one), then per request the
    spread of predicted / measured; ``per_request`` > 0 also lists that many requests."""
    run = c.run
    lines = [f"{run.source}: {run.version}; {int(c.counted.sum())} of {len(c.counted)} "
             f"requests compared ({run.failed} failed, not replayed); clients: "
             + (f"{run.clients.concurrency} closed-loop" if run.clients.closed
                else "open loop at the recorded sends"),
             f"metrics as {run.tool.value} defines them (docs/metrics.md)"
             + (f"; goodput: {objectives(run.tool, c.slo)}" if c.slo and c.slo.stated()
                else ""),
             f"{'metric':34}{'stat':>6}{'measured':>13}{'predicted':>13}{'error':>9}"
             f"{'file':>13}"]
    agg = c.aggregate
    for row in agg.itertuples():
        name = f"{row.metric} ({row.unit})" if row.unit else row.metric
        file = "" if not np.isfinite(row.reported) else f"{row.reported:13.4g}"
        err = "" if not np.isfinite(row.error) else f"{row.error * 100:+8.1f}%"
        lines.append(f"{name[:34]:34}{row.stat:>6}{row.measured:13.4g}{row.predicted:13.4g}"
                     f"{err:>9}{file}")
    per = c.per_request[c.per_request["counted"]]
    names = [k[len("measured_"):] for k in per.columns if k.startswith("measured_")]
    if names:
        lines.append("per request, predicted / measured:"
                     f"{'p10':>10}{'p50':>10}{'p90':>10}")
        for n in names:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = (per[f"predicted_{n}"] / per[f"measured_{n}"]).to_numpy(float)
            ratio = ratio[np.isfinite(ratio)]
            if ratio.size:
                q = np.percentile(ratio, [10, 50, 90])
                lines.append(f"  {n:32}{q[0]:10.3f}{q[1]:10.3f}{q[2]:10.3f}")
    if per_request > 0:
        lines.append(per.head(per_request).to_string(index=False,
                                                       float_format=lambda x: f"{x:.4g}"))
    return "\n".join(lines)

