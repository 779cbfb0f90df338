"""The cost laws of the model, each a small pure function (spec step.md §2).

This module is the single home of every formula of the spec that turns work into time:
``step.py``, ``memory.py``, ``overheads.py`` and ``calibration/`` all call these functions and
never restate them.

Conventions:

* Every function is written with ``jax.numpy`` and broadcasts over array arguments, so it
  runs traced (inside ``jit``/``vmap``/``grad``) or eagerly on Python scalars alike.
* Arguments documented as *static* are Python ints fixed by the deployment (group widths,
  expert counts); they choose the shape of the law, not its value.
* Units are in the argument names: ``_s`` seconds, ``_per_s`` a rate per second, ``bytes``.
* Zero work costs zero even where the rate is zero (Decision D5, ``0/0 = 0``); positive work
  over a zero rate is ``+inf``.
* Gradient safety: every division is guarded with the double-``where`` pattern so that the
  branch not taken never produces a NaN in a gradient.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = [
    "round_half_up", "safe_div", "ramp", "eff_shaped", "collective_time", "floor_rate_time",
    "span", "flat_span", "ring_span", "a2a_span", "experts_touched", "dcp_local",
    "sparse_read", "windowed_pairs", "windowed_causal_flops", "causal_pairs",
    "pcp_chunks", "pcp_local_tokens", "pcp_causal_pairs", "pcp_busiest_chunks", "smooth_max",
    "compute_time", "memory_time", "gemm_times", "routed_expert_work", "floor_plus_rate",
    "prefill_attention_time", "p_norm", "decode_attention_time", "tokens_per_expert",
    "routed_expert_time",
]


def round_half_up(x):
    """⌊x + 0.5⌋ (never banker's rounding): ``round_half_up(2.5) = 3``."""
    return jnp.floor(jnp.asarray(x) + 0.5)


def safe_div(num, den):
    """``num / den`` with D5's rule: 0 where ``num ≤ 0``, +inf where ``num > 0`` and ``den ≤ 0``."""
    num = jnp.asarray(num)
    den = jnp.asarray(den)
    ok = den > 0
    q = num / jnp.where(ok, den, 1.0)
    return jnp.where(num > 0, jnp.where(ok, q, jnp.inf), jnp.zeros_like(q))


def ramp(m_tokens, eps_max, m_half):
    """Token ramp of GEMM efficiency (step.md §2), dimensionless.

    ``0`` if ``m ≤ 0`` or ``eps_max ≤ 0``; ``eps_max`` if ``m_half ≤ 0``;
    else ``eps_max · m / (m + m_half)``.
    """
    m = jnp.asarray(m_tokens)
    pos = (m > 0) & (eps_max > 0)
    halfed = m_half > 0
    den = jnp.where(pos & halfed, m + m_half, 1.0)
    val = jnp.where(halfed, eps_max * m / den, eps_max * jnp.ones_like(den))
    return jnp.where(pos, val, jnp.zeros_like(val))


def _factor(x, h):
    """``x/(x+h)`` if ``h > 0`` and ``x > 0``, else 1."""
    x = jnp.asarray(x)
    ok = (h > 0) & (x > 0)
    den = jnp.where(ok, x + h, 1.0)
    return jnp.where(ok, x / den, jnp.ones_like(den))


def eff_shaped(m_tokens, n, k, eps_max, m_half, n_half, k_half):
    """Shape-aware GEMM efficiency (step.md §2): ``eps_max·F(m,m½)·F(k,k½)·F(n,n½)``."""
    m = jnp.asarray(m_tokens)
    val = eps_max * _factor(m, m_half) * _factor(k, k_half) * _factor(n, n_half)
    return jnp.where((m > 0) & (eps_max > 0), val, jnp.zeros_like(val))


def collective_time(nbytes, floor_s, peak_per_s, transition_per_s):
    """Three-parameter collective law ``coll_t(b)`` in seconds (step.md §2).

    ``t0`` for ``b ≤ 0``; +inf if ``r_peak ≤ 0``; ``max(t0, b/r_peak)`` if ``r_t ≤ 0``;
    else ``max(t0 + b/r_t, b/r_peak)``.
    """
    b = jnp.asarray(nbytes)
    peak_ok = peak_per_s > 0
    trans_ok = transition_per_s > 0
    at_peak = b / jnp.where(peak_ok, peak_per_s, 1.0)
    ramp_t = floor_s + b / jnp.where(trans_ok, transition_per_s, 1.0)
    t = jnp.where(trans_ok, jnp.maximum(ramp_t, at_peak), jnp.maximum(floor_s, at_peak))
    t = jnp.where(peak_ok, t, jnp.inf)
    return jnp.where(b > 0, t, floor_s * jnp.ones_like(t))


def floor_rate_time(nbytes, floor_s, rate_per_s):
    """Two-parameter law ``fr_t(b)`` in seconds: floor if ``b ≤ 0``, +inf if ``rate ≤ 0``,
    else ``max(floor, b/rate)``."""
    b = jnp.asarray(nbytes)
    ok = rate_per_s > 0
    t = jnp.maximum(floor_s, b / jnp.where(ok, rate_per_s, 1.0))
    t = jnp.where(ok, t, jnp.inf)
    return jnp.where(b > 0, t, floor_s * jnp.ones_like(t))


def span(cross: int, total: int, ratio):
    """Cross-node byte multiplier ``1 + (r − 1)·cross/total`` (1 unless r > 1 and finite).

    ``cross`` and ``total`` are static; ``ratio`` (NVLink over NIC rate) may be traced.
    """
    r = jnp.asarray(ratio)
    if cross <= 0 or total <= 0:
        return jnp.ones_like(r)
    active = (r > 1) & jnp.isfinite(r)
    return jnp.where(active, 1.0 + (jnp.where(active, r, 1.0) - 1.0) * (cross / total), 1.0)


def flat_span(group: int, per_node: int, ratio):
    """1 if the group fits a node (``G ≤ p``), else the full ratio ``r``."""
    if group <= per_node:
        return jnp.ones_like(jnp.asarray(ratio))
    return span(group - 1, group - 1, ratio)


def ring_span(group: int, per_node: int, ratio):
    """Ring collective span: flat unless p divides G, then ``span(G/p − 1, G − 1, r)``."""
    if group <= 1:
        return jnp.ones_like(jnp.asarray(ratio))
    if per_node <= 0 or group % per_node != 0:
        return flat_span(group, per_node, ratio)
    return span(group // per_node - 1, group - 1, ratio)


def a2a_span(group: int, per_node: int, ratio):
    """All-to-all span ``span(G − p, G − 1, r)``."""
    if group <= 1:
        return jnp.ones_like(jnp.asarray(ratio))
    return span(group - per_node, group - 1, ratio)


def experts_touched(tokens, experts: int, top_k: int, local):
    """Expected distinct experts touched on one rank (continuous, not rounded).

    ``0`` if ``local ≤ 0`` or ``t ≤ 0``; ``local`` if ``E ≤ 0``, ``k ≤ 0`` or ``k ≥ E``;
    else ``local·(1 − ((E − k)/E)^t)``.
    """
    t = jnp.asarray(tokens)
    loc = jnp.asarray(local) * jnp.ones_like(t)
    if experts <= 0 or top_k <= 0 or top_k >= experts:
        val = loc
    else:
        val = loc * (1.0 - jnp.power((experts - top_k) / experts, t))
    return jnp.where((t > 0) & (loc > 0), val, jnp.zeros_like(val))


def dcp_local(tokens, dcp: int, interleave: int):
    """Slowest DCP rank's share of ``tokens`` striped in runs of ``I`` over ``d`` ranks.

    ``base = ((L // I) // d)·I``, ``rest = min(L − base·d, I)``, result ``max(base + rest, 1)``;
    ``I ≤ 0`` counts as 1. ``tokens`` should be integer-valued (callers round first).
    """
    i = max(int(interleave), 1)
    length = jnp.asarray(tokens)
    base = jnp.floor(jnp.floor(length / i) / dcp) * i
    rest = jnp.minimum(length - base * dcp, i)
    return jnp.maximum(base + rest, 1.0)


def sparse_read(ctx, bound, compress_ratio):
    """Tokens read under a sparse bound ``t`` and compress ratio ``ρ`` (step.md §2)."""
    ctx = jnp.asarray(ctx)
    extra = jnp.where((ctx > bound) & (compress_ratio > 0),
                      (ctx - bound) / jnp.where(compress_ratio > 0, compress_ratio, 1.0), 0.0)
    return jnp.minimum(ctx, bound) + extra


def causal_pairs(new_tokens, prefix_tokens):
    """Continuum causal FLOP factor ``4·(s·c + s²/2)`` of a prefill chunk (step.md §4)."""
    s = jnp.asarray(new_tokens)
    return 4.0 * (s * prefix_tokens + s * s / 2.0)


def windowed_pairs(new_tokens, prefix_tokens, window):
    """Query-key pairs of one chunk under a sliding window ``W`` (step.md §2, ``pairs(s, c)``)."""
    s = jnp.asarray(new_tokens)
    c = jnp.asarray(prefix_tokens)
    ns = jnp.maximum(0.0, jnp.minimum(s, window - c))
    return ns * (c + 1.0) + ns * (ns - 1.0) / 2.0 - ns / 2.0 + (s - ns) * window


def windowed_causal_flops(new_tokens, prefix_tokens, window, mask=None):
    """``4·Σ pairs(s, c)`` over chunks given as arrays (0 when ``W ≤ 0``); ``mask`` drops lanes."""
    pairs = windowed_pairs(new_tokens, prefix_tokens, window)
    if mask is not None:
        pairs = jnp.where(mask, pairs, 0.0)
    total = 4.0 * jnp.sum(pairs, axis=-1)
    return jnp.where(window > 0, total, jnp.zeros_like(total))


def pcp_chunks(new_tokens, pcp: int):
    """Zig-zag chunk bounds of a prefill over ``pcp`` ranks.

    Returns ``(lo, n)`` of shape ``(..., pcp, 2)``: for rank r its chunks r and 2·pcp−1−r,
    each with start ``lo_j`` and length ``n_j``.
    """
    s = jnp.asarray(new_tokens)[..., None, None]
    n_chunks = 2 * pcp
    ch = jnp.ceil(s / n_chunks)
    idx = jnp.array([[r, n_chunks - 1 - r] for r in range(pcp)], dtype=s.dtype)
    lo = jnp.minimum(idx * ch, s)
    hi = jnp.minimum(lo + ch, s)
    return lo, hi - lo


def _pcp_replicated(new_tokens, pcp: int, dcp: int):
    s = jnp.asarray(new_tokens)
    ch = jnp.ceil(s / (2 * pcp))
    if dcp > 1:
        return (2 * pcp - 1) * ch >= s
    return jnp.zeros_like(s, dtype=bool)


def pcp_local_tokens(new_tokens, pcp: int, dcp: int):
    """Busiest PCP rank's new tokens: −1 if pcp ≤ 1 or s ≤ 0; s if replicated; else
    ``max_r Σ_{j∈r} n_j``."""
    s = jnp.asarray(new_tokens)
    if pcp <= 1:
        return -jnp.ones_like(s)
    _, n = pcp_chunks(s, pcp)
    local = jnp.max(jnp.sum(n, axis=-1), axis=-1)
    local = jnp.where(_pcp_replicated(s, pcp, dcp), s, local)
    return jnp.where(s > 0, local, -jnp.ones_like(s))


def _pcp_rank_pairs(new_tokens, prefix_tokens, pcp: int):
    lo, n = pcp_chunks(new_tokens, pcp)
    c = jnp.asarray(prefix_tokens)[..., None, None]
    hi = lo + n
    per_chunk = n * (c + 1.0) + (lo + hi - 1.0) * n / 2.0 - n / 2.0
    return jnp.sum(per_chunk, axis=-1), lo, n


def pcp_causal_pairs(new_tokens, prefix_tokens, pcp: int, dcp: int):
    """Causal FLOP factor of the busiest PCP rank (``4·max_r Σ …``), or the whole
    ``4·(s·c + s²/2)`` when the split is replicated."""
    s = jnp.asarray(new_tokens)
    rank_pairs, _, _ = _pcp_rank_pairs(s, prefix_tokens, pcp)
    split = 4.0 * jnp.max(rank_pairs, axis=-1)
    return jnp.where(_pcp_replicated(s, pcp, dcp), causal_pairs(s, prefix_tokens), split)


def pcp_busiest_chunks(new_tokens, prefix_tokens, pcp: int, dcp: int):
    """The busiest rank's two chunks as ``(s_j, c_j)`` arrays of shape ``(..., 2)``, at their
    global offsets ``c + lo_j`` (Decision D30: lowest rank on a tie). When the split is
    replicated, the whole prefill is the first chunk and the second is empty."""
    s = jnp.asarray(new_tokens)
    c = jnp.asarray(prefix_tokens)
    rank_pairs, lo, n = _pcp_rank_pairs(s, c, pcp)
    best = jnp.argmax(rank_pairs, axis=-1)
    pick = lambda a: jnp.take_along_axis(a, best[..., None, None], axis=-2)[..., 0, :]
    n_b, lo_b = pick(n), pick(lo)
    rep = _pcp_replicated(s, pcp, dcp)[..., None]
    whole_s = jnp.stack([s, jnp.zeros_like(s)], axis=-1)
    whole_c = jnp.stack([c, c], axis=-1) * jnp.ones_like(whole_s)
    return (jnp.where(rep, whole_s, n_b), jnp.where(rep, whole_c, c[..., None] + lo_b))


def smooth_max(values, temperature, axis=-1):
    """Log-sum-exp maximum ``m + τ·log Σ exp((v − m)/τ)`` with ``m`` the hard max; it tends to
    ``max`` as ``τ → 0`` and is the hard max for ``τ ≤ 0``. Used only by the opt-in smooth
    mode for calibration (``StepOptions.smooth_temperature``)."""
    v = jnp.asarray(values)
    hard = jnp.max(v, axis=axis, keepdims=True)
    tau = jnp.asarray(temperature)
    ok = tau > 0
    t = jnp.where(ok, tau, 1.0)
    soft = hard + t * jnp.log(jnp.sum(jnp.exp((v - hard) / t), axis=axis, keepdims=True))
    return jnp.squeeze(jnp.where(ok, soft, hard), axis)


# -- per-primitive kernel laws (used by step.py and by calibration/) ------------------------

def compute_time(flops, peak_flops_per_s, efficiency):
    """FLOPs at ``peak · efficiency``, seconds; 0 where the efficiency is 0 (a skipped term:
    no tokens, or an ``eps_max ≤ 0`` part) and for zero work (D5)."""
    t = safe_div(flops, peak_flops_per_s * efficiency)
    return jnp.where(efficiency > 0, t, jnp.zeros_like(t))


def memory_time(nbytes, bytes_per_s):
    """Bytes at a rate, seconds (D5)."""
    return safe_div(nbytes, bytes_per_s)


def gemm_times(m_tokens, n, k, weight_bytes, peak_flops_per_s, hbm_bytes_per_s, efficiency,
               activation_bytes: float = 0.0):
    """One GEMM of ``m × n × k`` (per rank): ``(compute_s, memory_s)``.

    compute = 2·m·n·k / (P·ε); memory = (weights + m·(n + k)·activation_bytes) / B_hbm.
    The spec's edges add the two (SM and HBM totals); ``expected_s`` and the profile fits
    take ``max(compute, memory)`` per kernel (expected.md).
    """
    m = jnp.asarray(m_tokens)
    compute = compute_time(2.0 * m * n * k, peak_flops_per_s, efficiency)
    memory = memory_time(weight_bytes + m * (n + k) * activation_bytes, hbm_bytes_per_s)
    return compute, memory


def routed_expert_work(routed_tokens, top_k: int, local_share: float,
                       flops_per_token_per_expert: float, imbalance, dp_slice: float,
                       physical_experts: int, experts_per_rank: int,
                       bytes_per_expert: float, tensor_shards: int):
    """Routed-expert FLOPs and weight bytes of one rank (step.md §6.2): ``(flops, bytes)``.

    FLOPs = tokens·top_k·share·F_e·imbalance / dp_slice (not divided by tp, the kept
    over-charge); bytes = B_e / shards · experts_touched(round_half_up(tokens)).
    """
    t = jnp.asarray(routed_tokens)
    flops = t * top_k * local_share * flops_per_token_per_expert * imbalance / dp_slice
    touched = experts_touched(round_half_up(t), physical_experts, top_k, experts_per_rank)
    return flops, bytes_per_expert / tensor_shards * touched


def floor_plus_rate(work, floor, rate):
    """``floor + work/rate`` (decode attention reads, recurrent tokens); +inf for positive
    work at a zero rate, and just the floor for zero work."""
    return floor + safe_div(work, rate)


def prefill_attention_time(work_flops, floor_s, peak_flops_per_s, efficiency, work_scale,
                           sm_derate=1.0):
    """Prefill attention with a fitted work scale: ``f_p + W/(P·ε·w_p)·sm_derate``
    (step.md §6.3; the floor is not derated)."""
    return floor_s + safe_div(work_flops, peak_flops_per_s * efficiency * work_scale) * sm_derate


def p_norm(a, b, order):
    """``(a^p + b^p)^(1/p)`` of two non-negative times, seconds: their sum at ``p = 1``, the
    larger one as ``p → ∞`` (``p < 1`` counts as 1). 0 where both are 0, with a finite
    gradient there (the double-``where`` guard)."""
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    p = jnp.maximum(jnp.asarray(order), 1.0)
    big = jnp.maximum(a, b)
    ok = big > 0
    safe = jnp.where(ok, big, 1.0)
    def pw(x):
        # (x / larger)^p in [0, 1], scaled so that a large order never overflows, with the
        # double where: 0^p has no finite derivative in p
        r = jnp.where(ok, x, 0.0) / safe
        pos = r > 0
        return jnp.where(pos, jnp.exp(p * jnp.log(jnp.where(pos, r, 1.0))), 0.0)

    total = pw(a) + pw(b)                  # ≥ 1 where ok: the larger term contributes 1
    val = safe * jnp.exp(jnp.log(jnp.where(ok, total, 1.0)) / p)
    return jnp.where(ok, val, jnp.zeros_like(val))


def decode_attention_time(kv_bytes, rows, floor_s, rate_per_s, row_s=0.0, overlap=1.0):
    """Decode attention of one layer on one rank, seconds: ``f + ‖(bytes/r, rows·c)‖_p``.

    * ``kv_bytes``: KV-cache bytes the decodes read; ``rows``: the (request, KV head) rows
      the kernel runs, ``decode requests × KV heads on the rank``.
    * ``floor_s`` (f): the launch floor; ``rate_per_s`` (r): the streaming rate of a large
      read (at most the chip's HBM bandwidth).
    * ``row_s`` (c): the least time one row costs (its query load, softmax merge, output
      write and smallest key tile), which the stream hides when the rows are long;
      ``overlap`` (p ≥ 1): how much it hides, from added (``p = 1``) to hidden behind the
      larger of the two (``p → ∞``), :func:`p_norm`.

    With ``row_s ≤ 0`` this is step.md §6.3's ``floor + bytes/rate``
    (:func:`floor_plus_rate`), whatever ``overlap``; +inf for positive bytes at a zero rate.
    """
    stream = safe_div(kv_bytes, rate_per_s)
    per_row = jnp.maximum(jnp.asarray(row_s), 0.0) * jnp.asarray(rows)
    return floor_s + jnp.where(row_s > 0, p_norm(stream, per_row, overlap), stream)


def tokens_per_expert(assignments, touched):
    """Token-expert assignments per touched expert (the rows of each expert's GEMM in a
    fused MoE kernel); 0 where no expert is touched."""
    t = jnp.asarray(touched)
    return safe_div(assignments, t)


def routed_expert_time(flops, weight_bytes, assignments, touched, peak_flops_per_s,
                       bytes_per_s, floor_s=0.0, m_half=0.0, assignment_s=0.0,
                       token_efficiency=None):
    """A fused-MoE layer's routed experts on one rank, seconds (``expected_s``)::

        floor + max(flops / (P · ε), weight_bytes / B) + assignments · c_a

    * ``flops``: the rank's routed FLOPs (imbalance applied); ``weight_bytes``: the bytes of
      the touched experts (:func:`routed_expert_work`); ``assignments``: token-expert pairs
      routed to the rank; ``touched``: distinct experts touched on it (:func:`experts_touched`).
    * ``floor_s``: the kernel's floor (routing, alignment, the grouped GEMMs' launches).
    * ``m_half`` > 0: each expert's GEMM runs ``m_e`` = :func:`tokens_per_expert` rows, at
      ``ε = m_e / (m_e + m½)`` of the peak (the grouped GEMM's own token ramp). With
      ``m_half ≤ 0`` the efficiency is ``token_efficiency`` (the step-level ramp of
      step.md §6.2), 1 if not given.
    * ``assignment_s`` (c_a): the time per token-expert pair of the permute / un-permute of
      the tokens' activations around the grouped GEMMs.

    With ``floor_s = m_half = assignment_s = 0`` this is ``max(compute, memory)`` at the
    step-level ramp, what ``expected_s`` priced before.
    """
    eff_tokens = 1.0 if token_efficiency is None else token_efficiency
    me = tokens_per_expert(assignments, touched)
    per_expert = jnp.where(me > 0, me / jnp.where(me > 0, me + jnp.maximum(m_half, 0.0), 1.0),
                           0.0)
    eff = jnp.where(m_half > 0, per_expert, eff_tokens)
    compute = compute_time(flops, peak_flops_per_s, eff)
    memory = memory_time(weight_bytes, bytes_per_s)
    work = jnp.maximum(compute, memory)
    extra = jnp.maximum(jnp.asarray(assignment_s), 0.0) * jnp.asarray(assignments)
    busy = (jnp.asarray(flops) > 0) | (jnp.asarray(weight_bytes) > 0)
    return jnp.where(busy, floor_s + work + extra, jnp.zeros_like(work + extra))
