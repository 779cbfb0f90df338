"""The user-facing batch: validation, bucket padding, and the ``NxS@C`` batch notation.

A :class:`Batch` is validated eagerly (before anything is traced): token counts must be
finite non-negative integers, the arrays must have one length, and NaN is an error.
``pad_to(bucket)`` gives the :class:`~jkernel.step.BatchArrays` the step function takes;
zero-padding never changes a price (D32).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .step import BatchArrays

__all__ = ["Request", "Batch", "DEFAULT_BUCKETS", "bucket_for", "parse_batch_spec"]

#: Request-count buckets: a batch of n requests is padded to the smallest bucket ≥ n, so a
#: simulation compiles at most one program per bucket. Beyond the last bucket, to a multiple
#: of it.
DEFAULT_BUCKETS = (16, 64, 256, 1024, 4096)


def bucket_for(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    for b in buckets:
        if n <= b:
            return b
    top = buckets[-1]
    return top * math.ceil(n / top)


@dataclass(frozen=True)
class Request:
    """One request scheduled this step (step.md §1.1): tokens run now and tokens cached."""

    scheduled: int
    computed: int
    prompt_len: int = 0
    cached_tokens: int = 0


def _int_array(name: str, values, n: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{name} holds NaN or infinite values")
        if not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold whole token counts, got {arr[arr != np.round(arr)][:3]}")
    elif arr.size and arr.dtype.kind not in "iub":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must be ≥ 0, got {int(arr.min())}")
    if arr.size and arr.max() >= 2 ** 31:
        raise ValueError(f"{name} exceeds 2^31 tokens")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries but scheduled has {n}")
    return arr.astype(np.int32)


def _int_scalar(name: str, value) -> int:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    f = float(value)
    if not math.isfinite(f) or f != int(f):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(f)


class Batch:
    """One step's requests: ``scheduled[i]`` tokens run now, ``computed[i]`` already cached.

    Args:
      scheduled, computed: sequences of ints of one length ``n`` (tokens).
      prompt_len: carried, not read by any formula (default ``computed + scheduled``).
      decode_threshold: a request with ``scheduled > decode_threshold`` is a prefill
        (default 1, vLLM's; D27).
      sm_budget: SMs available this step (0 = all).
      pad_tokens: data-parallel lockstep pad tokens (negative counts as 0).
    """

    __slots__ = ("scheduled", "computed", "prompt_len", "decode_threshold", "sm_budget",
                 "pad_tokens")

    def __init__(self, scheduled=(), computed=None, prompt_len=None, *,
                 decode_threshold: int = 1, sm_budget: int = 0, pad_tokens: int = 0):
        self.scheduled = _int_array("scheduled", scheduled)
        n = self.scheduled.shape[0]
        self.computed = (np.zeros(n, np.int32) if computed is None
                         else _int_array("computed", computed, n))
        self.prompt_len = (self.scheduled + self.computed if prompt_len is None
                           else _int_array("prompt_len", prompt_len, n))
        self.decode_threshold = _int_scalar("decode_threshold", decode_threshold)
        self.sm_budget = _int_scalar("sm_budget", sm_budget)
        if self.sm_budget < 0:
            raise ValueError(f"sm_budget must be ≥ 0, got {self.sm_budget}")
        self.pad_tokens = max(_int_scalar("pad_tokens", pad_tokens), 0)   # D27

    @classmethod
    def of(cls, requests: Sequence[Request | tuple], **kw) -> "Batch":
        """From :class:`Request` objects or ``(scheduled, computed[, prompt_len])`` tuples."""
        rows = [(r.scheduled, r.computed, r.prompt_len or r.scheduled + r.computed)
                if isinstance(r, Request) else
                (r[0], r[1], r[2] if len(r) > 2 else r[0] + r[1]) for r in requests]
        if not rows:
            return cls((), (), (), **kw)
        s, c, p = zip(*rows)
        return cls(s, c, p, **kw)

    @classmethod
    def from_spec(cls, spec: str, **kw) -> "Batch":
        """From the ``NxS@C[,NxS@C…]`` notation (see :func:`parse_batch_spec`)."""
        s, c = parse_batch_spec(spec)
        return cls(s, c, **kw)

    def __len__(self) -> int:
        return int(self.scheduled.shape[0])

    def tokens(self) -> int:
        return int(self.scheduled.sum())

    def __repr__(self) -> str:
        return (f"Batch({len(self)} requests, {self.tokens()} tokens, decode_threshold="
                f"{self.decode_threshold}, sm_budget={self.sm_budget}, "
                f"pad_tokens={self.pad_tokens})")

    def pad_to(self, size: int) -> BatchArrays:
        """Zero-padded numpy :class:`BatchArrays` of ``size`` requests."""
        n = len(self)
        if size < n:
            raise ValueError(f"bucket {size} is smaller than the batch ({n} requests)")
        pad = size - n
        z = lambda a: np.pad(a, (0, pad))  # noqa: E731
        return BatchArrays(z(self.scheduled), z(self.computed),
                           np.pad(np.ones(n, bool), (0, pad)),
                           np.int32(self.decode_threshold), np.int32(self.sm_budget),
                           np.int32(self.pad_tokens))


_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*@\s*(\d+)\s*$")


def parse_batch_spec(spec: str) -> tuple[list[int], list[int]]:
    """Parse ``"32x1@4096,1x2048@0"``: N requests of S scheduled tokens at C computed tokens.

    Returns ``(scheduled, computed)`` lists. An empty string is an empty batch.
    """
    scheduled: list[int] = []
    computed: list[int] = []
    if not spec.strip():
        return scheduled, computed
    for part in spec.split(","):
        m = _SPEC.match(part)
        if not m:
            raise ValueError(f"batch term {part.strip()!r} is not NxS@C (N requests of S "
                             "scheduled tokens at C cached tokens), e.g. 32x1@4096")
        n, s, c = (int(x) for x in m.groups())
        scheduled += [s] * n
        computed += [c] * n
    return scheduled, computed
