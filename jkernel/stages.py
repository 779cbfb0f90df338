"""The step's typed stages: the records each stage of pricing one step hands the next.

::

    BatchArrays (padded requests, a pytree)
      ──► sum_requests: ONE pass over the requests; RequestLanes (static, per plan) says
          which per-request lanes exist
      ──► RequestSums (the sums, a pytree)
      ──► StepBatch: the step's token counts (step.md §4) and reads, as scalars (or arrays of
          the batch shape under leading batch axes)
      ──► StepInputs: the batch with the ramps, the SM derate and the decode/prefill flags
          every term reads
      ──► the term laws (:mod:`jkernel.terms`) ──► Term (Resources + expected_s)
      ──► StepEstimate (:mod:`jkernel.step`)

:class:`Resources` (seconds per resource) is the one record of a term's, a step's and the
packed output's per-resource figures; :class:`StepOptions` the static switches every stage
reads. Everything here is traceable and never branches on values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import laws
from .plan import Plan, ReadShape, read_shape

__all__ = ["RESOURCES", "Resources", "BatchArrays", "StepOptions", "RequestLanes",
           "RequestSums", "RequestArrays", "PrefillContext", "PcpSplit", "DraftReads",
           "StepBatch", "StepInputs", "NeedsRequests", "primary_read", "request_lanes",
           "sum_requests"]


class Resources(NamedTuple):
    """Seconds on each resource of one rank (a pytree; arrays of the batch shape under
    ``vmap``): what the reference edges charge (step.md §6.11, §8).

    A field per resource, in the order of :data:`RESOURCES` (the order of
    ``StepEstimate.bottleneck``). It also reads by resource name, as a mapping does
    (``r["hbm"]``, :meth:`keys`, :meth:`items`); iterating it gives the values.
    """

    sm: jax.Array
    hbm: jax.Array
    nvlink: jax.Array
    nic: jax.Array
    host: jax.Array

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self._fields:
                raise KeyError(f"{key!r} is not a resource; resources: "
                               f"{', '.join(self._fields)}")
            return getattr(self, key)
        return tuple.__getitem__(self, key)

    def keys(self) -> tuple[str, ...]:
        return self._fields

    def values(self) -> tuple:
        return tuple(self)

    def items(self):
        return zip(self._fields, self)

    def as_dict(self) -> dict:
        """``{resource: seconds}`` in resource order."""
        return dict(zip(self._fields, self))


#: The resources a step is priced on, in :class:`Resources` order.
RESOURCES: tuple[str, ...] = Resources._fields


class BatchArrays(NamedTuple):
    """A batch as padded arrays (a pytree).

    ``scheduled``, ``computed``: int arrays ``(R,)`` of tokens run this step and tokens
    already in the KV cache. ``mask``:
    bool ``(R,)``, True for real requests (a request with ``scheduled = 0`` is padding anyway,
    D32). ``decode_threshold``, ``sm_budget``, ``pad_tokens``: int scalars (step.md §1.1).
    """

    scheduled: jax.Array
    computed: jax.Array
    mask: jax.Array
    decode_threshold: jax.Array
    sm_budget: jax.Array
    pad_tokens: jax.Array


@dataclass(frozen=True)
class StepOptions:
    """Static switches of the step function (changing them recompiles).

    ``smooth_temperature``: 0 prices exactly as the spec (hard maxima). A positive value
    replaces the maxima that compose a step (stage, per-kernel compute/memory, head,
    GPU/host) by a log-sum-exp with temperature ``smooth_temperature × Σ(args)``, for
    calibration by gradient; it tends to the hard max as the value tends to 0.
    ``expected_refinements``: expected.md's structure refinements 1–5 and jkernel's 6–8 (the
    monotone forms; True by default).
    ``expected_routed_max``: price routed experts at max(compute, memory) in ``expected_s``
    (False adds them as step.md's edges do).
    """

    smooth_temperature: float = 0.0
    expected_refinements: bool = True
    expected_routed_max: bool = True

    def maximum(self, *values):
        """The maximum that composes a step: hard, or smooth at ``smooth_temperature``."""
        if self.smooth_temperature <= 0 or len(values) == 1:
            out = values[0]
            for v in values[1:]:
                out = jnp.maximum(out, v)
            return out
        stacked = jnp.stack(jnp.broadcast_arrays(*values), axis=-1)
        tau = self.smooth_temperature * jax.lax.stop_gradient(jnp.sum(stacked, axis=-1))
        return laws.smooth_max(stacked, tau)


class NeedsRequests(ValueError):
    """A plan whose step reads per-request arrays after the request reduction."""


# -- the request lanes: which exist (static), their values and sums -------------------------

@dataclass(frozen=True)
class RequestLanes:
    """Which per-request lanes a plan's step sums (static and hashable; built once per plan
    by :meth:`of`). The lanes always present are the token and request counts, the causal
    FLOPs, the decodes' and every live request's plain context, and the largest prefill
    row's work; the others follow these fields:

    ``read_shapes``: one decode read, one live read (and one draft read) per distinct shaped
    read of the primary attentions (:func:`jkernel.plan.read_shape`); ``windows``: one
    windowed causal-FLOPs lane and one per-row maximum per sliding window; ``context``: DCP
    with a non-latent attention counts the requests with a cached context; ``prefill_context``:
    DCP with a latent attention counts the prefills with a context and takes their largest
    (``expected_s``'s chunked gather); ``pcp``: the tokens PCP withholds and vLLM's split
    (rows, pairs); ``draft``: the MTP drafter's context lane and reads. ``requests``: the
    step reads the per-request arrays after the reduction (DCP's MLA context gather).
    """

    uniform_width: int
    pcp: int
    dcp: int
    read_shapes: tuple[ReadShape, ...]
    windows: tuple[int, ...]
    context: bool
    prefill_context: bool
    draft: bool
    requests: bool

    @classmethod
    def of(cls, plan: Plan) -> "RequestLanes":
        shapes: list = []
        windows: set = set()
        dcp_plain = dcp_latent = requests = False
        for kind in plan.kinds:
            att = kind.attention
            if att is None:
                continue
            shape = read_shape(plan, att)
            if shape is not None and shape not in shapes:
                shapes.append(shape)
            if att.window > 0:
                windows.add(att.window)
            if plan.dcp > 1 and att.kind.dcp_shardable:
                dcp_latent |= att.kind.latent
                dcp_plain |= not att.kind.latent
                requests |= att.kind.latent and att.n_q > 0
        return cls(plan.uniform_decode_width, plan.pcp, plan.dcp, tuple(shapes),
                   tuple(sorted(windows)), dcp_plain, dcp_latent, bool(plan.draft_kinds),
                   requests)

    @property
    def expected_view(self) -> bool:
        """``expected_s`` prices a context-parallel view of the step (refinement 8: vLLM's
        PCP split, the latent DCP envelope); the edges keep the spec's counts."""
        return self.pcp > 1 or self.prefill_context

    def template(self, check: bool = False, leaf=0) -> "RequestSums":
        """A :class:`RequestSums` with ``leaf`` in every lane this plan has (None and empty
        tuples elsewhere): the structure :func:`sum_requests` returns."""
        one = leaf
        opt = lambda on: one if on else None  # noqa: E731
        pcp = self.pcp > 1
        n, w = len(self.read_shapes), len(self.windows)
        return RequestSums(
            tokens=one, n_live=one, nonuniform=one, prefill_tokens=one, prefill_requests=one,
            decode_kv_tokens=one, context=opt(self.context),
            prefill_context=opt(self.prefill_context), context_max=opt(self.prefill_context),
            causal_flops=one, withheld=opt(pcp), decode_reads=(one,) * n,
            draft_context=opt(self.draft), draft_reads=(one,) * (n if self.draft else 0),
            windowed=(one,) * w, live_kv_tokens=one, live_reads=(one,) * n,
            pcp_rows=opt(pcp), pcp_pairs=opt(pcp), row_max=one, window_row_max=(one,) * w,
            negative=opt(check))

    def size(self, check: bool = False) -> int:
        """How many lanes (sums) the plan's step has."""
        return len(jax.tree_util.tree_leaves(self.template(check)))

    def unstack(self, values, check: bool = False) -> "RequestSums":
        """The :class:`RequestSums` of ``values``, one per lane in lane order (the order of
        ``jax.tree_util.tree_leaves`` of the sums): how the split program reads the vector
        the request reduction wrote."""
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.template(check)),
                                            list(values))


class RequestSums(NamedTuple):
    """The request lanes of one step (step.md §4), summed over the requests (a pytree).

    Every field is an array of the batch shape (``()`` for one batch), in the float dtype
    of the step, except ``negative`` (int32). Lanes a plan lacks are None (or empty tuples);
    :class:`RequestLanes` says which exist, and the tuples follow its ``read_shapes`` and
    ``windows``. :func:`request_lanes` returns the same record before the sum (each field of
    the request shape). Field order is lane order.

    ``tokens``, ``n_live``: scheduled tokens and live requests; ``nonuniform``: live
    requests whose width is not the uniform decode's; ``prefill_tokens`` (rank-local under
    PCP), ``prefill_requests``; ``decode_kv_tokens``: Σ context + tokens over decodes;
    ``context``: requests with a cached context; ``prefill_context``, ``context_max``:
    prefills with a context, and their largest context (a maximum); ``causal_flops``: the
    prefills' causal pairs; ``withheld``: prefill tokens PCP keeps off this rank;
    ``decode_reads``: Σ over decodes of each shaped read; ``draft_context``,
    ``draft_reads``: every live request's context + 1 and its shaped reads there;
    ``windowed``: each window's causal FLOPs; ``live_kv_tokens``, ``live_reads``: every live
    request's context + tokens and shaped reads; ``pcp_rows``, ``pcp_pairs``: vLLM's PCP
    split of the prefills; ``row_max``, ``window_row_max``: the largest prefill work per
    query row (maxima); ``negative``: requests with a negative input (the sign check).
    """

    tokens: jax.Array
    n_live: jax.Array
    nonuniform: jax.Array
    prefill_tokens: jax.Array
    prefill_requests: jax.Array
    decode_kv_tokens: jax.Array
    context: jax.Array | None
    prefill_context: jax.Array | None
    context_max: jax.Array | None
    causal_flops: jax.Array
    withheld: jax.Array | None
    decode_reads: tuple
    draft_context: jax.Array | None
    draft_reads: tuple
    windowed: tuple
    live_kv_tokens: jax.Array
    live_reads: tuple
    pcp_rows: jax.Array | None
    pcp_pairs: jax.Array | None
    row_max: jax.Array
    window_row_max: tuple
    negative: jax.Array | None

    def lane_names(self) -> list[str]:
        """A name per lane, in lane order (``decode_reads[0]`` for a tuple's first)."""
        out = []
        for name, v in zip(self._fields, self):
            if isinstance(v, tuple):
                out += [f"{name}[{i}]" for i in range(len(v))]
            elif v is not None:
                out.append(name)
        return out

    def as_dict(self) -> dict:
        """``{lane name: array}`` in lane order (see :meth:`lane_names`)."""
        return dict(zip(self.lane_names(), jax.tree_util.tree_leaves(self)))


#: The lanes reduced by their maximum (their values are ≥ 0, so 0 is the identity).
_MAXIMA = ("context_max", "row_max", "window_row_max")


def primary_read(shape: ReadShape | None, ctx):
    """Tokens one decode at context ``ctx`` reads from the primary cache (step.md §6.3)."""
    if shape is None:
        return ctx
    read = ctx
    if shape.window > 0:
        read = jnp.minimum(read, shape.window)                                  # D3
    if shape.sparse_bound > 0:
        read = laws.sparse_read(read, shape.sparse_bound, shape.compress_ratio)
    if shape.dcp > 1:
        read = laws.dcp_local(laws.round_half_up(read), shape.dcp, shape.interleave)
    return read


def request_lanes(lanes: RequestLanes, s_in, c_in, mask, thr, dt, it=None,
                  check: bool = False) -> RequestSums:
    """Per-request quantities of step.md §4 (elementwise: any shape of requests), as a
    :class:`RequestSums` whose fields have the request shape; :func:`sum_requests` sums
    them (the maxima it maximises instead).

    ``it``: an integer dtype (int64) for the lanes whose per-request values are whole
    numbers below 2³⁴ (token counts, request counts, contexts, window-capped reads): they
    are computed and summed in integers from the int inputs, where XLA's CPU loop
    vectorises the sum (a float sum is one serial chain). Every partial sum of such a lane
    is an integer below 2⁵³, so its float sum would be exact and equals the integer sum
    converted: the two paths price alike to the bit. The other lanes (causal FLOPs, PCP
    splits, sparse and DCP reads) are in ``dt``. ``it=None`` (or float inputs) computes
    every lane in ``dt``.
    ``check``: fill ``negative``, the count of requests with a negative ``scheduled`` or
    ``computed`` (the bulk path's validity check, in the same pass).
    """
    ints = (it is not None and jnp.issubdtype(jnp.result_type(s_in), jnp.integer)
            and jnp.issubdtype(jnp.result_type(c_in), jnp.integer))
    neg = ((s_in < 0) | (c_in < 0)).astype(jnp.int32) if check else None
    live = mask & (s_in > 0)                                  # D32: scheduled 0 is padding
    s = jnp.where(live, s_in.astype(dt), 0.0)
    c = jnp.where(live, jnp.maximum(c_in.astype(dt), 0.0), 0.0)
    ctx = s + c            # > 0 for every live request, so the walk skips none of them
    # ws, wc: the tokens as whole numbers, for the whole-number lanes (integers of dtype
    # ``it`` from int inputs, else s and c themselves); count: a mask as a count lane
    if ints:
        ws = jnp.where(live, s_in, 0).astype(it)
        wc = jnp.where(live, jnp.maximum(c_in, 0), 0).astype(it)
        pre = live & (ws > thr)
        count = lambda m: m.astype(jnp.int32)  # noqa: E731
    else:
        ws, wc = s, c
        pre = live & (s > thr.astype(dt))
        count = lambda m: m  # noqa: E731
    dec = live & ~pre
    wctx = ws + wc
    wz = jnp.zeros((), ws.dtype)
    zero = jnp.zeros_like(s)
    pcp = lanes.pcp > 1
    if pcp:
        s_loc = laws.pcp_local_tokens(s, lanes.pcp, lanes.dcp)
        pairs = laws.pcp_causal_pairs(s, c, lanes.pcp, lanes.dcp)
        # the spec's busiest-rank chunks: the windowed lanes read them on both the edges
        # and expected_s (refinement 8 balances full attention's work, not a window's;
        # no shipped PCP pool has a sliding window)
        chunk_s, chunk_c = laws.pcp_busiest_chunks(s, c, lanes.pcp, lanes.dcp)
    else:
        pairs = laws.causal_pairs(s, c)
        chunk_s, chunk_c = s[..., None], c[..., None]

    def read(shape, whole_at, at, where):
        """One shaped read lane at context ``at`` (``whole_at``: the same as a whole
        number): in integers when it is a window cap alone."""
        if ints and shape.integral:
            return jnp.where(where, jnp.minimum(whole_at, shape.window), wz)
        return jnp.where(where, primary_read(shape, at), zero)

    shapes, windows = lanes.read_shapes, lanes.windows
    if pcp:
        # expected_s (refinement 8): vLLM's balanced split of a prefill over the PCP ranks
        # (see StepBatch.expected_view): 2·h rows of h = ceil(s/(2·pcp)) each, at prefix c
        half = jnp.ceil(s / (2 * lanes.pcp))
        pcp_rows = jnp.where(pre, jnp.maximum(2.0 * half, thr), zero)
        pcp_pairs = jnp.where(pre, 8.0 * half * (c + lanes.pcp * half), zero)
        row_max = jnp.where(pre, 4.0 * (c + lanes.pcp * half), zero)
    else:
        pcp_rows = pcp_pairs = None
        row_max = jnp.where(pre, 4 * wc + 2 * ws, wz)              # causal_pairs / s
    chunk_rows = jnp.sum(chunk_s, axis=-1)
    # decode_requests and decode_tokens follow from these (see StepBatch): fewer lanes, one
    # pass over the requests with less work per request
    per = RequestSums(
        tokens=ws, n_live=count(live),
        nonuniform=count(live & (ws != lanes.uniform_width)),
        prefill_tokens=jnp.where(pre, s_loc, zero) if pcp else jnp.where(pre, ws, wz),
        prefill_requests=count(pre),
        decode_kv_tokens=jnp.where(dec, wctx, wz),
        context=count(live & (wc > 0)) if lanes.context else None,
        # expected_s (refinement 8): vLLM's chunking of the prefills' cached context
        prefill_context=count(pre & (wc > 0)) if lanes.prefill_context else None,
        context_max=jnp.where(pre, wc, wz) if lanes.prefill_context else None,
        causal_flops=jnp.where(pre, pairs, zero),
        withheld=jnp.where(pre, s - s_loc, zero) if pcp else None,
        decode_reads=tuple(read(sh, wctx, ctx, dec) for sh in shapes),
        # a later draft pass: every live request runs one token at its context + 1
        draft_context=jnp.where(live, wctx + 1, wz) if lanes.draft else None,
        draft_reads=(tuple(read(sh, wctx + 1, ctx + 1.0, live) for sh in shapes)
                     if lanes.draft else ()),
        windowed=tuple(laws.windowed_causal_flops(chunk_s, chunk_c, w, mask=pre[..., None])
                       for w in windows),
        # expected_s (refinement 6): every live request's read of its cache, prefills too
        live_kv_tokens=jnp.where(live, wctx, wz),
        live_reads=tuple(read(sh, wctx, ctx, live) for sh in shapes),
        pcp_rows=pcp_rows, pcp_pairs=pcp_pairs,
        # expected_s (refinement 7): each prefill's causal work per row, maximised
        row_max=row_max,
        window_row_max=tuple(jnp.where(
            pre & (chunk_rows > 0), laws.windowed_causal_flops(chunk_s, chunk_c, w)
            / jnp.where(chunk_rows > 0, chunk_rows, 1.0), zero) for w in windows),
        negative=neg)
    return jax.tree_util.tree_map(
        lambda v: v if jnp.issubdtype(v.dtype, jnp.integer) else v.astype(dt), per)


def sum_requests(lanes: RequestLanes, batch: BatchArrays, dt, check: bool = False,
                 in_order: bool = False) -> RequestSums:
    """Σ over the request axis (the last) of every lane, in ONE variadic reduction.

    XLA fuses a tuple-reduce into a single pass over the requests, where separate sums each
    re-read them; with leading batch axes (the bulk path) the same reduction runs across
    all batches at once. The whole-number lanes are summed in int64 (see
    :func:`request_lanes`) when float64 is on, and every sum is returned in ``dt``, except
    ``negative`` (``check``: int32 count of requests with a negative input). The first
    half of the step, which :func:`jkernel.step.make_step_fn`'s ``from_sums`` completes.
    ``in_order``: a request axis of at most :data:`IN_ORDER_MAX` is summed by
    element-wise operations in the reduction's own order (:func:`_sum_in_order`: the same
    sums to the bit, without a reducer; the single step's small buckets) when every lane is
    an integer or float64 (:func:`_in_order_dtype`; a float32 step keeps the reduction).
    """
    thr = jnp.asarray(batch.decode_threshold)[..., None]
    it = jnp.int64 if jax.config.jax_enable_x64 else None
    per = request_lanes(lanes, jnp.asarray(batch.scheduled), jnp.asarray(batch.computed),
                        jnp.asarray(batch.mask), thr, dt, it, check)
    leaves, tree = jax.tree_util.tree_flatten(per)
    fields = [n.split("[")[0] for n in per.lane_names()]
    is_max = tuple(f in _MAXIMA for f in fields)
    shape = jnp.broadcast_shapes(*(v.shape for v in leaves))
    ops = tuple(jnp.broadcast_to(v, shape) for v in leaves)
    init = tuple(jnp.zeros((), x.dtype) for x in ops)
    combine = lambda a, b: tuple(                                     # noqa: E731
        jnp.maximum(x, y) if m else x + y for x, y, m in zip(a, b, is_max))
    if in_order and shape[-1] <= IN_ORDER_MAX and all(_in_order_dtype(x.dtype) for x in ops):
        sums = _sum_in_order(ops, init, is_max)
    else:
        sums = jax.lax.reduce(ops, init, combine, (len(shape) - 1,))
    return jax.tree_util.tree_unflatten(
        tree, [v if f == "negative" else v.astype(dt) for f, v in zip(fields, sums)])


#: The longest request axis :func:`sum_requests` sums ``in_order``: XLA's CPU compiler
#: sums a row of at most 32 elements as one serial chain (longer rows in groups of 32),
#: the order the written-out sum follows.
IN_ORDER_MAX = 32


def _in_order_dtype(dtype) -> bool:
    """Whether :func:`_sum_in_order` reproduces the reduction for a lane of ``dtype``:
    integers always, float64 (one serial chain), not float32, whose row XLA's CPU compiler
    sums in vector lanes (a different order: the last bit differs), so a float32 step keeps
    the reduction."""
    return jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.float64


def _sum_in_order(ops: tuple, init: tuple, is_max: tuple) -> tuple:
    """The last-axis sums (maxima where ``is_max``) of ``ops`` (at most
    :data:`IN_ORDER_MAX` long) from ``init``, written out as element-wise operations that
    equal ``jax.lax.reduce``'s to the bit: integer sums and maxima (exact in any order) in
    halvings of the axis, float sums in XLA's order, one serial chain from the initial
    value. A program without a reducer computation is cheaper to run: XLA's CPU runtime
    allocates every buffer of a reducer (some 40 for the step's lanes) on each run, which
    costs a single step more than its arithmetic."""
    n = ops[0].shape[-1]
    out = []
    for x, z, m in zip(ops, init, is_max):
        op = jnp.maximum if m else jnp.add
        if m or jnp.issubdtype(x.dtype, jnp.integer):
            width = 1 << max(n - 1, 0).bit_length()
            if width > n:
                x = jnp.concatenate([x, jnp.broadcast_to(z, x.shape[:-1] + (width - n,))],
                                    axis=-1)
            while x.shape[-1] > 1:
                h = x.shape[-1] // 2
                x = op(x[..., :h], x[..., h:])
            out.append(op(z, x[..., 0]))
        else:
            acc = z
            for j in range(n):
                acc = op(acc, x[..., j])
            out.append(acc)
    return tuple(out)


# -- the step's token counts -----------------------------------------------------------------

class RequestArrays(NamedTuple):
    """Per-request ``(scheduled, computed, prefill)`` of a step, live requests only (float
    dtype of the step; ``prefill`` bool): what DCP's MLA context gather reads."""

    scheduled: jax.Array
    computed: jax.Array
    prefill: jax.Array


class PrefillContext(NamedTuple):
    """``expected_s`` (DCP, latent): the prefills' cached context, ``(Σ c, count, max c)``
    over the prefills with one."""

    total: jax.Array
    count: jax.Array
    longest: jax.Array


class PcpSplit(NamedTuple):
    """PCP's lanes: the prefill tokens withheld from this rank, and vLLM's balanced split of
    the prefills (its rows and causal pairs per rank)."""

    withheld: jax.Array
    rows: jax.Array
    pairs: jax.Array


class DraftReads(NamedTuple):
    """A later draft pass's reads: Σ (context + 1) over live requests, and each shaped read
    at that context."""

    context: jax.Array
    reads: tuple


@dataclass(frozen=True)
class StepBatch:
    """A step's token counts (step.md §4), summed over its requests (a pytree; ``lanes`` and
    ``envelope`` are static).

    Every count is a float of the step's dtype with the batch shape (``()`` for one batch).
    ``tokens``, ``n_live``, ``uniform`` (a live uniform-decode step); ``any_context`` (DCP
    with a non-latent attention: whether a request has a cached context, else None);
    ``prefill_tokens``, ``prefill_requests``, ``decode_requests``, ``decode_tokens``;
    ``decode_kv_tokens`` / ``live_kv_tokens``: Σ context + tokens over decodes / every live
    request, with ``decode_reads`` / ``live_reads`` the same per shaped read (in
    ``lanes.read_shapes`` order); ``causal_flops``, ``windowed_flops`` (per window),
    ``row_max`` and ``window_row_max``: the prefills' causal work and its largest per-row
    share; ``t_real`` (tokens on this rank), ``t_pad`` (the DP lockstep pad), ``t_gemm``
    (their sum), ``empty``; ``sm_budget``, ``decode_threshold``; ``prefill_context``,
    ``pcp``, ``draft``: see :class:`PrefillContext`, :class:`PcpSplit`,
    :class:`DraftReads` (None where the plan has no such lanes); ``requests``: the
    per-request arrays where the plan reads them after the reduction (else None).
    ``envelope``: True on the view ``expected_s`` prices a context-parallel plan with.

    Build it with :meth:`from_sums`; :meth:`expected_view` and :meth:`draft_pass` give the
    other two views the terms price.
    """

    tokens: jax.Array
    n_live: jax.Array
    uniform: jax.Array
    any_context: jax.Array | None
    prefill_tokens: jax.Array
    prefill_requests: jax.Array
    decode_requests: jax.Array
    decode_tokens: jax.Array
    decode_kv_tokens: jax.Array
    live_kv_tokens: jax.Array
    decode_reads: tuple
    live_reads: tuple
    causal_flops: jax.Array
    windowed_flops: tuple
    row_max: jax.Array
    window_row_max: tuple
    t_real: jax.Array
    t_pad: jax.Array
    t_gemm: jax.Array
    empty: jax.Array
    sm_budget: jax.Array
    decode_threshold: jax.Array
    prefill_context: PrefillContext | None
    pcp: PcpSplit | None
    draft: DraftReads | None
    requests: RequestArrays | None
    lanes: RequestLanes
    envelope: bool = False

    @classmethod
    def from_sums(cls, lanes: RequestLanes, batch: BatchArrays, sums: RequestSums, dt
                  ) -> "StepBatch":
        """The counts of ``sums`` (``batch`` gives the scalars, and the request arrays when
        ``lanes.requests``). Raises :class:`NeedsRequests` when the plan reads the
        requests after the reduction and ``batch`` carries none."""
        tokens, n_live = sums.tokens, sums.n_live
        withheld = sums.withheld if sums.withheld is not None else jnp.zeros_like(tokens)
        t_real = tokens - withheld
        t_pad = jnp.maximum(jnp.asarray(batch.pad_tokens).astype(dt), 0.0)
        prefill_context = None
        if lanes.prefill_context:
            # Σ c over the prefills with context is what the live reads hold beyond the
            # decodes' contexts and the prefills' own tokens (no lane of its own)
            total = (sums.live_kv_tokens - sums.decode_kv_tokens
                     - (sums.prefill_tokens + withheld))
            prefill_context = PrefillContext(jnp.maximum(total, 0.0), sums.prefill_context,
                                             sums.context_max)
        requests = None
        if lanes.requests:
            if batch.scheduled is None:
                raise NeedsRequests("this plan reads per-request arrays after the reduction")
            s_in = jnp.asarray(batch.scheduled).astype(dt)
            live = jnp.asarray(batch.mask) & (s_in > 0)
            s = jnp.where(live, s_in, 0.0)
            c = jnp.where(live, jnp.maximum(jnp.asarray(batch.computed).astype(dt), 0.0), 0.0)
            thr = jnp.asarray(batch.decode_threshold).astype(dt)[..., None]
            requests = RequestArrays(s, c, live & (s > thr))
        return cls(
            tokens=tokens, n_live=n_live,
            uniform=(n_live > 0) & (sums.nonuniform <= 0),
            any_context=sums.context > 0 if sums.context is not None else None,
            prefill_tokens=sums.prefill_tokens, prefill_requests=sums.prefill_requests,
            # every live request is a prefill or a decode; a prefill's tokens are its
            # rank-local share plus what PCP withholds
            decode_requests=n_live - sums.prefill_requests,
            decode_tokens=tokens - sums.prefill_tokens - withheld,
            decode_kv_tokens=sums.decode_kv_tokens, live_kv_tokens=sums.live_kv_tokens,
            decode_reads=sums.decode_reads, live_reads=sums.live_reads,
            causal_flops=sums.causal_flops, windowed_flops=sums.windowed,
            row_max=sums.row_max, window_row_max=sums.window_row_max,
            t_real=t_real, t_pad=t_pad, t_gemm=t_real + t_pad,
            empty=(tokens <= 0) & (t_pad <= 0),
            sm_budget=jnp.asarray(batch.sm_budget).astype(dt),
            decode_threshold=jnp.asarray(batch.decode_threshold).astype(dt),
            prefill_context=prefill_context,
            pcp=(PcpSplit(sums.withheld, sums.pcp_rows, sums.pcp_pairs)
                 if sums.withheld is not None else None),
            draft=(DraftReads(sums.draft_context, sums.draft_reads)
                   if sums.draft_context is not None else None),
            requests=requests, lanes=lanes)

    def expected_view(self) -> "StepBatch":
        """The token counts ``expected_s`` prices a context-parallel plan with (refinement 8);
        the edges keep the spec's (parity).

        * PCP: vLLM v0.31.0 (``PCPManager.update_tokens_for_pcp``,
          ``vllm/v1/worker/gpu/cp_utils.py``) pads each prefill to a
          multiple of ``2·pcp`` and gives every rank two chunks of ``h = ceil(s/(2·pcp))``
          rows (DualChunkSwap: rank r holds chunks r and 2·pcp−1−r), pads included, while a
          decode is duplicated on every rank. So each rank runs ``2·h`` rows of a prefill
          (every rank the same, never a greedy busiest rank that reshuffles, and no
          replicated small prefill) with ``8·h·(c + pcp·h)`` causal FLOP pairs. A prefill is
          charged at least the ``decode_threshold`` rows of the decode it grew from (the
          monotone envelope: at pcp = 2 and threshold 3, a 3-token decode turning into a
          4-token prefill would otherwise drop from 3 rows per rank to 2).
        * DCP with a latent attention: :attr:`envelope` switches its DCP collectives to their
          monotone form (:func:`jkernel.terms.collectives`); a GQA pool's DCP rows (every
          token once any request has context) are monotone already.
        """
        if self.pcp is None:
            return dataclasses.replace(self, envelope=True)
        t_real = self.tokens - self.prefill_tokens - self.pcp.withheld + self.pcp.rows
        return dataclasses.replace(self, envelope=True, t_real=t_real,
                                   t_gemm=t_real + self.t_pad, prefill_tokens=self.pcp.rows,
                                   causal_flops=self.pcp.pairs)

    def draft_pass(self) -> "StepBatch":
        """The token counts of a later draft pass: every live request decodes one token at
        its context after the target pass (never the context-parallel view: draft passes
        run on the view of the pass they follow)."""
        n = self.n_live
        zero = jnp.zeros_like(n)
        req = self.requests
        return StepBatch(
            tokens=n, n_live=n, uniform=n > 0, any_context=n > 0, prefill_tokens=zero,
            prefill_requests=zero, decode_requests=n, decode_tokens=n,
            decode_kv_tokens=self.draft.context, live_kv_tokens=self.draft.context,
            decode_reads=self.draft.reads, live_reads=self.draft.reads, causal_flops=zero,
            windowed_flops=tuple(zero for _ in self.windowed_flops), row_max=zero,
            window_row_max=tuple(zero for _ in self.window_row_max), t_real=n, t_pad=zero,
            t_gemm=n, empty=n <= 0, sm_budget=self.sm_budget,
            decode_threshold=self.decode_threshold, prefill_context=None, pcp=None,
            draft=None,
            # no prefill rows: nothing to gather (step.md §6.9)
            requests=(None if req is None
                      else RequestArrays(*(jnp.zeros_like(x) for x in req))),
            lanes=self.lanes)

    def decode_read(self, shape: ReadShape | None):
        """Σ over decodes of the primary read per request (step.md §6.3); ``shape`` from
        :func:`jkernel.plan.read_shape` (None: the plain context)."""
        if shape is None:
            return self.decode_kv_tokens
        return self.decode_reads[self.lanes.read_shapes.index(shape)]

    def live_read(self, shape: ReadShape | None):
        """``expected_s``: Σ over every live request, prefills included, of its primary read."""
        if shape is None:
            return self.live_kv_tokens
        return self.live_reads[self.lanes.read_shapes.index(shape)]

    def windowed(self, window: int):
        """Windowed causal FLOPs of the step's prefill chunks (step.md §2, §6.3)."""
        return self.windowed_flops[self.lanes.windows.index(window)]

    def prefill_rows(self, window: int):
        """``expected_s``: the token count at which prefill attention runs, ``W / max_i w_i``
        (``W`` the step's causal work, ``w_i`` a prefill's work per query row): the one
        prefill's own rows for a single prefill, never raised by another request's rows."""
        if window > 0:
            i = self.lanes.windows.index(window)
            work, per_row = self.windowed_flops[i], self.window_row_max[i]
        else:
            work, per_row = self.causal_flops, self.row_max
        return jnp.where(per_row > 0, work / jnp.where(per_row > 0, per_row, 1.0), 0.0)


jax.tree_util.register_dataclass(
    StepBatch, data_fields=[f.name for f in dataclasses.fields(StepBatch)
                            if f.name not in ("lanes", "envelope")],
    meta_fields=["lanes", "envelope"])


@dataclass(frozen=True)
class StepInputs:
    """What every term reads (step.md §4, §5, §6.11): the step's counts with the quantities
    every layer shares (a pytree).

    ``batch``: the :class:`StepBatch`; ``sm_derate``: the slowdown of an SM budget below
    the chip's SMs (1 without one); ``r_g``, ``r_a``: the token ramp at the GEMM tokens and
    at the real tokens; ``has_dec``, ``has_pre``, ``has_live``: the step has a decode, a
    prefill, a live request (bool, the batch shape).
    """

    batch: StepBatch
    sm_derate: jax.Array
    r_g: jax.Array
    r_a: jax.Array
    has_dec: jax.Array
    has_pre: jax.Array
    has_live: jax.Array

    @classmethod
    def of(cls, batch: StepBatch, sm_count, eps, m_half) -> "StepInputs":
        """``batch`` with its SM derate (``sm_count`` SMs on the chip) and its token ramps
        (``eps``: the peak efficiency, ``m_half``: the half-efficiency token count)."""
        budget = batch.sm_budget
        sm_derate = jnp.where((budget > 0) & (budget < sm_count),
                              sm_count / jnp.where(budget > 0, budget, 1.0), 1.0)
        return cls(batch, sm_derate, laws.ramp(batch.t_gemm, eps, m_half),
                   laws.ramp(batch.t_real, eps, m_half), batch.decode_requests > 0,
                   batch.prefill_requests > 0, batch.n_live > 0)

    def expected_view(self, eps, m_half) -> "StepInputs":
        """The step ``expected_s`` prices a context-parallel plan with (see
        :meth:`StepBatch.expected_view`): its own token counts and ramps."""
        b = self.batch.expected_view()
        if b.pcp is None:
            return dataclasses.replace(self, batch=b)
        return dataclasses.replace(self, batch=b, r_g=laws.ramp(b.t_gemm, eps, m_half),
                                   r_a=laws.ramp(b.t_real, eps, m_half))

    def draft_pass(self, eps, m_half) -> "StepInputs":
        """A later draft pass (see :meth:`StepBatch.draft_pass`): one decode token per live
        request."""
        n = self.batch.n_live
        ramp = laws.ramp(n, eps, m_half)
        return StepInputs(self.batch.draft_pass(), self.sm_derate, ramp, ramp, n > 0, n < 0,
                          n > 0)


jax.tree_util.register_dataclass(
    StepInputs, data_fields=[f.name for f in dataclasses.fields(StepInputs)], meta_fields=[])
