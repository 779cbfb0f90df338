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
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import memory as _memory
from . import overheads as _overheads
from .batch import DEFAULT_BUCKETS, Batch, bucket_for
from .bulk import chunked, many_inputs, raise_negative
from .catalog import Repos
from .documents.coefficients import EVIDENCED
from .errors import Refusal
from .params import CHIP_NAMES, Params
from .pricer import PerThreadBuffers, StepPricer, packed_call as _packed_call
from .programs import PACKED_FIELDS, estimate_of, estimates_of, programs
from .documents import Pool
from .resolve import (EngineSettings, Inputs, Resolution, Resolved, open_inputs as _open_inputs,
                      resolve)
from .runtime import configure
from .stages import BatchArrays, StepOptions
from .startup import check_opened
from .step import StepEstimate
from . import validate as _v
from .validate import ArgumentError

__all__ = ["Kernel", "open", "open_pool", "open_inputs", "new", "ArgumentError"]




class Kernel:
    """One pool's cost model. Build it with :func:`open` / :func:`open_pool` / :func:`new`.

    Attributes:
      plan: the static :class:`~jkernel.plan.Plan` (hashable; jit treats it as static).
      params: the :class:`~jkernel.params.Params` pytree the kernel prices with (SI units).
      step_fn: the pure function ``step_fn(params, batch_arrays) -> StepEstimate``.
      inputs: the documents the kernel was built from (``inputs.chip`` for the memory size).
      settings: the :class:`~jkernel.resolve.EngineSettings` the kernel runs with (block
        size, scheduler limits, max_model_len, prefix caching…).
    """

    def __init__(self, resolved: Resolved, *, options: StepOptions = StepOptions(),
                 buckets: Sequence[int] = DEFAULT_BUCKETS, params: Params | None = None):
        self._resolved = resolved
        self.plan = resolved.plan
        self.options = options
        if not isinstance(options, StepOptions):
            raise ArgumentError("options", f"must be a jkernel.StepOptions, not {options!r}")
        self.buckets = _v.buckets(buckets)
        self.params = resolved.params if params is None else _v.params_mapping(params, Params)
        if set(self.params) != set(resolved.params):
            raise ArgumentError("params", "must be a jkernel.Params with exactly the kernel's "
                                f"names: {sorted(resolved.params)}")
        self._programs = programs(self.plan, options, tuple(self.params))
        self.step_fn = self._programs.step_fn
        self._flat = jnp.stack([jnp.asarray(v) for v in self.params.values()])
        self._threads = PerThreadBuffers()      # step_time's reused input buffers
        if params is not None:                  # the documents' own are checked as read
            _v.params_values(self._programs.names, self._flat, CHIP_NAMES)

    # -- construction helpers -----------------------------------------------------------
    def with_params(self, params: Params) -> "Kernel":
        """A kernel that prices with ``params`` (same names); shares compiled programs."""
        return Kernel(self._resolved, options=self.options, buckets=self.buckets,
                      params=_v.params_mapping(params, Params))

    def with_options(self, options: StepOptions) -> "Kernel":
        return Kernel(self._resolved, options=options, buckets=self.buckets, params=self.params)

    @property
    def inputs(self) -> Inputs:
        return self._resolved.inputs

    @property
    def memory_plan(self) -> _memory.MemoryPlan:
        """What the memory rules size this pool from (:class:`jkernel.memory.MemoryPlan`:
        the vLLM version's rules, weights, activation and graph terms, attention windows)."""
        return self._resolved.memory

    @property
    def settings(self) -> EngineSettings:
        """The engine settings the kernel runs with, unstated ones resolved (a frozen
        record; ``settings.as_dict()`` for JSON)."""
        return self._resolved.settings

    @property
    def trace_count(self) -> int:
        """How many times the packed step programs were traced (a recompilation guard)."""
        return self._programs.traces

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
        s, c, scal = self._inputs(batch, scheduled, computed, decode_threshold, sm_budget,
                                  pad_tokens, sign)
        n = s.shape[0]
        size = bucket_for(n, self.buckets)
        packed = np.zeros(2 * size + 3, np.int32)
        packed[:n] = s
        packed[size:size + n] = c
        end = 2 * size
        packed[end], packed[end + 1], packed[end + 2] = scal
        return packed

    def _inputs(self, batch: Batch | None, scheduled, computed, decode_threshold, sm_budget,
                pad_tokens, sign: bool = True):
        """Validated int32 ``scheduled``, ``computed`` and the three step scalars of a
        single step's arguments."""
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
        return s, c, scal

    def step_time(self, batch: Batch | None = None, *, scheduled=None, computed=None,
                  decode_threshold: int = 1, sm_budget: int = 0, pad_tokens: int = 0
                  ) -> StepEstimate:
        """Price one step (jitted; one program per bucket). Fields are Python floats.

        Either a :class:`Batch`, or its arrays directly (``scheduled``, ``computed``: ``(n,)``
        token counts; int32 numpy arrays are read without a copy) and its scalars, checked
        as ``Batch`` checks them — the cheapest call for a simulator.
        """
        s, c, scal = self._inputs(batch, scheduled, computed, decode_threshold, sm_budget,
                                  pad_tokens, sign=False)   # the program counts negatives
        vals = _packed_call(self._programs.step, self._flat, self.buckets, self._threads, s, c,
                            scal)
        if vals[-1]:
            raise_negative((s[None], c[None]), 0, 1)
        return estimate_of(vals)

    def pricer(self, clock: str = "expected_s", *, decode_threshold: int | None = None,
               sm_budget: int = 0) -> StepPricer:
        """A :class:`~jkernel.StepPricer` for a simulator's loop: ``pricer(scheduled,
        computed, pad_tokens=0)`` returns the step's ``clock`` figure (seconds) as a float,
        the same value as ``step_time(...)``'s field, to the bit, with the scalars fixed
        here (``decode_threshold`` defaults to the kernel's settings'; ``sm_budget`` 0 = all
        SMs). It checks the clock and the scalars now and, per call, only the lengths and
        the signs of the counts (docs/simulator.md)."""
        thr = self.settings.decode_threshold if decode_threshold is None else decode_threshold
        return StepPricer(self._programs.step, self._flat, self.buckets, clock, thr, sm_budget)

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
        value, g = self._programs.grad(PACKED_FIELDS.index(of))(self._flat, packed)
        g = np.asarray(g)
        return float(value), Params(dict(zip(self._programs.names, g)))

    def breakdown(self, batch: Batch):
        """Where ``batch``'s step time goes: a :class:`pandas.DataFrame` of layer kind ×
        named term × resource seconds with each term's share of ``expected_s``
        (:func:`jkernel.breakdown.breakdown_table`; jitted, not on the packed fast path)."""
        from .breakdown import breakdown_table

        if not isinstance(batch, Batch):
            raise ArgumentError("batch", f"breakdown takes a jkernel.Batch, not "
                                f"{type(batch).__name__}")
        return breakdown_table(self.plan, self._programs.jit_step(self.params,
                                                           self.batch_arrays(batch)))

    def warm_up(self, buckets: Sequence[int] | None = None) -> None:
        """Compile the step program for every bucket ahead of time."""
        for size in self.buckets if buckets is None else _v.bucket_sizes("buckets", buckets):
            packed = np.zeros(2 * size + 3, np.int32)
            packed[-3] = 1
            self._programs.step(self._flat, packed)

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
        arrays = many_inputs(batches, scheduled, computed, decode_threshold, sm_budget,
                             pad_tokens, buckets=self.buckets)
        flat = self._flat if dtype is None else self._flat.astype(_v.price_dtype(dtype))
        return estimates_of(chunked(
            lambda *x: self._programs.many(flat, *x), arrays, chunk, columns=len(PACKED_FIELDS),
            at=lambda o: functools.partial(self._programs.at(o, False), flat)))

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
        if tuple(params) != self._programs.names:
            raise ArgumentError("params", "must have exactly the kernel's names")
        flat = jnp.stack([jnp.asarray(params[n]) for n in self._programs.names], axis=-1)
        if flat.ndim != 2:
            raise ArgumentError("params", "a single Params needs leaves with a leading "
                                "param-set axis (or pass a list of Params)")
        _v.params_values(self._programs.names, flat, CHIP_NAMES)
        arrays = many_inputs(batches, scheduled, computed, decode_threshold, sm_budget,
                             pad_tokens, buckets=self.buckets)
        rows = chunked(lambda *x: self._programs.sweep(flat, *x), arrays, chunk,
                       columns=len(PACKED_FIELDS), axis=1, sets=flat.shape[0],
                       at=lambda o: functools.partial(self._programs.at(o, True), flat))
        return estimates_of(rows)

    # -- memory (memory.md) -----------------------------------------------------------------
    def fixed_bytes(self) -> _memory.MemoryBreakdown:
        return _memory.fixed_bytes(self.memory_plan, self.params)

    def sequence_variable_bytes(self, tokens: int) -> int:
        return _memory.sequence_variable_bytes(
            self.plan, self.memory_plan, int(tokens),
            dcp_shards_all_kv_layers=self._resolved.settings.dcp_shards_all_kv_layers)

    def sequence_fixed_bytes(self) -> int:
        return _memory.sequence_fixed_bytes(self.memory_plan)

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
        return _memory.device_memory_bytes(self.memory_plan, self.inputs.chip)

    def kv_cache_pages(self) -> int:
        """Pages left for the KV cache per rank (memory.md §5)."""
        return _memory.kv_cache_pages(self.device_memory_bytes(),
                                      self._resolved.settings.gpu_memory_utilization,
                                      self.fixed_bytes().total(), self.page_bytes())

    # -- around a step (methods.md) ---------------------------------------------------------
    def admission_overhead(self, prompt_tokens: int) -> float:
        """Host time before a request of ``prompt_tokens`` (whole, ≥ 0) is scheduled, s.

        methods.md prices ``prompt_tokens ≤ 0`` as 0; only 0 reaches that branch here: a
        negative, fractional or NaN count is refused as ``Batch`` refuses it (one validation for every entry point)."""
        t = _v.whole("prompt_tokens", prompt_tokens)
        return float(_overheads.admission_overhead(self.params, t))

    def admission_overheads(self, prompt_tokens) -> np.ndarray:
        """:meth:`admission_overhead` of many prompts in one vectorised call:
        ``prompt_tokens`` ``(n,)`` whole counts ≥ 0 → seconds ``(n,)`` (float64 numpy),
        each the figure ``admission_overhead`` gives for it, to the bit. A replay prices
        every prompt length of its workload with it up front."""
        t = _v.tokens_array("prompt_tokens", prompt_tokens)
        return np.asarray(_overheads.admission_overhead(self.params, t), np.float64)

    def output_token_overhead(self) -> float:
        return float(_overheads.output_token_overhead(self.params))

    def completion_overhead(self) -> float:
        return float(_overheads.completion_overhead(self.params))

    def api_server_work(self) -> _overheads.ApiServerWork:
        """The API server process's time per request admitted and per token streamed,
        seconds (:class:`~jkernel.overheads.ApiServerWork`): what the replay queues on it."""
        return _overheads.ApiServerWork(
            float(_overheads.api_server_request_time(self.params)),
            float(_overheads.api_server_token_time(self.params)))

    def pd_transfer_time(self, tokens: int, src: _overheads.Placement,
                         dst: _overheads.Placement) -> float:
        """KV transfer of one request to the decode pool (call on the prefill pool, D26).
        ``tokens`` whole and ≥ 0; ``src`` and ``dst`` are :class:`~jkernel.Placement`."""
        t = _v.whole("tokens", tokens)
        for name, p in (("src", src), ("dst", dst)):
            if not isinstance(p, _overheads.Placement):
                raise ArgumentError(name, f"must be a jkernel.Placement, not {p!r}")
            _v.placement_pool(name, p, [q.role for q in self.inputs.deployment.pools])
        return float(_overheads.pd_transfer_time(
            self.params, t, kv_bytes_per_token=self.plan.kv_bytes_per_token,
            same_node=src.node == dst.node,
            same_rack_domain=self._resolved.links.rack_domain and src.rack == dst.rack,
            floor_name=self._resolved.settings.pd_floor_name))

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
        return list(self._resolved.provenance)

    def evidence(self) -> tuple[int, int, list[str]]:
        prov = self._resolved.provenance
        evidenced = sum(1 for p in prov if p.method in EVIDENCED)
        return evidenced, len(prov), [p.name for p in prov if p.method == "assumed"]

    def resolution(self) -> Resolution:
        """What the kernel resolved (resolution.md §12.3): widths, all-reduce backend,
        async scheduling, cascade attention, the overrides of stated settings."""
        return self._resolved.resolution

    def pool(self) -> Pool:
        """The pool as stated in the deployment document (unstated settings 0, "" or None;
        :attr:`settings` has them resolved)."""
        return self.inputs.deployment.pools[self.inputs.pool_index]

    def decode_context_parallel_width(self) -> int:
        return self.plan.dcp

    def prefill_context_parallel_width(self) -> int:
        return self.plan.pcp

    def assumption(self, name: str) -> str | None:
        """The scope string of a kernel assumption (``"<value>: <reason>"``), or None."""
        for p in self._resolved.provenance:
            if p.set == "jkernel" and p.name == name:
                return p.scope
        return None

    def __repr__(self) -> str:
        sc = self.inputs.scenario
        pool = self.pool()
        return (f"Kernel({sc.name}: {sc.model} on {sc.cluster.hardware}, pool "
                f"{self.inputs.pool_index} ({pool.role}), tp {self.plan.tp}, dp "
                f"{self.plan.dp}, ep {self.plan.ep})")


# -- entry points ----------------------------------------------------------------------------

def open_inputs(bundle: Any, repos: Repos | None = None, pool: int | str = 0) -> Inputs:
    """Load a bundle and every document it names (resolution.md §1)."""
    configure()
    return _open_inputs(bundle, repos, pool)


def new(inputs: Inputs, **kw) -> Kernel:
    """Validate and resolve ``inputs`` into a kernel; raises :class:`Refusal`."""
    configure()
    return Kernel(resolve(inputs), **kw)


def open(bundle: Any, repos: Repos | None = None, **kw) -> Kernel:  # noqa: A001
    """The kernel of a colocated deployment's pool.

    A disaggregated deployment needs one kernel per pool: that is refused here, naming
    ``open_pool``.
    """
    configure()
    inputs = _open_inputs(bundle, repos, 0)
    pools = inputs.deployment.pools
    if len(pools) > 1:
        roles = ", ".join(p.role for p in pools)
        raise Refusal("R3", f"the deployment has {len(pools)} pools ({roles}); build one "
                      "kernel per pool with jkernel.open_pool(bundle, role)", field="pools")
    k = Kernel(resolve(inputs), **kw)
    check_opened(k)
    return k


def open_pool(bundle: Any, pool: int | str, repos: Repos | None = None, **kw) -> Kernel:
    """The kernel of one pool, named by its role (``prefill``, ``decode``) or index."""
    configure()
    k = Kernel(resolve(_open_inputs(bundle, repos, pool)), **kw)
    check_opened(k)
    return k
