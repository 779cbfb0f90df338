"""Composing the laws into one forward pass (spec step.md; ``expected_s`` from expected.md).

:func:`make_step_fn` closes over a pool's static :class:`~jkernel.plan.Plan` and returns the
pure function ``step_fn(params, batch) -> StepEstimate``. It is traceable (``jit``,
``vmap``, ``grad``), never branches on values, and never raises: a zero rate with positive
work gives ``+inf``; zero work costs zero (D5).

Shapes: ``batch`` holds request arrays of shape ``(R,)`` (``R`` = the bucket size) and
scalars; under ``vmap`` every field gains leading batch axes and so does the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import laws
from .plan import (EAGER, FULL, PIECEWISE, AttentionPlan, CollectiveKey, GroupPlan, KindPlan,
                   Plan)

__all__ = ["RESOURCES", "BatchArrays", "StepEstimate", "StepOptions", "make_step_fn"]

RESOURCES = ("sm", "hbm", "nvlink", "nic", "host")
_SHARDABLE = ("gqa", "mla", "sparse_mla")
_LATENT = ("mla", "sparse_mla")


class BatchArrays(NamedTuple):
    """A batch as padded arrays (a pytree).

    ``scheduled``, ``computed``, ``prompt_len``: int arrays ``(R,)`` of tokens run this step,
    tokens already in the KV cache, and the prompt length (carried, not read). ``mask``:
    bool ``(R,)``, True for real requests (a request with ``scheduled = 0`` is padding anyway,
    D32). ``decode_threshold``, ``sm_budget``, ``pad_tokens``: int scalars (step.md §1.1).
    """

    scheduled: jax.Array
    computed: jax.Array
    prompt_len: jax.Array
    mask: jax.Array
    decode_threshold: jax.Array
    sm_budget: jax.Array
    pad_tokens: jax.Array


class StepEstimate(NamedTuple):
    """The price of one step, float seconds (arrays under ``vmap``).

    ``per_resource_s`` maps each of :data:`RESOURCES` to its total (zeros included; see
    :meth:`resources` for the spec's positive-only view). ``bottleneck`` is an index into
    :data:`RESOURCES` (strict ``>``, ties keep the earlier; ``host`` for the empty step).
    """

    overlap_s: jax.Array
    no_overlap_s: jax.Array
    expected_s: jax.Array
    per_resource_s: dict
    bottleneck: jax.Array

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
    ``expected_refinements``: expected.md's structure refinements 1–5 (True by default).
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

    step_fn.plan = plan
    step_fn.options = options
    return step_fn


def _read_signature(att: AttentionPlan) -> tuple:
    return (att.kind, att.window, att.index_topk, att.compress_ratio)


def _request_lanes(plan: Plan, s_in, c_in, mask, thr, dt) -> dict:
    """Per-request quantities of step.md §4 (elementwise: any shape of requests).

    Returns name → array of the request shape; the step sums each over the requests.
    """
    s_in = s_in.astype(dt)
    live = mask & (s_in > 0)                                  # D32: scheduled 0 is padding
    s = jnp.where(live, s_in, 0.0)
    c = jnp.where(live, jnp.maximum(c_in.astype(dt), 0.0), 0.0)
    ctx = s + c            # > 0 for every live request, so the walk skips none of them
    pre = live & (s > thr)
    dec = live & ~pre
    zero = jnp.zeros_like(s)
    if plan.pcp > 1:
        s_loc = laws.pcp_local_tokens(s, plan.pcp, plan.dcp)
        pairs = laws.pcp_causal_pairs(s, c, plan.pcp, plan.dcp)
        chunk_s, chunk_c = laws.pcp_busiest_chunks(s, c, plan.pcp, plan.dcp)
    else:
        s_loc = s
        pairs = laws.causal_pairs(s, c)
        chunk_s, chunk_c = s[..., None], c[..., None]
    # decode_requests and decode_tokens follow from these (see _Batch): fewer lanes, one
    # pass over the requests with less work per request
    lanes = {
        "tokens": s, "n_live": live,
        "nonuniform": live & (s != plan.uniform_decode_width),
        "causal_flops": jnp.where(pre, pairs, zero),
        "prefill_tokens": jnp.where(pre, s_loc, zero),
        "prefill_requests": pre,
        "decode_kv_tokens": jnp.where(dec, ctx, zero),
    }
    if plan.dcp > 1:
        lanes["context"] = live & (c > 0)
    if plan.pcp > 1:
        lanes["withheld"] = jnp.where(pre, s - s_loc, zero)
    for name, att in _read_lanes(plan).items():
        lanes[name] = jnp.where(dec, _primary_read(plan, att, ctx), zero)
    if plan.draft_kinds:
        # a later draft pass: every live request runs one token at its context + 1
        lanes["draft_context"] = jnp.where(live, ctx + 1.0, zero)
        for name, att in _read_lanes(plan).items():
            lanes["draft_" + name] = jnp.where(live, _primary_read(plan, att, ctx + 1.0), zero)
    for window in _windows(plan):
        lanes[f"win{window}"] = laws.windowed_causal_flops(chunk_s, chunk_c, window,
                                                           mask=pre[..., None])
    return {k: v.astype(dt) for k, v in lanes.items()}


def _primary_read(plan: Plan, att: AttentionPlan, ctx):
    """Tokens one decode reads from the primary attention's cache (step.md §6.3)."""
    read = ctx
    if att.kind == "swa" and att.window > 0:
        read = jnp.minimum(read, att.window)                                     # D3
    if att.kind == "sparse_mla":
        t = att.index_topk if att.index_topk > 0 else att.window
        if t > 0:
            read = laws.sparse_read(read, t, att.compress_ratio)
    if plan.dcp > 1 and att.kind in _SHARDABLE:
        read = laws.dcp_local(laws.round_half_up(read), plan.dcp, plan.interleave)
    return read


def _shaped_read(att: AttentionPlan, plan: Plan) -> bool:
    return ((att.kind == "swa" and att.window > 0)
            or (att.kind == "sparse_mla" and (att.index_topk > 0 or att.window > 0))
            or (plan.dcp > 1 and att.kind in _SHARDABLE))


def _read_lanes(plan: Plan) -> dict:
    """Lane name → attention, for each distinct primary read that is not the plain context."""
    out: dict = {}
    for kind in plan.kinds:
        att = kind.attention
        if att is not None and _shaped_read(att, plan):
            name = "read_%s_%d_%d_%d" % _read_signature(att)
            out.setdefault(name, att)
    return out


def _windows(plan: Plan) -> list[int]:
    return sorted({k.attention.window for k in plan.kinds
                   if k.attention is not None and k.attention.window > 0})


def _sum_requests(plan: Plan, batch: BatchArrays, dt) -> dict:
    """Σ over the request axis (the last) of every lane, in ONE variadic reduction.

    XLA fuses a tuple-reduce into a single pass over the requests, where separate sums each
    re-read them; with leading batch axes (the bulk path) the same reduction runs across
    all batches at once.
    """
    thr = jnp.asarray(batch.decode_threshold).astype(dt)[..., None]
    lanes = _request_lanes(plan, jnp.asarray(batch.scheduled), jnp.asarray(batch.computed),
                           jnp.asarray(batch.mask), thr, dt)
    names = list(lanes)
    ops = tuple(jnp.broadcast_to(lanes[n], lanes["tokens"].shape) for n in names)
    init = tuple(jnp.zeros((), dt) for _ in names)
    sums = jax.lax.reduce(ops, init, lambda a, b: tuple(x + y for x, y in zip(a, b)),
                          (ops[0].ndim - 1,))
    return dict(zip(names, sums))


class _Batch:
    """Per-step reductions over the request arrays (step.md §4), computed in one pass.

    Every per-request quantity a step needs — token counts, the decode reads of each distinct
    primary-attention shape and the windowed causal FLOPs of each window — is evaluated per
    request (a min or ceil of a sum is not the sum of the mins) and summed together.
    """

    def __init__(self, plan: Plan, batch: BatchArrays, dt):
        self._batch, self._dt = batch, dt
        self.sums = sums = _sum_requests(plan, batch, dt)
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

    def requests(self):
        """``(s, c, prefill mask)`` per request, for the MLA context gather (DCP only)."""
        b, dt = self._batch, self._dt
        s_in = jnp.asarray(b.scheduled).astype(dt)
        live = jnp.asarray(b.mask) & (s_in > 0)
        s = jnp.where(live, s_in, 0.0)
        c = jnp.where(live, jnp.maximum(jnp.asarray(b.computed).astype(dt), 0.0), 0.0)
        thr = jnp.asarray(b.decode_threshold).astype(dt)[..., None]
        return s, c, live & (s > thr)

    def decode_read(self, plan: Plan, att: AttentionPlan):
        """Σ over decodes of the primary read per request (step.md §6.3)."""
        if not _shaped_read(att, plan):
            return self.decode_kv_tokens
        return self.sums["read_%s_%d_%d_%d" % _read_signature(att)]

    def windowed(self, window: int):
        """Windowed causal FLOPs of the step's prefill chunks (step.md §2, §6.3)."""
        return self.sums[f"win{window}"]


class _Constants:
    """The params a step reads, lifted once per call (step.md §3), and the two lookups every
    layer uses: the collective law on NVLink or the NIC, and the attention decode pair."""

    def __init__(self, plan: Plan, params):
        self.params = params
        # the compute rate sustained in the engine (compute_derate ∈ (0, 1], 1 until a
        # step-trace fit: the chip's clock under a whole model's load, below the isolated
        # kernels' of the profiles)
        self.P = params["peak_flops_per_s"] * params["compute_derate"]
        self.dt = jnp.result_type(self.P)
        self.zero = jnp.zeros((), self.dt)
        self.B_hbm = params["hbm_bytes_per_s"] * params["hbm_derate"]
        self.eps, self.m_half = params[plan.gemm_names[0]], params[plan.gemm_names[1]]
        self.n_half = params[plan.gemm_names[2]] if plan.shape_aware else self.zero
        self.k_half = params[plan.gemm_names[3]] if plan.shape_aware else self.zero
        imb = params.get("moe_routing_imbalance_median", self.zero)
        self.imb = jnp.where(imb > 0, imb, 1.0)
        self.ratio = params["nvlink_bytes_per_s"] / params["nic_bytes_per_s"]
        self.plan = plan

    def coll(self, key: CollectiveKey | None, group: GroupPlan, nbytes, a2a: bool):
        """One collective launch → ``(nvlink_s, nic_s)``, priced by the measured law; a group
        that crosses nodes pays the span on its bytes (step.md §6.8)."""
        if key is None:
            return self.zero, self.zero
        p = self.params
        law = lambda x: laws.collective_time(x, p[key.floor], p[key.peak],  # noqa: E731
                                             p[key.transition])
        if group.crosses:
            span = (laws.a2a_span if a2a else laws.ring_span)(group.width, group.per_node,
                                                              self.ratio)
            return self.zero, law(nbytes * span)
        return law(nbytes), self.zero

    def pair(self, kind: str):
        """``(floor_s, rate)`` of decode attention for ``kind`` (step.md §3, ``pair``)."""
        p = self.params
        f0, r0 = p["attention_decode_floor"], p["attention_decode_rate"]
        for k, fn, rn in self.plan.decode_pairs[1:]:
            if k == kind:
                use = p[rn] > 0
                return jnp.where(use, p[fn], f0), jnp.where(use, p[rn], r0)
        return f0, r0


class _Step:
    """One batch's token counts with the quantities every layer shares (§4, §5, §6.11)."""

    def __init__(self, plan: Plan, c: _Constants, batch: BatchArrays):
        self.b = b = _Batch(plan, batch, c.dt)
        sm_count = c.params["sm_count"]
        budget = b.sm_budget
        self.sm_derate = jnp.where((budget > 0) & (budget < sm_count),
                                   sm_count / jnp.where(budget > 0, budget, 1.0), 1.0)
        self.r_g = laws.ramp(b.t_gemm, c.eps, c.m_half)
        self.r_a = laws.ramp(b.t_real, c.eps, c.m_half)
        self.has_dec = b.decode_requests > 0
        self.has_pre = b.prefill_requests > 0


class _LayerCost(NamedTuple):
    """One layer of one kind, per rank, seconds (step.md §6.11 and expected.md)."""

    dense_sm: jax.Array
    dense_hbm: jax.Array
    routed_sm: jax.Array
    routed_hbm: jax.Array
    nvlink: jax.Array
    nic: jax.Array
    expected: jax.Array


def _layer(kind: KindPlan, plan: Plan, options: StepOptions, c: _Constants, st: _Step
           ) -> _LayerCost:
    """Price one layer of ``kind`` (step.md §6.1–§6.11), and its ``expected_s`` share."""
    b, P, B_hbm, zero = st.b, c.P, c.B_hbm, c.zero
    derate, r_g, r_a = st.sm_derate, st.r_g, st.r_a
    refine = options.expected_refinements
    mx = lambda *v: _maximum(options, *v)  # noqa: E731
    tp, att = plan.tp, kind.attention
    gemm_flops = dense_shaped_s = weight_bytes = zero
    routed_sm = routed_hbm = zero
    attn_sm_s = attn_hbm_s = attn_flops = kv_fallback = recurrent_s = zero
    nvl = nic = expected = zero

    # -- dense GEMMs (§6.1); expected: each GEMM at max(compute, memory) ----------------
    for g in kind.gemms:
        n_r, k_r = (g.n / tp, g.k) if g.shard_n else (g.n, g.k / tp)
        frac = 1.0 / tp
        if refine:                                    # refinement 1: vLLM's real sharding
            frac = g.vllm_rank_fraction
            if frac >= 1.0:
                n_r, k_r = g.n, g.k
            elif g.shard_n:
                n_r = g.n * frac
        if plan.shape_aware:
            e_spec = laws.eff_shaped(b.t_gemm, (g.n / tp if g.shard_n else g.n),
                                     (g.k if g.shard_n else g.k / tp), c.eps, c.m_half,
                                     c.n_half, c.k_half)
            dense_shaped_s += laws.compute_time(b.t_gemm * g.flops_per_token / tp, P, e_spec)
            e_exp = laws.eff_shaped(b.t_gemm, n_r, k_r, c.eps, c.m_half, c.n_half, c.k_half)
        else:
            e_exp = r_g
        compute, memory = laws.gemm_times(b.t_gemm, n_r, k_r, g.weight_bytes * frac, P, B_hbm,
                                          e_exp, 2.0 if refine else 0.0)   # refinement 2
        expected += mx(compute * derate, memory)
    if not plan.shape_aware:
        gemm_flops += b.t_gemm * kind.dense_flops_per_token / tp
    weight_bytes += kind.dense_weight_bytes / tp

    # -- mixture of experts (§6.2) ---------------------------------------------------------
    if kind.moe:
        routed_flops, routed_bytes = laws.routed_expert_work(
            b.t_gemm * plan.funnel, kind.top_k, plan.local_expert_share,
            kind.expert_flops_per_token_per_expert, c.imb, plan.dp_slice,
            plan.physical_experts, plan.experts_per_rank, kind.expert_weight_bytes_per_expert,
            plan.expert_tensor_shards)
        routed_sm = laws.safe_div(routed_flops, P * r_g) * derate
        routed_hbm = laws.memory_time(routed_bytes, B_hbm)
        shared_flops = b.t_gemm * kind.shared_expert_flops_per_token / tp
        gemm_flops += shared_flops                    # shared experts price as dense
        weight_bytes += kind.shared_expert_weight_bytes / tp
        expected += (mx(routed_sm, routed_hbm) if options.expected_routed_max
                     else routed_sm + routed_hbm)
        expected += mx(laws.safe_div(shared_flops, P * r_g) * derate,
                       kind.shared_expert_weight_bytes / tp / B_hbm)

    # -- primary attention (§6.3), secondaries (§6.4), KV fallback (§6.6) -----------------
    if att is not None:
        f_dec, r_dec = c.pair(att.kind)
        T = b.decode_read(plan, att)
        with_rate = r_dec > 0
        attn_hbm_s += jnp.where(st.has_dec & with_rate,
                                laws.floor_plus_rate(T * plan.bpt_layer, f_dec, r_dec), 0.0)
        kv_fallback = jnp.where(st.has_dec & ~with_rate, T * plan.bpt_layer, 0.0)
        causal = b.windowed(att.window) if att.window > 0 else b.causal_flops
        f_p = c.params["attention_prefill_floor"]
        w_p = c.params["attention_prefill_work_scale"]
        scaled = w_p > 0
        attn_work = causal * att.n_q * att.d_h / tp
        exp_work = attn_work
        if refine and att.kind in _LATENT and att.qk_nope_head_dim and att.v_head_dim:
            # refinement 3: MLA prefill runs decompressed; per pair per head
            # 2·(qk_nope + qk_rope) + 2·v_head FLOPs instead of 4·d_h.
            per_pair = 2 * (att.qk_nope_head_dim + att.qk_rope_head_dim) + 2 * att.v_head_dim
            exp_work = causal / 4.0 * per_pair * att.n_q / tp
        w_safe = jnp.where(scaled, w_p, 1.0)
        pre_sm = jnp.where(st.has_pre & scaled, laws.prefill_attention_time(
            attn_work, f_p, P, r_a, w_safe, derate), 0.0)
        exp_pre_sm = jnp.where(st.has_pre & scaled, laws.prefill_attention_time(
            exp_work, f_p, P, r_a, w_safe, derate), 0.0)
        attn_sm_s += pre_sm
        attn_flops += jnp.where(st.has_pre & ~scaled, attn_work, 0.0)
        exp_attn_flops = jnp.where(st.has_pre & ~scaled, exp_work, 0.0)
        if att.kind not in _LATENT and plan.dcp <= 1 and not plan.blackwell:
            # single-launch rule: one varlen launch for a mixed batch (D4 on a tie)
            cond = st.has_dec & st.has_pre & with_rate & scaled
            attn_hbm_s -= jnp.where(cond & (f_dec <= f_p), f_dec, 0.0)
            attn_sm_s -= jnp.where(cond & (f_dec > f_p), f_p, 0.0)
        for a in kind.secondaries:
            f_a, r_sec = c.pair(a.kind)
            per_token = plan.bpt_layer * (a.n_kv * a.d_h) / (att.n_kv * att.d_h)
            T2 = b.decode_kv_tokens
            if a.window > 0:
                T2 = jnp.minimum(T2, a.window * b.decode_requests)
            if a.compress_ratio > 1:
                T2 = T2 / a.compress_ratio
            if plan.dcp > 1 and a.kind in _SHARDABLE:
                T2 = laws.dcp_local(laws.round_half_up(T2), plan.dcp, plan.interleave)
            attn_hbm_s += jnp.where(st.has_dec & (r_sec > 0),
                                    laws.floor_plus_rate(T2 * per_token, f_a, r_sec), 0.0)
        expected += (attn_hbm_s + (attn_sm_s - pre_sm + exp_pre_sm)
                     + laws.safe_div(exp_attn_flops, P * r_a) * derate + kv_fallback / B_hbm)

    # -- recurrent mixers (§6.5) -----------------------------------------------------------
    if kind.recurrent is not None:
        for rk, fn, rn in plan.recurrent_names:
            if rk == kind.recurrent.kind:
                f_r, rho = c.params[fn], c.params[rn]
                ok = (f_r > 0) & (rho > 0)
                recurrent_s = jnp.where(ok, laws.floor_plus_rate(b.t_real, f_r, rho), 0.0)
        expected += recurrent_s

    # -- elementwise (§6.7) ----------------------------------------------------------------
    elementwise = b.t_gemm * kind.elementwise_bytes_per_token / tp
    expected += elementwise / B_hbm

    # -- graph collectives (§6.8) ----------------------------------------------------------
    for coll in kind.collectives:
        nbytes = b.t_gemm * plan.hidden_size * 2.0
        if coll.op == "alltoall" and kind.top_k > 0 and coll.routed:
            nbytes = nbytes * kind.top_k
        dv, dn = c.coll(plan.key(coll.op, coll.group), plan.group(coll.group), nbytes,
                        coll.op == "alltoall" and coll.routed)
        nvl, nic = nvl + dv, nic + dn
        launches = 2 if (refine and coll.op == "alltoall") else 1    # refinement 5
        expected += launches * (dv + dn)

    # -- DCP collectives (§6.9) and PCP gathers (§6.10) ------------------------------------
    cp_v, cp_n = _context_parallel_collectives(plan, b, att, c.coll, zero, kind.secondaries)
    nvl, nic = nvl + cp_v, nic + cp_n
    expected += cp_v + cp_n

    # -- composition (§6.11) ---------------------------------------------------------------
    dense_sm = (laws.safe_div(gemm_flops, P * r_g) * derate + dense_shaped_s * derate
                + laws.safe_div(attn_flops, P * r_a) * derate + recurrent_s + attn_sm_s)
    dense_hbm = (weight_bytes + kv_fallback + elementwise) / B_hbm + attn_hbm_s
    return _LayerCost(dense_sm, dense_hbm, routed_sm, routed_hbm, nvl, nic, expected)


def _head(plan: Plan, c: _Constants, st: _Step, tokens):
    """LM head over ``tokens`` rows (step.md §7): ``(sm_s, hbm_s)``, 0 when no real token."""
    real = st.b.t_real > 0
    ramp = laws.ramp(tokens, c.eps, c.m_half)
    sm = jnp.where(real, laws.safe_div(tokens * plan.head_flops_per_token / plan.tp,
                                       c.P * ramp) * st.sm_derate, 0.0)
    hbm = jnp.where(real, plan.head_weight_bytes / plan.tp / c.B_hbm, 0.0)
    return sm, hbm


def _draft(plan: Plan, options: StepOptions, c: _Constants, st: _Step, first: dict):
    """expected_s only: the MTP drafter's work after the target pass.

    vLLM v0.31.0 runs one speculator module per draft token: the first over the step's
    tokens (the target's hidden states), each later one over one token per request; every
    pass computes the logits of one token per request. The edges leave the drafter unpriced
    (D7). ``first`` maps a kind id to its layer's expected seconds in this step.
    """
    n = st.b.n_live
    total = sum((count * first[kid] for kid, count in plan.draft_kinds), c.zero)
    if plan.num_spec > 1:
        later = _Step.__new__(_Step)
        later.b = _DraftBatch(st.b)
        later.sm_derate, later.has_dec, later.has_pre = st.sm_derate, n > 0, n < 0
        later.r_g = later.r_a = laws.ramp(n, c.eps, c.m_half)
        kinds = {k.id: k for k in plan.kinds}
        per_pass = sum((count * _layer(kinds[kid], plan, options, c, later).expected
                        for kid, count in plan.draft_kinds), c.zero)
        total += (plan.num_spec - 1) * per_pass
    total += plan.num_spec * _maximum(options, *_head(plan, c, st, n))
    return jnp.where(n > 0, total, 0.0)


class _DraftBatch:
    """Token counts of a later draft pass: every live request decodes one token at its
    context after the target pass. Quacks like :class:`_Batch` for :func:`_layer`."""

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

    def decode_read(self, plan: Plan, att: AttentionPlan):
        if not _shaped_read(att, plan):
            return self.decode_kv_tokens
        return self._b.sums["draft_read_%s_%d_%d_%d" % _read_signature(att)]

    def windowed(self, window: int):
        return jnp.zeros_like(self.tokens)

    def requests(self):
        """No prefill rows: nothing to gather (step.md §6.9)."""
        s, c, pre = self._b.requests()
        return jnp.zeros_like(s), jnp.zeros_like(c), jnp.zeros_like(pre)


def _price(plan: Plan, options: StepOptions, params, batch: BatchArrays) -> StepEstimate:
    c = _Constants(plan, params)
    st = _Step(plan, c, batch)
    b = st.b
    mx = lambda *v: _maximum(options, *v)  # noqa: E731
    zero = c.zero
    SM = HBM = NVL = NIC = stages = gpu_expected = zero
    per_kind: dict = {}
    for kind in plan.kinds:
        cost = _layer(kind, plan, options, c, st)
        n = kind.count
        stages += n * (mx(cost.dense_sm, cost.dense_hbm, cost.nvlink, cost.nic)
                       + cost.routed_sm + cost.routed_hbm)
        SM += n * (cost.dense_sm + cost.routed_sm)
        HBM += n * (cost.dense_hbm + cost.routed_hbm)
        NVL += n * cost.nvlink
        NIC += n * cost.nic
        gpu_expected += n * cost.expected
        per_kind[kind.id] = cost.expected

    # -- LM head (§7): logits for every real token -----------------------------------------
    head_sm, head_hbm = _head(plan, c, st, b.t_real)
    head_overlap = mx(head_sm, head_hbm)
    SM += head_sm
    HBM += head_hbm
    if options.expected_refinements:
        # refinement 4: logits only for the sampled positions
        sampled = jnp.minimum(b.t_real, b.n_live * plan.uniform_decode_width)
        gpu_expected += mx(*_head(plan, c, st, sampled))
        if plan.draft_kinds:
            gpu_expected += _draft(plan, options, c, st, per_kind)
    else:
        gpu_expected += head_overlap

    # -- host (§8) -------------------------------------------------------------------------
    mode = jnp.where((b.n_live <= 0) | b.uniform, plan.decode_mode, plan.other_mode)
    mode = jnp.where(b.tokens + b.t_pad > plan.capture_ceiling, EAGER, mode)
    replay = params["host_replay_graph_per_step"]
    per_step = jnp.where(mode == FULL, replay,
                         jnp.where(mode == PIECEWISE, replay * plan.segments,
                                   params["host_launch_eager_per_layer"] * plan.total_layers))
    launches = params["host_launch_per_kernel"] * plan.total_kernels
    host = per_step + jnp.where(b.empty, 0.0, launches)
    # expected.md: a FULL graph launches its own kernels
    host_exp = per_step + jnp.where(b.empty | (mode == FULL), 0.0, launches)

    # -- totals (§9) -----------------------------------------------------------------------
    keep = ~b.empty
    SM, HBM, NVL, NIC = (jnp.where(keep, x, 0.0) for x in (SM, HBM, NVL, NIC))
    no_overlap = SM + HBM + NVL + NIC + host
    overlap = jnp.where(keep, jnp.minimum(stages + head_overlap + host, no_overlap), host)
    totals = jnp.stack(jnp.broadcast_arrays(SM, HBM, NVL, NIC, host), axis=-1)
    bottleneck = jnp.where(b.empty, len(RESOURCES) - 1, jnp.argmax(totals, axis=-1))
    gpu = jnp.where(keep, gpu_expected + plan.total_kernels * params["kernel_gap"], 0.0)
    expected = mx(gpu, host_exp) + host_unhidden_s(params, b.n_live)
    return StepEstimate(
        overlap_s=overlap, no_overlap_s=no_overlap, expected_s=expected,
        per_resource_s={"sm": SM, "hbm": HBM, "nvlink": NVL, "nic": NIC, "host": host},
        bottleneck=bottleneck.astype(jnp.int32))


def host_unhidden_s(params, live_requests):
    """expected.md's serial host time: host work the GPU does not hide, added after the
    GPU/host maximum, seconds (any shape of ``live_requests``).

    vLLM 0.23–0.31's V1 engine core without async scheduling runs, between two GPU passes,
    the scheduler, the model runner's input preparation and the update from the sampled
    tokens; part of it is per step (``host_serial``) and part per scheduled request
    (``host_serial_per_request``). Both are engine-level constants fitted from step traces
    (calibration.traces); they are 0 until one is fitted.
    """
    return params["host_serial"] + params["host_serial_per_request"] * live_requests


def _context_parallel_collectives(plan: Plan, b: _Batch, att: AttentionPlan | None, coll,
                                  zero, secondaries: tuple[AttentionPlan, ...] = ()):
    """DCP query/LSE/output collectives, MLA context gathers and PCP KV gathers (the primary's
    latent and rope key, and each secondary attention's key: ``secondaries``)."""
    nvl = nic = zero
    if att is None or att.n_q <= 0:
        return nvl, nic

    def charge(op: str, group: str, nbytes, when):
        nonlocal nvl, nic
        key = plan.key(op, group)
        dv, dn = coll(key, plan.group(group), nbytes, op == "alltoall")
        nvl = nvl + jnp.where(when, dv, 0.0)
        nic = nic + jnp.where(when, dn, 0.0)

    latent = att.kind in _LATENT
    if plan.dcp > 1 and att.kind in _SHARDABLE:
        rows = b.decode_tokens if latent else jnp.where(b.any_context, b.tokens, 0.0)
        some = rows > 0
        h, qW = att.n_q, att.d_h
        oW = att.kv_lora_rank if latent and att.kv_lora_rank > 0 else att.d_h
        if plan.pcp > 1:
            aH = h / plan.tp
            if plan.dcp > plan.pcp:
                aH = h
                charge("all_gather", "TP", rows * aH * qW * 2.0, some)
        else:
            aH = h / plan.tp * plan.dcp                                            # D29
            charge("all_gather", "DCP", rows * aH * qW * 2.0, some)
        if plan.dcp_comm_backend == "a2a":
            charge("alltoall", "DCP", rows * aH * (oW + 2) * 2.0, some)
        else:
            charge("all_gather", "DCP", plan.dcp * rows * aH * 4.0, some)
            charge("all_reduce" if plan.pcp > 1 else "reduce_scatter", "DCP",
                   rows * aH * oW * 2.0, some)
        if latent:
            v, n = _mla_context_gather(plan, b, att, coll)
            nvl, nic = nvl + v, nic + n
    if plan.pcp > 1:
        rows = plan.pcp * b.prefill_tokens
        some = b.prefill_tokens > 0
        if 0 < att.kv_lora_rank < att.d_h:
            charge("all_gather", "PCP", rows * att.kv_lora_rank * 2.0, some)
            charge("all_gather", "PCP", rows * (att.d_h - att.kv_lora_rank) * 2.0, some)
        else:
            charge("all_gather", "PCP", rows * att.d_h * 2.0, some)
        # step.md §6.10: one more gather per secondary attention with a key (the indexer's,
        # rows·n_kv·d_h·2 bytes). (Before: the secondaries' gathers were not charged.)
        for a in secondaries:
            if a.n_kv > 0 and a.d_h > 0:
                charge("all_gather", "PCP", rows * a.n_kv * a.d_h * 2.0, some)
    return nvl, nic


def _mla_context_gather(plan: Plan, b: _Batch, att: AttentionPlan, coll):
    """Chunked context gathers of DCP-sharded latent prefixes (step.md §6.9)."""
    key = plan.key("all_gather", "DCP")
    group = plan.group("DCP")
    s_req, c_req, pre_req = b.requests()
    big = jnp.finfo(s_req.dtype).max
    order = jnp.argsort(jnp.where(pre_req, s_req, big), axis=-1, stable=True)
    pre = jnp.take_along_axis(pre_req, order, axis=-1)
    c = jnp.take_along_axis(c_req, order, axis=-1)
    breaker = pre & (c <= 0)
    seg = jnp.cumsum(breaker.astype(jnp.int32), axis=-1)
    contrib = jnp.where(pre & (c > 0), c, 0.0)
    n_seg = s_req.shape[-1] + 1
    onehot = seg[..., None] == jnp.arange(n_seg)
    S = jnp.sum(jnp.where(onehot, contrib[..., None], 0.0), axis=-2)   # (..., n_seg)
    chunk = max(plan.mla_chunk, 1)
    n = jnp.ceil(S / chunk)
    per = S * att.d_h * 2.0 / jnp.where(n > 0, n, 1.0)
    v, k = coll(key, group, per, False)
    use = S > 0
    return (jnp.sum(jnp.where(use, n * v, 0.0), axis=-1),
            jnp.sum(jnp.where(use, n * k, 0.0), axis=-1))
