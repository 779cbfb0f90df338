"""Lockstep replay: K variants of one replay stepped together, every step priced in one
vectorised call.

A *variant* is the same serving replay (pools, scheduler, requests) under other constants:
the kernel's parameters scaled by named factors, the step time multiplied by a systematic
factor per step regime (:mod:`jkernel.regimes`) and a per-step jitter, and a time added
before each request reaches the entry pool. Each variant keeps its own scheduler state
(its own :class:`~jkernel.replay.sim.Pool` objects: engines, replicas, KV blocks, event
heap, clients), so variants diverge as their step times differ; variants that share a
workload share its arrivals and lengths exactly (common random numbers).

The loop (:class:`Lockstep`): every active variant runs its event loop
(:meth:`VariantSimulation.advance`) until one of its engines has scheduled a batch that
needs a price; then the batches of all variants are priced together, one vectorised call
per pool (``jax.vmap`` of the kernel's ``step_fn`` over variant rows: row *i* is variant
*i*'s parameters and batch; :func:`paired_program`), each variant's step is launched with
its time (:meth:`VariantSimulation.complete`), and the loop goes on until every variant
has run out of events. One iteration is one simulated step of every variant still
running, so the iterations number the longest variant's steps.

Around the step each variant behaves exactly as :mod:`jkernel.replay.sim` (the scheduler,
routing, async scheduling, overheads and the disaggregated transfer are the same code);
the variant with no factors reproduces the plain replay (``tests/test_replay_lockstep.py``).
The KV transfer of a disaggregated pair and the admission, output-token and completion
overheads are priced at the kernel's own parameters in every variant.

Per-step Python is the variants' schedulers plus copying each batch into one row of the
priced arrays; a cheaper scheduler loop speeds this module up as it speeds up a replay.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import jax
import numpy as np

from ..batch import bucket_for
from ..params import Params
from ..regimes import REGIMES, classify_row
from ..step import BatchArrays
from .api import Prepared, ReplayResult, prepare
from .sim import Pool, Simulation, gc_paused, step_ticks, ticks

__all__ = ["Variant", "VariantSimulation", "Lockstep", "paired_program", "lockstep_replay"]

_NREG = len(REGIMES)


@dataclass(frozen=True)
class Variant:
    """What one variant of a lockstep replay changes.

    Attributes:
      log_scale: constant name → log of the factor its value is multiplied by (names a
        pool's kernel does not have are ignored for that pool).
      log_factor: per regime (:data:`jkernel.regimes.REGIMES` order), the log of the factor
        every step time of that regime is multiplied by (the systematic error of a draw).
      step_sd: per regime, the standard deviation of a per-step log jitter (independent
        between steps; drawn from ``seed``).
      front_s: seconds added before each request reaches the entry pool (may be negative;
        the admission delay never goes below zero).
      workload: which of the lockstep's workloads the variant replays (index).
      seed: the jitter's seed (the lockstep draws its per-step jitter from one stream
        seeded by every variant's seed, so a set of variants replays identically).
    """

    log_scale: Mapping[str, float] = field(default_factory=dict)
    log_factor: tuple[float, ...] = (0.0,) * _NREG
    step_sd: tuple[float, ...] = (0.0,) * _NREG
    front_s: float = 0.0
    workload: int = 0
    seed: int = 0

    def __post_init__(self):
        for name in ("log_factor", "step_sd"):
            v = getattr(self, name)
            if len(v) != _NREG or not all(math.isfinite(float(x)) for x in v):
                raise ValueError(f"Variant.{name} needs {_NREG} finite values (one per "
                                 f"regime: {', '.join(r.label for r in REGIMES)}), got {v!r}")
        if any(float(x) < 0 for x in self.step_sd):
            raise ValueError(f"Variant.step_sd must be ≥ 0, got {self.step_sd!r}")
        if not math.isfinite(float(self.front_s)):
            raise ValueError(f"Variant.front_s must be finite, got {self.front_s!r}")
        bad = [n for n, v in self.log_scale.items() if not math.isfinite(float(v))]
        if bad:
            raise ValueError(f"Variant.log_scale has non-finite values for {bad}")


@functools.lru_cache(maxsize=32)
def paired_program(step_fn, names: tuple[str, ...], clock: str):
    """A jitted ``(flat (N, P), scheduled (N, R), computed (N, R), scalars (N, 3)) →
    (seconds (N,), bottleneck (N,), regime (N,))``: row *i* priced by ``step_fn`` at the
    parameters of row *i* of ``flat`` (columns in ``names`` order), the clock figure
    ``clock`` (``expected_s`` or ``no_overlap_s``), its bottleneck resource and its
    regime (:func:`jkernel.regimes.classify_row`, decode threshold ``scalars[:, 0]``).
    Cached per step function, names and clock."""

    def one(flat, s, c, scal):
        p = Params({n: flat[i] for i, n in enumerate(names)})
        est = step_fn(p, BatchArrays(s, c, s > 0, scal[0], scal[1], scal[2]))
        return getattr(est, clock), est.bottleneck, classify_row(s, scal[0], est.bottleneck)

    return jax.jit(jax.vmap(one))


class _EntryPool(Pool):
    """The entry pool of a variant: its admission delay moved by the variant's ``front_s``
    (never below zero)."""

    def __init__(self, kernel, *, front_us: int = 0, **kw):
        super().__init__(kernel, **kw)
        self.front_us = int(front_us)

    def admission_us(self, prompt: int) -> int:
        return max(0, super().admission_us(prompt) + self.front_us)


class VariantSimulation(Simulation):
    """A :class:`~jkernel.replay.sim.Simulation` that stops where a step needs its price
    (:meth:`advance`) and goes on when given it (:meth:`complete`)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._pending = None
        self._started = False

    def _step(self, engine, t: int) -> None:
        cur = self._next_batch(engine, t)
        if cur is not None:
            self._pending = (engine, t, cur)

    def advance(self):
        """Run events until a step needs a price: ``(engine, t, batch per replica)``, or
        None when the simulation is over."""
        if not self._started:
            self._start()
            self._started = True
        heap, pop, handle = self._heap, heapq.heappop, self._handle
        while heap:
            handle(*pop(heap))
            if self._pending is not None:
                return self._pending
        if self._progress is not None:
            self._progress.close()
        return None

    def complete(self, dur: int) -> None:
        """Launch the pending step with its duration (ticks)."""
        engine, t, cur = self._pending
        self._pending = None
        self._launch(engine, t, cur, dur)


class Lockstep:
    """Variants of one replay run together (module docstring).

    ``layout``: the pools as ``(kernel, name, first_node)``, the entry pool first (one
    colocated pool, or prefill then decode); ``prepared``: one
    :class:`~jkernel.replay.api.Prepared` workload per index a variant may name;
    ``clock``: ``expected_s`` or ``no_overlap_s``.
    """

    def __init__(self, layout: Sequence[tuple], prepared: Sequence[Prepared],
                 variants: Sequence[Variant], *, clock: str = "expected_s"):
        if clock not in ("expected_s", "no_overlap_s"):
            raise ValueError(f"clock must be 'expected_s' or 'no_overlap_s', not {clock!r}")
        if not variants:
            raise ValueError("a lockstep replay needs at least one variant")
        self.layout = list(layout)
        self.prepared = list(prepared)
        self.variants = list(variants)
        for i, v in enumerate(self.variants):
            if not isinstance(v, Variant):
                raise TypeError(f"variants[{i}] must be a jkernel.replay.lockstep.Variant, "
                                f"not {type(v).__name__}")
            if not 0 <= v.workload < len(self.prepared):
                raise ValueError(f"variants[{i}].workload {v.workload} is not one of the "
                                 f"{len(self.prepared)} workloads")
        self.clock = clock
        k = len(self.variants)
        # per pool: the program, the parameter rows of every variant, the bucket sizes
        self._programs, self._flat = [], []
        for kernel, _, _ in self.layout:
            names = tuple(kernel.params)
            self._programs.append(paired_program(kernel.step_fn, names, clock))
            base = np.array([float(np.asarray(kernel.params[n])) for n in names])
            rows = np.tile(base, (k, 1))
            for i, v in enumerate(self.variants):
                for j, n in enumerate(names):
                    if n in v.log_scale:
                        rows[i, j] *= math.exp(float(v.log_scale[n]))
            self._flat.append(rows)
        self._log_factor = np.array([v.log_factor for v in self.variants], float)
        self._step_sd = np.array([v.step_sd for v in self.variants], float)
        self._jitter = any(np.any(self._step_sd[i] > 0) for i in range(k))
        # one stream of per-step jitter for the run, seeded by every variant's seed (one
        # standard normal per variant per iteration; the replicas of one engine step share it)
        self._rng = np.random.default_rng([v.seed for v in self.variants])
        self.sims = [self._simulation(v) for v in self.variants]
        self.iterations = 0
        self.priced_rows = 0

    def _simulation(self, v: Variant) -> VariantSimulation:
        pools = []
        for j, (kernel, name, first_node) in enumerate(self.layout):
            if j == 0:
                pools.append(_EntryPool(kernel, name=name, first_node=first_node,
                                        clock=self.clock, front_us=ticks(v.front_s)))
            else:
                pools.append(Pool(kernel, name=name, first_node=first_node, clock=self.clock))
        return self.prepared[v.workload].simulation(pools, cls=VariantSimulation)

    def run(self) -> list[ReplayResult]:
        """Run every variant to its end; their results, in variant order."""
        sims = self.sims
        with gc_paused():
            pending = [s.advance() for s in sims]
            active = [i for i, p in enumerate(pending) if p is not None]
            while active:
                self.iterations += 1
                durations = self._price([(i, pending[i]) for i in active])
                still = []
                for i in active:
                    sims[i].complete(durations[i])
                    nxt = sims[i].advance()
                    pending[i] = nxt
                    if nxt is not None:
                        still.append(i)
                active = still
        return [self.prepared[v.workload].result(s) for v, s in zip(self.variants, sims)]

    def _price(self, items: list) -> dict[int, int]:
        """Every pending step of ``items`` (``(variant, (engine, t, batch))``) priced, one
        call per pool: variant → step ticks."""
        by_pool: dict[int, tuple] = {}
        for i, (engine, _, cur) in items:
            pool = engine.pool
            j = 0 if pool is self.sims[i].pools[0] else 1
            acc = by_pool.get(j)
            if acc is None:
                acc = by_pool[j] = ([], [], [], [])
            owner, rows, thrs, stepping = acc
            stepping.append(i)
            for row in pool.rows(cur):
                owner.append(i)
                rows.append(row)
                thrs.append(pool.decode_threshold)
        if self._jitter:
            z = self._rng.standard_normal(len(self.variants))
        seconds = np.zeros(len(self.variants))
        for j, (owner, rows, thrs, stepping) in by_pool.items():
            kernel = self.layout[j][0]
            n = len(owner)
            width = bucket_for(max(len(r[0]) for r in rows), kernel.buckets)
            # the row count padded to a power of two: few shapes, few compilations
            m = 1 << max(0, (n - 1).bit_length())
            s = np.zeros((m, width), np.int32)
            c = np.zeros((m, width), np.int32)
            scal = np.zeros((m, 3), np.int32)
            scal[:, 0] = 1
            for r, (sc, co, pad) in enumerate(rows):
                k = len(sc)
                s[r, :k] = sc
                c[r, :k] = co
                scal[r, 2] = pad
            scal[:n, 0] = thrs
            var = np.zeros(m, np.int64)
            var[:n] = owner
            secs, _, regime = self._programs[j](self._flat[j][var], s, c, scal)
            var = var[:n]
            regime = np.asarray(regime)[:n]
            logf = self._log_factor[var, regime]
            if self._jitter:
                logf = logf + self._step_sd[var, regime] * z[var]
            secs = np.asarray(secs)[:n] * np.exp(logf)
            self.priced_rows += n
            if n == len(stepping):                 # one row per variant: no replicas to max
                seconds[var] = secs
            else:
                np.maximum.at(seconds, var, secs)
        sec = seconds.tolist()
        return {i: step_ticks(sec[i]) for i, _ in items}


def lockstep_replay(kernels: Sequence, workloads: Sequence, variants: Sequence[Variant], *,
                    clock: str = "expected_s", clients=None, window=None
                    ) -> tuple[list[ReplayResult], Lockstep]:
    """Replay ``variants`` in lockstep. ``kernels``: one colocated pool's kernel, or the
    prefill and the decode kernel; ``workloads``: request tables (the replay's columns),
    one per workload index a variant names; ``clients`` and ``window`` as in
    :func:`jkernel.replay.replay` (the same for every workload). Returns the variants'
    results in order and the :class:`Lockstep` (its ``iterations`` and ``priced_rows``)."""
    kernels = list(kernels)
    if len(kernels) == 1:
        layout = [(kernels[0], "", 0)]
    elif len(kernels) == 2:
        pre = Pool(kernels[0], name="prefill")
        layout = [(kernels[0], "prefill", 0), (kernels[1], "decode", pre.nodes)]
    else:
        raise ValueError(f"a replay has one pool or a prefill and a decode pool, not "
                         f"{len(kernels)} kernels")
    probe = [Pool(k, name=n, first_node=f, clock=clock) for k, n, f in layout]
    prepared = [prepare(probe, w, clients, window) for w in workloads]
    ls = Lockstep(layout, prepared, variants, clock=clock)
    return ls.run(), ls
