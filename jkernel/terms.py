"""Named cost terms: one function per piece of work a step prices (spec step.md §6–§8 and
expected.md).

Every term returns a :class:`Term`: the seconds it puts on each resource of one rank for
**one layer** of one kind (step-level terms — the LM head, the drafter, the host — for the
whole step), as the reference edges count them, and the seconds it adds to jkernel's own
``expected_s``. :mod:`jkernel.step` composes the same list of terms twice: into the edges
(``overlap_s``, ``no_overlap_s``) and into ``expected_s``.

The term functions are traceable and never branch on values. Their arguments:

* ``kind`` / ``plan``: static structure (:mod:`jkernel.plan`);
* ``c``: :class:`Constants`, the params a step reads, lifted once;
* ``st``: the step's batch reductions (``st.b``: token counts of step.md §4 as scalars, or
  arrays of the batch shape under leading batch axes) with the ramps and the SM derate;
* ``options``: :class:`~jkernel.step.StepOptions` and ``mx``, its maximum.

Shapes: every field of a :class:`Term` has the batch shape (``()`` for one batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import laws
from .plan import (DCP_SHARDABLE, EAGER, FULL, LATENT_KINDS, PIECEWISE, AttentionPlan,
                   CollectiveKey, GroupPlan, KindPlan, Plan)

__all__ = ["Term", "ReadShape", "read_shape", "primary_read", "Constants", "SERIAL_TERMS",
           "HOST_TERMS", "GPU_STEP_TERMS", "layer_terms", "lm_head", "draft_passes",
           "graph_replay", "kernel_launches", "kernel_gap", "host_serial", "STEP",
           "breakdown_table", "BREAKDOWN_COLUMNS"]


#: The key of the step-level terms in :attr:`StepEstimate.terms` (not a layer kind).
STEP = "(step)"
#: Layer terms the edges add after a layer's overlapped stage instead of inside it
#: (step.md §6.11: routed experts run serially after the dense stage).
SERIAL_TERMS = ("routed experts",)
#: Step-level terms on the host side of ``expected_s = max(gpu, host) + host_serial``.
HOST_TERMS = ("host graph replay", "host kernel launches")
#: Step-level terms on the GPU side (added to the layers' terms).
GPU_STEP_TERMS = ("lm head", "draft passes", "kernel gap")


class Term(NamedTuple):
    """One named cost term, seconds per rank (a pytree).

    ``sm_s``, ``hbm_s``, ``nvlink_s``, ``nic_s``, ``host_s``: what the reference edges charge
    each resource (step.md §6.11, §8); ``expected_s``: what the term adds to ``expected_s``
    (expected.md), which need not be any one resource's time (a GEMM adds the larger of its
    compute and memory time).
    """

    sm_s: jax.Array
    hbm_s: jax.Array
    nvlink_s: jax.Array
    nic_s: jax.Array
    host_s: jax.Array
    expected_s: jax.Array

    @classmethod
    def of(cls, zero, *, sm=None, hbm=None, nvlink=None, nic=None, host=None, expected=None):
        z = lambda x: zero if x is None else x  # noqa: E731
        return cls(z(sm), z(hbm), z(nvlink), z(nic), z(host), z(expected))

    def scaled(self, n) -> "Term":
        return Term(*(n * x for x in self))

    def __add__(self, other: "Term") -> "Term":          # type: ignore[override]
        return Term(*(a + b for a, b in zip(self, other)))

    def where(self, keep) -> "Term":
        return Term(*(jnp.where(keep, x, 0.0) for x in self))


# -- the decode read of one attention: ONE decision ---------------------------------------

@dataclass(frozen=True)
class ReadShape:
    """How a decode's read of an attention's cache differs from its plain context (step.md
    §6.3): capped by a sliding window (D3), bounded by a sparse top-k with a compression
    ratio, and sharded over DCP ranks. A hashable, static record; it also names the request
    lane that carries the summed read."""

    window: int = 0
    sparse_bound: int = 0
    compress_ratio: int = 0
    dcp: int = 1
    interleave: int = 1
    draft: bool = False            # the lane of a later draft pass (context + 1)

    def for_draft(self) -> "ReadShape":
        return ReadShape(self.window, self.sparse_bound, self.compress_ratio, self.dcp,
                         self.interleave, True)


def read_shape(plan: Plan, att: AttentionPlan) -> ReadShape | None:
    """The shape of ``att``'s decode read, or None when a decode reads its whole context."""
    window = att.window if att.kind == "swa" and att.window > 0 else 0
    bound = 0
    if att.kind == "sparse_mla":
        bound = att.index_topk if att.index_topk > 0 else att.window
    dcp = plan.dcp if plan.dcp > 1 and att.kind in DCP_SHARDABLE else 1
    if not window and bound <= 0 and dcp <= 1:
        return None
    return ReadShape(window, max(bound, 0), att.compress_ratio if bound > 0 else 0, dcp,
                     plan.interleave)


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


# -- the params a step reads ---------------------------------------------------------------

class Constants:
    """The params a step reads, lifted once per call (step.md §3), and the two lookups every
    layer uses: the collective law on NVLink or the NIC, and the attention decode pair."""

    def __init__(self, plan: Plan, params):
        self.params = params
        # the compute rate sustained in the engine: compute_derate ∈ (0, 1] is 1 until a
        # step-trace fit (calibration.stepfit), the chip's clock under a whole model's load
        # below the isolated kernels' of the profiles; it scales both edges and expected_s
        self.P = params["peak_flops_per_s"] * params["compute_derate"]
        self.dt = jnp.result_type(self.P)
        self.zero = jnp.zeros((), self.dt)
        self.B_hbm = params["hbm_bytes_per_s"] * params["hbm_derate"]
        self.eps, self.m_half = params[plan.gemm_names[0]], params[plan.gemm_names[1]]
        self.n_half = params[plan.gemm_names[2]] if plan.shape_aware else self.zero
        self.k_half = params[plan.gemm_names[3]] if plan.shape_aware else self.zero
        imb = params.get("moe_routing_imbalance_median", self.zero)
        self.imb = jnp.where(imb > 0, imb, 1.0)
        # expected_s's shape constants (0 where absent: step.md's laws)
        self.row_floor = params.get("attention_decode_row_floor", self.zero)
        self.overlap = params.get("attention_decode_overlap", self.zero)
        suffix = plan.gemm_names[0].rsplit("_", 1)[-1]
        self.moe_floor = params.get(f"moe_kernel_floor_{suffix}", self.zero)
        self.moe_m_half = params.get("moe_m_half", self.zero)
        self.moe_assignment = params.get("moe_assignment_time", self.zero)
        self.ratio = params["nvlink_bytes_per_s"] / params["nic_bytes_per_s"]
        self.plan = plan

    def coll(self, key: CollectiveKey, group: GroupPlan, nbytes, a2a: bool):
        """One collective launch → ``(nvlink_s, nic_s)``, priced by the measured law; a group
        that crosses nodes pays the span on its bytes (step.md §6.8). ``key`` comes from
        :meth:`Plan.key`, which always has one (the plan's collective table)."""
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


# -- layer terms ---------------------------------------------------------------------------

def dense_gemm(g, plan: Plan, options, c: Constants, st) -> Term:
    """One (fused) dense GEMM (step.md §6.1; expected: max(compute, memory) with vLLM's
    sharding, refinement 1, and activation traffic, refinement 2)."""
    b, P, B_hbm, derate, tp = st.b, c.P, c.B_hbm, st.sm_derate, plan.tp
    refine = options.expected_refinements
    n_r, k_r = (g.n / tp, g.k) if g.shard_n else (g.n, g.k / tp)
    frac = 1.0 / tp
    if refine:                                        # refinement 1: vLLM's real sharding
        frac = g.vllm_rank_fraction
        if frac >= 1.0:
            n_r, k_r = g.n, g.k
        elif g.shard_n:
            n_r = g.n * frac
    if plan.shape_aware:
        e_spec = laws.eff_shaped(b.t_gemm, (g.n / tp if g.shard_n else g.n),
                                 (g.k if g.shard_n else g.k / tp), c.eps, c.m_half,
                                 c.n_half, c.k_half)
        edge_sm = laws.compute_time(b.t_gemm * g.flops_per_token / tp, P, e_spec) * derate
        e_exp = laws.eff_shaped(b.t_gemm, n_r, k_r, c.eps, c.m_half, c.n_half, c.k_half)
    else:
        edge_sm = laws.safe_div(b.t_gemm * g.flops_per_token / tp, P * st.r_g) * derate
        e_exp = st.r_g
    compute, memory = laws.gemm_times(b.t_gemm, n_r, k_r, g.weight_bytes * frac, P, B_hbm,
                                      e_exp, 2.0 if refine else 0.0)      # refinement 2
    return Term.of(c.zero, sm=edge_sm, hbm=g.weight_bytes / tp / B_hbm,
                   expected=options.mx(compute * derate, memory))


def routed_experts(kind: KindPlan, plan: Plan, options, c: Constants, st) -> Term:
    """Routed experts (step.md §6.2), serial after the layer's stage in the edges."""
    routed_flops, routed_bytes = laws.routed_expert_work(
        st.b.t_gemm * plan.funnel, kind.top_k, plan.local_expert_share,
        kind.expert_flops_per_token_per_expert, c.imb, plan.dp_slice,
        plan.physical_experts, plan.experts_per_rank, kind.expert_weight_bytes_per_expert,
        plan.expert_tensor_shards)
    sm = laws.safe_div(routed_flops, c.P * st.r_g) * st.sm_derate
    hbm = laws.memory_time(routed_bytes, c.B_hbm)
    exp = options.mx(sm, hbm) if options.expected_routed_max else sm + hbm
    if options.expected_refinements and options.expected_routed_max:
        exp = jnp.where(_fused_moe_law(c), _fused_moe(kind, plan, c, st, routed_bytes), exp)
    return Term.of(c.zero, sm=sm, hbm=hbm, expected=exp)


def _fused_moe_law(c: Constants):
    """Whether the fused-MoE constants are calibrated (any of them positive)."""
    return (c.moe_floor > 0) | (c.moe_m_half > 0) | (c.moe_assignment > 0)


def _fused_moe(kind: KindPlan, plan: Plan, c: Constants, st, routed_bytes):
    """``expected_s``'s routed experts as vLLM's fused-MoE kernel runs them
    (:func:`jkernel.laws.routed_expert_time`): the kernel's floor, each expert's grouped GEMM
    at its own rows (tokens per touched expert), a rank's tensor slice of the expert FLOPs
    (vLLM shards the expert intermediate dimension, refinement 1; no routing-imbalance
    multiplier, which the per-expert ramp replaces), the touched experts' weights, and the
    permute / un-permute of each token-expert assignment."""
    routed = st.b.t_gemm * plan.funnel
    # every routed token's FLOPs on the rank's experts, then the rank's tensor slice of them
    # (with EP off every rank holds 1/(tp·dp) of each expert: no dp_slice on top)
    flops, _ = laws.routed_expert_work(
        routed, kind.top_k, plan.local_expert_share, kind.expert_flops_per_token_per_expert,
        1.0, 1.0, plan.physical_experts, plan.experts_per_rank,
        kind.expert_weight_bytes_per_expert, plan.expert_tensor_shards)
    assignments = routed * kind.top_k * plan.local_expert_share
    touched = laws.experts_touched(laws.round_half_up(routed), plan.physical_experts,
                                   kind.top_k, plan.experts_per_rank)
    return laws.routed_expert_time(flops / plan.expert_tensor_shards, routed_bytes,
                                   assignments, touched, c.P / st.sm_derate, c.B_hbm,
                                   c.moe_floor, c.moe_m_half, c.moe_assignment,
                                   token_efficiency=st.r_g)


def shared_experts(kind: KindPlan, plan: Plan, options, c: Constants, st) -> Term:
    """Shared experts: priced as dense GEMMs (step.md §6.2)."""
    flops = st.b.t_gemm * kind.shared_expert_flops_per_token / plan.tp
    sm = laws.safe_div(flops, c.P * st.r_g) * st.sm_derate
    hbm = kind.shared_expert_weight_bytes / plan.tp / c.B_hbm
    return Term.of(c.zero, sm=sm, hbm=hbm, expected=options.mx(sm, hbm))


def _single_launch(att: AttentionPlan, plan: Plan) -> bool:
    """vLLM v0.31.0 FlashAttention runs one varlen launch for a mixed batch (step.md §6.3)."""
    return att.kind not in LATENT_KINDS and plan.dcp <= 1 and not plan.blackwell


def _monotone(options) -> bool:
    """jkernel's refinements 6–8 (on with expected.md's 1–5): the terms that keep
    ``expected_s`` non-decreasing as work is added (see :func:`attention_decode_read`,
    :func:`attention_prefill` and, for context-parallel plans,
    :func:`context_parallel_collectives` with ``jkernel.step._Batch.expected_view``)."""
    return options.expected_refinements


def attention_decode_read(att: AttentionPlan, plan: Plan, options, c: Constants, st) -> Term:
    """The primary attention's read of its cache (step.md §6.3) and the plain KV read where
    no decode rate is calibrated (§6.6). In a mixed single-launch step the cheaper of the two
    floors is not charged (D4 on a tie: the decode's).

    The edges charge the read of decodes only, so a decode that crosses the decode threshold
    stops reading its context (the reference's behaviour). ``expected_s`` (refinement 6)
    charges every live request's read, prefills included: vLLM v0.31.0's attention backends
    read a prefill chunk's keys and values — its cached context and the chunk just written —
    from the paged cache, so a request that turns from decode into prefill keeps its read
    and adds its prefill work.
    """
    f_dec, r_dec = c.pair(att.kind)
    with_rate = r_dec > 0
    shape = read_shape(plan, att)
    single = _single_launch(att, plan)
    f_p = c.params["attention_prefill_floor"]
    scaled = c.params["attention_prefill_work_scale"] > 0

    # (request, KV head) rows per rank: KV heads are replicated when n_kv < tp, and a latent
    # cache has one
    heads = 1.0 if att.kind in LATENT_KINDS else max(1.0, att.n_kv / plan.tp)

    def priced(T, reads, requests=None):
        if requests is None:
            read = laws.floor_plus_rate(T * plan.bpt_layer, f_dec, r_dec)
        else:
            # expected_s: the shape-aware law (jkernel.laws.decode_attention_time), which is
            # the edges' floor + bytes/rate where no row floor is calibrated
            read = laws.decode_attention_time(T * plan.bpt_layer, requests * heads, f_dec,
                                              r_dec, c.row_floor, c.overlap)
        hbm = jnp.where(reads & with_rate, read, 0.0)
        if single:
            cond = reads & st.has_pre & with_rate & scaled
            hbm = hbm - jnp.where(cond & (f_dec <= f_p), f_dec, 0.0)
        return hbm + jnp.where(reads & ~with_rate, T * plan.bpt_layer, 0.0) / c.B_hbm

    edge = priced(st.b.decode_read(shape), st.has_dec)
    exp = (priced(st.b.live_read(shape), st.has_live, st.b.n_live) if _monotone(options)
           else edge)
    return Term.of(c.zero, hbm=edge, expected=exp)


def attention_prefill(att: AttentionPlan, plan: Plan, options, c: Constants, st) -> Term:
    """The primary attention's prefill work over causal pairs (step.md §6.3); ``expected_s``
    prices MLA decompressed (refinement 3).

    The edges take the efficiency from the token ramp at the whole step's token count, so a
    small extra request raises a long prefill's attention efficiency and lowers the price
    (the reference's behaviour). ``expected_s`` (refinement 7) runs the ramp at
    ``W / max_i w_i`` rows — ``W`` the step's causal work, ``w_i`` one prefill's work per
    query row —, i.e. charges ``(W + m½·max_i w_i)/(P·ε_max)``: the single prefill's own
    ramp, non-decreasing when a request is added or grows.
    """
    b, P, derate = st.b, c.P, st.sm_derate
    f_p = c.params["attention_prefill_floor"]
    w_p = c.params["attention_prefill_work_scale"]
    scaled = w_p > 0
    causal = b.windowed(att.window) if att.window > 0 else b.causal_flops
    work = causal * att.n_q * att.d_h / plan.tp
    exp_work = work
    if (options.expected_refinements and att.kind in LATENT_KINDS and att.qk_nope_head_dim
            and att.v_head_dim):
        # refinement 3: MLA prefill runs decompressed; per pair per head
        # 2·(qk_nope + qk_rope) + 2·v_head FLOPs instead of 4·d_h.
        per_pair = 2 * (att.qk_nope_head_dim + att.qk_rope_head_dim) + 2 * att.v_head_dim
        exp_work = causal / 4.0 * per_pair * att.n_q / plan.tp
    w_safe = jnp.where(scaled, w_p, 1.0)

    def priced(w, eff):
        return (jnp.where(st.has_pre & scaled, laws.prefill_attention_time(
                    w, f_p, P, eff, w_safe, derate), 0.0)
                + laws.safe_div(jnp.where(st.has_pre & ~scaled, w, 0.0), P * eff) * derate)

    edge = priced(work, st.r_a)
    if _monotone(options):
        exp = priced(exp_work, laws.ramp(b.prefill_rows(att.window), c.eps, c.m_half))
    else:
        exp = priced(exp_work, st.r_a)
    if _single_launch(att, plan):
        f_dec, r_dec = c.pair(att.kind)
        both = st.has_pre & (r_dec > 0) & scaled & (f_dec > f_p)
        edge = edge - jnp.where(both & st.has_dec, f_p, 0.0)
        exp = exp - jnp.where(both & (st.has_live if _monotone(options) else st.has_dec),
                              f_p, 0.0)
    return Term.of(c.zero, sm=edge, expected=exp)


def secondary_decode_read(a: AttentionPlan, att: AttentionPlan, plan: Plan, options,
                          c: Constants, st) -> Term:
    """A secondary attention's decode read (an indexer, a compressed cache; step.md §6.4);
    ``expected_s`` reads it for every live request (refinement 6)."""
    b = st.b
    f_a, r_sec = c.pair(a.kind)
    per_token = plan.bpt_layer * (a.n_kv * a.d_h) / (att.n_kv * att.d_h)

    def priced(T2, requests, reads):
        if a.window > 0:
            T2 = jnp.minimum(T2, a.window * requests)
        if a.compress_ratio > 1:
            T2 = T2 / a.compress_ratio
        if plan.dcp > 1 and a.kind in DCP_SHARDABLE:
            T2 = laws.dcp_local(laws.round_half_up(T2), plan.dcp, plan.interleave)
        return jnp.where(reads & (r_sec > 0),
                         laws.floor_plus_rate(T2 * per_token, f_a, r_sec), 0.0)

    edge = priced(b.decode_kv_tokens, b.decode_requests, st.has_dec)
    exp = (priced(b.live_read(None), b.n_live, st.has_live) if _monotone(options) else edge)
    return Term.of(c.zero, hbm=edge, expected=exp)


def recurrent_mixer(kind: KindPlan, plan: Plan, options, c: Constants, st) -> Term:
    """A recurrent mixer's update over the step's tokens (step.md §6.5)."""
    s = c.zero
    for rk, fn, rn in plan.recurrent_names:
        if rk == kind.recurrent.kind:
            f_r, rho = c.params[fn], c.params[rn]
            ok = (f_r > 0) & (rho > 0)
            s = jnp.where(ok, laws.floor_plus_rate(st.b.t_real, f_r, rho), 0.0)
    return Term.of(c.zero, sm=s, expected=s)


def elementwise(kind: KindPlan, plan: Plan, options, c: Constants, st) -> Term:
    """Norms and other elementwise kernels: their bytes on HBM (step.md §6.7)."""
    s = st.b.t_gemm * kind.elementwise_bytes_per_token / plan.tp / c.B_hbm
    return Term.of(c.zero, hbm=s, expected=s)


def graph_collective(coll, kind: KindPlan, plan: Plan, options, c: Constants, st) -> Term:
    """One collective of the graph (step.md §6.8): an all-reduce, gather or scatter over
    the TP group, or the MoE all-to-all (bytes × top_k when routed). ``expected_s`` charges
    the all-to-all as its two launches, dispatch and combine (refinement 5)."""
    nbytes = st.b.t_gemm * plan.hidden_size * 2.0
    if coll.op == "alltoall" and kind.top_k > 0 and coll.routed:
        nbytes = nbytes * kind.top_k
    dv, dn = c.coll(plan.key(coll.op, coll.group), plan.group(coll.group), nbytes,
                    coll.op == "alltoall" and coll.routed)
    launches = 2 if (options.expected_refinements and coll.op == "alltoall") else 1
    return Term.of(c.zero, nvlink=dv, nic=dn, expected=launches * (dv + dn))


def collective_name(coll) -> str:
    if coll.op == "alltoall" and coll.routed:
        return "moe dispatch and combine"
    return f"{coll.op} {coll.group}"


def context_parallel_collectives(kind: KindPlan, plan: Plan, options, c: Constants, st
                                 ) -> dict[str, Term]:
    """DCP query/LSE/output collectives, MLA context gathers (step.md §6.9) and PCP KV
    gathers (§6.10: the primary's latent and rope key, and each secondary's key), by name.

    On the view ``expected_s`` prices a context-parallel plan with (``st.b.envelope``,
    refinement 8), a latent attention's DCP collectives take their monotone form:

    * vLLM v0.31.0's MLA backend (``MLACommonImpl.forward``) all-gathers the decode
      queries over the DCP group and combines the outputs by their LSE
      (``cp_lse_ag_out_rs``) only when the step has a decode; a prefill reads its cached
      context through the chunked context gather instead. So in the engine the last decode
      turning prefill removes three launches per layer. ``expected_s`` charges the decode
      path's collectives whenever a request is live, over the decode rows plus
      ``decode_threshold`` rows per prefill — the decode each prefill grew from — so a
      prefill never costs less than that decode (the envelope refinement 6 applies to the
      decode read's floor). It over-charges a step of prefills only, by at most those
      launches.
    * the context gather follows vLLM's chunking of the prefills' cached context
      (``MLACommonMetadataBuilder``): every prefill with context gets ``chunk / P`` tokens
      of the workspace per iteration (rounded down to whole blocks; P such prefills), so
      ``ceil(max c / that)`` gathers move the ``Σ c`` tokens — non-decreasing in each
      context and in P, where the spec's runs (split at each prefill without context,
      ordered by new tokens) regroup when a request grows.
    """
    att, b, zero = kind.attention, st.b, c.zero
    envelope = bool(b.envelope) and _monotone(options)
    out: dict[str, Term] = {}
    if att is None or att.n_q <= 0:
        return out

    def charge(name: str, op: str, group: str, nbytes, when):
        dv, dn = c.coll(plan.key(op, group), plan.group(group), nbytes, op == "alltoall")
        dv, dn = jnp.where(when, dv, 0.0), jnp.where(when, dn, 0.0)
        t = Term.of(zero, nvlink=dv, nic=dn, expected=dv + dn)
        out[name] = out[name] + t if name in out else t

    latent = att.kind in LATENT_KINDS
    if plan.dcp > 1 and att.kind in DCP_SHARDABLE:
        rows = b.decode_tokens if latent else jnp.where(b.any_context, b.tokens, 0.0)
        some = rows > 0
        if latent and envelope:
            rows = rows + b.thr * b.prefill_requests
            some = st.has_live
        h, qW = att.n_q, att.d_h
        oW = att.kv_lora_rank if latent and att.kv_lora_rank > 0 else att.d_h
        if plan.pcp > 1:
            aH = h / plan.tp
            if plan.dcp > plan.pcp:
                aH = h
                charge("dcp query all_gather TP", "all_gather", "TP", rows * aH * qW * 2.0,
                       some)
        else:
            aH = h / plan.tp * plan.dcp                                            # D29
            charge("dcp query all_gather", "all_gather", "DCP", rows * aH * qW * 2.0, some)
        if plan.dcp_comm_backend == "a2a":
            charge("dcp output alltoall", "alltoall", "DCP", rows * aH * (oW + 2) * 2.0, some)
        else:
            charge("dcp lse all_gather", "all_gather", "DCP", plan.dcp * rows * aH * 4.0, some)
            op = "all_reduce" if plan.pcp > 1 else "reduce_scatter"
            charge(f"dcp output {op}", op, "DCP", rows * aH * oW * 2.0, some)
        if latent:
            dv, dn = (_chunked_context_gather if envelope else _mla_context_gather)(
                plan, b, att, c)
            out["dcp context gather"] = Term.of(zero, nvlink=dv, nic=dn, expected=dv + dn)
    if plan.pcp > 1:
        rows = plan.pcp * b.prefill_tokens
        some = b.prefill_tokens > 0
        if 0 < att.kv_lora_rank < att.d_h:
            charge("pcp kv all_gather", "all_gather", "PCP", rows * att.kv_lora_rank * 2.0, some)
            charge("pcp kv all_gather", "all_gather", "PCP",
                   rows * (att.d_h - att.kv_lora_rank) * 2.0, some)
        else:
            charge("pcp kv all_gather", "all_gather", "PCP", rows * att.d_h * 2.0, some)
        # step.md §6.10: one more gather per secondary attention with a key (the indexer's,
        # rows·n_kv·d_h·2 bytes)
        for a in kind.secondaries:
            if a.n_kv > 0 and a.d_h > 0:
                charge("pcp kv all_gather", "all_gather", "PCP", rows * a.n_kv * a.d_h * 2.0,
                       some)
    return out


def _mla_context_gather(plan: Plan, b, att: AttentionPlan, c: Constants):
    """Chunked context gathers of DCP-sharded latent prefixes (step.md §6.9)."""
    key = plan.key("all_gather", "DCP")
    group = plan.group("DCP")
    s_req, c_req, pre_req = b.requests()
    big = jnp.finfo(s_req.dtype).max
    order = jnp.argsort(jnp.where(pre_req, s_req, big), axis=-1, stable=True)
    pre = jnp.take_along_axis(pre_req, order, axis=-1)
    cc = jnp.take_along_axis(c_req, order, axis=-1)
    breaker = pre & (cc <= 0)
    seg = jnp.cumsum(breaker.astype(jnp.int32), axis=-1)
    contrib = jnp.where(pre & (cc > 0), cc, 0.0)
    n_seg = s_req.shape[-1] + 1
    onehot = seg[..., None] == jnp.arange(n_seg)
    S = jnp.sum(jnp.where(onehot, contrib[..., None], 0.0), axis=-2)   # (..., n_seg)
    chunk = max(plan.mla_chunk, 1)
    n = jnp.ceil(S / chunk)
    per = S * att.d_h * 2.0 / jnp.where(n > 0, n, 1.0)
    v, k = c.coll(key, group, per, False)
    use = S > 0
    return (jnp.sum(jnp.where(use, n * v, 0.0), axis=-1),
            jnp.sum(jnp.where(use, n * k, 0.0), axis=-1))


def _chunked_context_gather(plan: Plan, b, att: AttentionPlan, c: Constants):
    """``expected_s``: the DCP gathers of the prefills' cached latent context as vLLM v0.31.0
    chunks it (see :func:`context_parallel_collectives`): ``n = ceil(max c / q)``
    iterations, ``q = max(⌊chunk / P / block⌋·block, block)``, each gathering ``Σ c / n``
    tokens of ``d_h`` bf16 values."""
    total, count, longest = b.prefill_context()
    block = float(max(plan.block_size, 1))
    share = jnp.floor(max(plan.mla_chunk, 1) / jnp.maximum(count, 1.0) / block) * block
    n = jnp.ceil(longest / jnp.maximum(share, block))
    per = total * att.d_h * 2.0 / jnp.where(n > 0, n, 1.0)
    v, k = c.coll(plan.key("all_gather", "DCP"), plan.group("DCP"), per, False)
    use = total > 0
    return jnp.where(use, n * v, 0.0), jnp.where(use, n * k, 0.0)


def gemm_names(kind: KindPlan) -> list[str]:
    """A unique term name per fused GEMM of ``kind``: ``gemm <role>+<role>``."""
    names, seen = [], {}
    for g in kind.gemms:
        base = "gemm " + "+".join(r or "?" for r in g.roles)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
    return names


def layer_terms(kind: KindPlan, plan: Plan, options, c: Constants, st) -> dict[str, Term]:
    """Every named term of one layer of ``kind``, in pricing order (step.md §6.1–§6.10)."""
    out: dict[str, Term] = {}
    for name, g in zip(gemm_names(kind), kind.gemms):
        out[name] = dense_gemm(g, plan, options, c, st)
    if kind.moe:
        out["routed experts"] = routed_experts(kind, plan, options, c, st)
        out["shared experts"] = shared_experts(kind, plan, options, c, st)
    att = kind.attention
    if att is not None:
        out["attention decode read"] = attention_decode_read(att, plan, options, c, st)
        out["attention prefill"] = attention_prefill(att, plan, options, c, st)
        for i, a in enumerate(kind.secondaries):
            name = f"attention {a.role or i} decode read"
            t = secondary_decode_read(a, att, plan, options, c, st)
            out[name] = out[name] + t if name in out else t
    if kind.recurrent is not None:
        out["recurrent mixer"] = recurrent_mixer(kind, plan, options, c, st)
    out["norms and elementwise"] = elementwise(kind, plan, options, c, st)
    for coll in kind.collectives:
        name = collective_name(coll)
        t = graph_collective(coll, kind, plan, options, c, st)
        out[name] = out[name] + t if name in out else t
    for name, t in context_parallel_collectives(kind, plan, options, c, st).items():
        out[name] = out[name] + t if name in out else t
    return out


# -- step-level terms ----------------------------------------------------------------------

def _head_times(plan: Plan, c: Constants, st, tokens):
    """LM head over ``tokens`` rows (step.md §7): ``(sm_s, hbm_s)``, 0 when no real token."""
    real = st.b.t_real > 0
    ramp = laws.ramp(tokens, c.eps, c.m_half)
    sm = jnp.where(real, laws.safe_div(tokens * plan.head_flops_per_token / plan.tp,
                                       c.P * ramp) * st.sm_derate, 0.0)
    hbm = jnp.where(real, plan.head_weight_bytes / plan.tp / c.B_hbm, 0.0)
    return sm, hbm


def lm_head(plan: Plan, options, c: Constants, st) -> Term:
    """The LM head: the edges compute logits for every real token (step.md §7);
    ``expected_s`` only for the sampled positions (refinement 4)."""
    b = st.b
    sm, hbm = _head_times(plan, c, st, b.t_real)
    if options.expected_refinements:
        sampled = jnp.minimum(b.t_real, b.n_live * plan.uniform_decode_width)
        exp = options.mx(*_head_times(plan, c, st, sampled))
    else:
        exp = options.mx(sm, hbm)
    return Term.of(c.zero, sm=sm, hbm=hbm, expected=exp)


def draft_passes(plan: Plan, options, c: Constants, st, first: dict, later_step) -> Term:
    """``expected_s`` only: the MTP drafter's work after the target pass.

    vLLM v0.31.0 runs one speculator module per draft token: the first over the step's
    tokens (the target's hidden states), each later one over one token per request; every
    pass computes the logits of one token per request. The edges leave the drafter unpriced
    (D7). ``first`` maps a kind id to its layer's expected seconds in this step;
    ``later_step`` builds the token counts of a later pass.
    """
    n = st.b.n_live
    total = sum((count * first[kid] for kid, count in plan.draft_kinds), c.zero)
    if plan.num_spec > 1:
        later = later_step()
        kinds = {k.id: k for k in plan.kinds}
        per_pass = c.zero
        for kid, count in plan.draft_kinds:
            layer = c.zero
            for t in layer_terms(kinds[kid], plan, options, c, later).values():
                layer = layer + t.expected_s
            per_pass = per_pass + count * layer
        total += (plan.num_spec - 1) * per_pass
    total += plan.num_spec * options.mx(*_head_times(plan, c, st, n))
    return Term.of(c.zero, expected=jnp.where(n > 0, total, 0.0))


def graph_mode(plan: Plan, b):
    """The CUDA-graph mode of the step (step.md §8): FULL for a uniform decode under a FULL
    decode mode, EAGER past the capture ceiling."""
    mode = jnp.where((b.n_live <= 0) | b.uniform, plan.decode_mode, plan.other_mode)
    return jnp.where(b.tokens + b.t_pad > plan.capture_ceiling, EAGER, mode)


def graph_replay(plan: Plan, c: Constants, st) -> Term:
    """Host time per step of the graph mode: one replay (FULL), one per segment (PIECEWISE),
    or the eager per-layer launch cost (step.md §8). Charged even for an empty step."""
    p, mode = c.params, graph_mode(plan, st.b)
    replay = p["host_replay_graph_per_step"]
    s = jnp.where(mode == FULL, replay,
                  jnp.where(mode == PIECEWISE, replay * plan.segments,
                            p["host_launch_eager_per_layer"] * plan.total_layers))
    return Term.of(c.zero, host=s, expected=s)


def kernel_launches(plan: Plan, c: Constants, st) -> Term:
    """Host launch cost of every kernel (step.md §8); under FULL replay the graph launches
    its own kernels, so ``expected_s`` charges none (expected.md)."""
    b = st.b
    launches = c.params["host_launch_per_kernel"] * plan.total_kernels
    full = graph_mode(plan, b) == FULL
    return Term.of(c.zero, host=jnp.where(b.empty, 0.0, launches),
                   expected=jnp.where(b.empty | full, 0.0, launches))


def kernel_gap(plan: Plan, c: Constants, st) -> Term:
    """``expected_s`` only: the GPU's idle gap between consecutive kernels (expected.md)."""
    return Term.of(c.zero, expected=jnp.where(st.b.empty, 0.0,
                                              plan.total_kernels * c.params["kernel_gap"]))


def host_serial(plan: Plan, c: Constants, st) -> Term:
    """``expected_s`` only: host work the GPU does not hide, added after the GPU/host maximum
    (expected.md's serial host time).

    vLLM 0.23–0.31's V1 engine core without async scheduling runs, between two GPU passes,
    the scheduler, the model runner's input preparation and the update from the sampled
    tokens: part of it per step (``host_serial``), part per live request
    (``host_serial_per_request``). Both are engine-level constants fitted from step traces
    (``calibration.stepfit``); they are 0 until one is fitted. An empty batch is no engine
    step (vLLM's core skips the model when nothing is scheduled) and costs none.
    """
    b = st.b
    serial = (c.params["host_serial"] * jnp.ones_like(b.tokens)
              + c.params["host_serial_per_request"] * b.n_live)
    return Term.of(c.zero, expected=jnp.where(b.empty, 0.0, serial))


# -- where a step's time goes --------------------------------------------------------------

#: Columns of :func:`breakdown_table` (seconds unless named otherwise).
BREAKDOWN_COLUMNS = ("kind", "layers", "term", "sm_s", "hbm_s", "nvlink_s", "nic_s", "host_s",
                     "expected_s", "share")


def breakdown_table(plan: Plan, estimate):
    """Rows of layer kind × term × resource seconds of one (unbatched) estimate.

    Returns a :class:`pandas.DataFrame` with :data:`BREAKDOWN_COLUMNS`: ``layers`` is the
    kind's layer count (1 for the step-level terms, kind :data:`STEP`); the resource columns
    are the edges' seconds of the term over all its layers, and sum over the rows to
    ``per_resource_s``; ``expected_s`` is the term's part of ``expected_s`` on its critical
    path — the GPU terms when ``gpu_s ≥ host_s``, else the host terms (the other side is
    hidden under it and shows 0), plus ``host serial`` — so the column sums to
    ``expected_s`` (exactly for the hard maximum, ``smooth_temperature = 0``); ``share`` is
    ``expected_s`` of the row over the step's.
    """
    import numpy as np
    import pandas as pd

    if estimate.terms is None:
        raise ValueError("this estimate carries no terms (a packed fast path); price with "
                         "Kernel.breakdown or step_fn")
    counts = {k.id: k.count for k in plan.kinds}
    f = lambda x: float(np.asarray(x))  # noqa: E731
    step = estimate.terms[STEP]
    gpu = sum(f(t.expected_s) for kid, d in estimate.terms.items() for n, t in d.items()
              if kid != STEP or n in GPU_STEP_TERMS)
    host = sum(f(step[n].expected_s) for n in HOST_TERMS)
    gpu_critical = gpu >= host
    total = f(estimate.expected_s)
    rows = []
    order = [k.id for k in plan.kinds] + [STEP]
    for kid in order:
        for name in sorted(estimate.terms[kid]):
            t = estimate.terms[kid][name]
            if kid == STEP and name in HOST_TERMS:
                exp = f(t.expected_s) if not gpu_critical else 0.0
            elif kid == STEP and name == "host serial":
                exp = f(t.expected_s)
            else:
                exp = f(t.expected_s) if gpu_critical else 0.0
            rows.append((kid, counts.get(kid, 1), name, f(t.sm_s), f(t.hbm_s), f(t.nvlink_s),
                         f(t.nic_s), f(t.host_s), exp, exp / total if total > 0 else 0.0))
    return pd.DataFrame(rows, columns=list(BREAKDOWN_COLUMNS))
