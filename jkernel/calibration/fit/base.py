"""What every fit shares: parameters, problems, the one optimiser loop, the losses, error
statistics, the spec's reference values and the deterministic subsample.

A fit is a :class:`Problem`: named parameters (:class:`Param`, each in log or logit space), a
traceable ``predict(values, rows) -> seconds`` built from :mod:`jkernel.laws` (never a
restated formula), and the observation rows split into a fit part and a held-out part by
the one held-out split, :func:`jkernel.calibration.data.heldout.held_out` (profile rows by a
stable hash of their shape, step traces by time or by a hash of the step's index).
:func:`solve` minimises a robust loss of ``r = log(predicted / measured)`` over the fit rows
with optax's Adam:

* loss: soft-L1 (pseudo-Huber) ``2δ²(sqrt(1 + (r/δ)²) − 1)`` with ``δ = 0.05`` by default,
  quadratic within ±5 % and linear beyond, so a handful of rows the law cannot describe
  (a tile-quantisation spike, an occupancy cliff) do not drag the fit;
* optimiser: :func:`adam_loop`, Adam on a cosine-decayed learning rate inside one jitted
  ``fori_loop`` (no Python per step, one compilation for runs of any length), run from a
  few deterministic starting points; the start with the lowest loss wins. Everything is
  deterministic (no random numbers). The step-trace fit
  (:mod:`jkernel.calibration.fit.traces`) runs the same loop.

Every fit reports, on the fit and the held-out rows, the median and the 90th percentile of
``|log(predicted / measured)|`` (0.1 ≈ a 10 % miss), for the fitted curve and for the
comparison curves (the spec's reference values, the reference's sum form), and the
Gauss–Newton standard errors of :mod:`jkernel.calibration.fit.uncertainty`.

No module of the package sets ``jax.config`` at import; the entry functions (:func:`solve`,
``fit_chip``, ``fit_trace``) turn on float64 through :func:`jkernel.enable_x64`.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..data.profiles import CATALOG_NAMES
from .uncertainty import Laplace, gauss_newton

__all__ = [
    "Param", "ErrorStats", "ErrorRow", "Problem", "Solution", "PrimitiveFit", "PlotSeries",
    "REFERENCE", "REFERENCE_HBM_DERATE", "soft_l1", "log_ratio", "error_stats", "adam_loop",
    "minimise", "solve", "slices_table", "plot_series", "chip_document", "subsample",
    "columns",
]

# --------------------------------------------------------------------------------------
# Chips
# --------------------------------------------------------------------------------------

def chip_document(chip: str, catalog: str | Path | None = None):
    """The catalog's chip document (:class:`jkernel.documents.hardware.Chip`) of ``chip``
    (a catalog name like ``h100``; a profile folder name like ``h100_sxm`` is mapped by
    :data:`jkernel.calibration.data.profiles.CATALOG_NAMES`)."""
    from jkernel.catalog import catalog_root
    from jkernel.documents.hardware import load_chip

    name = CATALOG_NAMES.get(chip, chip)
    root = Path(catalog) if catalog is not None else catalog_root()
    path = root / "hardware" / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no chip document for {name!r} at {path}")
    return load_chip(path)


#: The spec's reference values (documents.md §8.7), SI units, used as comparison curves and
#: starting points. GEMM: (eps_max, m_half) per dtype; attention: decode (floor s, rate B/s),
#: prefill (floor s, work scale), swa decode (floor s, rate B/s); imbalance; hbm derate.
REFERENCE: dict[str, dict[str, Any]] = {
    "a100-sxm": {"gemm": {"bf16": (0.899, 89.0)}, "imbalance": 1.001,
                 "decode": (18.5e-6, 1.713e12), "prefill": (19.5e-6, 0.50), "swa": None},
    "b200": {"gemm": {"bf16": (0.787, 152.0), "fp8": (0.717, 164.0), "nvfp4": (0.504, 139.0)},
             "imbalance": 0.986, "decode": (11.0e-6, 6.93e12), "prefill": (16.5e-6, 0.38),
             "swa": (11.5e-6, 3.85e12)},
    "b300": {"gemm": {"bf16": (0.854, 167.0), "fp8": (0.761, 163.0), "nvfp4": (0.441, 188.0)},
             "imbalance": 0.998, "decode": (11.0e-6, 6.82e12), "prefill": (15.0e-6, 0.44),
             "swa": (11.0e-6, 3.565e12)},
    "gb200-nvl72": {"gemm": {"bf16": (0.778, 166.0), "fp8": (0.688, 172.0),
                             "nvfp4": (0.525, 149.0)},
                    "imbalance": 0.977, "decode": (13.0e-6, 7.2e12),
                    "prefill": (17.0e-6, 0.38), "swa": (12.5e-6, 4.96e12)},
    "h100": {"gemm": {"bf16": (0.903, 160.0), "fp8": (0.784, 144.0)}, "imbalance": 1.044,
             "decode": (11.0e-6, 2.412e12), "prefill": (19.5e-6, 0.44),
             "swa": (10.0e-6, 1.072e12)},
    "h200": {"gemm": {"bf16": (0.890, 102.0), "fp8": (0.788, 94.0)}, "imbalance": 1.056,
             "decode": (13.5e-6, 2.592e12), "prefill": (18.5e-6, 0.44),
             "swa": (9.5e-6, 1.248e12)},
    "l40s": {"gemm": {"bf16": (0.740, 103.0), "fp8": (0.586, 135.0)}, "imbalance": 1.029,
             "decode": (11.0e-6, 0.674e12), "prefill": (13.0e-6, 0.50),
             "swa": (10.5e-6, 0.62208e12)},
}
REFERENCE_HBM_DERATE = 0.8


# --------------------------------------------------------------------------------------
# Parameters and errors
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    """One fitted quantity.

    ``name`` is the registry name (``gemm_eps_max_bf16``) or, for a nuisance parameter that
    is fitted but not written, a descriptive one (``moe_call_floor``). ``init`` is the
    starting value in SI units. ``transform`` is ``"log"`` (``v = exp θ``) or ``"logit"``
    (``v = lo + (hi − lo)·sigmoid θ``). ``units`` is the registry unit of the written entry;
    ``written`` False marks a nuisance parameter.
    """

    name: str
    init: float
    transform: str = "log"
    lo: float = 0.0
    hi: float = 1.0
    units: str = "dimensionless"
    written: bool = True

    def __post_init__(self):
        if self.transform not in ("log", "logit"):
            raise ValueError(f"{self.name}: transform must be 'log' or 'logit'")
        if self.transform == "log" and not self.init > 0:
            raise ValueError(f"{self.name}: a log parameter needs a positive start, got "
                             f"{self.init}")
        if self.transform == "logit" and not self.lo < self.init < self.hi:
            raise ValueError(f"{self.name}: start {self.init} outside ({self.lo}, {self.hi})")

    def to_theta(self, value: float) -> float:
        if self.transform == "log":
            return math.log(max(float(value), 1e-300))
        u = (float(value) - self.lo) / (self.hi - self.lo)
        u = min(max(u, 1e-9), 1 - 1e-9)
        return math.log(u / (1.0 - u))

    def from_theta(self, theta):
        if self.transform == "log":
            return jnp.exp(theta)
        return self.lo + (self.hi - self.lo) * jax.nn.sigmoid(theta)


def log_ratio(predicted, measured):
    """``log(predicted / measured)`` (numpy or jnp)."""
    return jnp.log(predicted) - jnp.log(measured)


def soft_l1(r, delta: float = 0.05):
    """Pseudo-Huber loss ``2δ²(sqrt(1 + (r/δ)²) − 1)``: ``≈ r²`` near 0, ``≈ 2δ|r|`` beyond δ."""
    return 2.0 * delta * delta * (jnp.sqrt(1.0 + (r / delta) ** 2) - 1.0)


@dataclass(frozen=True)
class ErrorStats:
    """Median and 90th percentile of ``|log(predicted / measured)|`` over ``rows`` rows."""

    rows: int
    median: float
    p90: float

    @classmethod
    def of(cls, predicted, measured) -> "ErrorStats":
        p = np.asarray(predicted, dtype=np.float64)
        m = np.asarray(measured, dtype=np.float64)
        if p.size == 0:
            return cls(0, float("nan"), float("nan"))
        r = np.abs(np.log(p) - np.log(m))
        r = np.where(np.isfinite(r), r, np.inf)
        return cls(int(p.size), float(np.median(r)), float(np.percentile(r, 90)))

    def to_dict(self) -> dict:
        return {"metric": "abs_log_ratio", "median": round(self.median, 5),
                "p90": round(self.p90, 5), "rows": self.rows}

    def __str__(self) -> str:
        return f"{self.median:.4f} / {self.p90:.4f} ({self.rows})"


def error_stats(predicted, measured) -> ErrorStats:
    return ErrorStats.of(predicted, measured)


@dataclass(frozen=True)
class ErrorRow:
    """One line of a fit's error table: a slice of the rows under one curve."""

    slice: str
    variant: str
    fit: ErrorStats
    held: ErrorStats


# --------------------------------------------------------------------------------------
# Problems and the optimiser
# --------------------------------------------------------------------------------------

Predict = Callable[[Mapping[str, jax.Array], Mapping[str, jax.Array]], jax.Array]


@dataclass
class Problem:
    """A fit: parameters, a traceable prediction and the rows (numpy columns, with
    ``latency_s``). ``fixed`` holds constants passed to ``predict`` beside the parameters.
    ``starts``: extra starting points (name → SI value; unnamed parameters keep ``init``)."""

    params: tuple[Param, ...]
    predict: Predict
    fit_rows: Mapping[str, np.ndarray]
    held_rows: Mapping[str, np.ndarray]
    fixed: Mapping[str, float] = field(default_factory=dict)
    starts: Sequence[Mapping[str, float]] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def theta0(self) -> np.ndarray:
        rows = [[p.to_theta(p.init) for p in self.params]]
        for s in self.starts:
            rows.append([p.to_theta(s.get(p.name, p.init)) for p in self.params])
        return np.asarray(rows, dtype=np.float64)

    def started_at(self, values: Mapping[str, float], predict: Predict | None = None
                   ) -> "Problem":
        """A copy that starts from ``values`` (one start) and, optionally, predicts with
        another function of the same parameters."""
        params = []
        for p in self.params:
            v = float(values.get(p.name, p.init))
            if p.transform == "logit":
                span = p.hi - p.lo
                v = min(max(v, p.lo + 1e-6 * span), p.hi - 1e-6 * span)
            elif not v > 0:
                v = p.init
            params.append(replace(p, init=v))
        return Problem(tuple(params), predict or self.predict, self.fit_rows, self.held_rows,
                       self.fixed, ())

    def values(self, theta) -> dict[str, jax.Array]:
        return {p.name: p.from_theta(theta[i]) for i, p in enumerate(self.params)}

    def evaluate(self, values: Mapping[str, float], rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """Predicted seconds of ``rows`` at SI ``values`` (fixed constants merged in), by one
        jitted call (eager evaluation would compile every primitive for every row count)."""
        n = len(next(iter(rows.values()))) if rows else 0
        if n == 0:
            return np.zeros(0)
        v = {**{k: jnp.asarray(x, dtype=jnp.float64) for k, x in self.fixed.items()},
             **{k: jnp.asarray(x, dtype=jnp.float64) for k, x in values.items()}}
        fn = _jitted(self.predict)
        return np.asarray(fn(v, _jnp_rows(rows)), dtype=np.float64)

    def evaluate_both(self, values: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
        """Predictions of the fit rows and of the held-out rows, by one call over both."""
        nf = len(self.fit_rows["latency_s"])
        nh = len(self.held_rows.get("latency_s", ()))
        if nh == 0:
            return self.evaluate(values, self.fit_rows), np.zeros(0)
        both = {k: np.concatenate([np.asarray(self.fit_rows[k]), np.asarray(self.held_rows[k])])
                for k in self.fit_rows}
        pred = self.evaluate(values, both)
        return pred[:nf], pred[nf:]


@functools.lru_cache(maxsize=64)
def _jitted(fn):
    """A cached ``jax.jit`` of a predict function (keyed by identity)."""
    return jax.jit(fn)


def _jnp_rows(rows: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in rows.items()}


@dataclass
class Solution:
    """The result of :func:`solve`: SI values, ``θ``, the loss and the Laplace fit."""

    values: dict[str, float]
    theta: np.ndarray
    loss: float
    laplace: Laplace | None
    fit_pred: np.ndarray
    held_pred: np.ndarray
    seconds: float


def adam_loop(objective, lr: float):
    """``(θ0, data, n) -> (θ, final loss)``: ``n`` (a traced int) Adam steps of optax's
    ``scale_by_adam`` on a cosine-decayed rate over ``n``, in a ``fori_loop``, so that one
    compilation serves runs of any length (the exploration of several starts and the main
    run)."""
    opt = optax.scale_by_adam()

    def run(th0, data, n):
        nf = jnp.maximum(n, 1).astype(jnp.float64)

        def body(i, carry):
            th, st = carry
            g = jax.grad(objective)(th, data)
            g = jnp.where(jnp.isfinite(g), g, 0.0)
            upd, st = opt.update(g, st, th)
            frac = jnp.minimum(i / nf, 1.0)
            rate = lr * (0.01 + 0.99 * 0.5 * (1.0 + jnp.cos(jnp.pi * frac)))
            return optax.apply_updates(th, jax.tree_util.tree_map(lambda u: -rate * u, upd)), st
        th, _ = jax.lax.fori_loop(0, n, body, (th0, opt.init(th0)))
        final = objective(th, data)
        return th, jnp.where(jnp.isfinite(final), final, jnp.inf)
    return run


def minimise(objective: Callable[[jax.Array, Any], jax.Array], theta0: np.ndarray, data: Any,
             *, steps: int = 1500, lr: float = 0.05,
             explore: int | None = None) -> tuple[np.ndarray, float]:
    """Adam (optax) on ``objective(θ, data)``; returns the best ``θ`` and its loss.

    With several starting points (rows of ``theta0``), each runs ``explore`` steps
    (default ``min(300, steps // 4)``) and the start with the lowest loss then runs the full
    ``steps``; one compiled program serves all runs. Non-finite gradient entries are zeroed
    (a start in a region where the law is flat). Deterministic: no random numbers anywhere.
    """
    theta0 = np.atleast_2d(np.asarray(theta0, dtype=np.float64))
    run = jax.jit(adam_loop(objective, lr))
    if theta0.shape[0] > 1:
        n_explore = int(explore if explore is not None else min(300, max(steps // 4, 1)))
        losses = [float(run(jnp.asarray(t), data, n_explore)[1]) for t in theta0]
        start = theta0[int(np.argmin(losses))]
    else:
        start = theta0[0]
    th, loss = run(jnp.asarray(start), data, int(steps))
    return np.asarray(th), float(loss)


def solve(problem: Problem, *, steps: int = 1500, lr: float = 0.05, delta: float = 0.05,
          uncertainty: bool = True, max_se: float = 0.5) -> Solution:
    """Fit ``problem`` (see the module docstring); returns a :class:`Solution`."""
    import jkernel
    jkernel.enable_x64()                  # sums of many small times: float64 (entry point)
    t0 = time.perf_counter()
    if len(problem.fit_rows.get("latency_s", ())) == 0:
        raise ValueError("no rows to fit")
    fixed = {k: jnp.asarray(v) for k, v in problem.fixed.items()}
    data = _jnp_rows(problem.fit_rows)

    def residuals(theta, rows):
        v = {**fixed, **problem.values(theta)}
        return log_ratio(problem.predict(v, rows), rows["latency_s"])

    def objective(theta, rows):
        return jnp.mean(soft_l1(residuals(theta, rows), delta))

    theta, loss = minimise(objective, problem.theta0(), data, steps=steps, lr=lr)
    values = {k: float(v) for k, v in problem.values(jnp.asarray(theta)).items()}
    lap = None
    if uncertainty:
        def to_value(th):
            return jnp.stack([p.from_theta(th[i]) for i, p in enumerate(problem.params)])
        lap = gauss_newton(residuals, theta, problem.names, to_value=to_value, args=(data,),
                           max_se=max_se)
    fit_pred, held_pred = problem.evaluate_both(values)
    return Solution(values, theta, loss, lap, fit_pred, held_pred, time.perf_counter() - t0)


def subsample(obs, max_rows: int | None, seed: int = 1):
    """At most ``max_rows`` rows of an observation set, picked deterministically by a hash of
    each row's shape (``obs.shape_hash``); all rows when the set is small enough."""
    if max_rows is None or len(obs) <= max_rows:
        return obs
    h = obs.shape_hash(seed)
    keep = np.argsort(h, kind="stable")[:max_rows]
    return obs.select(np.sort(keep))


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------

@dataclass
class PlotSeries:
    """Data for one figure of a report: measured against predicted on held-out rows."""

    title: str
    x: np.ndarray
    xlabel: str
    measured: np.ndarray
    predicted: Mapping[str, np.ndarray]
    logx: bool = True


@dataclass
class PrimitiveFit:
    """One primitive's fit on one chip.

    ``values``: fitted SI values by parameter name (nuisance parameters included).
    ``params``: the :class:`Param` specs (units, whether written).
    ``written``: name → SI value of the entries to write (may differ from ``values`` where a
    rule replaces an unidentified value, as for a collective's peak rate).
    ``entry_slice``: name → the error-table slice whose held-out error the entry reports.
    ``errors``: the error table (:class:`ErrorRow`).
    ``laplace``: standard errors and identifiability (may be None).
    """

    primitive: str
    chip: str
    params: tuple[Param, ...]
    values: dict[str, float]
    written: dict[str, float]
    errors: list[ErrorRow]
    entry_slice: dict[str, str]
    laplace: Laplace | None
    source: str
    sha256: str
    rows_fit: int
    rows_held: int
    skipped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    plots: list[PlotSeries] = field(default_factory=list)
    primary: str = "fitted"

    def error(self, slice_: str, variant: str | None = None) -> ErrorRow | None:
        variant = variant or self.primary
        for row in self.errors:
            if row.slice == slice_ and row.variant == variant:
                return row
        return None

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


def slices_table(problem: Problem, values_by_variant: Mapping[str, tuple[Problem, Mapping[str, float]]],
                 slices: Mapping[str, tuple[np.ndarray, np.ndarray]], *,
                 return_predictions: bool = False):
    """Error rows for every (slice, variant): ``values_by_variant`` maps a variant label to
    a problem (its predict and rows, which must align with ``problem``'s) and SI values;
    ``slices`` maps a slice label to boolean masks over (fit rows, held rows). Each variant
    is evaluated once over all rows; with ``return_predictions`` the ``{variant: (fit,
    held)}`` predictions are returned too (for plots, without evaluating again)."""
    preds = {}
    for variant, (prob, vals) in values_by_variant.items():
        preds[variant] = prob.evaluate_both(vals)
    yf = np.asarray(problem.fit_rows["latency_s"])
    yh = np.asarray(problem.held_rows["latency_s"])
    out: list[ErrorRow] = []
    for sl, (mf, mh) in slices.items():
        for variant, (pf, ph) in preds.items():
            out.append(ErrorRow(sl, variant, ErrorStats.of(pf[mf] if len(pf) else pf, yf[mf]),
                                ErrorStats.of(ph[mh] if len(ph) else ph, yh[mh])))
    return (out, preds) if return_predictions else out


def plot_series(title: str, problem: Problem, preds: Mapping[str, tuple[np.ndarray, np.ndarray]],
                mask_fit: np.ndarray, mask_held: np.ndarray, xcol: str, xlabel: str, *,
                variants: Sequence[str] | None = None, logx: bool = True) -> PlotSeries | None:
    """A :class:`PlotSeries` of the rows picked by the masks (fit and held-out together,
    sorted by ``xcol``) from already computed predictions."""
    x = np.concatenate([np.asarray(problem.fit_rows[xcol])[mask_fit],
                        np.asarray(problem.held_rows[xcol])[mask_held]])
    if len(x) < 3:
        return None
    y = np.concatenate([np.asarray(problem.fit_rows["latency_s"])[mask_fit],
                        np.asarray(problem.held_rows["latency_s"])[mask_held]])
    order = np.argsort(x, kind="stable")
    predicted = {}
    for v, (pf, ph) in preds.items():
        if variants is not None and v not in variants:
            continue
        predicted[v] = np.concatenate([pf[mask_fit], ph[mask_held]])[order]
    return PlotSeries(title, x[order], xlabel, y[order], predicted, logx)


def columns(obs, names: Iterable[str], **extra) -> dict[str, np.ndarray]:
    """float64 numpy columns of an observation set, plus computed ``extra`` columns."""
    out = {n: np.asarray(getattr(obs, n), dtype=np.float64) for n in names}
    out.update({k: np.asarray(v, dtype=np.float64) for k, v in extra.items()})
    return out
