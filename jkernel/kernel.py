"""``Kernel``: what a simulator holds for one pool, and the entry points that build one.

``open(bundle)`` builds the colocated pool's kernel, ``open_pool(bundle, role)`` one pool of a
disaggregated deployment, ``open_inputs(bundle)`` loads the documents without building.
A kernel is immutable: every method is a pure function of its arguments.

Speed: ``step_time`` runs one jitted program per request bucket, fed with the params packed
into one array and the batch into two, so a call costs a few microseconds of dispatch;
``price_many`` runs the same step function over a whole chunk of batches at once
(the batch axis is a vector axis of every operation), in bounded chunks.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import memory as _memory
from . import overheads as _overheads
from .batch import DEFAULT_BUCKETS, Batch, bucket_for
from .catalog import Repos
from .documents.coefficients import EVIDENCED
from .errors import Refusal
from .params import Params
from .programs import PACKED_FIELDS, estimate_of, estimates_of, packed_batch, programs
from .resolve import Inputs, Resolved, open_inputs as _open_inputs, resolve
from .stages import BatchArrays, StepOptions
from .step import StepEstimate
from . import validate as _v
from .validate import ArgumentError

__all__ = ["Kernel", "open", "open_pool", "open_inputs", "new", "enable_x64",
           "enable_compilation_cache", "default_cache_dir", "ArgumentError"]

#: Threads pricing chunks of batches side by side in ``price_many`` (one per core, at most 4).
_WORKERS = max(1, min(4, os.cpu_count() or 1))


def enable_x64() -> None:
    """Turn on float64 in JAX (the spec's arithmetic). Called by the entry points."""
    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)


def default_cache_dir() -> str | None:
    """Where compiled step programs persist: ``$JKERNEL_CACHE_DIR`` (``0`` turns the cache
    off: None), else the user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``)
    ``/jkernel/xla``."""
    env = (os.environ.get("JKERNEL_CACHE_DIR") or "").strip()
    if env == "0":
        return None
    if env:
        return os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jkernel", "xla")


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Persist compiled step programs across processes in ``path`` (default
    :func:`default_cache_dir`), so a second run of a command compiles nothing. Returns the
    directory used, or None when ``JKERNEL_CACHE_DIR=0`` turns the cache off (or the
    directory cannot be made, which only costs compile time)."""
    path = str(path) if path is not None else default_cache_dir()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge._backends)
    except Exception:          # private API moved: assume started, change nothing
        return True


_ENTERED = False


def _entry() -> None:
    """What every entry point sets before JAX is first used (never at import).

    * float64 (the spec's arithmetic);
    * synchronous dispatch on CPU: a step is a few microseconds of work, and JAX's
      asynchronous CPU dispatch adds ~40 µs per call around it. It takes effect only if JAX's
      CPU backend has not started yet (let jkernel open a kernel first for the fastest
      ``step_time``); ``JKERNEL_CPU_ASYNC_DISPATCH=1`` keeps JAX's default;
    * one intra-op thread in XLA's CPU client (``PJRT_NPROC=1``, read when the client
      starts, unless the caller set it): a step is too small to gain from a second thread,
      and XLA splitting it over two cost 2–3 × (see benchmarks/RESULTS.md); ``price_many``
      keeps the cores busy with a thread per chunk instead. ``JKERNEL_CPU_THREADS=N`` asks
      for N;
    * the persistent compilation cache in :func:`default_cache_dir` (on by default,
      ``JKERNEL_CACHE_DIR=0`` turns it off), unless the caller configured JAX's own.
    """
    global _ENTERED
    enable_x64()
    if _ENTERED:
        return
    _ENTERED = True
    if not _backend_started():
        if os.environ.get("JKERNEL_CPU_ASYNC_DISPATCH", "0") != "1":
            jax.config.update("jax_cpu_enable_async_dispatch", False)
        threads = os.environ.get("JKERNEL_CPU_THREADS", "1")
        if "PJRT_NPROC" not in os.environ and threads.strip() not in ("", "0"):
            os.environ["PJRT_NPROC"] = threads.strip()
    if not jax.config.jax_compilation_cache_dir:
        enable_compilation_cache()


#: XLA's CPU runtime reads a host array in place (no copy) when it starts on a 64-byte
#: boundary; numpy's allocations are 16-byte aligned, so most callers' arrays are copied.
_ALIGN = 64


def _aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array starting on a :data:`_ALIGN`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = -raw.ctypes.data % _ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def _view_from_boundary(x: np.ndarray) -> tuple[np.ndarray, int] | None:
    """``x`` (C-contiguous) as the tail of a flat view that starts at the 64-byte boundary
    at or below its first byte: ``(view, offset)`` with ``view[offset:]`` = ``x.ravel()``,
    so XLA's CPU runtime reads it in place and the program skips the first ``offset``
    elements. Only bytes of the page holding ``x``'s first byte are added (a page is a
    whole number of 64-byte blocks), so nothing unmapped is touched; nothing is written.
    None when ``x`` does not start on a multiple of its item size."""
    head = x.ctypes.data % _ALIGN
    if head % x.itemsize or not x.flags.c_contiguous:
        return None
    off = head // x.itemsize
    raw = (ctypes.c_char * ((x.size + off) * x.itemsize)).from_address(x.ctypes.data - head)
    return np.frombuffer(raw, x.dtype), off


def _in_place(x: np.ndarray) -> bool:
    """Whether XLA's CPU runtime can read ``x`` without copying it."""
    return x.flags.c_contiguous and x.ctypes.data % _ALIGN == 0


class _Staging:
    """Reusable aligned host buffers for the bulk path's chunks that XLA cannot read in
    place (unaligned, or the short last chunk): one copy into memory that is already
    mapped (a fresh buffer per chunk would page-fault through every chunk). A buffer is
    held by one chunk from its
    fill until its result has been read back (the program reads its inputs in place), then
    returned; at most ``keep`` buffers stay cached."""

    def __init__(self, keep: int = 3 * _WORKERS):
        self._free: list = []
        self._lock = threading.Lock()
        self._keep = keep

    def take(self, shape: tuple, dtype) -> np.ndarray:
        """A buffer of ``shape`` and ``dtype``, reused when a free one matches."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.shape == shape and buf.dtype == dtype:
                    return self._free.pop(i)
        return _aligned_empty(shape, dtype)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.insert(0, buf)
            del self._free[self._keep:]


_STAGING = _Staging()


def _negative_input(arrays, start: int, size: int) -> None:
    """Raise for the negative token count the pricing program found in rows
    ``start:start + size`` (read again on the host only on this error path)."""
    for name, x in zip(("scheduled", "computed"), arrays[:2]):
        low = int(x[start:start + size].min())
        if low < 0:
            raise ArgumentError(name, f"must be ≥ 0, got {low}")
    raise ArgumentError("scheduled", "must be ≥ 0")          # unreachable: one was negative


class Kernel:
    """One pool's cost model. Build it with :func:`open` / :func:`open_pool` / :func:`new`.

    Attributes:
      plan: the static :class:`~jkernel.plan.Plan` (hashable; jit treats it as static).
      params: the :class:`~jkernel.params.Params` pytree the kernel prices with (SI units).
      step_fn: the pure function ``step_fn(params, batch_arrays) -> StepEstimate``.
      inputs: the documents the kernel was built from (``inputs.chip`` for the memory size).
      settings: the engine settings the kernel used (block size, scheduler limits…).
    """

    def __init__(self, resolved: Resolved, *, options: StepOptions = StepOptions(),
                 buckets: Sequence[int] = DEFAULT_BUCKETS, params: Params | None = None):
        self._r = resolved
        self.plan = resolved.plan
        self.options = options
        self.buckets = tuple(sorted(buckets))
        self.params = resolved.params if params is None else params
        if set(self.params) != set(resolved.params):
            raise ValueError("params must have exactly the kernel's names: "
                             f"{sorted(resolved.params)}")
        self._c = programs(self.plan, options, tuple(self.params))
        self.step_fn = self._c.step_fn
        self._flat = jnp.stack([jnp.asarray(v) for v in self.params.values()])

    # -- construction helpers -----------------------------------------------------------
    def with_params(self, params: Params) -> "Kernel":
        """A kernel that prices with ``params`` (same names); shares compiled programs."""
        return Kernel(self._r, options=self.options, buckets=self.buckets, params=params)

    def with_options(self, options: StepOptions) -> "Kernel":
        return Kernel(self._r, options=options, buckets=self.buckets, params=self.params)

    @property
    def inputs(self) -> Inputs:
        return self._r.inputs

    @property
    def settings(self) -> dict:
        return dict(self._r.settings)

    @property
    def trace_count(self) -> int:
        """How many times the packed step programs were traced (a recompilation guard)."""
        return self._c.traces

    # -- the step ---------------------------------------------------------------------------
    def batch_arrays(self, batch: Batch, bucket: int | None = None) -> BatchArrays:
        """``batch`` padded to its bucket as :class:`BatchArrays` for ``step_fn``: numpy
        arrays (``jit``, ``grad`` and the unjitted ``step_fn`` take them as they are; a
        jitted call moves them in the same step as its other arguments, where one eager
        ``jnp.asarray`` per field cost ~60 µs each)."""
        size = bucket if bucket is not None else bucket_for(len(batch), self.buckets)
        return batch.pad_to(size)

    def _pack(self, batch: Batch | None, scheduled, computed, decode_threshold, sm_budget,
              pad_tokens, sign: bool = True) -> np.ndarray:
        """The int32 ``(2R + 3,)`` input of the packed step program (validated; with
        ``sign=False`` the sign of int32 arrays is left to the program's count)."""
        if batch is not None:
            if scheduled is not None or computed is not None:
                raise ArgumentError("batch", "give a Batch or scheduled/computed arrays, "
                                    "not both")
            if not isinstance(batch, Batch):
                raise ArgumentError("batch", f"must be a jkernel.Batch, not "
                                    f"{type(batch).__name__} (or pass scheduled=, computed=)")
            s, c = batch.scheduled, batch.computed
            scal = (batch.decode_threshold, batch.sm_budget, batch.pad_tokens)
        else:
            if scheduled is None:
                raise ArgumentError("scheduled", "step_time needs a Batch or a scheduled "
                                    "array")
            s = _v.tokens_array("scheduled", scheduled, sign=sign)
            c = (np.zeros(s.shape[0], np.int32) if computed is None
                 else _v.tokens_array("computed", computed, s.shape[0], sign=sign))
            scal = _v.step_scalars(decode_threshold, sm_budget, pad_tokens)
        n = s.shape[0]
        size = bucket_for(n, self.buckets)
        packed = np.zeros(2 * size + 3, np.int32)
        packed[:n] = s
        packed[size:size + n] = c
        end = 2 * size
        packed[end], packed[end + 1], packed[end + 2] = scal
        return packed

    def step_time(self, batch: Batch | None = None, *, scheduled=None, computed=None,
                  decode_threshold: int = 1, sm_budget: int = 0, pad_tokens: int = 0
                  ) -> StepEstimate:
        """Price one step (jitted; one program per bucket). Fields are Python floats.

        Either a :class:`Batch`, or its arrays directly (``scheduled``, ``computed``: ``(n,)``
        token counts; int32 numpy arrays are read without a copy) and its scalars, checked
        as ``Batch`` checks them — the cheapest call for a simulator.
        """
        packed = self._pack(batch, scheduled, computed, decode_threshold, sm_budget,
                            pad_tokens, sign=False)     # the program counts negatives
        vals = self._c.step(self._flat, packed).tolist()
        if vals[-1]:
            b = packed_batch(packed)
            _negative_input((b.scheduled[None], b.computed[None]), 0, 1)
        return estimate_of(vals)

    def gradient(self, batch: Batch | None = None, *, of: str = "expected_s",
                 scheduled=None, computed=None, decode_threshold: int = 1, sm_budget: int = 0,
                 pad_tokens: int = 0) -> tuple[float, Params]:
        """``(value, d value / d params)`` of one step's ``of`` (``expected_s``,
        ``overlap_s``, ``no_overlap_s`` or ``<resource>_s``) at the kernel's params: one
        jitted program. The gradient is a :class:`Params` of numpy float64 scalars (SI
        units per unit of each parameter)."""
        if of not in PACKED_FIELDS[:-1]:
            raise ArgumentError("of", f"{of!r} is not a priced figure; allowed: "
                                f"{', '.join(PACKED_FIELDS[:-1])}")
        packed = self._pack(batch, scheduled, computed, decode_threshold, sm_budget,
                            pad_tokens)
        value, g = self._c.grad(PACKED_FIELDS.index(of))(self._flat, packed)
        g = np.asarray(g)
        return float(value), Params(dict(zip(self._c.names, g)))

    def breakdown(self, batch: Batch):
        """Where ``batch``'s step time goes: a :class:`pandas.DataFrame` of layer kind ×
        named term × resource seconds with each term's share of ``expected_s``
        (:func:`jkernel.breakdown.breakdown_table`; jitted, not on the packed fast path)."""
        from .breakdown import breakdown_table

        if not isinstance(batch, Batch):
            raise TypeError(f"breakdown takes a jkernel.Batch, not {type(batch).__name__}")
        return breakdown_table(self.plan, self._c.jit_step(self.params,
                                                           self.batch_arrays(batch)))

    def warm_up(self, buckets: Sequence[int] | None = None) -> None:
        """Compile the step program for every bucket ahead of time."""
        for size in buckets or self.buckets:
            packed = np.zeros(2 * size + 3, np.int32)
            packed[-3] = 1
            self._c.step(self._flat, packed)

    def price_many(self, batches: Sequence[Batch] | None = None, *, scheduled=None,
                   computed=None, decode_threshold=1, sm_budget=0,
                   pad_tokens=0, chunk: int = 4096, dtype=None) -> StepEstimate:
        """Price many batches with one program, in chunks of ``chunk`` batches.

        Either a list of :class:`Batch`, or arrays ``scheduled`` / ``computed`` of shape
        ``(batches, requests)``, zero-padded; the scalars may be ints or arrays of shape
        ``(batches,)``, checked as ``Batch`` checks them. int32 C-contiguous arrays are not
        copied on the host and their sign is checked in the same pass of the program that
        prices them; on CPU, XLA reads them in place when they are 64-byte aligned (else
        each chunk is copied once into a reused aligned buffer). ``dtype=jnp.float32``
        prices in single precision. With several devices (``jax.local_devices()``), every chunk is split
        over all of them along the batch axis (same results as one device). Memory stays
        bounded by the chunk, however many batches come. Returns a :class:`StepEstimate`
        of numpy arrays of shape ``(batches,)``; zero batches give empty arrays.
        """
        arrays = self._many_inputs(batches, scheduled, computed, decode_threshold, sm_budget,
                                   pad_tokens)
        flat = self._flat if dtype is None else self._flat.astype(dtype)
        return estimates_of(self._chunked(lambda *x: self._c.many(flat, *x), arrays, chunk,
                                        at=lambda o: functools.partial(self._c.at(o, False),
                                                                       flat)))

    def price_sweep(self, params: Sequence[Params] | Params, batches=None, *, scheduled=None,
                    computed=None, decode_threshold=1, sm_budget=0, pad_tokens=0,
                    chunk: int = 4096) -> StepEstimate:
        """Price the same batches under many parameter sets in one call (``vmap`` over the
        params pytree).

        ``params``: a list of :class:`Params` (same names as the kernel's), or one Params
        whose leaves have a leading axis. Batches are given and checked as in
        :meth:`price_many` (and split over the devices likewise). Returns arrays of shape
        ``(param_sets, batches)``.
        """
        if not isinstance(params, Params):
            params = list(params)
            if not params:
                raise ArgumentError("params", "needs at least one parameter set")
            params = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params)
        if tuple(params) != self._c.names:
            raise ArgumentError("params", "must have exactly the kernel's names")
        flat = jnp.stack([jnp.asarray(params[n]) for n in self._c.names], axis=-1)
        if flat.ndim != 2:
            raise ArgumentError("params", "a single Params needs leaves with a leading "
                                "param-set axis (or pass a list of Params)")
        arrays = self._many_inputs(batches, scheduled, computed, decode_threshold, sm_budget,
                                   pad_tokens)
        rows = self._chunked(lambda *x: self._c.sweep(flat, *x), arrays, chunk, axis=1,
                             sets=flat.shape[0],
                             at=lambda o: functools.partial(self._c.at(o, True), flat))
        return estimates_of(rows)

    def _many_inputs(self, batches, scheduled, computed, decode_threshold, sm_budget,
                     pad_tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validate many batches: int32 ``scheduled`` and ``computed`` ``(B, R)`` (the
        caller's arrays when they are already int32 and contiguous) and scalars ``(B, 3)``."""
        if batches is not None:
            if scheduled is not None or computed is not None:
                raise ArgumentError("batches", "give either batches or scheduled/computed "
                                    "arrays, not both")
            batches = list(batches)
            for j, b in enumerate(batches):
                if not isinstance(b, Batch):
                    raise ArgumentError(f"batches[{j}]", f"must be a jkernel.Batch, not "
                                        f"{type(b).__name__}")
            width = bucket_for(max((len(b) for b in batches), default=1), self.buckets)
            s, c = (_aligned_empty((len(batches), width), np.int32) for _ in "sc")
            scal = _aligned_empty((len(batches), 3), np.int32)
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
        scal = _aligned_empty((nb, 3), np.int32)          # read in place by the program
        scal[:, 0] = _v.scalar_column("decode_threshold", decode_threshold, nb)
        scal[:, 1] = _v.scalar_column("sm_budget", sm_budget, nb)
        scal[:, 2] = _v.scalar_column("pad_tokens", pad_tokens, nb, lo=None)
        return s, c, scal

    @staticmethod
    def _chunked(fn, arrays: tuple[np.ndarray, ...], chunk: int, axis: int = 0,
                 sets: int = 0, at=None):
        """Run ``fn`` over row chunks of ``arrays`` (the last one padded with empty batches so
        every chunk runs one program). One device: two chunks at a time, as XLA runs each
        program on the calling thread and releases the GIL, so a second thread keeps a
        second core busy. Several devices: each chunk is split over all of them along the
        batch axis (``jax.sharding``), one chunk at a time. On one CPU device, a whole chunk
        of ``scheduled``/``computed`` that is not 64-byte aligned is read in place through
        a view from the boundary below it (``at(offsets)`` gives the program that skips
        the offsets) instead of being copied."""
        n = arrays[0].shape[0]
        chunk = int(chunk)
        if chunk < 1:
            raise ArgumentError("chunk", f"must be ≥ 1, got {chunk}")
        if n == 0:
            empty = np.zeros((0, len(PACKED_FIELDS)))
            return empty if not sets else np.zeros((sets, 0, len(PACKED_FIELDS)))
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
                    _in_place(x) for x in parts[:2]):
                views = [(x, 0) if _in_place(x) else _view_from_boundary(x)
                         for x in parts[:2]]
                if all(v is not None for v in views):
                    parts[0], parts[1] = (v[0].reshape(-1) for v in views)
                    call = at((views[0][1], views[1][1]))
            for j, x in enumerate(parts):
                if short or (on_cpu and not _in_place(x)):
                    buf = _STAGING.take((size,) + x.shape[1:], x.dtype)
                    buf[:rows_in] = x
                    if short:
                        buf[rows_in:] = 0
                    parts[j] = buf
                    staged.append(buf)
            try:
                rows, negative = call(*(put(x) for x in parts))
                if np.asarray(negative).any():
                    _negative_input(arrays, start, size)
                out = np.asarray(rows)
                if short:
                    out = out.take(np.arange(rows_in), axis=axis)
            finally:
                for buf in staged:
                    _STAGING.give(buf)
            return out

        starts = range(0, n, size)
        workers = 1 if len(devices) > 1 else min(len(starts), _WORKERS)
        if workers <= 1:
            outs = [run(i) for i in starts]
        else:
            with ThreadPoolExecutor(workers) as pool:
                outs = list(pool.map(run, starts))
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=axis)

    # -- memory (memory.md) -----------------------------------------------------------------
    def fixed_bytes(self) -> _memory.MemoryBreakdown:
        return _memory.fixed_bytes(self._r.memory, self.params)

    def sequence_variable_bytes(self, tokens: int) -> int:
        return _memory.sequence_variable_bytes(
            self.plan, self._r.memory, int(tokens),
            dcp_shards_all_kv_layers=self._r.settings["dcp_shards_all_kv_layers"])

    def sequence_fixed_bytes(self) -> int:
        return _memory.sequence_fixed_bytes(self._r.memory)

    def page_bytes(self) -> int:
        """One KV page: ``sequence_variable_bytes(block_size)``."""
        return self.sequence_variable_bytes(self.plan.block_size)

    def kv_bytes_per_token(self) -> float:
        """Whole-model KV bytes per token per rank (kvB, memory.md §1)."""
        return self.plan.kv_bytes_per_token

    def device_memory_bytes(self) -> float:
        """The memory ``gpu_memory_utilization`` multiplies, bytes per rank: the datasheet's
        under the spec's recipe, what CUDA reports as total under the vLLM version rules that
        measure it (:func:`jkernel.memory.device_memory_bytes`)."""
        return _memory.device_memory_bytes(self._r.memory, self.inputs.chip)

    def kv_cache_pages(self) -> int:
        """Pages left for the KV cache per rank (memory.md §5)."""
        return _memory.kv_cache_pages(self.device_memory_bytes(),
                                      self._r.settings["gpu_memory_utilization"],
                                      self.fixed_bytes().total(), self.page_bytes())

    # -- around a step (methods.md) ---------------------------------------------------------
    def admission_overhead(self, prompt_tokens: int) -> float:
        """Host time before a request of ``prompt_tokens`` (whole, ≥ 0) is scheduled, s.

        methods.md prices ``prompt_tokens ≤ 0`` as 0; only 0 reaches that branch here: a
        negative, fractional or NaN count is refused as ``Batch`` refuses it (issue 10)."""
        t = _v.whole("prompt_tokens", prompt_tokens)
        return float(_overheads.admission_overhead(self.params, t))

    def output_token_overhead(self) -> float:
        return float(_overheads.output_token_overhead(self.params))

    def completion_overhead(self) -> float:
        return float(_overheads.completion_overhead(self.params))

    def pd_transfer_time(self, tokens: int, src: _overheads.Placement,
                         dst: _overheads.Placement) -> float:
        """KV transfer of one request to the decode pool (call on the prefill pool, D26).
        ``tokens`` whole and ≥ 0; ``src`` and ``dst`` are :class:`~jkernel.Placement`."""
        t = _v.whole("tokens", tokens)
        for name, p in (("src", src), ("dst", dst)):
            if not isinstance(p, _overheads.Placement):
                raise ArgumentError(name, f"must be a jkernel.Placement, not {p!r}")
        return float(_overheads.pd_transfer_time(
            self.params, t, kv_bytes_per_token=self.plan.kv_bytes_per_token,
            same_node=src.node == dst.node,
            same_rack_domain=self._r.links["rack_domain"] and src.rack == dst.rack,
            floor_name=self._r.settings.get("pd_floor_name")))

    def tier_time(self, tier: str, direction: str, nbytes: float, queue_depth: int = 1
                  ) -> float:
        """Move ``nbytes`` (finite, ≥ 0) to or from offload tier ``tier`` with
        ``queue_depth`` (whole, ≥ 1) transfers in flight, s."""
        if not isinstance(tier, str):
            raise ArgumentError("tier", f"must be a tier name, got {tier!r}")
        if direction not in ("to_tier", "from_tier"):
            raise ArgumentError("direction", f"must be 'to_tier' or 'from_tier', not "
                                f"{direction!r}")
        nb = _v.amount("nbytes", nbytes)
        depth = _v.positive("queue_depth", queue_depth)
        return float(_overheads.tier_time(self.params, self.inputs.devices.get(tier),
                                          direction, nb, depth))

    # -- introspection (resolution.md §12) --------------------------------------------------
    def provenance(self) -> list:
        return list(self._r.provenance)

    def evidence(self) -> tuple[int, int, list[str]]:
        prov = self._r.provenance
        evidenced = sum(1 for p in prov if p.method in EVIDENCED)
        return evidenced, len(prov), [p.name for p in prov if p.method == "assumed"]

    def resolved(self):
        return self._r.resolution

    def deployment(self):
        """The pool as stated (unstated settings 0, "" or None)."""
        return self.inputs.deployment.pools[self.inputs.pool_index]

    def decode_context_parallel_width(self) -> int:
        return self.plan.dcp

    def prefill_context_parallel_width(self) -> int:
        return self.plan.pcp

    def assumption(self, name: str) -> str | None:
        """The scope string of a kernel assumption (``"<value>: <reason>"``), or None."""
        for p in self._r.provenance:
            if p.set == "jkernel" and p.name == name:
                return p.scope
        return None

    def __repr__(self) -> str:
        sc = self.inputs.scenario
        pool = self.deployment()
        return (f"Kernel({sc.name}: {sc.model} on {sc.cluster.hardware}, pool "
                f"{self.inputs.pool_index} ({pool.role}), tp {self.plan.tp}, dp "
                f"{self.plan.dp}, ep {self.plan.ep})")


# -- entry points ----------------------------------------------------------------------------

def open_inputs(bundle: Any, repos: Repos | None = None, pool: int | str = 0) -> Inputs:
    """Load a bundle and every document it names (resolution.md §1)."""
    _entry()
    return _open_inputs(bundle, repos, pool)


def new(inputs: Inputs, **kw) -> Kernel:
    """Validate and resolve ``inputs`` into a kernel; raises :class:`Refusal`."""
    _entry()
    return Kernel(resolve(inputs), **kw)


def open(bundle: Any, repos: Repos | None = None, **kw) -> Kernel:  # noqa: A001
    """The kernel of a colocated deployment's pool.

    A disaggregated deployment needs one kernel per pool: that is refused here, naming
    ``open_pool``.
    """
    _entry()
    inputs = _open_inputs(bundle, repos, 0)
    pools = inputs.deployment.pools
    if len(pools) > 1:
        roles = ", ".join(p.role for p in pools)
        raise Refusal("R3", f"the deployment has {len(pools)} pools ({roles}); build one "
                      "kernel per pool with jkernel.open_pool(bundle, role)", field="pools")
    return _started(Kernel(resolve(inputs), **kw))


def _started(k: Kernel) -> Kernel:
    """``k``, or the refusal vLLM would stop at start-up with (:func:`jkernel.memory.
    start_refusal`): no KV page left, or a stated max_model_len the cache cannot hold,
    when the bundle states its gpu_memory_utilization.

    A departure from the spec, which lists no such refusal for ``open`` (resolution.md §1,
    §13) and whose vectors open pools whose fixed bytes overflow the budget at the
    utilization jkernel assumes when none is stated (D15, 0.92): those keep memory.md §5's
    pages = max(0, …) and are priced. A budget the bundle states is held to vLLM v0.31.0's
    start-up check (README precedence rule 2). ``new`` never refuses here."""
    if k.assumption("gpu_memory_utilization") is not None:
        return k
    engine = getattr(k.deployment(), "engine", None)
    _memory.check_start(k, max_model_len=int(getattr(engine, "max_model_len", 0) or 0),
                        pool=f"pools[{k.inputs.pool_index}]")
    return k


def open_pool(bundle: Any, pool: int | str, repos: Repos | None = None, **kw) -> Kernel:
    """The kernel of one pool, named by its role (``prefill``, ``decode``) or index."""
    _entry()
    return _started(Kernel(resolve(_open_inputs(bundle, repos, pool)), **kw))
