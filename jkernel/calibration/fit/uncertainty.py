"""Standard errors, identifiability and prediction bands of fitted parameters.

Every fit in :mod:`jkernel.calibration` minimises a loss over parameters ``θ`` that live in
a transformed space (log, or logit for bounded quantities; see
:class:`jkernel.calibration.fit.base.Param`). Around the optimum the residuals
``r_i(θ) = log(predicted_i / measured_i)`` are linearised, ``r(θ + δ) ≈ r(θ) + J δ``, which
gives the Gauss–Newton (Laplace) approximation of the posterior::

    H_data = Jᵀ J / σ²                         σ² = Σ r_i² / (n − p)   (residual scale)
    C      = (H_data + Λ)⁻¹                    Λ = prior precision (0 for profile fits)

``C`` is the covariance of ``θ``; a parameter's standard error in its own units follows by
the delta method, ``se(v) = |dv/dθ| · sqrt(C_ii)``, and a symmetric interval in ``θ`` gives a
positive, asymmetric 95 % interval in ``v`` (``v·exp(±1.96 se_θ)`` for a log parameter).

**Identifiability** is judged from the data alone (``H_data``, without the prior), so a prior
never makes a parameter look measured:

1. ``H_data`` is eigen-decomposed. Directions whose eigenvalue is below
   ``rcond · λ_max`` are null directions: the data does not move the loss along them. A
   parameter with a squared loading above ``null_loading`` on the null directions is
   *unidentifiable* (reason ``"no curvature"``, e.g. a collective's peak rate when no
   measured message is large enough to be bound by it, or ``host_launch_per_kernel`` when
   every step runs a full CUDA graph).
2. Otherwise its data-only standard error in ``θ`` (from the pseudo-inverse of ``H_data``)
   must not exceed ``max_se`` (default 0.5: a factor of e^0.5 ≈ 1.65 for a log parameter);
   a larger one is reported as *unidentifiable* (reason ``"ill-conditioned"``): the data
   constrains it only in combination with other parameters.

Unidentifiable parameters get no standard error (``None``): the coefficient writer marks
them ``identifiable: false`` and omits ``standard_error``; the step-trace fitter keeps them
at their catalog values.

Caveat, stated in every report: profile residuals are dominated by the law's structural
misfit (tile quantisation, occupancy), not by independent noise, so these standard errors
measure how well the data pins the parameters *given the law*; the held-out error is the
honest measure of predictive accuracy.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Laplace", "gauss_newton", "jacobian_columns", "residual_scale", "prediction_band", "Z95"]

#: Two-sided 95 % normal quantile.
Z95 = 1.959963984540054


def residual_scale(residuals: np.ndarray, n_params: int) -> float:
    """``sqrt(Σ r² / (n − p))``, the residual scale of a least-squares fit (log space)."""
    r = np.asarray(residuals, dtype=np.float64)
    dof = max(len(r) - int(n_params), 1)
    return float(np.sqrt(np.sum(r * r) / dof))


@dataclass(frozen=True)
class Laplace:
    """The Gauss–Newton approximation at a fitted ``θ``.

    Attributes:
      names: parameter names, in ``θ`` order.
      theta: the fitted transformed parameters.
      cov_theta: covariance of ``θ`` (posterior: data plus prior), ``(p, p)``.
      sigma: residual scale ``σ`` used (log space).
      rows: number of residuals.
      identifiable: name → bool (judged from the data alone).
      reason: name → ``""``, ``"no curvature"`` or ``"ill-conditioned"``.
      se_theta: name → standard error of ``θ_i`` (None when unidentifiable).
      se_value: name → standard error in the parameter's own (SI) units, by the delta
        method (None when unidentifiable).
      ci95: name → ``(low, high)`` in SI units (None when unidentifiable).
      condition: condition number of ``H_data`` (inf when singular).
    """

    names: tuple[str, ...]
    theta: np.ndarray
    cov_theta: np.ndarray
    sigma: float
    rows: int
    identifiable: Mapping[str, bool]
    reason: Mapping[str, str]
    se_theta: Mapping[str, float | None]
    se_value: Mapping[str, float | None]
    ci95: Mapping[str, tuple[float, float] | None]
    condition: float
    notes: tuple[str, ...] = field(default=())

    def unidentifiable(self) -> list[str]:
        return [n for n in self.names if not self.identifiable[n]]


@functools.lru_cache(maxsize=16)
def _jvp_program(fn):
    """A jitted forward-mode product of ``fn`` (cached by identity)."""
    return jax.jit(lambda t, th_, *a: jax.jvp(lambda x: fn(x, *a), (th_,), (t,))[1])


def jacobian_columns(fn: Callable[..., jax.Array], theta, args: tuple = ()) -> np.ndarray:
    """``∂fn(θ, *args)/∂θ`` as an ``(n, p)`` array, one jitted forward-mode product per
    column (on CPU this is much faster than ``jacfwd``, whose batched tangents turn row
    gathers slow). ``args`` are passed as jit arguments, never captured as constants (XLA
    would constant-fold whatever depends on them alone)."""
    th = jnp.asarray(theta)
    jvp = _jvp_program(fn)
    eye = np.eye(th.shape[0])
    cols = [np.asarray(jvp(jnp.asarray(e), th, *args), dtype=np.float64).reshape(-1)
            for e in eye]
    return np.stack(cols, axis=1) if cols else np.zeros((0, 0))


def gauss_newton(residual_fn: Callable[..., jax.Array], theta: np.ndarray,
                 names: Sequence[str], *, to_value: Callable[[jax.Array], jax.Array],
                 args: tuple = (),
                 sigma: float | None = None, prior_precision: np.ndarray | None = None,
                 max_se: float = 0.5, rcond: float = 1e-9, null_loading: float = 0.05,
                 jacobian: np.ndarray | None = None) -> Laplace:
    """Laplace approximation of a least-squares fit in transformed space.

    Args:
      residual_fn: ``(θ, *args) → r`` (log ratios of the fitted rows), traceable.
      args: data passed to ``residual_fn`` as jit arguments.
      theta: fitted ``θ`` (1-D).
      names: one name per entry of ``θ``.
      to_value: ``θ → v`` (SI values, same shape), traceable; used for the delta method.
      sigma: residual scale; default :func:`residual_scale` of the residuals at ``θ``.
      prior_precision: ``(p, p)`` prior precision in ``θ`` (0 / None for no prior).
      max_se: largest data-only standard error of ``θ_i`` still called identifiable.
      rcond: relative eigenvalue below which a direction of ``H_data`` is null.
      null_loading: squared loading on null directions that makes a parameter unidentifiable.
      jacobian: the ``(n, p)`` Jacobian if the caller already has it.
    """
    theta = np.asarray(theta, dtype=np.float64)
    p = theta.shape[0]
    names = tuple(names)
    if len(names) != p:
        raise ValueError(f"{len(names)} names for {p} parameters")
    th = jnp.asarray(theta)
    r = np.asarray(jax.jit(residual_fn)(th, *args), dtype=np.float64)
    J = np.asarray(jacobian_columns(residual_fn, th, args) if jacobian is None else jacobian,
                   dtype=np.float64)
    finite = np.isfinite(r) & np.all(np.isfinite(J), axis=1)
    r, J = r[finite], J[finite]
    s = residual_scale(r, p) if sigma is None else float(sigma)
    s = max(s, 1e-12)
    H = J.T @ J / (s * s)
    # data-only identifiability
    w, V = np.linalg.eigh(H)
    lam_max = float(np.max(w)) if w.size else 0.0
    null = w <= rcond * max(lam_max, 0.0) if lam_max > 0 else np.ones_like(w, dtype=bool)
    loading = np.sum(V[:, null] ** 2, axis=1) if null.any() else np.zeros(p)
    inv_w = np.where(null, 0.0, 1.0 / np.where(null, 1.0, w))
    C_data = (V * inv_w) @ V.T
    se_data = np.sqrt(np.maximum(np.diag(C_data), 0.0))
    positive = w[~null]
    condition = (float(lam_max / positive.min()) if positive.size and not null.any()
                 else float("inf"))
    prior = np.zeros((p, p)) if prior_precision is None else np.asarray(prior_precision, float)
    post = H + prior
    try:
        C = np.linalg.inv(post) if np.linalg.matrix_rank(post) == p else np.linalg.pinv(post)
    except np.linalg.LinAlgError:
        C = np.linalg.pinv(post)
    se_post = np.sqrt(np.maximum(np.diag(C), 0.0))
    jac_v = np.asarray(jax.jacfwd(to_value)(th), dtype=np.float64)
    dv = np.diag(jac_v) if jac_v.ndim == 2 else np.asarray(jac_v)
    values = np.asarray(to_value(th), dtype=np.float64)
    identifiable, reason, se_t, se_v, ci = {}, {}, {}, {}, {}
    for i, n in enumerate(names):
        if loading[i] > null_loading:
            ok, why = False, "no curvature"
        elif se_data[i] > max_se:
            ok, why = False, "ill-conditioned"
        else:
            ok, why = True, ""
        identifiable[n], reason[n] = ok, why
        if ok:
            se_t[n] = float(se_post[i])
            se_v[n] = float(abs(dv[i]) * se_post[i])
            lo = np.asarray(to_value(th.at[i].add(-Z95 * se_post[i])))[i]
            hi = np.asarray(to_value(th.at[i].add(Z95 * se_post[i])))[i]
            lo, hi = float(min(lo, hi, values[i])), float(max(lo, hi, values[i]))
            ci[n] = (lo, hi)
        else:
            se_t[n] = se_v[n] = ci[n] = None
    return Laplace(names, theta, C, s, int(len(r)), identifiable, reason, se_t, se_v, ci,
                   condition)


def prediction_band(log_predict: Callable[..., jax.Array], laplace: Laplace, *,
                    args: tuple = (), observation: bool = True, z: float = Z95,
                    free: Sequence[str] | None = None):
    """A band for predicted times from the fitted parameters' covariance.

    ``log_predict``: ``(θ, *args) → log(seconds)`` of the rows to predict (traceable). The variance of
    each row's log time is ``g C gᵀ`` (``g = ∂ log t / ∂θ``) over the identifiable
    parameters (``free`` restricts it further); with ``observation=True`` the residual
    variance ``σ²`` is added, so the band is a prediction interval for one measured step
    rather than a confidence band for the mean.

    Returns ``(low, centre, high)`` numpy arrays in seconds.
    """
    th = jnp.asarray(laplace.theta)
    centre = np.asarray(jax.jit(log_predict)(th, *args), dtype=np.float64)
    G = np.atleast_2d(jacobian_columns(log_predict, th, args))
    if G.shape[0] != np.size(centre):
        G = G.reshape(np.size(centre), -1)
    keep = np.array([laplace.identifiable[n] and (free is None or n in free)
                     for n in laplace.names])
    C = laplace.cov_theta[np.ix_(keep, keep)]
    g = G[:, keep]
    var = np.einsum("ij,jk,ik->i", g, C, g) if keep.any() else np.zeros(len(G))
    if observation:
        var = var + laplace.sigma ** 2
    half = z * np.sqrt(np.maximum(var, 0.0))
    c = centre.reshape(-1)
    return np.exp(c - half), np.exp(c), np.exp(c + half)
