"""One set of argument checks for every entry point (``Batch``, ``step_time``,
``price_many``, ``price_sweep``, the methods around a step and the command line).

Every check raises :class:`ArgumentError` — a ``ValueError`` whose ``argument`` attribute
names the argument and whose message starts with it — before anything is traced, so a bad
value never reaches a compiled program and never fails there as a raw ``OverflowError``,
``AttributeError`` or a silent zero.

Token counts are whole numbers in ``[0, 2³¹)`` (the programs read them as int32); the step's
scalars likewise, except ``pad_tokens``, where a negative count means no padding (D27).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np

__all__ = ["ArgumentError", "INT32_MAX", "tokens_array", "tokens_matrix", "whole",
           "step_scalars", "scalar_column", "amount", "positive"]

#: The largest token count the step programs read (int32).
INT32_MAX = 2 ** 31 - 1


class ArgumentError(ValueError):
    """A bad argument to a jkernel call. ``argument`` names it; ``reason`` says what is
    allowed."""

    def __init__(self, argument: str, reason: str):
        self.argument = argument
        self.reason = reason
        super().__init__(f"{argument}: {reason}")


def _check_values(name: str, arr: np.ndarray, *, lo: int | None = 0) -> np.ndarray:
    """``arr`` as int32 after the checks (NaN, fractions, range), one pass where it can."""
    kind = arr.dtype.kind
    if kind == "b":
        arr = arr.astype(np.int32)
    elif kind == "f":
        if arr.size:
            if not np.isfinite(arr).all():
                raise ArgumentError(name, "holds NaN or infinite values")
            bad = arr != np.floor(arr)
            if bad.any():
                raise ArgumentError(name, f"must hold whole token counts, got {arr[bad][:3]}")
    elif kind not in "iu":
        raise ArgumentError(name, f"must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.int32:
        if arr.size and lo is not None and arr.min() < lo:
            raise ArgumentError(name, f"must be ≥ {lo}, got {int(arr.min())}")
        return arr
    if arr.size:
        mn, mx = arr.min(), arr.max()
        if lo is not None and mn < lo:
            raise ArgumentError(name, f"must be ≥ {lo}, got {mn:g}" if kind == "f" else
                                f"must be ≥ {lo}, got {int(mn)}")
        if mx > INT32_MAX or mn < -INT32_MAX:
            raise ArgumentError(name, f"exceeds 2^31 - 1 = {INT32_MAX} tokens, got {mx:g}"
                                if kind == "f" else
                                f"exceeds 2^31 - 1 = {INT32_MAX} tokens, got {int(mx)}")
    return arr.astype(np.int32)


def tokens_array(name: str, values, n: int | None = None, *, of: str = "scheduled",
                 sign: bool = True) -> np.ndarray:
    """A one-dimensional int32 array of token counts (``n`` entries when given).
    ``sign=False`` leaves the sign of an int32 array to the caller (the step program
    counts negative entries in its own pass over the requests)."""
    if type(values) is np.ndarray and values.dtype == np.int32 and values.ndim == 1:
        arr = values                                   # the simulator's fast path
        if sign and arr.size and arr.min() < 0:
            raise ArgumentError(name, f"must be ≥ 0, got {int(arr.min())}")
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError) as exc:
            raise ArgumentError(name, f"must be a sequence of integers ({exc})") from None
        if arr.ndim != 1:
            raise ArgumentError(name, f"must be one-dimensional, got shape {arr.shape}")
        arr = _check_values(name, arr)
    if n is not None and arr.shape[0] != n:
        raise ArgumentError(name, f"has {arr.shape[0]} entries but {of} has {n}")
    return arr


def tokens_matrix(name: str, values) -> np.ndarray:
    """A two-dimensional ``(batches, requests)`` int32 array of token counts. An int32
    C-contiguous array is returned as it is (no copy); its sign is checked by the program
    that reads it (see :meth:`jkernel.Kernel.price_many`)."""
    arr = np.asarray(values)
    if arr.ndim != 2:
        raise ArgumentError(name, f"must have shape (batches, requests), got {arr.shape}")
    if arr.dtype == np.int32:
        return np.ascontiguousarray(arr)
    return np.ascontiguousarray(_check_values(name, arr))


def whole(name: str, value, *, lo: int | None = 0, hi: int = INT32_MAX) -> int:
    """One whole number in ``[lo, hi]`` (``lo`` None: no lower bound)."""
    if type(value) is int:
        v = value
    else:
        if isinstance(value, (bool, np.bool_)) or value is None or not isinstance(value, Real):
            raise ArgumentError(name, f"must be an integer, got {value!r}")
        if isinstance(value, Integral):
            v = int(value)
        else:
            f = float(value)
            if not math.isfinite(f) or f != math.floor(f):
                raise ArgumentError(name, f"must be a whole number, got {value!r}")
            v = int(f)
    if lo is not None and v < lo:
        raise ArgumentError(name, f"must be ≥ {lo}, got {v}")
    if v > hi or v < -hi:
        raise ArgumentError(name, f"must be at most {hi} (int32), got {v}")
    return v


def step_scalars(decode_threshold, sm_budget, pad_tokens) -> tuple[int, int, int]:
    """The step's scalars: ``decode_threshold`` ≥ 0, ``sm_budget`` ≥ 0 (0 = all SMs),
    ``pad_tokens`` (negative counts as 0, D27)."""
    thr = whole("decode_threshold", decode_threshold)
    sm = whole("sm_budget", sm_budget)
    pad = whole("pad_tokens", pad_tokens, lo=None)
    return thr, sm, pad if pad > 0 else 0


def scalar_column(name: str, value, nb: int, *, lo: int | None = 0) -> np.ndarray:
    """An int or a ``(batches,)`` array of a step scalar, as int32 ``(batches,)``."""
    if np.ndim(value) == 0:
        v = whole(name, value, lo=lo)
        return np.full(nb, max(v, 0) if lo is None else v, np.int32)
    arr = np.asarray(value)
    if arr.shape != (nb,):
        raise ArgumentError(name, f"must be an integer or have shape ({nb},), got {arr.shape}")
    arr = _check_values(name, arr, lo=lo)
    return np.maximum(arr, 0) if lo is None else arr


def amount(name: str, value, *, positive_only: bool = False) -> float:
    """A finite non-negative real (token counts, bytes) for the methods around a step."""
    if isinstance(value, (bool, np.bool_)) or value is None or not isinstance(value, Real):
        raise ArgumentError(name, f"must be a number, got {value!r}")
    f = float(value)
    if not math.isfinite(f):
        raise ArgumentError(name, f"must be finite, got {value!r}")
    if f < 0:
        raise ArgumentError(name, f"must be ≥ 0, got {value!r}")
    if positive_only and f == 0:
        raise ArgumentError(name, f"must be > 0, got {value!r}")
    return f


def positive(name: str, value) -> int:
    """A whole number ≥ 1 (queue depths)."""
    return whole(name, value, lo=1)
