"""Bulk pricing: many batches through one compiled program, in bounded chunks.

``Kernel.price_many`` and ``price_sweep`` validate their batches with :func:`many_inputs` and
run the kernel's batched program over them with :func:`chunked`, which bounds memory by the
chunk, keeps a second core busy with a second chunk (one device), or splits each chunk over
every local device along the batch axis (several), and on CPU lets XLA read the caller's
arrays in place: a 64-byte aligned chunk as it is, an unaligned one through a view from the
boundary below it (:func:`view_from_boundary`), the rest copied once into reused aligned
buffers (:class:`Staging`). See docs/bulk.md.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from . import validate as _v
from .batch import Batch, bucket_for
from .validate import ArgumentError

__all__ = ["ALIGN", "WORKERS", "aligned_empty", "view_from_boundary", "in_place", "Staging",
           "raise_negative", "many_inputs", "chunked"]


#: XLA's CPU runtime reads a host array in place (no copy) when it starts on a 64-byte
#: boundary; numpy's allocations are 16-byte aligned, so most callers' arrays are copied.
ALIGN = 64

#: Threads pricing chunks of batches side by side (one per core, at most 4).
WORKERS = max(1, min(4, os.cpu_count() or 1))


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array starting on a :data:`ALIGN`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def view_from_boundary(x: np.ndarray) -> tuple[np.ndarray, int] | None:
    """``x`` (C-contiguous) as the tail of a flat view that starts at the 64-byte boundary
    at or below its first byte: ``(view, offset)`` with ``view[offset:]`` = ``x.ravel()``,
    so XLA's CPU runtime reads it in place and the program skips the first ``offset``
    elements. Only bytes of the page holding ``x``'s first byte are added (a page is a
    whole number of 64-byte blocks), so nothing unmapped is touched; nothing is written.
    None when ``x`` does not start on a multiple of its item size."""
    head = x.ctypes.data % ALIGN
    if head % x.itemsize or not x.flags.c_contiguous:
        return None
    off = head // x.itemsize
    raw = (ctypes.c_char * ((x.size + off) * x.itemsize)).from_address(x.ctypes.data - head)
    return np.frombuffer(raw, x.dtype), off


def in_place(x: np.ndarray) -> bool:
    """Whether XLA's CPU runtime can read ``x`` without copying it."""
    return x.flags.c_contiguous and x.ctypes.data % ALIGN == 0


class Staging:
    """Reusable aligned host buffers for the bulk path's chunks that XLA cannot read in
    place (unaligned, or the short last chunk): one copy into memory that is already
    mapped (a fresh buffer per chunk would page-fault through every chunk). A buffer is
    held by one chunk from its fill until its result has been read back (the program reads
    its inputs in place), then returned; at most ``keep`` buffers stay cached."""

    def __init__(self, keep: int = 3 * WORKERS):
        self._free: list = []
        self._lock = threading.Lock()
        self._keep = keep

    def take(self, shape: tuple, dtype) -> np.ndarray:
        """A buffer of ``shape`` and ``dtype``, reused when a free one matches."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.shape == shape and buf.dtype == dtype:
                    return self._free.pop(i)
        return aligned_empty(shape, dtype)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.insert(0, buf)
            del self._free[self._keep:]


_STAGING = Staging()


def raise_negative(arrays, start: int, size: int) -> None:
    """Raise :class:`~jkernel.ArgumentError` for the negative token count a pricing
    program found in rows ``start:start + size`` of ``arrays`` (``scheduled``,
    ``computed``, …), naming the array and the value (read again on the host only on this
    error path)."""
    for name, x in zip(("scheduled", "computed"), arrays[:2]):
        low = int(x[start:start + size].min())
        if low < 0:
            raise ArgumentError(name, f"must be ≥ 0, got {low}")
    raise ArgumentError("scheduled", "must be ≥ 0")          # unreachable: one was negative




def many_inputs(batches, scheduled, computed, decode_threshold, sm_budget, pad_tokens, *,
                buckets: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate many batches (``price_many`` / ``price_sweep``'s arguments): int32
    ``scheduled`` and ``computed`` ``(B, R)`` (the caller's arrays when they are already
    int32 and contiguous; a list of :class:`~jkernel.Batch` is padded to its bucket among
    ``buckets``, in aligned arrays) and the scalars ``(B, 3)``: decode_threshold, sm_budget,
    pad_tokens. Raises :class:`~jkernel.ArgumentError` naming the argument."""
    if batches is not None:
        if scheduled is not None or computed is not None:
            raise ArgumentError("batches", "give either batches or scheduled/computed "
                                "arrays, not both")
        batches = list(batches)
        for j, b in enumerate(batches):
            if not isinstance(b, Batch):
                raise ArgumentError(f"batches[{j}]", f"must be a jkernel.Batch, not "
                                    f"{type(b).__name__}")
        width = bucket_for(max((len(b) for b in batches), default=1), buckets)
        s, c = (aligned_empty((len(batches), width), np.int32) for _ in "sc")
        scal = aligned_empty((len(batches), 3), np.int32)
        for x in (s, c, scal):
            x[...] = 0
        for j, b in enumerate(batches):
            s[j, :len(b)] = b.scheduled
            c[j, :len(b)] = b.computed
            scal[j] = (b.decode_threshold, b.sm_budget, b.pad_tokens)
        return s, c, scal
    if scheduled is None:
        raise ArgumentError("scheduled", "price_many needs batches or a scheduled array")
    s = _v.tokens_matrix("scheduled", scheduled)
    c = np.zeros_like(s) if computed is None else _v.tokens_matrix("computed", computed)
    if c.shape != s.shape:
        raise ArgumentError("computed", f"must have the shape of scheduled {s.shape} "
                            f"(batches, requests), got {c.shape}")
    nb = s.shape[0]
    scal = aligned_empty((nb, 3), np.int32)          # read in place by the program
    scal[:, 0] = _v.scalar_column("decode_threshold", decode_threshold, nb)
    scal[:, 1] = _v.scalar_column("sm_budget", sm_budget, nb)
    scal[:, 2] = _v.scalar_column("pad_tokens", pad_tokens, nb, lo=None)
    return s, c, scal


def chunked(fn, arrays: tuple[np.ndarray, ...], chunk: int, *, columns: int, axis: int = 0,
            sets: int = 0, at=None) -> np.ndarray:
    """Run ``fn`` over row chunks of ``arrays`` (the last one padded with empty batches so
    every chunk runs one program) and join its ``rows`` along ``axis``.

    ``arrays``: ``scheduled``, ``computed`` ``(B, R)`` and the scalars ``(B, 3)`` (as
    :func:`many_inputs` gives them); ``fn(*chunk_arrays)`` returns ``(rows, negative)``,
    ``rows`` with the batch axis at ``axis`` and ``columns`` figures last, ``negative``
    the count of negative request entries per batch (any one raises
    :func:`raise_negative`). ``sets``: the leading parameter-set axis of a sweep's rows (0:
    none); zero batches give empty rows of that shape.

    One device: up to :data:`WORKERS` chunks at a time, as XLA runs each program on the
    calling thread and releases the GIL, so each thread keeps a core busy. Several devices: each
    chunk is split over all of them along the batch axis (``jax.sharding``), one chunk at a
    time. On one CPU device, a whole chunk of ``scheduled``/``computed`` that is not 64-byte
    aligned is read in place through a view from the boundary below it (``at(offsets)``
    gives the program that skips the offsets) instead of being copied; the rest is staged
    in reused aligned buffers."""
    n = arrays[0].shape[0]
    chunk = _v.chunk(chunk)
    if n == 0:
        empty = np.zeros((0, columns))
        return empty if not sets else np.zeros((sets, 0, columns))
    devices = jax.local_devices()
    if jax.config.jax_default_device is not None:     # `with jax.default_device(d)`
        devices = [jax.config.jax_default_device]
    size = min(chunk, n)
    on_cpu = getattr(devices[0], "platform", devices[0]) == "cpu"   # else: copied anyway
    put = functools.partial(jax.device_put, may_alias=True)
    if len(devices) > 1:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        nd = len(devices)
        size = -(-size // nd) * nd
        sharding = NamedSharding(Mesh(np.asarray(devices), ("batches",)),
                                 PartitionSpec("batches"))
        put = functools.partial(jax.device_put, device=sharding, may_alias=True)

    def run(start: int) -> np.ndarray:
        parts = [x[start:start + size] for x in arrays]
        rows_in = parts[0].shape[0]
        short = size - rows_in
        staged = []
        call = fn
        if at is not None and on_cpu and len(devices) == 1 and not short and not all(
                in_place(x) for x in parts[:2]):
            views = [(x, 0) if in_place(x) else view_from_boundary(x)
                     for x in parts[:2]]
            if all(v is not None for v in views):
                parts[0], parts[1] = (v[0].reshape(-1) for v in views)
                call = at((views[0][1], views[1][1]))
        for j, x in enumerate(parts):
            if short or (on_cpu and not in_place(x)):
                buf = _STAGING.take((size,) + x.shape[1:], x.dtype)
                buf[:rows_in] = x
                if short:
                    buf[rows_in:] = 0
                parts[j] = buf
                staged.append(buf)
        try:
            rows, negative = call(*(put(x) for x in parts))
            if np.asarray(negative).any():
                raise_negative(arrays, start, size)
            out = np.asarray(rows)
            if short:
                out = out.take(np.arange(rows_in), axis=axis)
        finally:
            for buf in staged:
                _STAGING.give(buf)
        return out

    starts = range(0, n, size)
    workers = 1 if len(devices) > 1 else min(len(starts), WORKERS)
    if workers <= 1:
        outs = [run(i) for i in starts]
    else:
        with ThreadPoolExecutor(workers) as pool:
            outs = list(pool.map(run, starts))
    return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=axis)
