"""Calibrating the engine-level constants of a step from measured steps.

Per-operator profiles time kernels one at a time; a whole step also pays what happens
between and around them. :func:`calibrate_steps` finds which constants a measured step trace
fixes and fits them, in four named stages:

1. **Residuals** (:func:`residual_terms`): the catalog's misses, in seconds, regressed per
   step kind on the step's structure, ``meas − pred ≈ a + b·requests + c·prefill tokens``.
   Each non-zero coefficient points at one constant: ``a`` at time per step that the GPU
   does not hide (``host_serial``; ``kernel_gap`` per kernel is the same column on one
   model), ``b`` at a cost per scheduled request (``host_serial_per_request``; decode
   attention's ``attention_decode_rate`` is nearly the same column when contexts barely
   vary), ``c`` at the compute rate sustained in the engine (``compute_derate``;
   ``attention_prefill_work_scale`` competes only through the small attention share).
2. **Identifiability** (:func:`explained`): the Jacobian of ``log expected_s`` with
   respect to each candidate's ``log`` value over the steps; a candidate whose column the
   chosen constants' columns explain (R² above :data:`COLLINEAR`) cannot be told apart
   from them by this trace. Among such a set the fit keeps the constant that transfers
   across models (a per-step host time rather than a per-kernel gap, the profiles' HBM and
   attention rates rather than a trace's) and names the others as not identified.
3. **Fit** (:func:`~jkernel.calibration.fit.traces.fit_trace`): the chosen constants through
   ``jax.grad`` of ``expected_s``, log-normal priors around the catalog values (a constant
   whose catalog value is 0 starts at :data:`~jkernel.calibration.fit.traces.ZERO_SCALES`),
   soft-L1 loss, Gauss–Newton standard errors; steps after an idle engine (``idle_before``)
   left out; split by time (the last ``heldout`` fraction held out).
4. **Errors** (:mod:`~jkernel.calibration.fit.steperrors`): per step kind and batch size on
   the held-out part and on whole other runs, before and after, and the decode slope.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..data.traces import StepTrace
from .steperrors import step_errors, step_kinds, summary
from .traces import TraceFit, fit_trace, log_price, price_steps, zero_scale

__all__ = ["STEP_CONSTANTS", "PROFILE_ONLY", "CANDIDATES", "COLLINEAR", "residual_terms",
           "jacobian", "explained", "StepCalibration", "calibrate_steps"]

#: The constants a vLLM step trace fixes (what the profiles cannot see), with their meaning.
STEP_CONSTANTS = {
    "host_serial": "host time per step the GPU does not hide (scheduler, input preparation, "
                   "update from the sampled tokens), s",
    "host_serial_per_request": "the same per scheduled request (the engine's per-request "
                               "Python work and sampling), s",
    "compute_derate": "compute rate sustained in the engine relative to the isolated "
                      "kernels of the profiles (clocks under a whole model's load), in (0, 1]",
}
#: The values the step constants have without a step trace (what the profiles leave; what
#: ``jkernel.resolve`` assumes when the registry holds no fitted value, which
#: tests/test_replay_validate.py checks): :func:`calibrate_steps` starts from these, so a
#: refit does not start from its own result, and the serving validation
#: (``validation/replay.py``) prices with them as its "profiles only" case. The one home of
#: these values in calibration.
PROFILE_ONLY = {"host_serial": 0.0, "host_serial_per_request": 0.0, "compute_derate": 1.0,
                "kernel_gap": 0.0}
#: Candidates examined (stage 2) besides the chosen ones, and why each is not fitted when
#: it is collinear with one of them.
CANDIDATES = {
    "kernel_gap": "a constant per kernel: on one model the kernel count is fixed, so the same "
                  "column as host_serial",
    "hbm_derate": "moves the weight read, a constant per step on one model: collinear with "
                  "host_serial; kept at the profiles' value",
    "attention_decode_rate": "moves the KV read, nearly proportional to the requests when "
                             "contexts barely vary: collinear with host_serial_per_request; "
                             "kept at the profiles' value",
    "attention_prefill_work_scale": "prefill attention's share of a 1k-token prefill is small: "
                                    "the prefill level fixes compute_derate, not this",
}
#: R² above which a Jacobian column counts as explained by the chosen constants' columns.
COLLINEAR = 0.98


def residual_terms(kernel, params, trace: StepTrace, pred: np.ndarray | None = None) -> dict:
    """Stage 1: per step kind, the least-squares ``(a s, b s/request, c s/prefill token)`` of
    measured − predicted seconds (usable steps; ``c`` only for prefill steps)."""
    p = price_steps(kernel, params, trace) if pred is None else pred
    kind, size, usable = step_kinds(trace)
    pre_tok = np.array([float(np.sum(np.where(s > t, s, 0)))
                        for s, t in zip(trace.scheduled, trace.decode_threshold)])
    out = {}
    for k in ("decode", "prefill"):
        m = usable & (kind == k)
        if m.sum() < 3:
            continue
        cols = [np.ones(int(m.sum())), size[m].astype(float)]
        if k == "prefill":
            cols.append(pre_tok[m])
        A = np.vstack(cols).T
        coef = np.linalg.lstsq(A, trace.duration_s[m] - p[m], rcond=None)[0]
        out[k] = {"per_step_s": float(coef[0]), "per_request_s": float(coef[1]),
                  "per_prefill_token_s": float(coef[2]) if k == "prefill" else 0.0,
                  "steps": int(m.sum())}
    return out


def _subsample(n: int, at_most: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, min(n, at_most)).round().astype(int))


def jacobian(kernel, trace: StepTrace, names: Sequence[str], *, params=None,
             at_most: int = 3000) -> np.ndarray:
    """``∂ log expected_s / ∂ log v`` for each of ``names`` (columns) over an evenly spaced
    subsample of the usable steps (rows), through the one log-price program
    (:func:`~jkernel.calibration.fit.traces.log_price`); a constant at 0 is evaluated at its
    :data:`~jkernel.calibration.fit.traces.ZERO_SCALES` value."""
    _, _, usable = step_kinds(trace)
    tr = trace.select(np.nonzero(usable)[0][_subsample(int(usable.sum()), at_most)])
    base = kernel.params if params is None else params
    v0 = np.array([float(base[n]) if float(base[n]) > 0 else zero_scale(n) for n in names])
    stacks = [a for _, a in tr.stacked(kernel.buckets)]
    price = log_price(kernel.step_fn, "expected_s", tuple(names))
    return np.asarray(jax.jacfwd(lambda theta: price(theta, base, stacks))(
        jnp.log(jnp.asarray(v0))))


def _r2(y: np.ndarray, X: np.ndarray) -> float:
    """Share of ``y``'s variation about 0 that a least-squares combination of ``X``'s
    columns explains (1: ``y`` is in their span)."""
    if X.shape[1] == 0 or not np.any(y):
        return 0.0 if np.any(y) else 1.0
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    return float(1.0 - np.sum((y - X @ coef) ** 2) / np.sum(y ** 2))


def explained(kernel, trace: StepTrace, chosen: Sequence[str], candidates: Sequence[str],
              **kw) -> dict[str, float]:
    """Stage 2: for each chosen constant, how much of its Jacobian column the *other* chosen
    ones explain (near 1: the trace cannot separate it); for each other candidate, how much
    the chosen ones explain (above :data:`COLLINEAR`: fitting it adds nothing this trace can
    tell apart). Name → R²."""
    names = tuple(dict.fromkeys([*chosen, *candidates]))
    J = jacobian(kernel, trace, names, **kw)
    idx = {n: i for i, n in enumerate(names)}
    out = {}
    for n in names:
        others = [idx[m] for m in chosen if m != n]
        out[n] = _r2(J[:, idx[n]], J[:, others])
    return out


@dataclass
class StepCalibration:
    """Result of :func:`calibrate_steps`: the residual terms and the R² of stage 2 before
    the fit, the :class:`~jkernel.calibration.fit.traces.TraceFit`, and the acceptance
    figures (summaries from :func:`jkernel.calibration.fit.steperrors.summary`) and
    per-kind/batch tables, before and after, for the held-out part of the fitted run and
    for every other run."""

    residuals: dict
    r2: dict
    fit: TraceFit
    summaries: list[dict]
    tables: object
    not_identified: dict[str, str] = field(default_factory=dict)

    def values(self) -> dict[str, float]:
        return self.fit.coefficient_values()


def calibrate_steps(trace: StepTrace, held: Sequence[tuple[str, StepTrace]] = (), *,
                    kernel=None, fit: Sequence[str] = tuple(STEP_CONSTANTS),
                    candidates: Sequence[str] = tuple(CANDIDATES), heldout: float = 0.3,
                    steps: int = 400, from_profiles: bool = True,
                    progress: Callable[[str], None] | None = None) -> StepCalibration:
    """Stages 1–4 of the module docstring on ``trace`` (fitted on its first ``1 − heldout``
    in time) with ``held`` = ``[(label, trace)]`` other runs entirely held out.
    ``from_profiles``: start (and report "before") from :data:`PROFILE_ONLY` for the
    constants it names, not from the catalog's values, which may be an earlier fit's."""
    import pandas as pd
    say = progress or (lambda m: None)
    k = kernel if kernel is not None else trace.kernel()
    if from_profiles:
        k = k.with_params(k.params.replace(**{n: v for n, v in PROFILE_ONLY.items()
                                              if n in k.params}))
    res = residual_terms(k, k.params, trace)
    for kind, r in res.items():
        say(f"catalog misses, {kind} steps: {r['per_step_s'] * 1e6:+.0f} µs per step, "
            f"{r['per_request_s'] * 1e6:+.1f} µs per request"
            + (f", {r['per_prefill_token_s'] * 1e9:+.0f} ns per prefill token"
               if kind == "prefill" else ""))
    r2 = explained(k, trace, fit, candidates)
    not_identified = {}
    for n in candidates:
        if n in fit:
            continue
        if r2[n] > COLLINEAR:
            not_identified[n] = (f"{r2[n]:.4f} of its effect is the fitted constants' "
                                 f"(R² > {COLLINEAR}): {CANDIDATES.get(n, '')}")
        else:
            not_identified[n] = (f"separable (R² {r2[n]:.3f}) but not needed by the "
                                 f"residuals: {CANDIDATES.get(n, '')}")
    say("R² of each column by the fitted constants' columns: "
        + ", ".join(f"{n} {v:.4f}" for n, v in r2.items()))
    tf = fit_trace(trace, fit, kernel=k, heldout=heldout, split="time", steps=steps,
                   exclude_flags=("idle_before",), progress=say)
    # the held-out part is the fit's own split (data.heldout.held_out), never recomputed
    parts = [(f"last {heldout:.0%} of the fitted run", trace.select(tf.held)), *held]
    sums, tabs = [], []
    for label, tr in parts:
        for when, params in (("before", k.params), ("after", tf.params())):
            s = summary(k, params, tr, part=label)
            s["when"] = when
            sums.append(s)
            tb = step_errors(k, params, tr, part=label)
            tb.insert(1, "when", when)
            tabs.append(tb)
    return StepCalibration(res, r2, tf, sums, pd.concat(tabs, ignore_index=True),
                           not_identified)
