"""Prediction intervals of a replay's metrics: draws of the constants, of the model's
structural error and of the workload, replayed in lockstep (docs/intervals.md).

    from jkernel.replay.intervals import replay_intervals, format_intervals
    res = replay_intervals(kernel, requests, level=0.8, draws=32)
    res.metrics["ttft_mean_s"]      # MetricInterval: point, central, low, high, shares
    print(format_intervals(res))

Steps:

1. the replay at the point constants (:func:`jkernel.replay.replay`): the point estimate,
   and the batches the extrapolation check reads;
2. the deployment's extrapolation class and flags
   (:func:`jkernel.uncertainty.extrapolation.assess`);
3. ``draws`` variants (:class:`jkernel.replay.lockstep.Variant`), draw *k* taking: log
   factors of the constants from the posterior (:class:`~jkernel.uncertainty.posterior.
   Posterior`); one standard normal ``z_k`` that sets the systematic log factor of every
   regime, ``bias + sd · z_k`` of the class (the error model's ``systematic``); the
   per-step jitter of each regime; a front-end time ``bias_s + sd_s · w_k`` before each
   request; and workload ``k mod S`` of ``S`` seeds of a workload spec (a request table
   is one workload: its arrivals are what happened, no sampling noise). Draws of one
   workload share its requests exactly (common random numbers);
4. the lockstep replay of every draw (:class:`jkernel.replay.lockstep.Lockstep`: one
   vectorised pricing call per simulated step for all draws);
5. per metric, the interval and the share of each source
   (:mod:`jkernel.uncertainty.intervals`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from ..regimes import REGIMES
from ..uncertainty.errormodel import ErrorModel, constants_digest, shipped_error_model
from ..uncertainty.extrapolation import Extrapolation, assess
from ..uncertainty.intervals import METRICS, MetricInterval, interval, metric_values, shares
from ..uncertainty.posterior import Posterior
from .api import ReplayResult, replay, replay_disaggregated
from .lockstep import Variant, lockstep_replay

__all__ = ["Draws", "IntervalReplay", "draw_variants", "replay_intervals",
           "format_intervals", "intervals_table"]


@dataclass(frozen=True)
class Draws:
    """The variants of an interval replay and, per draw, the summary of each source
    (:func:`jkernel.uncertainty.intervals.shares` regresses on them): ``log_scales``
    ``(K, p)`` of ``posterior.names``; ``z`` the systematic normal; ``w`` the front-end
    normal; ``workload`` the workload index."""

    variants: tuple[Variant, ...]
    log_scales: np.ndarray
    z: np.ndarray
    w: np.ndarray
    workload: np.ndarray


def draw_variants(posterior: Posterior, error_model: ErrorModel, cls: str, draws: int, *,
                  workloads: int = 1, seed: int = 0, front_end: bool = True,
                  sources: Sequence[str] = ("constants", "structural", "front_end")
                  ) -> Draws:
    """``draws`` variants of the sources named in ``sources`` (module docstring, step 3)."""
    if draws < 2:
        raise ValueError(f"an interval needs at least 2 draws, got {draws}")
    rng = np.random.default_rng([seed, 21])
    use = set(sources)
    scales = posterior.log_scales(draws, rng) if "constants" in use else \
        np.zeros((draws, len(posterior)))
    z = rng.standard_normal(draws) if "structural" in use else np.zeros(draws)
    w = rng.standard_normal(draws) if (front_end and "front_end" in use) else np.zeros(draws)
    bias, sd = error_model.log_bias(cls), error_model.log_sd(cls)
    jitter = error_model.jitter_sd() if "structural" in use else np.zeros(len(REGIMES))
    fe = error_model.front_end
    out = []
    for k in range(draws):
        factor = (bias + sd * z[k]) if "structural" in use else np.zeros(len(REGIMES))
        front = (fe.bias_s + fe.sd_s * w[k]) if (front_end and "front_end" in use) else 0.0
        out.append(Variant(log_scale=posterior.named(scales[k]),
                           log_factor=tuple(float(x) for x in factor),
                           step_sd=tuple(float(x) for x in jitter), front_s=float(front),
                           workload=k % workloads, seed=seed * 100_003 + k))
    return Draws(tuple(out), scales, z, w, np.arange(draws) % workloads)


@dataclass
class IntervalReplay:
    """What :func:`replay_intervals` returns.

    Attributes:
      level: the intervals' level.
      metrics: metric → :class:`~jkernel.uncertainty.intervals.MetricInterval`
        (:data:`~jkernel.uncertainty.intervals.METRICS`).
      point: the replay at the point constants.
      results: every draw's :class:`~jkernel.replay.ReplayResult`.
      draws: the :class:`Draws`.
      extrapolation: the deployment's class and flags.
      error_model: the error model's name (and file).
      notes: what a source could not contribute and why.
      seconds: wall time of the point replay and of the lockstep replay.
      iterations: lockstep iterations (simulated steps of the longest draw).
    """

    level: float
    metrics: Mapping[str, MetricInterval]
    point: ReplayResult
    results: list
    draws: Draws
    extrapolation: Extrapolation
    error_model: str
    notes: tuple[str, ...] = ()
    seconds: Mapping[str, float] = field(default_factory=dict)
    iterations: int = 0

    def __repr__(self) -> str:
        m = self.metrics
        return (f"IntervalReplay({len(self.results)} draws, {self.level:.0%}: TTFT mean "
                f"{m['ttft_mean_s'].central * 1e3:.1f} ms [{m['ttft_mean_s'].low * 1e3:.1f}, "
                f"{m['ttft_mean_s'].high * 1e3:.1f}], ITL mean "
                f"{m['itl_mean_s'].central * 1e3:.2f} ms [{m['itl_mean_s'].low * 1e3:.2f}, "
                f"{m['itl_mean_s'].high * 1e3:.2f}]; {self.extrapolation.cls})")


def _constants_feature(kernel, posterior: Posterior, scales: np.ndarray,
                       point: ReplayResult) -> np.ndarray:
    """Per draw, the mean log change of the price of a few of the point replay's typical
    steps (a decode step and a step with a prompt chunk, at the median batch) under the
    draw's constants: the constants' draw in one number."""
    from ..batch import Batch

    if not len(posterior) or not np.any(scales):
        return np.zeros(len(scales))
    names = [n for n in posterior.names if n in kernel.params]
    if not names:
        return np.zeros(len(scales))
    steps = point.steps
    reqs = point.requests
    n = max(1, int(np.median(steps["requests"]))) if len(steps) else 1
    done = reqs[reqs["e2e_s"].notna()]
    ctx = int(done["input_tokens"].mean() + done["output_tokens"].mean() / 2) if len(done) \
        else 1024
    prompt = int(done["input_tokens"].median()) if len(done) else 1024
    thr = int(kernel.settings.decode_threshold)
    batches = [Batch([1] * n, [ctx] * n, decode_threshold=thr),
               Batch([1] * max(n - 1, 0) + [min(prompt, 2048)], [ctx] * max(n - 1, 0) + [0],
                     decode_threshold=thr)]
    idx = [posterior.names.index(x) for x in names]
    base = kernel.params
    sets = [base] + [base.replace(**{x: float(np.asarray(base[x])) * math.exp(row[i])
                                     for x, i in zip(names, idx)}) for row in scales]
    price = np.asarray(kernel.price_sweep(sets, batches).expected_s)
    return np.log(price[1:] / price[0]).mean(axis=1)


def replay_intervals(kernel, requests=None, *, workload=None, level: float = 0.8,
                     draws: int = 32, seeds: int | None = None,
                     error_model: ErrorModel | None = None,
                     posterior: Posterior | None = None, front_end: bool = True,
                     sources: Sequence[str] = ("constants", "structural", "front_end",
                                               "workload"),
                     method: str = "normal", clock: str = "expected_s", clients=None,
                     window=None, seed: int = 0) -> IntervalReplay:
    """Intervals of a replay's metrics (module docstring).

    Args:
      kernel: a colocated pool's :class:`jkernel.Kernel`, or ``(prefill, decode)``.
      requests: a request table (the replay's columns), or a list of them (draws of the
        workload, e.g. one per seed of a generator; the first is the point's); or
        ``workload``: a
        :class:`~jkernel.replay.WorkloadSpec` or
        :class:`~jkernel.replay.GeneratedWorkload`, whose ``seeds`` (default 4) seeds,
        the spec's seed and the next ones, are the workload draws (its clients and
        window are used unless given).
      level: the intervals' level, in (0, 1).
      draws: variants replayed in lockstep (K).
      error_model: default the catalog's (:func:`~jkernel.uncertainty.errormodel.
        shipped_error_model`).
      posterior: default :meth:`~jkernel.uncertainty.posterior.Posterior.from_kernel`
        of the (first) kernel, joined by the error model's correlations.
      front_end: add the error model's client front end (False for times taken on the
        engine's own clock).
      sources: which sources to draw (a subset of ``constants``, ``structural``,
        ``front_end``, ``workload``): the others stay at their point values.
      method: ``normal`` or ``empirical`` (:func:`jkernel.uncertainty.intervals.interval`).
      seed: seed of the draws.
    """
    from .spec import GeneratedWorkload, WorkloadSpec

    t0 = time.perf_counter()
    kernels = list(kernel) if isinstance(kernel, (list, tuple)) else [kernel]
    if not 1 <= len(kernels) <= 2:
        raise ValueError("kernel: one colocated pool's kernel, or (prefill, decode)")
    unknown = set(sources) - {"constants", "structural", "front_end", "workload"}
    if unknown:
        raise ValueError(f"sources: unknown {sorted(unknown)}; allowed: constants, "
                         "structural, front_end, workload")
    if (requests is None) == (workload is None):
        raise ValueError("give either requests (a table) or workload (a spec), not both")
    em = error_model if error_model is not None else shipped_error_model()
    post = posterior if posterior is not None else Posterior.from_kernel(kernels[0], em)
    notes = []
    if em.constants_sha256 and em.constants_sha256 != constants_digest():
        how = em.command or "python -m validation.error_model"
        notes.append(f"error model: estimated with other constants than the catalog's "
                     f"coefficient sets now hold; regenerate it ({how})")
    if workload is not None:
        spec = workload.spec if isinstance(workload, GeneratedWorkload) else workload
        if not isinstance(spec, WorkloadSpec):
            raise TypeError(f"workload must be a WorkloadSpec or GeneratedWorkload, not "
                            f"{type(workload).__name__}")
        count = (4 if seeds is None else int(seeds)) if "workload" in sources else 1
        if count < 1:
            raise ValueError(f"seeds must be ≥ 1, got {seeds}")
        tables = [replace(spec, seed=spec.seed + j).generate().requests for j in range(count)]
        clients = spec.clients if clients is None else clients
        window = (None if spec.window.empty else spec.window) if window is None else window
    elif isinstance(requests, (list, tuple)):
        tables = list(requests) if "workload" in sources else list(requests[:1])
        if not tables:
            raise ValueError("requests: an empty list of workloads")
        if seeds is not None:
            raise ValueError("seeds: with a list of request tables, each table is a workload")
    else:
        tables = [requests]
        if seeds not in (None, 1):
            raise ValueError("seeds: a request table is one workload (its arrivals are "
                             "given); give a workload spec to draw workloads")
        notes.append("workload: a request table, its arrivals and lengths fixed (no "
                     "sampling noise drawn)")
    kw = dict(clock=clock, clients=clients, window=window)
    if len(kernels) == 1:
        point = replay(kernels[0], tables[0], **kw)
    else:
        point = replay_disaggregated(kernels[0], kernels[1], tables[0], **kw)
    t1 = time.perf_counter()
    ext = assess(kernels[-1], em, steps=point.steps)
    if not len(post) and "constants" in sources:
        notes.append("constants: no constant of this deployment records a standard error "
                     "(its uncertainty is in the extrapolation class)")
    d = draw_variants(post, em, ext.cls, draws, workloads=len(tables), seed=seed,
                      front_end=front_end, sources=sources)
    results, ls = lockstep_replay(kernels, tables, d.variants, **kw)
    t2 = time.perf_counter()
    feats = {"constants": _constants_feature(kernels[-1], post, d.log_scales, point),
             "structural": d.z, "front_end": d.w}
    if len(tables) > 1:
        feats["workload"] = np.eye(len(tables))[d.workload][:, 1:]
    values = metric_values([r.summary for r in results])
    out = {}
    for m in METRICS:
        central, lo, hi = interval(values[m], level, method=method)
        out[m] = MetricInterval(m, float(point.summary.get(m, math.nan)), central, lo, hi,
                                level, shares(values[m], feats),
                                tuple(float(x) for x in values[m]))
    name = em.name + (f" ({em.file})" if em.file else "")
    return IntervalReplay(level, out, point, results, d, ext, name, tuple(notes),
                          {"point": t1 - t0, "lockstep": t2 - t1}, ls.iterations)


_ROWS = (("ttft", "TTFT", "ms", 1e3), ("itl", "ITL", "ms", 1e3), ("e2e", "E2E", "s", 1.0))


def intervals_table(res: IntervalReplay):
    """One row per metric: point, central, low, high and each source's share (pandas)."""
    import pandas as pd

    from ..uncertainty.intervals import SOURCES

    rows = []
    for m, iv in res.metrics.items():
        rows.append({"metric": m, "point": iv.point, "central": iv.central, "low": iv.low,
                     "high": iv.high, "level": iv.level,
                     **{f"share_{s}": iv.shares.get(s, math.nan) for s in SOURCES}})
    return pd.DataFrame(rows)


def format_intervals(res: IntervalReplay) -> str:
    """The intervals as the command line prints them."""
    from ..uncertainty.intervals import SOURCES

    pct = f"{res.level:.0%}"
    head = (f"{'':10}{'point':>10}{'central':>10}{pct + ' interval':>22}   share of the "
            f"variance: " + " ".join(f"{s:>10}" for s in SOURCES))
    lines = [head]

    def fmt(v, scale):
        return f"{v * scale:10.3f}" if math.isfinite(v) else f"{'-':>10}"
    for key, label, unit, scale in _ROWS:
        for stat in ("mean", "p50", "p90", "p99"):
            iv = res.metrics[f"{key}_{stat}_s"]
            sh = " ".join(f"{iv.shares.get(s, math.nan) * 100:9.0f}%"
                          if math.isfinite(iv.shares.get(s, math.nan)) else f"{'-':>10}"
                          for s in SOURCES)
            lines.append(f"{label + ' ' + stat + ' ' + unit:10}{fmt(iv.point, scale)}"
                         f"{fmt(iv.central, scale)}   [{iv.low * scale:8.3f}, "
                         f"{iv.high * scale:8.3f}]   {sh}")
    for key, label in (("throughput_tokens_per_s", "tokens/s"),
                       ("output_tokens_per_s", "output/s")):
        iv = res.metrics[key]
        lines.append(f"{label:10}{fmt(iv.point, 1)}{fmt(iv.central, 1)}   "
                     f"[{iv.low:8.1f}, {iv.high:8.1f}]")
    lines.append(f"{len(res.results)} draws in lockstep ({res.iterations} iterations, "
                 f"{res.seconds.get('lockstep', 0):.1f} s; point replay "
                 f"{res.seconds.get('point', 0):.1f} s); error model {res.error_model}")
    lines.append(f"extrapolation: {res.extrapolation.describe()}")
    lines.extend(f"note: {n}" for n in res.notes)
    return "\n".join(lines)
