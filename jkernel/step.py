"""Composing the terms into one forward pass (spec step.md; ``expected_s`` from expected.md).

:func:`make_step_fn` closes over a pool's static :class:`~jkernel.plan.Plan` and returns the
pure function ``step_fn(params, batch) -> StepEstimate``. It is traceable (``jit``,
``vmap``, ``grad``), never branches on values, and never raises: a zero rate with positive
work gives ``+inf``; zero work costs zero (D5). The stages it runs, and the records they
hand on, are :mod:`jkernel.stages`'; the terms it composes, :mod:`jkernel.terms`'.

Shapes: ``batch`` holds request arrays of shape ``(R,)`` (``R`` = the bucket size) and
scalars; under ``vmap`` every field gains leading batch axes and so does the estimate.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import terms
from .plan import Plan
from .stages import (RESOURCES, BatchArrays, RequestLanes, RequestSums, Resources, StepBatch,
                     StepInputs, StepOptions, sum_requests)
from .terms import STEP, PricedTerms, Side

__all__ = ["StepEstimate", "make_step_fn"]


class StepEstimate(NamedTuple):
    """The price of one step, float seconds (arrays under ``vmap``).

    ``overlap_s`` and ``no_overlap_s`` are the reference's two edges (step.md), kept at
    parity with the spec, including its non-monotone rules (see :func:`_edges`).
    ``expected_s`` is jkernel's own estimate (expected.md): ``max(gpu_s, host_s) +
    host_serial_s`` over the named terms, exactly the sum of the breakdown's ``expected_s``
    column. It is **not** bounded by the edges: its refinements add work the edges leave out
    (the MoE all-to-all's second direction, replicated GEMMs, activation traffic, a prefill
    chunk's cache read, the drafter) and remove work they charge (logits for every token,
    a FULL graph's kernel launches, compute summed with memory), so it can lie above
    ``no_overlap_s`` (large MoE steps) or below ``overlap_s``. With the refinements off and
    the host terms and ``kernel_gap``/``host_serial`` at zero, ``overlap_s ≤ expected_s ≤
    no_overlap_s``. With the default options it is non-decreasing when a request is added,
    when a request's scheduled or cached tokens grow, and when a decode crosses the decode
    threshold; the host side follows vLLM's graph mode, so a step that becomes a uniform
    decode (FULL graph) or crosses the capture ceiling can change its host time either way
    (hidden whenever the GPU side is longer).

    ``per_resource_s`` is a :class:`~jkernel.stages.Resources` of each resource's total
    (zeros included; it reads by name too, ``per_resource_s["hbm"]``; see :meth:`resources`
    for the spec's positive-only view). ``bottleneck`` is an index into
    :data:`RESOURCES` (strict ``>``, ties keep the earlier; ``host`` for the empty step).
    ``terms`` maps a layer kind's id (and :data:`jkernel.terms.STEP` for the LM head, the
    drafter and the host) to ``{term name: Term}``, each layer term already multiplied by
    its kind's layer count: for every resource the terms sum to ``per_resource_s`` (None on
    the packed fast paths, which return only the totals).
    """

    overlap_s: jax.Array
    no_overlap_s: jax.Array
    expected_s: jax.Array
    per_resource_s: Resources
    bottleneck: jax.Array
    terms: dict | None = None

    @property
    def bottleneck_name(self) -> str:
        return RESOURCES[int(self.bottleneck)]

    def resources(self) -> dict[str, float]:
        """Positive per-resource totals of one (unbatched) estimate, in resource order."""
        out = {r: float(v) for r, v in self.per_resource_s.items()}
        pos = {r: v for r, v in out.items() if v > 0}
        return pos if pos else {"host": out["host"]}


def make_step_fn(plan: Plan, options: StepOptions = StepOptions()):
    """Return ``step_fn(params, batch) -> StepEstimate`` for one pool's plan.

    The function carries ``plan``, ``options``, ``lanes`` (the plan's
    :class:`~jkernel.stages.RequestLanes`, built once here) and two variants: ``checked``
    and ``from_sums`` (below).
    """
    lanes = RequestLanes.of(plan)

    def step_fn(params, batch: BatchArrays) -> StepEstimate:
        return _price(plan, lanes, options, params, batch)

    def checked(params, batch: BatchArrays, in_order: bool = False):
        """``(StepEstimate, negative)``: ``negative`` (int32, the batch shape) counts the
        requests with a negative ``scheduled`` or ``computed``, in the same pass over the
        requests (the bulk path's validity check; the estimate treats them as D32 says).
        ``in_order``: sum a short request axis without a reducer
        (:func:`~jkernel.stages.sum_requests`; the same figures, a cheaper single step)."""
        return _price(plan, lanes, options, params, batch, check=True, in_order=in_order)

    def from_sums(params, batch: BatchArrays, sums: RequestSums) -> StepEstimate:
        """The estimate from the request sums of :func:`~jkernel.stages.sum_requests`
        (``batch`` gives the scalars; its request arrays may be None; ``sums.negative`` is
        not read). Raises :class:`~jkernel.stages.NeedsRequests` for a plan that reads
        per-request arrays after the reduction (the DCP context gather)."""
        return _price(plan, lanes, options, params, batch, sums=sums)

    step_fn.checked = checked
    step_fn.from_sums = from_sums
    step_fn.plan = plan
    step_fn.options = options
    step_fn.lanes = lanes
    return step_fn


def _edges(plan: Plan, options: StepOptions, priced: PricedTerms, b: StepBatch, zero):
    """The reference edges (step.md §6.11, §9) over the named terms.

    Returns ``(overlap_s, no_overlap_s, per-resource totals)``. Parity with the spec keeps
    its non-monotone rules: prefill attention's efficiency is the ramp at the whole step's
    token count (a small extra request raises it), and a request that crosses the decode
    threshold stops reading its cached context (its decode read is replaced by prefill
    work). ``expected_s`` does not inherit either (see :func:`_expected`).
    """
    SM = HBM = NVL = NIC = stages = zero
    for kind in plan.kinds:
        dense = [zero] * 4
        serial = zero
        for name, t in priced.layers[kind.id].items():
            r = t.per_resource_s
            if terms.side(kind.id, name) is Side.SERIAL:
                serial = serial + r.sm + r.hbm
                SM, HBM = SM + kind.count * r.sm, HBM + kind.count * r.hbm
                continue
            dense = [d + x for d, x in zip(dense, (r.sm, r.hbm, r.nvlink, r.nic))]
        stages += kind.count * (options.maximum(*dense) + serial)
        SM += kind.count * dense[0]
        HBM += kind.count * dense[1]
        NVL += kind.count * dense[2]
        NIC += kind.count * dense[3]
    # the step-level GPU terms (the LM head, step.md §7) run as one stage of compute and
    # memory, any communication after it; the host terms add to the host
    head = [zero] * 4
    host = zero
    for name, t in priced.step.items():
        r, where = t.per_resource_s, terms.side(STEP, name)
        if where.gpu:
            head = [h + x for h, x in zip(head, (r.sm, r.hbm, r.nvlink, r.nic))]
        elif where is Side.HOST:
            host = host + r.host
    SM, HBM, NVL, NIC = SM + head[0], HBM + head[1], NVL + head[2], NIC + head[3]
    keep = ~b.empty
    SM, HBM, NVL, NIC = (jnp.where(keep, x, 0.0) for x in (SM, HBM, NVL, NIC))
    no_overlap = SM + HBM + NVL + NIC + host
    head_stage = options.maximum(head[0], head[1]) + (head[2] + head[3])
    overlap = jnp.where(keep, jnp.minimum(stages + head_stage + host, no_overlap), host)
    return overlap, no_overlap, Resources(SM, HBM, NVL, NIC, host)


def _expected(plan: Plan, options: StepOptions, priced: PricedTerms, b: StepBatch, zero):
    """``expected_s = max(gpu_s, host_s) + host_serial_s`` over the named terms
    (expected.md): ``gpu_s`` sums every layer term and the GPU step terms (0 for an empty
    step), ``host_s`` the host terms, ``host_serial_s`` the host-serial ones."""
    gpu = zero
    for kind in plan.kinds:
        gpu += kind.count * terms.expected_sum(priced.layers[kind.id], zero)
    host = serial = zero
    for name, t in priced.step.items():
        where = terms.side(STEP, name)
        if where.gpu:
            gpu += t.expected_s
        elif where is Side.HOST:
            host = host + t.expected_s
        else:
            serial = serial + t.expected_s
    gpu = jnp.where(~b.empty, gpu, 0.0)
    return options.maximum(gpu, host) + serial


def _published(plan: Plan, priced: PricedTerms, b: StepBatch) -> dict:
    """The terms as :attr:`StepEstimate.terms`: each layer term × its kind's count, GPU
    terms zero for an empty step (as the totals are)."""
    keep = ~b.empty
    out = {kind.id: {name: t.scaled(kind.count).where(keep)
                     for name, t in priced.layers[kind.id].items()} for kind in plan.kinds}
    out[STEP] = {name: (t.where(keep) if terms.side(STEP, name).gpu else t)
                 for name, t in priced.step.items()}
    return out


def _first_max(values) -> jax.Array:
    """``jnp.argmax`` over the resources' totals (the first largest; the first NaN if any),
    written out as comparisons: an ``argmax`` is a reduction whose reducer's buffers XLA's
    CPU runtime allocates on every run of a single step."""
    values = jnp.broadcast_arrays(*values)
    best, index = values[0], jnp.zeros(jnp.shape(values[0]), jnp.int32)
    for i, v in enumerate(values[1:], 1):
        take = (v > best) | (jnp.isnan(v) & ~jnp.isnan(best))
        best, index = jnp.where(take, v, best), jnp.where(take, i, index)
    return index


def _price(plan: Plan, lanes: RequestLanes, options: StepOptions, params, batch: BatchArrays,
           check: bool = False, sums: RequestSums | None = None, in_order: bool = False):
    """The step's estimate; with ``check``, ``(estimate, negative)`` where ``negative`` is
    the int32 count of requests (per batch) with a negative ``scheduled`` or ``computed``,
    counted in the same single pass over the requests that prices them."""
    c = terms.Constants(plan, params)
    if sums is None:
        sums = sum_requests(lanes, batch, c.dt, check, in_order)
    b = StepBatch.from_sums(lanes, batch, sums, c.dt)
    st = StepInputs.of(b, c.params["sm_count"], c.eps, c.m_half)
    # refinement 8: a context-parallel plan prices expected_s on its own view of the step
    # (vLLM's PCP split, the DCP envelope); the edges keep the spec's counts
    ex = (st.expected_view(c.eps, c.m_half)
          if options.expected_refinements and lanes.expected_view else st)
    priced = terms.price_terms(plan, options, c, st, ex)
    overlap, no_overlap, per = _edges(plan, options, priced, b, c.zero)
    expected = _expected(plan, options, priced, b, c.zero)
    bottleneck = jnp.where(b.empty, len(RESOURCES) - 1, _first_max(per))
    est = StepEstimate(overlap_s=overlap, no_overlap_s=no_overlap, expected_s=expected,
                       per_resource_s=per, bottleneck=bottleneck.astype(jnp.int32),
                       terms=_published(plan, priced, b))
    return (est, sums.negative) if check else est
