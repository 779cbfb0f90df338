"""The posterior of a kernel's fitted constants, and draws from it.

The fits of :mod:`jkernel.calibration` compute a Gauss–Newton (Laplace) posterior
(:mod:`jkernel.calibration.fit.uncertainty`); a coefficient set keeps each identifiable
entry's ``standard_error`` (in the entry's units), and a fit's own
:class:`~jkernel.calibration.fit.uncertainty.Laplace` keeps the whole covariance. Here the
constants live in log space, ``θ = log v``, where a standard error ``se`` of ``v`` is
``se / v`` (the delta method), and the posterior is the normal ``θ ~ N(log v̂, C)``:

* :meth:`Posterior.from_kernel`: every constant the kernel prices with whose selected
  coefficient entry records a ``standard_error`` (and is identifiable), independent unless
  an error model's ``correlations`` give the correlation of a block (the step-trace fit's
  constants are estimated together and correlated);
* :meth:`Posterior.from_laplace`: a fit's covariance as it is (log-parameterised fits:
  the step-trace fit, whose ``θ`` is already ``log v``).

A draw is a set of log factors by name (:meth:`Posterior.log_scales`): a constant's value
in draw *k* is ``v̂ · exp(δ_k)``. Constants without a recorded uncertainty (assumed,
copied, profile-only) are not drawn: the extrapolation class of the error model widens the
interval for them instead (:mod:`jkernel.uncertainty.extrapolation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Posterior", "selected_entries"]


@dataclass(frozen=True)
class Posterior:
    """``θ = log v ~ N(log values, cov)`` over ``names``.

    Attributes:
      names: the constants with an uncertainty, in ``cov`` order.
      values: their point values (SI units).
      cov: covariance of their logs, ``(p, p)``.
      origins: per name, where its uncertainty comes from (set and method, or the fit).
    """

    names: tuple[str, ...]
    values: np.ndarray
    cov: np.ndarray
    origins: tuple[str, ...] = ()

    def __post_init__(self):
        p = len(self.names)
        if np.shape(self.values) != (p,) or np.shape(self.cov) != (p, p):
            raise ValueError(f"a posterior over {p} names needs {p} values and a {p}×{p} "
                             f"covariance, got {np.shape(self.values)} and "
                             f"{np.shape(self.cov)}")
        if p and (not np.all(np.isfinite(self.cov))
                  or np.linalg.eigvalsh((self.cov + self.cov.T) / 2).min()
                  < -1e-12 * max(1.0, float(np.abs(self.cov).max()))):
            raise ValueError("the covariance must be finite, symmetric and positive "
                             "semi-definite")

    @property
    def sd(self) -> np.ndarray:
        """Standard deviation of each log value (≈ the relative standard error)."""
        return np.sqrt(np.maximum(np.diag(self.cov), 0.0))

    def __len__(self) -> int:
        return len(self.names)

    def log_scales(self, draws: int, rng: np.random.Generator) -> np.ndarray:
        """``(draws, p)`` log factors ``δ ~ N(0, cov)``."""
        p = len(self.names)
        if p == 0:
            return np.zeros((draws, 0))
        w, v = np.linalg.eigh((self.cov + self.cov.T) / 2)
        root = v * np.sqrt(np.maximum(w, 0.0))
        return rng.standard_normal((draws, p)) @ root.T

    def named(self, row: np.ndarray) -> dict[str, float]:
        """One draw's log factors by name (what a lockstep variant takes)."""
        return {n: float(x) for n, x in zip(self.names, row)}

    def restricted(self, names: Sequence[str]) -> "Posterior":
        """The marginal over ``names`` (those it has, in its order)."""
        keep = [i for i, n in enumerate(self.names) if n in set(names)]
        return Posterior(tuple(self.names[i] for i in keep), self.values[keep],
                         self.cov[np.ix_(keep, keep)],
                         tuple(self.origins[i] for i in keep) if self.origins else ())

    def merged(self, other: "Posterior") -> "Posterior":
        """This posterior with ``other``'s names added or replacing (block-diagonal
        between the two: ``other`` wins for a name both have)."""
        mine = [i for i, n in enumerate(self.names) if n not in set(other.names)]
        names = tuple(self.names[i] for i in mine) + other.names
        p, q = len(mine), len(other.names)
        cov = np.zeros((p + q, p + q))
        cov[:p, :p] = self.cov[np.ix_(mine, mine)]
        cov[p:, p:] = other.cov
        origins = (tuple(self.origins[i] for i in mine) if self.origins else ("",) * p) + \
            (other.origins or ("",) * q)
        return Posterior(names, np.concatenate([self.values[mine], other.values]), cov,
                         origins)

    # ----------------------------------------------------------------------------------
    @classmethod
    def empty(cls) -> "Posterior":
        return cls((), np.zeros(0), np.zeros((0, 0)), ())

    @classmethod
    def from_kernel(cls, kernel, error_model=None) -> "Posterior":
        """The posterior of ``kernel``'s constants from the standard errors its selected
        coefficient entries record (module docstring); ``error_model``'s correlations
        (:class:`~jkernel.uncertainty.errormodel.ErrorModel`) join constants fitted
        together."""
        params = kernel.params
        chosen = selected_entries(kernel)
        names, values, sds, origins = [], [], [], []
        for origin in kernel.provenance():
            if origin.name not in params or origin.name not in chosen:
                continue
            entry = chosen[origin.name]
            extra = dict(entry.extra)
            se = extra.get("standard_error")
            if se is None or extra.get("identifiable") is False or not entry.value:
                continue
            rel = abs(float(se) / float(entry.value))
            if not np.isfinite(rel) or rel <= 0:
                continue
            names.append(origin.name)
            values.append(float(np.asarray(params[origin.name])))
            sds.append(rel)
            origins.append(f"{origin.set}: {origin.method}, standard_error {se} "
                           f"({rel * 100:.2g} %)")
        cov = np.diag(np.square(sds)) if sds else np.zeros((0, 0))
        index = {n: i for i, n in enumerate(names)}
        for cor in (error_model.correlations if error_model is not None else ()):
            have = [n for n in cor.names if n in index]
            if len(have) < 2:
                continue
            r = cor.array()
            pos = {n: i for i, n in enumerate(cor.names)}
            for a in have:
                for b in have:
                    if a != b:
                        ia, ib = index[a], index[b]
                        cov[ia, ib] = r[pos[a], pos[b]] * sds[ia] * sds[ib]
            for a in have:
                origins[index[a]] += f"; correlated with the others of {cor.source or 'a fit'}"
        return cls(tuple(names), np.asarray(values, float), cov, tuple(origins))

    @classmethod
    def from_laplace(cls, laplace, values: dict | None = None, *,
                     origin: str = "a fit's Laplace covariance") -> "Posterior":
        """A log-parameterised fit's posterior (``θ = log v``; the step-trace fit,
        :class:`~jkernel.calibration.fit.traces.TraceFit`\\ ``.laplace``), over its
        identifiable names; ``values``: their point values (default ``exp θ``)."""
        keep = [i for i, n in enumerate(laplace.names) if laplace.identifiable[n]]
        names = tuple(laplace.names[i] for i in keep)
        vals = np.array([float(values[n]) if values is not None else
                         float(np.exp(laplace.theta[i])) for n, i in zip(names, keep)])
        cov = np.asarray(laplace.cov_theta, float)[np.ix_(keep, keep)]
        return cls(names, vals, (cov + cov.T) / 2, (origin,) * len(names))


def selected_entries(kernel) -> dict:
    """Name → the coefficient entry the kernel's selection chose (documents.md §8.4: the
    last applicable entry of the scenario's sets wins), as
    :func:`jkernel.documents.coefficients.select` picks it for the kernel's pool."""
    from ..documents.coefficients import select
    from .extrapolation import deployment_facts

    f = deployment_facts(kernel)
    chosen = select(kernel.inputs.coefficient_sets, hardware=f.hardware, model=f.model,
                    tp=f.tp, ep=f.ep, nodes_spanned=f.nodes_spanned,
                    engine_version=kernel.inputs.scenario.engine_version)
    return {name: e for name, (e, _) in chosen.items()}
