"""Calibration's data room: loaders of measured data, each into a typed record a fit reads.

* :mod:`~jkernel.calibration.data.heldout`: the one held-out split (rows by a stable hash of
  their key, steps by time);
* :mod:`~jkernel.calibration.data.profiles`: per-operator profiles (NVIDIA AIConfigurator's
  Parquet tables, Vidur's CSV files) as observation sets with explicit units;
* :mod:`~jkernel.calibration.data.traces`: the step-trace format (JSON Lines of measured
  whole steps) and :class:`~jkernel.calibration.data.traces.StepTrace`;
* :mod:`~jkernel.calibration.data.timestamps`: the one reconstruction of engine steps from
  streamed token timestamps;
* :mod:`~jkernel.calibration.data.importers`: aggregate forward-pass rows, streamed token
  timestamps (JSON) and Splitwise's table into step traces;
* :mod:`~jkernel.calibration.data.residency`: a residency-vllm serving run (``trace.csv`` +
  ``trace.itl.csv``) into a step trace.

Nothing here fits or prices: the room imports no module of :mod:`jkernel.calibration.fit`.
"""

__all__: list[str] = []
