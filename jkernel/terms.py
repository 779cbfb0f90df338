"""Named cost terms: one law per piece of work a step prices (spec step.md §6–§8 and
expected.md), and the one table that names them.

Every term is a :class:`Term`: the seconds it puts on each resource of one rank
(:class:`~jkernel.stages.Resources`) for **one layer** of one kind (step-level terms — the LM
head, the drafter, the host — for the whole step), as the reference edges count them, and
the seconds it adds to jkernel's own ``expected_s``. :data:`LAYER_TERMS` and
:data:`STEP_TERMS` list every term with its :class:`Side` (where the composers in
:mod:`jkernel.step` put it); :func:`price_terms` prices the table for one step.

The laws are traceable and never branch on values. Their arguments:

* ``kind`` / ``plan``: static structure (:mod:`jkernel.plan`);
* ``options``: :class:`~jkernel.stages.StepOptions` (``options.maximum``, the step's max);
* ``c``: :class:`Constants`, the params a step reads, lifted once;
* ``st``: :class:`~jkernel.stages.StepInputs`: the step's token counts (``st.batch``, a
  :class:`~jkernel.stages.StepBatch` of scalars, or arrays of the batch shape under leading
  batch axes) with the ramps and the SM derate.

Adding a term: write its law here (a function of the arguments above returning a
:class:`Term`) and add its row to :data:`LAYER_TERMS` or :data:`STEP_TERMS`.

Shapes: every field of a :class:`Term` has the batch shape (``()`` for one batch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import laws
from .plan import (AttentionPlan, CollectiveKey, CollectiveLaunch, GemmPlan,
                   GraphMode, GroupPlan, KindPlan, Plan, Rows, read_shape)
from .stages import Resources, StepInputs, StepOptions

__all__ = ["Term", "Side", "TermRow", "LAYER_TERMS", "STEP_TERMS", "STEP", "Constants",
           "PricedTerms", "side", "price_terms", "expected_sum", "layer_terms", "gemm_names",
           "dense_gemm", "dense_gemms", "routed_experts", "shared_experts",
           "attention_decode_read", "attention_prefill", "secondary_decode_reads",
           "secondary_decode_read", "recurrent_mixer", "elementwise", "collectives", "lm_head",
           "draft_passes", "graph_mode", "graph_replay", "kernel_launches", "kernel_gap",
           "host_serial"]


#: The key of the step-level terms in :attr:`StepEstimate.terms` (not a layer kind).
STEP = "(step)"


class Term(NamedTuple):
    """One named cost term, seconds per rank (a pytree).

    ``per_resource_s``: what the reference edges charge each resource (step.md §6.11, §8);
    ``expected_s``: what the term adds to ``expected_s`` (expected.md), which need not be
    any one resource's time (a GEMM adds the larger of its compute and memory time).
    """

    per_resource_s: Resources
    expected_s: jax.Array

    @classmethod
    def of(cls, zero, *, sm=None, hbm=None, nvlink=None, nic=None, host=None, expected=None):
        z = lambda x: zero if x is None else x  # noqa: E731
        return cls(Resources(z(sm), z(hbm), z(nvlink), z(nic), z(host)), z(expected))

    def scaled(self, n) -> "Term":
        return jax.tree_util.tree_map(lambda x: n * x, self)

    def __add__(self, other: "Term") -> "Term":          # type: ignore[override]
        return jax.tree_util.tree_map(lambda a, b: a + b, self, other)

    def where(self, keep) -> "Term":
        return jax.tree_util.tree_map(lambda x: jnp.where(keep, x, 0.0), self)


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

def gemm_names(kind: KindPlan) -> list[str]:
    """A unique term name per fused GEMM of ``kind``: ``gemm <role>+<role>``."""
    names, seen = [], {}
    for g in kind.gemms:
        base = "gemm " + "+".join(r or "?" for r in g.roles)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
    return names


def dense_gemms(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                st: StepInputs) -> dict[str, Term]:
    """Every fused dense GEMM of ``kind``, by :func:`gemm_names`."""
    return {name: dense_gemm(g, plan, options, c, st)
            for name, g in zip(gemm_names(kind), kind.gemms)}


def dense_gemm(g: GemmPlan, plan: Plan, options: StepOptions, c: Constants,
               st: StepInputs) -> Term:
    """One (fused) dense GEMM (step.md §6.1; expected: max(compute, memory) with vLLM's
    sharding, refinement 1, and activation traffic, refinement 2)."""
    b, P, B_hbm, derate, tp = st.batch, c.P, c.B_hbm, st.sm_derate, plan.tp
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
                   expected=options.maximum(compute * derate, memory))


def routed_experts(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                   st: StepInputs) -> Term:
    """Routed experts (step.md §6.2), serial after the layer's stage in the edges."""
    routed_flops, routed_bytes = laws.routed_expert_work(
        st.batch.t_gemm * plan.funnel, kind.top_k, plan.local_expert_share,
        kind.expert_flops_per_token_per_expert, c.imb, plan.dp_slice,
        plan.physical_experts, plan.experts_per_rank, kind.expert_weight_bytes_per_expert,
        plan.expert_tensor_shards)
    sm = laws.safe_div(routed_flops, c.P * st.r_g) * st.sm_derate
    hbm = laws.memory_time(routed_bytes, c.B_hbm)
    return Term.of(c.zero, sm=sm, hbm=hbm, expected=(options.maximum(sm, hbm)
                                                     if options.expected_routed_max
                                                     else sm + hbm))


def shared_experts(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                   st: StepInputs) -> Term:
    """Shared experts: priced as dense GEMMs (step.md §6.2)."""
    flops = st.batch.t_gemm * kind.shared_expert_flops_per_token / plan.tp
    sm = laws.safe_div(flops, c.P * st.r_g) * st.sm_derate
    hbm = kind.shared_expert_weight_bytes / plan.tp / c.B_hbm
    return Term.of(c.zero, sm=sm, hbm=hbm, expected=options.maximum(sm, hbm))


def _single_launch(att: AttentionPlan, plan: Plan) -> bool:
    """vLLM v0.31.0 FlashAttention runs one varlen launch for a mixed batch (step.md §6.3)."""
    return not att.kind.latent and plan.dcp <= 1 and not plan.blackwell


def _monotone(options) -> bool:
    """jkernel's refinements 6–8 (on with expected.md's 1–5): the terms that keep
    ``expected_s`` non-decreasing as work is added (see :func:`attention_decode_read`,
    :func:`attention_prefill` and, for context-parallel plans,
    :func:`collectives` with :meth:`jkernel.stages.StepBatch.expected_view`)."""
    return options.expected_refinements


def attention_decode_read(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                          st: StepInputs) -> Term:
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
    att = kind.attention
    f_dec, r_dec = c.pair(att.kind)
    with_rate = r_dec > 0
    shape = read_shape(plan, att)
    single = _single_launch(att, plan)
    f_p = c.params["attention_prefill_floor"]
    scaled = c.params["attention_prefill_work_scale"] > 0

    def priced(T, reads):
        hbm = jnp.where(reads & with_rate,
                        laws.floor_plus_rate(T * plan.bpt_layer, f_dec, r_dec), 0.0)
        if single:
            cond = reads & st.has_pre & with_rate & scaled
            hbm = hbm - jnp.where(cond & (f_dec <= f_p), f_dec, 0.0)
        return hbm + jnp.where(reads & ~with_rate, T * plan.bpt_layer, 0.0) / c.B_hbm

    edge = priced(st.batch.decode_read(shape), st.has_dec)
    exp = priced(st.batch.live_read(shape), st.has_live) if _monotone(options) else edge
    return Term.of(c.zero, hbm=edge, expected=exp)


def attention_prefill(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                      st: StepInputs) -> Term:
    """The primary attention's prefill work over causal pairs (step.md §6.3); ``expected_s``
    prices MLA decompressed (refinement 3).

    The edges take the efficiency from the token ramp at the whole step's token count, so a
    small extra request raises a long prefill's attention efficiency and lowers the price
    (the reference's behaviour). ``expected_s`` (refinement 7) runs the ramp at
    ``W / max_i w_i`` rows — ``W`` the step's causal work, ``w_i`` one prefill's work per
    query row —, i.e. charges ``(W + m½·max_i w_i)/(P·ε_max)``: the single prefill's own
    ramp, non-decreasing when a request is added or grows.
    """
    att = kind.attention
    b, P, derate = st.batch, c.P, st.sm_derate
    f_p = c.params["attention_prefill_floor"]
    w_p = c.params["attention_prefill_work_scale"]
    scaled = w_p > 0
    causal = b.windowed(att.window) if att.window > 0 else b.causal_flops
    work = causal * att.n_q * att.d_h / plan.tp
    exp_work = work
    if (options.expected_refinements and att.kind.latent and att.qk_nope_head_dim
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


def secondary_decode_reads(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                           st: StepInputs) -> dict[str, Term]:
    """Every secondary attention's decode read, as ``attention <role> decode read``."""
    out: dict[str, Term] = {}
    for i, a in enumerate(kind.secondaries):
        name = f"attention {a.role or i} decode read"
        t = secondary_decode_read(a, kind.attention, plan, options, c, st)
        out[name] = out[name] + t if name in out else t
    return out


def secondary_decode_read(a: AttentionPlan, att: AttentionPlan, plan: Plan,
                          options: StepOptions, c: Constants, st: StepInputs) -> Term:
    """A secondary attention's decode read (an indexer, a compressed cache; step.md §6.4);
    ``expected_s`` reads it for every live request (refinement 6)."""
    b = st.batch
    f_a, r_sec = c.pair(a.kind)
    per_token = plan.bpt_layer * (a.n_kv * a.d_h) / (att.n_kv * att.d_h)

    def priced(T2, requests, reads):
        if a.window > 0:
            T2 = jnp.minimum(T2, a.window * requests)
        if a.compress_ratio > 1:
            T2 = T2 / a.compress_ratio
        if plan.dcp > 1 and a.kind.dcp_shardable:
            T2 = laws.dcp_local(laws.round_half_up(T2), plan.dcp, plan.interleave)
        return jnp.where(reads & (r_sec > 0),
                         laws.floor_plus_rate(T2 * per_token, f_a, r_sec), 0.0)

    edge = priced(b.decode_kv_tokens, b.decode_requests, st.has_dec)
    exp = (priced(b.live_read(None), b.n_live, st.has_live) if _monotone(options) else edge)
    return Term.of(c.zero, hbm=edge, expected=exp)


def recurrent_mixer(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                    st: StepInputs) -> Term:
    """A recurrent mixer's update over the step's tokens (step.md §6.5)."""
    s = c.zero
    for rk, fn, rn in plan.recurrent_names:
        if rk == kind.recurrent.kind:
            f_r, rho = c.params[fn], c.params[rn]
            ok = (f_r > 0) & (rho > 0)
            s = jnp.where(ok, laws.floor_plus_rate(st.batch.t_real, f_r, rho), 0.0)
    return Term.of(c.zero, sm=s, expected=s)


def elementwise(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                st: StepInputs) -> Term:
    """Norms and other elementwise kernels: their bytes on HBM (step.md §6.7)."""
    s = st.batch.t_gemm * kind.elementwise_bytes_per_token / plan.tp / c.B_hbm
    return Term.of(c.zero, hbm=s, expected=s)


def collectives(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                st: StepInputs) -> dict[str, Term]:
    """Every collective one layer of ``kind`` launches, as :meth:`Plan.launches` lists it
    (the plan decides which; this prices them), by term name: the graph's all-reduces,
    gathers, scatters and the MoE all-to-all (step.md §6.8; ``expected_s`` charges the
    all-to-all as its two launches, dispatch and combine, refinement 5), DCP's
    query/LSE/output collectives and MLA context gathers (§6.9), PCP's KV gathers (§6.10).

    A launch moves ``rows × factors`` bytes (:class:`~jkernel.plan.Rows`): the hidden
    states of the GEMM tokens; DCP's rows — the decode tokens of a latent attention, every
    token of a GQA one once a request has context —; or ``pcp ×`` the prefill tokens.

    On the view ``expected_s`` prices a context-parallel plan with (``st.batch.envelope``,
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
    b, zero = st.batch, c.zero
    envelope = bool(b.envelope) and _monotone(options)
    att = kind.attention
    out: dict[str, Term] = {}
    rows: dict[Rows, tuple] = {}

    def counted(which: Rows):
        """``(rows, when)`` of a row count, evaluated once per layer."""
        if which not in rows:
            if which is Rows.HIDDEN:
                rows[which] = (b.t_gemm * plan.hidden_size, None)
            elif which is Rows.DCP:
                latent = att.kind.latent
                n = b.decode_tokens if latent else jnp.where(b.any_context, b.tokens, 0.0)
                some = n > 0
                if latent and envelope:
                    n = n + b.decode_threshold * b.prefill_requests
                    some = st.has_live
                rows[which] = (n, some)
            else:                                                           # Rows.PCP
                rows[which] = (plan.pcp * b.prefill_tokens, b.prefill_tokens > 0)
        return rows[which]

    for launch in plan.launches(kind):
        key, group = plan.key(launch.op, launch.group), plan.group(launch.group)
        if launch.rows is Rows.CONTEXT:
            gather = _chunked_context_gather if envelope else _mla_context_gather
            dv, dn = gather(plan, b, launch, key, group, c)
            t = Term.of(zero, nvlink=dv, nic=dn, expected=dv + dn)
        else:
            n, when = counted(launch.rows)
            nbytes = n
            for f in launch.factors:
                nbytes = nbytes * f
            dv, dn = c.coll(key, group, nbytes, launch.all_to_all)
            if when is not None:
                dv, dn = jnp.where(when, dv, 0.0), jnp.where(when, dn, 0.0)
            launches = 2 if (options.expected_refinements and launch.dispatch_and_combine) \
                else 1
            t = Term.of(zero, nvlink=dv, nic=dn, expected=launches * (dv + dn))
        out[launch.name] = out[launch.name] + t if launch.name in out else t
    return out


def _mla_context_gather(plan: Plan, b, launch: CollectiveLaunch, key: CollectiveKey,
                        group: GroupPlan, c: Constants):
    """Chunked context gathers of DCP-sharded latent prefixes (step.md §6.9)."""
    s_req, c_req, pre_req = b.requests
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
    per = _bytes(S, launch) / jnp.where(n > 0, n, 1.0)
    v, k = c.coll(key, group, per, launch.all_to_all)
    use = S > 0
    return (jnp.sum(jnp.where(use, n * v, 0.0), axis=-1),
            jnp.sum(jnp.where(use, n * k, 0.0), axis=-1))


def _chunked_context_gather(plan: Plan, b, launch: CollectiveLaunch, key: CollectiveKey,
                            group: GroupPlan, c: Constants):
    """``expected_s``: the DCP gathers of the prefills' cached latent context as vLLM v0.31.0
    chunks it (see :func:`collectives`): ``n = ceil(max c / q)``
    iterations, ``q = max(⌊chunk / P / block⌋·block, block)``, each gathering ``Σ c / n``
    tokens of ``d_h`` bf16 values."""
    total, count, longest = b.prefill_context
    block = float(max(plan.block_size, 1))
    share = jnp.floor(max(plan.mla_chunk, 1) / jnp.maximum(count, 1.0) / block) * block
    n = jnp.ceil(longest / jnp.maximum(share, block))
    per = _bytes(total, launch) / jnp.where(n > 0, n, 1.0)
    v, k = c.coll(key, group, per, launch.all_to_all)
    use = total > 0
    return jnp.where(use, n * v, 0.0), jnp.where(use, n * k, 0.0)


def _bytes(rows, launch: CollectiveLaunch):
    for f in launch.factors:
        rows = rows * f
    return rows


# -- step-level terms ----------------------------------------------------------------------

def _head_times(plan: Plan, c: Constants, st: StepInputs, tokens):
    """LM head over ``tokens`` rows (step.md §7): ``(sm_s, hbm_s)``, 0 when no real token."""
    real = st.batch.t_real > 0
    ramp = laws.ramp(tokens, c.eps, c.m_half)
    sm = jnp.where(real, laws.safe_div(tokens * plan.head_flops_per_token / plan.tp,
                                       c.P * ramp) * st.sm_derate, 0.0)
    hbm = jnp.where(real, plan.head_weight_bytes / plan.tp / c.B_hbm, 0.0)
    return sm, hbm


def lm_head(plan: Plan, options: StepOptions, c: Constants, st: StepInputs,
            layers: LayerTerms) -> Term:
    """The LM head: the edges compute logits for every real token (step.md §7);
    ``expected_s`` only for the sampled positions (refinement 4)."""
    b = st.batch
    sm, hbm = _head_times(plan, c, st, b.t_real)
    if options.expected_refinements:
        sampled = jnp.minimum(b.t_real, b.n_live * plan.uniform_decode_width)
        exp = options.maximum(*_head_times(plan, c, st, sampled))
    else:
        exp = options.maximum(sm, hbm)
    return Term.of(c.zero, sm=sm, hbm=hbm, expected=exp)


def draft_passes(plan: Plan, options: StepOptions, c: Constants, st: StepInputs,
                 layers: LayerTerms) -> Term:
    """``expected_s`` only: the MTP drafter's work after the target pass.

    vLLM v0.31.0 runs one speculator module per draft token: the first over the step's
    tokens (the target's hidden states), each later one over one token per request; every
    pass computes the logits of one token per request. The edges leave the drafter unpriced
    (D7). The first pass's layer of a kind costs the target's (``layers``, priced on this
    step); a later pass is priced on :meth:`~jkernel.stages.StepInputs.draft_pass`.
    """
    n = st.batch.n_live
    total = sum((count * expected_sum(layers[kid], c.zero)
                 for kid, count in plan.draft_kinds), c.zero)
    if plan.num_spec > 1:
        later = st.draft_pass(c.eps, c.m_half)
        kinds = {k.id: k for k in plan.kinds}
        per_pass = c.zero
        for kid, count in plan.draft_kinds:
            layer = c.zero
            for t in layer_terms(kinds[kid], plan, options, c, later).values():
                layer = layer + t.expected_s
            per_pass = per_pass + count * layer
        total += (plan.num_spec - 1) * per_pass
    total += plan.num_spec * options.maximum(*_head_times(plan, c, st, n))
    return Term.of(c.zero, expected=jnp.where(n > 0, total, 0.0))


def graph_mode(plan: Plan, b):
    """The CUDA-graph mode of the step (step.md §8), an int array of :class:`GraphMode`
    values: FULL for a uniform decode under a FULL decode mode, EAGER past the capture
    ceiling."""
    mode = jnp.where((b.n_live <= 0) | b.uniform, int(plan.decode_mode), int(plan.other_mode))
    return jnp.where(b.tokens + b.t_pad > plan.capture_ceiling, int(GraphMode.EAGER), mode)


def graph_replay(plan: Plan, options: StepOptions, c: Constants, st: StepInputs,
                 layers: LayerTerms) -> Term:
    """Host time per step of the graph mode: one replay (FULL), one per segment (PIECEWISE),
    or the eager per-layer launch cost (step.md §8). Charged even for an empty step."""
    p, mode = c.params, graph_mode(plan, st.batch)
    replay = p["host_replay_graph_per_step"]
    s = jnp.where(mode == int(GraphMode.FULL), replay,
                  jnp.where(mode == int(GraphMode.PIECEWISE), replay * plan.segments,
                            p["host_launch_eager_per_layer"] * plan.total_layers))
    return Term.of(c.zero, host=s, expected=s)


def kernel_launches(plan: Plan, options: StepOptions, c: Constants, st: StepInputs,
                    layers: LayerTerms) -> Term:
    """Host launch cost of every kernel (step.md §8); under FULL replay the graph launches
    its own kernels, so ``expected_s`` charges none (expected.md)."""
    b = st.batch
    launches = c.params["host_launch_per_kernel"] * plan.total_kernels
    full = graph_mode(plan, b) == int(GraphMode.FULL)
    return Term.of(c.zero, host=jnp.where(b.empty, 0.0, launches),
                   expected=jnp.where(b.empty | full, 0.0, launches))


def kernel_gap(plan: Plan, options: StepOptions, c: Constants, st: StepInputs,
               layers: LayerTerms) -> Term:
    """``expected_s`` only: the GPU's idle gap between consecutive kernels (expected.md)."""
    return Term.of(c.zero, expected=jnp.where(st.batch.empty, 0.0,
                                              plan.total_kernels * c.params["kernel_gap"]))


def host_serial(plan: Plan, options: StepOptions, c: Constants, st: StepInputs,
                layers: LayerTerms) -> Term:
    """``expected_s`` only: host work the GPU does not hide, added after the GPU/host maximum
    (expected.md's serial host time).

    vLLM 0.23–0.31's V1 engine core without async scheduling runs, between two GPU passes,
    the scheduler, the model runner's input preparation and the update from the sampled
    tokens: part of it per step (``host_serial``), part per live request
    (``host_serial_per_request``). Both are engine-level constants fitted from step traces
    (``calibration.stepfit``); they are 0 until one is fitted. An empty batch is no engine
    step (vLLM's core skips the model when nothing is scheduled) and costs none.
    """
    b = st.batch
    serial = (c.params["host_serial"] * jnp.ones_like(b.tokens)
              + c.params["host_serial_per_request"] * b.n_live)
    return Term.of(c.zero, expected=jnp.where(b.empty, 0.0, serial))


# -- the one table of terms ------------------------------------------------------------------

class Side(Enum):
    """Where a term's seconds go when :mod:`jkernel.step` composes a step.

    ``STAGE``: GPU work inside its layer's overlapped stage (the edges take the stage's
    maximum over resources; a step-level GPU term joins the LM head's stage, step.md §7);
    ``SERIAL``: GPU work the edges add after its layer's stage (step.md §6.11: routed
    experts); both are on the GPU side of ``expected_s = max(gpu_s, host_s) +
    host_serial_s``, zero for an empty step. ``HOST``: the host side of that maximum;
    ``HOST_SERIAL``: host work after it.
    """

    STAGE = "gpu stage"
    SERIAL = "gpu serial"
    HOST = "host"
    HOST_SERIAL = "host serial"

    @property
    def gpu(self) -> bool:
        return self in (Side.STAGE, Side.SERIAL)


@dataclass(frozen=True)
class TermRow:
    """One row of the term table.

    ``name``: the term's name; None for a family whose law names its terms (a GEMM per
    fused role, a read per secondary attention, a collective per launch; families are
    ``STAGE`` terms). ``law``: ``law(kind, plan, options, c, st)`` for a layer row,
    ``law(plan, options, c, st, layers)`` for a step row (``layers``: the layer terms of this
    step, by kind id); it returns a :class:`Term` (a family: ``{name: Term}``).
    ``applies``: whether the row prices anything for a kind (layer rows) or for a plan and
    its options (step rows). ``edges``: the reference edges charge it (it is priced on their
    view of the step, and its ``expected_s`` on ``expected_s``'s); False: an ``expected_s``
    refinement, priced on ``expected_s``'s view alone.
    """

    name: str | None
    side: Side
    law: Callable
    applies: Callable | None = None
    edges: bool = True


#: Every layer term, in pricing order (step.md §6.1–§6.10).
LAYER_TERMS: tuple[TermRow, ...] = (
    TermRow(None, Side.STAGE, dense_gemms),
    TermRow("routed experts", Side.SERIAL, routed_experts, lambda k: k.moe),
    TermRow("shared experts", Side.STAGE, shared_experts, lambda k: k.moe),
    TermRow("attention decode read", Side.STAGE, attention_decode_read,
            lambda k: k.attention is not None),
    TermRow("attention prefill", Side.STAGE, attention_prefill,
            lambda k: k.attention is not None),
    TermRow(None, Side.STAGE, secondary_decode_reads, lambda k: k.attention is not None),
    TermRow("recurrent mixer", Side.STAGE, recurrent_mixer, lambda k: k.recurrent is not None),
    TermRow("norms and elementwise", Side.STAGE, elementwise),
    TermRow(None, Side.STAGE, collectives),
)

#: Every step-level term, in pricing order (step.md §7, §8 and expected.md).
STEP_TERMS: tuple[TermRow, ...] = (
    TermRow("lm head", Side.STAGE, lm_head),
    TermRow("draft passes", Side.STAGE, draft_passes,
            lambda plan, options: options.expected_refinements and bool(plan.draft_kinds),
            edges=False),
    TermRow("kernel gap", Side.STAGE, kernel_gap, edges=False),
    TermRow("host graph replay", Side.HOST, graph_replay),
    TermRow("host kernel launches", Side.HOST, kernel_launches),
    TermRow("host serial", Side.HOST_SERIAL, host_serial, edges=False),
)

#: ``{kind id: {term name: Term}}``, one layer of each kind.
LayerTerms = dict


def side(kind_id: str, name: str) -> Side:
    """The side of term ``name`` of kind ``kind_id`` (:data:`STEP` for a step-level term)."""
    for row in STEP_TERMS if kind_id == STEP else LAYER_TERMS:
        if row.name == name:
            return row.side
    return Side.STAGE                                   # a family's term


def _add(out: dict, name: str, t: Term) -> None:
    out[name] = out[name] + t if name in out else t


def layer_terms(kind: KindPlan, plan: Plan, options: StepOptions, c: Constants,
                st: StepInputs) -> dict[str, Term]:
    """Every named term of one layer of ``kind`` on ``st``, in :data:`LAYER_TERMS` order (a
    name priced twice adds up)."""
    out: dict[str, Term] = {}
    for row in LAYER_TERMS:
        if row.applies is not None and not row.applies(kind):
            continue
        priced = row.law(kind, plan, options, c, st)
        for name, t in (priced.items() if row.name is None else ((row.name, priced),)):
            _add(out, name, t)
    return out


class PricedTerms(NamedTuple):
    """Every term of one step: ``layers[kind id][term]`` per layer, ``step[term]`` once."""

    layers: LayerTerms
    step: dict


def _both(edge_fn, st: StepInputs, ex: StepInputs):
    """A term priced on the edges' view ``st``, with ``expected_s`` from ``expected_s``'s
    view ``ex`` (the same view unless refinement 8 gives a context-parallel plan its own)."""
    edge = edge_fn(st)
    if ex is st:
        return edge
    exp = edge_fn(ex)
    if isinstance(edge, dict):
        return {n: t._replace(expected_s=exp[n].expected_s) for n, t in edge.items()}
    return edge._replace(expected_s=exp.expected_s)


def price_terms(plan: Plan, options: StepOptions, c: Constants, st: StepInputs,
                ex: StepInputs) -> PricedTerms:
    """Price the table for one step: each term's resources on the edges' view ``st`` and
    its ``expected_s`` on ``ex`` (:meth:`~jkernel.stages.StepInputs.expected_view`, or
    ``st`` itself); an ``expected_s``-only row on ``ex`` alone."""
    layers = {kind.id: _both(lambda s, k=kind: layer_terms(k, plan, options, c, s), st, ex)
              for kind in plan.kinds}
    step: dict[str, Term] = {}
    for row in STEP_TERMS:
        if row.applies is not None and not row.applies(plan, options):
            continue
        law = lambda s, r=row: r.law(plan, options, c, s, layers)  # noqa: E731
        step[row.name] = _both(law, st, ex) if row.edges else law(ex)
    return PricedTerms(layers, step)


def expected_sum(layer: dict, zero):
    """Σ of ``expected_s`` over one layer's terms ({name: Term}), from ``zero``."""
    out = zero
    for t in layer.values():
        out = out + t.expected_s
    return out
