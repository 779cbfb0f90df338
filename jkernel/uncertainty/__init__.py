"""Predictive uncertainty: prediction intervals for serving metrics, with the share each
source contributes, and the probability that a deployment meets its SLA (docs/intervals.md).

Three sources, kept apart and each measured:

* the posterior of the fitted constants (:mod:`~jkernel.uncertainty.posterior`, from the
  fits' standard errors and covariances);
* the model's own structural error per step regime and extrapolation class, estimated from
  held-out residuals and shipped as data (:mod:`~jkernel.uncertainty.errormodel`,
  :mod:`~jkernel.uncertainty.estimate`, :mod:`~jkernel.uncertainty.extrapolation`);
* the workload's sampling noise (seeds of a workload spec).

Draws of all three run through the lockstep replay
(:func:`jkernel.replay.intervals.replay_intervals`); :mod:`~jkernel.uncertainty.intervals`
turns the draws into intervals and shares, :mod:`~jkernel.uncertainty.sla` into the
probability that SLA targets hold. Importing the package imports none of its modules.
"""
