"""Calibration of jkernel's step-time laws against measured data.

The package turns public operator measurements and step traces into the parameters of
jkernel's cost laws, evaluating the very laws the step function uses (``jkernel.laws``), and
reports how well they hold:

* :mod:`calibration.profiles`: typed loaders for the per-operator tables of NVIDIA
  AIConfigurator (GEMM, prefill and decode attention, MoE, MLA modules, NCCL collectives
  and vLLM's custom all-reduce) and Vidur's per-op CSV profiles, with explicit units,
  dropped rows counted by reason, and deterministic fit / held-out splits by shape;
* :mod:`calibration.base`: what every fit shares (parameters, problems, the one Adam loop,
  the soft-L1 loss, error statistics, the one held-out split ``held_out`` that every fit
  and report uses, the deterministic subsample);
* :mod:`~calibration.gemm`, :mod:`~calibration.attention`, :mod:`~calibration.moe` and
  :mod:`~calibration.collectives`: per-primitive fits in log/logit space (optax, robust loss
  on the log ratio), held-out errors beside the spec's reference values; and
  :mod:`calibration.fit`, the whole-chip fit ``fit_chip``;
* :mod:`calibration.traces`: the JSON Lines step-trace format and trace fits through
  ``jax.grad`` of ``expected_s``; :mod:`calibration.validate`: errors per step kind and
  batch size; :mod:`calibration.stepfit`: which engine-level constants a measured trace
  fixes (residual terms, identifiability, time-split fit, errors before and after);
* :mod:`calibration.importers` (aggregate rows, streamed token timestamps, the splitwise
  table) and :mod:`calibration.residency` (a streamed serving run's ``trace.csv`` +
  ``trace.itl.csv``);
* :mod:`calibration.uncertainty`: Gauss–Newton / Laplace standard errors, prediction bands
  and identifiability;
* :mod:`calibration.report`: coefficient sets in the catalog's format and Markdown reports;
* ``python -m calibration profiles|traces|import`` and ``python -m calibration.regenerate``
  (the shipped catalog's calibrated values, ``--steps`` for the step-trace constants).

The modules form layers, each importing only those before it: ``uncertainty`` ← ``base``
← ``profiles`` ← primitives and ``traces`` ← ``validate`` ← ``stepfit`` ← ``fit``
← ``importers``, ``report`` ← ``residency``, ``seed`` ← ``regenerate`` ← ``__main__``
(``tests/test_calibration_layers.py``). No module sets ``jax.config`` at import.

Importing :mod:`calibration` is cheap: it imports none of its submodules, numpy, JAX or
pyarrow. Import the submodule you need, e.g. ``from calibration import profiles``.
pyarrow, needed to read the Parquet tables, is the optional extra
``pip install 'jkernel[profiles]'``.
"""

__all__: list[str] = []
