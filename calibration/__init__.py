"""Calibration of jkernel's step-time laws against measured data.

The package turns public operator measurements into the parameters of jkernel's cost laws
and reports how well they hold. It is built in stages:

* :mod:`calibration.profiles` (now): typed loaders for the per-operator tables of NVIDIA
  AIConfigurator (GEMM, prefill and decode attention, MoE, MLA modules, NCCL collectives
  and vLLM's custom all-reduce) and Vidur's per-op CSV profiles. Every table becomes a
  frozen observation set of numpy columns with explicit units (seconds, bytes, FLOPs,
  token counts), rows it had to drop counted by reason, and deterministic fit / held-out
  splits keyed on the row's shape.
* fitting of law coefficients to those observations (to follow);
* whole-step traces: generation of synthetic traces with known parameters and recovery
  of those parameters (to follow);
* uncertainty of the fitted coefficients (to follow);
* reports comparing predicted and measured times (to follow).

Importing :mod:`calibration` is cheap: it imports none of its submodules, numpy, JAX or
pyarrow. Import the submodule you need, e.g. ``from calibration import profiles``.
pyarrow, needed to read the Parquet tables, is the optional extra
``pip install 'jkernel[profiles]'``.
"""

__all__: list[str] = []
