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

from .stages import BatchArrays
from .limits import MAX_BATCH_REQUESTS
from .validate import ArgumentError, step_scalars, tokens_array

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


class Batch:
    """One step's requests: ``scheduled[i]`` tokens run now, ``computed[i]`` already cached.

    Args:
      scheduled, computed: sequences of ints of one length ``n`` (tokens). An int32 numpy
        array is kept as it is, not copied (do not change it while the batch is in use).
      prompt_len: carried, not read by any formula (default ``computed + scheduled``).
      decode_threshold: a request with ``scheduled > decode_threshold`` is a prefill
        (default 1, vLLM's; D27).
      sm_budget: SMs available this step (0 = all).
      pad_tokens: data-parallel lockstep pad tokens (negative counts as 0).
    """

    __slots__ = ("scheduled", "computed", "_prompt_len", "decode_threshold", "sm_budget",
                 "pad_tokens")

    def __init__(self, scheduled=(), computed=None, prompt_len=None, *,
                 decode_threshold: int = 1, sm_budget: int = 0, pad_tokens: int = 0):
        # Checks live in jkernel.validate (shared with price_many and the CLI); an int32
        # numpy array is taken as it is, after one sign check (the simulator's fast path).
        self.scheduled = s = tokens_array("scheduled", scheduled)
        n = s.shape[0]
        self.computed = (np.zeros(n, np.int32) if computed is None
                         else tokens_array("computed", computed, n))
        self._prompt_len = (None if prompt_len is None
                           else tokens_array("prompt_len", prompt_len, n))
        self.decode_threshold, self.sm_budget, self.pad_tokens = step_scalars(
            decode_threshold, sm_budget, pad_tokens)                     # pad < 0 → 0: D27

    @property
    def prompt_len(self) -> np.ndarray:
        """Carried, not read by any formula; ``scheduled + computed`` unless given."""
        if self._prompt_len is None:
            self._prompt_len = self.scheduled + self.computed
        return self._prompt_len

    @classmethod
    def of(cls, requests: Sequence[Request | tuple], **kw) -> "Batch":
        """From :class:`Request` objects or ``(scheduled, computed[, prompt_len])`` tuples."""
        if isinstance(requests, (str, bytes)) or not isinstance(requests,
                                                                 (Sequence, np.ndarray)):
            raise ArgumentError("requests", f"must be a sequence of jkernel.Request or "
                                f"(scheduled, computed[, prompt_len]) tuples, got {requests!r}")
        rows = []
        for i, r in enumerate(requests):
            if isinstance(r, Request):
                rows.append((r.scheduled, r.computed, r.prompt_len or None))
            elif (isinstance(r, (Sequence, np.ndarray)) and not isinstance(r, (str, bytes))
                  and np.ndim(r) == 1 and len(r) in (2, 3)):
                rows.append((r[0], r[1], r[2] if len(r) > 2 else None))
            else:
                raise ArgumentError(f"requests[{i}]", f"must be a jkernel.Request or a "
                                    f"(scheduled, computed[, prompt_len]) tuple, got {r!r}")
        if not rows:
            return cls((), (), (), **kw)
        s, c, p = zip(*rows)
        if any(x is None for x in p):             # prompt_len unstated: scheduled + computed
            s_arr = tokens_array("scheduled", s)
            c_arr = tokens_array("computed", c, len(s_arr))
            p = [int(s_arr[i]) + int(c_arr[i]) if x is None else x for i, x in enumerate(p)]
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
        out = np.zeros((3, size), np.int32)
        out[0, :n] = self.scheduled
        out[1, :n] = self.computed
        out[2, :n] = 1
        return BatchArrays(out[0], out[1], out[2].astype(bool),
                           np.int32(self.decode_threshold), np.int32(self.sm_budget),
                           np.int32(self.pad_tokens))


#: The most requests one ``NxS@C`` spec may describe (a guard against a typo's 10¹⁰).
MAX_SPEC_REQUESTS = MAX_BATCH_REQUESTS

_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*@\s*(\d+)\s*$")


def parse_batch_spec(spec: str) -> tuple[list[int], list[int]]:
    """Parse ``"32x1@4096,1x2048@0"``: N requests of S scheduled tokens at C computed tokens.

    Returns ``(scheduled, computed)`` lists. An empty string is an empty batch.
    """
    scheduled: list[int] = []
    computed: list[int] = []
    if not spec.strip():
        return scheduled, computed
    terms = []
    for part in spec.split(","):
        m = _SPEC.match(part)
        if not m:
            raise ArgumentError("batch", f"term {part.strip()!r} is not NxS@C (N requests of "
                                "S scheduled tokens at C cached tokens), e.g. 32x1@4096")
        terms.append(tuple(int(x) for x in m.groups()))
    total = sum(n for n, _, _ in terms)
    if total > MAX_SPEC_REQUESTS:
        raise ArgumentError("batch", f"{total:,} requests; a step holds at most "
                            f"{MAX_SPEC_REQUESTS:,} here (vLLM's max_num_seqs is far lower)")
    for n, s, c in terms:
        scheduled += [s] * n
        computed += [c] * n
    return scheduled, computed
