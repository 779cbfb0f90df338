"""Pricing and fitting step traces: the one log-price program, synthetic traces, and a
gradient fitter of the kernel's parameters against measured steps.

The log-price program (:func:`log_price`)
=========================================

Every computation of calibration that prices the steps of a trace (the fit's residuals, its
Jacobian and Gauss–Newton polish, the prediction band, the errors before and after, the
identifiability Jacobian of :mod:`~jkernel.calibration.fit.stepfit`, the synthetic traces)
runs one function: :func:`log_price`, ``(θ, base params, stacks) → log seconds`` of every
step, the step function ``vmap``-ped over each request-count stack of
:meth:`~jkernel.calibration.data.traces.StepTrace.stacked` and concatenated in stack order,
with the named parameters replaced by ``exp θ``. :func:`price_steps` is its jitted form at
given parameters, in the trace's step order.

Fitting (:func:`fit_trace`)
===========================

Chosen parameters of the kernel's :class:`~jkernel.Params` (any names: host overheads,
``kernel_gap``, ``host_serial``, ``hbm_derate``, attention floors…) are fitted against the
measured durations through ``jax.grad`` of the step function's ``expected_s`` (or
``no_overlap_s`` / ``overlap_s`` on request), ``vmap``-ped over the steps (the batch arrays of
all steps stacked, one stack per request-count bucket). Each parameter lives in log space,
``v = exp θ``. The objective is a negative log posterior::

    L(θ) = Σ_steps ½·ρ(r_i)/σ²  +  ½ Σ_params ((θ_j − μ_j)/σ_p)²,   r = log(pred/measured)

with ρ the soft-L1 loss (≈ r² within ±δ), σ the residual scale, and a log-normal prior per
parameter centred on its catalog value (``μ = log v_catalog``, ``σ_p = log 3`` by default).
Optimisation: optax's Adam (``steps``, at σ = 0.05) from the catalog values, then σ is
re-estimated from the residuals' MAD and a few damped Gauss–Newton steps with the soft-L1
loss's IRLS weights finish the fit at that σ. The compiled programs are cached per
(step function, fitted names, target), so refitting the same structure compiles nothing.
A parameter whose catalog value is 0 (``kernel_gap``, ``host_serial`` until a trace fit)
cannot sit in log space at 0: it starts at a typical scale (:data:`ZERO_SCALES`) with the
prior centred there. After the fit, parameters the data cannot identify
(:mod:`~jkernel.calibration.fit.uncertainty`, judged from the data term alone) are reported
as such and **kept at their catalog values**, so an unobserved parameter never drifts.

Steps are split into fit and held-out parts by the one held-out split (the last fraction in
time, or a hash of the step's index:
:meth:`~jkernel.calibration.data.traces.StepTrace.held_mask`); both errors are reported,
beside those of the catalog values, and a prediction band for any batch follows from the
Laplace covariance (:meth:`TraceFit.band`).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..data.traces import StepTrace, TraceError, make_trace
from .base import ErrorStats, adam_loop, soft_l1
from .uncertainty import Laplace, gauss_newton, jacobian_columns, prediction_band

__all__ = ["TARGETS", "ZERO_SCALES", "zero_scale", "log_price", "price_steps",
           "generate_trace", "fit_trace", "TraceFit"]

#: The step function's outputs a trace can be fitted against.
TARGETS = ("expected_s", "no_overlap_s", "overlap_s")

#: Starting scale (SI) of a fitted parameter whose catalog value is 0.
ZERO_SCALES = {"kernel_gap": 1e-6, "host_serial": 100e-6, "host_serial_per_request": 10e-6,
               "host_launch_per_kernel": 2e-6,
               "host_replay_graph_per_step": 10e-6, "host_launch_eager_per_layer": 5e-6,
               "attention_decode_floor": 10e-6, "attention_prefill_floor": 10e-6}
_DEFAULT_ZERO_SCALE = 1e-6


def zero_scale(name: str) -> float:
    """The starting scale (SI) of ``name`` when its catalog value is 0 (:data:`ZERO_SCALES`,
    1e-6 for a name not listed)."""
    return ZERO_SCALES.get(name, _DEFAULT_ZERO_SCALE)


# --------------------------------------------------------------------------------------
# The log-price program
# --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def log_price(step_fn, target: str = "expected_s", names: tuple[str, ...] = ()):
    """The one log-price program of calibration: a traceable
    ``(θ, base, stacks) → log seconds``, shape ``(n,)``, of the ``n`` steps in ``stacks``
    (the batch-array stacks of :meth:`~jkernel.calibration.data.traces.StepTrace.stacked`,
    concatenated in stack order), priced by ``step_fn`` ``vmap``-ped over each stack's steps
    at ``base`` (:class:`~jkernel.Params`) with ``names[i]`` set to ``exp θ[i]``; ``θ`` is
    ignored when ``names`` is empty. ``target`` is one of :data:`TARGETS`.

    Cached by ``(step_fn, target, names)``, so the one function object serves every caller
    of one structure and jit caches keyed on it compile once."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    names = tuple(names)
    many = jax.vmap(step_fn, in_axes=(None, 0))

    def log_seconds(theta, base, stacks):
        p = base.replace(**{n: jnp.exp(theta[i]) for i, n in enumerate(names)}) if names \
            else base
        return jnp.concatenate([jnp.log(getattr(many(p, a), target)) for a in stacks])
    return log_seconds


@functools.lru_cache(maxsize=16)
def _price_program(step_fn, target: str):
    """:func:`log_price` at given parameters, jitted (cached per step function and target)."""
    return jax.jit(log_price(step_fn, target))


def price_steps(kernel, params, trace: StepTrace, target: str = "expected_s") -> np.ndarray:
    """Seconds of every step of ``trace`` priced by ``kernel``'s step function at ``params``
    (:func:`log_price`, jitted), shape ``(len(trace),)``, in the trace's step order."""
    stacks = trace.stacked(kernel.buckets)
    order = np.concatenate([idx for idx, _ in stacks])
    logs = _price_program(kernel.step_fn, target)(jnp.zeros(0), params,
                                                  [a for _, a in stacks])
    out = np.zeros(len(trace))
    out[order] = np.exp(np.asarray(logs))
    return out


def generate_trace(kernel, batches, *, params=None, noise: float = 0.03, seed: int = 0,
                   target: str = "expected_s", deployment=None, pool=None,
                   source: str = "generated by jkernel.calibration.fit.traces.generate_trace"
                   ) -> StepTrace:
    """A synthetic trace: each batch priced by ``kernel`` (with ``params`` if given) and
    multiplied by ``exp(noise·N(0, 1))`` (numpy's PCG64 with ``seed``)."""
    k = kernel if params is None else kernel.with_params(params)
    dep = deployment if deployment is not None else _kernel_deployment(kernel)
    trace = make_trace(dep, batches, np.ones(len(batches)), pool=pool, source=source)
    t = price_steps(k, k.params, trace, target)
    rng = np.random.default_rng(seed)
    trace.duration_s = t * np.exp(noise * rng.standard_normal(len(t)))
    return trace


def _kernel_deployment(kernel):
    sc = kernel.inputs.scenario
    return sc.name if sc is not None else None


# --------------------------------------------------------------------------------------
# The fitter
# --------------------------------------------------------------------------------------

class _Programs:
    """The compiled programs of one fit structure (step function, fitted names, target and
    optimiser settings), cached so that refitting a kernel of the same plan (another trace,
    other catalog values, another σ) compiles nothing. Everything that varies is an
    argument: ``data = (arrays, y, w, base params, μ, σ, σ_p)``."""

    def __init__(self, step_fn, names: tuple[str, ...], target: str, steps: int, lr: float,
                 delta: float):
        price = log_price(step_fn, target, names)

        def residuals(theta, data):
            arrays, y, w, base = data[:4]
            return (price(theta, base, arrays) - y) * w

        def objective(theta, data):
            _, _, w, _, mu, sigma, prior_sigma = data
            r = residuals(theta, data)
            r = jnp.where(jnp.isfinite(r), r, 10.0)
            data_term = 0.5 * jnp.sum(soft_l1(r, delta)) / sigma ** 2
            prior = 0.5 * jnp.sum(((theta - mu) / prior_sigma) ** 2)
            return (data_term + prior) / jnp.maximum(jnp.sum(w), 1.0)

        self.residuals = residuals
        self.res_jit = jax.jit(residuals)
        loop = jax.jit(adam_loop(objective, lr))
        self.adam = lambda th0, data: loop(th0, data, int(steps))


@functools.lru_cache(maxsize=8)
def _programs(step_fn, names, target, steps, lr, delta) -> _Programs:
    """The compiled programs of one fit structure (cached: refitting compiles nothing)."""
    return _Programs(step_fn, names, target, steps, lr, delta)


def _polish(residuals, res, objective, theta, data, mu, prior_sigma, sigma, delta, n_rows,
            iters: int = 10) -> np.ndarray:
    """Damped Gauss–Newton (Levenberg–Marquardt) on the same objective after Adam, with the
    soft-L1 loss's IRLS weights ``1/sqrt(1 + (r/δ)²)``: a few exact curvature steps finish
    what a first-order method approaches slowly along correlated directions."""
    th = np.asarray(theta, dtype=np.float64)
    best = float(objective(jnp.asarray(th), data))
    lam = 1e-3
    prior = np.eye(len(th)) / prior_sigma ** 2
    for _ in range(iters):
        r = np.asarray(res(jnp.asarray(th), data))
        J = jacobian_columns(residuals, th, (data,))
        ok = np.isfinite(r) & np.all(np.isfinite(J), axis=1)
        r, J = r[ok], J[ok]
        w = 1.0 / np.sqrt(1.0 + (r / delta) ** 2)
        A = (J.T * w) @ J / sigma ** 2 + prior
        g = (J.T * w) @ r / sigma ** 2 + prior @ (th - mu)
        improved = False
        for _ in range(6):
            try:
                step = np.linalg.solve(A + lam * np.diag(np.diag(A)), g)
            except np.linalg.LinAlgError:
                lam *= 10
                continue
            cand = th - step
            val = float(objective(jnp.asarray(cand), data))
            if np.isfinite(val) and val < best:
                th, best, lam, improved = cand, val, max(lam / 10, 1e-9), True
                break
            lam *= 10
        if not improved or np.max(np.abs(step)) < 1e-7:
            break
    return th


@dataclass
class TraceFit:
    """Result of :func:`fit_trace`.

    ``values``: fitted SI values of the chosen names (unidentifiable ones back at their
    catalog values); ``raw``: the optimiser's values before that; ``catalog``: the starting
    catalog values; ``identifiable`` / ``reason`` from the Laplace fit; ``errors``: rows of
    (part, curve, ErrorStats) for the fit and held-out steps; ``held``: which steps of the
    trace given to :func:`fit_trace` were held out (boolean, that trace's length; steps left
    out by ``exclude_flags`` are False), so a report reads the fit's own split.
    """

    names: tuple[str, ...]
    values: dict[str, float]
    raw: dict[str, float]
    catalog: dict[str, float]
    laplace: Laplace
    target: str
    errors: list[tuple[str, str, ErrorStats]]
    steps_fit: int
    steps_held: int
    seconds: float
    sigma: float
    deployment: Any
    trace_file: str | None
    trace_sha256: str
    skipped: dict[str, int]
    notes: list[str]
    kernel: Any = None
    held: np.ndarray | None = None

    @property
    def identifiable(self) -> dict[str, bool]:
        return dict(self.laplace.identifiable)

    def params(self):
        """The kernel's :class:`~jkernel.Params` with the fitted values."""
        return self.kernel.params.replace(**self.values)

    def band(self, batches, *, observation: bool = True):
        """``(low, centre, high)`` seconds for each :class:`jkernel.Batch`: the 95 % band
        from the Laplace covariance of the identifiable fitted parameters, plus the
        residual scatter of one measured step when ``observation`` (a prediction interval)."""
        trace = make_trace(None, list(batches), np.ones(len(batches)))
        stacks = trace.stacked(self.kernel.buckets)
        order = np.concatenate([idx for idx, _ in stacks])
        base = self.kernel.params.replace(**self.values)
        lap = self.laplace
        free = [i for i, n in enumerate(lap.names) if lap.identifiable[n]]
        price = log_price(self.kernel.step_fn, self.target,
                          tuple(lap.names[i] for i in free))
        pick = jnp.asarray(free, dtype=jnp.int32)

        def log_pred(theta, arrays):
            return price(theta[pick], base, arrays)
        lo, mid, hi = prediction_band(log_pred, self.laplace, args=([a for _, a in stacks],),
                                      observation=observation)
        out = [np.zeros(len(trace)) for _ in range(3)]
        for arr, vals in zip(out, (lo, mid, hi)):
            arr[order] = vals
        return tuple(out)

    def coefficient_values(self) -> dict[str, float]:
        """SI values of the identifiable fitted parameters (what a coefficient set gets)."""
        return {n: self.values[n] for n in self.names if self.laplace.identifiable[n]}


def fit_trace(trace: StepTrace, fit: Sequence[str], *, kernel=None, repos=None,
              target: str = "expected_s", steps: int = 400, lr: float = 0.05,
              heldout: float = 0.2, seed: int = 0, prior_sigma: float = math.log(3.0),
              delta: float = 0.05, exclude_flags: Sequence[str] = (),
              max_se: float = 0.5, split: str = "hash",
              progress: Callable[[str], None] | None = None) -> TraceFit:
    """Calibrate the parameters named in ``fit`` against a trace (module docstring).

    ``kernel``: the trace's kernel if already open (else opened from the header);
    ``exclude_flags``: steps carrying any of these flags are left out (e.g.
    ``("idle_before",)`` for reconstructed traces); ``split``: ``"hash"`` holds out a
    hash-chosen ``heldout`` fraction of the steps, ``"time"`` the last ``heldout`` fraction
    in time order (``end_s``, else file order).
    """
    say = progress or (lambda m: None)
    import jkernel
    jkernel.enable_x64()
    t0 = time.perf_counter()
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    k = kernel if kernel is not None else trace.kernel(repos)
    names = tuple(dict.fromkeys(fit))
    if not names:
        raise ValueError("name at least one parameter to fit")
    unknown = [n for n in names if n not in k.params]
    if unknown:
        raise ValueError(f"the kernel has no parameter(s) {unknown}; fittable names of this "
                         f"deployment: {', '.join(sorted(k.params))}")
    notes = []
    keep = np.ones(len(trace), bool)
    if exclude_flags:
        keep = np.array([not (set(f) & set(exclude_flags)) for f in trace.flags])
        if not keep.any():
            raise TraceError(f"every step carries one of the flags {list(exclude_flags)}")
        if not keep.all():
            notes.append(f"{int((~keep).sum())} steps flagged {list(exclude_flags)} left out")
        trace = trace.select(keep)
    held = trace.held_mask(heldout, seed, split)
    if held.all() or len(trace) < 5:
        held[:] = False
    held_input = np.zeros(len(keep), bool)
    held_input[np.nonzero(keep)[0]] = held
    n_fit, n_held = int((~held).sum()), int(held.sum())
    say(f"fitting {', '.join(names)} on {n_fit} steps ({n_held} held out), target {target}")
    base = k.params
    catalog = {n: float(base[n]) for n in names}
    mu = np.array([math.log(catalog[n]) if catalog[n] > 0
                   else math.log(zero_scale(n)) for n in names])
    for n in names:
        if catalog[n] <= 0:
            notes.append(f"{n}: catalog value {catalog[n]:g}; started at {zero_scale(n):g} "
                         "(SI) with the prior centred there (kept at the catalog value if "
                         "unidentified)")
    prog = _programs(k.step_fn, names, target, int(steps), float(lr), float(delta))
    # every step in one set of stacks (fit and held-out together, told apart by a weight),
    # so one compiled program serves the fit, the Jacobian and the error tables
    stacks = trace.stacked(k.buckets)
    order = np.concatenate([idx for idx, _ in stacks])
    y = jnp.asarray(np.log(trace.duration_s[order]))
    w = jnp.asarray((~held[order]).astype(np.float64))
    arrays = [a for _, a in stacks]

    def data_for(sigma):
        return (arrays, y, w, base, jnp.asarray(mu), jnp.asarray(sigma, jnp.float64),
                jnp.asarray(prior_sigma, jnp.float64))

    theta, _ = prog.adam(jnp.asarray(mu), data_for(0.05))
    theta = np.asarray(theta)
    res_jit = prog.res_jit
    r1 = np.asarray(res_jit(jnp.asarray(theta), data_for(0.05)))[np.asarray(w) > 0]
    sigma = float(max(1.4826 * np.median(np.abs(r1 - np.median(r1))), 1e-4))
    say(f"Adam done ({time.perf_counter() - t0:.1f} s); residual scale σ = {sigma:.4f}; "
        "Gauss-Newton polish")
    data = data_for(sigma)

    def objective_np(th, data_):
        # the polish's objective from the residual program (no extra compilation)
        r = np.asarray(res_jit(jnp.asarray(th), data_))
        r = np.where(np.isfinite(r), r, 10.0)
        rho = 2.0 * delta ** 2 * (np.sqrt(1.0 + (r / delta) ** 2) - 1.0)
        return (0.5 * np.sum(rho) / sigma ** 2
                + 0.5 * np.sum(((np.asarray(th) - mu) / prior_sigma) ** 2)) / n_fit
    theta = _polish(prog.residuals, res_jit, objective_np, theta, data, mu, prior_sigma, sigma,
                    delta, n_fit)
    lap = gauss_newton(prog.residuals, theta, names, to_value=jnp.exp, sigma=sigma,
                       args=(data,), prior_precision=np.eye(len(names)) / prior_sigma ** 2,
                       max_se=max_se)
    raw = {n: float(np.exp(theta[i])) for i, n in enumerate(names)}
    values = {n: (raw[n] if lap.identifiable[n] else catalog[n]) for n in names}
    for n in names:
        if not lap.identifiable[n]:
            notes.append(f"{n}: not identifiable from this trace ({lap.reason[n]}); kept at "
                         f"its catalog value {catalog[n]:g}")
    say(f"fit done ({time.perf_counter() - t0:.1f} s)")
    y_np = np.asarray(y)
    hm = np.asarray(w) == 0
    errors = []
    for curve, vals in (("fitted", values), ("catalog", catalog)):
        th = jnp.asarray([math.log(max(vals[n], 1e-300)) for n in names])
        pred_log = np.asarray(res_jit(th, (arrays, y, jnp.ones_like(w), base))) + y_np
        for label, m in (("fit", ~hm), ("held-out", hm)):
            if m.any():
                errors.append((label, curve, ErrorStats.of(np.exp(pred_log[m]),
                                                           np.exp(y_np[m]))))
    errors.sort(key=lambda e: (e[0] != "fit", e[1] != "fitted"))
    return TraceFit(names, values, raw, catalog, lap, target, errors, n_fit, n_held,
                    time.perf_counter() - t0, sigma, trace.deployment, trace.file,
                    trace.sha256, dict(trace.skipped), notes, k, held_input)
