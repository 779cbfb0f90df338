"""Composing the laws into one forward pass (spec step.md; ``expected_s`` from expected.md).

:func:`make_step_fn` closes over a pool's static :class:`~jkernel.plan.Plan` and returns the
pure function ``step_fn(params, batch) -> StepEstimate``. It is traceable (``jit``,
``vmap``, ``grad``), never branches on values, and never raises: a zero rate with positive
work gives ``+inf``; zero work costs zero (D5).

Shapes: ``batch`` holds request arrays of shape ``(R,)`` (``R`` = the bucket size) and
scalars; under ``vmap`` every field gains leading batch axes and so does the estimate.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import laws, terms
from .plan import DCP_SHARDABLE, LATENT_KINDS, Plan

__all__ = ["RESOURCES", "BatchArrays", "StepEstimate", "StepOptions", "make_step_fn"]

RESOURCES = ("sm", "hbm", "nvlink", "nic", "host")


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

    ``per_resource_s`` maps each of :data:`RESOURCES` to its total (zeros included; see
    :meth:`resources` for the spec's positive-only view). ``bottleneck`` is an index into
    :data:`RESOURCES` (strict ``>``, ties keep the earlier; ``host`` for the empty step).
    ``terms`` maps a layer kind's id (and :data:`jkernel.terms.STEP` for the LM head, the
    drafter and the host) to ``{term name: Term}``, each layer term already multiplied by
    its kind's layer count: for every resource the terms sum to ``per_resource_s`` (None on
    the packed fast paths, which return only the totals).
    """

    overlap_s: jax.Array
    no_overlap_s: jax.Array
    expected_s: jax.Array
    per_resource_s: dict
    bottleneck: jax.Array
    terms: dict | None = None

    @property
    def bottleneck_name(self) -> str:
        return RESOURCES[int(self.bottleneck)]

    def resources(self) -> dict[str, float]:
        """Positive per-resource totals of one (unbatched) estimate, in resource order."""
        out = {r: float(self.per_resource_s[r]) for r in RESOURCES}
        pos = {r: v for r, v in out.items() if v > 0}
        return pos if pos else {"host": out["host"]}


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


def _maximum(options: StepOptions, *values):
    if options.smooth_temperature <= 0 or len(values) == 1:
        out = values[0]
        for v in values[1:]:
            out = jnp.maximum(out, v)
        return out
    stacked = jnp.stack(jnp.broadcast_arrays(*values), axis=-1)
    tau = options.smooth_temperature * jax.lax.stop_gradient(jnp.sum(stacked, axis=-1))
    return laws.smooth_max(stacked, tau)


def make_step_fn(plan: Plan, options: StepOptions = StepOptions()):
    """Return ``step_fn(params, batch) -> StepEstimate`` for one pool's plan."""

    def step_fn(params, batch: BatchArrays) -> StepEstimate:
        return _price(plan, options, params, batch)

    def checked(params, batch: BatchArrays):
        """``(StepEstimate, negative)``: ``negative`` (int32, the batch shape) counts the
        requests with a negative ``scheduled`` or ``computed``, in the same pass over the
        requests (the bulk path's validity check; the estimate treats them as D32 says)."""
        return _price(plan, options, params, batch, check=True)

    def from_sums(params, batch: BatchArrays, sums: dict) -> StepEstimate:
        """The estimate from the request sums of :func:`sum_requests` (``batch`` gives the
        scalars; its request arrays may be None). Raises :class:`NeedsRequests` for a plan
        that reads per-request arrays after the reduction (the DCP context gather)."""
        return _price(plan, options, params, batch, sums=sums)

    step_fn.checked = checked
    step_fn.from_sums = from_sums
    step_fn.plan = plan
    step_fn.options = options
    return step_fn


class NeedsRequests(ValueError):
    """A plan whose step reads per-request arrays after the request reduction."""


def _request_lanes(plan: Plan, s_in, c_in, mask, thr, dt, it=None, check: bool = False
                   ) -> dict:
    """Per-request quantities of step.md §4 (elementwise: any shape of requests).

    Returns lane key → array of the request shape; the step sums each over the requests
    (the ``("row_max", …)`` keys it maximises instead). Keys are static: names for the token
    counts (and, on context-parallel plans, ``withheld``, ``pcp_rows``, ``pcp_pairs``,
    ``context``, ``prefill_context``), a :class:`~jkernel.terms.ReadShape` for each distinct
    shaped decode read, ``("live", shape)`` for every live request's read,
    ``("window", w)`` for each window's causal FLOPs and ``("row_max", w)`` for the largest
    prefill row's work.

    ``it``: an integer dtype (int64) for the lanes whose per-request values are whole
    numbers below 2³⁴ (token counts, request counts, contexts, window-capped reads): they
    are computed and summed in integers from the int inputs, where XLA's CPU loop
    vectorises the sum (a float sum is one serial chain). Every partial sum of such a lane
    is an integer below 2⁵³, so its float sum would be exact and equals the integer sum
    converted: the two paths price alike to the bit. The other lanes (causal FLOPs, PCP
    splits, sparse and DCP reads) are in ``dt``. ``it=None`` (or float inputs) computes
    every lane in ``dt``.
    ``check``: add ``"negative"``, the count of requests with a negative ``scheduled`` or
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
    if plan.pcp > 1:
        s_loc = laws.pcp_local_tokens(s, plan.pcp, plan.dcp)
        pairs = laws.pcp_causal_pairs(s, c, plan.pcp, plan.dcp)
        # the spec's busiest-rank chunks: the windowed lanes read them on both the edges
        # and expected_s (refinement 8 balances full attention's work, not a window's;
        # no shipped PCP pool has a sliding window)
        chunk_s, chunk_c = laws.pcp_busiest_chunks(s, c, plan.pcp, plan.dcp)
    else:
        pairs = laws.causal_pairs(s, c)
        chunk_s, chunk_c = s[..., None], c[..., None]
    # decode_requests and decode_tokens follow from these (see _Batch): fewer lanes, one
    # pass over the requests with less work per request
    lanes: dict = {
        "tokens": ws, "n_live": count(live),
        "nonuniform": count(live & (ws != plan.uniform_decode_width)),
        "prefill_tokens": (jnp.where(pre, s_loc, zero) if plan.pcp > 1
                           else jnp.where(pre, ws, wz)),
        "prefill_requests": count(pre),
        "decode_kv_tokens": jnp.where(dec, wctx, wz),
    }
    if plan.dcp > 1 and _dcp_kinds(plan, latent=False):
        lanes["context"] = count(live & (wc > 0))
    if plan.dcp > 1 and _dcp_kinds(plan, latent=True):
        # expected_s (refinement 8): vLLM's chunking of the prefills' cached context
        lanes["prefill_context"] = count(pre & (wc > 0))
        lanes[("row_max", "context")] = jnp.where(pre, wc, wz)
    lanes["causal_flops"] = jnp.where(pre, pairs, zero)
    if plan.pcp > 1:
        lanes["withheld"] = jnp.where(pre, s - s_loc, zero)
    shapes = _read_shapes(plan)

    def read(shape, whole_at, at, where):
        """One shaped read lane at context ``at`` (``whole_at``: the same as a whole
        number): in integers when it is a window cap alone."""
        if ints and _integral(shape):
            return jnp.where(where, jnp.minimum(whole_at, shape.window), wz)
        return jnp.where(where, terms.primary_read(shape, at), zero)

    for shape in shapes:
        lanes[shape] = read(shape, wctx, ctx, dec)
    if plan.draft_kinds:
        # a later draft pass: every live request runs one token at its context + 1
        lanes["draft_context"] = jnp.where(live, wctx + 1, wz)
        for shape in shapes:
            lanes[shape.for_draft()] = read(shape, wctx + 1, ctx + 1.0, live)
    for window in _windows(plan):
        lanes[("window", window)] = laws.windowed_causal_flops(chunk_s, chunk_c, window,
                                                               mask=pre[..., None])
    # expected_s (refinement 6): every live request's read of its cache, prefills included
    lanes["live_kv_tokens"] = jnp.where(live, wctx, wz)
    for shape in shapes:
        lanes[("live", shape)] = read(shape, wctx, ctx, live)
    # expected_s (refinement 7): each prefill's causal work per row, maximised (not summed)
    if plan.pcp > 1:
        # expected_s (refinement 8): vLLM's balanced split of a prefill over the PCP ranks
        # (see _Batch.expected_view): 2·h rows of h = ceil(s/(2·pcp)) each, at prefix c
        half = jnp.ceil(s / (2 * plan.pcp))
        lanes["pcp_rows"] = jnp.where(pre, jnp.maximum(2.0 * half, thr), zero)
        lanes["pcp_pairs"] = jnp.where(pre, 8.0 * half * (c + plan.pcp * half), zero)
        lanes[("row_max", 0)] = jnp.where(pre, 4.0 * (c + plan.pcp * half), zero)
    else:
        lanes[("row_max", 0)] = jnp.where(pre, 4 * wc + 2 * ws, wz)   # causal_pairs / s
    for window in _windows(plan):
        chunk_rows = jnp.sum(chunk_s, axis=-1)
        lanes[("row_max", window)] = jnp.where(
            pre & (chunk_rows > 0), laws.windowed_causal_flops(chunk_s, chunk_c, window)
            / jnp.where(chunk_rows > 0, chunk_rows, 1.0), zero)
    if check:
        lanes["negative"] = neg
    return {k: v if jnp.issubdtype(v.dtype, jnp.integer) else v.astype(dt)
            for k, v in lanes.items()}


def _integral(shape) -> bool:
    """A decode read that is an integer function of the context: a window cap alone."""
    return shape.window > 0 and shape.sparse_bound <= 0 and shape.dcp <= 1


def _read_shapes(plan: Plan) -> list:
    """Each distinct shaped decode read of the plan's primary attentions."""
    out: list = []
    for kind in plan.kinds:
        if kind.attention is not None:
            shape = terms.read_shape(plan, kind.attention)
            if shape is not None and shape not in out:
                out.append(shape)
    return out


def _dcp_kinds(plan: Plan, latent: bool) -> bool:
    """Whether the plan has a DCP-sharded primary attention that is latent (or not)."""
    return any(k.attention is not None and k.attention.kind in DCP_SHARDABLE
               and (k.attention.kind in LATENT_KINDS) == latent for k in plan.kinds)


def _windows(plan: Plan) -> list[int]:
    return sorted({k.attention.window for k in plan.kinds
                   if k.attention is not None and k.attention.window > 0})


def sum_requests(plan: Plan, batch: BatchArrays, dt, check: bool = False) -> dict:
    """Σ over the request axis (the last) of every lane, in ONE variadic reduction.

    XLA fuses a tuple-reduce into a single pass over the requests, where separate sums each
    re-read them; with leading batch axes (the bulk path) the same reduction runs across
    all batches at once. The whole-number lanes are summed in int64 (see
    :func:`_request_lanes`) when float64 is on, and every sum is returned in ``dt``, except
    ``"negative"`` (``check``: int32 count of requests with a negative input). The first
    half of the step, which :func:`make_step_fn`'s ``from_sums`` completes.
    """
    thr = jnp.asarray(batch.decode_threshold)[..., None]
    it = jnp.int64 if jax.config.jax_enable_x64 else None
    lanes = _request_lanes(plan, jnp.asarray(batch.scheduled), jnp.asarray(batch.computed),
                           jnp.asarray(batch.mask), thr, dt, it, check)
    names = list(lanes)
    # the per-row maxima reduce by max (their values are ≥ 0, so 0 is the identity), the
    # rest by sum, all in the same single pass
    is_max = tuple(isinstance(n, tuple) and n[0] == "row_max" for n in names)
    shape = jnp.broadcast_shapes(*(v.shape for v in lanes.values()))
    ops = tuple(jnp.broadcast_to(lanes[n], shape) for n in names)
    init = tuple(jnp.zeros((), x.dtype) for x in ops)
    sums = jax.lax.reduce(ops, init, lambda a, b: tuple(
        jnp.maximum(x, y) if m else x + y for x, y, m in zip(a, b, is_max)),
        (len(shape) - 1,))
    return {n: v if n == "negative" else v.astype(dt) for n, v in zip(names, sums)}


class _Batch:
    """Per-step reductions over the request arrays (step.md §4), computed in one pass.

    Every per-request quantity a step needs — token counts, the decode reads of each distinct
    primary-attention shape and the windowed causal FLOPs of each window — is evaluated per
    request (a min or ceil of a sum is not the sum of the mins) and summed together.
    """

    def __init__(self, plan: Plan, batch: BatchArrays, dt, check: bool = False, sums=None):
        self._batch, self._dt = batch, dt
        self.sums = sums = (sum_requests(plan, batch, dt, check) if sums is None
                            else dict(sums))
        self.negative = sums.pop("negative", None)
        self.tokens = sums["tokens"]
        self.n_live = sums["n_live"]
        self.any_context = sums["context"] > 0 if "context" in sums else None  # DCP only
        self.uniform = (self.n_live > 0) & (sums["nonuniform"] <= 0)
        self.causal_flops = sums["causal_flops"]
        self.prefill_tokens = sums["prefill_tokens"]
        self.prefill_requests = sums["prefill_requests"]
        withheld = sums.get("withheld", jnp.zeros_like(self.tokens))
        # every live request is a prefill or a decode; a prefill's tokens are its rank-local
        # share plus what PCP withholds
        self.decode_requests = self.n_live - self.prefill_requests
        self.decode_tokens = self.tokens - self.prefill_tokens - withheld
        self.decode_kv_tokens = sums["decode_kv_tokens"]
        self.t_real = self.tokens - withheld
        self.t_pad = jnp.maximum(jnp.asarray(batch.pad_tokens).astype(dt), 0.0)
        self.t_gemm = self.t_real + self.t_pad
        self.empty = (self.tokens <= 0) & (self.t_pad <= 0)
        self.sm_budget = jnp.asarray(batch.sm_budget).astype(dt)
        self.thr = jnp.asarray(batch.decode_threshold).astype(dt)
        #: True on the view expected_s prices a context-parallel plan with
        self.envelope = False

    def expected_view(self, plan: Plan) -> "_Batch":
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
          monotone form (:func:`jkernel.terms.context_parallel_collectives`); a GQA pool's
          DCP rows (every token once any request has context) are monotone already.
        """
        v = copy.copy(self)
        v.envelope = True
        if plan.pcp > 1:
            s = self.sums
            v.t_real = self.tokens - self.prefill_tokens - s["withheld"] + s["pcp_rows"]
            v.t_gemm = v.t_real + self.t_pad
            v.prefill_tokens = s["pcp_rows"]
            v.causal_flops = s["pcp_pairs"]
        return v

    def prefill_context(self):
        """``expected_s`` (DCP, latent): ``(Σ c, count, max c)`` over the prefills with a
        cached context. Σ c is what the live reads hold beyond the decodes' contexts and the
        prefills' own tokens (no lane of its own)."""
        s = self.sums
        prefill_s = s["prefill_tokens"] + s.get("withheld", jnp.zeros_like(self.tokens))
        total = s["live_kv_tokens"] - self.decode_kv_tokens - prefill_s
        return (jnp.maximum(total, 0.0), s["prefill_context"], s[("row_max", "context")])

    def requests(self):
        """``(s, c, prefill mask)`` per request, for the MLA context gather (DCP only)."""
        b, dt = self._batch, self._dt
        if b.scheduled is None:
            raise NeedsRequests("this plan reads per-request arrays after the reduction")
        s_in = jnp.asarray(b.scheduled).astype(dt)
        live = jnp.asarray(b.mask) & (s_in > 0)
        s = jnp.where(live, s_in, 0.0)
        c = jnp.where(live, jnp.maximum(jnp.asarray(b.computed).astype(dt), 0.0), 0.0)
        thr = jnp.asarray(b.decode_threshold).astype(dt)[..., None]
        return s, c, live & (s > thr)

    def decode_read(self, shape):
        """Σ over decodes of the primary read per request (step.md §6.3); ``shape`` from
        :func:`jkernel.terms.read_shape` (None: the plain context)."""
        return self.decode_kv_tokens if shape is None else self.sums[shape]

    def windowed(self, window: int):
        """Windowed causal FLOPs of the step's prefill chunks (step.md §2, §6.3)."""
        return self.sums[("window", window)]

    def live_read(self, shape):
        """``expected_s``: Σ over every live request, prefills included, of its primary read."""
        return self.sums["live_kv_tokens"] if shape is None else self.sums[("live", shape)]

    def prefill_rows(self, window: int):
        """``expected_s``: the token count at which prefill attention runs, ``W / max_i w_i``
        (``W`` the step's causal work, ``w_i`` a prefill's work per query row): the one
        prefill's own rows for a single prefill, never raised by another request's rows."""
        work = self.windowed(window) if window > 0 else self.causal_flops
        per_row = self.sums[("row_max", window if window > 0 else 0)]
        return jnp.where(per_row > 0, work / jnp.where(per_row > 0, per_row, 1.0), 0.0)


class _Step:
    """One batch's token counts with the quantities every layer shares (§4, §5, §6.11)."""

    def __init__(self, plan: Plan, c: terms.Constants, batch: BatchArrays, check: bool = False,
                 sums=None):
        self.b = b = _Batch(plan, batch, c.dt, check, sums)
        sm_count = c.params["sm_count"]
        budget = b.sm_budget
        self.sm_derate = jnp.where((budget > 0) & (budget < sm_count),
                                   sm_count / jnp.where(budget > 0, budget, 1.0), 1.0)
        self.r_g = laws.ramp(b.t_gemm, c.eps, c.m_half)
        self.r_a = laws.ramp(b.t_real, c.eps, c.m_half)
        self.has_dec = b.decode_requests > 0
        self.has_pre = b.prefill_requests > 0
        self.has_live = b.n_live > 0

    def expected_view(self, plan: Plan, c: terms.Constants) -> "_Step":
        """The step ``expected_s`` prices a context-parallel plan with (see
        :meth:`_Batch.expected_view`): its own token counts and ramps."""
        st = copy.copy(self)
        st.b = b = self.b.expected_view(plan)
        if plan.pcp > 1:
            st.r_g = laws.ramp(b.t_gemm, c.eps, c.m_half)
            st.r_a = laws.ramp(b.t_real, c.eps, c.m_half)
        return st

    def later_draft_pass(self, c: terms.Constants) -> "_Step":
        """The token counts of a later draft pass: one decode token per live request."""
        later = _Step.__new__(_Step)
        n = self.b.n_live
        later.b = _DraftBatch(self.b)
        later.sm_derate, later.has_dec, later.has_pre = self.sm_derate, n > 0, n < 0
        later.has_live = n > 0
        later.r_g = later.r_a = laws.ramp(n, c.eps, c.m_half)
        return later


class _DraftBatch:
    """Token counts of a later draft pass: every live request decodes one token at its
    context after the target pass. Quacks like :class:`_Batch` for the layer terms."""

    #: never the context-parallel view (draft passes run on the target pass's view)
    envelope = False

    def __init__(self, b: _Batch):
        n = b.n_live
        zero = jnp.zeros_like(n)
        self._b = b
        self.tokens = self.t_real = self.t_gemm = self.decode_tokens = n
        self.decode_requests = self.n_live = n
        self.t_pad = self.prefill_requests = self.prefill_tokens = self.causal_flops = zero
        self.decode_kv_tokens = b.sums["draft_context"]
        self.any_context = n > 0
        self.empty = n <= 0
        self.uniform = n > 0
        self.sm_budget = b.sm_budget

    def decode_read(self, shape):
        return self.decode_kv_tokens if shape is None else self._b.sums[shape.for_draft()]

    live_read = decode_read                  # every live request of a draft pass decodes

    def windowed(self, window: int):
        return jnp.zeros_like(self.tokens)

    def prefill_rows(self, window: int):
        return jnp.zeros_like(self.tokens)

    def requests(self):
        """No prefill rows: nothing to gather (step.md §6.9)."""
        s, c, pre = self._b.requests()
        return jnp.zeros_like(s), jnp.zeros_like(c), jnp.zeros_like(pre)


class _Priced(NamedTuple):
    """Every term of one step: ``layers[kind id][term]`` per layer, ``step[term]`` once."""

    layers: dict
    step: dict


def _terms(plan: Plan, options: StepOptions, c: terms.Constants, st: _Step) -> _Priced:
    """Price every named term of the step (the one list both composers read)."""
    opts = _Opts(options)
    # refinement 8: a context-parallel plan prices expected_s on its own view of the step
    # (vLLM's PCP split, the DCP envelope); the edges keep the spec's counts
    cp = plan.pcp > 1 or (plan.dcp > 1 and _dcp_kinds(plan, latent=True))
    ex = st.expected_view(plan, c) if options.expected_refinements and cp else st

    def both(edge_fn):
        edge = edge_fn(st)
        if ex is st:
            return edge
        exp = edge_fn(ex)
        if isinstance(edge, dict):
            return {n: t._replace(expected_s=exp[n].expected_s) for n, t in edge.items()}
        return edge._replace(expected_s=exp.expected_s)

    layers = {kind.id: both(lambda s, k=kind: terms.layer_terms(k, plan, opts, c, s))
              for kind in plan.kinds}
    step = {"lm head": both(lambda s: terms.lm_head(plan, opts, c, s))}
    if options.expected_refinements and plan.draft_kinds:
        first = {kid: _sum_expected(layers[kid], c.zero) for kid, _ in plan.draft_kinds}
        step["draft passes"] = terms.draft_passes(plan, opts, c, ex, first,
                                                  lambda: ex.later_draft_pass(c))
    step["kernel gap"] = terms.kernel_gap(plan, c, st)
    step["host graph replay"] = terms.graph_replay(plan, c, st)
    step["host kernel launches"] = terms.kernel_launches(plan, c, st)
    step["host serial"] = terms.host_serial(plan, c, st)
    return _Priced(layers, step)


class _Opts:
    """StepOptions with its maximum, as the term functions take them."""

    def __init__(self, options: StepOptions):
        self.expected_refinements = options.expected_refinements
        self.expected_routed_max = options.expected_routed_max
        self.mx = lambda *v: _maximum(options, *v)  # noqa: E731


def _sum_expected(layer: dict, zero):
    out = zero
    for t in layer.values():
        out = out + t.expected_s
    return out


def _edges(plan: Plan, options: StepOptions, priced: _Priced, b: _Batch, zero):
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
            if name in terms.SERIAL_TERMS:
                serial = serial + t.sm_s + t.hbm_s
                SM, HBM = SM + kind.count * t.sm_s, HBM + kind.count * t.hbm_s
                continue
            dense = [d + x for d, x in zip(dense, (t.sm_s, t.hbm_s, t.nvlink_s, t.nic_s))]
        stages += kind.count * (_maximum(options, *dense) + serial)
        SM += kind.count * dense[0]
        HBM += kind.count * dense[1]
        NVL += kind.count * dense[2]
        NIC += kind.count * dense[3]
    head = priced.step["lm head"]
    SM, HBM = SM + head.sm_s, HBM + head.hbm_s
    host = priced.step["host graph replay"].host_s + priced.step["host kernel launches"].host_s
    keep = ~b.empty
    SM, HBM, NVL, NIC = (jnp.where(keep, x, 0.0) for x in (SM, HBM, NVL, NIC))
    no_overlap = SM + HBM + NVL + NIC + host
    overlap = jnp.where(keep, jnp.minimum(stages + _maximum(options, head.sm_s, head.hbm_s)
                                          + host, no_overlap), host)
    return overlap, no_overlap, {"sm": SM, "hbm": HBM, "nvlink": NVL, "nic": NIC, "host": host}


def _expected(plan: Plan, options: StepOptions, priced: _Priced, b: _Batch, zero):
    """``expected_s = max(gpu_s, host_s) + host_serial_s`` over the named terms
    (expected.md): ``gpu_s`` sums every layer term and the GPU step terms (0 for an empty
    step), ``host_s`` the host terms."""
    gpu = zero
    for kind in plan.kinds:
        gpu += kind.count * _sum_expected(priced.layers[kind.id], zero)
    for name in terms.GPU_STEP_TERMS:
        if name in priced.step:
            gpu += priced.step[name].expected_s
    gpu = jnp.where(~b.empty, gpu, 0.0)
    host = zero
    for name in terms.HOST_TERMS:
        host = host + priced.step[name].expected_s
    return _maximum(options, gpu, host) + priced.step["host serial"].expected_s


def _published(plan: Plan, priced: _Priced, b: _Batch) -> dict:
    """The terms as :attr:`StepEstimate.terms`: each layer term × its kind's count, GPU
    terms zero for an empty step (as the totals are)."""
    keep = ~b.empty
    out = {kind.id: {name: t.scaled(kind.count).where(keep)
                     for name, t in priced.layers[kind.id].items()} for kind in plan.kinds}
    out[terms.STEP] = {name: (t if name in terms.HOST_TERMS or name == "host serial"
                              else t.where(keep)) for name, t in priced.step.items()}
    return out


def _price(plan: Plan, options: StepOptions, params, batch: BatchArrays,
           check: bool = False, sums=None):
    """The step's estimate; with ``check``, ``(estimate, negative)`` where ``negative`` is
    the int32 count of requests (per batch) with a negative ``scheduled`` or ``computed``,
    counted in the same single pass over the requests that prices them."""
    c = terms.Constants(plan, params)
    st = _Step(plan, c, batch, check, sums)
    b = st.b
    priced = _terms(plan, options, c, st)
    overlap, no_overlap, per = _edges(plan, options, priced, b, c.zero)
    expected = _expected(plan, options, priced, b, c.zero)
    totals = jnp.stack(jnp.broadcast_arrays(*(per[r] for r in RESOURCES)), axis=-1)
    bottleneck = jnp.where(b.empty, len(RESOURCES) - 1, jnp.argmax(totals, axis=-1))
    est = StepEstimate(overlap_s=overlap, no_overlap_s=no_overlap, expected_s=expected,
                       per_resource_s=per, bottleneck=bottleneck.astype(jnp.int32),
                       terms=_published(plan, priced, b))
    return (est, b.negative) if check else est
