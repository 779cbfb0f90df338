"""Calibration's report room: where a fit's numbers leave.

* :mod:`~jkernel.calibration.report.coefficients`: entries and coefficient sets in the
  catalog's format (which standard set a name goes to, registry units, provenance);
* :mod:`~jkernel.calibration.report.markdown`: Markdown reports of a chip fit and a
  step-trace fit;
* :mod:`~jkernel.calibration.report.plots`: measured-against-predicted PNG plots.
"""

__all__: list[str] = []
