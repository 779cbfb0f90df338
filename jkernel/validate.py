"""One set of argument checks for every entry point (``Batch``, ``step_time``,
``price_many``, ``price_sweep``, the methods around a step, the kernel's own arguments —
buckets, params, options, pool, Placement —, the replay's kernels and the command line).

Every check raises :class:`ArgumentError` — a ``ValueError`` whose ``argument`` attribute
names the argument and whose message starts with it — before anything is traced, so a bad
value never reaches a compiled program and never fails there as a raw ``OverflowError``,
``AttributeError`` or a silent zero.

Token counts are whole numbers in ``[0, 2³¹)`` (the programs read them as int32); the step's
scalars likewise, except ``pad_tokens``, where a negative count means no padding (D27).
The largest values taken are in :mod:`jkernel.limits` (docs/limits.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Integral, Real

import numpy as np

from .limits import INT32_MAX

__all__ = ["ArgumentError", "INT32_MAX", "tokens_array", "tokens_matrix", "whole",
           "step_scalars", "scalar_column", "amount", "positive", "buckets", "bucket_sizes",
           "PRICE_DTYPES", "price_dtype", "pool_selector", "chunk", "params_values",
           "placement_pool", "finite", "kernel", "disaggregated_pair", "params_mapping"]

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


def whole(name: str, value, *, lo: int | None = 0, hi: int = INT32_MAX,
          limit: str | None = None) -> int:
    """One whole number in ``[lo, hi]`` (``lo`` None: no lower bound); ``limit`` names the
    :mod:`jkernel.limits` bound ``hi`` is, for the message."""
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
        if limit is not None:
            from .limits import beyond
            raise ArgumentError(name, beyond(limit, v))
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


# -- the kernel's own arguments -------------------------------------------------------------

def buckets(value) -> tuple[int, ...]:
    """Request-count buckets: a non-empty sequence of whole numbers in
    ``[1, MAX_BATCH_REQUESTS]``, returned sorted without repeats. A bucket below 1 would pad
    a batch into no requests at all (``buckets=(-16,)`` once priced a real request as an
    empty batch)."""
    from .limits import MAX_BATCH_REQUESTS

    if isinstance(value, (str, bytes)) or value is None or np.ndim(value) != 1:
        raise ArgumentError("buckets", f"must be a sequence of request counts, e.g. "
                            f"(16, 64, 256), got {value!r}")
    out = sorted({whole("buckets", b, lo=1, hi=MAX_BATCH_REQUESTS,
                           limit="MAX_BATCH_REQUESTS") for b in value})
    if not out:
        raise ArgumentError("buckets", "needs at least one request count")
    return tuple(out)


def bucket_sizes(name: str, value) -> list[int]:
    """Bucket sizes to compile (``warm_up``): whole numbers in ``[1, MAX_BATCH_REQUESTS]``."""
    from .limits import MAX_BATCH_REQUESTS

    if isinstance(value, (str, bytes)) or np.ndim(value) != 1:
        raise ArgumentError(name, f"must be a sequence of request counts, got {value!r}")
    return [whole(name, b, lo=1, hi=MAX_BATCH_REQUESTS, limit="MAX_BATCH_REQUESTS") for b in value]


#: The float dtypes a bulk price may be computed in: float16 overflows a step's byte and
#: FLOP counts (65,504 at most) and an integer dtype cannot hold seconds; both once gave NaN.
PRICE_DTYPES = ("float32", "float64")


def price_dtype(value):
    """``None`` (the kernel's float64) or a dtype among :data:`PRICE_DTYPES`, as numpy's."""
    if value is None:
        return None
    try:
        dt = np.dtype(value)
    except TypeError:
        dt = None
    if dt is None or dt.name not in PRICE_DTYPES:
        raise ArgumentError("dtype", f"must be None (float64), float32 or float64, got "
                            f"{value!r}: an integer dtype cannot hold seconds and float16 "
                            "overflows a step's byte counts")
    return dt


def pool_selector(value) -> int | str:
    """A pool named by index (a whole number; the deployment checks its range) or role (a
    non-empty string)."""
    if isinstance(value, str):
        if not value:
            raise ArgumentError("pool", "needs a role (prefill, decode, colocated) or an "
                                "index, got ''")
        return value
    return whole("pool", value, lo=None)


def chunk(value) -> int:
    """Batches per program of the bulk path: whole, ≥ 1."""
    return whole("chunk", value, lo=1)


def _must_be_positive(name: str, chip_names) -> bool:
    """Parameters the step divides by: zero or negative prices a step at inf or NaN."""
    return (name in chip_names or name.endswith("_derate")
            or name.startswith(("gemm_eps_max", "collective_peak_rate")))


def _must_not_be_negative(name: str) -> bool:
    """Parameters that are times (floors, host work): a negative one prices a negative
    step."""
    return "floor" in name or name.startswith("host_") or name == "kernel_gap"


def params_values(names, flat, chip_names) -> None:
    """Refuse a parameter set (``flat``: ``(names,)`` or ``(sets, names)``, in ``names``
    order) holding NaN or an infinity, a chip rate, derate, GEMM efficiency or collective
    peak rate ≤ 0, or a negative floor or host time: each would price a step as NaN,
    infinite or negative (a zero ``hbm_bytes_per_s`` once priced NaN). Traced values (inside
    a JAX transformation) are not checked here."""
    try:
        arr = np.asarray(flat, dtype=float)
    except TypeError:                    # a tracer: checked where the values are concrete
        return
    arr = arr.reshape(-1, len(names)) if arr.size else arr.reshape(0, len(names))
    bad = ~np.isfinite(arr)
    for j, name in enumerate(names):
        col = arr[:, j]
        where = ""
        if arr.shape[0] > 1:
            where = " (parameter set {})"
        if bad[:, j].any():
            i = int(np.flatnonzero(bad[:, j])[0])
            raise ArgumentError("params", f"{name} is {col[i]}{where.format(i)}; every "
                                "parameter must be finite")
        if _must_be_positive(name, chip_names) and (col <= 0).any():
            i = int(np.flatnonzero(col <= 0)[0])
            raise ArgumentError("params", f"{name} is {col[i]:g}{where.format(i)}; it must be "
                                "> 0 (the step divides by it)")
        if _must_not_be_negative(name) and (col < 0).any():
            i = int(np.flatnonzero(col < 0)[0])
            raise ArgumentError("params", f"{name} is {col[i]:g}{where.format(i)}; it is a "
                                "time and must be ≥ 0")


def params_mapping(value, params_type):
    """``value`` as ``params_type`` (:class:`jkernel.Params`): a Params as it is, another
    mapping of names to values converted."""
    if isinstance(value, params_type):
        return value
    if not isinstance(value, Mapping):
        raise ArgumentError("params", f"must be a jkernel.Params (a mapping of names to "
                            f"values), not {type(value).__name__}")
    return params_type(value)


def placement_pool(name: str, placement, roles) -> None:
    """A :class:`~jkernel.Placement`'s ``pool`` is "" (unstated), a role of the deployment
    or an index of one of its pools."""
    pool = placement.pool
    if pool == "":
        return
    if isinstance(pool, str):
        if pool not in roles:
            raise ArgumentError(f"{name}.pool", f"{pool!r} is not a pool of the deployment; "
                                f"its pools are {', '.join(roles)} (or an index)")
    elif not 0 <= pool < len(roles):
        raise ArgumentError(f"{name}.pool", f"no pool at index {pool}; the deployment has "
                            f"{len(roles)}")


def finite(name: str, value, *, lo: float | None = None, positive: bool = False) -> float:
    """A finite real (``lo``: lower bound; ``positive``: > 0)."""
    if isinstance(value, (bool, np.bool_)) or value is None or not isinstance(value, Real):
        raise ArgumentError(name, f"must be a number, got {value!r}")
    f = float(value)
    if not math.isfinite(f):
        raise ArgumentError(name, f"must be finite, got {value!r}")
    if positive and not f > 0:
        raise ArgumentError(name, f"must be > 0, got {value!r}")
    if lo is not None and f < lo:
        raise ArgumentError(name, f"must be ≥ {lo:g}, got {value!r}")
    return f


def kernel(name: str, value):
    """``value`` if it is a :class:`jkernel.Kernel`."""
    from .kernel import Kernel

    if not isinstance(value, Kernel):
        raise ArgumentError(name, f"must be a jkernel.Kernel (jkernel.open / open_pool), not "
                            f"{type(value).__name__}")
    return value


def disaggregated_pair(prefill, decode) -> None:
    """The two kernels of a disaggregated replay: the prefill pool then the decode pool, of
    one model (the decode pool reads the KV cache the prefill pool wrote). Swapped pools, a
    colocated pool, or a 70B prefill pool beside an 8B decode pool are refused."""
    kernel("prefill_kernel", prefill)
    kernel("decode_kernel", decode)
    roles = (prefill.pool().role, decode.pool().role)
    if roles == ("decode", "prefill"):
        raise ArgumentError("prefill_kernel", "is the decode pool and decode_kernel the "
                            "prefill pool: pass the prefill pool first "
                            "(open_pool(bundle, 'prefill'), open_pool(bundle, 'decode'))")
    for arg, role, want in (("prefill_kernel", roles[0], "prefill"),
                            ("decode_kernel", roles[1], "decode")):
        if role != want:
            raise ArgumentError(arg, f"is a {role} pool; a disaggregated replay takes the "
                                f"{want} pool here (open_pool(bundle, {want!r}))")
    a, b = prefill.inputs, decode.inputs
    if a.scenario.model != b.scenario.model or a.model != b.model:
        raise ArgumentError("decode_kernel", f"serves {b.scenario.model} but the prefill pool "
                            f"serves {a.scenario.model}: the decode pool continues the "
                            "prefill pool's requests from its KV cache, so both serve one "
                            "model")
