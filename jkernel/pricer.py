"""``StepPricer``: the single step for a simulator that prices one batch after another.

``Kernel.pricer()`` returns one. Per thread and request bucket it keeps one 64-byte-aligned
int32 buffer holding the packed step input (:func:`jkernel.programs.packed_batch`'s
layout) that the step program reads in place (on a CPU device, through a JAX array that
aliases the buffer, so a call converts no argument). Each call writes the batch's token
counts into it, zeroes only the rows the previous batch of that bucket used beyond this
one, runs the kernel's compiled single-step program and returns one figure: no validation
beyond the sign check the program makes in the same pass, no :class:`~jkernel.StepEstimate`
object. The figures are the packed program's for a freshly packed input, to the bit.
See docs/simulator.md.

``Kernel.step_time`` runs through the same kind of buffers (its own, one set per thread),
after validating its arguments.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from .batch import bucket_for
from .bulk import aligned_empty, raise_negative
from .programs import PACKED_FIELDS, packed_batch
from .validate import ArgumentError

__all__ = ["StepPricer", "PRICED_FIGURES"]

#: The figures a pricer can return (``clock``): the packed step output's but ``bottleneck``.
PRICED_FIGURES = PACKED_FIELDS[:-1]


class _Slot:
    """One bucket's packed input ``(2R + 3,)``: the aligned host buffer, the argument the
    program is called with (a JAX array aliasing the buffer where the device reads host
    memory in place, else the buffer itself), and how many request rows may be non-zero."""

    __slots__ = ("packed", "arg", "used", "size")

    def __init__(self, size: int):
        self.size = size
        self.packed = packed = aligned_empty((2 * size + 3,), np.int32)
        packed[:] = 0
        self.used = 0
        self.arg = _aliasing(packed)

    def load(self, scheduled, computed, n: int) -> np.ndarray:
        """Write ``n`` requests' counts and zero the rows a longer earlier batch left; the
        buffer (its three scalars are the caller's to write)."""
        packed, size, used = self.packed, self.size, self.used
        if n > used:            # counted before writing: a failed write leaves no stale row
            self.used = n       # that a later, shorter batch would not clear
        packed[:n] = scheduled
        packed[size:size + n] = computed
        if used > n:
            packed[n:used] = 0
            packed[size + n:size + used] = 0
            self.used = n
        return packed


def _aliasing(buf: np.ndarray):
    """A JAX array that reads ``buf``'s memory (CPU: ``device_put(may_alias=True)`` of an
    aligned buffer is zero-copy), checked by its address and by writing through the buffer;
    ``buf`` itself when the device copies (an accelerator), so each call moves it."""
    try:
        arr = jax.device_put(buf, may_alias=True)
        if arr.unsafe_buffer_pointer() != buf.ctypes.data:
            return buf
        old = int(buf[-1])
        buf[-1] = old + 1
        seen = int(np.asarray(arr)[-1]) == old + 1
        buf[-1] = old
        return arr if seen else buf
    except Exception:                     # a backend without host aliasing: copy per call
        return buf


class PerThreadBuffers(threading.local):
    """Reused input buffers, one set per thread: ``slots`` by bucket size."""

    def __init__(self):
        self.slots: dict[int, _Slot] = {}


def _slot(state: PerThreadBuffers, n: int, buckets) -> _Slot:
    size = bucket_for(n, buckets)
    slot = state.slots.get(size)
    if slot is None:
        slot = state.slots[size] = _Slot(size)
    return slot


def packed_call(step, flat, buckets, state: PerThreadBuffers, s: np.ndarray, c: np.ndarray,
                scal: tuple) -> list:
    """Price validated int32 ``s``, ``c`` and the three step scalars with the packed step
    program ``step`` at the flat parameters ``flat``, through ``state``'s buffer of their
    bucket (of ``buckets``): the packed figures and, last, the program's count of negative
    entries, as a list of Python floats (the caller raises for a negative count)."""
    slot = _slot(state, s.shape[0], buckets)
    packed = slot.load(s, c, s.shape[0])
    end = 2 * slot.size
    packed[end], packed[end + 1], packed[end + 2] = scal
    return step(flat, slot.arg).tolist()


class StepPricer:
    """Prices single steps of one kernel into reused buffers (build it with
    :meth:`jkernel.Kernel.pricer`). ``pricer(scheduled, computed, pad_tokens=0)`` returns
    the ``clock`` figure in seconds, ``pricer.figures(...)`` all of them.

    May be shared between threads: each thread writes its own buffers.

    Args (of :meth:`Kernel.pricer`):
      clock: the figure a call returns, one of :data:`PRICED_FIGURES` (default
        ``expected_s``; ``no_overlap_s`` for parity with the reference kernel).
      decode_threshold, sm_budget: the step scalars, fixed for the pricer and checked as
        ``Batch`` checks them (default: the kernel's settings' decode threshold, all SMs).

    Attributes: ``clock``, ``decode_threshold``, ``sm_budget``.
    """

    def __init__(self, step, flat, buckets, clock: str = "expected_s",
                 decode_threshold: int = 1, sm_budget: int = 0):
        """``step``: the kernel's packed single-step program, ``flat``: its parameters as
        the program reads them, ``buckets``: its request buckets (what
        :meth:`jkernel.Kernel.pricer` passes)."""
        from . import validate as _v

        if not isinstance(clock, str) or clock not in PRICED_FIGURES:
            raise ArgumentError("clock", f"{clock!r} is not a priced figure; allowed: "
                                f"{', '.join(PRICED_FIGURES)}")
        self.decode_threshold, self.sm_budget, _ = _v.step_scalars(decode_threshold,
                                                                   sm_budget, 0)
        self.clock = clock
        self._col = PACKED_FIELDS.index(clock)
        self._buckets = buckets
        self._run = step
        self._flat = flat
        self._state = PerThreadBuffers()

    def _priced(self, scheduled, computed, pad_tokens) -> list:
        """The packed program's output row (the figures, then the negative count)."""
        n = len(scheduled)
        if len(computed) != n:
            raise ArgumentError("computed", f"must have {n} entries like scheduled, got "
                                f"{len(computed)}")
        slot = _slot(self._state, n, self._buckets)
        packed = slot.load(scheduled, computed, n)
        end = 2 * slot.size
        packed[end] = self.decode_threshold
        packed[end + 1] = self.sm_budget
        packed[end + 2] = pad_tokens
        vals = self._run(self._flat, slot.arg).tolist()
        if vals[-1]:
            b = packed_batch(packed)
            raise_negative((b.scheduled[None], b.computed[None]), 0, 1)
        return vals

    def figures(self, scheduled, computed, pad_tokens: int = 0) -> list:
        """The step's figures in :data:`~jkernel.programs.PACKED_FIELDS` order (Python
        floats, ``bottleneck`` as a float).

        ``scheduled``, ``computed``: ``n`` whole token counts each (lists of ints or int32
        arrays); only their lengths and signs are checked (the sign by the program, in the
        same pass): a float is truncated and a value beyond int32 is numpy's to refuse or
        wrap. ``pad_tokens``: the data-parallel lockstep pad (an int; negative counts as 0).
        Raises :class:`~jkernel.ArgumentError` for unequal lengths or a negative count."""
        return self._priced(scheduled, computed, pad_tokens)[:-1]

    def __call__(self, scheduled, computed, pad_tokens: int = 0) -> float:
        """The step's ``clock`` figure (seconds) for ``n`` requests (see :meth:`figures`)."""
        return self._priced(scheduled, computed, pad_tokens)[self._col]
