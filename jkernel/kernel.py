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

import functools
import os
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
from .plan import Plan
from .resolve import Inputs, Resolved, open_inputs as _open_inputs, resolve
from .step import RESOURCES, BatchArrays, StepEstimate, StepOptions, make_step_fn

__all__ = ["Kernel", "open", "open_pool", "open_inputs", "new", "enable_x64",
           "enable_compilation_cache"]

#: Threads pricing chunks of batches side by side in ``price_many`` (one per core, at most 4).
_WORKERS = max(1, min(4, os.cpu_count() or 1))

_PACK = ("overlap_s", "no_overlap_s", "expected_s") + tuple(f"{r}_s" for r in RESOURCES) + \
    ("bottleneck",)


def enable_x64() -> None:
    """Turn on float64 in JAX (the spec's arithmetic). Called by the entry points."""
    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str:
    """Persist compiled step programs across processes in ``path`` (default
    ``$JKERNEL_CACHE_DIR`` or ``~/.cache/jkernel/xla``). Returns the directory used."""
    path = str(path or os.environ.get("JKERNEL_CACHE_DIR")
               or os.path.join(os.path.expanduser("~"), ".cache", "jkernel", "xla"))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _entry() -> None:
    """What every entry point sets before JAX is first used (never at import).

    * float64 (the spec's arithmetic);
    * synchronous dispatch on CPU: a step is a few microseconds of work, and JAX's
      asynchronous CPU dispatch adds ~40 µs per call around it. It takes effect only if JAX's
      CPU backend has not started yet (let jkernel open a kernel first for the fastest
      ``step_time``); ``JKERNEL_CPU_ASYNC_DISPATCH=1`` keeps JAX's default;
    * the persistent compilation cache when ``JKERNEL_CACHE_DIR`` is set.
    """
    enable_x64()
    if os.environ.get("JKERNEL_CPU_ASYNC_DISPATCH", "0") != "1":
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if os.environ.get("JKERNEL_CACHE_DIR"):
        enable_compilation_cache()


class _Compiled:
    """The jitted programs of one (plan, options, parameter names): shared by every kernel
    with that structure, so ``with_params`` never recompiles."""

    def __init__(self, plan: Plan, options: StepOptions, names: tuple[str, ...]):
        self.step_fn = make_step_fn(plan, options)
        self.names = names
        self.traces = 0
        step_fn = self.step_fn

        def unpack(flat) -> Params:
            return Params(dict(zip(names, [flat[..., i] for i in range(len(names))])))

        def pack(est: StepEstimate):
            dt = est.no_overlap_s.dtype
            cols = [est.overlap_s, est.no_overlap_s, est.expected_s] + \
                [est.per_resource_s[r] for r in RESOURCES] + [est.bottleneck.astype(dt)]
            return jnp.stack(jnp.broadcast_arrays(*cols), axis=-1)

        def one(flat, packed):
            """``packed``: int32 ``(..., 2R + 3)`` = scheduled (R), computed (R), then
            decode_threshold, sm_budget, pad_tokens; one array, so one host→device copy.
            Leading axes are batches: the step function broadcasts over them itself (no
            vmap), which lets it sum requests as vector operations across batches."""
            self.traces += 1                       # runs at trace time only
            r = (packed.shape[-1] - 3) // 2
            sched, comp = packed[..., :r], packed[..., r:2 * r]
            batch = BatchArrays(sched, comp, sched > 0, packed[..., 2 * r],
                                packed[..., 2 * r + 1], packed[..., 2 * r + 2])
            return pack(step_fn(unpack(flat), batch))

        def many(flat, sched, comp, scal):
            """Batches ``(B, R)`` and their scalars ``(B, 3)``, unpacked: the bulk path
            slices the caller's arrays into chunks without copying them into one."""
            self.traces += 1
            batch = BatchArrays(sched, comp, sched > 0, scal[..., 0], scal[..., 1],
                                scal[..., 2])
            return pack(step_fn(unpack(flat), batch))

        self.unpack = unpack
        self.pack = pack
        self.one = jax.jit(one)
        self.many = jax.jit(many)
        self.sweep = jax.jit(jax.vmap(many, in_axes=(0, None, None, None)))
        self.jit_step = jax.jit(step_fn)


@functools.lru_cache(maxsize=64)
def _compiled(plan: Plan, options: StepOptions, names: tuple[str, ...]) -> _Compiled:
    return _Compiled(plan, options, names)


def max_zero(x):
    """``max(x, 0)`` elementwise for an int or an array (a negative pad counts as 0, D27)."""
    return np.maximum(np.asarray(x, np.int64), 0)


def _estimate(row: np.ndarray) -> StepEstimate:
    vals = [float(x) for x in row]
    per = dict(zip(RESOURCES, vals[3:8]))
    return StepEstimate(vals[0], vals[1], vals[2], per, int(vals[8]))


def _estimates(rows: np.ndarray) -> StepEstimate:
    per = {r: rows[..., 3 + i] for i, r in enumerate(RESOURCES)}
    return StepEstimate(rows[..., 0], rows[..., 1], rows[..., 2], per,
                        rows[..., 8].astype(np.int32))


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
        self._c = _compiled(self.plan, options, tuple(self.params))
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
        """``batch`` padded to its bucket, as jnp :class:`BatchArrays` for ``step_fn``."""
        size = bucket if bucket is not None else bucket_for(len(batch), self.buckets)
        return BatchArrays(*(jnp.asarray(x) for x in batch.pad_to(size)))

    def _packed(self, batch: Batch) -> np.ndarray:
        n = len(batch)
        size = bucket_for(n, self.buckets)
        packed = np.zeros(2 * size + 3, np.int32)
        packed[:n] = batch.scheduled
        packed[size:size + n] = batch.computed
        packed[2 * size:] = (batch.decode_threshold, batch.sm_budget, batch.pad_tokens)
        return packed

    def step_time(self, batch: Batch) -> StepEstimate:
        """Price one step (jitted; one program per bucket). Fields are Python floats."""
        if not isinstance(batch, Batch):
            raise TypeError(f"step_time takes a jkernel.Batch, not {type(batch).__name__}")
        return _estimate(np.asarray(self._c.one(self._flat, self._packed(batch))))

    def breakdown(self, batch: Batch):
        """Where ``batch``'s step time goes: a :class:`pandas.DataFrame` of layer kind ×
        named term × resource seconds with each term's share of ``expected_s``
        (:func:`jkernel.terms.breakdown_table`; jitted, not on the packed fast path)."""
        from .terms import breakdown_table

        if not isinstance(batch, Batch):
            raise TypeError(f"breakdown takes a jkernel.Batch, not {type(batch).__name__}")
        return breakdown_table(self.plan, self._c.jit_step(self.params,
                                                           self.batch_arrays(batch)))

    def warm_up(self, buckets: Sequence[int] | None = None) -> None:
        """Compile the step program for every bucket ahead of time."""
        for size in buckets or self.buckets:
            packed = np.zeros(2 * size + 3, np.int32)
            packed[-3] = 1
            self._c.one(self._flat, packed).block_until_ready()

    def price_many(self, batches: Sequence[Batch] | None = None, *, scheduled=None,
                   computed=None, decode_threshold=1, sm_budget=0,
                   pad_tokens=0, chunk: int = 4096, dtype=None) -> StepEstimate:
        """Price many batches with one program, in chunks of ``chunk`` batches.

        Either a list of :class:`Batch`, or arrays ``scheduled`` / ``computed`` of shape
        ``(batches, requests)``, zero-padded; the scalars may be ints or arrays of shape
        ``(batches,)``. ``dtype=jnp.float32`` prices
        in single precision. Memory stays bounded by the chunk, however many batches come.
        Returns a :class:`StepEstimate` of numpy arrays of shape ``(batches,)``.
        """
        arrays = self._many_inputs(batches, scheduled, computed, decode_threshold, sm_budget,
                                   pad_tokens)
        flat = self._flat if dtype is None else self._flat.astype(dtype)
        return _estimates(self._chunked(lambda *x: self._c.many(flat, *x), arrays, chunk))

    def price_sweep(self, params: Sequence[Params] | Params, batches=None, *, scheduled=None,
                    computed=None, decode_threshold=1, sm_budget=0, pad_tokens=0,
                    chunk: int = 4096) -> StepEstimate:
        """Price the same batches under many parameter sets in one call (``vmap`` over the
        params pytree).

        ``params``: a list of :class:`Params` (same names as the kernel's), or one Params
        whose leaves have a leading axis. Returns arrays of shape ``(param_sets, batches)``.
        """
        if not isinstance(params, Params):
            params = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params)
        if tuple(params) != self._c.names:
            raise ValueError("params must have exactly the kernel's names")
        flat = jnp.stack([jnp.asarray(params[n]) for n in self._c.names], axis=-1)
        arrays = self._many_inputs(batches, scheduled, computed, decode_threshold, sm_budget,
                                   pad_tokens)
        rows = self._chunked(lambda *x: self._c.sweep(flat, *x), arrays, chunk, axis=1)
        return _estimates(rows)

    def _many_inputs(self, batches, scheduled, computed, decode_threshold, sm_budget,
                     pad_tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validate many batches: int32 ``scheduled`` and ``computed`` ``(B, R)`` (the
        caller's arrays when they are already int32 and contiguous) and scalars ``(B, 3)``."""
        if batches is not None:
            if scheduled is not None or computed is not None:
                raise ValueError("give either batches or scheduled/computed arrays, not both")
            width = bucket_for(max((len(b) for b in batches), default=1), self.buckets)
            s = np.zeros((len(batches), width), np.int32)
            c = np.zeros((len(batches), width), np.int32)
            scal = np.zeros((len(batches), 3), np.int32)
            for j, b in enumerate(batches):
                s[j, :len(b)] = b.scheduled
                c[j, :len(b)] = b.computed
                scal[j] = (b.decode_threshold, b.sm_budget, b.pad_tokens)
            return s, c, scal
        if scheduled is None:
            raise ValueError("price_many needs batches or a scheduled array")
        s = np.asarray(scheduled)
        c = np.zeros_like(s) if computed is None else np.asarray(computed)
        if s.ndim != 2 or c.shape != s.shape:
            raise ValueError(f"scheduled and computed must both have shape (batches, requests)"
                             f", got {s.shape} and {c.shape}")
        for name, x in (("scheduled", s), ("computed", c)):
            if x.dtype.kind == "f" and not np.all(np.isfinite(x)):
                raise ValueError(f"{name} holds NaN or infinite values")
            if x.dtype.kind not in "iuf":
                raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
            if x.size and x.min() < 0:
                raise ValueError(f"{name} must be ≥ 0")
            if x.size and x.max() >= 2 ** 31:
                raise ValueError(f"{name} exceeds 2^31 tokens")
        nb = s.shape[0]
        scal = np.stack([np.broadcast_to(np.asarray(x, np.int64), (nb,))
                         for x in (decode_threshold, max_zero(sm_budget), max_zero(pad_tokens))],
                        axis=1).astype(np.int32)
        return (np.ascontiguousarray(s, dtype=np.int32), np.ascontiguousarray(c, dtype=np.int32),
                scal)

    @staticmethod
    def _chunked(fn, arrays: tuple[np.ndarray, ...], chunk: int, axis: int = 0):
        """Run ``fn`` over row chunks of ``arrays`` (the last one padded with empty batches so
        every chunk runs one program), two chunks at a time: XLA runs each program on one
        core and releases the GIL, so a second thread keeps a second core busy."""
        n = arrays[0].shape[0]
        if n == 0:
            raise ValueError("no batches to price")
        size = min(chunk, n)

        def run(start: int) -> np.ndarray:
            parts = [x[start:start + size] for x in arrays]
            short = size - parts[0].shape[0]
            if short:
                parts = [np.concatenate([x, np.zeros((short,) + x.shape[1:], x.dtype)])
                         for x in parts]
            out = np.asarray(fn(*(jax.device_put(x, may_alias=True) for x in parts)))
            return out.take(np.arange(size - short), axis=axis) if short else out

        starts = range(0, n, size)
        workers = min(len(starts), _WORKERS)
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

    def kv_cache_pages(self) -> int:
        """Pages left for the KV cache per rank (memory.md §5)."""
        return _memory.kv_cache_pages(self.inputs.chip.memory_bytes,
                                      self._r.settings["gpu_memory_utilization"],
                                      self.fixed_bytes().total(), self.page_bytes())

    # -- around a step (methods.md) ---------------------------------------------------------
    def admission_overhead(self, prompt_tokens: int) -> float:
        return float(_overheads.admission_overhead(self.params, prompt_tokens))

    def output_token_overhead(self) -> float:
        return float(_overheads.output_token_overhead(self.params))

    def completion_overhead(self) -> float:
        return float(_overheads.completion_overhead(self.params))

    def pd_transfer_time(self, tokens: int, src: _overheads.Placement,
                         dst: _overheads.Placement) -> float:
        """KV transfer of one request to the decode pool (call on the prefill pool, D26)."""
        return float(_overheads.pd_transfer_time(
            self.params, tokens, kv_bytes_per_token=self.plan.kv_bytes_per_token,
            same_node=src.node == dst.node,
            same_rack_domain=self._r.links["rack_domain"] and src.rack == dst.rack,
            floor_name=self._r.settings.get("pd_floor_name")))

    def tier_time(self, tier: str, direction: str, nbytes: float, queue_depth: int = 1
                  ) -> float:
        return float(_overheads.tier_time(self.params, self.inputs.devices.get(tier),
                                          direction, nbytes, queue_depth))

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
    return Kernel(resolve(inputs), **kw)


def open_pool(bundle: Any, pool: int | str, repos: Repos | None = None, **kw) -> Kernel:
    """The kernel of one pool, named by its role (``prefill``, ``decode``) or index."""
    _entry()
    return Kernel(resolve(_open_inputs(bundle, repos, pool)), **kw)
