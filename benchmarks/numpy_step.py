"""An independent NumPy (float64) implementation of jkernel's step model, for the deployments
the benchmarks price: the speed yardstick of ``Kernel.step_time`` (``bench_step.py``).

Written from the spec (``docs/spec/step.md`` and ``expected.md``; the README's "A worked
step, by hand") and the catalog's constants, **not** from jkernel's code: it reads the
kernel's static :class:`~jkernel.plan.Plan` fields and its ``Params`` values as inputs and
calls none of jkernel's laws, terms or step functions. It prices the dense plans the
benchmarks use (qwen3-14b-h100-tp1, llama-3.1-8b-h100-tp1, llama-3.1-70b-h100-tp4: GQA
attention without a window, dense GEMMs, TP collectives on NVLink or across nodes); a plan
with anything else (experts, sliding or sparse windows, latent attention, recurrent
mixers, secondary attentions, context parallelism, a drafter) or non-default
``StepOptions`` is refused with the feature named, never priced approximately.
``expected_s``'s decode read follows the shape-aware law of ``docs/concepts.md``: the
floor plus the p-norm of the KV stream time and a time per (request, KV head) row
(``attention_decode_row_floor``, ``attention_decode_overlap``; with no row time, step.md
§6.3's floor + bytes/rate). The fused-MoE law of the routed experts is not needed here:
plans with experts are refused.

It is written as a careful engineer would write a fast NumPy version: everything that does
not depend on the batch is computed once at construction; a call makes a handful of
vectorised passes over the requests (sums, counts and one float64 sum of causal pairs) and
does the rest in Python floats. ``tests/test_numpy_reference.py`` holds it equal to
``Kernel.step_time`` to 1e-12 relative on random batches.

    from benchmarks.numpy_step import NumpyStep
    ref = NumpyStep.of(kernel)
    est = ref(scheduled, computed, decode_threshold=1, sm_budget=0, pad_tokens=0)
    est.expected_s, est.no_overlap_s, est.overlap_s, est.per_resource_s["hbm"]
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["NumpyEstimate", "NumpyStep", "Unsupported"]

RESOURCES = ("sm", "hbm", "nvlink", "nic", "host")
INF = float("inf")
# CUDA-graph modes of the plan (resolution.md §11), as the plan numbers them
EAGER, PIECEWISE, FULL = 0, 1, 2


class Unsupported(ValueError):
    """A plan with a feature this reference does not implement."""


class NumpyEstimate(NamedTuple):
    """One step's price, Python floats (seconds); ``per_resource_s`` has all five
    resources (zeros included); ``bottleneck`` indexes :data:`RESOURCES`."""

    overlap_s: float
    no_overlap_s: float
    expected_s: float
    per_resource_s: dict
    bottleneck: int


def _factor(x: float, half: float) -> float:
    """x/(x + h) for a positive h and x, else 1 (step.md §2, shape-aware efficiency)."""
    return x / (x + half) if (half > 0.0 and x > 0.0) else 1.0


class _Gemm(NamedTuple):
    """A fused dense GEMM, per rank, folded into what does not depend on the batch: its
    compute time is ``x · coefficient`` with ``x = t / F(t, m½)`` (shape-aware; ``t / ramp(t)``
    otherwise), its memory time ``weight + t · activations``."""

    edge: float            # the spec's FLOPs F/tp over P · eps · F(k) · F(n), per token
    exp: float             # vLLM's shard: 2 · n_r · k_r over P · eps · F(k_r) · F(n_r)
    exp_weight: float      # weight bytes of vLLM's shard over B_hbm (refinement 1)
    exp_act: float         # (n_r + k_r) · 2 activation bytes per token over B_hbm (2)


class _Collective(NamedTuple):
    floor: float
    peak: float
    transition: float
    span: float            # byte multiplier when the group crosses nodes (1 otherwise)
    on_nic: bool
    launches: int          # expected_s: an all-to-all is two launches


class NumpyStep:
    """The step model of one kernel's plan and params, in NumPy and Python floats."""

    @classmethod
    def of(cls, kernel) -> "NumpyStep":
        """The reference for ``kernel`` (its ``plan``, ``params`` and ``options``)."""
        return cls(kernel.plan, {k: float(v) for k, v in kernel.params.items()},
                   kernel.options)

    def __init__(self, plan, params: dict, options=None):
        self._check(plan, options)
        p = {k: float(v) for k, v in params.items()}
        kind = plan.kinds[0]
        att = kind.attention
        tp = plan.tp
        self.layers = float(kind.count)
        self.uniform_width = int(plan.uniform_decode_width)
        # step.md §3: the constants fixed at construction
        self.P = P = p["peak_flops_per_s"] * p["compute_derate"]
        self.B = B = p["hbm_bytes_per_s"] * p["hbm_derate"]
        self.eps = eps = p[plan.gemm_names[0]]
        self.m_half = p[plan.gemm_names[1]]
        self.shape_aware = bool(plan.shape_aware)
        n_half = p[plan.gemm_names[2]] if plan.shape_aware else 0.0
        k_half = p[plan.gemm_names[3]] if plan.shape_aware else 0.0
        self.sm_count = p["sm_count"]
        if not (P > 0 and B > 0 and eps > 0):
            raise Unsupported("the NumPy reference does not price a zero peak, bandwidth or "
                              "GEMM efficiency (D5's infinities)")
        # §6.1 and expected.md refinements 1, 2: per fused GEMM
        gemms = []
        weight_hbm = 0.0
        shaped = (lambda n, k: eps * _factor(k, k_half) * _factor(n, n_half)) \
            if plan.shape_aware else (lambda n, k: 1.0)
        for g in kind.gemms:
            n_s, k_s = (g.n / tp, g.k) if g.shard_n else (g.n, g.k / tp)
            frac = g.vllm_rank_fraction
            if frac >= 1.0:
                n_r, k_r = g.n, g.k
            elif g.shard_n:
                n_r, k_r = g.n * frac, g.k
            else:
                n_r, k_r = n_s, k_s
            gemms.append(_Gemm(edge=g.flops_per_token / tp / (P * shaped(n_s, k_s)),
                               exp=2.0 * n_r * k_r / (P * shaped(n_r, k_r)),
                               exp_weight=g.weight_bytes * frac / B,
                               exp_act=(n_r + k_r) * 2.0 / B))
            weight_hbm += g.weight_bytes / tp / B
        self.gemms = tuple(gemms)
        self.edge_gemm = sum(g.edge for g in gemms)
        # the weights stream once per layer, whatever the batch (§6.1)
        self.weight_hbm = weight_hbm
        # §6.7: norms and elementwise bytes per token of the layer, on HBM
        self.elementwise_per_token = kind.elementwise_bytes_per_token / tp / B
        # §6.3 attention: the GQA decode pair, the prefill floor and work scale
        self.bpt = plan.kv_bytes_per_token / plan.kv_layers if plan.kv_layers else 0.0
        self.f_dec = p["attention_decode_floor"]
        self.r_dec = p["attention_decode_rate"]
        for k, floor, rate in plan.decode_pairs[1:]:      # a pair of the kind's own
            if k == att.kind and p[rate] > 0:
                self.f_dec, self.r_dec = p[floor], p[rate]
        self.f_p = p["attention_prefill_floor"]
        self.w_p = p["attention_prefill_work_scale"]
        # causal pairs → seconds at unit efficiency, with and without the work scale
        self.attn_scaled = att.n_q * att.d_h / tp / (P * self.w_p) if self.w_p > 0 else 0.0
        self.attn_plain = att.n_q * att.d_h / tp / P
        self.read_per_token = self.bpt / self.r_dec if self.r_dec > 0 else 0.0
        # expected_s's decode law: f + ((bytes/r)^p + (rows · c)^p)^(1/p), one row per
        # (request, KV head) on the rank (KV heads replicated below one per rank); with no
        # row time c it is the edges' f + bytes/r, whatever p (p < 1 counts as 1)
        self.row_s = max(p.get("attention_decode_row_floor", 0.0), 0.0)
        self.row_order = max(p.get("attention_decode_overlap", 1.0), 1.0)
        self.row_per_request = self.row_s * max(1.0, att.n_kv / tp)
        # FlashAttention's single varlen launch for a mixed batch (not on Blackwell, no DCP)
        self.single_launch = not plan.blackwell
        # §6.8: the graph's collectives of one layer, bytes = tokens · H · 2
        colls = []
        ratio = p["nvlink_bytes_per_s"] / p["nic_bytes_per_s"]
        for c in kind.collectives:
            key = next(k for k in plan.collective_keys if (k.op, k.group) == (c.op, c.group))
            group = next(g for g in plan.groups if g.name == c.group)
            colls.append(_Collective(
                p[key.floor], p[key.peak], p[key.transition],
                _ring_span(group.width, group.per_node, ratio) if group.crosses else 1.0,
                group.crosses, 2 if c.op == "alltoall" else 1))
        self.collectives = tuple(colls)
        self.coll_bytes_per_token = plan.hidden_size * 2.0
        # §7 LM head
        self.head_compute = plan.head_flops_per_token / tp / P      # per token at ε = 1
        self.head_hbm = plan.head_weight_bytes / tp / B
        # §8 host
        self.decode_mode, self.other_mode = plan.decode_mode, plan.other_mode
        self.ceiling = plan.capture_ceiling
        replay = p["host_replay_graph_per_step"]
        self.host_mode = {FULL: replay, PIECEWISE: replay * plan.segments,
                          EAGER: p["host_launch_eager_per_layer"] * plan.total_layers}
        self.launches = p["host_launch_per_kernel"] * plan.total_kernels
        # expected.md: the GPU's gap between kernels and the host work it does not hide
        self.kernel_gap = plan.total_kernels * p["kernel_gap"]
        self.serial = p["host_serial"]
        self.serial_per_request = p["host_serial_per_request"]

    @staticmethod
    def _check(plan, options) -> None:
        def no(what: str):
            raise Unsupported(f"the NumPy reference does not price {what}")

        if options is not None and (options.smooth_temperature != 0
                                    or not options.expected_refinements
                                    or not options.expected_routed_max):
            no(f"non-default step options ({options})")
        if len(plan.kinds) != 1:
            no(f"{len(plan.kinds)} layer kinds")
        kind = plan.kinds[0]
        att = kind.attention
        if att is None or att.kind != "gqa" or att.window > 0 or att.n_q <= 0:
            no(f"the attention {att}")
        if kind.secondaries:
            no("secondary attentions")
        if kind.moe or kind.shared_expert_flops_per_token > 0:
            no("experts")
        if kind.recurrent is not None:
            no("recurrent mixers")
        if plan.pcp > 1 or plan.dcp > 1:
            no("context parallelism")
        if plan.draft_kinds:
            no("a drafter")
        if any(c.op == "alltoall" or c.group != "TP" for c in kind.collectives):
            no("collectives other than the TP group's")

    # -- one step --------------------------------------------------------------------------
    def __call__(self, scheduled, computed, decode_threshold: int = 1, sm_budget: int = 0,
                 pad_tokens: int = 0) -> NumpyEstimate:
        """Price one step. ``scheduled``, ``computed``: int arrays ``(n,)`` (non-negative;
        a request with ``scheduled = 0`` is padding, D32)."""
        s = np.asarray(scheduled)
        c = np.asarray(computed)
        n_live = int(np.count_nonzero(s))
        if n_live < s.size:                            # D32: drop the zero-padding rows
            live = s > 0
            s, c = s[live], c[live]
        # §4, the walk, as vectorised sums: token counts, the decodes' contexts, the
        # prefills' causal pairs and (expected_s) their largest work per row
        if n_live:
            tokens = int(s.sum())
            context = int(c.sum())
            pre = s > decode_threshold
            n_pre = int(np.count_nonzero(pre))
            uniform = n_live == int(np.count_nonzero(s == self.uniform_width))
        else:
            tokens = context = n_pre = 0
            uniform = False
        if n_pre:
            sp, cp = s[pre].astype(np.float64), c[pre].astype(np.float64)
            pre_kv = float(sp.sum()) + float(cp.sum())
            causal = float((4.0 * (sp * cp + sp * sp / 2.0)).sum())
            row_max = float((4.0 * cp + 2.0 * sp).max())
        else:
            pre_kv = causal = row_max = 0.0
        live_kv = float(tokens + context)                      # every live request's read
        dec_kv = live_kv - pre_kv                              # the decodes' contexts
        t_real = float(tokens)
        t_pad = float(pad_tokens) if pad_tokens > 0 else 0.0
        t_gemm = t_real + t_pad

        # §8: the graph mode and the host per step
        mode = self.decode_mode if (n_live == 0 or uniform) else self.other_mode
        if t_gemm > self.ceiling:
            mode = EAGER
        host_step = self.host_mode[mode]
        if t_gemm <= 0:                                        # §4.1: the empty step
            per = dict.fromkeys(RESOURCES, 0.0)
            per["host"] = host_step
            return NumpyEstimate(host_step, host_step, host_step, per, 4)

        derate = self.sm_count / sm_budget if 0 < sm_budget < self.sm_count else 1.0
        m_half = self.m_half
        # x: tokens over the token factor of the efficiency (F(t, m½) shape-aware, else the
        # ramp); a GEMM's compute time is x times its coefficient
        fm = t_gemm / (t_gemm + m_half) if m_half > 0 else 1.0
        x = t_gemm / fm if self.shape_aware else t_gemm / (self.eps * fm)

        # §6.1 dense GEMMs; expected: max(compute, memory) per GEMM at vLLM's sharding
        sm = x * self.edge_gemm * derate
        hbm = self.weight_hbm
        exp = 0.0
        for g in self.gemms:
            compute = x * g.exp * derate
            memory = g.exp_weight + t_gemm * g.exp_act
            exp += compute if compute > memory else memory

        # §6.3 attention: the decodes' read (edges) / every live request's (expected)
        has_pre = n_pre > 0
        has_dec = n_live > n_pre
        f_dec, f_p = self.f_dec, self.f_p
        mixed_launch = self.single_launch and has_pre and self.r_dec > 0 and self.w_p > 0
        drop_dec_floor = mixed_launch and f_dec <= f_p
        if self.r_dec > 0:
            if has_dec:
                t = f_dec + dec_kv * self.read_per_token
                hbm += t - f_dec if drop_dec_floor else t
            if n_live:
                stream = live_kv * self.read_per_token
                if self.row_s > 0:
                    stream = _p_norm(stream, n_live * self.row_per_request,
                                     self.row_order)
                t = f_dec + stream
                exp += t - f_dec if drop_dec_floor else t
        else:                                                  # §6.6: the KV fallback
            hbm += dec_kv * self.bpt / self.B if has_dec else 0.0
            exp += live_kv * self.bpt / self.B

        # §6.3 prefill attention over causal pairs; expected at the prefill's own rows
        if has_pre:
            drop_pre_floor = mixed_launch and f_dec > f_p
            rows = causal / row_max if row_max > 0 else 0.0
            for eff, some, edge in ((self._ramp(t_real), has_dec, True),
                                    (self._ramp(rows), n_live > 0, False)):
                if self.w_p > 0:
                    t = f_p + causal * self.attn_scaled / eff * derate
                else:
                    t = causal * self.attn_plain / eff * derate
                if drop_pre_floor and some:
                    t -= f_p
                if edge:
                    sm += t
                else:
                    exp += t

        # §6.7 elementwise
        elem = t_gemm * self.elementwise_per_token
        hbm += elem
        exp += elem

        # §6.8 collectives
        nvl = nic = 0.0
        nbytes = t_gemm * self.coll_bytes_per_token
        for k in self.collectives:
            b = nbytes * k.span
            if k.peak <= 0:
                t = INF
            elif k.transition <= 0:
                t = max(k.floor, b / k.peak)
            else:
                t = max(k.floor + b / k.transition, b / k.peak)
            if k.on_nic:
                nic += t
            else:
                nvl += t
            exp += k.launches * t

        # §6.11 over the layers, §7 the LM head (expected: the sampled tokens only)
        L = self.layers
        stage = L * max(sm, hbm, nvl, nic)
        if t_real > 0:
            head_sm = t_real * self.head_compute / self._ramp(t_real) * derate
            head_hbm = self.head_hbm
            sampled = min(t_real, float(n_live * self.uniform_width))
            head_exp = max(sampled * self.head_compute / self._ramp(sampled) * derate,
                           head_hbm)
        else:
            head_sm = head_hbm = head_exp = 0.0
        SM = L * sm + head_sm
        HBM = L * hbm + head_hbm
        NVL = L * nvl
        NIC = L * nic
        host = host_step + self.launches
        # §9 totals
        no_overlap = SM + HBM + NVL + NIC + host
        overlap = min(stage + max(head_sm, head_hbm) + host, no_overlap)
        # expected.md: max(gpu, host) + the host work the GPU does not hide; a FULL graph
        # launches its own kernels
        gpu = L * exp + head_exp + self.kernel_gap
        host_exp = host_step + (0.0 if mode == FULL else self.launches)
        expected = max(gpu, host_exp) + self.serial + self.serial_per_request * n_live
        totals = (SM, HBM, NVL, NIC, host)
        best = 0
        for i in (1, 2, 3, 4):
            if totals[i] > totals[best]:
                best = i
        return NumpyEstimate(overlap, no_overlap, expected, dict(zip(RESOURCES, totals)),
                             best)

    def _ramp(self, m: float) -> float:
        """Token ramp of GEMM efficiency (step.md §2)."""
        eps, half = self.eps, self.m_half
        if m <= 0 or eps <= 0:
            return 0.0
        return eps * m / (m + half) if half > 0 else eps


def _p_norm(a: float, b: float, p: float) -> float:
    """``(a^p + b^p)^(1/p)`` of two non-negative times, ``p ≥ 1``; scaled by the larger so
    that a large ``p`` never overflows; 0 where both are 0."""
    big = a if a > b else b
    if big <= 0.0:
        return 0.0
    return big * ((a / big) ** p + (b / big) ** p) ** (1.0 / p)


def _ring_span(group: int, per_node: int, ratio: float) -> float:
    """Ring collective byte multiplier across nodes (step.md §2)."""
    def span(cross, total):
        if cross <= 0 or total <= 0 or not (1 < ratio < INF):
            return 1.0
        return 1.0 + (ratio - 1.0) * (cross / total)

    if group <= 1:
        return 1.0
    if per_node <= 0 or group % per_node:
        return 1.0 if group <= per_node else span(group - 1, group - 1)
    return span(group // per_node - 1, group - 1)
