"""The one held-out split of calibration: which rows (profile rows, trace steps) a fit never
sees.

Every fit and every report splits its rows with :func:`held_out`: profile rows by a stable
hash of their shape (:meth:`jkernel.calibration.data.profiles.Observations.split`, so one
shape never lands on both sides), step traces by time (the last fraction held out, so a fit
never learns from the steps after those it is judged on) or by a hash of the step's index
(:meth:`jkernel.calibration.data.traces.StepTrace.held_mask`). :func:`row_hash` is the
stable per-row hash (SplitMix64 over the key columns), independent of the process, the
platform and Python's hash seed. Serving runs are held out whole, by run per source
(:func:`held_out_runs`).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = ["row_hash", "held_out", "held_out_runs"]


_M64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _column_codes(values: np.ndarray) -> np.ndarray:
    """A stable uint64 code per value (independent of Python's hash seed)."""
    v = np.asarray(values)
    if v.dtype.kind == "b":
        return v.astype(np.uint64)
    if v.dtype.kind in "iu":
        return np.ascontiguousarray(v.astype(np.int64)).view(np.uint64)
    if v.dtype.kind == "f":
        return np.ascontiguousarray(v.astype(np.float64) + 0.0).view(np.uint64)  # -0.0 → 0.0
    uniq, inv = np.unique(v.astype(str), return_inverse=True)
    codes = np.array(
        [int.from_bytes(hashlib.blake2b(u.encode(), digest_size=8).digest(), "little")
         for u in uniq], dtype=np.uint64)
    return codes[inv].reshape(v.shape)


def row_hash(seed: int, keys: Sequence[np.ndarray]) -> np.ndarray:
    """A uint64 per row, shape ``(n,)``, that depends only on ``seed`` and the row's values
    in the key columns ``keys`` (each shape ``(n,)``: integers, floats, booleans or strings),
    stable across processes and platforms: SplitMix64 chained over the columns."""
    if not len(keys):
        raise ValueError("row_hash needs at least one key column")
    n = len(keys[0])
    h = _splitmix64(np.full(n, int(seed) & _M64, dtype=np.uint64))
    for col in keys:
        h = _splitmix64(h ^ _splitmix64(_column_codes(col)))
    return h


def held_out(fraction: float, *, key_hash: np.ndarray | None = None,
             time_s: np.ndarray | None = None) -> np.ndarray:
    """Which rows a fit never sees: a boolean mask, shape ``(n,)``, True = held out.

    ``fraction`` in [0, 1] is the held-out share. Give exactly one of:

    * ``key_hash`` (uint64, shape ``(n,)``, from :func:`row_hash`): a row is held out when
      its hash mapped to [0, 1) is below ``fraction``. Rows with equal keys fall on the same
      side, and a row's side does not depend on the other rows (so it survives selecting
      and concatenating). The profile fits key on the row's shape; the step-trace fits'
      ``"hash"`` split keys on the step's index.
    * ``time_s`` (shape ``(n,)``, any increasing clock): the rows after the first
      ``round((1 − fraction) · n)`` in time order (ties kept in row order) are held out, so
      the fit learns from the past only. The step-trace fits' ``"time"`` split (what the
      shipped step constants use).
    """
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the held-out fraction must lie in [0, 1], got {fraction}")
    if (key_hash is None) == (time_s is None):
        raise ValueError("held_out takes exactly one of key_hash= and time_s=")
    if key_hash is not None:
        u = (np.asarray(key_hash, np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        return u < fraction
    t = np.asarray(time_s)
    held = np.zeros(len(t), bool)
    held[np.argsort(t, kind="stable")[int(round((1.0 - fraction) * len(t))):]] = True
    return held


def held_out_runs(source: str, runs: Sequence[str]) -> set[str]:
    """The held-out runs of one source of serving runs: the third (rounded, at least one)
    whose ``sha256("<source>/<run>")`` sorts first. By run, never by request: a run's load
    stages go with it, and a run's side depends only on its name and the runs beside it."""
    names = sorted(set(runs))
    ranked = sorted(names, key=lambda r: hashlib.sha256(f"{source}/{r}".encode()).hexdigest())
    return set(ranked[:max(1, round(len(names) / 3))])
