"""Calibration of jkernel's step-time laws against measured data.

The package turns public operator measurements and measured steps into the parameters of
jkernel's cost laws, evaluating the very laws the step function uses (:mod:`jkernel.laws`),
and reports how well they hold. It is four rooms, each with one job (``README.md`` in this
folder has the data flows and the layer table that ``tests/test_calibration_layers.py``
reads):

* :mod:`jkernel.calibration.data`: data loaders: operator profiles (AIConfigurator, Vidur),
  the step-trace format, importers into it (aggregate rows, streamed token timestamps,
  Splitwise, residency-vllm runs) and the one held-out split;
* :mod:`jkernel.calibration.fit`: the fits: the shared machinery (parameters, the one Adam
  loop, losses, statistics), uncertainty, the primitive fits and the chip fit, the
  step-trace fit with its one log-price program, and the step-constant fit;
* :mod:`jkernel.calibration.report`: coefficient-set writing, Markdown reports, plots;
* drivers: ``python -m jkernel.calibration profiles|traces|import`` (:mod:`.__main__`),
  ``python -m jkernel.calibration.regenerate`` (the shipped catalog's calibrated values) and
  ``python -m jkernel.calibration.seed`` (the catalog's first collectives).

No module sets ``jax.config`` at import. Importing :mod:`jkernel.calibration` (or a room) is
cheap: it imports none of its submodules, numpy, JAX or pyarrow. Import the module you need,
e.g. ``from jkernel.calibration.data import profiles``. pyarrow, needed to read the Parquet
tables, is the optional extra ``pip install 'jkernel[profiles]'``.
"""

__all__: list[str] = []
