"""The compiled programs of one kernel structure: what ``Kernel`` runs.

:func:`programs` returns the :class:`Programs` of one (plan, options, parameter names),
shared by every kernel with that structure, so ``Kernel.with_params`` never recompiles.
They take the params packed into one array (``flat``, the names' order) and a batch packed
as one int32 array (:func:`packed_batch` reads it), and return the step's figures packed
as :data:`PACKED_FIELDS` (:func:`estimate_of` / :func:`estimates_of` read them back).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .params import Params
from .plan import Plan
from .stages import (RESOURCES, BatchArrays, NeedsRequests, Resources, StepOptions,
                     sum_requests)
from .step import StepEstimate, make_step_fn

__all__ = ["Programs", "programs", "PACKED_FIELDS", "SMALL_PACKED", "packed_batch",
           "estimate_of", "estimates_of"]

#: The figures of a packed step output, in column order (``bottleneck`` as a float).
PACKED_FIELDS = ("overlap_s", "no_overlap_s", "expected_s", *(f"{r}_s" for r in RESOURCES),
                 "bottleneck")

#: The largest packed single-step input (int32 entries) that runs as one program: XLA's CPU
#: runtime runs a program inline when all its buffers are ≤ 512 bytes.
SMALL_PACKED = 128


def packed_batch(packed) -> BatchArrays:
    """The batch of a packed step input, int32 ``(..., 2R + 3)``: scheduled (R), computed
    (R), then decode_threshold, sm_budget, pad_tokens (views, numpy or traced)."""
    r = (packed.shape[-1] - 3) // 2
    sched, comp = packed[..., :r], packed[..., r:2 * r]
    return BatchArrays(sched, comp, sched > 0, packed[..., 2 * r], packed[..., 2 * r + 1],
                       packed[..., 2 * r + 2])


def estimate_of(values: list) -> StepEstimate:
    """The :class:`StepEstimate` of one packed output row as a list of Python floats."""
    return StepEstimate(values[0], values[1], values[2], Resources(*values[3:8]),
                        int(values[8]))


def estimates_of(rows: np.ndarray) -> StepEstimate:
    """The :class:`StepEstimate` of packed output rows ``(..., 9)``: numpy arrays of the
    leading shape (``bottleneck`` int32)."""
    return StepEstimate(rows[..., 0], rows[..., 1], rows[..., 2],
                        Resources(*(rows[..., 3 + i] for i in range(len(RESOURCES)))),
                        rows[..., 8].astype(np.int32))


class Programs:
    """The jitted programs of one (plan, options, parameter names).

    Attributes: ``step_fn`` (:func:`jkernel.step.make_step_fn` of the plan), ``names`` (the
    params' order in ``flat``), ``traces`` (how many times a packed program was traced),
    ``unpack(flat) -> Params``, ``pack(estimate)`` (its figures as the last axis), and the
    programs ``one(flat, packed)``, ``many(flat, scheduled, computed, scalars)``,
    ``sweep`` (``many`` over a leading param-set axis), ``at(offsets, sweep)``,
    ``jit_step`` (``jit(step_fn)``, the terms included), ``reduce_requests`` and
    ``from_sums`` (the two halves of :meth:`step`).
    """

    def __init__(self, plan: Plan, options: StepOptions, names: tuple[str, ...]):
        self.step_fn = step_fn = make_step_fn(plan, options)
        self.names = names
        self.traces = 0
        lanes = step_fn.lanes
        n_lanes = lanes.size(check=True)

        def unpack(flat) -> Params:
            return Params(dict(zip(names, [flat[..., i] for i in range(len(names))])))

        def pack(est: StepEstimate):
            dt = est.no_overlap_s.dtype
            cols = [est.overlap_s, est.no_overlap_s, est.expected_s, *est.per_resource_s,
                    est.bottleneck.astype(dt)]
            return jnp.stack(jnp.broadcast_arrays(*cols), axis=-1)

        def one(flat, packed):
            """``packed``: int32 ``(..., 2R + 3)`` = scheduled (R), computed (R), then
            decode_threshold, sm_budget, pad_tokens; one array, so one host→device copy.
            Leading axes are batches: the step function broadcasts over them itself (no
            vmap), which lets it sum requests as vector operations across batches.
            Returns the 9 packed figures and, last, the count of negative request entries
            (the sign check of the array entry point, in the same pass)."""
            self.traces += 1                       # runs at trace time only
            # in_order: the small buckets sum their requests without a reducer computation
            est, negative = step_fn.checked(unpack(flat), packed_batch(packed),
                                            in_order=True)
            rows = pack(est)
            return jnp.concatenate([rows, negative.astype(rows.dtype)[..., None]], axis=-1)

        def many(flat, sched, comp, scal):
            """Batches ``(B, R)`` and their scalars ``(B, 3)``, unpacked: the bulk path
            slices the caller's arrays into chunks without copying them into one. Also
            returns how many requests of each batch have a negative ``scheduled`` or
            ``computed`` (int32 ``(B,)``): the sign check of int32 inputs is a lane of the
            step's one pass over the requests, not a second read of them."""
            self.traces += 1
            batch = BatchArrays(sched, comp, sched > 0, scal[..., 0], scal[..., 1],
                                scal[..., 2])
            est, negative = step_fn.checked(unpack(flat), batch)
            return pack(est), negative

        def reduce_requests(packed, dt):
            """The first half of a single step: the request sums (in lane order, the sign
            check last) and the three scalars as one ``dt`` vector. Few kernels, so XLA's CPU
            runtime runs it inline."""
            self.traces += 1
            batch = packed_batch(packed)
            sums = sum_requests(lanes, batch, dt, check=True)
            return jnp.stack([v.astype(dt) for v in jax.tree_util.tree_leaves(sums)]
                             + [x.astype(dt) for x in (batch.decode_threshold,
                                                       batch.sm_budget, batch.pad_tokens)])

        def from_sums(flat, vec):
            """The second half: the step from the sums (their layout is the plan's
            :class:`~jkernel.stages.RequestLanes`); one program for every bucket, on buffers
            of a few hundred bytes."""
            self.traces += 1
            n = n_lanes
            batch = BatchArrays(None, None, None, vec[n], vec[n + 1], vec[n + 2])
            sums = lanes.unstack([vec[i] for i in range(n)], check=True)
            rows = pack(step_fn.from_sums(unpack(flat), batch, sums))
            return jnp.concatenate([rows, sums.negative[None]])

        def grad_of(field: int):
            def value(flat, packed):
                return one(flat, packed)[field]
            return jax.jit(jax.value_and_grad(value))

        self.unpack = unpack
        self.pack = pack
        self.one = jax.jit(one)
        self.many = jax.jit(many)
        self.sweep = jax.jit(jax.vmap(many, in_axes=(0, None, None, None)))

        @functools.lru_cache(maxsize=8)
        def at(offsets: tuple[int, int], sweep: bool):
            """``many`` (or ``sweep``) on flat views of ``scheduled`` and ``computed`` whose
            first ``offsets`` elements precede the batches (the bulk path's views from the
            64-byte boundary below an unaligned array)."""
            def run(flat, s_view, c_view, scal):
                b = scal.shape[0]
                sched = s_view[offsets[0]:].reshape(b, -1)
                comp = c_view[offsets[1]:].reshape(b, -1)
                return many(flat, sched, comp, scal)
            return jax.jit(jax.vmap(run, in_axes=(0, None, None, None)) if sweep else run)

        self.at = at
        self.jit_step = jax.jit(step_fn)
        self.reduce_requests = jax.jit(reduce_requests, static_argnums=1)
        self.from_sums = jax.jit(from_sums)
        self._split: bool | None = None
        self._grads: dict[int, Any] = {}
        self._grad_of = grad_of

    @property
    def split(self) -> bool | None:
        """Whether a large single step runs as two programs (None until one has run; False
        for a plan that reads the requests after the reduction)."""
        return self._split

    def step(self, flat, packed) -> np.ndarray:
        """One packed step's 9 figures (float64 numpy). A batch whose input exceeds 512
        bytes (64 requests and up) runs as two programs, the request reduction and the
        rest: XLA's CPU runtime runs a program inline only when it has few kernels or all
        its buffers are at most 512 bytes, and otherwise schedules its ~40 kernels over its
        thread pool, which cost a fixed ~12-25 µs (more than the second dispatch). Plans
        that read the requests after the reduction (DCP's context gather) stay one program."""
        if packed.shape[-1] <= SMALL_PACKED or self._split is False:
            return np.asarray(self.one(flat, packed))
        if self._split is None:
            try:
                vec = self.reduce_requests(packed, flat.dtype)
                out = np.asarray(self.from_sums(flat, vec))
            except NeedsRequests:
                self._split = False
                return np.asarray(self.one(flat, packed))
            self._split = True
            return out
        return np.asarray(self.from_sums(flat, self.reduce_requests(packed, flat.dtype)))

    def grad(self, field: int):
        """``jit(value_and_grad)`` of one packed output column w.r.t. the flat params: one
        program with one output array (a Params-shaped output would be one buffer per
        name, which costs more than the backward pass itself for one batch)."""
        g = self._grads.get(field)
        if g is None:
            g = self._grads[field] = self._grad_of(field)
        return g


@functools.lru_cache(maxsize=64)
def programs(plan: Plan, options: StepOptions, names: tuple[str, ...]) -> Programs:
    """The :class:`Programs` of one kernel structure (cached: every kernel with it shares
    them)."""
    return Programs(plan, options, names)
