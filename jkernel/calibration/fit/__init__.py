"""Calibration's fit room: parameters fitted to measured data through jkernel's own laws.

* :mod:`~jkernel.calibration.fit.uncertainty`: Gauss–Newton (Laplace) standard errors,
  identifiability and prediction bands;
* :mod:`~jkernel.calibration.fit.base`: parameters, problems, the one Adam loop, the losses,
  error statistics, the spec's reference values;
* :mod:`~jkernel.calibration.fit.gemm`, :mod:`~jkernel.calibration.fit.attention`,
  :mod:`~jkernel.calibration.fit.collectives`, :mod:`~jkernel.calibration.fit.moe`: the
  primitive fits on operator profiles; :mod:`~jkernel.calibration.fit.chip`: all of them for
  one chip;
* :mod:`~jkernel.calibration.fit.traces`: the one log-price program of a step trace and the
  gradient fit of any parameters against measured steps;
  :mod:`~jkernel.calibration.fit.steperrors`: errors per step kind and batch size;
  :mod:`~jkernel.calibration.fit.stepfit`: which engine-level constants a measured trace
  fixes, and their fit.
"""

__all__: list[str] = []
